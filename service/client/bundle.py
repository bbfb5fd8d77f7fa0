"""`zero1 submit --code DIR`: DIR zipped as a code bundle, and uploaded with a progress bar.

The zip is reproducible (entries sorted, timestamps fixed), so the same directory gives the same
digest and a second upload is answered 200 with the bundle the service already has.
"""

from __future__ import annotations

import fnmatch
import io
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

from .output import terminal

SKIPPED_DIRS = frozenset({".git", "__pycache__", ".hg", ".svn", ".mypy_cache", ".pytest_cache", ".ruff_cache"})
"""Directories never bundled: version control and caches. A virtualenv (a directory holding
pyvenv.cfg) is skipped wherever it is, as is what DIR's top-level .gitignore lists."""
_EPOCH = (1980, 1, 1, 0, 0, 0)  # zip's earliest time: every entry's, so the bytes depend on content only
UPLOAD_CHUNK_BYTES = 1 << 20


class Ignore:
    """The patterns of a .gitignore (blank lines and comments skipped; `!` negation not supported):
    a pattern with a slash other than a trailing one is anchored at the top, one without matches a
    name at any depth, a trailing slash matches directories only."""

    def __init__(self, lines: list[str]) -> None:
        self.patterns = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith(("#", "!"))]

    @classmethod
    def of(cls, root: Path) -> Ignore:
        path = root / ".gitignore"
        return cls(path.read_text(errors="replace").splitlines() if path.is_file() else [])

    def __call__(self, relative: str, *, is_dir: bool) -> bool:
        name = relative.rsplit("/", 1)[-1]
        for pattern in self.patterns:
            if pattern.endswith("/"):
                if not is_dir:
                    continue
                pattern = pattern.rstrip("/")
            if "/" in pattern:
                if fnmatch.fnmatchcase(relative, pattern.lstrip("/")):
                    return True
            elif fnmatch.fnmatchcase(name, pattern):
                return True
        return False


def bundle_files(root: Path) -> Iterator[tuple[str, Path]]:
    """(name in the zip, file) for every file bundled from `root`, sorted; symlinks are skipped (the
    service refuses them) with a note on stderr."""
    ignore = Ignore.of(root)

    def walk(directory: Path) -> Iterator[tuple[str, Path]]:
        for path in sorted(directory.iterdir()):
            relative = path.relative_to(root).as_posix()
            if path.is_symlink():
                print(f"zero1: {relative} is a symlink: not bundled", file=sys.stderr)
            elif path.is_dir():
                if path.name in SKIPPED_DIRS or (path / "pyvenv.cfg").is_file() or ignore(relative, is_dir=True):
                    continue
                yield from walk(path)
            elif path.is_file() and not ignore(relative, is_dir=False):
                yield relative, path

    yield from walk(root)


def zip_directory(root: Path) -> tuple[bytes, int]:
    """The bundle of `root` as zip bytes, and its number of files."""
    buffer = io.BytesIO()
    count = 0
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, path in bundle_files(root):
            info = zipfile.ZipInfo(name, date_time=_EPOCH)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, path.read_bytes())
            count += 1
    return buffer.getvalue(), count


def upload_chunks(data: bytes, *, label: str, stream=None) -> Iterator[bytes]:
    """`data` in chunks for an upload, drawing a progress bar on `stream` (stderr) as they go: a rich
    bar on a terminal, else one line at the end."""
    stream = stream or sys.stderr
    total = len(data)
    chunks = (data[start : start + UPLOAD_CHUNK_BYTES] for start in range(0, max(total, 1), UPLOAD_CHUNK_BYTES))
    if (console := terminal(stream)) is None:
        yield from chunks
        stream.write(progress_line(label, total, total) + "\n")
        stream.flush()
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    columns = (TextColumn("{task.description}", markup=False), BarColumn(), DownloadColumn())
    with Progress(*columns, console=console) as bar:
        task = bar.add_task(label, total=total)
        for chunk in chunks:
            yield chunk
            bar.advance(task, len(chunk))


def progress_line(label: str, done: int, total: int, *, width: int = 30) -> str:
    """The bar in a pipe, its sizes in the unit the total reads best in: a 3 kB bundle is not 0.00/0.00 MB."""
    fraction = done / total if total else 1.0
    filled = int(fraction * width)
    scale, unit = next(((s, u) for s, u in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")) if total >= s), (1, "bytes"))
    sizes = f"{done:,}/{total:,}" if scale == 1 else f"{done / scale:.2f}/{total / scale:.2f}"
    return f"{label} [{'#' * filled}{'.' * (width - filled)}] {fraction:4.0%} {sizes} {unit}"

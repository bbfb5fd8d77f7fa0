"""Which files a `dataset` job reads, and its tokenizer file: paths resolved inside the data roots.

Standard library only: the API checks a submitted path with it (no torch there), and a rank
resolves it again where it reads, since the files may have changed since the check. A path is a
file, a directory (every file under it with the format's extension, hidden ones skipped, links to
directories not followed) or a glob (`*`, `?`, `[...]` within its directories: `**` is not
recursive; name a directory for that). The glob's directory part and every file matched must
resolve (symlinks followed) inside a root.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterable, Sequence

MAX_FILES = 10_000
"""Most files one dataset may name (a directory walk stops there)."""

EXTENSIONS = {
    "jsonl": (".jsonl", ".json"),
    "parquet": (".parquet",),
    "csv": (".csv",),
    "text": (".txt", ".text", ".md"),
}
"""The files of a directory that a format reads; a file or a glob names its files itself."""

BYTES = "bytes"
"""The tokenizer that needs no file: one token per UTF-8 byte."""

_MAGIC = re.compile(r"[*?[]")


def real_roots(roots: Sequence[str] | None) -> list[str] | None:
    return None if roots is None else [os.path.realpath(root) for root in roots]


def inside(real: str, roots: Sequence[str] | None) -> bool:
    """Whether a resolved path is inside one of the resolved `roots` (None: anywhere)."""
    return roots is None or any(os.path.commonpath([real, root]) == root for root in roots)


def absolute_path(path: str) -> str:
    """`path` made absolute with symlinks followed up to its first glob component (the rest kept):
    what a rank, whose working directory is not the service's, resolves the same way."""
    base, rest = _split_glob(path)
    return os.path.join(os.path.realpath(base), *rest)


def _split_glob(path: str) -> tuple[str, list[str]]:
    """(the directories before the first glob component, the components from it on)."""
    parts = path.split(os.sep)
    first = next((i for i, part in enumerate(parts) if _MAGIC.search(part)), len(parts))
    return os.sep.join(parts[:first]) or (os.sep if path.startswith(os.sep) else os.curdir), parts[first:]


def resolve_files(path: str, *, format: str, roots: Sequence[str] | None) -> list[str]:
    """The real paths of the regular files `path` names, sorted; ValueError ("data.path: ...") for a
    path outside the roots, naming no file, or naming more than MAX_FILES."""
    resolved_roots = real_roots(roots)
    where = f"the data roots {resolved_roots} (ZERO1_DATA_ROOTS; symlinks are followed)"
    full = absolute_path(path)
    if _MAGIC.search(full):
        base, _ = _split_glob(full)
        if not inside(base, resolved_roots):
            raise ValueError(f"data.path: {path!r}: the glob's directory {base} is outside {where}")
        candidates: Iterable[str] = glob.iglob(full)  # lazy: the count below stops it
    else:
        if not inside(full, resolved_roots):
            raise ValueError(f"data.path: {path!r} resolves to {full}, outside {where}")
        candidates = _walk(full, EXTENSIONS[format]) if os.path.isdir(full) else [full]
    files = set()
    for candidate in candidates:
        real = os.path.realpath(candidate)
        if not inside(real, resolved_roots):
            raise ValueError(f"data.path: {path!r} matches {candidate}, which resolves to {real}, outside {where}")
        if os.path.isfile(real):  # a directory a glob matched, a FIFO or a device: not data
            files.add(real)
        if len(files) > MAX_FILES:
            raise ValueError(f"data.path: {path!r} names more than {MAX_FILES} files")
    if not files:
        raise ValueError(f"data.path: {path!r} matches no {format} files")
    return sorted(files)


def _walk(directory: str, extensions: tuple[str, ...]) -> Iterable[str]:
    """The files under `directory` with one of `extensions`, hidden files and directories skipped."""
    seen = 0
    for parent, dirs, names in os.walk(directory):  # followlinks=False: a link to a directory is not entered
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            seen += 1
            if seen > 100 * MAX_FILES:
                raise ValueError(f"data.path: {directory} holds more than {100 * MAX_FILES} entries; name a glob")
            if not name.startswith(".") and name.endswith(extensions):
                yield os.path.join(parent, name)


def resolve_tokenizer(tokenizer: str, *, roots: Sequence[str] | None) -> str:
    """The real path of the tokenizer.json that `tokenizer` (the file or its directory) names; ValueError
    ("data.tokenizer: ...") when it is outside the roots or missing."""
    resolved_roots = real_roots(roots)
    real = os.path.realpath(tokenizer)
    if not inside(real, resolved_roots):
        raise ValueError(
            f"data.tokenizer: {tokenizer!r} resolves to {real}, outside the data roots {resolved_roots} "
            "(ZERO1_DATA_ROOTS; symlinks are followed)"
        )
    if os.path.isdir(real):
        real = os.path.realpath(os.path.join(real, "tokenizer.json"))
        if not inside(real, resolved_roots):
            raise ValueError(f"data.tokenizer: {tokenizer!r}'s tokenizer.json resolves to {real}, outside the roots")
    if not os.path.isfile(real):
        raise ValueError(f"data.tokenizer: no tokenizer file: {real} (a tokenizer.json, its directory, or 'bytes')")
    return real

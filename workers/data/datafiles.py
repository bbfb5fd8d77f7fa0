"""Which files a `dataset` job reads, and its tokenizer file: paths resolved inside the data roots.

Standard library only: the API checks a submitted path with it (no torch there), and a rank
resolves it again where it reads, since the files may have changed since the check. A path is a
file, a directory (every file under it with the format's extension, hidden ones skipped, links to
directories not followed) or a glob (`*`, `?`, `[...]` within its directories: `**` is not
recursive; name a directory for that). The glob's directory part and every file matched must
resolve (symlinks followed) inside a root.

A glob is walked here, not by the glob module, so that its cost is bounded whatever it says: it
may hold no `.` or `..` component (`*/../` repeated k times would visit 3^k paths under three
directories, and `..` walks out of the roots), it never enters a directory that resolves outside
the roots, and every directory entry it visits, matched or not, counts against MAX_CANDIDATES
within MAX_RESOLVE_S. No message names a path outside the roots: a user learns nothing of the
service's files from a refusal.
"""

from __future__ import annotations

import fnmatch
import os
import re
import time
from collections.abc import Iterable, Iterator, Sequence

MAX_FILES = 10_000
"""Most files one dataset may name (a directory walk stops there)."""

MAX_CANDIDATES = 100 * MAX_FILES
"""Most directory entries resolving one path may visit, matched or not (a glob's or a directory's walk)."""

MAX_RESOLVE_S = 2.0
"""Most seconds resolving one path may take (a slow file system, a wide glob): it stops there with a 422."""

EXTENSIONS = {
    "jsonl": (".jsonl", ".json"),
    "parquet": (".parquet",),
    "csv": (".csv",),
    "text": (".txt", ".text", ".md"),
}
"""The files of a directory that a format reads; a file or a glob names its files itself."""

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
"""A tokenizer's files in its directory (an hf model's): what final/ copies beside the model, and
what is fetched of a model on an object store to read its tokenizer."""

BYTES = "bytes"
"""The tokenizer that needs no file: one token per UTF-8 byte."""

_MAGIC = re.compile(r"[*?[]")


def real_roots(roots: Sequence[str] | None) -> list[str] | None:
    """The local roots resolved; an object store's (`s3://...`) are not directories and are left out."""
    return None if roots is None else [os.path.realpath(root) for root in roots if "://" not in root]


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


class _Budget:
    """The entries a walk has visited and the time it has taken, against their bounds."""

    def __init__(self, path: str, *, max_candidates: int, time_s: float):
        self.path = path
        self.max_candidates = max_candidates
        self.time_s = time_s
        self.visited = 0
        self.deadline = time.monotonic() + time_s

    def visit(self) -> None:
        """One more entry; ValueError ("data.path: ...") past either bound."""
        self.visited += 1
        if self.visited > self.max_candidates:
            raise ValueError(
                f"data.path: {self.path!r} visits more than {self.max_candidates:,} directory entries "
                "(matched or not); name fewer directories"
            )
        if time.monotonic() > self.deadline:
            raise ValueError(
                f"data.path: {self.path!r} took more than {self.time_s:g} s to resolve "
                f"({self.visited:,} directory entries visited); name fewer directories"
            )


def resolve_files(
    path: str,
    *,
    format: str,
    roots: Sequence[str] | None,
    max_candidates: int = MAX_CANDIDATES,
    time_s: float = MAX_RESOLVE_S,
) -> list[str]:
    """The real paths of the regular files `path` names, sorted; ValueError ("data.path: ...") for a
    path outside the roots, a glob with a `.` or `..` component, a walk past `max_candidates` entries
    or `time_s` seconds, naming no file, or naming more than MAX_FILES."""
    resolved_roots = real_roots(roots)
    where = f"the data roots {resolved_roots} (ZERO1_DATA_ROOTS; symlinks are followed)"
    budget = _Budget(path, max_candidates=max_candidates, time_s=time_s)
    if _MAGIC.search(path):
        candidates = _glob(path, roots=resolved_roots, budget=budget, where=where)
    else:
        full = os.path.realpath(path)
        if not inside(full, resolved_roots):
            raise ValueError(f"data.path: {path!r} resolves outside {where}")
        candidates = _walk(full, EXTENSIONS[format], budget=budget) if os.path.isdir(full) else [full]
    files = set()
    for candidate in candidates:
        real = os.path.realpath(candidate)
        if not inside(real, resolved_roots):  # `candidate` is a name in a root; where it leads is not told
            raise ValueError(f"data.path: {path!r} matches {candidate}, which resolves outside {where}")
        if os.path.isfile(real):  # a directory a glob matched, a FIFO or a device: not data
            files.add(real)
        if len(files) > MAX_FILES:
            raise ValueError(f"data.path: {path!r} names more than {MAX_FILES} files")
    if not files:
        raise ValueError(f"data.path: {path!r} matches no {format} files")
    return sorted(files)


def _glob(path: str, *, roots: list[str] | None, budget: _Budget, where: str) -> Iterator[str]:
    """The paths a glob matches, its directory part checked inside the roots first."""
    if any(part in (os.curdir, os.pardir) for part in path.split(os.sep)):
        raise ValueError(
            f"data.path: {path!r}: a glob may not have '.' or '..' components (they walk outside the data "
            "roots or visit the same directories again); name its directory as it is"
        )
    given_base, parts = _split_glob(path)
    base = os.path.realpath(given_base)
    if not inside(base, roots):
        raise ValueError(f"data.path: {path!r}: the glob's directory {given_base!r} is outside {where}")
    return _matches(base, [part for part in parts if part], roots=roots, budget=budget)


def _matches(base: str, parts: list[str], *, roots: list[str] | None, budget: _Budget) -> Iterator[str]:
    """The paths under `base` that `parts` (one pattern a level) match, level by level, as glob.glob
    would (names starting with '.' only by a pattern that does), entering no directory outside the roots."""
    frontier = [base]
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        found = []
        for directory in frontier:
            for candidate in _level(directory, part, budget=budget):
                # a level before the last leads on only through directories inside the roots
                if last or (os.path.isdir(candidate) and inside(os.path.realpath(candidate), roots)):
                    found.append(candidate)
        frontier = found
    yield from frontier


def _level(directory: str, part: str, *, budget: _Budget) -> Iterator[str]:
    """The entries of `directory` that one component matches, each visited entry counted."""
    if not _MAGIC.search(part):  # a literal name: one lookup
        budget.visit()
        candidate = os.path.join(directory, part)
        if os.path.lexists(candidate):
            yield candidate
        return
    try:
        entries = os.scandir(directory)
    except OSError:  # gone, or not readable: it matches nothing, as with glob
        return
    with entries:
        for entry in entries:
            budget.visit()
            if entry.name.startswith(".") and not part.startswith("."):
                continue
            if fnmatch.fnmatchcase(entry.name, part):
                yield os.path.join(directory, entry.name)


def _walk(directory: str, extensions: tuple[str, ...], *, budget: _Budget) -> Iterable[str]:
    """The files under `directory` with one of `extensions`, hidden files and directories skipped;
    every entry seen, directories too, counted."""
    for parent, dirs, names in os.walk(directory):  # followlinks=False: a link to a directory is not entered
        for _ in range(len(dirs) + len(names)):
            budget.visit()
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            if not name.startswith(".") and name.endswith(extensions):
                yield os.path.join(parent, name)


def resolve_tokenizer(tokenizer: str, *, roots: Sequence[str] | None) -> str:
    """The real path of the tokenizer.json that `tokenizer` (the file or its directory) names; ValueError
    ("data.tokenizer: ...") when it is outside the roots or missing. No message names a path outside them."""
    resolved_roots = real_roots(roots)
    real = os.path.realpath(tokenizer)
    if not inside(real, resolved_roots):
        raise ValueError(
            f"data.tokenizer: {tokenizer!r} resolves outside the data roots {resolved_roots} "
            "(ZERO1_DATA_ROOTS; symlinks are followed)"
        )
    if os.path.isdir(real):
        real = os.path.realpath(os.path.join(real, "tokenizer.json"))
        if not inside(real, resolved_roots):
            raise ValueError(f"data.tokenizer: {tokenizer!r}'s tokenizer.json resolves outside the data roots")
    if not os.path.isfile(real):
        raise ValueError(f"data.tokenizer: no tokenizer file: {real} (a tokenizer.json, its directory, or 'bytes')")
    return real

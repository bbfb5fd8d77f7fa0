"""The dataset token cache's byte bound: least recently used entries deleted past
ZERO1_TOKEN_CACHE_MAX_BYTES.

An entry is `<cache>/tokens/<key>.bin` and its sidecar `<key>.json` (workers/data/datasets.py writes
both, the sidecar last, and touches the sidecar on every hit); its last use is the newer mtime of
the two. The standard library only: the API process never imports torch to trim it.

An entry is never deleted while a queued or active job may need it: every such job's entry was
made or touched by its submit's check, just before the job was stored, so entries used since the
oldest of those jobs was submitted (less a margin for the check-to-insert gap) are kept, even past
the bound. Deleting one a job needs would cost time, not correctness: a rank that finds its entry
gone tokenizes it again, and a rank that has mapped it keeps its bytes until it exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

KEEP_MARGIN_S = 60.0
"""Entries used this long before the oldest pending job's submit are kept too."""
STALE_TEMP_S = 86_400.0
"""A writer's temporary file this old belongs to a writer that died: it is deleted."""
_SUFFIXES = (".bin", ".json")


@dataclass(slots=True)
class _Entry:
    key: str
    num_bytes: int = 0
    used_at: float = 0.0


def tokens_dir(cache_dir: str | Path) -> Path:
    return Path(cache_dir) / "tokens"


def mark_used(token_file: str) -> None:
    """Touch the entry's sidecar (best effort): a submit's check used it now."""
    with contextlib.suppress(OSError):
        os.utime(Path(token_file).with_suffix(".json"))


def trim(directory: Path, *, max_bytes: int, keep_since: float, keep: frozenset[str] = frozenset()) -> list[str]:
    """Delete least recently used entries until the cache holds at most max_bytes, never one used at or
    after `keep_since` (a time.time()) nor one whose key is in `keep`; the keys deleted, oldest first."""
    entries, total = _scan(directory)
    removed = []
    for entry in sorted(entries.values(), key=lambda e: e.used_at):
        if total <= max_bytes:
            break
        if entry.used_at >= keep_since or entry.key in keep:
            continue
        for suffix in (".json", ".bin"):  # the sidecar first: a reader then takes the entry for absent
            try:
                (directory / f"{entry.key}{suffix}").unlink(missing_ok=True)
            except OSError as error:
                log.warning("token cache: could not delete %s%s: %s", entry.key, suffix, error)
        total -= entry.num_bytes
        removed.append(entry.key)
    if total > max_bytes:
        log.warning(
            "token cache: %d bytes kept, over ZERO1_TOKEN_CACHE_MAX_BYTES = %d: the rest may be needed by pending jobs",
            total,
            max_bytes,
        )
    return removed


def _scan(directory: Path) -> tuple[dict[str, _Entry], int]:
    """Key -> entry, and the bytes of all; a writer's stale temporary file is deleted on the way."""
    entries: dict[str, _Entry] = {}
    total = 0
    try:
        listing = list(os.scandir(directory))
    except FileNotFoundError:
        return entries, 0
    for item in listing:
        try:
            info = item.stat(follow_symlinks=False)
        except OSError:
            continue  # gone since it was listed
        if item.name.startswith("."):
            _drop_stale(item.path, modified_at=info.st_mtime)
            continue
        key, suffix = os.path.splitext(item.name)
        if suffix not in _SUFFIXES:
            continue
        entry = entries.setdefault(key, _Entry(key))
        entry.num_bytes += info.st_size
        entry.used_at = max(entry.used_at, info.st_mtime)
        total += info.st_size
    return entries, total


def _drop_stale(path: str, *, modified_at: float) -> None:
    if time.time() - modified_at > STALE_TEMP_S:
        with contextlib.suppress(OSError):
            os.unlink(path)

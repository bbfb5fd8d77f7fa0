"""Content digests of the local files a job loads besides its data: an hf model's save_pretrained
directory and a tokenizer. Standard library only: the service computes them at admission, and the
rank computes them again before it loads, so that what trains is what was planned.

A directory's digest covers every regular file in it, by relative name and content; a symbolic
link, a device or a FIFO anywhere inside is refused (a link would let a directory that was
checked inside the roots read, and copy into final/, a file outside them). Each file is opened
without following links and hashed from the descriptor it was checked on. A file's digest is
remembered by (path, device, inode, size, mtime_ns), so a 14 GB weight file is hashed once per
process, not on every plan of it; a file rewritten in place gets a new mtime and is hashed again.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import threading
from collections import OrderedDict

from workers.config import FieldError

MAX_FILES = 10_000
"""Most files a hashed directory may hold (a save_pretrained directory holds a dozen or a few hundred
shards); more is refused before any is read."""
MAX_DEPTH = 16
"""Deepest sub-directory followed."""
_CHUNK_BYTES = 1 << 20
_CACHE_ENTRIES = 100_000


class DigestError(FieldError):
    """A directory or file that cannot be hashed as it must be, or whose digest is not the expected one;
    `field` names the request field (model.path, data.tokenizer)."""


class _FileDigests:
    """sha256 of files by (path, device, inode, size, mtime_ns), least recently used dropped first."""

    def __init__(self) -> None:
        self._known: OrderedDict[tuple, str] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes_hashed = 0
        """Bytes read to hash files in this process: a test's view of what the cache saved."""

    def of(self, path: str, *, field: str, shown: str) -> str:
        """The hex sha256 of the regular file `path`, opened without following a link."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            why = "is a symbolic link" if exc.errno == errno.ELOOP else f"cannot be read: {exc.strerror}"
            raise DigestError(field, f"{shown} {why}") from None
        with os.fdopen(fd, "rb") as file:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise DigestError(field, f"{shown} is not a regular file")
            key = (path, info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
            with self._lock:
                if key in self._known:
                    self._known.move_to_end(key)
                    return self._known[key]
            digest = self._hash(file)
        with self._lock:
            self._known[key] = digest
            while len(self._known) > _CACHE_ENTRIES:
                self._known.popitem(last=False)
        return digest

    def _hash(self, file) -> str:
        digest = hashlib.sha256()
        while chunk := file.read(_CHUNK_BYTES):
            digest.update(chunk)
            self.bytes_hashed += len(chunk)
        return digest.hexdigest()


FILES = _FileDigests()
"""This process's cache of file digests."""


def directory_digest(path: str, *, field: str) -> str:
    """The digest ("sha256:<hex>") of every regular file under the directory `path`: their relative
    names and contents. DigestError naming `field` for a link or another kind of file inside, a
    directory too deep, or more than MAX_FILES files."""
    files = _regular_files(path, field=field)
    entries = [[name, FILES.of(os.path.join(path, name), field=field, shown=f"{path}/{name}")] for name in files]
    return digest_of(entries)


def files_digest(paths: list[str], *, field: str) -> str:
    """The digest ("sha256:<hex>") of the named regular files (by base name and content): a
    tokenizer.json and the tokenizer_config.json read beside it."""
    entries = [[os.path.basename(p), FILES.of(p, field=field, shown=p)] for p in paths]
    return digest_of(entries)


def tokenizer_digest(tokenizer_json: str) -> str:
    """The digest of a tokenizer as a rank reads it: the tokenizer.json at its real path, and the
    tokenizer_config.json beside it (its eos_token) when there is one."""
    paths = [tokenizer_json]
    config = os.path.join(os.path.dirname(tokenizer_json), "tokenizer_config.json")
    if os.path.lexists(config):
        paths.append(config)
    return files_digest(paths, field="data.tokenizer")


def check_digest(actual: str, *, expected: str, field: str, path: str) -> None:
    """DigestError unless `actual` is `expected`: the files changed since the job was admitted."""
    if actual != expected:
        raise DigestError(
            field,
            f"{path} has changed since the job was admitted: its files' digest is {actual}, not {expected}; "
            "submit the job again to plan the new content",
        )


def digest_of(entries: list[list[str]]) -> str:
    """The digest of [relative name, hex sha256] pairs, sorted by name: a directory's or files'."""
    canonical = json.dumps(entries, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8", "surrogateescape")).hexdigest()


def _regular_files(root: str, *, field: str) -> list[str]:
    """The relative names of the regular files under `root`, sorted; nothing else may be there."""
    names: list[str] = []
    pending = [("", 0)]
    while pending:
        relative, depth = pending.pop()
        if depth > MAX_DEPTH:
            raise DigestError(field, f"{root}/{relative} is nested more than {MAX_DEPTH} directories deep")
        with os.scandir(os.path.join(root, relative)) as entries:
            for entry in entries:
                name = f"{relative}/{entry.name}" if relative else entry.name
                if entry.is_symlink():
                    raise DigestError(
                        field,
                        f"{root}/{name} is a symbolic link: a model or tokenizer directory must hold regular "
                        "files only (copy the file in)",
                    )
                if entry.is_dir(follow_symlinks=False):
                    pending.append((name, depth + 1))
                elif entry.is_file(follow_symlinks=False):
                    names.append(name)
                else:
                    raise DigestError(field, f"{root}/{name} is not a regular file nor a directory")
                if len(names) > MAX_FILES:
                    raise DigestError(field, f"{root} holds more than {MAX_FILES} files")
    return sorted(names)

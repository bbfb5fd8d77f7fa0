"""Code bundles' checks: a user's zip, its entries refused or re-packed under bundle/ (unpack), its digest.

The standard library alone (and ServiceError): the API checks a bundle's entries without
importing, let alone running, what is in it. User code runs only in a child on the workers, whose
trusted parent unpacks the stored zip for it (workers/training/bundles.py) and puts it first on the
child's sys.path, never its own. As defence in depth a bundle may not name a top-level module that
could shadow one: a start-up hook, the standard library's, an installed distribution's, zero1's.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.machinery
import importlib.metadata
import io
import re
import stat
import sys
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import IO

from service.errors import ServiceError

MAX_ENTRIES = 10_000
MAX_UNCOMPRESSED_BYTES = 1 << 30
RESERVED_NAMES = frozenset({"workers", "service", "zero1_migrations"})
"""zero1's own top-level packages, which a bundle placed first on sys.path would shadow."""
STARTUP_HOOKS = frozenset({"sitecustomize", "usercustomize"})
"""Modules the interpreter imports as it starts, from anywhere on sys.path (as it reads a .pth file)."""
MODULE_SUFFIXES = (*importlib.machinery.all_suffixes(), ".pyw")
"""A file is a module when its name ends so: name.py, name.pyc, name.so, name.cpython-311-….so."""
TOP_LEVEL_DIR = "bundle"
"""Every entry of a stored zip is under it; the workers unpack what is below it (workers/training/bundles.py)."""
DIGEST = re.compile(r"sha256:([0-9a-f]{64})")

_CHUNK_BYTES = 1 << 20
_UNKNOWN_SIZE = 1 << 62
_METHODS = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)  # bzip2 and lzma decompress without a bound per read
_DRIVE = re.compile(r"[A-Za-z]:")
_EPOCH = (1980, 1, 1, 0, 0, 0)  # zip's earliest time: a stored zip depends on the files alone
_UNITS = ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))


@dataclass(frozen=True, slots=True)
class BundleInfo:
    """A checked bundle: its digest (of the bytes as uploaded) and its sizes."""

    digest: str
    """"sha256:<64 hex>"."""
    bytes: int
    """The zip's size as uploaded."""
    files: int
    """Regular files (directories not counted)."""
    uncompressed_bytes: int
    """The files' bytes, as counted while decompressing them."""


def invalid_code(message: str, *, entry: str | None = None) -> ServiceError:
    """A 422 for a body that is not a bundle zero1 accepts, naming the entry."""
    detail: dict[str, str] = {"field": "body", "message": message, "type": "value_error"}
    if entry is not None:
        detail["entry"] = entry
    return ServiceError(f"body: {message}", status_code=422, error="invalid_code", detail=[detail])


def check_digest(digest: str, *, field: str = "code") -> str:
    """The 64 hex digits of "sha256:<64 hex>", or a 422 naming `field`."""
    found = DIGEST.fullmatch(digest)
    if found is None:
        message = f"{digest[:80]!r} is not a code digest: expected 'sha256:' and 64 lowercase hex digits"
        detail = [{"field": field, "message": message, "type": "value_error"}]
        raise ServiceError(f"{field}: {message}", status_code=422, error="invalid_request", detail=detail)
    return found.group(1)


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def check_bundle(
    data: bytes, *, max_entries: int = MAX_ENTRIES, max_uncompressed_bytes: int = MAX_UNCOMPRESSED_BYTES
) -> BundleInfo:
    """The bundle's digest and sizes, every file decompressed and counted; a 422 naming the entry otherwise."""
    return unpack(data, into=None, max_entries=max_entries, max_uncompressed_bytes=max_uncompressed_bytes)


def unpack(data: bytes, *, into: zipfile.ZipFile | None, max_entries: int, max_uncompressed_bytes: int) -> BundleInfo:
    """Check the zip `data`; with `into`, write its files there under bundle/, in the order of their names."""
    if not data:
        raise invalid_code("the body is empty: send a zip")
    try:
        source = zipfile.ZipFile(io.BytesIO(data))
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as error:
        raise invalid_code(f"not a zip file zero1 can read ({error})") from None
    with source:
        entries = _check_names(source.infolist(), max_entries=max_entries)
        if into is not None:
            into.writestr(_stored_info(TOP_LEVEL_DIR + "/"), b"")
        num_files = 0
        total_bytes = 0
        for name, info in sorted(entries.items()):
            if info.is_dir():
                if into is not None:
                    into.writestr(_stored_info(f"{TOP_LEVEL_DIR}/{name}/"), b"")
                continue
            stored = _stored_info(f"{TOP_LEVEL_DIR}/{name}", mode=info.external_attr >> 16)
            # zip64 fields once an entry may pass 4 GiB (deflate adds a little to incompressible data)
            zip64 = max_uncompressed_bytes > zipfile.ZIP64_LIMIT // 2
            with nullcontext() if into is None else into.open(stored, "w", force_zip64=zip64) as out:
                total_bytes = _copy_entry(
                    source, info, out=out, total_bytes=total_bytes, max_bytes=max_uncompressed_bytes
                )
            num_files += 1
    return BundleInfo(digest=digest_of(data), bytes=len(data), files=num_files, uncompressed_bytes=total_bytes)


def _check_names(infos: list[zipfile.ZipInfo], *, max_entries: int) -> dict[str, zipfile.ZipInfo]:
    """Plain name (no "." or empty parts, no trailing "/") -> entry, every name checked before any is read."""
    if len(infos) > max_entries:
        raise invalid_code(f"the zip has {len(infos)} entries, more than the limit of {max_entries}")
    entries: dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        name = _check_entry(info)
        if name is None:
            continue  # "./": the bundle's root itself
        if name in entries:
            raise invalid_code(f"entry {info.filename!r} names the same path as an earlier entry", entry=info.filename)
        entries[name] = info
    if all(info.is_dir() for info in entries.values()):
        raise invalid_code("the zip holds no files")
    _check_no_file_is_a_directory(entries)
    return entries


def _check_no_file_is_a_directory(entries: dict[str, zipfile.ZipInfo]) -> None:
    """A 422 naming both entries when a file's path is a directory of another entry (`x` and `x/y.py`):
    unpacked, one of them cannot exist, and the unpacking fails only when a job or plan uses the bundle."""
    for name, info in sorted(entries.items()):
        parts = name.split("/")
        for depth in range(1, len(parts)):
            parent = entries.get("/".join(parts[:depth]))
            if parent is not None and not parent.is_dir():
                raise invalid_code(
                    f"entry {info.filename!r} is inside {parent.filename!r}, which is a file: "
                    "a path cannot be both a file and a directory",
                    entry=info.filename,
                )


def _check_entry(info: zipfile.ZipInfo) -> str | None:
    """The entry's plain name; a 422 for one that could land outside the bundle or shadow zero1."""
    raw = info.filename
    if raw.startswith(("/", "\\")) or _DRIVE.match(raw):
        raise invalid_code(f"entry {raw!r} is an absolute path", entry=raw)
    if "\\" in raw:  # an unzip may skip such a name without a word
        raise invalid_code(f"entry {raw!r} has a backslash: a zip separates a path's parts with '/'", entry=raw)
    parts = [part for part in raw.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise invalid_code(f"entry {raw!r} has a '..' component", entry=raw)
    if stat.S_ISLNK(info.external_attr >> 16):
        raise invalid_code(f"entry {raw!r} is a symlink", entry=raw)
    if not parts:
        return None
    if (shadowed := _shadowed(parts, is_dir=info.is_dir())) is not None:
        raise invalid_code(f"entry {raw!r} {shadowed}, first on its code's sys.path: rename it", entry=raw)
    if not info.is_dir() and info.flag_bits & 0x1:
        raise invalid_code(f"entry {raw!r} is encrypted", entry=raw)
    if not info.is_dir() and info.compress_type not in _METHODS:
        raise invalid_code(
            f"entry {raw!r} is compressed by method {info.compress_type}; zip it with deflate (8) or none (0)",
            entry=raw,
        )
    return "/".join(parts)


def _shadowed(parts: list[str], *, is_dir: bool) -> str | None:
    """What a top-level module or package of the bundle (name.py, name.*.so, name/, a .pth) would
    shadow, in words; None for an entry that shadows nothing."""
    if len(parts) == 1 and not is_dir:
        if parts[0].endswith(".pth"):
            return "is a start-up hook (a .pth file)"
        if not parts[0].endswith(MODULE_SUFFIXES):
            return None  # a data file: nothing imports it
    name = parts[0].partition(".")[0]
    if name in RESERVED_NAMES:
        return f"would shadow zero1's own package {name!r}"
    if name in STARTUP_HOOKS:
        return f"would run as the start-up hook {name!r}"
    if name in sys.stdlib_module_names:
        return f"would shadow the standard library's module {name!r}"
    if distributions := _installed_modules().get(name):
        return f"would shadow the module {name!r} of the installed distribution {distributions[0]!r}"
    return None


@functools.cache
def _installed_modules() -> dict[str, list[str]]:
    """Top-level module -> the installed distributions that provide it (read once: the image's own)."""
    return importlib.metadata.packages_distributions()


def _copy_entry(
    source: zipfile.ZipFile, info: zipfile.ZipInfo, *, out: IO[bytes] | None, total_bytes: int, max_bytes: int
) -> int:
    """Decompress one file in chunks into `out`, counting what comes out; the bundle's bytes so far.

    The header's file_size is a claim, not a bound: zipfile is told the size is unknown, so that
    it stops at the data's real end (and checks the CRC there), and the count decides.
    """
    raw = info.filename
    unbounded = copy.copy(info)
    unbounded.file_size = _UNKNOWN_SIZE
    entry_bytes = 0
    with _damaged_as_422(raw), source.open(unbounded) as stream:
        while chunk := stream.read(_CHUNK_BYTES):
            entry_bytes += len(chunk)
            if total_bytes + entry_bytes > max_bytes:
                raise invalid_code(f"the bundle unpacks to more than {_size(max_bytes)} at entry {raw!r}", entry=raw)
            if out is not None:
                out.write(chunk)
    if entry_bytes != info.file_size:
        raise invalid_code(
            f"entry {raw!r} unpacks to {entry_bytes} bytes, but its header says {info.file_size}", entry=raw
        )
    return total_bytes + entry_bytes


@contextmanager
def _damaged_as_422(entry: str) -> Iterator[None]:
    """zipfile's errors on a damaged entry (a bad CRC, bad deflate data, a cut-off file) as a 422 naming it."""
    try:
        yield
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, ValueError) as error:
        raise invalid_code(f"entry {entry!r} is damaged ({error or type(error).__name__})", entry=entry) from None


def _stored_info(name: str, *, mode: int = 0) -> zipfile.ZipInfo:
    """A stored entry's header: a fixed time, 0o755 for directories and executables, 0o644 for other files."""
    info = zipfile.ZipInfo(name, date_time=_EPOCH)
    if name.endswith("/"):
        info.external_attr = (stat.S_IFDIR | 0o755) << 16 | 0x10  # 0x10: MS-DOS's directory flag
    else:
        info.external_attr = (stat.S_IFREG | (0o755 if mode & 0o100 else 0o644)) << 16
        info.compress_type = zipfile.ZIP_DEFLATED
    return info


def _size(num_bytes: int) -> str:
    """1073741824 -> "1073741824 bytes (1 GiB)"."""
    for unit_bytes, unit in _UNITS:
        if num_bytes >= unit_bytes and num_bytes % unit_bytes == 0:
            return f"{num_bytes} bytes ({num_bytes // unit_bytes} {unit})"
    return f"{num_bytes} bytes"

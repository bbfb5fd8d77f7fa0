"""A job's code bundle, fetched and unpacked by a trusted parent for its child alone.

A bundle is never on the trusted side's import path: a Ray worker that ran with it as its working
directory would import a `sitecustomize.py`, or any module the bundle names like one it imports,
as the service's uid. So the parent (a rank's actor, a plan's task) reads the stored zip itself
(a file opened without following a link, or an object read with its own credentials) and unpacks
it into a fresh directory of its own (mkdtemp, 0700), entry by entry: no absolute path, no `..`,
no link, regular files and directories only, within the upload's limits. Only then is the
directory given to the child's uid, the top last; only the child's sys.path holds it. The files
land in .../working_dir_files/code/, the name tracebacks are trimmed by (workers/records.py).
Standard library only, and the store (workers/training/storage.py) for a bundle on a bucket.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import PurePosixPath
from typing import BinaryIO
from urllib.parse import unquote, urlparse

from workers.training.storage import open_store

TOP_LEVEL_DIR = "bundle"
"""Every entry of a stored zip is under it (service/store/code/checks.py packs it so)."""
CODE_DIRS = ("working_dir_files", "code")
"""The unpacked files' place under the private directory: workers.records trims tracebacks by it."""
MAX_ENTRIES = 10_000
MAX_UNCOMPRESSED_BYTES = 1 << 30
"""The upload's limits, checked again: a stored zip is the service's, but unpacking stays bounded."""
_CHUNK_BYTES = 1 << 20
_FILE_TYPES = (0, stat.S_IFREG, stat.S_IFDIR)  # 0: a zip made without Unix modes


class BundleError(ValueError):
    """The bundle could not be fetched or unpacked; the message says which bundle and why."""


def unpack_bundle(uri: str, *, owner: tuple[int, int] | None) -> str:
    """The bundle stored at `uri` (file://….zip or s3://….zip) unpacked into a fresh private
    directory, given to `owner` (uid, gid; None: kept as this process's): the unpacked code's path,
    <mkdtemp>/working_dir_files/code. BundleError, with nothing left behind, when it cannot be."""
    staging = tempfile.mkdtemp(prefix="zero1-code-")
    code = os.path.join(staging, *CODE_DIRS)
    try:
        os.makedirs(code, mode=0o700)
        with _archive(uri, staging) as archive:
            _extract(archive, code)
        _give(staging, owner)
    except Exception as error:  # noqa: BLE001 - zipfile's, zlib's and the object store's client's errors too
        shutil.rmtree(staging, ignore_errors=True)
        why = str(error) if isinstance(error, BundleError) else f"{type(error).__name__}: {error}"
        raise BundleError(f"the code bundle could not be unpacked for its child: {why}") from None
    return code


@contextlib.contextmanager
def _archive(uri: str, staging: str) -> Iterator[zipfile.ZipFile]:
    """The stored zip: a local file opened without following a link, or an object downloaded (with
    this process's credentials) into the private directory first."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        file = _open_regular(unquote(parsed.path))
    elif parsed.scheme == "s3":
        file = _download(uri, staging)
    else:
        raise BundleError(f"{uri!r} is neither file:// nor s3://")
    with file, zipfile.ZipFile(file) as archive:
        yield archive


def _download(uri: str, staging: str) -> BinaryIO:
    """The object `uri` in a file of `staging`, open to read, its name already removed."""
    directory, _, name = uri.rpartition("/")
    local = os.path.join(staging, "bundle.zip")
    with open_store(directory).open(name) as source, open(local, "xb") as out:
        shutil.copyfileobj(source, out, _CHUNK_BYTES)
    file = open(local, "rb")  # noqa: SIM115 - the caller closes it
    os.unlink(local)  # read through the descriptor: nothing of it is left in what the child gets
    return file


def _open_regular(path: str) -> BinaryIO:
    """`path` opened to read without following a link at its end; BundleError unless a regular file."""
    handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    file = os.fdopen(handle, "rb")
    if not stat.S_ISREG(os.fstat(handle).st_mode):
        file.close()
        raise BundleError(f"{path} is not a regular file")
    return file


def _extract(archive: zipfile.ZipFile, code: str) -> None:
    """Every entry of `archive` under code/ (without the top bundle/ directory), checked first."""
    infos = archive.infolist()
    if len(infos) > MAX_ENTRIES:
        raise BundleError(f"it has {len(infos)} entries, more than {MAX_ENTRIES}")
    total_bytes = 0
    for info in infos:
        parts = _entry_parts(info)
        if not parts:
            continue  # bundle/ itself
        target = os.path.join(code, *parts)
        if info.is_dir():
            os.makedirs(target, mode=0o755, exist_ok=True)
            continue
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        total_bytes = _write(archive, info, target, total_bytes=total_bytes)


def _entry_parts(info: zipfile.ZipInfo) -> list[str]:
    """The entry's path below bundle/, as parts; BundleError for one that could land elsewhere."""
    name = info.filename
    parts = PurePosixPath(name).parts
    mode = info.external_attr >> 16
    if "\\" in name or not parts or parts[0] != TOP_LEVEL_DIR or any(p in ("/", ".", "..", "") for p in parts):
        raise BundleError(f"entry {name!r} is not a plain path under {TOP_LEVEL_DIR}/")
    if stat.S_IFMT(mode) not in _FILE_TYPES:
        raise BundleError(f"entry {name!r} is not a regular file or a directory (mode {mode:o})")
    return list(parts[1:])


def _write(archive: zipfile.ZipFile, info: zipfile.ZipInfo, target: str, *, total_bytes: int) -> int:
    """One file's bytes into a new file `target` (never through a link, never over a file): the
    bundle's bytes so far."""
    mode = 0o755 if (info.external_attr >> 16) & 0o100 else 0o644
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    with archive.open(info) as source, os.fdopen(os.open(target, flags, mode), "wb") as out:
        while chunk := source.read(_CHUNK_BYTES):
            total_bytes += len(chunk)
            if total_bytes > MAX_UNCOMPRESSED_BYTES:
                raise BundleError(f"it unpacks to more than {MAX_UNCOMPRESSED_BYTES} bytes")
            out.write(chunk)
    return total_bytes


def _give(staging: str, owner: tuple[int, int] | None) -> None:
    """Everything under `staging` to `owner`, the top last: until then the child's uid can reach none of it."""
    if owner is None:
        return
    uid, gid = owner
    for directory, dirnames, filenames in os.walk(staging, topdown=False):
        for name in dirnames + filenames:
            os.chown(os.path.join(directory, name), uid, gid, follow_symlinks=False)
    os.chown(staging, uid, gid, follow_symlinks=False)

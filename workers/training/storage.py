"""Where a job's bytes live: a directory, or a prefix of an S3 bucket (`s3://bucket/prefix`, any
S3-compatible store: MinIO, Ceph, R2), behind one small interface, so that the checkpoints' readers
(workers/training/checkpoints.py), the service and a rank's trusted parent do not care which.

An object store is reached through fsspec's s3fs, configured only by what boto reads: the
standard AWS variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION,
AWS_PROFILE), its files and an instance's role. Nothing here names an endpoint or a key.

A URI that is neither a path nor s3:// is refused (parse_uri): `gs://b/p` or `http://h/p` taken
for a relative directory would put a job's checkpoints in `./gs:/b/p`, where no one looks.

Names inside a store are relative and '/'-separated (`step-000000099/complete.json`). A directory
store never follows a link that a job's code may have planted, on the way or at the end, even one
swapped in while it reads: every name is walked from the root's descriptor (workers/training/confined.py),
no link is listed, and only regular files with one link are read. Standard library only, and
fsspec where a store is remote: the control plane imports this without torch.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from workers.training import confined
from workers.uris import parse_uri

_COPY_BYTES = 8 << 20
_PART_BYTES = 64 << 20
"""An object store upload's part: a 750 MB shard goes in 12 parts."""


def as_store(root: str | os.PathLike | Store) -> Store:
    """`root` as a store: a store as it is, a path or URI opened (open_store)."""
    return root if isinstance(root, Store) else open_store(str(root))


def open_store(uri: str) -> Store:
    """The store `uri` names (parse_uri's rules)."""
    scheme, root = parse_uri(uri)
    return DirectoryStore(Path(root)) if scheme == "file" else ObjectStore(root, scheme=scheme)


def _check_name(name: str) -> str:
    """A relative name below the store's root: no absolute path, no '..', no empty part."""
    if name in ("", "."):
        return ""
    parts = name.split("/")
    if name.startswith("/") or any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"not a name inside the store: {name!r}")
    return name


class Store:
    """A job's storage root (or the whole storage's): names relative to it. OSError on what cannot
    be read or written; FileNotFoundError for a name that is absent."""

    uri: str
    local: bool

    def child(self, name: str) -> Store:
        raise NotImplementedError

    def list(self, name: str = "") -> list[str]:
        """The names of the entries directly under `name` (files and directories); [] when there are none."""
        raise NotImplementedError

    def read(self, name: str, *, limit: int | None = None) -> bytes:
        """The file's bytes (at most `limit`)."""
        raise NotImplementedError

    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the file: one range request on an object store."""
        raise NotImplementedError

    def write(self, name: str, data: bytes) -> None:
        """The file is absent, or whole: never torn."""
        raise NotImplementedError

    def put_file(self, local: Path | BinaryIO, name: str) -> None:
        """Copy the local file `local` (a path, or a file object open to read) to `name`, whole or not at all."""
        raise NotImplementedError

    def size(self, name: str) -> int:
        raise NotImplementedError

    def exists(self, name: str) -> bool:
        raise NotImplementedError

    def is_file(self, name: str) -> bool:
        """A file (in a directory: a regular file, not a link) is at `name`."""
        raise NotImplementedError

    def is_dir(self, name: str) -> bool:
        """A directory (in a directory: not a link), or a prefix with objects under it, is at `name`."""
        raise NotImplementedError

    def remove(self, name: str) -> None:
        """Delete a file; an absent one is no error."""
        raise NotImplementedError

    def remove_tree(self, name: str = "") -> None:
        """Delete everything under `name` (the whole root when empty); an absent one is no error."""
        raise NotImplementedError

    def rename(self, src: str, dst: str) -> None:
        """A small file to another name (a marker): a copy and a delete on an object store."""
        raise NotImplementedError

    def open(self, name: str) -> Any:
        """A binary file object to read, seekable (ranged reads on an object store)."""
        raise NotImplementedError


class DirectoryStore(Store):
    """A directory on a filesystem (shared by every node on a cluster). Every name is reached by
    workers/training/confined.py's walk from the root: no link is followed anywhere below it, reads
    take regular files with one link, files are created O_EXCL with dir_fd. The root is trusted: the
    checkpoint storage's root, which no job can write, or a directory below it (child)."""

    local = True

    def __init__(self, root: Path, *, base: Path | None = None) -> None:
        self.root = Path(root)
        self.uri = str(self.root)
        self._base = self.root if base is None else Path(base)
        relative = "." if base is None else str(self.root.relative_to(self._base))
        self._prefix = "" if relative == "." else relative

    def path(self, name: str = "") -> Path:
        name = _check_name(name)
        return self.root / name if name else self.root

    def _name(self, name: str) -> str:
        """`name` relative to the trusted base the walks start from."""
        name = _check_name(name)
        return "/".join(part for part in (self._prefix, name) if part)

    def child(self, name: str) -> DirectoryStore:
        return DirectoryStore(self.path(name), base=self._base)

    def list(self, name: str = "") -> list[str]:
        try:
            return confined.list_dir(self._base, self._name(name))
        except OSError:
            return []

    def open(self, name: str) -> Any:
        return confined.open_file(self._base, self._name(name))

    def read(self, name: str, *, limit: int | None = None) -> bytes:
        with self.open(name) as file:
            return file.read() if limit is None else file.read(limit)

    def read_range(self, name: str, start: int, end: int) -> bytes:
        with self.open(name) as file:
            file.seek(start)
            return file.read(max(0, end - start))

    def write(self, name: str, data: bytes) -> None:
        self.put_file(io.BytesIO(data), name)

    def put_file(self, local: Path | BinaryIO, name: str) -> None:
        name = self._name(name)
        parent, _, last = name.rpartition("/")
        tmp = "/".join(part for part in (parent, f".{last}.tmp-{uuid.uuid4().hex[:8]}") if part)
        self._base.mkdir(parents=True, exist_ok=True)  # the caller's own path, as before
        descriptor = confined.create_file(self._base, tmp, mode=0o666, parents_mode=0o777)
        try:
            with _opened(local) as source, os.fdopen(descriptor, "wb") as out:
                shutil.copyfileobj(source, out, _COPY_BYTES)
                out.flush()
                os.fsync(out.fileno())
            confined.replace(self._base, tmp, name)
        except BaseException:
            confined.unlink(self._base, tmp)
            raise

    def size(self, name: str) -> int:
        info = confined.entry_stat(self._base, self._name(name))
        if info is None:
            raise FileNotFoundError(errno.ENOENT, f"{name} does not exist")
        return info.st_size

    def exists(self, name: str) -> bool:
        return confined.entry_stat(self._base, self._name(name)) is not None

    def is_file(self, name: str) -> bool:
        info = confined.entry_stat(self._base, self._name(name))
        return info is not None and stat.S_ISREG(info.st_mode)

    def is_dir(self, name: str) -> bool:
        info = confined.entry_stat(self._base, self._name(name))
        return info is not None and stat.S_ISDIR(info.st_mode)

    def remove(self, name: str) -> None:
        confined.unlink(self._base, self._name(name))

    def remove_tree(self, name: str = "") -> None:
        name = self._name(name)
        if name:
            confined.remove_tree(self._base, name)
        else:  # the base itself, the caller's own path: rmtree is descriptor-based below it
            shutil.rmtree(self._base, ignore_errors=True)

    def rename(self, src: str, dst: str) -> None:
        confined.replace(self._base, self._name(src), self._name(dst))


class ObjectStore(Store):
    """A prefix of a bucket, through fsspec (s3fs). Listings are never cached: a checkpoint's
    marker written by another process must be seen at once."""

    local = False

    def __init__(self, root: str, *, scheme: str = "s3", fs: Any = None) -> None:
        self.root = root.rstrip("/")
        self.scheme = scheme
        self.uri = f"{scheme}://{self.root}"
        self.fs = fs if fs is not None else filesystem(scheme)

    def key(self, name: str = "") -> str:
        name = _check_name(name)
        return f"{self.root}/{name}" if name else self.root

    def child(self, name: str) -> ObjectStore:
        return ObjectStore(self.key(name), scheme=self.scheme, fs=self.fs)

    def list(self, name: str = "") -> list[str]:
        try:
            found = self.fs.ls(self.key(name), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted({PurePosixPath(path).name for path in found})

    def open(self, name: str) -> Any:
        return self.fs.open(self.key(name), "rb", cache_type="none")

    def read(self, name: str, *, limit: int | None = None) -> bytes:
        if limit is None:
            return self.fs.cat_file(self.key(name))
        return self.fs.cat_file(self.key(name), start=0, end=limit)

    def read_range(self, name: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        return self.fs.cat_file(self.key(name), start=start, end=end)

    def write(self, name: str, data: bytes) -> None:
        self.fs.pipe_file(self.key(name), data)  # one PUT: the object appears whole or not at all

    def put_file(self, local: Path | BinaryIO, name: str) -> None:
        # a multipart upload past one block, visible only once complete
        with _opened(local) as source, self.fs.open(self.key(name), "wb", block_size=_PART_BYTES) as out:
            shutil.copyfileobj(source, out, _COPY_BYTES)

    def size(self, name: str) -> int:
        return int(self.fs.size(self.key(name)))

    def exists(self, name: str) -> bool:
        return bool(self.fs.exists(self.key(name)))

    def is_file(self, name: str) -> bool:
        return bool(self.fs.isfile(self.key(name)))

    def is_dir(self, name: str) -> bool:
        return bool(self.fs.isdir(self.key(name)))

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.key(name))

    def remove_tree(self, name: str = "") -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.key(name) + "/", recursive=True)

    def rename(self, src: str, dst: str) -> None:
        self.fs.copy(self.key(src), self.key(dst))
        self.remove(src)


@contextlib.contextmanager
def _opened(local: Path | BinaryIO) -> Iterator[BinaryIO]:
    """A path opened to read (closed after), or a file object as it is (its owner closes it)."""
    if isinstance(local, (str, os.PathLike)):
        with open(local, "rb") as file:
            yield file
    else:
        yield local


def filesystem(scheme: str = "s3") -> Any:
    """fsspec's filesystem for `scheme`, configured by the standard AWS settings alone, with no
    listing cache (another process's writes are seen at once)."""
    import fsspec

    return fsspec.filesystem(scheme, use_listings_cache=False, skip_instance_cache=True)

"""Paths below a trusted directory, opened so that nothing a job's code planted on the way can
redirect them: every path the service or a rank's parent (root, or another uid than the job's)
opens, creates, lists or deletes inside a job's storage or a child's home goes through here.

A check then an open by path (`is_symlink()`, then `open(path, O_NOFOLLOW)`) loses a race: O_NOFOLLOW
guards the last component only, and a job's code can swap a directory on the way for a link to
another job's between the two (`renameat2(RENAME_EXCHANGE)` in a loop). So a name is walked from
the root's descriptor, one component at a time, each opened `O_DIRECTORY|O_NOFOLLOW` with `dir_fd`
(the kernel resolves each against the descriptor held, not against a path again); the last is
opened `O_NOFOLLOW|O_NONBLOCK` (a planted FIFO never blocks the reader) and fstat'ed: a read wants a
regular file with one link (a hard link could be another file). Files are created with `dir_fd`
and `O_CREAT|O_EXCL|O_NOFOLLOW`; listing, renaming and deleting work on the parent's descriptor.

The root itself is the caller's: a path whose parent no job can write (the storage root, a fresh
mkdtemp) or a descriptor it opened while the path was still its own (Root). Errors are OSErrors whose
strerror names the path relative to the root and why (`step-000000777 is a symbolic link`), with the
errno of the cause (FileNotFoundError stays one); a name that is not relative is a ValueError.
Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Iterator
from typing import BinaryIO

Root = str | os.PathLike | int
"""A directory the caller trusts: a path (opened following links: it is the caller's own), or a
descriptor it holds (used, never closed here)."""

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_WHY = {errno.ELOOP: "is a symbolic link", errno.ENOTDIR: "is not a directory", errno.ENOENT: "does not exist"}


def parts_of(name: str) -> list[str]:
    """The components of a relative '/'-separated name ("" or "." for the root itself); ValueError
    for an absolute one, or one with an empty, '.' or '..' component."""
    if name in ("", "."):
        return []
    parts = name.split("/")
    if name.startswith("/") or any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"not a name inside the directory: {name!r}")
    return parts


def refusal(error: OSError, shown: str, *, dir_fd: int, part: str) -> OSError:
    """`error` of opening `part` in `dir_fd`, as an OSError of the same errno whose strerror names
    `shown` and why; a link opened as a directory (ENOTDIR) is named a link."""
    code = error.errno
    if code == errno.ENOTDIR:
        with contextlib.suppress(OSError):
            if stat.S_ISLNK(os.stat(part, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                code = errno.ELOOP
    return OSError(code, f"{shown or '.'} {_WHY.get(code, error.strerror or str(error))}")


def _open_root(root: Root) -> int:
    return os.dup(root) if isinstance(root, int) else os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def open_dir(root: Root, name: str = "", *, create_mode: int | None = None) -> int:
    """A descriptor of the directory `name` below `root` (the caller closes it), no link followed on
    the way; with `create_mode`, a missing component is made (mkdir with dir_fd, that mode)."""
    fd = _open_root(root)
    shown = []
    try:
        for part in parts_of(name):
            shown.append(part)
            if create_mode is not None:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, create_mode, dir_fd=fd)
            try:
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
            except OSError as error:
                raise refusal(error, "/".join(shown), dir_fd=fd, part=part) from None
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def opened_dir(root: Root, name: str = "", *, create_mode: int | None = None) -> Iterator[int]:
    """open_dir's descriptor, closed after."""
    fd = open_dir(root, name, create_mode=create_mode)
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def parent_of(root: Root, name: str, *, create_mode: int | None = None) -> Iterator[tuple[int, str]]:
    """(a descriptor of the directory that holds `name`, its last component), the descriptor closed after."""
    parts = parts_of(name)
    if not parts:
        raise ValueError("the directory itself has no parent inside it")
    with opened_dir(root, "/".join(parts[:-1]), create_mode=create_mode) as fd:
        yield fd, parts[-1]


def open_descriptor(root: Root, name: str, *, flags: int = READ_FLAGS, one_link: bool = True) -> int:
    """A descriptor of the regular file `name` below `root` (opened with `flags` | O_NOFOLLOW), no
    link followed on the way; OSError naming it when it is not a regular file, or has more than one
    link and `one_link`."""
    with parent_of(root, name) as (parent, last):
        try:
            fd = os.open(last, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
        except OSError as error:
            raise refusal(error, name, dir_fd=parent, part=last) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, f"{name} is not a regular file")
        if one_link and info.st_nlink != 1:
            raise OSError(errno.EMLINK, f"{name} has {info.st_nlink} hard links")
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(root: Root, name: str, *, one_link: bool = True) -> BinaryIO:
    """The regular file `name` below `root`, open to read (open_descriptor's rules)."""
    return os.fdopen(open_descriptor(root, name, one_link=one_link), "rb")


def create_file(root: Root, name: str, *, mode: int = 0o600, parents_mode: int | None = None) -> int:
    """A new file `name` below `root`, open to write (O_CREAT|O_EXCL|O_NOFOLLOW with dir_fd: never an
    existing file, never through a link); with `parents_mode`, missing directories are made."""
    with parent_of(root, name, create_mode=parents_mode) as (parent, last):
        try:
            return os.open(last, _CREATE_FLAGS, mode, dir_fd=parent)
        except OSError as error:
            raise refusal(error, name, dir_fd=parent, part=last) from None


def entry_stat(root: Root, name: str) -> os.stat_result | None:
    """The entry `name` itself (a link is not followed: it is a link), its parents walked; None when
    it or a directory on the way is absent, or a component on the way is no directory."""
    if not parts_of(name):
        return os.stat(_root_path_or_fd(root))
    try:
        with parent_of(root, name) as (parent, last):
            return os.stat(last, dir_fd=parent, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
            return None
        raise


def _root_path_or_fd(root: Root) -> str | int:
    return root if isinstance(root, int) else os.fspath(root)


def list_dir(root: Root, name: str = "") -> list[str]:
    """The names in the directory `name` below `root`, sorted, links left out."""
    with opened_dir(root, name) as fd, os.scandir(fd) as entries:
        return sorted(entry.name for entry in entries if not entry.is_symlink())


def unlink(root: Root, name: str, *, missing_ok: bool = True) -> None:
    """Delete the file (or link: never followed) `name` below `root`."""
    try:
        with parent_of(root, name) as (parent, last):
            os.unlink(last, dir_fd=parent)
    except FileNotFoundError:
        if not missing_ok:
            raise


def remove_tree(root: Root, name: str) -> None:
    """Delete `name` below `root` and all under it; absent is no error. A file or link is unlinked; a
    directory goes by shutil.rmtree with dir_fd, which on Linux is descriptor-based (it opens each
    directory with O_NOFOLLOW from its parent's descriptor and checks it is the one it listed), so
    a link swapped in anywhere below is never followed."""
    try:
        with parent_of(root, name) as (parent, last):
            info = os.stat(last, dir_fd=parent, follow_symlinks=False)
            if stat.S_ISDIR(info.st_mode):
                shutil.rmtree(last, dir_fd=parent, ignore_errors=True)
            else:
                os.unlink(last, dir_fd=parent)
    except OSError as error:
        if error.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            raise


def replace(root: Root, src: str, dst: str) -> None:
    """Rename `src` to `dst` (both below `root`), replacing `dst`; neither parent reached through a link."""
    with parent_of(root, src) as (src_dir, src_last), parent_of(root, dst) as (dst_dir, dst_last):
        os.replace(src_last, dst_last, src_dir_fd=src_dir, dst_dir_fd=dst_dir)

"""Which directory stops a uid on its way to a file, links followed as the kernel follows them: for
the one-line start errors of ZERO1_RUN_AS (workers/runtime/sandbox.py's check_runnable).

A venv's `bin/python` is a link whose target may lie in a private home (/root is 0700): every directory
above the link is searchable and the exec still fails, so the walk goes on from each link's target and
names the directory that refuses, the path it lies above, and the link that led there. Modes are read
for the uid and its one gid (children run with no supplementary groups); ACLs are not read, so this
only explains a failure the kernel reported, never decides one.

May import: the standard library only.
"""

from __future__ import annotations

import os
import stat

MAX_LINKS = 40
"""Links followed before giving up, as the kernel's ELOOP does."""


def blocked_at(path: str, *, uid: int, gid: int, access: int = os.X_OK) -> str | None:
    """Where `uid` is stopped on its way to `path` or to `access` it, in words: 'cannot search /root (mode
    0700), above /root/.pyenv/bin/python3, the target of /srv/venv/bin/python'; None where nothing is."""
    links: list[str] = []
    pending = os.path.abspath(path)
    for _ in range(MAX_LINKS):
        current = "/"
        parts = [part for part in pending.split("/") if part not in ("", ".")]
        for index, name in enumerate(parts):
            if not _may(current, uid=uid, gid=gid, access=os.X_OK):
                return f"cannot search {current} ({_mode(current)}), above {pending}{_via(links)}"
            if name == "..":
                current = os.path.dirname(current)
                continue
            step = os.path.join(current, name)
            try:
                if not os.path.islink(step):
                    current = step
                    continue
                target = os.readlink(step)
            except OSError:  # gone or unreadable: not this walk's to explain
                return None
            links.append(step)
            pending = os.path.join(current, target, *parts[index + 1 :])  # an absolute target starts over at /
            break
        else:
            if not _may(current, uid=uid, gid=gid, access=access):
                verb = "run" if access & os.X_OK and not os.path.isdir(current) else "read"
                return f"cannot {verb} {current} ({_mode(current)}){_via(links)}"
            return None
    return None


def _may(path: str, *, uid: int, gid: int, access: int) -> bool:
    """Whether the mode bits of `path` let `uid` (its group `gid` only) have `access` (os.R_OK | os.X_OK ...)."""
    try:
        info = os.stat(path)
    except OSError:
        return True  # not this walk's to explain
    shift = 6 if info.st_uid == uid else 3 if info.st_gid == gid else 0
    return (info.st_mode >> shift) & access == access


def _mode(path: str) -> str:
    info = os.stat(path)
    return f"mode {stat.S_IMODE(info.st_mode):04o}, owner {info.st_uid}:{info.st_gid}"


def _via(links: list[str]) -> str:
    if not links:
        return ""
    first = f" (reached from {links[0]})" if len(links) > 1 else ""
    return f", the target of {links[-1]}{first}"

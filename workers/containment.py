"""A job's processes end with it: the small trusted process (the keeper) between a rank's parent and
its untrusted child, as Kubernetes gives each pod its own PID namespace.

Where the kernel allows it (unshare(CLONE_NEWPID) needs CAP_SYS_ADMIN), the keeper forks an init,
pid 1 of a new PID namespace, and the init forks the child. When the child ends the init exits, and
the kernel kills every other process of the namespace: a daemon that double-forked and called
setsid to leave the child's session included. The init mounts the namespace's own /proc, so the
child sees no other job's processes. Where unshare is refused, the keeper is a child
subreaper (PR_SET_CHILD_SUBREAPER): every orphan of the child's tree is reparented to it, and it
SIGKILLs all of its descendants when the child ends.

The keeper runs as the service's uid; only the child drops to the job's. It ends as the child
ended (its exit code, or killed by the same signal), so whoever waits for the keeper (the zygote,
or Popen) learns what a wait for the child would have said. SIGTERM to the keeper (the parent's
kill) ends the whole tree at once; the lifeline's end (the parent gone) ends it LIFELINE_GRACE_S
later, once the child has had the time to exit on its own. Either way the keeper ends last,
killed by SIGKILL. SIGUSR1 to the keeper (the parent asking a hung rank for its stacks) is passed on
to the child, through the namespace's init where there is one; the child starts with SIGUSR1
ignored, until it sets its own handler (workers/runtime/child.py: faulthandler's).

`python -I -m workers.containment UID GID REPORT_FD LIFELINE_FD COMMAND...` keeps a fresh interpreter
(the child starts COMMAND as UID:GID, "-" for this process's own); the zygote calls keep() itself.

May import: the standard library only.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

CLONE_NEWPID = 0x20000000
CLONE_NEWNS = 0x00020000
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REC = 0x4000
MS_PRIVATE = 0x40000
PR_SET_CHILD_SUBREAPER = 36
NAMESPACE = "its own PID namespace"
SUBREAPER = "a subreaper that kills what it leaves behind (no PID namespace here: {why})"
LIFELINE_GRACE_S = 5.0
"""How long the child has to exit on its own once its parent is gone, before its tree is killed."""


def keep(
    start: Callable[[], None], *, lifeline_fd: int, started: Callable[[str], None], inherited: Iterable[int]
) -> NoReturn:
    """Run start() (which never returns: it becomes the child) in a forked process contained as
    this module says, and end as it ends. started(containment) is called once the child is forked;
    `inherited` are descriptors only the child needs, closed here once it has them."""
    wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_write)  # SIGCHLD and SIGTERM wake the wait below
    for number in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(number, lambda *_: None)
    forked: list[int] = []
    _pass_on(signal.SIGUSR1, forked)
    pid, status_read, containment = _fork(start)
    forked.append(pid)
    for fd in inherited:
        with contextlib.suppress(OSError):
            os.close(fd)
    status = None  # the child's wait status; None: killed
    try:
        with contextlib.suppress(OSError):  # a parent gone before it heard: the lifeline says so
            started(containment)
        status = _wait(pid, lifeline_fd=lifeline_fd, wake=wake_read)
        if status is not None and status_read >= 0:  # the init says how the child ended, unless it was killed
            told = os.read(status_read, 4)
            status = int.from_bytes(told, "little") if len(told) == 4 else status
    finally:
        if status_read < 0:
            _kill_descendants()
        elif status is None:  # the namespace ends with its init, here not reaped yet: its pid is still its own
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        _end_as(-signal.SIGKILL if status is None else os.waitstatus_to_exitcode(status))


def _fork(start: Callable[[], None]) -> tuple[int, int, str]:
    """The child forked, contained: (the pid of this process's child, the read end of the pipe its
    init tells the child's end on (-1: no namespace), the containment in words)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    containment = NAMESPACE
    status_read = -1
    status_write = -1
    if libc.unshare(CLONE_NEWPID) == 0:  # this process's next child is pid 1 of a new namespace
        status_read, status_write = os.pipe()
    else:
        containment = SUBREAPER.format(why=os.strerror(ctypes.get_errno()))
    pid = os.fork()
    if pid == 0:
        signal.set_wakeup_fd(-1)
        for number in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(number, signal.SIG_DFL)
        _init(start, status_write) if status_write >= 0 else _run(start)
    if status_write >= 0:
        os.close(status_write)
    return pid, status_read, containment


def _init(start: Callable[[], None], status_write: int) -> NoReturn:
    """Pid 1 of the namespace: forks the child, reaps what is orphaned to it, and when the child
    ends tells the keeper how and exits, which ends every process left in the namespace."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # pid 1 ignores what it has no handler for
        forked: list[int] = []
        _pass_on(signal.SIGUSR1, forked)
        _private_proc()
        pid = os.fork()
        if pid == 0:
            os.close(status_write)
            _run(start)
        forked.append(pid)
        for fd in _open_fds():
            if fd != status_write:
                with contextlib.suppress(OSError):
                    os.close(fd)
        while True:
            ended, status = os.waitpid(-1, 0)
            if ended == pid:
                os.write(status_write, status.to_bytes(4, "little"))
                break
    finally:
        os._exit(0)


def _private_proc() -> None:
    """A /proc of the namespace's own (in a mount namespace of the init's, private so that nothing
    propagates back), as a container has: the child sees its own processes and no other job's (their
    command lines name their paths), and its pids are the ones /proc names. Best effort: where the
    mount is refused, the child sees the node's /proc, as before."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) == 0 and libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) == 0:
        libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)


def _run(start: Callable[[], None]) -> NoReturn:
    try:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # until the child's own handler: never its death
        start()
    finally:
        os._exit(1)


def _pass_on(number: int, forked: list[int]) -> None:
    """Signal `number`, received here, is sent on to this process's child (forked's one pid, once forked)."""

    def send(*_: Any) -> None:
        for pid in forked:
            with contextlib.suppress(OSError):
                os.kill(pid, number)

    signal.signal(number, send)


def _wait(pid: int, *, lifeline_fd: int, wake: int) -> int | None:
    """The wait status of `pid` (this process's child), reaping the orphans that end meanwhile; None
    once this process was told to kill (SIGTERM) or the lifeline broke and the grace ran out."""
    deadline = None
    watched = [wake, lifeline_fd]
    while True:
        if (status := _reap(pid)) is not None:
            return status
        if deadline is not None and time.monotonic() >= deadline:
            return None
        readable = select.select(watched, [], [], 0.5)[0]
        if wake in readable:
            with contextlib.suppress(BlockingIOError):
                if signal.SIGTERM in os.read(wake, 64):
                    return None
        if lifeline_fd in readable and not os.read(lifeline_fd, 1):
            watched.remove(lifeline_fd)
            deadline = time.monotonic() + LIFELINE_GRACE_S


def _reap(pid: int) -> int | None:
    """The wait status of `pid` if it has ended; the other children that have are reaped."""
    while True:
        ended, status = os.waitpid(-1, os.WNOHANG)
        if ended == pid:
            return status
        if ended == 0:
            return None


def _kill_descendants() -> None:
    """SIGKILL every process below this one (orphans of the child's tree are this subreaper's
    children), again until none is left, reaping them. Each is signalled through a pidfd opened
    before its ancestry is read again, so that a pid freed and reused meanwhile is never signalled."""
    me = os.getpid()
    while True:
        parents = _parents()
        below = [pid for pid in parents if _descends(pid, me, parents.get)]
        for pid in below:
            with contextlib.suppress(OSError):
                handle = os.pidfd_open(pid)
                try:
                    if _descends(pid, me, _parent):
                        signal.pidfd_send_signal(handle, signal.SIGKILL)
                finally:
                    os.close(handle)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        if not below:
            return
        time.sleep(0.01)


def _parents() -> dict[int, int]:
    """Every process's parent, as /proc says now."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (parent := _parent(int(entry))) is not None:
            parents[int(entry)] = parent
    return parents


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return int(stat.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _descends(pid: int, ancestor: int, parent_of: Callable[[int], int | None]) -> bool:
    for _ in range(4096):
        parent = parent_of(pid)
        if parent is None or parent <= 1:
            return False
        if parent == ancestor:
            return True
        pid = parent
    return False


def _end_as(code: int) -> NoReturn:
    """Exit with `code`, or (negative) be killed by that signal, as the child was."""
    if code < 0:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        with contextlib.suppress(OSError, ValueError):
            signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)


def _open_fds() -> list[int]:
    return [int(name) for name in os.listdir("/proc/self/fd")]


# --------------------------------------------------------------------------- a fresh interpreter's keeper


def _exec(command: list[str], *, uid: int | None, gid: int | None) -> None:
    """The child of a fresh interpreter: its own session, the job's identity (after entering its
    working directory, the keeper's, as Popen does), then COMMAND with the keeper's environment."""
    os.setsid()
    if uid is not None and gid is not None:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    os.execve(command[0], command, dict(os.environ))


def start_fresh(
    command: list[str], *, env: dict[str, str], cwd: str, identity: tuple[int, int] | None, stdio: tuple[int, int]
) -> subprocess.Popen:
    """COMMAND (`python -m workers.runtime.child MODE CONN LIFELINE STAGING`) as a fresh interpreter
    under a keeper of its own: `python -I`, this process's uid, so nothing of the bundle it starts in
    is on its path; the keeper's Popen, its `containment` set once the keeper has forked the child."""
    report_read, report_write = os.pipe()
    uid, gid = (str(identity[0]), str(identity[1])) if identity else ("-", "-")
    connection_fd = int(command[4])
    lifeline_fd = int(command[5])
    keeper = [sys.executable, "-I", "-m", "workers.containment", uid, gid, str(report_write), str(lifeline_fd)]
    try:
        process: Any = subprocess.Popen(
            keeper + command,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=stdio[0],
            stderr=stdio[1],
            pass_fds=(connection_fd, lifeline_fd, report_write),
            start_new_session=True,
        )
    finally:
        os.close(report_write)
    with os.fdopen(report_read, "rb") as report:
        said = report.read().decode(errors="replace") if select.select([report], [], [], 60)[0] else ""
    process.containment = said or "no known containment (its keeper said nothing)"
    return process


def main(argv: list[str]) -> NoReturn:
    uid = argv[0]
    gid = argv[1]
    report = int(argv[2])
    lifeline = int(argv[3])
    command = argv[4:]
    identity = (None, None) if uid == "-" else (int(uid), int(gid))

    os.set_inheritable(report, False)  # the keeper's to write, never the child's

    def started(containment: str) -> None:
        os.write(report, containment.encode())
        os.close(report)

    keep(lambda: _exec(command, uid=identity[0], gid=identity[1]), lifeline_fd=lifeline, started=started, inherited=())


if __name__ == "__main__":
    main(sys.argv[1:])

"""The zygote: a process per node (and per raylet) that imports torch and the training loop once,
then forks each child (workers/runtime/sandbox.py's Child) from itself, so that a rank's child
starts in milliseconds, not in the 1.3-3 s a fresh interpreter takes to import torch.

Trust: the zygote is the service's, like a rank's actor: it runs as the service's uid, holds no
secret (its environment is a child's allowlist) and never imports Ray. Only its own uid may connect
(SO_PEERCRED), through a socket in a 0700 directory of that uid's. A forked child keeps only the
descriptors it was sent (its socket, lifeline, stdout and stderr), leaves the zygote's session,
drops to its uid and gid with no supplementary groups before it enters its working directory,
and takes the environment and sys.path a fresh child would have. The zygote forks before it reads
anything of a request: the forked keeper (workers/containment.py) reads its own, so what the
zygote's memory holds when it forks is torch and zero1's code, the same for every job, and no
child finds another job's paths or run id in its memory. The keeper forks the child in its own
PID namespace (or as a subreaper where the kernel refuses one), so that a job's processes end
with its child, and ends as the child ended.

The conversation, one SOCK_SEQPACKET connection per child:

    parent: {"mode", "staging", "env", "cwd", "uid", "gid"} with the child's socket, lifeline,
            stdout and stderr (pipes its parent reads) as SCM_RIGHTS
    keeper: {"pid": N, "containment": how}   once forked, or {"error": why}
    zygote: {"returncode": R}                once the keeper ended (as the child did; negative: a signal)

The zygote exits when the process it watches (the raylet of the Ray worker that started it, or
that process itself outside Ray) is gone. Where none can be started or reached, spawn raises
Unavailable and the caller starts a fresh interpreter instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import select
import selectors
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from workers import containment

PRELOAD = ("torch", "workers.training.loop", "workers.runtime.child", "workers.runtime.rank_child")
"""What the zygote imports once, for every child it forks (none of them touches CUDA on import)."""
PER_CHILD = frozenset({"HOME", "TMPDIR", "PYTHONPATH", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"})
"""A child's variables that are its own; the rest of its environment is the zygote's, and names it."""
READY_TIMEOUT_S = 60.0
ANSWER_TIMEOUT_S = 30.0
"""How long a parent waits for a running zygote to fork its child before it starts one afresh."""
LOST = 255
"""The exit code reported for a child whose zygote ended before it could say how the child ended."""


class Unavailable(RuntimeError):
    """No zygote could be reached or started here: the caller starts a fresh interpreter."""


# --------------------------------------------------------------------------- the parent's side


class ZygoteProcess:
    """A child the zygote forked, as much of subprocess.Popen as sandbox.Child uses."""

    def __init__(self, connection: socket.socket, pid: int, containment: str) -> None:
        self.pid = pid
        """The keeper's (workers/containment.py): SIGTERM to it ends the child and all it started."""
        self.containment = containment
        self.returncode: int | None = None
        self._connection: socket.socket | None = connection

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left < 0:
                raise subprocess.TimeoutExpired(f"zygote child {self.pid}", timeout or 0)
            self._read(left if self._connection is not None else 0.05)
        return self.returncode

    def _read(self, timeout: float | None) -> None:
        """The zygote's word on how the child ended, if it came within timeout. Once the zygote is
        gone the child is init's: it has ended when its pid is free, how is lost (LOST)."""
        if self._connection is None:
            if _alive(self.pid):
                time.sleep(timeout or 0)
            else:
                self.returncode = LOST
            return
        if not select.select([self._connection], [], [], timeout)[0]:
            return
        data = self._connection.recv(4096)
        self._connection.close()
        self._connection = None
        if data:
            self.returncode = int(json.loads(data)["returncode"])


def spawn(
    mode: str,
    staging: str,
    *,
    env: Mapping[str, str],
    cwd: str,
    uid: int | None,
    gid: int | None,
    connection_fd: int,
    lifeline_fd: int,
    out_fd: int,
    err_fd: int,
) -> ZygoteProcess:
    """Fork `python -m workers.runtime.child MODE <connection> <lifeline> STAGING` from this node's
    zygote (started here if there is none), as `uid`:`gid`, in `cwd`, with `env`, its stdout and
    stderr `out_fd` and `err_fd`, contained by a keeper (workers/containment.py)."""
    base_env = {name: value for name, value in env.items() if name not in PER_CHILD}
    try:
        path, watched = _socket_path(base_env)
        connection = _connect(path) or _start(path, watched, base_env)
    except (OSError, subprocess.SubprocessError) as exc:
        raise Unavailable(f"no zygote could be started: {type(exc).__name__}: {exc}") from None
    request = {"mode": mode, "staging": staging, "env": dict(env), "cwd": cwd, "uid": uid, "gid": gid}
    try:
        connection.settimeout(ANSWER_TIMEOUT_S)  # a zygote that hangs is not waited for
        socket.send_fds(connection, [json.dumps(request).encode()], [connection_fd, lifeline_fd, out_fd, err_fd])
        answer = json.loads(connection.recv(65536) or b"{}")
        connection.settimeout(None)
    except (OSError, ValueError) as exc:
        connection.close()
        raise Unavailable(f"the zygote at {path} did not answer: {exc}") from None
    if "pid" not in answer:
        connection.close()
        raise Unavailable(f"the zygote at {path} could not fork: {answer.get('error', 'it hung up')}")
    return ZygoteProcess(connection, int(answer["pid"]), str(answer.get("containment")))


def _socket_path(base_env: Mapping[str, str]) -> tuple[str, int]:
    """This node's zygote socket for this interpreter, code and environment, and the pid it watches:
    a Ray worker's raylet (the zygote outlives the worker, not the node's Ray), else this process."""
    directory = os.path.join(tempfile.gettempdir(), f"zero1-zygote-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise Unavailable(f"{directory} is not a directory of uid {os.getuid()}'s alone")
    watched = os.getppid() if _command(os.getppid()) == "raylet" else os.getpid()
    code = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    key = json.dumps([sys.executable, code, watched, sorted(base_env.items())])
    return os.path.join(directory, hashlib.sha256(key.encode()).hexdigest()[:20] + ".sock"), watched


def _connect(path: str) -> socket.socket | None:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        connection.connect(path)
    except OSError:
        connection.close()
        return None
    return connection


def _start(path: str, watched: int, base_env: Mapping[str, str]) -> socket.socket:
    """Start the zygote for `path` (one starter at a time, under a lock) and connect to it."""
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (connection := _connect(path)) is not None:  # another rank started it meanwhile
            return connection
        ready_read, ready_write = os.pipe()
        with open(path + ".log", "ab") as log:
            starter = subprocess.Popen(
                [sys.executable, "-m", "workers.runtime.zygote", path, str(watched), str(ready_write)],
                env={**base_env, "HOME": os.path.dirname(path)},
                cwd="/",
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                pass_fds=(ready_write,),
                start_new_session=True,
            )
        os.close(ready_write)
        try:
            starter.wait(timeout=READY_TIMEOUT_S)  # it forks the zygote and exits: Ray kills a worker's children
            ready = select.select([ready_read], [], [], READY_TIMEOUT_S)[0] and os.read(ready_read, 1)
        finally:
            os.close(ready_read)
        if ready != b"1" or (connection := _connect(path)) is None:
            with open(path + ".log", "rb") as log:
                tail = log.read().decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise Unavailable(f"the zygote did not start at {path}: {tail[0]}")
        return connection


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as comm:
            return comm.read().strip()
    except OSError:
        return ""


# --------------------------------------------------------------------------- the zygote


def main(argv: list[str]) -> None:
    path = argv[0]
    watched = int(argv[1])
    ready = int(argv[2])
    if os.fork():  # the starter's child goes on alone, nobody's child but init's
        os._exit(0)
    os.setsid()
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    torch = sys.modules["torch"]
    if torch.cuda.is_initialized():  # a forked child could not use CUDA
        raise SystemExit(f"CUDA was initialised while importing {PRELOAD}: the zygote cannot fork")
    _serve(path, watched, ready)


def _serve(path: str, watched: int, ready: int) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    staged = f"{path}.{os.getpid()}"
    listener.bind(staged)
    os.chmod(staged, 0o600)
    listener.listen(64)
    os.replace(staged, path)  # a stale socket of a zygote gone is replaced in one step
    mine = os.stat(path).st_ino
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    os.write(ready, b"1")
    os.close(ready)
    children: dict[int, socket.socket] = {}
    events = selectors.DefaultSelector()
    events.register(listener, selectors.EVENT_READ)
    events.register(wake_read, selectors.EVENT_READ)
    try:
        while _alive(watched):
            for key, _ in events.select(timeout=1.0):
                if key.fileobj is listener:
                    _accept(listener, children)
                else:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake_read, 4096)
            _reap(children)
    finally:
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == mine:
                os.unlink(path)
                os.unlink(path + ".lock")
                if not os.path.getsize(path + ".log"):
                    os.unlink(path + ".log")


def _accept(listener: socket.socket, children: dict[int, socket.socket]) -> None:
    """Fork a keeper for one connection from this uid, before anything of its request is read: the
    keeper reads it, so this process's memory, which every later child is forked from, never holds
    a job's request (its paths, its run id). A caller of another uid is answered why, not forked for."""
    connection, _ = listener.accept()
    try:
        _, uid, _ = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != os.getuid():
            raise PermissionError(f"uid {uid} may not start children here")
        pid = os.fork()
        if pid == 0:
            try:
                _keeper(connection)  # never returns
            finally:
                os._exit(1)  # nor, whatever happens, goes back to the zygote's loop
        children[pid] = connection
    except Exception as exc:  # noqa: BLE001 - a refused caller is answered and closed; the zygote goes on
        with contextlib.suppress(OSError):
            connection.send(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
        connection.close()


def _keeper(connection: socket.socket) -> None:
    """The forked keeper (workers/containment.py): reads its own request, forks the child contained
    (its own PID namespace, or a subreaper), answers the keeper's pid and the containment, and ends
    as the child ends; the zygote reports that end."""
    fds: list[int] = []
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in [int(name) for name in os.listdir("/proc/self/fd")]:  # the listener, other callers' sockets
            if fd not in (0, 1, 2, connection.fileno()):
                with contextlib.suppress(OSError):
                    os.close(fd)
        os.setsid()  # the parent's SIGTERM reaches the keeper alone, which ends the child's tree
        connection.settimeout(10)
        data, fds, _, _ = socket.recv_fds(connection, 1 << 20, 4)
        request = json.loads(data)
        if len(fds) != 4:
            raise ValueError(f"{len(fds)} descriptors sent, 4 needed")
    except Exception as exc:  # noqa: BLE001 - a request that is not one is answered why
        with contextlib.suppress(OSError):
            connection.send(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
        os._exit(1)

    def started(how: str) -> None:
        connection.send(json.dumps({"pid": os.getpid(), "containment": how}).encode())
        connection.close()

    containment.keep(lambda: _become(request, fds), lifeline_fd=fds[1], started=started, inherited=fds[:1] + fds[2:])


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is not None:
            with contextlib.suppress(OSError):
                connection.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
            connection.close()


def _become(request: dict[str, Any], fds: list[int]) -> None:
    """The forked child: a fresh child's session, descriptors, identity, directory, environment
    and import path, then workers.runtime.child's main."""
    code = 1
    try:
        os.setsid()
        connection_fd, lifeline_fd, out_fd, err_fd = fds
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        kept = {0, 1, 2, connection_fd, lifeline_fd}
        for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
            if fd not in kept:
                with contextlib.suppress(OSError):
                    os.close(fd)
        if request["uid"] is not None:
            os.setgroups([])
            os.setresgid(request["gid"], request["gid"], request["gid"])
            os.setresuid(request["uid"], request["uid"], request["uid"])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None
        extra = [entry for entry in request["env"].get("PYTHONPATH", "").split(os.pathsep) if entry]
        sys.path[:] = [request["cwd"], *extra, *sys.path[1:]]  # as `python -m` in cwd with PYTHONPATH has it
        import importlib

        importlib.invalidate_caches()
        from workers.runtime import child

        argv = [request["mode"], str(connection_fd), str(lifeline_fd), request["staging"]]
        sys.argv = [child.__file__, *argv]
        child.main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as an interpreter would: the traceback, then exit 1
        import traceback

        traceback.print_exc()
    finally:
        import atexit

        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Untrusted work in a child process: a built environment, the owner's uid, no secret, no Ray.

Everything a user's job runs is untrusted: its model's code, and the parsers that read its data.
The trusted side (a rank's Ray actor, a plan's or a submit's Ray task: zero1's code, connected to
Ray) starts such work as a child process of its own and talks to it over a socket pair:

- parent -> child: pickled messages (the parent is trusted, so the child may unpickle them);
- child -> parent: JSON only, bounded in size: the parent never unpickles what the child sends.

The child's environment is built from an allowlist (PATH, locale, thread and CUDA/NCCL settings),
never inherited whole; nothing named like a secret passes. With `run_as` it runs under that uid
and gid, with no supplementary groups. A lifeline pipe ends it when its parent goes, however the
parent dies (SIGKILL of a cancelled rank included). A child is forked from the node's zygote, torch
already loaded (workers/runtime/zygote.py), or started as a fresh interpreter where there is none;
either way under a keeper (workers/containment.py) that ends every process the child started when
it ends (its own PID namespace, or a subreaper). Its stdout and stderr are pipes the parent reads.
This room imports the standard library only, and workers.training.bundles when a child has a code
bundle to unpack.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from workers import containment
from workers.records import OOM_KILLED, RunAs
from workers.runtime import zygote
from workers.runtime.capture import ChildOutput, LoggedOutput

MAX_MESSAGE_BYTES = 64 << 20
"""The largest message a child may send; past it the child is treated as broken."""
PASSED_NAMES = frozenset(
    {
        "PATH",
        "LANG",
        "LANGUAGE",
        "TZ",
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "NVIDIA_VISIBLE_DEVICES",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "OPENBLAS_CORETYPE",
        "OPENBLAS_L2_SIZE",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONUNBUFFERED",
        "PYTHONHASHSEED",
        "HF_HUB_OFFLINE",
        "HF_DATASETS_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "TOKENIZERS_PARALLELISM",
        "LD_LIBRARY_PATH",
    }
)
"""Variables a child gets from its parent's environment, as they are."""
PASSED_PREFIXES = ("LC_", "NCCL_", "GLOO_", "TORCH_")
"""Families of variables a child gets too (locale, the collectives' tuning, torch's switches)."""
SECRET_NAME = re.compile(r"(^|_)(TOKEN|SECRET|PASSWORD|PASSWD|PASS|CREDENTIALS?|KEY|AUTH|DSN)(_|$)|DATABASE_URL")
"""A name that may hold a secret: never passed, whatever the lists above say."""
NEVER_PREFIXES = ("ZERO1_", "RAY_", "AWS_", "PG", "MLFLOW_")
"""Families that hold the service's settings and credentials: never passed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChildSpec:
    """Where and as whom a child runs."""

    home: str
    """Its HOME and the root of its TMPDIR: the job's own directory (or a scratch one of a task's)."""
    code_uri: str | None = None
    """The job's code bundle as stored (file://….zip, s3://….zip): this process unpacks it into a
    private directory given to the child, its working directory and PYTHONPATH, and no one else's
    import path (workers/training/bundles.py); None: the child works in home."""
    run_as: RunAs | None = None


class ChildExited(RuntimeError):
    """The child ended without answering: `rank 1 exited: killed by signal 9 (out of memory?)`."""


class ProtocolError(RuntimeError):
    """The child sent something that is not a message of the protocol."""


def is_secret_name(name: str) -> bool:
    return name.startswith(NEVER_PREFIXES) or SECRET_NAME.search(name.upper()) is not None


def child_environment(environ: Mapping[str, str], *, home: str, pythonpath: str | None) -> dict[str, str]:
    """The child's whole environment: the allowlisted variables of `environ` that are not named like
    a secret, then HOME, TMPDIR (home/tmp) and PYTHONPATH (the code bundle, where there is one)."""
    env = {
        name: value
        for name, value in environ.items()
        if (name in PASSED_NAMES or name.startswith(PASSED_PREFIXES)) and not is_secret_name(name)
    }
    env.setdefault("PATH", os.defpath)
    env |= {"HOME": home, "TMPDIR": os.path.join(home, "tmp"), "PYTHONNOUSERSITE": "1"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return env


def prepare_home(spec: ChildSpec) -> None:
    """The child's home and TMPDIR, made (mode 0700) and owned by its uid where it has one. Neither
    follows a link: a job's earlier children own the home and may have planted one."""
    for path in (spec.home, os.path.join(spec.home, "tmp")):
        os.makedirs(path, mode=0o700, exist_ok=True)
        _own(path, spec.run_as)
        os.chmod(path, 0o700, follow_symlinks=False)  # a link here is an error (Linux has no lchmod)


def stage_code(code_uri: str, run_as: RunAs | None) -> str:
    """The child's own copy of its code bundle (its working directory), unpacked by this process
    from the stored zip into a fresh directory that no child could have planted anything in, then
    given to the child's uid, the top last. Never a Ray working_dir: a bundle on this process's
    sys.path would run as this process's uid."""
    from workers.training.bundles import unpack_bundle  # the store's client, for a bundle on a bucket

    return unpack_bundle(code_uri, owner=None if run_as is None else (run_as.uid, run_as.gid))


def _own(path: str, run_as: RunAs | None) -> None:
    if run_as is not None:
        os.chown(path, run_as.uid, run_as.gid, follow_symlinks=False)


def exit_reason(returncode: int | None, *, oom_killed: bool = False) -> str:
    """How a process ended, in words: `exited with code 3`, `was killed by signal 9 (SIGKILL: out
    of memory?)` (the kernel's OOM killer sends SIGKILL); `oom_killed`: it was killing meanwhile."""
    if returncode is None:
        return "is still running"
    if returncode >= 0:
        return f"exited with code {returncode}"
    number = -returncode
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = "unknown"
    hint = (f": {OOM_KILLED}" if oom_killed else ": out of memory?") if number == signal.SIGKILL else ""
    return f"was killed by signal {number} ({name}{hint})"


def oom_kills() -> int | None:
    """Processes the kernel's OOM killer has killed on this machine (/proc/vmstat's oom_kill, Linux
    4.13+: a cgroup's memory limit counts too); None where it cannot be read."""
    with contextlib.suppress(OSError, ValueError), open("/proc/vmstat") as file:
        return next((int(line.split()[1]) for line in file if line.startswith("oom_kill ")), None)
    return None


class Child:
    """A running child: its process, the parent's end of the socket, and the lifeline's write end."""

    def __init__(
        self,
        mode: str,
        spec: ChildSpec,
        *,
        environ: Mapping[str, str] | None = None,
        on_output: Callable[[str, str], None] | None = None,
    ) -> None:
        """`on_output(stream, line)`: each line the child writes to its stdout or stderr (from a
        thread of this process's); by default logged here, each line after a prefix."""
        prepare_home(spec)
        self._oom_kills = oom_kills()  # a SIGKILL while this count grows is the OOM killer's
        code = self._staged = stage_code(spec.code_uri, spec.run_as) if spec.code_uri else None
        staging = os.path.dirname(os.path.dirname(code)) if code else "-"  # the child removes it if orphaned
        parent_end, child_end = socket.socketpair()
        lifeline_read, self._lifeline = os.pipe()
        cwd = code or spec.home
        env = child_environment(os.environ if environ is None else environ, home=spec.home, pythonpath=code)
        self.output = ChildOutput(on_output or LoggedOutput(logging.getLogger(__name__)))  # pipes this process reads
        try:
            command = [sys.executable, "-m", "workers.runtime.child", mode, str(child_end.fileno()), str(lifeline_read)]
            self.process = self._fork(command[3:] + [staging], env, cwd, spec.run_as)
            if self.process is None:  # a fresh interpreter, under a keeper of its own (workers/containment.py)
                identity = (spec.run_as.uid, spec.run_as.gid) if spec.run_as else None
                self.process = containment.start_fresh(
                    command + [staging], env=env, cwd=cwd, identity=identity, stdio=self.output.write_ends
                )
        finally:
            child_end.close()
            os.close(lifeline_read)
            self.output.started()
        self.containment = self.process.containment
        logging.getLogger(__name__).info("child %d (%s) runs in %s", self.process.pid, mode, self.containment)
        self.conn = Connection(parent_end.detach())

    def _fork(self, argv: list[str], env: dict[str, str], cwd: str, run_as: RunAs | None) -> Any:
        """The child forked from this node's zygote (torch already loaded: workers/runtime/zygote.py);
        None where there is no zygote to fork from, and the child starts as a fresh interpreter."""
        if os.environ.get("ZERO1_ZYGOTE", "on") == "off":
            return None
        out_fd, err_fd = self.output.write_ends
        try:
            return zygote.spawn(
                argv[0],
                argv[3],
                env=env,
                cwd=cwd,
                uid=run_as.uid if run_as else None,
                gid=run_as.gid if run_as else None,
                connection_fd=int(argv[1]),
                lifeline_fd=int(argv[2]),
                out_fd=out_fd,
                err_fd=err_fd,
            )
        except zygote.Unavailable as exc:
            logging.getLogger(__name__).warning("starting a child without the zygote: %s", exc)
            return None

    def send(self, message: Any) -> None:
        self.conn.send_bytes(pickle.dumps(message))

    def receive(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        """The child's next message; None when none came within timeout_s. ChildExited when the
        child has ended (its socket closed), ProtocolError for what is not a JSON object."""
        try:
            if timeout_s is not None and not self.conn.poll(timeout_s):
                return None
            data = self.conn.recv_bytes(MAX_MESSAGE_BYTES)
        except (EOFError, OSError):
            raise ChildExited(self.ended()) from None
        try:
            message = json.loads(data)
        except ValueError:
            message = None
        if not isinstance(message, dict):
            raise ProtocolError(f"the child sent {len(data)} bytes that are not a JSON object")
        return message

    def ended(self, timeout_s: float = 10.0) -> str:
        """How the child ended, waiting up to timeout_s for it to; killed when it does not end."""
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.process.wait()
        return exit_reason(code, oom_killed=self._oom_kills is not None and (oom_kills() or 0) > self._oom_kills)

    def kill(self) -> None:
        """End the child and every process it started: its keeper (workers/containment.py) kills
        them all, then itself, by SIGKILL."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # a zygote's child may end before it says so
                os.kill(self.process.pid, signal.SIGTERM)

    def dump_stacks(self) -> None:
        """Have the child write the stacks of all its threads to its stderr (its faulthandler's, even
        while a thread holds the GIL): SIGUSR1 to its keeper, which passes it on (workers/containment.py)."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGUSR1)

    def close(self) -> None:
        """Hang up: the child's lifeline breaks and it exits, if it has not, and all it started with it."""
        self.conn.close()
        if self._lifeline >= 0:
            os.close(self._lifeline)
            self._lifeline = -1
        self.kill()
        self.process.wait()
        self.output.close()
        if self._staged is not None:  # the bundle's copy: made by this process, removed without following links
            shutil.rmtree(os.path.dirname(os.path.dirname(self._staged)), ignore_errors=True)
            self._staged = None


def call_in_child(
    function: str,
    argument: Any,
    *,
    timeout_s: float,
    run_as: RunAs | None = None,
    bundle: str | None = None,
    keep: Callable[[str], None] | None = None,
) -> Any:
    """`function` ("module:name") applied to `argument` in a child with a scratch home and the code
    bundle stored at `bundle` (its URI) as its code: its JSON result. keep(home) takes what the
    parent keeps of the home once the child answered, before the home is removed. A bundle that
    cannot be unpacked raises workers.training.bundles.BundleError. The child's exception comes back as ChildError (an
    InvalidModelError's field kept); past timeout_s the child is killed and TimeoutError raised; a
    child that dies raises ChildExited."""
    import time

    home = tempfile.mkdtemp(prefix="zero1-task-")
    try:
        child = Child("call", ChildSpec(home=home, code_uri=bundle, run_as=run_as))
    except BaseException:
        shutil.rmtree(home, ignore_errors=True)
        raise
    try:
        child.send((function, argument))
        deadline = time.monotonic() + timeout_s
        while (message := child.receive(max(0.0, deadline - time.monotonic()))) is None:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the child ran past {timeout_s:g} s and was stopped")
        if "error" in message:
            raise ChildError.of(message["error"])
        child.close()  # it answered: nothing of it runs while its files are taken
        if keep is not None:
            keep(home)
        return message.get("result")
    finally:
        child.close()
        shutil.rmtree(home, ignore_errors=True)


def check_runnable(run_as: RunAs) -> None:
    """ValueError of one line, naming what to change, unless a child under `run_as` can start this
    Python, import zero1 (every directory on the way to the interpreter, the standard library and the
    installed code, links' targets included, must be searchable by that uid, the files readable) and
    reach the temporary directory, where its scratch home, its copy of a code bundle and the inputs
    staged for it are made (a child enters its working directory before it drops root, so a temporary
    directory it cannot search fails only on its first absolute path)."""
    scratch = tempfile.gettempdir()
    probe = "import os, sys, workers.runtime.child; sys.exit(0 if os.access(sys.argv[1], os.X_OK) else 3)"
    try:
        done = subprocess.run(
            [sys.executable, "-c", probe, scratch],
            user=run_as.uid,
            group=run_as.gid,
            extra_groups=[],
            cwd="/",
            env=child_environment(os.environ, home="/", pythonpath=None),
            capture_output=True,
            text=True,
            timeout=60,
        )
    except PermissionError:
        done = None
    if done is not None and done.returncode == 3:
        raise ValueError(
            f"ZERO1_RUN_AS: uid {run_as.uid} cannot reach the temporary directory {scratch}, where its children's "
            "scratch and staged inputs are made: it and every directory above it must be searchable by that "
            "uid (chmod o+x), or set TMPDIR to one that is"
        )
    if done is None or done.returncode != 0:
        said = " ".join((done.stderr.strip().splitlines() or [""])[-1].split()) if done is not None else ""
        fallback = f"cannot run {sys.executable}" if done is None else f"runs Python but cannot import zero1: {said}"
        raise ValueError(f"ZERO1_RUN_AS: uid {run_as.uid} {_what_blocks(run_as) or fallback}")


def _what_blocks(run_as: RunAs) -> str | None:
    """The first directory (or file) that stops `run_as` on its way to the interpreter, the standard
    library, zero1's code or the installed packages, and how to fix it; None where the modes allow all."""
    import sysconfig

    from workers.reach import blocked_at

    code = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above workers/
    readable = os.R_OK | os.X_OK
    wanted = [(sys.executable, os.X_OK), (os.path.dirname(os.__file__), readable), (code, readable)]
    for path, access in [*wanted, (sysconfig.get_paths()["purelib"], readable)]:
        if (why := blocked_at(path, uid=run_as.uid, gid=run_as.gid, access=access)) is not None:
            return f"{why}: make each directory on the way searchable by it (chmod o+x) or use a Python it can reach"
    return None


class ChildError(RuntimeError):
    """An exception raised in a child, as it reported it: its type's name, message, and the field
    of the request it names (an InvalidModelError's); the caller turns it into its own error."""

    def __init__(self, exception: str, message: str, field: str | None = None, value_error: bool = False) -> None:
        super().__init__(f"{exception}: {message}")
        self.exception = exception
        self.message = message
        self.field = field
        self.value_error = value_error

    def __reduce__(self):  # crosses Ray as its fields
        return (type(self), (self.exception, self.message, self.field, self.value_error))

    @classmethod
    def of(cls, error: Any) -> ChildError:
        if not isinstance(error, dict):
            raise ProtocolError("the child's error is not an object")
        field = error.get("field")
        return cls(
            str(error.get("exception", "Exception"))[:200],
            str(error.get("message", ""))[:2000],
            str(field)[:200] if field else None,
            error.get("value_error") is True,
        )

"""The zygote (workers/runtime/zygote.py): children forked with torch loaded are children as a fresh
interpreter would make them, under another uid for real (the tests run as root): the identity,
environment, descriptors, session and import path they were asked for and nothing of the zygote's;
their ends are reported as Popen reports them; only the zygote's own uid may ask it for a child; it
ends with the process it watches; and where it cannot be used, a child still starts, without it.

Packages: workers.runtime.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from workers.records import RunAs
from workers.runtime import zygote
from workers.runtime.sandbox import Child, ChildExited, ChildSpec, call_in_child, child_environment

from helpers import stored_bundle

NOBODY = RunAs(65534, 65534)

PROBE = """
import os, sys


def parent():
    # as /proc sees it: in a PID namespace of its own, getppid() is the namespace's init, pid 1
    return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[1])


def who(_):
    return {
        "ids": [os.getresuid(), os.getresgid(), os.getgroups()],
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
        "leads_session": os.getsid(0) == os.getpid(),
        "parent": open(f"/proc/{parent()}/cmdline").read().split("\\0")[:4],
        "torch_loaded_before_me": "torch" in sys.modules,
        "path0": sys.path[0],
        "tmp": __import__("tempfile").gettempdir(),
    }
"""


@pytest.fixture(scope="module")
def bundle(searchable, tmp_path_factory) -> str:
    """The stored probe bundle's URI: each child gets its own copy, unpacked by its parent."""
    return stored_bundle(tmp_path_factory.mktemp("zygote-bundle") / "probe.zip", {"probe.py": PROBE.encode()})


def test_a_forked_child_is_what_a_fresh_one_would_be_under_another_uid(bundle, monkeypatch):
    monkeypatch.setenv("ZERO1_API_TOKENS", "alice:not-for-children")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-for-children-either")
    seen = call_in_child("probe:who", None, timeout_s=120, run_as=NOBODY, bundle=bundle)
    assert seen["ids"] == [[65534] * 3, [65534] * 3, []]
    assert seen["parent"][1:3] == ["-m", "workers.runtime.zygote"]  # forked, not a fresh interpreter
    assert seen["torch_loaded_before_me"] is True
    assert seen["leads_session"] is True
    code = seen["cwd"]
    assert code.endswith("/working_dir_files/code") and seen["path0"] == code and seen["env"]["PYTHONPATH"] == code
    home = seen["env"]["HOME"]
    assert Path(home).name.startswith("zero1-task-") and seen["tmp"] == os.path.join(home, "tmp")
    assert not any(name.startswith(("ZERO1_", "AWS_")) for name in seen["env"])
    assert "not-for-children" not in json.dumps(seen["env"])
    # stdin, stdout, stderr, its socket and lifeline, and the descriptor listing /proc/self/fd: no other
    assert len(seen["fds"]) == 6 and seen["fds"][:3] == [0, 1, 2], seen["fds"]


def test_with_the_zygote_off_a_fresh_interpreter_sees_the_same_but_its_parent(bundle, monkeypatch):
    forked = call_in_child("probe:who", None, timeout_s=120, run_as=NOBODY, bundle=bundle)
    monkeypatch.setenv("ZERO1_ZYGOTE", "off")  # as a node's environment turns it off
    fresh = call_in_child("probe:who", None, timeout_s=120, run_as=NOBODY, bundle=bundle)
    assert fresh["parent"][1:3] != ["-m", "workers.runtime.zygote"]
    assert fresh["torch_loaded_before_me"] is False
    for seen in (forked, fresh):
        home = seen["env"]["HOME"]
        code = seen["cwd"]
        for key in ("cwd", "path0", "tmp"):  # made per call: compare their shape
            seen[key] = seen[key].replace(code, "CODE").replace(home, "HOME")
        seen["env"] = {k: v.replace(home, "HOME") for k, v in seen["env"].items() if k != "PYTHONPATH"}
        del seen["parent"], seen["torch_loaded_before_me"]
        seen["fds"] = len(seen["fds"])
    assert forked == fresh


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("os._exit(3)", "exited with code 3"),
        ("os.kill(os.getpid(), 9)", "was killed by signal 9 (SIGKILL: out of memory?)"),
        ("raise SystemExit('bye')", "exited with code 1"),
    ],
)
def test_how_a_forked_child_ended_is_reported_as_popen_reports_it(bundle, tmp_path, body, expected):
    module = stored_bundle(tmp_path / "ends.zip", {"ends.py": f"import os\n\n\ndef now(_):\n    {body}\n".encode()})
    with pytest.raises(ChildExited) as ended:
        call_in_child("ends:now", None, timeout_s=120, run_as=NOBODY, bundle=module)
    assert str(ended.value) == expected


def test_a_child_killed_by_its_parent_is_reported_killed_and_its_session_gone(bundle, tmp_path):
    home = tmp_path / "home"
    child = Child("call", ChildSpec(home=str(home), code_uri=bundle, run_as=NOBODY))
    try:
        assert isinstance(child.process, zygote.ZygoteProcess)
        assert child.process.poll() is None
        child.kill()
        assert child.ended(timeout_s=30) == "was killed by signal 9 (SIGKILL: out of memory?)"
        with pytest.raises(ProcessLookupError):
            os.killpg(child.process.pid, 0)
    finally:
        child.close()


def _own_zygote(bundle: str) -> Path:
    """This process's zygote's socket, the zygote started if it was not."""
    call_in_child("probe:who", None, timeout_s=120, bundle=bundle)
    env = child_environment(os.environ, home="/", pythonpath=None)
    path, _ = zygote._socket_path({name: value for name, value in env.items() if name not in zygote.PER_CHILD})
    assert Path(path).is_socket()
    return Path(path)


def test_only_the_zygotes_own_uid_may_ask_it_for_a_child(bundle):
    target = _own_zygote(bundle)
    directory = target.parent
    assert directory.stat().st_mode & 0o777 == 0o700 and target.stat().st_mode & 0o777 == 0o600
    knock = textwrap.dedent(
        """
        import json, socket, sys
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            s.connect(sys.argv[1])
        except OSError as exc:
            print(json.dumps({"refused": type(exc).__name__})); raise SystemExit
        print(s.recv(4096).decode() or "{}")
        """
    )

    def as_nobody() -> dict:
        done = subprocess.run(
            [sys.executable, "-c", knock, str(target)], user=65534, group=65534, extra_groups=[], cwd="/",
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        return json.loads(done.stdout)

    assert as_nobody() == {"refused": "PermissionError"}  # the directory is the service's alone
    directory.chmod(0o711)
    target.chmod(0o666)
    try:  # even where the socket can be reached, the zygote asks the kernel who is calling
        assert as_nobody() == {"error": "PermissionError: uid 65534 may not start children here"}
    finally:
        target.chmod(0o600)
        directory.chmod(0o700)


def test_the_zygote_ends_with_the_process_it_watches(bundle, tmp_path):
    """The script (it watches itself: a zygote of its own) names its zygote, and ends when told; the
    zygote's pidfd, opened while both live, then says it ended too (30 s: a bound on a failure)."""
    script = tmp_path / "user.py"
    script.write_text(
        "import os, sys\n"
        "from pathlib import Path\n"
        "from workers.runtime.sandbox import call_in_child\n"
        f"print(call_in_child('probe:who', None, timeout_s=120, bundle={bundle!r})['parent'][2])\n"
        "for pid in (int(entry.name) for entry in Path('/proc').iterdir() if entry.name.isdigit()):\n"
        "    try:\n"
        "        argv = Path(f'/proc/{pid}/cmdline').read_bytes().split(b'\\0')\n"
        "    except OSError:\n"
        "        continue\n"
        "    if argv[1:3] == [b'-m', b'workers.runtime.zygote'] and argv[4:5] == [str(os.getpid()).encode()]:\n"
        "        print(pid, flush=True)  # the zygote watching this process\n"
        "sys.stdin.readline()\n"
    )
    user = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert user.stdout.readline().strip() == "workers.runtime.zygote"
        zygote_pid = int(user.stdout.readline())
        pidfd = os.pidfd_open(zygote_pid)
    finally:
        user.stdin.close()  # the script ends
    try:
        assert user.wait(timeout=120) == 0
        assert select.select([pidfd], [], [], 30)[0] == [pidfd], "the zygote outlived the process it watched"
    finally:
        os.close(pidfd)


def test_where_no_zygote_can_be_used_a_child_starts_without_it(bundle, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    shared = tmp_path / f"zero1-zygote-{os.getuid()}"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # not the service's alone: never trusted with a socket
    with caplog.at_level(logging.WARNING, logger="workers.runtime.sandbox"):
        seen = call_in_child("probe:who", None, timeout_s=120, bundle=bundle)
    assert seen["parent"][1:3] != ["-m", "workers.runtime.zygote"]
    assert "starting a child without the zygote" in caplog.text and "is not a directory of uid 0's alone" in caplog.text
    assert list(shared.iterdir()) == []


def test_a_zygote_that_cannot_load_torch_says_why_and_the_child_starts_without_it(bundle, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    broken = tmp_path / "site"
    broken.mkdir()
    monkeypatch.setattr(zygote, "_start", _start_with(broken))
    with pytest.raises(zygote.Unavailable, match="did not start at .*: ImportError: this torch is broken on purpose"):
        zygote.spawn(
            "call", "-", env={}, cwd="/", uid=None, gid=None, connection_fd=0, lifeline_fd=0, out_fd=1, err_fd=2
        )


def _start_with(site: Path):
    """zygote._start, with a `torch` on the path that fails to import."""
    (site / "torch.py").write_text("raise ImportError('this torch is broken on purpose')\n")
    original = zygote._start

    def start(path, watched, base_env):
        return original(path, watched, {**base_env, "PYTHONPATH": str(site)})

    return start


def test_a_request_the_zygote_cannot_read_is_answered_and_it_goes_on(bundle):
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as connection:
        connection.connect(str(_own_zygote(bundle)))
        connection.send(b"not json")
        assert json.loads(connection.recv(4096))["error"].startswith("JSONDecodeError")
    assert call_in_child("probe:who", None, timeout_s=120, bundle=bundle)["parent"][2] == "workers.runtime.zygote"


def test_a_zygote_killed_under_its_children_loses_only_their_exit_status_and_is_replaced(bundle, tmp_path):
    child = Child("call", ChildSpec(home=str(tmp_path / "home"), code_uri=bundle, run_as=NOBODY))
    try:
        assert isinstance(child.process, zygote.ZygoteProcess)
        zygote_pid = int(Path(f"/proc/{child.process.pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        pidfd = os.pidfd_open(zygote_pid)
        try:
            os.kill(zygote_pid, 9)
            assert select.select([pidfd], [], [], 30)[0] == [pidfd]  # the zygote has ended: its socket is closed
        finally:
            os.close(pidfd)
        assert child.process.poll() is None  # the zygote's end read: the child is init's now
        with pytest.raises(subprocess.TimeoutExpired):  # the child waits for its work: still running
            child.process.wait(timeout=0.5)
        assert child.process.poll() is None
        child.kill()
        assert child.ended(timeout_s=30) == f"exited with code {zygote.LOST}"
    finally:
        child.close()
    # the next child starts a new zygote over the dead one's socket
    assert call_in_child("probe:who", None, timeout_s=120, bundle=bundle)["parent"][2] == "workers.runtime.zygote"

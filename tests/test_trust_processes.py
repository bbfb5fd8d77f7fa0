"""Issue 40's processes (findings 4, 5 and 11's stdout), attacked as a job's code would: a child
scans its own memory for another job's paths and run id (the zygote forks before it reads a
request); a forward() double-forks and setsids a daemon that must not outlive its job (each child
in its own PID namespace, or under a subreaper keeper where unshare is refused); a child's stdout
and stderr are pipes its parent reads, never Ray's worker log files, whose path it would learn and
whose `:actor_name:` markers Ray parses. The tests run as root, so the uids switch for real; the
last ones run a real `zero1 serve` with ZERO1_RUN_AS.

Packages: workers.containment, workers.runtime.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers import containment
from workers.records import RunAs
from workers.runtime.rank_parent import PipedLines, RankProcess
from workers.runtime.sandbox import Child, ChildSpec, call_in_child

from helpers import job_body, wait_for
from marks import starts
from served import ALICE, Served, running

TRAPS = '''
import ctypes
import os
import re
import sys
import time


def scan(pattern):
    """Every match of `pattern` in this process's own memory: its heap and anonymous mappings."""
    ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: its /proc/self/mem is its own again after setuid
    regex, found = re.compile(pattern.encode()), set()
    with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", 0) as mem:
        for line in maps:
            fields = line.split()
            if "r" not in fields[1] or (len(fields) > 5 and fields[5] not in ("[heap]", "[stack]")):
                continue
            start, end = (int(part, 16) for part in fields[0].split("-"))
            for at in range(start, end, 1 << 24):
                try:
                    mem.seek(max(start, at - 512))
                    chunk = mem.read(min(end, at + (1 << 24)) - max(start, at - 512))
                except OSError:
                    break
                found.update(match.decode() for match in regex.findall(chunk))
    return sorted(found)


def daemon(where):
    """A daemon that leaves: double fork, setsid, every descriptor closed, then a sleeper whose
    command line holds the token (how the node finds it); returns once the sleeper has started."""
    reports, token = where
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.closerange(0, 1 << 16)
            sleeper = "import sys, time\\nopen(sys.argv[1], 'w').close()\\nwhile True: time.sleep(1)"
            os.execv(sys.executable, [sys.executable, "-c", sleeper, os.path.join(reports, "daemon-" + token)])
        os._exit(0)
    os.wait()
    while not os.path.exists(os.path.join(reports, "daemon-" + token)):
        time.sleep(0.01)
    return "left a daemon"


def outputs(text):
    """What this process's stdout and stderr are, after a line on each."""
    print(text, flush=True)
    print(text + " on stderr", file=sys.stderr, flush=True)
    return [os.readlink(f"/proc/self/fd/{fd}") for fd in (1, 2)]
'''


def stored_bundle(path: Path, files: dict[str, str]) -> str:
    """A code bundle as the service stores it (a zip, every entry under bundle/): its file:// URI."""
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(f"bundle/{name}", text)
    path.chmod(0o644)
    return path.as_uri()


@pytest.fixture(scope="module")
def traps(searchable) -> Iterator[str]:
    directory = Path(tempfile.mkdtemp(prefix="zero1-traps-"))
    directory.chmod(0o755)
    try:
        yield stored_bundle(directory / "traps.zip", {"traps.py": TRAPS})
    finally:
        subprocess.run(["rm", "-rf", str(directory)], check=False)


def _daemons(token: str) -> list[int]:
    """The node's running processes whose command line holds `token` (as the node's /proc sees them)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            running = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
            if entry.name.isdigit() and running and token.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _wait_gone(reports: Path, token: str) -> None:
    assert (reports / f"daemon-{token}").exists()  # it started
    wait_for(lambda: _daemons(token), lambda running: running == [], what="the daemon to end", timeout_s=5)


# --------------------------------------------------------------------------- finding 4: the zygote's memory


def test_a_child_finds_nothing_of_another_jobs_request_in_its_memory(traps, monkeypatch):
    monkeypatch.delenv("ZERO1_ZYGOTE", raising=False)
    run_id = secrets.token_hex(16)
    victim_home = Path(tempfile.mkdtemp(prefix="zero1-jobs-")) / f"job-7-victim-{run_id}"
    victim = Child("call", ChildSpec(home=str(victim_home), code_uri=traps, run_as=RunAs(2001, 2001)))
    try:
        victim_staging = Path(victim._staged).parents[1].name  # zero1-code-XXXXXXXX: its bundle's copy
        pattern = r"victim-[0-9a-f]{32}|zero1-code-[a-z0-9_]{8}"  # nothing of the victim's but its shape
        found = call_in_child("traps:scan", pattern, timeout_s=120, run_as=RunAs(2002, 2002), bundle=traps)
    finally:
        victim.close()
        subprocess.run(["rm", "-rf", str(victim_home.parent)], check=False)
    assert victim.containment == containment.NAMESPACE
    assert f"victim-{run_id}" not in found
    assert victim_staging not in found, found
    assert any(name.startswith("zero1-code-") for name in found)  # the scan sees its own request's paths


# --------------------------------------------------------------------------- finding 5: a daemon outlives its job


@pytest.mark.parametrize("zygote", ["on", "off"])
def test_a_double_forked_daemon_ends_with_its_child(traps, reports, monkeypatch, zygote):
    monkeypatch.setenv("ZERO1_ZYGOTE", zygote)
    token = secrets.token_hex(16)
    said = call_in_child("traps:daemon", [str(reports), token], timeout_s=120, run_as=RunAs(2001, 2001), bundle=traps)
    assert said == "left a daemon"
    _wait_gone(reports, token)


KEEPER_AS_NOBODY = """
import json, sys
from workers.runtime.sandbox import Child, ChildSpec

child = Child("call", ChildSpec(home=sys.argv[1], code_uri=sys.argv[2]))
child.send(("traps:daemon", sys.argv[3:5]))
answer = child.receive(120)
child.close()
print(json.dumps({"answer": answer, "containment": child.containment}))
"""


@pytest.mark.parametrize("zygote", ["on", "off"])
def test_where_no_pid_namespace_may_be_made_the_subreaper_ends_the_daemon(traps, reports, zygote):
    # a service that is not root (no ZERO1_RUN_AS) may not unshare: its keeper is a subreaper instead
    home = Path(tempfile.mkdtemp(prefix="zero1-nobody-"))
    token = secrets.token_hex(16)
    os.chown(home, 65534, 65534)
    env = {**os.environ, "ZERO1_ZYGOTE": zygote, "TMPDIR": str(home)}
    done = subprocess.run(
        [sys.executable, "-c", KEEPER_AS_NOBODY, str(home / "child"), traps, str(reports), token],
        user=65534, group=65534, extra_groups=[], cwd="/", env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    subprocess.run(["rm", "-rf", str(home)], check=False)
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout.splitlines()[-1])
    assert said["answer"] == {"result": "left a daemon"}
    assert said["containment"].startswith("a subreaper"), said["containment"]
    _wait_gone(reports, token)


PARENT_KILLED = """
import json, os, sys
from workers.runtime.sandbox import Child, ChildSpec
from workers.records import RunAs

child = Child("call", ChildSpec(home=sys.argv[1], code_uri=sys.argv[2], run_as=RunAs(2001, 2001)))
child.send(("traps:daemon", sys.argv[3:5]))
print(json.dumps(child.receive(120)), flush=True)
os.kill(os.getpid(), 9)  # as a cancelled rank's actor is killed: no close, no kill of its child
"""


@pytest.mark.parametrize("zygote", ["on", "off"])
def test_a_daemon_ends_when_its_childs_parent_is_killed(traps, reports, zygote):
    home = Path(tempfile.mkdtemp(prefix="zero1-killed-"))
    token = secrets.token_hex(16)
    env = {**os.environ, "ZERO1_ZYGOTE": zygote}
    argv = [sys.executable, "-c", PARENT_KILLED, str(home / "child"), traps, str(reports), token]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)
    subprocess.run(["rm", "-rf", str(home)], check=False)
    assert done.returncode == -9 and json.loads(done.stdout) == {"result": "left a daemon"}, done.stderr
    _wait_gone(reports, token)


# --------------------------------------------------------------------------- finding 11: stdout and stderr


@pytest.mark.parametrize("zygote", ["on", "off"])
def test_a_childs_stdout_and_stderr_are_pipes_its_parent_reads(traps, monkeypatch, zygote):
    monkeypatch.setenv("ZERO1_ZYGOTE", zygote)
    home = Path(tempfile.mkdtemp(prefix="zero1-pipes-"))
    lines: list[tuple[str, str]] = []
    child = Child(
        "call",
        ChildSpec(home=str(home), code_uri=traps, run_as=RunAs(2001, 2001)),
        on_output=lambda *line: lines.append(line),
    )
    try:
        child.send(("traps:outputs", ":actor_name:Imitated"))
        answer = child.receive(120)
    finally:
        child.close()
        subprocess.run(["rm", "-rf", str(home)], check=False)
    assert [target.startswith("pipe:[") for target in answer["result"]] == [True, True], answer
    assert ("stdout", ":actor_name:Imitated") in lines and ("stderr", ":actor_name:Imitated on stderr") in lines


def test_what_a_child_floods_its_pipes_with_is_bounded_in_its_parent_and_the_drop_marked(monkeypatch):
    monkeypatch.setattr(PipedLines, "MAX_BYTES", 100)
    process = RankProcess.__new__(RankProcess)  # the parent's side alone: no child started
    process.rank = 1
    process._piped = PipedLines()
    process._count = 5  # 5 lines handed on before
    for i in range(50):
        process._piped("stdout", f"line {i:03}")
    sent: list = []
    process._hand_on_piped(sent.extend)
    marker = sent[0]
    kept = sent[1:]
    assert (marker.stream, marker.dropped[0]) == ("marker", 50 - len(kept)) and 0 < len(kept) < 50
    assert [line.n for line in sent] == list(range(5, 5 + len(sent)))  # numbered by the parent, in order
    assert [line.line for line in kept] == [f"line {i:03}" for i in range(50 - len(kept), 50)]


# --------------------------------------------------------------------------- a real zero1 serve with ZERO1_RUN_AS


TRAP_MODEL = """
import json
import os
import sys

import torch
from torch import nn

import traps


class Trap(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args, self.sprung = args, False
        self.embed = nn.Embedding(64, 16)
        self.head = nn.Linear(16, 64)

    def forward(self, input_ids, labels):
        if not self.sprung and not isinstance(input_ids, torch._subclasses.FakeTensor):
            self.sprung = True
            rank = torch.distributed.get_rank()
            seen = traps.outputs(f":actor_name:Imitated {self.args['token']} rank {rank}")
            with open(os.path.join(self.args["reports"], f"outputs-{rank}.json"), "w") as out:
                json.dump(seen, out)
            if rank == 0:
                traps.daemon([self.args["reports"], self.args["token"]])
        logits = self.head(self.embed(input_ids))
        return nn.functional.cross_entropy(logits.reshape(-1, 64), labels.reshape(-1))


def build(**args):
    return Trap(args)
"""


@pytest.fixture(scope="module")
@starts("ray", "slow")
def served(searchable) -> Iterator[Served]:
    with running("zero1-trust-processes-", ZERO1_RUN_AS="alice=2001:2001,bob=2002:2002,*=30000-30009") as service:
        yield service


def _ray_logs(served: Served) -> list[Path]:
    (session,) = Path(os.environ["RAY_TMPDIR"]).glob(f"**/session_*_{served.process.pid}")
    return [path for path in (session / "logs").rglob("*") if path.is_file()]


def test_a_jobs_daemon_ends_with_it_and_its_output_reaches_its_log_not_rays(served, reports, tmp_path):
    bundle = tmp_path / "trap"
    bundle.mkdir()
    (bundle / "trap.py").write_text(TRAP_MODEL)
    (bundle / "traps.py").write_text(TRAPS)
    code = served.upload(bundle, ALICE)
    token = secrets.token_hex(16)
    model = {"kind": "python", "entrypoint": "trap:build", "args": {"reports": str(reports), "token": token}}
    body = job_body(name="trap", model=model, seq_len=8) | {"data": {"kind": "synthetic"}, "code": code, "steps": 3}
    r = served.request("POST", "/v1/jobs", ALICE, json=body)
    assert r.status_code == 201, r.text
    job = served.wait(r.json()["id"], ALICE)
    assert job["status"] == "succeeded", job["error"]
    _wait_gone(reports, token)

    for rank in (0, 1):  # its stdout and stderr: pipes, not the files of Ray's session it would learn
        seen = json.loads((reports / f"outputs-{rank}.json").read_text())
        assert [target.startswith("pipe:[") for target in seen] == [True, True], seen
    logs = wait_for(
        lambda: served.request("GET", f"/v1/jobs/{job['id']}/logs", ALICE).json()["data"],
        lambda lines: sum(token in line["line"] for line in lines) == 4,
        what="the imitated markers in the job's log",
    )
    imitated = sorted((line["rank"], line["stream"], line["line"]) for line in logs if token in line["line"])
    assert imitated == [
        (rank, stream, f":actor_name:Imitated {token} rank {rank}{suffix}")
        for rank in (0, 1)
        for stream, suffix in (("stderr", " on stderr"), ("stdout", ""))
    ]
    assert not [path for path in _ray_logs(served) if token.encode() in path.read_bytes()]
    said = [line["line"] for line in logs if line["stream"] == "log" and "child runs in" in line["line"]]
    assert sorted(said) == [f"INFO zero1: rank {rank}'s child runs in {containment.NAMESPACE}" for rank in (0, 1)], said

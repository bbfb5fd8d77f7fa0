"""Hang detection (a job's health.hang_factor and hang_min_s): the pure decision (workers/phases.py: the
limit from the median of the completed steps, hang_min_s before the first, the clock restarted by work
that is not a step, the grace of a rank waiting in a collective); a rank's parent finding its child hung,
its stacks in the log, the child killed and a HangError that names the rank, the step and the phase;
the stacks of a real child asked for through its keeper, as another uid, in a PID namespace or under
a subreaper; and a python job whose forward() blocks at step 3 on its first attempt only, retried from
its checkpoint to success through the API.

Packages: workers.phases, workers.records, workers.containment, workers.runtime, service.scheduling.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import pytest

from workers import containment, phases
from workers.config import HealthConfig
from workers.records import MetricRow, RankError, RunAs, root_cause
from workers.runtime.rank_parent import MetricsSink, PipedLines, RankFailed, RankProcess
from workers.runtime.sandbox import Child, ChildSpec

from helpers import TERMINAL, wait_for, wait_job, zip_of

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- the decision


def test_the_limit_is_hang_factor_times_the_median_step_and_at_least_hang_min_s():
    assert phases.limit_s([], hang_factor=20, hang_min_s=7) == 7  # no step completed: hang_min_s alone
    assert phases.limit_s([0.5, 0.5, 0.5], hang_factor=20, hang_min_s=7) == 10
    assert phases.limit_s([0.1, 0.1, 0.1], hang_factor=20, hang_min_s=7) == 7
    # the median: a slow first step (compilation, warm-up) does not raise it once steps settle
    assert phases.limit_s([30.0, 0.5, 0.5], hang_factor=20, hang_min_s=1) == 10
    assert phases.limit_s([30.0], hang_factor=20, hang_min_s=1) == 600


def test_before_its_first_step_a_rank_is_given_hang_min_s_and_its_first_step_as_long_again():
    watch = phases.HangWatch(hang_factor=20, hang_min_s=5, now=0.0)
    assert watch.hung(5.0) is None
    assert watch.hung(5.5) == phases.Hang(step=-1, phase="setup", waited_s=5.5, limit_s=5, median_s=None)
    watch.at(step=0, phase="data", now=4.0)  # set up in 4 s: leaving setup is progress
    watch.at(step=0, phase="forward", now=4.1)  # a step's own phases are not
    assert watch.hung(9.0) is None
    hang = watch.hung(9.5)
    assert (hang.step, hang.phase, hang.median_s) == (0, "forward", None)
    assert hang.message(1) == "rank 1 hung at step 0 for 5.5 s (no step completed yet, limit 5.0 s) in forward"


def test_after_steps_the_median_sets_the_limit_and_each_row_restarts_the_clock():
    watch = phases.HangWatch(hang_factor=20, hang_min_s=1, now=0.0)
    for step in range(5):
        watch.stepped(step=step, step_time_s=0.5, now=1.0 + step * 0.5)
    assert (watch.step, watch.phase) == (5, phases.BETWEEN_STEPS)  # until the child says where it is
    watch.at(step=5, phase="all_gather", now=3.2)
    watch.at(step=5, phase="forward", now=3.3)  # stale reports in a step's own phases change nothing
    assert watch.hung(3.0 + 10.0) is None
    hang = watch.hung(3.0 + 10.1)
    assert hang.message(0) == "rank 0 hung at step 5 for 10.1 s (median step 0.5 s, limit 10.0 s) in forward"


def test_evaluating_and_checkpointing_restart_the_clock_entering_and_leaving():
    watch = phases.HangWatch(hang_factor=2, hang_min_s=1, now=0.0)
    watch.stepped(step=0, step_time_s=1.0, now=1.0)
    watch.at(step=1, phase="forward", now=1.1)
    watch.at(step=1, phase="eval", now=2.5)  # the step took 1.5 s of its 2: the eval starts afresh
    assert watch.hung(2.5 + 2.0) is None
    watch.at(step=1, phase="checkpoint", now=4.4)  # one phase outside the steps to another: afresh again
    assert watch.hung(4.4 + 2.0) is None
    assert watch.hung(4.4 + 2.1).phase == "checkpoint"
    watch.at(step=2, phase="data", now=6.0)  # and leaving it
    assert watch.hung(8.0) is None and watch.hung(8.1).step == 2


def test_a_rank_waiting_in_a_collective_is_given_the_peer_grace_and_a_request_served_restarts_the_clock():
    watch = phases.HangWatch(hang_factor=20, hang_min_s=10, now=0.0)
    watch.at(step=0, phase="reduce_scatter", now=0.0)
    assert watch.hung(10.0 + phases.PEER_GRACE_S) is None
    assert watch.hung(10.1 + phases.PEER_GRACE_S).limit_s == 10 + phases.PEER_GRACE_S
    watch.served(now=12.0)  # the parent answered the child ("stop?", a checkpoint read): its wait was ours
    assert watch.hung(12.0 + 10 + phases.PEER_GRACE_S) is None


def test_the_median_is_of_the_last_steps_and_a_row_without_a_time_leaves_it():
    watch = phases.HangWatch(hang_factor=10, hang_min_s=0.1, now=0.0)
    for step in range(phases.MEDIAN_STEPS):
        watch.stepped(step=step, step_time_s=5.0, now=0.0)
    for step in range(phases.MEDIAN_STEPS, phases.MEDIAN_STEPS + 49):
        watch.stepped(step=step, step_time_s=1.0, now=0.0)
    watch.stepped(step=500, step_time_s=float("nan"), now=0.0)  # no time: the window stays
    assert watch.hung(50.1).median_s == 5.0  # the last 99: 50 at 5 s, 49 at 1 s
    watch.stepped(step=501, step_time_s=1.0, now=0.0)
    assert watch.hung(10.1).median_s == 1.0


def test_a_phase_as_a_child_says_it_is_made_fit_for_an_event():
    assert phases.phase_name("all_gather") == "all_gather"
    assert phases.phase_name("x\n" * 30) == "x_" * 20
    assert phases.phase_name("") == "unknown" and phases.phase_name(None) == "None"


def test_the_marker_is_the_step_and_the_phase_the_rank_entered_last():
    phases.begin_step(7)
    assert phases.current() == (7, "data")
    phases.enter("backward")
    assert phases.current() == (7, "backward")


def test_a_hang_in_a_collective_gives_way_to_the_rank_it_waited_for():
    def hang(rank: int, phase: str) -> RankError:
        message = f"rank {rank} hung at step 3 for 9.0 s (median step 0.1 s, limit 8.0 s) in {phase}"
        return RankError(exception="HangError", message=message, rank=rank)

    peer_lost = RankError(
        exception="RuntimeError", message="[../gloo/transport/tcp/pair.cc:534] Connection closed by peer"
    )
    waiting = hang(0, "all_gather")
    stuck = hang(1, "forward")
    assert waiting.is_peer_wait and not stuck.is_peer_wait and not waiting.is_peer_loss
    assert root_cause([waiting, peer_lost, stuck]) == stuck
    assert root_cause([peer_lost, waiting]) == waiting  # a hang in a collective before a peer's loss
    assert root_cause([waiting, hang(1, "barrier")]) == waiting  # nothing else: the first
    assert root_cause([peer_lost]) == peer_lost


FAULTHANDLER_DUMP = """Thread 0x00007f57a01ff6c0 (most recent call first):
  File "/code/workers/runtime/rank_child.py", line 150 in _report_phases
  File "/usr/lib/python3.11/threading.py", line 982 in run

Current thread 0x00007f57bee89b80 (most recent call first):
  File "/tmp/job/working_dir_files/ab12/tinylm/model.py", line 88 in forward
  File "/code/workers/training/loop.py", line 320 in forward
  File "/code/workers/runtime/rank_child.py", line 60 in run_rank
  File "/code/workers/runtime/child.py", line 70 in main""".splitlines()


def test_the_training_threads_stack_is_read_out_of_the_dump_most_recent_call_last():
    stack = phases.training_stack(FAULTHANDLER_DUMP)
    assert stack == [
        '  File "/code/workers/runtime/child.py", line 70 in main',
        '  File "/code/workers/runtime/rank_child.py", line 60 in run_rank',
        '  File "/code/workers/training/loop.py", line 320 in forward',
        '  File "/tmp/job/working_dir_files/ab12/tinylm/model.py", line 88 in forward',
    ]
    assert RankError.tidy_traceback(stack)[-1] == '  File "tinylm/model.py", line 88 in forward'
    assert phases.training_stack(FAULTHANDLER_DUMP[:3]) == []  # no training thread: no stack


# --------------------------------------------------------------------------- the parent's watchdog


class _HangingChild:
    """Stands in for a rank's child: says its messages, then nothing; asked for its stacks, writes the dump."""

    def __init__(self, process: RankProcess, *messages: dict) -> None:
        self.process = process
        self.messages = list(messages)
        self.sent: list = []
        self.what: list[str] = []
        self.output = types.SimpleNamespace(drain=lambda: None)

    def receive(self, timeout_s: float) -> dict | None:
        if self.messages:
            return self.messages.pop(0)
        time.sleep(min(timeout_s, 0.02))
        return None

    def send(self, message: dict) -> None:
        self.sent.append(message)

    def dump_stacks(self) -> None:
        self.what.append("dump")
        for line in FAULTHANDLER_DUMP:  # as the child's faulthandler writes to its stderr
            self.process._piped("stderr", line)

    def kill(self) -> None:
        self.what.append("kill")


def _row(step: int, step_time_s: float) -> dict:
    row = MetricRow(
        step=step,
        loss=1.0,
        grad_norm=1.0,
        loss_scale=1.0,
        skipped=False,
        step_time_s=step_time_s,
        tokens_per_s=1.0,
        mem_peak_bytes=(0,),
        mem_planned_bytes=0,
    )
    return {"t": "row", "row": row.to_json()}


def _relay(*messages: dict, health: HealthConfig, logs: list | None = None) -> _HangingChild:
    process = RankProcess.__new__(RankProcess)  # the parent's side alone: no child started
    process.rank = 1
    process.world_size = 2
    process._piped = PipedLines()
    process._count = 0
    process.child = child = _HangingChild(process, *messages)
    process.run(
        {"config": types.SimpleNamespace(health=health)},
        sink=MetricsSink(send=lambda rows: None, flush=lambda rows: None),
        send_logs=(logs if logs is not None else []).extend,
        stop_requested=lambda step, checkpointed: False,
        parent_gone=lambda: False,
    )
    return child


def test_a_hung_child_has_its_stacks_logged_then_is_killed_and_the_attempt_fails_naming_rank_step_and_phase():
    health = HealthConfig(hang_factor=20, hang_min_s=0.3)
    logs: list = []
    child = None
    with pytest.raises(RankFailed) as failed:
        rows = [_row(step, 0.001) for step in range(3)]
        child = _relay(*rows, {"t": "at", "step": 3, "phase": "forward"}, health=health, logs=logs)
    assert child is None  # it raised
    error = failed.value.rank_error
    assert error.exception == "HangError"
    assert error.message.startswith("rank 1 hung at step 3 for ")
    assert error.message.endswith(" s (median step 0.001 s, limit 0.3 s) in forward"), error.message
    assert error.traceback[0] == '  File "/code/workers/runtime/child.py", line 70 in main'
    assert error.traceback[-1] == '  File "tinylm/model.py", line 88 in forward'
    # the log: what the parent says, then the stacks as the child wrote them, in that order
    lines = [(line.stream, line.line) for line in logs]
    assert lines[0] == ("log", f"WARNING zero1: {error.message}: the stacks of its threads follow (faulthandler)")
    assert lines[1:] == [("stderr", line) for line in FAULTHANDLER_DUMP]
    assert [line.n for line in logs] == list(range(len(logs)))


def test_the_stacks_are_asked_for_before_the_child_is_killed():
    health = HealthConfig(hang_factor=20, hang_min_s=0.1)
    process = RankProcess.__new__(RankProcess)
    process.rank = 0
    process.world_size = 1
    process._piped = PipedLines()
    process._count = 0
    process.child = child = _HangingChild(process)
    with pytest.raises(RankFailed, match=r"rank 0 hung before its first step for .* in setup"):
        process.run(
            {"config": types.SimpleNamespace(health=health)},
            sink=MetricsSink(send=lambda rows: None, flush=lambda rows: None),
            send_logs=lambda lines: None,
            stop_requested=lambda step, checkpointed: False,
            parent_gone=lambda: False,
        )
    assert child.what == ["dump", "kill"]


def test_no_hang_is_called_without_hang_factor_and_a_bad_report_is_a_protocol_error():
    result = {"t": "result", "result": {"first_step": 0, "last_step": 0, "cancelled": False}}
    child = _relay({"t": "at", "step": 0, "phase": "forward"}, result, health=HealthConfig(hang_factor=None))
    assert child.what == []
    with pytest.raises(RankFailed, match="step is not an integer"):
        _relay({"t": "at", "step": "3", "phase": "forward"}, health=HealthConfig())


# --------------------------------------------------------------------------- a real child's stacks, through its keeper


def _dumped_until_seen(child: Child, lines: list[str], frame: str) -> list[str]:
    """Ask the child for its stacks until `frame` shows in what it wrote (its faulthandler is set as
    it starts: a SIGUSR1 before that is ignored, never its end)."""

    def ask() -> list[str]:
        child.dump_stacks()
        return lines

    seen = wait_for(
        ask,
        lambda seen: child.process.poll() is not None or any(line.endswith(frame) for line in seen),
        what=f"{frame!r} in the stacks",
        timeout_s=120,
    )
    assert child.process.poll() is None, seen  # asked for its stacks, it goes on
    return seen


@pytest.mark.parametrize("zygote", ["on", "off"])
def test_a_childs_stacks_come_through_its_keeper_to_its_stderr_and_it_lives_on(searchable, monkeypatch, zygote):
    monkeypatch.setenv("ZERO1_ZYGOTE", zygote)
    home = Path(tempfile.mkdtemp(prefix="zero1-hang-"))
    home.chmod(0o711)  # the child's uid reaches its home below
    lines: list[str] = []
    spec = ChildSpec(home=str(home / "child"), run_as=RunAs(2001, 2001))  # another uid, in a PID namespace
    child = Child("call", spec, on_output=lambda stream, line: lines.append(f"{stream}: {line}"))
    try:
        child.send(("time:sleep", 300))  # stuck in a call, as a rank in its forward
        seen = _dumped_until_seen(child, lines, " in _call")
    finally:
        child.close()
        subprocess.run(["rm", "-rf", str(home)], check=False)
    assert child.containment == containment.NAMESPACE
    assert any(line.startswith("stderr: Current thread 0x") for line in seen), seen
    assert any(line.startswith("stderr: Thread 0x") for line in seen)  # every thread: the lifeline's watcher too


DUMP_AS_NOBODY = """
import json, sys, time
from workers.runtime.sandbox import Child, ChildSpec

lines = []
child = Child("call", ChildSpec(home=sys.argv[1]), on_output=lambda stream, line: lines.append(line))
child.send(("time:sleep", 300))
deadline = time.monotonic() + 120
while not any(line.endswith(" in _call") for line in lines) and time.monotonic() < deadline:
    child.dump_stacks()
    time.sleep(0.1)
alive = child.process.poll() is None
child.close()
print(json.dumps({"containment": child.containment, "lines": lines, "alive": alive}))
"""


@pytest.mark.parametrize("zygote", ["on", "off"])
def test_under_a_subreaper_keeper_the_stacks_come_through_too(searchable, zygote):
    # a service that is not root may not unshare: its keeper is a subreaper, the child its own child
    home = Path(tempfile.mkdtemp(prefix="zero1-nobody-"))
    os.chown(home, 65534, 65534)
    env = {**os.environ, "ZERO1_ZYGOTE": zygote, "TMPDIR": str(home)}
    done = subprocess.run(
        [sys.executable, "-c", DUMP_AS_NOBODY, str(home / "child")],
        user=65534, group=65534, extra_groups=[], cwd="/", env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    subprocess.run(["rm", "-rf", str(home)], check=False)
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout.splitlines()[-1])
    assert said["containment"].startswith("a subreaper"), said["containment"]
    assert said["alive"] and any(line.endswith(" in _call") for line in said["lines"]), said["lines"]


# --------------------------------------------------------------------------- a python job that hangs, through the API

EXAMPLE_DIR = ROOT / "examples" / "byo-model"
EXAMPLE = json.loads((EXAMPLE_DIR / "job.json").read_text())
HANGS_ONCE = (
    (EXAMPLE_DIR / "tinylm" / "model.py")
    .read_text()
    .replace("import torch\n", "import os\nimport time\n\nimport torch\n", 1)
    .replace(
        "        logits = self.head(self.norm(x))\n",
        "        logits = self.head(self.norm(x))\n"
        "        if not isinstance(x, torch._subclasses.FakeTensor) and self.training:  # ranks only, not the trace\n"
        "            self.calls = getattr(self, 'calls', 0) + 1\n"
        "            marker = os.path.join(os.environ['HOME'], 'hung-once')\n"
        "            if self.calls == 4 and torch.distributed.get_rank() == 1 and not os.path.exists(marker):\n"
        "                open(marker, 'w').close()  # the first attempt's rank 1 blocks at its step 3, forever\n"
        "                while True:\n"
        "                    time.sleep(1)\n",
    )
)


def test_a_rank_whose_forward_blocks_is_found_hung_its_stack_logged_and_the_job_resumes_to_success(examples_app):
    client, _ = examples_app
    assert "hung-once" in HANGS_ONCE
    bundle = zip_of({"tinylm/__init__.py": b"", "tinylm/model.py": HANGS_ONCE.encode()})
    upload = client.post("/v1/code", content=bundle, headers={"Content-Type": "application/zip"})
    assert upload.status_code in (200, 201), upload.text
    data = {key: str(ROOT / EXAMPLE["data"][key]) for key in ("path", "tokenizer")}
    steps = 8
    body = {
        **EXAMPLE,
        "data": {**EXAMPLE["data"], **data},
        "code": upload.json()["code"],
        "steps": steps,
        "checkpoint_every": 2,
        "max_retries": 2,  # one for the hang; one spare, should a loaded machine set up past hang_min_s
        "health": {"hang_min_s": 8},
    }
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 201, r.text
    job = wait_job(client, r.json()["id"], lambda j: j["status"] in TERMINAL, timeout_s=300)
    assert job["status"] == "succeeded", job

    events = client.get(f"/v1/jobs/{job['id']}/events").json()["data"]
    restarts = [e["reason"] for e in events if e["to_status"] == "restarting"]
    assert restarts and all("HangError: rank " in reason for reason in restarts), restarts
    hung = [i for i, reason in enumerate(restarts) if "hung at step 3 " in reason]
    assert len(hung) == 1, restarts
    attempt = hung[0]  # the attempts before it hung elsewhere, if any did
    reason = restarts[attempt]
    cause = reason.splitlines()[0]
    assert "rank 1 on node " in cause and "HangError: rank 1 hung at step 3 for " in cause, reason
    assert ") in forward; retry " in cause and "resumes from checkpoint step 1" in cause, reason
    assert reason.splitlines()[-1].strip().startswith('File "tinylm/model.py", line ')  # its tail: where it sat
    assert reason.splitlines()[-1].endswith(" in forward"), reason
    assert job["attempt"] == len(restarts)

    # the hung rank's log: what its parent said, then the stacks of every thread, the forward among them
    logs = client.get(f"/v1/jobs/{job['id']}/logs", params={"attempt": attempt, "rank": 1, "limit": 10_000}).json()[
        "data"
    ]
    said = [line["line"] for line in logs if line["stream"] == "log" and "WARNING zero1: rank 1 hung" in line["line"]]
    assert len(said) == 1 and said[0].endswith("the stacks of its threads follow (faulthandler)"), said
    stderr = [line["line"] for line in logs if line["stream"] == "stderr"]
    assert any(line.startswith("Current thread 0x") or line.startswith("Thread 0x") for line in stderr), stderr
    frames = [line for line in stderr if "tinylm/model.py" in line and line.endswith(" in forward")]
    assert frames, stderr
    assert any(line.endswith(" in _report_phases") for line in stderr)  # every thread's stack, not one

    # resumed from its checkpoint of step 1: every step once on the surviving curve
    curve = client.get(f"/v1/jobs/{job['id']}/metrics", params={"limit": 100}).json()["data"]
    assert [row["step"] for row in curve] == list(range(steps))
    assert {row["attempt"] for row in curve if row["step"] >= 2} == {len(restarts)}

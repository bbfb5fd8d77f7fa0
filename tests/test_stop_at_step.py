"""Stopping at a step boundary (a preemption): rank 0's answer, agreed by every rank, ends the
attempt after that step with a checkpoint of it, and the resumed run ends where an unstopped one
does, bit for bit; the parent's answers come without a Ray round trip a step, exact at checkpoints.

Packages: workers.training, workers.runtime
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import threading
import time
import types
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file

import workers.training.loop
import workers.training.writer
from workers.config import TrainConfig
from workers.models.builtin import build_model
from workers.records import AttemptStatus, MetricRow
from workers.runtime.actors import JobSupervisor, Placement
from workers.runtime.rank_actor import _StopAsker
from workers.runtime.rank_parent import MetricsSink, PipedLines, RankFailed, RankProcess
from workers.training.checkpoints import checkpointed_metrics, latest_checkpoint
from workers.training.loop import train
from workers.training.reader import read_shard

from distributed import run_ranks, small_run
from test_workers import wait_for as poll_until

STEPS = 8


def _config(root: str, *, checkpoint_every: int) -> TrainConfig:
    return small_run(root, steps=STEPS, checkpoint_every=checkpoint_every)


def _attempt(rank: int, world_size: int, root: str, checkpoint_every: int, stop_after: int | None, name: str) -> None:
    """One attempt of the run on this rank: stopped after `stop_after` (None: trains to the end);
    its result, what it was asked, what it saved and its rows go to root/../<name>-<rank>.json."""
    saved = []
    asked = []
    save = workers.training.writer.CheckpointWriter.save  # a process of its own: patched for this attempt only

    def counting_save(writer, step, metrics=()):
        saved.append(step)
        return save(writer, step, metrics)

    def stop_at(step: int, checkpointed: bool) -> bool:
        asked.append([step, checkpointed])
        return step == stop_after

    workers.training.writer.CheckpointWriter.save = counting_save
    rows: list[MetricRow] = []
    result = train(
        _config(root, checkpoint_every=checkpoint_every),
        rank=rank,
        world_size=world_size,
        on_metrics=rows.append,
        stop_at=stop_at,
    )
    record = {
        "stopped": result.stopped,
        "cancelled": result.cancelled,
        "first_step": result.first_step,
        "last_step": result.last_step,
        "saved": saved,
        "asked": asked,
        "rows": [row.step for row in rows],
    }
    Path(root).parent.joinpath(f"{name}-{rank}.json").write_text(json.dumps(record))


def _read(tmp_path: Path, name: str) -> list[dict]:
    return [json.loads((tmp_path / f"{name}-{rank}.json").read_text()) for rank in range(2)]


def _final_state(root: Path) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """The final model's weights, and the last checkpoint's optimizer shards."""
    step, world = latest_checkpoint(root)
    shards = [read_shard(root / f"step-{step:09d}" / f"rank-{r:05d}-of-{world:05d}.safetensors") for r in range(world)]
    return load_file(root / "final" / "model.safetensors"), shards


@pytest.mark.parametrize(
    ("stop_after", "checkpoint_every"),
    [(4, 0), (3, 4)],
    ids=["between-checkpoints", "at-a-checkpoint"],
)
def test_a_run_stopped_after_a_step_checkpoints_it_and_resumes_bit_for_bit(tmp_path, stop_after, checkpoint_every):
    whole = tmp_path / "whole" / "ck"
    stopped = tmp_path / "stopped" / "ck"
    run_ranks(2, _attempt, str(whole), checkpoint_every, None, "whole")
    run_ranks(2, _attempt, str(stopped), checkpoint_every, stop_after, "stopped")
    periodic = [s for s in range(STEPS) if checkpoint_every and (s + 1) % checkpoint_every == 0]

    for rank, attempt in enumerate(_read(stopped.parent, "stopped")):
        assert (attempt["stopped"], attempt["cancelled"]) == (True, False)
        assert (attempt["first_step"], attempt["last_step"]) == (0, stop_after)
        assert attempt["rows"] == list(range(stop_after + 1))
        assert attempt["saved"] == [stop_after]  # once: at a periodic checkpoint, no second one
        # only rank 0 is asked, after every step, told whether that step was just checkpointed
        want = [[s, s in periodic] for s in range(stop_after + 1)]
        assert attempt["asked"] == (want if rank == 0 else [])
    assert latest_checkpoint(stopped) == (stop_after, 2)
    assert sorted(p.name for p in stopped.iterdir()) == [f"step-{stop_after:09d}"]
    assert sorted(p.name for p in (stopped / f"step-{stop_after:09d}").iterdir()) == [
        "complete.json",
        "rank-00000-of-00002.metrics.json",
        "rank-00000-of-00002.safetensors",
        "rank-00001-of-00002.metrics.json",
        "rank-00001-of-00002.safetensors",
    ]
    assert [row.step for row in checkpointed_metrics(stopped, after_step=-1)] == list(range(stop_after + 1))

    run_ranks(2, _attempt, str(stopped), checkpoint_every, None, "resumed")
    for attempt in _read(stopped.parent, "resumed"):
        assert (attempt["stopped"], attempt["first_step"], attempt["last_step"]) == (False, stop_after + 1, STEPS - 1)
        assert attempt["rows"] == list(range(stop_after + 1, STEPS))  # with the first attempt's: each step once
    assert [row.step for row in checkpointed_metrics(stopped, after_step=-1)] == list(range(STEPS))

    got_weights, got_shards = _final_state(stopped)
    want_weights, want_shards = _final_state(whole)
    assert got_weights.keys() == want_weights.keys()
    for name, weight in want_weights.items():
        assert torch.equal(got_weights[name], weight), name
    for got, want in zip(got_shards, want_shards, strict=True):
        for got_buffer, want_buffer in zip(got["buffers"], want["buffers"], strict=True):
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                assert torch.equal(got_buffer[kind], want_buffer[kind]), kind


def test_a_stop_waits_for_a_step_that_was_not_skipped(tmp_path, monkeypatch):
    """Steps 3 and 4 are skipped (nan gradients): rank 0 is not asked after them, and the stop asked
    for since step 3 lands after step 5, the first clean one, as a periodic checkpoint would."""
    forwards = itertools.count()  # one micro-batch a step, one rank: the forward's count is the step

    def poisoned(*args, **kwargs):
        model = build_model(*args, **kwargs)
        model.register_forward_hook(lambda module, inputs, loss: loss * math.nan if next(forwards) in (3, 4) else loss)
        return model

    monkeypatch.setattr(workers.training.loop, "build_model", poisoned)
    asked: list[int] = []
    cfg = dataclasses.replace(_config(str(tmp_path), checkpoint_every=0), global_batch_size=4, max_nonfinite_steps=3)
    result = train(cfg, stop_at=lambda step, checkpointed: asked.append(step) or step >= 3)
    assert (result.stopped, result.last_step) == (True, 5)
    assert asked == [0, 1, 2, 5]
    assert latest_checkpoint(tmp_path) == (5, 1)
    assert [row.skipped for row in checkpointed_metrics(tmp_path, after_step=-1)] == [False] * 3 + [True] * 2 + [False]


# --------------------------------------------------------------------------- the parent's answers


@pytest.fixture
def supervisor(ray_cluster):
    """A JobSupervisor that is never started: what rank 0's parent asks."""
    placement = Placement(num_workers=1, cpus_per_worker=0.5)
    actor = JobSupervisor.remote("stop-asker", _config("unused", checkpoint_every=0), placement)
    yield actor
    ray.kill(actor, no_restart=True)


def _answers_true_within(ask, *, timeout_s: float = 30.0) -> None:
    """Ask (never blocking) until the answer is True, failing at the deadline (a bound on a failure)."""
    deadline = time.monotonic() + timeout_s
    calls = 0
    while True:
        calls += 1
        if ask():
            return
        assert time.monotonic() < deadline, f"still False after {calls} asks in {timeout_s:g} s"
        time.sleep(0.01)


def test_the_parent_answers_each_step_without_waiting_and_each_checkpoint_exactly(supervisor):
    asker = _StopAsker(supervisor, every_s=0.05)
    for step in range(20):  # nothing asked for: no stop, at a checkpoint or not
        assert asker(step, step % 5 == 4) is False

    ray.get(supervisor.request_stop.remote())  # after the next checkpoint (a resize)
    assert ray.get(supervisor.stop_mode.remote()) == "checkpoint"
    steps = itertools.count(20)
    answers: list[bool] = []

    def learnt() -> bool:  # between checkpoints it never stops, whatever it has learnt
        answers.append(asker(next(steps), False))
        return asker.mode == "checkpoint"

    _answers_true_within(learnt)
    assert set(answers) == {False}
    assert asker(next(steps), True) is True  # at a checkpoint it asks, and waits: exact

    ray.get(supervisor.request_stop.remote(True))  # now: after the next step (a preemption)
    _answers_true_within(lambda: asker(next(steps), False))
    assert asker.mode == "step"
    ray.get(supervisor.request_stop.remote(False))  # a later resize's ask takes nothing back
    assert ray.get(supervisor.stop_mode.remote()) == "step"
    assert asker(next(steps), False) is True and asker(next(steps), True) is True


@ray.remote(num_cpus=0, max_concurrency=4)
class _HeldSupervisor:
    """Stands in for a JobSupervisor whose stop_mode answers only once the test lets it: "checkpoint"."""

    def __init__(self) -> None:
        self._released = threading.Event()

    def stop_mode(self) -> str:
        self._released.wait()
        return "checkpoint"

    def release(self) -> None:
        self._released.set()


def test_between_checkpoints_no_ask_waits_for_the_supervisor(ray_cluster):
    """The supervisor answers nothing until every ask between checkpoints has been answered: had
    one waited for it, the asks would never end (the thread is joined with a bound on that failure)."""
    held = _HeldSupervisor.remote()
    try:
        asker = _StopAsker(held, every_s=0.0)
        events: list[str] = []
        asking = threading.Thread(target=lambda: events.extend(f"{asker(step, False)}" for step in range(40)))
        asking.start()
        asking.join(timeout=60)
        assert not asking.is_alive(), "an ask between checkpoints waited for the supervisor"
        ray.get(held.release.remote())
        events.append("released")
        assert asker(40, True) is True  # at a checkpoint it waits for the answer
        assert events == ["False"] * 40 + ["released"]
    finally:
        ray.kill(held, no_restart=True)


def test_a_stop_asked_for_now_is_answered_true_without_a_checkpoint(supervisor):
    asker = _StopAsker(supervisor, every_s=0.05)
    assert asker(0, False) is False
    ray.get(supervisor.request_stop.remote(now=True))
    _answers_true_within(lambda: asker(1, False))
    assert asker(2, True) is True


class _Child:
    """Stands in for a rank's child: says its messages in order, keeps what the parent sends."""

    def __init__(self, *messages: dict) -> None:
        self.messages = list(messages)
        self.sent = []
        self.killed = False
        self.output = types.SimpleNamespace(drain=lambda: None)  # its stdout and stderr: nothing written there

    def receive(self, timeout_s: float) -> dict:
        return self.messages.pop(0)

    def send(self, message: dict) -> None:
        self.sent.append(message)

    def kill(self) -> None:
        self.killed = True


def _relay(rank: int, child: _Child, asked: list) -> None:
    process = RankProcess.__new__(RankProcess)  # the child's words without starting one
    process.rank = rank
    process.world_size = 2
    process.child = child
    process._piped = PipedLines()
    process._count = 0
    process.run(
        {},
        sink=MetricsSink(send=lambda rows: None, flush=lambda rows: None),
        send_logs=lambda lines: None,
        stop_requested=lambda step, checkpointed: asked.append((step, checkpointed)) or step == 3,
        parent_gone=lambda: False,
    )


def test_rank_0s_stop_question_is_checked_field_by_field():
    result = {"t": "result", "result": {"first_step": 0, "last_step": 3, "cancelled": False, "stopped": True}}
    asked: list = []
    child = _Child(
        {"t": "stop?", "step": 2, "checkpointed": False}, {"t": "stop?", "step": 3, "checkpointed": True}, result
    )
    _relay(0, child, asked)
    assert asked == [(2, False), (3, True)]
    assert child.sent == [{}, {"stop": False}, {"stop": True}]

    for bad in ("yes", 1, None):
        with pytest.raises(RankFailed, match="checkpointed is not a boolean"):
            _relay(0, _Child({"t": "stop?", "step": 2, "checkpointed": bad}), [])
    with pytest.raises(RankFailed, match="rank 1 sent a 'stop\\?' message"):  # only rank 0 asks
        _relay(1, _Child({"t": "stop?", "step": 2, "checkpointed": False}), [])


# --------------------------------------------------------------------------- end to end


def test_a_job_asked_to_stop_now_stops_after_its_next_step_with_a_checkpoint_of_it(ray_cluster, tmp_path):
    root = tmp_path / "ck"
    cfg = dataclasses.replace(_config(str(root), checkpoint_every=0), steps=100_000)
    supervisor = JobSupervisor.remote("preempted", cfg, Placement(num_workers=2, cpus_per_worker=0.5, timeout_s=30))
    ray.get(supervisor.start.remote())
    _, seen = poll_until(supervisor, until=lambda state, rows: len(rows) >= 3, timeout_s=120)
    ray.get(supervisor.request_stop.remote(True))
    state, rows = poll_until(
        supervisor, until=lambda state, rows: state.status not in (AttemptStatus.STARTING, AttemptStatus.RUNNING)
    )
    rows = seen + [row for row in rows if row.step > seen[-1].step]  # the supervisor drops the rows acked
    assert state.status == AttemptStatus.STOPPED, state.error
    last = max(row.step for row in rows)
    assert sorted(row.step for row in rows) == list(range(last + 1))
    assert latest_checkpoint(root) == (last, 2)
    assert [row.step for row in checkpointed_metrics(root, after_step=-1)] == list(range(last + 1))
    assert not (root / "final").exists()

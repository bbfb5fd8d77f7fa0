"""The training loop's checkpoint decisions (workers.training's Checkpointer), step by step against a
stand-in writer, with no process group: periodic checkpoints and the last step's, a checkpoint owed
by a skipped step written at the next clean one, the stop asked after each step but the last and a
skipped one, and what a stop writes; the step an attempt starts at.

Packages: workers.training.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest
import torch

from workers.models.builtin import build_model
from workers.records import MetricRow
from workers.training.checkpointer import Checkpointer, first_step
from workers.training.writer import CheckpointIO
from workers.zero.optimizer import ZeRO1AdamW, decay_param_groups

from distributed import SMALL, small_run


class _Writer:
    """Stands in for CheckpointWriter: records each call in order; a save holds its step up step/10 s."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def save(self, step: int, metrics: Sequence[MetricRow] = ()) -> float:
        self.calls.append(("save", step, [row.step for row in metrics]))
        return step / 10

    def abandon(self) -> None:
        self.calls.append(("abandon",))

    def __enter__(self) -> _Writer:
        self.calls.append(("enter",))
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.calls.append(("exit", exc_type))


def _row(step: int, *, skipped: bool = False) -> MetricRow:
    return MetricRow(
        step=step,
        loss=1.0,
        grad_norm=float("nan") if skipped else 1.0,
        loss_scale=1.0,
        skipped=skipped,
        step_time_s=0.1,
        tokens_per_s=1.0,
        mem_peak_bytes=(1,),
        mem_planned_bytes=1,
    )


def _checkpointer(writer: _Writer | None, *, every: int, num_steps: int, max_skips: int = 3, stop=None) -> Checkpointer:
    return Checkpointer(
        writer,
        checkpoint_every=every,
        num_steps=num_steps,
        max_nonfinite_steps=max_skips,
        decide_stop=stop or (lambda step, checkpointed: False),
    )


def _run(checkpointer: Checkpointer, num_steps: int, *, skipped: Sequence[int] = ()) -> list[MetricRow]:
    """The loop's calls, step by step: the rows as reported, until the end or a stop."""
    rows = []
    in_a_row = 0
    for step in range(num_steps):
        in_a_row = in_a_row + 1 if step in skipped else 0
        rows.append(checkpointer.maybe_save(_row(step, skipped=step in skipped), skipped_in_a_row=in_a_row))
        if checkpointer.maybe_stop(rows[-1]):
            break
    return rows


def test_every_checkpoint_every_steps_and_the_last_with_the_rows_since_the_previous():
    writer = _Writer()
    rows = _run(_checkpointer(writer, every=2, num_steps=7), 7)
    assert writer.calls == [("save", 1, [0, 1]), ("save", 3, [2, 3]), ("save", 5, [4, 5]), ("save", 6, [6])]
    assert [row.checkpoint_blocked_s for row in rows] == [None, 0.1, None, 0.3, None, 0.5, 0.6]


def test_checkpoint_every_0_checkpoints_the_last_step_only():
    writer = _Writer()
    _run(_checkpointer(writer, every=0, num_steps=5), 5)
    assert writer.calls == [("save", 4, [0, 1, 2, 3, 4])]


def test_a_checkpoint_due_on_a_skipped_step_is_written_at_the_next_clean_one():
    writer = _Writer()
    rows = _run(_checkpointer(writer, every=2, num_steps=10), 10, skipped=[3])
    assert [call[1] for call in writer.calls] == [1, 4, 5, 7, 9]
    assert writer.calls[1] == ("save", 4, [2, 3, 4])  # the skipped step's row goes with it
    assert rows[3].checkpoint_blocked_s is None


def test_skips_in_a_row_keep_the_checkpoint_owed_until_a_clean_step():
    writer = _Writer()
    _run(_checkpointer(writer, every=2, num_steps=10, max_skips=5), 10, skipped=[3, 4, 5, 6])
    assert [call[1] for call in writer.calls] == [1, 7, 9]


def test_the_last_step_is_checkpointed_though_skipped_unless_the_skips_fail_the_run_there():
    writer = _Writer()
    _run(_checkpointer(writer, every=0, num_steps=4, max_skips=3), 4, skipped=[3])
    assert writer.calls == [("save", 3, [0, 1, 2, 3])]

    writer = _Writer()
    _run(_checkpointer(writer, every=0, num_steps=4, max_skips=3), 4, skipped=[1, 2, 3])
    assert writer.calls == []  # the third skip in a row fails the run at step 3 (the loop raises)


def test_a_stop_is_asked_after_each_step_but_the_last_and_a_skipped_one_told_whether_it_was_checkpointed():
    asked: list[tuple[int, bool]] = []
    checkpointer = _checkpointer(
        _Writer(), every=2, num_steps=6, stop=lambda step, checkpointed: asked.append((step, checkpointed)) or False
    )
    _run(checkpointer, 6, skipped=[2])
    assert asked == [(0, False), (1, True), (3, True), (4, False)]


def test_a_stop_between_checkpoints_writes_its_step_with_the_rows_since_the_last():
    writer = _Writer()
    rows = _run(_checkpointer(writer, every=2, num_steps=8, stop=lambda step, checkpointed: step == 4), 8)
    assert [row.step for row in rows] == [0, 1, 2, 3, 4]
    assert writer.calls == [("save", 1, [0, 1]), ("save", 3, [2, 3]), ("save", 4, [4])]
    assert rows[-1].checkpoint_blocked_s is None  # reported before the stop was asked for


def test_a_stop_at_a_checkpoint_writes_nothing_more():
    writer = _Writer()
    rows = _run(_checkpointer(writer, every=2, num_steps=8, stop=lambda step, checkpointed: step == 3), 8)
    assert [row.step for row in rows] == [0, 1, 2, 3]
    assert writer.calls == [("save", 1, [0, 1]), ("save", 3, [2, 3])]


def test_without_a_writer_nothing_is_written_and_a_stop_is_still_asked_for():
    asked: list[int] = []
    checkpointer = _checkpointer(None, every=2, num_steps=6, stop=lambda step, c: asked.append(step) or step == 2)
    with checkpointer:
        rows = _run(checkpointer, 6)
    checkpointer.abandon()
    assert [row.step for row in rows] == [0, 1, 2] and asked == [0, 1, 2]
    assert all(row.checkpoint_blocked_s is None for row in rows)


def test_leaving_and_abandoning_are_the_writers():
    writer = _Writer()
    with pytest.raises(RuntimeError), _checkpointer(writer, every=1, num_steps=2):
        raise RuntimeError("a failed step")
    assert writer.calls == [("enter",), ("exit", RuntimeError)]

    writer = _Writer()
    with _checkpointer(writer, every=1, num_steps=2) as checkpointer:
        checkpointer.abandon()
    assert writer.calls == [("enter",), ("abandon",), ("exit", None)]


# --------------------------------------------------------------------------- the first step


def _io(latest: tuple[int, int] | None) -> CheckpointIO:
    def fetch(name: str, ranges: list[tuple[int, int]]):
        raise AssertionError(f"nothing is read: {name}")

    return CheckpointIO(latest=lambda: latest, fetch=fetch)


def _opt() -> ZeRO1AdamW:
    model = build_model(SMALL, dtype=torch.float32, seed=0)
    return ZeRO1AdamW(decay_param_groups(model, weight_decay=0.1), lr=3e-3)


def test_an_attempt_starts_at_0_without_a_checkpoint_and_a_run_from_scratch_refuses_another_runs(tmp_path):
    config = small_run(tmp_path)
    assert first_step(config, opt=_opt(), io=_io(None)) == 0
    assert first_step(dataclasses.replace(config, checkpoint_dir=None), opt=_opt(), io=None) == 0
    fresh = dataclasses.replace(config, resume=False)
    assert first_step(fresh, opt=_opt(), io=_io(None)) == 0
    with pytest.raises(ValueError, match="already holds a checkpoint of step 5, and this run starts from scratch"):
        first_step(fresh, opt=_opt(), io=_io((5, 1)))

"""The training loop's checkpoint decisions: which steps are checkpointed, which step an attempt starts
at, and what a stop at a step writes.

A checkpoint is due every `checkpoint_every` steps; one falling on a skipped step (a non-finite
gradient norm) waits for the next clean one, and the last step's is written anyway. After each step
but the last and a skipped one, a stop may be asked for (a resize, a preemption): the attempt ends
there with a checkpoint of that step, the periodic one just written or one written then. The files
themselves are CheckpointWriter's (workers/training/writer.py: in the background, one write in flight).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Protocol

from workers.config import TrainConfig
from workers.records import MetricRow
from workers.training.reader import resume
from workers.training.writer import CheckpointIO, CheckpointWriter
from workers.zero.optimizer import ZeRO1AdamW


class ShardWriter(Protocol):
    """What the Checkpointer asks of a writer (CheckpointWriter's methods): tests hand it a stand-in."""

    def save(self, step: int, metrics: Sequence[MetricRow] = ()) -> float: ...

    def abandon(self) -> None: ...

    def __enter__(self) -> ShardWriter: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


StopDecision = Callable[[int, bool], bool]
"""decide(step, checkpointed) -> whether every rank stops after `step` (rank 0's answer, agreed)."""


class Checkpointer:
    """One attempt's checkpoints, decided step by step in the training thread, on every rank alike.

    maybe_save(row) after each step writes the checkpoint due there; maybe_stop(row) then asks whether
    the attempt stops at that step, and writes its checkpoint if the step had none. A context manager:
    leaving it waits for the write in flight (CheckpointWriter); abandon() after a cancellation lets
    that write finish without raising its error. Without a writer (no checkpoint_dir) nothing is
    written, and a stop is still asked for."""

    def __init__(
        self,
        writer: ShardWriter | None,
        *,
        checkpoint_every: int,
        num_steps: int,
        max_nonfinite_steps: int,
        decide_stop: StopDecision,
    ) -> None:
        self._writer = writer
        self._checkpoint_every = checkpoint_every
        self._num_steps = num_steps
        self._max_nonfinite_steps = max_nonfinite_steps
        self._decide_stop = decide_stop
        self._since_checkpoint: list[MetricRow] = []
        self._due = False  # a periodic checkpoint is owed (its step, or a later one, was skipped)
        self._checkpointed = False  # the last step's checkpoint was written at it

    @classmethod
    def for_run(
        cls, config: TrainConfig, *, opt: ZeRO1AdamW, io: CheckpointIO | None, decide_stop: StopDecision
    ) -> Checkpointer:
        """The run's Checkpointer: a CheckpointWriter into config.checkpoint_dir through `io` (none
        without a checkpoint_dir)."""
        writer = None
        if config.checkpoint_dir:
            writer = CheckpointWriter(
                opt,
                root=Path(config.checkpoint_dir),
                io=io,
                keep_last=config.keep_last,
                asynchronous=config.async_checkpoints,
            )
        return cls(
            writer,
            checkpoint_every=config.checkpoint_every,
            num_steps=config.steps,
            max_nonfinite_steps=config.max_nonfinite_steps,
            decide_stop=decide_stop,
        )

    def maybe_save(self, row: MetricRow, *, skipped_in_a_row: int) -> MetricRow:
        """The checkpoint of row.step if one is due: `row` with the seconds it held the step up."""
        self._due = self._due or self._periodic(row.step)
        self._since_checkpoint.append(row)
        self._checkpointed = self._saves(row, skipped_in_a_row=skipped_in_a_row)
        if not self._checkpointed:
            return row
        blocked_s = self._writer.save(row.step, self._since_checkpoint)
        self._since_checkpoint = []
        self._due = False
        return replace(row, checkpoint_blocked_s=blocked_s)

    def maybe_stop(self, row: MetricRow) -> bool:
        """Whether the attempt stops after row.step (never after the last step nor a skipped one: a
        stop's checkpoint is then one a periodic one could be, and the resumed run's count of skips in
        a row, from 0, is the one the unstopped run would have); its checkpoint is written first."""
        if self._last(row.step) or row.skipped or not self._decide_stop(row.step, self._checkpointed):
            return False
        if self._writer is not None and not self._checkpointed:
            self._writer.save(row.step, self._since_checkpoint)
            self._since_checkpoint = []
        return True

    def abandon(self) -> None:
        """After a cancellation: the write in flight still finishes; its error is logged, not raised."""
        if self._writer is not None:
            self._writer.abandon()

    def __enter__(self) -> Checkpointer:
        if self._writer is not None:
            self._writer.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._writer is not None:  # waits for the write in flight
            self._writer.__exit__(exc_type, exc, tb)

    def _saves(self, row: MetricRow, *, skipped_in_a_row: int) -> bool:
        """A checkpoint falling on a skipped step waits for the next clean one: written now, it would
        hold the same weights under a later step and, with keep_last, prune the ones from before the
        trouble began. The last step's is written anyway (the skips changed nothing), unless the skips
        fail the run there."""
        if self._writer is None or skipped_in_a_row >= self._max_nonfinite_steps:
            return False
        return self._last(row.step) or (self._due and not row.skipped)

    def _periodic(self, step: int) -> bool:
        return bool(self._checkpoint_every and (step + 1) % self._checkpoint_every == 0)

    def _last(self, step: int) -> bool:
        return step + 1 == self._num_steps


def first_step(config: TrainConfig, *, opt: ZeRO1AdamW, io: CheckpointIO | None) -> int:
    """The step this attempt starts at: after the newest complete checkpoint, loaded into `opt`
    (config.resume), else 0. A run from scratch refuses a checkpoint_dir holding another run's."""
    if not config.checkpoint_dir:
        return 0
    if config.resume:
        resumed = resume(opt, io)
        return 0 if resumed is None else resumed.step + 1
    if (found := io.latest()) is not None:
        raise ValueError(
            f"checkpoint_dir {config.checkpoint_dir} already holds a checkpoint of step {found[0]}, and this run "
            "starts from scratch (resume=False): it is another run's"
        )
    return 0

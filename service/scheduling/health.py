"""The rollback policy, as a pure function of what the scheduler knows of a diverged attempt (its
rank's Divergence, the job's health settings, its rollbacks so far and its newest checkpoint before
the event): roll the job back to that checkpoint, skipping the batches up to the event and scaling
the learning rate, or fail it once its rollbacks are spent; with the event's words.

A rollback is no retry: it spends one of health.max_rollbacks, never one of max_retries. The
rollbacks a job took are stored with it (jobs.rollbacks) and every later attempt of it trains with
their data skips and learning-rate factor (relaunch_terms). docs/api.md, "Training health".

No database, no Ray, no clock: service/scheduling/outcomes.py gathers the facts and carries the
decision out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from workers.config import DataSkip, HealthConfig
from workers.records import Divergence


@dataclass(frozen=True, slots=True, kw_only=True)
class Rollback:
    """One rollback, as the job stores it (jobs.rollbacks)."""

    kind: str
    """The divergence's kind (workers.records.DivergenceKind's value)."""
    step: int
    """The step the divergence was seen at."""
    checkpoint_step: int | None
    """The checkpoint the job resumed from; None: none before the event, it started again at step 0."""
    num_batches: int
    """Batches skipped: those of the steps after the checkpoint up to the event (0 without skip_batches)."""

    @property
    def resume_step(self) -> int:
        return 0 if self.checkpoint_step is None else self.checkpoint_step + 1

    def skip(self) -> DataSkip | None:
        """The data skip every later attempt trains with; None where no batch is skipped."""
        return DataSkip(step=self.resume_step, num_batches=self.num_batches) if self.num_batches else None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> Rollback:
        return cls(**value)


@dataclass(frozen=True, slots=True, kw_only=True)
class RollbackDecision:
    """Roll back (`rollback` set) or fail, and the words the job's event says it with."""

    reason: str
    rollback: Rollback | None = None
    """The rollback to store and carry out; None: the job fails."""


def decide(
    divergence: Divergence, *, health: HealthConfig, num_rollbacks: int, checkpoint_step: int | None
) -> RollbackDecision:
    """Roll `divergence`'s job back to `checkpoint_step` (its newest complete checkpoint before the
    event; None: none) while its rollbacks last, else fail it naming the rollbacks spent."""
    what = divergence.describe()
    if num_rollbacks >= health.max_rollbacks:
        return RollbackDecision(
            reason=f"{what}: no rollback left ({num_rollbacks} of max_rollbacks {health.max_rollbacks} spent)"
        )
    resume_step = 0 if checkpoint_step is None else checkpoint_step + 1
    rollback = Rollback(
        kind=divergence.kind.value,
        step=divergence.step,
        checkpoint_step=checkpoint_step,
        num_batches=divergence.step + 1 - resume_step if health.skip_batches else 0,
    )
    to = "the start" if checkpoint_step is None else f"step {checkpoint_step}"
    skipping = f", skipping {rollback.num_batches} batches" if rollback.num_batches else ""
    lr = f", lr x{health.lr_factor ** (num_rollbacks + 1):.4g}" if health.lr_factor != 1 else ""
    count = f"rollback {num_rollbacks + 1} of {health.max_rollbacks}"
    return RollbackDecision(reason=f"{what}: rolled back to {to}{skipping}{lr} ({count})", rollback=rollback)


def rollbacks_of(stored: list[dict[str, Any]] | None) -> list[Rollback]:
    """A job's rollbacks, from its jobs.rollbacks column (null: none)."""
    return [Rollback.from_json(value) for value in stored or []]


def relaunch_terms(rollbacks: list[Rollback], *, lr_factor: float) -> tuple[tuple[DataSkip, ...], float]:
    """What a job's attempts train with after `rollbacks`: their data skips, and the learning rate's
    scale (lr_factor once per rollback)."""
    skips = tuple(skip for skip in (rollback.skip() for rollback in rollbacks) if skip is not None)
    return skips, lr_factor ** len(rollbacks)

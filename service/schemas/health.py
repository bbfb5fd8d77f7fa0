"""A job's `health`: divergence rollback and hang detection (docs/api.md, "Training health"),
converted once into the workers' HealthConfig by to_spec()."""

from __future__ import annotations

from pydantic import Field

from service.schemas.fields import Body, Bool, Float, Int
from workers.config import DataSkip, HealthConfig, default_of


def _health(name: str):
    return default_of(HealthConfig, name)


class HealthSpec(Body):
    """What the service does when training goes wrong: roll a diverged run back, end a hung attempt."""

    max_rollbacks: Int = Field(
        _health("max_rollbacks"),
        ge=0,
        le=100,
        description="Rollbacks to the last checkpoint before a loss spike or a non-finite run (none spends a "
        "retry); 0: a non-finite run fails and a spike is only logged.",
    )
    spike_zscore: Float | None = Field(
        _health("spike_zscore"),
        gt=0,
        le=1e6,
        allow_inf_nan=False,
        description="A loss this many standard deviations above the mean of the spike_window steps before it "
        "is a spike; null: no spike detection.",
    )
    spike_window: Int = Field(_health("spike_window"), ge=2, le=100_000, description="Steps the spike test looks back.")
    lr_factor: Float = Field(
        _health("lr_factor"),
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="The learning rate is multiplied by this at each rollback (1: unchanged).",
    )
    skip_batches: Bool = Field(
        _health("skip_batches"),
        description="A rollback skips the batches between its checkpoint and the event (the data that caused it).",
    )
    hang_factor: Float | None = Field(
        _health("hang_factor"),
        gt=1,
        le=1e6,
        allow_inf_nan=False,
        description="A rank with no step for this many times its median step time (and at least hang_min_s) is "
        "hung: its stacks go to its log and the attempt is retried; null: no hang detection.",
    )
    hang_min_s: Float = Field(
        _health("hang_min_s"),
        gt=0,
        le=7 * 24 * 3600,
        allow_inf_nan=False,
        description="Seconds a rank waits for a step at least before it counts as hung.",
    )

    def to_spec(self) -> HealthConfig:
        return HealthConfig(**self.model_dump())


class DataSkipSpec(Body):
    """Batches a job never trains on: from `step` on, each step reads the batch of the step num_batches
    further on. A rollback adds one (its checkpoint's step + 1, the batches up to the event); a job
    given the same from its start reads the same batch at every step."""

    step: Int = Field(ge=0, le=100_000_000, description="The first step that reads past the skipped batches.")
    num_batches: Int = Field(ge=1, le=100_000_000, description="Batches (whole steps' global batches) skipped.")

    def to_spec(self) -> DataSkip:
        return DataSkip(step=self.step, num_batches=self.num_batches)

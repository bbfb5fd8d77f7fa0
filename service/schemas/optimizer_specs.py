"""A job's optimizer: AdamW's hyperparameters and the learning-rate schedule, each converted once
into the workers' spec by its to_spec()."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from service.schemas.fields import Body, Bool, Float, Int
from workers import limits
from workers.config import SCHEDULE_KINDS, FieldError, OptimizerSpec, ScheduleSpec, default_of

MAX_STEPS = 100_000_000
"""The most steps a job may train (JobSpec.steps): a schedule's step counts are bounded by it too."""


def _opt(name: str):
    return default_of(OptimizerSpec, name)


def _schedule(name: str):
    return default_of(ScheduleSpec, name)


class ScheduleConfig(Body):
    """The learning rate by step: `lr` is the peak (workers/training/schedule.py, docs/api.md "Schedules")."""

    kind: Literal[SCHEDULE_KINDS] = Field(
        _schedule("kind"), description="After the warmup: constant, linear or cosine decay, or wsd."
    )
    warmup_steps: Int = Field(
        _schedule("warmup_steps"), ge=0, le=MAX_STEPS, description="Steps of linear warmup: lr·(s + 1)/W."
    )
    min_lr_ratio: Float = Field(
        _schedule("min_lr_ratio"), ge=0, le=1, allow_inf_nan=False, description="Where decay ends, as a fraction of lr."
    )
    decay_steps: Int | None = Field(
        _schedule("decay_steps"), ge=1, le=MAX_STEPS, description="wsd only: the steps of its final linear decay."
    )

    @model_validator(mode="after")
    def _decay_steps_for_wsd(self) -> ScheduleConfig:
        if self.kind == "wsd" and self.decay_steps is None:
            raise FieldError("decay_steps", "decay_steps is required for a wsd schedule (the steps of its final decay)")
        if self.kind != "wsd" and self.decay_steps is not None:
            raise FieldError("decay_steps", f"decay_steps applies to a wsd schedule only, not to {self.kind!r}")
        return self

    def check_steps(self, steps: int) -> None:
        """ValueError unless the warmup (and a wsd decay) fit in the job's `steps`."""
        decay = self.decay_steps or 0
        if self.warmup_steps + decay > steps:
            parts = "warmup_steps" + (" + decay_steps" if decay else "")
            numbers = f"{self.warmup_steps}" + (f" + {decay}" if decay else "")
            raise FieldError(
                f"optimizer.schedule.{parts.split()[0]}",
                f"optimizer.schedule.{parts} ({numbers}) must be <= steps ({steps})",
            )

    def to_spec(self) -> ScheduleSpec:
        return ScheduleSpec(**self.model_dump())


class OptimizerConfig(Body):
    lr: Float = Field(_opt("lr"), gt=0, le=10, allow_inf_nan=False, description="The peak learning rate.")
    betas: tuple[
        Annotated[Float, Field(ge=0, lt=1, allow_inf_nan=False)],
        Annotated[Float, Field(ge=0, lt=1, allow_inf_nan=False)],
    ] = _opt("betas")
    eps: Float = Field(_opt("eps"), ge=0, le=1, allow_inf_nan=False)
    weight_decay: Float = Field(_opt("weight_decay"), ge=0, le=10, allow_inf_nan=False)
    max_grad_norm: Float | None = Field(_opt("max_grad_norm"), gt=0, le=1e6, allow_inf_nan=False)
    overlap_comm: Bool = Field(
        _opt("overlap_comm"),
        description="Send each gradient bucket's reduce during the backward (ZeRO1AdamW's overlap_comm; "
        "off by default: docs/optimizer.md).",
    )
    bucket_cap_mb: Float = Field(
        _opt("bucket_cap_mb"),
        ge=limits.MIN_BUCKET_CAP_MB,
        le=4096,
        allow_inf_nan=False,
        description=f"Largest gradient bucket, MiB (at least {limits.MIN_BUCKET_CAP_MB:g}).",
    )
    schedule: ScheduleConfig = ScheduleConfig()

    def to_spec(self) -> OptimizerSpec:
        values = self.model_dump(exclude={"schedule"}) | {"betas": tuple(self.betas)}
        return OptimizerSpec(**values, schedule=self.schedule.to_spec())

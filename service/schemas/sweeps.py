"""POST /v1/sweeps and what the sweep routes answer: a base job spec, a space over its fields by path,
and the trials that search it (service/experiments/sweeps.py runs them)."""

from __future__ import annotations

import math
import re
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from service.schemas.fields import Body, Bool, Float, Int, Text
from workers.config import FieldError

MAX_TRIALS = 256
MAX_DIMENSIONS = 16
PATH = r"^[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*){0,5}$"
"""A field of the job spec by its path: optimizer.lr, optimizer.schedule.warmup_steps, model.n_layer."""


class Uniform(Body):
    uniform: tuple[Float, Float] = Field(description="[low, high]: drawn uniformly")


class LogUniform(Body):
    log_uniform: tuple[Float, Float] = Field(description="[low, high], both > 0: drawn uniformly in log space")


class IntUniform(Body):
    int_uniform: tuple[Int, Int] = Field(description="[low, high]: an integer, each equally likely, both ends included")


Dimension = list[Any] | Uniform | LogUniform | IntUniform
"""A searched field's values: a list (a grid, or a choice when the search is random), or a range."""


class EarlyStopping(Body):
    """ASHA: at each rung a trial goes on only within the best 1/eta of the trials that reached it before."""

    kind: Literal["asha"] = "asha"
    rungs: list[Int] = Field(
        min_length=1, max_length=16, description="Steps done at which a trial is judged, increasing, each < steps."
    )
    eta: Int = Field(3, ge=2, le=16, description="The reduction factor: the best 1/eta at a rung go on.")
    bootstrap_count: Int | None = Field(
        None,
        ge=0,
        le=MAX_TRIALS,
        description="The values earlier trials must have recorded at a rung before it stops any (Optuna's "
        "bootstrap_count); default eta - 1: a cutoff at the best 1/eta of fewer means little.",
    )

    @property
    def bootstrap(self) -> int:
        return self.eta - 1 if self.bootstrap_count is None else self.bootstrap_count

    @model_validator(mode="after")
    def _increasing(self) -> EarlyStopping:
        if self.rungs[0] < 1 or any(b <= a for a, b in zip(self.rungs, self.rungs[1:], strict=False)):
            raise FieldError("early_stopping.rungs", f"give increasing step counts >= 1, not {self.rungs}")
        return self


class SweepSpec(Body):
    """POST /v1/sweeps: a job spec searched over some of its fields, one job per trial."""

    name: Text = Field(min_length=1, max_length=180)
    base: dict[str, Any] = Field(description="A job spec (POST /v1/jobs's body): what every trial shares.")
    space: dict[str, Dimension] = Field(
        min_length=1,
        max_length=MAX_DIMENSIONS,
        description="Each searched field by its path in the job spec (optimizer.lr) -> a list of values, or "
        '{"uniform": [a, b]}, {"log_uniform": [a, b]}, {"int_uniform": [a, b]}. Lists only: the full grid; '
        "with a range: max_trials random draws (seeded).",
    )
    max_trials: Int | None = Field(None, ge=1, le=MAX_TRIALS, description="Random search: the draws (required).")
    max_concurrent: Int = Field(2, ge=1, le=MAX_TRIALS, description="Trials that may run (or wait queued) at once.")
    metric: Literal["eval_loss", "loss"] = Field(
        "eval_loss", description="What the best trial has least of: its last eval_loss, or its last loss."
    )
    seed: Int = Field(0, ge=0, le=2**63 - 1, description="Of a random search's draws.")
    skip_unfit: Bool = Field(
        False, description="A trial whose plan does not fit is listed as skipped, not a 422 for the whole sweep."
    )
    early_stopping: EarlyStopping | None = Field(
        None, description='{"kind": "asha", "rungs": [steps, ...], "eta": 3}: stop the trials behind at each rung.'
    )

    @model_validator(mode="after")
    def _consistent(self) -> SweepSpec:
        for path, dimension in self.space.items():
            if not re.fullmatch(PATH, path):
                raise FieldError("space", f"{path!r} is not a field's path (letters, digits and _, joined by .)")
            if isinstance(dimension, list) and not 1 <= len(dimension) <= MAX_TRIALS:
                raise FieldError(f"space.{path}", f"give 1 to {MAX_TRIALS} values, not {len(dimension)}")
            low, high = _bounds(dimension)
            if low is not None and not low <= high:
                raise FieldError(f"space.{path}", f"low ({low}) must be <= high ({high})")
            if isinstance(dimension, LogUniform) and low <= 0:
                raise FieldError(f"space.{path}", f"log_uniform needs low > 0 (got {low})")
        if self.is_grid:
            size = math.prod(len(values) for values in self.space.values())
            if size > MAX_TRIALS:
                raise FieldError("space", f"the grid has {size} trials, more than {MAX_TRIALS}")
        elif self.max_trials is None:
            raise FieldError("max_trials", "a random search (a range in space) needs max_trials")
        return self

    @property
    def is_grid(self) -> bool:
        return all(isinstance(dimension, list) for dimension in self.space.values())


def _bounds(dimension: Dimension) -> tuple[Any, Any]:
    for kind in ("uniform", "log_uniform", "int_uniform"):
        if hasattr(dimension, kind):
            return getattr(dimension, kind)
    return None, None


class TrialPublic(BaseModel):
    index: int
    values: dict[str, Any] = Field(description="Each searched field's path -> its value in this trial.")
    job_id: int | None = Field(description="Its job; null while it waits its turn, and for a skipped trial.")
    status: str = Field(description="Its job's status; pending before it has one; skipped.")
    skipped: str | None = Field(None, description="Why it does not run.")
    reason: str | None = Field(None, description="Why it waits: its turn in the sweep, or its job's in the queue.")
    rungs: dict[str, float | None] = Field(
        default_factory=dict, description="Early stopping: each rung reached (steps) -> the metric there."
    )
    steps_done: int = 0
    metric: float | None = Field(None, description="The sweep's metric, last value of the job (null before one).")


class SweepPublic(BaseModel):
    id: int
    name: str
    owner: str | None
    status: Literal["running", "suspended", "succeeded", "failed", "cancelled"]
    metric: str
    max_concurrent: int
    early_stopping: EarlyStopping | None
    gpu_seconds: float = Field(
        description="Summed over its trials' jobs: GPUs held x seconds, start to end, each attempt at its N "
        "(as GET /v1/usage counts them)."
    )
    created_at: datetime
    finished_at: datetime | None
    trials: list[TrialPublic]
    best: TrialPublic | None = Field(description="The succeeded trial with the least metric; null before one.")
    tag: str = Field(description="Every trial's job carries it (GET /v1/jobs?tag=).")


class SweepsPublic(BaseModel):
    data: list[SweepPublic]

"""What GET /v1/usage answers: GPU-seconds held and spent training by owner and priority class over a
period, and each owner's GPUs against their quota (service/scheduling/usage.py counts them)."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, Field

_NUMBER = re.compile(r"\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*")


def _not_a_number(value: object) -> object:
    # pydantic's lax mode reads "1700000000" or "0.5" as seconds since 1970: a period is asked in ISO 8601
    if isinstance(value, (int, float)) or (isinstance(value, str) and _NUMBER.fullmatch(value)):
        raise ValueError(f"Input should be an ISO 8601 time such as 2026-12-01 or 2026-12-01T00:00:00Z (got {value!r})")
    return value


IsoTime = Annotated[datetime, BeforeValidator(_not_a_number)]
"""A time asked in ISO 8601 (a date, or a date and time; without a zone, UTC), never a number of seconds."""


class UsageRowPublic(BaseModel):
    """One owner's usage at one priority class over the period."""

    owner: str | None = Field(description="Null: jobs submitted while auth was off.")
    priority_class: int = Field(description="The jobs' priority (0-100): zero1 names no ranges of priorities.")
    jobs: int = Field(description="Jobs that held GPUs or stored a training step in the period.")
    gpu_seconds_held: float = Field(
        description="GPUs x seconds the jobs held them (starting, running, restarting), within the period."
    )
    gpu_seconds_training: float = Field(
        description="GPUs x seconds of the training steps stored in the period: each row's step_time_s x its N."
    )


class QuotaUsagePublic(BaseModel):
    """An owner's GPUs now, and their usage over the period against their quota."""

    owner: str | None = Field(description="Null: jobs submitted while auth was off.")
    gpus_in_use: int = Field(description="GPUs their starting, running and restarting jobs hold now (each its N).")
    borrowed_gpus: int = Field(description="Of those, the GPUs of jobs running past the quota (preempted first).")
    quota: int | None = Field(description="ZERO1_GPU_QUOTAS' entry for them (or `*`'s); null: no quota.")
    gpu_seconds_held: float = Field(description="Over the period, at every priority class.")
    gpu_seconds_training: float = Field(description="Over the period, at every priority class.")
    quota_gpu_seconds: float | None = Field(
        description="quota x the period's seconds up to now: what holding the whole quota throughout would be; "
        "null without a quota."
    )
    quota_used: float | None = Field(
        description="gpu_seconds_held / quota_gpu_seconds (above 1 with borrowed GPUs); null without a quota, or "
        "for a period that has not begun."
    )


class UsagePublic(BaseModel):
    """GET /v1/usage: the caller's usage (an admin's: everyone's) over [since, until)."""

    since: datetime
    until: datetime
    seconds: float = Field(description="The period's seconds up to now (until, or now if until is later).")
    gpu_seconds_held: float = Field(description="The rows' sum.")
    gpu_seconds_training: float = Field(description="The rows' sum.")
    data: list[UsageRowPublic] = Field(description="By owner, then priority class, highest first.")
    quotas: list[QuotaUsagePublic] = Field(
        description="Each owner in data or holding GPUs now (an ordinary user: themselves alone), by owner."
    )

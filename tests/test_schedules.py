"""Learning-rate schedules: each kind's rate at every step against the issue's formula (written out
here, apart from workers/training/schedule.py), the optimizer training with it, a stopped and
resumed cosine run equal to an uninterrupted one, the rows' `lr` through the API, and the 422s.

Packages: workers.training, workers.config, service.schemas.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from workers.config import OptimizerSpec, ScheduleSpec
from workers.records import MetricRow
from workers.training.loop import train

import helpers
from distributed import small_run

STEPS = 24
LR = 3e-3
WARMUP = 5
RATIO = 0.1
KINDS = {
    "constant": ScheduleSpec(),
    "constant-warmup": ScheduleSpec(warmup_steps=WARMUP),
    "linear": ScheduleSpec(kind="linear", warmup_steps=WARMUP, min_lr_ratio=RATIO),
    "cosine": ScheduleSpec(kind="cosine", warmup_steps=WARMUP, min_lr_ratio=RATIO),
    "wsd": ScheduleSpec(kind="wsd", warmup_steps=WARMUP, min_lr_ratio=RATIO, decay_steps=7),
    "wsd-1": ScheduleSpec(kind="wsd", decay_steps=1),
}


def expected_lr(s: int, *, kind: str, lr: float, steps: int, w: int, r: float, d: int | None) -> float:
    """The issue's formula, term for term."""
    if s < w:
        return lr * (s + 1) / w
    p = (s - w) / max(1, steps - w)
    if kind == "constant":
        return lr
    if kind == "linear":
        return lr - (lr - r * lr) * p
    if kind == "cosine":
        return r * lr + (lr - r * lr) * (1 + math.cos(math.pi * p)) / 2
    # wsd: lr through step S - D, then linear to r·lr at step S - 1
    if d == 1:
        return r * lr if s == steps - 1 else lr
    return lr if s <= steps - d else lr + (r * lr - lr) * (s - (steps - d)) / (d - 1)


def _run(tmp_path, schedule: ScheduleSpec, *, lr: float = LR, steps: int = STEPS, **overrides) -> list[MetricRow]:
    rows: list[MetricRow] = []
    config = small_run(tmp_path, steps=steps, optimizer=OptimizerSpec(lr=lr, schedule=schedule), **overrides)
    train(config, on_metrics=rows.append)
    return rows


@pytest.mark.parametrize("name", KINDS)
def test_every_steps_lr_is_the_formulas(tmp_path, name):
    schedule = KINDS[name]
    rows = _run(tmp_path, schedule)
    assert [row.step for row in rows] == list(range(STEPS))
    for row in rows:
        want = expected_lr(
            row.step,
            kind=schedule.kind,
            lr=LR,
            steps=STEPS,
            w=schedule.warmup_steps,
            r=schedule.min_lr_ratio,
            d=schedule.decay_steps,
        )
        assert abs(row.lr - want) <= 1e-12 * want, (name, row.step, row.lr, want)
    if schedule.kind != "constant":
        floor = schedule.min_lr_ratio * LR
        assert rows[-1].lr < LR and min(row.lr for row in rows) >= floor * (1 - 1e-12)


def test_the_optimizer_steps_with_the_scheduled_rate(tmp_path):
    """Step 1's loss depends on step 0's update alone: a warmup's first rate (lr/2) gives the loss a
    constant lr/2 gives, bit for bit, and not the one a constant lr gives."""
    warm = _run(tmp_path / "warm", ScheduleSpec(kind="linear", warmup_steps=2), steps=2)
    half = _run(tmp_path / "half", ScheduleSpec(), lr=LR / 2, steps=2)
    full = _run(tmp_path / "full", ScheduleSpec(), steps=2)
    assert [row.lr for row in warm] == [LR / 2, LR]
    assert warm[1].loss == half[1].loss != full[1].loss


def test_a_cosine_run_stopped_and_resumed_has_the_uninterrupted_rates_and_losses(tmp_path):
    schedule = KINDS["cosine"]
    uninterrupted = _run(tmp_path / "whole", schedule, checkpoint_every=4)
    config = small_run(
        tmp_path / "stopped", steps=STEPS, checkpoint_every=4, optimizer=OptimizerSpec(lr=LR, schedule=schedule)
    )
    first: list[MetricRow] = []
    result = train(config, on_metrics=first.append, stop_at=lambda step, checkpointed: step == 9)
    assert result.stopped and first[-1].step == 9
    rest: list[MetricRow] = []
    train(dataclasses.replace(config, resume=True), on_metrics=rest.append)
    assert rest[0].step == 10
    resumed = first + rest
    assert [(r.step, r.lr, r.loss) for r in resumed] == [(r.step, r.lr, r.loss) for r in uninterrupted]


# --------------------------------------------------------------------------- through the API


def test_a_jobs_rows_carry_its_scheduled_lr(client):
    schedule = {"kind": "cosine", "warmup_steps": 3, "min_lr_ratio": 0.2}
    body = helpers.job_body(steps=10, optimizer={**helpers.FAST, "schedule": schedule})
    job = client.post("/v1/jobs", json=body)
    assert job.status_code == 201, job.text
    assert job.json()["spec"]["optimizer"]["schedule"] == {**schedule, "decay_steps": None}
    job = helpers.wait_job(client, job.json()["id"], lambda j: j["status"] in helpers.TERMINAL)
    assert job["status"] == "succeeded", job["error"]
    rows = client.get(f"/v1/jobs/{job['id']}/metrics").json()["data"]
    lr = helpers.FAST["lr"]
    want = [expected_lr(s, kind="cosine", lr=lr, steps=10, w=3, r=0.2, d=None) for s in range(10)]
    assert [row["lr"] for row in rows] == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize(
    ("schedule", "steps", "text"),
    [
        ({"kind": "wsd"}, 10, "decay_steps is required for a wsd schedule"),
        ({"kind": "cosine", "decay_steps": 3}, 10, "decay_steps applies to a wsd schedule only"),
        ({"kind": "step"}, 10, "Input should be 'constant', 'linear', 'cosine' or 'wsd'"),
        ({"kind": "linear", "warmup_steps": 11}, 10, "optimizer.schedule.warmup_steps (11) must be <= steps (10)"),
        (
            {"kind": "wsd", "warmup_steps": 4, "decay_steps": 7},
            10,
            "optimizer.schedule.warmup_steps + decay_steps (4 + 7) must be <= steps (10)",
        ),
        ({"min_lr_ratio": 1.5}, 10, "less than or equal to 1"),
    ],
)
def test_a_schedule_that_cannot_run_is_a_422_that_says_why(client, schedule, steps, text):
    body = helpers.job_body(steps=steps, optimizer={**helpers.FAST, "schedule": schedule})
    r = client.post("/v1/jobs", params={"dry_run": True}, json=body)
    assert r.status_code == 422 and text in r.json()["message"], r.text
    assert r.json()["detail"][0]["field"].startswith(("optimizer.schedule", "optimizer")), r.text  # never "body"

"""A sweep trained for real: a 6-trial grid over optimizer.lr x warmup_steps on the tiny GPT, on the
session's Ray cluster (4 logical GPUs), through the API and through the client; each trial's rows
train at its lr, and the best is the trial whose last eval loss is least, read back from the rows; with
ASHA, a clearly bad trial stops at its rung with a checkpoint and ends stopped_early.

Packages: service.experiments, service.api, service.client, workers.training.
"""

from __future__ import annotations

import math

import pytest

from workers.config import ScheduleSpec
from workers.training.schedule import lr_at

import helpers
from conftest import client_on

STEPS = 6
LRS = (0.001, 0.003, 0.01)
WARMUPS = (0, 2)
STOPPED_STEPS = 200
"""The ASHA test's trials' steps: many more than its rung's 10."""


def spec() -> dict:
    optimizer = helpers.FAST | {"schedule": {"kind": "cosine", "warmup_steps": 0, "min_lr_ratio": 0.1}}
    return {
        "name": "real-grid",
        "base": helpers.job_body(num_gpus=1, steps=STEPS, eval_every=3, optimizer=optimizer),
        "space": {"optimizer.lr": list(LRS), "optimizer.schedule.warmup_steps": list(WARMUPS)},
        "max_concurrent": 3,
    }


def test_a_six_trial_grid_trains_each_trial_at_its_lr_and_names_the_trial_least_in_eval_loss(client):
    created = client.post("/v1/sweeps", json=spec())
    assert created.status_code == 201, created.text
    with client_on(client) as zero1:
        sweep = zero1.get_sweep(created.json()["id"]).wait(timeout=600, interval=0.2)
        assert sweep.status == "succeeded", sweep.info
        trials = sweep.info.trials
        assert [t.status for t in trials] == ["succeeded"] * 6
        tagged = zero1.jobs(tag=sweep.info.tag)
        assert sorted(job.id for job in tagged) == sorted(t.job_id for t in trials)
        last_eval = {}
        for trial in trials:
            rows = zero1.job(trial.job_id).metrics()
            assert [row.step for row in rows] == list(range(STEPS))
            warmup = trial.values["optimizer.schedule.warmup_steps"]
            schedule = ScheduleSpec(kind="cosine", warmup_steps=warmup, min_lr_ratio=0.1)
            lr = trial.values["optimizer.lr"]
            for row in rows:  # each row trained at this trial's rate, as its schedule gives it
                assert row.lr == pytest.approx(lr_at(row.step, lr=lr, steps=STEPS, schedule=schedule), rel=1e-6)
            evaluated = [row for row in rows if row.eval_loss is not None]
            assert evaluated and math.isfinite(evaluated[-1].eval_loss)
            last_eval[trial.index] = evaluated[-1].eval_loss
            assert trial.metric == pytest.approx(last_eval[trial.index])
        best = min(last_eval, key=lambda index: (last_eval[index], index))
        assert sweep.info.best is not None and sweep.info.best.index == best
        assert sweep.best().id == trials[best].job_id
        assert sweep.info.gpu_seconds > 0


def test_asha_stops_a_clearly_bad_trial_at_its_rung_with_a_checkpoint_and_the_sweep_still_finds_the_best(client):
    body = spec() | {
        "name": "real-asha",
        "space": {"optimizer.lr": [0.01, 0.003, 1e-7]},
        "max_concurrent": 1,  # the bad trial is judged once both others have recorded the rung (bootstrap_count 2)
        "early_stopping": {"kind": "asha", "rungs": [10], "eta": 3},
    }
    # 200 steps: the bad trial's stop is asked at the tick after its rung's row is stored, and lands at its
    # next step; the steps it trains meanwhile must not reach its end
    body["base"] = body["base"] | {"steps": STOPPED_STEPS, "eval_every": 5}
    created = client.post("/v1/sweeps", json=body)
    assert created.status_code == 201, created.text
    with client_on(client) as zero1:
        sweep = zero1.get_sweep(created.json()["id"]).wait(timeout=600, interval=0.2)
        good, other, bad = sweep.info.trials
        assert (sweep.status, good.status, other.status, bad.status) == (
            "succeeded", "succeeded", "succeeded", "stopped_early"
        ), sweep.info  # fmt: skip
        assert set(bad.rungs) == {"10"} and bad.rungs["10"] > max(good.rungs["10"], other.rungs["10"])
        job = zero1.job(bad.job_id)
        assert job.events()[-1].reason.startswith("stopped early by ASHA at the rung of 10 steps: eval_loss")
        assert job.info.num_retries == 0
        rows = job.metrics()
        assert 10 <= len(rows) < STOPPED_STEPS and [row.step for row in rows] == list(range(len(rows)))
        assert max(c.step for c in job.checkpoints()) == rows[-1].step  # stopped with a checkpoint at its last row
        assert sweep.info.best is not None and sweep.info.best.index in (good.index, other.index)

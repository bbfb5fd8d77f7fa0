"""Sweeps: a job spec searched over its fields by path, planned whole before any trial starts (a 422
naming the trial that does not fit, or skip_unfit), its trials run as jobs tagged with it, at most
max_concurrent at once, the best the succeeded trial with the least metric; cancel; who sees one.
Through the API, the client and the CLI, and the real scheduler on stand-ins for Ray (tests/fakes.py),
ticked by the test, whose attempts the test ends; on SQLite and PostgreSQL.

Packages: service.experiments, service.scheduling, service.intake, service.api, service.schemas, service.client,
service.cli.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator

import pytest
from fakes import FakeClock, end_attempt, metric_row, tick
from fastapi.testclient import TestClient

from service.cli import main
from service.store.metric_rows import store_metrics
from service.store.tables import Job

import helpers
from conftest import client_on, make_settings, serve_on_fakes

ALICE, BOB = "alice-token-of-the-sweep-tests-0123456789", "bob-token-of-the-sweep-tests-0123456789"


@pytest.fixture
def api(tmp_path, database_url) -> Iterator[TestClient]:
    """The app on 4 logical GPUs whose scheduler ticks only when the test says; alice's token by default."""
    settings = make_settings(tmp_path, database_url=database_url, api_tokens=f"alice:{ALICE},bob:{BOB}")
    with serve_on_fakes(settings) as client:
        client.app.state.runtime.scheduler.stop()
        client.app.state.runtime.launcher.clock = FakeClock()
        client.headers["Authorization"] = f"Bearer {ALICE}"
        yield client


def grid(**fields) -> dict:
    return {
        "name": "lr-grid",
        "base": helpers.job_body(num_gpus=1, steps=100, eval_every=10),
        "space": {"optimizer.lr": [0.001, 0.003, 0.01], "optimizer.schedule.warmup_steps": [0, 10]},
        "max_concurrent": 2,
        **fields,
    }


def finish(api: TestClient, job_id: int, eval_loss: float | None) -> None:
    """The job's attempt ends succeeded (or failed, for None), its last evaluated row at `eval_loss`."""
    end_attempt(api.app.state.runtime, job_id, eval_loss)


def live_jobs(sweep: dict) -> list[int]:
    return [t["job_id"] for t in sweep["trials"] if t["status"] in ("queued", "starting", "running")]


def test_a_grid_runs_each_trial_as_a_tagged_job_two_at_a_time_and_names_the_best(api):
    created = api.post("/v1/sweeps", json=grid())
    assert created.status_code == 201, created.text
    sweep = created.json()
    assert [t["values"] for t in sweep["trials"]] == [
        {"optimizer.lr": lr, "optimizer.schedule.warmup_steps": w} for lr in (0.001, 0.003, 0.01) for w in (0, 10)
    ]
    assert {t["status"] for t in sweep["trials"]} == {"pending"} and sweep["best"] is None
    losses = {0: 2.5, 1: 2.4, 2: 2.1, 3: 2.2, 4: None, 5: 2.3}  # trial 4 fails
    ended = set()
    while True:
        tick(api, 2)
        sweep = api.get(f"/v1/sweeps/{sweep['id']}").json()
        live = live_jobs(sweep)
        assert len(live) <= 2, sweep
        if sweep["status"] != "running":
            break
        for trial in sweep["trials"]:
            if trial["job_id"] in live and trial["index"] not in ended:
                finish(api, trial["job_id"], losses[trial["index"]])
                ended.add(trial["index"])
    assert sweep["status"] == "succeeded" and ended == set(range(6))
    assert [t["status"] for t in sweep["trials"]] == ["succeeded"] * 4 + ["failed", "succeeded"]
    assert (sweep["best"]["index"], sweep["best"]["metric"]) == (2, 2.1)
    assert sweep["best"]["values"] == {"optimizer.lr": 0.003, "optimizer.schedule.warmup_steps": 0}

    tagged = api.get("/v1/jobs", params={"tag": sweep["tag"], "limit": 100}).json()["data"]
    assert sorted(job["id"] for job in tagged) == sorted(t["job_id"] for t in sweep["trials"])
    by_job = {t["job_id"]: t["values"] for t in sweep["trials"]}
    for job in tagged:  # each trial's job trains with its values
        values = by_job[job["id"]]
        assert job["spec"]["optimizer"]["lr"] == values["optimizer.lr"]
        assert job["spec"]["optimizer"]["schedule"]["warmup_steps"] == values["optimizer.schedule.warmup_steps"]
        assert job["owner"] == "alice" and job["tags"] == [sweep["tag"]]
    assert [s["id"] for s in api.get("/v1/sweeps").json()["data"]] == [sweep["id"]]


def test_a_trial_that_cannot_fit_is_a_422_naming_it_and_skip_unfit_runs_the_rest(api):
    space = {"model.n_embd": [32, 32768]}
    refused = api.post("/v1/sweeps", json=grid(space=space))
    assert refused.status_code == 422, refused.text
    body = refused.json()
    assert body["message"].startswith("trial 1 (model.n_embd=32768): does not fit: the per-GPU plan at N = 1")
    assert body["trial"] == 1 and body["plan"]["per_gpu"]["total_bytes"] > 80 * 10**9
    assert api.get("/v1/sweeps").json()["data"] == []  # nothing stored, no job submitted
    assert api.get("/v1/jobs").json()["data"] == []

    created = api.post("/v1/sweeps", json=grid(space=space, skip_unfit=True)).json()
    assert [t["status"] for t in created["trials"]] == ["pending", "skipped"]
    assert created["trials"][1]["skipped"].startswith("does not fit: the per-GPU plan")
    tick(api, 2)
    sweep = api.get(f"/v1/sweeps/{created['id']}").json()
    finish(api, live_jobs(sweep)[0], 2.0)
    tick(api, 2)
    sweep = api.get(f"/v1/sweeps/{created['id']}").json()
    assert (sweep["status"], sweep["best"]["index"]) == ("succeeded", 0)

    invalid = api.post("/v1/sweeps", json=grid(space={"optimizer.lr": [0.001, -1.0]}))
    assert invalid.status_code == 422, invalid.text
    assert invalid.json()["message"].startswith(
        "trial 1 (optimizer.lr=-1.0): optimizer.lr: Input should be greater than 0"
    )


def test_a_random_search_draws_the_same_trials_from_the_same_seed_within_its_ranges(api):
    space = {"optimizer.lr": {"log_uniform": [1e-4, 1e-2]}, "micro_batch_size": {"int_uniform": [1, 4]}}
    first = api.post("/v1/sweeps", json=grid(space=space, max_trials=5, seed=11)).json()
    again = api.post("/v1/sweeps", json=grid(space=space, max_trials=5, seed=11)).json()
    other = api.post("/v1/sweeps", json=grid(space=space, max_trials=5, seed=12)).json()
    values = [t["values"] for t in first["trials"]]
    assert len(values) == 5 and values == [t["values"] for t in again["trials"]]
    assert values != [t["values"] for t in other["trials"]]
    assert all(1e-4 <= v["optimizer.lr"] <= 1e-2 and v["micro_batch_size"] in (1, 2, 3, 4) for v in values)
    assert len({round(math.log10(v["optimizer.lr"]), 6) for v in values}) == 5

    for body, says in [
        (grid(space=space), "max_trials: a random search (a range in space) needs max_trials"),
        (grid(space={"optimizer.lr": {"log_uniform": [0, 1]}}, max_trials=2), "log_uniform needs low > 0 (got 0.0)"),
        (grid(space={"optimizer.lr": {"uniform": [2, 1]}}, max_trials=2), "low (2.0) must be <= high (1.0)"),
        (grid(space={"Optimizer..lr": [1]}), "is not a field's path"),
        (grid(space={"optimizer.lr": [0.1] * 20, "seed": list(range(20))}), "the grid has 400 trials, more than 256"),
    ]:
        response = api.post("/v1/sweeps", json=body)
        assert response.status_code == 422 and says in response.json()["message"], response.text


def test_cancel_ends_the_running_trials_and_skips_the_rest_and_only_the_owner_sees_or_cancels(api):
    sweep = api.post("/v1/sweeps", json=grid()).json()
    tick(api, 2)
    running = live_jobs(api.get(f"/v1/sweeps/{sweep['id']}").json())
    assert len(running) == 2
    bob = {"Authorization": f"Bearer {BOB}"}
    assert api.get(f"/v1/sweeps/{sweep['id']}", headers=bob).status_code == 404
    assert api.post(f"/v1/sweeps/{sweep['id']}/cancel", headers=bob).status_code == 404
    assert api.get("/v1/sweeps", headers=bob).json()["data"] == []

    cancelled = api.post(f"/v1/sweeps/{sweep['id']}/cancel")
    assert cancelled.status_code == 202, cancelled.text
    assert cancelled.json()["status"] == "cancelled"
    assert [t["skipped"] for t in cancelled.json()["trials"][2:]] == ["the sweep was cancelled first"] * 4
    tick(api, 2)
    assert {api.get(f"/v1/jobs/{job_id}").json()["status"] for job_id in running} == {"cancelled"}
    assert len(api.get("/v1/jobs").json()["data"]) == 2  # no trial submitted after the cancel
    again = api.post(f"/v1/sweeps/{sweep['id']}/cancel")
    assert again.status_code == 409 and "only a running or suspended sweep can be cancelled" in again.text


def test_the_client_runs_a_sweep_waits_for_it_and_opens_its_best_trials_job(api):
    with client_on(api, ALICE) as client:
        sweep = client.sweep(grid(max_concurrent=6))
        assert (sweep.status, sweep.done, len(sweep.info.trials)) == ("running", False, 6)
        ended = set()
        while not sweep.refresh().done:
            tick(api, 2)
            for trial in sweep.refresh().info.trials:  # 4 GPUs: 4 at once
                if trial.status in ("starting", "running") and trial.index not in ended:
                    finish(api, trial.job_id, 2.0 + abs(trial.index - 3) / 10)  # trial 3 least
                    ended.add(trial.index)
        assert sweep.wait(timeout=60).status == "succeeded"
        best = sweep.best()
        assert best is not None and best.id == sweep.info.trials[3].job_id and best.status == "succeeded"
        other = client.sweep(grid(name="other"))
        assert (other.suspend().status, other.done) == ("suspended", False)
        assert (other.resume().status, other.refresh().status) == ("running", "running")
        assert (other.cancel().status, other.done) == ("cancelled", True)
        assert [s.id for s in client.sweeps()] == [other.id, sweep.id]


def test_the_cli_starts_a_sweep_and_shows_its_trials_and_best(api, cli_as, tmp_path, capsys):
    spec = tmp_path / "sweep.json"
    spec.write_text(json.dumps(grid(space={"optimizer.lr": [0.001, 0.01]})))
    cli_as(ALICE)
    assert main(["sweep", str(spec)]) == 0, capsys.readouterr().err
    lines = capsys.readouterr().out.splitlines()
    sweep_id = int(re.match(r"sweep (\d+) lr-grid: running, best none yet; its jobs are tagged sweep:\1$", lines[0])[1])
    assert lines[1].split() == ["trial", "job", "status", "eval_loss", "values"]
    assert [line.split()[:5] for line in lines[2:]] == [
        ["0", "-", "pending", "-", "optimizer.lr=0.001"],
        ["1", "-", "pending", "-", "optimizer.lr=0.01"],
    ]
    assert lines[2].endswith("(waits its turn: 0 of the sweep's trials have not ended (max_concurrent 2))")
    tick(api, 2)
    jobs = [t["job_id"] for t in api.get(f"/v1/sweeps/{sweep_id}").json()["trials"]]
    finish(api, jobs[0], 2.5)
    finish(api, jobs[1], 2.25)
    tick(api, 2)
    assert main(["sweeps", str(sweep_id)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"sweep {sweep_id} lr-grid: succeeded, best trial 1 (job {jobs[1]}, eval_loss 2.2500)")
    assert out[3].split() == ["1", str(jobs[1]), "succeeded", "2.2500", "optimizer.lr=0.01"]
    assert main(["sweeps"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split() == [str(sweep_id), "succeeded", "2", "lr-grid"]
    cli_as(BOB)
    assert main(["sweeps", str(sweep_id)]) == 1
    assert f"404 no sweep with id {sweep_id}" in capsys.readouterr().err

    cli_as(ALICE)
    other = api.post("/v1/sweeps", json=grid(name="other")).json()["id"]
    for action, status in [("--suspend", "suspended"), ("--resume", "running"), ("--cancel", "cancelled")]:
        assert main(["sweeps", str(other), action]) == 0, capsys.readouterr().err
        assert capsys.readouterr().out.startswith(f"sweep {other} other: {status},")
    assert main(["sweeps", "--resume"]) == 2
    assert "--resume needs a sweep's ID" in capsys.readouterr().err


def test_a_trial_that_cannot_be_submitted_when_its_turn_comes_is_skipped_saying_why_and_the_tick_goes_on(api):
    base = helpers.job_body(num_gpus=1, steps=100, depends_on=[10**9])  # checked as each trial is submitted
    sweep = api.post("/v1/sweeps", json=grid(base=base, space={"optimizer.lr": [0.001, 0.01]})).json()
    other = api.post("/v1/jobs", json=helpers.job_body(num_gpus=1)).json()["id"]
    tick(api, 2)
    shown = api.get(f"/v1/sweeps/{sweep['id']}").json()
    assert [t["status"] for t in shown["trials"]] == ["skipped", "skipped"]
    assert shown["trials"][0]["skipped"] == "could not be submitted: depends_on: no job with id 1000000000"
    assert shown["status"] == "failed"  # every trial ended (none ran), none succeeded
    assert api.get(f"/v1/jobs/{other}").json()["status"] == "running"  # the ticks went on


def train(api: TestClient, job_id: int, *, through: int, eval_loss: float, eval_at: int) -> None:
    """The job's rows for steps 0..through, its loss falling, evaluated at step `eval_at` only."""
    runtime = api.app.state.runtime
    with runtime.db.session() as session:
        job = session.get(Job, job_id)
        steps = range((job.step or -1) + 1, through + 1)
        rows = [metric_row(s, loss=3.0 - s / 100, eval_loss=eval_loss if s == eval_at else None) for s in steps]
        store_metrics(session, job, rows)


def asha(**fields) -> dict:
    """lr 1e-3 and 3e-3 train; 0.3 and 1.0 diverge (the test says so by their eval loss at the rung)."""
    return grid(
        space={"optimizer.lr": [0.001, 0.003, 0.3, 1.0, 0.01]},
        early_stopping={"kind": "asha", "rungs": [5], "eta": 3},
        **fields,
    )


def test_asha_stops_the_trials_behind_at_a_rung_saying_why_and_the_next_trial_takes_their_gpus_in_that_tick(api):
    sweep = api.post("/v1/sweeps", json=asha()).json()
    assert sweep["early_stopping"] == {"kind": "asha", "rungs": [5], "eta": 3, "bootstrap_count": None}
    url = f"/v1/sweeps/{sweep['id']}"
    tick(api, 2)
    first = live_jobs(api.get(url).json())
    assert len(first) == 2
    for job_id, at_rung in zip(first, (2.0, 2.1), strict=True):  # the second worse, but judged by one value only
        train(api, job_id, through=5, eval_loss=at_rung, eval_at=4)
    tick(api)
    sweep = api.get(url).json()
    assert [t["rungs"] for t in sweep["trials"][:2]] == [{"5": 2.0}, {"5": 2.1}]
    assert [api.get(f"/v1/jobs/{job_id}").json()["status"] for job_id in first] == ["running", "running"]
    for job_id, final in zip(first, (1.5, 1.4), strict=True):
        finish(api, job_id, final)
    tick(api, 2)
    sweep = api.get(url).json()
    assert [t["status"] for t in sweep["trials"]][:2] == ["succeeded", "succeeded"]
    bad = live_jobs(sweep)
    assert [t["index"] for t in sweep["trials"] if t["job_id"] in bad] == [2, 3]
    for job_id, at_rung in zip(bad, (4.0, 9.0), strict=True):
        train(api, job_id, through=6, eval_loss=at_rung, eval_at=4)
    tick(api)  # the rung judged: both asked to stop, at their next step with a checkpoint
    tick(api)  # the stop asked of each attempt
    assert [api.get(f"/v1/jobs/{job_id}").json()["status"] for job_id in bad] == ["running", "running"]
    tick(api)  # each attempt stopped: both end stopped_early, and trial 4 is submitted and starts
    sweep = api.get(url).json()
    assert [t["status"] for t in sweep["trials"]][2:4] == ["stopped_early", "stopped_early"]
    assert sweep["trials"][4]["status"] in ("starting", "running")
    cut = 2.0 + (2.1 - 2.0) / 3  # the 100/3-th percentile of the two values before, interpolated
    assert sweep["trials"][2]["rungs"] == {"5": 4.0} and sweep["trials"][3]["rungs"] == {"5": 9.0}
    reasons = [api.get(f"/v1/jobs/{job_id}/events").json()["data"][-1]["reason"] for job_id in bad]
    assert reasons[0] == (
        "stopped early by ASHA at the rung of 5 steps: eval_loss 4 is past the best 1/3 of the 2 trial(s) "
        f"before it there (cutoff {cut:.4g})"
    )
    assert reasons[1].startswith(
        "stopped early by ASHA at the rung of 5 steps: eval_loss 9 is past the best 1/3 of the 3"
    )
    assert [api.get(f"/v1/jobs/{job_id}").json()["num_retries"] for job_id in bad] == [0, 0]

    finish(api, sweep["trials"][4]["job_id"], 1.6)
    tick(api, 2)
    sweep = api.get(url).json()
    assert sweep["status"] == "succeeded" and sweep["best"]["index"] == 1
    assert sweep["gpu_seconds"] >= 0


def test_asha_cutoff_is_ray_tunes_percentile_once_bootstrap_count_values_are_recorded():
    import numpy as np

    from service.experiments.early_stopping import cutoff

    draw = np.random.default_rng(3)
    for eta in (2, 3, 4):
        for count in (1, 2, 5, 9):
            values = draw.normal(size=count).tolist()
            assert cutoff(values, eta) == pytest.approx(np.percentile(values, 100 / eta))
            assert cutoff(values, eta, bootstrap=count + 1) is None  # too few values recorded before
            assert cutoff(values, eta, bootstrap=count) == cutoff(values, eta)
    assert cutoff([], 3) is None


def test_a_rung_at_or_past_the_trials_steps_or_not_increasing_is_a_422(api):
    late = api.post("/v1/sweeps", json=grid(early_stopping={"rungs": [10, 100]}))
    assert late.status_code == 422
    assert "early_stopping.rungs: its last rung (100) must be < steps (100)" in late.json()["message"]
    unordered = api.post("/v1/sweeps", json=grid(early_stopping={"rungs": [10, 5]}))
    assert unordered.status_code == 422 and "give increasing step counts >= 1, not [10, 5]" in unordered.text


def test_a_suspended_sweep_suspends_its_trials_and_submits_none_until_it_resumes(api):
    sweep = api.post("/v1/sweeps", json=grid()).json()
    url = f"/v1/sweeps/{sweep['id']}"
    tick(api, 2)
    running = live_jobs(api.get(url).json())
    waiting = api.get(url).json()["trials"][2]
    assert waiting["reason"] == "waits its turn: 2 of the sweep's trials have not ended (max_concurrent 2)"
    assert api.post(f"{url}/resume").status_code == 409
    suspended = api.post(f"{url}/suspend")
    assert suspended.status_code == 202 and suspended.json()["status"] == "suspended"
    tick(api, 3)
    sweep = api.get(url).json()
    assert [t["status"] for t in sweep["trials"]] == ["suspended"] * 2 + ["pending"] * 4
    assert sweep["trials"][0]["reason"] == "suspended with the sweep"
    assert sweep["trials"][2]["reason"] == "the sweep is suspended"
    assert api.post(f"{url}/suspend").status_code == 409
    bob = {"Authorization": f"Bearer {BOB}"}
    assert api.post(f"{url}/resume", headers=bob).status_code == 404

    resumed = api.post(f"{url}/resume")
    assert resumed.status_code == 202 and resumed.json()["status"] == "running"
    tick(api, 2)
    sweep = api.get(url).json()
    assert live_jobs(sweep) == running and len(api.get("/v1/jobs").json()["data"]) == 2


def test_a_trial_whose_job_waits_in_the_queue_says_why_as_the_queue_does(api):
    blocker = api.post("/v1/jobs", json=helpers.job_body(num_gpus=4, steps=100, priority=90)).json()
    tick(api, 2)
    sweep = api.post("/v1/sweeps", json=grid()).json()
    tick(api, 2)
    sweep = api.get(f"/v1/sweeps/{sweep['id']}").json()
    queued = [t for t in sweep["trials"] if t["status"] == "queued"]
    assert len(queued) == 2 and api.get(f"/v1/jobs/{blocker['id']}").json()["status"] == "running"
    in_queue = {entry["id"]: entry["reason"] for entry in api.get("/v1/queue").json()["data"]}
    assert [t["reason"] for t in queued] == [in_queue[t["job_id"]] for t in queued]
    assert all(t["reason"] for t in queued)

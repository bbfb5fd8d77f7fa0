"""Sweeps: a job spec searched over its fields by path, planned whole before any trial starts (a 422
naming the trial that does not fit, or skip_unfit), its trials run as jobs tagged with it, at most
max_concurrent at once, the best the succeeded trial with the least metric; cancel; who sees one.
Through the API, the client and the CLI, and the real scheduler on stand-ins for Ray (tests/fakes.py),
ticked by the test, whose attempts the test ends; on SQLite and PostgreSQL.

Packages: service.scheduling, service.api, service.schemas, service.client, service.cli.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator

import pytest
from fakes import FakeClock
from fastapi.testclient import TestClient

from service.cli import main
from service.store.metric_rows import store_metrics
from service.store.tables import Job
from workers.records import AttemptPoll, AttemptStatus, MetricRow

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


def tick(api: TestClient, count: int = 1) -> None:
    for _ in range(count):
        api.app.state.runtime.scheduler.tick()


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
    runtime = api.app.state.runtime
    with runtime.db.session() as session:
        job = session.get(Job, job_id)
        row = MetricRow(
            step=9, loss=3.0, grad_norm=1.0, loss_scale=1.0, skipped=False, step_time_s=0.1,
            tokens_per_s=1.0, mem_peak_bytes=(1,), mem_planned_bytes=1, eval_loss=eval_loss,
        )  # fmt: skip
        store_metrics(session, job, [row])
        attempt = job.attempt
    status = AttemptStatus.FAILED if eval_loss is None else AttemptStatus.SUCCEEDED
    runtime.launcher.attempts[(job_id, attempt)].ended = AttemptPoll(status=status, nodes=("node-0",))


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
    assert again.status_code == 409 and "only a running sweep can be cancelled" in again.text


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
        assert other.cancel().status == "cancelled"
        assert [s.id for s in client.sweeps()] == [other.id, sweep.id]


def test_the_cli_starts_a_sweep_and_shows_its_trials_and_best(api, cli_as, tmp_path, capsys):
    spec = tmp_path / "sweep.json"
    spec.write_text(json.dumps(grid(space={"optimizer.lr": [0.001, 0.01]})))
    cli_as(ALICE)
    assert main(["sweep", str(spec)]) == 0, capsys.readouterr().err
    lines = capsys.readouterr().out.splitlines()
    sweep_id = int(re.match(r"sweep (\d+) lr-grid: running, best none yet; its jobs are tagged sweep:\1$", lines[0])[1])
    assert lines[1].split() == ["trial", "job", "status", "eval_loss", "values"]
    assert [line.split() for line in lines[2:]] == [
        ["0", "-", "pending", "-", "optimizer.lr=0.001"],
        ["1", "-", "pending", "-", "optimizer.lr=0.01"],
    ]
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

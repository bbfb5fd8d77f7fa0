"""MLflow and sweeps: with ZERO1_MLFLOW_TRACKING_URI set, a sweep is one parent run in its owner's
experiment on a real `mlflow server` (tests/test_mlflow.py's), named as the sweep and holding its space as
params; each trial's run is nested under it (`mlflow.parentRunId`) with its values; once the sweep ends,
the parent ends too, FINISHED with the best trial's job and metric (KILLED for a cancelled sweep). An
exporter restarted after a crash between making the parent and recording it finds that parent again
rather than making a second. The sweeps run on the stand-in launcher (tests/fakes.py), ticked by the
test, whose attempts the test ends; the app's exporter thread sends, and the test polls MLflow.

Packages: service.tracking, service.scheduling, service.store.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fakes import FakeClock, end_attempt, tick
from fastapi.testclient import TestClient
from test_mlflow import MlflowServer, mlflow_client

from service.store.tables import MlflowRun, MlflowSweepRun
from service.tracking.exporter import Exporter

import helpers
from conftest import make_settings, serve_on_fakes

ALICE = "alice-token-of-the-mlflow-sweep-tests-0123456789"
LRS = [0.001, 0.003, 0.01]
EVAL_LOSSES = {0: 2.5, 1: 2.1, 2: 2.3}
"""Each trial's last eval_loss: trial 1 is the best."""


@pytest.fixture
def api(request, tmp_path, mlflow_server) -> Iterator[TestClient]:
    """The app on 4 logical GPUs, exporting to the server, whose scheduler ticks only when the test says;
    alice's token. Each test's database numbers its sweeps and jobs from 1: an experiment of its own."""
    settings = make_settings(
        tmp_path,
        api_tokens=f"alice:{ALICE}",
        mlflow_tracking_uri=mlflow_server.uri,
        mlflow_experiment=f"zero1-sweeps-{request.node.name}",
        mlflow_interval_s=0.2,
        mlflow_max_backoff_s=2,
    )
    with serve_on_fakes(settings) as client:
        client.app.state.runtime.scheduler.stop()
        client.app.state.runtime.launcher.clock = FakeClock()
        client.headers["Authorization"] = f"Bearer {ALICE}"
        yield client


def experiment_of(api: TestClient) -> str:
    return f"{api.app.state.runtime.settings.mlflow_experiment}/alice"


def finish(api: TestClient, job_id: int, eval_loss: float) -> None:
    """The job's attempt ends succeeded, its last evaluated row at `eval_loss`."""
    end_attempt(api.app.state.runtime, job_id, eval_loss)


def sweep_body(**fields) -> dict:
    return {
        "name": "lr-sweep",
        "base": helpers.job_body(num_gpus=1, steps=100, eval_every=10),
        "space": {"optimizer.lr": LRS},
        "max_concurrent": 2,
        **fields,
    }


def runs_of(server: MlflowServer, experiment: str, sweep_id: int) -> tuple[list, list]:
    """The sweep's runs in `experiment` (all tagged zero1.sweep_id): (parents, trials' runs by index)."""
    client = mlflow_client(server)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return [], []
    tagged = client.search_runs([found.experiment_id], filter_string=f"tags.`zero1.sweep_id` = '{sweep_id}'")
    parents = [run for run in tagged if "mlflow.parentRunId" not in run.data.tags]
    trials = [run for run in tagged if "mlflow.parentRunId" in run.data.tags]
    return parents, sorted(trials, key=lambda run: int(run.data.tags["zero1.trial_index"]))


def test_a_sweep_is_a_parent_run_its_trials_nested_and_it_ends_with_the_best_trial(api, mlflow_server):
    experiment = experiment_of(api)
    created = api.post("/v1/sweeps", json=sweep_body())
    assert created.status_code == 201, created.text
    sweep_id = created.json()["id"]
    tick(api, 2)  # trials 0 and 1 start: the parent is made with the first trial's run
    parents, trials = helpers.wait_for(
        lambda: runs_of(mlflow_server, experiment, sweep_id),
        lambda found: len(found[1]) == 2,
        what="the first two trials' runs",
        timeout_s=60,
        interval_s=0.2,
    )
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.run_name == "lr-sweep" and parent.info.status == "RUNNING"
    assert parent.data.params["space.optimizer.lr"] == str(LRS)
    assert (parent.data.params["metric"], parent.data.params["max_concurrent"]) == ("eval_loss", "2")
    assert "base.steps" not in parent.data.params  # the base is each trial's: its params hold the spec
    assert (parent.data.tags["zero1.owner"], parent.data.tags["zero1.status"]) == ("alice", "running")

    ended = set()
    while (sweep := api.get(f"/v1/sweeps/{sweep_id}").json())["status"] == "running":
        for trial in sweep["trials"]:
            if trial["status"] == "running" and trial["index"] not in ended:
                finish(api, trial["job_id"], EVAL_LOSSES[trial["index"]])
                ended.add(trial["index"])
        tick(api, 2)
    assert sweep["status"] == "succeeded" and sweep["best"]["index"] == 1
    jobs = [trial["job_id"] for trial in sweep["trials"]]

    parents, trials = helpers.wait_for(
        lambda: runs_of(mlflow_server, experiment, sweep_id),
        lambda found: len(found[0]) == 1 and found[0][0].info.status != "RUNNING",
        what="the parent run's end",
        timeout_s=60,
        interval_s=0.2,
    )
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.data.tags["zero1.status"] == "succeeded"
    assert parent.data.tags["zero1.best_job_id"] == str(jobs[1])
    assert parent.data.tags["zero1.best_trial_index"] == "1"
    assert parent.data.metrics == {"best_eval_loss": 2.1}
    assert [run.data.tags["zero1.job_id"] for run in trials] == [str(job) for job in jobs]
    for index, run in enumerate(trials):  # each nested under the parent, with its values; ended first
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert run.data.tags["zero1.trial_index"] == str(index)
        assert run.data.tags["zero1.trial.optimizer.lr"] == str(LRS[index])
        assert run.data.params["optimizer.lr"] == str(LRS[index])
        assert run.info.status == "FINISHED" and run.info.experiment_id == parent.info.experiment_id

    # A crash after the parent and a trial's run were made, before either was recorded: the restarted
    # exporter finds both again by their tags (zero1.sweep_key, zero1.job_key) and ends the parent again.
    runtime = api.app.state.runtime
    runtime.exporter.stop()
    with runtime.db.session() as session:
        parent_cursor = session.get(MlflowSweepRun, sweep_id)
        parent_cursor.run_id = None
        parent_cursor.done = False
        trial_cursor = session.get(MlflowRun, jobs[0])
        trial_cursor.run_id = None
        trial_cursor.done = False
    restarted = Exporter(db=runtime.db, settings=runtime.settings, storage=runtime.storage)
    helpers.wait_for(restarted.run_once, lambda more: not more, what="the restarted exporter's pass", timeout_s=60)
    with runtime.db.session() as session:
        recorded = session.get(MlflowSweepRun, sweep_id)
        assert (recorded.run_id, recorded.done) == (parent.info.run_id, True)
        assert session.get(MlflowRun, jobs[0]).run_id == trials[0].info.run_id
    again_parents, again_trials = runs_of(mlflow_server, experiment, sweep_id)
    assert [run.info.run_id for run in again_parents] == [parent.info.run_id]
    assert [run.info.run_id for run in again_trials] == [run.info.run_id for run in trials]
    assert again_parents[0].info.status == "FINISHED" and again_parents[0].data.metrics == {"best_eval_loss": 2.1}


def test_a_cancelled_sweeps_parent_ends_killed_with_no_best(api, mlflow_server):
    experiment = experiment_of(api)
    sweep_id = api.post("/v1/sweeps", json=sweep_body()).json()["id"]
    tick(api, 2)
    helpers.wait_for(
        lambda: runs_of(mlflow_server, experiment, sweep_id),
        lambda found: len(found[0]) == 1 and len(found[1]) == 2,
        what="the parent and the first two trials' runs",
        timeout_s=60,
        interval_s=0.2,
    )
    assert api.post(f"/v1/sweeps/{sweep_id}/cancel").status_code == 202
    tick(api, 2)
    parents, trials = helpers.wait_for(
        lambda: runs_of(mlflow_server, experiment, sweep_id),
        lambda found: len(found[0]) == 1 and found[0][0].info.status != "RUNNING",
        what="the parent run's end",
        timeout_s=60,
        interval_s=0.2,
    )
    parent = parents[0]
    assert parent.info.status == "KILLED" and parent.data.tags["zero1.status"] == "cancelled"
    assert "zero1.best_job_id" not in parent.data.tags and parent.data.metrics == {}
    assert [run.info.status for run in trials] == ["KILLED", "KILLED"]  # trial 2 never ran: no run

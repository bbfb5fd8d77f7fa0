"""Where a job's files live and what a finished job keeps, asked of service.store's JobStorage alone:
no Ray, no service, a tmp dir and the Job rows the service stores (transient here).

Packages: service.store.
"""

from __future__ import annotations

import os
import stat

from service.store.job_storage import JobStorage, checkpoint_dirname, dataset_cache_dir
from service.store.tables import Job
from workers.records import MetricRow, RunAs
from workers.training.checkpoints import COMPLETE, FINAL, step_dir, write_json
from workers.training.storage import ObjectStore

from conftest import make_settings


def checkpointed(job_dir, step: int, *, complete: bool = True, loss: float = 1.0) -> None:
    """A checkpoint at `step` as a one-rank job writes it: its shard, its rows, then its marker."""
    directory = step_dir(job_dir, step)
    directory.mkdir(parents=True)
    (directory / "rank-00000-of-00001.safetensors").write_bytes(b"shard")
    row = MetricRow(
        step=step,
        loss=loss,
        grad_norm=1.0,
        loss_scale=1.0,
        skipped=False,
        step_time_s=0.02,
        tokens_per_s=1000.0,
        mem_peak_bytes=(1_000,),
        mem_planned_bytes=1_000,
        rank=0,
    )
    write_json(directory / "rank-00000-of-00001.metrics.json", [row.to_json()])
    if complete:
        write_json(directory / COMPLETE, {"step": step, "world_size": 1})


def test_a_jobs_place_is_job_id_run_id_under_the_checkpoint_uri(tmp_path):
    storage = JobStorage(make_settings(tmp_path))
    job = Job(id=7, run_id="abc123", owner="alice")
    assert checkpoint_dirname(7, "abc123") == "job-7-abc123"
    assert checkpoint_dirname(7, None) == "job-7"  # a job stored before run ids existed
    assert storage.checkpoint_uri(job) == str(tmp_path / "checkpoints" / "job-7-abc123")
    assert storage.checkpoint_dir(job) == tmp_path / "checkpoints" / "job-7-abc123"
    assert storage.dataset_cache_dir == dataset_cache_dir(str(tmp_path / "checkpoints"))
    assert storage.dataset_cache_dir == (tmp_path / "checkpoints").resolve() / "datasets"


def test_on_an_object_store_a_job_is_a_prefix_and_no_directory_is_made(tmp_path):
    settings = make_settings(tmp_path, checkpoint_uri="s3://bucket/ckpt/", local_dir=str(tmp_path / "local"))
    nobody = RunAs(65534, 65534)
    storage = JobStorage(settings, run_as=lambda owner: nobody if owner == "alice" else None)
    job = Job(id=3, run_id="r1", owner="alice")
    assert storage.checkpoint_uri(job) == "s3://bucket/ckpt/job-3-r1"  # join_uri: one slash
    found = storage.checkpoint_dir(job)
    assert isinstance(found, ObjectStore) and found.uri == "s3://bucket/ckpt/job-3-r1"
    assert storage.prepare_job_dir(job) == (None, nobody)  # each rank's parent makes its home on its node
    assert not (tmp_path / "local").exists()


def test_a_jobs_directory_is_made_private_before_its_ranks_start(tmp_path):
    storage = JobStorage(make_settings(tmp_path))
    job = Job(id=1, run_id="x", owner="bob")
    directory, run_as = storage.prepare_job_dir(job)
    assert directory == storage.checkpoint_uri(job) and run_as is None
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700


def test_a_relaunch_resumes_after_the_latest_complete_checkpoint(tmp_path):
    storage = JobStorage(make_settings(tmp_path))
    job = Job(id=2, run_id="r", owner="alice")
    assert storage.resume_step(job) == 0  # no directory yet: from the start
    job_dir = storage.checkpoint_dir(job)
    checkpointed(job_dir, 4)
    checkpointed(job_dir, 9)
    checkpointed(job_dir, 14, complete=False)  # being written when the attempt died
    assert storage.resume_step(job) == 10
    rows = storage.checkpointed_metrics(job, after_step=4)
    assert [row.step for row in rows] == [9]  # the unfinished checkpoint's rows are not read


def test_a_finished_job_keeps_its_newest_complete_checkpoints_and_final_model(tmp_path):
    storage = JobStorage(make_settings(tmp_path, checkpoint_keep_finished=2))
    job = Job(id=5, run_id="r", owner="alice")
    job_dir = storage.checkpoint_dir(job)
    for step in (1, 3, 5, 7):
        checkpointed(job_dir, step)
    checkpointed(job_dir, 8, complete=False)
    (job_dir / FINAL).mkdir()
    (job_dir / FINAL / "model.safetensors").write_bytes(b"weights")
    (job_dir / "tmp").mkdir()  # the children's scratch
    (job_dir / "tmp" / "left.txt").write_text("scratch")
    storage.retire(job)
    assert sorted(p.name for p in job_dir.iterdir()) == [FINAL, "step-000000005", "step-000000007"]
    assert (job_dir / FINAL / "model.safetensors").read_bytes() == b"weights"
    assert storage.resume_step(job) == 8


def test_keep_finished_0_leaves_the_final_model_alone(tmp_path):
    storage = JobStorage(make_settings(tmp_path, checkpoint_keep_finished=0))
    job = Job(id=6, run_id="r", owner="alice")
    job_dir = storage.checkpoint_dir(job)
    checkpointed(job_dir, 2)
    (job_dir / FINAL).mkdir()
    storage.retire(job)
    assert [p.name for p in job_dir.iterdir()] == [FINAL]


def test_retiring_a_job_that_wrote_nothing_is_no_error(tmp_path):
    storage = JobStorage(make_settings(tmp_path))
    job = Job(id=8, run_id="r", owner="alice")
    storage.retire(job)
    storage.discard_stored_metrics(job, through_step=100)
    assert not storage.checkpoint_dir(job).exists()

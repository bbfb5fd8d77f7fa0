"""GPU usage of jobs trained for real: two tiny GPTs on the session's Ray cluster (1 GPU at priority 70, 2 GPUs
at priority 50, checkpointing), then GET /v1/usage against what their events, their start and end, and their
stored rows say, and the counters of /metrics. tests/test_usage.py has the definitions and the page.

Packages: service.scheduling, service.api, workers.training.
"""

from __future__ import annotations

from datetime import datetime

import pytest
from prometheus_client.parser import text_string_to_metric_families

import helpers


def _time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def test_usage_sums_equal_the_gpu_seconds_of_real_jobs_events_and_rows(client):
    submitted = {
        70: client.post("/v1/jobs", json=helpers.job_body(name="one", num_gpus=1, steps=12, priority=70)).json(),
        50: client.post(
            "/v1/jobs", json=helpers.job_body(name="two", num_gpus=2, steps=12, priority=50, checkpoint_every=4)
        ).json(),
    }
    jobs = {
        priority: helpers.wait_job(client, job["id"], lambda j: j["status"] in helpers.TERMINAL, timeout_s=600)
        for priority, job in submitted.items()
    }
    assert all(job["status"] == "succeeded" for job in jobs.values()), jobs
    shown = client.get("/v1/usage").json()
    rows = {row["priority_class"]: row for row in shown["data"]}
    assert sorted(rows) == [50, 70] and all(row["owner"] is None for row in rows.values())

    for priority, job in jobs.items():
        events = client.get(f"/v1/jobs/{job['id']}/events").json()["data"]
        from_events = sum(
            event["gpus"] * (_time(after["at"]) - _time(event["at"])).total_seconds()
            for event, after in zip(events, events[1:], strict=False)
        )
        start_to_end = job["num_gpus"] * (_time(job["finished_at"]) - _time(job["started_at"])).total_seconds()
        metrics = client.get(f"/v1/jobs/{job['id']}/metrics").json()["data"]
        trained = sum(row["step_time_s"] * row["world_size"] for row in metrics)
        row = rows[priority]
        assert row["gpu_seconds_held"] == pytest.approx(from_events, rel=0.01), (priority, events)
        assert row["gpu_seconds_held"] == pytest.approx(start_to_end, rel=0.01)
        assert row["gpu_seconds_training"] == pytest.approx(trained, rel=0.01)
        assert 0 < row["gpu_seconds_training"] < row["gpu_seconds_held"]  # starting, loading, the checkpoints' writes
    assert any(row["checkpoint_blocked_s"] for row in client.get(f"/v1/jobs/{jobs[50]['id']}/metrics").json()["data"])

    counters: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name in ("zero1_gpu_seconds_held_total", "zero1_gpu_seconds_training_total"):
                counters[(sample.name, sample.labels["priority_class"])] = sample.value
    for priority, row in rows.items():
        assert counters[("zero1_gpu_seconds_training_total", str(priority))] == pytest.approx(
            row["gpu_seconds_training"], rel=0.01
        )
        assert counters[("zero1_gpu_seconds_held_total", str(priority))] == pytest.approx(
            row["gpu_seconds_held"], rel=0.01
        )

"""Elastic jobs end to end: min_gpus, admission, starting small, growing at a checkpoint, shrinking
after a rank dies, each attempt resharding the optimizer state it resumes from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import make_settings, serve
from helpers import FAST, TERMINAL, job_body, wait_for
from test_faults import final_shards, kill_rank, transitions

STEPS, EVERY = 80, 8


@pytest.fixture
def elastic_app(ray_cluster, tmp_path):
    """The app with no wait between an elastic job's resizes."""
    settings = make_settings(tmp_path, elastic_grow_interval_s=0)
    with serve(settings) as client:
        yield client, settings


def _flat_state(shards: list[dict]) -> list[torch.Tensor]:
    """Each flat buffer's fp32 master copy, whole: the shards' owned slices in rank order."""
    return [torch.cat([s["buffers"][i]["master"] for s in shards]) for i in range(len(shards[0]["buffers"]))]


def _resumed_from(event: dict) -> int:
    return int(event["reason"].split("resumes from checkpoint step ")[1].split()[0].rstrip(":;,")) + 1


def test_an_elastic_job_starts_small_grows_shrinks_and_ends_where_an_unresized_run_ends(elastic_app):
    client, settings = elastic_app
    # eps well above the second moment's smallest entries: where Adam divides by sqrt(v) ~ 0, the
    # summation order's last bit would be amplified into the update
    optimizer = {**FAST, "eps": 1e-6}
    body = job_body(
        steps=STEPS, checkpoint_every=EVERY, num_gpus=4, micro_batch_size=2, max_retries=2, optimizer=optimizer
    )
    job = lambda job_id: client.get(f"/v1/jobs/{job_id}").json()
    submit = lambda **overrides: client.post("/v1/jobs", json={**body, **overrides}).json()["id"]

    reference = submit(name="unresized")
    wait_for(lambda: job(reference), lambda j: j["status"] in TERMINAL, what="the unresized run")
    assert job(reference)["status"] == "succeeded"

    blocker = submit(name="blocker", num_gpus=2, steps=1_000_000, checkpoint_every=0, max_retries=0)
    wait_for(lambda: job(blocker), lambda j: j["status"] == "running", what="the blocker running")
    elastic = submit(name="elastic", min_gpus=2)
    started = wait_for(lambda: job(elastic), lambda j: (j["step"] or -1) >= 3, what="the elastic job at step 3")
    assert (started["world_size"], started["min_gpus"], started["num_gpus"]) == (2, 2, 4)

    client.post(f"/v1/jobs/{blocker}/cancel")  # 2 GPUs free, no job queued: it grows at its next checkpoint
    grown = wait_for(lambda: job(elastic), lambda j: j["world_size"] == 4 and j["status"] == "running", what="4")
    assert grown["num_retries"] == 0  # a resize to grow spends no retry

    second = submit(name="blocker-again", num_gpus=2, steps=1_000_000, checkpoint_every=0, max_retries=0)
    events = client.get(f"/v1/jobs/{elastic}/events").json()["data"]
    grew_at = _resumed_from([e for e in events if e["to_status"] == "restarting"][-1])
    # past a checkpoint at 4 (steps at 4 survive the retry) and short of the end
    wait_for(lambda: job(elastic), lambda j: (j["step"] or 0) >= grew_at + EVERY + 2, what="a checkpoint at 4")
    kill_rank(settings.ray_namespace, elastic, attempt=grown["attempt"], rank=3)
    # the retry leaves the queued job the 2 GPUs it needs, and resumes on the other 2
    wait_for(lambda: job(second), lambda j: j["status"] == "running", what="the second blocker running")
    done = wait_for(lambda: job(elastic), lambda j: j["status"] in TERMINAL, what="the elastic job's end")
    client.post(f"/v1/jobs/{second}/cancel")
    assert done["status"] == "succeeded", done
    assert (done["world_size"], done["num_retries"]) == (2, 1)

    events = client.get(f"/v1/jobs/{elastic}/events").json()["data"]
    grow, shrink = "restarting", "restarting"
    assert transitions(events) == ["queued", "starting", "running", grow, "running", shrink, "running", "succeeded"]
    assert "2 GPUs free: placing 2 ranks (elastic: it runs at N in [2, 4])" in events[1]["reason"]
    assert events[3]["reason"].startswith("resized 2 -> 4: GPUs free and no job queued: attempt 1 resumes"), events
    assert events[5]["reason"].startswith("resized 4 -> 2: rank 3 on node "), events
    assert "retry 1 of 2" in events[5]["reason"]
    assert [e["reason"].split(" ranks placed")[0] for e in events if e["to_status"] == "running"] == [
        "2",
        "attempt 1: 4",
        "attempt 2: 2",
    ]
    assert events[-1]["reason"] == f"all 2 ranks finished step {STEPS - 1}"

    curve = client.get(f"/v1/jobs/{elastic}/metrics", params={"limit": 10_000}).json()["data"]
    assert [m["step"] for m in curve] == list(range(STEPS))  # every step once
    sizes = [m["world_size"] for m in curve]
    assert sizes[0] == 2 and 4 in sizes and sizes[-1] == 2
    assert [n for i, n in enumerate(sizes) if i == 0 or n != sizes[i - 1]] == [2, 4, 2]
    assert all(len(m["mem_peak_bytes"]) == m["world_size"] for m in curve)
    unresized = client.get(f"/v1/jobs/{reference}/metrics", params={"limit": 10_000}).json()["data"]
    worst = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(curve, unresized, strict=True))
    assert worst <= 1e-4, worst

    checkpoints = Path(settings.checkpoint_uri)
    resized = _flat_state(final_shards(settings.database_url, checkpoints, elastic, step=STEPS - 1))
    plain = _flat_state(final_shards(settings.database_url, checkpoints, reference, step=STEPS - 1))
    worst_param = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(resized, plain, strict=True))
    assert worst_param <= 1e-5, worst_param
    print(
        f"\nelastic 2 -> 4 -> 2 against unresized 4 over {STEPS} steps: largest loss difference {worst:.1e}, "
        f"largest parameter difference {worst_param:.1e} (relative to the largest parameter)"
    )


@pytest.mark.parametrize(
    ("overrides", "text"),
    [
        ({"min_gpus": 3, "num_gpus": 2}, "min_gpus (3) must be <= num_gpus (2)"),
        (
            {"min_gpus": 3, "num_gpus": 4, "global_batch_size": 10},
            "no world size N in [min_gpus, num_gpus] = [3, 4] divides the global batch (10) into micro-batches of 2",
        ),
    ],
)
def test_an_elastic_spec_without_an_allowed_world_size_is_a_422_naming_the_numbers(client, overrides, text):
    response = client.post("/v1/jobs", json=job_body(**overrides))
    assert response.status_code == 422 and text in response.json()["message"], response.text


def test_an_elastic_job_is_planned_at_the_fewest_gpus_it_runs_on(client):
    """ZeRO-1's per-GPU bytes fall as N grows: it is admitted if it fits at its fewest."""
    plan = client.post(
        "/v1/jobs", json=job_body(num_gpus=4, min_gpus=3, global_batch_size=12), params={"dry_run": "true"}
    )
    assert plan.status_code == 200, plan.text
    assert plan.json()["plan"]["num_gpus"] == 3  # 12 % (2 x 3) == 0: 3 is allowed, and the fewest
    odd = client.post(
        "/v1/jobs", json=job_body(num_gpus=4, min_gpus=3, global_batch_size=8), params={"dry_run": "true"}
    )
    assert odd.json()["plan"]["num_gpus"] == 4  # 8 % 6 != 0: 3 is not allowed

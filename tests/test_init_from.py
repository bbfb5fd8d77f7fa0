"""init_from: a job started from another succeeded job's final weights, with fresh optimizer state.
Through the API on Ray (a first-step loss at the trained weights' own loss on that batch, far below a
fresh start's; 422s naming init_from.job for another shape, a source that has not succeeded and another
owner's job), and in one process (a resumed run keeps its own checkpoint; bf16 takes the fp32 weights
as its master copy; an hf model starts from its save_pretrained layout; a rank's parent hands its child
only the file the service recorded, from a directory or an object store; a rank refuses weights of
another shape; on 2 ranks, runs at stages 2 and 3 start from the weights where stage 1 does).

Packages: workers.training, workers.memory, service.scheduling, service.schemas, service.api.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_model

from workers.config import FieldError, InitSpec, OptimizerSpec, SyntheticSpec, TrainConfig
from workers.data.sources import Batches
from workers.memory.specs import GPTSpec
from workers.models.builtin import build_model
from workers.training.loop import train
from workers.training.staging import fetch_weights

import helpers
from conftest import make_settings, serve
from helpers import bearer
from test_artifacts import LLAMA

ALICE, BOB, ROOT = (f"{user}-{secrets.token_urlsafe(24)}" for user in ("alice", "bob", "root"))
TOKENS = f"alice:{ALICE},bob:{BOB},root:{ROOT}:admin"
TINY = GPTSpec(**{k: v for k, v in helpers.TINY.items() if k != "kind"})
FAST = OptimizerSpec(lr=0.003, betas=(0.9, 0.95), weight_decay=0.0, max_grad_norm=1.0)


# --------------------------------------------------------------------------- through the API, on Ray


@pytest.fixture(scope="module")
def api(ray_cluster, tmp_path_factory) -> Iterator[TestClient]:
    """alice and bob are users, root an admin."""
    with serve(make_settings(tmp_path_factory.mktemp("init-from"), api_tokens=TOKENS)) as client:
        yield client


def run(api: TestClient, token: str, **overrides) -> dict:
    """A job of helpers.job_body's (TINY, fp32, seed 7) submitted as `token`'s user, run to its end."""
    submitted = api.post("/v1/jobs", json=helpers.job_body(**overrides), headers=bearer(token))
    assert submitted.status_code == 201, submitted.text
    return helpers.wait_job(
        api, submitted.json()["id"], lambda j: j["status"] in helpers.TERMINAL, headers=bearer(token)
    )


@pytest.fixture(scope="module")
def trained(api) -> dict:
    """alice's job: TINY trained for 60 steps on one rank."""
    job = run(api, ALICE, name="trained", num_gpus=1, steps=60)
    assert job["status"] == "succeeded", job["error"]
    return job


def first_loss(api: TestClient, job: dict) -> float:
    rows = api.get(f"/v1/jobs/{job['id']}/metrics", headers=bearer(ALICE)).json()["data"]
    assert rows[0]["step"] == 0
    return rows[0]["loss"]


def test_a_job_started_from_a_trained_job_starts_at_its_loss(api, trained, tmp_path):
    started = api.post(
        "/v1/jobs",
        json=helpers.job_body(name="started", steps=2, init_from={"job": trained["id"]}),
        headers=bearer(ALICE),
    )
    fresh = api.post("/v1/jobs", json=helpers.job_body(name="fresh", steps=2), headers=bearer(ALICE))
    assert started.status_code == fresh.status_code == 201, (started.text, fresh.text)
    assert started.json()["plan"] == fresh.json()["plan"]  # the plan is the new job's own
    jobs = [
        helpers.wait_job(api, r.json()["id"], lambda j: j["status"] in helpers.TERMINAL, headers=bearer(ALICE))
        for r in (started, fresh)
    ]
    assert [j["status"] for j in jobs] == ["succeeded"] * 2, [j["error"] for j in jobs]
    spec = jobs[0]["spec"]["init_from"]
    assert spec["job"] == trained["id"] and len(spec["sha256"]) == 64 and spec["bytes"] > 0

    # the trained job's weights, evaluated here on the batch the started job's first step sees
    # (2 ranks x a micro-batch of 2: the row's loss is the mean of the ranks' means)
    weights = api.get(f"/v1/jobs/{trained['id']}/artifacts/model.safetensors", headers=bearer(ALICE))
    assert hashlib.sha256(weights.content).hexdigest() == spec["sha256"]
    (tmp_path / "model.safetensors").write_bytes(weights.content)
    model = build_model(TINY, dtype=torch.float32)
    load_model(model, tmp_path / "model.safetensors")
    with torch.no_grad():
        losses = [model(*_batches(rank, world_size=2).micro_batch(0, 0)).item() for rank in range(2)]
    evaluated = sum(losses) / 2

    started_loss = first_loss(api, jobs[0])
    fresh_loss = first_loss(api, jobs[1])
    print(f"first-step loss: started {started_loss:.6f}, trained weights' eval {evaluated:.6f}, fresh {fresh_loss:.6f}")
    assert started_loss == pytest.approx(evaluated, rel=0.01)
    assert started_loss < 0.75 * fresh_loss


def _batches(rank: int, *, world_size: int) -> Batches:
    return Batches(
        model=TINY,
        data=SyntheticSpec(),
        seed=7,
        seq_len=None,
        global_batch_size=2 * world_size,
        micro_batch_size=2,
        rank=rank,
        world_size=world_size,
    )


def refusal(api: TestClient, token: str, **overrides) -> str:
    """The message of a dry run's 422, which names init_from.job in its detail."""
    response = api.post("/v1/jobs", params={"dry_run": True}, json=helpers.job_body(**overrides), headers=bearer(token))
    assert response.status_code == 422, response.text
    assert [d["field"] for d in response.json()["detail"]] == ["init_from.job"], response.text
    return response.json()["message"]


def test_a_model_of_another_shape_is_a_422_naming_the_parameter_and_both_shapes(api, trained):
    wider = {**helpers.TINY, "n_embd": 64}
    message = refusal(api, ALICE, model=wider, init_from={"job": trained["id"]})
    assert message == (
        f"init_from.job: parameter transformer.wte.weight has shape (64, 32) in job {trained['id']}'s final "
        "weights, (64, 64) in this job's model"
    )
    deeper = {**helpers.TINY, "n_layer": 3}
    assert "transformer.h.2.ln_1.weight (32) is not among" in refusal(
        api, ALICE, model=deeper, init_from={"job": trained["id"]}
    )
    mlp = {"kind": "mlp", "sizes": [8, 4]}
    assert "trained a gpt model; this job's model is mlp" in refusal(
        api, ALICE, model=mlp, init_from={"job": trained["id"]}
    )


def test_a_source_that_has_not_succeeded_or_is_anothers_is_a_422(api, trained):
    submitted = api.post("/v1/jobs", json=helpers.job_body(steps=1_000_000), headers=bearer(ALICE)).json()
    api.post(f"/v1/jobs/{submitted['id']}/cancel", headers=bearer(ALICE))
    helpers.wait_job(api, submitted["id"], lambda j: j["status"] == "cancelled", headers=bearer(ALICE))
    assert refusal(api, ALICE, init_from={"job": submitted["id"]}) == (
        f"init_from.job: job {submitted['id']} is cancelled: a job starts from a succeeded job's final/ weights"
    )
    # another owner's job is answered as one that does not exist, as its artifacts' route answers it
    artifacts = api.get(f"/v1/jobs/{trained['id']}/artifacts", headers=bearer(BOB))
    assert artifacts.status_code == 404 and artifacts.json()["message"] == f"no job with id {trained['id']}"
    assert refusal(api, BOB, init_from={"job": trained["id"]}) == f"init_from.job: no job with id {trained['id']}"
    assert refusal(api, BOB, init_from={"job": 10**12}) == f"init_from.job: no job with id {10**12}"
    assert refusal(api, ALICE, init_from={"job": 2**63 - 1}) == f"init_from.job: no job with id {2**63 - 1}"
    # an admin may start from anyone's
    admitted = api.post(
        "/v1/jobs",
        params={"dry_run": True},
        json=helpers.job_body(init_from={"job": trained["id"]}),
        headers=bearer(ROOT),
    )
    assert admitted.status_code == 200 and admitted.json()["admitted"], admitted.text
    too_large = api.post("/v1/jobs", json=helpers.job_body(init_from={"job": 2**63}), headers=bearer(ALICE))
    assert too_large.status_code == 422 and too_large.json()["detail"][0]["field"] == "init_from.job"


# --------------------------------------------------------------------------- in one process


def config(directory: Path, **overrides) -> TrainConfig:
    values = {
        "model": TINY,
        "steps": 4,
        "precision": "fp32",
        "optimizer": FAST,
        "micro_batch_size": 2,
        "seed": 7,
        "checkpoint_every": 2,
        "checkpoint_dir": str(directory),
        "resume": False,
    }
    return TrainConfig(**{**values, **overrides})


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> InitSpec:
    """A run's final weights (TINY, 20 steps), as the service would record them; `path`: the file itself."""
    directory = tmp_path_factory.mktemp("source") / "job-1"
    train(config(directory, steps=20, checkpoint_every=0))
    weights = directory / "final" / "model.safetensors"
    return InitSpec(
        job=1,
        uri=str(directory),
        sha256=hashlib.sha256(weights.read_bytes()).hexdigest(),
        bytes=weights.stat().st_size,
        path=str(weights),
    )


def test_a_resumed_run_continues_from_its_own_checkpoint_not_from_the_weights_it_started_from(source, tmp_path):
    whole: list = []
    train(config(tmp_path / "whole", init_from=source), on_metrics=whole.append)
    stopped: list = []
    result = train(
        config(tmp_path / "stopped", init_from=source), on_metrics=stopped.append, stop_at=lambda step, _: step == 1
    )
    assert result.stopped and [r.step for r in stopped] == [0, 1]
    resumed: list = []
    train(config(tmp_path / "stopped", init_from=source, resume=True), on_metrics=resumed.append)
    assert [r.step for r in resumed] == [2, 3]
    assert [r.loss for r in stopped + resumed] == [r.loss for r in whole]

    fresh: list = []
    train(config(tmp_path / "fresh"), on_metrics=fresh.append)
    assert whole[0].loss < fresh[0].loss - 0.5  # it did start from the trained weights


def test_bf16_starts_from_the_fp32_weights_as_its_master_copy(source, tmp_path):
    """The optimizer's master copy is final/'s fp32 weights exactly, not their bf16 rounding (about
    |w| / 512, far more than the one step of lr = 1e-6 taken here)."""
    lr = 1e-6
    tiny_steps = replace(FAST, lr=lr)
    train(config(tmp_path / "bf16", precision="bf16", optimizer=tiny_steps, init_from=source, steps=1))
    model = build_model(TINY, dtype=torch.float32)
    load_model(model, source.path)
    final = build_model(TINY, dtype=torch.float32)
    load_model(final, tmp_path / "bf16" / "final" / "model.safetensors")
    # one step of Adam from zero moments moves each weight by at most about lr
    moved = max((a - b).abs().max().item() for a, b in zip(model.parameters(), final.parameters(), strict=True))
    assert 0 < moved <= 1.2 * lr  # lr, and the rounding of an fp32 weight near 1 (2**-23)


def test_a_rank_hands_its_child_only_the_file_that_was_recorded(source, tmp_path):
    fetched = fetch_weights(source, into=str(tmp_path / "ok"))
    assert Path(fetched.path).read_bytes() == Path(source.path).read_bytes() and fetched.path != source.path

    with pytest.raises(FieldError, match=r"is not the file recorded when it succeeded") as refused:
        fetch_weights(replace(source, sha256="0" * 64), into=str(tmp_path / "other"))
    assert refused.value.field == "init_from.job" and not any((tmp_path / "other").iterdir())
    with pytest.raises(FieldError, match=rf"it has {source.bytes}\+ bytes"):
        fetch_weights(replace(source, bytes=source.bytes - 1), into=str(tmp_path / "shorter"))

    planted = tmp_path / "planted" / "job-2"
    (planted / "final").mkdir(parents=True)
    (planted / "final" / "model.safetensors").symlink_to(source.path)  # the right bytes, behind a link
    with pytest.raises(FieldError, match="cannot be read"):
        fetch_weights(replace(source, uri=str(planted)), into=str(tmp_path / "linked"))


def test_a_rank_fetches_the_weights_from_an_object_store_as_from_a_directory(source, s3_uri, tmp_path):
    from workers.training.storage import open_store

    open_store(s3_uri).put_file(Path(source.path), "final/model.safetensors")
    fetched = fetch_weights(replace(source, uri=s3_uri), into=str(tmp_path / "fetched"))
    assert Path(fetched.path).read_bytes() == Path(source.path).read_bytes()
    with pytest.raises(FieldError, match="is not the file recorded"):
        fetch_weights(replace(source, uri=s3_uri, sha256="f" * 64), into=str(tmp_path / "other"))
    with pytest.raises(FieldError, match="cannot be read"):
        fetch_weights(replace(source, uri=f"{s3_uri}-gone"), into=str(tmp_path / "gone"))


def test_a_rank_refuses_weights_of_another_shape_naming_the_parameter(source, tmp_path):
    wider = replace(TINY, n_embd=64, n_head=4)
    with pytest.raises(FieldError) as refused:
        train(config(tmp_path / "wider", model=wider, init_from=source))
    assert refused.value.field == "init_from.job"
    assert refused.value.reason == (
        "parameter transformer.wte.weight has shape (64, 32) in job 1's final weights, (64, 64) in this job's model"
    )


def test_an_hf_model_starts_from_its_save_pretrained_weights(tmp_path):
    """final/ holds an hf model under its lm's names, a tied weight once: a run from it starts at the
    loss from_pretrained's model has on that run's first batch."""
    from transformers import AutoModelForCausalLM

    from workers.config import HFSpec
    from workers.models.hf import CausalLM

    spec = HFSpec(config=LLAMA, vocab_size=64, block_size=32)
    hf = {"model": spec, "planned_bytes": 1 << 30}  # its traced plan's, which the rows only report
    train(config(tmp_path / "job-1", **hf, steps=20, checkpoint_every=0))
    weights = tmp_path / "job-1" / "final" / "model.safetensors"
    init = InitSpec(job=1, uri="", sha256="", bytes=weights.stat().st_size, path=str(weights))  # no parent here
    rows: list = []
    train(config(tmp_path / "started", **hf, steps=1, init_from=init), on_metrics=rows.append)

    loaded = CausalLM(AutoModelForCausalLM.from_pretrained(weights.parent, dtype=torch.float32))
    batches = Batches(
        model=spec,
        data=SyntheticSpec(),
        seed=7,
        seq_len=None,
        global_batch_size=2,
        micro_batch_size=2,
        rank=0,
        world_size=1,
    )
    with torch.no_grad():
        evaluated = loaded(*batches.micro_batch(0, 0)).item()
    assert rows[0].loss == pytest.approx(evaluated, rel=1e-5)
    fresh: list = []
    train(config(tmp_path / "fresh", **hf, steps=1), on_metrics=fresh.append)
    assert rows[0].loss < fresh[0].loss - 0.5


def _train_from(rank: int, world_size: int, root: str, stage: int, init: InitSpec | None, out: str) -> None:
    """A 4-step run at ZeRO `stage` from `init`'s weights (None: from scratch); rank 0 writes its losses to `out`."""
    import json

    rows: list = []
    run = config(Path(root), zero_stage=stage, init_from=init, micro_batch_size=1, global_batch_size=2)
    train(run, rank=rank, world_size=world_size, on_metrics=rows.append)
    if rank == 0:
        Path(out).write_text(json.dumps([row.loss for row in rows]))


def test_runs_at_stages_2_and_3_start_from_the_weights_where_stage_1_does(source, tmp_path):
    """Stage 2 loads final/'s whole tensors into its flat shards, stage 3 into its FSDP2 shards: their
    curves on 2 ranks are stage 1's from the same weights (fp32, stage 1's tolerance against them)."""
    import json

    from distributed import run_ranks

    curves = {}
    for name, stage, init in (("1", 1, source), ("2", 2, source), ("3", 3, source), ("fresh 3", 3, None)):
        out = tmp_path / f"{name}.json"
        run_ranks(2, _train_from, str(tmp_path / name), stage, init, str(out))
        curves[name] = json.loads(out.read_text())
    assert curves["2"] == pytest.approx(curves["1"], rel=1e-5)
    assert curves["3"] == pytest.approx(curves["1"], rel=1e-5)
    assert curves["3"][0] < curves["fresh 3"][0] - 0.5  # it did start from the trained weights

"""The v2 example as a user runs it (examples/tiny-llama.json: a tiny Llama on the shipped corpus
and tokenizer, on 2 ranks through the API): it trains, evaluates, hands back a model that
from_pretrained loads, and a rank killed mid-run is retried to the same final state, bit for bit.

Packages: workers.models, workers.training, service.api.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM

from workers.config import HFSpec
from workers.models.hf import build_hf
from workers.training.checkpoints import shard_file
from workers.training.reader import read_shard

from figures import record
from helpers import TERMINAL, wait_for, wait_job
from test_faults import assert_same_state, final_shards, kill_rank

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = json.loads((ROOT / "examples" / "tiny-llama.json").read_text())


@pytest.fixture(scope="module")
def served(examples_app):
    return examples_app


def example(**overrides) -> dict:
    """The example with its paths made absolute (the tests' working directory may be elsewhere)."""
    data = {key: str(ROOT / EXAMPLE["data"][key]) for key in ("path", "tokenizer")}
    return {**EXAMPLE, "data": {**EXAMPLE["data"], **data}, **overrides}


def checkpoint_root(client: TestClient, job_id: int) -> Path:
    from service.store.tables import Job

    runtime = client.app.state.runtime
    with runtime.db.session() as session:
        return runtime.storage.checkpoint_dir(session.get(Job, job_id))


def master_weights(root: Path, *, step: int, world_size: int) -> dict[str, torch.Tensor]:
    """The fp32 master weights of a checkpoint: every rank's shard of each flat buffer, joined."""
    shards = [read_shard(shard_file(root, step, rank, world_size)) for rank in range(world_size)]
    weights = {}
    for b, buffer in enumerate(shards[0]["buffers"]):
        flat = torch.cat([shard["buffers"][b]["master"] for shard in shards])
        for param in buffer["params"]:
            weights[param["name"]] = flat[param["offset"] : param["offset"] + param["numel"]].view(param["shape"])
    return weights


def test_the_tiny_llama_example_trains_evaluates_and_its_final_model_loads(served):
    client, settings = served
    steps = 60
    r = client.post("/v1/jobs", json=example(steps=steps, eval_every=30, checkpoint_every=30))
    assert r.status_code == 201, r.text
    assert r.json()["plan"]["method"] == "traced"
    job = wait_job(client, r.json()["id"], lambda j: j["status"] in TERMINAL)
    assert job["status"] == "succeeded", job["error"]
    rows = client.get(f"/v1/jobs/{job['id']}/metrics", params={"limit": 1000}).json()["data"]
    losses = [row["loss"] for row in rows]
    assert len(losses) == steps and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0, losses
    evaluated = [(row["step"], row["eval_loss"]) for row in rows if row["eval_loss"] is not None]
    assert [step for step, _ in evaluated] == [29, 59] and evaluated[1][1] < evaluated[0][1], evaluated

    names = {entry["name"] for entry in client.get(f"/v1/jobs/{job['id']}/artifacts").json()["data"]}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    root = checkpoint_root(client, job["id"])
    loaded = AutoModelForCausalLM.from_pretrained(root / "final").eval()
    # the job's final parameters: the fp32 master weights of its last checkpoint, in a model of its spec
    spec = HFSpec(config=EXAMPLE["model"]["config"], vocab_size=512, block_size=128)
    rebuilt = build_hf(spec, dtype=torch.float32, device="cpu", activation_checkpointing=False, seed=1).eval()
    rebuilt.load_state_dict(master_weights(root, step=steps - 1, world_size=2), strict=False)
    batch = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(batch).logits, rebuilt.lm(batch).logits)


def test_a_killed_rank_of_a_dataset_job_is_retried_to_the_same_final_state_bit_for_bit(served):
    client, settings = served
    steps = 60
    every = 20
    body = example(steps=steps, checkpoint_every=every, eval_every=0, max_retries=1)
    victim = client.post("/v1/jobs", json={**body, "name": "killed"}).json()["id"]
    reference = client.post("/v1/jobs", json={**body, "name": "uninterrupted"}).json()["id"]
    job = lambda job_id: client.get(f"/v1/jobs/{job_id}").json()
    wait_for(lambda: job(victim), lambda j: (j["step"] or 0) >= every + 5, what="step 25")
    kill_rank(settings.ray_namespace, victim, attempt=0, rank=1)
    done = wait_job(client, victim, lambda j: j["status"] in TERMINAL)
    assert done["status"] == "succeeded" and done["attempt"] == 1, done
    wait_job(client, reference, lambda j: j["status"] == "succeeded")
    killed, clean = (
        final_shards(settings.database_url, Path(settings.checkpoint_uri), j, step=steps - 1)
        for j in (victim, reference)
    )
    assert len(killed) == len(clean) == 2
    assert_same_state(killed, clean)  # the dataset's order resumed at exactly the next sample
    record("a rank killed, retried, dataset kind", faults=1, jobs_accepted=2, jobs_stored=2)

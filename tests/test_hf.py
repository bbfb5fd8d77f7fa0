"""The hf model kind: Hugging Face causal LMs planned by their trace, trained on 2 ranks, fine-tuned
from a save_pretrained directory inside ZERO1_MODEL_ROOTS, and the 422s that name the field.

Packages: workers.models, service.planning.
"""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient
from torch.nn import functional as F

from service.main import create_app
from service.planning.traces import TraceRequest, run_trace
from workers.config import HFSpec, InvalidModelError, OptimizerSpec, SyntheticSpec, TrainConfig
from workers.data.sources import Batches
from workers.memory.model import breakdown
from workers.models.hf import build_hf
from workers.training.loop import train

import helpers
from conftest import end_supervisors, make_settings
from helpers import LLAMA_2_7B, TERMINAL, wait_job

QWEN2_0_5B = {
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}
TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
    "tie_word_embeddings": True,
}
"""Small enough that a few dozen steps on 2 CPU ranks take seconds; tied, as the optimizer must handle."""


def tiny_spec(**overrides) -> HFSpec:
    return HFSpec(config=TINY_LLAMA | overrides, vocab_size=128, block_size=32)


def traced_workload(config: dict, *, precision: str, micro_batch_size: int, activation_checkpointing: bool):
    """The trace of an hf `config`'s step (16 tokens a sequence) and the planner's Workload of it."""
    traced = run_trace(
        TraceRequest(
            model={"kind": "hf", "config": config, "path": None},
            precision=precision,
            micro_batch_size=micro_batch_size,
            seq_len=16,
            activation_checkpointing=activation_checkpointing,
        )
    )
    workload = traced.workload(precision=precision)
    return traced, workload


def hf_config(fields: dict):
    from transformers import AutoConfig

    fields = dict(fields)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


# --------------------------------------------------------------------------- the workers' side, without Ray


def test_every_rank_builds_the_same_model_and_its_loss_is_the_next_token_cross_entropy():
    first, second = (build_hf(tiny_spec(), dtype=torch.float32, seed=3) for _ in range(2))
    states = zip(first.state_dict().values(), second.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in states)
    other = build_hf(tiny_spec(), dtype=torch.float32, seed=4)
    assert not torch.equal(first.lm.lm_head.weight, other.lm.lm_head.weight)
    assert first.lm.config._attn_implementation == "sdpa" and first.training
    assert first.lm.lm_head.weight is first.lm.model.embed_tokens.weight  # tied: one tensor
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    inputs = tokens[:, :-1]
    targets = tokens[:, 1:]
    logits = first.lm(input_ids=inputs).logits
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # not shifted a second time
    torch.testing.assert_close(first(inputs, targets), expected)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_traced_plan_counts_what_a_stage_3_rank_gathers_the_root_and_its_decoder_layers(tied):
    """The units an hf model is sharded by at stage 3 (its decoder layers) are found in its trace: the
    root's parameters (embeddings, final norm, an untied head) and two layers, each tensor once. The
    plan holds what the trace's step held gathered at its peak: the root and at least one layer, at
    most two and one layer's unsharded gradients (the peak of this model is at its head)."""
    config = TINY_LLAMA | {"num_hidden_layers": 5, "tie_word_embeddings": tied}
    traced, workload = traced_workload(config, precision="bf16", micro_batch_size=2, activation_checkpointing=False)
    model = build_hf(tiny_spec(**config), dtype=torch.float32)
    layers = model.lm.model.layers
    per_layer = sum(p.numel() for p in layers[0].parameters())
    everything = sum(p.numel() for p in model.parameters())
    root = everything - len(layers) * per_layer
    assert root == 128 * 32 * (1 if tied else 2) + 32  # embeddings, an untied head, the final norm
    assert traced.gathered_numel == root + 2 * per_layer
    assert 2 * (root + per_layer) <= traced.gathered_bytes <= 2 * (root + 3 * per_layer)
    shard = -(-sum(traced.group_numels) // 4)  # ⌈Ψ/N⌉
    assert breakdown(workload, num_gpus=4, stage=3).params_bytes == 2 * shard + traced.gathered_bytes


def test_one_rank_trains_a_tied_model_with_activation_checkpointing_within_2_percent_of_its_traced_plan():
    _, workload = traced_workload(TINY_LLAMA, precision="fp32", micro_batch_size=4, activation_checkpointing=True)
    planned = breakdown(workload, num_gpus=1, stage=1).total_bytes
    config = TrainConfig(
        model=tiny_spec(),
        steps=25,
        precision="fp32",
        optimizer=OptimizerSpec(lr=0.01, weight_decay=0.0),
        micro_batch_size=4,
        seq_len=16,
        seed=1,
        activation_checkpointing=True,
        planned_bytes=planned,
    )
    rows = []
    train(config, on_metrics=rows.append)
    assert rows[-1].loss < rows[0].loss - 0.3, [r.loss for r in rows]
    assert {r.mem_planned_bytes for r in rows} == {planned}  # the admitted plan's, not a closed form
    assert rows[-1].mem_peak_bytes[0] == pytest.approx(planned, rel=0.02)  # the rank's count on its CPU tensors


def test_a_rank_checks_the_model_path_against_the_roots_again(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    spec = HFSpec(path=str(outside), roots=(str(tmp_path / "models"),), vocab_size=128, block_size=32)
    with pytest.raises(InvalidModelError, match=r"model.path: .* outside the model roots"):
        build_hf(spec, dtype=torch.float32)


def test_a_rank_builds_and_trains_an_hf_model_without_transformers_noise(tmp_path, capfd):
    """No `loss_type=None ... unrecognized` warning and no weight-loading bar: each went into every
    rank's log (issue 32). The loss is the one transformers would pick (ForCausalLM)."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.warning_once.cache_clear()  # transformers warns once a process: as a new rank would
    saved = build_hf(tiny_spec(), dtype=torch.float32, seed=3)
    saved.lm.save_pretrained(tmp_path / "models" / "tiny")
    transformers_logging.warning_once.cache_clear()
    capfd.readouterr()
    spec = HFSpec(
        path=str(tmp_path / "models" / "tiny"), roots=(str(tmp_path / "models"),), vocab_size=128, block_size=32
    )
    for model in (build_hf(tiny_spec(), dtype=torch.float32, seed=3), build_hf(spec, dtype=torch.float32)):
        tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        assert model.lm.loss_type == "ForCausalLM"
    out, err = capfd.readouterr()
    assert "loss_type" not in out + err and "Loading" not in out + err and "%|" not in err, (out, err)


# --------------------------------------------------------------------------- through the API


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def hf_client(ray_cluster, tmp_path_factory, model_root):
    settings = make_settings(tmp_path_factory.mktemp("app"), model_roots=[str(model_root)])
    try:
        with TestClient(create_app(settings), raise_server_exceptions=False) as client:
            yield client
    finally:
        end_supervisors(settings.ray_namespace)


def plan(client, model: dict, **body):
    return client.post("/v1/plan", json={"model": {"kind": "hf", **model}, "num_gpus": 8, **body})


def test_a_llama_2_7b_config_plans_its_published_parameter_count(hf_client):
    response = plan(hf_client, {"config": LLAMA_2_7B}, precision="bf16")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["num_params"] == 6_738_415_616 and body["method"] == "traced"
    assert (body["vocab_size"], body["block_size"]) == (32000, 4096)
    per_gpu = body["per_gpu"]
    assert per_gpu["params_bytes"] == 2 * 6_738_415_616 and per_gpu["activations_bytes"] > 0
    # seq_len defaults to max_position_embeddings; a shorter one, and checkpointing, hold less
    short = plan(hf_client, {"config": LLAMA_2_7B}, precision="bf16", seq_len=1024).json()["per_gpu"]
    assert short["activations_bytes"] < per_gpu["activations_bytes"]
    checkpointed = plan(
        hf_client, {"config": LLAMA_2_7B}, precision="bf16", seq_len=1024, activation_checkpointing=True
    ).json()["per_gpu"]
    assert checkpointed["activations_bytes"] < short["activations_bytes"]
    two = plan(hf_client, {"config": LLAMA_2_7B}, precision="bf16", seq_len=1024, micro_batch_size=2).json()
    assert two["per_gpu"]["activations_bytes"] > short["activations_bytes"]


def test_a_qwen2_config_with_tied_embeddings_counts_them_once(hf_client):
    from transformers import AutoModelForCausalLM

    response = plan(hf_client, {"config": QWEN2_0_5B}, seq_len=128)
    assert response.status_code == 200, response.text
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(QWEN2_0_5B))
    every = [p for _, p in model.named_parameters(remove_duplicate=False)]
    unique = {id(p): p.numel() for p in every}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in every) - sum(unique.values()) == 151936 * 896  # the tie, listed twice
    assert response.json()["num_params"] == sum(unique.values()) == 494_032_768
    assert response.json()["block_size"] == 32768  # Qwen2Config's default, resolved by transformers


@pytest.mark.parametrize(
    ("model", "extra", "field", "match"),
    [
        ({"path": "meta-llama/Llama-2-7b"}, {}, "model.path", "never downloaded"),
        ({"path": "/etc"}, {}, "model.path", "outside the model roots"),
        ({"path": "{root}/missing"}, {}, "model.path", "no such directory"),
        ({"config": {"model_type": "no-such-model"}}, {}, "model.config", "Unrecognized model identifier"),
        (
            {"config": {**TINY_LLAMA, "hidden_size": 30, "num_attention_heads": 4}},
            {},
            "model.config",
            r"hidden size \(30\) is not a multiple of the number of attention heads \(4\)",
        ),
        ({"config": TINY_LLAMA}, {"seq_len": 33}, "seq_len", r"seq_len \(33\) must be <= .* \(32\)"),
        ({"config": {"vocab_size": 10}}, {}, "model.config", "needs model_type"),
        ({"config": TINY_LLAMA, "path": "x"}, {}, "model.path", "exactly one of model.config or model.path"),
    ],
    ids=[
        "hub-id",
        "outside-roots",
        "missing-dir",
        "unknown-model-type",
        "rejected-config",
        "seq-len",
        "no-type",
        "both",
    ],
)
def test_a_model_transformers_or_the_roots_refuse_is_a_422_naming_the_field(
    hf_client, model_root, model, extra, field, match
):
    model = {k: v.format(root=model_root) if isinstance(v, str) else v for k, v in model.items()}
    for response in (
        plan(hf_client, model, **extra),
        hf_client.post("/v1/jobs", json=helpers.job_body(model={"kind": "hf", **model}, **extra)),
    ):
        assert response.status_code == 422, response.text
        body = response.json()
        assert [d["field"] for d in body["detail"]] == [field], body
        assert __import__("re").search(match, body["message"]), body["message"]


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_an_hf_job_trains_on_2_ranks_with_its_loss_falling(hf_client, zero_stage):
    """At stage 3 its decoder layers are FSDP2's units (workers/zero/stage3.py units_of)."""
    body = helpers.job_body(
        model={"kind": "hf", "config": TINY_LLAMA},
        steps=30,
        micro_batch_size=4,
        seq_len=16,
        name="tiny-llama",
        zero_stage=zero_stage,
    )
    response = hf_client.post("/v1/jobs", json=body)
    assert response.status_code == 201, response.text
    assert response.json()["plan"]["method"] == "traced" and response.json()["plan"]["vocab_size"] == 128
    assert response.json()["plan"]["stage"] == zero_stage
    job = wait_job(hf_client, response.json()["id"], lambda job: job["status"] in TERMINAL)
    assert job["status"] == "succeeded", job["error"]
    rows = hf_client.get(f"/v1/jobs/{job['id']}/metrics").json()["data"]
    assert [r["step"] for r in rows] == list(range(30))
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3, [r["loss"] for r in rows]
    planned = job["plan"]["per_gpu"]["total_bytes"] - job["plan"]["per_gpu"]["overhead_bytes"]
    assert {r["mem_planned_bytes"] for r in rows} == {planned}


def test_a_job_fine_tunes_the_weights_of_a_save_pretrained_directory(hf_client, model_root):
    """The first step's loss is the saved model's own loss on the job's first batch: its weights were loaded."""
    from transformers import AutoModelForCausalLM

    fields = TINY_LLAMA | {"tie_word_embeddings": False}
    torch.manual_seed(11)
    saved = AutoModelForCausalLM.from_config(hf_config(fields))
    with torch.no_grad():
        saved.lm_head.weight.mul_(40)  # far from any random init: a confident (and mostly wrong) model
    saved.save_pretrained(model_root / "pretrained")
    body = helpers.job_body(
        model={"kind": "hf", "path": str(model_root / "pretrained")}, steps=3, micro_batch_size=2, seq_len=16
    )
    response = hf_client.post("/v1/jobs", json=body)
    assert response.status_code == 201, response.text
    job = wait_job(hf_client, response.json()["id"], lambda job: job["status"] in TERMINAL)
    assert job["status"] == "succeeded", job["error"]
    first = hf_client.get(f"/v1/jobs/{job['id']}/metrics").json()["data"][0]

    spec = HFSpec(path=str(model_root / "pretrained"), vocab_size=128, block_size=32)
    losses = []
    for rank in (0, 1):  # each rank's slice of step 0, made as the rank makes it; the row is their mean
        batches = Batches(
            model=spec,
            data=SyntheticSpec(),
            seed=body["seed"],
            seq_len=16,
            global_batch_size=4,
            micro_batch_size=2,
            rank=rank,
            world_size=2,
        )
        inputs, targets = batches.micro_batch(0, 0)
        with torch.no_grad():
            logits = saved(input_ids=inputs).logits
        losses.append(F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item())
    expected = sum(losses) / 2
    assert first["loss"] == pytest.approx(expected, rel=1e-5)
    assert expected > 10  # nothing a fresh init gives (about ln 128 = 4.85)


def _peaks_at_stages(rank: int, world_size: int, planned: dict[int, int], out: str) -> None:
    """A few steps of TINY_LLAMA (fp32, micro-batches of 4 x 16 tokens) at each stage of `planned` (stage:
    its plan's bytes); each rank writes {stage: its peaks} to out-<rank>.json."""
    import json
    from pathlib import Path

    peaks = {}
    for stage, planned_bytes in planned.items():
        rows: list = []
        config = TrainConfig(
            model=tiny_spec(),
            steps=3,
            precision="fp32",
            optimizer=OptimizerSpec(lr=0.01, weight_decay=0.0),
            micro_batch_size=4,
            seq_len=16,
            seed=1,
            zero_stage=stage,
            planned_bytes=planned_bytes,
        )
        train(config, rank=rank, world_size=world_size, on_metrics=rows.append)
        peaks[stage] = [row.mem_peak_bytes[0] for row in rows]
    Path(f"{out}-{rank}.json").write_text(json.dumps(peaks))


@pytest.mark.parametrize("num_gpus", [2, 4])
def test_an_hf_llama_at_stages_2_and_3_holds_about_what_its_traced_plan_says(num_gpus, tmp_path):
    """Each rank's peak, counted on its CPU tensors, against the traced plan at its stage and N. Stage 3
    within 5%, as issue 42 asks (0.986 at N = 2, 0.983 at N = 4 on a quiet machine: the trace plays
    FSDP2's gathers and frees, and holds a unit until the next one's forward is done, as a GPU frees it;
    a CPU frees it at once. Once, on a loaded machine, 1.011 at N = 4: where FSDP2's asynchronous gather
    of the next unit lands against the free of the last one depends on timing). Stage 2 within 2%
    (0.988 and 0.987 here, as stage 1's): the trace plays the staging buffers of its gradient buckets
    (buckets_bytes), which gloo's receive buffers, alive after the step's peak here, do not change."""
    import json

    from distributed import run_ranks

    _, workload = traced_workload(TINY_LLAMA, precision="fp32", micro_batch_size=4, activation_checkpointing=False)
    planned = {stage: breakdown(workload, num_gpus=num_gpus, stage=stage).total_bytes for stage in (2, 3)}
    assert breakdown(workload, num_gpus=num_gpus, stage=2).buckets_bytes == workload.buckets_bytes > 0
    run_ranks(num_gpus, _peaks_at_stages, planned, str(tmp_path / "peaks"))
    for rank in range(num_gpus):
        peaks = json.loads((tmp_path / f"peaks-{rank}.json").read_text())
        assert all(peak == pytest.approx(planned[2], rel=0.02) for peak in peaks["2"]), (rank, peaks, planned)
        assert all(peak == pytest.approx(planned[3], rel=0.05) for peak in peaks["3"]), (rank, peaks, planned)

"""POST /v1/plan and GET /healthz through the ASGI app.

Packages: service.api, service.planning.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

GPT2_XL = {"kind": "gpt", "vocab_size": 50257, "n_layer": 48, "n_head": 25, "n_embd": 1600, "block_size": 1024}
MIB = 2**20


@pytest.fixture(scope="module")
def client(fake_client):
    """Plans read the cluster's logical GPUs and ask no Ray: the app on stand-ins for Ray (conftest's fake_client)."""
    return fake_client


def test_seed_example(client):
    r = client.post("/v1/plan", json={"num_params": 7_500_000_000, "num_gpus": 64, "gpu_memory_gb": 80})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["per_gpu"] == {
        "params_bytes": 15_000_000_000,
        "grads_bytes": 15_000_000_000,
        "buckets_bytes": 0,
        "optimizer_bytes": 1_406_250_000,
        "padding_bytes": 0,
        "activations_bytes": 0,
        "temporaries_bytes": 0,
        "overhead_bytes": 0,
        "total_bytes": 31_406_250_000,
    }
    assert body["method"] == "formula"
    buckets = 3 * 25 * MIB  # stage 2: two 25 MiB buckets in flight and one filling
    assert body["stages"] == {
        "0": 120_000_000_000,
        "1": 31_406_250_000,
        "2": 16_640_625_000 + buckets,
        "3": 1_875_000_000,
    }
    assert body["fits"] is True and body["min_gpus"] == 2
    assert body["gpu_memory_bytes"] == 80_000_000_000
    assert body["headroom_bytes"] == 80_000_000_000 - 31_406_250_000
    assert [p["num_gpus"] for p in body["sweep"]] == [2**i for i in range(11)]
    assert body["sweep"][0] == {"num_gpus": 1, "total_bytes": 120_000_000_000, "fits": False}


def test_defaults_come_from_the_cluster(client):
    body = client.post("/v1/plan", json={"num_params": 1_000_000_000}).json()
    assert body["num_gpus"] == 4 and body["gpu_memory_bytes"] == 80_000_000_000
    assert (body["stage"], body["precision"], body["optimizer"]) == (1, "fp16", "adamw")
    assert body["per_gpu"]["total_bytes"] == 4 * 10**9 + 12 * 10**9 // 4


def test_model_plan_has_activations_overhead_and_padding(client):
    r = client.post("/v1/plan", json={"model": GPT2_XL, "num_gpus": 8, "micro_batch_size": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["num_params"] == 1_557_611_200
    per_gpu = body["per_gpu"]
    assert per_gpu["overhead_bytes"] == 10**9  # ZERO1_GPU_OVERHEAD_GB=1
    assert per_gpu["activations_bytes"] > 0 and per_gpu["padding_bytes"] > 0
    assert per_gpu["total_bytes"] == sum(v for k, v in per_gpu.items() if k != "total_bytes")
    ckpt = client.post(
        "/v1/plan",
        json={"model": GPT2_XL, "num_gpus": 8, "micro_batch_size": 2, "activation_checkpointing": True},
    ).json()
    assert ckpt["per_gpu"]["activations_bytes"] < per_gpu["activations_bytes"]


def test_a_stage_2_plan_lists_its_gradient_buckets_of_the_cap_asked(client):
    """Stage 2's line: what the staging buffers of the buckets add at the step's peak (the built-in
    model's closed form), smaller with smaller buckets; other stages have none. A wide GPT on short
    sequences, whose peak is in backward's blocks (GPT-2 XL's, at its head, stages nothing)."""
    wide = {"kind": "gpt", "vocab_size": 512, "n_layer": 6, "n_head": 8, "n_embd": 512, "block_size": 128}
    common = {"model": wide, "num_gpus": 8, "micro_batch_size": 2, "stage": 2}
    default, small = (client.post("/v1/plan", json=common | cap).json() for cap in ({}, {"bucket_cap_mb": 1}))
    assert 0 < small["per_gpu"]["buckets_bytes"] < default["per_gpu"]["buckets_bytes"] <= 3 * 25 * MIB
    for body in (default, small):
        per_gpu = body["per_gpu"]
        assert per_gpu["total_bytes"] == sum(v for k, v in per_gpu.items() if k != "total_bytes")
        assert body["stages"]["2"] == per_gpu["total_bytes"]
    stage1 = client.post("/v1/plan", json=common | {"stage": 1}).json()
    assert stage1["per_gpu"]["buckets_bytes"] == 0 and stage1["stages"] == default["stages"]
    r = client.post("/v1/plan", json=common | {"bucket_cap_mb": 0.5})
    assert r.status_code == 422 and "bucket_cap_mb" in r.json()["message"]


def test_a_model_that_does_not_fit_says_what_would(client):
    body = client.post("/v1/plan", json={"num_params": 7_500_000_000, "num_gpus": 1, "gpu_memory_gb": 24}).json()
    assert body["fits"] is False and body["headroom_bytes"] == 24 * 10**9 - 120 * 10**9
    assert body["min_gpus"] is None  # stage 1 never drops below 4Ψ = 30 GB
    stage3 = client.post(
        "/v1/plan", json={"num_params": 7_500_000_000, "num_gpus": 1, "gpu_memory_gb": 24, "stage": 3}
    ).json()
    assert stage3["min_gpus"] == 5  # 16 x 7.5e9 / 24e9 = 5


def test_healthz(client):
    r = client.get("/healthz")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_openapi_and_docs_are_served(client):
    assert "/v1/plan" in client.get("/openapi.json").json()["paths"]
    assert client.get("/docs").status_code == 200


@pytest.mark.parametrize(
    ("body", "field", "numbers"),
    [
        ({"num_params": 0}, "num_params", "got 0"),
        ({"num_params": -5}, "num_params", "got -5"),
        ({"num_params": 10**15 + 1}, "num_params", "got 1000000000000001"),
        ({"num_params": 1000, "num_gpus": 0}, "num_gpus", "got 0"),
        ({"num_params": 1000, "num_gpus": -3}, "num_gpus", "got -3"),
        ({"num_params": 1000, "model": GPT2_XL}, "model", "got both"),
        ({}, "model", "got neither"),
        ({"num_params": 1000, "precision": "fp8"}, "precision", "'fp8'"),
        ({"num_params": 1000, "optimizer": "lion"}, "optimizer", "'lion'"),
        ({"num_params": 1000, "stage": 4}, "stage", "got 4"),
        ({"num_params": 1000, "gpu_memory_gb": -1}, "gpu_memory_gb", "got -1"),
        ({"num_params": 1000, "gpu_memory_gb": 0}, "gpu_memory_gb", "got 0"),
        ({"model": {**GPT2_XL, "n_embd": 1601}}, "model.n_embd", "n_embd (1601) must be divisible by n_head (25)"),
        ({"model": {**GPT2_XL, "n_layer": 0}}, "model.n_layer", "got 0"),
        ({"model": {"kind": "mlp", "sizes": [10]}}, "model.sizes", "at least 2"),
        ({"model": {"kind": "rnn"}}, "model", "'rnn'"),
        ({"model": GPT2_XL, "seq_len": 4096}, "seq_len", "seq_len (4096) must be <= model.block_size (1024)"),
        ({"num_params": 1000, "micro_batch_size": 4}, "micro_batch_size", "micro_batch_size only apply"),
        ({"num_param": 1000}, "num_param", "Extra inputs are not permitted"),
        (
            {"model": {**GPT2_XL, "n_layer": 100_000, "n_embd": 100_000, "n_head": 1}},
            "model",
            "above the limit of 1,000,000,000,000,000",
        ),
    ],
)
def test_bad_input_is_a_422_naming_the_field(client, body, field, numbers):
    r = client.post("/v1/plan", json=body)
    assert r.status_code == 422, r.text
    err = r.json()
    assert err["error"] == "invalid_request"
    assert err["message"].startswith(f"{field}: ") or f"; {field}: " in err["message"]
    assert numbers in err["message"]
    assert any(d["field"] == field for d in err["detail"])


@pytest.mark.parametrize("raw", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_non_finite_gpu_memory_is_a_422(client, raw):
    r = client.post(
        "/v1/plan",
        content=f'{{"num_params": 1000, "gpu_memory_gb": {raw}}}',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 422, r.text
    assert r.json()["message"].startswith("gpu_memory_gb: ")


@pytest.mark.parametrize("content", ["", "{", "[1, 2]", "null", '"text"', '{"num_params": }'])
def test_malformed_bodies_are_422(client, content):
    r = client.post("/v1/plan", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["message"]


def test_unknown_route_and_method_are_json(client):
    assert client.get("/v1/nope").json()["error"] == "not_found"
    r = client.get("/v1/plan")
    assert r.status_code == 405 and r.json()["error"] == "method_not_allowed"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
plan_fields = st.sampled_from(
    [
        "num_params",
        "model",
        "num_gpus",
        "gpu_memory_gb",
        "precision",
        "optimizer",
        "stage",
        "micro_batch_size",
        "seq_len",
        "activation_checkpointing",
    ]
)
model_values = st.fixed_dictionaries(
    {"kind": st.sampled_from(["gpt", "mlp", "x"])},
    optional={
        "vocab_size": st.integers(-2, 10**8),
        "n_layer": st.integers(-2, 10**6),
        "n_head": st.integers(-2, 10**4),
        "n_embd": st.integers(-2, 10**8),
        "block_size": st.integers(-2, 10**9),
        "sizes": st.lists(st.integers(-2, 10**8), max_size=5),
    },
)
plan_bodies = st.dictionaries(plan_fields, json_values | model_values | st.integers(-(10**20), 10**20), max_size=6)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=plan_bodies)
def test_no_body_yields_a_500(client, body):
    r = client.post("/v1/plan", content=json.dumps(body, allow_nan=True), headers={"content-type": "application/json"})
    assert r.status_code in (200, 422), r.text
    payload = r.json()
    if r.status_code == 200:
        assert payload["per_gpu"]["total_bytes"] == sum(v for k, v in payload["per_gpu"].items() if k != "total_bytes")
    else:
        assert payload["error"] == "invalid_request" and payload["message"]


def test_booleans_are_not_counts(client):
    r = client.post("/v1/plan", json={"num_params": True})
    assert r.status_code == 422 and r.json()["message"] == (
        "num_params: Input should be a number, not a boolean (got true)"
    )


def test_a_body_without_json_content_type_is_explained(client):
    r = client.post("/v1/plan", content='{"num_params": 5}', headers={"content-type": "text/plain"})
    assert r.status_code == 422
    assert "Content-Type: application/json" in r.json()["message"]


def test_invalid_json_names_the_position(client):
    r = client.post("/v1/plan", content='{"num_params": }', headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["message"].startswith("body: invalid JSON at character 15")


def test_a_traced_plan_agrees_with_the_closed_forms_and_a_second_asks_the_cache(app):
    client, _ = app  # a trace is a Ray task: the app on the session's cluster
    body = {
        "model": {"kind": "gpt", "vocab_size": 50304, "n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024},
        "num_gpus": 4,
        "precision": "bf16",
        "micro_batch_size": 4,
        "activation_checkpointing": True,
    }
    closed = client.post("/v1/plan", json=body).json()
    tracer = client.app.state.runtime.tracer
    before = tracer.traces_run
    traced = client.post("/v1/plan", json=body | {"method": "traced"})
    assert traced.status_code == 200, traced.text
    traced = traced.json()
    assert (closed["method"], traced["method"], tracer.traces_run) == ("model", "traced", before + 1)
    assert traced["num_params"] == closed["num_params"] == 124_475_904
    for kind in ("params", "grads", "optimizer", "padding", "overhead"):  # the layout, byte for byte
        assert traced["per_gpu"][f"{kind}_bytes"] == closed["per_gpu"][f"{kind}_bytes"], kind
    for kind in ("activations", "temporaries"):
        assert traced["per_gpu"][f"{kind}_bytes"] == pytest.approx(closed["per_gpu"][f"{kind}_bytes"], rel=0.01)
    again = client.post("/v1/plan", json=body | {"method": "traced"})
    assert again.json() == traced and tracer.traces_run == before + 1  # answered from the cache


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"num_params": 1000, "method": "traced"}, "method only apply to a plan for a model"),
        ({"model": GPT2_XL, "method": "formula"}, "method"),
    ],
)
def test_a_method_that_does_not_apply_is_a_422(client, extra, message):
    r = client.post("/v1/plan", json=extra)
    assert r.status_code == 422 and message in r.json()["message"], r.text

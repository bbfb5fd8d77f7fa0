"""POST /v1/plan/recommend through the ASGI app, each configuration checked by POST /v1/plan.

Packages: service.api, service.planning.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.planning.configurations import divisors

ROOT = Path(__file__).resolve().parents[1]
# examples/gpt-7.5b.json's model: 7,500,029,952 parameters, 36 layers of width 4096 with 32 heads, block 2048
GPT_7B = json.loads((ROOT / "examples" / "gpt-7.5b.json").read_text())["model"]
ACCEPTANCE = {
    "model": GPT_7B,
    "global_batch_size": 64,
    "seq_len": 2048,
    "precision": "bf16",
    "gpu_memory_gb": 80,
    "max_gpus": 64,
}
PLAN_FIELDS = ("model", "seq_len", "precision", "gpu_memory_gb")


def plan_of(
    client, body: dict, *, num_gpus: int, micro_batch_size: int, activation_checkpointing: bool, stage: int = 1
) -> dict:
    request = {key: body[key] for key in PLAN_FIELDS if key in body}
    request |= {
        "num_gpus": num_gpus,
        "micro_batch_size": micro_batch_size,
        "activation_checkpointing": activation_checkpointing,
        "stage": stage,
    }
    response = client.post("/v1/plan", json=request)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def client(fake_client):
    """Recommendations read the cluster's logical GPUs and ask no Ray: the app on stand-ins (fake_client)."""
    return fake_client


def test_a_7_5e9_model_on_up_to_64_gpus_every_item_checked_by_plan(client):
    response = client.post("/v1/plan/recommend", json=ACCEPTANCE)
    assert response.status_code == 200, response.text
    body = response.json()
    items = body["recommendations"]
    assert items and body["count"] == len(items)
    assert body["cost_model"]["num_params"] == 7_500_029_952
    costs = [item["cost"] for item in items]
    assert costs == sorted(costs)
    for item in items:
        n = item["num_gpus"]
        m = item["micro_batch_size"]
        assert n * m * item["accumulation_steps"] == 64 and n <= 64
        plan = plan_of(client, ACCEPTANCE, num_gpus=n, micro_batch_size=m, **_ckpt(item))
        assert plan["fits"], item
        assert (plan["per_gpu"]["total_bytes"], plan["headroom_bytes"]) == (item["total_bytes"], item["headroom_bytes"])
        if n * m < 64:  # the next micro-batch up, 2m (64 / N is a power of two), does not fit: m is the largest
            assert not plan_of(client, ACCEPTANCE, num_gpus=n, micro_batch_size=2 * m, **_ckpt(item))["fits"], item
    least = plan_of(client, ACCEPTANCE, num_gpus=1, micro_batch_size=1, activation_checkpointing=True)
    assert least["min_gpus"] == 2  # 4Ψ + 12Ψ/2 + checkpointed activations + 1 GB overhead = 78.3 GB
    assert {item["zero_stage"] for item in items} == {1, 2, 3}  # a later stage where it fits a larger micro-batch
    fewest = min(n for n in divisors(64) if n >= least["min_gpus"])
    assert fewest in {item["num_gpus"] for item in items} and fewest == min(item["num_gpus"] for item in items)
    print(f"\n{len(items)} configurations; the first 3:")
    for item in items[:3]:
        print(json.dumps(item))


def _ckpt(item: dict) -> dict:
    """The /v1/plan settings of an item beside N and the micro-batch: checkpointing and the stage."""
    return {"activation_checkpointing": item["activation_checkpointing"], "stage": item["zero_stage"]}


def test_the_cost_is_the_stated_formula_with_the_stated_numbers(client):
    body = client.post("/v1/plan/recommend", json=ACCEPTANCE).json()
    cost = body["cost_model"]
    assert (cost["gpu_tflops"], cost["network_gb_per_s"], cost["unit"]) == (
        400.0,
        100.0,
        "GPU-seconds per optimizer step",
    )
    assert cost["tokens_per_step"] == 64 * 2048 and cost["bytes_per_param"] == 2
    assert "6 * num_params * tokens_per_step" in cost["formula"] and "4/3" in cost["formula"]
    psi = cost["num_params"]
    tokens = cost["tokens_per_step"]
    for item in body["recommendations"]:
        n = item["num_gpus"]
        compute_s = 6 * psi * tokens / n / 400e12 * (4 / 3 if item["activation_checkpointing"] else 1)
        acc = item["accumulation_steps"]
        passes = {1: 2, 2: acc + 1, 3: 3 * acc}[item["zero_stage"]]  # stage 2: a reduce per micro-batch; 3: 3 passes
        comm_s = passes * (n - 1) / n * psi * 2 / 100e9
        assert (item["compute_s"], item["comm_s"]) == (pytest.approx(compute_s), pytest.approx(comm_s))
        assert item["cost"] == pytest.approx(n * (compute_s + comm_s))


def test_defaults_come_from_the_cluster_and_the_model(client):
    small = {"kind": "gpt", "vocab_size": 512, "n_layer": 2, "n_head": 4, "n_embd": 128, "block_size": 256}
    body = client.post("/v1/plan/recommend", json={"model": small, "global_batch_size": 8}).json()
    assert (body["max_gpus"], body["gpu_memory_bytes"]) == (4, 80 * 10**9)  # the test cluster's
    assert body["cost_model"]["tokens_per_step"] == 8 * 256  # seq_len = block_size
    # a small model fits everywhere at the whole global batch: no checkpointing, cheapest on one GPU
    assert [(i["num_gpus"], i["micro_batch_size"], i["activation_checkpointing"]) for i in body["recommendations"]] == [
        (1, 8, False),
        (2, 4, False),
        (4, 2, False),
    ]
    assert body["recommendations"][0]["why"] == (
        "the fewest GPUs it fits on; micro-batch is capped by the global batch: 8 / (1 GPU) = 8"
    )


def test_an_mlp_has_no_checkpointing_and_plans_agree(client):
    mlp = {"kind": "mlp", "sizes": [784, 1024, 10]}
    body = client.post("/v1/plan/recommend", json={"model": mlp, "global_batch_size": 6, "max_gpus": 8}).json()
    assert [i["num_gpus"] for i in body["recommendations"]] == [1, 2, 3, 6]
    assert not any(i["activation_checkpointing"] for i in body["recommendations"])
    for item in body["recommendations"]:
        plan = plan_of(
            client, {"model": mlp}, num_gpus=item["num_gpus"], micro_batch_size=item["micro_batch_size"], **_ckpt(item)
        )
        assert plan["per_gpu"]["total_bytes"] == item["total_bytes"]


def test_nothing_within_max_gpus_is_a_does_not_fit_with_the_least_plan(client):
    response = client.post("/v1/plan/recommend", json={**ACCEPTANCE, "max_gpus": 1})
    assert response.status_code == 422, response.text
    error = response.json()
    assert error["error"] == "does_not_fit"
    plan = error["plan"]
    assert (plan["num_gpus"], plan["stage"], plan["fits"], plan["min_gpus"]) == (1, 3, False, 2)
    least_gb = plan["per_gpu"]["total_bytes"] / 1e9
    assert error["message"] == (
        f"nothing fits within max_gpus = 1: the least per-GPU plan found is {least_gb:.2f} GB "
        "(N = 1, micro-batch 1, with activation checkpointing, ZeRO stage 3), above the 80.00 GB of each GPU; "
        "N >= 2 would fit (N must also divide global_batch_size (64))"
    )


def test_a_fit_on_gpus_that_do_not_divide_the_batch_is_said(client):
    response = client.post("/v1/plan/recommend", json={**ACCEPTANCE, "global_batch_size": 3, "max_gpus": 2})
    assert response.status_code == 422 and response.json()["error"] == "does_not_fit"
    assert response.json()["message"].endswith(
        "N >= 2 would fit, but N must also divide global_batch_size (3) and none up to max_gpus does"
    )


def test_a_model_that_fits_on_no_number_of_gpus_says_so(client):
    """7.5B in bf16 on GPUs of 1 GB: at stage 3 the units it gathers, its step and the overhead (1 GB)
    alone are more."""
    response = client.post("/v1/plan/recommend", json={**ACCEPTANCE, "gpu_memory_gb": 1})
    assert response.status_code == 422 and response.json()["error"] == "does_not_fit"
    assert (
        "ZeRO stage 3 fits on no number of GPUs: the units it gathers, its step and the overhead alone are"
        in (response.json()["message"])
    )


def test_where_stage_1_fits_nowhere_a_later_stage_is_recommended_and_says_why(client):
    """7.5B in bf16 on GPUs of 32 GB: stage 1's 4Ψ (30 GB) and its shard leave no room at any N up to 64;
    stages 2 (2Ψ) and 3 do. Every item is checked by POST /v1/plan at its stage and at stage 1."""
    body = {**ACCEPTANCE, "gpu_memory_gb": 32}
    items = client.post("/v1/plan/recommend", json=body).json()["recommendations"]
    assert items and {item["zero_stage"] for item in items} <= {2, 3} and 2 in {i["zero_stage"] for i in items}
    for item in items:
        n, m = item["num_gpus"], item["micro_batch_size"]
        at = {"num_gpus": n, "micro_batch_size": m, "activation_checkpointing": item["activation_checkpointing"]}
        assert plan_of(client, body, **at, stage=item["zero_stage"])["per_gpu"]["total_bytes"] == item["total_bytes"]
        assert not plan_of(client, body, **at, stage=1)["fits"]
        if item["zero_stage"] == 2:
            assert (
                "ZeRO stage 2 (gradients sharded too; a reduce every micro-batch) is the first stage it fits at"
                in (item["why"])
            )


@pytest.mark.parametrize(
    ("change", "field", "numbers"),
    [
        ({"global_batch_size": None}, "global_batch_size", "Field required"),
        ({"global_batch_size": 0}, "global_batch_size", "got 0"),
        ({"global_batch_size": 10**30}, "global_batch_size", "less than or equal to 100000000"),
        ({"global_batch_size": True}, "global_batch_size", "not a boolean"),
        ({"seq_len": 4096}, "seq_len", "seq_len (4096) must be <= model.block_size (2048)"),
        ({"max_gpus": 0}, "max_gpus", "got 0"),
        ({"max_gpus": 2**21}, "max_gpus", "less than or equal to 1048576"),
        ({"max_gpus": 10**40}, "max_gpus", "less than or equal to 1048576"),
        ({"gpu_memory_gb": 0}, "gpu_memory_gb", "got 0"),
        ({"precision": "fp8"}, "precision", "'fp8'"),
        ({"micro_batch_size": 2}, "micro_batch_size", "Extra inputs are not permitted"),
        ({"stage": 2}, "stage", "Extra inputs are not permitted"),
        ({"model": None}, "model", "Field required"),
        ({"model": {"kind": "mlp", "sizes": [4, 2]}}, "seq_len", "seq_len only applies to a gpt model"),
        (
            {"model": {**GPT_7B, "n_layer": 100_000, "n_embd": 100_000, "n_head": 1}, "seq_len": None},
            "model",
            "above the limit of 1,000,000,000,000,000",
        ),
    ],
)
def test_bad_bodies_are_a_422_naming_the_field(client, change, field, numbers):
    body = {key: value for key, value in (ACCEPTANCE | change).items() if value is not None}
    response = client.post("/v1/plan/recommend", json=body)
    assert response.status_code == 422, response.text
    error = response.json()
    assert error["error"] == "invalid_request"
    assert error["message"].startswith(f"{field}: ") or f"; {field}: " in error["message"]
    assert numbers in error["message"]


@pytest.mark.parametrize("raw", ["NaN", "Infinity", "1e400"])
def test_non_finite_gpu_memory_is_a_422(client, raw):
    content = json.dumps({**ACCEPTANCE, "gpu_memory_gb": 1}).replace('"gpu_memory_gb": 1', f'"gpu_memory_gb": {raw}')
    response = client.post("/v1/plan/recommend", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 422 and response.json()["message"].startswith("gpu_memory_gb: ")


def test_a_batch_with_many_divisors_on_a_million_gpus_answers(client):
    body = {**ACCEPTANCE, "global_batch_size": 73_513_440, "max_gpus": 1 << 20}  # 768 divisors
    response = client.post("/v1/plan/recommend", json=body)
    assert response.status_code == 200, response.text
    items = response.json()["recommendations"]
    assert min(item["num_gpus"] for item in items) == 2
    assert all(item["total_bytes"] <= 80 * 10**9 for item in items)


recommend_bodies = st.fixed_dictionaries(
    {
        "model": st.one_of(
            st.fixed_dictionaries(
                {
                    "kind": st.just("gpt"),
                    "vocab_size": st.integers(-1, 10**7),
                    "n_layer": st.integers(-1, 200),
                    "n_head": st.sampled_from([1, 2, 4, 8]),
                    "n_embd": st.sampled_from([8, 64, 4096, 16384]),
                    "block_size": st.integers(-1, 10**6),
                }
            ),
            st.fixed_dictionaries({"kind": st.just("mlp"), "sizes": st.lists(st.integers(-1, 10**6), max_size=4)}),
        ),
        "global_batch_size": st.integers(-1, 10**9) | st.sampled_from([720720, 73_513_440, 2**26]),
    },
    optional={
        "seq_len": st.integers(-1, 10**6),
        "max_gpus": st.integers(-1, 2**22),
        "gpu_memory_gb": st.floats(-1, 10**7),
        "precision": st.sampled_from(["fp16", "bf16", "fp32", "fp4"]),
        "optimizer": st.sampled_from(["adamw", "sgd", "lion"]),
    },
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=recommend_bodies)
def test_no_body_yields_a_500(client, body):
    response = client.post("/v1/plan/recommend", json=body)
    assert response.status_code in (200, 422), response.text
    payload = response.json()
    if response.status_code == 200:
        assert payload["recommendations"] and all(i["headroom_bytes"] >= 0 for i in payload["recommendations"])
    else:
        assert payload["error"] in ("invalid_request", "does_not_fit") and payload["message"]


def test_the_endpoint_is_documented(client):
    paths = client.get("/openapi.json").json()["paths"]
    assert "/v1/plan/recommend" in paths and "422" in paths["/v1/plan/recommend"]["post"]["responses"]

"""Issue 27, items 5, 6 and 11: every Ray error of a plan or submit is a 4xx or a 503, never a 500;
traces and dataset checks wait holding no request thread and no database connection, bounded in
total and per user (429), and so are log streams; an hf model's directory and a tokenizer are
hashed at admission, the digest keys the trace and goes to the ranks, which check it again.

Packages: service.planning, workers.runtime.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import anyio.to_thread
import pytest
import ray
from fastapi.testclient import TestClient

from service.errors import ServiceError
from service.planning.tasks import run_task, run_task_async, task_error
from service.schemas.requests import JobSpec
from workers.config import DatasetSpec, HFSpec
from workers.data import digests
from workers.data.digests import DigestError, directory_digest, tokenizer_digest

from conftest import make_settings, serve
from figures import record
from helpers import TINY, bearer, stored_bundle, wait_for, zip_of

ROOT = Path(__file__).resolve().parents[1]
ALICE, BOB = (f"{user}-{secrets.token_urlsafe(24)}" for user in ("alice", "bob"))
ZIP = {"Content-Type": "application/zip"}
MAX_TASKS = 3
MAX_TASKS_PER_USER = 2
MAX_FOLLOWERS = 2
MAX_FOLLOWERS_PER_USER = 1
TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
    "tie_word_embeddings": False,
}
SLOW_MODEL = """
import os
import time

from torch import nn


class Tiny(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.emb = nn.Embedding(vocab, 8)
        self.head = nn.Linear(8, vocab)

    def forward(self, input_ids, labels):
        logits = self.head(self.emb(input_ids))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def build(gate="", vocab=16):
    if gate:
        open(f"{gate}.{vocab}.waiting", "w").close()  # the test sees the trace running
    while gate and not os.path.exists(gate):  # until the test opens the gate
        time.sleep(0.05)
    return Tiny(vocab)
"""


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> tuple[Path, Path]:
    """(model root, data root): a tiny llama's save_pretrained-like directory, a corpus and a tokenizer."""
    base = tmp_path_factory.mktemp("roots")
    models = base / "models"
    data = base / "data"
    (models / "llama").mkdir(parents=True)
    (models / "llama" / "config.json").write_text(json.dumps(TINY_LLAMA))
    (models / "llama" / "model.safetensors").write_bytes(os.urandom(4096))  # read by ranks only, never by a plan
    data.mkdir()
    shutil.copy(ROOT / "examples" / "data" / "tokenizer.json", data / "tokenizer.json")
    shutil.copy(ROOT / "examples" / "data" / "tiny-corpus.jsonl", data / "corpus.jsonl")
    return models, data


@pytest.fixture(scope="module")
def served(ray_cluster, tmp_path_factory, roots):
    """Two users; at most 3 traces (2 a user) and 2 log streams (1 a user) at once. The scheduler ticks
    once a minute, so a submitted job stays queued for the module's tests (no rank runs here)."""
    models, data = roots
    settings = make_settings(
        tmp_path_factory.mktemp("trust-tasks"),
        api_tokens=f"alice:{ALICE},bob:{BOB}",
        model_roots=[str(models)],
        data_roots=[str(data)],
        max_tasks=MAX_TASKS,
        max_tasks_per_user=MAX_TASKS_PER_USER,
        max_log_followers=MAX_FOLLOWERS,
        max_log_followers_per_user=MAX_FOLLOWERS_PER_USER,
        plan_timeout_s=60,
        scheduler_interval_s=60,
    )
    with serve(settings) as client:
        yield client


def upload(client: TestClient, files: dict[str, str], token: str = ALICE) -> str:
    response = client.post("/v1/code", content=zip_of(files), headers={**ZIP, **bearer(token)})
    assert response.status_code in (200, 201), response.text
    return response.json()["code"]


def python_plan(code: str, **args) -> dict:
    return {"model": {"kind": "python", "entrypoint": "slow.model:build", "args": args}, "code": code, "seq_len": 8}


# --------------------------------------------------------------------------- item 5: Ray errors


def test_user_code_that_exits_its_process_is_a_422_naming_the_entrypoint(served):
    code = upload(served, {"crash/__init__.py": "", "crash/model.py": "import os\n\ndef build():\n    os._exit(3)\n"})
    body = {"model": {"kind": "python", "entrypoint": "crash.model:build"}, "code": code, "seq_len": 8}
    r = served.post("/v1/plan", json=body, headers=bearer(ALICE))
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["field"] == "model.entrypoint"
    assert r.json()["message"].startswith("model.entrypoint: the task's process exited"), r.json()
    assert served.app.state.runtime.task_slots.in_flight == 0  # its slot was given back
    record("a plan whose code calls os._exit (item 5)", tried=1, refused=1)


def echo(request):
    return request


def test_a_bundle_the_task_cannot_unpack_is_a_422_naming_code(ray_cluster, tmp_path):
    """A stored zip whose file `x` and directory `x/` share a path: the task cannot unpack it for its child."""
    options = {
        "timeout_s": 60,
        "timed_out": lambda: ServiceError("timed out", status_code=422),
        "failed": lambda exc: ServiceError(str(exc), status_code=422),
        "code": stored_bundle(tmp_path / "clash.zip", {"x": b"", "x/y.py": b""}),
    }
    with pytest.raises(ServiceError) as blocking:
        run_task(json.dumps, [1], **options)
    with pytest.raises(ServiceError) as awaited:
        anyio.run(lambda: run_task_async(json.dumps, [2], **options))
    for raised in (blocking.value, awaited.value):
        assert raised.status_code == 422 and raised.extra["detail"][0]["field"] == "code", raised.message
        assert raised.message.startswith("code: the code bundle could not be unpacked for its child")
        assert "File exists" in raised.message
    record("a bundle the task cannot unpack (item 5)", tried=1, refused=1)


def test_a_task_asked_of_a_ray_that_is_not_connected_is_a_503_with_retry_after(ray_cluster):
    """In a process that never connected to Ray, run_task answers 503 (ray.remote would start a Ray
    of its own in the API process)."""
    script = (
        "import json\n"
        "from service.errors import ServiceError\n"
        "from service.planning.tasks import run_task\n"
        "try:\n"
        "    run_task(json.dumps, 1, timeout_s=20, timed_out=lambda: ServiceError('t'), failed=ServiceError)\n"
        "except ServiceError as e:\n"
        "    print(json.dumps([e.status_code, e.headers, e.message]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env
    )
    status, headers, message = json.loads(done.stdout.strip().splitlines()[-1])
    assert status == 503 and headers == {"Retry-After": "10"}, done.stdout
    assert message == "the Ray cluster could not run the task (Ray is not connected); retry in 10 s"


CLUSTER_FAULTS = [
    ray.exceptions.NodeDiedError("the node died"),
    ray.exceptions.RaySystemError("the GCS is unreachable"),
    ray.exceptions.ObjectLostError("ab" * 28, None, ""),
    ray.exceptions.ActorDiedError(),
    ray.exceptions.TaskUnschedulableError("no node has the resources"),
    ray.exceptions.LocalRayletDiedError(),
    ray.exceptions.RuntimeEnvSetupError("pip failed"),  # no task has a runtime_env of the request's: the cluster's
]


@pytest.mark.parametrize("exc", CLUSTER_FAULTS, ids=lambda e: type(e).__name__)
def test_the_clusters_faults_are_503s_with_retry_after(exc):
    answer = task_error(exc, failed=lambda e: pytest.fail(f"blamed the input for {e!r}"), blame="model")
    assert answer.status_code == 503 and answer.headers == {"Retry-After": "10"}
    assert answer.message.startswith(f"the Ray cluster could not run the task ({type(exc).__name__}: ")


@pytest.mark.parametrize(
    ("exc", "says"),
    [
        (ray.exceptions.WorkerCrashedError(), "the task's process exited"),
        (
            ray.exceptions.OutOfMemoryError("killed by the memory monitor"),
            "the task's process was killed for using too much memory",
        ),
    ],
)
def test_a_crash_of_the_tasks_process_is_the_inputs_422(exc, says):
    answer = task_error(exc, failed=lambda e: pytest.fail(repr(e)), blame="data")
    assert answer.status_code == 422 and answer.extra["detail"][0]["field"] == "data"
    assert answer.message.startswith(f"data: {says}")


def test_an_error_that_is_no_rays_is_not_hidden():
    with pytest.raises(KeyError):
        task_error(KeyError("a bug"), failed=ServiceError, blame="model")


# --------------------------------------------------------------------------- item 6: slots


def borrowed_request_threads(client: TestClient) -> int:
    """anyio's request threads (the pool sync routes run in) taken now, read on the app's event loop."""
    return client.portal.call(lambda: anyio.to_thread.current_default_thread_limiter().borrowed_tokens)


def test_slow_traces_hold_no_thread_nor_connection_and_past_the_limits_are_429(served, tmp_path):
    """Alice's two slow traces and Bob's one fill ZERO1_MAX_TASKS (3): meanwhile no request thread and no
    database connection is held, /healthz answers before any of them, and one more plan of either is a 429 that
    names its bound; once the gate opens all three plans complete."""
    runtime = served.app.state.runtime
    gate = tmp_path / "gate"
    code = {
        token: upload(served, {"slow/__init__.py": "", "slow/model.py": SLOW_MODEL}, token) for token in (ALICE, BOB)
    }
    answers: dict[int, int] = {}

    def plan_in_background(token: str, vocab: int) -> threading.Thread:
        def post() -> None:
            body = python_plan(code[token], gate=str(gate), vocab=vocab)
            answers[vocab] = served.post("/v1/plan", json=body, headers=bearer(token)).status_code

        thread = threading.Thread(target=post, daemon=True)
        thread.start()
        return thread

    def running(*vocabs: int) -> None:
        marks = [Path(f"{gate}.{vocab}.waiting") for vocab in vocabs]
        wait_for(lambda: [m.exists() for m in marks], all, what=f"traces {vocabs} running", timeout_s=90)

    waiting = [plan_in_background(ALICE, 16), plan_in_background(ALICE, 17)]
    running(16, 17)
    refused = served.post("/v1/plan", json=python_plan(code[ALICE], gate=str(gate), vocab=18), headers=bearer(ALICE))
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "5", refused.text
    assert f"alice has 2 in flight, the limit of ZERO1_MAX_TASKS_PER_USER = {MAX_TASKS_PER_USER}" in refused.text

    waiting.append(plan_in_background(BOB, 19))
    running(19)
    refused = served.post("/v1/plan", json=python_plan(code[BOB], gate=str(gate), vocab=20), headers=bearer(BOB))
    assert refused.status_code == 429, refused.text
    assert f"3 are in flight, the limit of ZERO1_MAX_TASKS = {MAX_TASKS}" in refused.json()["message"]

    # answered while the gate is shut: all three plans still waiting on their traces, none answered
    assert served.get("/healthz").status_code == 200
    assert not gate.exists() and all(thread.is_alive() for thread in waiting) and answers == {}
    assert borrowed_request_threads(served) == 0
    pool = runtime.db.engine.pool  # the scheduler borrows a connection for a moment each tick: wait for none
    wait_for(pool.checkedout, lambda n: n == 0, what="no database connection held", timeout_s=10, interval_s=0.01)

    gate.touch()
    for thread in waiting:
        thread.join(timeout=120)
    assert answers == {16: 200, 17: 200, 19: 200} and runtime.task_slots.in_flight == 0
    record("slow traces filling the request threads (item 6)", tried=1, refused=1)


def test_log_streams_are_bounded_per_user_and_in_total(served):
    runtime = served.app.state.runtime
    job = {"name": "follow", "model": TINY, "num_gpus": 1, "steps": 10, "micro_batch_size": 1}
    ids = {
        token: served.post("/v1/jobs", json=job, headers=bearer(token)).json()["id"]  # queued: no tick for a minute
        for token in (ALICE, BOB)
    }

    def follow(token: str):
        return served.stream("GET", f"/v1/jobs/{ids[token]}/logs?follow=true", headers=bearer(token))

    with follow(ALICE) as first:
        assert first.status_code == 200
        second = served.get(f"/v1/jobs/{ids[ALICE]}/logs?follow=true", headers=bearer(ALICE))
        assert second.status_code == 429 and second.headers["Retry-After"] == "30"
        limit = f"the limit of ZERO1_MAX_LOG_FOLLOWERS_PER_USER = {MAX_FOLLOWERS_PER_USER}"
        assert f"too many log streams at once: alice has 1 in flight, {limit}" in second.json()["message"]
        with follow(BOB) as bobs:
            assert bobs.status_code == 200 and runtime.log_followers.in_flight == 2
            third = served.get(f"/v1/jobs/{ids[BOB]}/logs", params={"follow": "true"}, headers=bearer(BOB))
            assert third.status_code == 429
            assert f"2 are in flight, the limit of ZERO1_MAX_LOG_FOLLOWERS = {MAX_FOLLOWERS}" in third.json()["message"]
            assert served.get(f"/v1/jobs/{ids[BOB]}/logs", headers=bearer(BOB)).status_code == 200  # a page: no slot
    wait_for(lambda: runtime.log_followers.in_flight, lambda n: n == 0, what="the streams' slots back", timeout_s=10)
    with follow(ALICE) as again:
        assert again.status_code == 200
    for token, job_id in ids.items():
        served.post(f"/v1/jobs/{job_id}/cancel", headers=bearer(token))
    record("log followers past their caps (item 6)", tried=1, refused=1)


# --------------------------------------------------------------------------- item 11: digests


def hf_plan(path: Path, **extra) -> dict:
    return {"model": {"kind": "hf", "path": str(path), **extra}, "num_gpus": 1, "seq_len": 16}


def test_the_same_model_path_with_new_content_is_traced_again(served, roots):
    models, _ = roots
    directory = models / "changing"
    shutil.copytree(models / "llama", directory)
    tracer = served.app.state.runtime.tracer
    first = served.post("/v1/plan", json=hf_plan(directory), headers=bearer(ALICE))
    assert first.status_code == 200, first.text
    traced = tracer.traces_run
    again = served.post("/v1/plan", json=hf_plan(directory), headers=bearer(ALICE))
    assert again.json() == first.json() and tracer.traces_run == traced  # the same content: the cache answered

    (directory / "config.json").write_text(json.dumps({**TINY_LLAMA, "num_hidden_layers": 4}))
    deeper = served.post("/v1/plan", json=hf_plan(directory), headers=bearer(ALICE))
    assert deeper.status_code == 200 and tracer.traces_run == traced + 1, deeper.text
    assert deeper.json()["num_params"] > first.json()["num_params"]
    record("a model directory changed under its path (item 11)", tried=1, refused=1)


def test_a_link_inside_a_model_directory_is_a_422(served, roots, tmp_path):
    models, _ = roots
    directory = models / "linked"
    shutil.copytree(models / "llama", directory)
    (tmp_path / "secret").write_text("outside the roots")
    (directory / "tokenizer.json").symlink_to(tmp_path / "secret")
    r = served.post("/v1/plan", json=hf_plan(directory), headers=bearer(ALICE))
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "model.path", r.text
    assert f"{directory}/tokenizer.json is a symbolic link" in r.json()["message"]
    record("a link inside a model directory (item 11)", tried=1, refused=1)


def test_a_given_model_digest_must_be_the_directorys(served, roots):
    models, _ = roots
    wrong = "sha256:" + "0" * 64
    r = served.post("/v1/plan", json=hf_plan(models / "llama", digest=wrong), headers=bearer(ALICE))
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "model.digest", r.text
    assert directory_digest(str(models / "llama"), field="model.path") in r.json()["message"]


def test_a_jobs_model_digest_reaches_its_ranks_which_refuse_a_changed_directory(served, roots):
    models, _ = roots
    directory = models / "job-model"
    shutil.copytree(models / "llama", directory)
    admitted = directory_digest(str(directory), field="model.path")
    body = {"name": "hf", "model": {"kind": "hf", "path": str(directory)}, "num_gpus": 1, "seq_len": 16, "steps": 1}
    r = served.post("/v1/jobs", json=body, headers=bearer(ALICE))
    assert r.status_code == 201, r.text
    spec = served.get(f"/v1/jobs/{r.json()['id']}", headers=bearer(ALICE)).json()["spec"]
    assert spec["model"]["digest"] == admitted
    plan = served.get(f"/v1/jobs/{r.json()['id']}", headers=bearer(ALICE)).json()["plan"]
    from service.schemas.responses import PlanPublic

    config = JobSpec.model_validate(spec).to_config(
        checkpoint_dir="unused", model_roots=[str(models)], plan=PlanPublic.model_validate(plan)
    )
    assert isinstance(config.model, HFSpec) and config.model.digest == admitted
    served.post(f"/v1/jobs/{r.json()['id']}/cancel", headers=bearer(ALICE))

    with open(directory / "model.safetensors", "r+b") as weights:  # the same size, other bytes
        weights.write(b"\0" * 16)
    import torch

    from workers.models.hf import build_hf

    with pytest.raises(DigestError) as changed:
        build_hf(config.model, dtype=torch.float32)
    assert changed.value.field == "model.path"
    assert f"{directory} has changed since the job was admitted: its files' digest is sha256:" in str(changed.value)
    record("a model directory changed after admission (item 11)", tried=1, refused=1)


def test_a_tokenizers_digest_is_recorded_at_submit_and_checked_where_it_is_loaded(served, roots):
    from workers.data.datasets import load_tokenizer

    _, data = roots
    tokenizer = data / "tokenizer.json"
    model = {**TINY, "vocab_size": 1024}
    body = {
        "name": "tok",
        "model": model,
        "data": {"kind": "dataset", "format": "jsonl", "path": str(data / "corpus.jsonl"), "tokenizer": str(tokenizer)},
        "num_gpus": 1,
        "steps": 1,
        "micro_batch_size": 2,
    }
    r = served.post("/v1/jobs", json=body, headers=bearer(BOB))
    assert r.status_code == 201, r.text
    spec = served.get(f"/v1/jobs/{r.json()['id']}", headers=bearer(BOB)).json()["spec"]
    admitted = spec["data"]["tokenizer_digest"]
    assert admitted == tokenizer_digest(str(tokenizer))
    served.post(f"/v1/jobs/{r.json()['id']}/cancel", headers=bearer(BOB))

    worker_spec = DatasetSpec(
        format="jsonl",
        path=str(data / "corpus.jsonl"),
        tokenizer=str(tokenizer),
        roots=(str(data),),
        tokenizer_digest=admitted,
    )
    assert load_tokenizer(worker_spec).vocab_size <= 1024  # unchanged: it loads
    (data / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))  # read beside it: counted
    try:
        with pytest.raises(DigestError) as changed:
            load_tokenizer(worker_spec)
        assert changed.value.field == "data.tokenizer" and "has changed since the job was admitted" in str(
            changed.value
        )
    finally:
        (data / "tokenizer_config.json").unlink()


def test_a_files_digest_is_remembered_by_its_stat_so_a_large_file_is_read_once(tmp_path):
    (tmp_path / "shards").mkdir()
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "shards" / "weights-1.bin").write_bytes(b"w" * (3 << 20))
    first = directory_digest(str(tmp_path), field="model.path")
    read = digests.FILES.bytes_hashed
    assert directory_digest(str(tmp_path), field="model.path") == first and digests.FILES.bytes_hashed == read
    with open(tmp_path / "config.json", "a") as config:
        config.write(" ")
    changed = directory_digest(str(tmp_path), field="model.path")
    assert changed != first and digests.FILES.bytes_hashed == read + 3  # only the changed file was read again
    (tmp_path / "shards" / "weights-1.bin").rename(tmp_path / "shards" / "weights-2.bin")
    assert directory_digest(str(tmp_path), field="model.path") != changed  # names count, not only contents


def test_a_link_beside_a_tokenizer_where_its_config_is_read_is_a_422(served, roots, tmp_path):
    _, data = roots
    (data / "linked").mkdir()
    shutil.copy(data / "tokenizer.json", data / "linked" / "tokenizer.json")
    (tmp_path / "outside.json").write_text(json.dumps({"eos_token": "</s>"}))
    (data / "linked" / "tokenizer_config.json").symlink_to(tmp_path / "outside.json")
    dataset = {"kind": "dataset", "format": "jsonl", "path": str(data / "corpus.jsonl")}
    body = {
        "name": "tok",
        "model": {**TINY, "vocab_size": 1024},
        "data": {**dataset, "tokenizer": str(data / "linked")},
        "num_gpus": 1,
        "steps": 1,
    }
    r = served.post("/v1/jobs", params={"dry_run": "true"}, json=body, headers=bearer(BOB))
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "data.tokenizer", r.text
    assert r.json()["message"] == f"data.tokenizer: {data}/linked/tokenizer_config.json is a symbolic link"

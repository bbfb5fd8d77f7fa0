"""A job's inputs on the session's S3 server (tests/s3.py). A `dataset` job's data: paths resolved
by listing under the rules of local files, staged for a child, the token file stored in the
bucket's token cache and fetched by the ranks instead of the data. An hf model's directory: hashed
as a local copy is, staged by the trusted side for the trace and the ranks. The 422s and settings
that guard both.

Packages: workers.training, workers.data, service.scheduling, service.planning, service.settings.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from service.settings import Settings
from workers.config import DatasetSpec
from workers.data.datafiles import resolve_files
from workers.data.datasets import DatasetSource
from workers.data.digests import directory_digest
from workers.training import staging
from workers.training.storage import open_store

import helpers
from conftest import make_settings, serve
from distributed import small_run
from test_hf import TINY_LLAMA, hf_config

TREE = {
    "corpus/a.jsonl": ["alpha", "beta"],
    "corpus/b.jsonl": ["gamma"],
    "corpus/.hidden.jsonl": ["never read"],
    "corpus/notes.txt": ["not jsonl"],
    "corpus/sub/c.jsonl": ["delta"],
    "corpus/.cache/d.jsonl": ["never read either"],
    "other/x.jsonl": ["outside the root"],
}


def jsonl(texts: list[str]) -> bytes:
    return "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()


@pytest.fixture
def tree(s3_uri, tmp_path) -> tuple[str, Path]:
    """TREE in the bucket under <s3_uri>/data and in a local directory: (the bucket's root, the local one)."""
    store = open_store(f"{s3_uri}/data")
    local = tmp_path / "data"
    for name, texts in TREE.items():
        store.write(name, jsonl(texts))
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(jsonl(texts))
    return f"{s3_uri}/data", local


@pytest.mark.parametrize("path", ["corpus", "corpus/*.jsonl", "corpus/*/*.jsonl", "corpus/.*.jsonl", "corpus/a.jsonl"])
def test_objects_resolve_as_the_same_local_files_do(tree, path):
    root, local = tree
    objects = staging.resolve_objects(f"{root}/{path}", format="jsonl", roots=[root])
    files = resolve_files(str(local / path), format="jsonl", roots=[str(local)])
    bucket_prefix = root.removeprefix("s3://")
    assert [key.removeprefix(bucket_prefix + "/") for key, _ in objects] == [os.path.relpath(f, local) for f in files]
    assert [size for _, size in objects] == [os.path.getsize(f) for f in files]


def test_objects_outside_the_roots_or_naming_nothing_are_refused_by_field(tree):
    root, _ = tree
    bucket = root.removeprefix("s3://").split("/")[0]
    cases = [
        (root.rsplit("/", 1)[0] + "/other/x.jsonl", "outside the object-store data roots"),
        (f"s3://{bucket}/elsewhere", "outside the object-store data roots"),
        (f"{root}/corpus/*.parquet", "matches no jsonl files"),
        (f"{root}/nothing", "matches no jsonl files"),
        (f"{root}/corpus/../other", "an s3 URI names a bucket"),
        ("gs://b/data", "storage scheme 'gs' is not supported"),
    ]
    for path, text in cases:
        with pytest.raises(ValueError, match="^data.path: ") as raised:
            staging.resolve_objects(path, format="jsonl", roots=[root])
        assert text in str(raised.value), path
    with pytest.raises(ValueError, match="lists more than 3 objects"):
        staging.resolve_objects(f"{root}/corpus/*.jsonl", format="jsonl", roots=[root], max_candidates=3)


def test_staged_data_tokenize_as_the_local_files_and_the_token_file_round_trips(tree, s3_uri, tmp_path):
    root, local = tree
    remote = DatasetSpec(format="jsonl", path=f"{root}/corpus", tokenizer="bytes", roots=(root,), validation_fraction=0)
    staged = staging.stage(remote, into=str(tmp_path / "staged"))
    assert staged.roots == (os.path.realpath(tmp_path / "staged"),)
    from_bucket = DatasetSource(spec=staged, seq_len=4, seed=0)
    from_disk = DatasetSource(
        spec=DatasetSpec(format="jsonl", path=str(local / "corpus"), tokenizer="bytes", validation_fraction=0),
        seq_len=4,
        seed=0,
    )
    assert np.array_equal(from_bucket.token_file.tokens, from_disk.token_file.tokens)
    assert bytes(from_bucket.token_file.tokens[:5].tolist()) == b"alpha"

    cache = tmp_path / "cache"  # the check's cache, its token file published to the bucket's
    made = DatasetSource(spec=dataclasses.replace(staged, cache_dir=str(cache)), seq_len=4, seed=0)
    store_uri = staging.token_store(s3_uri)
    uri = staging.publish_tokens(made.token_file.path, store_uri=store_uri)
    assert uri == f"{store_uri}/{Path(made.token_file.path).name}"
    assert staging.publish_tokens(made.token_file.path, store_uri=store_uri) == uri  # stored once

    # a rank: its parent fetches the token file; the child maps it by its key and reads no data
    with_uri = dataclasses.replace(remote, token_uri=uri)
    directory = str(tmp_path / "rank")
    for_child = staging.data_for_child(with_uri, into=directory)
    assert for_child.path == remote.path and for_child.cache_dir == directory
    fetched = DatasetSource(spec=for_child, seq_len=4, seed=0)
    assert not fetched.token_file.created and fetched.token_file.path.startswith(directory)
    assert np.array_equal(fetched.token_file.tokens, from_disk.token_file.tokens)

    # gone from the bucket (a lifecycle rule): the data are staged instead, and tokenized again
    open_store(store_uri).remove(Path(uri).name)
    directory = str(tmp_path / "rank-again")
    for_child = staging.data_for_child(with_uri, into=directory)
    assert for_child.token_uri is None and for_child.path.startswith(directory)
    again = DatasetSource(spec=for_child, seq_len=4, seed=0)
    assert again.token_file.created
    assert np.array_equal(again.token_file.tokens, from_disk.token_file.tokens)


def test_a_config_with_nothing_on_a_store_passes_through_for_child_untouched(tmp_path):
    config = small_run(tmp_path, data=DatasetSpec(format="jsonl", path=str(tmp_path), tokenizer="bytes"))
    assert staging.for_child(config) == (config, None)


def test_for_child_stages_data_into_a_directory_it_removes_on_failure(tree, s3_uri, tmp_path, monkeypatch):
    root, _ = tree
    data = DatasetSpec(format="jsonl", path=f"{root}/corpus", tokenizer="bytes", roots=(root,))
    config, directory = staging.for_child(small_run(tmp_path, data=data))
    try:
        assert config.data.path.startswith(directory) and config.data.cache_dir is None
        assert sorted(os.listdir(directory)) == ["data"]
    finally:
        shutil.rmtree(directory)
    made = []
    monkeypatch.setattr(staging.tempfile, "mkdtemp", lambda **kw: made.append(str(tmp_path / "made")) or made[-1])
    os.makedirs(tmp_path / "made")
    missing = dataclasses.replace(data, path=f"{root}/nothing")
    with pytest.raises(ValueError, match="matches no jsonl files"):
        staging.for_child(small_run(tmp_path, data=missing))
    assert made and not os.path.exists(made[0])


def test_roots_that_are_not_directories_nor_s3_stop_the_service_at_start(tmp_path):
    with pytest.raises(ValueError, match="ZERO1_DATA_ROOTS: 'gs://b/data': storage scheme 'gs' is not supported"):
        Settings(data_roots="data,gs://b/data")
    with pytest.raises(ValueError, match="ZERO1_MODEL_ROOTS: 'http://h/m': storage scheme 'http' is not supported"):
        Settings(model_roots="http://h/m")
    assert Settings(data_roots="data,s3://b/data").data_roots == ["data", "s3://b/data"]
    assert Settings(model_roots="s3://b/models").model_roots == ["s3://b/models"]


@dataclasses.dataclass(frozen=True)
class _TraceLike:
    model: dict
    tokenizer_dir: str | None = None


def _upload(local: Path, uri: str) -> None:
    store = open_store(uri)
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        store.write(path.relative_to(local).as_posix(), path.read_bytes())


def test_a_model_directory_on_s3_has_its_local_copys_digest_and_a_trace_stages_only_its_config(s3_uri, tmp_path):
    local = tmp_path / "model"
    (local / "sub").mkdir(parents=True)
    (local / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (local / "model.safetensors").write_bytes(os.urandom(3 << 20))
    (local / "tokenizer.json").write_text("{}")
    (local / "sub" / "extra.bin").write_bytes(b"x" * 10)
    root = f"{s3_uri}/models"
    _upload(local, f"{root}/m")
    digest = staging.model_digest(f"{root}/m", roots=[root])
    assert digest == directory_digest(str(local), field="model.path")
    staged = staging.stage_model(f"{root}/m", into=str(tmp_path / "all"))
    assert directory_digest(staged, field="model.path") == digest

    trace = staging.staged_inputs(_TraceLike(model={"kind": "hf", "path": f"{root}/m"}), into=str(tmp_path / "t"))
    assert sorted(p.name for p in Path(trace.model["path"]).rglob("*") if p.is_file()) == ["config.json"]
    check = staging.staged_inputs(_TraceLike(model={}, tokenizer_dir=f"{root}/m"), into=str(tmp_path / "c"))
    assert sorted(p.name for p in Path(check.tokenizer_dir).iterdir()) == ["tokenizer.json"]

    open_store(f"{root}/empty").write("a.txt", b"")
    for path, text in [
        (f"{s3_uri}/elsewhere/m", "outside the object-store model roots"),
        (f"{root}/empty", "it has no config.json"),
    ]:
        with pytest.raises(ValueError, match="^model.path: ") as raised:
            staging.model_digest(path, roots=[root])
        assert text in str(raised.value)


# --------------------------------------------------------------------------- through the API


@pytest.fixture
def s3_data_app(ray_cluster, tree, s3_uri, tmp_path):
    root, _ = tree
    settings = make_settings(
        tmp_path,
        checkpoint_uri=f"{s3_uri}/checkpoints",  # beside the data root, never holding it (refused at start)
        local_dir=str(tmp_path / "local"),
        data_roots=[str(tmp_path / "mine"), root],
        model_roots=[root],
    )
    with serve(settings) as client:
        yield client, root


def dataset_job(path: str, **data) -> dict:
    body = helpers.job_body(model={**helpers.TINY, "vocab_size": 512, "block_size": 8}, steps=4, micro_batch_size=1)
    return {**body, "data": {"kind": "dataset", "format": "jsonl", "tokenizer": "bytes", "path": path, **data}}


def test_data_on_s3_outside_its_roots_or_of_the_wrong_kind_are_422s_naming_the_field(s3_data_app):
    client, root = s3_data_app
    outside = root.rsplit("/", 1)[0] + "/other/x.jsonl"
    cases = [
        (dataset_job(outside), "data.path", "outside the object-store data roots"),
        (dataset_job(f"{root}/corpus/*.csv"), "data.path", "matches no jsonl files"),
        (dataset_job(f"{root}/corpus", tokenizer=f"{root}/tokenizer.json"), "data.tokenizer", "not from an object"),
        (
            {**dataset_job(root), "data": {"kind": "text", "path": f"{root}/corpus/a.jsonl"}},
            "data.path",
            "kind dataset",
        ),
    ]
    for body, field, text in cases:
        r = client.post("/v1/jobs", params={"dry_run": True}, json=body)
        assert r.status_code == 422, (body["data"], r.text)
        assert text in r.json()["message"] and r.json()["detail"][0]["field"] == field, r.json()


def test_a_dataset_jobs_data_come_from_the_bucket_and_its_ranks_fetch_only_the_token_file(s3_data_app, s3_server):
    client, root = s3_data_app
    texts = [f"document {i} " + "ab" * (i % 7) for i in range(80)]
    store = open_store(root)
    store.write("big/part-0.jsonl", jsonl(texts[:40]))
    store.write("big/part-1.jsonl", jsonl(texts[40:]))
    planted = f"{root}/elsewhere/{'0' * 64}.bin"  # a user never names the token file: the service does
    r = client.post("/v1/jobs", json=dataset_job(f"{root}/big/*.jsonl", token_uri=planted))
    assert r.status_code == 201, r.text
    mark = s3_server.mark()  # the submit's check read the data; the ranks start after this
    token_uri = r.json()["spec"]["data"]["token_uri"]
    checkpoints = root.rsplit("/", 1)[0] + "/checkpoints"  # s3_data_app's ZERO1_CHECKPOINT_URI
    assert token_uri != planted and token_uri.startswith(staging.token_store(checkpoints) + "/")
    job = helpers.wait_job(client, r.json()["id"], lambda j: j["status"] in helpers.TERMINAL)
    assert job["status"] == "succeeded", job["error"]
    rows = client.get(f"/v1/jobs/{job['id']}/metrics").json()["data"]
    assert [row["step"] for row in rows] == [0, 1, 2, 3] and all(np.isfinite(row["loss"]) for row in rows)

    tokens_store = open_store(token_uri.rsplit("/", 1)[0])
    name = token_uri.rsplit("/", 1)[1]
    # each rank's parent fetched the token file whole, once; no rank read the data
    assert s3_server.requests(mark, key_prefix=f"{root}/big", method="GET") == []
    assert s3_server.bytes_served(token_uri, since=mark) == 2 * tokens_store.size(name)
    # and it is the bytes tokenizer's stream of the files, in file order
    tokens = np.frombuffer(tokens_store.read(name), dtype="<u2")
    assert tokens.tolist() == [t for text in texts for t in [*text.encode(), 256]]


def test_an_hf_job_fine_tunes_a_model_directory_in_the_bucket(ray_cluster, s3_server, s3_uri, tmp_path):
    """The first step's loss is far above a fresh init's: the ranks loaded the weights from the bucket."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(11)
    saved = AutoModelForCausalLM.from_config(hf_config(TINY_LLAMA | {"tie_word_embeddings": False}))
    with torch.no_grad():
        saved.lm_head.weight.mul_(40)  # a confident (and mostly wrong) model: no random init's loss
    saved.save_pretrained(tmp_path / "pretrained")
    root = f"{s3_uri}/models"
    _upload(tmp_path / "pretrained", f"{root}/pretrained")
    settings = make_settings(
        tmp_path, checkpoint_uri=f"{s3_uri}/checkpoints", local_dir=str(tmp_path / "local"), model_roots=[root]
    )
    with serve(settings) as client:
        outside = helpers.job_body(model={"kind": "hf", "path": f"{s3_uri}/pretrained"}, seq_len=16)
        r = client.post("/v1/jobs", params={"dry_run": True}, json=outside)
        assert r.status_code == 422 and r.json()["detail"][0]["field"] == "model.path", r.text
        assert "outside the object-store model roots" in r.json()["message"]

        body = helpers.job_body(
            model={"kind": "hf", "path": f"{root}/pretrained"}, steps=3, micro_batch_size=2, seq_len=16
        )
        r = client.post("/v1/jobs", json=body)
        assert r.status_code == 201, r.text
        assert r.json()["spec"]["model"]["digest"] == directory_digest(str(tmp_path / "pretrained"), field="m")
        mark = s3_server.mark()
        job = helpers.wait_job(client, r.json()["id"], lambda j: j["status"] in helpers.TERMINAL)
        assert job["status"] == "succeeded", job["error"]
        first = client.get(f"/v1/jobs/{job['id']}/metrics").json()["data"][0]
    assert first["loss"] > 10  # a fresh init's is about ln 128 = 4.85
    weights = (tmp_path / "pretrained" / "model.safetensors").stat().st_size
    # each rank's parent fetched the weights once
    assert s3_server.bytes_served(f"{root}/pretrained/model.safetensors", since=mark) == 2 * weights


def test_a_store_that_cannot_be_read_at_submit_is_a_503_naming_the_field(s3_data_app, monkeypatch):
    """The store's client failing (an endpoint down, credentials refused: botocore's errors are not
    OSErrors) is the service's 503, never a 500."""
    from botocore.exceptions import EndpointConnectionError

    client, root = s3_data_app

    class Down:
        def __getattr__(self, name):
            def refuse(*args, **kwargs):
                raise EndpointConnectionError(endpoint_url="http://127.0.0.1:9")

            return refuse

    monkeypatch.setattr(staging, "filesystem", lambda scheme="s3": Down())
    r = client.post("/v1/jobs", params={"dry_run": True}, json=dataset_job(f"{root}/corpus"))
    assert r.status_code == 503 and r.json()["error"] == "storage_unreachable", r.text
    assert r.json()["message"].startswith("data.path: the object store could not be read: EndpointConnectionError")
    model = helpers.job_body(model={"kind": "hf", "path": f"{root}/model"}, seq_len=16)
    r = client.post("/v1/jobs", params={"dry_run": True}, json=model)
    assert r.status_code == 503 and r.json()["message"].startswith("model.path: the object store could not"), r.text


def test_a_check_as_another_uid_reads_the_staged_copy_and_its_token_file_goes_to_the_bucket(
    searchable, tree, s3_uri, tmp_path
):
    """The task's side stages the data where a child under its owner's uid (ZERO1_RUN_AS) can read
    them, and the child, holding no credentials, tokenizes them; the task stores the token file."""
    from service.planning.dataset_checks import DatasetRequest
    from workers.records import DatasetSummary, RunAs
    from workers.runtime.isolated import IsolatedCall, run_isolated

    root, local = tree
    cache = tmp_path / "cache"  # the service's: the child spills its token file, the task moves it here
    data = DatasetSpec(
        format="jsonl",
        path=f"{root}/corpus",
        tokenizer="bytes",
        roots=(root,),
        validation_fraction=0,
        cache_dir=str(cache),
    )
    call = IsolatedCall(
        function="service.planning.dataset_checks:run_check",
        argument=DatasetRequest(data=data, vocab_size=512, seq_len=4, global_batch_size=1, seed=0),
        result=DatasetSummary,
        blame="data",
        timeout_s=120,
        run_as=RunAs(65534, 65534),
        token_cache=str(cache / "tokens"),
        token_store=staging.token_store(s3_uri),
    )
    summary = run_isolated(call)
    expected = resolve_files(str(local / "corpus"), format="jsonl", roots=None)
    texts = [json.loads(line)["text"] for f in expected for line in Path(f).read_text().splitlines()]
    num_tokens = sum(len(text.encode()) + 1 for text in texts)
    assert summary.tokenized and summary.num_tokens == num_tokens
    assert summary.token_file.startswith(staging.token_store(s3_uri) + "/")
    stored = open_store(staging.token_store(s3_uri))
    assert stored.size(Path(summary.token_file).name) == 2 * num_tokens
    assert (cache / "tokens" / Path(summary.token_file).name).stat().st_size == 2 * num_tokens
    assert not list(Path(tempfile.gettempdir()).glob("zero1-inputs-*/data"))  # the staged copy is gone


def test_a_staged_copy_belongs_to_the_childs_uid_alone(tree, tmp_path):
    root, _ = tree
    data = DatasetSpec(format="jsonl", path=f"{root}/corpus", tokenizer="bytes", roots=(root,))
    config, directory = staging.for_child(small_run(tmp_path, data=data), owner=(65534, 65534))
    try:
        assert os.stat(directory).st_mode & 0o777 == 0o700  # a mkdtemp: no other user enters it
        owners = {os.stat(os.path.join(path, name)).st_uid for path, _, names in os.walk(directory) for name in names}
        assert owners == {65534} and os.stat(directory).st_uid == 65534
        assert Path(config.data.path, "a.jsonl").is_file()
    finally:
        shutil.rmtree(directory)

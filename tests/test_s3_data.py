"""A `dataset` job's data on the session's S3 server (tests/s3.py): paths resolved by listing under
the rules of local files, staged for a child, the token file stored in the bucket's token cache and
fetched by the ranks instead of the data, and the 422s and settings that guard it.

Packages: workers.training, workers.data, service.scheduling, service.settings.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from service.settings import Settings
from workers.config import DatasetSpec
from workers.data.datafiles import resolve_files
from workers.data.datasets import DatasetSource
from workers.training import staging
from workers.training.storage import open_store

import helpers
from conftest import make_settings, serve

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
    store, local = open_store(f"{s3_uri}/data"), tmp_path / "data"
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
    for_child, directory = staging.for_child(with_uri)
    try:
        assert for_child.path == remote.path and for_child.cache_dir == directory
        fetched = DatasetSource(spec=for_child, seq_len=4, seed=0)
        assert not fetched.token_file.created and fetched.token_file.path.startswith(directory)
        assert np.array_equal(fetched.token_file.tokens, from_disk.token_file.tokens)
    finally:
        shutil.rmtree(directory)

    # gone from the bucket (a lifecycle rule): the data are staged instead, and tokenized again
    open_store(store_uri).remove(Path(uri).name)
    for_child, directory = staging.for_child(with_uri)
    try:
        assert for_child.token_uri is None and for_child.path.startswith(directory)
        again = DatasetSource(spec=for_child, seq_len=4, seed=0)
        assert again.token_file.created
        assert np.array_equal(again.token_file.tokens, from_disk.token_file.tokens)
    finally:
        shutil.rmtree(directory)


def test_a_local_dataset_passes_through_for_child_untouched(tmp_path):
    spec = DatasetSpec(format="jsonl", path=str(tmp_path), tokenizer="bytes")
    assert staging.for_child(spec) == (spec, None)


def test_roots_that_are_not_directories_nor_s3_stop_the_service_at_start(tmp_path):
    with pytest.raises(ValueError, match="ZERO1_DATA_ROOTS: 'gs://b/data': storage scheme 'gs' is not supported"):
        Settings(data_roots="data,gs://b/data")
    with pytest.raises(ValueError, match="ZERO1_MODEL_ROOTS: 's3://b/models': a model root is a directory"):
        Settings(model_roots="s3://b/models")
    assert Settings(data_roots="data,s3://b/data").data_roots == ["data", "s3://b/data"]


# --------------------------------------------------------------------------- through the API


@pytest.fixture
def s3_data_app(ray_cluster, tree, s3_uri, tmp_path):
    root, _ = tree
    settings = make_settings(
        tmp_path, checkpoint_uri=s3_uri, local_dir=str(tmp_path / "local"), data_roots=[str(tmp_path / "mine"), root]
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
    assert token_uri != planted and token_uri.startswith(staging.token_store(root.rsplit("/", 1)[0]) + "/")
    job = helpers.wait_job(client, r.json()["id"], lambda j: j["status"] in helpers.TERMINAL)
    assert job["status"] == "succeeded", job["error"]
    rows = client.get(f"/v1/jobs/{job['id']}/metrics").json()["data"]
    assert [row["step"] for row in rows] == [0, 1, 2, 3] and all(np.isfinite(row["loss"]) for row in rows)

    tokens_store, name = open_store(token_uri.rsplit("/", 1)[0]), token_uri.rsplit("/", 1)[1]
    # each rank's parent fetched the token file whole, once; no rank read the data
    assert s3_server.requests(mark, key_prefix=f"{root}/big", method="GET") == []
    assert s3_server.bytes_served(token_uri, since=mark) == 2 * tokens_store.size(name)
    # and it is the bytes tokenizer's stream of the files, in file order
    tokens = np.frombuffer(tokens_store.read(name), dtype="<u2")
    assert tokens.tolist() == [t for text in texts for t in [*text.encode(), 256]]

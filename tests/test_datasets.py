"""The dataset data kind: formats, paths inside the roots, tokenizing once into the cache, packing,
the world-size-independent order, the held-out split, the 422s at submit, and a job on the shipped
example corpus.

Packages: workers.data, service.planning.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from fastapi.testclient import TestClient

import workers.data.datasets as datasets_module
from service.main import create_app
from workers.config import DatasetSpec
from workers.data.datafiles import resolve_files
from workers.data.datasets import DatasetSource, prepare_tokens
from workers.data.sources import Batches
from workers.memory.model import GPTSpec

import helpers
from conftest import end_supervisors, make_settings

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "data"
EOS = 256  # the bytes tokenizer's


def bytes_spec(path: Path, *, format: str = "jsonl", **overrides) -> DatasetSpec:
    values = {"format": format, "path": str(path), "tokenizer": "bytes", "validation_fraction": 0.0}
    return DatasetSpec(**{**values, **overrides})


def stream(*documents: str) -> list[int]:
    """The bytes tokenizer's stream: each document's bytes, then EOS."""
    return [t for doc in documents for t in [*doc.encode(), EOS]]


def write_jsonl(path: Path, texts: list, field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t, "n": i}) + "\n" for i, t in enumerate(texts)))
    return path


# --------------------------------------------------------------------------- reading


@pytest.mark.parametrize("format", ["jsonl", "parquet", "csv", "text"])
def test_every_format_reads_in_file_order(tmp_path, format):
    texts = ["héllo world", "", 'second, "quoted" doc', "three"]
    if format == "jsonl":
        write_jsonl(tmp_path / "a.jsonl", texts)
    elif format == "parquet":
        pq.write_table(pa.table({"n": list(range(4)), "text": texts}), tmp_path / "a.parquet")
    elif format == "csv":
        import csv

        with open(tmp_path / "a.csv", "w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow(["n", "text"])
            writer.writerows([[i, t] for i, t in enumerate(texts)])
    else:  # each text file is one document, its newlines kept
        (tmp_path / "a.txt").write_text("héllo world\nline two\n")
        (tmp_path / "b.txt").write_text("three")
        texts = ["héllo world\nline two\n", "three"]
    tokens = prepare_tokens(bytes_spec(tmp_path, format=format), tokenizer=datasets_module.ByteTokenizer()).tokens
    assert list(tokens) == stream(*[t for t in texts if t])  # an empty document adds nothing, not a lone EOS


def test_paths_files_directories_globs_and_the_roots(tmp_path):
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    (root / "sub" / ".hidden").mkdir(parents=True)
    outside.mkdir()
    for path in [root / "a.jsonl", root / "sub" / "b.jsonl", root / ".c.jsonl", root / "sub" / ".hidden" / "d.jsonl"]:
        write_jsonl(path, ["x"])
    (root / "notes.txt").write_text("not jsonl")
    write_jsonl(outside / "secret.jsonl", ["secret"])
    roots = [str(root)]

    def files(path) -> list[str]:
        return [os.path.relpath(f, root) for f in resolve_files(str(path), format="jsonl", roots=roots)]

    assert files(root) == ["a.jsonl", "sub/b.jsonl"]  # a directory: its format's files, hidden ones skipped
    assert files(root / "a.jsonl") == ["a.jsonl"]
    assert files(root / "*.jsonl") == ["a.jsonl"]  # a glob: one level, hidden names unmatched
    assert files(root / "*" / "*.jsonl") == ["sub/b.jsonl"]
    assert files(root / "notes.txt") == ["notes.txt"]  # a file named is read whatever its extension
    with pytest.raises(ValueError, match=r"data\.path: .* matches no jsonl files"):
        files(root / "*.parquet")
    with pytest.raises(ValueError, match=r"data\.path: .* outside the data roots"):
        files(outside / "secret.jsonl")
    with pytest.raises(ValueError, match=r"data\.path: .*glob's directory .* is outside"):
        files(outside / "*.jsonl")
    with pytest.raises(ValueError, match=r"data\.path: .* outside"):
        files(root / ".." / "outside" / "*.jsonl")
    (root / "link.jsonl").symlink_to(outside / "secret.jsonl")  # a link in the root to a file outside it
    with pytest.raises(ValueError, match=r"link\.jsonl, which resolves outside the data roots \[[^]]*\] \("):
        files(root / "*.jsonl")
    with pytest.raises(ValueError, match=r"outside"):
        files(root)


def test_packing_is_exact_and_the_order_a_seeded_permutation(tmp_path):
    docs = ["abcdefg", "hij", "klmnopqrstu", "vw"]  # 27 tokens with their EOS: 6 blocks of 4, 3 dropped
    write_jsonl(tmp_path / "a.jsonl", docs)
    source = DatasetSource(spec=bytes_spec(tmp_path), seq_len=3, seed=5)
    flat = stream(*docs)
    blocks = torch.tensor(flat[: 6 * 4]).view(6, 4)
    assert source.num_blocks == 6 and len(source.held_out) == 0
    assert sorted(source.perm.tolist()) == list(range(6))
    assert source.perm.tolist() == np.random.default_rng(5).permutation(6).tolist()
    for step in range(4):  # past an epoch: positions wrap mod the train blocks
        got = source.train_block_tokens(step, range(4), 4)
        want = blocks[[int(source.perm[(step * 4 + i) % 6]) for i in range(4)]]
        torch.testing.assert_close(got, want)
    assert blocks[1].tolist() == [*b"efg", EOS] and blocks[2].tolist() == [*b"hij", EOS]  # documents joined by EOS
    other = DatasetSource(spec=bytes_spec(tmp_path), seq_len=3, seed=6)
    assert other.perm.tolist() != source.perm.tolist()


def gpt(vocab_size: int = 257, block_size: int = 8) -> GPTSpec:
    return GPTSpec(vocab_size=vocab_size, n_layer=1, n_head=1, n_embd=8, block_size=block_size)


def corpus(tmp_path: Path, *, num_docs: int = 60) -> Path:
    return write_jsonl(tmp_path / "corpus.jsonl", [f"document {i} " + "ab" * (i % 7) for i in range(num_docs)])


def step_samples(spec: DatasetSpec, *, world_size: int, step: int, global_batch: int = 8, micro: int = 2) -> tuple:
    """Every rank's micro-batches of one step, in rank order: (inputs, targets) of the global batch."""
    inputs = []
    targets = []
    for rank in range(world_size):
        batches = Batches(
            model=gpt(),
            data=spec,
            seed=3,
            seq_len=None,
            global_batch_size=global_batch,
            micro_batch_size=micro,
            rank=rank,
            world_size=world_size,
        )
        for m in range(batches.accumulation_steps):
            x, y = batches.micro_batch(step, m)
            inputs.append(x)
            targets.append(y)
    return torch.cat(inputs), torch.cat(targets)


def test_the_sample_order_is_the_same_for_any_world_size_and_a_resume(tmp_path):
    spec = bytes_spec(tmp_path / "corpus.jsonl", cache_dir=str(tmp_path / "cache"), validation_fraction=0.1)
    corpus(tmp_path)
    source = DatasetSource(spec=spec, seq_len=8, seed=3)
    for step in (0, 1, 7, 40):  # 40: several epochs on
        one = step_samples(spec, world_size=1, step=step)
        for world_size in (2, 4):
            torch.testing.assert_close(step_samples(spec, world_size=world_size, step=step), one)
        want = source.train_block_tokens(step, range(8), 8)
        torch.testing.assert_close(one, (want[:, :-1], want[:, 1:]))
    # consecutive steps take consecutive positions of the order: a resume at step s takes the next samples
    both = source.train_block_tokens(0, range(16), 8)
    torch.testing.assert_close(source.train_block_tokens(1, range(8), 8), both[8:])


def test_held_out_blocks_never_train_and_each_rank_evaluates_its_slice(tmp_path):
    spec = bytes_spec(tmp_path / "corpus.jsonl", validation_fraction=0.2)
    corpus(tmp_path)
    source = DatasetSource(spec=spec, seq_len=8, seed=3)
    held = set(source.held_out.tolist())
    assert len(held) == -(-source.num_blocks // 5) and not held & set(source.perm.tolist())
    trained = {int(b) for step in range(3 * source.num_blocks) for b in source.train_block_ids(step, range(8), 8)}
    assert trained == set(source.perm.tolist()) and not trained & held
    world = 2
    micro = 2
    ranks = [
        Batches(
            model=gpt(),
            data=spec,
            seed=3,
            seq_len=None,
            global_batch_size=8,
            micro_batch_size=micro,
            rank=r,
            world_size=world,
        )
        for r in range(world)
    ]
    held_blocks = source.block_tokens(source.held_out)
    for index in range(2):
        for rank, batches in enumerate(ranks):
            x, y = batches.held_out_micro_batch(index)
            first = (index * world + rank) * micro
            want = held_blocks[[(first + j) % len(held) for j in range(micro)]]
            torch.testing.assert_close((x, y), (want[:, :-1], want[:, 1:]))


def test_the_token_file_is_written_once_and_reused(tmp_path):
    corpus(tmp_path)
    spec = bytes_spec(tmp_path / "corpus.jsonl", cache_dir=str(tmp_path / "cache"))
    before = datasets_module.tokenizations
    first = prepare_tokens(spec, tokenizer=datasets_module.ByteTokenizer())
    assert first.created and datasets_module.tokenizations == before + 1
    path = Path(first.path)
    assert path.parent == tmp_path / "cache" / "tokens" and path.stat().st_size == 2 * len(first.tokens)  # uint16
    sidecar = json.loads(path.with_suffix(".json").read_text())
    assert sidecar["num_tokens"] == len(first.tokens) and sidecar["dtype"] == "<u2" and sidecar["eos_id"] == EOS
    mtime = path.stat().st_mtime_ns
    again = prepare_tokens(spec, tokenizer=datasets_module.ByteTokenizer())
    assert not again.created and isinstance(again.tokens, np.memmap) and again.path == first.path
    assert datasets_module.tokenizations == before + 1 and path.stat().st_mtime_ns == mtime
    np.testing.assert_array_equal(again.tokens, first.tokens)
    with open(tmp_path / "corpus.jsonl", "a") as file:  # new content: a new key, tokenized again
        file.write(json.dumps({"text": "one more"}) + "\n")
    changed = prepare_tokens(spec, tokenizer=datasets_module.ByteTokenizer())
    assert changed.created and changed.path != first.path and len(changed.tokens) == len(first.tokens) + 9


def test_the_shipped_tokenizer_and_the_checks(tmp_path):
    spec = DatasetSpec(
        format="jsonl",
        path=str(EXAMPLES / "tiny-corpus.jsonl"),
        tokenizer=str(EXAMPLES),  # the directory: its tokenizer.json
        roots=(str(EXAMPLES),),
    )
    source = DatasetSource(spec=spec, seq_len=32, seed=0, vocab_size=512, global_batch_size=16)
    assert source.vocab_size == 512 and source.token_file.eos_id == 0
    tokens = source.token_file.tokens
    assert (tokens == 0).sum() == 2500 and tokens[-1] == 0  # one EOS after each document
    with pytest.raises(ValueError, match=r"data\.tokenizer: its vocabulary has 512 tokens, more than .*\(500\)"):
        DatasetSource(spec=spec, seq_len=32, seed=0, vocab_size=500)
    with pytest.raises(ValueError, match=r"data\.text_field: 'body' is not a column"):
        DatasetSource(spec=bytes_spec(EXAMPLES / "tiny-corpus.jsonl", text_field="body"), seq_len=32, seed=0)
    with pytest.raises(ValueError, match=r"data\.text_field: 'n' holds a int"):
        DatasetSource(spec=bytes_spec(corpus(tmp_path), text_field="n"), seq_len=8, seed=0)
    write_jsonl(tmp_path / "empty.jsonl", ["", ""])
    with pytest.raises(ValueError, match=r"data\.path: .* the dataset is empty"):
        DatasetSource(spec=bytes_spec(tmp_path / "empty.jsonl"), seq_len=8, seed=0)
    with pytest.raises(ValueError, match=r"leaving \d+ train blocks, fewer than one global batch of 16"):
        DatasetSource(spec=bytes_spec(tmp_path / "corpus.jsonl", validation_fraction=0.01), seq_len=99, seed=0,
                      global_batch_size=16)  # fmt: skip
    (tmp_path / "bad.json").write_text("{not a tokenizer")
    with pytest.raises(ValueError, match=r"data\.tokenizer: .* not a tokenizer\.json"):
        DatasetSource(spec=bytes_spec(tmp_path / "corpus.jsonl", tokenizer=str(tmp_path / "bad.json")), seq_len=8,
                      seed=0)  # fmt: skip
    with pytest.raises(ValueError, match=r"data\.tokenizer: required"):
        DatasetSource(spec=bytes_spec(tmp_path / "corpus.jsonl", tokenizer=None), seq_len=8, seed=0)


# --------------------------------------------------------------------------- through the API


@pytest.fixture
def data_app(ray_cluster, tmp_path):
    """The app with the data roots a tmp directory and the shipped examples."""
    root = tmp_path / "data"
    root.mkdir()
    settings = make_settings(tmp_path, data_roots=[str(root), str(EXAMPLES)])
    try:
        with TestClient(create_app(settings), raise_server_exceptions=False) as client:
            yield client, root, settings
    finally:
        end_supervisors(settings.ray_namespace)


def dataset_job(**data) -> dict:
    body = helpers.job_body(model={**helpers.TINY, "vocab_size": 512}, steps=2)
    return {**body, "data": {"kind": "dataset", "format": "jsonl", "tokenizer": "bytes", **data}}


def test_bad_datasets_are_422s_naming_the_field(data_app, tmp_path):
    client, root, _ = data_app
    corpus(root)
    write_jsonl(root / "empty.jsonl", [""])
    (root / "bad.json").write_text("{}")
    outside = write_jsonl(tmp_path / "outside.jsonl", ["x"])
    cases = [
        (dict(path=str(outside)), "data.path", "outside the data roots"),
        (dict(path=str(root / "*.parquet")), "data.path", "matches no jsonl files"),
        (dict(path=str(root / "corpus.jsonl"), tokenizer=str(root / "none.json")), "data.tokenizer", "no tokenizer"),
        (dict(path=str(root / "corpus.jsonl"), tokenizer=str(tmp_path)), "data.tokenizer", "outside the data roots"),
        (dict(path=str(root / "corpus.jsonl"), tokenizer=str(root / "bad.json")), "data.tokenizer", "not a tokenizer"),
        (dict(path=str(root / "corpus.jsonl"), text_field="body"), "data.text_field", "'body' is not a column"),
        (dict(path=str(root / "empty.jsonl")), "data.path", "the dataset is empty"),
        (
            dict(path=str(root / "corpus.jsonl"), format="text", text_field="body"),
            "data.text_field",
            "only applies to jsonl",
        ),
    ]
    for data, field, text in cases:
        r = client.post("/v1/jobs", params={"dry_run": True}, json=dataset_job(**data))
        assert r.status_code == 422, (data, r.text)
        assert text in r.json()["message"] and r.json()["detail"][0]["field"] == field, (data, r.json())
    small = dataset_job(path=str(root / "corpus.jsonl"), tokenizer=str(EXAMPLES / "tokenizer.json"))
    r = client.post("/v1/jobs", params={"dry_run": True}, json={**small, "model": {**helpers.TINY, "vocab_size": 300}})
    assert r.status_code == 422 and "512 tokens, more than the model's vocab_size (300)" in r.json()["message"]
    r = client.post("/v1/jobs", params={"dry_run": True}, json={**small, "global_batch_size": 400})
    assert r.status_code == 422 and "fewer than one global batch of 400" in r.json()["message"], r.text
    r = client.post("/v1/jobs", json={**small, "model": {"kind": "mlp", "sizes": [4, 2]}})
    assert r.status_code == 422 and "synthetic data only" in r.json()["message"]


def test_a_gpt_trains_on_the_example_corpus_through_the_api(data_app):
    """examples/tiny-gpt-corpus.json, for 40 steps (its paths are relative to the repository)."""
    client, _, settings = data_app
    body = json.loads((ROOT / "examples" / "tiny-gpt-corpus.json").read_text())
    data = {
        **body["data"],
        "path": str(ROOT / body["data"]["path"]),
        "tokenizer": str(ROOT / body["data"]["tokenizer"]),
    }
    body = {**body, "data": data, "steps": 40, "checkpoint_every": 0}
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 201, r.text
    tokens = list((Path(settings.checkpoint_uri) / "datasets" / "tokens").glob("*.bin"))
    assert len(tokens) == 1  # tokenized at submit, before any rank started
    mtime = tokens[0].stat().st_mtime_ns
    job = helpers.wait_job(client, r.json()["id"], lambda j: j["status"] in helpers.TERMINAL)
    assert job["status"] == "succeeded", job["error"]
    losses = [m["loss"] for m in client.get(f"/v1/jobs/{job['id']}/metrics").json()["data"]]
    assert len(losses) == 40 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0, losses
    assert [p.stat().st_mtime_ns for p in tokens[0].parent.glob("*.bin")] == [mtime]  # the ranks mapped it


def test_tokenizing_past_the_data_timeout_is_a_422(ray_cluster, tmp_path):
    settings = make_settings(tmp_path, data_roots=[str(EXAMPLES)], data_timeout_s=0.01)
    body = dataset_job(path=str(EXAMPLES / "tiny-corpus.jsonl"))
    try:
        with TestClient(create_app(settings), raise_server_exceptions=False) as client:
            r = client.post("/v1/jobs", params={"dry_run": True}, json=body)
    finally:
        end_supervisors(settings.ray_namespace)
    assert r.status_code == 422 and r.json()["error"] == "data_timeout", r.text
    assert "ZERO1_DATA_TIMEOUT_S = 0.01 s" in r.json()["message"]

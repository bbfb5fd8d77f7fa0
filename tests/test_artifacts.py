"""Evaluation on held-out data and a succeeded run's final model: in one process, on 2 gloo ranks,
and through the API and the CLI (2 ranks under Ray).

Packages: workers.training, service.store, service.cli.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, load_model
from torch import nn

from service import cli
from service.cli import jobs as cli_jobs
from service.schemas.model_specs import GPTModelSpec
from workers.config import DatasetSpec, HFSpec, SyntheticSpec, TrainConfig
from workers.data.sources import Batches
from workers.memory.model import GPTSpec, MLPSpec
from workers.models.builtin import build_model
from workers.training.artifacts import write_final
from workers.training.checkpoints import final_dir, shard_file
from workers.training.loop import train
from workers.training.reader import read_shard
from workers.zero.optimizer import ZeRO1AdamW, decay_param_groups
from zero1 import Client

from distributed import run_ranks
from helpers import TERMINAL, TINY, job_body, wait_job

SMALL = GPTSpec(vocab_size=64, n_layer=2, n_head=2, n_embd=32, block_size=32)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------- held-out data and eval


def test_held_out_batches_are_not_training_batches_and_each_rank_has_its_own():
    def batches(rank: int, model=SMALL) -> Batches:
        return Batches(
            model=model,
            data=SyntheticSpec(),
            seed=7,
            seq_len=None,
            global_batch_size=4,
            micro_batch_size=2,
            rank=rank,
            world_size=2,
        )

    training = {tuple(batches(r).micro_batch(s, 0)[0][i].tolist()) for r in (0, 1) for s in range(20) for i in (0, 1)}
    held_out = [batches(r).held_out_micro_batch(k)[0] for r in (0, 1) for k in range(3)]
    rows = [tuple(row.tolist()) for batch in held_out for row in batch]
    assert len(set(rows)) == len(rows) == 12 and not training & set(rows)
    torch.testing.assert_close(batches(1).held_out_micro_batch(2), batches(1).held_out_micro_batch(2))  # seeded
    mlp = MLPSpec(sizes=(5, 8, 3))
    x, y = batches(0, model=mlp).held_out_micro_batch(0)
    assert x.shape == (2, 5) and y.shape == (2,) and not torch.equal(x, batches(0, model=mlp).micro_batch(0, 0)[0])


def test_eval_rows_come_on_the_right_steps_and_equal_a_direct_computation(tmp_path):
    cfg = TrainConfig(
        model=SMALL,
        steps=7,
        precision="fp32",
        micro_batch_size=2,
        seed=3,
        eval_every=3,
        eval_batches=4,
        checkpoint_dir=str(tmp_path),
    )
    rows = []
    train(cfg, on_metrics=rows.append)
    assert [r.step for r in rows if r.eval_loss is not None] == [2, 5, 6]  # every 3rd, and the last
    assert all(math.isfinite(r.eval_loss) for r in rows if r.eval_loss is not None)

    # the last row's eval_loss, computed directly from the final weights on the same held-out batches
    model = build_model(SMALL, dtype=torch.float32)
    load_model(model, final_dir(tmp_path) / "model.safetensors")
    model.eval()
    held_out = Batches(
        model=SMALL,
        data=SyntheticSpec(),
        seed=3,
        seq_len=None,
        global_batch_size=2,
        micro_batch_size=2,
        rank=0,
        world_size=1,
    )
    total = torch.zeros((), dtype=torch.float32)
    with torch.no_grad():
        for index in range(4):
            total += model(*held_out.held_out_micro_batch(index)).float()
    assert rows[-1].eval_loss == (total / 4).item()

    # evaluating changes nothing of the training
    plain = []
    train(TrainConfig(**{**_fields(cfg), "eval_every": 0, "checkpoint_dir": None}), on_metrics=plain.append)
    assert [r.loss for r in plain] == [r.loss for r in rows] and all(r.eval_loss is None for r in plain)


def _fields(cfg: TrainConfig) -> dict:
    return {name: getattr(cfg, name) for name in cfg.__slots__}


def test_a_cancelled_run_writes_no_final_model(tmp_path):
    cfg = TrainConfig(model=SMALL, steps=5, precision="fp32", checkpoint_dir=str(tmp_path))
    seen = []
    result = train(cfg, on_metrics=seen.append, should_stop=lambda: len(seen) == 2)
    assert result.cancelled and not final_dir(tmp_path).exists()


# --------------------------------------------------------------------------- consolidation


def _two_ranks_write_the_full_model(rank: int, world_size: int, root: str) -> None:
    torch.manual_seed(0)
    model = build_model(SMALL, dtype=torch.bfloat16, seed=1)
    opt = ZeRO1AdamW(decay_param_groups(model, weight_decay=0.1), lr=1e-2, process_group=dist.group.WORLD)
    inputs = torch.randint(0, SMALL.vocab_size, (2, 16), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        opt.scale_loss(model(inputs, inputs)).backward()
        opt.step()
        opt.zero_grad()
    config = TrainConfig(model=SMALL, steps=2, precision="bf16")
    # 7 elements a message: every parameter crosses messages, and some cross the ranks' shards
    write_final(
        model,
        opt,
        config=config,
        directory=Path(root) / "final",
        rank=rank,
        world_size=world_size,
        process_group=dist.group.WORLD,
        chunk_numel=7,
    )
    full = opt.consolidated_state_dict(dst=0)
    if rank != 0:
        return
    saved = load_file(Path(root) / "final" / "model.safetensors")
    assert set(saved) == {name for name, _ in model.named_parameters()}  # the tied head once, as wte
    for name, tensor in saved.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, full["params"][name]["master"]), name
    # the 16-bit model is a rounding of the fp32 weights written
    for name, param in model.named_parameters():
        assert torch.equal(saved[name].to(torch.bfloat16), param.detach()), name


def test_two_ranks_gather_the_fp32_master_weights_chunk_by_chunk(tmp_path):
    run_ranks(2, _two_ranks_write_the_full_model, str(tmp_path))
    final = tmp_path / "final"
    manifest = json.loads((final / "manifest.json").read_text())
    assert [f["name"] for f in manifest["files"]] == ["model.safetensors", "spec.json"]
    for entry in manifest["files"]:
        assert entry["bytes"] == (final / entry["name"]).stat().st_size
        assert entry["sha256"] == _sha256(final / entry["name"])
    spec = GPTModelSpec.model_validate(json.loads((final / "spec.json").read_text())).to_spec()
    model = build_model(spec, dtype=torch.float32)
    assert load_model(model, final / "model.safetensors") == (set(), [])  # loads whole, the head re-tied
    assert model.lm_head.weight is model.transformer.wte.weight


# --------------------------------------------------------------------------- hf: save_pretrained


class CausalLM(nn.Module):
    """The shape of the hf kind's module: a transformers causal LM as `lm`, the loss from forward."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, labels=labels).loss


LLAMA = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
    "tie_word_embeddings": True,
}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_an_lm_is_saved_as_save_pretrained_lays_it_out_and_loads_with_the_same_logits(tmp_path, tied):
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    fields = {k: v for k, v in LLAMA.items() if k != "model_type"} | {"tie_word_embeddings": tied}
    config = LlamaConfig(**fields)
    model = CausalLM(AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    opt = ZeRO1AdamW(decay_param_groups(model, weight_decay=0.1), lr=1e-2)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # weights that differ from any init
        opt.scale_loss(model(ids, ids)).backward()
        opt.step()
        opt.zero_grad()
    tokenizer = tmp_path / "tokenizer.json"
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tokenizer))
    job = TrainConfig(
        model=HFSpec(config=LLAMA | {"tie_word_embeddings": tied}, vocab_size=64, block_size=32),
        data=DatasetSpec(format="jsonl", path=str(tmp_path / "corpus.jsonl"), tokenizer=str(tokenizer)),
        steps=2,
        precision="fp32",
    )
    final = tmp_path / "job" / "final"
    write_final(model, opt, config=job, directory=final, rank=0, world_size=1, process_group=None)

    loaded = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model.lm(ids).logits, rtol=0, atol=0)
    names = {f["name"] for f in json.loads((final / "manifest.json").read_text())["files"]}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert (final / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    assert not list(final.parent.glob(".final*"))  # written aside, then renamed into place


def test_a_bytes_job_final_directory_holds_its_tokenizer_and_names_its_eos(tmp_path):
    """final/ needs nothing the user must know: AutoTokenizer gives the bytes the data were tokenized
    as, and config.json's and generation_config.json's EOS is the bytes EOS (256), not the config's 0."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig

    torch.manual_seed(0)
    fields = LLAMA | {"vocab_size": 257, "eos_token_id": 0}
    model = CausalLM(AutoModelForCausalLM.from_config(LlamaConfig(**fields), dtype=torch.float32))
    opt = ZeRO1AdamW(decay_param_groups(model, weight_decay=0.1), lr=1e-2)
    job = TrainConfig(
        model=HFSpec(config=fields, vocab_size=257, block_size=32),
        data=DatasetSpec(format="jsonl", path=str(tmp_path / "corpus.jsonl"), tokenizer="bytes"),
        steps=1,
        precision="fp32",
    )
    final = tmp_path / "job" / "final"
    write_final(model, opt, config=job, directory=final, rank=0, world_size=1, process_group=None)

    tokenizer = AutoTokenizer.from_pretrained(final)
    text = "héllo, wörld\n😀"
    assert tokenizer(text)["input_ids"] == list(text.encode()) and tokenizer.decode(list(text.encode())) == text
    assert tokenizer.eos_token_id == 256 and len(tokenizer) == 257
    loaded = AutoModelForCausalLM.from_pretrained(final)
    assert loaded.config.eos_token_id == 256 and GenerationConfig.from_pretrained(final).eos_token_id == 256
    names = {f["name"] for f in json.loads((final / "manifest.json").read_text())["files"]}
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= names

    gpt = tmp_path / "gpt" / "final"  # a built-in model's final/ carries it too
    bytes_gpt = GPTSpec(vocab_size=257, n_layer=1, n_head=2, n_embd=16, block_size=32)
    builtin = build_model(bytes_gpt, dtype=torch.float32)
    gpt_opt = ZeRO1AdamW(builtin.parameters(), lr=1e-2)
    gpt_job = TrainConfig(model=bytes_gpt, data=job.data, steps=1, precision="fp32")
    write_final(builtin, gpt_opt, config=gpt_job, directory=gpt, rank=0, world_size=1, process_group=None)
    assert AutoTokenizer.from_pretrained(gpt)(text)["input_ids"] == list(text.encode())


# --------------------------------------------------------------------------- through the API and the CLI


@pytest.fixture(scope="module")
def succeeded(client):
    """A 2-rank GPT job with eval_every, run to success once for the tests below."""
    body = job_body(steps=8, micro_batch_size=2, eval_every=3, eval_batches=2, precision="fp32")
    job = client.post("/v1/jobs", json=body).json()
    job = wait_job(client, job["id"], lambda j: j["status"] in TERMINAL)
    assert job["status"] == "succeeded", job["error"]
    return job


def test_eval_loss_is_in_the_metrics_and_the_latest_row(client, succeeded):
    rows = client.get(f"/v1/jobs/{succeeded['id']}/metrics").json()["data"]
    assert [r["step"] for r in rows if r["eval_loss"] is not None] == [2, 5, 7]
    assert all(math.isfinite(r["eval_loss"]) for r in rows if r["eval_loss"] is not None)
    assert succeeded["latest"]["eval_loss"] == rows[-1]["eval_loss"]
    evaluated = client.get(f"/v1/jobs/{succeeded['id']}/metrics", params={"evaluated": True, "max_points": 2})
    assert [r["step"] for r in evaluated.json()["data"]] == [2, 5, 7]  # never thinned away


def _checkpoint_root(client, job_id: int) -> Path:
    from service.store.tables import Job

    runtime = client.app.state.runtime
    with runtime.db.session() as session:
        return runtime.storage.checkpoint_dir(session.get(Job, job_id))


def test_artifacts_list_the_model_and_spec_with_their_sha256_and_hold_the_final_weights(client, succeeded):
    listing = client.get(f"/v1/jobs/{succeeded['id']}/artifacts")
    assert listing.status_code == 200, listing.text
    body = listing.json()
    assert [f["name"] for f in body["data"]] == ["model.safetensors", "spec.json"] and body["count"] == 2
    root = _checkpoint_root(client, succeeded["id"])
    for entry in body["data"]:
        got = client.get(f"/v1/jobs/{succeeded['id']}/artifacts/{entry['name']}")
        assert got.status_code == 200 and int(got.headers["content-length"]) == entry["bytes"] == len(got.content)
        assert hashlib.sha256(got.content).hexdigest() == entry["sha256"] == _sha256(root / "final" / entry["name"])
    assert json.loads((root / "final" / "spec.json").read_text()) == TINY

    # the weights are the fp32 master weights of the last step: the last checkpoint's shards, joined
    weights = load_file(root / "final" / "model.safetensors")
    shards = [read_shard(shard_file(root, 7, rank, 2)) for rank in range(2)]
    model = build_model(GPTModelSpec.model_validate(TINY).to_spec(), dtype=torch.float32)
    for b, _ in enumerate(shards[0]["buffers"]):
        flat = torch.cat([shard["buffers"][b]["master"] for shard in shards])
        for param in shards[0]["buffers"][b]["params"]:
            expected = flat[param["offset"] : param["offset"] + param["numel"]].view(param["shape"])
            assert torch.equal(weights[param["name"]], expected), param["name"]
    assert load_model(model, root / "final" / "model.safetensors") == (set(), [])


def test_an_artifact_is_served_by_range(client, succeeded):
    url = f"/v1/jobs/{succeeded['id']}/artifacts/model.safetensors"
    whole = client.get(url).content
    part = client.get(url, headers={"Range": "bytes=8-99"})
    assert part.status_code == 206 and part.content == whole[8:100]
    assert part.headers["content-range"] == f"bytes 8-99/{len(whole)}"
    assert client.get(url, headers={"Range": f"bytes={len(whole) - 5}-"}).content == whole[-5:]
    assert client.get(url, headers={"Range": f"bytes={len(whole)}-"}).status_code == 416


@pytest.mark.parametrize(
    "name", ["manifest.json", "%2E%2E", "..%2Fcomplete.json", "%2E%2E%2Fstep-000000007%2Fcomplete.json", "nothing"]
)
def test_only_a_listed_name_is_served(client, succeeded, name):
    response = client.get(f"/v1/jobs/{succeeded['id']}/artifacts/{name}")
    assert response.status_code == 404


def test_a_job_that_has_not_succeeded_has_no_artifacts_yet(client):
    job = client.post("/v1/jobs", json=job_body(steps=1000, num_gpus=4)).json()
    client.post(f"/v1/jobs/{job['id']}/cancel")
    wait_job(client, job["id"], lambda j: j["status"] in TERMINAL)
    for path in ("artifacts", "artifacts/model.safetensors"):
        response = client.get(f"/v1/jobs/{job['id']}/{path}")
        assert response.status_code == 409 and response.json()["error"] == "conflict", response.text
    assert client.get("/v1/jobs/999999/artifacts").status_code == 404


def test_cli_download_verifies_every_file(client, succeeded, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli_jobs, "_client", lambda args, **_: Client(http=client))
    assert cli.main(["download", str(succeeded["id"]), str(tmp_path / "out")]) == 0
    root = _checkpoint_root(client, succeeded["id"])
    for name in ("model.safetensors", "spec.json"):
        assert (tmp_path / "out" / name).read_bytes() == (root / "final" / name).read_bytes()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all("sha256 ok" in line for line in lines), lines

    # a file that does not match its listed digest is refused, and not left in place
    listing = client.get(f"/v1/jobs/{succeeded['id']}/artifacts").json()
    listing["data"][1]["sha256"] = "0" * 64

    class Tampered:
        def __getattr__(self, name):
            return getattr(client, name)

        def get(self, url, **kwargs):
            if url.endswith("/artifacts"):
                return type("R", (), {"is_success": True, "json": lambda self: listing, "status_code": 200})()
            return client.get(url, **kwargs)

    monkeypatch.setattr(cli_jobs, "_client", lambda args, **_: Client(http=Tampered()))
    assert cli.main(["download", str(succeeded["id"]), str(tmp_path / "bad")]) == 1
    assert "sha256 mismatch" in capsys.readouterr().err and not (tmp_path / "bad" / "spec.json").exists()

"""Models, data and the training loop of one process, without Ray."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.checkpoints import checkpointed_metrics, discard_stored_metrics, latest_checkpoint
from workers.data import Batches, MarkovSource, SyntheticSpec, TextSpec
from workers.memory import GPTSpec, MLPSpec, Workload, breakdown
from workers.models import build_model, saved_activation_bytes
from workers.train import OptimizerSpec, TrainConfig, train

SMALL = GPTSpec(vocab_size=64, n_layer=2, n_head=2, n_embd=32, block_size=32)


@settings(max_examples=15, deadline=None)
@given(
    vocab_size=st.integers(2, 200), n_layer=st.integers(1, 3), n_head=st.integers(1, 4),
    head_dim=st.integers(1, 8), block_size=st.integers(1, 40),
)  # fmt: skip
def test_gpt_module_has_exactly_the_planned_parameters(vocab_size, n_layer, n_head, head_dim, block_size):
    spec = GPTSpec(vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, n_embd=n_head * head_dim,
                   block_size=block_size)  # fmt: skip
    model = build_model(spec, dtype=torch.float32)
    assert {name: tuple(p.shape) for name, p in model.named_parameters()} == spec.parameter_shapes()
    assert sum(p.numel() for p in model.parameters()) == spec.num_params


def test_mlp_module_has_exactly_the_planned_parameters():
    spec = MLPSpec(sizes=(13, 64, 7, 3))
    assert sum(p.numel() for p in build_model(spec, dtype=torch.float32).parameters()) == spec.num_params


@pytest.mark.parametrize("checkpointing", [False, True], ids=["full", "checkpointed"])
@pytest.mark.parametrize(
    ("dtype", "bytes_per_element"), [(torch.float32, 4), (torch.bfloat16, 2)], ids=["fp32", "bf16"]
)
@pytest.mark.parametrize(
    ("spec", "batch"),
    [
        (GPTSpec(vocab_size=256, n_layer=2, n_head=4, n_embd=64, block_size=64), 4),
        (GPTSpec(vocab_size=1024, n_layer=4, n_head=8, n_embd=128, block_size=128), 2),
        (GPTSpec(vocab_size=2048, n_layer=6, n_head=6, n_embd=192, block_size=96), 3),
    ],
    ids=["tiny", "small", "medium"],
)
def test_activation_estimate_matches_measurement(spec, batch, dtype, bytes_per_element, checkpointing):
    """The planner's activations against the bytes autograd really saves (the issue asks 15%; we hold 2%)."""
    torch.manual_seed(0)
    model = build_model(spec, dtype=dtype, activation_checkpointing=checkpointing)
    idx = torch.randint(0, spec.vocab_size, (batch, spec.block_size))
    measured = saved_activation_bytes(model, idx, idx)
    planned = spec.activation_bytes(micro_batch_size=batch, seq_len=spec.block_size,
                                    bytes_per_element=bytes_per_element, checkpointing=checkpointing)  # fmt: skip
    assert measured == pytest.approx(planned, rel=0.02)


def test_mlp_activation_estimate_matches_measurement():
    spec = MLPSpec(sizes=(64, 256, 256, 10))
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    measured = saved_activation_bytes(build_model(spec, dtype=torch.float32), x, y)
    planned = spec.activation_bytes(micro_batch_size=32, seq_len=1, bytes_per_element=4, checkpointing=False)
    assert measured == pytest.approx(planned, rel=0.02)


def batches(world_size: int, rank: int, *, micro: int, data=None, model=SMALL) -> Batches:
    return Batches(model=model, data=data or SyntheticSpec(), seed=7, seq_len=None, global_batch_size=8,
                   micro_batch_size=micro, rank=rank, world_size=world_size)  # fmt: skip


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_global_batch_is_the_same_for_any_world_size(world_size):
    whole = torch.cat([batches(1, 0, micro=2).micro_batch(3, m)[0] for m in range(4)])
    sliced = torch.cat(
        [batches(world_size, r, micro=2).micro_batch(3, m)[0] for r in range(world_size) for m in range(4 // world_size)]
    )
    assert torch.equal(whole, sliced)
    assert not torch.equal(whole, torch.cat([batches(1, 0, micro=8).micro_batch(4, 0)[0]]))  # steps differ


def test_batch_sizes_must_divide():
    with pytest.raises(ValueError, match=r"global_batch_size \(8\) must be a multiple of world_size \(3\)"):
        batches(3, 0, micro=1)


def test_markov_floor_is_between_zero_and_log_branching():
    source = MarkovSource(vocab_size=64, branching=4, seed=0)
    floor = source.loss_floor(32)
    assert 0 < floor < math.log(4)
    tokens = source.sample([1, 2, 3], 50)
    # every transition the sampler made has positive probability under the chain
    assert (source.transition[tokens[:, :-1], tokens[:, 1:]] > 0).all()


def test_text_data_is_character_level(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("hello zero one! " * 20, encoding="utf-8")
    b = batches(1, 0, micro=2, data=TextSpec(path=str(path)))
    inputs, targets = b.micro_batch(0, 0)
    assert inputs.shape == (2, 32) and torch.equal(inputs[:, 1:], targets[:, :-1])
    assert b.source.chars == sorted(set("hello zero one! "))
    too_small = GPTSpec(vocab_size=4, n_layer=1, n_head=1, n_embd=8, block_size=8)
    with pytest.raises(ValueError, match="has 9 distinct characters, more than vocab_size \\(4\\)"):
        batches(1, 0, micro=2, data=TextSpec(path=str(path)), model=too_small)


def test_training_reports_every_metric_and_its_planned_memory():
    cfg = TrainConfig(model=SMALL, steps=3, precision="bf16", micro_batch_size=4, global_batch_size=8)
    rows: list[dict] = []
    result = train(cfg, on_metrics=rows.append)
    assert (result.first_step, result.last_step, result.cancelled) == (0, 2, False)
    assert [r["step"] for r in rows] == [0, 1, 2]
    keys = {"step", "rank", "loss", "grad_norm", "loss_scale", "skipped", "step_time_s", "tokens_per_s",
            "mem_peak_bytes", "mem_planned_bytes"}  # fmt: skip
    assert all(set(r) == keys for r in rows)
    plan = breakdown(Workload.from_model(SMALL, precision="bf16", micro_batch_size=4), num_gpus=1, stage=1)
    assert rows[0]["mem_planned_bytes"] == plan.total_bytes
    assert rows[0]["mem_peak_bytes"] == pytest.approx(plan.total_bytes, rel=0.02)
    assert rows[0]["tokens_per_s"] == pytest.approx(8 * 32 / rows[0]["step_time_s"])


def test_fp16_training_uses_loss_scaling():
    rows: list[dict] = []
    train(TrainConfig(model=SMALL, steps=2, precision="fp16"), on_metrics=rows.append)
    assert rows[0]["loss_scale"] == 2.0**16 and all(math.isfinite(r["loss"]) for r in rows)


def final_state(root: Path) -> dict:
    step, _ = latest_checkpoint(root)
    return torch.load(root / f"step-{step:09d}" / "rank-00000-of-00001.pt")


def test_a_stopped_run_resumes_from_its_last_complete_checkpoint(tmp_path):
    base = {"model": SMALL, "steps": 12, "precision": "bf16", "micro_batch_size": 4, "checkpoint_every": 5,
            "optimizer": OptimizerSpec(lr=1e-3)}  # fmt: skip
    train(TrainConfig(**base, checkpoint_dir=str(tmp_path / "whole")))
    assert sorted(p.name for p in (tmp_path / "whole").iterdir()) == ["step-000000004", "step-000000009",
                                                                      "step-000000011"]  # fmt: skip

    stopped = TrainConfig(**base, checkpoint_dir=str(tmp_path / "stopped"))
    seen: list[int] = []
    result = train(stopped, on_metrics=lambda row: seen.append(row["step"]), should_stop=lambda: len(seen) == 8)
    assert result.cancelled and result.last_step == 7
    assert latest_checkpoint(tmp_path / "stopped") == (4, 1)
    resumed = train(stopped)
    assert (resumed.first_step, resumed.last_step) == (5, 11)
    for got, want in zip(final_state(tmp_path / "stopped")["buffers"], final_state(tmp_path / "whole")["buffers"]):
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got[kind], want[kind])


def test_an_incomplete_checkpoint_is_ignored(tmp_path):
    cfg = TrainConfig(model=SMALL, steps=4, precision="fp32", checkpoint_every=2, checkpoint_dir=str(tmp_path))
    train(cfg)
    (tmp_path / "step-000000003" / "complete.json").unlink()  # as if rank 0 died before marking it
    assert latest_checkpoint(tmp_path) == (1, 1)
    assert train(cfg).first_step == 2


def test_a_torn_checkpoint_marker_or_rows_file_is_skipped_not_raised(tmp_path):
    """A marker or rows file cut short (a write a crash lost) makes that checkpoint not count:
    the one before it is used, and no reader raises (the control plane reads these every relaunch)."""
    rows: list[dict] = []
    cfg = TrainConfig(model=SMALL, steps=4, precision="fp32", checkpoint_every=2, checkpoint_dir=str(tmp_path))
    train(cfg, on_metrics=rows.append)
    (tmp_path / "step-000000003" / "complete.json").write_text('{"step": 3, "wor')
    (tmp_path / "step-000000001" / "rank-00000-of-00001.metrics.json").write_text('[{"step": 0, ')
    assert latest_checkpoint(tmp_path) == (1, 1)
    assert [row["step"] for row in checkpointed_metrics(tmp_path, after_step=-1)] == [2, 3]
    assert train(cfg).first_step == 2


def test_every_checkpoint_file_is_fsynced_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    """A rename can reach the disk before the data it names: without fsync a power loss leaves a
    complete.json (or a shard) of zero length under its final name."""
    synced: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    train(TrainConfig(model=SMALL, steps=1, precision="fp32", checkpoint_dir=str(tmp_path)))
    assert str(tmp_path / "step-000000000") in synced  # the directory too: its new entries survive a power loss
    assert any(Path(path).name.startswith(".complete.json.tmp") for path in synced)
    assert any(Path(path).name.startswith(".rank-00000-of-00001.pt.tmp") for path in synced)


def test_a_first_run_refuses_a_directory_that_holds_another_runs_checkpoints(tmp_path):
    train(TrainConfig(model=SMALL, steps=2, precision="fp32", checkpoint_dir=str(tmp_path)))
    fresh = TrainConfig(model=SMALL, steps=4, precision="fp32", checkpoint_dir=str(tmp_path), resume=False)
    with pytest.raises(ValueError, match=r"already holds a checkpoint of step 1, and this run starts from scratch"):
        train(fresh)


def test_a_16_bit_gpt_can_compute_in_fp32():
    """compute_dtype: bf16 parameters and gradients, fp32 activations (CPUs without bf16 matmuls)."""
    idx = torch.randint(0, SMALL.vocab_size, (2, SMALL.block_size), generator=torch.Generator().manual_seed(0))
    mixed = build_model(SMALL, dtype=torch.bfloat16, compute_dtype=torch.float32)
    upcast = build_model(SMALL, dtype=torch.bfloat16).float()  # the same bf16 weights, held in fp32
    loss = mixed(idx, idx)
    loss.backward()
    torch.testing.assert_close(loss, upcast(idx, idx))
    assert all(p.dtype == p.grad.dtype == torch.bfloat16 for p in mixed.parameters())


def test_keep_last_prunes_older_checkpoints_and_a_crashs_leftovers(tmp_path):
    cfg = TrainConfig(model=SMALL, steps=10, precision="fp32", checkpoint_every=2, checkpoint_dir=str(tmp_path),
                      keep_last=2)  # fmt: skip
    (tmp_path / "step-000000000").mkdir(parents=True)  # an unfinished checkpoint of an earlier crash
    train(cfg)
    assert latest_checkpoint(tmp_path) == (9, 1)
    assert sorted(p.name for p in tmp_path.glob("step-*/rank-*.pt")) == ["rank-00000-of-00001.pt"] * 2
    assert sorted(p.parent.name for p in tmp_path.glob("step-*/complete.json")) == ["step-000000007", "step-000000009"]
    # the pruned ones keep only their rows, until the control plane says they are stored
    assert sorted(p.parent.name for p in tmp_path.glob("step-*/pruned.json")) == [f"step-00000000{s}" for s in (1, 3, 5)]
    assert [row["step"] for row in checkpointed_metrics(tmp_path, after_step=-1)] == list(range(10))
    assert discard_stored_metrics(tmp_path, through_step=4) == [1, 3]
    assert [row["step"] for row in checkpointed_metrics(tmp_path, after_step=-1)] == list(range(4, 10))
    assert discard_stored_metrics(tmp_path, through_step=9) == [5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000007", "step-000000009"]
    with pytest.raises(ValueError, match=r"keep_last \(-1\) >= 0"):
        TrainConfig(model=SMALL, steps=1, keep_last=-1)


def test_a_relaunch_reads_back_rows_whose_checkpoints_were_pruned_before_they_were_stored(tmp_path):
    """The ranks run ahead of the control plane; keep_last must not cost it rows it never got."""
    rows: list[dict] = []
    cfg = TrainConfig(model=SMALL, steps=12, precision="fp32", checkpoint_every=2, checkpoint_dir=str(tmp_path),
                      keep_last=1)  # fmt: skip
    train(cfg, on_metrics=rows.append)
    assert latest_checkpoint(tmp_path) == (11, 1)
    saved = checkpointed_metrics(tmp_path, after_step=2)  # the database stopped at step 2
    assert [row["step"] for row in saved] == list(range(3, 12))
    assert [row["loss"] for row in saved] == [row["loss"] for row in rows[3:]]


def test_the_rows_since_the_last_checkpoint_are_saved_with_it(tmp_path):
    rows: list[dict] = []
    cfg = TrainConfig(model=SMALL, steps=7, precision="fp32", checkpoint_every=3, checkpoint_dir=str(tmp_path))
    train(cfg, on_metrics=rows.append)
    merged = {k: v for k, v in rows[4].items() if k != "rank"} | {"mem_peak_bytes": [rows[4]["mem_peak_bytes"]]}
    saved = checkpointed_metrics(tmp_path, after_step=3)
    assert [row["step"] for row in saved] == [4, 5, 6] and saved[0] == merged
    assert checkpointed_metrics(tmp_path, after_step=6) == []

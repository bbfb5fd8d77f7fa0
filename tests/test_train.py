"""Models, data and the training loop of one process, without Ray.

Packages: workers.training, workers.models, workers.data.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import math
import os
import signal
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import workers.training.loop
from workers import limits
from workers.config import MAX_TEXT_BYTES, OptimizerSpec, SyntheticSpec, TextSpec, TrainConfig
from workers.data.sources import Batches, MarkovSource, _open_nofollow, read_text
from workers.memory.model import GPTSpec, MLPSpec, Workload, breakdown
from workers.models.builtin import build_model
from workers.records import MetricRow
from workers.training.checkpoints import checkpointed_metrics, discard_stored_metrics, latest_checkpoint
from workers.training.loop import NonFiniteError, save_checkpoint, train
from workers.training.reader import read_shard

from distributed import run_ranks
from figures import record

SMALL = GPTSpec(vocab_size=64, n_layer=2, n_head=2, n_embd=32, block_size=32)


@settings(max_examples=15, deadline=None)
@given(
    vocab_size=st.integers(2, 200),
    n_layer=st.integers(1, 3),
    n_head=st.integers(1, 4),
    head_dim=st.integers(1, 8),
    block_size=st.integers(1, 40),
)
def test_gpt_module_has_exactly_the_planned_parameters(vocab_size, n_layer, n_head, head_dim, block_size):
    spec = GPTSpec(
        vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, n_embd=n_head * head_dim, block_size=block_size
    )
    model = build_model(spec, dtype=torch.float32)
    assert {name: tuple(p.shape) for name, p in model.named_parameters()} == spec.parameter_shapes()
    assert sum(p.numel() for p in model.parameters()) == spec.num_params


def test_mlp_module_has_exactly_the_planned_parameters():
    spec = MLPSpec(sizes=(13, 64, 7, 3))
    assert sum(p.numel() for p in build_model(spec, dtype=torch.float32).parameters()) == spec.num_params


def batches(world_size: int, rank: int, *, micro: int, data=None, model=SMALL) -> Batches:
    return Batches(
        model=model,
        data=data or SyntheticSpec(),
        seed=7,
        seq_len=None,
        global_batch_size=8,
        micro_batch_size=micro,
        rank=rank,
        world_size=world_size,
    )


@pytest.mark.parametrize("kind", ["synthetic", "text"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_the_global_batch_is_the_same_for_any_world_size(world_size, kind, tmp_path):
    """Sample i of step s is the same at any N (an elastic job's resizes change nothing); the
    dataset kind's order is tests/test_datasets.py's."""
    data = None
    if kind == "text":
        path = tmp_path / "corpus.txt"
        path.write_text("".join(chr(ord("a") + (i * 7) % 26) for i in range(5_000)))
        data = TextSpec(path=str(path))
    whole = torch.cat([batches(1, 0, micro=2, data=data).micro_batch(3, m)[0] for m in range(4)])
    sliced = torch.cat(
        [
            batches(world_size, r, micro=2, data=data).micro_batch(3, m)[0]
            for r in range(world_size)
            for m in range(4 // world_size)
        ]
    )
    assert torch.equal(whole, sliced)
    other_step = batches(1, 0, micro=8, data=data).micro_batch(4, 0)[0]
    assert not torch.equal(whole, other_step)  # steps differ


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


@contextlib.contextmanager
def fails_if_blocked(seconds: int = 10):
    """A read that blocks (a FIFO without a writer) fails the test instead of hanging it."""

    def stop(signum, frame):
        raise TimeoutError(f"blocked for {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def data_root(tmp_path) -> Path:
    root = tmp_path / "data"
    root.mkdir()
    (root / "corpus.txt").write_text("hello zero one! " * 20, encoding="utf-8")
    (tmp_path / "secret.txt").write_text("outside the roots " * 20, encoding="utf-8")
    return root


def text_batches(path: Path, **spec) -> Batches:
    return batches(1, 0, micro=2, data=TextSpec(path=str(path), **spec))


def test_a_text_file_inside_the_data_roots_is_read(data_root):
    b = text_batches(data_root / "corpus.txt", roots=(str(data_root),))
    assert b.source.chars == sorted(set("hello zero one! "))
    (data_root / "crlf.txt").write_bytes(b"a\r\nb\rc\n" * 10)  # newlines as Path.read_text gives them
    assert read_text(TextSpec(path=str(data_root / "crlf.txt"), roots=(str(data_root),))) == "a\nb\nc\n" * 10


def test_a_text_file_swapped_for_a_symlink_out_of_the_roots_is_refused(data_root):
    corpus = data_root / "corpus.txt"
    text_batches(corpus, roots=(str(data_root),))  # checked at submit: inside
    corpus.unlink()
    corpus.symlink_to(data_root.parent / "secret.txt")  # swapped before the rank reads it
    with pytest.raises(
        ValueError,
        match=rf"data.path '{corpus}' resolves to {data_root.parent / 'secret.txt'}, "
        rf"outside the data roots \['{data_root}'\]",
    ):
        text_batches(corpus, roots=(str(data_root),))
    record("data.path swapped for a symlink out of the roots after submit", faults=1)


def test_a_symlink_to_dev_zero_is_refused(data_root):
    link = data_root / "zero.txt"
    link.symlink_to("/dev/zero")
    with pytest.raises(ValueError, match=r"resolves to /dev/zero, outside the data roots"):
        text_batches(link, roots=(str(data_root),))
    with fails_if_blocked(), pytest.raises(ValueError, match=r"\(/dev/zero\) is not a regular file \(mode c"):
        text_batches(link)  # no roots: still not read, not even the first byte


def test_a_fifo_or_a_directory_is_refused(data_root):
    fifo = data_root / "fifo.txt"
    os.mkfifo(fifo)
    with fails_if_blocked(), pytest.raises(ValueError, match=rf"'{fifo}' \({fifo}\) is not a regular file \(mode p"):
        text_batches(fifo, roots=(str(data_root),))
    (data_root / "dir.txt").mkdir()
    with pytest.raises(ValueError, match=r"dir.txt\) is not a regular file \(mode d"):
        text_batches(data_root / "dir.txt", roots=(str(data_root),))


def test_a_text_file_above_the_size_limit_is_refused(data_root):
    corpus = data_root / "corpus.txt"  # 320 bytes
    assert len(read_text(TextSpec(path=str(corpus), max_bytes=320))) == 320
    with pytest.raises(ValueError, match=rf"data.path '{corpus}' is 320 bytes, above the limit of 319 bytes"):
        text_batches(corpus, roots=(str(data_root),), max_bytes=319)
    assert TextSpec(path="x").max_bytes == MAX_TEXT_BYTES == 1 << 30
    with pytest.raises(ValueError, match=r"max_bytes \(0\) >= 1"):
        TextSpec(path="x", max_bytes=0)
    with pytest.raises(ValueError, match=r"data roots must be absolute .* got \['data'\]"):
        TextSpec(path="x", roots=("data",))


def test_a_component_swapped_for_a_symlink_after_the_check_is_not_followed(data_root):
    """The window between realpath and open: the rank opens the path it resolved, component by
    component from its root, following no symlink, so a swap inside that window fails to open."""
    (data_root / "sub").mkdir()
    (data_root / "sub" / "corpus.txt").write_text("x" * 100)
    fd = _open_nofollow(str(data_root / "sub" / "corpus.txt"), root=str(data_root))
    os.close(fd)
    (data_root / "sub" / "corpus.txt").unlink()
    (data_root / "sub" / "corpus.txt").symlink_to(data_root.parent / "secret.txt")
    with pytest.raises(OSError) as last:
        _open_nofollow(str(data_root / "sub" / "corpus.txt"), root=str(data_root))
    assert last.value.errno == errno.ELOOP
    (data_root / "sub").rename(data_root / "moved")
    (data_root / "sub").symlink_to(data_root.parent)  # a directory swapped for a link out of the root
    with pytest.raises(OSError) as middle:
        _open_nofollow(str(data_root / "sub" / "secret.txt"), root=str(data_root))
    assert middle.value.errno in (errno.ELOOP, errno.ENOTDIR)


def test_the_launcher_passes_the_data_roots_resolved(tmp_path, monkeypatch, data_root):
    from service.schemas.requests import JobSpec

    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    spec = JobSpec.model_validate(job_body(data={"kind": "text", "path": str(data_root / "corpus.txt")}))
    config = spec.to_config(checkpoint_dir="unused", data_roots=["data", str(tmp_path / "link")])
    assert config.data == TextSpec(
        path=str(data_root / "corpus.txt"), roots=(str(data_root), str(tmp_path / "elsewhere"))
    )
    assert spec.to_config(checkpoint_dir="unused").data.roots == ()  # none given: nothing is read


def test_training_reports_every_metric_and_its_planned_memory():
    cfg = TrainConfig(model=SMALL, steps=3, precision="bf16", micro_batch_size=4, global_batch_size=8)
    rows: list[MetricRow] = []
    result = train(cfg, on_metrics=rows.append)
    assert (result.first_step, result.last_step, result.cancelled) == (0, 2, False)
    assert [r.step for r in rows] == [0, 1, 2]
    keys = {
        "step",
        "rank",
        "loss",
        "grad_norm",
        "loss_scale",
        "skipped",
        "step_time_s",
        "tokens_per_s",
        "mem_peak_bytes",
        "mem_planned_bytes",
        "eval_loss",
        "world_size",
        "checkpoint_blocked_s",
        "lr",
    }
    assert all(set(r.to_json()) == keys and r.rank == 0 and r.world_size == 1 for r in rows)
    assert {r.lr for r in rows} == {cfg.optimizer.lr}  # the default schedule: constant, no warmup
    plan = breakdown(Workload.from_model(SMALL, precision="bf16", micro_batch_size=4), num_gpus=1, stage=1)
    assert rows[0].mem_planned_bytes == plan.total_bytes
    (peak,) = rows[0].mem_peak_bytes  # this rank's own
    assert peak == pytest.approx(plan.total_bytes, rel=0.02)
    assert rows[0].tokens_per_s == pytest.approx(8 * 32 / rows[0].step_time_s)


def test_fp16_training_uses_loss_scaling():
    rows: list[MetricRow] = []
    train(TrainConfig(model=SMALL, steps=2, precision="fp16"), on_metrics=rows.append)
    assert rows[0].loss_scale == 2.0**16 and all(math.isfinite(r.loss) for r in rows)


def final_state(root: Path) -> dict:
    step, _ = latest_checkpoint(root)
    return read_shard(root / f"step-{step:09d}" / "rank-00000-of-00001.safetensors")


def test_a_stopped_run_resumes_from_its_last_complete_checkpoint(tmp_path):
    base = {
        "model": SMALL,
        "steps": 12,
        "precision": "bf16",
        "micro_batch_size": 4,
        "checkpoint_every": 5,
        "optimizer": OptimizerSpec(lr=1e-3),
    }
    train(TrainConfig(**base, checkpoint_dir=str(tmp_path / "whole")))
    assert sorted(p.name for p in (tmp_path / "whole").iterdir()) == [
        "final",
        "step-000000004",
        "step-000000009",
        "step-000000011",
    ]

    stopped = TrainConfig(**base, checkpoint_dir=str(tmp_path / "stopped"))
    seen: list[int] = []
    result = train(stopped, on_metrics=lambda row: seen.append(row.step), should_stop=lambda: len(seen) == 8)
    assert result.cancelled and result.last_step == 7
    assert latest_checkpoint(tmp_path / "stopped") == (4, 1)
    resumed = train(stopped)
    assert (resumed.first_step, resumed.last_step) == (5, 11)
    for got, want in zip(
        final_state(tmp_path / "stopped")["buffers"], final_state(tmp_path / "whole")["buffers"], strict=True
    ):
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
    rows: list[MetricRow] = []
    cfg = TrainConfig(model=SMALL, steps=4, precision="fp32", checkpoint_every=2, checkpoint_dir=str(tmp_path))
    train(cfg, on_metrics=rows.append)
    (tmp_path / "step-000000003" / "complete.json").write_text('{"step": 3, "wor')
    (tmp_path / "step-000000001" / "rank-00000-of-00001.metrics.json").write_text('[{"step": 0, ')
    assert latest_checkpoint(tmp_path) == (1, 1)
    assert [row.step for row in checkpointed_metrics(tmp_path, after_step=-1)] == [2, 3]
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
    assert any(Path(path).name.startswith(".rank-00000-of-00001.safetensors.tmp") for path in synced)


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
    cfg = TrainConfig(
        model=SMALL, steps=10, precision="fp32", checkpoint_every=2, checkpoint_dir=str(tmp_path), keep_last=2
    )
    (tmp_path / "step-000000000").mkdir(parents=True)  # an unfinished checkpoint of an earlier crash
    train(cfg)
    assert latest_checkpoint(tmp_path) == (9, 1)
    assert sorted(p.name for p in tmp_path.glob("step-*/rank-*.safetensors")) == ["rank-00000-of-00001.safetensors"] * 2
    assert sorted(p.parent.name for p in tmp_path.glob("step-*/complete.json")) == ["step-000000007", "step-000000009"]
    # the pruned ones keep only their rows, until the control plane says they are stored
    assert sorted(p.parent.name for p in tmp_path.glob("step-*/pruned.json")) == [
        f"step-00000000{s}" for s in (1, 3, 5)
    ]
    assert [row.step for row in checkpointed_metrics(tmp_path, after_step=-1)] == list(range(10))
    assert discard_stored_metrics(tmp_path, through_step=4) == [1, 3]
    assert [row.step for row in checkpointed_metrics(tmp_path, after_step=-1)] == list(range(4, 10))
    assert discard_stored_metrics(tmp_path, through_step=9) == [5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "step-000000007", "step-000000009"]
    with pytest.raises(ValueError, match=r"keep_last \(-1\) >= 0"):
        TrainConfig(model=SMALL, steps=1, keep_last=-1)


def test_a_relaunch_reads_back_rows_whose_checkpoints_were_pruned_before_they_were_stored(tmp_path):
    """The ranks run ahead of the control plane; keep_last must not cost it rows it never got."""
    rows: list[MetricRow] = []
    cfg = TrainConfig(
        model=SMALL, steps=12, precision="fp32", checkpoint_every=2, checkpoint_dir=str(tmp_path), keep_last=1
    )
    train(cfg, on_metrics=rows.append)
    assert latest_checkpoint(tmp_path) == (11, 1)
    saved = checkpointed_metrics(tmp_path, after_step=2)  # the database stopped at step 2
    assert [row.step for row in saved] == list(range(3, 12))
    assert [row.loss for row in saved] == [row.loss for row in rows[3:]]


def test_the_rows_since_the_last_checkpoint_are_saved_with_it(tmp_path):
    rows: list[MetricRow] = []
    cfg = TrainConfig(model=SMALL, steps=7, precision="fp32", checkpoint_every=3, checkpoint_dir=str(tmp_path))
    train(cfg, on_metrics=rows.append)
    merged = MetricRow.merge({0: rows[4]})  # one rank: its own row, rank None
    saved = checkpointed_metrics(tmp_path, after_step=3)
    assert [row.step for row in saved] == [4, 5, 6] and saved[0] == merged
    assert checkpointed_metrics(tmp_path, after_step=6) == []


# --------------------------------------------------------------------------- non-finite gradients

TINY = GPTSpec(vocab_size=16, n_layer=1, n_head=1, n_embd=8, block_size=8)


def nan_loss_at(bad_steps: range):
    """A build_model for train() whose model's loss (hence its every gradient) is nan at those steps."""

    def poisoned(*args, **kwargs):
        model = build_model(*args, **kwargs)
        forwards = itertools.count()  # one micro-batch a step: the forward's count is the step
        model.register_forward_hook(
            lambda module, inputs, loss: loss * math.nan if next(forwards) in bad_steps else loss
        )
        return model

    return poisoned


def _nonfinite_training_fails(rank: int, world_size: int, root: str, precision: str) -> None:
    workers.training.loop.build_model = nan_loss_at(range(5, 10**6) if rank == 1 else range(0))  # a process of its own
    cfg = TrainConfig(
        model=TINY,
        steps=20,
        precision=precision,
        micro_batch_size=4,
        checkpoint_every=2,
        checkpoint_dir=root,
        keep_last=2,
        max_nonfinite_steps=3,
    )
    rows: list[MetricRow] = []
    message = (
        r"3 steps in a row had a non-finite gradient norm \(max_nonfinite_steps = 3\) at step 7: "
        r"steps 5-7 were skipped"
    )
    with pytest.raises(NonFiniteError, match=message):
        train(cfg, rank=rank, world_size=world_size, on_metrics=rows.append)
    assert [r.step for r in rows] == list(range(8))
    assert [r.skipped for r in rows] == [False] * 5 + [True] * 3  # on both ranks
    assert all(math.isfinite(r.grad_norm) for r in rows[:5]) and math.isnan(rows[5].grad_norm)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_run_whose_gradients_stay_nan_fails_and_keeps_its_good_checkpoints(tmp_path, precision):
    """Before: a nan global norm stepped the master weights to nan, the run went on to succeed,
    and pruning deleted the checkpoints from before the nan. Now the bad steps are skipped, the
    run fails after max_nonfinite_steps of them, and the checkpoint due at step 5 (a skipped
    step) is not written: steps 1 and 3 stay, complete."""
    run_ranks(2, _nonfinite_training_fails, str(tmp_path), precision)
    assert latest_checkpoint(tmp_path) == (3, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000001", "step-000000003"]
    assert len(list(tmp_path.glob("step-*/complete.json"))) == 2
    for shard in tmp_path.glob("step-*/rank-*.safetensors"):
        state = read_shard(shard)
        assert all(torch.isfinite(buf[kind]).all() for buf in state["buffers"] for kind in ("master", "exp_avg"))
    record(f"gradients nan from step 5, {precision}: failed, good checkpoints kept", faults=1)


def test_a_checkpoint_due_at_a_skipped_step_is_written_at_the_next_clean_one(tmp_path, monkeypatch):
    monkeypatch.setattr(workers.training.loop, "build_model", nan_loss_at(range(5, 6)))
    cfg = TrainConfig(
        model=TINY,
        steps=8,
        precision="bf16",
        micro_batch_size=4,
        checkpoint_every=2,
        checkpoint_dir=str(tmp_path),
        max_nonfinite_steps=2,
    )
    rows: list[MetricRow] = []
    train(cfg, on_metrics=rows.append)
    assert [r.skipped for r in rows] == [False] * 5 + [True] + [False] * 2
    assert sorted(p.parent.name for p in tmp_path.glob("step-*/complete.json")) == [
        "step-000000001",
        "step-000000003",
        "step-000000006",
        "step-000000007",
    ]
    assert [r.step for r in checkpointed_metrics(tmp_path, after_step=3)] == [4, 5, 6, 7]


def _nonfinite_state_is_not_saved(rank: int, world_size: int, root: str) -> None:
    model = build_model(TINY, dtype=torch.bfloat16)
    from workers.zero.optimizer import ZeRO1AdamW

    opt = ZeRO1AdamW(model.parameters())
    save_checkpoint(opt, Path(root), step=0)  # finite: written
    if rank == 1:
        opt._buffers[0].state["exp_avg_sq"][3] = math.inf  # one element, on one rank
    with pytest.raises(
        NonFiniteError,
        match=r"step 2: 1 of the optimizer state's elements are nan or inf "
        r"\(master 0, exp_avg 0, exp_avg_sq 1\)",
    ):
        save_checkpoint(opt, Path(root), step=2, keep_last=1)


def test_a_checkpoint_of_nonfinite_state_is_refused_on_every_rank_before_anything_is_written(tmp_path):
    run_ranks(2, _nonfinite_state_is_not_saved, str(tmp_path))
    assert latest_checkpoint(tmp_path) == (0, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000000"]  # nothing of step 2, none pruned


def job_body(**overrides) -> dict:
    """A job as POST /v1/jobs takes it: TINY on one GPU."""
    model = {"kind": "gpt", "vocab_size": 16, "n_layer": 1, "n_head": 1, "n_embd": 8, "block_size": 8}
    return {"name": "tiny", "model": model, "num_gpus": 1, "steps": 10, **overrides}


def test_max_nonfinite_steps_has_one_default_above_the_fp16_scalers_back_off():
    from service.schemas.requests import JobSpec
    from workers.zero.optimizer import DynamicLossScaler

    scaler = DynamicLossScaler()
    halvings = math.log(scaler.min_scale / scaler.scale, scaler.backoff_factor)  # 2**16 -> 1: 16 skips in a row
    assert halvings < limits.DEFAULT_MAX_NONFINITE_STEPS
    assert TrainConfig(model=TINY, steps=1).max_nonfinite_steps == limits.DEFAULT_MAX_NONFINITE_STEPS
    assert JobSpec.model_fields["max_nonfinite_steps"].default == limits.DEFAULT_MAX_NONFINITE_STEPS
    with pytest.raises(ValueError, match=r"max_nonfinite_steps \(0\) >= 1"):
        TrainConfig(model=TINY, steps=1, max_nonfinite_steps=0)
    assert JobSpec.model_validate(job_body()).max_nonfinite_steps == limits.DEFAULT_MAX_NONFINITE_STEPS
    spec = JobSpec.model_validate(job_body(max_nonfinite_steps=7))
    assert spec.to_config(checkpoint_dir="unused").max_nonfinite_steps == 7

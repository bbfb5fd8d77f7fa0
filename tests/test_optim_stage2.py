"""ZeRO2AdamW (ZeRO Stage 2) on 1-4 gloo ranks: against torch.optim.AdamW on the whole model, against
ZeRO1AdamW bit for bit, with its memory and its checkpoints those of stage 1.

Packages: workers.zero.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from test_optim import (
    HYPER,
    MAX_NORM,
    TINY_BUCKET_MB,
    AdamWReference,
    assert_matches_reference,
    loss_on,
    make_model,
    rank_slice,
    schedule,
)
from torch import nn

from workers.memory import model as memory
from workers.zero.optimizer import ZeRO1AdamW, decay_param_groups
from workers.zero.stage2 import MAX_BUCKETS_IN_FLIGHT, ZeRO2AdamW, stage2_reduce_op

from distributed import run_ranks, train_attempt


class SmallBuckets2(ZeRO2AdamW):
    """ZeRO2AdamW that accepts buckets of 30 fp32 elements: TinyNet's 301-element buffer in many."""

    min_bucket_cap_mb = TINY_BUCKET_MB


class SmallBuckets1(ZeRO1AdamW):
    min_bucket_cap_mb = TINY_BUCKET_MB


def _step(model, opt, rank: int, world_size: int, step: int, *, num_micro: int = 1) -> None:
    """One optimizer step on this rank's slice of global batch `step`, in num_micro micro-batches
    (unequal where the rows do not divide, each loss weighted by its share of the rows)."""
    idx, target = rank_slice(rank, world_size, step)
    micro = list(zip(idx.tensor_split(num_micro), target.tensor_split(num_micro), strict=True))
    for i, (x, y) in enumerate(micro):
        with opt.no_sync() if i < num_micro - 1 else contextlib.nullcontext():
            opt.scale_loss(loss_on(model, x, y, step) * (len(x) / len(idx))).backward()
        assert all(p.grad is None for p in model.parameters())  # stage 2 keeps no full gradient
    opt.step()
    opt.zero_grad()


@contextlib.contextmanager
def _watching_collectives() -> Iterator[dict[str, mock.MagicMock]]:
    names = ("reduce", "reduce_scatter_single", "all_gather_single", "all_reduce", "batch_isend_irecv")
    with contextlib.ExitStack() as stack:
        yield {name: stack.enter_context(mock.patch.object(dist, name, wraps=getattr(dist, name))) for name in names}


# ----------------------------------------------------------------------- against torch's AdamW


def _matches_reference(rank: int, world_size: int, dtype: torch.dtype, reduce_op: str, num_micro: int) -> None:
    """Clipped, scheduled, num_micro micro-batches a step, against AdamW on the whole batch (fp32: the
    model is the master copy; 16-bit: an fp32 master copy), 6 steps."""
    with _watching_collectives() as calls:
        model = make_model(dtype)
        opt = SmallBuckets2(
            decay_param_groups(model, weight_decay=0.1),
            **HYPER,
            max_grad_norm=MAX_NORM,
            reduce_op=reduce_op,
            gather_op="p2p" if reduce_op == "p2p" else "all_gather",  # the GPUs' gather beside their reduce
            bucket_cap_mb=TINY_BUCKET_MB,
        )
        assert opt.stage == 2 and len(opt._buckets) >= 5
        if opt.loss_scaler is not None:
            opt.loss_scaler.scale = 1024.0  # no overflow: the reference never skips
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        ref = AdamWReference(dtype, lr_lambda=schedule)
        norms = []
        for step in range(6):
            _step(model, opt, rank, world_size, step, num_micro=num_micro)
            sched.step()
            assert not opt.skipped
            norms.append(opt.grad_norm)
            rel = 2 * torch.finfo(dtype).eps if dtype != torch.float32 else 1e-5
            assert opt.grad_norm == pytest.approx(ref.step(step), rel=rel), f"step {step}"
            assert_matches_reference(model, ref, step=step)
    assert max(norms) > MAX_NORM  # the clip was applied
    # every backward reduced every bucket once, on every rank
    assert opt._shards.sent == 6 * num_micro * len(opt._buckets)
    if opt._shards.any_order:
        # gloo's sends go as each bucket fills: the staging buffers alive at once are the buckets in
        # flight and one filling a buffer, though this model's branch has gradients every other step
        bound = MAX_BUCKETS_IN_FLIGHT + len(opt._buffers)
        assert opt._shards.most_in_flight <= bound < len(opt._buckets), (opt._shards.most_in_flight, bound)
    counts = {name: c.call_count for name, c in calls.items()}
    if world_size == 1:
        assert all(n == 0 for name, n in counts.items() if name != "all_reduce"), counts
        return
    # the reduce went by the collective asked for, never by stage 1's reduce-scatter of a full buffer
    assert counts["reduce_scatter_single"] == 0
    if reduce_op == "reduce":
        assert counts["reduce"] >= 6 * num_micro * len(opt._buckets)
    else:
        assert counts["reduce"] == 0
    if reduce_op == "p2p":  # a batch of sends and receives per bucket, and the gather's
        assert counts["batch_isend_irecv"] >= 6 * num_micro * len(opt._buckets)
    else:
        assert counts["batch_isend_irecv"] == 0 and counts["all_gather_single"] > 0


@pytest.mark.parametrize("num_micro", [1, 3], ids=["one_batch", "accumulate3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_stage2_matches_torch_adamw(world_size, dtype, num_micro):
    """gloo's default reduce (p2p)."""
    run_ranks(world_size, _matches_reference, dtype, "p2p", num_micro)


@pytest.mark.parametrize("reduce_op", ["reduce", "all_reduce"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_stage2_on_the_gpus_collectives_on_gloo_matches_torch_adamw(world_size, dtype, reduce_op):
    """NCCL's default reduce for stage 2 (a reduce to each owner), and the all-reduce, forced on gloo."""
    assert stage2_reduce_op("nccl", "auto") == "reduce" and stage2_reduce_op("gloo", "auto") == "p2p"
    run_ranks(world_size, _matches_reference, dtype, reduce_op, 3)


def _collectives_learn_fill_order(rank: int, world_size: int, reduce_op: str) -> None:
    """A collective launches the buckets in one order on every rank: tag order for the first backward,
    then rank 0's fill order, in which the staging buffers alive at once stay bounded."""
    model = make_model()
    opt = SmallBuckets2(
        decay_param_groups(model, weight_decay=0.1), **HYPER, reduce_op=reduce_op, bucket_cap_mb=TINY_BUCKET_MB
    )
    shards = opt._shards
    assert not shards.any_order and shards.order == shards.buckets
    for step in range(3):
        idx, target = rank_slice(rank, world_size, step)
        opt.scale_loss(loss_on(model, idx, target, 0)).backward()  # step 0's graph every time: the branch too
        opt.step()
        opt.zero_grad()
        if step == 0:
            learned = [b.tag for b in shards.order]
            assert sorted(learned) == list(range(len(shards.buckets))) and learned != sorted(learned)
            shards.most_in_flight = 0
    assert [b.tag for b in shards.order] == learned
    bound = MAX_BUCKETS_IN_FLIGHT + len(opt._buffers)
    assert shards.most_in_flight <= bound < len(shards.buckets), (shards.most_in_flight, bound)


@pytest.mark.parametrize("reduce_op", ["reduce", "all_reduce"])
def test_stage2_collectives_launch_in_rank_0s_fill_order(reduce_op):
    run_ranks(2, _collectives_learn_fill_order, reduce_op)


def test_stage2_refuses_stage_1s_reduce_scatter():
    with pytest.raises(ValueError, match=r"stage 2 reduce_op must be .* got 'reduce_scatter'"):
        ZeRO2AdamW(make_model().parameters(), reduce_op="reduce_scatter")


# ----------------------------------------------------------------------- against stage 1


def _same_bits_as_stage1(rank: int, world_size: int, dtype: torch.dtype) -> None:
    """One micro-batch a step: the p2p reduce sums each owned element in rank order at both stages,
    and 0 + x is x: the same parameters and norms, bit for bit, over 8 steps (the `sometimes`
    branch without a gradient on odd steps)."""
    runs = {}
    for cls in (SmallBuckets1, SmallBuckets2):
        model = make_model(dtype)
        groups = decay_param_groups(model, weight_decay=0.1)
        opt = cls(groups, **HYPER, max_grad_norm=MAX_NORM, bucket_cap_mb=TINY_BUCKET_MB)
        norms = []
        for step in range(8):
            idx, target = rank_slice(rank, world_size, step)
            opt.scale_loss(loss_on(model, idx, target, step)).backward()
            opt.step()
            opt.zero_grad()
            norms.append(opt.grad_norm)
        runs[cls.stage] = ([p.detach().clone() for p in model.parameters()], norms, opt.state_dict())
    for p, q in zip(runs[1][0], runs[2][0], strict=True):
        assert torch.equal(p, q)
    assert runs[1][1] == runs[2][1]
    # the checkpoint format is stage 1's: the same keys and the same tensors
    flat1, flat2 = (_flatten(runs[s][2]) for s in (1, 2))
    assert flat1.keys() == flat2.keys()
    for key, value in flat1.items():
        assert torch.equal(value, flat2[key]) if isinstance(value, torch.Tensor) else value == flat2[key], key


def _flatten(state, prefix: str = "") -> dict:
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in _flatten(value, f"{prefix}{key}.").items()}
    if isinstance(state, list | tuple):
        return {k: v for i, value in enumerate(state) for k, v in _flatten(value, f"{prefix}{i}.").items()}
    return {prefix: state}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_stage2_gives_stage_1s_bits_and_checkpoint(world_size, dtype):
    run_ranks(world_size, _same_bits_as_stage1, dtype)


def _resume_across_stages(rank: int, world_size: int) -> None:
    """4 steps at stage 2, its state_dict loaded into stage 1 for 4 more (and the other way):
    equal to 8 steps at stage 1."""
    straight = make_model()
    opt = ZeRO1AdamW(decay_param_groups(straight, weight_decay=0.1), **HYPER, max_grad_norm=MAX_NORM)
    for step in range(8):
        _step_any(straight, opt, rank, world_size, step)
    for first, second in ((ZeRO2AdamW, ZeRO1AdamW), (ZeRO1AdamW, ZeRO2AdamW)):
        model = make_model()
        opt = first(decay_param_groups(model, weight_decay=0.1), **HYPER, max_grad_norm=MAX_NORM)
        for step in range(4):
            _step_any(model, opt, rank, world_size, step)
        saved = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, saved)
        saved.seek(0)
        loaded = torch.load(saved, weights_only=False)
        model = make_model()
        model.load_state_dict(loaded["model"])
        opt = second(decay_param_groups(model, weight_decay=0.1), **HYPER, max_grad_norm=MAX_NORM)
        opt.load_state_dict(loaded["opt"])
        for step in range(4, 8):
            _step_any(model, opt, rank, world_size, step)
        for p, q in zip(model.parameters(), straight.parameters(), strict=True):
            assert torch.equal(p, q), f"{first.__name__} then {second.__name__}"


def _step_any(model, opt, rank, world_size, step) -> None:
    idx, target = rank_slice(rank, world_size, step)
    loss_on(model, idx, target, step).backward()
    opt.step()
    opt.zero_grad()


def test_a_stage_2_checkpoint_resumes_at_stage_1_and_back():
    run_ranks(2, _resume_across_stages)


def test_a_stage_2_run_stopped_on_2_ranks_resumes_at_stage_1_on_4_on_the_uninterrupted_curve(tmp_path):
    """The loop's checkpoints are one format across stages and world sizes: stage 2 at N = 2 for 4 steps,
    then stage 1 at N = 4 from its checkpoint, follows stage 1 at N = 2 throughout (fp32, losses within
    1e-5), and ends on the very weights of the same stop and resume at stage 1 (stage 2 without
    accumulation gives stage 1's bits; N = 4 sums in another order, which Adam's normalised update
    carries to the weights' last bits, so those are compared with the same resume)."""
    run_ranks(2, train_attempt, str(tmp_path / "whole"), 1, 4, None, str(tmp_path / "whole.json"))
    for stage in (2, 1):
        root = str(tmp_path / f"stopped-{stage}")
        run_ranks(2, train_attempt, root, stage, 4, 3, str(tmp_path / f"first-{stage}.json"))
        run_ranks(4, train_attempt, root, 1, 2, None, str(tmp_path / f"second-{stage}.json"))
    read = lambda name: json.loads((tmp_path / f"{name}.json").read_text())
    whole = read("whole")
    first = read("first-2")
    second = read("second-2")
    assert [step for step, _ in first] == [0, 1, 2, 3] and [step for step, _ in second] == [4, 5, 6, 7]
    assert [step for step, _ in whole] == list(range(8))
    torch.testing.assert_close([loss for _, loss in first + second], [loss for _, loss in whole], rtol=1e-5, atol=0)
    assert first + second == read("first-1") + read("second-1")
    resumed = load_file(tmp_path / "stopped-2" / "final" / "model.safetensors")
    same_resume = load_file(tmp_path / "stopped-1" / "final" / "model.safetensors")
    assert resumed.keys() == same_resume.keys()
    assert all(torch.equal(resumed[name], tensor) for name, tensor in same_resume.items())


# ----------------------------------------------------------------------- memory


def _memory(rank: int, world_size: int) -> None:
    """The bytes stage 2 keeps are the memory model's at stage 2: the full flat parameters, the
    gradient shard and the state shard (and their padding); stage 1's gradient buffer is gone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64)).to(torch.bfloat16)
    opt = ZeRO2AdamW(decay_param_groups(model, weight_decay=0.1))
    assert all(buf.grads is None and buf.grad_shard.numel() == buf.shard_numel for buf in opt._buffers)
    groups = tuple(sum(slot.numel for slot in buf.slots) for buf in opt._buffers)
    workload = memory.Workload(
        precision="bf16",
        optimizer="adamw",
        group_numels=groups,
        alignment_numel=opt.alignment_numel,
    )
    planned = memory.breakdown(workload, num_gpus=world_size, stage=2)
    planned_states = planned.params_bytes + planned.grads_bytes + planned.optimizer_bytes + planned.padding_bytes
    assert opt.model_state_bytes() == planned_states  # the same on every rank
    owned = torch.tensor([sum(buf.owned_numel for buf in opt._buffers)])
    if world_size > 1:
        dist.all_reduce(owned)
    assert owned.item() == sum(groups)  # every gradient element is kept on exactly one rank
    stage1 = ZeRO1AdamW(decay_param_groups(model, weight_decay=0.1))
    saved = stage1.model_state_bytes() - opt.model_state_bytes()
    full = sum(buf.params.numel() * buf.params.element_size() for buf in opt._buffers)
    assert saved == full - full // world_size  # 2Ψ -> 2Ψ/N, padding included


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_stage2_state_bytes_equal_the_memory_model(world_size):
    run_ranks(world_size, _memory)

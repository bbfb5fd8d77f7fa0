"""ZeRO Stage 3 (workers/zero/stage3.py, on torch's FSDP2) on 1-4 gloo ranks against torch.optim.AdamW
on the whole model: clipping, a schedule, fp16 loss scaling and accumulation, as stage 1's tests.

Packages: workers.zero.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, load_model
from test_optim import (
    HYPER,
    MAX_NORM,
    AdamWReference,
    TinyNet,
    loss_on,
    make_model,
    rank_slice,
    schedule,
)
from torch import nn
from torch.distributed.tensor import DTensor
from torch.testing import assert_close

from workers.memory import model as memory
from workers.models.builtin import build_model
from workers.zero.optimizer import ZeRO1AdamW, decay_param_groups
from workers.zero.stage3 import ZeRO3AdamW, shard_model, units_of

from distributed import SMALL, run_ranks, train_attempt


def _full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if isinstance(param, DTensor) else param


def _assert_matches(model: nn.Module, ref: AdamWReference, *, dtype: torch.dtype, step: int) -> None:
    """The sharded fp32 master, gathered and cast to the compute dtype, against the reference's model:
    assert_close's defaults in fp32, one ulp at the tensor's scale in 16 bits (test_optim's rule)."""
    for (name, p), q in zip(model.named_parameters(), ref.model.parameters(), strict=True):
        got = _full(p.detach()).to(dtype)
        tol = {}
        if dtype != torch.float32:
            eps = torch.finfo(dtype).eps
            tol = {"atol": eps * q.abs().max().item(), "rtol": 2 * eps}
        assert_close(got, q.detach(), **tol, msg=lambda m, name=name: f"{name} at step {step}: {m}")


def _matches_reference(rank: int, world_size: int, dtype: torch.dtype, num_micro: int) -> None:
    """6 steps, num_micro micro-batches each, against AdamW on the whole batch (16-bit: over an fp32 master
    copy that starts as the 16-bit init upcast, as the shards do)."""
    model = shard_model(make_model(dtype).float(), compute_dtype=dtype)
    opt = ZeRO3AdamW(decay_param_groups(model, weight_decay=0.1), **HYPER, compute_dtype=dtype, max_grad_norm=MAX_NORM)
    assert isinstance(model.fc1.weight, DTensor) and (opt.loss_scaler is not None) == (dtype == torch.float16)
    if opt.loss_scaler is not None:
        opt.loss_scaler.scale = 1024.0  # no overflow: the reference never skips
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    ref = AdamWReference(dtype, lr_lambda=schedule)
    norms = []
    for step in range(6):
        idx, target = rank_slice(rank, world_size, step)
        micro = list(zip(idx.tensor_split(num_micro), target.tensor_split(num_micro), strict=True))
        for x, y in micro:
            with opt.no_sync():
                opt.scale_loss(loss_on(model, x, y, step) * (len(x) / len(idx))).backward()
        carried = torch.tensor([rank + 1.0, step])  # summed over the ranks by the norm's all-reduce
        opt.step(also_sum=carried)
        sched.step()
        opt.zero_grad()
        assert carried.tolist() == [world_size * (world_size + 1) / 2, step * world_size]
        assert not opt.skipped
        norms.append(opt.grad_norm)
        rel = 2 * torch.finfo(dtype).eps if dtype != torch.float32 else 1e-5
        assert opt.grad_norm == pytest.approx(ref.step(step), rel=rel), f"step {step}"
        _assert_matches(model, ref, dtype=dtype, step=step)
    assert max(norms) > MAX_NORM  # the clip was applied


@pytest.mark.parametrize("num_micro", [1, 3], ids=["one_batch", "accumulate3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_stage3_matches_torch_adamw(world_size, dtype, num_micro):
    run_ranks(world_size, _matches_reference, dtype, num_micro)


# ----------------------------------------------------------------------- one checkpoint format


def _steps(model, opt, sched, rank: int, world_size: int, steps: range) -> None:
    for step in steps:
        idx, target = rank_slice(rank, world_size, step)
        opt.scale_loss(loss_on(model, idx, target, step)).backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def _optimizer(stage: int, dtype: torch.dtype):
    """TinyNet and its optimizer at `stage`: stage 1 holds the model in `dtype`, stage 3 the fp32 master
    computing in it; both start from the same (16-bit-rounded) weights."""
    if stage == 1:
        model = make_model(dtype)
        opt = ZeRO1AdamW(decay_param_groups(model, weight_decay=0.1), **HYPER, max_grad_norm=MAX_NORM)
    else:
        model = shard_model(make_model(dtype).float(), compute_dtype=dtype)
        opt = ZeRO3AdamW(
            decay_param_groups(model, weight_decay=0.1), **HYPER, compute_dtype=dtype, max_grad_norm=MAX_NORM
        )
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule)


def _first_half(rank: int, world_size: int, stage: int, dtype: torch.dtype, directory: str) -> None:
    model, opt, sched = _optimizer(stage, dtype)
    _steps(model, opt, sched, rank, world_size, range(4))
    torch.save(opt.state_dict(), Path(directory) / f"rank-{rank}.pt")


def _second_half(rank: int, world_size: int, stage: int, dtype: torch.dtype, directory: str, saved_n: int) -> None:
    """Every shard of the first half's checkpoint loaded at this stage and N, 4 more steps, against
    AdamW on the whole batch for all 8."""
    model, opt, sched = _optimizer(stage, dtype)
    shards = [torch.load(Path(directory) / f"rank-{r}.pt", weights_only=False) for r in range(saved_n)]
    assert {shard["format"] for shard in shards} == {"zero1.sharded.v1"}
    opt.load_resharded_state_dicts(shards)
    sched.last_epoch = 3  # the schedule resumes with the steps, as the training loop's does (lr_at(step))
    sched.step()
    ref = AdamWReference(dtype, lr_lambda=schedule)
    for step in range(4):
        ref.step(step)
    for step in range(4, 8):
        _steps(model, opt, sched, rank, world_size, range(step, step + 1))
        ref.step(step)
        if stage == 3:
            _assert_matches(model, ref, dtype=dtype, step=step)
        else:
            for (name, p), q in zip(model.named_parameters(), ref.model.parameters(), strict=True):
                tol = (
                    {}
                    if dtype == torch.float32
                    else {"atol": torch.finfo(dtype).eps * q.abs().max().item(), "rtol": 2 * torch.finfo(dtype).eps}
                )
                assert_close(p.detach(), q.detach(), **tol, msg=lambda m, name=name: f"{name} at step {step}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("first", "second"), [((3, 4), (1, 2)), ((1, 2), (3, 3)), ((3, 2), (3, 4))])
def test_a_checkpoint_resumes_across_stages_and_world_sizes(tmp_path, dtype, first, second):
    """Stage 3 on 4 ranks, then stage 1 on 2 (and stage 1 to stage 3, stage 3 to stage 3 at another N):
    stage 1's sharded format, on the curve of AdamW on the whole batch."""
    (stage_a, n_a), (stage_b, n_b) = first, second
    run_ranks(n_a, _first_half, stage_a, dtype, str(tmp_path))
    run_ranks(n_b, _second_half, stage_b, dtype, str(tmp_path), n_a)


def test_a_stage_3_run_stopped_on_2_ranks_resumes_at_stage_1_on_4_on_the_uninterrupted_curve(tmp_path):
    """Through the training loop: stage 3 at N = 2 for 4 steps, then stage 1 at N = 4 from its checkpoint,
    follows stage 1 at N = 2 throughout (fp32, losses within 1e-5); final/ holds the same model."""
    run_ranks(2, train_attempt, str(tmp_path / "whole"), 1, 4, None, str(tmp_path / "whole.json"))
    stopped = str(tmp_path / "stopped")
    run_ranks(2, train_attempt, stopped, 3, 4, 3, str(tmp_path / "first.json"))
    run_ranks(4, train_attempt, stopped, 1, 2, None, str(tmp_path / "second.json"))
    read = lambda name: json.loads((tmp_path / f"{name}.json").read_text())
    whole = read("whole")
    first = read("first")
    second = read("second")
    assert [step for step, _ in first] == [0, 1, 2, 3] and [step for step, _ in second] == [4, 5, 6, 7]
    torch.testing.assert_close([loss for _, loss in first + second], [loss for _, loss in whole], rtol=1e-5, atol=0)
    resumed = load_file(tmp_path / "stopped" / "final" / "model.safetensors")
    straight = load_file(tmp_path / "whole" / "final" / "model.safetensors")
    assert {k: v.shape for k, v in resumed.items()} == {k: v.shape for k, v in straight.items()}
    for name, tensor in straight.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=1e-3, atol=1e-3, msg=name)


def test_a_stage_3_run_writes_the_final_model_of_its_master_weights(tmp_path):
    """final/ of a stage-3 run on 2 ranks: every parameter in fp32, loadable into the built-in GPT."""
    run_ranks(2, train_attempt, str(tmp_path / "s3"), 3, 4, None, str(tmp_path / "s3.json"))
    model = build_model(SMALL, dtype=torch.float32)
    missing, unexpected = load_model(model, tmp_path / "s3" / "final" / "model.safetensors", strict=False)
    assert unexpected == [] and all(name.endswith("lm_head.weight") for name in missing)  # tied: saved once
    saved = load_file(tmp_path / "s3" / "final" / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in saved.values())
    assert len(json.loads((tmp_path / "s3.json").read_text())) == 8


def _memory(rank: int, world_size: int) -> None:
    """A rank keeps its shards only: (4 + 4 + 8)·⌈Ψ_t/N⌉-ish bytes of the trained tensors, rows rounded up,
    where a replica would keep 16Ψ."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64))
    psi = sum(p.numel() for p in model.parameters())
    shard_model(model, compute_dtype=torch.bfloat16)
    opt = ZeRO3AdamW(decay_param_groups(model, weight_decay=0.1), compute_dtype=torch.bfloat16)
    model(torch.randn(4, 64)).float().square().mean().backward()
    opt.step()
    held = opt.model_state_bytes()
    plan = memory.breakdown(memory.Workload(group_numels=(psi,), precision="bf16"), num_gpus=world_size, stage=3)
    assert plan.params_bytes + plan.grads_bytes + plan.optimizer_bytes == 16 * -(-psi // world_size)
    # dim-0 shards of whole rows: within one row of each tensor per state of the ⌈Ψ/N⌉ formula
    rows = sum(p.shape[1] if p.dim() > 1 else 1 for p in model.parameters())
    assert abs(held - 16 * psi / world_size) <= 16 * rows, (held, 16 * psi / world_size)


@pytest.mark.parametrize("world_size", [2, 4])
def test_stage3_keeps_a_shard_of_every_model_state(world_size):
    run_ranks(world_size, _memory)


def test_the_units_are_a_transformers_blocks_or_the_children_that_share_nothing():
    from workers.memory.model import GPTSpec
    from workers.models.builtin import build_model

    gpt = build_model(GPTSpec(vocab_size=64, n_layer=3, n_head=2, n_embd=32, block_size=16), dtype=torch.float32)
    assert units_of(gpt) == list(gpt.transformer.h)
    tiny = TinyNet()
    names = [name for name, child in tiny.named_children() if any(child is unit for unit in units_of(tiny))]
    assert names == ["norm", "fc1", "fc2", "gate", "sometimes"]  # embed and head share their weight: the root's


def test_stage3_refuses_a_16_bit_model():
    with pytest.raises(ValueError, match="stage 3 shards an fp32 model"):
        shard_model(make_model(torch.bfloat16), compute_dtype=torch.bfloat16)

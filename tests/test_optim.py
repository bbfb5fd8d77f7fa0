"""ZeRO1AdamW on 1-4 gloo ranks against torch.optim.AdamW on the full model.

Packages: workers.zero.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing import assert_close

from workers.memory import model as memory
from workers.zero.optimizer import DynamicLossScaler, ZeRO1AdamW, decay_param_groups

from distributed import run_ranks
from figures import record

GLOBAL_BATCH = 12  # divisible by every world size tested, so each rank takes an equal slice
SEQ = 5
VOCAB = 13


class TinyNet(nn.Module):
    """Odd sizes on purpose: a 1-element bias and scale, tensors smaller than N,
    a tied head, a frozen tensor, and a branch that gets no gradient on odd steps.
    Its two flat buffers hold 301 = 7·43 and 41 elements: prime to every N tested."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 7)
        self.norm = nn.LayerNorm(7)
        self.fc1 = nn.Linear(7, 11)
        self.fc2 = nn.Linear(11, 7)
        self.gate = nn.Linear(7, 1)  # 1-element bias
        self.scale = nn.Parameter(torch.ones(1))
        self.sometimes = nn.Linear(7, 7)
        self.frozen = nn.Parameter(torch.randn(5), requires_grad=False)
        self.head = nn.Linear(7, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, idx: torch.Tensor, *, use_branch: bool) -> torch.Tensor:
        x = self.norm(self.embed(idx))
        x = x + self.fc2(torch.nn.functional.gelu(self.fc1(x))) * self.scale * torch.sigmoid(self.gate(x))
        if use_branch:
            x = x + self.sometimes(x)
        return self.head(x)


def make_model(dtype: torch.dtype = torch.float32) -> TinyNet:
    torch.manual_seed(0)
    return TinyNet().to(dtype)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)
    return idx, torch.roll(idx, 1, dims=1)


def loss_on(model: TinyNet, idx: torch.Tensor, target: torch.Tensor, step: int) -> torch.Tensor:
    logits = model(idx, use_branch=step % 2 == 0)
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), target.reshape(-1))


def rank_slice(rank: int, world_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx, target = global_batch(step)
    per_rank = GLOBAL_BATCH // world_size
    return idx[rank * per_rank : (rank + 1) * per_rank], target[rank * per_rank : (rank + 1) * per_rank]


def schedule(step: int) -> float:
    return min(1.0, (step + 1) / 5) * 0.5 ** (step // 10)  # warm-up, then step decay


HYPER = {"lr": 3e-2, "betas": (0.9, 0.95), "eps": 1e-8}
MAX_NORM = 0.5
TINY_BUCKET_MB = 30 * 4 / 2**20  # 30 fp32 elements: TinyNet's 301-element buffer in several buckets


class SmallBuckets(ZeRO1AdamW):
    """ZeRO1AdamW that accepts TINY_BUCKET_MB, far below what a job may ask (MIN_BUCKET_CAP_MB):
    the bucketing of a 301-element model is the same code as that of a large one."""

    min_bucket_cap_mb = TINY_BUCKET_MB


OVERLAP = {  # overlap on: both reduce and gather, with buckets small enough to cut TinyNet many ways
    False: {},
    True: {"overlap_comm": True, "overlap_gather": True, "bucket_cap_mb": TINY_BUCKET_MB},
}


def train_zero1(rank, world_size, model, opt, *, steps, first_step):
    for step in range(first_step, first_step + steps):
        idx, target = rank_slice(rank, world_size, step)
        opt.scale_loss(loss_on(model, idx, target, step)).backward()
        opt.step()
        opt.zero_grad()


# ----------------------------------------------------------------------- the reference


class AdamWReference:
    """torch.optim.AdamW on the whole model and the whole global batch: what ZeRO1AdamW on N ranks
    must match, clipped to MAX_NORM.

    In fp32 the model is its own master copy. In a 16-bit dtype, mixed precision's recipe: a
    16-bit replica computes the gradients; an fp32 master copy (the replica upcast at the start)
    takes them upcast, is clipped and stepped, and is cast back into the replica."""

    def __init__(self, dtype: torch.dtype = torch.float32, *, lr_lambda=None) -> None:
        self.model = make_model(dtype)
        self.master = self.model if dtype == torch.float32 else make_model(torch.float32)
        if self.master is not self.model:
            with torch.no_grad():
                for p16, p32 in zip(self.model.parameters(), self.master.parameters(), strict=True):
                    p32.copy_(p16)
        self.opt = torch.optim.AdamW(decay_param_groups(self.master, weight_decay=0.1), **HYPER, fused=True)
        self.sched = None if lr_lambda is None else torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda)

    def step(self, step: int) -> float:
        """One step on global batch `step`; returns the global gradient norm before clipping."""
        self.model.zero_grad(set_to_none=True)
        loss_on(self.model, *global_batch(step), step).backward()
        if self.master is not self.model:
            for p16, p32 in zip(self.model.parameters(), self.master.parameters(), strict=True):
                p32.grad = None if p16.grad is None else p16.grad.float()
        norm = torch.nn.utils.clip_grad_norm_(self.master.parameters(), MAX_NORM)
        self.opt.step()
        if self.sched is not None:
            self.sched.step()
        if self.master is not self.model:
            with torch.no_grad():
                for p16, p32 in zip(self.model.parameters(), self.master.parameters(), strict=True):
                    p16.copy_(p32)
        return norm.item()


def assert_matches_reference(model: nn.Module, ref: AdamWReference, *, step: int) -> None:
    """fp32: assert_close's defaults (rtol 1.3e-6, atol 1e-5): the N ranks (and micro-batches) sum
    the same gradients in another order, a few fp32 roundings apart. 16-bit: within the model dtype's rounding: the
    two sides round the 16-bit gradients of different batch splits differently, so allow one ulp
    at the tensor's scale."""
    for (name, p), q in zip(model.named_parameters(), ref.model.parameters(), strict=True):
        tol = {}
        if p.dtype != torch.float32:
            eps = torch.finfo(p.dtype).eps
            tol = {"atol": eps * q.abs().max().item(), "rtol": 2 * eps}
        assert_close(p, q, **tol, msg=lambda m, name=name: f"{name} at step {step}: {m}")


# ----------------------------------------------------------------------- fp32: exact AdamW


def _fp32_matches_adamw(rank: int, world_size: int, steps: int, overlap: bool = False) -> None:
    model = make_model()
    opt = SmallBuckets(decay_param_groups(model, weight_decay=0.1), **HYPER, max_grad_norm=MAX_NORM, **OVERLAP[overlap])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    ref = AdamWReference(lr_lambda=schedule)
    for step in range(steps):
        idx, target = rank_slice(rank, world_size, step)
        loss_on(model, idx, target, step).backward()
        opt.step()
        opt.zero_grad()
        sched.step()

        ref_norm = ref.step(step)
        assert opt.grad_norm == pytest.approx(ref_norm, rel=1e-5), f"step {step}"
        assert not opt.skipped
        assert_matches_reference(model, ref, step=step)
    # the branch without a gradient on odd steps took half the steps, as in torch.optim.AdamW
    steps_of = {s.name: s.step for s in opt._slots}
    assert steps_of["sometimes.weight"] == math.ceil(steps / 2) and steps_of["fc1.weight"] == steps
    assert torch.equal(model.frozen, make_model().frozen)


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_fp32_matches_torch_adamw(world_size, overlap):
    run_ranks(world_size, _fp32_matches_adamw, 24, overlap)


def test_without_process_group_it_is_adamw_on_a_master_copy():
    """World size 1 with no torch.distributed at all: no communication, plain AdamW."""
    assert not dist.is_initialized()
    _fp32_matches_adamw(0, 1, 6)


def test_buffer_totals_are_prime_to_every_world_size_tested():
    opt = ZeRO1AdamW(decay_param_groups(make_model(), weight_decay=0.1))
    assert [buf.numel for buf in opt._buffers] == [301, 41]
    assert all(math.gcd(buf.numel, n) == 1 for buf in opt._buffers for n in (2, 3, 4))


def test_workers_exports_the_optimizer():
    import workers

    assert workers.ZeRO1AdamW is ZeRO1AdamW


# ----------------------------------------------------------------------- mixed precision


def _mixed_matches_master_reference(rank: int, world_size: int, dtype: torch.dtype, steps: int, overlap: bool) -> None:
    model = make_model(dtype)
    opt = SmallBuckets(decay_param_groups(model, weight_decay=0.1), **HYPER, max_grad_norm=MAX_NORM, **OVERLAP[overlap])
    assert (opt.loss_scaler is not None) == (dtype == torch.float16)
    if opt.loss_scaler is not None:
        opt.loss_scaler.scale = 1024.0  # no overflow: the reference never skips
    ref = AdamWReference(dtype)
    for step in range(steps):
        idx, target = rank_slice(rank, world_size, step)
        opt.scale_loss(loss_on(model, idx, target, step)).backward()
        opt.step()
        opt.zero_grad()
        assert not opt.skipped
        ref.step(step)
        assert_matches_reference(model, ref, step=step)


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_mixed_precision_matches_fp32_master_reference(world_size, dtype, overlap):
    run_ranks(world_size, _mixed_matches_master_reference, dtype, 20, overlap)


# ----------------------------------------------------------------------- loss scaling


def _overflow_skips_on_every_rank(rank: int, world_size: int) -> None:
    model = make_model(torch.float16)
    opt = ZeRO1AdamW(model.parameters(), lr=1e-2, loss_scaler=DynamicLossScaler(scale=1024.0, min_scale=256.0))
    before = [p.detach().clone() for p in model.parameters()]
    idx, target = rank_slice(rank, world_size, 0)
    loss = loss_on(model, idx, target, 0)
    if rank == world_size - 1:
        loss = loss * float("inf")  # overflow on one rank only
    opt.scale_loss(loss).backward()
    opt.step()
    opt.zero_grad()
    assert opt.skipped and not math.isfinite(opt.grad_norm)
    assert opt.loss_scale == 512.0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(s.step == 0 for s in opt._slots)

    opt.scale_loss(loss_on(model, idx, target, 0)).backward()  # a clean step goes through
    opt.step()
    opt.zero_grad()
    assert not opt.skipped and opt.loss_scale == 512.0
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))

    for _ in range(2):  # 512 -> 256 (the minimum), then an overflow at the minimum is an error
        opt.scale_loss(loss_on(model, idx, target, 0) * float("inf")).backward()
        if opt.loss_scale == 256.0:
            with pytest.raises(FloatingPointError, match=r"minimum loss scale \(256.0\)"):
                opt.step()
        else:
            opt.step()
        opt.zero_grad()


def test_fp16_overflow_skips_the_step_on_every_rank_and_halves_the_scale():
    run_ranks(2, _overflow_skips_on_every_rank)


def _poison_one_element(param: torch.Tensor, value: float):
    """Every gradient of `param` gets `value` in its first element, before it reaches .grad; the hook's handle."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[0] = value
        return grad

    return param.register_hook(hook)


def _state_of(opt: ZeRO1AdamW) -> list[torch.Tensor]:
    return [opt._state(buf, kind).clone() for buf in opt._buffers for kind in ("master", "exp_avg", "exp_avg_sq")]


def _nonfinite_norm_skips_on_every_rank(rank: int, world_size: int, dtype: torch.dtype, bad: float) -> None:
    """No loss scaler (bf16, fp32): a nan or inf in one element of rank 1's gradient skips the
    step on every rank, changing nothing, and the next clean step is the one an optimizer that
    never saw the bad step takes."""
    model = make_model(dtype)
    clean = make_model(dtype)
    opt = ZeRO1AdamW(decay_param_groups(model, weight_decay=0.1), **HYPER, max_grad_norm=MAX_NORM)
    clean_opt = ZeRO1AdamW(decay_param_groups(clean, weight_decay=0.1), **HYPER, max_grad_norm=MAX_NORM)
    assert opt.loss_scaler is None
    train_zero1(rank, world_size, model, opt, steps=2, first_step=0)
    train_zero1(rank, world_size, clean, clean_opt, steps=2, first_step=0)
    params = _params(model)
    state = _state_of(opt)
    counts = [s.step for s in opt._slots]

    poison = contextlib.nullcontext()
    if rank == 1:  # fc1.weight's first element is in rank 0's shard: the bad value crosses ranks
        poison = _poison_one_element(model.fc1.weight, bad)
    train_zero1(rank, world_size, model, opt, steps=1, first_step=2)
    assert opt.skipped and not math.isfinite(opt.grad_norm), (rank, opt.grad_norm)
    assert all(torch.equal(p, q) for p, q in zip(_params(model), params, strict=True))
    assert all(torch.equal(t, u) for t, u in zip(_state_of(opt), state, strict=True))
    assert [s.step for s in opt._slots] == counts

    if rank == 1:
        poison.remove()  # the gradients are clean again
    train_zero1(rank, world_size, model, opt, steps=1, first_step=3)
    train_zero1(rank, world_size, clean, clean_opt, steps=1, first_step=3)
    assert not opt.skipped and opt.grad_norm == clean_opt.grad_norm
    assert all(torch.equal(p, q) for p, q in zip(_params(model), _params(clean), strict=True))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_nonfinite_grad_norm_skips_the_step_on_every_rank_without_a_loss_scaler(dtype, bad):
    run_ranks(2, _nonfinite_norm_skips_on_every_rank, dtype, bad)
    record(f"{bad} gradient on one rank, {str(dtype).removeprefix('torch.')}: the step skipped on every rank", faults=1)


def test_loss_scaler_grows_after_its_interval():
    scaler = DynamicLossScaler(scale=8.0, growth_interval=3)
    for _ in range(3):
        scaler.update(overflow=False)
    assert scaler.scale == 16.0 and scaler.clean_steps == 0
    scaler.update(overflow=True)
    assert scaler.scale == 8.0


# ----------------------------------------------------------------------- memory = the plan


GPT = memory.GPTSpec(vocab_size=67, n_layer=2, n_head=2, n_embd=24, block_size=17)


def _gpt_groups(dtype: torch.dtype) -> list[dict]:
    params = [(n, nn.Parameter(torch.randn(shape).to(dtype))) for n, shape in GPT.parameter_shapes().items()]
    return [
        {"params": [(n, p) for n, p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [(n, p) for n, p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _memory_matches_plan(rank: int, world_size: int) -> None:
    for dtype, precision in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float32, "fp32")):
        opt = ZeRO1AdamW(_gpt_groups(dtype))
        plan = memory.breakdown(memory.Workload.from_model(GPT, precision=precision), num_gpus=world_size, stage=1)
        measured = opt.memory_bytes()
        assert sum(measured.values()) == plan.optimizer_bytes + plan.padding_bytes, (precision, measured, plan)
        owned = torch.tensor([sum(buf.owned_numel for buf in opt._buffers)])
        if world_size > 1:
            dist.all_reduce(owned)
        assert owned.item() == GPT.num_params  # every element's state lives on exactly one rank
        allocated = sum(
            t.numel() * t.element_size() for buf in opt._buffers for t in (buf.params, buf.grads, *buf.state.values())
        )
        assert allocated == plan.params_bytes + plan.grads_bytes + plan.optimizer_bytes + plan.padding_bytes
        assert measured["master"] == (0 if dtype == torch.float32 else 4 * sum(b.owned_numel for b in opt._buffers))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_state_bytes_per_rank_equal_the_memory_model(world_size):
    run_ranks(world_size, _memory_matches_plan)


# ----------------------------------------------------------------------- checkpoints


def _sharded_round_trip(rank: int, world_size: int) -> None:
    model = make_model(torch.bfloat16)
    opt = ZeRO1AdamW(decay_param_groups(model, weight_decay=0.1), **HYPER, max_grad_norm=MAX_NORM)
    train_zero1(rank, world_size, model, opt, steps=3, first_step=3)
    state = opt.state_dict()
    assert state["buffers"][0]["exp_avg"].numel() == opt._buffers[0].owned_numel  # no padding saved
    train_zero1(rank, world_size, model, opt, steps=3, first_step=6)
    expected = [p.detach().clone() for p in model.parameters()]

    resumed = make_model(torch.bfloat16)
    resumed_opt = ZeRO1AdamW(decay_param_groups(resumed, weight_decay=0.1), **HYPER, max_grad_norm=MAX_NORM)
    resumed_opt.load_state_dict(state)
    train_zero1(rank, world_size, resumed, resumed_opt, steps=3, first_step=6)
    for p, q in zip(resumed.parameters(), expected, strict=True):
        assert torch.equal(p, q)


def test_sharded_checkpoint_resumes_exactly():
    run_ranks(2, _sharded_round_trip)


def _save_consolidated(rank: int, world_size: int, path: str) -> None:
    model = make_model()
    opt = ZeRO1AdamW(decay_param_groups(model, weight_decay=0.1), **HYPER, max_grad_norm=MAX_NORM)
    train_zero1(rank, world_size, model, opt, steps=4, first_step=4)
    consolidated = opt.consolidated_state_dict(chunk_numel=17)  # small chunks: many rounds
    assert (consolidated is None) == (rank != 0)
    if rank == 0:
        torch.save(consolidated, path)
    train_zero1(rank, world_size, model, opt, steps=4, first_step=8)
    if rank == 0:
        torch.save([p.detach() for p in model.parameters()], path + ".final")


def _resume_consolidated(rank: int, world_size: int, path: str) -> None:
    model = make_model()
    opt = ZeRO1AdamW(decay_param_groups(model, weight_decay=0.1), **HYPER, max_grad_norm=MAX_NORM)
    saved = torch.load(path)
    opt.load_state_dict(saved)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, saved["params"][name]["master"]), name
    train_zero1(rank, world_size, model, opt, steps=4, first_step=8)
    for p, q in zip(model.parameters(), torch.load(path + ".final"), strict=True):
        assert_close(p, q)


def test_consolidated_checkpoint_reshards_from_4_to_2_and_3(tmp_path):
    path = str(tmp_path / "consolidated.pt")
    run_ranks(4, _save_consolidated, path)
    saved = torch.load(path)
    assert saved["params"]["fc1.weight"]["exp_avg"].shape == (11, 7)
    assert saved["params"]["fc1.weight"]["step"] == 4
    for world_size in (2, 3):
        run_ranks(world_size, _resume_consolidated, path)


def test_sharded_checkpoint_refuses_another_world_size():
    model = make_model()
    opt = ZeRO1AdamW(model.parameters())
    state = opt.state_dict()
    state["world_size"] = 2
    with pytest.raises(ValueError, match="rank 0 of 2 .* cannot load into rank 0 of 1"):
        opt.load_state_dict(state)


# ----------------------------------------------------------------------- overlap


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _overlap_changes_no_bits(rank: int, world_size: int, dtype: torch.dtype) -> None:
    """Buckets sent during backward, or all of them in step(), or everything over gloo's
    all_reduce: the first two are the same bits (the owner sums in rank order either way),
    the third the same values within rounding."""
    runs = {}
    for name, kwargs in {
        "overlap": OVERLAP[True],
        "no_overlap": {"bucket_cap_mb": TINY_BUCKET_MB},
        "all_reduce": {"reduce_op": "all_reduce", "gather_op": "all_reduce"},
    }.items():
        model = make_model(dtype)
        opt = SmallBuckets(decay_param_groups(model, weight_decay=0.1), **HYPER, max_grad_norm=MAX_NORM, **kwargs)
        if name == "overlap":
            assert opt.overlap_comm and opt.overlap_gather and len(opt._buckets) >= 5
            assert len(opt._gather_slices(opt._buffers[0])) > 1
        else:
            assert not opt.overlap_comm
        norms = []
        for step in range(8):
            idx, target = rank_slice(rank, world_size, step)
            opt.scale_loss(loss_on(model, idx, target, step)).backward()
            opt.step()
            opt.zero_grad()
            norms.append(opt.grad_norm)
        runs[name] = (_params(model), norms)
    for p, q in zip(runs["overlap"][0], runs["no_overlap"][0], strict=True):
        assert torch.equal(p, q)
    assert runs["overlap"][1] == runs["no_overlap"][1]
    for p, q in zip(runs["overlap"][0], runs["all_reduce"][0], strict=True):
        assert_close(p, q, atol=4 * torch.finfo(dtype).eps * q.abs().max().item(), rtol=4 * torch.finfo(dtype).eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_overlap_on_or_off_gives_the_same_bits(world_size, dtype):
    run_ranks(world_size, _overlap_changes_no_bits, dtype)


def _buckets_go_during_backward(rank: int, world_size: int) -> None:
    model = make_model()
    opt = SmallBuckets(
        decay_param_groups(model, weight_decay=0.1), **HYPER, overlap_comm=True, bucket_cap_mb=TINY_BUCKET_MB
    )
    buckets = opt._buckets
    # reverse parameter order, at most the cap unless one parameter is larger, each parameter once
    for buf in opt._buffers:
        mine = [b for b in buckets if b.buf is buf]
        assert [b.lo for b in mine] == sorted((b.lo for b in mine), reverse=True)
        assert mine[0].hi == buf.numel and mine[-1].lo == 0
        assert all(b.hi - b.lo <= 30 or b.num_slots == 1 for b in mine)
        assert sum(b.num_slots for b in mine) == len(buf.slots)
    assert [b.tag for b in buckets] == list(range(len(buckets)))

    idx, target = rank_slice(rank, world_size, 0)
    loss_on(model, idx, target, 0).backward()  # step 0: every parameter gets a gradient
    assert opt._next_launch == len(buckets) and all(b.launched for b in buckets)  # all sent before step()
    opt.step()
    opt.zero_grad()
    idx, target = rank_slice(rank, world_size, 1)
    loss_on(model, idx, target, 1).backward()  # step 1: the `sometimes` branch gets none
    waiting = opt._bucket_of[next(s.index for s in opt._slots if s.name == "sometimes.weight")]
    assert not waiting.launched  # its bucket, and every bucket after it, wait for step()
    assert all(b.launched == (b.tag < waiting.tag) for b in buckets)
    opt.step()
    opt.zero_grad()


def test_buckets_are_sent_during_backward_in_order():
    run_ranks(2, _buckets_go_during_backward)


def _accumulation(rank: int, world_size: int) -> None:
    """4 micro-batches: 3 under no_sync(), the last one sends; equal to one batch of all 4."""
    results = []
    for micro in (1, 4):
        model = make_model()
        opt = SmallBuckets(
            decay_param_groups(model, weight_decay=0.1), **HYPER, overlap_comm=True, bucket_cap_mb=TINY_BUCKET_MB
        )
        for step in range(4):
            idx, target = rank_slice(rank, world_size, step)
            for i, (x, y) in enumerate(zip(idx.chunk(micro), target.chunk(micro), strict=True)):
                with opt.no_sync() if i < micro - 1 else contextlib.nullcontext():
                    (loss_on(model, x, y, step) / micro).backward()
                if i < micro - 1:
                    assert not any(b.launched for b in opt._buckets)
            opt.step()
            opt.zero_grad()
        results.append(_params(model))
    for p, q in zip(*results, strict=True):
        assert_close(p, q)

    # a second backward outside no_sync() after a bucket went is an error, as in DDP
    model = make_model()
    opt = SmallBuckets(
        decay_param_groups(model, weight_decay=0.1), **HYPER, overlap_comm=True, bucket_cap_mb=TINY_BUCKET_MB
    )
    idx, target = rank_slice(rank, world_size, 0)
    loss_on(model, idx, target, 0).backward()
    with pytest.raises(RuntimeError, match=r"second gradient of \S+ arrived after its bucket was sent.*no_sync"):
        loss_on(model, idx, target, 0).backward()
    opt.zero_grad()  # and the optimizer is usable again
    loss_on(model, idx, target, 0).backward()
    opt.step()


def test_gradient_accumulation_sends_only_the_last_micro_batch():
    run_ranks(2, _accumulation)


def test_overlap_needs_point_to_point_collectives():
    with pytest.raises(ValueError, match="overlap_comm needs reduce_op and gather_op 'p2p'.*'all_reduce'"):
        ZeRO1AdamW(make_model().parameters(), overlap_comm=True, reduce_op="all_reduce")
    with pytest.raises(ValueError, match="overlap_gather needs reduce_op and gather_op 'p2p'.*'all_gather'"):
        ZeRO1AdamW(make_model().parameters(), overlap_gather=True, gather_op="all_gather")


def test_bucket_cap_has_one_lower_bound_in_the_optimizer_and_the_api():
    """A cap of 1e-9 MB was accepted: one bucket, and one fused update launch, per element and step."""
    from pydantic import ValidationError

    from service.schemas.requests import JobSpec, OptimizerConfig
    from workers.config import OptimizerSpec

    for tiny in (1e-9, 0.0):
        with pytest.raises(ValueError, match=rf"bucket_cap_mb \({tiny}\) must be >= 1.0 MiB"):
            ZeRO1AdamW(make_model().parameters(), bucket_cap_mb=tiny)
        with pytest.raises(ValidationError, match=r"bucket_cap_mb\n  Input should be greater than or equal to 1"):
            OptimizerConfig(bucket_cap_mb=tiny)
    from workers import limits

    assert ZeRO1AdamW(make_model().parameters(), bucket_cap_mb=limits.MIN_BUCKET_CAP_MB).bucket_cap_mb == 1.0
    assert OptimizerConfig(bucket_cap_mb=limits.MIN_BUCKET_CAP_MB).bucket_cap_mb == 1.0
    defaults = (
        ZeRO1AdamW(make_model().parameters()).bucket_cap_mb,
        OptimizerSpec().bucket_cap_mb,
        JobSpec.model_fields["optimizer"].default.bucket_cap_mb,
    )
    assert defaults == (limits.DEFAULT_BUCKET_CAP_MB,) * 3


# ----------------------------------------------------------------------- input checks


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -1.0}, r"lr must be >= 0, got -1.0"),
        ({"betas": (0.9, 1.0)}, r"betas must be in \[0, 1\), got \(0.9, 1.0\)"),
        ({"eps": -1e-8}, r"eps must be >= 0"),
        ({"weight_decay": -0.1}, r"weight_decay must be >= 0, got -0.1"),
        ({"max_grad_norm": 0.0}, r"max_grad_norm must be > 0 or None, got 0.0"),
    ],
)
def test_bad_hyperparameters_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ZeRO1AdamW(make_model().parameters(), **kwargs)


# ----------------------------------------------------------------------- the GPU's collectives, on gloo


@contextlib.contextmanager
def _watching_collectives() -> Iterator[dict[str, mock.MagicMock]]:
    """Every torch.distributed call ZeRO1AdamW's communication can make, recorded and passed on."""
    names = ("reduce_scatter_single", "all_gather_single", "all_reduce", "batch_isend_irecv")
    with contextlib.ExitStack() as stack:
        yield {name: stack.enter_context(mock.patch.object(dist, name, wraps=getattr(dist, name))) for name in names}


def _ptrs(tensors) -> set[int]:
    return {t.data_ptr() for t in tensors}


def _collectives_match_reference(rank: int, world_size: int, dtype: torch.dtype, steps: int, num_micro: int) -> None:
    """NCCL's default path, reduce_scatter then all_gather, forced on gloo: num_micro micro-batches
    a step (all but the last under no_sync()), clipped, against AdamWReference on the whole batch."""
    with _watching_collectives() as calls:
        model = make_model(dtype)
        opt = ZeRO1AdamW(
            decay_param_groups(model, weight_decay=0.1),
            **HYPER,
            max_grad_norm=MAX_NORM,
            reduce_op="reduce_scatter",
            gather_op="all_gather",
        )
        assert (opt.reduce_op, opt.gather_op) == ("reduce_scatter", "all_gather")
        assert (opt.loss_scaler is not None) == (dtype == torch.float16)
        if opt.loss_scaler is not None:
            opt.loss_scaler.scale = 1024.0  # no overflow: the reference never skips
        ref = AdamWReference(dtype)
        norms = []
        for step in range(steps):
            idx, target = rank_slice(rank, world_size, step)
            # unequal micro-batches where the rank's rows do not divide (3 ranks: 2, 1, 1 rows):
            # each loss weighted by its share of the rows, so the sum is the rank's mean loss
            micro = list(zip(idx.tensor_split(num_micro), target.tensor_split(num_micro), strict=True))
            for i, (x, y) in enumerate(micro):
                with opt.no_sync() if i < num_micro - 1 else contextlib.nullcontext():
                    opt.scale_loss(loss_on(model, x, y, step) * (len(x) / len(idx))).backward()
            assert calls["reduce_scatter_single"].call_count == (step * len(opt._buffers) if world_size > 1 else 0)
            carried = torch.tensor([rank + 1.0, step])  # the training loop's loss rides on the norm's all-reduce
            opt.step(also_sum=carried)
            opt.zero_grad()
            assert carried.tolist() == [world_size * (world_size + 1) / 2, step * world_size]
            assert not opt.skipped
            norms.append(opt.grad_norm)
            # the norm of 16-bit gradients rounded in other places (each micro-batch's sum, each
            # rank's sum) of parameters an ulp apart: two ulps; fp32: a few roundings, as above
            rel = 2 * torch.finfo(dtype).eps if dtype != torch.float32 else 1e-5
            assert opt.grad_norm == pytest.approx(ref.step(step), rel=rel), f"step {step}"
            assert_matches_reference(model, ref, step=step)
    assert max(norms) > MAX_NORM  # the clip was applied, not only computed

    if world_size == 1:  # LocalComm: one rank moves nothing, whatever the options say
        assert all(c.call_count == 0 for c in calls.values()), {n: c.call_count for n, c in calls.items()}
        return
    # reduce-scatter: each buffer's flat grad (N*S,) once a step, only in step() (counted before it above)
    reduced = [c.args[1] for c in calls["reduce_scatter_single"].call_args_list]
    assert len(reduced) == steps * len(opt._buffers) and _ptrs(reduced) == _ptrs(b.grads for b in opt._buffers)
    # all-gather into each buffer's flat params (N*S,): once at construction, then once a step
    gathered = [c.args[0] for c in calls["all_gather_single"].call_args_list]
    assert len(gathered) == (steps + 1) * len(opt._buffers)
    assert _ptrs(gathered) == _ptrs(b.params for b in opt._buffers)
    # all-reduce: only the norm, flags and carried vector (1 + slots + 2,) a step, never a flat buffer;
    # no p2p sends
    summed = [c.args[0] for c in calls["all_reduce"].call_args_list]
    assert len(summed) == steps and all(t.numel() == 1 + len(opt._slots) + 2 for t in summed)
    assert calls["batch_isend_irecv"].call_count == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_reduce_scatter_and_all_gather_on_gloo_match_the_reference(world_size, dtype):
    """The path NCCL takes by default (comm.default_collectives), run where CI runs: gloo."""
    run_ranks(world_size, _collectives_match_reference, dtype, 6, 3)


# ----------------------------------------------------------------------- CUDA + NCCL


def _nccl_matches_adamw(rank: int, world_size: int) -> None:
    torch.cuda.set_device(rank)
    model = make_model().cuda()
    opt = ZeRO1AdamW(decay_param_groups(model, weight_decay=0.1), **HYPER, max_grad_norm=MAX_NORM)
    assert (opt.reduce_op, opt.gather_op) == ("reduce_scatter", "all_gather")
    assert all(buf.state["exp_avg"].is_cuda for buf in opt._buffers)
    ref = make_model().cuda()
    ref_opt = torch.optim.AdamW(decay_param_groups(ref, weight_decay=0.1), **HYPER, fused=True)
    for step in range(10):
        idx, target = rank_slice(rank, world_size, step)
        loss_on(model, idx.cuda(), target.cuda(), step).backward()
        opt.step()
        opt.zero_grad()
        ref_opt.zero_grad(set_to_none=True)
        idx, target = global_batch(step)
        loss_on(ref, idx.cuda(), target.cuda(), step).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert_close(p, q)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL and CUDA tensors)")
def test_nccl_on_cuda_matches_torch_adamw():
    run_ranks(torch.cuda.device_count(), _nccl_matches_adamw, backend="nccl")

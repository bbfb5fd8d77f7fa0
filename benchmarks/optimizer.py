"""Optimizer speed and memory: ZeRO1AdamW beside DDP + AdamW and DDP + ZeroRedundancyOptimizer.

    .venv/bin/python benchmarks/optimizer.py                 # docs/benchmarks.md's figures: ~50 minutes here
    .venv/bin/python benchmarks/optimizer.py --quick         # 10M model, N = 1 and 2, 5 steps: ~1 minute
    .venv/bin/python benchmarks/optimizer.py --from-json benchmarks/results/optimizer.json   # reprint a run

World sizes 1, 2 and 4 on gloo (spawned processes, one CPU thread each) train
GPT-2-style decoders of ~10M, ~50M and ~120M parameters on the same random
tokens, in bf16 mixed precision and in fp32, with five optimizer set-ups, one
after another on the same model and data:

    (a)  DDP + torch.optim.AdamW(fused=True); in bf16 over a full fp32 master copy
    (b)  DDP + ZeroRedundancyOptimizer(AdamW, fused=True); in bf16 over the same fp32 master copy
    (c)  ZeRO1AdamW, overlap_comm=False: reduce and gather after the backward, one after the other
    (d)  ZeRO1AdamW, overlap_comm=True: each bucket's reduce sent during the backward
    (e)  (d) and overlap_gather=True: each slice's gather sent while the next slice updates

Per cell (model, precision, N) it prints the step split in medians of the
slowest rank (forward+backward, exposed communication, update, gather), tokens/s,
optimizer-state and model-state bytes per rank and communication bytes per
step; then the ratios the targets name, the shard update's memory bandwidth
against this machine's copy bandwidth, gloo's collectives (the measurement
behind default_collectives), and a PNG of bytes per rank against N beside the
seed's 4Ψ + 12Ψ/N.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from workers.memory import model as memory
from workers.models.builtin import build_model as build_gpt
from workers.zero.optimizer import ZeRO1AdamW, decay_param_groups, default_collectives

MODELS = {  # ~10M, ~50M, ~120M (GPT-2 small's shape and vocabulary)
    "10M": memory.GPTSpec(vocab_size=8192, n_layer=4, n_head=6, n_embd=384, block_size=128),
    "50M": memory.GPTSpec(vocab_size=16384, n_layer=8, n_head=10, n_embd=640, block_size=128),
    "120M": memory.GPTSpec(vocab_size=50257, n_layer=12, n_head=12, n_embd=768, block_size=128),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
LR = 3e-4
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1
UPDATE_BYTES_PER_ELEMENT = 28  # fused AdamW on a shard: read grad, master, m, v; write master, m, v (+ the cast)
COPY_NUMEL = 1 << 26  # 256 MiB of fp32: far beyond the caches
TARGET_VS_A = 1.0
TARGET_VS_B = 0.8
STRETCH_VS_A = 0.9
TARGET_BANDWIDTH = 0.5
TARGET_EXPOSED = 0.5
TARGET_MODELS = ("50M", "120M")
TARGET_WORLD_SIZES = (2, 4)
MB = 1e6


# --------------------------------------------------------------------------- model, data, timing


def build_model(spec: memory.GPTSpec, *, precision: str, args: argparse.Namespace) -> nn.Module:
    """the built-in GPT (workers.models.builtin), the same initial weights on every rank and for every config."""
    compute = torch.float32 if precision == "bf16" and args.bf16_compute == "fp32" else None
    return build_gpt(spec, dtype=DTYPES[precision], seed=args.seed, compute_dtype=compute)


def batch(step: int, *, rank: int, world_size: int, spec: memory.GPTSpec, args: argparse.Namespace):
    """This rank's slice of the global batch of step `step`: (B, T) inputs and next-token targets."""
    gen = torch.Generator().manual_seed(args.seed * 1000 + step)
    tokens = torch.randint(0, spec.vocab_size, (world_size * args.micro_batch_size, args.seq_len + 1), generator=gen)
    mine = tokens[rank * args.micro_batch_size : (rank + 1) * args.micro_batch_size]
    return mine[:, :-1], mine[:, 1:]


def timed(fn: Callable[[], object]) -> float:
    """Seconds of fn between barriers: the slowest rank's time, seen by every rank."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Every tensor in optimizer.state (moments and fused AdamW's step counters)."""
    return sum(tensor_bytes(v for v in s.values() if isinstance(v, Tensor)) for s in optimizer.state.values())


def ring_bytes(numel: int, elem_bytes: int, n: int) -> float:
    """Ring all-reduce: each rank sends 2(N-1)/N of the buffer."""
    return 2 * (n - 1) / n * numel * elem_bytes


def shard_bytes(numel: int, elem_bytes: int, n: int) -> float:
    """Reduce-scatter, all-gather, or a broadcast of every rank's shard: each rank sends (N-1)/N of the buffer."""
    return (n - 1) / n * numel * elem_bytes


def plain_groups(model: nn.Module) -> list[dict]:
    """decay_param_groups without the names, for torch's optimizers."""
    return [{**g, "params": [p for _, p in g["params"]]} for g in decay_param_groups(model, weight_decay=WEIGHT_DECAY)]


class FP32Master:
    """The fp32 master copy of a 16-bit model: grads upcast in, weights cast back out."""

    def __init__(self, model: nn.Module) -> None:
        # requires_grad: ZeroRedundancyOptimizer buckets and broadcasts trainable tensors only
        self.pairs = [(p, p.detach().float().requires_grad_()) for p in model.parameters()]
        self.by_param = {id(p): m for p, m in self.pairs}

    def groups(self, model: nn.Module) -> list[dict]:
        return [
            {"params": [self.by_param[id(p)] for _, p in g["params"]], "weight_decay": g["weight_decay"]}
            for g in decay_param_groups(model, weight_decay=WEIGHT_DECAY)
        ]

    def upcast_grads(self, owned: set[int] | None = None) -> None:
        for p, m in self.pairs:
            if owned is None or id(m) in owned:
                m.grad = p.grad.float()

    @torch.no_grad()
    def cast_back(self) -> None:
        for p, m in self.pairs:
            p.copy_(m)
            m.grad = None

    def nbytes(self) -> int:
        return tensor_bytes(m for _, m in self.pairs)


# --------------------------------------------------------------------------- the four configs


class Trainer:
    """One optimizer set-up: local (no-communication) and real training steps, and its bytes per rank."""

    key: str
    label: str

    def __init__(self, model: nn.Module, *, precision: str, world_size: int) -> None:
        self.model = model
        self.precision = precision
        self.world_size = world_size
        self.num_params = sum(p.numel() for p in model.parameters())
        self.elem_bytes = DTYPES[precision].itemsize

    def local_forward_backward(self, x: Tensor, y: Tensor) -> float:
        """Seconds of one forward+backward that communicates nothing (then gradients are zeroed)."""
        raise NotImplementedError

    def train_step(self, x: Tensor, y: Tensor) -> dict[str, float]:
        """One real step: fwd_bwd (as run, with what it sends), comm, update, gather, step seconds and loss."""
        raise NotImplementedError

    def optimizer_state_bytes(self) -> int:
        raise NotImplementedError

    def comm_bytes(self) -> float:
        raise NotImplementedError

    def update_numel(self) -> int:
        """Elements this rank's optimizer update reads and writes."""
        raise NotImplementedError

    def model_state_bytes(self) -> int:
        params = list(self.model.parameters())
        return tensor_bytes(params) + tensor_bytes(p.grad for p in params) + self.optimizer_state_bytes()


def _forward_backward(model: nn.Module, x: Tensor, y: Tensor, losses: list[float]) -> Callable[[], None]:
    def run() -> None:
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())

    return run


class DDPTrainer(Trainer):
    def __init__(self, model: nn.Module, *, precision: str, world_size: int) -> None:
        super().__init__(model, precision=precision, world_size=world_size)
        # grads are views of DDP's buckets: no second copy of them, as in ZeRO1AdamW's flat buffer
        self.ddp = DDP(model, gradient_as_bucket_view=True)
        self.master = FP32Master(model) if precision != "fp32" else None

    def local_forward_backward(self, x: Tensor, y: Tensor) -> float:
        with self.ddp.no_sync():
            seconds = timed(_forward_backward(self.ddp, x, y, []))
        self.ddp.zero_grad(set_to_none=False)
        return seconds

    def synced_forward_backward(self, x: Tensor, y: Tensor) -> tuple[float, float]:
        self.ddp.zero_grad(set_to_none=False)
        losses: list[float] = []
        return timed(_forward_backward(self.ddp, x, y, losses)), losses[0]


class DDPAdamW(DDPTrainer):
    key = "a"
    label = "(a) DDP + AdamW(fused)"

    def __init__(self, model: nn.Module, *, precision: str, world_size: int) -> None:
        super().__init__(model, precision=precision, world_size=world_size)
        groups = self.master.groups(model) if self.master else plain_groups(model)
        self.opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, fused=True)

    def train_step(self, x: Tensor, y: Tensor) -> dict[str, float]:
        fwd_bwd, loss = self.synced_forward_backward(x, y)
        update = timed(self._update)
        return dict(fwd_bwd=fwd_bwd, reduce_wait=0.0, update=update, gather=0.0, step=fwd_bwd + update, loss=loss)

    def _update(self) -> None:
        if self.master:
            self.master.upcast_grads()
        self.opt.step()
        if self.master:
            self.master.cast_back()

    def optimizer_state_bytes(self) -> int:
        return state_bytes(self.opt) + (self.master.nbytes() if self.master else 0)

    def comm_bytes(self) -> float:
        return ring_bytes(self.num_params, self.elem_bytes, self.world_size)

    def update_numel(self) -> int:
        return self.num_params


class DDPZeroRedundancy(DDPTrainer):
    key = "b"
    label = "(b) DDP + ZeroRedundancyOptimizer"

    def __init__(self, model: nn.Module, *, precision: str, world_size: int) -> None:
        super().__init__(model, precision=precision, world_size=world_size)
        groups = self.master.groups(model) if self.master else plain_groups(model)
        # bucket views: one broadcast per rank's shard instead of one per parameter
        self.zero = ZeroRedundancyOptimizer(
            groups,
            optimizer_class=torch.optim.AdamW,
            parameters_as_bucket_view=True,
            lr=LR,
            betas=BETAS,
            fused=True,
        )
        self.owned = {id(p) for g in self.zero.optim.param_groups for p in g["params"]}
        self.local_step_s = 0.0
        inner = self.zero.optim.step

        def timed_step(*a, **kw):  # ZeroRedundancyOptimizer.step() = this local AdamW, then broadcasts
            start = time.perf_counter()
            out = inner(*a, **kw)
            self.local_step_s = time.perf_counter() - start
            return out

        self.zero.optim.step = timed_step

    def train_step(self, x: Tensor, y: Tensor) -> dict[str, float]:
        fwd_bwd, loss = self.synced_forward_backward(x, y)
        upcast = timed(lambda: self.master.upcast_grads(self.owned)) if self.master else 0.0
        zero_step = timed(self.zero.step)
        cast = timed(self.master.cast_back) if self.master else 0.0
        update = upcast + self.local_step_s + cast
        gather = zero_step - self.local_step_s
        return dict(
            fwd_bwd=fwd_bwd,
            reduce_wait=0.0,
            update=update,
            gather=gather,
            step=fwd_bwd + upcast + zero_step + cast,
            loss=loss,
        )

    def optimizer_state_bytes(self) -> int:
        return state_bytes(self.zero.optim) + (self.master.nbytes() if self.master else 0)

    def comm_bytes(self) -> float:
        gathered = 4 if self.master else self.elem_bytes  # the broadcast moves fp32 masters
        n = self.world_size
        return ring_bytes(self.num_params, self.elem_bytes, n) + shard_bytes(self.num_params, gathered, n)

    def update_numel(self) -> int:
        return sum(p.numel() for p in self.owned_params())

    def owned_params(self) -> list[Tensor]:
        return [p for g in self.zero.optim.param_groups for p in g["params"]]


class ZeRO1(Trainer):
    """ZeRO1AdamW on the unwrapped model: it reduces the gradients itself."""

    LABELS = {"c": "no overlap", "d": "overlap reduce", "e": "overlap reduce+gather"}

    def __init__(self, model: nn.Module, *, precision: str, world_size: int, key: str, bucket_cap_mb: float) -> None:
        super().__init__(model, precision=precision, world_size=world_size)
        self.opt = ZeRO1AdamW(
            decay_param_groups(model, weight_decay=WEIGHT_DECAY),
            lr=LR,
            betas=BETAS,
            overlap_comm=key in "de",
            overlap_gather=key == "e",
            bucket_cap_mb=bucket_cap_mb,
            record_phase_times=True,
        )
        self.key = key
        self.label = f"({key}) ZeRO1AdamW {self.LABELS[key]}"
        self.num_tensors = len(self.opt._slots)

    def local_forward_backward(self, x: Tensor, y: Tensor) -> float:
        with self.opt.no_sync():
            seconds = timed(_forward_backward(self.model, x, y, []))
        self.opt.zero_grad()
        return seconds

    def train_step(self, x: Tensor, y: Tensor) -> dict[str, float]:
        self.opt.zero_grad()
        losses: list[float] = []
        fwd_bwd = timed(_forward_backward(self.model, x, y, losses))
        opt_step = timed(self.opt.step)
        phases = self.opt.phase_times_s
        return dict(
            fwd_bwd=fwd_bwd,
            reduce_wait=phases["reduce"],
            update=phases["update"],
            gather=phases["gather"],
            step=fwd_bwd + opt_step,
            loss=losses[0],
        )

    def optimizer_state_bytes(self) -> int:
        return sum(self.opt.memory_bytes().values())

    def model_state_bytes(self) -> int:
        return self.opt.model_state_bytes()  # its flat param and grad buffers (padded) + its state shard

    def comm_bytes(self) -> float:
        padded = sum(buf.params.numel() for buf in self.opt._buffers)
        n = self.world_size
        # p2p: send each peer its part of the gradients, then my updated shard to each peer
        return 2 * shard_bytes(padded, self.elem_bytes, n) + ring_bytes(1 + self.num_tensors, 4, n)

    def update_numel(self) -> int:
        return sum(buf.shard_numel for buf in self.opt._buffers)


def make_trainer(
    key: str, spec: memory.GPTSpec, *, precision: str, world_size: int, args: argparse.Namespace
) -> Trainer:
    model = build_model(spec, precision=precision, args=args)
    kw = dict(precision=precision, world_size=world_size)
    if key == "a":
        return DDPAdamW(model, **kw)
    if key == "b":
        return DDPZeroRedundancy(model, **kw)
    return ZeRO1(model, **kw, key=key, bucket_cap_mb=args.bucket_cap_mb)


# --------------------------------------------------------------------------- measuring


def max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


STEP_KEYS = ("fwd_bwd", "reduce_wait", "update", "gather", "step")


def measure(trainer: Trainer, spec: memory.GPTSpec, *, rank: int, world_size: int, args: argparse.Namespace) -> dict:
    """Medians (slowest rank per step) of the local forward+backward and of the real step's phases.

    exposed communication = (real fwd+bwd - local fwd+bwd) + the wait for the reduce in step():
    what the gradient communication adds to a step beyond the compute it overlaps."""
    data = lambda step: batch(step, rank=rank, world_size=world_size, spec=spec, args=args)
    # the local passes run among the timed steps, spread over them: in the same state of caches and
    # allocator as the real ones (measured before the first step they came out up to 30% faster)
    local_every = max(1, args.steps // max(1, args.local_steps))
    local: list[float] = []
    steps = []
    loss = math.nan
    for step in range(args.warmup_steps + args.steps):
        timed_index = step - args.warmup_steps
        if timed_index >= 0 and timed_index % local_every == 0 and len(local) < args.local_steps:
            local.append(trainer.local_forward_backward(*data(step)))
        out = trainer.train_step(*data(step))
        loss = out["loss"]
        if step >= args.warmup_steps:
            steps.append(max_over_ranks([out[k] for k in STEP_KEYS]))
    med = {k: statistics.median(s[i] for s in steps) for i, k in enumerate(STEP_KEYS)}
    local_fwd_bwd = statistics.median(local) if local else med["fwd_bwd"]
    loss_t = torch.tensor(loss, dtype=torch.float64)
    dist.all_reduce(loss_t)
    opt_bytes, model_bytes = max_over_ranks([trainer.optimizer_state_bytes(), trainer.model_state_bytes()])
    update_numel = max_over_ranks([trainer.update_numel()])[0]
    return dict(
        key=trainer.key,
        label=trainer.label,
        fwd_bwd=local_fwd_bwd,
        fwd_bwd_real=med["fwd_bwd"],
        comm=med["fwd_bwd"] - local_fwd_bwd + med["reduce_wait"],
        update=med["update"],
        gather=med["gather"],
        step=med["step"],
        steps_timed=len(steps),
        loss=loss_t.item() / world_size,
        optimizer_bytes=int(opt_bytes),
        model_bytes=int(model_bytes),
        comm_bytes=trainer.comm_bytes(),
        update_bytes=UPDATE_BYTES_PER_ELEMENT * update_numel,
    )


def copy_bandwidth(*, repeats: int) -> float:
    """Bytes per second of a large copy (read + write), every rank copying at once as in the update."""
    src = torch.ones(COPY_NUMEL, dtype=torch.float32)
    dst = torch.empty_like(src)
    times = [timed(lambda: dst.copy_(src)) for _ in range(1 + repeats)][1:]
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def time_collectives(numel: int, dtype: torch.dtype, *, world_size: int, rank: int, repeats: int) -> dict[str, float]:
    """Median seconds (slowest rank) of each way to do the two beats on a flat (numel,) buffer."""
    full = torch.ones(numel, dtype=dtype)
    size = numel // world_size
    shard = torch.ones(size, dtype=dtype)
    received = torch.empty((world_size - 1, size), dtype=dtype)
    peers = [r for r in range(world_size) if r != rank]

    def p2p_reduce() -> None:  # what ZeRO1AdamW's p2p reduce does for one bucket holding everything
        ops = [dist.P2POp(dist.irecv, received[k], peer) for k, peer in enumerate(peers)]
        ops += [dist.P2POp(dist.isend, full[peer * size : (peer + 1) * size], peer) for peer in peers]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        mine = full[rank * size : (rank + 1) * size]
        for row in received:
            mine.add_(row)

    def p2p_gather() -> None:
        ops = []
        for peer in peers:
            ops.append(dist.P2POp(dist.irecv, full[peer * size : (peer + 1) * size], peer))
            ops.append(dist.P2POp(dist.isend, full[rank * size : (rank + 1) * size], peer))
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    ops = {
        "all_reduce": lambda: dist.all_reduce(full),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full),
        "all_gather": lambda: dist.all_gather_into_tensor(full, shard),
        "p2p_reduce": p2p_reduce,
        "p2p_gather": p2p_gather,
    }
    out = {}
    for name, op in ops.items():
        full.fill_(1)  # repeated reduces grow the values; keep them finite
        out[name] = statistics.median([timed(op) for _ in range(1 + repeats)][1:])
    return out


def run_rank(rank: int, world_size: int, init_file: str, out_file: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # the ranks share this machine's cores
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch")
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        cells = []
        for name in args.models:
            spec = MODELS[name]
            for precision in args.precisions:
                for key in args.configs:
                    if world_size == 1 and key in "de":
                        continue  # nothing to overlap: the same as (c)
                    trainer = make_trainer(key, spec, precision=precision, world_size=world_size, args=args)
                    row = measure(trainer, spec, rank=rank, world_size=world_size, args=args)
                    cells.append(
                        dict(model=name, num_params=spec.num_params, precision=precision, world_size=world_size, **row)
                    )
                    if rank == 0:
                        print(
                            f"  N={world_size} {name} {precision} {row['label']}: step {row['step'] * 1e3:,.0f} ms",
                            flush=True,
                        )
                    del trainer
                    gc.collect()
        bandwidth = copy_bandwidth(repeats=5)
        collectives = {}
        if world_size > 1:
            collectives = {
                p: time_collectives(
                    args.collective_numel, DTYPES[p], world_size=world_size, rank=rank, repeats=args.collective_repeats
                )
                for p in args.precisions
            }
        dist.barrier()
        if rank == 0:
            Path(out_file).write_text(
                json.dumps({"cells": cells, "copy_bandwidth": bandwidth, "collectives": collectives})
            )
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- printing


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


def _x(value: float) -> str:
    return f"{value:.2f}x"


def print_cell(rows: list[dict], *, tokens_per_step: int, bandwidth: float) -> None:
    a = next((r for r in rows if r["key"] == "a"), None)
    b = next((r for r in rows if r["key"] == "b"), None)
    header = (
        f"{'config':<36}{'fwd+bwd':>9}{'exp comm':>10}{'update':>9}{'gather':>9}{'step':>9}"
        f"{'tokens/s':>10}{'opt state':>11}{'model st':>10}{'comm/step':>11}{'upd GB/s':>10}"
        f"{'vs (a)':>8}{'vs (b)':>8}{'loss':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        gbps = r["update_bytes"] / r["update"] / 1e9 if r["update"] > 0 else math.nan
        print(
            f"{r['label']:<36}{_ms(r['fwd_bwd']):>9}{_ms(r['comm']):>10}{_ms(r['update']):>9}"
            f"{_ms(r['gather']):>9}{_ms(r['step']):>9}{tokens_per_step / r['step']:>10,.0f}"
            f"{r['optimizer_bytes'] / MB:>9.1f}MB{r['model_bytes'] / MB:>8.1f}MB{r['comm_bytes'] / MB:>9.1f}MB"
            f"{gbps:>10.2f}{_x(r['step'] / a['step']) if a else '-':>8}{_x(r['step'] / b['step']) if b else '-':>8}"
            f"{r['loss']:>9.4f}"
        )
    print(f"copy bandwidth per rank, all ranks copying at once: {bandwidth / 1e9:.2f} GB/s")


def cell_targets(rows: list[dict], *, bandwidth: float) -> dict[str, tuple[float, str, bool]]:
    """name -> (value, limit, met) for one cell's targets; (d)'s are the issue's, (c)'s the default's."""
    by = {r["key"]: r for r in rows}
    out = {}
    for key in ("c", "d"):
        if {"a", key} <= by.keys():
            v = by[key]["step"] / by["a"]["step"]
            out[f"({key})/(a) step"] = (v, f"<= {TARGET_VS_A}", v <= TARGET_VS_A)
            out[f"stretch ({key})/(a) step"] = (v, f"<= {STRETCH_VS_A}", v <= STRETCH_VS_A)
        if {"b", key} <= by.keys():
            v = by[key]["step"] / by["b"]["step"]
            out[f"({key})/(b) step"] = (v, f"<= {TARGET_VS_B}", v <= TARGET_VS_B)
    if {"c", "d"} <= by.keys() and by["c"]["comm"] > 0:
        v = by["d"]["comm"] / by["c"]["comm"]
        out["(d)/(c) exposed comm"] = (v, f"<= {TARGET_EXPOSED}", v <= TARGET_EXPOSED)
    if "c" in by:
        v = by["c"]["update_bytes"] / by["c"]["update"] / bandwidth
        out["(c) update/copy bandwidth"] = (v, f">= {TARGET_BANDWIDTH}", v >= TARGET_BANDWIDTH)
    return out


SUMMARY_COLUMNS = (
    "(c)/(a) step",
    "(c)/(b) step",
    "(d)/(a) step",
    "(d)/(b) step",
    "(d)/(c) exposed comm",
    "(c) update/copy bandwidth",
)


def print_summary(cells: dict, bandwidths: dict) -> None:
    """The targets over the cells they name: 50M and 120M, N = 2 and 4, bf16 and fp32."""
    print(
        "=== targets: 50M and 120M models, N = 2 and 4, bf16 and fp32; (d) as the issue names them, "
        "(c) = ZeRO1AdamW's default (no overlap)"
    )
    header = f"{'model':<7}{'prec':<6}{'N':>3}" + "".join(f"{c:>{max(len(c), 8) + 2}}" for c in SUMMARY_COLUMNS)
    print(header)
    print("-" * len(header))
    verdicts: dict[str, tuple[str, list[bool]]] = {}
    for (model, precision, n), rows in cells.items():
        if model not in TARGET_MODELS or n not in TARGET_WORLD_SIZES:
            continue
        targets = cell_targets(rows, bandwidth=bandwidths[n])
        for name, (_, limit, ok) in targets.items():
            verdicts.setdefault(name, (limit, []))[1].append(ok)
        print(
            f"{model:<7}{precision:<6}{n:>3}"
            + "".join(
                f"{f'{targets[c][0]:.2f}' if c in targets else '-':>{max(len(c), 8) + 2}}" for c in SUMMARY_COLUMNS
            )
        )
    for name, (limit, oks) in verdicts.items():
        print(f"target {name} {limit}: met in {sum(oks)} of {len(oks)} cells")


def print_collectives(collectives: dict, *, numel: int) -> None:
    reduce_default, gather_default = default_collectives("gloo")
    print(
        f"=== gloo's collectives on a flat buffer of {numel:,} elements; "
        f"default_collectives('gloo') = ({reduce_default}, {gather_default}). ZeRO1AdamW's p2p = direct sends."
    )
    header = (
        f"{'N':>3} {'dtype':<6}{'all_reduce':>12}{'reduce_scatter':>16}{'p2p_reduce':>12}"
        f"{'all_gather':>12}{'p2p_gather':>12}{'fastest reduce':>16}{'fastest gather':>16}"
    )
    print(header)
    print("-" * len(header))
    for n, per_dtype in sorted(collectives.items()):
        for precision, t in per_dtype.items():
            reduce_best = min(("all_reduce", "reduce_scatter", "p2p_reduce"), key=t.get)
            gather_best = min(("all_reduce", "all_gather", "p2p_gather"), key=t.get)
            print(
                f"{n:>3} {precision:<6}{_ms(t['all_reduce']):>10}ms{_ms(t['reduce_scatter']):>14}ms"
                f"{_ms(t['p2p_reduce']):>10}ms{_ms(t['all_gather']):>10}ms{_ms(t['p2p_gather']):>10}ms"
                f"{reduce_best:>16}{gather_best:>16}"
            )


def plot_memory(cells: dict, path: Path, *, precision: str) -> None:
    """Bytes per rank against N: measured (ZeRO1AdamW and DDP + AdamW), the memory model's plan,
    and the seed's 4Ψ + 12Ψ/N (model states of a 16-bit model with an fp32 AdamW)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({m for (m, p, _) in cells if p == precision}, key=lambda m: MODELS[m].num_params)
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4.4), squeeze=False)
    curve_n = [1, 2, 4, 8, 16, 32, 64]
    for ax, name in zip(axes[0], models, strict=True):
        spec = MODELS[name]
        psi = spec.num_params
        workload = memory.Workload.from_model(spec, precision=precision)
        plan = [memory.breakdown(workload, num_gpus=n, stage=1) for n in curve_n]
        ax.plot(curve_n, [(4 * psi + 12 * psi / n) / 1e9 for n in curve_n], "k--", label="seed: 4Ψ + 12Ψ/N")
        ax.plot(
            curve_n,
            [(p.params_bytes + p.grads_bytes + p.optimizer_bytes + p.padding_bytes) / 1e9 for p in plan],
            "-",
            color="tab:blue",
            alpha=0.6,
            label="planned model state (stage 1)",
        )
        ax.plot(
            curve_n,
            [(p.optimizer_bytes + p.padding_bytes) / 1e9 for p in plan],
            "-",
            color="tab:orange",
            alpha=0.6,
            label="planned optimizer state",
        )
        ax.plot(curve_n, [p.total_bytes / 1e9 for p in plan], ":", color="tab:gray", label="planned per-GPU total")
        ax.axhline(4 * psi / 1e9, color="k", lw=0.6, alpha=0.5)
        for key, marker, color, what in (
            ("c", "o", "tab:blue", "model_bytes"),
            ("c", "s", "tab:orange", "optimizer_bytes"),
            ("a", "^", "tab:red", "model_bytes"),
        ):
            pts = sorted(
                (n, r[what])
                for (m, p, n), rows in cells.items()
                if m == name and p == precision
                for r in rows
                if r["key"] == key
            )
            if pts:
                label = {"model_bytes": "model state", "optimizer_bytes": "optimizer state"}[what]
                cfg = "ZeRO1AdamW" if key == "c" else "DDP + AdamW"
                ax.plot(
                    [n for n, _ in pts],
                    [v / 1e9 for _, v in pts],
                    marker,
                    color=color,
                    ms=8,
                    label=f"measured {label}, {cfg}",
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks(curve_n, [str(n) for n in curve_n])
        ax.set_xlabel("N (data-parallel ranks)")
        ax.set_ylabel("GB per rank")
        ax.set_title(f"GPT {name} (Ψ = {psi / 1e6:.1f}M), {precision}")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_report(cells: dict, bandwidths: dict, collectives: dict, *, args: argparse.Namespace) -> None:
    print()
    print(
        f"GPT models {', '.join(f'{m} (Ψ = {MODELS[m].num_params:,})' for m in args.models)}; gloo, 1 CPU thread per "
        f"rank; micro-batch {args.micro_batch_size} x seq {args.seq_len} per rank; {args.local_steps} local + "
        f"{args.warmup_steps} warm-up + {args.steps} timed steps per config; bucket_cap_mb {args.bucket_cap_mb}. "
        "Times in ms, medians over steps of the slowest rank; bytes per rank."
    )
    for (model, precision, n), rows in cells.items():
        print()
        compute = f", layers compute in {args.bf16_compute}" if precision == "bf16" else ""
        print(f"=== {model}, {precision}{compute}, N = {n}")
        print_cell(rows, tokens_per_step=n * args.micro_batch_size * args.seq_len, bandwidth=bandwidths[n])
    print()
    print_summary(cells, bandwidths)
    print()
    print(NOTES)
    if collectives:
        print()
        print_collectives(collectives, numel=args.collective_numel)


NOTES = """notes:
  fwd+bwd    forward + backward that sends nothing (DDP under no_sync(), ZeRO1AdamW under no_sync()).
  exp comm   exposed gradient communication: the real fwd+bwd minus that, plus ZeRO1AdamW's wait for the
             reduce in step() (with the global norm's all-reduce); what communication adds to the step.
  update     (a)/(b) bf16: upcast the (owned) grads to fp32, fused AdamW, cast the masters back to bf16;
             (b): its inner local AdamW step. ZeRO1AdamW: its "update" phase (fused AdamW over the shard and
             the cast; with overlap, sending each finished slice too).
  gather     (b): ZeroRedundancyOptimizer.step() minus its local step (the per-rank broadcasts);
             ZeRO1AdamW: what is left of the gather after the update.
  step       the whole step as run (its parts are medians of their own, so they need not add up exactly).
  upd GB/s   28 bytes per updated element (read grad, master, exp_avg, exp_avg_sq; write master, exp_avg,
             exp_avg_sq; the cast to bf16 writes 2 more and reads no more than the 2-byte grad saves) / update.
  comm/step  analytical, sent per rank: ring all-reduce 2(N-1)/N·Ψ·bytes; (b)'s shard broadcasts (N-1)/N·Ψ
             (fp32 masters in bf16); ZeRO1AdamW p2p: (N-1)/N·Ψ for the reduce and again for the gather
             (Ψ padded), plus its norm's all-reduce of (1 + #tensors) fp32 — DDP's volume.
  bf16       with --bf16-compute fp32 (default) each layer upcasts its bf16 weights: params, grads, comm
             and optimizer are bf16, the matmuls run in fp32 (this AVX2 CPU runs bf16 matmuls ~10-30x slower).
  N = 4      four single-threaded ranks on this machine's 2 cores: each runs about half the time."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=list(MODELS))
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--precisions", nargs="+", choices=tuple(DTYPES), default=["bf16", "fp32"])
    parser.add_argument("--configs", nargs="+", choices=("a", "b", "c", "d", "e"), default=["a", "b", "c", "d", "e"])
    parser.add_argument("--micro-batch-size", type=int, default=1, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument(
        "--local-steps",
        type=int,
        default=5,
        help="forward+backward passes without communication, spread over the timed steps",
    )
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per config")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--collective-numel", type=int, default=1 << 24)
    parser.add_argument("--collective-repeats", type=int, default=5)
    parser.add_argument(
        "--bf16-compute",
        choices=("fp32", "bf16"),
        default="fp32",
        help="dtype of the bf16 model's forward/backward (see notes)",
    )
    parser.add_argument("--plot", type=Path, default=Path(__file__).with_name("memory_scaling.png"))
    parser.add_argument("--json", type=Path, default=None, help="also write every figure here")
    parser.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="print the report and draw the plot of a run saved with --json, without running",
    )
    parser.add_argument("--quick", action="store_true", help="10M model, N = 1 and 2, 5 timed steps")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.models = ["10M"]
        args.world_sizes = [1, 2]
        args.steps = 5
        args.local_steps = 2
        args.warmup_steps = 1
    block = min(MODELS[m].block_size for m in args.models)
    if not 1 <= args.seq_len <= block:
        raise SystemExit(f"--seq-len ({args.seq_len}) must be in [1, {block}]")
    if args.steps < 1 or args.warmup_steps < 0 or args.local_steps < 0 or min(args.world_sizes) < 1:
        raise SystemExit("need --steps >= 1, --warmup-steps >= 0, --local-steps >= 0, world sizes >= 1")
    return args


RUN_SETTINGS = (
    "micro_batch_size",
    "seq_len",
    "local_steps",
    "warmup_steps",
    "steps",
    "bucket_cap_mb",
    "collective_numel",
    "bf16_compute",
)


def load_run(path: Path, args: argparse.Namespace) -> tuple[dict, dict, dict]:
    """A run saved with --json; its models, world sizes and precisions become the report's."""
    saved = json.loads(path.read_text())
    cells: dict[tuple[str, str, int], list[dict]] = {}
    for row in saved["cells"]:
        cells.setdefault((row["model"], row["precision"], row["world_size"]), []).append(row)
    args.models = sorted({m for m, _, _ in cells}, key=lambda m: MODELS[m].num_params)
    args.precisions = [p for p in DTYPES if any(p == q for _, q, _ in cells)]
    args.world_sizes = sorted({n for _, _, n in cells})
    args.steps = max(r["steps_timed"] for r in saved["cells"])
    for key, value in saved.get("settings", {}).items():  # runs saved before settings were: the defaults
        setattr(args, key, value)
    bandwidths = {int(n): v for n, v in saved["copy_bandwidth"].items()}
    return cells, bandwidths, {int(n): v for n, v in saved["collectives"].items()}


def main() -> None:
    args = parse_args()
    if args.from_json:
        cells, bandwidths, collectives = load_run(args.from_json, args)
    else:
        cells, bandwidths, collectives = run(args)
    cells = dict(sorted(cells.items(), key=lambda kv: (MODELS[kv[0][0]].num_params, kv[0][1], kv[0][2])))
    print_report(cells, bandwidths, collectives, args=args)
    if args.plot:
        for precision in args.precisions:
            path = (
                args.plot
                if precision == "bf16" or len(args.precisions) == 1
                else args.plot.with_stem(f"{args.plot.stem}_{precision}")
            )
            plot_memory(cells, path, precision=precision)
            print(f"memory-scaling plot ({precision}): {path}")
    if args.json:
        settings = {k: getattr(args, k) for k in RUN_SETTINGS}
        args.json.write_text(
            json.dumps(
                {
                    "cells": [r for rows in cells.values() for r in rows],
                    "settings": settings,
                    "copy_bandwidth": bandwidths,
                    "collectives": collectives,
                },
                indent=1,
            )
        )


def run(args: argparse.Namespace) -> tuple[dict, dict, dict]:
    """Every world size in its own spawned group of ranks; the figures of all of them."""
    cells: dict[tuple[str, str, int], list[dict]] = {}
    bandwidths = {}
    collectives = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.world_sizes:
            init_file = os.path.join(tmp, f"init-{n}")
            out_file = os.path.join(tmp, f"out-{n}.json")
            print(f"N = {n}: spawning {n} rank(s)", flush=True)
            mp.spawn(run_rank, args=(n, init_file, out_file, args), nprocs=n, join=True)
            result = json.loads(Path(out_file).read_text())
            for row in result["cells"]:
                cells.setdefault((row["model"], row["precision"], n), []).append(row)
            bandwidths[n] = result["copy_bandwidth"]
            if result["collectives"]:
                collectives[n] = result["collectives"]
    return cells, bandwidths, collectives


if __name__ == "__main__":
    main()

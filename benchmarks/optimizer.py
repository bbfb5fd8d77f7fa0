"""Optimizer speed and memory: ZeRO1AdamW beside DDP + AdamW and DDP + ZeroRedundancyOptimizer.

    .venv/bin/python benchmarks/optimizer.py     # 1.5 minutes on 2 idle CPU cores; more when shared

Two ranks on gloo (spawned processes, one CPU thread each) train the same
GPT-2-style decoder on the same random tokens, in bf16 mixed precision and in
fp32, with four optimizer set-ups:

    (a)  DDP + torch.optim.AdamW(fused=True); in bf16 over a full fp32 master copy
    (b)  DDP + ZeroRedundancyOptimizer(AdamW, fused=True); in bf16 over the same fp32 master copy
    (c)  ZeRO1AdamW with the collectives default_collectives() picks for gloo (all_reduce / all_reduce)
    (c') ZeRO1AdamW with reduce_scatter / all_gather, the collectives it uses on NCCL

Per precision it prints one table of step phases (medians over the timed
steps of the slowest rank), one of bytes per rank with the ratios against (a)
and (b), the memory model's prediction beside the measurement, and the two
targets: (c)'s update at most 0.6x (a)'s, and (c)'s bf16 model state 0.625x
(a)'s within 1%. Last, a table of gloo's collectives on a buffer of the
model's size: the measurement behind default_collectives("gloo").
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from workers import memory
from workers.models import build_model as build_gpt
from workers.optim import ZeRO1AdamW, decay_param_groups, default_collectives

WORLD_SIZE = 2
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PHASES = ("fwd_bwd", "comm", "update", "gather", "step")
LR, BETAS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 0.1
UPDATE_TARGET = 0.6  # (c)'s update / (a)'s update at N = 2
MODEL_STATE_TARGET = (4 + 12 / WORLD_SIZE) / 16  # bf16: (p + g + K/N) / (p + g + K) = 0.625
MODEL_STATE_TOLERANCE = 0.01
MB = 1e6


# --------------------------------------------------------------------------- the model


def build_model(spec: memory.GPTSpec, *, precision: str, args: argparse.Namespace) -> nn.Module:
    """workers.models' GPT, the same initial weights on every rank and for every config."""
    compute = torch.float32 if precision == "bf16" and args.bf16_compute == "fp32" else None
    return build_gpt(spec, dtype=DTYPES[precision], seed=args.seed, compute_dtype=compute)


def batch(step: int, *, rank: int, args: argparse.Namespace) -> tuple[Tensor, Tensor]:
    """This rank's slice of the global batch of step `step`: (B, T) inputs and next-token targets."""
    gen = torch.Generator().manual_seed(args.seed * 1000 + step)
    tokens = torch.randint(0, args.vocab_size, (WORLD_SIZE * args.micro_batch_size, args.seq_len + 1), generator=gen)
    mine = tokens[rank * args.micro_batch_size : (rank + 1) * args.micro_batch_size]
    return mine[:, :-1], mine[:, 1:]


# --------------------------------------------------------------------------- timing and bytes


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


def all_reduce_bytes(numel: int, elem_bytes: int) -> float:
    """Ring all-reduce: each rank sends (and receives) 2(N-1)/N of the buffer."""
    return 2 * (WORLD_SIZE - 1) / WORLD_SIZE * numel * elem_bytes


def shard_collective_bytes(numel: int, elem_bytes: int) -> float:
    """Reduce-scatter, all-gather, or a broadcast of every rank's shard: (N-1)/N of the buffer."""
    return (WORLD_SIZE - 1) / WORLD_SIZE * numel * elem_bytes


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
        # a transient (Ψ,) fp32 gradient, dropped after the update like ZeRO1AdamW's
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


def plain_groups(model: nn.Module) -> list[dict]:
    """decay_param_groups without the names, for torch's optimizers."""
    return [{**g, "params": [p for _, p in g["params"]]} for g in decay_param_groups(model, weight_decay=WEIGHT_DECAY)]


def timed_forward_backward(model: nn.Module, x: Tensor, y: Tensor) -> tuple[float, float]:
    """(seconds, loss) of one forward and backward between barriers."""
    losses = []

    def run() -> None:
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())

    return timed(run), losses[0]


def ddp_forward_backward(ddp: DDP, x: Tensor, y: Tensor) -> tuple[float, float, float]:
    """(fwd+bwd s, exposed gradient communication s, loss): the all-reduce DDP does not
    hide under backward is its fwd+bwd minus the same fwd+bwd under no_sync()."""
    with ddp.no_sync():
        ddp.zero_grad(set_to_none=False)
        local_s, _ = timed_forward_backward(ddp, x, y)
    ddp.zero_grad(set_to_none=False)
    synced_s, loss = timed_forward_backward(ddp, x, y)
    return local_s, synced_s - local_s, loss


# --------------------------------------------------------------------------- the configs


class Trainer:
    """One optimizer set-up: a timed training step and its bytes per rank."""

    key: str
    label: str

    def __init__(self, model: nn.Module, *, precision: str) -> None:
        self.model, self.precision = model, precision
        self.num_params = sum(p.numel() for p in model.parameters())
        self.elem_bytes = DTYPES[precision].itemsize

    def train_step(self, x: Tensor, y: Tensor) -> dict[str, float]:
        raise NotImplementedError

    def optimizer_state_bytes(self) -> int:
        raise NotImplementedError

    def comm_bytes(self) -> float:
        raise NotImplementedError

    def model_state_bytes(self) -> int:
        params = list(self.model.parameters())
        return tensor_bytes(params) + tensor_bytes(p.grad for p in params) + self.optimizer_state_bytes()


class DDPAdamW(Trainer):
    key, label = "a", "(a)  DDP + AdamW(fused)"

    def __init__(self, model: nn.Module, *, precision: str) -> None:
        super().__init__(model, precision=precision)
        # grads are views of DDP's buckets: no second copy of them, as in ZeRO1AdamW's flat buffer
        self.ddp = DDP(model, gradient_as_bucket_view=True)
        self.master = FP32Master(model) if precision != "fp32" else None
        groups = self.master.groups(model) if self.master else plain_groups(model)
        self.opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, fused=True)

    def train_step(self, x: Tensor, y: Tensor) -> dict[str, float]:
        fwd_bwd, comm, loss = ddp_forward_backward(self.ddp, x, y)
        update = timed(self._update)
        return dict(fwd_bwd=fwd_bwd, comm=comm, update=update, gather=math.nan, step=fwd_bwd + comm + update, loss=loss)

    def _update(self) -> None:
        if self.master:
            self.master.upcast_grads()
        self.opt.step()
        if self.master:
            self.master.cast_back()

    def optimizer_state_bytes(self) -> int:
        return state_bytes(self.opt) + (self.master.nbytes() if self.master else 0)

    def comm_bytes(self) -> float:
        return all_reduce_bytes(self.num_params, self.elem_bytes)


class DDPZeroRedundancy(Trainer):
    key, label = "b", "(b)  DDP + ZeroRedundancyOptimizer(AdamW fused)"

    def __init__(self, model: nn.Module, *, precision: str) -> None:
        super().__init__(model, precision=precision)
        self.ddp = DDP(model, gradient_as_bucket_view=True)
        self.master = FP32Master(model) if precision != "fp32" else None
        groups = self.master.groups(model) if self.master else plain_groups(model)
        # bucket views: one broadcast per rank's shard instead of one per parameter
        self.zero = ZeroRedundancyOptimizer(
            groups, optimizer_class=torch.optim.AdamW, parameters_as_bucket_view=True,
            lr=LR, betas=BETAS, fused=True,
        )  # fmt: skip
        self.owned = {id(p) for g in self.zero.optim.param_groups for p in g["params"]}
        self.local_step_s = 0.0
        self.zero.optim.step = self._timed_local_step(self.zero.optim.step)

    def _timed_local_step(self, step: Callable) -> Callable:
        # ZeroRedundancyOptimizer.step() = the local AdamW on this rank's shard, then broadcasts
        def timed_step(*args, **kwargs):
            start = time.perf_counter()
            out = step(*args, **kwargs)
            self.local_step_s = time.perf_counter() - start
            return out

        return timed_step

    def train_step(self, x: Tensor, y: Tensor) -> dict[str, float]:
        fwd_bwd, comm, loss = ddp_forward_backward(self.ddp, x, y)
        upcast = timed(lambda: self.master.upcast_grads(self.owned)) if self.master else 0.0
        zero_step = timed(self.zero.step)
        cast = timed(self.master.cast_back) if self.master else 0.0
        update, gather = upcast + self.local_step_s + cast, zero_step - self.local_step_s
        return dict(fwd_bwd=fwd_bwd, comm=comm, update=update, gather=gather, step=fwd_bwd + comm + update + gather, loss=loss)

    def optimizer_state_bytes(self) -> int:
        return state_bytes(self.zero.optim) + (self.master.nbytes() if self.master else 0)

    def comm_bytes(self) -> float:
        gathered = 4 if self.master else self.elem_bytes  # the broadcast moves fp32 masters
        return all_reduce_bytes(self.num_params, self.elem_bytes) + shard_collective_bytes(self.num_params, gathered)


class ZeRO1(Trainer):
    """ZeRO1AdamW on the unwrapped model: it reduces the gradients itself."""

    def __init__(self, model: nn.Module, *, precision: str, spec: memory.GPTSpec, key: str,
                 reduce_op: str = "auto", gather_op: str = "auto") -> None:  # fmt: skip
        super().__init__(model, precision=precision)
        self.opt = ZeRO1AdamW(
            decay_param_groups(model, weight_decay=WEIGHT_DECAY), lr=LR, betas=BETAS,
            reduce_op=reduce_op, gather_op=gather_op, record_phase_times=True,
        )  # fmt: skip
        self.key = key
        self.label = f"{'(' + key + ')':<5}ZeRO1AdamW {self.opt.reduce_op} / {self.opt.gather_op}"
        self.padded_numel = memory.shard_numel(memory.Workload.from_model(spec), num_gpus=WORLD_SIZE) * WORLD_SIZE
        self.num_tensors = len(list(model.parameters()))

    def train_step(self, x: Tensor, y: Tensor) -> dict[str, float]:
        self.opt.zero_grad()
        fwd_bwd, loss = timed_forward_backward(self.model, x, y)
        opt_step = timed(self.opt.step)
        phases = self.opt.phase_times_s
        return dict(fwd_bwd=fwd_bwd, comm=phases["reduce"], update=phases["update"], gather=phases["gather"],
                    step=fwd_bwd + opt_step, loss=loss)  # fmt: skip

    def optimizer_state_bytes(self) -> int:
        return sum(self.opt.memory_bytes().values())

    def model_state_bytes(self) -> int:
        return self.opt.model_state_bytes()  # its flat param and grad buffers (padded) + its state shard

    def comm_bytes(self) -> float:
        beat = {"all_reduce": all_reduce_bytes, "reduce_scatter": shard_collective_bytes, "all_gather": shard_collective_bytes}
        # plus the norm's all-reduce of [Σg², one flag per tensor] in fp32
        return (beat[self.opt.reduce_op](self.padded_numel, self.elem_bytes)
                + beat[self.opt.gather_op](self.padded_numel, self.elem_bytes)
                + all_reduce_bytes(1 + self.num_tensors, 4))  # fmt: skip


def make_trainers(spec: memory.GPTSpec, *, precision: str, args: argparse.Namespace) -> list[Trainer]:
    """The four configs, each on its own model with the same initial weights."""
    model = lambda: build_model(spec, precision=precision, args=args)  # noqa: E731
    return [
        DDPAdamW(model(), precision=precision),
        DDPZeroRedundancy(model(), precision=precision),
        ZeRO1(model(), precision=precision, spec=spec, key="c"),
        ZeRO1(model(), precision=precision, spec=spec, key="c'", reduce_op="reduce_scatter", gather_op="all_gather"),
    ]


# --------------------------------------------------------------------------- measuring


def max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def measure(trainers: list[Trainer], *, rank: int, args: argparse.Namespace) -> list[dict]:
    """Each step runs every config in turn on the same batch, so a noisy stretch of a
    shared machine slows all of them alike rather than whichever ran then."""
    per_step: dict[str, list[list[float]]] = {t.key: [] for t in trainers}
    last_loss: dict[str, float] = {}
    for step in range(args.warmup_steps + args.steps):
        x, y = batch(step, rank=rank, args=args)
        for trainer in trainers:
            times = trainer.train_step(x, y)
            last_loss[trainer.key] = times["loss"]
            if step >= args.warmup_steps:
                per_step[trainer.key].append(max_over_ranks([times[p] for p in PHASES]))
    return [summarize(t, per_step[t.key], loss=last_loss[t.key]) for t in trainers]


def summarize(trainer: Trainer, per_step: list[list[float]], *, loss: float) -> dict:
    """Medians over the timed steps of each phase (per step, the slowest rank), bytes per rank."""
    medians = {p: statistics.median(s[i] for s in per_step) for i, p in enumerate(PHASES)}
    loss = torch.tensor(loss, dtype=torch.float64)
    dist.all_reduce(loss)
    opt_bytes, model_bytes = max_over_ranks([trainer.optimizer_state_bytes(), trainer.model_state_bytes()])
    return dict(
        key=trainer.key, label=trainer.label, **medians, loss=loss.item() / WORLD_SIZE,
        optimizer_bytes=int(opt_bytes), model_bytes=int(model_bytes), comm_bytes=trainer.comm_bytes(),
        zero1_memory_bytes=trainer.opt.memory_bytes() if isinstance(trainer, ZeRO1) else None,
    )  # fmt: skip


def time_collectives(numel: int, dtype: torch.dtype, *, repeats: int) -> dict[str, float]:
    """Median seconds (slowest rank) of each collective on a flat (numel,) buffer."""
    full = torch.ones(numel, dtype=dtype)
    shard = torch.ones(numel // WORLD_SIZE, dtype=dtype)
    ops = {
        "all_reduce": lambda: dist.all_reduce(full),
        # reduce-scatter: (N*S,) -> own (S,); all-gather: own (S,) -> (N*S,)
        "reduce_scatter": lambda: dist.reduce_scatter_single(shard, full),
        "all_gather": lambda: dist.all_gather_single(full, shard),
        # the same beats from rooted collectives, one per rank: slice r of (N*S,) summed onto rank r,
        # and rank r's slice sent to all (ZeroRedundancyOptimizer's gather)
        "reduces": lambda: [dist.reduce(part, dst=r) for r, part in enumerate(full.chunk(WORLD_SIZE))],
        "broadcasts": lambda: [dist.broadcast(part, src=r) for r, part in enumerate(full.chunk(WORLD_SIZE))],
    }
    out = {}
    for name, op in ops.items():
        full.fill_(1)  # repeated all-reduces double the values; keep them finite
        times = [timed(op) for _ in range(1 + repeats)][1:]
        out[name] = statistics.median(times)
    return out


def run_rank(rank: int, init_file: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # two ranks share this machine's cores
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        spec = memory.GPTSpec(vocab_size=args.vocab_size, n_layer=args.n_layer, n_head=args.n_head,
                              n_embd=args.n_embd, block_size=args.block_size)  # fmt: skip
        results = {}
        for precision in args.precisions:
            results[precision] = measure(make_trainers(spec, precision=precision, args=args), rank=rank, args=args)
        padded = memory.shard_numel(memory.Workload.from_model(spec), num_gpus=WORLD_SIZE) * WORLD_SIZE
        collectives = {p: time_collectives(padded, DTYPES[p], repeats=args.collective_repeats) for p in args.precisions}
        if rank == 0:
            print_report(spec, results, collectives, args=args)
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- printing


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:,.1f}"


def _ratio(x: float, ref: float) -> str:
    return "-" if math.isnan(x) or math.isnan(ref) or ref == 0 else f"{x / ref:.2f}x"


def print_phases(rows: list[dict], *, tokens_per_step: int) -> None:
    header = (f"{'config':<50}{'fwd+bwd':>9}{'grad comm':>11}{'update':>9}{'gather':>9}"
              f"{'step':>9}{'tokens/s':>10}{'last loss':>11}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['label']:<50}{_ms(r['fwd_bwd']):>9}{_ms(r['comm']):>11}{_ms(r['update']):>9}"
              f"{_ms(r['gather']):>9}{_ms(r['step']):>9}{tokens_per_step / r['step']:>10,.0f}{r['loss']:>11.4f}")  # fmt: skip
    fwd_bwd = [r["fwd_bwd"] for r in rows]
    same_loss = len({r["loss"] for r in rows}) == 1
    print(f"fwd+bwd is the same work in every config: its spread, max/min = {max(fwd_bwd) / min(fwd_bwd):.2f}x, "
          f"is this run's timing noise. Last losses {'identical' if same_loss else 'DIFFER'} across configs.")  # fmt: skip


def print_bytes(rows: list[dict]) -> None:
    a, b = rows[0], rows[1]
    header = (f"{'config':<50}{'opt state':>10}{'model state':>12}{'comm/step':>10}"
              f"{'| vs (a): update':>17}{'step':>7}{'opt':>7}{'model':>7}"
              f"{'| vs (b): update':>17}{'step':>7}{'opt':>7}{'model':>7}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for r in rows:
        vs = lambda ref: "".join(  # noqa: E731
            f"{_ratio(r[k], ref[k]):>7}" for k in ("step", "optimizer_bytes", "model_bytes")
        )
        print(f"{r['label']:<50}{r['optimizer_bytes'] / MB:>8.1f}MB{r['model_bytes'] / MB:>10.1f}MB"
              f"{r['comm_bytes'] / MB:>8.1f}MB{'| ':>10}{_ratio(r['update'], a['update']):>7}{vs(a)}"
              f"{'| ':>10}{_ratio(r['update'], b['update']):>7}{vs(b)}")  # fmt: skip


def print_plan_check(spec: memory.GPTSpec, rows: list[dict], *, precision: str) -> None:
    workload = memory.Workload.from_model(spec, precision=precision)
    plan0 = memory.breakdown(workload, num_gpus=WORLD_SIZE, stage=0)
    plan1 = memory.breakdown(workload, num_gpus=WORLD_SIZE, stage=1)
    a, c = rows[0], next(r for r in rows if r["key"] == "c")
    checks = [
        ("(c) optimizer state = stage-1 optimizer + padding", plan1.optimizer_bytes + plan1.padding_bytes, c["optimizer_bytes"]),
        ("(c) model state = stage-1 params + grads + optimizer + padding",
         plan1.params_bytes + plan1.grads_bytes + plan1.optimizer_bytes + plan1.padding_bytes, c["model_bytes"]),
        ("(a) model state = stage-0 params + grads + optimizer",
         plan0.params_bytes + plan0.grads_bytes + plan0.optimizer_bytes, a["model_bytes"]),
    ]  # fmt: skip
    print(f"memory model (workers/memory.py) vs measured, bytes per rank; (c) by kind: {c['zero1_memory_bytes']}")
    for label, planned, measured in checks:
        diff = measured - planned
        verdict = "exact" if diff == 0 else f"differs by {diff:+,} B"
        print(f"  {label:<64} planned {planned:>13,}  measured {measured:>13,}  {verdict}")


def print_targets(rows: list[dict], *, precision: str) -> None:
    a, c = rows[0], next(r for r in rows if r["key"] == "c")
    update = c["update"] / a["update"]
    print(f"target: (c) update <= {UPDATE_TARGET}x (a)'s at N={WORLD_SIZE}: {update:.2f}x  "
          f"{'met' if update <= UPDATE_TARGET else 'MISSED'}")  # fmt: skip
    if precision == "bf16":
        model = c["model_bytes"] / a["model_bytes"]
        ok = abs(model / MODEL_STATE_TARGET - 1) <= MODEL_STATE_TOLERANCE
        print(f"target: (c) model state = {MODEL_STATE_TARGET}x (a)'s within {MODEL_STATE_TOLERANCE:.0%}: "
              f"{model:.4f}x  {'met' if ok else 'MISSED'}")  # fmt: skip


def print_collectives(collectives: dict[str, dict[str, float]], *, numel: int) -> None:
    reduce_default, gather_default = default_collectives("gloo")
    print(f"collectives on gloo, {WORLD_SIZE} ranks, a flat buffer of {numel:,} elements (the model, padded); "
          f"default_collectives('gloo') = ({reduce_default}, {gather_default})")  # fmt: skip
    header = (f"{'dtype':<6}{'buffer':>10}{'all_reduce':>12}{'reduce_scatter':>16}{'all_gather':>12}"
              f"{f'{WORLD_SIZE} reduces':>11}{f'{WORLD_SIZE} broadcasts':>14}{'faster reduce':>16}{'faster gather':>15}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for precision, t in collectives.items():
        reduce_best = min(("all_reduce", "reduce_scatter"), key=t.get)
        gather_best = min(("all_reduce", "all_gather"), key=t.get)
        print(f"{precision:<6}{numel * DTYPES[precision].itemsize / MB:>8.1f}MB{_ms(t['all_reduce']):>10}ms"
              f"{_ms(t['reduce_scatter']):>14}ms{_ms(t['all_gather']):>10}ms{_ms(t['reduces']):>9}ms"
              f"{_ms(t['broadcasts']):>12}ms{reduce_best:>16}{gather_best:>15}")  # fmt: skip
    print("faster reduce / gather: of the two collectives ZeRO1AdamW can use for that beat. The per-rank")
    print("reduces and broadcasts (ZeroRedundancyOptimizer's gather) are not among its options; shown for comparison.")


def print_report(spec: memory.GPTSpec, results: dict, collectives: dict, *, args: argparse.Namespace) -> None:
    tokens_per_step = WORLD_SIZE * args.micro_batch_size * args.seq_len
    print(f"GPT: vocab {spec.vocab_size}, {spec.n_layer} layers, {spec.n_head} heads, n_embd {spec.n_embd}, "
          f"block {spec.block_size}: Ψ = {spec.num_params:,} parameters. N = {WORLD_SIZE} ranks on gloo, "
          f"1 CPU thread each; micro-batch {args.micro_batch_size} x seq {args.seq_len} per rank "
          f"({tokens_per_step} tokens/step). {args.warmup_steps} warm-up + {args.steps} timed steps; "
          f"times in ms, medians over steps of the slowest rank.")  # fmt: skip
    for precision, rows in results.items():
        print()
        print(f"=== {precision}" + (" mixed precision: bf16 params, grads and communication; fp32 master and "
                                    f"AdamW state; forward/backward compute in {args.bf16_compute}"
                                    if precision == "bf16" else ": fp32 params, grads, communication and AdamW state"))  # fmt: skip
        print_phases(rows, tokens_per_step=tokens_per_step)
        print()
        print_bytes(rows)
        print()
        print_plan_check(spec, rows, precision=precision)
        print_targets(rows, precision=precision)
    print()
    print(NOTES)
    print()
    print_collectives(collectives, numel=memory.shard_numel(memory.Workload.from_model(spec), num_gpus=WORLD_SIZE) * WORLD_SIZE)


NOTES = """notes:
  grad comm  DDP: the exposed part, DDP fwd+bwd minus the same fwd+bwd under no_sync(); fwd+bwd is
             the no_sync one. ZeRO1AdamW: its "reduce" phase (gradient collective + the norm's all-reduce).
  update     (a)/(b) bf16: upcast the (owned) grads to fp32, fused AdamW, cast the masters back to bf16.
             (b): ZeroRedundancyOptimizer's inner local AdamW step, timed separately; gather = its
             step() minus that (the per-rank broadcasts). ZeRO1AdamW: its "update" phase (with the cast).
  last loss  mean over ranks after the last step: the configs train the same model on the same data,
             so it agrees to every digit when their arithmetic does.
  step       the real step: DDP fwd+bwd with its communication + update + gather (barriers between).
  opt state  torch optimizers: every tensor in optimizer.state (moments, step counters) + the fp32 master
             copy; ZeRO1AdamW: sum(memory_bytes()), padding included. Max over ranks.
  model      params + grads + opt state, by tensor sizes (ZeRO1AdamW: its model_state_bytes(), the padded
             flat buffers + its state shard); fp32 grads upcast for the update are transient and not
             counted, so (a) bf16 is 16 B/param: params 2 + grads 2 + master 4 + exp_avg 4 + exp_avg_sq 4.
  planned    the memory model counts no AdamW step counters: (a)'s fused AdamW keeps one 4-byte tensor
             per parameter tensor, its whole difference from stage 0.
  bf16 fwd   with --bf16-compute fp32 (default) each layer upcasts its bf16 weights to fp32 activations:
             params, grads, communication and optimizer are bf16 exactly as in native bf16, but the
             matmuls run in fp32, because this CPU class (AVX2, no AVX512-BF16/AMX) runs bf16 ~10-30x slower.
  (b) bf16   ZeroRedundancyOptimizer runs over the full fp32 master copy: it shards the moments, not the
             master, and its broadcast moves fp32 masters.
  comm/step  analytical, per rank, N = 2: ring all-reduce 2(N-1)/N·Ψ·bytes; reduce-scatter, all-gather
             and (b)'s shard broadcasts (N-1)/N·Ψ·bytes each; ZeRO1AdamW's Ψ is the padded flat buffer,
             plus its norm's all-reduce of (1 + #tensors) fp32."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=None, help="default: block size")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per config")
    parser.add_argument("--collective-repeats", type=int, default=5)
    parser.add_argument("--precisions", nargs="+", choices=tuple(DTYPES), default=["bf16", "fp32"])
    parser.add_argument(
        "--bf16-compute", choices=("fp32", "bf16"), default="fp32",
        help="dtype of the bf16 model's forward/backward: fp32 upcasts the bf16 weights per layer "
        "(params, grads and communication stay bf16); CPUs without bf16 matmul run bf16 ~10-30x slower",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.seq_len = args.seq_len or args.block_size
    if not 1 <= args.seq_len <= args.block_size:
        raise ValueError(f"seq_len ({args.seq_len}) must be in [1, block_size ({args.block_size})]")
    if args.warmup_steps < 0 or args.steps < 1:
        raise ValueError(f"need warmup_steps ({args.warmup_steps}) >= 0 and steps ({args.steps}) >= 1")
    return args


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(run_rank, args=(init_file, args), nprocs=WORLD_SIZE, join=True)


if __name__ == "__main__":
    main()

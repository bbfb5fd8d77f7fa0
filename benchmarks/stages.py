"""ZeRO stages side by side: DDP (stage 0), ZeRO1AdamW (1), ZeRO2AdamW (2) and FSDP2 + ZeRO3AdamW (3) on one model.

    .venv/bin/python benchmarks/stages.py                # docs/benchmarks.md's table: ~3 minutes here
    .venv/bin/python benchmarks/stages.py --quick        # a 2M model, 3 steps: ~30 s
    .venv/bin/python benchmarks/stages.py --from-json benchmarks/results/stages.json   # reprint a run

At N = 2 and 4 on gloo (spawned processes, one CPU thread each), each stage trains the same GPT on
the same tokens, one after another, and every rank reports:

- the step's median time (the slowest rank's) and tokens/s;
- its peak bytes, measured: the tensors it keeps between steps (parameters, gradients, optimizer
  state; for ZeRO the flat buffers) plus the step's peak beyond them, counted op by op as the
  workers count it on a CPU (workers/models/trace.py measure_step), beside the planner's per-GPU
  bytes for that stage (workers/memory/model.py, no fixed overhead);
- the bytes it sends per step, counted at the collectives' calls, beside the ZeRO paper's volume:
  2Ψ elements per step at stages 0-2 (a ring all-reduce, or a reduce-scatter and an all-gather:
  passes·(N−1)/N·Ψ·p bytes from each GPU); stage 2 reduces every micro-batch, so with
  accumulation it sends (accumulation + 1) passes; stage 3 gathers the parameters for each
  micro-batch's forward and backward and reduce-scatters its gradients: 3Ψ, 3 passes a micro-batch.

Counting: a point-to-point send counts its bytes; a collective counts what a ring sends from
each rank (all-reduce 2(N−1)/N of the tensor, reduce-scatter and all-gather (N−1)/N of the whole,
a reduce to one owner (N−1)/N of its part: the parts of a bucket together are its reduce-scatter).
DDP's all-reduces go through torch's default communication hook, registered so that they pass
dist.all_reduce, where they are counted.

A GPU section (NCCL, torch.cuda.max_memory_allocated) is benchmarks/gpu_check.py's, where one is lent.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from workers.memory import model as memory
from workers.models.builtin import build_model
from workers.models.trace import loss_of, measure_step
from workers.zero.optimizer import ZeRO1AdamW, decay_param_groups
from workers.zero.stage2 import ZeRO2AdamW
from workers.zero.stage3 import ZeRO3AdamW, shard_model

MODELS = {
    "2M": memory.GPTSpec(vocab_size=2048, n_layer=2, n_head=4, n_embd=256, block_size=128),
    "10M": memory.GPTSpec(vocab_size=8192, n_layer=4, n_head=6, n_embd=384, block_size=128),
}
STAGES = (0, 1, 2, 3)
HYPER = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8}
WEIGHT_DECAY = 0.1
RESULTS = Path(__file__).parent / "results" / "stages.json"


# --------------------------------------------------------------------------- counting bytes sent


class SentBytes:
    """Bytes this rank sends, by the collectives' calls (module docstring), while installed."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.total = 0
        self._patches: list = []

    def ring(self, numel_bytes: int, passes: float) -> None:
        self.total += round(passes * (self.world_size - 1) / self.world_size * numel_bytes)

    @contextlib.contextmanager
    def installed(self):
        def nbytes(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        def arg(args, kwargs, index: int, *names: str) -> torch.Tensor:
            """A collective's tensor argument, given by position or by name."""
            if len(args) > index:
                return args[index]
            return next(kwargs[name] for name in names if name in kwargs)

        wrappers = {
            "all_reduce": lambda *a, **k: self.ring(nbytes(arg(a, k, 0, "tensor")), 2),
            "reduce": lambda *a, **k: self.ring(nbytes(arg(a, k, 0, "tensor")), 1),
            "reduce_scatter_single": lambda *a, **k: self.ring(nbytes(arg(a, k, 1, "input")), 1),
            "reduce_scatter_tensor": lambda *a, **k: self.ring(nbytes(arg(a, k, 1, "input")), 1),
            "all_gather_single": lambda *a, **k: self.ring(nbytes(arg(a, k, 0, "output")), 1),
            "all_gather_into_tensor": lambda *a, **k: self.ring(nbytes(arg(a, k, 0, "output_tensor", "output")), 1),
        }
        originals = {name: getattr(dist, name) for name in (*wrappers, "batch_isend_irecv")}

        def wrap(name):
            def call(*args, **kwargs):
                wrappers[name](*args, **kwargs)
                return originals[name](*args, **kwargs)

            return call

        def batch(ops):
            self.total += sum(nbytes(op.tensor) for op in ops if op.op is dist.isend)
            return originals["batch_isend_irecv"](ops)

        try:
            for name in wrappers:
                setattr(dist, name, wrap(name))
            dist.batch_isend_irecv = batch
            yield self
        finally:
            for name, original in originals.items():
                setattr(dist, name, original)


# --------------------------------------------------------------------------- one stage on one rank


def _tensor_bytes(tensors) -> int:
    seen = set()
    total = 0
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _kept_bytes(model: nn.Module, opt, stage: int) -> int:
    """Bytes kept between steps: ZeRO's flat buffers and state, or DDP's parameters, gradients and state."""
    if stage > 0:
        return opt.model_state_bytes()  # stage 3: its shards of the parameters, gradients and state
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return _tensor_bytes([*model.parameters(), *grads, *state])


def run_stage(stage: int, *, rank: int, world_size: int, args: argparse.Namespace) -> dict:
    spec = MODELS[args.model]
    model = build_model(spec, dtype=torch.float32, seed=args.seed)
    if stage == 3:
        shard_model(model, compute_dtype=torch.float32)
    groups = decay_param_groups(model, weight_decay=WEIGHT_DECAY)
    counter = SentBytes(world_size)
    if stage == 3:
        net = model
        opt = ZeRO3AdamW(groups, **HYPER)
    elif stage == 0:
        net = DDP(model, gradient_as_bucket_view=True)
        net.register_comm_hook(None, allreduce_hook)  # torch's default, through dist.all_reduce: counted
        opt = torch.optim.AdamW(groups, **HYPER, foreach=True)
    else:
        net = model
        optimizer_class = ZeRO1AdamW if stage == 1 else ZeRO2AdamW
        opt = optimizer_class(groups, **HYPER, max_grad_norm=None)
    gen = torch.Generator().manual_seed(args.seed + rank)
    micro = args.micro_batch_size
    times = []
    sent = []
    peaks = []
    losses = []
    for step in range(args.warmup + args.steps):
        batches = [
            torch.randint(0, spec.vocab_size, (micro, spec.block_size + 1), generator=gen)
            for _ in range(args.accumulation)
        ]
        dist.barrier()
        counter.total = 0
        start = time.perf_counter()
        step_peak = 0
        with counter.installed():
            for i, batch in enumerate(batches):
                inputs = batch[:, :-1]
                targets = batch[:, 1:]
                last = i == len(batches) - 1
                sync = (
                    contextlib.nullcontext() if last or stage == 2 else (net.no_sync() if stage == 0 else opt.no_sync())
                )

                def forward(inputs=inputs, targets=targets):
                    return loss_of(net(inputs, targets)) / args.accumulation

                # counted once, on the first step, as the workers count it (at stage 3 only the first step
                # sees FSDP2's gathered units made: it resizes their storages in place after)
                with sync:
                    if step == 0:
                        loss, used = measure_step(model, (inputs, targets), forward, lambda loss: loss.backward())
                        step_peak = max(step_peak, used.peak_bytes)
                    else:
                        loss = forward()
                        loss.backward()
            opt.step()
        kept = _kept_bytes(model, opt, stage) if step == 0 else 0  # gradients included, as the workers count
        opt.zero_grad(set_to_none=stage != 0)
        elapsed = time.perf_counter() - start
        if step == 0:
            peaks.append(kept + step_peak)
        if step >= args.warmup:
            times.append(elapsed)
            sent.append(counter.total)
            losses.append(loss.item())
    workload = memory.Workload.from_model(spec, precision="fp32", micro_batch_size=micro)
    planned = memory.breakdown(workload, num_gpus=world_size, stage=stage).total_bytes
    return {
        "stage": stage,
        "rank": rank,
        "step_s": statistics.median(times),
        "sent_bytes": max(sent),
        "peak_bytes": peaks[0],
        "planned_bytes": planned,
        "num_params": workload.num_params,
        "last_loss": losses[-1],
    }


def run_rank(rank: int, world_size: int, init_file: str, out_file: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # the ranks share this machine's cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        rows = [run_stage(stage, rank=rank, world_size=world_size, args=args) for stage in STAGES]
    finally:
        dist.destroy_process_group()
    Path(f"{out_file}.{rank}").write_text(json.dumps(rows))


# --------------------------------------------------------------------------- the table


def measure(args: argparse.Namespace) -> dict:
    spec = MODELS[args.model]
    cells = []
    for n in args.world_sizes:
        with tempfile.TemporaryDirectory() as tmp:
            init_file = os.path.join(tmp, "init")
            out_file = os.path.join(tmp, "out")
            mp.spawn(run_rank, args=(n, init_file, out_file, args), nprocs=n, join=True)
            per_rank = [json.loads(Path(f"{out_file}.{r}").read_text()) for r in range(n)]
        for index, stage in enumerate(STAGES):
            rows = [ranks[index] for ranks in per_rank]
            cells.append(
                {
                    "num_gpus": n,
                    "stage": stage,
                    "step_s": max(r["step_s"] for r in rows),
                    "tokens_per_s": n
                    * args.micro_batch_size
                    * args.accumulation
                    * spec.block_size
                    / max(r["step_s"] for r in rows),
                    "peak_bytes": max(r["peak_bytes"] for r in rows),
                    "planned_bytes": rows[0]["planned_bytes"],
                    "sent_bytes": max(r["sent_bytes"] for r in rows),
                    "num_params": rows[0]["num_params"],
                    "last_loss": rows[0]["last_loss"],
                }
            )
    return {
        "model": args.model,
        "micro_batch_size": args.micro_batch_size,
        "accumulation": args.accumulation,
        "steps": args.steps,
        "torch": torch.__version__,
        "cells": cells,
    }


def paper_bytes(cell: dict, *, accumulation: int) -> float:
    """The ZeRO paper's volume per GPU per step: 2Ψ elements at stages 0 and 1 (a ring all-reduce, or a
    reduce-scatter and an all-gather); stage 2 reduces each micro-batch: accumulation + 1 passes;
    stage 3: 3 passes a micro-batch."""
    n = cell["num_gpus"]
    passes = {0: 2, 1: 2, 2: accumulation + 1, 3: 3 * accumulation}[cell["stage"]]
    return passes * (n - 1) / n * cell["num_params"] * 4  # fp32: 4 bytes a parameter


def table(result: dict) -> str:
    acc = result["accumulation"]
    lines = [
        f"GPT {result['model']} ({result['cells'][0]['num_params']:,} parameters), fp32, micro-batch "
        f"{result['micro_batch_size']} x {acc} accumulation, {result['steps']} steps, gloo, torch {result['torch']}",
        "",
        f"{'N':>3}  {'stage':<10}{'step ms':>9}{'tokens/s':>10}{'peak MB':>10}{'plan MB':>10}{'peak/plan':>10}"
        f"{'sent MB':>10}{'paper MB':>10}{'sent/paper':>11}",
    ]
    names = {0: "0 (DDP)", 1: "1", 2: "2", 3: "3 (FSDP2)"}
    for cell in result["cells"]:
        paper = paper_bytes(cell, accumulation=acc)
        lines.append(
            f"{cell['num_gpus']:>3}  {names[cell['stage']]:<10}"
            f"{cell['step_s'] * 1e3:>9.1f}{cell['tokens_per_s']:>10,.0f}"
            f"{cell['peak_bytes'] / 1e6:>10.2f}{cell['planned_bytes'] / 1e6:>10.2f}"
            f"{cell['peak_bytes'] / cell['planned_bytes']:>10.3f}{cell['sent_bytes'] / 1e6:>10.2f}"
            f"{paper / 1e6:>10.2f}{cell['sent_bytes'] / paper:>11.3f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="10M")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="the 2M model, 3 steps")
    parser.add_argument("--from-json", type=Path, help="reprint a saved run")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.from_json:
        print(table(json.loads(args.from_json.read_text())))
        return
    if args.quick:
        args.model = "2M"
        args.steps = 3
    result = measure(args)
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()

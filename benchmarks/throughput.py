"""Training throughput through zero1 against a plain DDP loop: the service's overhead as a ratio.

    .venv/bin/python benchmarks/throughput.py [--before REF]      (make bench runs every benchmark)

The same job both ways, on 2 gloo ranks of this machine: examples/tiny-llama.json (a tiny Llama
on the shipped corpus and tokenizer, fp32, micro-batch 8, global batch 16, seq 64), with
evaluation off and one checkpoint at the end.

- zero1: `zero1 serve` (embedded Ray) on loopback; the job is submitted over HTTP, its ranks are
  Ray actors training with ZeRO1AdamW; tokens/s is each step's row (global batch tokens over the
  step's wall time, as the ranks report it).
- DDP: two processes (torch.multiprocessing), the same model from the same seed, the same
  batches (workers.data.sources.Batches over the same token file), DistributedDataParallel and
  torch.optim.AdamW (foreach), timed per step the same way.

Each runs twice, in the order zero1, DDP, DDP, zero1, and each one's steps are pooled: a run's few
seconds of training may overlap the last server's Ray winding down, or a busier minute of the
machine, and the symmetric order keeps that from always falling on one side.

With `--before REF`, zero1 also runs the tree of git ref REF (checked out with `git worktree`, run
with this venv: benchmarks/startup.py's way) in the same run, in the order this, before, DDP, DDP,
before, this: a change's cost in throughput, side by side.

Prints one table, medians over the steps after the first 10 (warm-up), and the ratio.

With `--split`, no service: the training loop's step (workers/training/loop.py) and the DDP step
run one after the other in the same two processes, each split into its phases (ZeRO1AdamW's
record_phase_times), and a step that counts its memory op by op is timed apart: where the time
between the two goes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = json.loads((ROOT / "examples" / "tiny-llama.json").read_text())
WARMUP_STEPS = 10


def _job(steps: int) -> dict:
    data = {key: str(ROOT / EXAMPLE["data"][key]) for key in ("path", "tokenizer")}
    return {
        **EXAMPLE,
        "data": {**EXAMPLE["data"], **data},
        "steps": steps,
        "eval_every": 0,
        "checkpoint_every": 0,
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def zero1_rates(*, steps: int, scratch: Path, tree: Path = ROOT) -> tuple[list[float], str]:
    """Tokens/s of each step of the job run through `zero1 serve` of `tree`'s code, and the cache dir
    of its token file."""
    scratch.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(tree),
        "ZERO1_DATABASE_URL": f"sqlite:///{scratch}/zero1.db",
        "ZERO1_CHECKPOINT_URI": f"{scratch}/checkpoints",
        "ZERO1_DATA_ROOTS": str(ROOT / "examples" / "data"),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "HF_HUB_OFFLINE": "1",
    }
    zero1 = str(Path(sys.executable).with_name("zero1"))
    server = subprocess.Popen(
        [zero1, "serve", "--port", str(port)],
        cwd=tree,  # Ray's workers import from the driver's working directory: the tree's code
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            _wait_healthy(client, server)
            job = client.post("/v1/jobs", json=_job(steps))
            job.raise_for_status()
            job_id = job.json()["id"]
            while (state := client.get(f"/v1/jobs/{job_id}").json())["status"] not in (
                "succeeded",
                "failed",
                "cancelled",
            ):
                time.sleep(1)
            if state["status"] != "succeeded":
                raise SystemExit(f"the zero1 job ended {state['status']}: {state['error']}")
            rows = client.get(f"/v1/jobs/{job_id}/metrics", params={"limit": 10_000}).json()["data"]
            return [row["tokens_per_s"] for row in rows], f"{scratch}/checkpoints/datasets"
    finally:
        server.terminate()
        server.wait(timeout=120)


def _wait_healthy(client: httpx.Client, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 180  # the service starts its embedded Ray first
    while True:
        try:
            if client.get("/healthz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or server.poll() is not None:
            raise SystemExit("zero1 serve did not start")
        time.sleep(0.2)


def _ddp_parts(steps: int, cache_dir: str, *, rank: int, world_size: int):
    """(model in DDP, torch.optim.AdamW, Batches) of the benchmark's job on this rank."""
    from torch.nn.parallel import DistributedDataParallel

    from workers.config import DatasetSpec, HFSpec
    from workers.data.sources import Batches
    from workers.models.hf import build_hf

    job = _job(steps)
    spec = HFSpec(config=job["model"]["config"], vocab_size=512, block_size=128)
    model = DistributedDataParallel(build_hf(spec, dtype=torch.float32, seed=job["seed"]))
    hyper = job["optimizer"]
    opt = torch.optim.AdamW(
        model.parameters(), lr=hyper["lr"], betas=hyper["betas"], eps=hyper["eps"], weight_decay=0.0, foreach=True
    )
    data = job["data"]
    batches = Batches(
        model=spec,
        data=DatasetSpec(format=data["format"], path=data["path"], tokenizer=data["tokenizer"], cache_dir=cache_dir),
        seed=job["seed"],
        seq_len=job["seq_len"],
        global_batch_size=job["micro_batch_size"] * world_size,
        micro_batch_size=job["micro_batch_size"],
        rank=rank,
        world_size=world_size,
    )
    return model, opt, batches


def _ddp_step(model, opt, batches, step: int, clock=lambda phase: None) -> None:
    """One DDP step as the benchmark times it; clock(phase) after each phase."""
    inputs, targets = batches.micro_batch(step, 0)
    loss = model(inputs, targets)
    loss.backward()  # DDP's all-reduce runs in its buckets as the gradients arrive, waited for here
    clock("forward, backward (all-reduce overlapped)")
    torch.nn.utils.clip_grad_norm_(model.parameters(), EXAMPLE["optimizer"]["max_grad_norm"])
    opt.step()
    opt.zero_grad(set_to_none=True)
    clock("clip, AdamW")
    reduced = loss.detach().clone()
    dist.all_reduce(reduced)  # the global loss, as zero1 reports it each step
    reduced.item()
    clock("the loss's all-reduce")


def _ddp_rank(rank: int, world_size: int, port: int, steps: int, cache_dir: str, out: str) -> None:
    torch.set_num_threads(1)  # as a Ray actor of 1 CPU runs
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    model, opt, batches = _ddp_parts(steps, cache_dir, rank=rank, world_size=world_size)
    tokens = EXAMPLE["micro_batch_size"] * world_size * EXAMPLE["seq_len"]
    rates = []
    for step in range(steps):
        dist.barrier()
        start = time.perf_counter()
        _ddp_step(model, opt, batches, step)
        rates.append(tokens / (time.perf_counter() - start))
    if rank == 0:
        Path(out).write_text(json.dumps(rates))
    dist.destroy_process_group()


def _zero1_config(steps: int, cache_dir: str):
    """The benchmark's job as the training loop takes it (workers.config.TrainConfig)."""
    from workers.config import DatasetSpec, HFSpec, OptimizerSpec, TrainConfig

    job = _job(steps)
    hyper = job["optimizer"]
    return TrainConfig(
        model=HFSpec(config=job["model"]["config"], vocab_size=512, block_size=128),
        steps=steps,
        data=DatasetSpec(**{k: job["data"][k] for k in ("format", "path", "tokenizer")}, cache_dir=cache_dir),
        precision=job["precision"],
        optimizer=OptimizerSpec(
            lr=hyper["lr"], betas=tuple(hyper["betas"]), eps=hyper["eps"], weight_decay=0.0, max_grad_norm=1.0
        ),
        micro_batch_size=job["micro_batch_size"],
        seq_len=job["seq_len"],
        seed=job["seed"],
        planned_bytes=0,  # the service's traced plan; nothing here reads it
    )


SPLIT_ROWS = (
    "zero1: a step",
    "  forward, backward, the loss",
    "  reduce (p2p), norm/flags/loss all-reduce",
    "  update, cast",
    "  gather (p2p)",
    "zero1: a step that counts its memory",
    "DDP: a step",
    "  forward, backward (all-reduce overlapped)",
    "  clip, AdamW",
    "  the loss's all-reduce",
)
"""The --split table's rows, in order; the indented ones split the step above them."""


def _split_rank(rank: int, world_size: int, port: int, steps: int, cache_dir: str, out: str) -> None:
    """zero1's step (the training loop's, without the service) and DDP's, one after the other each step
    in the same two processes, each split into its phases; every tenth zero1 step counts its memory
    op by op, as a CPU rank did before 6300fca."""
    from workers.training import loop

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    context = loop._step_context(
        _zero1_config(steps, cache_dir),
        rank=rank,
        world_size=world_size,
        process_group=None,
        device=torch.device("cpu"),
    )
    context.opt.record_phase_times = True
    ddp = _ddp_parts(steps, cache_dir, rank=rank, world_size=world_size)
    times: dict[str, list[float]] = {name: [] for name in SPLIT_ROWS}
    for step in range(steps):
        counted = step % 10 == 0
        if counted:
            context.cpu_peak_bytes = None  # this step counts again
        dist.barrier()
        start = time.perf_counter()
        context.run_step(step)
        total = time.perf_counter() - start
        phases = context.opt.phase_times_s
        dist.barrier()
        ddp_start = time.perf_counter()
        last = [ddp_start]
        ddp_phases = {}

        def clock(phase: str, last=last, ddp_phases=ddp_phases) -> None:
            now = time.perf_counter()
            ddp_phases[f"  {phase}"] = now - last[0]
            last[0] = now

        _ddp_step(*ddp, step, clock)
        if step < WARMUP_STEPS:
            continue
        times["DDP: a step"].append(time.perf_counter() - ddp_start)
        for name, seconds in ddp_phases.items():
            times[name].append(seconds)
        if counted:
            times["zero1: a step that counts its memory"].append(total)
            continue
        times["zero1: a step"].append(total)
        times["  forward, backward, the loss"].append(total - sum(phases.values()))
        times["  reduce (p2p), norm/flags/loss all-reduce"].append(phases["reduce"])
        times["  update, cast"].append(phases["update"])
        times["  gather (p2p)"].append(phases["gather"])
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def split(*, steps: int, scratch: Path) -> None:
    """Print where a step's time goes, zero1's training loop beside DDP's (the --split table)."""
    out = scratch / "split.json"
    cache = str(scratch / "datasets")
    mp.spawn(_split_rank, args=(2, _free_port(), steps, cache, str(out)), nprocs=2, join=True)
    times = json.loads(out.read_text())
    print(f"{'tiny Llama, 2 gloo ranks, fp32: one process a rank':<52}{'steps':>7}{'p50':>10}{'mean':>10}")
    print("-" * 79)
    for name, values in times.items():
        median = 1e3 * statistics.median(values)
        mean = 1e3 * statistics.mean(values)
        print(f"{name:<52}{len(values):>7}{median:>8.2f}ms{mean:>8.2f}ms")
        if name == "zero1: a step that counts its memory":
            print()
    print(f"(steps {WARMUP_STEPS}..{steps - 1}; each step zero1's then DDP's; 'a step' leaves out the counting ones)")


def ddp_rates(*, steps: int, cache_dir: str, scratch: Path) -> list[float]:
    scratch.mkdir(parents=True, exist_ok=True)
    out = scratch / "ddp.json"
    mp.spawn(_ddp_rank, args=(2, _free_port(), steps, cache_dir, str(out)), nprocs=2, join=True)
    return json.loads(out.read_text())


def _runs(order: tuple[str, ...], *, before: Path | None, steps: int, scratch: Path) -> dict[str, list[float]]:
    """Each name's rates after warm-up, its runs pooled, run in `order`: "this" and "before" are zero1
    jobs of this tree and the earlier one, "ddp" the DDP loop. A symmetric order (a, b, b, a) keeps any
    one of them from always running while the last server's Ray winds down, or on a quieter machine."""
    rates: dict[str, list[float]] = {name: [] for name in order}
    cache_dir = ""  # the token file's cache, which a zero1 job writes first
    for round_, name in enumerate(order):
        if name == "ddp":
            found = ddp_rates(steps=steps, cache_dir=cache_dir, scratch=scratch / f"ddp-{round_}")
        else:
            tree = before if name == "before" else ROOT
            found, cache_dir = zero1_rates(steps=steps, scratch=scratch / f"{name}-{round_}", tree=tree)
        rates[name] += found[WARMUP_STEPS:]
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--before", help="git ref of a tree whose zero1 runs the same job, for comparison")
    parser.add_argument(
        "--split", action="store_true", help="where a step's time goes: the training loop beside DDP, no service"
    )
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="zero1-throughput-"))
    if args.split:
        try:
            split(steps=args.steps, scratch=scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return
    try:
        if args.before:
            from startup import worktree  # benchmarks/ is this script's directory, first on sys.path

            order = ("this", "before", "ddp", "ddp", "before", "this")
            with worktree(args.before) as before:
                rates = _runs(order, before=before, steps=args.steps, scratch=scratch)
        else:
            order = ("this", "ddp", "ddp", "this")
            rates = _runs(order, before=None, steps=args.steps, scratch=scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = [(f"zero1 before ({args.before})", rates["before"])] if args.before else []
    rows += [("zero1 (service, Ray, ZeRO1AdamW)", rates["this"]), ("plain DDP + torch.optim.AdamW", rates["ddp"])]
    header = f"{'tiny Llama, 2 gloo ranks, fp32':<36}{'steps':>7}{'tokens/s p50':>14}{'step p50':>11}{'vs DDP':>8}"
    print(header)
    print("-" * len(header))
    base = statistics.median(rates["ddp"])
    for label, pooled in rows:
        median = statistics.median(pooled)
        tokens = EXAMPLE["micro_batch_size"] * 2 * EXAMPLE["seq_len"]
        print(f"{label:<36}{len(pooled):>7}{median:>14,.0f}{1e3 * tokens / median:>9.1f}ms{median / base:>8.2f}")
    print(
        f"(each row: two runs, in the order {' '.join(order)}; medians over steps {WARMUP_STEPS}..{args.steps - 1} "
        "of each run, pooled; target: zero1 >= 0.98x DDP)"
    )


if __name__ == "__main__":
    main()

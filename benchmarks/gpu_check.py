"""GPU check: the optimizer's tests on CUDA, and ZeRO-1's bytes per rank beside the plan.

    .venv/bin/python benchmarks/gpu_check.py            # on a CUDA machine; sized for < 5 minutes on one H200
    .venv/bin/python benchmarks/gpu_check.py --device cpu --small --skip-tests    # smoke run, seconds

1. Runs `pytest -q tests/test_optim.py` in a subprocess, alongside step 2: on a
   CUDA machine this includes the NCCL test, skipped elsewhere. Prints its
   pass/fail counts (--tests-timeout-s stops it).
2. Builds a 1.16e9-parameter GPT-2-style decoder in bf16 with
   workers.models.builtin.build_model, wraps it in ZeRO1AdamW (reduce_scatter /
   all_gather, the NCCL collectives) and trains a few steps on random tokens,
   resetting torch.cuda's peak at the start of each step. First at world size 1
   (no process group), then, in this same process, as rank 0 of N = 2, 4, 8 on
   torch's `fake` backend: its collectives are no-ops, but every buffer ZeRO-1
   allocates is real, so rank 0 holds what rank 0 of N would.
3. Prints one table, one row per N: the memory model's plan (model states and
   activations), the model-state bytes the optimizer allocated, the peak
   torch.cuda.max_memory_allocated, their ratio, and whether the optimizer's
   own account of its state (ZeRO1AdamW.memory_bytes) equals the plan's
   optimizer + padding bytes.

With --device cpu there is no allocator to ask: the table shows model states
only, and n/a for the peak. Exits 1 if a test fails or a byte count differs
from the plan.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: `workers` is importable

from workers.memory import model as memory  # noqa: E402
from workers.memory.model import GB, GPTSpec  # noqa: E402
from workers.models.builtin import build_model  # noqa: E402
from workers.zero.optimizer import (  # noqa: E402
    UPCAST_CHUNK_NUMEL,
    ZeRO1AdamW,
    decay_param_groups,
)

# Ψ = 1,160,835,840: GPT-2's vocabulary (padded to a multiple of 64), 24 layers of width 1920
GPT_1B = GPTSpec(vocab_size=50304, n_layer=24, n_head=16, n_embd=1920, block_size=1024)
GPT_TINY = GPTSpec(vocab_size=96, n_layer=2, n_head=2, n_embd=32, block_size=32)
PRECISION = "bf16"
CUDA_TEST = "test_nccl_on_cuda_matches_torch_adamw"


# --------------------------------------------------------------------------- 1. the tests


@dataclass(frozen=True, slots=True, kw_only=True)
class TestReport:
    counts: dict[str, int]
    """pytest's summary: outcome -> number of tests."""
    cuda_test: str
    """passed, failed, skipped, or unknown (no summary): the NCCL test's outcome."""
    returncode: int | None
    """pytest's exit status; None when it was stopped at its timeout."""
    wall_s: float
    tail: str


def parse_pytest_counts(output: str) -> dict[str, int]:
    """{'passed': 25, 'skipped': 1, ...} from pytest's last summary line."""
    lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|errors?|skipped)", line)]
    if not lines:
        return {}
    return {kind: int(n) for n, kind in re.findall(r"(\d+) (\w+)", lines[-1])}


def cuda_test_outcome(output: str, counts: dict[str, int]) -> str:
    """-rA lists passed and failed tests by name; a skip is listed by reason only."""
    for line in output.splitlines():
        word = line.split(" ", 1)[0]
        if CUDA_TEST in line and word in ("PASSED", "FAILED", "ERROR"):
            return word.lower()
    return "skipped" if counts else "unknown"


class OptimTestRun:
    """`pytest -q tests/test_optim.py` in its own process (and session), output to a file.

    It runs while the memory is measured: max_memory_allocated counts this
    process's allocations only, so the tests' CUDA context does not show.
    """

    def __init__(self) -> None:
        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - read back and closed in result()
        self._start = time.perf_counter()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-rA", "tests/test_optim.py"],
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def kill(self) -> None:
        """End pytest and the ranks it spawned: its whole process group."""
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait()

    def finish(self, *, timeout_s: float) -> TestReport:
        """Wait until `timeout_s` after the start; stop pytest there."""
        try:
            returncode = self._proc.wait(timeout=max(0.0, self._start + timeout_s - time.perf_counter()))
        except subprocess.TimeoutExpired:
            self.kill()
            returncode = None
        self._log.seek(0)
        output = self._log.read()
        self._log.close()
        if returncode is None:
            output += f"\nstopped at the timeout, {timeout_s:.0f} s after the start"
        counts = parse_pytest_counts(output)
        return TestReport(
            counts=counts,
            cuda_test=cuda_test_outcome(output, counts),
            returncode=returncode,
            wall_s=time.perf_counter() - self._start,
            tail="\n".join(output.splitlines()[-40:]),
        )


def print_test_report(report: TestReport) -> None:
    counts = ", ".join(f"{n} {kind}" for kind, n in report.counts.items()) or "no summary"
    verdict = {0: "ok", None: "TIMED OUT"}.get(report.returncode, f"FAILED (exit {report.returncode})")
    print(f"pytest -q tests/test_optim.py: {counts} in {report.wall_s:.0f} s: {verdict}")
    print(f"  {CUDA_TEST}: {report.cuda_test}")
    if report.returncode != 0:
        print(report.tail)
    print()


# --------------------------------------------------------------------------- 2. the measurement


@dataclass(frozen=True, slots=True, kw_only=True)
class Measurement:
    num_gpus: int
    num_params: int
    model_state_bytes: int
    """Flat parameter and gradient buffers plus the fp32 shard: exact tensor sizes."""
    optimizer_state_bytes: int
    """sum(ZeRO1AdamW.memory_bytes().values()): the optimizer's own account."""
    peak_bytes: int | None
    """Largest torch.cuda.max_memory_allocated over the steps; None off CUDA."""


@contextmanager
def rank0_of(num_gpus: int) -> Iterator[None]:
    """Be rank 0 of `num_gpus` on the fake backend for the block; at 1, no process group at all."""
    if num_gpus == 1:
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=num_gpus)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build_zero1(spec: GPTSpec, *, device: torch.device) -> tuple[torch.nn.Module, ZeRO1AdamW]:
    """The bf16 GPT on `device` and ZeRO1AdamW over it with the NCCL collectives."""
    # initialise on the device itself: a 1e9-parameter init on the host takes longer than the check
    with device:
        model = build_model(spec, dtype=torch.bfloat16, device=device)
    groups = decay_param_groups(model, weight_decay=0.1)
    opt = ZeRO1AdamW(groups, lr=3e-4, betas=(0.9, 0.95), reduce_op="reduce_scatter", gather_op="all_gather")
    return model, opt


def train_step(model: torch.nn.Module, opt: ZeRO1AdamW, *, idx: torch.Tensor, targets: torch.Tensor) -> int | None:
    """One step from a reset peak; the step's torch.cuda.max_memory_allocated (None off CUDA).

    Under `fake` the reduced gradients are whatever the reduce's buffer held, so
    the weights turn to noise: only the allocations mean anything here.
    """
    cuda = idx.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(idx.device)
    opt.scale_loss(model(idx, targets)).backward()
    opt.step()
    opt.zero_grad()
    if not cuda:
        return None
    torch.cuda.synchronize(idx.device)
    return torch.cuda.max_memory_allocated(idx.device)


def measure(
    spec: GPTSpec, *, num_gpus: int, device: torch.device, micro_batch_size: int, seq_len: int, steps: int
) -> Measurement:
    """Train `steps` steps as rank 0 of `num_gpus`; what that rank allocated. Frees it all after."""
    with rank0_of(num_gpus):
        result = _train_and_count(
            spec, num_gpus=num_gpus, device=device, shape=(micro_batch_size, seq_len), steps=steps
        )
    # the model and optimizer died with _train_and_count's frame; gradient hooks and
    # parameters refer to each other, so only the cycle collector frees them
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _train_and_count(
    spec: GPTSpec, *, num_gpus: int, device: torch.device, shape: tuple[int, int], steps: int
) -> Measurement:
    model, opt = build_zero1(spec, device=device)
    torch.manual_seed(num_gpus)
    peaks = []
    for _ in range(steps):
        idx = torch.randint(0, spec.vocab_size, shape, device=device)
        targets = torch.randint(0, spec.vocab_size, shape, device=device)
        peaks.append(train_step(model, opt, idx=idx, targets=targets))
    return Measurement(
        num_gpus=num_gpus,
        num_params=sum(p.numel() for p in model.parameters()),
        model_state_bytes=opt.model_state_bytes(),
        optimizer_state_bytes=sum(opt.memory_bytes().values()),
        peak_bytes=None if None in peaks else max(peaks),
    )


# --------------------------------------------------------------------------- 3. the table


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    measured: Measurement
    plan: memory.Breakdown
    formula_bytes: int
    """4Ψ + 12⌈Ψ/N⌉: bf16 weights and gradients, fp32 master and moments sharded."""
    grad_copy_bytes: int
    """The update's transient: an fp32 copy of one chunk of a gradient shard."""

    @property
    def planned_state_bytes(self) -> int:
        p = self.plan
        return p.params_bytes + p.grads_bytes + p.optimizer_bytes + p.padding_bytes

    @property
    def state_check(self) -> str:
        diff = self.measured.optimizer_state_bytes - (self.plan.optimizer_bytes + self.plan.padding_bytes)
        return "exact" if diff == 0 else f"{_signed(diff)} B"


def plan_row(spec: GPTSpec, measured: Measurement, *, micro_batch_size: int, seq_len: int) -> Row:
    workload = memory.Workload.from_model(spec, precision=PRECISION, micro_batch_size=micro_batch_size, seq_len=seq_len)
    n = measured.num_gpus
    psi = spec.num_params
    shards = [memory.padded_numel(g, num_gpus=n) // n for g in workload.group_numels]
    return Row(
        measured=measured,
        plan=memory.breakdown(workload, num_gpus=n, stage=1),
        formula_bytes=4 * psi + 12 * -(-psi // n),
        grad_copy_bytes=4 * min(max(shards), UPCAST_CHUNK_NUMEL["cuda"]),
    )


def _unit(largest_bytes: int) -> tuple[str, float]:
    for name, size in (("GB", GB), ("MB", 10**6)):
        if largest_bytes >= size:
            return name, size
    return "kB", 10**3


def _signed(value: int) -> str:
    return f"{value:+,}" if value else "0"


def print_table(rows: list[Row]) -> None:
    unit, size = _unit(max(row.plan.total_bytes for row in rows))

    def fmt(value: int | None) -> str:
        return "n/a" if value is None else f"{value / size:,.3f}"

    print(f"bytes per rank in {unit} (Δ in bytes); planned: memory.breakdown(stage=1); measured: rank 0")
    header = (
        f"{'N':>3}{'4Ψ+12Ψ/N':>11}{'planned':>10}{'planned':>10}{'planned':>10}{'measured':>10}"
        f"{'Δ states':>10}{'max_memory':>12}{'measured':>10}{'fp32 grad':>11}  optimizer state"
    )
    sub = (
        f"{'':>3}{'':>11}{'states':>10}{'activ.':>10}{'total':>10}{'states':>10}"
        f"{'':>10}{'_allocated':>12}{'/planned':>10}{'copy':>11}  = plan opt.+pad."
    )
    print(header)
    print(sub)
    print("-" * len(header))
    for row in rows:
        m = row.measured
        ratio = "n/a" if m.peak_bytes is None else f"{m.peak_bytes / row.plan.total_bytes:.3f}"
        print(
            f"{m.num_gpus:>3}{fmt(row.formula_bytes):>11}{fmt(row.planned_state_bytes):>10}"
            f"{fmt(row.plan.activations_bytes):>10}{fmt(row.plan.total_bytes):>10}{fmt(m.model_state_bytes):>10}"
            f"{_signed(m.model_state_bytes - row.planned_state_bytes):>10}{fmt(m.peak_bytes):>12}{ratio:>10}"
            f"{fmt(row.grad_copy_bytes):>11}  {row.state_check}"
        )


NOTE = """
planned states = params + grads + optimizer + padding of memory.breakdown(stage=1): the
  formula 4Ψ + 12Ψ/N (bf16 weights and gradients replicated, 2 + 2 bytes per parameter;
  fp32 master, exp_avg and exp_avg_sq sharded, 4 + 4 + 4 bytes over N ranks) plus the
  padding of each flat buffer to a multiple of 128·N elements. Δ states: measured − planned.
max_memory_allocated (the largest over the steps, each from a reset) counts every tensor
  live at the step's high-water mark, not only what the plan names: the model states, then
  either the activations (end of forward, with the fp32 logits and their gradient beside
  the saved log-softmax) or, in the update, the fp32 copy of one chunk of a gradient shard
  that the fused AdamW kernel reads ('fp32 grad copy': at most 4 x 2^22 bytes, the
  optimizer upcasts a chunk at a time); plus cuBLAS's workspace and the allocator's
  rounding, which the plan's fixed overhead line covers. So measured/planned above 1 by a
  few percent is expected.
under `fake` (N > 1) the optimizer takes its non-NCCL path: it reduce-scatters into a
  fresh (S,) buffer and gathers from a clone of its shard where NCCL works in place, 2
  transient bytes per shard element each; real NCCL ranks hold that much less."""


# --------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke run")
    parser.add_argument("--small", action="store_true", help=f"a tiny GPT ({GPT_TINY.num_params:,} parameters)")
    parser.add_argument("--skip-tests", action="store_true", help="do not run tests/test_optim.py")
    parser.add_argument("--world-sizes", default="1,2,4,8", help="comma-separated N (default 1,2,4,8)")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="training steps per N (default 3; 2 with --small)")
    parser.add_argument("--tests-timeout-s", type=float, default=240.0)
    args = parser.parse_args()
    args.world_sizes = [int(n) for n in args.world_sizes.split(",")]
    if any(n < 1 for n in args.world_sizes):
        parser.error(f"--world-sizes must be positive integers, got {args.world_sizes}")
    args.steps = args.steps or (2 if args.small else 3)
    return args


def describe(device: torch.device, spec: GPTSpec, *, built_num_params: int, micro_batch_size: int, steps: int) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    built = "the same" if built_num_params == spec.num_params else f"{built_num_params:,}"
    return (
        f"{name}, torch {torch.__version__}; GPT {spec.n_layer}x{spec.n_embd} (vocab {spec.vocab_size}), "
        f"Ψ = {spec.num_params:,} parameters (built model: {built}), {PRECISION}, micro-batch "
        f"{micro_batch_size} x seq {spec.block_size}, {steps} steps per N; GB = 1e9 bytes"
    )


def measure_rows(
    spec: GPTSpec, *, device: torch.device, world_sizes: list[int], micro_batch_size: int, steps: int
) -> list[Row]:
    rows = []
    for n in world_sizes:
        measured = measure(
            spec, num_gpus=n, device=device, micro_batch_size=micro_batch_size, seq_len=spec.block_size, steps=steps
        )
        rows.append(plan_row(spec, measured, micro_batch_size=micro_batch_size, seq_len=spec.block_size))
    return rows


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device (use --device cpu for a smoke run)")
    spec = GPT_TINY if args.small else GPT_1B
    tests = None if args.skip_tests else OptimTestRun()
    try:
        rows = measure_rows(
            spec, device=device, world_sizes=args.world_sizes, micro_batch_size=args.micro_batch_size, steps=args.steps
        )
    except BaseException:
        if tests is not None:
            tests.kill()
        raise
    tests_ok = True
    if tests is not None:
        report = tests.finish(timeout_s=args.tests_timeout_s)
        print_test_report(report)
        tests_ok = report.returncode == 0
    print(
        describe(
            device,
            spec,
            built_num_params=rows[0].measured.num_params,
            micro_batch_size=args.micro_batch_size,
            steps=args.steps,
        )
    )
    print_table(rows)
    print(NOTE)
    exact = all(r.state_check == "exact" and r.measured.model_state_bytes == r.planned_state_bytes for r in rows)
    return 0 if tests_ok and exact else 1


if __name__ == "__main__":
    sys.exit(main())

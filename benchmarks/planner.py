"""Planner speed and what the plan counts: closed forms, traced plans, and the trace against the plan.

    .venv/bin/python benchmarks/planner.py        (make bench runs every benchmark)

Prints three tables from one run:
1. closed-form plans: per-plan latency (p50, p99) and throughput for the memory model alone,
   the API's request path in-process (validation, plan, JSON), and POST /v1/plan over HTTP to a
   `zero1 serve` on loopback (one keep-alive client, sequential requests); target < 1 ms p99
   in-process;
2. traced plans (method "traced"): a trace in this process, and POST /v1/plan through the
   service's Ray task: the first request (the task's worker starts and imports torch), a new
   digest on a warm worker (cold: traced), and the same request again (cached);
3. the trace against the plan: the built-in GPT at GPT-2 small's shape, bf16, seq 1024 — the
   closed forms' activations and temporaries, this repository's trace on fake tensors, and
   torch's MemTracker at its peak (ACT + TEMP), side by side.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from service.planning.capacity import simulated_capacity
from service.planning.plans import make_plan, plan_public
from service.schemas.plan_requests import PlanRequest
from service.settings import Settings
from workers.memory.fit import plan
from workers.memory.model import GB, GPTSpec, Workload

GPT2_SMALL = {"kind": "gpt", "vocab_size": 50304, "n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024}
DEEP = {"kind": "gpt", "vocab_size": 32000, "n_layer": 32, "n_head": 32, "n_embd": 4096, "block_size": 2048}
"""A 32-layer, 6.6e9-parameter GPT: a deep model whose trace extrapolates per layer."""
TRACED_BODY = {"model": GPT2_SMALL, "num_gpus": 8, "precision": "bf16", "micro_batch_size": 4, "method": "traced"}

SEED_BODY = {"num_params": 7_500_000_000, "num_gpus": 64, "gpu_memory_gb": 80}
GPT2_XL = {"kind": "gpt", "vocab_size": 50257, "n_layer": 48, "n_head": 25, "n_embd": 1600, "block_size": 1024}
GPT_BODY = {"model": GPT2_XL, "num_gpus": 8, "gpu_memory_gb": 80, "micro_batch_size": 4}
TARGET_S = 1e-3


def _timings(fn: Callable[[], object], *, repeat: int) -> list[float]:
    for _ in range(min(100, repeat)):  # warm caches and lazy imports
        fn()
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def _request_path(body: dict) -> Callable[[], str]:
    cluster = simulated_capacity(Settings())

    def run() -> str:
        request = PlanRequest.model_validate(body)
        return plan_public(make_plan(request, cluster=cluster, overhead_bytes=GB)).model_dump_json()

    return run


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _timed_once(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _traced_http_rows(client: httpx.Client, *, repeat: int) -> list[tuple[str, str, list[float]]]:
    def post(body: dict) -> Callable[[], None]:
        return lambda: client.post("/v1/plan", json=body, timeout=600).raise_for_status()

    first = _timed_once(post(TRACED_BODY | {"micro_batch_size": 1}))
    # a new digest each (micro-batch 2, 3, ...): a trace on the warm worker, never the cache
    cold = [_timed_once(post(TRACED_BODY | {"micro_batch_size": m})) for m in range(2, 7)]
    deep = [_timed_once(post(TRACED_BODY | {"model": DEEP, "micro_batch_size": m})) for m in range(1, 4)]
    cached = _timings(post(TRACED_BODY), repeat=repeat)
    return [
        ("HTTP traced: first request", "GPT-2 small, b 1", [first]),
        ("HTTP traced: cold (new digest)", "GPT-2 small, b 2..6", cold),
        ("HTTP traced: cold (new digest)", "32 layers 6.6e9, b 1..3", deep),
        ("HTTP traced: cached", "GPT-2 small, b 4", cached),
    ]


def _traced_in_process_rows() -> list[tuple[str, str, list[float]]]:
    from workers.models.builtin import trace_builtin

    rows = []
    for label, model in (("GPT-2 small, b 4", GPT2_SMALL), ("32 layers 6.6e9, b 1", DEEP)):
        spec = GPTSpec(**{k: v for k, v in model.items() if k != "kind"})
        batch = 4 if model is GPT2_SMALL else 1
        trace_builtin(spec, precision="bf16", micro_batch_size=batch)  # torch's first-call costs
        times = [_timed_once(lambda: trace_builtin(spec, precision="bf16", micro_batch_size=batch)) for _ in range(5)]
        rows.append(("trace in process", label, times))
    return rows


def _http_rows(*, repeat: int) -> tuple[list[tuple[str, str, list[float]]], list[tuple[str, str, list[float]]]]:
    port = _free_port()
    zero1 = str(Path(sys.executable).with_name("zero1"))
    scratch = tempfile.mkdtemp(prefix="zero1-bench-")
    env = {
        **os.environ,
        "ZERO1_DATABASE_URL": f"sqlite:///{scratch}/zero1.db",
        "ZERO1_CHECKPOINT_URI": f"{scratch}/checkpoints",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    }
    server = subprocess.Popen(
        [zero1, "serve", "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            deadline = time.monotonic() + 120  # the service starts its embedded Ray first
            while True:
                try:
                    client.get("/healthz")
                    break
                except httpx.TransportError:
                    if time.monotonic() > deadline or server.poll() is not None:
                        raise SystemExit("zero1 serve did not start") from None
                    time.sleep(0.1)
            rows = []
            for label, body in (("Ψ = 7.5e9, N = 64", SEED_BODY), ("GPT-2 XL, N = 8", GPT_BODY)):

                def post(body=body):
                    response = client.post("/v1/plan", json=body)
                    response.raise_for_status()

                rows.append(("HTTP POST /v1/plan", label, _timings(post, repeat=repeat)))
            return rows, _traced_http_rows(client, repeat=repeat)
    finally:
        server.terminate()
        server.wait(timeout=60)
        shutil.rmtree(scratch, ignore_errors=True)


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} µs" if seconds < 1e-3 else f"{seconds * 1e3:,.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2000, help="timed calls per row (in-process)")
    parser.add_argument("--http-repeat", type=int, default=500, help="timed requests per row (HTTP)")
    args = parser.parse_args()

    seed = Workload.from_num_params(7_500_000_000)
    gpt = Workload.from_model(GPTSpec(**{k: v for k, v in GPT2_XL.items() if k != "kind"}), micro_batch_size=4)
    rows = [
        (
            "memory.plan (in-process)",
            "Ψ = 7.5e9, N = 64",
            _timings(lambda: plan(seed, num_gpus=64, gpu_memory_bytes=80 * GB), repeat=args.repeat),
        ),
        (
            "memory.plan (in-process)",
            "GPT-2 XL, N = 8",
            _timings(lambda: plan(gpt, num_gpus=8, gpu_memory_bytes=80 * GB), repeat=args.repeat),
        ),
        ("API request path (in-process)", "Ψ = 7.5e9, N = 64", _timings(_request_path(SEED_BODY), repeat=args.repeat)),
        ("API request path (in-process)", "GPT-2 XL, N = 8", _timings(_request_path(GPT_BODY), repeat=args.repeat)),
    ]
    http, traced_http = _http_rows(repeat=args.http_repeat)
    rows += http
    header = (
        f"{'path':<32}{'plan (with sweep N=1..1024)':<26}{'calls':>7}{'p50':>12}{'p99':>12}{'plans/s':>10}"
        "  target < 1 ms in-process"
    )
    print(header)
    print("-" * len(header))
    for path, label, times in rows:
        times.sort()
        p50 = statistics.median(times)
        p99 = times[int(0.99 * (len(times) - 1))]
        verdict = ("met (p99)" if p99 < TARGET_S else "MISSED (p99)") if "in-process" in path else "-"
        print(
            f"{path:<32}{label:<26}{len(times):>7}{_fmt_s(p50):>12}{_fmt_s(p99):>12}"
            f"{len(times) / sum(times):>10,.0f}  {verdict}"
        )
    print()
    _print_traced([*_traced_in_process_rows(), *traced_http])
    print()
    _print_trace_vs_plan()


def _print_traced(rows: list[tuple[str, str, list[float]]]) -> None:
    header = f"{'traced plan':<34}{'model, micro-batch':<26}{'calls':>7}{'p50':>12}{'max':>12}"
    print(header)
    print("-" * len(header))
    for path, label, times in rows:
        print(f"{path:<34}{label:<26}{len(times):>7}{_fmt_s(statistics.median(times)):>12}{_fmt_s(max(times)):>12}")


def _memtracker_peak(spec: GPTSpec, *, micro_batch_size: int, checkpointing: bool) -> int:
    """ACT + TEMP at MemTracker's peak for one bf16 micro-batch of the built-in GPT at seq block_size."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from workers.models.builtin import GPT
    from workers.models.trace import materialize

    with torch.device("meta"):
        model = GPT(spec, activation_checkpointing=checkpointing).to(torch.bfloat16)
    with FakeTensorMode(allow_non_fake_inputs=True):
        materialize(model)
        idx = torch.zeros(micro_batch_size, spec.block_size, dtype=torch.long)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            model(idx, idx).backward()
        (peak,) = tracker.get_tracker_snapshot("peak").values()
    return sum(nbytes for kind, nbytes in peak.items() if kind != "Total" and kind.name in ("ACT", "TEMP"))


def _print_trace_vs_plan() -> None:
    from workers.models.builtin import trace_builtin

    spec = GPTSpec(**{k: v for k, v in GPT2_SMALL.items() if k != "kind"})
    header = (
        f"{'GPT-2 small, bf16, seq 1024':<30}{'plan act':>11}{'plan temp':>11}{'plan sum':>11}"
        f"{'trace act':>11}{'trace temp':>11}{'trace sum':>11}{'MemTracker':>12}{'plan/MT':>9}"
    )
    print(header + "   (MB = 1e6 bytes)")
    print("-" * len(header))
    for checkpointing in (False, True):
        for batch in (1, 4):
            step = {"micro_batch_size": batch, "seq_len": 1024, "bytes_per_element": 2, "checkpointing": checkpointing}
            act = spec.activation_bytes(**step)
            temp = spec.temporaries_bytes(**step)
            traced = trace_builtin(
                spec, precision="bf16", micro_batch_size=batch, activation_checkpointing=checkpointing
            )
            tracked = _memtracker_peak(spec, micro_batch_size=batch, checkpointing=checkpointing)
            label = f"b {batch}, {'checkpointing' if checkpointing else 'no checkpointing'}"
            mb = [
                x / 1e6
                for x in (act, temp, act + temp, traced.memory.activations_bytes, traced.memory.temporaries_bytes)
            ]
            print(
                f"{label:<30}"
                + "".join(f"{x:>11,.1f}" for x in mb)
                + f"{traced.memory.peak_bytes / 1e6:>11,.1f}{tracked / 1e6:>12,.1f}{(act + temp) / tracked:>9.3f}"
            )


if __name__ == "__main__":
    main()

"""Planner speed: a plan with its sweep, in-process and through the HTTP API.

    .venv/bin/python benchmarks/planner.py        (make bench runs every benchmark)

Prints one table: per-plan latency (p50, p99) and throughput for the memory
model alone, the API's request path in-process (validation, plan, JSON), and
POST /v1/plan over HTTP to a `zero1 serve` on loopback (one keep-alive client,
sequential requests). The target is a plan with sweep in under 1 ms in-process.
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

from service.cluster import simulated_capacity
from service.config import Settings
from service.planning import make_plan, plan_public
from service.schemas import PlanRequest
from workers.memory import GB, GPTSpec, Workload, plan

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


def _http_rows(*, repeat: int) -> list[tuple[str, str, list[float]]]:
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
            return rows
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
        *_http_rows(repeat=args.http_repeat),
    ]
    header = (
        f"{'path':<32}{'plan (with sweep N=1..1024)':<26}{'calls':>7}{'p50':>12}{'p99':>12}{'plans/s':>10}"
        "  target < 1 ms in-process"
    )
    print(header)
    print("-" * len(header))
    for path, label, times in rows:
        times.sort()
        p50, p99 = statistics.median(times), times[int(0.99 * (len(times) - 1))]
        verdict = ("met (p99)" if p99 < TARGET_S else "MISSED (p99)") if "in-process" in path else "-"
        print(
            f"{path:<32}{label:<26}{len(times):>7}{_fmt_s(p50):>12}{_fmt_s(p99):>12}"
            f"{len(times) / sum(times):>10,.0f}  {verdict}"
        )


if __name__ == "__main__":
    main()

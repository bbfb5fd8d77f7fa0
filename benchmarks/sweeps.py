"""One search run twice: the full grid, and the same grid with ASHA early stopping.

    .venv/bin/python benchmarks/sweeps.py   # --steps 500 --rungs 50,150 --eta 3

The service runs in this process (create_app, the scheduler ticking) on an embedded Ray with 4
logical GPUs, warmed by a 2-step job first. The search: a small GPT's (4 layers, 128 wide, 1.1M
parameters) optimizer.lr over --lrs (two of them, 1e-5 and 1e-6 by
default, clearly too small to train in --steps steps), one GPU a trial, two trials at a time, the
metric the last eval loss. The sweep runs once without early stopping and once with
`{"kind": "asha", "rungs": [...], "eta": 3}`; for each, one table row: the GPU-seconds its trials
held (GET /v1/sweeps/{id}'s gpu_seconds: GPUs x seconds from each start to each end), the wall
time, the trials that ended stopped_early, and the best trial found with its metric. Writes
benchmarks/results/sweeps.json. A CPU run here: gloo over logical GPUs, fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # the embedded Ray on loopback

HERE = Path(__file__).resolve().parent
MODEL = {"kind": "gpt", "vocab_size": 256, "n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64}
OPTIMIZER = {"lr": 0.003, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0, "max_grad_norm": 1.0}


def wait(read: Callable[[], Any], until: Callable[[Any], bool], *, what: str, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while not until(value := read()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:g} s for {what}; last: {value}")
        time.sleep(0.2)
    return value


def search(args: argparse.Namespace, *, asha: bool) -> dict[str, Any]:
    base = {
        "model": MODEL,
        "num_gpus": 1,
        "precision": "fp32",
        "optimizer": OPTIMIZER,
        "steps": args.steps,
        "micro_batch_size": 4,
        "eval_every": args.eval_every,
        "seed": 7,
    }
    body = {
        "name": "asha" if asha else "grid",
        "base": base,
        "space": {"optimizer.lr": args.lrs},
        "max_concurrent": args.concurrent,
    }
    if asha:
        body["early_stopping"] = {"kind": "asha", "rungs": args.rungs, "eta": args.eta}
    return body


def run(args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    from fastapi.testclient import TestClient

    from service.main import create_app
    from service.settings import Settings

    settings = Settings(
        database_url=f"sqlite:///{root / 'zero1.db'}",
        checkpoint_uri=str(root / "checkpoints"),
        simulated_gpus=4,
        cpus_per_worker=0.5,
        scheduler_interval_s=0.05,
    )
    rows = []
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        warm = search(args, asha=False)["base"] | {"name": "warm-up", "steps": 2, "eval_every": 0}
        job = client.post("/v1/jobs", json=warm).json()["id"]  # Ray's first workers, paid before either search
        wait(
            lambda: client.get(f"/v1/jobs/{job}").json()["status"],
            lambda s: s == "succeeded",
            what="warm-up",
            timeout_s=300,
        )
        for asha in (False, True):
            created = client.post("/v1/sweeps", json=search(args, asha=asha))
            assert created.status_code == 201, created.text
            url = f"/v1/sweeps/{created.json()['id']}"
            started = time.monotonic()
            sweep = wait(
                lambda url=url: client.get(url).json(),
                lambda s: s["status"] != "running",
                what=f"sweep {url}",
                timeout_s=args.timeout,
            )
            best = sweep["best"]
            rows.append(
                {
                    "search": "ASHA" if asha else "grid",
                    "status": sweep["status"],
                    "gpu_seconds": sweep["gpu_seconds"],
                    "wall_s": round(time.monotonic() - started, 1),
                    "stopped_early": [
                        t["values"]["optimizer.lr"] for t in sweep["trials"] if t["status"] == "stopped_early"
                    ],
                    "steps_done": sum(t["steps_done"] for t in sweep["trials"]),
                    "best_lr": None if best is None else best["values"]["optimizer.lr"],
                    "best_metric": None if best is None else best["metric"],
                    "trials": [
                        {k: t[k] for k in ("values", "status", "steps_done", "metric", "rungs")}
                        for t in sweep["trials"]
                    ],
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument(
        "--lrs", type=lambda s: [float(v) for v in s.split(",")], default=[0.01, 0.003, 0.001, 1e-5, 1e-6]
    )
    parser.add_argument("--rungs", type=lambda s: [int(v) for v in s.split(",")], default=[50, 150])
    parser.add_argument("--eta", type=int, default=3)
    parser.add_argument("--concurrent", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="zero1-bench-sweeps-") as tmp:
        rows = run(args, Path(tmp))
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, no GPU (gloo over logical GPUs)",
        "command": "benchmarks/sweeps.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "rows": rows,
    }
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "sweeps.json").write_text(json.dumps(result, indent=1) + "\n")
    lrs = ", ".join(f"{lr:g}" for lr in args.lrs)
    print(f"{len(args.lrs)} trials (optimizer.lr in {lrs}), {args.steps} steps each, {args.concurrent} at a time")
    print(f"ASHA: rungs {args.rungs}, eta {args.eta}; metric: last eval_loss")
    header = ("search", "GPU-s", "wall s", "steps", "stopped early (lr)", "best lr", "best eval_loss")
    print("{:<6}  {:>7}  {:>7}  {:>6}  {:<20}  {:>8}  {:>14}".format(*header))
    for row in rows:
        stopped = ", ".join(f"{lr:g}" for lr in row["stopped_early"]) or "-"
        best_lr = "-" if row["best_lr"] is None else f"{row['best_lr']:g}"
        metric = "-" if row["best_metric"] is None else f"{row['best_metric']:.4f}"
        print(
            f"{row['search']:<6}  {row['gpu_seconds']:>7.1f}  {row['wall_s']:>7.1f}  {row['steps_done']:>6}  "
            f"{stopped:<20}  {best_lr:>8}  {metric:>14}"
        )
    grid, asha = rows
    saved = 1 - asha["gpu_seconds"] / grid["gpu_seconds"]
    same = "the same" if grid["best_lr"] == asha["best_lr"] else "a different"
    print(f"ASHA spent {saved:.0%} fewer GPU-seconds and found {same} best trial.")


if __name__ == "__main__":
    main()

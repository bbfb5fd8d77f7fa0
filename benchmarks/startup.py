"""How long a tiny job waits before it trains: submit -> first metric row, and -> succeeded.

    .venv/bin/python benchmarks/startup.py --before REF [--jobs N]

The README's tiny-gpt (examples/tiny-gpt.json: 2 ranks, synthetic data, fp32, 300 steps), submitted
over HTTP to `zero1 serve` (embedded Ray, ZERO1_SCHEDULER_INTERVAL_S=0.05), one job after another;
the first metric row is the first GET /v1/jobs/{id}/metrics (polled every 20 ms) that has one.
Side by side, from one run, on this machine:

- `before`: the tree of git ref REF (the commit before a change), checked out with `git worktree`
  into a scratch directory and run with this venv (PYTHONPATH puts its `service` and `workers`
  first, for the server and for every Ray worker it starts);
- `this tree`: the working tree;
- `this tree, ZERO1_RUN_AS`: the same with the ranks' children under uid 65534. Where that uid cannot
  search a directory above the interpreter (a Python under /root, 0700), the benchmark grants o+x
  on it for the run and gives the mode back after, saying so.

Each server's first job is a warm-up, not counted (its Ray starts its worker pool). Prints medians,
minimums and maximums over --jobs jobs per column, then where the time goes, phase by phase, from
the same jobs: the job's events (`starting`, `running`: the server's clock, at the scheduler tick
that saw each) and its ranks' log lines (the time each rank wrote them), read through the API.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
JOB = json.loads((ROOT / "examples" / "tiny-gpt.json").read_text())
ZERO1 = str(Path(sys.executable).with_name("zero1"))


@contextmanager
def serve(tree: Path, scratch: Path, **env: str) -> Iterator[httpx.Client]:
    """`zero1 serve` running `tree`'s code, its state in `scratch`."""
    port = _free_port()
    clean = {key: value for key, value in os.environ.items() if not key.startswith("ZERO1_")}
    environment = {
        **clean,
        "PYTHONPATH": str(tree),
        "ZERO1_DATABASE_URL": f"sqlite:///{scratch}/zero1.db",
        "ZERO1_CHECKPOINT_URI": f"{scratch}/checkpoints",
        "ZERO1_SCHEDULER_INTERVAL_S": "0.05",
        "ZERO1_CPUS_PER_WORKER": "0.5",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_TMPDIR": tempfile.mkdtemp(prefix="z1b-"),
        **env,
    }
    log = open(scratch / "serve.log", "wb")  # noqa: SIM115 - open for the server's life
    server = subprocess.Popen([ZERO1, "serve", "--port", str(port)], cwd=tree, env=environment, stdout=log, stderr=log)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            deadline = time.monotonic() + 180
            while True:
                try:
                    if client.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit(f"zero1 serve did not start: {(scratch / 'serve.log').read_text()[-2000:]}")
                time.sleep(0.1)
            yield client
    finally:
        server.terminate()
        server.wait(timeout=120)
        log.close()
        shutil.rmtree(environment["RAY_TMPDIR"], ignore_errors=True)


PHASES = {
    "starting": "submit -> `starting` (the scheduler takes the job)",
    "running": "-> `running` (supervisor, placement, rank actors, children import torch, rendezvous)",
    "built": "-> every rank's model built (process group joined, data and model made)",
    "stepped": "-> step 0's log line (the first step)",
    "first_row": "-> first metric row through the API (relay, supervisor, scheduler poll, database)",
    "succeeded": "-> `succeeded` (steps 1-299, checkpoints, final/)",
}
"""Each phase ends at its key's moment and starts at the one before it (the first at the submit)."""


def one_job(client: httpx.Client) -> dict[str, float]:
    """Seconds from the submit to each moment of PHASES, of one tiny job."""
    start = time.monotonic()
    submitted_at = time.time()
    response = client.post("/v1/jobs", json=JOB)
    response.raise_for_status()
    job_id = response.json()["id"]
    first_row = None
    while True:
        if first_row is None and client.get(f"/v1/jobs/{job_id}/metrics", params={"limit": 1}).json()["data"]:
            first_row = time.monotonic() - start
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            if job["status"] != "succeeded":
                raise SystemExit(f"job {job_id} ended {job['status']}: {job['error']}")
            done = time.monotonic() - start
            return {
                **_moments(client, job_id, since=submitted_at),
                "first_row": first_row if first_row is not None else done,
                "succeeded": done,
            }
        time.sleep(0.02)


def _moments(client: httpx.Client, job_id: int, *, since: float) -> dict[str, float]:
    """Seconds after `since` (the submit) of the job's first `starting` and `running` events, of the
    last rank's model built (its "N parameters" line) and of rank 0's step 0 line."""
    events = client.get(f"/v1/jobs/{job_id}/events").json()["data"]
    lines = client.get(f"/v1/jobs/{job_id}/logs", params={"limit": 100}).json()["data"]
    moments = {}
    for status in ("starting", "running"):
        moments[status] = min(_at(e["at"]) for e in events if e["to_status"] == status) - since
    last = JOB["steps"] - 1
    built = [_at(line["time"]) for line in lines if line["line"].endswith(f"parameters, steps 0 to {last}")]
    moments["built"] = max(built) - since
    moments["stepped"] = min(_at(line["time"]) for line in lines if f"step 0/{last} " in line["line"]) - since
    return moments


def _at(stamp: str) -> float:
    moment = datetime.fromisoformat(stamp)
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def measure(tree: Path, *, jobs: int, **env: str) -> list[dict[str, float]]:
    scratch = Path(tempfile.mkdtemp(prefix="zero1-bench-"))
    try:
        with serve(tree, scratch, **env) as client:
            try:
                one_job(client)  # warm-up
                return [one_job(client) for _ in range(jobs)]
            except SystemExit:  # a job that failed: the server's log says why
                print((scratch / "serve.log").read_text()[-6000:], file=sys.stderr)
                raise
    finally:
        subprocess.run(["rm", "-rf", str(scratch)], check=False)


@contextmanager
def worktree(ref: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="zero1-before-")) / "tree"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), ref], check=True, capture_output=True
    )
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False)


@contextmanager
def searchable_interpreter() -> Iterator[list[Path]]:
    """o+x on each directory above the interpreter that others cannot search, for the run."""
    blocked = [d for d in Path(os.path.realpath(sys.executable)).parents if not d.stat().st_mode & stat.S_IXOTH]
    modes = {d: d.stat().st_mode for d in blocked}
    for directory, mode in modes.items():
        os.chmod(directory, mode | stat.S_IXOTH)
    try:
        yield blocked
    finally:
        for directory, mode in modes.items():
            os.chmod(directory, stat.S_IMODE(mode))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="git ref of the tree to compare with")
    parser.add_argument("--jobs", type=int, default=5, help="jobs measured per column (after one warm-up)")
    args = parser.parse_args()
    columns: dict[str, list[dict[str, float]]] = {}
    with worktree(args.before) as before:
        columns[f"before ({args.before})"] = measure(before, jobs=args.jobs)
    columns["this tree"] = measure(ROOT, jobs=args.jobs)
    with searchable_interpreter() as granted:
        if granted:
            print(f"(o+x granted on {', '.join(map(str, granted))} for the ZERO1_RUN_AS column)", file=sys.stderr)
        columns["this tree, ZERO1_RUN_AS"] = measure(ROOT, jobs=args.jobs, ZERO1_RUN_AS="*=65534-65534")
    print(
        f"examples/tiny-gpt.json (2 ranks, 300 steps); median (min-max) of {args.jobs} jobs each, after one warm-up\n"
    )
    _table("from submit to", {"first metric row": "first_row", "`succeeded`": "succeeded"}, columns, lambda r, k: r[k])
    print("\nWhere the time goes, phase by phase (each from the end of the one above):\n")
    keys = list(PHASES)
    rows = {PHASES[k]: k for k in keys}
    _table("phase", rows, columns, lambda r, k: r[k] - (r[keys[keys.index(k) - 1]] if keys.index(k) else 0.0))


def _table(
    title: str, rows: dict[str, str], columns: dict[str, list[dict[str, float]]], value: Callable[..., float]
) -> None:
    """A markdown table: a row per (label, key), a column per tree, value(run, key) of each run."""
    print(f"| {title} | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for label, key in rows.items():
        print(f"| {label} | " + " | ".join(_cell([value(r, key) for r in runs]) for runs in columns.values()) + " |")


if __name__ == "__main__":
    main()

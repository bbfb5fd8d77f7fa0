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
minimums and maximums over --jobs jobs per column.
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
from collections.abc import Iterator
from contextlib import contextmanager
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
        "RAY_TMPDIR": tempfile.mkdtemp(prefix="zero1-bench-ray-"),
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


def one_job(client: httpx.Client) -> tuple[float, float]:
    """(seconds to the first metric row, seconds to succeeded) of one tiny job."""
    start = time.monotonic()
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
            return first_row if first_row is not None else time.monotonic() - start, time.monotonic() - start
        time.sleep(0.02)


def measure(tree: Path, *, jobs: int, **env: str) -> list[tuple[float, float]]:
    scratch = Path(tempfile.mkdtemp(prefix="zero1-bench-"))
    try:
        with serve(tree, scratch, **env) as client:
            one_job(client)  # warm-up
            return [one_job(client) for _ in range(jobs)]
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
    columns: dict[str, list[tuple[float, float]]] = {}
    with worktree(args.before) as before:
        columns[f"before ({args.before})"] = measure(before, jobs=args.jobs)
    columns["this tree"] = measure(ROOT, jobs=args.jobs)
    with searchable_interpreter() as granted:
        if granted:
            print(f"(o+x granted on {', '.join(map(str, granted))} for the ZERO1_RUN_AS column)", file=sys.stderr)
        columns["this tree, ZERO1_RUN_AS"] = measure(ROOT, jobs=args.jobs, ZERO1_RUN_AS="*=65534:65534")
    names = list(columns)
    print(
        f"examples/tiny-gpt.json (2 ranks, 300 steps); median (min-max) of {args.jobs} jobs each, after one warm-up\n"
    )
    print("| from submit to | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    print("| first metric row | " + " | ".join(_cell([r[0] for r in columns[n]]) for n in names) + " |")
    print("| `succeeded` | " + " | ".join(_cell([r[1] for r in columns[n]]) for n in names) + " |")


if __name__ == "__main__":
    main()

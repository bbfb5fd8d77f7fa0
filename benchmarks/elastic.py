"""An elastic job's loss curve beside an unresized run's: the same job, resized 2 -> 4 -> 2.

    .venv/bin/python benchmarks/elastic.py   # --steps 80 --every 8

The service runs in this process (create_app, the scheduler ticking) on an embedded Ray with 4
logical GPUs, and drives the scenario of tests/test_elastic.py:

1. the job unresized, on 4 GPUs, to the end (the reference);
2. a blocker holds 2 GPUs; the job, elastic (min_gpus 2, num_gpus 4), starts on the other 2;
3. the blocker is cancelled: the job grows to 4 at its next checkpoint;
4. a second blocker is queued and a rank of the job is killed: its retry resumes on 2, leaving
   the blocker the other 2, and the job runs to the end on 2.

Prints the world size of each stretch of steps and the largest difference between the two loss
curves; writes benchmarks/results/elastic.json and benchmarks/elastic.png (the two curves, and N
by step). A CPU run here: gloo over logical GPUs, a tiny GPT in fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # the embedded Ray on loopback

HERE = Path(__file__).resolve().parent
TINY = {"kind": "gpt", "vocab_size": 64, "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}
OPTIMIZER = {"lr": 0.003, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.0, "max_grad_norm": 1.0}
TERMINAL = ("succeeded", "failed", "cancelled")


def wait(read: Callable[[], Any], until: Callable[[Any], bool], *, what: str, timeout_s: float = 300) -> Any:
    deadline = time.monotonic() + timeout_s
    while not until(value := read()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:g} s for {what}; last: {value}")
        time.sleep(0.1)
    return value


def run(steps: int, every: int, root: Path) -> dict[str, Any]:
    import ray
    from fastapi.testclient import TestClient

    from service.main import create_app
    from service.scheduling.ray_launcher import supervisor_name
    from service.settings import Settings

    settings = Settings(
        database_url=f"sqlite:///{root / 'zero1.db'}",
        checkpoint_uri=str(root / "checkpoints"),
        simulated_gpus=4,
        cpus_per_worker=0.5,
        scheduler_interval_s=0.05,
        elastic_grow_interval_s=0,
    )
    body = {
        "model": TINY,
        "num_gpus": 4,
        "precision": "fp32",
        "optimizer": OPTIMIZER,
        "steps": steps,
        "micro_batch_size": 2,
        "checkpoint_every": every,
        "max_retries": 2,
        "seed": 7,
    }
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        job = lambda job_id: client.get(f"/v1/jobs/{job_id}").json()
        submit = lambda name, **more: client.post("/v1/jobs", json={**body, "name": name, **more}).json()["id"]
        curve = lambda job_id: client.get(f"/v1/jobs/{job_id}/metrics", params={"limit": 10_000}).json()["data"]
        blocker = {"num_gpus": 2, "steps": 1_000_000, "checkpoint_every": 0, "max_retries": 0}

        reference = submit("unresized")
        wait(lambda: job(reference), lambda j: j["status"] in TERMINAL, what="the unresized run")
        first = submit("blocker", **blocker)
        wait(lambda: job(first), lambda j: j["status"] == "running", what="the blocker")
        elastic = submit("elastic", min_gpus=2)
        wait(lambda: job(elastic), lambda j: (j["step"] or -1) >= 3, what="the elastic job on 2")
        client.post(f"/v1/jobs/{first}/cancel")
        grown = wait(lambda: job(elastic), lambda j: j["world_size"] == 4 and j["status"] == "running", what="4")
        second = submit("blocker-again", **blocker)
        step_at_4 = grown["step"] or 0
        wait(lambda: job(elastic), lambda j: (j["step"] or 0) >= step_at_4 + 2 * every, what="a checkpoint at 4")
        actor = ray.get_actor(supervisor_name(elastic, grown["attempt"]), namespace=settings.ray_namespace)
        ray.kill(ray.get(actor.worker.remote(3)), no_restart=True)
        done = wait(lambda: job(elastic), lambda j: j["status"] in TERMINAL, what="the elastic job's end")
        client.post(f"/v1/jobs/{second}/cancel")
        events = client.get(f"/v1/jobs/{elastic}/events").json()["data"]
        return {
            "steps": steps,
            "checkpoint_every": every,
            "status": done["status"],
            "reference": [[m["step"], m["loss"]] for m in curve(reference)],
            "elastic": [[m["step"], m["loss"], m["world_size"]] for m in curve(elastic)],
            "events": [f"{e['to_status']}: {e['reason']}" for e in events],
        }


def stretches(rows: list[list]) -> list[tuple[int, int, int]]:
    """(first step, last step, N) of each run of steps at one world size."""
    out: list[tuple[int, int, int]] = []
    for step, _, n in rows:
        if out and out[-1][2] == n:
            out[-1] = (out[-1][0], step, n)
        else:
            out.append((step, step, n))
    return out


def draw(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, n_ax) = plt.subplots(2, 1, figsize=(7.5, 5.2), sharex=True, height_ratios=[3, 1])
    ref = result["reference"]
    ela = result["elastic"]
    loss_ax.plot(
        [s for s, _ in ref], [v for _, v in ref], lw=3, alpha=0.35, color="tab:blue", label="unresized, 4 GPUs"
    )
    loss_ax.plot([s for s, _, _ in ela], [v for _, v, _ in ela], lw=1, color="tab:red", label="elastic, 2 → 4 → 2")
    loss_ax.set_ylabel("training loss")
    loss_ax.legend(frameon=False)
    loss_ax.set_title(f"The same job, resized twice: largest loss difference {result['max_rel_diff']:.1e} (relative)")
    n_ax.step([s for s, _, _ in ela], [n for _, _, n in ela], where="post", color="tab:red")
    n_ax.set_ylabel("GPUs (N)")
    n_ax.set_yticks([2, 3, 4])
    n_ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--every", type=int, default=8, help="checkpoint_every")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="zero1-elastic-") as tmp:
        result = run(args.steps, args.every, Path(tmp))
    ref = {step: loss for step, loss in result["reference"]}
    result["max_rel_diff"] = max(abs(loss - ref[step]) / abs(ref[step]) for step, loss, _ in result["elastic"])
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "elastic.json").write_text(json.dumps(result, indent=1) + "\n")
    draw(result, HERE / "elastic.png")
    print(f"elastic job: {result['status']}, {len(result['elastic'])} steps stored once each")
    print(f"{'steps':>12}  {'N':>2}  {'loss (elastic)':>14}  {'loss (unresized)':>16}")
    for first, last, n in stretches(result["elastic"]):
        elastic_loss = next(v for s, v, _ in result["elastic"] if s == last)
        print(f"{first:>5} – {last:<4}  {n:>2}  {elastic_loss:>14.6f}  {ref[last]:>16.6f}")
    print(f"largest loss difference, step by step: {result['max_rel_diff']:.2e} (relative)")
    for line in result["events"]:
        print(f"  {line}")


if __name__ == "__main__":
    main()

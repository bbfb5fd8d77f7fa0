"""The commands that talk to a running API: `zero1 submit`, `jobs`, `status`, `watch`, `cancel` and
`download`, through an HTTP client that sends ZERO1_TOKEN. `jobs` and `watch` draw with rich on a
terminal and print plain text otherwise (service/cli/output.py)."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from service.cli.bundle import upload_chunks, zip_directory
from service.cli.output import STATUS_STYLES, terminal
from service.cli.plans import format_plan
from service.schemas.printable import MULTILINE, escape

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table


def _client(args: argparse.Namespace, *, timeout_s: float = 30):
    """An HTTP client of the API that sends ZERO1_TOKEN, when set, as its bearer token."""
    import httpx

    token = os.environ.get("ZERO1_TOKEN", "").strip()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=args.url, timeout=timeout_s, headers=headers)


SUBMIT_TIMEOUT_S = 600
"""A submit waits for the service's admission: a traced plan and a dataset tokenized at submit
(ZERO1_PLAN_TIMEOUT_S, ZERO1_DATA_TIMEOUT_S), each bounded by the service."""


def _api_error(response) -> int | None:
    """Print an API error the way a person reads it; its exit code, or None on success."""
    if response.is_success:
        return None
    response.read()  # a streamed response's body is not read yet
    try:
        body = response.json()
        message = body.get("message") or body
    except ValueError:
        message = response.text
    print(f"zero1: {response.status_code} {escape(str(message), keep=MULTILINE)}", file=sys.stderr)
    return 1


def cmd_submit(args: argparse.Namespace) -> int:
    try:
        body = json.loads(Path(args.spec).read_text())
    except (OSError, ValueError) as exc:
        print(f"zero1 submit: cannot read {args.spec}: {exc}", file=sys.stderr)
        return 2
    with _client(args, timeout_s=SUBMIT_TIMEOUT_S) as client:
        if args.code is not None:
            digest = _upload_code(client, Path(args.code))
            if digest is None:
                return 1
            body["code"] = digest
        if args.priority is not None:
            body["priority"] = args.priority
        response = client.post("/v1/jobs", json=body, params={"dry_run": str(args.dry_run).lower()})
    if response.status_code == 422 and response.json().get("error") == "does_not_fit":
        print(f"does not fit: {escape(response.json()['message'], keep=MULTILINE)}", file=sys.stderr)
        print(format_plan(response.json()["plan"]), file=sys.stderr)
        return 1
    if (code := _api_error(response)) is not None:
        return code
    body = response.json()
    print(format_plan(body["plan"]))
    if args.dry_run:
        print("\ndry run: the job fits and would be admitted")
    else:
        print(f"\njob {body['id']} {body['status']} (queue position {body['queue_position']})")
    return 0


def _upload_code(client, directory: Path) -> str | None:
    """DIR zipped and uploaded (POST /v1/code) with a progress bar on stderr: its digest, or None
    (the reason printed) when it cannot be."""
    if not directory.is_dir():
        print(f"zero1 submit: --code {directory}: not a directory", file=sys.stderr)
        return None
    data, files = zip_directory(directory)
    label = f"uploading {directory} ({files} files)"
    response = client.post(
        "/v1/code",
        content=upload_chunks(data, label=label),
        headers={"Content-Type": "application/zip", "Content-Length": str(len(data))},
    )
    if _api_error(response) is not None:
        return None
    code = response.json()["code"]
    print(f"code {code} ({'stored' if response.status_code == 201 else 'already stored'})", file=sys.stderr)
    return code


def _job_cells(job: dict) -> dict[str, str]:
    """A job's row of `zero1 jobs`, each column as text: the plain line and the table share them. The
    name is its submitter's: printed with its control characters escaped (service/schemas/printable.py)."""
    loss = (job.get("latest") or {}).get("loss")
    return {
        "id": str(job["id"]),
        "status": job["status"],
        "step": "-" if job["step"] is None else str(job["step"] + 1),
        "steps": str(job["steps"]),
        "gpus": _gpus(job),
        "loss": "-" if loss is None else f"{loss:.4f}",
        "name": escape(job["name"]),
    }


def _job_line(job: dict) -> str:
    cells = _job_cells(job)
    return (
        f"{cells['id']:>6}  {cells['status']:<10}  {cells['step']:>8}/{cells['steps']:<8}  {cells['gpus']:>5}  "
        f"{cells['loss']:>8}  {cells['name']}"
    )


def _gpus(job: dict) -> str:
    """The N it runs at; an elastic job's as N/most (2/4), its most before it starts."""
    num_gpus = job["num_gpus"]
    if job.get("min_gpus", num_gpus) == num_gpus:
        return str(num_gpus)
    return f"{job.get('world_size') or '-'}/{num_gpus}"


def cmd_jobs(args: argparse.Namespace) -> int:
    with _client(args) as client:
        response = client.get(
            "/v1/jobs", params={"limit": args.limit, **({"status": args.status} if args.status else {})}
        )
    if (code := _api_error(response)) is not None:
        return code
    jobs = response.json()["data"]
    if (console := terminal()) is not None:
        console.print(_jobs_table(jobs))
        return 0
    print(f"{'id':>6}  {'status':<10}  {'step':>8}/{'steps':<8}  {'gpus':>5}  {'loss':>8}  name")
    for job in jobs:
        print(_job_line(job))
    return 0


def _jobs_table(jobs: list[dict]) -> Table:
    """The jobs as a rich Table: the plain listing's columns, the status coloured. Cells are Text,
    never markup: a job's name is its submitter's."""
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in ("id", "status", "step", "gpus", "loss"):
        table.add_column(name, justify="left" if name == "status" else "right")
    table.add_column("name", overflow="fold")
    for job in jobs:
        cells = _job_cells(job)
        table.add_row(
            Text(cells["id"]),
            Text(cells["status"], style=STATUS_STYLES.get(job["status"], "")),
            Text(f"{cells['step']}/{cells['steps']}"),
            Text(cells["gpus"]),
            Text(cells["loss"]),
            Text(cells["name"]),
        )
    return table


def cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        response = client.get(f"/v1/jobs/{args.job_id}")
        if (code := _api_error(response)) is not None:
            return code
        events = client.get(f"/v1/jobs/{args.job_id}/events")
    job = response.json()
    print(json.dumps({k: v for k, v in job.items() if k not in ("spec", "plan")}, indent=2))
    if not events.is_success:  # another user's job: its events are its owner's and admins'
        return 0
    for event in events.json()["data"]:
        reason = escape(event["reason"], keep=MULTILINE)  # a user's code may have written it
        print(f"{event['at']}  {event['from_status'] or '-':>10} -> {event['to_status']:<10}  {reason}")
    return 0


def _watch_fields(job: dict, *, eval_loss: float | None) -> dict[str, str]:
    """The figures of the watch line as text: the plain line and the rich bar share them."""
    latest = job.get("latest") or {}
    loss, speed = latest.get("loss"), latest.get("tokens_per_s")
    return {
        "loss": "-" if loss is None else f"{loss:.4f}",
        "eval": "" if eval_loss is None else f"eval {eval_loss:.4f}",
        "tokens_per_s": "-" if speed is None else f"{speed:,.0f}",
        "status": job["status"],
    }


def _progress(job: dict, *, eval_loss: float | None = None, width: int = 30) -> str:
    """The watch line; eval_loss: the latest held-out loss seen (rows carry it only on steps that evaluate)."""
    done = 0 if job["step"] is None else job["step"] + 1
    filled = width * done // job["steps"]
    fields = _watch_fields(job, eval_loss=eval_loss)
    evaluated = f"{fields['eval']}  " if fields["eval"] else ""
    return (
        f"[{'#' * filled}{'.' * (width - filled)}] {done}/{job['steps']}  loss {fields['loss']}  "
        f"{evaluated}{fields['tokens_per_s']} tokens/s  {fields['status']}"
    )


@contextlib.contextmanager
def _watch_display(console: Console | None) -> Iterator[Callable[[dict, float | None], None]]:
    """draw(job, eval_loss): the watch line redrawn in place (`\\r`), or on a terminal (`console`) a
    rich bar of steps done with loss, eval loss, tokens/s and the status beside it."""
    if console is None:

        def draw(job: dict, eval_loss: float | None) -> None:
            print(f"\r{_progress(job, eval_loss=eval_loss)}", end="", flush=True)

        yield draw
        print()
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[losses]}"),
        TextColumn("{task.fields[tokens_per_s]} tokens/s"),
        TextColumn("[{task.fields[style]}]{task.fields[status]}"),
        console=console,
    )
    tasks = []  # the job's bar, added at the first draw: an unknown job draws none

    def draw(job: dict, eval_loss: float | None) -> None:
        done = 0 if job["step"] is None else job["step"] + 1
        fields = _watch_fields(job, eval_loss=eval_loss)
        losses = f"loss {fields['loss']}  {fields['eval']}".rstrip()
        fields |= {"losses": losses, "style": STATUS_STYLES.get(job["status"], "default")}
        if not tasks:
            tasks.append(bar.add_task(f"job {job['id']}", total=job["steps"], **fields))
        bar.update(tasks[0], completed=done, total=job["steps"], **fields)

    with bar:
        yield draw


def cmd_watch(args: argparse.Namespace) -> int:
    """A live progress bar until the job ends; exit 0 only if it succeeded."""
    import time

    seen_step, evaluated = None, {"step": -1, "eval_loss": None}
    with _client(args) as client, _watch_display(terminal()) as draw:
        while True:
            response = client.get(f"/v1/jobs/{args.job_id}")
            if (code := _api_error(response)) is not None:
                return code
            job = response.json()
            if job["step"] is not None and job["step"] != seen_step:
                seen_step = job["step"]
                evaluated = _latest_eval(client, args.job_id, after=evaluated)
            draw(job, evaluated["eval_loss"])
            if job["status"] in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(args.interval)
    if job["error"]:
        print(f"error: {escape(str(job['error']), keep=MULTILINE)}", file=sys.stderr)
    return 0 if job["status"] == "succeeded" else 1


def _latest_eval(client, job_id: int, *, after: dict) -> dict:
    """The newest row that evaluated since `after` (a row, or its step -1 and no eval_loss), else
    `after`: rows carry eval_loss only on the steps that evaluate, which a poll may not land on."""
    response = client.get(
        f"/v1/jobs/{job_id}/metrics", params={"evaluated": "true", "after_step": after["step"], "limit": 10_000}
    )
    rows = response.json()["data"] if response.is_success else []  # another's job: its metrics are not ours
    return rows[-1] if rows else after


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        response = client.post(f"/v1/jobs/{args.job_id}/cancel")
    if (code := _api_error(response)) is not None:
        return code
    print(f"job {args.job_id}: cancel requested ({response.json()['status']})")
    return 0


def cmd_download(args: argparse.Namespace) -> int:
    """Every file of the job's final model into DIR, streamed to a temporary name, its sha256 checked
    against the listing before it takes its own name; a line per file. Exit 1 at the first mismatch."""
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    with _client(args) as client:
        listing = client.get(f"/v1/jobs/{args.job_id}/artifacts")
        if (code := _api_error(listing)) is not None:
            return code
        files = listing.json()["data"]
        if not files:
            print(f"zero1 download: job {args.job_id} has no artifacts", file=sys.stderr)
            return 1
        for entry in files:
            name = Path(entry["name"]).name  # a file name, never a path out of DIR
            shown = escape(name)
            part = directory / f".{name}.part"
            digest, size = hashlib.sha256(), 0
            with client.stream("GET", f"/v1/jobs/{args.job_id}/artifacts/{name}") as response:
                if (code := _api_error(response)) is not None:
                    return code
                with open(part, "wb") as file:
                    for chunk in response.iter_bytes(1 << 20):
                        digest.update(chunk)
                        size += len(chunk)
                        file.write(chunk)
            if digest.hexdigest() != entry["sha256"] or size != entry["bytes"]:
                part.unlink()
                print(
                    f"zero1 download: {shown}: sha256 mismatch ({size:,} bytes, sha256 {digest.hexdigest()}; "
                    f"listed {entry['bytes']:,} bytes, sha256 {entry['sha256']})",
                    file=sys.stderr,
                )
                return 1
            part.replace(directory / name)
            print(f"{shown}  {size:,} bytes  sha256 ok {entry['sha256'][:16]}")
    return 0

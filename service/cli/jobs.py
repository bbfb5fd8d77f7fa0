"""The commands that talk to a running API: `zero1 submit`, `jobs`, `status`, `watch`, `cancel` and
`download`, through the Python client (`zero1.Client`, service/client/), which sends ZERO1_TOKEN.
`jobs` and `watch` draw with rich on a terminal and print plain text otherwise
(service/client/output.py). An API error is the client's ApiError, printed by main()."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from service.cli.plans import format_plan
from service.schemas.printable import MULTILINE, escape
from zero1 import ApiError, Client, Job
from zero1.output import STATUS_STYLES, terminal

if TYPE_CHECKING:
    from rich.table import Table


def _client(args: argparse.Namespace, *, timeout_s: float = 30) -> Client:
    """The API's client at --url (ZERO1_URL), sending ZERO1_TOKEN, when set, as its bearer token."""
    return Client(args.url, timeout_s=timeout_s)


def print_api_error(error: ApiError) -> int:
    """An API error the way a person reads it; the exit code, 1."""
    print(f"zero1: {error.status} {escape(error.message, keep=MULTILINE)}", file=sys.stderr)
    return 1


def _read_json(path: str, *, command: str) -> dict | None:
    """The JSON file a command was given, or None with why on stderr."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        print(f"zero1 {command}: cannot read {path}: {exc}", file=sys.stderr)
        return None


def cmd_submit(args: argparse.Namespace) -> int:
    if (body := _read_json(args.spec, command="submit")) is None:
        return 2
    code = args.code
    if code is not None and not Path(code).is_dir():
        print(f"zero1 submit: --code {code}: not a directory", file=sys.stderr)
        return 1
    with _client(args) as client:
        try:
            if code is not None:
                bundle = client.upload_code(code, progress=True)
                state = "stored" if bundle.created else "already stored"
                print(f"code {bundle.code} ({state})", file=sys.stderr)
                code = bundle.code
            answer = client.submit(
                body,
                code=code,
                dry_run=args.dry_run,
                priority=args.priority,
                tags=args.tag,
                notes=args.notes,
                depends_on=args.depends_on,
            )
        except ApiError as error:
            if error.status == 422 and error.error == "does_not_fit":  # the answer, as a fit's plan is: to stdout
                print(f"does not fit: {escape(error.message, keep=MULTILINE)}")
                print(format_plan(error.body["plan"]))
                return 1
            raise
    print(format_plan(answer.plan.model_dump(mode="json") if args.dry_run else answer.info.plan))
    if args.dry_run:
        print("\ndry run: the job fits and would be admitted")
    else:
        print(f"\njob {answer.id} {answer.status} (queue position {answer.info.queue_position})")
    return 0


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
        "name": escape(job["name"]) + (f"  [{', '.join(job['tags'])}]" if job.get("tags") else ""),
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
        listed = client.jobs(status=args.status, limit=args.limit, tag=args.tag)
        jobs = [job.info.model_dump(mode="json") for job in listed]
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
        job = client.job(args.job_id)
        try:
            events = job.events()
        except ApiError:  # another user's job: its events are its owner's and admins'
            events = []
    shown = job.info.model_dump(mode="json", exclude={"spec", "plan", "step"})  # steps_done beside steps: counts
    print(json.dumps(shown, indent=2))
    for event in events:
        reason = escape(event.reason, keep=MULTILINE)  # a user's code may have written it
        at = event.model_dump(mode="json")["at"]
        print(f"{at}  {event.from_status or '-':>10} -> {event.to_status:<10}  {reason}")
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    """A live progress bar until the job ends; exit 0 only if it succeeded."""
    with _client(args) as client:
        job = Job(client, args.job_id).wait(progress=True, interval=args.interval)
    if job.info.error:
        print(f"error: {escape(error_text(job.info.error), keep=MULTILINE)}", file=sys.stderr)
    return 0 if job.status == "succeeded" else 1


def error_text(error: dict) -> str:
    """A failed job's error as its event says it: where (the rank and node), then the exception and
    its message; the last lines of the traceback are `zero1 logs`'s and `status`'s."""
    where = f"rank {error['rank']} on node {error.get('node_id')}: " if error.get("rank") is not None else ""
    return f"{where}{error.get('exception', 'Error')}: {error.get('message', '')}"


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job = Job(client, args.job_id).cancel()
    print(f"job {args.job_id}: cancel requested ({job.status})")
    return 0


def cmd_download(args: argparse.Namespace) -> int:
    """Every file of the job's final model into DIR, or with --checkpoint STEP that checkpoint's shards
    and marker, streamed to a temporary name, its size (and a final file's sha256) checked against the
    listing before it takes its own name; a line per file. Exit 1 at the first mismatch."""

    def shown(path: Path, entry) -> None:
        checked = f"sha256 ok {entry.sha256[:16]}" if hasattr(entry, "sha256") else "size ok"
        print(f"{escape(path.name)}  {entry.bytes:,} bytes  {checked}")

    with _client(args) as client:
        job = Job(client, args.job_id)
        if args.checkpoint is None and not job.artifacts():
            print(f"zero1 download: job {args.job_id} has no artifacts", file=sys.stderr)
            return 1
        try:
            job.download(args.dir, checkpoint=args.checkpoint, on_file=shown)
        except ValueError as exc:
            print(f"zero1 download: {exc}", file=sys.stderr)
            return 1
    return 0


def cmd_tag(args: argparse.Namespace) -> int:
    """`zero1 tag ID TAG...` adds the tags, `zero1 untag ID TAG...` removes them; prints the job's tags."""
    with _client(args) as client:
        job = client.job(args.job_id)
        tags = set(job.info.tags)
        tags = tags | set(args.tags) if args.command == "tag" else tags - set(args.tags)
        info = job.set_tags(sorted(tags)).info
    print(f"job {args.job_id}: tags {', '.join(info.tags) or '(none)'}")
    return 0


def _trial_line(trial: dict) -> str:
    values = ", ".join(
        f"{path}={value:.4g}" if isinstance(value, float) else f"{path}={value}"
        for path, value in trial["values"].items()
    )
    metric = "-" if trial["metric"] is None else f"{trial['metric']:.4f}"
    job = "-" if trial["job_id"] is None else str(trial["job_id"])
    why = f"  ({escape(trial['reason'])})" if trial.get("reason") else ""
    return f"{trial['index']:>5}  {job:>6}  {trial['status']:<13}  {metric:>8}  {escape(values)}{why}"


def _print_sweep(sweep: dict) -> None:
    best = sweep["best"]
    said = (
        "none yet"
        if best is None
        else f"trial {best['index']} (job {best['job_id']}, {sweep['metric']} {best['metric']:.4f})"
    )
    where = f"its jobs are tagged {sweep['tag']}"
    print(f"sweep {sweep['id']} {escape(sweep['name'])}: {sweep['status']}, best {said}; {where}")
    print(f"{'trial':>5}  {'job':>6}  {'status':<13}  {sweep['metric']:>8}  values")
    for trial in sweep["trials"]:
        print(_trial_line(trial))


def cmd_sweep(args: argparse.Namespace) -> int:
    """`zero1 sweep SPEC.json`: plan and store a sweep, print its trials."""
    if (body := _read_json(args.spec, command="sweep")) is None:
        return 2
    with _client(args) as client:
        _print_sweep(client.sweep(body).info.model_dump(mode="json"))
    return 0


def cmd_sweeps(args: argparse.Namespace) -> int:
    """`zero1 sweeps`: yours, newest first; `zero1 sweeps ID`: one, with its trials; `--cancel`,
    `--suspend` or `--resume` it first."""
    with _client(args) as client:
        if args.sweep_id is not None:  # a 404 for one not yours, as an ApiError (main prints it)
            sweep = client.get_sweep(args.sweep_id)
            if args.action is not None:
                getattr(sweep, args.action)()
            _print_sweep(sweep.info.model_dump(mode="json"))
            return 0
        if args.action is not None:
            print(f"zero1 sweeps: --{args.action} needs a sweep's ID", file=sys.stderr)
            return 2
        print(f"{'id':>6}  {'status':<10}  {'trials':>6}  name")
        for sweep in client.sweeps():
            print(f"{sweep.id:>6}  {sweep.status:<10}  {len(sweep.info.trials):>6}  {escape(sweep.info.name)}")
    return 0

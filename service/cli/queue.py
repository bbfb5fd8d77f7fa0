"""The commands that steer the queue: `zero1 queue` (the waiting jobs in the order they start, when
each is estimated to start, why it waits, and each owner's GPUs against their quota), `suspend`,
`resume` and `priority`. `queue` draws a rich table on a terminal and prints plain text otherwise
(service/client/output.py)."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from service.cli.jobs import _client
from service.schemas.printable import escape
from service.schemas.responses import starts_in
from zero1 import Job
from zero1.output import terminal

if TYPE_CHECKING:
    from rich.console import Group

_COLUMNS = ("#", "id", "name", "owner", "priority", "gpus", "starts", "reason")


def _entry_cells(entry: dict) -> dict[str, str]:
    """A queued job's row, each column as text; the name, owner and reason escaped (users wrote them)."""
    num_gpus = entry["num_gpus"]
    min_gpus = entry["min_gpus"]
    return {
        "#": str(entry["position"]),
        "id": str(entry["id"]),
        "name": escape(entry["name"]),
        "owner": escape(entry["owner"] or "-"),
        "priority": str(entry["priority"]),
        "gpus": str(num_gpus) if min_gpus == num_gpus else f"{min_gpus}-{num_gpus}",
        "starts": starts_in(_instant(entry.get("estimated_start")), now=datetime.now(UTC)),
        "reason": escape(entry["reason"]),
    }


def _instant(iso: str | None) -> datetime | None:
    return None if iso is None else datetime.fromisoformat(iso)


def _owner_cells(usage: dict) -> dict[str, str]:
    quota = "none" if usage["quota"] is None else str(usage["quota"])
    borrowed = f" ({usage['borrowed_gpus']} borrowed)" if usage["borrowed_gpus"] else ""
    return {
        "owner": escape(usage["owner"] or "-"),
        "gpus": f"{usage['gpus_in_use']}{borrowed}",
        "quota": quota,
    }


def queue_lines(queue: dict) -> list[str]:
    """`zero1 queue` as plain text: the queue, then each owner's GPUs against their quota."""
    lines = [f"{'#':>4}  {'id':>6}  {'priority':>8}  {'gpus':>5}  {'owner':<12}  {'name':<20}  {'starts':<10}  reason"]
    for entry in queue["data"]:
        c = _entry_cells(entry)
        lines.append(
            f"{c['#']:>4}  {c['id']:>6}  {c['priority']:>8}  {c['gpus']:>5}  {c['owner']:<12}  {c['name']:<20}  "
            f"{c['starts']:<10}  {c['reason']}"
        )
    if queue["count"] > len(queue["data"]):
        lines.append(f"... and {queue['count'] - len(queue['data'])} more queued")
    if not queue["data"]:
        lines.append("(the queue is empty)")
    lines += ["", f"{'owner':<12}  {'gpus in use':>16}  quota"]
    for usage in queue["owners"]:
        c = _owner_cells(usage)
        lines.append(f"{c['owner']:<12}  {c['gpus']:>16}  {c['quota']}")
    return lines


def _queue_tables(queue: dict) -> Group:
    """The same as rich tables. Cells are Text, never markup: names and reasons are users'."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    jobs = Table(box=None, header_style="bold", pad_edge=False, title="queue", title_justify="left")
    for name in _COLUMNS:
        jobs.add_column(name, justify="right" if name in ("#", "id", "priority", "gpus", "starts") else "left")
    for entry in queue["data"]:
        cells = _entry_cells(entry)
        jobs.add_row(*(Text(cells[name], style="dim" if name == "reason" else "") for name in _COLUMNS))
    owners = Table(box=None, header_style="bold", pad_edge=False, title="GPUs by owner", title_justify="left")
    for name in ("owner", "gpus in use", "quota"):
        owners.add_column(name, justify="left" if name == "owner" else "right")
    for usage in queue["owners"]:
        cells = _owner_cells(usage)
        owners.add_row(Text(cells["owner"]), Text(cells["gpus"]), Text(cells["quota"]))
    more = queue["count"] - len(queue["data"])
    return Group(jobs, Text(f"... and {more} more queued" if more else ""), owners)


def cmd_queue(args: argparse.Namespace) -> int:
    with _client(args) as client:
        queue = client.queue(limit=args.limit).model_dump(mode="json")
    if (console := terminal()) is not None:
        console.print(_queue_tables(queue))
        return 0
    print("\n".join(queue_lines(queue)))
    return 0


def cmd_suspend(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job = Job(client, args.job_id).suspend()
    if job.status == "suspended":
        print(f"job {args.job_id}: suspended")
    else:  # an active job stops at its next step with a checkpoint
        print(f"job {args.job_id}: suspend requested ({job.status}; it stops at its next checkpoint)")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    with _client(args) as client:
        info = Job(client, args.job_id).resume().info
    print(f"job {args.job_id}: {info.status} (queue position {info.queue_position}, priority {info.priority})")
    return 0


def cmd_priority(args: argparse.Namespace) -> int:
    with _client(args) as client:
        info = Job(client, args.job_id).set_priority(args.priority).info
    where = f", queue position {info.queue_position}" if info.queue_position else ""
    print(f"job {args.job_id}: priority {info.priority} ({info.status}{where})")
    return 0

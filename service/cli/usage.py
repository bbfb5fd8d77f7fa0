"""`zero1 usage`: GPU-hours held and spent training by owner and priority class over a period, and each
owner's GPUs and usage against their quota (GET /v1/usage), as plain columns, or the API's JSON."""

from __future__ import annotations

import argparse
import json

from service.cli import jobs as cli_jobs
from service.schemas.printable import escape


def _hours(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 3600:,.2f}"


def usage_lines(report: dict) -> list[str]:
    """The report as text: the period and its totals, a line per owner and priority class, then the quotas."""
    lines = [
        f"from {report['since']} to {report['until']}: {_hours(report['gpu_seconds_held'])} GPU-hours held, "
        f"{_hours(report['gpu_seconds_training'])} training",
        "",
        f"{'owner':<16}  {'priority':>8}  {'jobs':>5}  {'GPU-h held':>12}  {'GPU-h training':>14}",
    ]
    for row in report["data"]:
        lines.append(
            f"{escape(row['owner'] or '-'):<16}  {row['priority_class']:>8}  {row['jobs']:>5}  "
            f"{_hours(row['gpu_seconds_held']):>12}  {_hours(row['gpu_seconds_training']):>14}"
        )
    if not report["data"]:
        lines.append("(no GPU was held in this period)")
    lines += ["", f"{'owner':<16}  {'gpus in use':>16}  {'quota':>5}  {'GPU-h held':>12}  {'of quota':>10}  used"]
    for quota in report["quotas"]:
        borrowed = f" ({quota['borrowed_gpus']} borrowed)" if quota["borrowed_gpus"] else ""
        used = "-" if quota["quota_used"] is None else f"{100 * quota['quota_used']:.1f}%"
        lines.append(
            f"{escape(quota['owner'] or '-'):<16}  {str(quota['gpus_in_use']) + borrowed:>16}  "
            f"{'none' if quota['quota'] is None else quota['quota']:>5}  {_hours(quota['gpu_seconds_held']):>12}  "
            f"{_hours(quota['quota_gpu_seconds']):>10}  {used}"
        )
    return lines


def cmd_usage(args: argparse.Namespace) -> int:
    with cli_jobs._client(args) as client:
        report = client.usage(since=args.since, until=args.until).model_dump(mode="json")
    print(json.dumps(report, indent=2) if args.json else "\n".join(usage_lines(report)))
    return 0

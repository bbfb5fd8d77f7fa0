"""The `zero1` command: `serve` runs the API; `plan` plans a model offline; `submit`,
`jobs`, `status`, `watch`, `logs`, `cancel`, `download`, `queue`, `usage`, `suspend`, `resume` and `priority`
talk to a running API through the Python client (`zero1`, service/client/); `db upgrade` migrates.

May import: service.settings, service.errors, service.auth, service.main, service.schemas,
service.store, service.planning, service.client, workers.memory.
"""

from __future__ import annotations

import argparse
import os
import sys
from decimal import Decimal, InvalidOperation

from service.cli.jobs import (
    cmd_cancel,
    cmd_download,
    cmd_jobs,
    cmd_status,
    cmd_submit,
    cmd_sweep,
    cmd_sweeps,
    cmd_tag,
    cmd_watch,
    print_api_error,
)
from service.cli.logs import cmd_logs
from service.cli.plans import cmd_plan
from service.cli.queue import cmd_priority, cmd_queue, cmd_resume, cmd_suspend
from service.cli.server import cmd_db, cmd_serve
from service.cli.usage import cmd_usage
from service.schemas.fields import MAX_TEXT_DIGITS, too_many_digits
from workers.memory.model import OPTIMIZERS, PRECISIONS, STAGES


def _count(text: str) -> int:
    """'7.5e9' -> 7500000000, exactly; a fractional count is an error."""
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if too_many_digits(value):
        raise argparse.ArgumentTypeError(f"must have at most {MAX_TEXT_DIGITS} digits, got {text}")
    if not value.is_finite() or value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text}")
    return int(value)


def _sizes(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"sizes must be comma-separated integers, got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zero1", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the REST API and dashboard")
    serve.add_argument("--host", help="bind address (default: ZERO1_HOST or 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default: ZERO1_PORT or 8000)")

    plan = commands.add_parser(
        "plan",
        help="per-GPU memory of a model under ZeRO, and the sweep over N",
        description="Plan by parameter count (--params 7.5e9) or by model (--model gpt ...). GB = 1e9 bytes.",
    )
    what = plan.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=_count, metavar="PSI", help="number of parameters, e.g. 7.5e9")
    what.add_argument("--model", choices=("gpt", "mlp"), help="plan a model spec (see the --n-* options)")
    plan.add_argument("--gpus", type=int, help="data-parallel GPUs N (default: the cluster's)")
    plan.add_argument("--gpu-memory-gb", type=float, help="memory per GPU in GB (default: the cluster's)")
    plan.add_argument("--precision", choices=PRECISIONS, default="fp16")
    plan.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    plan.add_argument("--stage", type=int, choices=STAGES, default=1)
    gpt = plan.add_argument_group("gpt model")
    gpt.add_argument("--vocab-size", type=int, default=50257)
    gpt.add_argument("--n-layer", type=int)
    gpt.add_argument("--n-head", type=int, help="default: n_embd / 64 (GPT-2's head width)")
    gpt.add_argument("--n-embd", type=int)
    gpt.add_argument("--block-size", type=int, default=1024)
    gpt.add_argument("--seq-len", type=int, help="default: block size")
    mlp = plan.add_argument_group("mlp model")
    mlp.add_argument("--sizes", type=_sizes, help="layer widths, e.g. 784,1024,10")
    jobs = plan.add_argument_group("model plans")
    jobs.add_argument("--micro-batch-size", type=int)
    jobs.add_argument("--activation-checkpointing", action="store_true", default=None)
    jobs.add_argument(
        "--trace", action="store_true", help="count the step by running it on fake tensors (method traced)"
    )
    recommend = plan.add_argument_group(
        "recommendations", "the configurations of a model that fit, cheapest first (POST /v1/plan/recommend)"
    )
    recommend.add_argument("--recommend", action="store_true", help="list GPUs x micro-batch x checkpointing")
    recommend.add_argument("--global-batch-size", type=int, metavar="G", help="samples per optimizer step")
    recommend.add_argument("--max-gpus", type=int, help="largest N considered (default: --gpus, else the cluster's)")
    plan.add_argument("--json", action="store_true", help="print the API's JSON instead of tables")

    url = {
        "default": os.environ.get("ZERO1_URL", "http://127.0.0.1:8000"),
        "help": "the API (default: ZERO1_URL or http://127.0.0.1:8000)",
    }
    submit = commands.add_parser("submit", help="submit a job spec (JSON file); prints its plan and id")
    submit.add_argument("spec", help="path of a JSON JobSpec, e.g. examples/tiny-gpt.json")
    submit.add_argument("--dry-run", action="store_true", help="plan and admit, store nothing")
    submit.add_argument(
        "--code",
        metavar="DIR",
        help="a python model's code: DIR zipped (without .git, __pycache__, virtualenvs and what its "
        ".gitignore lists), uploaded, and set as the job's code",
    )
    submit.add_argument("--priority", type=int, metavar="N", help="0-100, highest first (default: the service's, 50)")
    submit.add_argument("--tag", action="append", metavar="TAG", help="a tag to find it by (repeatable)")
    submit.add_argument("--notes", metavar="TEXT", help="notes on the job (its owner and admins see them)")
    submit.add_argument(
        "--depends-on",
        type=int,
        action="append",
        metavar="ID",
        help="start only once job ID has succeeded (repeatable)",
    )
    submit.add_argument("--url", **url)
    jobs = commands.add_parser("jobs", help="list jobs, newest first")
    jobs.add_argument("--status", action="append", help="only these statuses (repeatable)")
    jobs.add_argument("--tag", action="append", metavar="TAG", help="only jobs with this tag (repeatable: all of them)")
    jobs.add_argument("--limit", type=int, default=20)
    jobs.add_argument("--url", **url)
    for name, text in (
        ("status", "a job, with its events"),
        ("watch", "a live progress bar until the job ends"),
        ("cancel", "cancel a job"),
        ("suspend", "suspend a job: a running one stops at its next step with a checkpoint"),
        ("resume", "put a suspended job back in the queue"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("job_id", type=int)
        command.add_argument("--url", **url)
        if name == "watch":
            command.add_argument("--interval", type=float, default=0.5, help="seconds between refreshes")
    priority = commands.add_parser("priority", help="change a job's priority (0-100, highest first)")
    priority.add_argument("job_id", type=int)
    priority.add_argument("priority", type=int, help="the new priority, up to your ceiling")
    priority.add_argument("--url", **url)
    sweep = commands.add_parser("sweep", help="plan and run a sweep: a job spec searched over its fields")
    sweep.add_argument("spec", help="a JSON file: name, base, space, max_trials, max_concurrent, metric (docs/api.md)")
    sweep.add_argument("--url", **url)
    sweeps = commands.add_parser("sweeps", help="your sweeps; with ID, one with its trials and the best")
    sweeps.add_argument("sweep_id", type=int, nargs="?")
    steer = sweeps.add_mutually_exclusive_group()
    for action, what in [
        ("cancel", "its trials' jobs cancelled, the rest skipped"),
        ("suspend", "no further trial; its trials' jobs suspended"),
        ("resume", "its suspended trials back in the queue"),
    ]:
        steer.add_argument(f"--{action}", dest="action", action="store_const", const=action, help=what)
    sweeps.add_argument("--url", **url)
    for name, text in (("tag", "add tags to a job"), ("untag", "remove tags from a job")):
        command = commands.add_parser(name, help=text)
        command.add_argument("job_id", type=int)
        command.add_argument("tags", nargs="+", metavar="TAG")
        command.add_argument("--url", **url)
    queue = commands.add_parser("queue", help="the queued jobs in the order they start, why each waits")
    queue.add_argument("--limit", type=int, default=100, help="the first N queued jobs (default 100)")
    queue.add_argument("--url", **url)
    usage = commands.add_parser(
        "usage", help="GPU-hours held and training by owner and priority class, and against the quotas"
    )
    usage.add_argument("--since", metavar="TIME", help="ISO 8601, UTC without a zone (default: this month's start)")
    usage.add_argument("--until", metavar="TIME", help="ISO 8601, UTC without a zone (default: now)")
    usage.add_argument("--json", action="store_true", help="print the API's JSON")
    usage.add_argument("--url", **url)
    logs = commands.add_parser(
        "logs", help="a job's output lines, as [rank R] line", description="A job's output lines, oldest first."
    )
    logs.add_argument("job_id", type=int)
    logs.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="then each new line as it comes, until the job ends (exit 1 if it did not succeed)",
    )
    logs.add_argument("--rank", type=int, help="only this rank's lines")
    logs.add_argument("--attempt", type=int, help="only this attempt's lines (a retry is the next attempt)")
    logs.add_argument("--url", **url)
    download = commands.add_parser(
        "download", help="a succeeded job's final model, each file's sha256 checked; or one of its checkpoints"
    )
    download.add_argument("job_id", type=int)
    download.add_argument("dir", help="where the files go (created)")
    download.add_argument(
        "--checkpoint",
        type=int,
        metavar="STEP",
        help="that stored checkpoint's shards and marker instead (its size checked)",
    )
    download.add_argument("--url", **url)
    db = commands.add_parser("db", help="database maintenance")
    db.add_argument("action", choices=("upgrade",), help="upgrade: apply the migrations (ZERO1_DATABASE_URL)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    commands = {
        "plan": cmd_plan,
        "serve": cmd_serve,
        "submit": cmd_submit,
        "jobs": cmd_jobs,
        "status": cmd_status,
        "watch": cmd_watch,
        "logs": cmd_logs,
        "cancel": cmd_cancel,
        "download": cmd_download,
        "queue": cmd_queue,
        "usage": cmd_usage,
        "suspend": cmd_suspend,
        "resume": cmd_resume,
        "priority": cmd_priority,
        "tag": cmd_tag,
        "sweep": cmd_sweep,
        "sweeps": cmd_sweeps,
        "untag": cmd_tag,
        "db": cmd_db,
    }
    from zero1 import ApiError

    try:
        return commands[args.command](args)
    except ApiError as error:
        return print_api_error(error)
    except BrokenPipeError:  # `zero1 jobs | head -3`: the reader left, which is no error
        _silence_stdout()
        return 0
    except KeyboardInterrupt:  # Ctrl-C out of `zero1 logs -f` or `watch`: the shell's 128 + SIGINT, no traceback
        return 130
    except Exception as exc:
        import httpx

        if not isinstance(exc, httpx.TransportError):
            raise
        print(
            f"zero1 {args.command}: cannot reach the zero1 API at {args.url} ({type(exc).__name__}: {exc}). "
            "Start it with `zero1 serve` (or `make run`), or point ZERO1_URL or --url at a running one.",
            file=sys.stderr,
        )
        return 1


def _silence_stdout() -> None:
    """Send what is still buffered for stdout to /dev/null: the flush at exit would fail on the
    closed pipe and print a traceback (https://docs.python.org/3/library/signal.html#note-on-sigpipe)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())

"""`zero1 logs ID [-f] [--rank R] [--attempt A]`: a job's output lines as `[rank R] line`.

Without -f the lines stored so far, a page at a time; with -f each line as it arrives until the
job ends (the client's Job.logs(follow=True), service/client/streams.py), and the exit code is the
job's (0 only if it succeeded).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from service.cli import jobs  # jobs._client through the module: a test's stand-in client serves logs too
from zero1 import Job, LogLine, StreamError
from zero1.output import terminal

if TYPE_CHECKING:
    from rich.console import Console

LINE_STYLES = {"stderr": "red", "log": "dim", "marker": "yellow"}
"""A stream's style on a terminal; stdout lines are drawn unstyled."""


def _printer(console: Console | None) -> Callable[[LogLine], None]:
    """show(line): on stdout as it comes (flushed); coloured by stream on a terminal."""
    if console is None:
        return lambda line: print(line, flush=True)
    from rich.text import Text

    # Text, never markup: a line is the job's own output; soft_wrap: the terminal wraps, as `cat` would
    return lambda line: console.print(Text(str(line), style=LINE_STYLES.get(line.stream, "")), soft_wrap=True)


def cmd_logs(args: argparse.Namespace) -> int:
    show = _printer(terminal())
    with jobs._client(args) as client:
        job = Job(client, args.job_id)  # by its id alone: its lines need no other request
        lines = job.logs(
            follow=args.follow,
            rank=args.rank,
            attempt=args.attempt,
            note=lambda text: print(f"zero1 logs: {text}", file=sys.stderr),
        )
        try:
            for line in lines:
                show(line)
        except StreamError as exc:
            print(f"zero1 logs: {exc}", file=sys.stderr)
            return 1
    if not args.follow:
        return 0
    return 0 if job.ended.get("status") == "succeeded" else 1

"""`zero1 logs ID [-f] [--rank R] [--attempt A]`: a job's output lines as `[rank R] line`.

Without -f the lines stored so far, a page at a time (GET /v1/jobs/{id}/logs?after=); with -f the
same endpoint as server-sent events (?follow=true), each line printed as it arrives until the
server's `end` event, whose status is the exit code's (0 only if the job succeeded).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from service.cli import jobs  # jobs._client through the module: a test's stand-in client serves logs too
from service.cli.output import terminal
from service.schemas.printable import escape

if TYPE_CHECKING:
    from rich.console import Console

LINE_STYLES = {"stderr": "red", "log": "dim", "marker": "yellow"}
"""A stream's style on a terminal; stdout lines are drawn unstyled."""
_LINE_BREAK = re.compile(r"\r\n|\r|\n")  # SSE's three line ends, and no others (str.splitlines has more)


@dataclass(frozen=True, slots=True)
class ServerSentEvent:
    """One message of a text/event-stream."""

    event: str
    """Its `event:` field; "message" when it has none."""
    data: str
    """Its `data:` lines, joined by newlines."""
    id: str | None
    """The stream's last `id:` when it was dispatched."""


def sse_messages(chunks: Iterable[str]) -> Iterator[ServerSentEvent]:
    """The messages of a text/event-stream from its text in chunks split anywhere (the WHATWG
    parsing rules: a blank line dispatches, `:` lines are comments, one space after a field's
    colon is dropped, a message without data is not dispatched, `retry:` is ignored)."""
    buffer, event, data, last_id = "", "", [], None
    for chunk in chunks:
        buffer += chunk
        # a trailing \r may be the first half of a \r\n: it waits for the next chunk
        end = len(buffer) - 1 if buffer.endswith("\r") else len(buffer)
        *lines, rest = _LINE_BREAK.split(buffer[:end])
        buffer = rest + buffer[end:]
        for line in lines:
            if line == "":
                if data:
                    yield ServerSentEvent(event=event or "message", data="\n".join(data), id=last_id)
                event, data = "", []
                continue
            if line.startswith(":"):
                continue
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                event = value
            elif field == "data":
                data.append(value)
            elif field == "id" and "\0" not in value:
                last_id = value


def format_line(row: dict) -> str:
    """A log line as printed: `[rank R] line`, `[zero1] line` for the service's own (rank null). A rank
    may print escape sequences (stored as they are): here they are shown escaped, tabs kept."""
    prefix = "[zero1]" if row["rank"] is None else f"[rank {row['rank']}]"
    return f"{prefix} {escape(row['line'], keep=chr(9))}"


def _printer(console: Console | None) -> Callable[[dict], None]:
    """show(row): its line on stdout as it comes (flushed); coloured by stream on a terminal."""
    if console is None:
        return lambda row: print(format_line(row), flush=True)
    from rich.text import Text

    # Text, never markup: a line is the job's own output; soft_wrap: the terminal wraps, as `cat` would
    return lambda row: console.print(Text(format_line(row), style=LINE_STYLES.get(row["stream"], "")), soft_wrap=True)


def _query(args: argparse.Namespace) -> dict:
    return {key: value for key, value in (("rank", args.rank), ("attempt", args.attempt)) if value is not None}


def print_pages(client, job_id: int, *, query: dict, show: Callable[[dict], None]) -> int:
    """Every line stored so far, oldest first, a page at a time until a page is empty: 0, or the API
    error's exit code."""
    after = 0
    while True:
        response = client.get(f"/v1/jobs/{job_id}/logs", params={**query, "after": after})
        if (code := jobs._api_error(response)) is not None:
            return code
        page = response.json()
        if not page["data"]:
            return 0
        for row in page["data"]:
            show(row)
        after = page["next"]


RECONNECT_DELAYS_S = (1, 2, 4, 8, 15, 30)
"""The waits before each new try when a stream breaks off before its end (a service restarting)."""


def follow(client, job_id: int, *, query: dict, show: Callable[[dict], None]) -> int:
    """Every line, then each new one as the job writes it, until the server's `end` event: 0 if the
    job succeeded, 1 if it failed or was cancelled. A stream that breaks off before its end (the
    service restarting) is opened again after the last line shown, RECONNECT_DELAYS_S apart; 1
    when none of them comes back."""
    import httpx

    # read=None: a quiet job sends nothing but keep-alives for as long as it runs
    timeout = httpx.Timeout(10, read=None)
    after, delays, why = 0, iter(RECONNECT_DELAYS_S), "it ended"
    while True:
        params = {**query, "follow": "true", **({"after": after} if after else {})}
        try:
            with client.stream("GET", f"/v1/jobs/{job_id}/logs", params=params, timeout=timeout) as response:
                if (code := jobs._api_error(response)) is not None:
                    return code
                for message in sse_messages(response.iter_text()):
                    if message.event == "end":
                        return 0 if json.loads(message.data)["status"] == "succeeded" else 1
                    if message.event == "message":
                        row = json.loads(message.data)
                        show(row)
                        after, delays = row["seq"], iter(RECONNECT_DELAYS_S)  # it came back: the waits start again
            why = "it ended"
        except httpx.TransportError as exc:
            if after == 0 and why == "it ended":  # never connected: main() says where it looked
                raise
            why = f"{type(exc).__name__}: {exc}"
        delay = next(delays, None)
        if delay is None:
            print(f"zero1 logs: the stream of job {job_id} broke off before the job ended ({why})", file=sys.stderr)
            return 1
        print(f"zero1 logs: the stream broke off ({why}); again in {delay} s, after line {after}", file=sys.stderr)
        time.sleep(delay)


def cmd_logs(args: argparse.Namespace) -> int:
    show = _printer(terminal())
    with jobs._client(args) as client:
        if args.follow:
            return follow(client, args.job_id, query=_query(args), show=show)
        return print_pages(client, args.job_id, query=_query(args), show=show)

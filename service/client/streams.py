"""Server-sent events, as GET /v1/jobs/{id}/logs?follow=true sends a job's lines: the parser, and
the follower that opens the stream again where it broke off."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import StreamError, raise_for

if TYPE_CHECKING:
    import httpx

_LINE_BREAK = re.compile(r"\r\n|\r|\n")  # SSE's three line ends, and no others (str.splitlines has more)

RECONNECT_DELAYS_S = (1, 2, 4, 8, 15, 30)
"""The waits before each new try when a stream breaks off before its end (a service restarting)."""


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
    buffer = ""
    event = ""
    data = []
    last_id = None
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
                event = ""
                data = []
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


def follow_lines(
    http: httpx.Client, job_id: int, *, query: dict, note: Callable[[str], None], end: dict
) -> Iterator[dict]:
    """Every line of the job (as the API's JSON rows), then each new one as it is written, until the
    server's `end` event, whose JSON lands in `end` (its `status`). A stream that breaks off before
    its end (the service restarting) is opened again after the last line seen, RECONNECT_DELAYS_S
    apart, each wait told to `note`; a StreamError when none of them comes back. A first connection
    that fails raises its httpx.TransportError."""
    import httpx  # not at import: httpx's own command line loads rich, which `zero1 plan` never needs

    # read=None: a quiet job sends nothing but keep-alives for as long as it runs
    timeout = httpx.Timeout(10, read=None)
    after = 0
    delays = iter(RECONNECT_DELAYS_S)
    why = "it ended"
    while True:
        params = {**query, "follow": "true", **({"after": after} if after else {})}
        try:
            with http.stream("GET", f"/v1/jobs/{job_id}/logs", params=params, timeout=timeout) as response:
                raise_for(response)
                for message in sse_messages(response.iter_text()):
                    if message.event == "end":
                        end.update(json.loads(message.data))
                        return
                    if message.event == "message":
                        row = json.loads(message.data)
                        yield row
                        after = row["seq"]
                        delays = iter(RECONNECT_DELAYS_S)  # it came back: the waits start again
            why = "it ended"
        except httpx.TransportError as exc:
            if after == 0 and why == "it ended":  # never connected: the caller says where it looked
                raise
            why = f"{type(exc).__name__}: {exc}"
        delay = next(delays, None)
        if delay is None:
            raise StreamError(f"the stream of job {job_id} broke off before the job ended ({why})")
        note(f"the stream broke off ({why}); again in {delay} s, after line {after}")
        time.sleep(delay)

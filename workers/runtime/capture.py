"""A rank's output, kept: its stdout, stderr and Python logging, line by line, shipped in batches
to its job's supervisor; and a child's descriptors 1 and 2, pipes its parent reads (ChildOutput),
never the Ray worker's log files.

Lines are numbered in the order they are written (OutputLine.n). A batch is sent only once the
one before it has been delivered, so the supervisor receives a rank's lines in order. What waits
to be sent is bounded: past `max_bytes` the oldest waiting lines are dropped, and a marker line
in their place says how many.

In a rank's child, OutputCapture takes what Python writes (echo off: it is not written to the
pipes too); what is written below Python (a C extension, the interpreter before the capture
starts) goes down the pipes, and the parent hands it on into the job's log as well.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import select
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any, TextIO

from workers.records import OutputLine

MAX_LINE_CHARS = 4096
"""A longer line is cut here and goes on in the next (a progress bar without newlines, a dump)."""
SEND_EVERY_S = 0.5
SEND_EVERY_LINES = 500
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"

Send = Callable[[list[OutputLine]], Any]
"""Sends a batch; returns a handle that Delivered waits on (a Ray ObjectRef)."""
Delivered = Callable[[Any, float | None], bool]
"""Whether the batch of a handle has been delivered, waiting at most the timeout (None: no limit)."""


class OutputCapture:
    """Captures a rank's output between __enter__ and __exit__ (or close())."""

    def __init__(self, *, rank: int, send: Send, delivered: Delivered, max_bytes: int, echo: bool = True) -> None:
        """echo: each line is also written on to the stream it replaced (off in a rank's child,
        whose stdout and stderr its parent reads into the same log)."""
        self.rank = rank
        self.max_bytes = max_bytes
        self.echo = echo
        self._send = send
        self._delivered = delivered
        self._lock = threading.Lock()  # the waiting lines and the line count
        self._ship_lock = threading.Lock()  # one sender at a time: batches go out in order
        self._waiting: deque[OutputLine] = deque()
        self._waiting_bytes = 0
        self._count = 0
        self._dropped = (0, 0, -1)  # lines, bytes, n of the last dropped line
        self._in_flight: Any = None
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._inside = threading.local()  # set while this thread writes: output made then is not captured again
        self._saved: tuple[TextIO, TextIO, int] | None = None
        self._handler: logging.Handler | None = None
        self._shipper: threading.Thread | None = None

    def __enter__(self) -> OutputCapture:
        root = logging.getLogger()
        self._saved = (sys.stdout, sys.stderr, root.level)
        sys.stdout = _LineStream(self, "stdout", sys.stdout)
        sys.stderr = _LineStream(self, "stderr", sys.stderr)
        self._handler = _LogHandler(self, self._saved[1])
        root.addHandler(self._handler)
        if root.level == logging.NOTSET or root.level > logging.INFO:
            root.setLevel(logging.INFO)  # INFO records reach the handler (Python's default root level is WARNING)
        self._shipper = threading.Thread(target=self._ship_loop, daemon=True, name=f"zero1-logs-rank{self.rank}")
        self._shipper.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def print_exception(self, exc: BaseException) -> None:
        """The traceback of `exc` into the rank's stderr (a rank that raises leaves it in its logs)."""
        traceback.print_exception(exc, file=sys.stderr)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop capturing, then send what waits and wait (at most timeout_s) for its delivery."""
        if self._saved is None:
            return
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, _LineStream):
                stream.end()
        stdout, stderr, level = self._saved
        sys.stdout = stdout
        sys.stderr = stderr
        root = logging.getLogger()
        root.removeHandler(self._handler)
        root.setLevel(level)
        self._saved = None
        self._closed.set()
        self._wake.set()
        if self._shipper is not None:
            self._shipper.join(timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(Exception):  # no supervisor to take them: the worker's log files have them
            while self._ship(wait_s=max(0.0, deadline - time.monotonic())):
                pass
            if self._in_flight is not None:
                self._delivered(self._in_flight, max(0.0, deadline - time.monotonic()))

    # ----------------------------------------------------------------------- lines in

    def add(self, stream: str, text: str) -> None:
        """One line (no newline) of `stream`, cut into MAX_LINE_CHARS pieces."""
        now = time.time()
        pieces = [text[i : i + MAX_LINE_CHARS] for i in range(0, len(text), MAX_LINE_CHARS)] or [""]
        with self._lock:
            for piece in pieces:
                line = OutputLine(rank=self.rank, n=self._count, time=now, stream=stream, line=piece)
                self._count += 1
                self._waiting.append(line)
                self._waiting_bytes += line.size
            while self._waiting_bytes > self.max_bytes and len(self._waiting) > 1:
                oldest = self._waiting.popleft()
                self._waiting_bytes -= oldest.size
                lines, size, _ = self._dropped
                self._dropped = (lines + 1, size + oldest.size, oldest.n)
            if len(self._waiting) >= SEND_EVERY_LINES:
                self._wake.set()

    def writing(self) -> bool:
        """Whether this thread is already inside the capture (its own output is not captured)."""
        return getattr(self._inside, "active", False)

    def guard(self, active: bool) -> None:
        self._inside.active = active

    # ----------------------------------------------------------------------- lines out

    def _ship_loop(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(SEND_EVERY_S)
            self._wake.clear()
            with contextlib.suppress(Exception):  # a send that fails keeps its batch for the next try
                self._ship(wait_s=0.0)

    def _ship(self, *, wait_s: float) -> bool:
        """Send the waiting lines if the previous batch was delivered (waiting at most wait_s);
        whether a batch was sent."""
        with self._ship_lock:
            if self._in_flight is not None and not self._delivered(self._in_flight, wait_s):
                return False
            self._in_flight = None
            with self._lock:
                batch = list(self._waiting)
                self._waiting = deque()
                self._waiting_bytes = 0
                lines, size, last_n = self._dropped
                self._dropped = (0, 0, -1)
            if lines:  # in the place of the dropped lines: the n of the last of them
                text = (
                    f"[zero1] {lines:,} lines ({size:,} bytes) of rank {self.rank} were dropped: written faster than "
                    f"they could be shipped (ZERO1_LOG_MAX_BYTES {self.max_bytes:,})"
                )
                marker = OutputLine(
                    rank=self.rank, n=last_n, time=time.time(), stream="marker", line=text, dropped=(lines, size)
                )
                batch.insert(0, marker)
            if not batch:
                return False
            self.guard(True)
            try:
                self._in_flight = self._send(batch)
            except BaseException:
                with self._lock:
                    self._waiting.extendleft(reversed(batch))
                    self._waiting_bytes += sum(line.size for line in batch)
                raise
            finally:
                self.guard(False)
            return True


class HeldLines:
    """The supervisor's side: every rank's lines, in arrival order, held until the control plane
    says they are stored; past `max_bytes` the oldest are dropped, and counted."""

    POLL_LINES = 10_000
    """The most lines one poll hands on (the rest come with the next)."""

    def __init__(self, *, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lines: deque[OutputLine] = deque()
        self._bytes = 0
        self.dropped = (0, 0)
        """Lines and bytes dropped since the attempt began."""

    def add(self, lines: list[OutputLine]) -> None:
        self._lines.extend(lines)
        self._bytes += sum(line.size for line in lines)
        while self._bytes > self.max_bytes and len(self._lines) > 1:
            oldest = self._lines.popleft()
            self._bytes -= oldest.size
            lines, size = oldest.dropped if oldest.stream == "marker" else (1, oldest.size)
            self.dropped = (self.dropped[0] + lines, self.dropped[1] + size)

    def after(self, acks: dict[int, int]) -> list[OutputLine]:
        """Forget each rank's lines through its ack (the n stored last; -1 or absent: none), and
        give the oldest POLL_LINES of the rest."""
        if any(line.n <= acks.get(line.rank, -1) for line in self._lines):
            self._lines = deque(line for line in self._lines if line.n > acks.get(line.rank, -1))
            self._bytes = sum(line.size for line in self._lines)
        return [self._lines[i] for i in range(min(len(self._lines), self.POLL_LINES))]


class ChildOutput:
    """A child's stdout and stderr as pipes this process reads (never this process's own descriptors:
    a Ray worker's log files, whose path a child would learn and whose markers Ray parses): the
    write ends go to the child as its descriptors 1 and 2, and a thread hands each whole line, cut
    at MAX_LINE_CHARS, to on_output(stream, line)."""

    def __init__(self, on_output: Callable[[str, str], None]) -> None:
        self._on_output = on_output
        self._names: dict[int, str] = {}
        self._partial: dict[int, bytes] = {}
        self._ended: set[int] = set()
        ends = []
        for name in ("stdout", "stderr"):
            read, write = os.pipe()
            os.set_blocking(read, False)
            self._names[read] = name
            self._partial[read] = b""
            ends.append(write)
        self.write_ends: tuple[int, ...] = tuple(ends)
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read_loop, daemon=True, name="zero1-child-output")

    def started(self) -> None:
        """The child has the write ends (or did not start): this process's are closed, and it reads."""
        for fd in self.write_ends:
            os.close(fd)
        self.write_ends = ()
        self._reader.start()

    def drain(self) -> None:
        """Take every line the child has written so far (what it wrote before its last message is
        in the pipes by the time the message arrives)."""
        with self._lock:
            for fd in self._names:
                while fd not in self._ended and self._take(fd):
                    pass

    def close(self, timeout_s: float = 5.0) -> None:
        """Wait (at most timeout_s) for the pipes' ends: once every process of the child has ended."""
        if self._reader.is_alive():
            self._reader.join(timeout_s)

    def _read_loop(self) -> None:
        while self._names:
            ready = select.select(list(self._names), [], [], 1.0)[0]
            with self._lock:
                for fd in ready:
                    if fd not in self._ended:
                        self._take(fd)
                for fd in [fd for fd in self._ended if fd in self._names]:
                    os.close(fd)
                    del self._names[fd]

    def _take(self, fd: int) -> bool:
        """One read of `fd`, its whole lines handed on; whether there may be more to read now."""
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return False
        text = self._partial[fd] + data
        lines = text.split(b"\n")
        self._partial[fd] = b"" if not data else lines.pop()
        if not data:
            self._ended.add(fd)
        for line in lines if data or text else []:
            self._hand_on(self._names[fd], line)
        if len(self._partial[fd]) > 4 * MAX_LINE_CHARS:  # a line without an end: handed on in pieces
            self._hand_on(self._names[fd], self._partial[fd])
            self._partial[fd] = b""
        return bool(data)

    def _hand_on(self, stream: str, line: bytes) -> None:
        text = line.decode(errors="replace")
        text = text.rsplit("\r", 1)[-1]  # a carriage return starts the line again, as on a terminal
        for start in range(0, max(len(text), 1), MAX_LINE_CHARS):
            self._on_output(stream, text[start : start + MAX_LINE_CHARS])


class LoggedOutput:
    """A child's output where no job takes it (a plan's trace, a dataset check): logged by `logger`,
    each line quoted after a prefix, so that no line of the child's begins a line of this process's
    log (a Ray worker's, whose markers Ray parses); the first MAX_LOGGED_BYTES of it."""

    MAX_LOGGED_BYTES = 1 << 20

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.total_bytes = 0

    def __call__(self, stream: str, line: str) -> None:
        self.total_bytes += len(line) + 1
        if self.total_bytes <= self.MAX_LOGGED_BYTES:
            self.logger.info("child's %s: %r", stream, line)


class _LineStream(io.TextIOBase):
    """sys.stdout or sys.stderr: each write goes on to the stream it replaced, and each whole
    line into the capture. A carriage return starts the line again, as on a terminal."""

    def __init__(self, capture: OutputCapture, name: str, inner: TextIO) -> None:
        self.capture = capture
        self.name = name
        self.inner = inner
        self._partial = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        if self.capture.echo or self.capture.writing():
            self.inner.write(text)
        if self.capture.writing():
            return len(text)
        with self._lock:
            lines = (self._partial + text).split("\n")
            self._partial = lines.pop()
            if "\r" in self._partial:
                self._partial = self._partial.rsplit("\r", 1)[1]
        for line in lines:
            self.capture.add(self.name, line.rsplit("\r", 1)[-1] if "\r" in line else line)
        return len(text)

    def end(self) -> None:
        """The unfinished last line, if any, as a line."""
        with self._lock:
            partial = self._partial
            self._partial = ""
        if partial:
            self.capture.add(self.name, partial)
        self.inner.flush()

    def flush(self) -> None:
        self.inner.flush()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.inner.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.inner, "encoding", "utf-8")


class _LogHandler(logging.Handler):
    """The rank's Python logging (the root logger's records): one line per record line, stream
    "log", and on to the stderr it had (where the worker's log files get it)."""

    def __init__(self, capture: OutputCapture, stderr: TextIO) -> None:
        super().__init__(logging.INFO)
        self.capture = capture
        self.stderr = stderr
        self.setFormatter(logging.Formatter(LOG_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        if self.capture.writing():  # a record logged while shipping (Ray's own): not captured again
            return
        try:
            text = self.format(record)
            if self.capture.echo:
                self.stderr.write(text + "\n")
            for line in text.split("\n"):
                self.capture.add("log", line)
        except Exception:  # noqa: BLE001 - logging's contract: a handler reports its own errors
            self.handleError(record)

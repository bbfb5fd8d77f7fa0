"""A rank's parent: the Ray actor's side of the child that trains (workers/runtime/rank_child.py).

The actor is zero1's code, trusted and connected to Ray; the child runs the user's model and holds
nothing. The parent starts the child as the actor starts, hands it the job, and relays what it
says: metric rows to the supervisor in batches, log lines in order, rank 0's "stop after this step?"
questions, and the end. Nothing the child sends is trusted: each message is JSON, checked field by
field, and its rank is the parent's own. A child that dies without a word ends the attempt with how
it died (`rank 1 exited: killed by signal 9 (out of memory?)`).

The parent is the rank's watchdog too (a job's health.hang_factor): fed the child's rows and its
reports of where it is, a HangWatch (workers/phases.py) is asked at least once a second whether the
rank has made no progress for too long. A hung child is asked for its stacks (SIGUSR1 through its
keeper; its faulthandler writes every thread's to its stderr, which this process reads into the
rank's log), given DUMP_WAIT_S to write them, killed, and the attempt fails with a HangError that
names the rank, the step and the phase, its training thread's stack as the traceback. The child is
never trusted to report itself hung: it may be stuck in user code, holding the GIL.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from workers import phases
from workers.records import HANG_ERROR, STREAMS, Divergence, MetricRow, OutputLine, RankError, TrainResult
from workers.runtime.capture import MAX_LINE_CHARS
from workers.runtime.sandbox import Child, ChildExited, ChildSpec, ProtocolError
from workers.runtime.spool import Spool, SpoolError

_REPORT_EVERY_ROWS = 50
_REPORT_EVERY_S = 0.25
_FLUSH_WAIT_S = 30.0
DUMP_WAIT_S = 2.0
"""The longest a hung child is given to write its stacks: they are in once its stderr is quiet DUMP_QUIET_S."""
DUMP_QUIET_S = 0.3


class RankFailed(RuntimeError):
    """The child's rank failed: the error it reported (or how it died), carried to the supervisor whole."""

    def __init__(self, error: RankError) -> None:
        super().__init__(f"{error.exception}: {error.message}")
        self.rank_error = error

    def __reduce__(self):  # crosses Ray as its RankError
        return (type(self), (self.rank_error,))


class MetricsSink:
    """Batches a rank's metric rows to the supervisor: the first at once (a new job shows its first
    step as soon as it is taken), then every 50 rows or 0.25 s, and at the end. A batch goes only once
    the one before it is delivered (`delivered(what send returned, timeout_s)`, asked without waiting
    while the run goes on): the relay, which also answers rank 0's "stop?" at every step, never waits
    on the supervisor. The last batch goes once the one in flight is delivered, in order."""

    def __init__(
        self,
        send: Callable[[list[MetricRow]], Any],
        flush: Callable[[list[MetricRow]], None],
        delivered: Callable[[Any, float], bool] = lambda sent, timeout_s: True,
    ) -> None:
        self._send = send
        self._flush = flush
        self._delivered = delivered
        self.rows: list[MetricRow] = []
        self.sent_at = -math.inf
        self._in_flight: Any = None

    def __call__(self, row: MetricRow) -> None:
        self.rows.append(row)
        due = len(self.rows) >= _REPORT_EVERY_ROWS or time.monotonic() - self.sent_at >= _REPORT_EVERY_S
        if due and (self._in_flight is None or self._delivered(self._in_flight, 0)):
            self._in_flight = self._send(self.rows)
            self.rows = []
            self.sent_at = time.monotonic()

    def flush(self) -> None:
        if self._in_flight is not None:  # the supervisor takes calls concurrently: keep the batches' order
            self._delivered(self._in_flight, _FLUSH_WAIT_S)
            self._in_flight = None
        self._flush(self.rows)  # delivered before the run returns
        self.rows = []


class PipedLines:
    """What a rank's child writes to its stdout and stderr below Python's capture (a C extension,
    the interpreter before the capture starts), read from its pipes by the parent: held until the
    relay hands them on, at most MAX_BYTES (past it the oldest are dropped, and counted)."""

    MAX_BYTES = 4 << 20

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lines: deque[tuple[float, str, str]] = deque()
        self._bytes = 0
        self.dropped = (0, 0)
        self.received = 0
        """Lines taken in so far, dropped or not."""

    def __call__(self, stream: str, line: str) -> None:
        with self._lock:
            self.received += 1
            self._lines.append((time.time(), stream, line))
            self._bytes += len(line) + 1
            while self._bytes > self.MAX_BYTES and len(self._lines) > 1:
                oldest = self._lines.popleft()[2]
                self._bytes -= len(oldest) + 1
                self.dropped = (self.dropped[0] + 1, self.dropped[1] + len(oldest) + 1)

    def take(self) -> tuple[list[tuple[float, str, str]], tuple[int, int]]:
        with self._lock:
            lines = list(self._lines)
            dropped = self.dropped
            self._lines = deque()
            self._bytes = 0
            self.dropped = (0, 0)
        return lines, dropped


class RankProcess:
    """One rank's child, from the actor's start to the end of its run. The parent numbers the rank's
    log lines (the child's captured lines and what it wrote to its pipes), in the order it hands them on."""

    def __init__(self, *, rank: int, world_size: int, address: str, spec: ChildSpec) -> None:
        self.rank = rank
        self.world_size = world_size
        self._piped = PipedLines()
        self._count = 0
        self.child = Child("rank", spec, on_output=self._piped)
        self._piped("log", f"INFO zero1: rank {rank}'s child runs in {self.child.containment}")
        self.child.send({"rank": rank, "world_size": world_size, "address": address})

    def store_port(self, timeout_s: float) -> int:
        """Rank 0: the port of the rendezvous store its child opened."""
        message = self._receive(timeout_s)
        if message is None:
            raise TimeoutError(f"rank 0's child did not open the rendezvous store within {timeout_s:g} s")
        return _int(message, "port") if message.get("t") == "store" else self._unexpected(message)

    def run(
        self,
        start: dict[str, Any],
        *,
        sink: MetricsSink,
        send_logs: Callable[[list[OutputLine]], None],
        stop_requested: Callable[[int, bool], bool],
        parent_gone: Callable[[], bool],
        spool: Spool | None = None,
    ) -> TrainResult:
        """Hand the child its job and relay until it ends: its result, or RankFailed. Rank 0's child
        asks after each step (stop_requested(step, checkpointed)); the answer must come fast. With
        a spool (checkpoints on an object store), the child's reads and saves go through it. A hung
        child (its job's health.hang_factor) is asked for its stacks and killed: RankFailed, a HangError."""
        health = getattr(start.get("config"), "health", None)
        watch = None
        if health is not None and health.hang_factor is not None:
            watch = phases.HangWatch(hang_factor=health.hang_factor, hang_min_s=health.hang_min_s, now=time.monotonic())
        self.child.send(start)
        try:
            while True:
                self._hand_on_piped(send_logs)
                if watch is not None and (hang := watch.hung(time.monotonic())) is not None:
                    self._hung(hang, send_logs)
                if parent_gone():  # this node's Ray is gone: stop the child, and go
                    self.child.kill()
                    os._exit(1)
                if spool is not None and spool.error is not None:
                    self._storage_failed(spool.error)
                message = self._receive(1.0)
                if message is None:
                    continue
                kind = message.get("t")
                if spool is not None and kind in ("latest", "fetch", "saved"):
                    self._storage(spool, message)
                    _served(watch)
                elif kind == "row":
                    row = self._row(message)
                    sink(row)
                    if watch is not None:
                        watch.stepped(step=row.step, step_time_s=row.step_time_s, now=time.monotonic())
                elif kind == "at":
                    step = _int(message, "step")
                    if watch is not None:
                        watch.at(step=step, phase=phases.phase_name(message.get("phase")), now=time.monotonic())
                elif kind == "logs":
                    self._hand_on_piped(send_logs)
                    send_logs(self._lines(message))
                elif kind == "stop?" and self.rank == 0:  # the others learn rank 0's answer from it
                    step = _int(message, "step")
                    checkpointed = _bool(message, "checkpointed")
                    self.child.send({"stop": bool(stop_requested(step, checkpointed))})
                    _served(watch)
                elif kind == "result":
                    result = self._result(message)
                    if spool is not None:
                        self._finish_storage(spool, result)
                    return result
                elif kind == "error":
                    raise RankFailed(self._error(message))
                else:
                    self._unexpected(message)
        finally:
            self.child.output.drain()  # what it wrote before its last word (or its death) is in the pipes
            self._hand_on_piped(send_logs)
            sink.flush()

    def close(self) -> None:
        self.child.close()

    def _hung(self, hang: phases.Hang, send_logs: Callable[[list[OutputLine]], None]) -> None:
        """The child's stacks into the log, then the child killed: RankFailed with a HangError."""
        text = hang.message(self.rank)
        self._piped("log", f"WARNING zero1: {text}: the stacks of its threads follow (faulthandler)")
        before = self._piped.received
        self.child.dump_stacks()
        deadline = time.monotonic() + DUMP_WAIT_S
        count, quiet_since = before, time.monotonic()
        while time.monotonic() < deadline and (count == before or time.monotonic() - quiet_since < DUMP_QUIET_S):
            time.sleep(0.05)
            if self._piped.received != count:
                count, quiet_since = self._piped.received, time.monotonic()
        self.child.kill()
        self.child.output.drain()
        dumped = [line.line for line in self._hand_on_piped(send_logs) if line.stream == "stderr"]
        stack = RankError.tidy_traceback(phases.training_stack(dumped))
        raise RankFailed(RankError(exception=HANG_ERROR, message=text, traceback=stack))

    # ---------------------------------------------------------------- checkpoints on an object store

    def _storage(self, spool: Spool, message: dict[str, Any]) -> None:
        kind = message["t"]
        try:
            if kind == "latest":
                self.child.send({"latest": spool.latest()})
            elif kind == "fetch":
                ranges = message.get("ranges")
                if not isinstance(ranges, list) or not all(isinstance(r, list) and len(r) == 2 for r in ranges):
                    raise SpoolError("bad byte ranges")
                self.child.send({"fetched": spool.fetch(str(message.get("name")), ranges)})
            else:
                names = message.get("names")
                if not isinstance(names, list):
                    raise SpoolError("bad file names")
                spool.saved(_int(message, "step"), names)
        except (SpoolError, OSError, ValueError) as exc:
            if kind == "saved":
                self._storage_failed(exc)
            self.child.send({"error": f"{type(exc).__name__}: {exc}"[:2000]})

    def _finish_storage(self, spool: Spool, result: TrainResult) -> None:
        """Every save stored (the checkpoint a stop waited for included); rank 0's final/ after them."""
        try:
            spool.drain()
            if not (result.cancelled or result.stopped):
                spool.store_final()
        except (SpoolError, OSError) as exc:
            self._storage_failed(exc)

    def _storage_failed(self, exc: BaseException) -> None:
        self.child.kill()
        message = f"rank {self.rank}: checkpoint storage: {type(exc).__name__}: {exc}"[:2000]
        raise RankFailed(RankError(exception="StorageError", message=message))

    # ---------------------------------------------------------------- the child's words, checked

    def _receive(self, timeout_s: float) -> dict[str, Any] | None:
        try:
            return self.child.receive(timeout_s)
        except ChildExited as exc:
            raise RankFailed(RankError(exception="ChildExited", message=f"rank {self.rank} {exc}")) from None
        except ProtocolError as exc:
            self.child.kill()
            raise RankFailed(RankError(exception="ProtocolError", message=f"rank {self.rank}: {exc}")) from None

    def _unexpected(self, message: dict[str, Any]) -> Any:
        self.child.kill()
        kind = str(message.get("t"))[:40]
        raise RankFailed(RankError(exception="ProtocolError", message=f"rank {self.rank} sent a {kind!r} message"))

    def _row(self, message: dict[str, Any]) -> MetricRow:
        row = message.get("row")
        try:
            parsed = MetricRow.from_json(row)
            _check_row(parsed)
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            error = RankError(exception="ProtocolError", message=f"rank {self.rank}: bad row: {exc}")
            raise RankFailed(error) from None
        return MetricRow.from_json({**row, "rank": self.rank})

    def _hand_on_piped(self, send_logs: Callable[[list[OutputLine]], None]) -> list[OutputLine]:
        """What the child wrote to its pipes since the last call, numbered after the lines before it;
        a marker first, in the place of what was dropped, if anything was; the lines handed on."""
        piped, (dropped, size) = self._piped.take()
        lines = []
        if dropped:
            text = f"[zero1] {dropped:,} lines ({size:,} bytes) of rank {self.rank}'s stdout and stderr were dropped"
            marker = {"stream": "marker", "line": text, "dropped": (dropped, size)}
            lines.append(OutputLine(rank=self.rank, n=self._next(), time=time.time(), **marker))
        for at, stream, line in piped:
            lines.append(OutputLine(rank=self.rank, n=self._next(), time=at, stream=stream, line=line))
        if lines:
            send_logs(lines)
        return lines

    def _next(self) -> int:
        self._count += 1
        return self._count - 1

    def _lines(self, message: dict[str, Any]) -> list[OutputLine]:
        lines = message.get("lines")
        if not isinstance(lines, list):
            raise RankFailed(RankError(exception="ProtocolError", message=f"rank {self.rank}: bad log lines"))
        return [self._line(line) for line in lines if isinstance(line, dict)]

    def _line(self, line: dict[str, Any]) -> OutputLine:
        stream = line.get("stream") if line.get("stream") in STREAMS else "stdout"
        dropped = line.get("dropped")
        counts = tuple(int(v) for v in dropped[:2]) if isinstance(dropped, list) and len(dropped) == 2 else (0, 0)
        return OutputLine(
            rank=self.rank,
            n=self._next(),
            time=_float(line, "time"),
            stream=stream,
            line=str(line.get("line", ""))[:MAX_LINE_CHARS],
            dropped=counts,
        )

    def _result(self, message: dict[str, Any]) -> TrainResult:
        result = message.get("result")
        if not isinstance(result, dict):
            raise RankFailed(RankError(exception="ProtocolError", message=f"rank {self.rank}: bad result"))
        return TrainResult(
            rank=self.rank,
            first_step=_int(result, "first_step"),
            last_step=_int(result, "last_step"),
            cancelled=bool(result.get("cancelled")),
            stopped=bool(result.get("stopped")),
        )

    def _error(self, message: dict[str, Any]) -> RankError:
        error = message.get("error") if isinstance(message.get("error"), dict) else {}
        lines = error.get("traceback") if isinstance(error.get("traceback"), list) else []
        return RankError(
            exception=str(error.get("exception", "Exception"))[:200],
            message=str(error.get("message", ""))[:2000],
            traceback=tuple(RankError.tidy_traceback([str(line) for line in lines])),
            divergence=Divergence.from_json(error.get("divergence")),
        )


def _served(watch: phases.HangWatch | None) -> None:
    """The parent answered the child: the child's wait for it was not the rank's."""
    if watch is not None:
        watch.served(now=time.monotonic())


def _int(message: dict[str, Any], key: str) -> int:
    value = message.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise RankFailed(RankError(exception="ProtocolError", message=f"{key} is not an integer: {value!r}"[:200]))
    return value


def _bool(message: dict[str, Any], key: str) -> bool:
    value = message.get(key)
    if not isinstance(value, bool):
        raise RankFailed(RankError(exception="ProtocolError", message=f"{key} is not a boolean: {value!r}"[:200]))
    return value


def _float(message: dict[str, Any], key: str) -> float:
    value = message.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise RankFailed(RankError(exception="ProtocolError", message=f"{key} is not a number: {value!r}"[:200]))
    return float(value)


def _check_row(row: MetricRow) -> None:
    """The types a stored row needs (the database and the merge rely on them)."""
    if not isinstance(row.step, int) or row.step < 0:
        raise ValueError(f"step {row.step!r}")
    numbers = (
        row.loss,
        row.grad_norm,
        row.loss_scale,
        row.step_time_s,
        row.tokens_per_s,
        row.eval_loss,
        row.checkpoint_blocked_s,
    )
    if any(v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))) for v in numbers):
        raise ValueError("a number that is not one")
    if not all(isinstance(v, int) for v in (*row.mem_peak_bytes, row.mem_planned_bytes)):
        raise ValueError("bytes that are not integers")

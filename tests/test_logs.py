"""Job logs, piece by piece: a rank's output captured line by line and shipped in order within its
bound (workers.runtime.capture), the supervisor's side (HeldLines), and the database's (service.store.log_lines:
each line stored once, the bound kept with its marker), on SQLite and PostgreSQL; and the bound on
a real job. The whole path through Ray and the API is also in test_python_jobs (lines of every
rank, follow, a rank's traceback) and test_faults (no line lost across service restarts).

Packages: workers.runtime, service.store, service.api, service.dashboard.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sys
import threading
import time

from sqlalchemy import select

from service.store.log_lines import log_acks, read_logs, store_logs
from service.store.tables import Job, LogLine
from workers.records import OutputLine
from workers.runtime.capture import MAX_LINE_CHARS, HeldLines, OutputCapture

from conftest import make_settings, serve
from helpers import TERMINAL, job_body, wait_job


class Receiver:
    """Stands in for the supervisor: takes batches, delivers each when released (or at once)."""

    def __init__(self, *, hold: bool = False) -> None:
        self.batches: list[list[OutputLine]] = []
        self.released = threading.Event()
        if not hold:
            self.released.set()

    def send(self, lines: list[OutputLine]) -> int:
        self.batches.append(lines)
        return len(self.batches)

    def delivered(self, handle: int, timeout_s: float | None) -> bool:
        return self.released.wait(timeout_s)

    @property
    def lines(self) -> list[OutputLine]:
        return [line for batch in self.batches for line in batch]


def test_stdout_stderr_and_logging_are_captured_line_by_line_in_order_and_still_written(capfd):
    receiver = Receiver()
    streams = (sys.stdout, sys.stderr)
    level = logging.getLogger().level
    with OutputCapture(rank=3, send=receiver.send, delivered=receiver.delivered, max_bytes=1 << 20) as capture:
        print("first")
        print("a partial", end="")
        sys.stderr.write(" ignored\rerror line\n")
        print(" line")
        logging.getLogger("user.code").info("logged at %s", "info")
        logging.getLogger("user.code").debug("below INFO: not kept")
        print("two\nlines")
        capture.print_exception(_raised(ValueError("bad value")))
        print("no newline at the end", end="")
    got = [(line.stream, line.line) for line in receiver.lines]
    assert got[:6] == [
        ("stdout", "first"),
        ("stderr", "error line"),  # a carriage return starts the line again, as on a terminal
        ("stdout", "a partial line"),
        ("log", "INFO user.code: logged at info"),
        ("stdout", "two"),
        ("stdout", "lines"),
    ]
    traceback = [text for stream, text in got[6:-1]]
    assert traceback[0] == "Traceback (most recent call last):" and traceback[-1] == "ValueError: bad value", got
    assert got[-1] == ("stdout", "no newline at the end")
    assert [line.n for line in receiver.lines] == list(range(len(got))) and {line.rank for line in receiver.lines} == {
        3
    }
    assert all(isinstance(line.time, float) for line in receiver.lines)
    out, err = capfd.readouterr()  # each still went where it went before
    assert "first\n" in out and "two\nlines\n" in out and "error line" in err and "logged at info" in err
    assert (sys.stdout, sys.stderr) == streams and logging.getLogger().level == level  # put back
    assert all(type(handler).__name__ != "_LogHandler" for handler in logging.getLogger().handlers)


def _raised(exc: ValueError) -> ValueError:
    try:
        raise exc
    except ValueError as caught:
        return caught


def test_a_long_line_is_cut_into_pieces():
    receiver = Receiver()
    with OutputCapture(rank=0, send=receiver.send, delivered=receiver.delivered, max_bytes=1 << 20):
        print("x" * (2 * MAX_LINE_CHARS + 5))
    assert [len(line.line) for line in receiver.lines] == [MAX_LINE_CHARS, MAX_LINE_CHARS, 5]


def test_a_batch_waits_for_the_one_before_and_past_the_bound_the_oldest_waiting_are_dropped_with_a_marker():
    receiver = Receiver(hold=True)
    capture = OutputCapture(rank=1, send=receiver.send, delivered=receiver.delivered, max_bytes=100)
    with capture:
        print("0123456789")
        _until(lambda: len(receiver.batches) == 1)  # shipped by the shipper thread, not yet delivered
        for i in range(30):  # 30 lines of 10 bytes wait behind it: 20 of them past the bound
            print(f"line {i:5d}")
        assert capture._ship(wait_s=0.0) is False  # nothing more is sent while the first is undelivered
        assert len(receiver.batches) == 1
        receiver.released.set()
    first, second = receiver.batches
    assert [line.line for line in first] == ["0123456789"]
    marker, *kept = second
    assert marker.stream == "marker" and marker.line.startswith("[zero1] 20 lines (200 bytes) of rank 1 were dropped")
    assert [line.line for line in kept] == [f"line {i:5d}" for i in range(20, 30)]
    assert marker.n == 20 and [line.n for line in kept] == list(range(21, 31))  # the marker in their place


def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def _line(rank: int, n: int, text: str, *, at: float = 0.0, stream: str = "stdout") -> OutputLine:
    return OutputLine(rank=rank, n=n, time=1_700_000_000.0 + at, stream=stream, line=text)


def test_the_supervisor_holds_lines_until_acked_and_drops_the_oldest_past_its_bound():
    held = HeldLines(max_bytes=40)
    held.add([_line(0, n, f"r0 {n:05d}") for n in range(3)])  # 8 bytes each
    held.add([_line(1, n, f"r1 {n:05d}") for n in range(3)])
    assert [(line.rank, line.n) for line in held.after({})] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)][1:]
    assert held.dropped == (1, 8)
    assert [(line.rank, line.n) for line in held.after({0: 1, 1: 0})] == [(0, 2), (1, 1), (1, 2)]
    assert [(line.rank, line.n) for line in held.after({})] == [(0, 2), (1, 1), (1, 2)]  # acked lines are gone


def _job(session, attempt: int = 0) -> Job:
    job = Job(name="logs", status="running", spec={}, plan={}, num_gpus=2, steps=10, attempt=attempt)
    session.add(job)
    session.flush()
    return job


def test_lines_are_stored_once_each_ranks_in_order_interleaved_by_time(database):
    lines = [_line(0, 0, "a", at=1), _line(1, 0, "b", at=0.5), _line(0, 1, "c", at=0.2), _line(1, 1, "d", at=2)]
    with database.session() as session:
        job = _job(session)
        assert store_logs(session, job, lines, dropped=(0, 0), max_bytes=1 << 20) == 4
        # a poll that hands the same lines on again (its answer was not acked) stores nothing twice
        assert store_logs(session, job, lines + [_line(0, 2, "e", at=3)], dropped=(0, 0), max_bytes=1 << 20) == 1
        assert log_acks(job) == {0: 2, 1: 1}
        data, cursor = read_logs(session, job, after=0, limit=100)
    # rank 0's "c" was written (by its clock) before "a", but it is the rank's second line: each
    # rank's order is the order it wrote in; the ranks are interleaved by time
    assert [row["line"] for row in data] == ["b", "a", "c", "d", "e"]
    assert cursor == data[-1]["seq"] and [row["seq"] for row in data] == sorted(row["seq"] for row in data)
    with database.session() as session:
        job = session.get(Job, job.id)
        only_rank_1, _ = read_logs(session, job, after=0, limit=100, rank=1)
        page, next_cursor = read_logs(session, job, after=data[1]["seq"], limit=2)
        nothing, same = read_logs(session, job, after=cursor, limit=100)
        job.attempt = 1  # a new attempt's ranks count from 0 again
        assert log_acks(job) == {}
        assert store_logs(session, job, [_line(0, 0, "attempt 1")], dropped=(0, 0), max_bytes=1 << 20) == 1
    assert [row["line"] for row in only_rank_1] == ["b", "d"]
    assert [row["line"] for row in page] == ["c", "d"] and next_cursor == page[-1]["seq"]
    assert (nothing, same) == ([], cursor)


def test_past_the_bound_the_oldest_lines_go_and_one_marker_stands_in_their_place(database):
    with database.session() as session:
        job = _job(session)
        for start in range(0, 40, 10):  # 40 lines of 10 bytes into a bound of 105
            batch = [_line(n % 2, n // 2, f"line {n:05d}", at=n) for n in range(start, start + 10)]
            store_logs(session, job, batch, dropped=(0, 0), max_bytes=105)
        data, _ = read_logs(session, job, after=0, limit=100)
        state = job.log_state
    marker, *kept = data
    assert [row["line"] for row in kept] == [f"line {n:05d}" for n in range(30, 40)]  # the newest 100 bytes
    assert marker["stream"] == "marker" and (marker["rank"], marker["attempt"]) == (None, None)
    assert marker["line"] == (
        "[zero1] 30 earlier lines (300 bytes) were dropped: a job keeps the newest 105 bytes of its logs "
        "(ZERO1_LOG_MAX_BYTES)"
    )
    assert marker["seq"] < kept[0]["seq"] and state["bytes"] == 100
    with database.session() as session:  # what the supervisor dropped is counted too, and the marker is one
        job = session.get(Job, job.id)
        store_logs(session, job, [_line(0, 40, "after a drop", at=50)], dropped=(7, 70), max_bytes=105)
        markers = session.scalars(select(LogLine).where(LogLine.job_id == job.id, LogLine.stream == "marker")).all()
        data, _ = read_logs(session, job, after=0, limit=100)
    assert [m.line.split(" earlier")[0] for m in markers] == ["[zero1] 38"]  # 30 + 7 + the 1 trimmed for the new line
    assert data[-1]["line"] == "after a drop" and [row["stream"] for row in data[:2]] == ["marker", "stdout"]
    assert data[1]["line"] == "line 00031"


def test_a_job_that_logs_more_than_its_bound_keeps_its_newest_lines_and_the_marker(ray_cluster, tmp_path):
    """Rank 0 of the built-in trainer logs a line per step: 60 of them are about 4 KB, twice the bound."""
    steps = 60
    bound = 2048
    with serve(make_settings(tmp_path, log_max_bytes=bound)) as client:
        job = client.post("/v1/jobs", json=job_body(num_gpus=1, steps=steps)).json()
        done = wait_job(client, job["id"], lambda j: j["status"] in TERMINAL)
        assert done["status"] == "succeeded", done
        data = client.get(f"/v1/jobs/{job['id']}/logs", params={"limit": 10_000}).json()["data"]
    stored = [(x["seq"], x["rank"], x["stream"], x["line"][:60]) for x in data]
    # one marker, where the lines were dropped: first when every drop trimmed what was stored; after
    # the first lines stored when the supervisor dropped lines that waited for a poll that came late
    at = [i for i, x in enumerate(data) if x["stream"] == "marker"]
    assert len(at) == 1, stored
    at = at[0]
    marker = data[at]
    kept = data[:at] + data[at + 1 :]
    counts = re.fullmatch(r"\[zero1\] ([\d,]+) earlier lines \(([\d,]+) bytes\) were dropped: .*", marker["line"])
    assert counts and f"the newest {bound:,} bytes" in marker["line"], marker
    dropped, size = (int(count.replace(",", "")) for count in counts.groups())
    run = [
        (i, int(x["line"].split("step ")[1].split("/")[0]))
        for i, x in enumerate(data)
        if "zero1.train: step " in x["line"]
    ]
    steps_kept = [step for _, step in run]
    assert steps_kept == sorted(set(steps_kept)) and steps_kept[-1] == steps - 1 and len(steps_kept) < steps, stored
    first = len(run) - 1  # the newest run of consecutive steps begins at run[first]
    while first > 0 and run[first - 1][1] == run[first][1] - 1:
        first -= 1
    assert at < run[first][0], stored  # the newest lines, in order, come after the marker
    assert sum(len(x["line"].encode()) for x in kept) <= bound < sum(len(x["line"].encode()) for x in kept) + size
    # lines dropped before they were stored (more than the bound waited in the rank, or in the supervisor)
    # are counted by the same one marker
    assert dropped >= steps - len(steps_kept), data  # the step lines not kept, and at least rank 0's first line


class Reader:
    """The request, as the follow stream sees it: connected until `gone` is set."""

    def __init__(self) -> None:
        self.gone = False

    async def is_disconnected(self) -> bool:
        return self.gone


def test_follow_ends_when_its_client_goes_and_after_the_last_line_of_a_job_that_ended(database):
    from service.api.routes.jobs import _follow

    with database.session() as session:
        job = _job(session)  # running
        store_logs(session, job, [_line(0, 0, "hello"), _line(1, 0, "world")], dropped=(0, 0), max_bytes=1 << 20)
    selection = {"rank": None, "attempt": None, "limit": 100}

    async def until_the_client_goes() -> tuple[str, list[str]]:
        reader = Reader()
        stream = _follow(reader, database, job.id, after=0, **selection)
        first = await anext(stream)
        reader.gone = True
        return first, [message async for message in stream]

    first, rest = asyncio.run(until_the_client_goes())
    assert first.startswith("id: ") and '"line":"hello"' in first
    assert [m for m in rest if m.startswith("event: end")] == [] and len(rest) <= 1  # "world" at most, no end

    with database.session() as session:
        session.get(Job, job.id).status = "succeeded"

    async def all_of_it() -> list[str]:
        return [message async for message in _follow(Reader(), database, job.id, after=0, **selection)]

    messages = asyncio.run(all_of_it())
    assert ['"line":"hello"' in messages[0], '"line":"world"' in messages[1]] == [True, True]
    assert messages[2:] == ['event: end\ndata: {"status": "succeeded"}\n\n']


def test_the_docs_state_the_log_panels_numbers_as_the_page_uses_them():
    """docs/api.md said the panel keeps 1,000 lines where the page keeps 5,000 (issue 32)."""
    from pathlib import Path

    from service.dashboard import routes

    docs = " ".join((Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text().split())
    assert f"newest {routes.LOG_LINES:,} lines at first" in docs
    assert f"holds the newest {routes.LOG_KEEP:,} lines" in docs

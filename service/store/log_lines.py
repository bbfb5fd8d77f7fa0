"""A job's logs in the database: every rank's lines stored once, in order, within the job's bound
(ZERO1_LOG_MAX_BYTES: the oldest lines dropped, one marker line in their place), and read back
in pages after a cursor (a line's seq, its id). A finished job's lines are deleted once it ended
more than ZERO1_LOG_RETENTION_DAYS ago (expire_logs), one marker line left in their place.

What is stored is acknowledged to the supervisor by each rank's last stored n (log_acks), kept
on the job in the transaction that stores the lines: a line is stored once even when a poll
hands it on again, and the acks survive the deletion of the lines they name.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import delete, exists, insert, or_, select
from sqlalchemy.orm import Session

from service.store.tables import Job, LogLine
from workers.records import OutputLine

_TRIM_CHUNK = 1000
_FINISHED = ("succeeded", "failed", "cancelled", "stopped_early")


def log_acks(job: Job) -> dict[int, int]:
    """Rank -> the n of its last line of the job's current attempt that is stored."""
    return {int(rank): n for rank, n in _state(job)["acks"].items()}


def store_logs(session: Session, job: Job, lines: list[OutputLine], *, dropped: tuple[int, int], max_bytes: int) -> int:
    """Store the lines of the job's current attempt not stored yet, each rank's in its order and
    the ranks' interleaved by time; `dropped` is what its supervisor has dropped since the attempt
    began (lines, bytes); a rank's marker line adds the lines it stands for to the job's one marker.
    Then keep the job within max_bytes. The number of lines stored."""
    state = _state(job)
    acks = state["acks"]
    by_rank: dict[int, list[OutputLine]] = defaultdict(list)
    for line in sorted(lines, key=lambda line: (line.rank, line.n)):
        if line.n > acks.get(str(line.rank), -1):
            by_rank[line.rank].append(line)
    merged = list(heapq.merge(*by_rank.values(), key=lambda line: line.time))  # each rank's order kept
    fresh = [line for line in merged if line.stream != "marker"]
    held_lines, held_bytes = state["held_dropped"]
    new_lines = dropped[0] - held_lines
    new_bytes = dropped[1] - held_bytes
    for marker in (line for line in merged if line.stream == "marker"):  # a rank's: counted by the job's marker
        new_lines += marker.dropped[0]
        new_bytes += marker.dropped[1]
    state["held_dropped"] = list(dropped)
    if new_lines > 0:  # before this batch: its lines were written after the ones dropped
        _mark(session, job, state, lines=new_lines, size=new_bytes, max_bytes=max_bytes, at=None)
    for line in merged:
        acks[str(line.rank)] = line.n
    if fresh:
        session.execute(insert(LogLine), [_row(job, line) for line in fresh])
        state["bytes"] += sum(line.size for line in fresh)
    if state["bytes"] > max_bytes:
        _trim(session, job, state, max_bytes=max_bytes)
    if state != job.log_state:  # a new dict: the JSON column is written (only when it changed)
        job.log_state = state
    return len(fresh)


def read_logs(
    session: Session, job: Job, *, after: int, limit: int, rank: int | None = None, attempt: int | None = None
) -> tuple[list[dict[str, Any]], int]:
    """The job's lines after seq `after`, oldest first (at most `limit`), only `rank`'s and only
    `attempt`'s when given (the marker line is in every selection); and the cursor for the next
    page (the last seq, or `after` when there is none)."""
    query = select(LogLine).where(LogLine.job_id == job.id, LogLine.id > after).order_by(LogLine.id).limit(limit)
    if rank is not None:
        query = query.where(or_(LogLine.rank == rank, LogLine.rank.is_(None)))
    if attempt is not None:
        query = query.where(or_(LogLine.attempt == attempt, LogLine.attempt.is_(None)))
    data = [
        {
            "seq": row.id,
            "time": row.time,
            "rank": row.rank,
            "attempt": row.attempt,
            "stream": row.stream,
            "line": row.line,
        }
        for row in session.scalars(query)
    ]
    return data, data[-1]["seq"] if data else after


def _state(job: Job) -> dict[str, Any]:
    """A copy of the job's log state; the acks and the supervisor's drop count start again with each attempt."""
    state = dict(job.log_state or {})
    state.setdefault("bytes", 0)
    state.setdefault("dropped_lines", 0)
    state.setdefault("dropped_bytes", 0)
    if state.get("attempt") != job.attempt:
        state.update(attempt=job.attempt, acks={}, held_dropped=[0, 0])
    else:
        state["acks"] = dict(state["acks"])
    return state


def _row(job: Job, line: OutputLine) -> dict[str, Any]:
    return {
        "job_id": job.id,
        "attempt": job.attempt,
        "rank": line.rank,
        "time": datetime.fromtimestamp(line.time, UTC),
        "stream": line.stream,
        "line": line.line,
    }


def _trim(session: Session, job: Job, state: dict[str, Any], *, max_bytes: int) -> None:
    """Delete the job's oldest lines until its kept bytes are within max_bytes; the marker goes
    in the place of the last deleted."""
    excess = state["bytes"] - max_bytes
    lines = size = 0
    gone: list[int] = []
    query = (
        select(LogLine.id, LogLine.line)
        .where(LogLine.job_id == job.id, LogLine.stream != "marker")
        .order_by(LogLine.id)
        .execution_options(yield_per=_TRIM_CHUNK)
    )
    result = session.execute(query)
    try:
        for line_id, text in result:
            if size >= excess:
                break
            gone.append(line_id)
            lines += 1
            size += len(text.encode("utf-8", "replace"))
    finally:
        result.close()  # read in chunks, and left before the end
    for start in range(0, len(gone), _TRIM_CHUNK):
        session.execute(delete(LogLine).where(LogLine.id.in_(gone[start : start + _TRIM_CHUNK])))
    state["bytes"] -= size
    if gone:
        _mark(session, job, state, lines=lines, size=size, max_bytes=max_bytes, at=gone[-1])


def _mark(
    session: Session, job: Job, state: dict[str, Any], *, lines: int, size: int, max_bytes: int, at: int | None
) -> None:
    """Count `lines` more dropped and put the job's one marker line at seq `at` (None: after the
    lines stored so far)."""
    state["dropped_lines"] += lines
    state["dropped_bytes"] += size
    session.execute(delete(LogLine).where(LogLine.job_id == job.id, LogLine.stream == "marker", LogLine.rank.is_(None)))
    text = (
        f"[zero1] {state['dropped_lines']:,} earlier lines ({state['dropped_bytes']:,} bytes) were dropped: "
        f"a job keeps the newest {max_bytes:,} bytes of its logs (ZERO1_LOG_MAX_BYTES)"
    )
    marker = {"job_id": job.id, "attempt": None, "rank": None, "time": datetime.now(UTC), "stream": "marker"}
    session.execute(insert(LogLine), [{**marker, "line": text, **({"id": at} if at is not None else {})}])


def expire_logs(session: Session, *, finished_before: datetime, max_jobs: int, max_rows: int) -> tuple[int, int]:
    """Delete the lines of jobs that finished before `finished_before`, at most `max_rows` rows of at most
    `max_jobs` jobs, a chunk per statement; a job whose lines are all gone gets one marker line saying
    why. (jobs emptied, rows deleted): the caller commits, and calls again while there is more."""
    lines = select(LogLine.id).where(LogLine.job_id == Job.id, LogLine.stream != "marker")
    candidates = session.scalars(
        select(Job)
        .where(Job.status.in_(_FINISHED), Job.finished_at < finished_before, exists(lines))
        .order_by(Job.id)
        .limit(max_jobs)
    )
    jobs_emptied = rows = 0
    for job in list(candidates):
        while rows < max_rows:
            chunk = select(LogLine.id).where(LogLine.job_id == job.id, LogLine.stream != "marker")
            chunk = chunk.order_by(LogLine.id).limit(min(_TRIM_CHUNK, max_rows - rows))
            ids = list(session.scalars(chunk))
            if not ids:
                _mark_expired(session, job)
                jobs_emptied += 1
                break
            rows += session.execute(delete(LogLine).where(LogLine.id.in_(ids))).rowcount
    return jobs_emptied, rows


def _mark_expired(session: Session, job: Job) -> None:
    """The job's one marker line, now saying that its lines were deleted and when it ended."""
    state = _state(job)
    session.execute(delete(LogLine).where(LogLine.job_id == job.id, LogLine.stream == "marker", LogLine.rank.is_(None)))
    text = (
        f"[zero1] this job's log lines were deleted: it ended at {job.finished_at:%Y-%m-%d %H:%M:%S} UTC, "
        "longer ago than the service keeps logs (ZERO1_LOG_RETENTION_DAYS)"
    )
    marker = {"job_id": job.id, "attempt": None, "rank": None, "time": datetime.now(UTC), "stream": "marker"}
    session.execute(insert(LogLine), [{**marker, "line": text}])
    job.log_state = {**state, "bytes": 0, "expired": True}

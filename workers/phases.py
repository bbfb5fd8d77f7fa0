"""Where a rank is in its step, and when its parent calls it hung (a job's health.hang_factor and
health.hang_min_s, workers/config.py HealthConfig).

The training code marks each phase as it enters it (begin_step(step) as a step begins, then
enter("forward"), enter("reduce_scatter"), enter("checkpoint"), ...): one global store each,
nothing else on the hot path. The rank's child reads the marker from a thread of its own and tells
its parent when it has moved (workers/runtime/rank_child.py); the parent feeds a HangWatch with
those reports and the rows of the steps completed and asks it, at least once a second, whether the
rank is hung (workers/runtime/rank_parent.py, which then has the child's stacks written into its
log and ends the attempt). The child is not trusted to say it is hung: it may be stuck in user code.

The rule: a rank is hung when it has made no progress for longer than
`max(hang_min_s, hang_factor x the median time of its completed steps)` (the last MEDIAN_STEPS of
this attempt, as its rows report them), and for hang_min_s alone before its first step completes
(setting up, the first step's compilation and warm-up). Progress is a completed step, and entering
or leaving work that is not a step (OUTSIDE_STEPS: setting up, evaluating, checkpointing, writing
the final model), so that time spent there does not count against a step, nor a step's against
it; a request the parent answers (a checkpoint read through it, rank 0's "stop?") restarts the
clock too: that wait is the parent's. A rank waiting in a collective (COLLECTIVES) is waiting for a
peer: its limit is PEER_GRACE_S longer, so that the rank the others wait for is found first, its
stacks are the ones in the log and its failure is the one the job reports (workers.records.root_cause).

May import: workers.records.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import deque
from dataclasses import dataclass

from workers.records import COLLECTIVES

SETUP = "setup"
"""From the child's start to its first step: joining the group, building the model, resuming."""
BETWEEN_STEPS = "between_steps"
"""What the parent says of a rank that completed a step and has not said where it is since."""
OUTSIDE_STEPS = frozenset({SETUP, "eval", "checkpoint", "final"})
"""Work that is not a step: entering or leaving it is progress, and its time is not a step's."""
MEDIAN_STEPS = 99
"""Completed steps whose median sets the limit: the last ones of this attempt."""
PEER_GRACE_S = 5.0
"""How much longer a rank waiting in a collective is given than a rank elsewhere."""
_NAME = re.compile(r"[^A-Za-z0-9_.-]")

_at: tuple[int, str] = (-1, SETUP)


# --------------------------------------------------------------------------- the marker (the child's side)


def begin_step(step: int) -> None:
    """Step `step` begins (its data is read first)."""
    global _at
    _at = (step, "data")


def enter(phase: str) -> None:
    """The rank enters `phase` of its current step (or of the work between steps)."""
    global _at
    _at = (_at[0], phase)


def current() -> tuple[int, str]:
    """(the step, the phase) the rank is in: step -1 before its first."""
    return _at


def phase_name(text: object) -> str:
    """A phase as a child reported it, fit for an event: letters, digits and _.- only, at most 40."""
    return _NAME.sub("_", str(text))[:40] or "unknown"


# --------------------------------------------------------------------------- the decision (the parent's side)


def training_stack(dumped: list[str]) -> list[str]:
    """The training thread's frames out of faulthandler's dump of every thread (`dumped`, its lines), as
    a traceback has them: most recent call last; [] without it. The training thread is the one that
    runs the child's rank (workers/runtime/rank_child.py run_rank)."""
    blocks: list[list[str]] = []
    for line in dumped:
        if line.rstrip().endswith("(most recent call first):"):
            blocks.append([])
        elif blocks and line.strip():
            blocks[-1].append(line.rstrip())
    training = next((block for block in blocks if any(line.endswith(" in run_rank") for line in block)), [])
    return list(reversed(training))


def limit_s(step_times_s: list[float] | tuple[float, ...], *, hang_factor: float, hang_min_s: float) -> float:
    """Seconds without progress after which a rank is hung: hang_factor times the median of
    `step_times_s`, at least hang_min_s; hang_min_s alone before any step completed."""
    if not step_times_s:
        return hang_min_s
    return max(hang_min_s, hang_factor * statistics.median(step_times_s))


def phase_limit_s(limit: float, phase: str) -> float:
    """The limit for a rank in `phase`: PEER_GRACE_S longer in a collective (it waits for a peer)."""
    return limit + PEER_GRACE_S if phase in COLLECTIVES else limit


@dataclass(frozen=True, slots=True, kw_only=True)
class Hang:
    """A rank found hung: where, how long, and against what."""

    step: int
    """The step it was at; -1 before its first."""
    phase: str
    waited_s: float
    """Seconds since its last progress."""
    limit_s: float
    median_s: float | None
    """The median of its completed steps' times; None before its first completed."""

    def message(self, rank: int) -> str:
        """`rank 1 hung at step 3 for 12.0 s (median step 0.05 s, limit 10.0 s) in forward`: the
        phase last (workers.records.RankError.is_peer_wait reads it)."""
        where = f"at step {self.step}" if self.step >= 0 else "before its first step"
        median = "no step completed yet" if self.median_s is None else f"median step {self.median_s:.3g} s"
        return (
            f"rank {rank} hung {where} for {self.waited_s:.1f} s ({median}, limit {self.limit_s:.1f} s) in {self.phase}"
        )


class HangWatch:
    """One attempt of one rank, as its parent sees it: fed the rows of completed steps (stepped),
    the child's reports of where it is (at) and the requests the parent answered (served); hung(now)
    says whether the rank is hung. Times are time.monotonic()'s, passed in."""

    def __init__(self, *, hang_factor: float, hang_min_s: float, now: float) -> None:
        self.hang_factor = hang_factor
        self.hang_min_s = hang_min_s
        self.step_times_s: deque[float] = deque(maxlen=MEDIAN_STEPS)
        self.since = now
        """The clock's origin: the last progress."""
        self.step = -1
        self.phase = SETUP

    def stepped(self, *, step: int, step_time_s: float, now: float) -> None:
        """A row: `step` completed in step_time_s (its run, without its evaluation or checkpoint)."""
        if math.isfinite(step_time_s) and step_time_s >= 0:
            self.step_times_s.append(step_time_s)
        self.since = now
        if step >= self.step:  # the next one is under way, until the child says where it is
            self.step = step + 1
            self.phase = BETWEEN_STEPS

    def at(self, *, step: int, phase: str, now: float) -> None:
        """The child says it is at `phase` of `step`."""
        if phase != self.phase and (phase in OUTSIDE_STEPS or self.phase in OUTSIDE_STEPS):
            self.since = now
        self.step = step
        self.phase = phase

    def served(self, *, now: float) -> None:
        """The parent answered the child's request: the time the child waited for it was the parent's."""
        self.since = now

    def hung(self, now: float) -> Hang | None:
        """The hang, when the rank has made no progress for longer than its limit; else None."""
        times = tuple(self.step_times_s)
        limit = phase_limit_s(limit_s(times, hang_factor=self.hang_factor, hang_min_s=self.hang_min_s), self.phase)
        waited = now - self.since
        if waited <= limit:
            return None
        median = statistics.median(times) if times else None
        return Hang(step=self.step, phase=self.phase, waited_s=waited, limit_s=limit, median_s=median)

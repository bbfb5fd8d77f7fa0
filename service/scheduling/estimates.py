"""When each queued job starts, estimated (issue 44): the queue's policy replayed forward on a snapshot.

From the snapshot service/scheduling/dispatch.py reads (the jobs holding GPUs, the queued ones in the
queue's order, the stops in flight) the replay moves from event to event: a job holding GPUs ends
after its steps left x its step time (Holding.step_time_s), a stop asked ends after the victim's step
(and its checkpoint, unless one is due there), a job grows old enough to be preempted, a started one
begins to train. At each the policy (queue_policy.decide, as the scheduler calls it) starts, backfills
and preempts as it would: a job it starts holds its GPUs for its start-up (Waiting.restart_s) and its
steps left; a victim stopped goes back to the queue with its steps left; one shrunk trains on at its
smaller N. A queued job's estimate is the time the replay starts it.

Unknown (None): a start that depends on when a job of unknown length ends. A job's length is unknown
while it has no step time (no row stored yet; a queued job that never trained, once the replay starts
it). The replay runs twice, such jobs ending at once (after their start-up) and never: a start the
two replays agree on is the estimate, one they do not is unknown. What the replay cannot see makes an
estimate wrong, not unknown: jobs submitted later (one of a higher priority goes first), jobs that
fail, are cancelled or suspended, elastic jobs growing, a step time that changes.

Pure, as the policy is: no database, no Ray, no clock.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from service.scheduling.queue_policy import Decision, Holding, Preempt, Start, Waiting, checkpoint_due

Policy = Callable[[Iterable[Waiting], list[Holding], dict[int, Preempt]], Decision]
"""(queue in its order, the jobs holding GPUs, the preemptions in flight) -> the policy's decision."""


@dataclass(slots=True, kw_only=True)
class _Held:
    """A job holding GPUs in the replay."""

    job: Holding
    """As the policy sees it, its age and step as of the replay's start (brought up to date by at())."""
    since: float
    """When its attempt started (or was resized), in seconds of the replay: negative for one already running."""
    trains_at: float
    """When it trains: its steps left count down from here."""
    steps_left: float | None
    unknown_s: float
    """How long it trains if its length is unknown: at once (_AT_ONCE_S) or never (inf)."""
    leaves_at: float = math.inf
    """When the stop asked of it ends (inf: none asked)."""
    stop: Preempt | None = None
    """The preemption that stop carries out; None with leaves_at: it leaves and does not come back."""
    step_s: float | None = field(init=False)
    """Seconds a step takes at its N (None: unknown)."""

    def __post_init__(self) -> None:
        self.step_s = self.job.step_time_s

    def ends_at(self) -> float:
        """When it ends, if nothing stops it (inf: unknown)."""
        if self.steps_left is None or self.step_s is None:
            return self.trains_at + self.unknown_s
        return self.trains_at + self.steps_left * self.step_s

    def done(self, t: float) -> float:
        """Steps trained from the replay's start to `t`."""
        if self.step_s is None or not self.step_s > 0 or t <= self.trains_at:
            return 0.0
        return (t - self.trains_at) / self.step_s

    def left(self, t: float) -> float | None:
        return None if self.steps_left is None else max(0.0, self.steps_left - self.done(t))

    def at(self, t: float) -> Holding:
        """As the policy would see it at `t` (built field by field: dataclasses.replace is the replay's cost)."""
        job = self.job
        done = int(self.done(t))
        step = job.step if job.step is None and done == 0 else (-1 if job.step is None else job.step) + done
        return Holding(
            id=job.id,
            priority=job.priority,
            owner=job.owner,
            gpus=job.gpus,
            sizes=job.sizes,
            running=t >= self.trains_at and not job.ending,
            age_s=t - self.since,
            borrowed=job.borrowed,
            backfilled=job.backfilled,
            step=step,
            steps=job.steps,
            step_gpu_s=job.step_gpu_s,
            checkpoint_every=job.checkpoint_every,
            checkpoint_step=job.checkpoint_step,
            checkpoint_s=job.checkpoint_s,
            restart_s=job.restart_s,
            ending=job.ending,
        )

    def stop_after(self, t: float) -> float:
        """When a stop asked at `t` ends: its step, and its checkpoint unless one is due there."""
        if self.step_s is None:
            return t
        checkpoint = 0.0 if checkpoint_due(self.at(t)) else self.job.checkpoint_s
        return max(t, self.trains_at) + self.step_s + checkpoint


def starts(
    queue: list[Waiting],
    holding: list[Holding],
    *,
    policy: Policy,
    in_flight: dict[int, Preempt] | None = None,
    min_runtime_s: float = 0.0,
    order: Callable[[Waiting], tuple] = lambda w: (-w.priority, w.id),
) -> dict[int, float | None]:
    """Seconds from the snapshot until each job of `queue` starts (None: unknown), the policy replayed
    on it. `in_flight`: the stops asked of `holding` and not yet done (victim id -> what). `min_runtime_s`:
    the age from which a job may be preempted (ZERO1_PREEMPT_MIN_RUNTIME_S). `order`: the queue's."""
    rules = {"policy": policy, "in_flight": in_flight or {}, "min_runtime_s": min_runtime_s, "order": order}
    soon = _replay(queue, holding, unknown_s=_AT_ONCE_S, **rules)
    known = all(h.steps is not None and h.step_gpu_s is not None for h in holding) and all(
        w.steps_left is not None and w.step_gpu_s is not None for w in queue
    )
    never = soon if known else _replay(queue, holding, unknown_s=math.inf, **rules)  # the same replay
    return {job_id: at if _same(at, never[job_id]) else None for job_id, at in soon.items()}


_AT_ONCE_S = 1e-3
"""A job of unknown length ending at once: this long after its start-up (an event after its start)."""


def _same(a: float | None, b: float | None) -> bool:
    """The two replays agree on a start (to within a tenth of a second: _AT_ONCE_S's apart)."""
    return a is not None and b is not None and math.isclose(a, b, rel_tol=0.0, abs_tol=0.1)


def _replay(
    queue: list[Waiting],
    holding: list[Holding],
    *,
    policy: Policy,
    in_flight: dict[int, Preempt],
    min_runtime_s: float,
    order: Callable[[Waiting], tuple],
    unknown_s: float,
) -> dict[int, float | None]:
    """The policy replayed from the snapshot, the jobs of unknown length training `unknown_s` (_AT_ONCE_S:
    they end at once after their start-up; inf: never): when each job of `queue` starts (None: not in it)."""
    held = {h.id: _held(h, stop=in_flight.get(h.id), unknown_s=unknown_s) for h in holding}
    waiting = sorted(queue, key=order)
    started: dict[int, float | None] = dict.fromkeys((w.id for w in queue), None)
    pending = set(started)
    t = 0.0
    for _ in range(8 * (len(queue) + len(holding)) + 64):  # a bound: each event ends, starts or stops a job
        decision = policy(waiting, [h.at(t) for h in held.values()], _stopping(held))
        for start in decision.starts:
            job = next(w for w in waiting if w.id == start.job_id)
            waiting.remove(job)
            held[job.id] = _started(job, start.n, t, start=start, unknown_s=unknown_s)
            if job.id in pending:
                started[job.id] = t
                pending.discard(job.id)
        for preempt in decision.preempts:
            victim = held[preempt.victim]
            victim.stop = preempt
            victim.leaves_at = victim.stop_after(t)
        if not pending:
            break
        # a job that begins to train or grows old enough to be preempted matters to a head that waits only
        head_waits = decision.behind is not None
        t = min(
            (at for h in held.values() for at in _events(h, min_runtime_s, head_waits=head_waits) if at > t),
            default=math.inf,
        )
        if t == math.inf:
            break  # what is left waits on jobs of unknown length
        for h in [h for h in held.values() if min(h.leaves_at, h.ends_at()) <= t]:
            del held[h.job.id]
            if h.leaves_at <= t and h.stop is not None:
                _after_stop(h, t, held=held, waiting=waiting, order=order)
    return started


def _held(h: Holding, *, stop: Preempt | None, unknown_s: float) -> _Held:
    """A job of the snapshot: trains now if it runs; a stop in flight (or a cancel, a suspend) ends after its step."""
    steps_left = None if h.steps is None else h.steps - (-1 if h.step is None else h.step) - 1
    trains_at = 0.0 if h.running else max(0.0, h.restart_s - h.age_s)  # a start under way: as long as its last
    found = _Held(job=h, since=-h.age_s, trains_at=trains_at, steps_left=steps_left, unknown_s=unknown_s)
    if stop is not None or h.ending:
        found.stop = stop
        found.leaves_at = found.stop_after(0.0)
    return found


def _started(job: Waiting, n: int, t: float, *, start: Start, unknown_s: float) -> _Held:
    holding = Holding(
        id=job.id,
        priority=job.priority,
        owner=job.owner,
        gpus=n,
        sizes=job.sizes,
        running=False,
        age_s=0.0,
        borrowed=start.borrowed,
        backfilled=start.backfilled,
        step_gpu_s=job.step_gpu_s,
        restart_s=job.restart_s,
    )
    trains_at = t + job.restart_s
    return _Held(job=holding, since=t, trains_at=trains_at, steps_left=job.steps_left, unknown_s=unknown_s)


def _stopping(held: dict[int, _Held]) -> dict[int, Preempt]:
    return {job_id: h.stop for job_id, h in held.items() if h.stop is not None}


def _events(h: _Held, min_runtime_s: float, *, head_waits: bool) -> tuple[float, ...]:
    """The times at which `h` changes what the policy sees: it ends or leaves; and, where a head waits
    (for preemptions), it begins to train, it grows old enough to be preempted."""
    if head_waits:
        return (min(h.leaves_at, h.ends_at()), h.trains_at, h.since + min_runtime_s)
    return (min(h.leaves_at, h.ends_at()),)


def _after_stop(
    h: _Held, t: float, *, held: dict[int, _Held], waiting: list[Waiting], order: Callable[[Waiting], tuple]
) -> None:
    """A victim's stop done at `t`: back in the queue (in its order) with its steps left, or trained on at
    its smaller N."""
    job = h.job
    if h.stop.to_n is None:
        bisect.insort(
            waiting,
            Waiting(
                id=job.id,
                priority=job.priority,
                owner=job.owner,
                sizes=job.sizes,
                steps_left=None if h.steps_left is None else math.ceil(h.left(t)),
                step_gpu_s=job.step_gpu_s,
                restart_s=job.restart_s,
            ),
            key=order,
        )
        return
    smaller = replace(job, gpus=h.stop.to_n, running=False, age_s=0.0, step=h.at(t).step)
    trains_at = t + job.restart_s
    held[job.id] = _Held(job=smaller, since=t, trains_at=trains_at, steps_left=h.left(t), unknown_s=h.unknown_s)

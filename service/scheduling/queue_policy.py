"""The queue's policy, as pure functions of a snapshot: which queued jobs start, at which N, and
which running jobs to preempt for the first one that cannot (issue 29; docs/api.md, "Priorities,
quotas and preemption").

The queue is ordered by priority (highest first), then submission. A job starts when its fewest
GPUs are free and its owner's quota (ZERO1_GPU_QUOTAS) holds it; the first job that cannot start
(the *head*) waits for its GPUs and the jobs behind it may start on the idle ones (backfill): those
of its priority or higher are marked backfilled, so that it may take their GPUs back. A job past
its owner's quota starts only as *borrowed*, on GPUs no job within its quota waits for. For the
head the scheduler takes GPUs from the jobs it may preempt (borrowed ones, lower priorities, those
backfilled past it), never one younger than ZERO1_PREEMPT_MIN_RUNTIME_S: shrinking elastic jobs
first, then stopping whole ones, borrowed first, then the lowest priority, then the most recently
started; and only when that frees enough for it to start. Every N the scheduler picks (a start, a
retry, a relaunch after a restart, a growth: service/scheduling/elastic.py) goes through one quota
check, `allowed_sizes`.

No database, no Ray, no clock: service/scheduling/dispatch.py reads the snapshot and carries out
the decision; benchmarks/scheduling.py replays workloads through the same code.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

Quota = Callable[[str | None], int | None]
"""An owner -> the GPUs its running jobs may hold together (None: no quota)."""


@dataclass(frozen=True, slots=True)
class Waiting:
    """A queued job, as the policy needs it."""

    id: int
    priority: int
    owner: str | None
    sizes: tuple[int, ...]
    """The N it may run at, ascending: one unless elastic."""


@dataclass(frozen=True, slots=True)
class Holding:
    """An active job (it holds GPUs), as the policy needs it."""

    id: int
    priority: int
    owner: str | None
    gpus: int
    """The N its attempt runs at."""
    sizes: tuple[int, ...]
    running: bool
    """Training now: only such a job can checkpoint and stop (one starting or restarting cannot)."""
    age_s: float
    """Seconds since its attempt started (or it was last resized)."""
    borrowed: bool = False
    backfilled: bool = False
    step: int | None = None
    """Its last stored step."""


@dataclass(frozen=True, slots=True)
class Start:
    job_id: int
    n: int
    borrowed: bool = False
    backfilled: bool = False


@dataclass(frozen=True, slots=True)
class Preempt:
    """Take GPUs from `victim`: stop it (to_n None: back to the queue) or shrink it to `to_n`."""

    victim: int
    to_n: int | None
    by: int
    by_priority: int
    frees: int


@dataclass(slots=True)
class Decision:
    starts: list[Start] = field(default_factory=list)
    preempts: list[Preempt] = field(default_factory=list)
    reasons: dict[int, str] = field(default_factory=dict)
    """Queued job id -> why it waits (only those the policy looked at)."""
    behind: str | None = None
    """Why the queued jobs it did not look at wait: behind the first that cannot start."""


def quota_room(owner: str | None, *, quota: Quota, held: Mapping[str | None, int]) -> int | None:
    """The GPUs `owner` may still take within its quota, its jobs holding `held[owner]`; None: no quota."""
    limit = quota(owner)
    return None if limit is None else limit - held.get(owner, 0)


def allowed_sizes(sizes: Iterable[int], *, free: int, room: int | None) -> list[int]:
    """The N of `sizes` (ascending) that both `free` GPUs and the owner's quota `room` (None: none) allow."""
    return [n for n in sizes if n <= free and (room is None or n <= room)]


def ahead(a: Waiting | Holding, b: Waiting | Holding) -> bool:
    """Whether `a` comes before `b` in the queue's order (priority, then submission)."""
    return (-a.priority, a.id) < (-b.priority, b.id)


def decide(
    queue: Iterable[Waiting],
    holding: list[Holding],
    *,
    total: int,
    quota: Quota = lambda owner: None,
    borrowing: bool = True,
    min_runtime_s: float = 120.0,
    in_flight: dict[int, Preempt] | None = None,
) -> Decision:
    """The starts and preemptions for `queue` (in the queue's order) given the jobs `holding` GPUs
    of `total`. `in_flight`: preemptions asked before and not yet done (victim id -> what), whose
    GPUs are counted as coming, not asked for twice. Reads the queue only as far as it must: once
    no GPU is free and the head is known, the rest wait behind it."""
    in_flight = in_flight or {}
    decision = Decision()
    free = total - sum(h.gpus for h in holding)
    held = Counter()
    for h in holding:
        held[h.owner] += h.gpus
    head: Waiting | None = None
    over: list[Waiting] = []  # past their quota: they may only borrow, after the rest
    for job in queue:
        if free <= 0 and head is not None:
            break
        room = quota_room(job.owner, quota=quota, held=held)
        if room is not None and job.sizes[0] > room:
            over.append(job)
            decision.reasons[job.id] = f"quota: {_who(job.owner)} holds {held[job.owner]} of {quota(job.owner)} GPUs"
            continue
        fits = allowed_sizes(job.sizes, free=free, room=room)
        if fits:
            backfilled = head is not None and head.priority <= job.priority  # else lower: preemptible anyway
            decision.starts.append(Start(job.id, fits[-1], backfilled=backfilled))
            free -= fits[-1]
            held[job.owner] += fits[-1]
        elif head is None:
            head = job
            decision.behind = f"behind job {job.id} (priority {job.priority})"
            decision.reasons[job.id] = f"waiting for {job.sizes[0]} GPUs, {max(free, 0)} free"
        else:
            decision.reasons[job.id] = decision.behind
    if head is None:
        if borrowing:
            free = _borrow(over, free, decision)
        return decision
    _preempt_for(
        head,
        holding,
        free=free,
        quota=quota,
        held=held,
        min_runtime_s=min_runtime_s,
        in_flight=in_flight,
        decision=decision,
    )
    return decision


def decide_fifo(queue: Iterable[Waiting], holding: list[Holding], *, total: int) -> Decision:
    """ZERO1_QUEUE_POLICY=fifo (zero1 before priorities): `queue` in submission order starts while
    its head's fewest GPUs are free, at the most that are; the head waits, and nothing overtakes it."""
    decision = Decision()
    free = total - sum(h.gpus for h in holding)
    for job in queue:
        fits = [n for n in job.sizes if n <= free]
        if not fits:
            decision.reasons[job.id] = f"waiting for {job.sizes[0]} GPUs, {max(free, 0)} free"
            decision.behind = f"behind job {job.id}"
            break
        decision.starts.append(Start(job.id, fits[-1]))
        free -= fits[-1]
    return decision


def _borrow(over: list[Waiting], free: int, decision: Decision) -> int:
    """Start the jobs past their quota on the idle GPUs, in order, each as borrowed."""
    for job in over:
        fits = [n for n in job.sizes if n <= free]
        if fits:
            decision.starts.append(Start(job.id, fits[-1], borrowed=True))
            decision.reasons.pop(job.id, None)
            free -= fits[-1]
    return free


def preemptible(victim: Holding, by: Waiting, *, within_quota: bool) -> bool:
    """Whether `by` may take `victim`'s GPUs: it is borrowed (and `by` within its quota), of a lower
    priority, or backfilled past `by`."""
    return (
        (victim.borrowed and within_quota) or victim.priority < by.priority or (victim.backfilled and ahead(by, victim))
    )


def _preempt_for(
    head: Waiting,
    holding: list[Holding],
    *,
    free: int,
    quota: Quota,
    held: Counter,
    min_runtime_s: float,
    in_flight: dict[int, Preempt],
    decision: Decision,
) -> None:
    """The preemptions that let `head` start, if any do (none when those in flight are enough)."""
    coming = sum(p.frees for p in in_flight.values())
    need = head.sizes[0] - max(free, 0) - coming
    if in_flight:
        victim = next(iter(in_flight.values()))
        step = next((h.step for h in holding if h.id == victim.victim), None)
        decision.reasons[head.id] = f"preempting job {victim.victim} (checkpoint{_at(step)} in progress)"
    if need <= 0:
        return
    limit = quota(head.owner)
    within = limit is None or held[head.owner] + head.sizes[0] <= limit
    candidates = sorted(
        (
            h
            for h in holding
            if h.running
            and h.id not in in_flight
            and h.age_s >= min_runtime_s
            and preemptible(h, head, within_quota=within)
        ),
        key=lambda h: (not h.borrowed, h.priority, h.age_s),
    )
    if sum(h.gpus for h in candidates) < need:
        return  # even all of them would not let it start: take nothing
    plan = _victims(candidates, need)
    decision.preempts.extend(
        Preempt(victim=h.id, to_n=to_n, by=head.id, by_priority=head.priority, frees=h.gpus - (to_n or 0))
        for h, to_n in plan
    )
    first = plan[0][0]
    decision.reasons[head.id] = f"preempting job {first.id} (checkpoint{_at(first.step)} in progress)"


def _victims(candidates: list[Holding], need: int) -> list[tuple[Holding, int | None]]:
    """(victim, the N it shrinks to, or None to stop it) freeing at least `need` GPUs from
    `candidates` (in preemption order, which together hold enough): shrink elastic jobs first, then
    stop whole ones; then give back what was taken past `need`, the last taken first."""
    plan: dict[int, int | None] = {}
    freed = 0
    for h in candidates:  # shrinks, each to the largest N that frees what is still needed
        if freed >= need:
            break
        smaller = [n for n in h.sizes if n < h.gpus]
        if smaller:
            enough = [n for n in smaller if h.gpus - n >= need - freed]
            plan[h.id] = enough[-1] if enough else smaller[0]
            freed += h.gpus - plan[h.id]
    for h in candidates:  # then whole jobs
        if freed >= need:
            break
        if plan.get(h.id, h.gpus) is None:
            continue
        freed += plan.get(h.id, h.gpus)  # what it still holds after any shrink
        plan[h.id] = None
    by_id = {h.id: h for h in candidates}
    for job_id in reversed(list(plan)):  # the last taken may have freed more than needed: take less
        h = by_id[job_id]
        to_n = plan[job_id]
        now_freed = h.gpus - (to_n or 0)
        spare = freed - need
        larger = [n for n in h.sizes if n < h.gpus and h.gpus - n <= now_freed and now_freed - (h.gpus - n) <= spare]
        if spare > 0 and now_freed <= spare:
            del plan[job_id]
            freed -= now_freed
        elif spare > 0 and larger and (h.gpus - larger[-1]) < now_freed:
            plan[job_id] = larger[-1]
            freed -= now_freed - (h.gpus - larger[-1])
    return [(by_id[job_id], to_n) for job_id, to_n in plan.items()]


def _at(step: int | None) -> str:
    """Where a victim's checkpoint is: the step after its last stored one."""
    return "" if step is None else f" at step {step + 1}"


def _who(owner: str | None) -> str:
    return "the anonymous user" if owner is None else owner

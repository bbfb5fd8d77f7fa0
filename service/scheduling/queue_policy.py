"""The queue's policy, as pure functions of a snapshot: which queued jobs start, at which N, and
which running jobs to preempt for the first one that cannot (issue 29; docs/api.md, "Priorities,
quotas and preemption").

The queue is ordered by priority (highest first), then submission. A job starts when its fewest
GPUs are free and its owner's quota (ZERO1_GPU_QUOTAS) holds it; the first job that cannot start
(the *head*) waits for its GPUs and the jobs behind it may start on the idle ones (backfill): those
of its priority or higher are marked backfilled, so that it may take their GPUs back. A job past
its owner's quota starts only as *borrowed*, on GPUs no job within its quota waits for. For the
head the scheduler takes GPUs from the jobs it may preempt (borrowed ones, lower priorities, those
backfilled past it), never one younger than ZERO1_PREEMPT_MIN_RUNTIME_S, and only when that frees
enough for it to start. Of the ways to free enough (elastic jobs shrunk, whole jobs stopped) it takes
borrowed GPUs before any within a quota, then (ZERO1_PREEMPT_VICTIMS=least_loss, issue 44) the way
whose stops lose the fewest GPU-seconds (`stop_loss_gpu_s`), then the lowest priorities, shrinks
before stops, the most recently started; `lowest_priority` (before issue 44): elastic jobs shrunk
first, then whole jobs stopped, the lowest priority first, then the most recently started. Every N
the scheduler picks (a start, a retry, a relaunch after a restart, a growth:
service/scheduling/elastic.py) goes through one quota check, `allowed_sizes`.

GPU-seconds lost by a stop. A victim asked to stop trains to its next step boundary (work kept),
writes a checkpoint at that step and exits (workers/training/checkpointer.py maybe_stop,
service/scheduling/dispatch.py): no step is computed twice. What the stop costs, on top of what the
unstopped run would have spent, is time its GPUs are held without training:

- its checkpoint: `checkpoint_s` on each of its N GPUs, or nothing when a checkpoint is due at
  that step anyway (the stop coincides with it);
- its relaunch's start-up (placing, rendezvous, loading that checkpoint): `restart_s` on each GPU it
  relaunches at, N for a stop (when it starts again), the smaller N for a shrink (at once);
- when its step and checkpoint cannot end within ZERO1_PREEMPT_GRACE_S, the stop is a kill: then it
  loses its work since its last checkpoint, steps since it x step time x N (issue 44's formula), and
  the grace it trained through in vain, in place of the checkpoint.

Each fact is the victim's own, as stored (snapshot.py `with_loss_facts`): an unknown one counts 0. A
shrunk job grows back later only on GPUs nothing waits for, so its growth is not counted as lost.

No database, no Ray, no clock: service/scheduling/dispatch.py reads the snapshot and carries out
the decision; service/scheduling/estimates.py replays it forward for each queued job's estimated
start; benchmarks/scheduling.py replays workloads through the same code.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

Quota = Callable[[str | None], int | None]
"""An owner -> the GPUs its running jobs may hold together (None: no quota)."""

VictimChoice = Literal["least_loss", "lowest_priority"]
"""ZERO1_PREEMPT_VICTIMS: how the head's victims are chosen among those that may be preempted."""


@dataclass(frozen=True, slots=True)
class Waiting:
    """A queued job, as the policy needs it."""

    id: int
    priority: int
    owner: str | None
    sizes: tuple[int, ...]
    """The N it may run at, ascending: one unless elastic."""
    steps_left: int | None = None
    """Steps it has yet to train (for estimates: service/scheduling/estimates.py)."""
    step_gpu_s: float | None = None
    """GPU-seconds one of its steps takes (step time x N), from its latest row; None before it trained."""
    restart_s: float = 0.0
    """Seconds its last start took, from its launch to training (0: unknown)."""


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
    steps: int | None = None
    """Its steps in all (the spec's)."""
    step_gpu_s: float | None = None
    """GPU-seconds one of its steps takes: its latest row's step time x the N that row ran at (the same
    at any N, as far as a step's work divides among its ranks); None before its first row."""
    checkpoint_every: int = 0
    """Its spec's: a checkpoint after every such step (0: at the end only)."""
    checkpoint_step: int | None = None
    """The step of its newest complete checkpoint (None: none yet)."""
    checkpoint_s: float = 0.0
    """Seconds a checkpoint holds its training up (its last periodic one's; 0: unknown)."""
    restart_s: float = 0.0
    """Seconds its last start took, from its launch to training (0: unknown)."""
    ending: bool = False
    """A cancel, a suspend or an early stop is asked of it: it leaves at its next step, not to come back."""

    @property
    def step_time_s(self) -> float | None:
        """Seconds one of its steps takes at its N."""
        return None if self.step_gpu_s is None else self.step_gpu_s / self.gpus


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
    victims: VictimChoice = "least_loss",
    grace_s: float = 60.0,
) -> Decision:
    """The starts and preemptions for `queue` (in the queue's order) given the jobs `holding` GPUs
    of `total`. `in_flight`: preemptions asked before and not yet done (victim id -> what), whose
    GPUs are counted as coming, not asked for twice. `victims` and `grace_s` (ZERO1_PREEMPT_GRACE_S,
    past which a stop is a kill) choose the head's victims. Reads the queue only as far as it must:
    once no GPU is free and the head is known, the rest wait behind it."""
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
        victims=victims,
        grace_s=grace_s,
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
    victims: VictimChoice,
    grace_s: float,
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
    if victims == "least_loss":
        plan = least_loss(candidates, need, grace_s=grace_s)
    else:
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


def checkpoint_due(victim: Holding) -> bool:
    """Whether a checkpoint falls at the step `victim` would stop at (the one after its last stored:
    workers/training/checkpointer.py writes one after step s when (s + 1) % checkpoint_every == 0)."""
    stop_step = (-1 if victim.step is None else victim.step) + 1
    return bool(victim.checkpoint_every) and (stop_step + 1) % victim.checkpoint_every == 0


def stop_cost_s(victim: Holding, *, grace_s: float) -> float:
    """Seconds of each of its GPUs that a stop asked now loses, start-up aside: its checkpoint
    (nothing when one is due at that step), or, when its step and checkpoint cannot end within
    `grace_s`, the kill's: its steps since its last checkpoint x its step time, and the grace."""
    step_s = victim.step_time_s
    if step_s is not None and step_s + victim.checkpoint_s > grace_s:
        last = -1 if victim.step is None else victim.step
        since = last - (-1 if victim.checkpoint_step is None else victim.checkpoint_step)
        return max(since, 0) * step_s + grace_s
    return 0.0 if checkpoint_due(victim) else victim.checkpoint_s


def stop_loss_gpu_s(victim: Holding, *, to_n: int | None = None, grace_s: float = 60.0) -> float:
    """GPU-seconds lost by stopping `victim` now (to_n None: back to the queue, relaunched at its N
    later; else shrunk to to_n, relaunched at once): stop_cost_s on each of its GPUs, and its start-up
    on each GPU it relaunches at (the module's docstring)."""
    relaunched = victim.gpus if to_n is None else to_n
    return victim.gpus * stop_cost_s(victim, grace_s=grace_s) + relaunched * victim.restart_s


_Key = tuple[float, int, int, float]
"""A way's order (smaller first): the GPU-seconds lost, the priorities taken (priority x GPUs),
whole stops (shrinks before stops), the victims' ages (the most recently started first)."""


def least_loss(candidates: list[Holding], need: int, *, grace_s: float) -> list[tuple[Holding, int | None]]:
    """(victim, the N it shrinks to, or None to stop it) freeing at least `need` GPUs from
    `candidates` (which together hold enough). Borrowed GPUs go first: the least way among the
    borrowed jobs alone where they hold enough, else every borrowed job stopped and the least way
    among the others for the rest."""
    borrowed = [h for h in candidates if h.borrowed]
    if sum(h.gpus for h in borrowed) >= need:
        return _least_way(borrowed, need, grace_s=grace_s)
    rest = need - sum(h.gpus for h in borrowed)
    others = [h for h in candidates if not h.borrowed]
    return [(h, None) for h in borrowed] + _least_way(others, rest, grace_s=grace_s)


def _least_way(candidates: list[Holding], need: int, *, grace_s: float) -> list[tuple[Holding, int | None]]:
    """The way of the least _Key to free at least `need` GPUs from `candidates` (which hold enough),
    each left alone, shrunk to one of its smaller N or stopped. Exact, by dynamic programming over the
    GPUs freed (capped at `need`): O(candidates x their sizes x need)."""
    best: dict[int, tuple[_Key, tuple[tuple[Holding, int | None], ...]]] = {0: ((0.0, 0, 0, 0.0), ())}
    for h in candidates:
        ways = [(n, h.gpus - n) for n in h.sizes if n < h.gpus] + [(None, h.gpus)]
        grown = dict(best)
        for freed, (key, plan) in best.items():
            if freed >= need:
                continue
            for to_n, frees in ways:
                loss = round(stop_loss_gpu_s(h, to_n=to_n, grace_s=grace_s), 6)
                total = (key[0] + loss, key[1] + h.priority * frees, key[2] + (to_n is None), key[3] + h.age_s)
                reach = min(need, freed + frees)
                if reach not in grown or total < grown[reach][0]:
                    grown[reach] = (total, (*plan, (h, to_n)))
        best = grown
    return list(best[need][1]) if need > 0 and need in best else []


def _at(step: int | None) -> str:
    """Where a victim's checkpoint is: the step after its last stored one."""
    return "" if step is None else f" at step {step + 1}"


def _who(owner: str | None) -> str:
    return "the anonymous user" if owner is None else owner

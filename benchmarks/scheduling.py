"""The queue's policies side by side: strict FIFO against priority + backfill + preemption, the
preemption's victims chosen as before issue 44 (the lowest priority) and by least loss, and how far
the queue's estimated starts were from the real ones.

    .venv/bin/python benchmarks/scheduling.py   # --jobs 500 --seed 29 --load 0.9 --queued 10000

Replays one workload through the real scheduler (service.scheduling.scheduler.Scheduler, its
database on SQLite, its policy in service/scheduling/queue_policy.py) three times, under
ZERO1_QUEUE_POLICY=fifo, and under priority with ZERO1_PREEMPT_VICTIMS=lowest_priority and
least_loss, with a simulated launcher and clock in place of Ray: no job trains, each attempt's
progress is a function of the simulated time. Writes benchmarks/results/scheduling.json.

The workload (seeded): --jobs jobs on a 64-GPU cluster, arriving as a Poisson process whose rate
makes the offered load (the jobs' GPU-seconds over 64 GPUs x the arrival span) --load. Sizes
1-32 GPUs skewed to one GPU, run times log-normal (minutes to days), three priority classes, a
fifth of the jobs of 4 GPUs or more elastic (min_gpus = num_gpus / 2). The shape follows the
published analyses of Microsoft's Philly trace (Jeon et al., USENIX ATC 2019) and SenseTime's
Helios traces (Hu et al., SC 2021): most jobs use one GPU, a few large long jobs hold most of the
GPU time, and run times span minutes to days with a heavy tail. The parameters below are this
benchmark's own choice in that shape, not numbers fitted to either trace.

A simulated attempt needs the job's run time at its full num_gpus and progresses at N/num_gpus
of that rate at N GPUs (elastic); it holds its GPUs from its launch, starts training
START_DELAY_S later, and writes a checkpoint every CHECKPOINT_EVERY_S of progress. Asked to stop
(a preemption) it trains to its next step (STOP_DELAY_S later), then holds its GPUs
STOP_CHECKPOINT_S more for the checkpoint its exit waits for, well within ZERO1_PREEMPT_GRACE_S, and
keeps all its progress; killed (cancel) it keeps only its last periodic checkpoint, and the progress
since is counted as GPU-seconds lost. A relaunch resumes. Its polls bring the newest step's metric
row (a step is a second of work at full size), so the database holds each job's step, step time and
checkpoints as a real run's would: what least loss and the estimates read.

GPU-seconds lost to preemption: the stops' checkpoints (STOP_CHECKPOINT_S on each GPU of each attempt
stopped for now: a preemption, a shrink), the start-up of the attempts relaunched after them
(START_DELAY_S on each of their GPUs), and the work of attempts killed. Estimated starts: when a job
arrives and waits, GET /v1/queue's estimate for it (the scheduler's, Scheduler.estimated_starts, in
simulated seconds), against its first launch in the replay.

The clock is event-driven: it jumps to the next arrival, start, finish or stop, or to the moment
a job becomes old enough to preempt or to grow, and the scheduler ticks there until a tick
launches, stops or releases nothing.

Then the tick itself: with 10,000 jobs queued behind a full cluster, and behind one idle GPU that
no queued job fits (the priority policy then reads the whole queue to backfill), the median and
p95 of Scheduler.tick() over --ticks ticks, for each policy.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import func, insert, select

from service.intake import admission, submission
from service.planning.capacity import ClusterCapacity
from service.scheduling import job_states
from service.scheduling.scheduler import Scheduler
from service.schemas.requests import JobSpec
from service.schemas.responses import PlanPublic
from service.settings import Settings
from service.store.db import Database, upgrade
from service.store.tables import Job, JobEvent
from workers.memory.model import GB

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the suite's stand-ins for Ray
from fakes import FakeClock, FakeLauncher, FakeStorage, Timing

TOTAL_GPUS = 64
SIZES = (1, 2, 4, 8, 16, 32)
SIZE_WEIGHTS = (0.60, 0.13, 0.11, 0.09, 0.05, 0.02)
"""Share of jobs of each size: most use one GPU (Philly, Helios)."""
DURATION_MEDIAN_S = 30 * 60.0
DURATION_SIGMA = 1.6
"""ln(run time) ~ Normal(ln(30 min), 1.6): p90 about 4 h, p99 about 21 h, ..."""
DURATION_RANGE_S = (60.0, 7 * 86_400.0)
"""... cut to 1 min - 7 days."""
CLASSES = (("deadline", 90, 0.10), ("normal", 50, 0.60), ("best-effort", 10, 0.30))
"""(name, priority, share of jobs)."""
ELASTIC_SHARE = 0.20
"""Of the jobs of 4 GPUs or more: elastic, min_gpus = num_gpus / 2."""

START_DELAY_S = 30.0
"""From a launch to training: placing the ranks, rendezvous, loading a checkpoint."""
STOP_DELAY_S = 1.0
"""From a stop request to the end of the ranks' step (a step is a second at full size)."""
STOP_CHECKPOINT_S = 10.0
"""From the end of that step to the ranks' exit: the checkpoint's write, which the exit waits for (asynchronous
checkpoints: a periodic one due there as well as the stop's own). benchmarks/checkpoint.py wrote a GPT-2-small
shard (747 MB) to a local directory in 3.2 s and to an S3 server in 25 s."""
CHECKPOINT_BLOCKED_S = 0.3
"""What a periodic checkpoint's row says it held training up: the copy to host memory (0.23-0.29 s there)."""
CHECKPOINT_EVERY_S = 600.0
"""Periodic checkpoints, in seconds of progress at full size (a step is one such second)."""
MIN_RUNTIME_S = 120.0
GRACE_S = 60.0
GROW_INTERVAL_S = 300.0
_EPSILON_S = 1e-3
_MAX_SETTLE_TICKS = 8

RESULTS = Path(__file__).resolve().parent / "results" / "scheduling.json"
CLUSTER = ClusterCapacity(num_gpus=TOTAL_GPUS, num_gpus_free=TOTAL_GPUS, gpu_memory_bytes=80 * GB, simulated=True)
MODEL = {"kind": "mlp", "sizes": [64, 64]}


# --------------------------------------------------------------------------- the workload


@dataclass(frozen=True, slots=True, kw_only=True)
class SimJob:
    """One job of the workload."""

    arrival_s: float
    num_gpus: int
    min_gpus: int
    duration_s: float
    """Run time at num_gpus."""
    priority: int
    klass: str

    @property
    def gpu_s(self) -> float:
        return self.num_gpus * self.duration_s


def make_workload(*, num_jobs: int, seed: int, load: float) -> list[SimJob]:
    """`num_jobs` jobs, Poisson arrivals at the rate that makes the offered load `load`."""
    rng = random.Random(seed)
    shapes = [_shape(rng) for _ in range(num_jobs)]
    mean_gpu_s = statistics.fmean(n * d for n, _, d, _ in shapes)
    rate = load * TOTAL_GPUS / mean_gpu_s  # jobs per second
    arrival = 0.0
    out = []
    for num_gpus, min_gpus, duration_s, (klass, priority, _) in shapes:
        out.append(
            SimJob(
                arrival_s=arrival,
                num_gpus=num_gpus,
                min_gpus=min_gpus,
                duration_s=duration_s,
                priority=priority,
                klass=klass,
            )
        )
        arrival += rng.expovariate(rate)
    return out


def _shape(rng: random.Random) -> tuple[int, int, float, tuple[str, int, float]]:
    num_gpus = rng.choices(SIZES, weights=SIZE_WEIGHTS)[0]
    elastic = num_gpus >= 4 and rng.random() < ELASTIC_SHARE
    duration_s = min(
        max(rng.lognormvariate(math.log(DURATION_MEDIAN_S), DURATION_SIGMA), DURATION_RANGE_S[0]), DURATION_RANGE_S[1]
    )
    klass = rng.choices(CLASSES, weights=[share for _, _, share in CLASSES])[0]
    return num_gpus, num_gpus // 2 if elastic else num_gpus, round(duration_s), klass


def workload_line(workload: list[SimJob]) -> str:
    span_s = workload[-1].arrival_s
    load = sum(j.gpu_s for j in workload) / (TOTAL_GPUS * span_s)
    sizes = ", ".join(f"{n}: {sum(j.num_gpus == n for j in workload)}" for n in SIZES)
    classes = ", ".join(f"{name} ({p}): {sum(j.klass == name for j in workload)}" for name, p, _ in CLASSES)
    durations = sorted(j.duration_s for j in workload)
    return (
        f"{len(workload)} jobs on {TOTAL_GPUS} GPUs over {span_s / 3600:.1f} h of arrivals (Poisson), offered load "
        f"{load:.0%}; jobs by size {sizes}; by class {classes}; {sum(j.min_gpus < j.num_gpus for j in workload)} "
        f"elastic; run time at full size lognormal(ln 30 min, 1.6) cut to 1 min-7 d: median "
        f"{_hours(statistics.median(durations))}, p95 {_hours(durations[int(0.95 * (len(durations) - 1))])}, "
        f"max {_hours(durations[-1])}; the GPU-seconds of the 1-GPU jobs are "
        f"{sum(j.gpu_s for j in workload if j.num_gpus == 1) / sum(j.gpu_s for j in workload):.0%} of the total"
    )


def job_spec(sim: SimJob, *, name: str) -> JobSpec:
    """A cheap job of `sim`'s shape: a step is one second of work at num_gpus, so steps is its run time.
    micro_batch_size 1 and a global batch of num_gpus: an elastic job runs at every N in
    [min_gpus, num_gpus] that divides num_gpus."""
    return JobSpec(
        name=name,
        model=MODEL,
        num_gpus=sim.num_gpus,
        min_gpus=sim.min_gpus if sim.min_gpus < sim.num_gpus else None,
        precision="fp32",
        steps=max(1, round(sim.duration_s)),
        micro_batch_size=1,
        global_batch_size=sim.num_gpus,
        checkpoint_every=round(CHECKPOINT_EVERY_S),
        priority=sim.priority,
    )


class Plans:
    """Admission's plans, one per (num_gpus, min_gpus): the plan of a job does not depend on its steps."""

    def __init__(self) -> None:
        self._plans: dict[tuple[int, int], PlanPublic] = {}

    def __call__(self, spec: JobSpec) -> PlanPublic:
        key = (spec.num_gpus, spec.min_gpus or spec.num_gpus)
        if key not in self._plans:
            self._plans[key] = admission.admit(spec, cluster=CLUSTER, overhead_bytes=GB)
        return self._plans[key]


# --------------------------------------------------------------------------- the simulated cluster


def fake_cluster(settings: Settings, *, clock: FakeClock) -> FakeLauncher:
    """The launcher the scheduler calls, on a simulated cluster of TOTAL_GPUS (tests/fakes.py): each
    attempt progresses by the replay's clock, no process runs."""
    timing = Timing(
        start_delay_s=START_DELAY_S,
        stop_delay_s=STOP_DELAY_S,
        checkpoint_every_s=CHECKPOINT_EVERY_S,
        stop_checkpoint_s=STOP_CHECKPOINT_S,
        rows=True,
        checkpoint_blocked_s=CHECKPOINT_BLOCKED_S,
    )
    return FakeLauncher(settings, total_gpus=TOTAL_GPUS, clock=clock, timing=timing)


def next_event(launcher: FakeLauncher, after: float) -> float | None:
    """The earliest time after `after` at which a poll's answer changes, or a job becomes old
    enough to be preempted (priority policy), to grow (elastic, below its most), or overdue
    to stop (past the grace)."""
    times = []
    for found in launcher.attempts.values():
        if found.released_at is not None:
            continue
        times.extend(found.events())
        if launcher.settings.queue_policy == "priority":
            times.append(found.launched_at + MIN_RUNTIME_S + _EPSILON_S)
        if found.trains_until < math.inf:  # a stop's step ends: what its rows say changes
            times.append(found.trains_until)
        if found.n < found.num_gpus:
            times.append(found.launched_at + GROW_INTERVAL_S + _EPSILON_S)
        if found.stop_asked_at is not None:
            times.append(found.stop_asked_at + GRACE_S + _EPSILON_S)
    later = [t for t in times if after < t < math.inf]
    return min(later, default=None)


# --------------------------------------------------------------------------- the replay


@dataclass(slots=True)
class Replay:
    """One policy's run of the workload."""

    policy: str
    """fifo, or priority (victims the lowest priority first), or least_loss (priority, victims by least loss)."""
    makespan_s: float = 0.0
    held_gpu_s: float = 0.0
    held_until_last_arrival_gpu_s: float = 0.0
    restart_gpu_s: float = 0.0
    stopped_restart_gpu_s: float = 0.0
    """Of restart_gpu_s, the start-ups after a stop asked for now (a preemption)."""
    stop_checkpoint_gpu_s: float = 0.0
    lost_gpu_s: float = 0.0
    estimates: list[tuple[int, float, float | None]] = field(default_factory=list)
    """(job id, when it waited, its estimated start or None), for each job that waited on arrival."""
    started_at: dict[int, float] = field(default_factory=dict)
    """Job id -> its first launch, in simulated seconds."""
    preemptions: dict[str, int] = field(default_factory=dict)
    preempted_jobs: int = 0
    preempted_by_class: dict[str, int] = field(default_factory=dict)
    """Jobs preempted at least once, by class."""
    most_preemptions: int = 0
    """Of one job."""
    waits_s: dict[str, list[float]] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)
    num_ticks: int = 0
    wall_s: float = 0.0
    problems: list[str] = field(default_factory=list)


_SETTINGS = {
    "fifo": {"queue_policy": "fifo"},
    "priority": {"queue_policy": "priority", "preempt_victims": "lowest_priority"},
    "least_loss": {"queue_policy": "priority", "preempt_victims": "least_loss"},
}
"""Each replay's ZERO1_QUEUE_POLICY and ZERO1_PREEMPT_VICTIMS."""


def simulated(root: Path, *, policy: str) -> tuple[Database, FakeLauncher, FakeStorage, Scheduler, FakeClock]:
    """A scheduler on a fresh SQLite database and the simulated cluster, under `policy` (_SETTINGS)."""
    root.mkdir(parents=True)
    (root / "checkpoints").mkdir()
    settings = Settings(
        database_url=f"sqlite:///{root / 'zero1.db'}",
        checkpoint_uri=str(root / "checkpoints"),
        **_SETTINGS[policy],
        preempt_min_runtime_s=MIN_RUNTIME_S,
        preempt_grace_s=GRACE_S,
        elastic_grow_interval_s=GROW_INTERVAL_S,
    )
    upgrade(settings.database_url)
    db = Database(settings.database_url)
    clock = FakeClock()
    _database_time(clock)
    launcher = fake_cluster(settings, clock=clock)
    storage = FakeStorage(launcher)
    scheduler = Scheduler(
        db=db,
        launcher=launcher,
        storage=storage,
        total_gpus=lambda: TOTAL_GPUS,
        interval_s=settings.scheduler_interval_s,
        start_timeout_s=settings.start_timeout_s,
        grow_interval_s=GROW_INTERVAL_S,
        sweep_interval_s=3600.0,
        clock=clock,
    )
    return db, launcher, storage, scheduler, clock


SIMULATED_EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
"""The database's time at the replay's 0 s."""


def _database_time(clock: FakeClock) -> None:
    """The times the database records (events, a job's submission, start and end) are the replay's
    simulated ones, as they would be a real cluster's: least loss reads a victim's start-up from its events."""
    now = lambda: SIMULATED_EPOCH + timedelta(seconds=clock.now)
    for column in (JobEvent.__table__.c.at, Job.__table__.c.created_at):
        column.default.arg = lambda context: now()
    job_states.utcnow = now


def replay(policy: str, workload: list[SimJob], *, root: Path, plans: Plans) -> Replay:
    """`workload` through the scheduler under `policy`, event by event, to the last job's end."""
    db, launcher, storage, scheduler, clock = simulated(root, policy=policy)
    result = Replay(policy)
    sims = {}
    pending = deque(workload)
    started = time.perf_counter()
    while True:
        arrived = []
        while pending and pending[0].arrival_s <= clock.now:
            sim = pending.popleft()
            job_id = _submit(db, sim, name=f"sim-{len(sims)}", plans=plans)
            sims[job_id] = sim
            launcher.durations_s[job_id] = sim.duration_s
            arrived.append(job_id)
        result.num_ticks += _settle(scheduler, launcher)
        if waited := [job_id for job_id in arrived if job_id not in launcher.first_launch_at]:
            result.estimates += _estimate(db, scheduler, waited, now=clock.now)
        if not pending and len(storage.retired) == len(workload):
            break
        next_arrival_s = pending[0].arrival_s if pending else None
        upcoming = [t for t in (next_arrival_s, next_event(launcher, clock.now)) if t is not None]
        if not upcoming:
            result.problems.append(f"t={clock.now:.0f} s: nothing left to happen, {_stuck(db, scheduler)}")
            break
        clock.now = min(upcoming)
    result.wall_s = time.perf_counter() - started
    _collect(result, db=db, launcher=launcher, scheduler=scheduler, sims=sims)
    result.held_until_last_arrival_gpu_s = _held_until(launcher, workload[-1].arrival_s)
    db.dispose()
    return result


def _submit(db: Database, sim: SimJob, *, name: str, plans: Plans) -> int:
    spec = job_spec(sim, name=name)
    with db.session() as session:
        job, _ = submission.submit_job(
            session, spec=spec, plan=plans(spec), idempotency_key=None, priority=sim.priority
        )
        return job.id


def _settle(scheduler: Scheduler, launcher: FakeLauncher) -> int:
    """Tick at this instant until a tick launches, stops or releases nothing; the ticks."""
    for num_ticks in range(1, _MAX_SETTLE_TICKS + 1):
        before = launcher.num_actions
        scheduler.tick()
        if launcher.num_actions == before:
            return num_ticks
    return _MAX_SETTLE_TICKS


def _estimate(db: Database, scheduler: Scheduler, job_ids: list[int], *, now: float) -> list[tuple]:
    """(job id, now, its estimated start in simulated seconds or None) for `job_ids`, as GET /v1/queue
    would give them now (the whole queue read)."""
    with db.session() as session:
        seconds = scheduler.dispatcher.estimate_starts(session, limit=1_000_000)
    return [(job_id, now, None if seconds.get(job_id) is None else now + seconds[job_id]) for job_id in job_ids]


def _held_until(launcher: FakeLauncher, t: float) -> float:
    """GPU-seconds held from 0 to `t`."""
    return sum(
        max(0.0, min(t, a.released_at if a.released_at is not None else t) - a.launched_at) * a.n
        for a in launcher.attempts.values()
    )


def _stuck(db: Database, scheduler: Scheduler) -> str:
    with db.session() as session:
        counts = dict(session.execute(select(Job.status, func.count()).group_by(Job.status)).all())
    reasons = list(scheduler.queue_reasons().items())[:3]
    return f"jobs by status {counts}; the queue's first reasons {reasons}"


def _collect(result: Replay, *, db: Database, launcher: FakeLauncher, scheduler: Scheduler, sims: dict) -> None:
    with db.session() as session:
        rows = session.execute(select(Job.id, Job.status)).all()
        failed = session.execute(select(JobEvent.job_id, JobEvent.reason).where(JobEvent.to_status == "failed")).all()
        preempted = session.execute(  # the victim's transition names the preemption (dispatch.Stop.cause)
            select(JobEvent.job_id, func.count())
            .where(JobEvent.reason.contains("preempted by job"))
            .group_by(JobEvent.job_id)
        ).all()
    result.statuses = dict(Counter(status for _, status in rows))
    result.preempted_jobs = len(preempted)
    result.preempted_by_class = dict(Counter(sims[job_id].klass for job_id, _ in preempted))
    result.most_preemptions = max((n for _, n in preempted), default=0)
    result.problems += launcher.problems + [f"job {job_id} failed: {reason}" for job_id, reason in failed[-3:]]
    result.makespan_s = max((a.released_at or 0.0) for a in launcher.attempts.values())
    result.held_gpu_s = launcher.held_gpu_s
    result.restart_gpu_s = launcher.restart_gpu_s
    result.stopped_restart_gpu_s = launcher.stopped_restart_gpu_s
    result.stop_checkpoint_gpu_s = launcher.stop_checkpoint_gpu_s
    result.lost_gpu_s = launcher.lost_gpu_s
    result.started_at = dict(launcher.first_launch_at)
    registry = scheduler.telemetry.registry
    for outcome in ("checkpointed", "shrunk", "killed"):
        result.preemptions[outcome] = int(registry.get_sample_value("zero1_preemptions_total", {"outcome": outcome}))
    for name, _, _ in CLASSES:
        result.waits_s[name] = [
            launcher.first_launch_at[job_id] - sim.arrival_s
            for job_id, sim in sims.items()
            if sim.klass == name and job_id in launcher.first_launch_at
        ]


# --------------------------------------------------------------------------- the tick with 10,000 queued


def tick_times(
    policy: str, *, root: Path, plans: Plans, num_queued: int, num_ticks: int, idle_gpu: bool, seed: int
) -> list[float]:
    """Scheduler.tick()'s wall times with `num_queued` jobs queued behind a cluster whose GPUs running
    jobs hold (all of them, or all but one with no queued job of one GPU: `idle_gpu`)."""
    db, launcher, storage, scheduler, clock = simulated(root, policy=policy)
    rng = random.Random(seed)
    running = _fill(rng, TOTAL_GPUS - (1 if idle_gpu else 0))
    queued = [_shape(rng) for _ in range(num_queued)]
    if idle_gpu:
        queued = [shape for shape in queued if shape[0] > 1] or queued
        while len(queued) < num_queued:
            shape = _shape(rng)
            if shape[0] > 1:
                queued.append(shape)
    _bulk_insert(db, launcher, running=running, queued=queued, plans=plans, clock=clock)
    for _ in range(2):  # warm: the dispatcher learns the running jobs' ages, the caches fill
        scheduler.tick()
    times = []
    for _ in range(num_ticks):
        started = time.perf_counter()
        scheduler.tick()
        times.append(time.perf_counter() - started)
    with db.session() as session:
        still_queued = session.scalar(select(func.count()).where(Job.status == "queued"))
    assert still_queued == num_queued, f"{num_queued - still_queued} jobs started during the measurement"
    db.dispose()
    return times


def _fill(rng: random.Random, num_gpus: int) -> list[tuple[int, int, float, tuple[str, int, float]]]:
    """Running jobs of the workload's shape holding exactly `num_gpus`, none elastic."""
    out = []
    left = num_gpus
    while left > 0:
        n, _, duration_s, klass = _shape(rng)
        n = max(s for s in SIZES if s <= min(n, left))
        out.append((n, n, duration_s, klass))
        left -= n
    return out


def _bulk_insert(db: Database, launcher: FakeLauncher, *, running: list, queued: list, plans: Plans, clock) -> None:
    """The jobs written in one insert each: the running ones as running attempt 0, launched on the
    simulated cluster with a week left to run."""
    rows = []
    for i, (n, m, duration_s, (klass, priority, _)) in enumerate(running + queued):
        sim = SimJob(arrival_s=0.0, num_gpus=n, min_gpus=m, duration_s=duration_s, priority=priority, klass=klass)
        spec = job_spec(sim, name=f"bulk-{i}")
        is_running = i < len(running)
        rows.append(
            {
                "name": spec.name,
                "status": "running" if is_running else "queued",
                "spec": spec.model_dump(mode="json"),
                "plan": plans(spec).model_dump(mode="json"),
                "num_gpus": n,
                "min_gpus": spec.min_gpus,
                "world_size": n if is_running else None,
                "steps": spec.steps,
                "priority": priority,
            }
        )
    with db.session() as session:
        session.execute(insert(Job), rows)
        ids = list(session.scalars(select(Job.id).where(Job.status == "running").order_by(Job.id)))
        for job in session.scalars(select(Job).where(Job.id.in_(ids))):
            launcher.durations_s[job.id] = 7 * 86_400.0
            launcher.launch(job)
    clock.now = START_DELAY_S + 1.0  # every running attempt is past its start


# --------------------------------------------------------------------------- the table


def _hours(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _ms(values: list[float], q: float) -> str:
    return f"{_quantile(values, q) * 1e3:.1f} ms"


def table(
    results: list[Replay], ticks: dict[tuple[str, bool], list[float]], *, last_arrival_s: float, num_queued: int
) -> str:
    """The policies side by side, a markdown table."""
    rows: list[tuple[str, ...]] = [("measurement", *(_TITLES[r.policy] for r in results))]
    total = TOTAL_GPUS

    def row(name: str, fn) -> None:
        rows.append((name, *(fn(r) for r in results)))

    row("jobs succeeded", lambda r: f"{r.statuses.get('succeeded', 0)} of {sum(r.statuses.values())}")
    row("makespan (first arrival to last end)", lambda r: _hours(r.makespan_s))
    row(
        "GPU utilization until the last arrival",
        lambda r: f"{r.held_until_last_arrival_gpu_s / (total * last_arrival_s):.1%}",
    )
    row("GPU utilization over the makespan", lambda r: f"{r.held_gpu_s / (total * r.makespan_s):.1%}")
    for name, priority, _ in CLASSES:
        for label, q in (("p50", 0.5), ("p95", 0.95)):
            row(
                f"wait to first start, {name} ({priority}), {label}",
                lambda r, n=name, q=q: _hours(_quantile(r.waits_s[n], q)),
            )
    row("preemptions: stopped with a checkpoint", lambda r: str(r.preemptions["checkpointed"]))
    row("preemptions: shrunk (elastic)", lambda r: str(r.preemptions["shrunk"]))
    row("preemptions: killed past the grace", lambda r: str(r.preemptions["killed"]))
    row("jobs preempted at least once", lambda r: str(r.preempted_jobs))
    row(
        "of those: deadline / normal / best-effort",
        lambda r: " / ".join(str(r.preempted_by_class.get(name, 0)) for name, _, _ in CLASSES),
    )
    row("most preemptions of one job", lambda r: str(r.most_preemptions))
    row(
        f"GPU-seconds lost to preemption: the stops' checkpoints ({STOP_CHECKPOINT_S:g} s)", lambda r: _gpu_s(r, "stop")
    )
    row(f"GPU-seconds lost to preemption: relaunch start-up ({START_DELAY_S:g} s)", lambda r: _gpu_s(r, "restart"))
    row("GPU-seconds lost to preemption: work lost by kills", lambda r: _gpu_s(r, "killed"))
    row("GPU-seconds lost to preemption, in all", lambda r: _gpu_s(r, "all"))
    row("GPU-seconds of every relaunch's start-up (growths too)", lambda r: f"{r.restart_gpu_s:,.0f}")
    row("estimated starts: jobs that waited on arrival, with an estimate", lambda r: _coverage(r))
    for label, q in (("p50", 0.5), ("p90", 0.9)):
        row(f"estimated start: abs(estimated - actual), {label}", lambda r, q=q: _hours(_quantile(_errors(r), q)))
    for label, q in (("p50", 0.5), ("p90", 0.9)):
        row(f"their actual wait, {label}", lambda r, q=q: _hours(_quantile(_waited(r), q)))
    row("estimated start too early (the job started later)", lambda r: _early(r))
    row("scheduler ticks in the replay", lambda r: f"{r.num_ticks:,}")
    row("wall time of the replay", lambda r: f"{r.wall_s:.1f} s")
    for idle, what in ((False, "cluster full"), (True, "1 GPU idle, no 1-GPU job queued")):
        num = len(next(iter(ticks.values())))
        for label, q in (("p50", 0.5), ("p95", 0.95)):
            rows.append(
                (
                    f"tick, {num_queued:,} queued, {what}, {label} of {num}",
                    *(_ms(ticks[(r.policy, idle)], q) for r in results),
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


_TITLES = {
    "fifo": "FIFO (queue_policy=fifo)",
    "priority": "priority, victims: lowest priority",
    "least_loss": "priority, victims: least loss",
}


def lost_gpu_s(r: Replay) -> dict[str, float]:
    """GPU-seconds lost to preemption, by what: the stops' checkpoints, the relaunches' start-up after
    them, the work of attempts killed; and their sum."""
    parts = {"stop": r.stop_checkpoint_gpu_s, "restart": r.stopped_restart_gpu_s, "killed": r.lost_gpu_s}
    return {**parts, "all": sum(parts.values())}


def _gpu_s(r: Replay, part: str) -> str:
    return f"{lost_gpu_s(r)[part]:,.0f}"


def _estimated(r: Replay) -> list[tuple[float, float, float]]:
    """(when it waited, its estimated start, its first launch) of each job that waited and had an estimate."""
    return [(at, est, r.started_at[job_id]) for job_id, at, est in r.estimates if est is not None]


def _errors(r: Replay) -> list[float]:
    return [abs(est - started) for _, est, started in _estimated(r)]


def _waited(r: Replay) -> list[float]:
    return [started - at for at, _, started in _estimated(r)]


def _coverage(r: Replay) -> str:
    return f"{len(r.estimates)}, {len(_estimated(r))}"


def _early(r: Replay) -> str:
    estimated = _estimated(r)
    early = sum(est < started for _, est, started in estimated)
    return f"{early} of {len(estimated)}" if estimated else "-"


def summary(r: Replay) -> dict:
    """A replay's figures, as benchmarks/results/scheduling.json keeps them."""
    return {
        "policy": r.policy,
        "title": _TITLES[r.policy],
        "statuses": r.statuses,
        "makespan_s": round(r.makespan_s, 1),
        "held_gpu_s": round(r.held_gpu_s),
        "waits_s": {k: {"p50": _quantile(v, 0.5), "p95": _quantile(v, 0.95)} for k, v in r.waits_s.items()},
        "preemptions": r.preemptions,
        "preempted_jobs": r.preempted_jobs,
        "preempted_by_class": r.preempted_by_class,
        "most_preemptions": r.most_preemptions,
        "lost_to_preemption_gpu_s": {k: round(v) for k, v in lost_gpu_s(r).items()},
        "restart_gpu_s": round(r.restart_gpu_s),
        "estimates": {
            "waited": len(r.estimates),
            "estimated": len(_estimated(r)),
            "abs_error_s": {"p50": _quantile(_errors(r), 0.5), "p90": _quantile(_errors(r), 0.9)},
            "waited_s": {"p50": _quantile(_waited(r), 0.5), "p90": _quantile(_waited(r), 0.9)},
            "too_early": sum(est < started for _, est, started in _estimated(r)),
        },
        "num_ticks": r.num_ticks,
        "wall_s": round(r.wall_s, 1),
        "problems": r.problems,
    }


# --------------------------------------------------------------------------- main


class ErrorLog(logging.Handler):
    """Warnings and errors logged (the scheduler's "failing it alone", a tick's exception), kept to report."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = f"{record.levelname} {record.name}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + logging.Formatter().formatException(record.exc_info)
        self.records.append(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--seed", type=int, default=29)
    parser.add_argument(
        "--load", type=float, default=0.9, help="offered load: the jobs' GPU-seconds / (64 x arrival span)"
    )
    parser.add_argument("--queued", type=int, default=10_000, help="queued jobs for the tick's time")
    parser.add_argument("--ticks", type=int, default=20)
    parser.add_argument("--policies", nargs="+", default=list(_SETTINGS), choices=list(_SETTINGS))
    parser.add_argument("--out", type=Path, default=RESULTS, help="the figures as JSON")
    args = parser.parse_args()
    errors = ErrorLog()
    logging.getLogger().addHandler(errors)  # the scheduler's own info lines stay quiet
    logging.getLogger().setLevel(logging.WARNING)
    workload = make_workload(num_jobs=args.jobs, seed=args.seed, load=args.load)
    plans = Plans()
    results = []
    ticks = {}
    with tempfile.TemporaryDirectory(prefix="zero1-scheduling-") as tmp:
        root = Path(tmp)
        for policy in args.policies:
            results.append(replay(policy, workload, root=root / f"replay-{policy}", plans=plans))
            for idle in (False, True):
                ticks[(policy, idle)] = tick_times(
                    policy,
                    root=root / f"tick-{policy}-{idle}",
                    plans=plans,
                    num_queued=args.queued,
                    num_ticks=args.ticks,
                    idle_gpu=idle,
                    seed=args.seed,
                )
    print(f"machine: {platform.machine()}, {platform.python_version()}, SQLite; workload (seed {args.seed}):")
    print(workload_line(workload))
    print()
    print(table(results, ticks, last_arrival_s=workload[-1].arrival_s, num_queued=args.queued))
    for r in results:
        for problem in r.problems:
            print(f"{r.policy}: scheduler problem: {problem}")
    for record in errors.records[:5]:
        print(f"logged: {record}")
    if errors.records:
        print(f"{len(errors.records)} warnings and errors logged in all")
    args.out.parent.mkdir(exist_ok=True)
    figures = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, SQLite",
        "command": f"benchmarks/scheduling.py --jobs {args.jobs} --seed {args.seed} --load {args.load} "
        f"--queued {args.queued} --ticks {args.ticks} --policies {' '.join(args.policies)}",
        "workload": workload_line(workload),
        "replays": [summary(r) for r in results],
        "ticks_ms": {
            f"{policy} {'1 GPU idle' if idle else 'full'}": _tick_ms(t) for (policy, idle), t in ticks.items()
        },
    }
    args.out.write_text(json.dumps(figures, indent=1) + "\n")
    print(f"figures written to {args.out}")


def _tick_ms(times: list[float]) -> dict[str, float]:
    return {"p50": round(_quantile(times, 0.5) * 1e3, 1), "p95": round(_quantile(times, 0.95) * 1e3, 1)}


if __name__ == "__main__":
    main()

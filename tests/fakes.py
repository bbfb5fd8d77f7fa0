"""Stand-ins for Ray that drive the real scheduler, its database and the app: the fast lane of the
suite (`make test-fast`) and benchmarks/scheduling.py's replay run on them.

FakeLauncher has the launcher's interface (service/scheduling/ray_launcher.py's RayLauncher, as the
scheduler calls it) on a cluster of logical GPUs where no process runs: an attempt holds its GPUs
from its launch, trains from `start_delay_s` later, and ends when its work is done, by a clock the
caller moves (FakeClock) or the wall's. Work is counted in seconds at the job's full num_gpus (one
step a second); an attempt at N GPUs does N/num_gpus of it a second. Asked to stop now it stops
`stop_delay_s` later at its next step with a checkpoint there (held `stop_checkpoint_s` more, not
training, while it writes it); asked to stop at its next checkpoint (a growth) it stops there; killed
it keeps its last periodic checkpoint. With `rows`, a poll brings the newest step's metric row (and
the last periodic checkpoint's, since the last poll), as a supervisor would bring every step's. A
test ends an attempt itself with fail() or lose().

Packages: service (the launcher's and the storage's interfaces, AppState).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from service.app_state import AppState
from service.planning.capacity import ClusterCapacity
from service.settings import Settings
from service.store.job_storage import JobStorage
from service.store.metric_rows import store_metrics
from service.store.tables import Job
from service.telemetry import Telemetry
from workers.memory.model import gpu_memory_bytes_from_gb
from workers.records import AttemptPoll, AttemptStatus, MetricRow, RankError

if TYPE_CHECKING:
    from fastapi.testclient import TestClient

RUNS_UNTIL_STOPPED_S = math.inf
"""The work of a job whose duration the caller did not set: it runs until stopped, failed or lost."""


class FakeClock:
    """A clock the caller moves: fake_clock.now = t."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True, slots=True, kw_only=True)
class Timing:
    """How long a fake attempt takes for what a real one does (seconds of the launcher's clock)."""

    start_delay_s: float = 0.0
    """From a launch to training: placing the ranks, rendezvous, loading a checkpoint."""
    stop_delay_s: float = 0.0
    """From a stop asked now to the ranks' exit with a checkpoint at their next step."""
    checkpoint_every_s: float = 1.0
    """Periodic checkpoints, in seconds of work at full size."""
    stop_checkpoint_s: float = 0.0
    """After a stop's step, the seconds its ranks hold their GPUs writing its checkpoint (asynchronous
    checkpoints: the exit waits for the write, a periodic one or the stop's own), training no more."""
    rows: bool = False
    """Polls bring metric rows: the newest step's, and the last periodic checkpoint's since the last poll
    (its checkpoint_blocked_s `checkpoint_blocked_s`); step_time_s is a step's at the attempt's N."""
    checkpoint_blocked_s: float = 0.0
    """What the periodic checkpoints' rows report they held training up (the copy to host memory)."""


@dataclass(slots=True, kw_only=True)
class FakeAttempt:
    """One attempt of a job; its progress is in seconds of work at num_gpus."""

    job_id: int
    n: int
    num_gpus: int
    duration_s: float
    launched_at: float
    start_progress_s: float
    start_delay_s: float
    stop_at: float = math.inf
    """When a stop asked of it ends: its ranks exit."""
    trains_until: float = math.inf
    """When a stop asked of it has it stop training (its step; stop_at once its checkpoint is written)."""
    stop_asked_at: float | None = None
    stop_now: bool = False
    """The stop asked was for now (a preemption, a suspend), not at a checkpoint (a growth)."""
    after_stop: bool = False
    """Its job's previous attempt ended by a stop asked for now: this one's start-up is that stop's."""
    killed: bool = False
    ended: AttemptPoll | None = None
    """How a test ended it (fail(), lose()); None while its clock decides."""
    released_at: float | None = None

    @property
    def running_at(self) -> float:
        return self.launched_at + self.start_delay_s

    @property
    def rate(self) -> float:
        return self.n / self.num_gpus

    @property
    def finish_at(self) -> float:
        return self.running_at + (self.duration_s - self.start_progress_s) / self.rate

    def progress_s(self, t: float) -> float:
        t = min(t, self.trains_until)
        return min(self.duration_s, self.start_progress_s + max(0.0, t - self.running_at) * self.rate)

    def time_at(self, progress_s: float) -> float:
        return self.running_at + (progress_s - self.start_progress_s) / self.rate

    def status(self, t: float) -> AttemptStatus:
        if self.ended is not None:
            return self.ended.status
        if self.killed or (self.trains_until < self.finish_at and t >= self.stop_at):
            return AttemptStatus.STOPPED
        if t >= self.finish_at:
            return AttemptStatus.SUCCEEDED
        return AttemptStatus.STARTING if t < self.running_at else AttemptStatus.RUNNING

    def events(self) -> Iterable[float]:
        """The times at which this attempt changes what a poll says."""
        yield self.running_at
        yield self.stop_at if self.trains_until < self.finish_at else self.finish_at


class FakeLauncher:
    """The launcher interface the scheduler calls, on `total_gpus` logical GPUs: each attempt progresses
    by `clock`, no process runs. It keeps what a test or a benchmark asserts on: every launch in order,
    the GPUs held, and any launch past the cluster (`problems`)."""

    def __init__(
        self,
        settings: Settings,
        *,
        total_gpus: int,
        clock: Callable[[], float] = time.monotonic,
        timing: Timing = Timing(),
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.total_gpus = total_gpus
        self.timing = timing
        self.durations_s: dict[int, float] = {}
        """Job id -> its work at num_gpus; RUNS_UNTIL_STOPPED_S where unset."""
        self.attempts: dict[tuple[int, int], FakeAttempt] = {}
        self.launched: list[tuple[int, int, int]] = []
        """(job id, attempt, N) of each launch, in order."""
        self.saved_s: dict[int, float] = {}
        """Job id -> the work its latest checkpoint holds."""
        self.first_launch_at: dict[int, float] = {}
        self.num_actions = 0
        """Launches, stops taken, kills and releases: a tick that did none of them changed nothing here."""
        self.held_gpus = 0
        self.held_gpu_s = 0.0
        self.restart_gpu_s = 0.0
        """GPU-seconds of relaunched attempts' start-up (held, not training)."""
        self.lost_gpu_s = 0.0
        """GPU-seconds of work since the last checkpoint of attempts killed."""
        self.stop_checkpoint_gpu_s = 0.0
        """GPU-seconds of the exits of attempts stopped for now (a preemption, a suspend): held after their
        last step, writing its checkpoint."""
        self.stopped_restart_gpu_s = 0.0
        """Of restart_gpu_s, the start-ups of attempts after a stop asked for now (a preemption, a suspend)."""
        self.reported: dict[tuple[int, int], int] = {}
        """(job id, attempt) -> the last step a poll brought a row of (with Timing.rows)."""
        self.problems: list[str] = []

    # what the scheduler calls

    def launch(self, job: Job) -> None:
        key = (job.id, job.attempt)
        now = self.clock()
        if key in self.attempts:
            return  # adopted, as RayLauncher does
        n = job.world_size or job.num_gpus
        self.attempts[key] = FakeAttempt(
            job_id=job.id,
            n=n,
            num_gpus=job.num_gpus,
            duration_s=self.durations_s.get(job.id, RUNS_UNTIL_STOPPED_S),
            launched_at=now,
            start_progress_s=self.saved_s.get(job.id, 0.0),
            start_delay_s=self.timing.start_delay_s,
            after_stop=(before := self.attempts.get((job.id, job.attempt - 1))) is not None and before.stop_now,
        )
        self.launched.append((job.id, job.attempt, n))
        self.first_launch_at.setdefault(job.id, now)
        self.held_gpus += n
        self.num_actions += 1
        if self.held_gpus > self.total_gpus:
            self.problems.append(f"t={now:.0f} s: job {job.id} launched on {n}: {self.held_gpus} GPUs held")

    def poll(self, job_id: int, attempt: int, *, after_step: int, log_acks: dict[int, int]) -> AttemptPoll:
        return self.poll_many([(job_id, attempt, after_step, log_acks)])[(job_id, attempt)]

    def poll_many(self, attempts: list[tuple[int, int, int, dict[int, int]]]) -> dict[tuple[int, int], AttemptPoll]:
        return {(job_id, attempt): self._state(job_id, attempt) for job_id, attempt, _, _ in attempts}

    def request_stop(self, job_id: int, attempt: int, *, now: bool = False) -> bool:
        """`now`: stop stop_delay_s later at the next step, a checkpoint there; else at the next periodic checkpoint."""
        found = self.attempts.get((job_id, attempt))
        if found is None or found.released_at is not None or found.killed or found.ended is not None:
            return False
        t = self.clock()
        if now:
            at = max(t, found.running_at) + self.timing.stop_delay_s
        else:
            every_s = self.timing.checkpoint_every_s
            at = found.time_at((found.progress_s(t) // every_s + 1) * every_s)
        found.trains_until = min(found.trains_until, at)
        found.stop_at = found.trains_until + self.timing.stop_checkpoint_s
        found.stop_asked_at = t if found.stop_asked_at is None else found.stop_asked_at
        found.stop_now = found.stop_now or now
        self.num_actions += 1
        return True

    def cancel(self, job_id: int, attempt: int) -> None:
        """Kill the attempt: it keeps its last periodic checkpoint; the work since is lost."""
        found = self.attempts.get((job_id, attempt))
        if found is None or found.killed or found.status(self.clock()) not in _ALIVE:
            return
        progress = found.progress_s(self.clock())
        every_s = self.timing.checkpoint_every_s
        kept = max(found.start_progress_s, progress // every_s * every_s)
        self.lost_gpu_s += (progress - kept) * found.num_gpus
        self.saved_s[job_id] = kept
        found.killed = True
        self.num_actions += 1

    def release(self, job_id: int, attempt: int) -> None:
        found = self.attempts.get((job_id, attempt))
        if found is None or found.released_at is not None:
            return
        now = found.released_at = self.clock()
        self.held_gpus -= found.n
        self.held_gpu_s += (now - found.launched_at) * found.n
        if found.stop_now and not found.killed and found.trains_until < found.finish_at and now >= found.stop_at:
            self.stop_checkpoint_gpu_s += (found.stop_at - found.trains_until) * found.n
        if found.start_progress_s > 0 or attempt > 0:
            start_up_gpu_s = (min(now, found.running_at) - found.launched_at) * found.n
            self.restart_gpu_s += start_up_gpu_s
            self.stopped_restart_gpu_s += start_up_gpu_s if found.after_stop else 0.0
        self.num_actions += 1

    def gpus_free_to(self, job_id: int, attempt: int) -> int | None:
        return None  # Ray's view of free GPUs: no other workload here

    def sweep(self, attempts: set[tuple[int, int]]) -> int:
        return 0  # no placement group outlives its attempt here

    def supervisors(self) -> list[tuple[int, int]]:
        return [key for key, found in self.attempts.items() if found.released_at is None]

    def exists(self, job_id: int, attempt: int) -> bool:
        found = self.attempts.get((job_id, attempt))
        return found is not None and found.released_at is None

    # what a test does to an attempt

    def fail(
        self, job_id: int, attempt: int, *, exception: str = "RuntimeError", message: str = "a rank failed"
    ) -> None:
        """A rank of the attempt raised: its poll says failed, with the error."""
        error = RankError(exception=exception, message=message)
        self.attempts[(job_id, attempt)].ended = AttemptPoll(status=AttemptStatus.FAILED, error=error)

    def lose(self, job_id: int, attempt: int, *, message: str = "the supervisor died") -> None:
        """The attempt's supervisor is gone (its node died, Ray restarted)."""
        self.attempts[(job_id, attempt)].ended = AttemptPoll.lost(message)

    def _state(self, job_id: int, attempt: int) -> AttemptPoll:
        found = self.attempts.get((job_id, attempt))
        if found is None or found.released_at is not None:
            return AttemptPoll.lost("no such supervisor")
        if found.ended is not None:
            return found.ended
        status = found.status(self.clock())
        if status == AttemptStatus.STOPPED and not found.killed:  # its checkpoint at the step it stopped at
            self.saved_s[job_id] = found.progress_s(found.stop_at)
        rows = self._rows(found, key=(job_id, attempt)) if self.timing.rows and status != AttemptStatus.STARTING else ()
        return AttemptPoll(status=status, nodes=("node-0",) * found.n, metrics=rows)

    def _rows(self, found: FakeAttempt, *, key: tuple[int, int]) -> tuple[MetricRow, ...]:
        """The newest step's row, and the last periodic checkpoint's since the last poll (a step a second
        of work at full size: step k ends at k + 1 s of it)."""
        newest = math.ceil(found.progress_s(self.clock()) - 1e-9) - 1
        after = self.reported.get(key, math.floor(found.start_progress_s + 1e-9) - 1)
        if newest <= after:
            return ()
        self.reported[key] = newest
        step_time_s = found.num_gpus / found.n
        every = max(1, round(self.timing.checkpoint_every_s))
        checkpoint = (newest + 1) // every * every - 1
        rows = []
        if after < checkpoint < newest:
            rows.append(self._row(checkpoint, found, step_time_s, blocked_s=self.timing.checkpoint_blocked_s))
        blocked_s = self.timing.checkpoint_blocked_s if checkpoint == newest else None
        rows.append(self._row(newest, found, step_time_s, blocked_s=blocked_s))
        return tuple(rows)

    @staticmethod
    def _row(step: int, found: FakeAttempt, step_time_s: float, *, blocked_s: float | None) -> MetricRow:
        row = metric_row(step)
        return replace(row, step_time_s=step_time_s, world_size=found.n, checkpoint_blocked_s=blocked_s)


_ALIVE = (AttemptStatus.STARTING, AttemptStatus.RUNNING)


class FakeStorage:
    """The job storage the scheduler asks (JobStorage's interface) for a FakeLauncher's jobs: nothing is
    written; a relaunch resumes at the work its latest checkpoint holds (a step a second), and a
    finished job is counted as retired."""

    def __init__(self, launcher: FakeLauncher) -> None:
        self.launcher = launcher
        self.retired: set[int] = set()

    def checkpoint_dir(self, job: Job) -> Path:
        return Path(self.launcher.settings.checkpoint_uri) / f"job-{job.id}"  # never written: no final/ found

    def resume_step(self, job: Job) -> int:
        return int(self.launcher.saved_s.get(job.id, 0.0))

    def checkpointed_metrics(self, job: Job, *, after_step: int) -> list:
        return []

    def discard_stored_metrics(self, job: Job, *, through_step: int) -> None:
        pass

    def retire(self, job: Job) -> None:
        self.retired.add(job.id)


class LocalStorage(JobStorage):
    """The app's real job storage on this machine, where the only GPU node is the app's own: no Ray task
    asks the nodes whether they can write there."""

    def storage_problems(self) -> dict[str, str]:
        return {}


class FakeCluster:
    """RayCluster's interface on the settings' logical GPUs (ZERO1_SIMULATED_GPUS), those a FakeLauncher
    holds taken: nothing connects."""

    def __init__(self, settings: Settings, *, launcher: FakeLauncher) -> None:
        self.settings = settings
        self.launcher = launcher
        self.simulated = True

    def connect(self) -> None:
        pass

    def disconnect(self) -> None:
        pass

    def capacity(self) -> ClusterCapacity:
        total = self.launcher.total_gpus
        return ClusterCapacity(
            num_gpus=total,
            num_gpus_free=total - self.launcher.held_gpus,
            gpu_memory_bytes=gpu_memory_bytes_from_gb(self.settings.simulated_gpu_memory_gb),
            simulated=True,
        )


def state_on_fakes(settings: Settings, *, telemetry: Telemetry | None = None) -> AppState:
    """The app's state (create_app's make_state) with a FakeLauncher on the wall's clock, a FakeCluster
    and the real job storage: the API, the scheduler and the database as they are, no Ray."""
    launcher = FakeLauncher(settings, total_gpus=settings.simulated_gpus)
    return AppState(
        settings,
        telemetry=telemetry,
        cluster=FakeCluster(settings, launcher=launcher),
        storage=LocalStorage(settings),
        launcher=launcher,
    )


def metric_row(step: int, *, loss: float = 3.0, eval_loss: float | None = None) -> MetricRow:
    """A row as a rank would report it, at `step`, with `loss` and (if given) `eval_loss`."""
    return MetricRow(
        step=step, loss=loss, grad_norm=1.0, loss_scale=1.0, skipped=False, step_time_s=0.1, tokens_per_s=1.0,
        mem_peak_bytes=(1,), mem_planned_bytes=1, eval_loss=eval_loss,
    )  # fmt: skip


def end_attempt(runtime: AppState, job_id: int, eval_loss: float | None) -> None:
    """The job's attempt on the FakeLauncher ends succeeded (failed, for None), its last row at step 9
    evaluated at `eval_loss`: the next tick settles it."""
    with runtime.db.session() as session:
        job = session.get(Job, job_id)
        store_metrics(session, job, [metric_row(9, eval_loss=eval_loss)])
        attempt = job.attempt
    status = AttemptStatus.FAILED if eval_loss is None else AttemptStatus.SUCCEEDED
    runtime.launcher.attempts[(job_id, attempt)].ended = AttemptPoll(status=status, nodes=("node-0",))


def tick(api: TestClient, count: int = 1) -> None:
    """`count` ticks of the scheduler of an app served on these stand-ins (its own loop stopped)."""
    for _ in range(count):
        api.app.state.runtime.scheduler.tick()

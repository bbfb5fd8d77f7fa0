"""The job's Ray actor: a JobSupervisor per job, which owns its placement group and its ranks'
actors (a thin TrainWorker each, workers/runtime/rank_actor.py), and where a job is placed.

The supervisor reserves one placement-group bundle per rank (a GPU each, plus
an explicit CPU share, without which Ray would give every actor a whole CPU
and a CPU-only machine's logical GPUs would sit PENDING), starts the workers,
lets rank 0 choose the rendezvous address, and watches them: metrics arrive in
batches, a dead rank fails the job with its rank, node and cause, and cancel
kills every rank and frees the group.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from workers.config import TrainConfig
from workers.records import (
    AttemptPoll,
    AttemptStatus,
    MetricRow,
    OutputLine,
    RankError,
    RunAs,
    TrainResult,
    root_cause,
)
from workers.runtime.capture import HeldLines
from workers.runtime.cluster_tasks import remove_group
from workers.runtime.rank_actor import StopMode, TrainWorker

Strategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]

PEER_FAILURE_SETTLE_S = 5.0
"""After a rank fails, how long the supervisor reads the other ranks' reports for the cause: a
peer's collective fails at once when a rank dies, so this is only waited in full when the others
are still training (a rank's own exception), never on the success path."""


class PlacementError(RuntimeError):
    """The cluster could not place the job's ranks within the timeout."""


class RendezvousError(RuntimeError):
    """The placed ranks did not all start and report their address within the timeout."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    num_workers: int
    strategy: Strategy = "PACK"
    timeout_s: float = 60.0
    cpus_per_worker: float = 1.0
    """CPUs each rank reserves beside its GPU; give a fraction on a CPU-only
    machine with logical GPUs."""
    rendezvous_timeout_s: float = 120.0
    """How long the placed ranks may take to start (their processes, imports) and report their address."""
    process_group_timeout_s: float = 300.0
    code_uri: str | None = None
    """A python model's code bundle as stored (file://….zip, s3://….zip), unpacked by each rank's actor
    for its child alone, never a Ray working_dir (workers/training/bundles.py); None: no bundle."""
    name: str = ""
    """The placement group's name: the control plane finds a group by it and removes one its
    attempt no longer owns (service.scheduling.ray_launcher.placement_group_name)."""
    log_max_bytes: int = 16 << 20
    """The most bytes of log lines a rank, and the supervisor, hold before they are stored
    (ZERO1_LOG_MAX_BYTES): past it the oldest are dropped, with a count."""
    home: str | None = None
    """The job's directory, its ranks' children's HOME: made by the service, owned by run_as
    (None: each rank makes a scratch one)."""
    run_as: RunAs | None = None
    """The uid and gid the job's children run under (ZERO1_RUN_AS); None: the Ray worker's own."""

    def __post_init__(self) -> None:
        if self.num_workers < 1 or self.timeout_s <= 0 or self.cpus_per_worker < 0 or self.rendezvous_timeout_s <= 0:
            raise ValueError(
                f"need num_workers ({self.num_workers}) >= 1, timeout_s ({self.timeout_s}) > 0, "
                f"cpus_per_worker ({self.cpus_per_worker}) >= 0, rendezvous_timeout_s ({self.rendezvous_timeout_s}) > 0"
            )

    @property
    def bundle(self) -> dict[str, float]:
        return {"GPU": 1.0, "CPU": self.cpus_per_worker}


@ray.remote(num_cpus=0, max_concurrency=8)
class JobSupervisor:
    """Owns one job's placement group and workers; the control plane polls it."""

    def __init__(self, job_id: str, config: TrainConfig, placement: Placement) -> None:
        self.job_id = job_id
        self.config = config
        self.placement = placement
        self.status = AttemptStatus.STARTING
        self.error: RankError | None = None
        self.results: dict[int, TrainResult] = {}
        self._lock = threading.Lock()
        self._metrics: list[MetricRow] = []
        self._logs = HeldLines(max_bytes=placement.log_max_bytes)
        self._partial: dict[int, dict[int, dict[str, Any]]] = {}  # step -> rank -> row
        self._workers: list[Any] = []
        self._nodes: list[str] = []
        self._pg = None
        self._started = False
        self._stop_mode: StopMode | None = None

    def ping(self) -> AttemptStatus:
        """The status, without touching the metrics: is this supervisor alive?"""
        return self.status

    def start(self) -> None:
        """Place the ranks, rendezvous, and start training. Never raises: a start that fails
        (placement or rendezvous past its timeout, a rank that dies starting) leaves status
        "failed" with the cause and frees the placement group. Once: a second call (a control
        plane adopting an attempt it launched) does nothing."""
        with self._lock:
            if self._started:
                return
            self._started = True
        try:
            self._start()
        except Exception as exc:  # noqa: BLE001 - every cause of a failed start is reported by poll()
            self._fail(None, exc)

    def _start(self) -> None:
        p = self.placement
        with self._lock:  # a cancel() either comes first (no group is made) or sees the group
            if self.status != AttemptStatus.STARTING:
                return
            pg = self._pg = placement_group([p.bundle] * p.num_workers, strategy=p.strategy, name=p.name)
        ready, _ = ray.wait([pg.ready()], timeout=p.timeout_s)
        if not ready:
            raise PlacementError(
                f"could not place {p.num_workers} ranks of {p.bundle} ({p.strategy}) within {p.timeout_s:g} s: "
                f"requested GPU={p.num_workers}, CPU={p.num_workers * p.cpus_per_worker:g}; "
                f"available {_resources(ray.available_resources())} of {_resources(ray.cluster_resources())}"
            )
        with self._lock:  # likewise: the ranks are made only while no cancel() has come
            if self.status != AttemptStatus.STARTING:
                return
            self._workers = [
                TrainWorker.options(
                    num_gpus=1,
                    num_cpus=p.cpus_per_worker,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
                ).remote(rank, p.num_workers, home=p.home, run_as=p.run_as, code_uri=p.code_uri)
                for rank in range(p.num_workers)
            ]
        try:
            rendezvous = ray.get(
                [w.rendezvous.remote(p.rendezvous_timeout_s) for w in self._workers], timeout=p.rendezvous_timeout_s
            )
        except ray.exceptions.GetTimeoutError:
            raise RendezvousError(
                f"{p.num_workers} ranks were placed but did not all start within {p.rendezvous_timeout_s:g} s "
                "(rendezvous_timeout_s)"
            ) from None
        self._nodes = [node for _, _, node in rendezvous]
        address, port, _ = rendezvous[0]
        me = ray.get_runtime_context().current_actor
        runs = {
            w.run.remote(self.config, address, port, me, p.process_group_timeout_s, p.log_max_bytes): rank
            for rank, w in enumerate(self._workers)
        }
        with self._lock:
            cancelled = self.status != AttemptStatus.STARTING
            if not cancelled:
                self.status = AttemptStatus.RUNNING
        if cancelled:  # while starting: the ranks made since cancel() released go too
            self._release()
            return
        threading.Thread(target=self._watch, args=(runs,), daemon=True, name=f"watch-{self.job_id}").start()

    def report(self, rank: int, rows: list[MetricRow]) -> None:
        """Rows of one rank; a step is handed on once every rank has reported it."""
        with self._lock:
            for row in rows:
                by_rank = self._partial.setdefault(row.step, {})
                by_rank[rank] = row
                if len(by_rank) == self.placement.num_workers:
                    self._metrics.append(MetricRow.merge(self._partial.pop(row.step)))

    def report_logs(self, rank: int, lines: list[OutputLine]) -> None:
        """Log lines of one rank, in its order; held until a poll's caller says they are stored.
        Past the bound (Placement.log_max_bytes) the oldest held are dropped, and counted."""
        with self._lock:
            self._logs.add(lines)

    def poll(self, after_step: int = -1, log_acks: dict[int, int] | None = None) -> AttemptPoll:
        """Status, error, the steps after `after_step` completed on every rank (one row a step,
        rank 0's global values with every rank's mem_peak_bytes as a list), and each rank's log
        lines after the n `log_acks` gives for it (HeldLines.after), with the count of lines
        dropped (log_dropped: lines, bytes, since the attempt began).

        Rows up to `after_step` and lines up to the acks are dropped: the caller says what it has
        stored, so a caller that failed to store a batch gets it again on its next poll. An
        ended status (but "cancelled", set first) is reported once the ranks are gone and the
        group removed.
        """
        with self._lock:
            self._metrics = [row for row in self._metrics if row.step > after_step]
            return AttemptPoll(
                status=self.status,
                error=self.error,
                metrics=tuple(self._metrics),
                nodes=tuple(self._nodes),
                logs=tuple(self._logs.after(log_acks or {})),
                log_dropped=self._logs.dropped,
            )

    def request_stop(self, now: bool = False) -> None:
        """Stop the ranks (status "stopped") after their next checkpoint: an elastic job's resize; `now`:
        after their next step, with a checkpoint of it: a preemption. Once asked for, "now" stays."""
        with self._lock:
            self._stop_mode = "step" if now or self._stop_mode == "step" else "checkpoint"

    def stop_mode(self) -> StopMode | None:
        """None, or when the ranks are to stop (request_stop); rank 0's actor asks (rank_actor._StopAsker)."""
        return self._stop_mode

    def worker(self, rank: int) -> Any:
        return self._workers[rank]

    def cancel(self) -> None:
        """Kill every rank and free the placement group."""
        with self._lock:
            if self.status.ended:
                return
            self.status = AttemptStatus.CANCELLED
        self._release()

    def _watch(self, runs: dict[Any, int]) -> None:
        pending = list(runs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            for ref in done:
                rank = runs[ref]
                try:
                    self.results[rank] = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - any rank failure fails the job, with its cause
                    self._fail_with_root_cause(runs, rank, exc, pending)
                    return
        # GPUs first, then the news: a caller that sees the attempt over may drop this actor (a
        # group it made outlives it, held until the driver exits) and may place the next at once.
        self._release()
        with self._lock:
            if self.status == AttemptStatus.RUNNING:
                stopped = any(r.stopped for r in self.results.values())
                self.status = AttemptStatus.STOPPED if stopped else AttemptStatus.SUCCEEDED

    def _fail_with_root_cause(self, runs: dict[Any, int], rank: int, exc: Exception, pending: list[Any]) -> None:
        """Fail with the cause of the ranks' failures, not the first to arrive: the other ranks' reports
        that come within PEER_FAILURE_SETTLE_S are read too, and a peer's collective error gives way
        to the failure that caused it (root_cause)."""
        errors = [self._rank_error(rank, exc)]
        deadline = time.monotonic() + PEER_FAILURE_SETTLE_S
        while pending and (left := deadline - time.monotonic()) > 0:
            done, pending = ray.wait(pending, num_returns=1, timeout=left)
            for ref in done:
                try:
                    ray.get(ref)
                except Exception as other:  # noqa: BLE001 - read for its cause only
                    errors.append(self._rank_error(runs[ref], other))
        self._fail_with(root_cause(errors))

    def _rank_error(self, rank: int | None, exc: BaseException) -> RankError:
        node_id = self._nodes[rank] if rank is not None and rank < len(self._nodes) else None
        return RankError.of(exc, rank=rank, node_id=node_id)

    def _fail(self, rank: int | None, exc: Exception) -> None:
        """Status "failed" with the cause (`rank` None: the start failed, no one rank), then free everything."""
        self._fail_with(self._rank_error(rank, exc))

    def _fail_with(self, error: RankError) -> None:
        self._release()  # before the news, as in _watch
        with self._lock:
            if self.status != AttemptStatus.CANCELLED:  # a cancel wins: its ranks were killed on purpose
                self.status = AttemptStatus.FAILED
                self.error = error

    def _release(self) -> None:
        with self._lock:
            workers = list(self._workers)
            pg = self._pg
            self._pg = None
        for worker in workers:
            ray.kill(worker, no_restart=True)
        if pg is not None:
            remove_group(pg)


def _resources(resources: dict[str, float]) -> str:
    return ", ".join(f"{k}={resources.get(k, 0):g}" for k in ("GPU", "CPU"))

"""A rank's Ray actor, TrainWorker: thin, it holds its rank and the child that trains, and relays
for the child to the job's supervisor (workers/runtime/actors.py): metric rows in batches, log
lines in order, and rank 0's "stop after this step?", answered without a Ray round trip a step.

What it relays is worked out in workers/runtime/rank_parent.py, which tests drive without Ray; here
are the Ray calls: the supervisor's methods, asked by `.remote()` and waited on with ray.wait.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any, Literal

import ray

from workers.config import TrainConfig
from workers.records import RunAs, TrainResult
from workers.runtime.rank_parent import MetricsSink, RankProcess
from workers.runtime.rendezvous import parent_gone
from workers.runtime.sandbox import ChildSpec
from workers.runtime.spool import Spool
from workers.training import staging
from workers.training.storage import open_store
from workers.uris import is_remote

StopMode = Literal["checkpoint", "step"]
"""When a job asked to stop does: after its next checkpoint (an elastic job's resize), or after its
next step with a checkpoint of it (a preemption)."""


@ray.remote
class TrainWorker:
    """One rank's parent: it starts the child that trains (workers/runtime/rank_parent.py) as it starts, and
    relays for it. It holds its rank and its child, nothing else; it never loads torch."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        home: str | None = None,
        run_as: RunAs | None = None,
        code_uri: str | None = None,
    ) -> None:
        """`home`: the job's directory (None: a scratch one); `code_uri`: the job's code bundle as
        stored, which this process unpacks for the child to run in and import from."""
        self.rank = rank
        self.world_size = world_size
        self.raylet_gone = parent_gone()
        self.address = ray.util.get_node_ip_address()
        self.scratch = home is None  # removed after the run: checkpoints on an object store, or a test's
        self.home = home or tempfile.mkdtemp(prefix=f"zero1-rank{rank}-")
        self.run_as = run_as
        spec = ChildSpec(home=self.home, code_uri=code_uri, run_as=run_as)
        # started now: forked with torch loaded, or importing it while the job's other ranks are placed
        self.process = RankProcess(rank=rank, world_size=world_size, address=self.address, spec=spec)

    def rendezvous(self, timeout_s: float = 120.0) -> tuple[str, int, str]:
        """(address, port, node id) on this worker's node: rank 0's become the group's. Rank 0's
        child opens the group's store and holds its port; the other ranks' port is 0 (unused)."""
        port = self.process.store_port(timeout_s) if self.rank == 0 else 0
        return self.address, port, ray.get_runtime_context().get_node_id()

    def run(
        self, config: TrainConfig, address: str, port: int, supervisor: Any, pg_timeout_s: float, log_max_bytes: int
    ) -> TrainResult:
        """Train as this rank in the child, relaying its rows, lines and questions to the supervisor."""
        logs = _OrderedSender(lambda lines: supervisor.report_logs.remote(self.rank, lines))
        sink = MetricsSink(
            send=lambda rows: supervisor.report.remote(self.rank, rows),
            flush=lambda rows: ray.get(supervisor.report.remote(self.rank, rows)),
            delivered=_delivered,
        )
        spool = None
        if config.checkpoint_dir and is_remote(config.checkpoint_dir):
            # the child checkpoints into a spool in its home; this process stores it (it holds the credentials)
            store = open_store(config.checkpoint_dir)
            size = self.world_size
            spool = Spool(
                store, home=self.home, rank=self.rank, world_size=size, keep_last=config.keep_last, run_as=self.run_as
            )
            config = dataclasses.replace(config, checkpoint_dir=str(spool.dir))
        owner = None if self.run_as is None else (self.run_as.uid, self.run_as.gid)
        config, data_dir = staging.for_child(config, owner=owner)  # inputs on a store: fetched by this process
        start = {
            "config": config,
            "address": address,
            "port": port,
            "pg_timeout_s": pg_timeout_s,
            "log_max_bytes": log_max_bytes,
            "spool": spool is not None,
        }
        try:
            return self.process.run(
                start,
                sink=sink,
                send_logs=logs,
                stop_requested=_StopAsker(supervisor),
                parent_gone=self.raylet_gone,
                spool=spool,
            )
        finally:
            logs.wait()
            self.process.close()
            if spool is not None:
                spool.close()
            for scratch in (self.home if self.scratch else None, data_dir):
                if scratch is not None:
                    shutil.rmtree(scratch, ignore_errors=True)


class _StopAsker:
    """Rank 0's answers to "stop after this step?", asked at every step: exact after a checkpoint (it
    asks the supervisor and waits, as a resize needs), and never waiting after any other step: it
    answers from the supervisor's last reply, and keeps one call to it in flight at a time, made at
    most every `every_s`. A preemption then lands within about `every_s` and a step of being asked."""

    _ORDER = (None, "checkpoint", "step")  # the supervisor's mode only moves right

    def __init__(self, supervisor: Any, *, every_s: float = 0.25, timeout_s: float = 60.0) -> None:
        self._supervisor = supervisor
        self._every_s = every_s
        self._timeout_s = timeout_s
        self.mode: StopMode | None = None
        self._in_flight: Any = None
        self._asked_at = -float("inf")

    def __call__(self, step: int, checkpointed: bool) -> bool:
        if self.mode == "step":  # it stays: nothing more to ask
            return True
        if checkpointed:
            self._learn(ray.get(self._supervisor.stop_mode.remote(), timeout=self._timeout_s))
        else:
            if self._in_flight is not None and _delivered(self._in_flight, 0):
                reply = self._in_flight
                self._in_flight = None
                self._learn(ray.get(reply))
            if self._in_flight is None and time.monotonic() - self._asked_at >= self._every_s:
                self._in_flight = self._supervisor.stop_mode.remote()
                self._asked_at = time.monotonic()
        return self.mode == "step" or (self.mode == "checkpoint" and checkpointed)

    def _learn(self, mode: StopMode | None) -> None:
        """A reply made before a newer one that came first (the one in flight) takes nothing back."""
        self.mode = max(self.mode, mode, key=self._ORDER.index)


class _OrderedSender:
    """Sends a rank's log batches to the supervisor one after another: each once the one before it
    is delivered (the supervisor takes calls concurrently, so order is kept here)."""

    def __init__(self, send: Callable[[list[Any]], Any]) -> None:
        self._send = send
        self._in_flight = None

    def __call__(self, batch: list[Any]) -> None:
        self.wait()
        self._in_flight = self._send(batch)

    def wait(self, timeout_s: float = 30.0) -> None:
        if self._in_flight is not None:
            _delivered(self._in_flight, timeout_s)
            self._in_flight = None


def _delivered(ref: Any, timeout_s: float | None) -> bool:
    """Whether a Ray call has completed (delivered, or failed), waiting at most timeout_s."""
    ready, _ = ray.wait([ref], timeout=timeout_s)
    return bool(ready)

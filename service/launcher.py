"""Dispatch to Ray: each job runs under a JobSupervisor, a named detached actor."""

from __future__ import annotations

import logging
import math
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from service.config import Settings
from service.models import Job
from service.schemas import JobSpec, TextDataSpec
from workers.data import SyntheticSpec, TextSpec
from workers.train import OptimizerSpec, TrainConfig

log = logging.getLogger(__name__)
_RPC_TIMEOUT_S = 30
_STORAGE_TTL_S = 60.0


def supervisor_name(job_id: int, attempt: int = 0) -> str:
    """Each attempt has its own supervisor: a retry never waits for the old name to be freed."""
    return f"zero1-job-{job_id}-a{attempt}"


_NAME = re.compile(r"zero1-job-(\d+)-a(\d+)")


def train_config(
    spec: JobSpec, *, checkpoint_dir: str, keep_last: int = 0, data_roots: Sequence[str] = ()
) -> TrainConfig:
    """The workers' view of a job spec. A text job carries the data roots, resolved here (a
    relative root is under the service's working directory), for the ranks to check again
    where they read the file: none given, they read none."""
    if isinstance(spec.data, TextDataSpec):
        data = TextSpec(path=spec.data.path, roots=tuple(os.path.realpath(root) for root in data_roots))
    else:
        data = SyntheticSpec(branching=spec.data.branching)
    opt = spec.optimizer
    return TrainConfig(
        model=spec.model.to_spec(), steps=spec.steps, data=data, precision=spec.precision,
        optimizer=OptimizerSpec(lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay,
                                max_grad_norm=opt.max_grad_norm, overlap_comm=opt.overlap_comm,
                                bucket_cap_mb=opt.bucket_cap_mb),  # fmt: skip
        micro_batch_size=spec.micro_batch_size, global_batch_size=spec.global_batch_size, seq_len=spec.seq_len,
        seed=spec.seed, checkpoint_every=spec.checkpoint_every, checkpoint_dir=checkpoint_dir, keep_last=keep_last,
        activation_checkpointing=spec.activation_checkpointing, max_nonfinite_steps=spec.max_nonfinite_steps,
    )  # fmt: skip


class RayLauncher:
    """Starts, polls, cancels and releases job supervisors, one per (job, attempt)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._supervisors: dict[tuple[int, int], Any] = {}
        self._storage_problems: dict[str, str] = {}
        self._storage_checked_at = -math.inf

    def checkpoint_dir(self, job_id: int) -> str:
        return str(Path(self.settings.checkpoint_uri).resolve() / f"job-{job_id}")

    def resume_step(self, job_id: int) -> int:
        """The step a relaunch starts at: after the latest complete checkpoint, else 0."""
        from workers.train import latest_checkpoint

        found = latest_checkpoint(Path(self.checkpoint_dir(job_id)))
        return 0 if found is None else found[0] + 1

    def storage_problems(self) -> dict[str, str]:
        """Node id -> why that GPU node cannot write under ZERO1_CHECKPOINT_URI (empty when every
        one can), asked of the nodes themselves: on a cluster the path must be shared storage.
        Cached for a minute: a submit does not wait on Ray for it each time."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from workers.actors import probe_writable

        if time.monotonic() - self._storage_checked_at < _STORAGE_TTL_S:
            return self._storage_problems
        path = str(Path(self.settings.checkpoint_uri).resolve())
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU", 0) > 0]
        refs = [
            probe_writable.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(path)
            for node in nodes
        ]
        try:
            answers = ray.get(refs, timeout=_RPC_TIMEOUT_S)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:
            # not known either way: admit, and let a job that cannot checkpoint fail with the cause
            log.warning("could not probe the checkpoint storage: %s: %s", type(exc).__name__, exc)
            return {}
        self._storage_problems = {node: why for node, why in zip(nodes, answers, strict=True) if why}
        self._storage_checked_at = time.monotonic()
        return self._storage_problems

    def checkpointed_metrics(self, job_id: int, *, after_step: int) -> list[dict[str, Any]]:
        """Rows saved with the job's checkpoints after `after_step` (see workers.train)."""
        from workers.train import checkpointed_metrics

        return checkpointed_metrics(Path(self.checkpoint_dir(job_id)), after_step=after_step)

    def discard_stored_metrics(self, job_id: int, *, through_step: int) -> None:
        """Delete the job's pruned checkpoints whose rows are stored (see workers.train); a
        failure to delete is logged, not raised: it costs disk, not data."""
        from workers.train import discard_stored_metrics

        try:
            discard_stored_metrics(Path(self.checkpoint_dir(job_id)), through_step=through_step)
        except OSError as exc:
            log.warning("job %s: could not delete stored rows' checkpoint files: %s", job_id, exc)

    def launch(self, job: Job) -> None:
        """Start the job's current attempt; an attempt already started (the service stopped
        between launching it and committing) is adopted, not started twice."""
        from workers.actors import JobSupervisor, Placement

        config = train_config(
            JobSpec.model_validate(job.spec), checkpoint_dir=self.checkpoint_dir(job.id),
            keep_last=self.settings.checkpoint_keep_last, data_roots=self.settings.data_roots,
        )  # fmt: skip
        placement = Placement(
            num_workers=job.num_gpus, cpus_per_worker=self.settings.cpus_per_worker,
            timeout_s=self.settings.placement_timeout_s,
        )  # fmt: skip
        supervisor = JobSupervisor.options(
            name=supervisor_name(job.id, job.attempt), namespace=self.settings.ray_namespace,
            lifetime="detached", get_if_exists=True, scheduling_strategy=_on_head_node(),
        ).remote(str(job.id), config, placement)  # fmt: skip
        supervisor.start.remote()  # places the ranks in the background; poll() reports how it went
        self._supervisors[(job.id, job.attempt)] = supervisor

    def _handle(self, job_id: int, attempt: int) -> Any | None:
        import ray

        key = (job_id, attempt)
        if key not in self._supervisors:
            try:
                self._supervisors[key] = ray.get_actor(
                    supervisor_name(job_id, attempt), namespace=self.settings.ray_namespace
                )
            except ValueError:
                return None
        return self._supervisors[key]

    def exists(self, job_id: int, attempt: int) -> bool:
        """Whether the attempt's supervisor is alive in the Ray cluster (re-attaching to it)."""
        import ray

        supervisor = self._handle(job_id, attempt)
        if supervisor is None:
            return False
        try:
            ray.get(supervisor.ping.remote(), timeout=_RPC_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            self._supervisors.pop((job_id, attempt), None)
            return False
        return True

    def poll(self, job_id: int, attempt: int, *, after_step: int) -> dict[str, Any]:
        """The supervisor's poll(after_step); status "lost" when it is gone."""
        import ray

        supervisor = self._handle(job_id, attempt)
        name = supervisor_name(job_id, attempt)
        if supervisor is None:
            return _lost(f"no supervisor {name} in the Ray cluster")
        try:
            return ray.get(supervisor.poll.remote(after_step), timeout=_RPC_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            self._supervisors.pop((job_id, attempt), None)
            cause = str(exc).strip().splitlines()
            return _lost(f"supervisor {name} is unreachable: {type(exc).__name__}: {cause[0] if cause else ''}")

    def cancel(self, job_id: int, attempt: int) -> None:
        import ray

        supervisor = self._handle(job_id, attempt)
        if supervisor is not None:
            try:
                ray.get(supervisor.cancel.remote(), timeout=_RPC_TIMEOUT_S)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                log.warning("job %s: supervisor gone while cancelling", job_id)

    def release(self, job_id: int, attempt: int) -> None:
        """End an attempt's supervisor; its workers and placement group go with it."""
        import ray

        supervisor = self._supervisors.pop((job_id, attempt), None) or self._handle(job_id, attempt)
        self._supervisors.pop((job_id, attempt), None)
        if supervisor is not None:
            ray.kill(supervisor, no_restart=True)

    def supervisors(self) -> list[tuple[int, int]]:
        """(job id, attempt) of every zero1 supervisor alive in this deployment's namespace."""
        import ray

        found = []
        for entry in ray.util.list_named_actors(all_namespaces=True):
            match = _NAME.fullmatch(entry["name"])
            if match and entry["namespace"] == self.settings.ray_namespace:
                found.append((int(match[1]), int(match[2])))
        return found


def _on_head_node() -> Any:
    """Supervisors live on the head node (soft: anywhere if it has no room), so that losing a
    worker node costs the job its ranks there, which a retry replaces, not its supervisor."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    for node in ray.nodes():
        if node["Alive"] and "node:__internal_head__" in node["Resources"]:
            return NodeAffinitySchedulingStrategy(node_id=node["NodeID"], soft=True)
    return "DEFAULT"


def _lost(message: str) -> dict[str, Any]:
    return {"status": "lost", "metrics": [], "nodes": [],
            "error": {"rank": None, "node_id": None, "exception": "SupervisorLost", "message": message}}  # fmt: skip

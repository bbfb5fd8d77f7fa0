"""Dispatch to Ray: each job runs under a JobSupervisor, a named detached actor."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from service.config import Settings
from service.models import Job
from service.schemas import JobSpec, TextDataSpec
from workers.data import SyntheticSpec, TextSpec
from workers.train import OptimizerSpec, TrainConfig

log = logging.getLogger(__name__)
_RPC_TIMEOUT_S = 30


def supervisor_name(job_id: int) -> str:
    return f"zero1-job-{job_id}"


def train_config(spec: JobSpec, *, checkpoint_dir: str) -> TrainConfig:
    """The workers' view of a job spec."""
    data = TextSpec(path=spec.data.path) if isinstance(spec.data, TextDataSpec) else SyntheticSpec(
        branching=spec.data.branching
    )  # fmt: skip
    opt = spec.optimizer
    return TrainConfig(
        model=spec.model.to_spec(), steps=spec.steps, data=data, precision=spec.precision,
        optimizer=OptimizerSpec(lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay,
                                max_grad_norm=opt.max_grad_norm),
        micro_batch_size=spec.micro_batch_size, global_batch_size=spec.global_batch_size, seq_len=spec.seq_len,
        seed=spec.seed, checkpoint_every=spec.checkpoint_every, checkpoint_dir=checkpoint_dir,
        activation_checkpointing=spec.activation_checkpointing,
    )  # fmt: skip


class RayLauncher:
    """Starts, polls, cancels and releases job supervisors."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._supervisors: dict[int, Any] = {}

    def checkpoint_dir(self, job_id: int) -> str:
        return str(Path(self.settings.checkpoint_uri).resolve() / f"job-{job_id}")

    def launch(self, job: Job) -> None:
        from workers.actors import JobSupervisor, Placement

        config = train_config(JobSpec.model_validate(job.spec), checkpoint_dir=self.checkpoint_dir(job.id))
        placement = Placement(
            num_workers=job.num_gpus, cpus_per_worker=self.settings.cpus_per_worker,
            timeout_s=self.settings.placement_timeout_s,
        )  # fmt: skip
        supervisor = JobSupervisor.options(
            name=supervisor_name(job.id), namespace=self.settings.ray_namespace, lifetime="detached"
        ).remote(str(job.id), config, placement)
        supervisor.start.remote()  # places the ranks in the background; poll() reports how it went
        self._supervisors[job.id] = supervisor

    def _handle(self, job_id: int) -> Any | None:
        import ray

        if job_id not in self._supervisors:
            try:
                self._supervisors[job_id] = ray.get_actor(supervisor_name(job_id), namespace=self.settings.ray_namespace)
            except ValueError:
                return None
        return self._supervisors[job_id]

    def poll(self, job_id: int, *, after_step: int) -> dict[str, Any]:
        """The supervisor's poll(after_step); status "lost" when it is gone."""
        import ray

        supervisor = self._handle(job_id)
        if supervisor is None:
            return _lost(f"no supervisor {supervisor_name(job_id)} in the Ray cluster")
        try:
            return ray.get(supervisor.poll.remote(after_step), timeout=_RPC_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            return _lost(f"supervisor {supervisor_name(job_id)} is unreachable: {type(exc).__name__}")

    def cancel(self, job_id: int) -> None:
        import ray

        supervisor = self._handle(job_id)
        if supervisor is not None:
            try:
                ray.get(supervisor.cancel.remote(), timeout=_RPC_TIMEOUT_S)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                log.warning("job %s: supervisor gone while cancelling", job_id)

    def release(self, job_id: int) -> None:
        """End a finished job's supervisor (its workers and placement group are already freed)."""
        import ray

        supervisor = self._supervisors.pop(job_id, None) or self._handle(job_id)
        self._supervisors.pop(job_id, None)
        if supervisor is not None:
            ray.kill(supervisor, no_restart=True)


def _lost(message: str) -> dict[str, Any]:
    return {"status": "lost", "metrics": [], "nodes": [],
            "error": {"rank": None, "node_id": None, "exception": "SupervisorLost", "message": message}}  # fmt: skip

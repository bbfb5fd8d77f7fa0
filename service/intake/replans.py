"""A job whose attempt ran out of memory, planned again: the recommender's next configuration that keeps
its global batch (service/planning/replans.py), its spec and plan made as admission makes them
(service/intake/admission.py), for the failure policy to relaunch it at (service/scheduling/failure.py).

The scheduler calls a Replanner between transactions: a python or hf model's plan at another
micro-batch is a trace, a Ray task (cached by digest, run as the job's owner's uid), waited for in the
scheduler's thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from service.intake.admission import plan_request
from service.planning import replans
from service.planning.capacity import ClusterCapacity
from service.planning.plans import make_plan, model_shape, plan_public, workload_for
from service.planning.recommendations import cost_model_of
from service.planning.traces import TracedStep, Tracer, TraceRequest
from service.scheduling.failure import Replan
from service.schemas.model_specs import GPTModelSpec, HFModelSpec
from service.schemas.requests import RUNNABLE_STAGES, JobSpec
from service.schemas.responses import PlanPublic
from service.settings import Settings
from service.store.tables import Job
from workers.memory import model as memory
from workers.memory.model import GB
from workers.records import RankError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _OwnersTraces:
    """The service's tracer, its traces' children run as the job's owner's uid (ZERO1_RUN_AS)."""

    tracer: Tracer
    user: str | None

    def trace(self, request: TraceRequest) -> TracedStep:
        return self.tracer.trace(request, user=self.user)


class Replanner:
    """replanner(job, error): an out-of-memory attempt's job at its next configuration, or why none."""

    def __init__(self, settings: Settings, *, capacity: Callable[[], ClusterCapacity], tracer: Tracer) -> None:
        self.overhead_bytes = round(settings.gpu_overhead_gb * GB)
        self.cost_model = cost_model_of(settings)
        self.capacity = capacity
        """The cluster's GPUs and their memory, now, as admission plans against."""
        self.tracer = tracer

    def __call__(self, job: Job, error: RankError) -> Replan:
        spec = JobSpec.model_validate(job.spec)
        plan = PlanPublic.model_validate(job.plan)
        num_gpus = job.world_size or job.num_gpus
        traces = _OwnersTraces(self.tracer, job.owner)
        cluster = self.capacity()

        def spec_at(micro_batch_size: int, activation_checkpointing: bool) -> JobSpec:
            # the global batch stated: a spec that left it to micro_batch_size x num_gpus keeps it so
            fields = {"micro_batch_size": micro_batch_size, "global_batch_size": spec.batch_size}
            if _has_checkpointing(spec):
                fields["activation_checkpointing"] = activation_checkpointing
            return JobSpec.model_validate(spec.model_dump(mode="json") | fields)

        def workload_of(micro_batch_size: int, activation_checkpointing: bool) -> memory.Workload:
            request = plan_request(spec_at(micro_batch_size, activation_checkpointing), cluster=cluster)
            return workload_for(request, overhead_bytes=self.overhead_bytes, tracer=traces)

        failed = replans.Configuration(
            micro_batch_size=spec.micro_batch_size,
            activation_checkpointing=spec.activation_checkpointing,
            stage=plan.stage_for(num_gpus),
        )
        kept = replans.Kept(
            num_gpus=num_gpus,
            global_batch_size=spec.batch_size,
            num_tokens=spec.batch_size * _seq_len(spec, plan),
            stages=RUNNABLE_STAGES if spec.zero_stage == "auto" else (spec.zero_stage,),
            checkpointing_applies=_has_checkpointing(spec),
        )
        chosen = replans.next_configuration(workload_of, failed=failed, kept=kept, cost_model=self.cost_model)
        if chosen is None:
            return Replan(reason=replans.none_left_words(failed, kept=kept))
        log.info("job %s: %s", job.id, chosen.why)
        new_spec = spec_at(chosen.micro_batch_size, chosen.activation_checkpointing)
        request = plan_request(new_spec, cluster=cluster, stage=chosen.stage)
        made = make_plan(request, cluster=cluster, overhead_bytes=self.overhead_bytes, tracer=traces)
        where = ("" if error.rank is None else f" on rank {error.rank}") + f" ({error.exception}: {error.message})"
        return Replan(
            reason=replans.replan_words(failed, replans.configuration_of(chosen), kept=kept, where=where),
            spec=new_spec,
            plan=plan_public(made, shape=model_shape(request, tracer=traces)),
        )


def _has_checkpointing(spec: JobSpec) -> bool:
    """Whether the job's model has activation checkpointing of zero1's (a python model checkpoints its own)."""
    return isinstance(spec.model, (GPTModelSpec, HFModelSpec))


def _seq_len(spec: JobSpec, plan: PlanPublic) -> int:
    """Tokens a sample holds, for the step cost: seq_len, else the model's (an MLP's sample is one)."""
    return spec.seq_len or plan.block_size or getattr(spec.model, "block_size", None) or 1

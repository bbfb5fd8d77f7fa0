"""What the REST API returns: one model per response body, built from the stored rows and the
planner's results (the request bodies, which validate input, are service/schemas/plan_requests.py's
and service/schemas/requests.py's)."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field, computed_field, field_validator

from service.schemas.fields import JobStatus, OptimizerName, Precision


class BreakdownPublic(BaseModel):
    params_bytes: int
    grads_bytes: int
    buckets_bytes: int = Field(
        description="Stage 2's: the staging buffers of its gradient buckets at the step's peak; 0 at other stages."
    )
    optimizer_bytes: int
    padding_bytes: int
    activations_bytes: int = Field(
        description="Alive when one micro-batch's forward returns: its inputs and saved tensors."
    )
    temporaries_bytes: int = Field(
        description="The rest of that step's peak: logits, gradients in flight, a recomputed block."
    )
    overhead_bytes: int
    total_bytes: int


class SweepPointPublic(BaseModel):
    num_gpus: int
    total_bytes: int
    fits: bool


class PlanPublic(BaseModel):
    """A capacity plan: per-GPU bytes at N, the fit, and how it moves with N and stage."""

    num_params: int
    method: Literal["formula", "model", "traced"] = Field(
        description="formula: num_params alone; model: the built-in model's closed forms; "
        "traced: its step counted on fake tensors."
    )
    num_gpus: int
    stage: int
    precision: Precision
    optimizer: OptimizerName
    per_gpu: BreakdownPublic
    gpu_memory_bytes: int
    fits: bool
    headroom_bytes: int
    min_gpus: int | None = Field(description="Smallest N that fits at this stage; null if none does.")
    stages: dict[str, int] = Field(description="Per-GPU total of each stage 0-3 at this N.")
    sweep: list[SweepPointPublic] = Field(description="Per-GPU total at this stage for N = 1, 2, 4, ... 1024.")
    vocab_size: int | None = Field(
        None, description="An hf model's vocabulary, as its trace resolved the config; null for other plans."
    )
    block_size: int | None = Field(
        None, description="An hf model's max_position_embeddings (the default seq_len), likewise; null otherwise."
    )
    stage_at: dict[str, int] | None = Field(
        None,
        description="An elastic job with zero_stage auto: the stage it trains at on each N it may run on, the "
        "first that fits there (a resize may change it); null otherwise: `stage` at every N.",
    )

    def stage_for(self, world_size: int) -> int:
        """The ZeRO stage an attempt on `world_size` ranks trains at."""
        return self.stage if self.stage_at is None else self.stage_at.get(str(world_size), self.stage)


class HealthPublic(BaseModel):
    status: Literal["ok", "degraded"] = Field(
        description="degraded (with status code 503): the scheduler has not completed a tick for "
        "ZERO1_SCHEDULER_STALE_S, so no job is admitted, stopped or has its metrics stored."
    )
    version: str
    scheduler_tick_age_s: float | None = Field(description="Seconds since the scheduler last completed a tick.")


class ErrorPublic(BaseModel):
    """Every error the API returns."""

    error: str
    message: str
    detail: list[dict] | None = None


class MlflowRunPublic(BaseModel):
    """A job's MLflow run (ZERO1_MLFLOW_TRACKING_URI): where its params, metrics, status and final/ go."""

    run_id: str
    experiment_id: str | None
    url: str | None = Field(
        description="The run's page on the MLflow server; null for a tracking URI that is no server."
    )
    exported_step: int | None = Field(
        description="The last step whose metrics row the run holds; null before the first."
    )


class JobPublic(BaseModel):
    """A job as a reader sees it: everyone sees who holds the GPUs (name, owner, status, GPUs, progress, plan);
    spec, latest and error are null for all but the job's owner and admins."""

    id: int
    name: str
    status: JobStatus
    spec: dict | None = Field(
        description="The JobSpec as submitted (data.path resolved; after an out-of-memory replan, its configuration); "
        "null unless the caller owns the job or is an admin."
    )
    plan: dict
    num_gpus: int = Field(description="The most GPUs it runs on (all of them unless elastic).")
    min_gpus: int = Field(description="The fewest it runs on: num_gpus unless elastic.")
    world_size: int | None = Field(description="The N its current attempt runs at; null before its first start.")
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    step: int | None = Field(description="The index (from 0) of the last step with stored metrics; null before it.")
    steps: int

    @computed_field(description="Steps done, a count beside steps (step + 1): 300 of 300 when it is done.")
    @property
    def steps_done(self) -> int:
        return 0 if self.step is None else self.step + 1

    latest: dict | None = Field(
        description="The last metrics row; null before it, and unless the caller owns the job or is an admin."
    )
    error: dict | None = Field(
        description="Why the job failed (rank, node, exception); null unless it did, and "
        "unless the caller owns the job or is an admin."
    )
    attempt: int = Field(
        description="0 for the first launch, +1 for each relaunch (a retry, or a recovery after a service restart)."
    )
    num_retries: int = Field(0, description="Relaunches after a worker failure; at most spec.max_retries.")
    num_rollbacks: int = Field(
        0, description="Rollbacks after a diverged run (none a retry); at most spec.health.max_rollbacks."
    )
    queue_position: int | None = Field(description="1 for the next job to start; null unless queued.")
    owner: str | None = Field(None, description="The user whose token submitted it; null while auth is off.")
    priority: int = Field(50, description="0-100: the queue runs the highest first; a job may preempt lower ones.")
    tags: list[str] = Field([], description="Its tags, in alphabetical order (GET /v1/jobs?tag= finds it by one).")
    depends_on: list[int] = Field([], description="The jobs that must succeed before it starts.")
    notes: str | None = Field(
        None, description="Its notes; null unless set and the caller owns the job or is an admin."
    )
    borrowed: bool = Field(
        False, description="It runs past its owner's GPU quota on idle GPUs: the first to be preempted."
    )
    mlflow: MlflowRunPublic | None = Field(
        None,
        description="Its MLflow run (docs/api.md, MLflow): in GET /v1/jobs/{id} to its owner and admins, once the run "
        "exists; null otherwise.",
    )


class JobsPublic(BaseModel):
    data: list[JobPublic]
    next_cursor: str | None


class DryRunPublic(BaseModel):
    dry_run: Literal[True]
    admitted: bool
    plan: PlanPublic


class MetricPublic(BaseModel):
    step: int
    attempt: int
    loss: float | None
    grad_norm: float | None = Field(description="Null when not finite (a skipped step).")
    loss_scale: float
    skipped: bool
    step_time_s: float
    tokens_per_s: float
    mem_peak_bytes: list[int] = Field(description="Measured peak bytes per rank.")
    mem_planned_bytes: int
    eval_loss: float | None = Field(None, description="Held-out loss on a step that evaluated (eval_every).")
    world_size: int | None = Field(
        None, description="The N the step ran at (an elastic job's changes); null for rows stored before it was kept."
    )
    checkpoint_blocked_s: float | None = Field(
        None,
        description="Seconds the step's checkpoint held training up (waiting for the previous checkpoint's write "
        "and copying the shard to host memory; the whole write where checkpoints are synchronous); null on a step "
        "without a checkpoint.",
    )
    lr: float | None = Field(
        None, description="The learning rate the step used (optimizer.schedule's); null for rows stored before it."
    )

    @field_validator("loss", "grad_norm", "eval_loss", "checkpoint_blocked_s", "lr", mode="before")
    @classmethod
    def _finite_or_null(cls, value):
        return value if value is None or math.isfinite(value) else None


class MetricsPublic(BaseModel):
    data: list[MetricPublic]
    next_after_step: int | None = Field(description="Pass as after_step for the next page; null at the end.")


class LogLinePublic(BaseModel):
    seq: int = Field(description="Its place in the job's log: pass the last one seen as `after`.")
    time: datetime = Field(description="When the rank wrote it.")
    rank: int | None = Field(description="The rank that wrote it; null for the marker line.")
    attempt: int | None = Field(description="The attempt it was written in; null for the marker line.")
    stream: Literal["stdout", "stderr", "log", "marker"] = Field(
        description="stdout, stderr, log (Python logging), or marker: how many older lines were dropped "
        "(ZERO1_LOG_MAX_BYTES)."
    )
    line: str


class LogsPublic(BaseModel):
    data: list[LogLinePublic]
    next: int = Field(description="Pass as `after` for the next page (the last seq; `after` when there is none).")


class ArtifactPublic(BaseModel):
    name: str
    bytes: int
    sha256: str = Field(description="Hex digest of the file's bytes, computed by the service when the job succeeded.")


class ArtifactsPublic(BaseModel):
    data: list[ArtifactPublic]
    count: int


class CheckpointFilePublic(BaseModel):
    name: str = Field(
        description="A rank's shard (`rank-00000-of-00002.safetensors`) or the checkpoint's `complete.json`."
    )
    bytes: int


class CheckpointPublic(BaseModel):
    step: int = Field(description="The last step the checkpoint holds (0-based): a resume starts at step + 1.")
    files: list[CheckpointFilePublic]


class CheckpointsPublic(BaseModel):
    data: list[CheckpointPublic]
    count: int


class EventPublic(BaseModel):
    at: datetime
    from_status: str | None
    to_status: str
    reason: str
    gpus: int | None = Field(
        None,
        description="GPUs the job holds from this event until its next (its N while starting, running or "
        "restarting; 0 otherwise), as GET /v1/usage counts them; null for events stored before it was kept.",
    )


class EventsPublic(BaseModel):
    data: list[EventPublic]


class ClusterPublic(BaseModel):
    num_gpus: int
    num_gpus_free: int
    gpu_memory_bytes: int
    nodes: int
    simulated: bool
    data_roots: list[str] = Field(
        description="Where a text or dataset job's data.path (and tokenizer) may lie: ZERO1_DATA_ROOTS, resolved "
        "as the service resolves a path (real directories, or s3:// prefixes)."
    )
    model_roots: list[str] = Field(description="Where an hf model's path may lie: ZERO1_MODEL_ROOTS, resolved alike.")


class RecommendationPublic(BaseModel):
    """One configuration that fits: POST /v1/plan at these num_gpus, micro_batch_size and
    activation_checkpointing says the same total_bytes."""

    num_gpus: int
    micro_batch_size: int
    accumulation_steps: int = Field(description="global_batch_size / (num_gpus x micro_batch_size).")
    activation_checkpointing: bool
    zero_stage: int = Field(description="The ZeRO stage: a job's zero_stage, and POST /v1/plan's stage.")
    total_bytes: int = Field(description="Per-GPU bytes of the plan at this configuration.")
    headroom_bytes: int
    cost: float = Field(description="GPU-seconds per optimizer step: num_gpus x (compute_s + comm_s).")
    compute_s: float = Field(description="Seconds each GPU computes per step, at cost_model.gpu_tflops.")
    comm_s: float = Field(description="Seconds each GPU communicates per step, at cost_model.network_gb_per_s.")
    why: str = Field(description="What limits this configuration, with the numbers.")


class CostModelPublic(BaseModel):
    """How `cost` is computed, with every input, so that it can be checked by hand."""

    formula: str
    unit: str
    gpu_tflops: float = Field(description="Stated throughput per GPU, TFLOP/s (ZERO1_PLAN_GPU_TFLOPS).")
    network_gb_per_s: float = Field(description="Stated bandwidth per GPU, GB/s (ZERO1_PLAN_NETWORK_GB_PER_S).")
    num_params: int
    tokens_per_step: int = Field(description="global_batch_size x seq_len (an MLP: global_batch_size).")
    bytes_per_param: int = Field(description="Bytes of a parameter or gradient on the wire, at the precision.")


class RecommendationsPublic(BaseModel):
    """The ZeRO stage 1 configurations that fit, cheapest first."""

    recommendations: list[RecommendationPublic] = Field(
        description="Per (num_gpus, activation_checkpointing) the largest micro-batch that fits; sorted by cost, "
        "then fewer GPUs, larger micro-batch, no checkpointing. Always holds the fewest GPUs that fit."
    )
    count: int
    global_batch_size: int
    max_gpus: int
    gpu_memory_bytes: int
    cost_model: CostModelPublic


class CodeBundlePublic(BaseModel):
    """A stored code bundle, as its upload answers."""

    code: str = Field(description="sha256:<64 hex> of the zip's bytes as uploaded: what a job's `code` names.")
    bytes: int = Field(description="The zip's size.")
    files: int = Field(description="Regular files in it.")


class CodeBundleDetailPublic(CodeBundlePublic):
    uploaded_by: list[str | None] = Field(
        description="Who uploaded it, first uploader first: every one to an admin, only yourself to others; "
        "null for an upload while auth was off."
    )
    created_at: datetime = Field(description="The first of those uploads.")


class QueueEntryPublic(BaseModel):
    """A queued job in the queue's order: what anyone may see of it, and why it waits."""

    position: int = Field(description="1 for the next job to start.")
    id: int
    name: str
    owner: str | None = Field(description="The user whose token submitted it; null while auth is off.")
    priority: int
    num_gpus: int = Field(description="The most GPUs it runs on.")
    min_gpus: int = Field(description="The fewest it runs on: num_gpus unless elastic.")
    created_at: datetime
    reason: str = Field(
        description="Why it waits, as of the scheduler's last tick: e.g. `waiting for 4 GPUs, 2 free`, "
        "`quota: intern holds 2 of 2 GPUs`, `behind job 7 (priority 90)`."
    )
    estimated_start: datetime | None = Field(
        None,
        description="When it is estimated to start: the queue's policy replayed forward from now on the jobs "
        "holding GPUs (each ending after its steps left x its step time) and the queue ahead of it. Null where "
        "unknown: it waits for GPUs that a job of unknown length holds (one with no step time yet, or a queued "
        "job that never trained), or for a dependency. Jobs submitted later are not foreseen.",
    )


def starts_in(estimated_start: datetime | None, *, now: datetime, unknown: str = "-") -> str:
    """A QueueEntryPublic's estimated_start as `zero1 queue` and the dashboard's queue panel write it, from
    `now`: '<1 min', 'in 12 min', 'in 3.4 h', 'in 2.1 d'; `unknown` for none (dashboard.js: startsIn)."""
    if estimated_start is None:
        return unknown
    seconds = (estimated_start - now).total_seconds()
    if seconds < 60:
        return "<1 min"
    if seconds < 3600:
        return f"in {seconds // 60:.0f} min"
    if seconds < 2 * 86_400:
        return f"in {seconds / 3600:.1f} h"
    return f"in {seconds / 86_400:.1f} d"


class OwnerUsagePublic(BaseModel):
    """An owner's GPUs against their quota."""

    owner: str | None = Field(description="Null: jobs submitted while auth was off.")
    gpus_in_use: int = Field(description="GPUs their starting, running and restarting jobs hold (each its N).")
    borrowed_gpus: int = Field(description="Of those, the GPUs of jobs running past the quota (preempted first).")
    quota: int | None = Field(description="ZERO1_GPU_QUOTAS' entry for them (or `*`'s); null: no quota.")


class QueuePublic(BaseModel):
    """GET /v1/queue: the queued jobs in the order they start, and who holds the GPUs."""

    data: list[QueueEntryPublic]
    count: int = Field(description="Queued jobs in all (data holds the first `limit`).")
    owners: list[OwnerUsagePublic] = Field(
        description="Each owner with a job that holds GPUs or waits (queued or suspended), most GPUs first."
    )

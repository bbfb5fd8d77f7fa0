"""Request bodies of the REST API's jobs (and the CLI, which shares them): a job's spec, its
init_from, its world sizes and a priority patch. The plans' and recommendations' are
service/schemas/plan_requests.py's; the model and data specs they hold are
service/schemas/model_specs.py's and service/schemas/data_specs.py's; the field types all share,
service/schemas/fields.py's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from service.schemas.data_specs import DataSpec, SyntheticDataSpec
from service.schemas.fields import MAX_DEPENDENCIES, MAX_TAGS, Body, Bool, Int, JobIds, Notes, Precision, Tags, Text
from service.schemas.health import DataSkipSpec, HealthSpec
from service.schemas.model_specs import (
    MLPModelSpec,
    ModelSpec,
    PythonModelSpec,
    TracedModelSpec,
)
from service.schemas.optimizer_specs import MAX_STEPS, OptimizerConfig
from service.schemas.plan_requests import (
    MAX_GLOBAL_BATCH_SIZE,
    MAX_MICRO_BATCH_SIZE,
    MAX_NUM_GPUS,
    PlanRequest,
    check_code,
    code_field,
)
from workers.config import DataSkip, FieldError, InitSpec, ModelKind, TrainConfig, default_of
from workers.memory import model as memory

if TYPE_CHECKING:
    from service.schemas.responses import PlanPublic

ZeroStage = Literal[1, 2, 3, "auto"]
RUNNABLE_STAGES = (1, 2, 3)
"""The ZeRO stages a job trains at (workers/zero: ZeRO1AdamW, ZeRO2AdamW, ZeRO3AdamW on FSDP2); the
planner models 0-3."""


def _train(name: str):
    return default_of(TrainConfig, name)


def world_sizes(*, min_gpus: int, num_gpus: int, micro_batch_size: int, batch_size: int) -> list[int]:
    """The N a job may run at, ascending: those in [min_gpus, num_gpus] with batch_size a multiple of
    micro_batch_size x N (gradient accumulation makes up the rest). [num_gpus] for a job that is not
    elastic (min_gpus == num_gpus)."""
    return [n for n in range(min_gpus, num_gpus + 1) if batch_size % (micro_batch_size * n) == 0]


class InitFromSpec(Body):
    """A job's init_from: start from another succeeded job's final/ weights, with fresh optimizer state.
    `job` is the user's; the rest the service fills in at submit (service/intake/init_from.py),
    replacing anything given."""

    job: Int = Field(ge=1, le=2**63 - 1, description="A succeeded job of the caller's own (any job, for an admin).")
    uri: Text | None = Field(None, description="The service's: where the source job's final/ is stored.")
    sha256: Text | None = Field(None, description="The service's: final/model.safetensors' recorded sha256.")
    bytes: Int | None = Field(None, ge=0, description="The service's: final/model.safetensors' recorded size.")

    def to_spec(self) -> InitSpec:
        if self.uri is None or self.sha256 is None or self.bytes is None:
            raise ValueError(f"init_from: job {self.job}'s weights were not resolved when the job was submitted")
        return InitSpec(job=self.job, uri=self.uri, sha256=self.sha256, bytes=self.bytes)


class JobSpec(Body):
    """POST /v1/jobs: what to train, on how many GPUs."""

    name: Text = Field(min_length=1, max_length=200)
    model: ModelSpec
    data: DataSpec = SyntheticDataSpec(kind="synthetic")
    num_gpus: Int = Field(ge=1, le=MAX_NUM_GPUS, description="Data-parallel world size N (elastic: the most).")
    min_gpus: Int | None = Field(
        None,
        ge=1,
        le=MAX_NUM_GPUS,
        description="Elastic: the fewest GPUs it runs on (default num_gpus: not elastic). It runs at any N in "
        "[min_gpus, num_gpus] that divides its global batch into micro-batches, resized at checkpoints.",
    )
    precision: Precision = _train("precision")
    optimizer: OptimizerConfig = OptimizerConfig()
    zero_stage: ZeroStage = Field(
        1,
        description="The ZeRO stage it trains at: 1 shards the optimizer state, 2 the gradients too (per GPU "
        "2Ψ + 14Ψ/N in fp16 instead of 4Ψ + 12Ψ/N), 3 the parameters too (16Ψ/N and the units FSDP2 "
        "gathers); auto: the first of 1, 2, 3 whose plan fits the cluster, named in the job's plan and its "
        "first event.",
    )
    steps: Int = Field(ge=1, le=MAX_STEPS)
    micro_batch_size: Int = Field(_train("micro_batch_size"), ge=1, le=MAX_MICRO_BATCH_SIZE)
    global_batch_size: Int | None = Field(
        None,
        ge=1,
        le=MAX_GLOBAL_BATCH_SIZE,
        description="Default micro_batch_size x num_gpus; more accumulates gradients.",
    )
    seq_len: Int | None = Field(
        None,
        ge=1,
        le=100_000_000,
        description="Sequence models only; default block_size (hf: max_position_embeddings).",
    )
    activation_checkpointing: Bool = _train("activation_checkpointing")
    code: Text | None = code_field()
    seed: Int = Field(_train("seed"), ge=0, le=2**63 - 1)
    checkpoint_every: Int = Field(
        _train("checkpoint_every"), ge=0, le=100_000_000, description="0: a checkpoint at the end only."
    )
    keep_last: Int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="Complete checkpoints the job keeps while it runs, the newest (default "
        "ZERO1_CHECKPOINT_KEEP_LAST); older ones are deleted as new ones complete.",
    )
    eval_every: Int = Field(
        _train("eval_every"),
        ge=0,
        le=100_000_000,
        description="Steps between evaluations on the held-out data (and the last step); 0: none. "
        "Rows of those steps carry eval_loss.",
    )
    eval_batches: Int = Field(
        _train("eval_batches"), ge=1, le=10_000, description="Held-out micro-batches each rank evaluates."
    )
    init_from: InitFromSpec | None = Field(
        None, description='{"job": ID}: start from that succeeded job\'s final weights (a model of the same shape).'
    )
    max_retries: Int = Field(0, ge=0, le=100)
    priority: Int | None = Field(
        None,
        ge=0,
        le=100,
        description="0-100, highest first (default ZERO1_DEFAULT_PRIORITY); up to the owner's ceiling "
        "(ZERO1_PRIORITY_LIMITS). A job may preempt jobs of lower priority.",
    )
    max_nonfinite_steps: Int = Field(
        _train("max_nonfinite_steps"),
        ge=1,
        le=1_000_000,
        description="Steps in a row with a nan or inf gradient norm (each skipped) after which the job fails; "
        "fp16's loss scaler may skip up to 16 in a row at the start.",
    )
    health: HealthSpec = Field(
        default_factory=HealthSpec,
        description='Divergence rollback and hang detection (docs/api.md, "Training health").',
    )
    data_skips: list[DataSkipSpec] = Field(
        [],
        max_length=100,
        description="Batches never trained on, as a rollback skips them: a run given its rollbacks' skips "
        'from the start reads the same batches (docs/api.md, "Training health").',
    )
    tags: Tags = Field(
        [],
        max_length=MAX_TAGS,
        description="Labels to find it by (GET /v1/jobs?tag=); PATCH /v1/jobs/{id} replaces them.",
    )
    notes: Notes | None = Field(None, description="Free text for its owner; PATCH /v1/jobs/{id} replaces it.")
    notify: str | None = Field(
        None,
        max_length=2000,
        pattern=r"^https?://[^\s]+$",
        description="A URL that is POSTed the job's end, as ZERO1_WEBHOOK_URL is; its host must be one of "
        "ZERO1_WEBHOOK_NOTIFY_HOSTS.",
    )
    depends_on: JobIds = Field(
        [],
        max_length=MAX_DEPENDENCIES,
        description="Jobs (ids) that must succeed before it starts: it waits in the queue meanwhile, and is "
        "cancelled if one fails or is cancelled.",
    )

    @property
    def batch_size(self) -> int:
        """Samples per optimizer step: global_batch_size, or micro_batch_size x num_gpus. The same at
        every world size an elastic job runs at (accumulation makes up the rest)."""
        return self.global_batch_size or self.micro_batch_size * self.num_gpus

    def world_sizes(self) -> list[int]:
        """The N it may run at (see world_sizes())."""
        return world_sizes(
            min_gpus=self.min_gpus or self.num_gpus,
            num_gpus=self.num_gpus,
            micro_batch_size=self.micro_batch_size,
            batch_size=self.batch_size,
        )

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if self.min_gpus is None or self.min_gpus == self.num_gpus:
            per_step = self.micro_batch_size * self.num_gpus
            if self.global_batch_size is not None and self.global_batch_size % per_step:
                raise FieldError(
                    "global_batch_size",
                    f"global_batch_size ({self.global_batch_size}) must be a multiple of micro_batch_size "
                    f"({self.micro_batch_size}) x num_gpus ({self.num_gpus}) = {per_step}",
                )
        elif self.min_gpus > self.num_gpus:
            raise FieldError("min_gpus", f"min_gpus ({self.min_gpus}) must be <= num_gpus ({self.num_gpus})")
        elif not self.world_sizes():
            raise FieldError(
                "min_gpus",
                f"no world size N in [min_gpus, num_gpus] = [{self.min_gpus}, {self.num_gpus}] divides the global "
                f"batch ({self.batch_size}) into micro-batches of {self.micro_batch_size}: "
                f"N x micro_batch_size must divide global_batch_size",
            )
        check_code(
            self.model, code=self.code, seq_len=self.seq_len, activation_checkpointing=self.activation_checkpointing
        )
        self.optimizer.schedule.check_steps(self.steps)
        if isinstance(self.model, MLPModelSpec):
            if self.seq_len is not None or self.activation_checkpointing:
                field = "seq_len" if self.seq_len is not None else "activation_checkpointing"
                raise FieldError(field, "seq_len and activation_checkpointing only apply to a gpt model")
            if not isinstance(self.data, SyntheticDataSpec):
                raise FieldError("data.kind", "an mlp model trains on synthetic data only")
        elif isinstance(self.model, TracedModelSpec):
            return self  # seq_len and the parameter count are checked by its trace, at admission
        elif self.seq_len is not None and self.seq_len > self.model.block_size:
            raise FieldError(
                "seq_len", f"seq_len ({self.seq_len}) must be <= model.block_size ({self.model.block_size})"
            )
        num_params = self.model.to_spec().num_params
        if num_params > memory.MAX_NUM_PARAMS:
            raise FieldError(
                "model", f"model has {num_params:,} parameters, above the limit of {memory.MAX_NUM_PARAMS:,}"
            )
        return self

    def to_config(
        self,
        *,
        checkpoint_dir: str,
        keep_last: int = 0,
        async_checkpoints: bool = True,
        resume: bool = True,
        data_roots: Sequence[str] = (),
        dataset_cache_dir: str | None = None,
        model_roots: Sequence[str] = (),
        plan: PlanPublic | None = None,
        world_size: int | None = None,
        rollback_skips: Sequence[DataSkip] = (),
        lr_scale: float = 1.0,
    ) -> TrainConfig:
        """The workers' view of this job: every field converted once, here. An hf or python model takes
        its vocab_size, block_size and planned bytes from the plan it was admitted by (its trace's).
        `keep_last` is the server's default (ZERO1_CHECKPOINT_KEEP_LAST); the spec's own wins. The ZeRO stage
        is the plan's at `world_size` (an elastic auto job's may differ by N), the plan's own without one.
        `rollback_skips` and `lr_scale` are the job's rollbacks' (service/scheduling/health.py)."""
        traced = isinstance(self.model, TracedModelSpec)
        return TrainConfig(
            model=self.model_spec(plan=plan, model_roots=model_roots),
            planned_bytes=plan.per_gpu.total_bytes - plan.per_gpu.overhead_bytes if traced else None,
            zero_stage=self._stage(plan, world_size),
            steps=self.steps,
            data=self.data.to_spec(data_roots=data_roots, cache_dir=dataset_cache_dir),
            precision=self.precision,
            optimizer=self.optimizer.to_spec(),
            micro_batch_size=self.micro_batch_size,
            global_batch_size=self.batch_size,  # fixed: an elastic job's does not change with N
            seq_len=self.seq_len,
            seed=self.seed,
            checkpoint_every=self.checkpoint_every,
            checkpoint_dir=checkpoint_dir,
            keep_last=keep_last if self.keep_last is None else self.keep_last,
            async_checkpoints=async_checkpoints,
            activation_checkpointing=self.activation_checkpointing,
            max_nonfinite_steps=self.max_nonfinite_steps,
            health=self.health.to_spec(),
            data_skips=(*(skip.to_spec() for skip in self.data_skips), *rollback_skips),
            lr_scale=lr_scale,
            eval_every=self.eval_every,
            eval_batches=self.eval_batches,
            resume=resume,
            init_from=None if self.init_from is None else self.init_from.to_spec(),
        )

    def _stage(self, plan: PlanPublic | None, world_size: int | None) -> int:
        if plan is None:
            return self.stages()[0]
        return plan.stage if world_size is None else plan.stage_for(world_size)

    def model_spec(self, *, plan: PlanPublic | None = None, model_roots: Sequence[str] = ()) -> ModelKind:
        """The workers' model: a built-in's spec, or an hf or python model's with the vocab_size and
        block_size its traced plan resolved."""
        if not isinstance(self.model, TracedModelSpec):
            return self.model.to_spec()
        if plan is None or plan.vocab_size is None or plan.block_size is None:
            raise ValueError(
                f"an {self.model.kind} job needs the traced plan it was admitted by (vocab_size, block_size)"
            )
        if isinstance(self.model, PythonModelSpec):
            return self.model.to_spec(code=self.code, vocab_size=plan.vocab_size, block_size=plan.block_size)
        return self.model.to_spec(vocab_size=plan.vocab_size, block_size=plan.block_size, model_roots=model_roots)

    def stages(self) -> tuple[int, ...]:
        """The stages admission tries, in order: the one asked for, or (auto) each that runs, cheapest
        in communication first."""
        return RUNNABLE_STAGES if self.zero_stage == "auto" else (self.zero_stage,)

    def plan_request(self, *, stage: int | None = None) -> PlanRequest:
        """The capacity plan this job is admitted by at `stage` (default: the first it may run at), at
        the fewest GPUs it may run on (num_gpus unless elastic), where each GPU holds the most."""
        return PlanRequest(
            model=self.model,
            num_gpus=self.world_sizes()[0],
            precision=self.precision,
            optimizer="adamw",
            stage=self.stages()[0] if stage is None else stage,
            micro_batch_size=self.micro_batch_size,
            seq_len=self.seq_len,
            activation_checkpointing=None if isinstance(self.model, MLPModelSpec) else self.activation_checkpointing,
            bucket_cap_mb=self.optimizer.bucket_cap_mb,
            code=self.code,
        )


class JobPatch(Body):
    """PATCH /v1/jobs/{id}: what its owner may change, each field left as it is when absent (at least one).
    The priority of a queued, running or suspended job only; tags and notes at any time."""

    priority: Int | None = Field(
        None, ge=0, le=100, description="0-100, within the owner's ceiling (ZERO1_PRIORITY_LIMITS)."
    )
    tags: Tags | None = Field(None, max_length=MAX_TAGS, description="Its tags, all of them (replaces the set).")
    notes: Notes | None = Field(None, description='Its notes ("" clears them).')
    depends_on: JobIds | None = Field(
        None, max_length=MAX_DEPENDENCIES, description="A queued or suspended job's depends_on, all of it (replaced)."
    )

    @model_validator(mode="after")
    def _something(self) -> JobPatch:
        if self.priority is None and self.tags is None and self.notes is None and self.depends_on is None:
            raise FieldError("priority", "give at least one of priority, tags, notes and depends_on")
        return self

"""Request bodies of the REST API's plans (and the CLI's, which shares them): POST /v1/plan's and
POST /v1/plan/recommend's, their bounds, and the checks of a model and its code bundle that a job's
spec shares (service/schemas/requests.py). The model specs they hold are service/schemas/model_specs.py's;
the field types, service/schemas/fields.py's."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from service.schemas.fields import Body, Bool, Float, Int, OptimizerName, Precision, Text
from service.schemas.model_specs import (
    CODE_PATTERN,
    GPTModelSpec,
    MLPModelSpec,
    ModelSpec,
    PythonModelSpec,
    TracedModelSpec,
)
from workers import limits
from workers.config import FieldError
from workers.memory import model as memory

Stage = Literal[0, 1, 2, 3]

MAX_NUM_GPUS = 1 << 20
MAX_GLOBAL_BATCH_SIZE = 100_000_000
MAX_MICRO_BATCH_SIZE = 1_000_000
MAX_GPU_MEMORY_GB = 1e6

_MODEL_ONLY_FIELDS = ("micro_batch_size", "seq_len", "activation_checkpointing")


def code_field():
    return Field(
        None,
        pattern=CODE_PATTERN,
        description="The code bundle a python model comes from: sha256:<64 hex>, as POST /v1/code answered.",
    )


def check_code(model: ModelSpec, *, code: str | None, seq_len: int | None, activation_checkpointing) -> None:
    """A python model needs its bundle and a stated seq_len, and checkpoints its own activations;
    no other kind takes a bundle."""
    if not isinstance(model, PythonModelSpec):
        if code is not None:
            raise FieldError("code", f"code only applies to a python model, not to a {model.kind} model")
        return
    if code is None:
        raise FieldError(
            "code", "a python model needs code: the sha256:<hex> that POST /v1/code answered (zero1 ... --code DIR)"
        )
    if seq_len is None:
        raise FieldError("seq_len", "a python model needs seq_len: the sequence length it is planned and trained at")
    if activation_checkpointing:
        raise FieldError(
            "activation_checkpointing",
            "activation_checkpointing applies to gpt and hf models; a python model checkpoints its own",
        )


class PlanRequest(Body):
    """POST /v1/plan: exactly one of num_params or model."""

    num_params: Int | None = Field(None, ge=1, le=memory.MAX_NUM_PARAMS)
    model: ModelSpec | None = None
    num_gpus: Int | None = Field(None, ge=1, le=MAX_NUM_GPUS, description="Default: the cluster's GPUs.")
    gpu_memory_gb: Float | None = Field(
        None, gt=0, le=MAX_GPU_MEMORY_GB, allow_inf_nan=False, description="GB = 1e9 bytes. Default: the cluster's."
    )
    precision: Precision = "fp16"
    optimizer: OptimizerName = "adamw"
    stage: Stage = 1
    micro_batch_size: Int | None = Field(
        None, ge=1, le=MAX_MICRO_BATCH_SIZE, description="Default 1 (model plans only)."
    )
    seq_len: Int | None = Field(
        None, ge=1, le=100_000_000, description="Default: block_size, or an hf model's max_position_embeddings."
    )
    activation_checkpointing: Bool | None = Field(None, description="Default false (model plans only).")
    bucket_cap_mb: Float = Field(
        limits.DEFAULT_BUCKET_CAP_MB,
        ge=limits.MIN_BUCKET_CAP_MB,
        le=4096,
        allow_inf_nan=False,
        description="The job's largest gradient bucket, MiB: stage 2 plans the buckets a rank stages at once.",
    )
    code: Text | None = code_field()
    method: Literal["model", "traced"] | None = Field(
        None,
        description="How a built-in model's step is counted: model (its closed forms, the default) or traced "
        "(one micro-batch run on fake tensors in a Ray task, within ZERO1_PLAN_TIMEOUT_S; cached). An hf or "
        "python model is always traced.",
    )

    @model_validator(mode="after")
    def _one_source_of_params(self) -> PlanRequest:
        if (self.num_params is None) == (self.model is None):
            given = "both" if self.model is not None else "neither"
            raise FieldError("model", f"exactly one of num_params or model is required, got {given}")
        if self.model is None:
            extra = [f for f in (*_MODEL_ONLY_FIELDS, "method", "code") if getattr(self, f) is not None]
            if extra:
                raise FieldError(extra[0], f"{', '.join(extra)} only apply to a plan for a model, not to num_params")
            return self
        check_code(
            self.model, code=self.code, seq_len=self.seq_len, activation_checkpointing=self.activation_checkpointing
        )
        if isinstance(self.model, TracedModelSpec):
            if self.method == "model":
                raise FieldError(
                    "method",
                    f"an {self.model.kind} model is planned by its trace only: method must be traced (or omitted)",
                )
            self.method = "traced"
            return self
        _check_model(self.model, seq_len=self.seq_len)
        return self


def _check_model(model: GPTModelSpec | MLPModelSpec, *, seq_len: int | None) -> None:
    """A plan's seq_len fits the model, and the model is within the planner's bound (an hf model's
    both are checked by its trace)."""
    if seq_len is not None:
        if not isinstance(model, GPTModelSpec):
            raise FieldError("seq_len", "seq_len only applies to a gpt model")
        if seq_len > model.block_size:
            raise FieldError("seq_len", f"seq_len ({seq_len}) must be <= model.block_size ({model.block_size})")
    num_params = model.to_spec().num_params
    if num_params > memory.MAX_NUM_PARAMS:
        raise FieldError("model", f"model has {num_params:,} parameters, above the limit of {memory.MAX_NUM_PARAMS:,}")


class RecommendRequest(Body):
    """POST /v1/plan/recommend: the ZeRO configurations of a model that fit (the stages a job trains at),
    cheapest first."""

    model: ModelSpec
    global_batch_size: Int = Field(
        ge=1,
        le=MAX_GLOBAL_BATCH_SIZE,
        description="Samples per optimizer step: num_gpus x micro_batch_size x accumulation_steps.",
    )
    seq_len: Int | None = Field(None, ge=1, le=100_000_000, description="Default: block_size (GPT only).")
    precision: Precision = "fp16"
    optimizer: OptimizerName = "adamw"
    max_gpus: Int | None = Field(
        None, ge=1, le=MAX_NUM_GPUS, description="Largest N considered. Default: the cluster's GPUs."
    )
    gpu_memory_gb: Float | None = Field(
        None, gt=0, le=MAX_GPU_MEMORY_GB, allow_inf_nan=False, description="GB = 1e9 bytes. Default: the cluster's."
    )

    @model_validator(mode="after")
    def _consistent(self) -> RecommendRequest:
        if isinstance(self.model, TracedModelSpec):
            raise FieldError(
                "model",
                f"recommendations for an {self.model.kind} model are not supported yet; POST /v1/plan plans one",
            )
        _check_model(self.model, seq_len=self.seq_len)
        return self

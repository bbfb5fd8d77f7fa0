"""Request and response bodies of the REST API (and the CLI, which shares them)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from decimal import Decimal
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    field_validator,
    model_validator,
)

from workers import limits, memory
from workers.config import (
    DATASET_FORMATS,
    DatasetSpec,
    HFSpec,
    ModelKind,
    OptimizerSpec,
    SyntheticSpec,
    TextSpec,
    TrainConfig,
    default_of,
)

if TYPE_CHECKING:
    from service.responses import PlanPublic

Precision = Literal["fp16", "bf16", "fp32"]
OptimizerName = Literal["adamw", "adam", "sgd_momentum", "sgd"]
Stage = Literal[0, 1, 2, 3]

MAX_NUM_GPUS = 1 << 20
MAX_GLOBAL_BATCH_SIZE = 100_000_000
MAX_MICRO_BATCH_SIZE = 1_000_000
MAX_GPU_MEMORY_GB = 1e6
MAX_TEXT_DIGITS = 30
"""Digits a number typed as text (the planner's form, the CLI) may have: more than any field's bound needs
(2**63 - 1 has 19); int() of 1e1000000 takes time quadratic in its million digits, holding the GIL."""


def too_many_digits(value: Decimal) -> bool:
    """More than MAX_TEXT_DIGITS significant digits, or 10**MAX_TEXT_DIGITS or more; asked before int() expands it."""
    # adjusted() is the exponent of the leading digit: 1e1000000 is measured without being expanded
    return value.adjusted() >= MAX_TEXT_DIGITS or len(value.as_tuple().digits) > MAX_TEXT_DIGITS


def _a_number(value: object) -> object:
    # pydantic's lax mode reads true as 1 and "2" as 2; the schema says number, and a count
    # given as a boolean or a string is a mistake
    if isinstance(value, bool):
        raise ValueError(f"Input should be a number, not a boolean (got {str(value).lower()})")
    if isinstance(value, str):
        raise ValueError(f"Input should be a number, not a string (got {value[:40]!r})")
    return value


def _no_nul(text: str) -> str:
    # PostgreSQL's text columns cannot hold NUL (a 500 from the driver otherwise), nor can a file name
    if "\x00" in text:
        raise ValueError(f"must not contain a NUL character (\\u0000 at {text.index(chr(0))})")
    return text


Int = Annotated[int, BeforeValidator(_a_number)]
Float = Annotated[float, BeforeValidator(_a_number)]
Bool = StrictBool
"""true or false: pydantic's lax mode would also read 0, 1, "yes" and "off"."""
Text = Annotated[str, AfterValidator(_no_nul)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GPTModelSpec(_Body):
    """A GPT-2-style decoder (tied LM head, biases, pre-LayerNorm)."""

    kind: Literal["gpt"]
    vocab_size: Int = Field(ge=1, le=10_000_000)
    n_layer: Int = Field(ge=1, le=100_000)
    n_head: Int = Field(ge=1, le=100_000)
    n_embd: Int = Field(ge=1, le=10_000_000)
    block_size: Int = Field(ge=1, le=100_000_000)

    @field_validator("n_embd")
    @classmethod
    def _heads_divide_width(cls, n_embd: int, info) -> int:
        n_head = info.data.get("n_head")
        if n_head and n_embd % n_head:
            raise ValueError(
                f"n_embd ({n_embd}) must be divisible by n_head ({n_head}): {n_embd} % {n_head} = {n_embd % n_head}"
            )
        return n_embd

    def to_spec(self) -> memory.GPTSpec:
        return memory.GPTSpec(**self.model_dump(exclude={"kind"}))


class MLPModelSpec(_Body):
    """Linear layers of the given widths with ReLU between them."""

    kind: Literal["mlp"]
    sizes: list[Annotated[Int, Field(ge=1, le=10_000_000)]] = Field(min_length=2, max_length=10_000)

    def to_spec(self) -> memory.MLPSpec:
        return memory.MLPSpec(sizes=tuple(self.sizes))


MAX_CONFIG_DEPTH = 32
"""Nesting an hf model's config may have (config.json's are a few levels deep)."""


def _json_safe(value: Any, *, where: str = "config", depth: int = 0) -> None:
    """A stored spec must be JSON every database takes: no NUL in a string or key, no nan or inf."""
    if depth > MAX_CONFIG_DEPTH:
        raise ValueError(f"{where} is nested more than {MAX_CONFIG_DEPTH} levels deep")
    if isinstance(value, str):
        _no_nul(value)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} must be finite, got {value}")
    elif isinstance(value, dict):
        for key, item in value.items():
            _no_nul(key)
            _json_safe(item, where=f"{where}.{key}", depth=depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _json_safe(item, where=f"{where}[{i}]", depth=depth + 1)


class HFModelSpec(_Body):
    """A Hugging Face transformers causal LM: exactly one of config or path. Nothing is downloaded."""

    kind: Literal["hf"]
    config: dict[str, Any] | None = Field(
        None, description="config.json's fields, with model_type: a randomly initialised model (the job's seed)."
    )
    path: Text | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="A save_pretrained directory (config and weights) inside ZERO1_MODEL_ROOTS: fine-tuning.",
    )

    @field_validator("config")
    @classmethod
    def _has_model_type(cls, config: dict[str, Any] | None) -> dict[str, Any] | None:
        if config is None:
            return None
        if not isinstance(config.get("model_type"), str) or not config["model_type"]:
            raise ValueError(
                f"needs model_type, a transformers model type such as 'llama', got {config.get('model_type')!r}"
            )
        _json_safe(config)
        return config

    @model_validator(mode="after")
    def _one_source(self) -> HFModelSpec:
        if (self.config is None) == (self.path is None):
            given = "both" if self.config is not None else "neither"
            raise ValueError(f"exactly one of model.config or model.path is required, got {given}")
        return self

    def to_spec(self, *, vocab_size: int, block_size: int, model_roots: Sequence[str] = ()) -> HFSpec:
        """With the model roots resolved here, for the ranks to check `path` again where they read it."""
        return HFSpec(
            config=self.config,
            path=self.path,
            roots=tuple(os.path.realpath(root) for root in model_roots),
            vocab_size=vocab_size,
            block_size=block_size,
        )


ModelSpec = Annotated[GPTModelSpec | MLPModelSpec | HFModelSpec, Field(discriminator="kind")]
MODEL_KINDS = ("gpt", "mlp", "hf")

_MODEL_ONLY_FIELDS = ("micro_batch_size", "seq_len", "activation_checkpointing")


class PlanRequest(_Body):
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
    method: Literal["model", "traced"] | None = Field(
        None,
        description="How a built-in model's step is counted: model (its closed forms, the default) or traced "
        "(one micro-batch run on fake tensors in a Ray task, within ZERO1_PLAN_TIMEOUT_S; cached). An hf model "
        "is always traced.",
    )

    @model_validator(mode="after")
    def _one_source_of_params(self) -> PlanRequest:
        if (self.num_params is None) == (self.model is None):
            given = "both" if self.model is not None else "neither"
            raise ValueError(f"exactly one of num_params or model is required, got {given}")
        if self.model is None:
            extra = [f for f in (*_MODEL_ONLY_FIELDS, "method") if getattr(self, f) is not None]
            if extra:
                raise ValueError(f"{', '.join(extra)} only apply to a plan for a model, not to num_params")
            return self
        if isinstance(self.model, HFModelSpec):
            if self.method == "model":
                raise ValueError("an hf model is planned by its trace only: method must be traced (or omitted)")
            self.method = "traced"
            return self
        _check_model(self.model, seq_len=self.seq_len)
        return self


def _check_model(model: GPTModelSpec | MLPModelSpec, *, seq_len: int | None) -> None:
    """A plan's seq_len fits the model, and the model is within the planner's bound (an hf model's
    both are checked by its trace)."""
    if seq_len is not None:
        if not isinstance(model, GPTModelSpec):
            raise ValueError("seq_len only applies to a gpt model")
        if seq_len > model.block_size:
            raise ValueError(f"seq_len ({seq_len}) must be <= model.block_size ({model.block_size})")
    num_params = model.to_spec().num_params
    if num_params > memory.MAX_NUM_PARAMS:
        raise ValueError(f"model has {num_params:,} parameters, above the limit of {memory.MAX_NUM_PARAMS:,}")


class RecommendRequest(_Body):
    """POST /v1/plan/recommend: the ZeRO stage 1 configurations of a model that fit, cheapest first."""

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
        if isinstance(self.model, HFModelSpec):
            raise ValueError("model: recommendations for an hf model are not supported yet; POST /v1/plan plans one")
        _check_model(self.model, seq_len=self.seq_len)
        return self


# --------------------------------------------------------------------------- jobs


class SyntheticDataSpec(_Body):
    """A random Markov chain over the vocabulary (GPT) or a random teacher's labels (MLP)."""

    kind: Literal["synthetic"]
    branching: Int = Field(
        default_of(SyntheticSpec, "branching"), ge=1, le=1_000_000, description="Successors per token: lower is easier."
    )

    def to_spec(self, *, data_roots: Sequence[str] = (), cache_dir: str | None = None) -> SyntheticSpec:
        return SyntheticSpec(branching=self.branching)


class TextDataSpec(_Body):
    """Characters of a UTF-8 file readable by the workers."""

    kind: Literal["text"]
    path: Text = Field(min_length=1, max_length=4096)

    def to_spec(self, *, data_roots: Sequence[str] = (), cache_dir: str | None = None) -> TextSpec:
        """With the data roots resolved here (a relative root is under the service's working directory),
        for the ranks to check again where they read the file: none given, they read none."""
        return TextSpec(path=self.path, roots=tuple(os.path.realpath(root) for root in data_roots))


def _dataset(name: str):
    return default_of(DatasetSpec, name)


class DatasetDataSpec(_Body):
    """Local files read with `datasets`, tokenized once (cached on the checkpoint storage), packed into
    seq_len + 1 blocks in a seeded order that does not depend on num_gpus."""

    kind: Literal["dataset"]
    format: Literal[DATASET_FORMATS]
    path: Text = Field(
        min_length=1, max_length=4096, description="A file, a directory or a glob, inside ZERO1_DATA_ROOTS."
    )
    text_field: Text = Field(
        _dataset("text_field"), min_length=1, max_length=200, description="The column read (text format: text)."
    )
    tokenizer: Text | None = Field(
        _dataset("tokenizer"),
        min_length=1,
        max_length=4096,
        description="A tokenizer.json or its directory inside ZERO1_DATA_ROOTS, or bytes (UTF-8 bytes, EOS 256); "
        "omitted: an hf model's own (its path's directory).",
    )
    validation_fraction: Float = Field(
        _dataset("validation_fraction"), ge=0, le=0.5, allow_inf_nan=False, description="Blocks held out."
    )

    @model_validator(mode="after")
    def _text_reads_text(self) -> DatasetDataSpec:
        if self.format == "text" and self.text_field != "text":
            raise ValueError(f"text_field ({self.text_field!r}) only applies to jsonl, parquet and csv: text is text")
        return self

    def to_spec(self, *, data_roots: Sequence[str] = (), cache_dir: str | None = None) -> DatasetSpec:
        """With the data roots resolved here, for the ranks to check again where they read; cache_dir
        is the checkpoint storage's datasets/ directory."""
        return DatasetSpec(
            **self.model_dump(exclude={"kind"}),
            roots=tuple(os.path.realpath(root) for root in data_roots),
            cache_dir=cache_dir,
        )


DataSpec = Annotated[SyntheticDataSpec | TextDataSpec | DatasetDataSpec, Field(discriminator="kind")]
DATA_KINDS = ("synthetic", "text", "dataset")


def _opt(name: str):
    return default_of(OptimizerSpec, name)


class OptimizerConfig(_Body):
    lr: Float = Field(_opt("lr"), gt=0, le=10, allow_inf_nan=False)
    betas: tuple[
        Annotated[Float, Field(ge=0, lt=1, allow_inf_nan=False)],
        Annotated[Float, Field(ge=0, lt=1, allow_inf_nan=False)],
    ] = _opt("betas")
    eps: Float = Field(_opt("eps"), ge=0, le=1, allow_inf_nan=False)
    weight_decay: Float = Field(_opt("weight_decay"), ge=0, le=10, allow_inf_nan=False)
    max_grad_norm: Float | None = Field(_opt("max_grad_norm"), gt=0, le=1e6, allow_inf_nan=False)
    overlap_comm: Bool = Field(
        _opt("overlap_comm"),
        description="Send each gradient bucket's reduce during the backward (ZeRO1AdamW's overlap_comm; "
        "off by default: docs/optimizer.md).",
    )
    bucket_cap_mb: Float = Field(
        _opt("bucket_cap_mb"),
        ge=limits.MIN_BUCKET_CAP_MB,
        le=4096,
        allow_inf_nan=False,
        description=f"Largest gradient bucket, MiB (at least {limits.MIN_BUCKET_CAP_MB:g}).",
    )

    def to_spec(self) -> OptimizerSpec:
        return OptimizerSpec(**self.model_dump() | {"betas": tuple(self.betas)})


def _train(name: str):
    return default_of(TrainConfig, name)


class JobSpec(_Body):
    """POST /v1/jobs: what to train, on how many GPUs."""

    name: Text = Field(min_length=1, max_length=200)
    model: ModelSpec
    data: DataSpec = SyntheticDataSpec(kind="synthetic")
    num_gpus: Int = Field(ge=1, le=MAX_NUM_GPUS, description="Data-parallel world size N.")
    precision: Precision = _train("precision")
    optimizer: OptimizerConfig = OptimizerConfig()
    steps: Int = Field(ge=1, le=100_000_000)
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
    seed: Int = Field(_train("seed"), ge=0, le=2**63 - 1)
    checkpoint_every: Int = Field(
        _train("checkpoint_every"), ge=0, le=100_000_000, description="0: a checkpoint at the end only."
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
    max_retries: Int = Field(0, ge=0, le=100)
    max_nonfinite_steps: Int = Field(
        _train("max_nonfinite_steps"),
        ge=1,
        le=1_000_000,
        description="Steps in a row with a nan or inf gradient norm (each skipped) after which the job fails; "
        "fp16's loss scaler may skip up to 16 in a row at the start.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        per_step = self.micro_batch_size * self.num_gpus
        if self.global_batch_size is not None and self.global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be a multiple of micro_batch_size "
                f"({self.micro_batch_size}) x num_gpus ({self.num_gpus}) = {per_step}"
            )
        if isinstance(self.model, MLPModelSpec):
            if self.seq_len is not None or self.activation_checkpointing:
                raise ValueError("seq_len and activation_checkpointing only apply to a gpt model")
            if not isinstance(self.data, SyntheticDataSpec):
                raise ValueError("an mlp model trains on synthetic data only")
        elif isinstance(self.model, HFModelSpec):
            return self  # seq_len and the parameter count are checked by its trace, at admission
        elif self.seq_len is not None and self.seq_len > self.model.block_size:
            raise ValueError(f"seq_len ({self.seq_len}) must be <= model.block_size ({self.model.block_size})")
        num_params = self.model.to_spec().num_params
        if num_params > memory.MAX_NUM_PARAMS:
            raise ValueError(f"model has {num_params:,} parameters, above the limit of {memory.MAX_NUM_PARAMS:,}")
        return self

    def to_config(
        self,
        *,
        checkpoint_dir: str,
        keep_last: int = 0,
        resume: bool = True,
        data_roots: Sequence[str] = (),
        dataset_cache_dir: str | None = None,
        model_roots: Sequence[str] = (),
        plan: PlanPublic | None = None,
    ) -> TrainConfig:
        """The workers' view of this job: every field converted once, here. An hf model takes its
        vocab_size, block_size and planned bytes from the plan it was admitted by (its trace's)."""
        hf = isinstance(self.model, HFModelSpec)
        return TrainConfig(
            model=self.model_spec(plan=plan, model_roots=model_roots),
            planned_bytes=plan.per_gpu.total_bytes - plan.per_gpu.overhead_bytes if hf else None,
            steps=self.steps,
            data=self.data.to_spec(data_roots=data_roots, cache_dir=dataset_cache_dir),
            precision=self.precision,
            optimizer=self.optimizer.to_spec(),
            micro_batch_size=self.micro_batch_size,
            global_batch_size=self.global_batch_size,
            seq_len=self.seq_len,
            seed=self.seed,
            checkpoint_every=self.checkpoint_every,
            checkpoint_dir=checkpoint_dir,
            keep_last=keep_last,
            activation_checkpointing=self.activation_checkpointing,
            max_nonfinite_steps=self.max_nonfinite_steps,
            eval_every=self.eval_every,
            eval_batches=self.eval_batches,
            resume=resume,
        )

    def model_spec(self, *, plan: PlanPublic | None = None, model_roots: Sequence[str] = ()) -> ModelKind:
        """The workers' model: a built-in's spec, or an hf model's with the vocab_size and block_size its
        traced plan resolved."""
        if not isinstance(self.model, HFModelSpec):
            return self.model.to_spec()
        if plan is None or plan.vocab_size is None or plan.block_size is None:
            raise ValueError("an hf job needs the traced plan it was admitted by (vocab_size, block_size)")
        return self.model.to_spec(vocab_size=plan.vocab_size, block_size=plan.block_size, model_roots=model_roots)

    def plan_request(self) -> PlanRequest:
        """The capacity plan this job is admitted by: ZeRO stage 1 at N = num_gpus."""
        return PlanRequest(
            model=self.model,
            num_gpus=self.num_gpus,
            precision=self.precision,
            optimizer="adamw",
            stage=1,
            micro_batch_size=self.micro_batch_size,
            seq_len=self.seq_len,
            activation_checkpointing=None if isinstance(self.model, MLPModelSpec) else self.activation_checkpointing,
        )


JobStatus = Literal["queued", "starting", "running", "restarting", "succeeded", "failed", "cancelled"]

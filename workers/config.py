"""What a job asks of the workers: frozen dataclasses, the same on every rank, with their
defaults and the checks that show the arithmetic.

Standard library only: the control plane builds these from a job's API schema
(service.schemas.requests, JobSpec.to_config) without loading torch, and hands them to Ray.

May import: workers.limits, workers.memory.
"""

from __future__ import annotations

import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from workers import limits
from workers.memory import model as memory
from workers.memory.model import GPTSpec, MLPSpec

MAX_TEXT_BYTES = 1 << 30
"""Largest text file a rank reads by default (1 GiB: enwik9 fits)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SyntheticSpec:
    """A random Markov chain over the vocabulary (GPT), or a random linear
    teacher's labels (MLP): learnable, with a known floor for the loss."""

    branching: int = 4
    """Successors each token can have (GPT); fewer means lower entropy."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TextSpec:
    """Characters of a local UTF-8 file."""

    path: str
    roots: tuple[str, ...] | None = None
    """Absolute directories the file must resolve into (symlinks followed), checked again where a
    rank opens it: the service passes ZERO1_DATA_ROOTS. None: anywhere (a caller's own file)."""
    max_bytes: int = MAX_TEXT_BYTES
    """Largest file read, in bytes."""

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ValueError(f"need max_bytes ({self.max_bytes}) >= 1")
        relative = [root for root in self.roots or () if not os.path.isabs(root)]
        if relative:
            raise ValueError(
                f"data roots must be absolute (a rank's working directory is not the service's), got {relative}"
            )


DATASET_FORMATS = ("jsonl", "parquet", "csv", "text")


@dataclass(frozen=True, slots=True, kw_only=True)
class DatasetSpec:
    """Local files read with `datasets`, tokenized once (cached as a token file on the checkpoint
    storage), packed into seq_len + 1 blocks joined by the EOS token, in a seeded order that does
    not depend on the world size (docs/api.md, "Bring a dataset")."""

    format: str
    """jsonl, parquet, csv or text."""
    path: str
    """A file, directory or glob, resolved inside `roots`."""
    text_field: str = "text"
    tokenizer: str | None = None
    """A tokenizer.json or tokenizer directory inside the roots, or "bytes" (one token per UTF-8 byte,
    EOS 256); None: the hf model directory's own tokenizer."""
    validation_fraction: float = 0.01
    """Blocks held out for evaluation."""
    roots: tuple[str, ...] | None = None
    """Absolute directories path and tokenizer must resolve into; None: anywhere (a caller's own files)."""
    cache_dir: str | None = None
    """Where the token file is cached (the checkpoint storage); None: beside nothing, tokenized per run."""
    tokenizer_digest: str | None = None
    """workers/data/digests.py's digest of `tokenizer` when the job was admitted; where set, the tokenizer is
    hashed again before it is loaded, and a difference fails the load."""
    token_uri: str | None = None
    """For data on an object store: the token file the submit's check stored in the store's token cache
    (workers/training/staging.py). A rank's parent fetches it into cache_dir, where the child maps it by
    its key without reading the data; None: the files are read (and the cache looked up by content)."""

    def __post_init__(self) -> None:
        if self.format not in DATASET_FORMATS:
            raise ValueError(f"format must be one of {DATASET_FORMATS}, got {self.format!r}")
        if not 0 <= self.validation_fraction < 1:
            raise ValueError(f"validation_fraction must be in [0, 1), got {self.validation_fraction}")


DataSource = SyntheticSpec | TextSpec | DatasetSpec
"""What a job trains on (DataSpec in the API's schemas, service/schemas/data_specs.py, converted once)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HFSpec:
    """A Hugging Face transformers causal LM: `config` (config.json's fields, with model_type;
    random init from the job's seed) or `path` (a save_pretrained directory: its weights)."""

    config: dict[str, Any] | None = None
    path: str | None = None
    roots: tuple[str, ...] | None = None
    """Absolute directories `path` must resolve into (ZERO1_MODEL_ROOTS); None: anywhere."""
    digest: str | None = None
    """workers/data/digests.py's digest of `path`'s files when the job was admitted; where set, a rank hashes
    the directory again before it loads it, and a difference fails the attempt."""
    vocab_size: int
    """The model's vocabulary, resolved from its config when the job was admitted."""
    block_size: int
    """max_position_embeddings, resolved likewise: the default seq_len."""

    def __post_init__(self) -> None:
        if (self.config is None) == (self.path is None):
            raise ValueError("exactly one of config or path is required")


@dataclass(frozen=True, slots=True, kw_only=True)
class PythonSpec:
    """A model of the user's own code: `entrypoint` ("package.module:function") called with `args`
    returns a torch.nn.Module; `model(input_ids, labels)` returns the mean loss. The function runs
    only where the job's code bundle is the working directory (a rank, a trace's Ray task)."""

    entrypoint: str
    args: dict[str, Any] = field(default_factory=dict)
    code: str
    """The bundle, "sha256:<64 hex>" (POST /v1/code)."""
    vocab_size: int
    """Token ids the model takes, as its trace resolved them when the job was admitted."""
    block_size: int
    """The job's seq_len: a python model's longest sequence is the one it was planned at."""

    def __post_init__(self) -> None:
        module, _, function = self.entrypoint.partition(":")
        if not module or not function:
            raise ValueError(f"entrypoint must be 'package.module:function', got {self.entrypoint!r}")


class FieldError(ValueError):
    """A request's field that a worker found unusable: `field` names it in the job's body, `reason`
    says why. Raised on a worker and turned into a 422 naming the field by the service."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message

    def __reduce__(self):  # crosses Ray as (field, message), not as the formatted text
        return type(self), (self.field, self.reason)


class InvalidModelError(FieldError):
    """An hf model's config or directory that transformers cannot use, or a python model's code
    that fails (model.config, model.path, model.entrypoint). Raised where the model is built (a
    trace's Ray task, a rank), so it lives here, away from torch."""


ModelKind = GPTSpec | MLPSpec | HFSpec | PythonSpec
"""What a job trains (ModelSpec in the API's schemas, service/schemas/model_specs.py)."""


SCHEDULE_KINDS = ("constant", "linear", "cosine", "wsd")


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleSpec:
    """The learning rate by step, a pure function of it (workers/training/schedule.py): a linear warmup
    over warmup_steps, then constant, linear or cosine decay to min_lr_ratio x lr at the last step, or
    (wsd) constant until decay_steps before the end and a linear decay over them."""

    kind: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    decay_steps: int | None = None
    """wsd only: the steps of its final decay."""

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULE_KINDS:
            raise ValueError(f"schedule kind must be one of {SCHEDULE_KINDS}, got {self.kind!r}")
        if (self.decay_steps is None) != (self.kind != "wsd"):
            raise ValueError(f"decay_steps is required for a wsd schedule and only for it (kind {self.kind!r})")


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerSpec:
    lr: float = 3e-4
    """The peak learning rate: every step's with the default schedule (constant, no warmup)."""
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    max_grad_norm: float | None = 1.0
    overlap_comm: bool = False
    """Send each gradient bucket's reduce during the backward (ZeRO1AdamW's overlap_comm)."""
    bucket_cap_mb: float = limits.DEFAULT_BUCKET_CAP_MB
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)


@dataclass(frozen=True, slots=True, kw_only=True)
class InitSpec:
    """The weights a job starts from (the API's init_from): a succeeded job's final/model.safetensors,
    loaded with fresh optimizer state. Only a run that starts at step 0 loads them; a retried, preempted
    or resumed run resumes from its own checkpoint instead (workers/training/init_weights.py)."""

    job: int
    """The source job's id, which every error names."""
    uri: str
    """The source job's directory on the checkpoint storage (a path, or s3://...): read by a rank's
    parent (workers/training/staging.py), which holds the storage's credentials, never by its child."""
    sha256: str
    bytes: int
    """final/model.safetensors as the service recorded it when the source job succeeded: the parent's
    copy must match both, or the attempt fails."""
    path: str | None = None
    """The parent's checked copy, which the child loads; None until the parent has made it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HealthConfig:
    """What the service does when training, not a process, goes wrong (a job's `health`): roll back
    a diverged run to its last checkpoint before the event, and end an attempt whose rank stops
    stepping. The workers detect; the service decides (docs/api.md, "Training health")."""

    max_rollbacks: int = 0
    """Rollbacks a job may take, none of them a retry; 0: a non-finite run fails as before and a
    spike is only logged."""
    spike_zscore: float | None = 6.0
    """A step whose loss is this many standard deviations above the mean of the `spike_window`
    steps before it is a spike; None: no spike detection."""
    spike_window: int = 50
    """Steps of loss the spike test's mean and standard deviation are taken over."""
    lr_factor: float = 1.0
    """The learning rate is multiplied by this at each rollback (1.0: unchanged)."""
    skip_batches: bool = True
    """A rollback skips the batches between its checkpoint and the event (the data that caused it)."""
    hang_factor: float | None = 20.0
    """A rank that makes no step for this many times its median step time (and at least hang_min_s)
    is hung: its stacks go to its log and the attempt ends as a failure; None: no hang detection."""
    hang_min_s: float = 600.0
    """The least a rank waits for a step before it counts as hung."""

    def __post_init__(self) -> None:
        if self.max_rollbacks < 0 or self.spike_window < 2 or self.hang_min_s <= 0:
            raise ValueError(
                f"need max_rollbacks ({self.max_rollbacks}) >= 0, spike_window ({self.spike_window}) >= 2 "
                f"and hang_min_s ({self.hang_min_s}) > 0"
            )
        if not 0 < self.lr_factor <= 1:
            raise ValueError(f"need 0 < lr_factor ({self.lr_factor}) <= 1")


@dataclass(frozen=True, slots=True, kw_only=True)
class DataSkip:
    """Batches a run never trains on: from training step `step` on, every step reads the batch of the
    step `num_batches` further on (a rollback's window, or the same skip asked from the start)."""

    step: int
    num_batches: int

    def __post_init__(self) -> None:
        if self.step < 0 or self.num_batches < 1:
            raise ValueError(f"need step ({self.step}) >= 0 and num_batches ({self.num_batches}) >= 1")


def data_step(step: int, skips: tuple[DataSkip, ...]) -> int:
    """The step whose batch training step `step` reads: `step` plus the batches of every skip at or
    before it. A rollback from checkpoint C after an event at step E adds DataSkip(C + 1, E - C): step
    C + 1 then reads the batch step E + 1 would have read, and a fresh run given the same skips reads the
    same batches at every step."""
    return step + sum(skip.num_batches for skip in skips if skip.step <= step)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainConfig:
    """What one job trains; the same on every rank."""

    model: ModelKind
    steps: int
    data: DataSource = field(default_factory=SyntheticSpec)
    precision: str = "bf16"
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    zero_stage: int = 1
    """1: ZeRO1AdamW (the optimizer state sharded); 2: ZeRO2AdamW (the gradients too); 3: the
    parameters too (FSDP2 and ZeRO3AdamW, workers/zero/stage3.py)."""
    micro_batch_size: int = 1
    global_batch_size: int | None = None
    """Samples per step over all ranks; default micro_batch_size x world size
    (more means gradient accumulation)."""
    seq_len: int | None = None
    """GPT only; default block_size."""
    seed: int = 0
    checkpoint_every: int = 0
    """Steps between checkpoints; 0 checkpoints only at the end."""
    checkpoint_dir: str | None = None
    """Where checkpoints go; None keeps none."""
    keep_last: int = 0
    """Complete checkpoints kept (the newest ones); 0 keeps every one."""
    async_checkpoints: bool = True
    """Write checkpoints in a background thread: the step waits only for the previous checkpoint's
    write and the copy of its shard to host memory (workers/training/writer.py). False: the files are
    written, the ranks meet at a barrier and rank 0 marks the checkpoint complete before training goes on."""
    activation_checkpointing: bool = False
    resume: bool = True
    """Resume from the latest complete checkpoint in checkpoint_dir. A job's first attempt
    (False) starts from scratch, and refuses a directory that already holds checkpoints."""
    eval_every: int = 0
    """Steps between evaluations on the held-out data (0: none); rows then carry eval_loss."""
    eval_batches: int = 8
    """Micro-batches each rank evaluates per evaluation."""
    planned_bytes: int | None = None
    """The per-GPU bytes the job was admitted by, overhead left out (an hf model's traced plan);
    None: the rank plans a built-in model from its closed forms."""
    init_from: InitSpec | None = None
    """Start from another job's final weights (fresh optimizer state) instead of the seed's init."""
    max_nonfinite_steps: int = limits.DEFAULT_MAX_NONFINITE_STEPS
    """Steps in a row with a nan or inf global gradient norm (each skipped: it changes nothing)
    after which the run fails with NonFiniteError. Counted from 0 again after a resume."""
    health: HealthConfig = field(default_factory=HealthConfig)
    """Divergence rollback and hang detection (HealthConfig)."""
    data_skips: tuple[DataSkip, ...] = ()
    """Windows of batches never trained on (data_step): the job's own and its rollbacks'."""
    lr_scale: float = 1.0
    """The schedule's learning rates are multiplied by this: health.lr_factor once per rollback."""

    def __post_init__(self) -> None:
        if self.precision not in memory.PRECISIONS:
            raise ValueError(f"precision must be one of {memory.PRECISIONS}, got {self.precision!r}")
        if self.steps < 1 or self.micro_batch_size < 1 or self.checkpoint_every < 0 or self.keep_last < 0:
            raise ValueError(
                f"need steps ({self.steps}) >= 1, micro_batch_size ({self.micro_batch_size}) >= 1, "
                f"checkpoint_every ({self.checkpoint_every}) >= 0, keep_last ({self.keep_last}) >= 0"
            )
        if self.eval_every < 0 or self.eval_batches < 1:
            raise ValueError(f"need eval_every ({self.eval_every}) >= 0 and eval_batches ({self.eval_batches}) >= 1")
        if self.max_nonfinite_steps < 1:
            raise ValueError(f"need max_nonfinite_steps ({self.max_nonfinite_steps}) >= 1")
        if self.zero_stage not in (1, 2, 3):
            raise ValueError(f"zero_stage must be 1, 2 or 3, got {self.zero_stage!r}")
        if not 0 <= self.lr_scale <= 1:  # 0 only where many rollbacks' small lr_factor underflowed
            raise ValueError(f"need 0 <= lr_scale ({self.lr_scale}) <= 1")

    def global_batch(self, world_size: int) -> int:
        return self.global_batch_size or self.micro_batch_size * world_size


def default_of(cls: type, name: str) -> Any:
    """The default of dataclass `cls`'s field `name`: the API's schemas take their defaults from
    here, so each default has one source."""
    (found,) = [f for f in fields(cls) if f.name == name]
    if found.default is not MISSING:
        return found.default
    if found.default_factory is not MISSING:
        return found.default_factory()
    raise ValueError(f"{cls.__name__}.{name} has no default")

"""The ZeRO memory model: per-GPU bytes of a data-parallel training job.

Ψ parameters on N data-parallel ranks; p bytes per model parameter, g per
gradient, K optimizer bytes per parameter (docs/memory-model.md):

    stage 0 (DDP)     (p + g + K)·Ψ
    stage 1 (ZeRO-1)  (p + g)·Ψ + K·Ψ/N        fp16 AdamW: 4Ψ + 12Ψ/N
    stage 2           p·Ψ + (g + K)·Ψ/N + g·(the gradient buckets staged at once)
    stage 3           (p + g + K)·Ψ/N + p·(the units gathered at once)

Shards hold whole elements, so a sharded term of b bytes per element costs
b·⌈Ψ/N⌉ bytes on every rank: integer bytes, exact when N divides Ψ.

A plan by parameter count alone is the formula and nothing else (method
"formula"). A plan for a model also knows the optimizer's layout (one flat
buffer per parameter group, padded so that every rank owns an equal, aligned
slice), so its padding line is what the workers allocate beyond the formula,
byte for byte; and it adds what one micro-batch's step holds beyond the model
states: its activations (alive when forward returns) and temporaries (the rest
of the step's peak), plus a fixed per-GPU overhead. The built-in models have
closed forms for both (method "model", workers/memory/specs.py); any other model is
traced on fake tensors (method "traced", workers/models/trace.py). Frozen parameters
hold weights only: no gradient, no optimizer state. The full plan at N (whether
it fits, min_gpus, the sweep over N) is workers/memory/fit.py's, over these bytes.

Standard library only: the planner, the API and the CLI load this module
without torch or Ray.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from workers.memory.buckets import DEFAULT_BUCKET_CAP_MB, cap_numel, staging_bound_numel
from workers.memory.specs import GPTSpec, MLPSpec, ModelSpec

__all__ = ["GPTSpec", "MLPSpec", "ModelSpec"]  # the built-in models' shapes, planned here (workers/memory/specs.py)

GB = 10**9
"""The seed's gigabyte: 1e9 bytes."""

MAX_NUM_PARAMS = 10**15
"""Largest model the planner accepts (a quadrillion parameters)."""

STAGES = (0, 1, 2, 3)
PRECISIONS = ("fp16", "bf16", "fp32")
METHODS = ("formula", "model", "traced")
OPTIMIZERS = ("adamw", "adam", "sgd_momentum", "sgd")

# (p, g): bytes per model parameter and per gradient, in the model's dtype.
_MODEL_BYTES = {"fp16": (2, 2), "bf16": (2, 2), "fp32": (4, 4)}

# K: optimizer bytes per parameter. Mixed precision keeps an fp32 master copy
# (4) beside the fp32 state (Adam: exp_avg + exp_avg_sq, 8; SGD momentum: 4);
# an fp32 model is its own master copy.
_OPTIMIZER_BYTES = {
    "mixed": {"adamw": 12, "adam": 12, "sgd_momentum": 8, "sgd": 4},
    "fp32": {"adamw": 8, "adam": 8, "sgd_momentum": 4, "sgd": 0},
}

SHARD_ALIGNMENT_NUMEL = 128
"""Every rank's slice of a flat buffer is a multiple of this many elements.

Each slice then starts on a 256-byte boundary in 16-bit dtypes (512 in fp32),
which keeps vectorised kernels and NCCL's chunking on aligned addresses; the
optimizer (workers/zero/optimizer.py) imports this constant, so plan and allocation agree.
"""


def bytes_per_param(precision: str) -> tuple[int, int]:
    """(p, g) for a precision."""
    try:
        return _MODEL_BYTES[precision]
    except KeyError:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}") from None


def optimizer_bytes_per_param(precision: str, optimizer: str) -> int:
    """K for a precision and optimizer: the block that ZeRO-1 shards."""
    bytes_per_param(precision)
    table = _OPTIMIZER_BYTES["fp32" if precision == "fp32" else "mixed"]
    try:
        return table[optimizer]
    except KeyError:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}") from None


def padded_numel(numel: int, *, num_gpus: int, alignment_numel: int = SHARD_ALIGNMENT_NUMEL) -> int:
    """Length of a flat buffer of `numel` elements padded to N equal aligned slices."""
    quantum = num_gpus * alignment_numel
    return -(-numel // quantum) * quantum


# --------------------------------------------------------------------------- plans


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """What is planned, independent of N and the stage."""

    group_numels: tuple[int, ...]
    """Elements of each flat buffer (one per group of trainable parameters)."""
    frozen_numel: int = 0
    """Parameters that are not trained: weights only, replicated below stage 3."""
    gathered_numel: int = 0
    """Parameters a stage-3 rank holds whole at once beside its shards (the units FSDP2 has gathered),
    in the model dtype; 0 where the plan does not know the model's units (a plan by parameter count)."""
    gathered_bytes: int | None = None
    """A traced plan's: the bytes a stage-3 rank's step peaks at beyond the stage-1 step's (the units
    gathered and the gradients unsharded at that moment, workers/models/trace.py), which stage 3
    plans in place of the model dtype's bytes of gathered_numel; None: those."""
    buckets_bytes: int | None = None
    """What a stage-2 rank's step peaks at beyond the stage-1 step's: the staging buffers of its gradient
    buckets alive then (workers/memory/buckets.py), less the gradients they hold, which stage 1 counts
    among the states; a trace's stage-2 count (workers/models/trace.py) or a built-in model's closed
    form. None: the bound of a plan by parameter count, every bucket that can be staged at once."""
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    """The job's largest gradient bucket, MiB: what buckets_bytes was counted with, or bounds."""
    precision: str = "fp16"
    optimizer: str = "adamw"
    alignment_numel: int | None = None
    """Slice alignment of the optimizer's flat buffers; None for a plan by
    parameter count, which models no layout and so no padding."""
    activations_bytes: int = 0
    """Alive when one micro-batch's forward returns: its inputs and what autograd saved."""
    temporaries_bytes: int = 0
    """The rest of that step's peak: transient tensors (logits, gradients in flight)."""
    overhead_bytes: int = 0
    method: str = "formula"
    """How the plan was made: "formula" (num_params), "model" (a closed form) or "traced"."""

    def __post_init__(self) -> None:
        optimizer_bytes_per_param(self.precision, self.optimizer)
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if not 1 <= self.num_params <= MAX_NUM_PARAMS:
            raise ValueError(f"num_params must be in [1, {MAX_NUM_PARAMS:.0e}], got {self.num_params}")
        if not 0 < self.bucket_cap_mb < math.inf:
            raise ValueError(f"bucket_cap_mb must be a finite number > 0, got {self.bucket_cap_mb}")
        counts = (
            "frozen_numel",
            "gathered_numel",
            "gathered_bytes",
            "buckets_bytes",
            "activations_bytes",
            "temporaries_bytes",
        )
        for name in (*counts, "overhead_bytes"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def num_params(self) -> int:
        """Ψ: every parameter, trained or frozen."""
        return self.num_trainable + self.frozen_numel

    @property
    def num_trainable(self) -> int:
        return sum(self.group_numels)

    @classmethod
    def from_num_params(
        cls,
        num_params: int,
        *,
        precision: str = "fp16",
        optimizer: str = "adamw",
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    ) -> Workload:
        """The seed's formula: Ψ parameters, no layout, activations or overhead (at stage 2, the
        bound on the gradient buckets of bucket_cap_mb MiB staged at once)."""
        return cls(group_numels=(num_params,), precision=precision, optimizer=optimizer, bucket_cap_mb=bucket_cap_mb)

    @classmethod
    def from_model(
        cls,
        model: ModelSpec,
        *,
        precision: str = "fp16",
        optimizer: str = "adamw",
        micro_batch_size: int = 1,
        seq_len: int | None = None,
        activation_checkpointing: bool = False,
        overhead_bytes: int = 0,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    ) -> Workload:
        """A built-in model's plan: the optimizer's real layout, the closed forms of the step (and of a
        stage-2 step's gradient buckets of bucket_cap_mb MiB), overhead."""
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if isinstance(model, GPTSpec):
            seq_len = model.block_size if seq_len is None else seq_len
            if not 1 <= seq_len <= model.block_size:
                raise ValueError(f"seq_len must be in [1, block_size={model.block_size}], got {seq_len}")
        step = {
            "micro_batch_size": micro_batch_size,
            "seq_len": seq_len or 1,
            "bytes_per_element": bytes_per_param(precision)[0],
            "checkpointing": activation_checkpointing,
        }
        return cls(
            group_numels=tuple(n for n in model.param_groups() if n),
            precision=precision,
            optimizer=optimizer,
            alignment_numel=SHARD_ALIGNMENT_NUMEL,
            activations_bytes=model.activation_bytes(**step),
            temporaries_bytes=model.temporaries_bytes(**step),
            overhead_bytes=overhead_bytes,
            gathered_numel=model.gathered_numel(),
            buckets_bytes=model.buckets_bytes(**step, bucket_cap_mb=bucket_cap_mb),
            bucket_cap_mb=bucket_cap_mb,
            method="model",
        )

    @classmethod
    def from_trace(
        cls,
        *,
        group_numels: tuple[int, ...],
        frozen_numel: int,
        activations_bytes: int,
        temporaries_bytes: int,
        gathered_numel: int = 0,
        gathered_bytes: int | None = None,
        buckets_bytes: int | None = None,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        precision: str = "fp16",
        optimizer: str = "adamw",
        overhead_bytes: int = 0,
    ) -> Workload:
        """A traced model's plan: its parameter groups, what it holds gathered at stage 3, what its
        gradient buckets (of bucket_cap_mb MiB) stage at stage 2, and its step as counted on fake tensors."""
        return cls(
            group_numels=tuple(n for n in group_numels if n),
            frozen_numel=frozen_numel,
            gathered_numel=gathered_numel,
            gathered_bytes=gathered_bytes,
            buckets_bytes=buckets_bytes,
            bucket_cap_mb=bucket_cap_mb,
            precision=precision,
            optimizer=optimizer,
            alignment_numel=SHARD_ALIGNMENT_NUMEL,
            activations_bytes=activations_bytes,
            temporaries_bytes=temporaries_bytes,
            overhead_bytes=overhead_bytes,
            method="traced",
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Breakdown:
    """Per-GPU bytes by kind."""

    params_bytes: int
    grads_bytes: int
    buckets_bytes: int
    """Stage 2's: the staging buffers of the gradient buckets at the step's peak (0 at other stages)."""
    optimizer_bytes: int
    padding_bytes: int
    activations_bytes: int
    temporaries_bytes: int
    overhead_bytes: int

    @property
    def total_bytes(self) -> int:
        return (
            self.params_bytes
            + self.grads_bytes
            + self.buckets_bytes
            + self.optimizer_bytes
            + self.padding_bytes
            + self.activations_bytes
            + self.temporaries_bytes
            + self.overhead_bytes
        )


def shard_numel(workload: Workload, *, num_gpus: int) -> int:
    """Elements of optimizer state each rank allocates (the same on every rank)."""
    if workload.alignment_numel is None:
        return -(-workload.num_trainable // num_gpus)
    return sum(
        padded_numel(n, num_gpus=num_gpus, alignment_numel=workload.alignment_numel) // num_gpus
        for n in workload.group_numels
    )


def breakdown(workload: Workload, *, num_gpus: int, stage: int) -> Breakdown:
    """Per-GPU bytes of `workload` on `num_gpus` ranks at ZeRO `stage`."""
    _check_num_gpus(num_gpus)
    check_stage(stage)
    p, g = bytes_per_param(workload.precision)
    k = optimizer_bytes_per_param(workload.precision, workload.optimizer)
    psi = workload.num_trainable
    frozen = workload.frozen_numel
    step = {
        "activations_bytes": workload.activations_bytes,
        "temporaries_bytes": workload.temporaries_bytes,
        "overhead_bytes": workload.overhead_bytes,
    }
    if stage == 0:
        # plain DDP keeps everything replicated and needs no flat-buffer padding
        return Breakdown(
            params_bytes=p * (psi + frozen),
            grads_bytes=g * psi,
            buckets_bytes=0,
            optimizer_bytes=k * psi,
            padding_bytes=0,
            **step,
        )
    exact = -(-psi // num_gpus)  # ⌈Ψ/N⌉: the formula's shard, in whole elements
    shard = shard_numel(workload, num_gpus=num_gpus)
    # a replicated flat buffer spans all N padded slices
    full = psi if workload.alignment_numel is None else shard * num_gpus
    sharded_p = stage >= 3
    sharded_g = stage >= 2
    frozen_params = -(-frozen // num_gpus) if sharded_p else frozen
    gathered = _gathered_bytes(workload) if sharded_p else 0  # the units FSDP2 holds whole
    return Breakdown(
        params_bytes=p * ((exact if sharded_p else psi) + frozen_params) + gathered,
        grads_bytes=g * (exact if sharded_g else psi),
        buckets_bytes=_buckets_bytes(workload) if stage == 2 else 0,  # stage 3 reduce-scatters in FSDP2's units
        optimizer_bytes=k * exact,
        padding_bytes=(
            p * ((shard - exact) if sharded_p else (full - psi))
            + g * ((shard - exact) if sharded_g else (full - psi))
            + k * (shard - exact)
        ),
        **step,
    )


def total_bytes(workload: Workload, *, num_gpus: int, stage: int) -> int:
    return breakdown(workload, num_gpus=num_gpus, stage=stage).total_bytes


def floor_bytes(workload: Workload, *, stage: int) -> int:
    """Per-GPU bytes that no number of GPUs shards away at `stage`: the replicated model states (below
    stage 3; frozen weights too), the gradient buckets staged at once (stage 2), the units gathered at
    once (stage 3), the step and the overhead."""
    check_stage(stage)
    p, g = bytes_per_param(workload.precision)
    k = optimizer_bytes_per_param(workload.precision, workload.optimizer)
    sharded = (k if stage >= 1 else 0) + (g if stage >= 2 else 0) + (p if stage >= 3 else 0)
    replicated = p + g + k - sharded
    frozen = workload.frozen_numel if stage < 3 else 0
    gathered = _gathered_bytes(workload) if stage >= 3 else 0
    buckets = _buckets_bytes(workload) if stage == 2 else 0
    step = workload.activations_bytes + workload.temporaries_bytes + workload.overhead_bytes
    return replicated * workload.num_trainable + p * frozen + buckets + gathered + step


def _gathered_bytes(workload: Workload) -> int:
    """What a stage-3 rank holds gathered beside its shards: traced, or the gathered units' weights."""
    if workload.gathered_bytes is not None:
        return workload.gathered_bytes
    return bytes_per_param(workload.precision)[0] * workload.gathered_numel


def _buckets_bytes(workload: Workload) -> int:
    """What a stage-2 rank's staging buffers add to its step's peak: counted, or (a plan by parameter
    count, which knows no step) every byte of buckets that can be staged at once."""
    if workload.buckets_bytes is not None:
        return workload.buckets_bytes
    g = bytes_per_param(workload.precision)[1]
    cap = cap_numel(workload.bucket_cap_mb, bytes_per_element=g)
    return g * staging_bound_numel(workload.group_numels, cap=cap)


def _check_num_gpus(num_gpus: int) -> None:
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")


def check_stage(stage: int) -> None:
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage}")


def gpu_memory_bytes_from_gb(gpu_memory_gb: float) -> int:
    """GB (1e9 bytes, as in the seed) to integer bytes."""
    if not math.isfinite(gpu_memory_gb) or gpu_memory_gb <= 0:
        raise ValueError(f"gpu_memory_gb must be a finite number > 0, got {gpu_memory_gb}")
    return round(gpu_memory_gb * GB)

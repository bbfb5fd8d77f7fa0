"""ZeRO1AdamW: mixed-precision AdamW whose fp32 state is sharded over the data-parallel ranks.

The four beats of ZeRO Stage 1 (docs/optimizer.md; the bytes in docs/memory-model.md), after
every rank's backward has produced FULL gradients of its micro-batch:

1. reduce:  average the gradients; rank r keeps its own shard of them
2. update:  AdamW on rank r's shard of the fp32 state (master, exp_avg, exp_avg_sq)
3. cast:    the shard's fp32 master weights -> the model dtype
4. gather:  every rank receives every shard: the full updated model again

ZeRO1AdamW's step() calls the beats in order and decides, between reduce and
update, the global norm, the clip and whether to skip. The rooms it calls into:
workers/zero/flat.py lays parameters, gradients and state out in flat buffers cut
into equal shards (K·Ψ/N bytes of state per rank); workers/zero/comm.py moves them
between the ranks (beats 1 and 4; workers/zero/buckets.py for the p2p reduce; one
rank moves nothing); workers/zero/adamw.py updates and casts the shard (beats 2 and
3); workers/zero/sharded_state.py writes and reads the checkpoint formats (ZeRO1AdamW's
state_dict() and the rest come from there); workers/zero/loss_scale.py scales fp16
losses.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from workers import phases
from workers.limits import DEFAULT_BUCKET_CAP_MB, MIN_BUCKET_CAP_MB
from workers.memory.model import SHARD_ALIGNMENT_NUMEL
from workers.zero import sharded_state
from workers.zero.adamw import UPCAST_CHUNK_NUMEL, ShardAdamW, check_hyperparameters, step_runs
from workers.zero.buckets import Bucket
from workers.zero.comm import (
    GatherOp,
    Ranks,
    ReduceOp,
    connect,
    default_collectives,
    register_grad_hooks,
    resolve_collectives,
)
from workers.zero.flat import FlatBuffer, allocated_bytes, build_buffers, shard_slices, state_bytes
from workers.zero.loss_scale import DynamicLossScaler

# the names other modules import from here, wherever they live now
__all__ = ["UPCAST_CHUNK_NUMEL", "DynamicLossScaler", "ZeRO1AdamW", "decay_param_groups", "default_collectives"]

_CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


def decay_param_groups(model: torch.nn.Module, *, weight_decay: float) -> list[dict[str, Any]]:
    """The usual two groups, named: matrices and embeddings decay, biases and norms do not.

    The rule (dim >= 2 decays) is the one the memory model's param_groups() counts.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [(n, p) for n, p in named if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [(n, p) for n, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


class ZeRO1AdamW(sharded_state.CheckpointMethods, torch.optim.Optimizer):
    """AdamW with its fp32 state sharded over the ranks of `process_group` (ZeRO Stage 1).

    Use it on an unwrapped model (no DDP: the optimizer reduces the gradients
    itself), built and moved to its device before the optimizer:

        opt = ZeRO1AdamW(decay_param_groups(model, weight_decay=0.1), lr=3e-4, max_grad_norm=1.0)
        loss = model(x)
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()

    `grad_norm` (the global norm before clipping) and `skipped` describe the
    last step. A step whose global norm is not finite (nan or inf) is skipped on
    every rank, with or without a loss scaler: no parameter, state or step count
    changes (the loss scaler, if any, backs off). With record_phase_times=True,
    `phase_times_s` splits a step into reduce (with the norm's all-reduce), update
    (with the cast) and gather. fp16 models get dynamic loss scaling; bf16 and
    fp32 need none.
    zero_grad() always zeroes in place: the gradients are views of a flat
    buffer and stay so (set_to_none is ignored).

    Overlap (overlap_comm=True; it needs the "p2p" collectives, gloo's default):
    the flat buffers are cut into buckets of whole parameters, at most
    bucket_cap_mb each, in reverse parameter order (roughly the order backward
    produces them). A gradient hook on each parameter, registered once, counts
    arrivals; a bucket's reduce is sent the moment its last gradient arrives (and
    the buckets before it have gone), while backward goes on; step() waits for
    them. With overlap_gather the gather is sent slice by slice as the update
    finishes each slice. Both are off by default: where communication is CPU work
    competing with the backward and the update for the same cores (gloo over
    loopback on this project's 2-core machines) they measured 3-8% slower than
    sending after the backward (benchmarks/optimizer.py, configs c, d, e); they
    pay where a network or DMA engine moves the bytes. Accumulating micro-batches
    with overlap: run all but the last backward under no_sync(). A second backward
    outside no_sync() after a bucket has gone is an error, as in DDP.
    """

    stage: int = 1
    """The ZeRO stage: what is sharded beyond the optimizer state (workers/zero/stage2.py: the gradients)."""

    min_bucket_cap_mb: float = MIN_BUCKET_CAP_MB
    """The smallest bucket_cap_mb accepted (workers/limits.py). Tests that cut a model of a few
    hundred elements into many buckets lower it in a subclass."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        process_group: dist.ProcessGroup | None = None,
        max_grad_norm: float | None = None,
        loss_scaler: DynamicLossScaler | None | Literal["auto"] = "auto",
        alignment_numel: int = SHARD_ALIGNMENT_NUMEL,
        reduce_op: ReduceOp = "auto",
        gather_op: GatherOp = "auto",
        overlap_comm: bool = False,
        overlap_gather: bool = False,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        record_phase_times: bool = False,
    ):
        check_hyperparameters(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        if alignment_numel < 1:
            raise ValueError(f"alignment_numel must be >= 1, got {alignment_numel}")
        if not bucket_cap_mb >= self.min_bucket_cap_mb:
            raise ValueError(
                f"bucket_cap_mb ({bucket_cap_mb}) must be >= {self.min_bucket_cap_mb} MiB: every bucket is a send "
                "per peer and every slice of the update a kernel launch, each step"
            )
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        for group in self.param_groups:
            check_hyperparameters(**{k: group[k] for k in ("lr", "betas", "eps", "weight_decay")})

        self.process_group = process_group
        ranks = Ranks.of(process_group)
        self.world_size = ranks.world_size
        self.rank = ranks.rank
        self.reduce_op, self.gather_op = self._collectives(
            ranks,
            reduce_op=reduce_op,
            gather_op=gather_op,
            overlap_comm=overlap_comm,
            overlap_gather=overlap_gather,
        )
        self.bucket_cap_mb = bucket_cap_mb
        self.max_grad_norm = max_grad_norm
        self.alignment_numel = alignment_numel

        self._buffers = build_buffers(
            self.param_groups,
            world_size=self.world_size,
            rank=self.rank,
            alignment_numel=alignment_numel,
            full_grads=self.stage < 2,
        )
        self._slots = [slot for buf in self._buffers for slot in buf.slots]
        self.device = self._slots[0].param.device if self._slots else torch.device("cpu")
        model_dtypes = {slot.param.dtype for slot in self._slots}
        if loss_scaler == "auto":
            loss_scaler = DynamicLossScaler() if torch.float16 in model_dtypes else None
        self.loss_scaler = loss_scaler
        self._comm = connect(
            ranks,
            self._buffers,
            reduce_op=self.reduce_op if self.stage < 2 else "none",
            gather_op=self.gather_op,
            overlap_comm=overlap_comm and self.stage < 2,
            overlap_gather=overlap_gather,
            bucket_cap_mb=bucket_cap_mb,
        )
        self._had_grad = [False] * len(self._slots)  # this rank's parameters with a gradient since the last step
        self._sync = True  # False inside no_sync()
        self._connect_gradients(ranks)
        register_grad_hooks(self._slots, self._on_grad)
        self._adamw = ShardAdamW(self.device)
        self.grad_norm: float | None = None
        self.skipped = False
        self.record_phase_times = record_phase_times
        self.phase_times_s: dict[str, float] = {}
        # every rank starts from the same model: each takes the others' shards of it
        self._comm.gather_params()

    def _collectives(
        self, ranks: Ranks, *, reduce_op: str, gather_op: str, overlap_comm: bool, overlap_gather: bool
    ) -> tuple[str, str]:
        """(reduce, gather) with "auto" resolved for this stage and backend."""
        return resolve_collectives(
            ranks.backend,
            reduce_op=reduce_op,
            gather_op=gather_op,
            overlap_comm=overlap_comm,
            overlap_gather=overlap_gather,
        )

    def _connect_gradients(self, ranks: Ranks) -> None:
        """Stage 1 reduces the full flat gradients in step() (self._comm); stage 2 sets up its own reduce."""

    @property
    def overlap_comm(self) -> bool:
        """Whether backward sends the gradient buckets (never with one rank: nothing to send)."""
        return self._comm.overlap_comm

    @property
    def overlap_gather(self) -> bool:
        """Whether the update sends each slice as it finishes it (never with one rank)."""
        return self._comm.overlap_gather

    def _on_grad(self, index: int) -> None:
        """A parameter's gradient of this backward is complete: note it; outside no_sync() the
        communication counts it and sends what is ready."""
        self._had_grad[index] = True
        if self._sync:
            self._comm.grad_ready(index)

    # ------------------------------------------------------------------ public API

    def scale_loss(self, loss: Tensor) -> Tensor:
        """The loss to call backward() on: multiplied by the loss scale under fp16."""
        return loss if self.loss_scaler is None else loss * self.loss_scaler.scale

    @property
    def loss_scale(self) -> float:
        return 1.0 if self.loss_scaler is None else self.loss_scaler.scale

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, without its torch._disable_dynamo wrapper where nothing in this process has
        loaded torch._dynamo: the wrapper's first call imports it (about 1 s of CPU, every rank's
        start), and without a torch.compile there is nothing for it to guard against."""
        unguarded = getattr(torch.optim.Optimizer.add_param_group, "__wrapped__", None)
        if unguarded is None or "torch._dynamo" in sys.modules:
            return super().add_param_group(param_group)
        return unguarded(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._comm.finish_reduces()  # a bucket sent without a step(): let its sends end before zeroing
        self._comm.reset()
        for buf in self._buffers:
            buf.grads.zero_()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients without sending them (DDP's no_sync()):
        use it for every micro-batch but the last, whose backward then sends the sum."""
        previous = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = previous

    def model_state_bytes(self) -> int:
        """Bytes this rank allocates for model states: the flat parameter and gradient
        buffers and its shard of the optimizer state (the plan's params + grads +
        optimizer + padding)."""
        return allocated_bytes(self._buffers)

    def memory_bytes(self) -> dict[str, int]:
        """This rank's optimizer-state bytes by kind, measured from its tensors.

        `padding` is every allocated byte that holds no parameter: the state
        beyond the owned elements plus the padding of the flat parameter and
        gradient buffers. The total is the same on every rank and equals the
        memory model's optimizer_bytes + padding_bytes for this layout.
        """
        return state_bytes(self._buffers)

    @torch.no_grad()
    def step(self, closure=None, *, also_sum: Tensor | None = None):
        """Reduce, update the local shard, cast, gather. Returns the closure's loss.

        also_sum: fp32 values summed over the ranks in place by the norm's all-reduce, which the
        step makes anyway (the training loop's loss: one collective a step fewer)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scale = self.loss_scale
        clock = self._clock()
        phases.enter("reduce_scatter")
        self._reduce_gradients()  # 1. reduce: each buffer's grad_shard (S,) sums the ranks' gradients
        phases.enter("all_reduce")
        grad_norm, active = self._global_grad_stats(scale, also_sum)
        clock("reduce")
        # the norm comes from one all-reduce, so every rank holds the same value and skips, or
        # steps, with the others: a nan or inf anywhere in any rank's gradients reaches the sum
        # of squares of the rank owning that element, and squares are >= 0, so no inf - inf can
        # cancel it. An fp16 overflow, or a bf16/fp32 blow-up: stepping would write nan into the
        # master weights, or clip by max_grad_norm / inf = 0 and divide by it
        overflow = not math.isfinite(grad_norm)
        self.grad_norm = grad_norm
        self.skipped = overflow
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow=overflow)
        if not self.skipped:
            phases.enter("update")
            self._update(grad_norm=grad_norm, scale=scale, active=active)  # 2. update and 3. cast
            clock("update")
            phases.enter("all_gather")
            self._comm.gather_updated()  # 4. gather: every rank receives every updated shard
            clock("gather")
        self._had_grad = [False] * len(self._slots)
        self._end_step()
        return loss

    def _reduce_gradients(self) -> None:
        self._comm.reduce_gradients()

    def _end_step(self) -> None:
        self._comm.reset()
        for buf in self._buffers:
            buf.grad_shard = None

    def _clock(self):
        """clock(phase) records seconds since the previous call into phase_times_s (when enabled)."""
        if not self.record_phase_times:
            return lambda phase: None
        self.phase_times_s = {}
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        last = [time.perf_counter()]

        def clock(phase: str) -> None:
            sync()
            now = time.perf_counter()
            self.phase_times_s[phase] = now - last[0]
            last[0] = now

        return clock

    # ------------------------------------------------------------------ the norm and the update

    def _global_grad_stats(self, scale: float, also_sum: Tensor | None) -> tuple[float, list[bool]]:
        """Global gradient norm (unscaled, averaged) and which parameters had a gradient
        on any rank, from one all-reduce of [Σ g², flags..., also_sum...]. Padding is zero,
        so summing whole shards sums the owned elements only."""
        flags = len(self._slots)
        extra = 0 if also_sum is None else also_sum.numel()
        stats = torch.zeros(1 + flags + extra, dtype=torch.float32, device=self.device)
        for buf in self._buffers:
            stats[0] += self._adamw.sum_of_squares(buf.grad_shard)
        stats[1 : 1 + flags] = torch.tensor(self._had_grad, dtype=torch.float32)
        if also_sum is not None:
            stats[1 + flags :] = also_sum.reshape(-1)
        self._comm.all_reduce(stats)
        if also_sum is not None:
            also_sum.copy_(stats[1 + flags :].view_as(also_sum))
        values = stats[: 1 + flags].tolist()  # the one host sync of a step
        grad_norm = math.sqrt(values[0]) / (self._comm.grad_divisor * scale)  # inf and nan pass through
        return grad_norm, [flag > 0 for flag in values[1:]]

    def _update(self, *, grad_norm: float, scale: float, active: list[bool]) -> None:
        """AdamW on this rank's shard and the cast, slice by slice; with overlap_gather each
        slice is sent to the peers as soon as it is updated, while the next slice updates."""
        clip = 1.0
        if self.max_grad_norm is not None:
            clip = min(1.0, self.max_grad_norm / (grad_norm + _CLIP_EPS))
        # the kernel divides each gradient by this: sum -> mean, unscale, clip, in one pass
        grad_scale = torch.tensor(self._comm.grad_divisor * scale / clip, dtype=torch.float32, device=self.device)
        for b, buf in enumerate(self._buffers):
            runs = step_runs(buf, active)
            group = self.param_groups[buf.group_index]
            for i, (lo, hi) in enumerate(self._gather_slices(buf)):
                self._adamw.update_slice(buf, group, runs, lo, hi, grad_scale=grad_scale)
                self._comm.slice_updated(b, i, lo, hi)

    def _gather_slices(self, buf: FlatBuffer) -> list[tuple[int, int]]:
        return shard_slices(buf, bucket_cap_mb=self.bucket_cap_mb)

    # ------------------------------------------------------------------ names tests and benchmarks read

    def _state(self, buf: FlatBuffer, kind: str) -> Tensor:
        return buf.state_of(kind)

    @property
    def _buckets(self) -> list[Bucket]:
        return self._comm.buckets

    @property
    def _bucket_of(self) -> list[Bucket]:
        return self._comm.reducer.bucket_of

    @property
    def _next_launch(self) -> int:
        return self._comm.reducer.next_launch

"""ZeRO1AdamW: mixed-precision AdamW whose fp32 state is sharded over the data-parallel ranks.

The four beats of ZeRO Stage 1 (../shared/seed/zero-stage-1-math.txt), after
every rank's backward has produced FULL gradients of its micro-batch:

1. reduce:  average the gradients; rank r keeps its own shard of them
2. update:  AdamW on rank r's shard of the fp32 state (master, exp_avg, exp_avg_sq)
3. cast:    the shard's fp32 master weights -> the model dtype
4. gather:  every rank receives every shard: the full updated model again

Layout. For each (param group, dtype) the parameters and their gradients live
in one flat buffer of the model dtype, padded so that the N ranks own equal
slices of a multiple of SHARD_ALIGNMENT_NUMEL elements; each parameter (and
its .grad) is a view into it, so the collectives move whole buffers and no
per-parameter copies happen. Rank r allocates fp32 state for its slice only:
12 bytes per owned element in mixed precision (the master copy plus Adam's
two moments), 8 in fp32, where the parameter's slice is its own master copy.
That is the memory model's K·Ψ/N, byte for byte (workers/memory.py).
"""

from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from workers.memory import SHARD_ALIGNMENT_NUMEL, padded_numel

ReduceOp = Literal["auto", "reduce_scatter", "all_reduce"]
GatherOp = Literal["auto", "all_gather", "all_reduce"]

SHARDED_FORMAT = "zero1.sharded.v1"
CONSOLIDATED_FORMAT = "zero1.consolidated.v1"
_STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")
_CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_
UPDATE_CHUNK_NUMEL = 1 << 22  # 16-bit gradients are upcast this many at a time: a 16 MiB transient


def default_collectives(backend: str) -> tuple[str, str]:
    """(reduce, gather) collectives per backend, chosen by measurement.

    NCCL's reduce-scatter and all-gather are bandwidth-optimal: together they
    move exactly DDP's all-reduce volume. gloo's are not; on this project's
    2-core machines gloo's ring all-reduce beat them for both beats
    (benchmarks/optimizer.py prints the figures), so on gloo the reduce is an
    all-reduce of which each rank reads its shard, and the gather is an
    all-reduce of buffers that are zero outside each rank's shard.
    """
    if backend == "nccl":
        return "reduce_scatter", "all_gather"
    return "all_reduce", "all_reduce"


def decay_param_groups(
    model: torch.nn.Module, *, weight_decay: float
) -> list[dict[str, Any]]:
    """The usual two groups, named: matrices and embeddings decay, biases and norms do not.

    The rule (dim >= 2 decays) is the one the memory model's param_groups() counts.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [(n, p) for n, p in named if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [(n, p) for n, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


@dataclass(kw_only=True, slots=True)
class DynamicLossScaler:
    """fp16 loss scaling: halve on overflow, grow after `growth_interval` clean steps."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    clean_steps: int = 0

    def __post_init__(self) -> None:
        if not (self.min_scale > 0 and self.scale >= self.min_scale):
            raise ValueError(f"loss scale ({self.scale}) must be >= min_scale ({self.min_scale}) > 0")
        if self.growth_factor <= 1 or not 0 < self.backoff_factor < 1 or self.growth_interval < 1:
            raise ValueError(
                f"need growth_factor ({self.growth_factor}) > 1, 0 < backoff_factor ({self.backoff_factor}) < 1, "
                f"growth_interval ({self.growth_interval}) >= 1"
            )

    def update(self, *, overflow: bool) -> None:
        if overflow:
            if self.scale <= self.min_scale:
                raise FloatingPointError(
                    f"fp16 gradients overflow even at the minimum loss scale ({self.min_scale}): "
                    "the loss or the gradients are inf/nan; lower the learning rate or use bf16"
                )
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])


@dataclass(kw_only=True, slots=True, eq=False)
class _Slot:
    """One parameter inside a flat buffer."""

    name: str
    param: Tensor
    index: int  # position in the optimizer's flags vector
    offset: int  # first element in the flat buffer
    numel: int
    shape: tuple[int, ...]
    step: int = 0  # AdamW's step count, per parameter as in torch.optim.AdamW


@dataclass(kw_only=True, slots=True)
class _FlatBuffer:
    """The parameters of one (group, dtype) and this rank's slice of their state."""

    group_index: int
    slots: list[_Slot]
    numel: int
    shard_numel: int  # S: elements each rank owns, padding included
    rank: int
    params: Tensor  # (N*S,) model dtype; every parameter is a view into it
    grads: Tensor  # (N*S,) model dtype; every .grad is a view into it
    state: dict[str, Tensor]  # master / exp_avg / exp_avg_sq, each (S,) fp32
    grad_shard: Tensor | None = None  # (S,) this step's averaged gradient slice

    @property
    def start(self) -> int:
        return self.rank * self.shard_numel

    @property
    def owned_numel(self) -> int:
        """Elements of the shard that are real parameters, not padding."""
        return max(0, min(self.shard_numel, self.numel - self.start))

    def param_shard(self) -> Tensor:
        return self.params[self.start : self.start + self.shard_numel]

    def local_segments(self) -> list[tuple[_Slot, int, int]]:
        """(slot, lo, hi): the part of each parameter inside this shard, in shard coordinates."""
        out = []
        for slot in self.slots:
            lo = max(slot.offset, self.start) - self.start
            hi = min(slot.offset + slot.numel, self.start + self.shard_numel) - self.start
            if lo < hi:
                out.append((slot, lo, hi))
        return out


class ZeRO1AdamW(torch.optim.Optimizer):
    """AdamW with its fp32 state sharded over the ranks of `process_group` (ZeRO Stage 1).

    Use it on an unwrapped model (no DDP: the optimizer reduces the gradients
    itself), built and moved to its device before the optimizer:

        opt = ZeRO1AdamW(decay_param_groups(model, weight_decay=0.1), lr=3e-4, max_grad_norm=1.0)
        loss = model(x)
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()

    `grad_norm` (the global norm before clipping) and `skipped` describe the
    last step; with record_phase_times=True, `phase_times_s` splits it into
    reduce (with the norm's all-reduce), update (with the cast) and gather. fp16 models get dynamic loss scaling; bf16 and fp32 need none.
    zero_grad() always zeroes in place: the gradients are views of a flat
    buffer and stay so (set_to_none is ignored).
    """

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
        record_phase_times: bool = False,
    ):
        _check_hyperparameters(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        if alignment_numel < 1:
            raise ValueError(f"alignment_numel must be >= 1, got {alignment_numel}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        for group in self.param_groups:
            _check_hyperparameters(**{k: group[k] for k in ("lr", "betas", "eps", "weight_decay")})

        self.process_group = process_group
        distributed = process_group is not None or (dist.is_available() and dist.is_initialized())
        self.world_size = dist.get_world_size(process_group) if distributed else 1
        self.rank = dist.get_rank(process_group) if distributed else 0
        backend = dist.get_backend(process_group) if distributed else "none"
        reduce_auto, gather_auto = default_collectives(backend)
        self.reduce_op = reduce_auto if reduce_op == "auto" else reduce_op
        self.gather_op = gather_auto if gather_op == "auto" else gather_op
        # NCCL averages natively; elsewhere sum and fold 1/N into the update's grad scale
        self._reduce_avg = backend == "nccl"
        self.max_grad_norm = max_grad_norm
        self.alignment_numel = alignment_numel

        self._buffers = self._build_buffers()
        self._slots = [slot for buf in self._buffers for slot in buf.slots]
        self.device = self._slots[0].param.device if self._slots else torch.device("cpu")
        model_dtypes = {slot.param.dtype for slot in self._slots}
        if loss_scaler == "auto":
            loss_scaler = DynamicLossScaler() if torch.float16 in model_dtypes else None
        self.loss_scaler = loss_scaler
        self._had_grad = [False] * len(self._slots)
        hooks = [slot.param.register_post_accumulate_grad_hook(self._grad_marker(slot.index)) for slot in self._slots]
        # the hooks live on the parameters: remove them when the optimizer goes, so none keeps it alive
        weakref.finalize(self, lambda: [hook.remove() for hook in hooks])
        self.grad_norm: float | None = None
        self.skipped = False
        self.record_phase_times = record_phase_times
        self.phase_times_s: dict[str, float] = {}
        # every rank starts from the same model: each takes the others' shards of it
        self._gather_params()

    # ------------------------------------------------------------------ set-up

    def _build_buffers(self) -> list[_FlatBuffer]:
        buffers, index = [], 0
        for group_index, group in enumerate(self.param_groups):
            names = group.get("param_names") or [f"group{group_index}.{i}" for i in range(len(group["params"]))]
            by_dtype: dict[torch.dtype, list[tuple[str, Tensor]]] = {}
            for name, param in zip(names, group["params"]):
                if param.requires_grad:
                    by_dtype.setdefault(param.dtype, []).append((name, param))
            for named in by_dtype.values():
                buffers.append(self._flat_buffer(group_index, named, first_index=index))
                index += len(named)
        devices = {slot.param.device for buf in buffers for slot in buf.slots}
        if len(devices) > 1:
            raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
        return buffers

    def _flat_buffer(self, group_index: int, named: list[tuple[str, Tensor]], *, first_index: int) -> _FlatBuffer:
        dtype, device = named[0][1].dtype, named[0][1].device
        slots, offset = [], 0
        for i, (name, param) in enumerate(named):
            slots.append(
                _Slot(name=name, param=param, index=first_index + i, offset=offset, numel=param.numel(),
                      shape=tuple(param.shape))
            )
            offset += param.numel()
        total = padded_numel(offset, num_gpus=self.world_size, alignment_numel=self.alignment_numel)
        shard = total // self.world_size
        params = torch.zeros(total, dtype=dtype, device=device)
        grads = torch.zeros(total, dtype=dtype, device=device)
        for slot in slots:
            view = slice(slot.offset, slot.offset + slot.numel)
            params[view].copy_(slot.param.detach().reshape(-1))
            if slot.param.grad is not None:
                grads[view].copy_(slot.param.grad.reshape(-1))
            slot.param.data = params[view].view(slot.shape)
            slot.param.grad = grads[view].view(slot.shape)
        buf = _FlatBuffer(
            group_index=group_index, slots=slots, numel=offset, shard_numel=shard, rank=self.rank,
            params=params, grads=grads, state={},
        )
        mixed = dtype != torch.float32
        if mixed:  # an fp32 model's own shard is its master copy
            buf.state["master"] = buf.param_shard().float()
        buf.state["exp_avg"] = torch.zeros(shard, dtype=torch.float32, device=device)
        buf.state["exp_avg_sq"] = torch.zeros(shard, dtype=torch.float32, device=device)
        return buf

    def _grad_marker(self, index: int):
        optimizer = weakref.ref(self)

        def mark(_: Tensor) -> None:
            if (alive := optimizer()) is not None:
                alive._had_grad[index] = True

        return mark

    # ------------------------------------------------------------------ public API

    def scale_loss(self, loss: Tensor) -> Tensor:
        """The loss to call backward() on: multiplied by the loss scale under fp16."""
        return loss if self.loss_scaler is None else loss * self.loss_scaler.scale

    @property
    def loss_scale(self) -> float:
        return 1.0 if self.loss_scaler is None else self.loss_scaler.scale

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002 - see class docstring
        for buf in self._buffers:
            buf.grads.zero_()

    def model_state_bytes(self) -> int:
        """Bytes this rank allocates for model states: the flat parameter and gradient
        buffers and its shard of the optimizer state (the plan's params + grads +
        optimizer + padding)."""
        return sum(
            t.numel() * t.element_size()
            for buf in self._buffers
            for t in (buf.params, buf.grads, *buf.state.values())
        )

    def memory_bytes(self) -> dict[str, int]:
        """This rank's optimizer-state bytes by kind, measured from its tensors.

        `padding` is every allocated byte that holds no parameter: the state
        beyond the owned elements plus the padding of the flat parameter and
        gradient buffers. The total is the same on every rank and equals the
        memory model's optimizer_bytes + padding_bytes for this layout.
        """
        out = dict.fromkeys((*_STATE_KINDS, "padding"), 0)
        for buf in self._buffers:
            for kind, tensor in buf.state.items():
                used = buf.owned_numel * tensor.element_size()
                out[kind] += used
                out["padding"] += tensor.numel() * tensor.element_size() - used
            unused = buf.params.numel() - buf.numel
            out["padding"] += unused * (buf.params.element_size() + buf.grads.element_size())
        return out

    @torch.no_grad()
    def step(self, closure=None):
        """Reduce, update the local shard, cast, gather. Returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scale = self.loss_scale
        clock = self._clock()
        self._reduce_gradients()
        grad_norm, active = self._global_grad_stats(scale)
        clock("reduce")
        overflow = not math.isfinite(grad_norm)
        self.grad_norm, self.skipped = grad_norm, overflow and self.loss_scaler is not None
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow=overflow)
        if not self.skipped:
            self._update_shards(grad_norm=grad_norm, scale=scale, active=active)
            clock("update")
            self._gather_params()
            clock("gather")
        self._had_grad = [False] * len(self._slots)
        for buf in self._buffers:
            buf.grad_shard = None
        return loss

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

    # ------------------------------------------------------------------ the four beats

    def _reduce_gradients(self) -> None:
        for buf in self._buffers:
            shard = slice(buf.start, buf.start + buf.shard_numel)
            if self.world_size == 1:
                buf.grad_shard = buf.grads
            elif self.reduce_op == "all_reduce":
                # all-reduce: flat grad (N*S,) summed on every rank; this rank reads its (S,)
                dist.all_reduce(buf.grads, op=self._reduce_op(), group=self.process_group)
                buf.grad_shard = buf.grads[shard]
            else:
                # reduce-scatter: flat grad (N*S,) -> own shard (S,); in place where NCCL allows
                out = buf.grads[shard] if self._reduce_avg else torch.empty_like(buf.grads[shard])
                dist.reduce_scatter_single(out, buf.grads, op=self._reduce_op(), group=self.process_group)
                buf.grad_shard = out

    def _reduce_op(self) -> dist.ReduceOp:
        return dist.ReduceOp.AVG if self._reduce_avg else dist.ReduceOp.SUM

    def _grad_divisor(self) -> float:
        return 1.0 if self._reduce_avg or self.world_size == 1 else float(self.world_size)

    def _global_grad_stats(self, scale: float) -> tuple[float, list[bool]]:
        """Global gradient norm (unscaled, averaged) and which parameters had a gradient
        on any rank, from one all-reduce of [Σ g², flags...]. Padding is zero, so
        summing whole shards sums the owned elements only."""
        stats = torch.zeros(1 + len(self._slots), dtype=torch.float32, device=self.device)
        for buf in self._buffers:
            stats[0] += torch.linalg.vector_norm(buf.grad_shard, dtype=torch.float32).square()
        stats[1:] = torch.tensor(self._had_grad, dtype=torch.float32)
        if self.world_size > 1:
            dist.all_reduce(stats, group=self.process_group)
        values = stats.tolist()  # the one host sync of a step
        grad_norm = math.sqrt(values[0]) / (self._grad_divisor() * scale)  # inf and nan pass through
        return grad_norm, [flag > 0 for flag in values[1:]]

    def _update_shards(self, *, grad_norm: float, scale: float, active: list[bool]) -> None:
        clip = 1.0
        if self.max_grad_norm is not None:
            clip = min(1.0, self.max_grad_norm / (grad_norm + _CLIP_EPS))
        # the kernel divides each gradient by this: sum -> mean, unscale, clip, in one pass
        grad_scale = torch.tensor(self._grad_divisor() * scale / clip, dtype=torch.float32, device=self.device)
        for buf in self._buffers:
            group = self.param_groups[buf.group_index]
            master = buf.state.get("master", buf.param_shard())
            # the fused kernel wants one dtype: a 16-bit shard is upcast a chunk at a time, so the
            # update's transient stays at 4 bytes x UPDATE_CHUNK_NUMEL however large the shard
            chunk = UPDATE_CHUNK_NUMEL if buf.grad_shard.dtype != torch.float32 else buf.shard_numel
            for lo, hi, step in self._runs(buf, active):
                step_t = torch.tensor(float(step), dtype=torch.float32, device=self.device)
                for a in range(lo, hi, chunk):
                    b = min(a + chunk, hi)
                    torch._fused_adamw_(
                        [master[a:b]], [buf.grad_shard[a:b].float()], [buf.state["exp_avg"][a:b]],
                        [buf.state["exp_avg_sq"][a:b]], [], [step_t],
                        lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1],
                        weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False, maximize=False,
                        grad_scale=grad_scale, found_inf=None,
                    )  # fmt: skip
            if "master" in buf.state:
                buf.param_shard().copy_(buf.state["master"])  # cast: fp32 shard -> model dtype

    def _runs(self, buf: _FlatBuffer, active: list[bool]) -> list[tuple[int, int, int]]:
        """(lo, hi, step) ranges of the shard to update, after counting this step.

        torch.optim.AdamW skips a parameter without a gradient and counts
        steps per parameter; so do we. In the common case (every parameter
        stepped, equal counts) this is one range over the whole shard.
        """
        stepped = [slot for slot in buf.slots if active[slot.index]]
        for slot in stepped:
            slot.step += 1
        if len(stepped) == len(buf.slots) and len({slot.step for slot in buf.slots}) == 1:
            return [(0, buf.shard_numel, buf.slots[0].step)] if buf.slots else []
        runs: list[tuple[int, int, int]] = []
        for slot, lo, hi in buf.local_segments():
            if not active[slot.index]:
                continue
            if runs and runs[-1][1] == lo and runs[-1][2] == slot.step:
                runs[-1] = (runs[-1][0], hi, slot.step)
            else:
                runs.append((lo, hi, slot.step))
        return runs

    def _gather_params(self) -> None:
        if self.world_size == 1:
            return
        for buf in self._buffers:
            shard = buf.param_shard()
            if self.gather_op == "all_gather":
                # all-gather: own shard (S,) -> flat params (N*S,) on every rank
                source = shard if self._reduce_avg else shard.clone()  # in place only on NCCL
                dist.all_gather_single(buf.params, source, group=self.process_group)
            else:
                # all-reduce of buffers that are zero outside each rank's shard: x + 0 is exact
                buf.params[: buf.start].zero_()
                buf.params[buf.start + buf.shard_numel :].zero_()
                dist.all_reduce(buf.params, group=self.process_group)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard (owned elements only, padding is never saved) and its layout."""
        return {
            "format": SHARDED_FORMAT,
            "world_size": self.world_size,
            "rank": self.rank,
            "alignment_numel": self.alignment_numel,
            "param_groups": self._hyperparameters(),
            "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
            "buffers": [
                {
                    "group": buf.group_index,
                    "dtype": str(buf.params.dtype),
                    "numel": buf.numel,
                    "shard_numel": buf.shard_numel,
                    "params": [
                        {"name": s.name, "offset": s.offset, "numel": s.numel, "shape": s.shape, "step": s.step}
                        for s in buf.slots
                    ],
                    **{kind: self._state(buf, kind)[: buf.owned_numel].clone() for kind in _STATE_KINDS},
                }
                for buf in self._buffers
            ],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a shard saved by state_dict() at the same world size and rank."""
        if state_dict.get("format") == CONSOLIDATED_FORMAT:
            return self.load_consolidated_state_dict(state_dict)
        if state_dict.get("format") != SHARDED_FORMAT:
            raise ValueError(f"not a zero1 optimizer checkpoint (format {state_dict.get('format')!r})")
        saved = (state_dict["world_size"], state_dict["rank"], state_dict["alignment_numel"])
        if saved != (self.world_size, self.rank, self.alignment_numel):
            raise ValueError(
                f"sharded checkpoint of rank {saved[1]} of {saved[0]} (alignment {saved[2]}) cannot load into "
                f"rank {self.rank} of {self.world_size} (alignment {self.alignment_numel}); "
                "load its consolidated form to change world size"
            )
        if len(state_dict["buffers"]) != len(self._buffers):
            raise ValueError(f"checkpoint has {len(state_dict['buffers'])} flat buffers, optimizer has {len(self._buffers)}")
        for buf, saved_buf in zip(self._buffers, state_dict["buffers"]):
            layout = [(s.name, s.offset, s.numel, s.shape) for s in buf.slots]
            saved_layout = [(p["name"], p["offset"], p["numel"], tuple(p["shape"])) for p in saved_buf["params"]]
            if layout != saved_layout:
                raise ValueError(f"parameter layout differs from the checkpoint's in group {buf.group_index}")
            for slot, saved_param in zip(buf.slots, saved_buf["params"]):
                slot.step = int(saved_param["step"])
            for kind in _STATE_KINDS:
                self._state(buf, kind)[: buf.owned_numel].copy_(saved_buf[kind])
        self._load_common(state_dict)

    def consolidated_state_dict(self, *, dst: int = 0, chunk_numel: int = 1 << 22) -> dict[str, Any] | None:
        """The world-size-independent form on rank `dst` (None elsewhere): per parameter,
        fp32 master, exp_avg, exp_avg_sq and step, gathered to CPU `chunk_numel`
        elements per rank at a time. Every rank must call it."""
        if chunk_numel < 1:
            raise ValueError(f"chunk_numel must be >= 1, got {chunk_numel}")
        keep = self.rank == dst
        full = {
            kind: [torch.empty(buf.numel, dtype=torch.float32) if keep else None for buf in self._buffers]
            for kind in _STATE_KINDS
        }
        for i, buf in enumerate(self._buffers):
            for kind in _STATE_KINDS:
                self._gather_to_cpu(buf, self._state(buf, kind), full[kind][i], chunk_numel=chunk_numel)
        if not keep:
            return None
        params = {
            slot.name: {
                **{
                    kind: full[kind][i][slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
                    for kind in _STATE_KINDS
                },
                "step": slot.step,
            }
            for i, buf in enumerate(self._buffers)
            for slot in buf.slots
        }
        groups = [{**group, "params": []} for group in self._hyperparameters()]
        for buf in self._buffers:
            groups[buf.group_index]["params"] += [slot.name for slot in buf.slots]
        return {
            "format": CONSOLIDATED_FORMAT,
            "param_groups": groups,
            "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
            "params": params,
        }

    def load_consolidated_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the consolidated form at any world size: each rank takes its slices."""
        if state_dict.get("format") != CONSOLIDATED_FORMAT:
            raise ValueError(f"not a consolidated zero1 checkpoint (format {state_dict.get('format')!r})")
        saved = state_dict["params"]
        missing = [s.name for s in self._slots if s.name not in saved]
        if missing:
            raise ValueError(f"checkpoint lacks parameters {missing[:5]} ({len(missing)} in all)")
        for buf in self._buffers:
            for slot, lo, hi in buf.local_segments():
                entry = saved[slot.name]
                if tuple(entry["master"].shape) != slot.shape:
                    raise ValueError(
                        f"{slot.name}: checkpoint shape {tuple(entry['master'].shape)} != parameter shape {slot.shape}"
                    )
                src = slice(buf.start + lo - slot.offset, buf.start + hi - slot.offset)
                for kind in _STATE_KINDS:
                    self._state(buf, kind)[lo:hi].copy_(entry[kind].reshape(-1)[src])
            for slot in buf.slots:
                slot.step = int(saved[slot.name]["step"])
        self._load_common(state_dict)

    def _load_common(self, state_dict: dict[str, Any]) -> None:
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"checkpoint has {len(groups)} param groups, optimizer has {len(self.param_groups)}")
        for group, saved in zip(self.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k not in ("params", "param_names")})
        if self.loss_scaler is not None and state_dict.get("loss_scaler"):
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        for buf in self._buffers:
            if "master" in buf.state:
                buf.param_shard().copy_(buf.state["master"])
        self._gather_params()

    def _state(self, buf: _FlatBuffer, kind: str) -> Tensor:
        return buf.param_shard() if kind == "master" and "master" not in buf.state else buf.state[kind]

    def _hyperparameters(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in self.param_groups]

    def _gather_to_cpu(self, buf: _FlatBuffer, shard: Tensor, out: Tensor | None, *, chunk_numel: int) -> None:
        """All ranks' (S,) shards -> out (numel,) on CPU, chunk by chunk; padding dropped.
        Ranks with out=None take part in the collectives and keep nothing."""
        size = buf.shard_numel
        for lo in range(0, size, chunk_numel):
            hi = min(lo + chunk_numel, size)
            piece = shard[lo:hi].float().contiguous()
            if self.world_size == 1:
                pieces = piece.view(1, -1)
            else:
                pieces = torch.empty(self.world_size * (hi - lo), dtype=torch.float32, device=piece.device)
                dist.all_gather_single(pieces, piece, group=self.process_group)
                pieces = pieces.view(self.world_size, hi - lo)
            if out is None:
                continue
            for rank in range(self.world_size):
                first = rank * size + lo
                last = min(rank * size + hi, buf.numel)
                if first < last:
                    out[first:last].copy_(pieces[rank, : last - first])


def _check_hyperparameters(*, lr, betas, eps, weight_decay) -> None:
    if not (isinstance(lr, Tensor) or lr >= 0):
        raise ValueError(f"lr must be >= 0, got {lr}")
    if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
        raise ValueError(f"betas must be in [0, 1), got {tuple(betas)}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")

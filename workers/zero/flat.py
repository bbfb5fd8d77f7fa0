"""The flat layout of ZeRO1AdamW: parameters and gradients in flat buffers, cut into equal shards.

For each (param group, dtype) the parameters and their gradients live in one
flat buffer of the model dtype, padded so that the N ranks own equal slices of
a multiple of SHARD_ALIGNMENT_NUMEL elements; each parameter (and its .grad) is
a view into it, so the collectives move whole buffers and no per-parameter
copies happen. Rank r allocates fp32 state for its slice only: 12 bytes per
owned element in mixed precision (the master copy plus Adam's two moments), 8
in fp32, where the parameter's slice is its own master copy. That is the memory
model's K·Ψ/N, byte for byte (workers/memory/model.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from workers.memory.model import padded_numel

STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")


@dataclass(kw_only=True, slots=True, eq=False)
class Slot:
    """One parameter inside a flat buffer."""

    name: str
    param: Tensor
    index: int  # position in the optimizer's flags vector
    offset: int  # first element in the flat buffer
    numel: int
    shape: tuple[int, ...]
    step: int = 0  # AdamW's step count, per parameter as in torch.optim.AdamW


@dataclass(kw_only=True, slots=True)
class FlatBuffer:
    """The parameters of one (group, dtype) and this rank's slice of their state."""

    group_index: int
    slots: list[Slot]
    numel: int
    shard_numel: int  # S: elements each rank owns, padding included
    rank: int
    params: Tensor  # (N*S,) model dtype; every parameter is a view into it
    grads: Tensor | None  # (N*S,) model dtype, every .grad a view into it; None at stage 2 (no full gradient)
    state: dict[str, Tensor]  # master / exp_avg / exp_avg_sq, each (S,) fp32
    grad_shard: Tensor | None = None  # (S,) this step's summed gradient slice; kept across steps at stage 2

    @property
    def start(self) -> int:
        return self.rank * self.shard_numel

    @property
    def owned_numel(self) -> int:
        """Elements of the shard that are real parameters, not padding."""
        return max(0, min(self.shard_numel, self.numel - self.start))

    def param_shard(self) -> Tensor:
        return self.params[self.start : self.start + self.shard_numel]

    def state_of(self, kind: str) -> Tensor:
        """The (S,) fp32 state of a kind; an fp32 model's master copy is its own parameter shard."""
        return self.param_shard() if kind == "master" and "master" not in self.state else self.state[kind]

    def local_segments(self) -> list[tuple[Slot, int, int]]:
        """(slot, lo, hi): the part of each parameter inside this shard, in shard coordinates."""
        out = []
        for slot in self.slots:
            lo = max(slot.offset, self.start) - self.start
            hi = min(slot.offset + slot.numel, self.start + self.shard_numel) - self.start
            if lo < hi:
                out.append((slot, lo, hi))
        return out


def build_buffers(
    param_groups: list[dict[str, Any]], *, world_size: int, rank: int, alignment_numel: int, full_grads: bool = True
) -> list[FlatBuffer]:
    """One flat buffer per (group, dtype) of the parameters that require a gradient, in group order;
    each parameter becomes a view into it. With full_grads each .grad is a view of a flat gradient
    buffer too (stage 1); without (stage 2) no parameter keeps a .grad and each rank holds only its
    (S,) gradient shard."""
    buffers = []
    index = 0
    for group_index, group in enumerate(param_groups):
        names = group.get("param_names") or [f"group{group_index}.{i}" for i in range(len(group["params"]))]
        by_dtype: dict[torch.dtype, list[tuple[str, Tensor]]] = {}
        for name, param in zip(names, group["params"], strict=True):
            if param.requires_grad:
                by_dtype.setdefault(param.dtype, []).append((name, param))
        for named in by_dtype.values():
            buffers.append(
                _flat_buffer(
                    group_index,
                    named,
                    first_index=index,
                    world_size=world_size,
                    rank=rank,
                    alignment_numel=alignment_numel,
                    full_grads=full_grads,
                )
            )
            index += len(named)
    devices = {slot.param.device for buf in buffers for slot in buf.slots}
    if len(devices) > 1:
        raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
    return buffers


def layout_slots(named: list[tuple[str, Tensor]], *, first_index: int) -> list[Slot]:
    """The parameters' places in one flat buffer, back to back in the order given (no memory moved)."""
    slots = []
    offset = 0
    for i, (name, param) in enumerate(named):
        slots.append(
            Slot(
                name=name,
                param=param,
                index=first_index + i,
                offset=offset,
                numel=param.numel(),
                shape=tuple(param.shape),
            )
        )
        offset += param.numel()
    return slots


def _flat_buffer(
    group_index: int,
    named: list[tuple[str, Tensor]],
    *,
    first_index: int,
    world_size: int,
    rank: int,
    alignment_numel: int,
    full_grads: bool,
) -> FlatBuffer:
    dtype = named[0][1].dtype
    device = named[0][1].device
    slots = layout_slots(named, first_index=first_index)
    offset = slots[-1].offset + slots[-1].numel
    total = padded_numel(offset, num_gpus=world_size, alignment_numel=alignment_numel)
    shard = total // world_size
    params = torch.zeros(total, dtype=dtype, device=device)
    grads = torch.zeros(total, dtype=dtype, device=device) if full_grads else None
    for slot in slots:
        view = slice(slot.offset, slot.offset + slot.numel)
        params[view].copy_(slot.param.detach().reshape(-1))
        if grads is not None and slot.param.grad is not None:
            grads[view].copy_(slot.param.grad.reshape(-1))
        slot.param.data = params[view].view(slot.shape)
        slot.param.grad = None if grads is None else grads[view].view(slot.shape)
    buf = FlatBuffer(
        group_index=group_index,
        slots=slots,
        numel=offset,
        shard_numel=shard,
        rank=rank,
        params=params,
        grads=grads,
        state={},
        grad_shard=None if full_grads else torch.zeros(shard, dtype=dtype, device=device),
    )
    mixed = dtype != torch.float32
    if mixed:  # an fp32 model's own shard is its master copy
        buf.state["master"] = buf.param_shard().float()
    buf.state["exp_avg"] = torch.zeros(shard, dtype=torch.float32, device=device)
    buf.state["exp_avg_sq"] = torch.zeros(shard, dtype=torch.float32, device=device)
    return buf


def shard_slices(buf: FlatBuffer, *, bucket_cap_mb: float) -> list[tuple[int, int]]:
    """The shard in slices (shard coordinates), the same on every rank: about eight, each
    at most a bucket. The update runs slice by slice whether or not the gather overlaps it:
    the fused kernel's results depend (in the last bit) on where a call starts, so both
    modes cut the shard at the same places."""
    size = buf.shard_numel
    cap = max(1, int(bucket_cap_mb * 2**20) // buf.params.element_size())
    step = max(min(cap, -(-size // 8)), min(cap, 1 << 16))  # no slice below 64 Ki elements unless the cap is
    return [(lo, min(lo + step, size)) for lo in range(0, size, step)]


def gradient_tensor(buf: FlatBuffer) -> Tensor:
    """The gradient memory a buffer keeps between steps: the full flat buffer (stage 1) or the shard (stage 2)."""
    if buf.grads is not None:
        return buf.grads
    assert buf.grad_shard is not None, "a stage-2 buffer keeps its gradient shard"
    return buf.grad_shard


def allocated_bytes(buffers: list[FlatBuffer]) -> int:
    """Bytes of the flat parameter buffers, the gradients kept (full or the shard) and this rank's
    shard of the state."""
    return sum(
        t.numel() * t.element_size() for buf in buffers for t in (buf.params, gradient_tensor(buf), *buf.state.values())
    )


def state_bytes(buffers: list[FlatBuffer]) -> dict[str, int]:
    """This rank's state bytes by kind; `padding` is every allocated byte that holds no parameter."""
    out = dict.fromkeys((*STATE_KINDS, "padding"), 0)
    for buf in buffers:
        for kind, tensor in buf.state.items():
            used = buf.owned_numel * tensor.element_size()
            out[kind] += used
            out["padding"] += tensor.numel() * tensor.element_size() - used
        grads = gradient_tensor(buf)
        out["padding"] += (buf.params.numel() - buf.numel) * buf.params.element_size()
        out["padding"] += (grads.numel() - (buf.numel if buf.grads is not None else buf.owned_numel)) * (
            grads.element_size()
        )
    return out

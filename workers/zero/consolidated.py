"""ZeRO1AdamW's consolidated form: the whole fp32 state per parameter name, gathered to one rank
(it loads at any world size), and the fp32 master weights gathered one parameter at a time (the
final model, workers/training/artifacts.py). The sharded form and the optimizer's checkpoint
methods are in workers/zero/sharded_state.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from workers.zero.comm import GroupComm, LocalComm
from workers.zero.flat import STATE_KINDS, FlatBuffer, Slot

CONSOLIDATED_FORMAT = "zero1.consolidated.v1"


def hyperparameters(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The param groups without their tensors: lr, betas, eps, weight_decay and whatever a scheduler added."""
    return [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in param_groups]


def consolidated_state(
    buffers: list[FlatBuffer],
    comm: LocalComm | GroupComm,
    *,
    keep: bool,
    chunk_numel: int,
    param_groups: list[dict[str, Any]],
    loss_scaler: dict[str, float | int] | None,
) -> dict[str, Any] | None:
    """The world-size-independent form where `keep` (None elsewhere): per parameter, fp32
    master, exp_avg, exp_avg_sq and step, gathered to CPU `chunk_numel` elements per rank
    at a time. Every rank must call it."""
    full = {
        kind: [torch.empty(buf.numel, dtype=torch.float32) if keep else None for buf in buffers] for kind in STATE_KINDS
    }
    for i, buf in enumerate(buffers):
        for kind in STATE_KINDS:
            _gather_to_cpu(buf, buf.state_of(kind), full[kind][i], comm, chunk_numel=chunk_numel)
    if not keep:
        return None
    params = {
        slot.name: {
            **{
                kind: full[kind][i][slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
                for kind in STATE_KINDS
            },
            "step": slot.step,
        }
        for i, buf in enumerate(buffers)
        for slot in buf.slots
    }
    groups = [{**group, "params": []} for group in hyperparameters(param_groups)]
    for buf in buffers:
        groups[buf.group_index]["params"] += [slot.name for slot in buf.slots]
    return {"format": CONSOLIDATED_FORMAT, "param_groups": groups, "loss_scaler": loss_scaler, "params": params}


def gather_master(
    buffers: list[FlatBuffer],
    *,
    process_group: dist.ProcessGroup | None,
    world_size: int,
    rank: int,
    dst: int,
    chunk_numel: int,
) -> Iterator[tuple[Slot, Tensor | None]]:
    """Each parameter's fp32 master weights, on CPU at rank `dst` (None elsewhere), one parameter
    at a time: the ranks owning pieces of it send them to dst point-to-point, at most chunk_numel
    elements a message. No rank holds more than its own shard and one parameter beyond it; every
    rank must run the iterator to its end, in step (the layout, the same on every rank, says who
    sends what)."""
    for buf in buffers:
        master = buf.state_of("master")
        size = buf.shard_numel
        for slot in buf.slots:
            out = torch.empty(slot.numel, dtype=torch.float32) if rank == dst else None
            for owner in range(world_size):
                # the part of the parameter inside owner's shard, in flat-buffer coordinates
                lo = max(slot.offset, owner * size)
                hi = min(slot.offset + slot.numel, (owner + 1) * size)
                for a in range(lo, hi, chunk_numel):
                    b = min(a + chunk_numel, hi)
                    piece = slice(a - owner * size, b - owner * size)
                    into = slice(a - slot.offset, b - slot.offset)
                    if owner == rank == dst:
                        out[into].copy_(master[piece])
                    elif owner == rank:
                        dist.send(master[piece].float(), group=process_group, group_dst=dst)
                    elif rank == dst:
                        received = torch.empty(b - a, dtype=torch.float32, device=master.device)
                        dist.recv(received, group=process_group, group_src=owner)
                        out[into].copy_(received)
            yield slot, None if out is None else out.view(slot.shape)


def load_consolidated_state(buffers: list[FlatBuffer], slots: list[Slot], state_dict: dict[str, Any]) -> None:
    """Steps and this rank's slices of the state from the consolidated form, at any world size."""
    if state_dict.get("format") != CONSOLIDATED_FORMAT:
        raise ValueError(f"not a consolidated zero1 checkpoint (format {state_dict.get('format')!r})")
    saved = state_dict["params"]
    missing = [s.name for s in slots if s.name not in saved]
    if missing:
        raise ValueError(f"checkpoint lacks parameters {missing[:5]} ({len(missing)} in all)")
    for buf in buffers:
        for slot, lo, hi in buf.local_segments():
            entry = saved[slot.name]
            if tuple(entry["master"].shape) != slot.shape:
                raise ValueError(
                    f"{slot.name}: checkpoint shape {tuple(entry['master'].shape)} != parameter shape {slot.shape}"
                )
            src = slice(buf.start + lo - slot.offset, buf.start + hi - slot.offset)
            for kind in STATE_KINDS:
                buf.state_of(kind)[lo:hi].copy_(entry[kind].reshape(-1)[src])
        for slot in buf.slots:
            slot.step = int(saved[slot.name]["step"])


def _gather_to_cpu(
    buf: FlatBuffer, shard: Tensor, out: Tensor | None, comm: LocalComm | GroupComm, *, chunk_numel: int
) -> None:
    """All ranks' (S,) shards -> out (numel,) on CPU, chunk by chunk; padding dropped.
    Ranks with out=None take part in the collectives and keep nothing."""
    size = buf.shard_numel
    for lo in range(0, size, chunk_numel):
        hi = min(lo + chunk_numel, size)
        pieces = comm.all_gather(shard[lo:hi].float().contiguous())  # (N, hi - lo)
        if out is None:
            continue
        for rank in range(pieces.shape[0]):
            first = rank * size + lo
            last = min(rank * size + hi, buf.numel)
            if first < last:
                out[first:last].copy_(pieces[rank, : last - first])

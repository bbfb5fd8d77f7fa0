"""ZeRO1AdamW's checkpoint formats: its fp32 state to and from dictionaries that torch.save writes.

Two formats. The sharded one (SHARDED_FORMAT) is one rank's shard, owned
elements only, with the layout it was cut from: one shard loads at the same
world size, rank and alignment; all of a checkpoint's shards load at any world
size (load_resharded_state, elastic jobs). The consolidated one (CONSOLIDATED_FORMAT) is the
whole state per parameter name, gathered to one rank: it loads at any world
size. Each rank's state lives in the flat buffers of workers/zero/flat.py; the
gathers go through workers/zero/comm.py, so one rank needs no process group.
ZeRO1AdamW takes its checkpoint methods (state_dict() and the rest) from
CheckpointMethods, at the end.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from workers.zero.comm import GroupComm, LocalComm
from workers.zero.flat import STATE_KINDS, FlatBuffer, Slot

if TYPE_CHECKING:
    from workers.zero.loss_scale import DynamicLossScaler

SHARDED_FORMAT = "zero1.sharded.v1"
CONSOLIDATED_FORMAT = "zero1.consolidated.v1"


def hyperparameters(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The param groups without their tensors: lr, betas, eps, weight_decay and whatever a scheduler added."""
    return [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in param_groups]


def sharded_state_dict(
    buffers: list[FlatBuffer],
    *,
    world_size: int,
    rank: int,
    alignment_numel: int,
    param_groups: list[dict[str, Any]],
    loss_scaler: dict[str, float | int] | None,
) -> dict[str, Any]:
    """This rank's shard (owned elements only, padding is never saved) and its layout."""
    return {
        "format": SHARDED_FORMAT,
        "world_size": world_size,
        "rank": rank,
        "alignment_numel": alignment_numel,
        "param_groups": hyperparameters(param_groups),
        "loss_scaler": loss_scaler,
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
                **{kind: buf.state_of(kind)[: buf.owned_numel].clone() for kind in STATE_KINDS},
            }
            for buf in buffers
        ],
    }


def load_sharded_state(
    buffers: list[FlatBuffer], state_dict: dict[str, Any], *, world_size: int, rank: int, alignment_numel: int
) -> None:
    """Steps and state of a shard saved by sharded_state_dict() at the same world size and rank."""
    if state_dict.get("format") != SHARDED_FORMAT:
        raise ValueError(f"not a zero1 optimizer checkpoint (format {state_dict.get('format')!r})")
    saved = (state_dict["world_size"], state_dict["rank"], state_dict["alignment_numel"])
    if saved != (world_size, rank, alignment_numel):
        raise ValueError(
            f"sharded checkpoint of rank {saved[1]} of {saved[0]} (alignment {saved[2]}) cannot load into "
            f"rank {rank} of {world_size} (alignment {alignment_numel}); "
            "load every shard with load_resharded_state_dicts() to change world size"
        )
    if len(state_dict["buffers"]) != len(buffers):
        raise ValueError(f"checkpoint has {len(state_dict['buffers'])} flat buffers, optimizer has {len(buffers)}")
    for buf, saved_buf in zip(buffers, state_dict["buffers"], strict=True):
        _check_layout(buf, saved_buf)
        for slot, saved_param in zip(buf.slots, saved_buf["params"], strict=True):
            slot.step = int(saved_param["step"])
        for kind in STATE_KINDS:
            buf.state_of(kind)[: buf.owned_numel].copy_(saved_buf[kind])


def load_resharded_state(buffers: list[FlatBuffer], shards: list[dict[str, Any]]) -> None:
    """Steps and this rank's slices of the state from every shard of a sharded checkpoint saved at
    another world size (or the same): elastic resizing, with no consolidation step.

    The flat layout does not depend on the world size, only the cut does: saved rank r' of N' holds
    [r'·S', r'·S' + owned') of each buffer, and this rank copies the part of each that falls in its
    own range straight into its state. Shards loaded with torch.load(mmap=True) are file pages
    read where they are touched, so a rank reads the bytes it now owns (and each shard's small
    header), never the whole state, and holds nothing beyond its own shard while it loads."""
    world_size = len(shards)
    formats = {shard.get("format") for shard in shards}
    if formats != {SHARDED_FORMAT}:
        raise ValueError(f"not zero1 optimizer checkpoints (formats {sorted(map(repr, formats))})")
    ranks = [shard["rank"] for shard in shards]
    if ranks != list(range(world_size)) or {shard["world_size"] for shard in shards} != {world_size}:
        raise ValueError(
            f"need every shard of one checkpoint in rank order: got ranks {ranks} of world sizes "
            f"{sorted({shard['world_size'] for shard in shards})}"
        )
    first = shards[0]
    if len(first["buffers"]) != len(buffers):
        raise ValueError(f"checkpoint has {len(first['buffers'])} flat buffers, optimizer has {len(buffers)}")
    for i, buf in enumerate(buffers):
        _check_layout(buf, first["buffers"][i])
        own_lo, own_hi = buf.start, buf.start + buf.owned_numel
        copied = 0
        for shard in shards:
            saved = shard["buffers"][i]
            saved_lo = shard["rank"] * saved["shard_numel"]
            lo, hi = max(own_lo, saved_lo), min(own_hi, saved_lo + saved["master"].numel())
            if lo >= hi:
                continue
            for kind in STATE_KINDS:
                buf.state_of(kind)[lo - buf.start : hi - buf.start].copy_(saved[kind][lo - saved_lo : hi - saved_lo])
            copied += hi - lo
        if copied != buf.owned_numel:
            raise ValueError(
                f"the {world_size} shards hold {copied} of the {buf.owned_numel} elements this rank owns "
                f"in group {buf.group_index}"
            )
        for slot, saved_param in zip(buf.slots, first["buffers"][i]["params"], strict=True):
            slot.step = int(saved_param["step"])


def _check_layout(buf: FlatBuffer, saved: dict[str, Any]) -> None:
    layout = [(s.name, s.offset, s.numel, s.shape) for s in buf.slots]
    saved_layout = [(p["name"], p["offset"], p["numel"], tuple(p["shape"])) for p in saved["params"]]
    if layout != saved_layout:
        raise ValueError(f"parameter layout differs from the checkpoint's in group {buf.group_index}")


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
        master, size = buf.state_of("master"), buf.shard_numel
        for slot in buf.slots:
            out = torch.empty(slot.numel, dtype=torch.float32) if rank == dst else None
            for owner in range(world_size):
                # the part of the parameter inside owner's shard, in flat-buffer coordinates
                lo, hi = max(slot.offset, owner * size), min(slot.offset + slot.numel, (owner + 1) * size)
                for a in range(lo, hi, chunk_numel):
                    b = min(a + chunk_numel, hi)
                    piece, into = slice(a - owner * size, b - owner * size), slice(a - slot.offset, b - slot.offset)
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


def load_hyperparameters(param_groups: list[dict[str, Any]], state_dict: dict[str, Any]) -> None:
    """The saved hyperparameters into the param groups (either format)."""
    groups = state_dict["param_groups"]
    if len(groups) != len(param_groups):
        raise ValueError(f"checkpoint has {len(groups)} param groups, optimizer has {len(param_groups)}")
    for group, saved in zip(param_groups, groups, strict=True):
        group.update({k: v for k, v in saved.items() if k not in ("params", "param_names")})


def nonfinite_numel(buffers: list[FlatBuffer], comm: LocalComm | GroupComm, *, device: torch.device) -> dict[str, int]:
    """nan or inf elements of the fp32 state by kind over all ranks, from one all-reduce of three counts."""
    counts = torch.zeros(len(STATE_KINDS), dtype=torch.int64, device=device)
    for buf in buffers:
        for i, kind in enumerate(STATE_KINDS):
            counts[i] += torch.isfinite(buf.state_of(kind)).logical_not().sum()
    comm.all_reduce(counts)
    return dict(zip(STATE_KINDS, counts.tolist(), strict=True))


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


class CheckpointMethods:
    """ZeRO1AdamW's checkpoint methods (a base class of it): the formats above, applied to the
    flat buffers, communication, layout and loss scaler that its constructor sets up."""

    _buffers: list[FlatBuffer]
    _slots: list[Slot]
    _comm: LocalComm | GroupComm
    device: torch.device
    process_group: dist.ProcessGroup | None
    world_size: int
    rank: int
    alignment_numel: int
    param_groups: list[dict[str, Any]]
    loss_scaler: DynamicLossScaler | None

    def nonfinite_state_numel(self) -> dict[str, int]:
        """nan or inf elements of the fp32 state (master, exp_avg, exp_avg_sq) over all ranks, by
        kind: one all-reduce of three counts, so every rank gets the same answer. Every rank must
        call it. A full pass over the shard: once per checkpoint, not per step."""
        return nonfinite_numel(self._buffers, self._comm, device=self.device)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard (owned elements only, padding is never saved) and its layout."""
        return sharded_state_dict(
            self._buffers,
            world_size=self.world_size,
            rank=self.rank,
            alignment_numel=self.alignment_numel,
            param_groups=self.param_groups,
            loss_scaler=self._loss_scaler_state(),
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a shard saved by state_dict() at the same world size and rank, or the consolidated form."""
        if state_dict.get("format") == CONSOLIDATED_FORMAT:
            return self.load_consolidated_state_dict(state_dict)
        load_sharded_state(
            self._buffers, state_dict, world_size=self.world_size, rank=self.rank, alignment_numel=self.alignment_numel
        )
        self._load_common(state_dict)

    def load_resharded_state_dicts(self, shards: list[dict[str, Any]]) -> None:
        """Load this rank's part of a sharded checkpoint saved at any world size: every rank's
        state dict, in rank order (torch.load(mmap=True): only the owned bytes are read)."""
        load_resharded_state(self._buffers, shards)
        self._load_common(shards[0])

    def consolidated_state_dict(self, *, dst: int = 0, chunk_numel: int = 1 << 22) -> dict[str, Any] | None:
        """The world-size-independent form on rank `dst` (None elsewhere): per parameter,
        fp32 master, exp_avg, exp_avg_sq and step, gathered to CPU `chunk_numel`
        elements per rank at a time. Every rank must call it."""
        if chunk_numel < 1:
            raise ValueError(f"chunk_numel must be >= 1, got {chunk_numel}")
        return consolidated_state(
            self._buffers,
            self._comm,
            keep=self.rank == dst,
            chunk_numel=chunk_numel,
            param_groups=self.param_groups,
            loss_scaler=self._loss_scaler_state(),
        )

    def gather_master_weights(
        self, *, dst: int = 0, chunk_numel: int = 1 << 22
    ) -> Iterator[tuple[Tensor, Tensor | None]]:
        """(parameter, its fp32 master weights on CPU at rank `dst`, None elsewhere), one parameter
        at a time, sent point-to-point `chunk_numel` elements at most a message: no rank holds the
        full fp32 state (nor the full weights, unless dst keeps them). Every rank must iterate to the end."""
        if chunk_numel < 1:
            raise ValueError(f"chunk_numel must be >= 1, got {chunk_numel}")
        gathered = gather_master(
            self._buffers,
            process_group=self.process_group,
            world_size=self.world_size,
            rank=self.rank,
            dst=dst,
            chunk_numel=chunk_numel,
        )
        return ((slot.param, master) for slot, master in gathered)

    def load_consolidated_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the consolidated form at any world size: each rank takes its slices."""
        load_consolidated_state(self._buffers, self._slots, state_dict)
        self._load_common(state_dict)

    def _load_common(self, state_dict: dict[str, Any]) -> None:
        load_hyperparameters(self.param_groups, state_dict)
        if self.loss_scaler is not None and state_dict.get("loss_scaler"):
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        for buf in self._buffers:
            if "master" in buf.state:
                buf.param_shard().copy_(buf.state["master"])  # cast: fp32 shard -> model dtype
        self._comm.gather_params()

    def _loss_scaler_state(self) -> dict[str, float | int] | None:
        return None if self.loss_scaler is None else self.loss_scaler.state_dict()

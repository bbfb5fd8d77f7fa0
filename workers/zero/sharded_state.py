"""ZeRO1AdamW's checkpoint formats and the methods that read and write them.

The sharded format (SHARDED_FORMAT) is one rank's shard: its owned elements only, as 1-D fp32
tensors named by tensor_name (owned_state), and the layout they were cut from with the steps and
hyperparameters as plain values (shard_layout), which a checkpoint file keeps as JSON
(workers/training/writer.py). One shard loads at the same world size, rank and alignment
(load_sharded_state); a checkpoint's shards load at any world size (load_resharded_state, elastic
jobs), each rank reading only the runs it now owns (owned_pieces). The loaders take a read callback
rather than whole shards, so a caller reads those byte ranges of the files and nothing else. The
consolidated format is in workers/zero/consolidated.py. Each rank's state lives in the flat buffers
of workers/zero/flat.py. ZeRO1AdamW takes its checkpoint methods (state_dict() and the rest) from
CheckpointMethods, at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from workers.zero.comm import GroupComm, LocalComm
from workers.zero.consolidated import (
    CONSOLIDATED_FORMAT,
    consolidated_state,
    gather_master,
    hyperparameters,
    load_consolidated_state,
)
from workers.zero.flat import STATE_KINDS, FlatBuffer, Slot

if TYPE_CHECKING:
    from workers.zero.loss_scale import DynamicLossScaler

SHARDED_FORMAT = "zero1.sharded.v1"
_TENSORS = ("params", "param_names")


def tensor_name(buffer: int, kind: str) -> str:
    """A sharded checkpoint file's name of flat buffer `buffer`'s owned `kind` state (1-D fp32)."""
    return f"buffers.{buffer}.{kind}"


def shard_layout(
    buffers: list[FlatBuffer],
    *,
    world_size: int,
    rank: int,
    alignment_numel: int,
    param_groups: list[dict[str, Any]],
    loss_scaler: dict[str, float | int] | None,
) -> dict[str, Any]:
    """This rank's shard without its tensors: the layout it was cut from, the steps and the
    hyperparameters (plain values: a checkpoint file keeps them as JSON)."""
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
            }
            for buf in buffers
        ],
    }


def owned_state(buffers: list[FlatBuffer]) -> dict[str, Tensor]:
    """This rank's owned state (padding is never saved) by tensor_name: views, (owned,) fp32 each."""
    return {
        tensor_name(i, kind): buf.state_of(kind)[: buf.owned_numel]
        for i, buf in enumerate(buffers)
        for kind in STATE_KINDS
    }


def sharded_state_dict(buffers: list[FlatBuffer], **layout: Any) -> dict[str, Any]:
    """This rank's shard (owned elements only) and its layout, as one dictionary for torch.save."""
    state = shard_layout(buffers, **layout)
    for buf, entry in zip(buffers, state["buffers"], strict=True):
        entry.update({kind: buf.state_of(kind)[: buf.owned_numel].clone() for kind in STATE_KINDS})
    return state


def load_sharded_state(
    buffers: list[FlatBuffer],
    layout: dict[str, Any],
    read: Callable[[int, str], Tensor],
    *,
    world_size: int,
    rank: int,
    alignment_numel: int,
) -> None:
    """Steps and state of a shard saved at the same world size and rank: its layout (shard_layout's
    keys), and read(buffer, kind) -> that buffer's saved (owned,) state of that kind."""
    if layout.get("format") != SHARDED_FORMAT:
        raise ValueError(f"not a zero1 optimizer checkpoint (format {layout.get('format')!r})")
    saved = (layout["world_size"], layout["rank"], layout["alignment_numel"])
    if saved != (world_size, rank, alignment_numel):
        raise ValueError(
            f"sharded checkpoint of rank {saved[1]} of {saved[0]} (alignment {saved[2]}) cannot load into "
            f"rank {rank} of {world_size} (alignment {alignment_numel}); "
            "load every shard with load_resharded_state() to change world size"
        )
    if len(layout["buffers"]) != len(buffers):
        raise ValueError(f"checkpoint has {len(layout['buffers'])} flat buffers, optimizer has {len(buffers)}")
    for i, (buf, saved_buf) in enumerate(zip(buffers, layout["buffers"], strict=True)):
        _check_layout(buf, saved_buf)
        for slot, saved_param in zip(buf.slots, saved_buf["params"], strict=True):
            slot.step = int(saved_param["step"])
        for kind in STATE_KINDS:
            buf.state_of(kind)[: buf.owned_numel].copy_(read(i, kind))


@dataclass(frozen=True, slots=True)
class Piece:
    """A run of elements this rank owns, as a saved shard holds it: elements [start, stop) of
    saved rank `shard`'s tensors of flat buffer `buffer`, which land at `into` in this rank's (S,) state."""

    shard: int
    buffer: int
    start: int
    stop: int
    into: int


def owned_pieces(buffers: list[FlatBuffer], layouts: list[dict[str, Any]]) -> list[Piece]:
    """What this rank reads of a sharded checkpoint saved at another world size (or the same),
    from the layouts of all its shards in rank order (shard_layout's keys).

    The flat layout does not depend on the world size, only the cut does: saved rank r' of N' holds
    [r'·S', r'·S' + owned') of each buffer, and this rank needs the part of each that falls in its
    own range [r·S, r·S + owned)."""
    world_size = len(layouts)
    formats = {layout.get("format") for layout in layouts}
    if formats != {SHARDED_FORMAT}:
        raise ValueError(f"not zero1 optimizer checkpoints (formats {sorted(map(repr, formats))})")
    ranks = [layout["rank"] for layout in layouts]
    if ranks != list(range(world_size)) or {layout["world_size"] for layout in layouts} != {world_size}:
        raise ValueError(
            f"need every shard of one checkpoint in rank order: got ranks {ranks} of world sizes "
            f"{sorted({layout['world_size'] for layout in layouts})}"
        )
    first = layouts[0]
    if len(first["buffers"]) != len(buffers):
        raise ValueError(f"checkpoint has {len(first['buffers'])} flat buffers, optimizer has {len(buffers)}")
    pieces = []
    for i, buf in enumerate(buffers):
        _check_layout(buf, first["buffers"][i])
        own_lo = buf.start
        own_hi = buf.start + buf.owned_numel
        copied = 0
        for layout in layouts:
            saved = layout["buffers"][i]
            saved_lo = layout["rank"] * saved["shard_numel"]
            saved_hi = min(saved_lo + saved["shard_numel"], saved["numel"])  # padding is never saved
            lo = max(own_lo, saved_lo)
            hi = min(own_hi, saved_hi)
            if lo < hi:
                pieces.append(Piece(layout["rank"], i, lo - saved_lo, hi - saved_lo, lo - buf.start))
                copied += hi - lo
        if copied != buf.owned_numel:
            raise ValueError(
                f"the {world_size} shards hold {copied} of the {buf.owned_numel} elements this rank owns "
                f"in group {buf.group_index}"
            )
    return pieces


def load_resharded_state(
    buffers: list[FlatBuffer], layouts: list[dict[str, Any]], read: Callable[[Piece, str], Tensor]
) -> None:
    """Steps and this rank's slices of the state from every shard of a sharded checkpoint saved at
    another world size (or the same): elastic resizing, with no consolidation step. layouts: every
    shard's, in rank order; read(piece, kind) -> the piece's (stop - start,) elements of that kind
    (owned_pieces says which; a caller reads those byte ranges of the files and nothing else)."""
    for piece in owned_pieces(buffers, layouts):
        buf = buffers[piece.buffer]
        for kind in STATE_KINDS:
            buf.state_of(kind)[piece.into : piece.into + piece.stop - piece.start].copy_(read(piece, kind))
    for buf, saved in zip(buffers, layouts[0]["buffers"], strict=True):
        for slot, saved_param in zip(buf.slots, saved["params"], strict=True):
            slot.step = int(saved_param["step"])


def _check_layout(buf: FlatBuffer, saved: dict[str, Any]) -> None:
    layout = [(s.name, s.offset, s.numel, s.shape) for s in buf.slots]
    saved_layout = [(p["name"], p["offset"], p["numel"], tuple(p["shape"])) for p in saved["params"]]
    if layout != saved_layout:
        raise ValueError(f"parameter layout differs from the checkpoint's in group {buf.group_index}")


def load_hyperparameters(param_groups: list[dict[str, Any]], state_dict: dict[str, Any]) -> None:
    """The saved hyperparameters into the param groups (either format)."""
    groups = state_dict["param_groups"]
    if len(groups) != len(param_groups):
        raise ValueError(f"checkpoint has {len(groups)} param groups, optimizer has {len(param_groups)}")
    for group, saved in zip(param_groups, groups, strict=True):
        # a file's JSON has lists where the optimizer had tuples (betas): back to the optimizer's shapes
        group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k not in _TENSORS})


def nonfinite_numel(buffers: list[FlatBuffer], comm: LocalComm | GroupComm, *, device: torch.device) -> dict[str, int]:
    """nan or inf elements of the fp32 state by kind over all ranks, from one all-reduce of three counts."""
    counts = torch.zeros(len(STATE_KINDS), dtype=torch.int64, device=device)
    states = [(i, buf.state_of(kind)) for buf in buffers for i, kind in enumerate(STATE_KINDS)]
    # a sum is finite when every element is (or it overflowed): one cheap pass each and one host sync
    # for all; only a state whose sum is not finite is counted element by element (many times slower)
    sums = torch.stack([state.sum() for _, state in states]) if states else torch.zeros(0, device=device)
    for (i, state), finite in zip(states, torch.isfinite(sums).tolist(), strict=True):
        if not finite:
            counts[i] += torch.isfinite(state).logical_not().sum()
    comm.all_reduce(counts)
    return dict(zip(STATE_KINDS, counts.tolist(), strict=True))


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

    def _layout_args(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "rank": self.rank,
            "alignment_numel": self.alignment_numel,
            "param_groups": self.param_groups,
            "loss_scaler": self._loss_scaler_state(),
        }

    def shard_layout(self) -> dict[str, Any]:
        """This rank's shard's layout, steps and hyperparameters: state_dict() without its tensors."""
        return shard_layout(self._buffers, **self._layout_args())

    def owned_state(self) -> dict[str, Tensor]:
        """This rank's owned fp32 state by tensor name (buffers.{i}.{kind}): views, not copies."""
        return owned_state(self._buffers)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard (owned elements only, padding is never saved) and its layout."""
        return sharded_state_dict(self._buffers, **self._layout_args())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a shard saved by state_dict() at the same world size and rank, or the consolidated form."""
        if state_dict.get("format") == CONSOLIDATED_FORMAT:
            return self.load_consolidated_state_dict(state_dict)
        self.load_shard(state_dict, lambda buffer, kind: state_dict["buffers"][buffer][kind])

    def load_shard(self, layout: dict[str, Any], read: Callable[[int, str], Tensor]) -> None:
        """Load this rank's shard saved at the same world size: its layout, and read(buffer, kind)."""
        load_sharded_state(
            self._buffers,
            layout,
            read,
            world_size=self.world_size,
            rank=self.rank,
            alignment_numel=self.alignment_numel,
        )
        self._load_common(layout)

    def resharded_pieces(self, layouts: list[dict[str, Any]]) -> list[Piece]:
        """What this rank reads of a checkpoint saved at any world size (every shard's layout, in rank order)."""
        return owned_pieces(self._buffers, layouts)

    def load_resharded(self, layouts: list[dict[str, Any]], read: Callable[[Piece, str], Tensor]) -> None:
        """Load this rank's part of a sharded checkpoint saved at any world size: every shard's layout,
        in rank order, and read(piece, kind) for each of resharded_pieces(layouts)."""
        load_resharded_state(self._buffers, layouts, read)
        self._load_common(layouts[0])

    def load_resharded_state_dicts(self, shards: list[dict[str, Any]]) -> None:
        """load_resharded() from every rank's state_dict() (torch.load(mmap=True): only the owned bytes are read)."""
        self.load_resharded(shards, lambda p, kind: shards[p.shard]["buffers"][p.buffer][kind][p.start : p.stop])

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

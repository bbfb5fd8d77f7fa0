"""ZeRO stage 3's checkpoints in stage 1's format: one format across stages.

A stage-3 rank holds dim-0 shards of each parameter (FSDP2's DTensors); a checkpoint holds stage 1's
flat layout (workers/zero/flat.py: one buffer a parameter group, padded into N equal aligned shards).
Writing, a rank gathers each parameter and keeps its owned range of the flat layout, with its fp32
master, exp_avg and exp_avg_sq; reading, it takes each parameter's rows of its dim-0 shard from the
flat layout written at any N, or from a consolidated checkpoint. So a job resumes at another stage
and another N (workers/zero/sharded_state.py reads and writes the files).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from workers.memory.model import padded_numel
from workers.zero.consolidated import CONSOLIDATED_FORMAT, hyperparameters, load_consolidated_state
from workers.zero.flat import STATE_KINDS, FlatBuffer, layout_slots
from workers.zero.loss_scale import DynamicLossScaler
from workers.zero.sharded_state import (
    Piece,
    load_hyperparameters,
    load_resharded_state,
    load_sharded_state,
    owned_pieces,
    owned_state,
    shard_layout,
    tensor_name,
)


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def layout_buffers(
    param_groups: list[dict[str, Any]], *, world_size: int, rank: int, alignment_numel: int, with_state: bool
) -> list[FlatBuffer]:
    """Stage 1's flat layout of these param groups (workers/zero/flat.py: one buffer a group, the
    parameters in group order, padded into N equal aligned shards) with no parameter memory: what a
    stage-3 rank writes and reads of a checkpoint. with_state: each buffer's (S,) fp32 master,
    exp_avg and exp_avg_sq, zeroed, for this rank's owned range."""
    buffers = []
    index = 0
    for group_index, group in enumerate(param_groups):
        names = group.get("param_names") or [f"group{group_index}.{i}" for i in range(len(group["params"]))]
        named = [(name, p) for name, p in zip(names, group["params"], strict=True) if p.requires_grad]
        if not named:
            continue
        slots = layout_slots(named, first_index=index)
        offset = slots[-1].offset + slots[-1].numel
        index += len(named)
        shard = padded_numel(offset, num_gpus=world_size, alignment_numel=alignment_numel) // world_size
        device = _local(named[0][1]).device
        state = {
            kind: torch.zeros(shard if with_state else 0, dtype=torch.float32, device=device) for kind in STATE_KINDS
        }
        buffers.append(
            FlatBuffer(
                group_index=group_index,
                slots=slots,
                numel=offset,
                shard_numel=shard,
                rank=rank,
                params=torch.empty(0, dtype=torch.float32, device=device),
                grads=None,
                state=state,
            )
        )
    return buffers


def _dim0_rows(rows: int, *, world_size: int, rank: int) -> tuple[int, int]:
    """The rows [lo, hi) of a parameter that FSDP2's Shard(0) gives `rank`: chunks of ⌈rows/N⌉, the
    last ones short or empty."""
    chunk = -(-rows // world_size) if rows else 0
    lo = min(rank * chunk, rows)
    return lo, min(lo + chunk, rows)


class Stage3Checkpoints:
    """ZeRO3AdamW's checkpoint methods: stage 1's formats (workers/zero/sharded_state.py and
    consolidated.py), so that a checkpoint written at one stage and world size resumes at any other.

    Writing, each rank gathers each parameter's fp32 master and moments (one all-gather each, one
    parameter at a time) and keeps the part of stage 1's flat layout it owns: 12Ψ/N bytes beside the
    shards while the checkpoint is taken. Reading, each rank reads the part of the flat layout it
    owns, as stage 1 does, and every parameter is summed together from the ranks' parts (one
    all-reduce each) for each rank to keep its FSDP2 rows."""

    param_groups: list[dict[str, Any]]
    state: Any
    process_group: dist.ProcessGroup | None
    world_size: int
    rank: int
    alignment_numel: int
    loss_scaler: DynamicLossScaler | None
    device: torch.device

    def _layout(self, *, with_state: bool) -> list[FlatBuffer]:
        buffers = layout_buffers(
            self.param_groups,
            world_size=self.world_size,
            rank=self.rank,
            alignment_numel=self.alignment_numel,
            with_state=with_state,
        )
        for buf in buffers:
            for slot in buf.slots:
                step = self.state.get(slot.param, {}).get("step")
                slot.step = 0 if step is None else int(step)
        return buffers

    def _tensor_of(self, param: Tensor, kind: str) -> Tensor | None:
        return param if kind == "master" else self.state.get(param, {}).get(kind)

    def _layout_args(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "rank": self.rank,
            "alignment_numel": self.alignment_numel,
            "param_groups": self.param_groups,
            "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
        }

    def shard_layout(self) -> dict[str, Any]:
        return shard_layout(self._layout(with_state=False), **self._layout_args())

    def owned_state(self) -> dict[str, Tensor]:
        """This rank's part of the flat layout by tensor name, gathered from the shards (every rank calls it)."""
        buffers = self._layout(with_state=True)
        for buf in buffers:
            for slot in buf.slots:
                lo = max(slot.offset, buf.start)
                hi = min(slot.offset + slot.numel, buf.start + buf.shard_numel)
                for kind in STATE_KINDS:
                    tensor = self._tensor_of(slot.param, kind)
                    full = _full_tensor(tensor) if tensor is not None else None
                    if full is not None and lo < hi:
                        part = full.reshape(-1)[lo - slot.offset : hi - slot.offset]
                        buf.state[kind][lo - buf.start : hi - buf.start].copy_(part)
        return owned_state(buffers)

    def state_dict(self) -> dict[str, Any]:
        layout = self.shard_layout()
        state = self.owned_state()
        for i, entry in enumerate(layout["buffers"]):
            entry.update({kind: state[tensor_name(i, kind)].clone() for kind in STATE_KINDS})
        return layout

    def nonfinite_state_numel(self) -> dict[str, int]:
        """nan or inf elements of the fp32 shards by kind over all ranks (one all-reduce)."""
        counts = torch.zeros(len(STATE_KINDS), dtype=torch.int64, device=self.device)
        for group in self.param_groups:
            for param in group["params"]:
                for i, kind in enumerate(STATE_KINDS):
                    tensor = self._tensor_of(param, kind)
                    if tensor is not None:
                        counts[i] += torch.isfinite(_local(tensor)).logical_not().sum()
        if self.world_size > 1:
            dist.all_reduce(counts, group=self.process_group)
        return dict(zip(STATE_KINDS, counts.tolist(), strict=True))

    def resharded_pieces(self, layouts: list[dict[str, Any]]) -> list[Piece]:
        return owned_pieces(self._layout(with_state=False), layouts)

    def load_resharded(self, layouts: list[dict[str, Any]], read: Callable[[Piece, str], Tensor]) -> None:
        buffers = self._layout(with_state=True)
        load_resharded_state(buffers, layouts, read)
        self._import(buffers, layouts[0])

    def load_shard(self, layout: dict[str, Any], read: Callable[[int, str], Tensor]) -> None:
        buffers = self._layout(with_state=True)
        load_sharded_state(
            buffers, layout, read, world_size=self.world_size, rank=self.rank, alignment_numel=self.alignment_numel
        )
        self._import(buffers, layout)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("format") == CONSOLIDATED_FORMAT:
            return self.load_consolidated_state_dict(state_dict)
        self.load_shard(state_dict, lambda buffer, kind: state_dict["buffers"][buffer][kind])

    def load_resharded_state_dicts(self, shards: list[dict[str, Any]]) -> None:
        self.load_resharded(shards, lambda p, kind: shards[p.shard]["buffers"][p.buffer][kind][p.start : p.stop])

    def load_consolidated_state_dict(self, state_dict: dict[str, Any]) -> None:
        buffers = self._layout(with_state=True)
        load_consolidated_state(buffers, [slot for buf in buffers for slot in buf.slots], state_dict)
        self._import(buffers, state_dict)

    def _import(self, buffers: list[FlatBuffer], saved: dict[str, Any]) -> None:
        """Every parameter's master and moments from the ranks' parts of the flat layout, summed (one
        all-reduce each, every rank in the same order), into this rank's FSDP2 rows; the steps, the
        hyperparameters and the loss scale."""
        for buf in buffers:
            for slot in buf.slots:
                lo = max(slot.offset, buf.start)
                hi = min(slot.offset + slot.numel, buf.start + buf.owned_numel)
                if slot.step:
                    state = self.state[slot.param]
                    state["step"] = torch.tensor(float(slot.step), dtype=torch.float32)
                    for kind in ("exp_avg", "exp_avg_sq"):
                        state.setdefault(kind, torch.zeros_like(slot.param, memory_format=torch.preserve_format))
                for kind in STATE_KINDS:
                    target = self._tensor_of(slot.param, kind)
                    if target is None:
                        continue
                    full = torch.zeros(slot.numel, dtype=torch.float32, device=buf.state[kind].device)
                    if lo < hi:
                        full[lo - slot.offset : hi - slot.offset].copy_(
                            buf.state[kind][lo - buf.start : hi - buf.start]
                        )
                    if self.world_size > 1:
                        dist.all_reduce(full, group=self.process_group)
                    local = _local(target)
                    rows = _dim0_rows(slot.shape[0] if slot.shape else 1, world_size=self.world_size, rank=self.rank)
                    with torch.no_grad():
                        local.copy_(full.view(slot.shape or (1,))[rows[0] : rows[1]].view_as(local))
        load_hyperparameters(self.param_groups, saved)
        if self.loss_scaler is not None and saved.get("loss_scaler"):
            self.loss_scaler.load_state_dict(saved["loss_scaler"])

    def consolidated_state_dict(self, *, dst: int = 0, chunk_numel: int = 1 << 22) -> dict[str, Any] | None:
        """The world-size-independent form on rank `dst` (None elsewhere); every rank must call it."""
        params = {}
        for buf in self._layout(with_state=False):
            for slot in buf.slots:
                entry = {}
                for kind in STATE_KINDS:
                    tensor = self._tensor_of(slot.param, kind)
                    full = _full_tensor(tensor) if tensor is not None else torch.zeros(slot.shape)
                    entry[kind] = full.detach().float().cpu().clone()
                params[slot.name] = {**entry, "step": slot.step}
        if self.rank != dst:
            return None
        groups = [{**group, "params": []} for group in hyperparameters(self.param_groups)]
        for buf in self._layout(with_state=False):
            groups[buf.group_index]["params"] += [slot.name for slot in buf.slots]
        return {
            "format": CONSOLIDATED_FORMAT,
            "param_groups": groups,
            "loss_scaler": self._layout_args()["loss_scaler"],
            "params": params,
        }

    def gather_master_weights(
        self, *, dst: int = 0, chunk_numel: int = 1 << 22
    ) -> Iterator[tuple[Tensor, Tensor | None]]:
        """(parameter, its fp32 master weights on CPU at rank `dst`, None elsewhere), one parameter at a
        time (an all-gather each). Every rank must iterate to the end."""
        for buf in self._layout(with_state=False):
            for slot in buf.slots:
                full = _full_tensor(slot.param)
                yield slot.param, (full.detach().float().cpu() if self.rank == dst else None)


def _full_tensor(tensor: Tensor) -> Tensor:
    """The whole tensor of a DTensor (an all-gather: every rank calls it), detached."""
    tensor = tensor.detach()
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

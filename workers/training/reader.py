"""One rank's resume: its part of the newest complete checkpoint, read through CheckpointIO
(workers/training/writer.py) in the byte ranges it owns.

Each shard needed (this rank's own, or every saved shard after an elastic resize) is opened by its
header alone, two small reads (workers.training.checkpoints.shard_header); the layout in its metadata
says which runs of elements this rank owns (ZeRO1AdamW.resharded_pieces); those byte ranges are
fetched, and the file is mapped with safetensors, so only their pages are read. The counts go into
the log line and the returned ResumeRead.
"""

from __future__ import annotations

import json
import logging
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from workers.training.checkpoints import LEGACY_SHARD_SUFFIX, shard_header, shard_name
from workers.training.writer import METADATA_KEY, CheckpointIO
from workers.zero.flat import STATE_KINDS
from workers.zero.optimizer import ZeRO1AdamW
from workers.zero.sharded_state import Piece, tensor_name

log = logging.getLogger("zero1.train")

WHOLE_FILE = sys.maxsize
"""The end of a byte range that runs to the end of the file (a legacy shard is read whole)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeRead:
    """What a resume read of its checkpoint through CheckpointIO.fetch."""

    step: int
    """The checkpoint's step: training goes on at the next."""
    saved_world_size: int
    bytes_read: int
    """Every byte asked of fetch, each once: the headers and the owned elements."""
    num_ranges: int
    """Byte ranges asked of fetch: two for each shard's header, then the data's (adjacent ones merged)."""
    header_bytes: int
    """Of bytes_read, the shards' headers."""
    shard_bytes: int
    """This rank's shard: its owned elements of master, exp_avg and exp_avg_sq, in fp32."""


def resume(opt: ZeRO1AdamW, io: CheckpointIO) -> ResumeRead | None:
    """Load this rank's part of the newest complete checkpoint (None where there is none). Saved by
    another number of ranks (an elastic job resized), it is resharded: this rank reads each saved
    shard's header, then only the runs of elements it now owns (ZeRO1AdamW.resharded_pieces)."""
    found = io.latest()
    if found is None:
        return None
    step, saved_world = found
    rank = opt.rank
    world_size = opt.world_size
    if saved_world == world_size:
        try:
            shards = [_Shard(io, shard_name(step, rank, world_size))]
        except FileNotFoundError:
            return _resume_legacy(opt, io, step=step)
        own = shards[0]
        names = [tensor_name(i, kind) for i in range(len(own.layout.get("buffers", ()))) for kind in STATE_KINDS]
        own.fetch([own.byte_range(name) for name in names])
        with safe_open(own.path, "pt") as file:
            opt.load_shard(own.layout, lambda buffer, kind: file.get_slice(tensor_name(buffer, kind))[:])
    else:
        shards = [_Shard(io, shard_name(step, r, saved_world)) for r in range(saved_world)]
        layouts = [shard.layout for shard in shards]
        pieces = opt.resharded_pieces(layouts)
        for r, shard in enumerate(shards):
            mine = [p for p in pieces if p.shard == r]
            shard.fetch(
                [shard.byte_range(tensor_name(p.buffer, kind), p.start, p.stop) for p in mine for kind in STATE_KINDS]
            )
        with ExitStack() as stack:
            files = [stack.enter_context(safe_open(shard.path, "pt")) for shard in shards]

            def read(piece: Piece, kind: str) -> Tensor:
                return files[piece.shard].get_slice(tensor_name(piece.buffer, kind))[piece.start : piece.stop]

            opt.load_resharded(layouts, read)
    counts = ResumeRead(
        step=step,
        saved_world_size=saved_world,
        bytes_read=sum(shard.bytes_read for shard in shards),
        num_ranges=sum(shard.num_ranges for shard in shards),
        header_bytes=sum(shard.header_bytes for shard in shards),
        shard_bytes=sum(4 * t.numel() for t in opt.owned_state().values()),
    )
    log.info(
        "rank %d of %d resumed from step %d (saved by %d ranks): read %s bytes in %d ranges; its shard is %s bytes",
        rank,
        world_size,
        step,
        saved_world,
        f"{counts.bytes_read:,}",
        counts.num_ranges,
        f"{counts.shard_bytes:,}",
    )
    return counts


def _resume_legacy(opt: ZeRO1AdamW, io: CheckpointIO, *, step: int) -> ResumeRead:
    """A checkpoint written before shards were safetensors files (torch.save's zip; a job running
    across the upgrade): read whole, at its own world size only. Such a checkpoint saved by another
    number of ranks does not reshard: its missing .safetensors shards fail the resume."""
    path = io.fetch(shard_name(step, opt.rank, opt.world_size, suffix=LEGACY_SHARD_SUFFIX), [(0, WHOLE_FILE)])
    opt.load_state_dict(torch.load(path, map_location=opt.device))
    size = path.stat().st_size
    shard_bytes = sum(4 * t.numel() for t in opt.owned_state().values())
    log.info("rank %d of %d resumed from step %d (a .pt shard, read whole)", opt.rank, opt.world_size, step)
    return ResumeRead(
        step=step,
        saved_world_size=opt.world_size,
        bytes_read=size,
        num_ranges=1,
        header_bytes=0,
        shard_bytes=shard_bytes,
    )


class _Shard:
    """One saved shard as a resuming rank reads it through io.fetch: its header on opening, then
    byte ranges (fetch), each counted."""

    def __init__(self, io: CheckpointIO, name: str) -> None:
        self.io = io
        self.name = name
        self.bytes_read = self.num_ranges = 0
        self.path: Path | None = None
        self.data_start, self.tensors, metadata = shard_header(self._read)
        self.header_bytes = self.bytes_read
        if METADATA_KEY not in metadata:
            raise ValueError(f"{name}: not a zero1 shard (no {METADATA_KEY!r} in its safetensors metadata)")
        self.layout = json.loads(metadata[METADATA_KEY])

    def _read(self, start: int, end: int) -> bytes:
        path = self.fetch([(start, end)])
        with open(path, "rb") as file:
            file.seek(start)
            return file.read(end - start)

    def fetch(self, ranges: list[tuple[int, int]]) -> Path:
        """The local file once `ranges` are in it; adjacent and overlapping ranges asked as one."""
        merged: list[tuple[int, int]] = []
        for start, end in sorted(r for r in ranges if r[0] < r[1]):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
            else:
                merged.append((start, end))
        if merged or self.path is None:
            self.path = self.io.fetch(self.name, merged)
        self.bytes_read += sum(end - start for start, end in merged)
        self.num_ranges += len(merged)
        return self.path

    def byte_range(self, tensor: str, start: int = 0, stop: int | None = None) -> tuple[int, int]:
        """The file's bytes of elements [start, stop) of 1-D fp32 `tensor` (stop None: to its end)."""
        dtype, shape, begin, end = self.tensors.get(tensor, ("missing", (), 0, 0))
        stop = shape[0] if stop is None and len(shape) == 1 else stop
        if (
            dtype != "F32"
            or len(shape) != 1
            or end - begin != 4 * shape[0]
            or not 0 <= start <= (stop or 0) <= shape[0]
        ):
            raise ValueError(
                f"{self.name}: tensor {tensor} is {dtype} {list(shape)}, not the 1-D fp32 one its layout says "
                f"(elements [{start}, {stop}) of it)"
            )
        return self.data_start + begin + 4 * start, self.data_start + begin + 4 * stop


def read_shard(path: Path) -> dict[str, Any]:
    """A whole shard file as one dictionary, the shape ZeRO1AdamW.state_dict() returns (tests, tools)."""
    with safe_open(path, "pt") as file:
        state = json.loads(file.metadata()[METADATA_KEY])
        for i, entry in enumerate(state["buffers"]):
            entry.update({kind: file.get_tensor(tensor_name(i, kind)) for kind in STATE_KINDS})
    return state

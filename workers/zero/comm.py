"""ZeRO1AdamW's communication: the reduce and gather beats over the data-parallel ranks.

connect() decides the one-rank case once: a LocalComm moves nothing, a GroupComm
moves the flat buffers (workers/zero/flat.py) between the ranks of a process group,
with collectives or with point-to-point sends. The p2p reduce goes bucket by
bucket (workers/zero/buckets.py); with overlap_comm the gradient hooks send each
bucket the moment its last gradient arrives, while backward goes on.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from workers.zero.buckets import Bucket, BucketReducer, p2p_op
from workers.zero.flat import FlatBuffer, Slot

ReduceOp = Literal["auto", "p2p", "reduce_scatter", "all_reduce"]
"""Stage 1's reduce; "none" (internal) where the gradients are reduced elsewhere (stage 2)."""
GatherOp = Literal["auto", "p2p", "all_gather", "all_reduce"]

_GATHER_TAG = 1 << 20  # p2p tags: reduce buckets count from 0, gather chunks from here


def default_collectives(backend: str) -> tuple[str, str]:
    """(reduce, gather) collectives per backend, chosen by measurement.

    NCCL's reduce-scatter and all-gather are bandwidth-optimal: together they
    move exactly DDP's all-reduce volume. gloo's are not (on this project's
    2-core machines, 25M fp32 elements on 2 ranks: reduce_scatter_tensor 140 ms,
    all_gather_into_tensor 105 ms, all_reduce 97 ms), but its point-to-point
    sends are: "p2p" sends each peer its slice and sums what the peers send for
    its own (43 ms), and sends its updated slice to every peer (35 ms). The same
    sends, bucket by bucket, can overlap the backward pass (overlap_comm).
    benchmarks/optimizer.py prints the figures.
    """
    if backend == "nccl":
        return "reduce_scatter", "all_gather"
    return "p2p", "p2p"


def resolve_collectives(
    backend: str, *, reduce_op: ReduceOp, gather_op: GatherOp, overlap_comm: bool, overlap_gather: bool
) -> tuple[str, str]:
    """(reduce, gather) with "auto" resolved; overlap needs point-to-point sends for both."""
    reduce_auto, gather_auto = default_collectives(backend)
    if overlap_comm or overlap_gather:
        reduce_auto = "p2p"
        gather_auto = "p2p"
    reduce = reduce_auto if reduce_op == "auto" else reduce_op
    gather = gather_auto if gather_op == "auto" else gather_op
    for flag, value in (("overlap_comm", overlap_comm), ("overlap_gather", overlap_gather)):
        if value and (reduce, gather) != ("p2p", "p2p"):
            raise ValueError(f"{flag} needs reduce_op and gather_op 'p2p' (or 'auto'), got {reduce!r} / {gather!r}")
    return reduce, gather


@dataclass(frozen=True, kw_only=True, slots=True)
class Ranks:
    """This rank's place in the data-parallel group: one rank, backend "none", without torch.distributed."""

    process_group: dist.ProcessGroup | None
    world_size: int
    rank: int
    backend: str

    @classmethod
    def of(cls, process_group: dist.ProcessGroup | None) -> Ranks:
        distributed = process_group is not None or (dist.is_available() and dist.is_initialized())
        if not distributed:
            return cls(process_group=None, world_size=1, rank=0, backend="none")
        return cls(
            process_group=process_group,
            world_size=dist.get_world_size(process_group),
            rank=dist.get_rank(process_group),
            backend=dist.get_backend(process_group),
        )


def register_grad_hooks(slots: list[Slot], on_grad: Callable[[int], None]) -> None:
    """on_grad(slot.index) each time a parameter's gradient of a backward is complete.

    The hooks live on the parameters and hold on_grad's owner weakly; they are
    removed when the owner goes, so none keeps it alive."""
    method = weakref.WeakMethod(on_grad)

    def marker(index: int) -> Callable[[Tensor], None]:
        def mark(_: Tensor) -> None:
            if (alive := method()) is not None:
                alive(index)

        return mark

    hooks = [slot.param.register_post_accumulate_grad_hook(marker(slot.index)) for slot in slots]
    weakref.finalize(on_grad.__self__, lambda: [hook.remove() for hook in hooks])


def connect(
    ranks: Ranks,
    buffers: list[FlatBuffer],
    *,
    reduce_op: str,
    gather_op: str,
    overlap_comm: bool,
    overlap_gather: bool,
    bucket_cap_mb: float,
) -> LocalComm | GroupComm:
    """The communication for these ranks: with one rank there is nothing to move."""
    if ranks.world_size == 1:
        return LocalComm(buffers)
    return GroupComm(
        ranks,
        buffers,
        reduce_op=reduce_op,
        gather_op=gather_op,
        overlap_comm=overlap_comm,
        overlap_gather=overlap_gather,
        bucket_cap_mb=bucket_cap_mb,
    )


def _gather_tag(buffer_index: int, slice_index: int) -> int:
    return _GATHER_TAG + (buffer_index << 12) + slice_index


class LocalComm:
    """One rank: every gradient is already the whole sum, every parameter already gathered."""

    overlap_comm = False
    overlap_gather = False
    grad_divisor = 1.0  # the reduced gradient is the mean already

    def __init__(self, buffers: list[FlatBuffer]):
        self.buffers = buffers
        self.buckets: list[Bucket] = []

    def grad_ready(self, index: int) -> None:
        pass

    def reduce_gradients(self) -> None:
        for buf in self.buffers:
            buf.grad_shard = buf.grads[buf.start : buf.start + buf.shard_numel]

    def finish_reduces(self) -> None:
        pass

    def reset(self) -> None:
        pass

    def slice_updated(self, buffer_index: int, slice_index: int, lo: int, hi: int) -> None:
        pass

    def gather_updated(self) -> None:
        pass

    def gather_params(self) -> None:
        pass

    def all_reduce(self, tensor: Tensor) -> None:
        pass

    def all_gather(self, piece: Tensor) -> Tensor:
        return piece.view(1, -1)


class GroupComm:
    """N ranks of a process group: the reduce and gather beats, and the sums and gathers that
    the gradient norm and the checkpoints need."""

    def __init__(
        self,
        ranks: Ranks,
        buffers: list[FlatBuffer],
        *,
        reduce_op: str,
        gather_op: str,
        overlap_comm: bool,
        overlap_gather: bool,
        bucket_cap_mb: float,
    ):
        self.group = ranks.process_group
        self.world_size = ranks.world_size
        self.rank = ranks.rank
        self.buffers = buffers
        self.reduce_op = reduce_op
        self.gather_op = gather_op
        self.overlap_comm = overlap_comm
        self.overlap_gather = overlap_gather
        self._nccl = ranks.backend == "nccl"
        # NCCL's reduce-scatter averages natively; elsewhere sum and fold 1/N into the update's grad scale
        self._reduce_avg = self._nccl and reduce_op == "reduce_scatter"
        self.grad_divisor = 1.0 if self._reduce_avg else float(self.world_size)
        self._peers = [r for r in range(self.world_size) if r != self.rank]
        self.reducer = BucketReducer(
            buffers if reduce_op == "p2p" else [],
            group=self.group,
            world_size=self.world_size,
            rank=self.rank,
            bucket_cap_mb=bucket_cap_mb,
        )
        self._gather_works: list[Any] = []  # slices sent during the update (overlap_gather)

    @property
    def buckets(self) -> list[Bucket]:
        return self.reducer.buckets

    def grad_ready(self, index: int) -> None:
        if self.overlap_comm:
            self.reducer.grad_ready(index)

    def reduce_gradients(self) -> None:
        """Beat 1: every buffer's grad_shard is the (S,) sum (NCCL: mean) of the ranks' gradients of its shard."""
        self.reducer.reduce()
        for buf in self.buffers:
            shard = slice(buf.start, buf.start + buf.shard_numel)
            if self.reduce_op == "p2p":
                buf.grad_shard = buf.grads[shard]
            elif self.reduce_op == "all_reduce":
                # all-reduce: flat grad (N*S,) summed on every rank; this rank reads its (S,)
                dist.all_reduce(buf.grads, op=self._op(), group=self.group)
                buf.grad_shard = buf.grads[shard]
            else:
                # reduce-scatter: flat grad (N*S,) -> own shard (S,); in place where NCCL allows
                out = buf.grads[shard] if self._reduce_avg else torch.empty_like(buf.grads[shard])
                dist.reduce_scatter_single(out, buf.grads, op=self._op(), group=self.group)
                buf.grad_shard = out

    def finish_reduces(self) -> None:
        self.reducer.finish_all()

    def reset(self) -> None:
        self.reducer.reset()

    def slice_updated(self, buffer_index: int, slice_index: int, lo: int, hi: int) -> None:
        """With overlap_gather, send slice [lo, hi) of the shard the moment the update has cast it."""
        if self.overlap_gather:
            buf = self.buffers[buffer_index]
            self._gather_works += self._launch_gather(buf, lo, hi, tag=_gather_tag(buffer_index, slice_index))

    def gather_updated(self) -> None:
        """Beat 4 of a step: wait for the slices sent during the update, or gather every shard now."""
        if not self.overlap_gather:
            self.gather_params()
            return
        for work in self._gather_works:
            work.wait()
        self._gather_works = []

    def gather_params(self) -> None:
        """Every rank receives every rank's shard of the parameters."""
        works = []
        for b, buf in enumerate(self.buffers):
            shard = buf.param_shard()
            if self.gather_op == "p2p":
                # every rank sends its updated slice to every peer, straight into their flat buffers
                works += self._launch_gather(buf, 0, buf.shard_numel, tag=_gather_tag(b, 0))
            elif self.gather_op == "all_gather":
                # all-gather: own shard (S,) -> flat params (N*S,) on every rank
                source = shard if self._nccl else shard.clone()  # in place only on NCCL
                dist.all_gather_single(buf.params, source, group=self.group)
            else:
                # all-reduce of buffers that are zero outside each rank's shard: x + 0 is exact
                buf.params[: buf.start].zero_()
                buf.params[buf.start + buf.shard_numel :].zero_()
                dist.all_reduce(buf.params, group=self.group)
        for work in works:
            work.wait()

    def all_reduce(self, tensor: Tensor) -> None:
        """Sum over the ranks, in place."""
        dist.all_reduce(tensor, group=self.group)

    def all_gather(self, piece: Tensor) -> Tensor:
        """Every rank's (n,) piece -> (N, n), rank by rank."""
        pieces = torch.empty(self.world_size * piece.numel(), dtype=piece.dtype, device=piece.device)
        dist.all_gather_single(pieces, piece, group=self.group)
        return pieces.view(self.world_size, piece.numel())

    def _launch_gather(self, buf: FlatBuffer, lo: int, hi: int, *, tag: int) -> list[Any]:
        """Send slice [lo, hi) of this rank's shard to every peer; receive the same slice of theirs."""
        size = buf.shard_numel
        ops = []
        for peer in self._peers:
            ops.append(p2p_op(dist.irecv, buf.params[peer * size + lo : peer * size + hi], peer, self.group, tag))
            ops.append(p2p_op(dist.isend, buf.params[buf.start + lo : buf.start + hi], peer, self.group, tag))
        return dist.batch_isend_irecv(ops) if ops else []

    def _op(self) -> dist.ReduceOp:
        return dist.ReduceOp.AVG if self._reduce_avg else dist.ReduceOp.SUM

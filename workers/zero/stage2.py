"""ZeRO Stage 2: ZeRO1AdamW that keeps only its shard of the gradients.

Stage 1 keeps every rank's full gradient (2Ψ in a 16-bit model) until step()
reduces it. Stage 2 reduces each backward's gradients while the backward runs,
bucket by bucket (workers/zero/buckets.py cuts them, in the order backward
produces them), and keeps only the sum of the rank's own shard: 2Ψ/N bytes,
plus the buckets in flight. Each parameter's gradient, once autograd has
accumulated it, is copied into its bucket's staging buffer and dropped
(param.grad is None again); a bucket whose gradients have all arrived is
reduced to the ranks that own its parts, and the owner adds its part to its
(S,) gradient shard; at most MAX_BUCKETS_IN_FLIGHT reduces are outstanding.
When the backward ends, the buckets that did not fill (a parameter without a
gradient on this rank) go too, and every reduce is waited for: each backward,
on every rank, reduces every bucket exactly once. Accumulating micro-batches is
one backward each, no no_sync(): the shard is the running sum, as DeepSpeed's
stage 2 keeps it.

Gloo's point-to-point sends carry the bucket's tag, so a bucket goes the moment
it fills. A collective's buckets (and NCCL's untagged sends) go in one order on
every rank: tag order in the first backward, then the order in which rank 0's
first backward filled them. There, a parameter with a gradient in some
backwards and not in others holds back the buckets after it until the backward
ends.

The update, the cast, the gather and the checkpoint formats are stage 1's: the
flat layout, the shards and the state are the same, so a checkpoint written at
one stage resumes at the other. Without accumulation the p2p reduce sums in
stage 1's order and gives stage 1's bits.

Collectives (reduce_op): "p2p" sends each owner its part of a bucket and sums
what the peers send in rank order (gloo's default, as stage 1's); "reduce" is a
reduce to each owner of its part (NCCL's default: a bucket's parts together are
the bucket, so the bytes are a reduce-scatter's); "all_reduce" sums the whole
bucket everywhere and keeps the owned part.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from workers.memory.buckets import MAX_BUCKETS_IN_FLIGHT
from workers.zero.buckets import Bucket, build_buckets, p2p_op
from workers.zero.comm import Ranks
from workers.zero.flat import FlatBuffer, Slot
from workers.zero.optimizer import ZeRO1AdamW

Stage2ReduceOp = Literal["auto", "p2p", "reduce", "all_reduce"]


def stage2_reduce_op(backend: str, reduce_op: str) -> str:
    """reduce_op with "auto" resolved: a reduce to each owner on NCCL, point-to-point sends elsewhere
    (gloo's collectives are slower than its sends, as stage 1 measured)."""
    if reduce_op == "auto":
        return "reduce" if backend == "nccl" else "p2p"
    if reduce_op not in ("p2p", "reduce", "all_reduce"):
        raise ValueError(f"stage 2 reduce_op must be 'auto', 'p2p', 'reduce' or 'all_reduce', got {reduce_op!r}")
    return reduce_op


@dataclass(kw_only=True, slots=True, eq=False)
class Staged:
    """A bucket's gradients of one backward, on their way to their owners."""

    bucket: Bucket
    data: Tensor  # (hi - lo,) model dtype: this rank's gradients of the bucket
    works: list[Any] = field(default_factory=list)
    received: Tensor | None = None  # (N-1, owned part): the peers' gradients of this rank's part (p2p)


class GradientShards:
    """Each backward's gradients reduced, bucket by bucket, into every buffer's (S,) grad_shard."""

    def __init__(self, ranks: Ranks, buffers: list[FlatBuffer], *, reduce_op: str, bucket_cap_mb: float):
        self.group = ranks.process_group
        self.world_size = ranks.world_size
        self.rank = ranks.rank
        self.reduce_op = reduce_op
        self.peers = [r for r in range(self.world_size) if r != self.rank]
        self.slots = [slot for buf in buffers for slot in buf.slots]
        self.buckets = build_buckets(buffers, bucket_cap_mb=bucket_cap_mb)
        self.bucket_of: list[Bucket] = [self.buckets[0]] * len(self.slots) if self.buckets else []
        for bucket in self.buckets:
            for slot in bucket.buf.slots:
                if bucket.lo <= slot.offset < bucket.hi:
                    self.bucket_of[slot.index] = bucket
        self.staged: dict[int, Staged] = {}  # by bucket tag: buckets with gradients, not yet sent
        self.in_flight: deque[Staged] = deque()
        # Gloo's point-to-point sends carry the bucket's tag, so a bucket goes the moment it fills, in
        # whatever order backward fills them. Elsewhere (a collective, or NCCL's untagged sends) every
        # rank must launch the buckets in one order: tag order for the first backward, then the order
        # in which rank 0's first backward filled them (DDP too rebuilds its buckets after one).
        self.any_order = reduce_op == "p2p" and ranks.backend == "gloo"
        self.order: list[Bucket] = list(self.buckets)
        self.agreed = self.world_size == 1 or self.any_order
        self.filled: list[int] = []  # tags in the order this backward filled them (until agreed)
        self.next_launch = 0  # index into self.order (not any_order)
        self.sent = 0  # buckets reduced since construction (tests count them)
        self.most_in_flight = 0  # the most staging buffers alive at once (filling or in flight)
        self._callback_queued = False

    def grad_ready(self, slot: Slot) -> None:
        """slot's gradient of this backward is complete: stage it, drop it, send what is ready."""
        if not self._callback_queued:
            # the end of this backward sends what did not fill (DDP's way to learn that a backward ended)
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_backward)
            self._callback_queued = True
        bucket = self.bucket_of[slot.index]
        staged = self._staged(bucket)
        grad = slot.param.grad
        assert grad is not None, f"{slot.name}: a gradient hook without a gradient"
        start = slot.offset - bucket.lo
        staged.data[start : start + slot.numel].copy_(grad.reshape(-1))
        slot.param.grad = None  # the full gradient lives no longer than its copy into the bucket
        bucket.ready += 1
        if bucket.ready < bucket.num_slots:
            return
        if not self.agreed:
            self.filled.append(bucket.tag)
        if self.any_order:
            self._launch(bucket)
            return
        while self.next_launch < len(self.order):
            bucket = self.order[self.next_launch]
            if bucket.ready < bucket.num_slots:
                break
            self._launch(bucket)

    def end_of_backward(self) -> None:
        """Send every bucket not sent yet, in order (zeros where this rank had no gradient), and
        wait: each backward reduces each bucket once, on every rank."""
        self._callback_queued = False
        for bucket in self.buckets if self.any_order else self.order[self.next_launch :]:
            if not bucket.launched:
                self._launch(bucket)
        while self.in_flight:
            self._finish(self.in_flight.popleft())
        if not self.agreed:
            self._agree_on_order()
        for bucket in self.buckets:
            bucket.ready = 0
            bucket.launched = False
        self.next_launch = 0

    def _agree_on_order(self) -> None:
        """Every rank takes rank 0's fill order of this backward as the launch order from now on."""
        seen = set(self.filled)
        tags = self.filled + [b.tag for b in self.buckets if b.tag not in seen]
        order = torch.tensor(tags, dtype=torch.int64, device=self.buckets[0].buf.params.device)
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast(order, src=src, group=self.group)
        self.order = [self.buckets[tag] for tag in order.tolist()]
        self.agreed = True
        self.filled = []

    def _staged(self, bucket: Bucket) -> Staged:
        staged = self.staged.get(bucket.tag)
        if staged is None:
            staged = Staged(bucket=bucket, data=self._buffer(bucket))
            self.staged[bucket.tag] = staged
        return staged

    def _buffer(self, bucket: Bucket) -> Tensor:
        """A zeroed staging buffer for the bucket: allocated per bucket and freed when its reduce is
        summed (on a GPU the caching allocator hands the same blocks back), so none outlives a backward."""
        like = bucket.buf.params
        return torch.zeros(bucket.hi - bucket.lo, dtype=like.dtype, device=like.device)

    def _launch(self, bucket: Bucket) -> None:
        staged = self.staged.pop(bucket.tag, None) or Staged(bucket=bucket, data=self._buffer(bucket))
        bucket.launched = True
        if not self.any_order:
            self.next_launch += 1
        self.sent += 1
        while len(self.in_flight) >= MAX_BUCKETS_IN_FLIGHT:
            self._finish(self.in_flight.popleft())
        if self.world_size > 1:
            staged.works = getattr(self, f"_send_{self.reduce_op}")(staged)
        self.in_flight.append(staged)
        self.most_in_flight = max(self.most_in_flight, len(self.in_flight) + len(self.staged))

    def _parts(self, bucket: Bucket) -> Iterator[tuple[int, int, int]]:
        """(owner, a, b): each rank's part of the bucket, in bucket coordinates (empty parts left out)."""
        size = bucket.buf.shard_numel
        for owner in range(self.world_size):
            a = max(bucket.lo, owner * size)
            b = min(bucket.hi, (owner + 1) * size)
            if a < b:
                yield owner, a - bucket.lo, b - bucket.lo

    def _send_p2p(self, staged: Staged) -> list[Any]:
        ops = []
        for owner, a, b in self._parts(staged.bucket):
            if owner == self.rank:
                data = staged.data
                staged.received = torch.empty(len(self.peers), b - a, dtype=data.dtype, device=data.device)
                for k, peer in enumerate(self.peers):
                    ops.append(p2p_op(dist.irecv, staged.received[k], peer, self.group, staged.bucket.tag))
            else:
                ops.append(p2p_op(dist.isend, staged.data[a:b], owner, self.group, staged.bucket.tag))
        return dist.batch_isend_irecv(ops) if ops else []

    def _send_reduce(self, staged: Staged) -> list[Any]:
        works = []
        for owner, a, b in self._parts(staged.bucket):
            dst = owner if self.group is None else dist.get_global_rank(self.group, owner)
            works.append(dist.reduce(staged.data[a:b], dst=dst, group=self.group, async_op=True))
        return works

    def _send_all_reduce(self, staged: Staged) -> list[Any]:
        return [dist.all_reduce(staged.data, group=self.group, async_op=True)]

    def _finish(self, staged: Staged) -> None:
        """Wait for a bucket's reduce and add this rank's part of the sum to its gradient shard."""
        for work in staged.works:
            work.wait()
        bucket = staged.bucket
        buf = bucket.buf
        for owner, a, b in self._parts(bucket):
            if owner != self.rank:
                continue
            mine = staged.data[a:b]
            if self.reduce_op == "p2p" and staged.received is not None:
                _sum_in_rank_order(mine, staged.received, rank=self.rank, peers=self.peers)
            lo = bucket.lo + a - buf.start
            assert buf.grad_shard is not None
            buf.grad_shard[lo : lo + (b - a)].add_(mine)


def _sum_in_rank_order(mine: Tensor, received: Tensor, *, rank: int, peers: list[int]) -> None:
    """mine = g_0 + g_1 + ... + g_{N-1}, folded left in rank order: stage 1's sum, bit for bit."""
    by_rank = dict(zip(peers, received, strict=True))
    if rank > 0:
        before = by_rank[0]
        for r in range(1, rank):
            before.add_(by_rank[r])
        mine.add_(before)
    for r in sorted(p for p in peers if p > rank):
        mine.add_(by_rank[r])


class ZeRO2AdamW(ZeRO1AdamW):
    """ZeRO1AdamW whose gradients are sharded too (ZeRO Stage 2): same arguments, same state and
    checkpoints, gradient memory 2Ψ/N plus the buckets in flight instead of 2Ψ.

    Gradients are reduced during every backward (module docstring), so no parameter has a
    .grad after it and no_sync() changes nothing: accumulate micro-batches by calling backward
    on each. reduce_op is "auto", "p2p", "reduce" or "all_reduce"; overlap_comm is implied
    (the buckets always go during backward); overlap_gather is stage 1's.
    """

    stage = 2

    def _collectives(self, ranks: Ranks, *, reduce_op: str, gather_op: str, overlap_gather: bool, **_: Any):
        _, gather = super()._collectives(
            ranks, reduce_op="auto", gather_op=gather_op, overlap_comm=False, overlap_gather=overlap_gather
        )
        return stage2_reduce_op(ranks.backend, reduce_op), gather

    def _connect_gradients(self, ranks: Ranks) -> None:
        self._shards = GradientShards(ranks, self._buffers, reduce_op=self.reduce_op, bucket_cap_mb=self.bucket_cap_mb)

    def _on_grad(self, index: int) -> None:
        self._had_grad[index] = True
        self._shards.grad_ready(self._slots[index])

    def _reduce_gradients(self) -> None:
        pass  # every backward reduced its gradients into the shards as it ended

    def _end_step(self) -> None:
        pass  # the shards are the accumulators: zero_grad() zeroes them

    def zero_grad(self, set_to_none: bool = True) -> None:
        for buf in self._buffers:
            assert buf.grad_shard is not None
            buf.grad_shard.zero_()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield  # every backward reduces (module docstring): nothing to hold back

    @property
    def overlap_comm(self) -> bool:
        return self.world_size > 1

    @property
    def _buckets(self) -> list[Bucket]:
        return self._shards.buckets

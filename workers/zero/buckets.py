"""The point-to-point reduce of ZeRO1AdamW's gradients, bucket by bucket.

A bucket is a run of whole parameters of one flat buffer (workers/zero/flat.py).
Each rank sends every peer the part of a bucket the peer owns and receives the
peers' gradients of its own part into a pooled receive buffer, then sums them
in rank order. The buckets go in one order on every rank: with overlap_comm a
bucket goes the moment backward has produced its last gradient (the gradient
hooks of workers/zero/comm.py count the arrivals), the rest in step().
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from workers.memory.buckets import cap_numel, cut_buckets
from workers.zero.flat import FlatBuffer

RECV_BUFFERS = 2  # receive buffers per dtype for p2p reduces in flight; a third bucket waits for one


def p2p_op(op, tensor: Tensor, peer: int, group: dist.ProcessGroup | None, tag: int) -> dist.P2POp:
    """A send or receive to a peer, named by its rank in `group`."""
    if group is not None:
        peer = dist.get_global_rank(group, peer)
    return dist.P2POp(op, tensor, peer, group, tag)


@dataclass(kw_only=True, slots=True, eq=False)
class Bucket:
    """A run of whole parameters of one flat buffer, reduced by point-to-point sends:
    each rank sends every peer the part of the bucket the peer owns and receives,
    from every peer, the part it owns itself."""

    tag: int  # its place in the launch order, the same on every rank
    buf: FlatBuffer
    lo: int  # flat-buffer coordinates
    hi: int
    num_slots: int
    ready: int = 0  # parameters whose gradient of this backward has arrived
    launched: bool = False
    works: list[Any] = field(default_factory=list)
    received: Tensor | None = None  # (N-1, owned part) the peers' gradients of this rank's part
    storage: Tensor | None = None  # the pooled receive buffer `received` is a view of

    def owned(self) -> tuple[int, int]:
        """The part of the bucket in this rank's shard, in flat-buffer coordinates (may be empty)."""
        return max(self.lo, self.buf.start), min(self.hi, self.buf.start + self.buf.shard_numel)


def build_buckets(buffers: list[FlatBuffer], *, bucket_cap_mb: float) -> list[Bucket]:
    """Buckets of whole parameters, at most bucket_cap_mb each (a larger parameter is one
    bucket), each buffer from its end: the order in which backward produces gradients. The cut is
    the planner's (workers/memory/buckets.py), so a plan counts the buckets the optimizer makes."""
    buckets: list[Bucket] = []
    for buf in buffers:
        cap = cap_numel(bucket_cap_mb, bytes_per_element=buf.params.element_size())
        for cut in cut_buckets([slot.numel for slot in buf.slots], cap=cap):
            buckets.append(Bucket(tag=len(buckets), buf=buf, lo=cut.lo, hi=cut.hi, num_slots=cut.num_params))
    return buckets


class BucketReducer:
    """The p2p reduce, bucket by bucket in one order on every rank, into pooled receive buffers."""

    def __init__(
        self,
        buffers: list[FlatBuffer],
        *,
        group: dist.ProcessGroup | None,
        world_size: int,
        rank: int,
        bucket_cap_mb: float,
    ):
        self.group = group
        self.world_size = world_size
        self.rank = rank
        self.peers = [r for r in range(world_size) if r != rank]
        self.slots = [slot for buf in buffers for slot in buf.slots]
        self.buckets = build_buckets(buffers, bucket_cap_mb=bucket_cap_mb)
        self.bucket_of = [self.buckets[0]] * len(self.slots) if self.buckets else []
        for bucket in self.buckets:
            for slot in bucket.buf.slots:
                if bucket.lo <= slot.offset < bucket.hi:
                    self.bucket_of[slot.index] = bucket
        self.counted = [False] * len(self.slots)  # gradient arrived in this sync window
        self.next_launch = 0  # buckets go in order, the same on every rank
        self.in_flight: deque[Bucket] = deque()  # launched buckets, oldest first
        self.recv_free: dict[torch.dtype, list[Tensor]] = {}  # pooled receive buffers not in use
        self.recv_count: dict[torch.dtype, int] = {}  # pooled receive buffers allocated

    def grad_ready(self, index: int) -> None:
        """A parameter's gradient of this backward is complete: count it; send what is ready."""
        bucket = self.bucket_of[index]
        if self.counted[index]:
            if bucket.launched:
                raise RuntimeError(
                    f"a second gradient of {self.slots[index].name} arrived after its bucket was sent: "
                    "with overlap_comm, call step() after each backward(), or run the backward of every "
                    "micro-batch but the last under optimizer.no_sync()"
                )
            return
        self.counted[index] = True
        bucket.ready += 1
        while self.next_launch < len(self.buckets):
            bucket = self.buckets[self.next_launch]
            if bucket.ready < bucket.num_slots:
                break
            self.launch(bucket)
            self.next_launch += 1

    def reduce(self) -> None:
        """Buckets backward did not complete (overlap off, or a parameter without a gradient
        here) go now, in order; then every rank's own part is summed."""
        if not self.buckets:
            return
        for bucket in self.buckets[self.next_launch :]:
            self.launch(bucket)
        self.next_launch = len(self.buckets)
        self.finish_all()

    def launch(self, bucket: Bucket) -> None:
        """Send each peer its part of the bucket; post receives of the peers' gradients of mine."""
        buf = bucket.buf
        ops = []
        num_peers = len(self.peers)
        lo, hi = bucket.owned()
        if lo < hi:
            bucket.storage = self._recv_buffer(buf.grads, num_peers * (hi - lo))
            bucket.received = bucket.storage[: num_peers * (hi - lo)].view(num_peers, hi - lo)
            for k, peer in enumerate(self.peers):
                ops.append(p2p_op(dist.irecv, bucket.received[k], peer, self.group, bucket.tag))
        for peer in self.peers:
            a = max(bucket.lo, peer * buf.shard_numel)
            b = min(bucket.hi, (peer + 1) * buf.shard_numel)
            if a < b:
                ops.append(p2p_op(dist.isend, buf.grads[a:b], peer, self.group, bucket.tag))
        bucket.works = dist.batch_isend_irecv(ops) if ops else []
        bucket.launched = True
        self.in_flight.append(bucket)

    def _recv_buffer(self, like: Tensor, numel: int) -> Tensor:
        """A pooled receive buffer of at least `numel` elements. At most RECV_BUFFERS per dtype
        exist: reused, not allocated per step (fresh memory costs page faults on every step);
        when all are in use the oldest bucket in flight is finished first."""
        free = self.recv_free.setdefault(like.dtype, [])
        while not free and self.recv_count.get(like.dtype, 0) >= RECV_BUFFERS and self.in_flight:
            self._finish_oldest()
        if free:
            buffer = free.pop()
            if buffer.numel() >= numel:
                return buffer
        else:
            self.recv_count[like.dtype] = self.recv_count.get(like.dtype, 0) + 1
        return torch.empty(numel, dtype=like.dtype, device=like.device)  # (re)allocated at the largest size

    def finish_all(self) -> None:
        """Wait for every launched bucket and sum the gradients of this rank's parts."""
        while self.in_flight:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        """Wait for the oldest bucket in flight and sum, in place, the gradients of this rank's part.

        The sum is g_0 + g_1 + ... + g_{N-1} folded left in rank order on every owner, however
        the buckets were cut or timed: overlap on or off gives the same bits."""
        bucket = self.in_flight.popleft()
        for work in bucket.works:
            work.wait()
        bucket.works = []
        if bucket.received is None:
            return
        lo, hi = bucket.owned()
        mine = bucket.buf.grads[lo:hi]
        peers = dict(zip(self.peers, bucket.received, strict=True))
        if self.rank > 0:
            before = peers[0]
            for r in range(1, self.rank):
                before.add_(peers[r])
            mine.add_(before)  # (g_0 + ... + g_{r-1}) + g_r: addition commutes exactly
        for r in range(self.rank + 1, self.world_size):
            mine.add_(peers[r])
        self.recv_free[bucket.storage.dtype].append(bucket.storage)
        bucket.received = bucket.storage = None

    def reset(self) -> None:
        assert not self.in_flight, "reset with reduces in flight"
        for bucket in self.buckets:
            bucket.ready = 0
            bucket.launched = False
        self.counted = [False] * len(self.slots)
        self.next_launch = 0

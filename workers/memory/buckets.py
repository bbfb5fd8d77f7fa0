"""Stage 2's gradient buckets as the planner counts them: the cut, the bound on those in flight, and
the staging buffers a rank holds during a backward.

A ZeRO stage-2 rank (workers/zero/stage2.py) copies each gradient into its bucket's staging buffer,
allocated when the bucket's first gradient arrives and freed once its reduce is summed; at most
MAX_BUCKETS_IN_FLIGHT reduces are outstanding, and launching one more first waits for the oldest.
The optimizer cuts its buckets with cut_buckets (workers/zero/buckets.py); Staging plays its buffers
for the planner, in a trace of a stage-2 step (workers/models/grad_buckets.py) and in the built-in
models' closed forms (workers/memory/specs.py): plan and allocation cut in one place.

Standard library only, as workers/memory/model.py, which plans with it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

MAX_BUCKETS_IN_FLIGHT = 2
"""Buckets whose reduce may be outstanding at once: launching one more first waits for the oldest, so
a rank's gradient memory during backward is bounded by the buckets in flight and the ones filling
(one a flat buffer, where backward runs through each buffer's parameters in reverse), not the whole
model's gradient."""

MIB = 2**20
"""bucket_cap_mb is in MiB, as DDP's."""

DEFAULT_BUCKET_CAP_MB = 25.0
"""Largest gradient bucket of ZeRO1AdamW's overlapped reduce and of stage 2's, MiB (as DDP's
bucket_cap_mb); a job's default (workers/limits.py takes it from here)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketCut:
    """A run of whole parameters of one flat buffer: its parameters [first, first + num_params) and
    their elements [lo, hi) in the buffer."""

    first: int
    num_params: int
    lo: int
    hi: int


def cap_numel(bucket_cap_mb: float, *, bytes_per_element: int) -> int:
    """Elements of a bucket of at most bucket_cap_mb MiB (a larger parameter is a bucket of its own)."""
    return max(1, int(bucket_cap_mb * MIB) // bytes_per_element)


def cut_buckets(numels: Sequence[int], *, cap: int) -> list[BucketCut]:
    """The buckets of one flat buffer whose parameters hold `numels` elements, back to back: runs of
    whole parameters of at most `cap` elements (a larger parameter alone), from the buffer's end, the
    order in which backward produces the gradients."""
    offsets = [0]
    for numel in numels:
        offsets.append(offsets[-1] + numel)
    cuts = []
    last = None  # the index of the bucket's last parameter
    for index in reversed(range(len(numels))):
        if last is not None and offsets[last + 1] - offsets[index] > cap:
            cuts.append(
                BucketCut(first=index + 1, num_params=last - index, lo=offsets[index + 1], hi=offsets[last + 1])
            )
            last = None
        if last is None:
            last = index
    if last is not None:
        cuts.append(BucketCut(first=0, num_params=last + 1, lo=0, hi=offsets[last + 1]))
    return cuts


def staging_bound_numel(group_numels: Sequence[int], *, cap: int) -> int:
    """The most elements of staging buffers a rank can hold at once, knowing only each flat buffer's
    size: the buckets in flight and one filling each buffer, each at most a cap, and never more than
    the whole gradient (a bucket holds whole parameters: one larger than the cap exceeds this)."""
    groups = [n for n in group_numels if n]
    return min(sum(groups), (MAX_BUCKETS_IN_FLIGHT + len(groups)) * cap)


class Staging:
    """GradientShards' staging buffers over one backward, counted in bytes (live_bytes, peak_bytes).

    A bucket's buffer is allocated when its first gradient is staged; a bucket whose gradients have
    all arrived is launched, and launching one while MAX_BUCKETS_IN_FLIGHT are outstanding first
    finishes the oldest, which frees its buffer; the backward's end launches the buckets that got no
    gradient (each with a zeroed buffer) and finishes every reduce. Buckets launch as they fill:
    gloo's tagged sends go so, and a collective goes in rank 0's fill order after the first backward.

    `buffers` lists each flat buffer's parameters' elements in its layout order; a parameter is named
    by (buffer, index). bytes_per_element: of every buffer, or of each (one a dtype)."""

    def __init__(
        self, buffers: Sequence[Sequence[int]], *, bytes_per_element: int | Sequence[int], bucket_cap_mb: float
    ) -> None:
        if isinstance(bytes_per_element, int):
            bytes_per_element = [bytes_per_element] * len(buffers)
        self.bucket_of: dict[tuple[int, int], int] = {}
        self.nbytes: list[int] = []
        self.num_params: list[int] = []
        for buffer, (numels, element) in enumerate(zip(buffers, bytes_per_element, strict=True)):
            for cut in cut_buckets(numels, cap=cap_numel(bucket_cap_mb, bytes_per_element=element)):
                for index in range(cut.first, cut.first + cut.num_params):
                    self.bucket_of[(buffer, index)] = len(self.nbytes)
                self.nbytes.append((cut.hi - cut.lo) * element)
                self.num_params.append(cut.num_params)
        self.arrived = [0] * len(self.nbytes)
        self.allocated = [False] * len(self.nbytes)
        self.launched = [False] * len(self.nbytes)
        self.in_flight: deque[int] = deque()
        self.live_bytes = 0
        self.peak_bytes = 0

    def stage(self, buffer: int, index: int) -> None:
        """A parameter's gradient arrives: its bucket's buffer is allocated if this is its first."""
        self._allocate(self.bucket_of[(buffer, index)])

    def staged(self, buffer: int, index: int) -> None:
        """The gradient is in its bucket (and dropped): a bucket it completes is launched."""
        bucket = self.bucket_of[(buffer, index)]
        self.arrived[bucket] += 1
        if self.arrived[bucket] == self.num_params[bucket]:
            self._launch(bucket)

    def end(self) -> None:
        """The backward ended: the buckets not launched go (zeroed), and every reduce is finished."""
        for bucket, launched in enumerate(self.launched):
            if not launched:
                self._launch(bucket)
        while self.in_flight:
            self._free(self.in_flight.popleft())
        self.arrived = [0] * len(self.nbytes)
        self.launched = [False] * len(self.nbytes)

    def _allocate(self, bucket: int) -> None:
        if not self.allocated[bucket]:
            self.allocated[bucket] = True
            self.live_bytes += self.nbytes[bucket]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _launch(self, bucket: int) -> None:
        self._allocate(bucket)
        self.launched[bucket] = True
        while len(self.in_flight) >= MAX_BUCKETS_IN_FLIGHT:
            self._free(self.in_flight.popleft())
        self.in_flight.append(bucket)

    def _free(self, bucket: int) -> None:
        self.allocated[bucket] = False
        self.live_bytes -= self.nbytes[bucket]

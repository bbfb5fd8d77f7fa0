"""Stage2Schedule: a ZeRO stage-2 rank's gradient buckets played on a model without an optimizer, so
that the planner's traces count a stage-2 step as a rank holds it (workers/models/trace.py).

workers/zero/stage2.py's GradientShards copies each gradient, once autograd has accumulated it, into
its bucket's staging buffer and drops it (param.grad = None); workers/memory/buckets.py's Staging
says when those buffers are allocated and freed, over the buckets the optimizer cuts from its flat
buffers: decayed matrices, then the rest (decay_param_groups), each split by dtype.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from workers.memory.buckets import Staging
from workers.models.units import Meter


def flat_buffers(model: nn.Module) -> list[list[nn.Parameter]]:
    """The trainable parameters of each of the optimizer's flat buffers, in its order: decayed (2 or more
    dimensions), then the rest, each split by dtype (workers/zero/flat.py build_buffers)."""
    trainable = [p for p in model.parameters() if p.requires_grad]  # a tied tensor once
    buffers = []
    for group in ([p for p in trainable if p.dim() >= 2], [p for p in trainable if p.dim() < 2]):
        by_dtype: dict = {}
        for param in group:
            by_dtype.setdefault(param.dtype, []).append(param)
        buffers.extend(by_dtype.values())
    return buffers


class Stage2Schedule:
    """GradientShards' staging buffers during one micro-batch's backward, told to a meter's hold(nbytes).

    The peers' receive buffers of gloo's point-to-point reduce are not played: they depend on N and the
    rank, and NCCL's reduce has none (docs/memory-model.md)."""

    def __init__(self, model: nn.Module, meter: Meter, *, bucket_cap_mb: float) -> None:
        self.meter = meter
        self.buffers = flat_buffers(model)
        self.staging = Staging(
            [[p.numel() for p in params] for params in self.buffers],
            bytes_per_element=[params[0].element_size() for params in self.buffers],
            bucket_cap_mb=bucket_cap_mb,
        )
        self.slot = {id(p): (b, i) for b, params in enumerate(self.buffers) for i, p in enumerate(params)}
        self._handles: list = []

    def keeps_grad(self, param: Tensor) -> bool:
        """Whether the schedule takes param's gradient (into its bucket), so that it never becomes a state."""
        return id(param) in self.slot

    def __enter__(self) -> Stage2Schedule:
        for params in self.buffers:
            self._handles.extend(p.register_post_accumulate_grad_hook(self._grad_ready) for p in params)
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._told(self.staging.end)

    def _grad_ready(self, param: Tensor) -> None:
        slot = self.slot[id(param)]
        self._told(lambda: self.staging.stage(*slot))
        param.grad = None  # copied into its staging buffer: the full gradient is freed
        self._told(lambda: self.staging.staged(*slot))

    def _told(self, change: Callable[[], None]) -> None:
        """Run a change of the staging buffers and tell the meter the bytes it allocated or freed."""
        before = self.staging.live_bytes
        change()
        self.meter.hold(self.staging.live_bytes - before)

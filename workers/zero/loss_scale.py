"""fp16 dynamic loss scaling: the loss is multiplied before backward so that small gradients stay
representable in fp16, and the step divides it out again (workers/zero/optimizer.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class DynamicLossScaler:
    """fp16 loss scaling: halve on overflow, grow after `growth_interval` clean steps."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    clean_steps: int = 0

    def __post_init__(self) -> None:
        if not (self.min_scale > 0 and self.scale >= self.min_scale):
            raise ValueError(f"loss scale ({self.scale}) must be >= min_scale ({self.min_scale}) > 0")
        if self.growth_factor <= 1 or not 0 < self.backoff_factor < 1 or self.growth_interval < 1:
            raise ValueError(
                f"need growth_factor ({self.growth_factor}) > 1, 0 < backoff_factor ({self.backoff_factor}) < 1, "
                f"growth_interval ({self.growth_interval}) >= 1"
            )

    def update(self, *, overflow: bool) -> None:
        if overflow:
            if self.scale <= self.min_scale:
                raise FloatingPointError(
                    f"fp16 gradients overflow even at the minimum loss scale ({self.min_scale}): "
                    "the loss or the gradients are inf/nan; lower the learning rate or use bf16"
                )
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])

"""The learning rate of a step: a pure function of the step, so that a retry, a resize or a
preemption resumes on exactly the rate an uninterrupted run would use (ScheduleSpec).

With `lr` the peak and step s counted from 0 over `steps` S, warmup W and r = min_lr_ratio:
lr·(s + 1)/W for s < W; then, with p = (s − W)/max(1, S − W), constant stays at lr, linear is
lr − (lr − r·lr)·p, cosine is r·lr + (lr − r·lr)·(1 + cos(π·p))/2; wsd holds lr through step S − D
and decays linearly from there to r·lr at S − 1 (D = decay_steps; D = 1: r·lr at the last step).
"""

from __future__ import annotations

import math

from workers.config import ScheduleSpec


def lr_at(step: int, *, lr: float, steps: int, schedule: ScheduleSpec) -> float:
    """The learning rate step `step` (0-based) of a `steps`-step run trains with."""
    warmup = schedule.warmup_steps
    floor = lr * schedule.min_lr_ratio
    if step < warmup:
        return lr * (step + 1) / warmup
    if schedule.kind == "constant":
        return lr
    if schedule.kind == "wsd":  # lr through step S − D, then linear to r·lr at S − 1
        start = steps - schedule.decay_steps
        decay = schedule.decay_steps
        if step < start or (step == start and decay > 1):
            return lr
        return lr - (lr - floor) * ((step - start) / (decay - 1) if decay > 1 else 1.0)
    progress = (step - warmup) / max(1, steps - warmup)
    if schedule.kind == "linear":
        return lr - (lr - floor) * progress
    return floor + (lr - floor) * (1 + math.cos(math.pi * progress)) / 2

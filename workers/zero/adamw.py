"""AdamW on one rank's shard of a flat buffer (workers/zero/flat.py): beats 2 and 3 of ZeRO1AdamW's step.

torch's fused AdamW kernel runs over ranges of the fp32 shard, then the shard is
cast to the model dtype. A 16-bit gradient is upcast a chunk at a time into one
reused fp32 scratch, both for the kernel and for the gradient norm's Σ g², so
neither makes a full-size temporary.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from workers.zero.flat import FlatBuffer

# 16-bit gradients are upcast to fp32 this many elements at a time into one reused scratch: on a CPU
# 64 Ki (256 KiB, it stays in cache; a full-size upcast costs ~5x the time, mostly in page faults);
# on a GPU 4 Mi, few enough kernel launches
UPCAST_CHUNK_NUMEL = {"cpu": 1 << 16, "cuda": 1 << 22}


def check_hyperparameters(*, lr, betas, eps, weight_decay) -> None:
    """ValueError naming the first of AdamW's hyperparameters out of its range (torch.optim.AdamW's checks)."""
    if not (isinstance(lr, Tensor) or lr >= 0):
        raise ValueError(f"lr must be >= 0, got {lr}")
    if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
        raise ValueError(f"betas must be in [0, 1), got {tuple(betas)}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")


def step_runs(buf: FlatBuffer, active: list[bool]) -> list[tuple[int, int, int]]:
    """(lo, hi, step) ranges of the shard to update, after counting this step.

    torch.optim.AdamW skips a parameter without a gradient and counts
    steps per parameter; so do we. In the common case (every parameter
    stepped, equal counts) this is one range over the whole shard.
    """
    stepped = [slot for slot in buf.slots if active[slot.index]]
    for slot in stepped:
        slot.step += 1
    if len(stepped) == len(buf.slots) and len({slot.step for slot in buf.slots}) == 1:
        return [(0, buf.shard_numel, buf.slots[0].step)] if buf.slots else []
    runs: list[tuple[int, int, int]] = []
    for slot, lo, hi in buf.local_segments():
        if not active[slot.index]:
            continue
        if runs and runs[-1][1] == lo and runs[-1][2] == slot.step:
            runs[-1] = (runs[-1][0], hi, slot.step)
        else:
            runs.append((lo, hi, slot.step))
    return runs


class ShardAdamW:
    """The fused AdamW kernel and Σ g² over this rank's shards, in fp32, with one upcast scratch."""

    def __init__(self, device: torch.device):
        self.device = device
        self.upcast_chunk = UPCAST_CHUNK_NUMEL.get(device.type, UPCAST_CHUNK_NUMEL["cuda"])
        self._scratch: Tensor | None = None  # fp32 upcast of a 16-bit gradient chunk

    def sum_of_squares(self, grad: Tensor) -> Tensor:
        """Σ g² in fp32. A 16-bit gradient is upcast a chunk at a time into the scratch on a CPU
        (vector_norm(dtype=float32) there takes ~5x as long); on a GPU vector_norm upcasts as it reads."""
        if grad.dtype == torch.float32 or self.device.type != "cpu":
            return torch.linalg.vector_norm(grad, dtype=torch.float32).square()
        total = torch.zeros((), dtype=torch.float32, device=grad.device)
        scratch = self._upcast_scratch()
        for a in range(0, grad.numel(), self.upcast_chunk):
            chunk = scratch[: min(self.upcast_chunk, grad.numel() - a)].copy_(grad[a : a + self.upcast_chunk])
            total += torch.dot(chunk, chunk)
        return total

    def update_slice(
        self,
        buf: FlatBuffer,
        group: dict[str, Any],
        runs: list[tuple[int, int, int]],
        lo: int,
        hi: int,
        *,
        grad_scale: Tensor,
    ) -> None:
        """The fused AdamW kernel over [lo, hi) of the shard, then the cast to the model dtype."""
        master = buf.state_of("master")
        grad = buf.grad_shard
        upcast = grad.dtype != torch.float32
        for run_lo, run_hi, step in runs:
            run_lo = max(run_lo, lo)
            run_hi = min(run_hi, hi)
            if run_lo >= run_hi:
                continue
            step_t = torch.tensor(float(step), dtype=torch.float32, device=self.device)
            # the fused kernel wants one dtype: a 16-bit gradient is upcast a cache-sized chunk at a
            # time into one reused scratch, so the update makes no full-size temporary
            chunk = self.upcast_chunk if upcast else run_hi - run_lo
            for a in range(run_lo, run_hi, chunk):
                b = min(a + chunk, run_hi)
                g = self._upcast_scratch()[: b - a].copy_(grad[a:b]) if upcast else grad[a:b]
                torch._fused_adamw_(
                    [master[a:b]],
                    [g],
                    [buf.state["exp_avg"][a:b]],
                    [buf.state["exp_avg_sq"][a:b]],
                    [],
                    [step_t],
                    lr=group["lr"],
                    beta1=group["betas"][0],
                    beta2=group["betas"][1],
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    amsgrad=False,
                    maximize=False,
                    grad_scale=grad_scale,
                    found_inf=None,
                )
        if "master" in buf.state:
            buf.param_shard()[lo:hi].copy_(buf.state["master"][lo:hi])  # cast: fp32 shard -> model dtype

    def _upcast_scratch(self) -> Tensor:
        if self._scratch is None:
            self._scratch = torch.empty(self.upcast_chunk, dtype=torch.float32, device=self.device)
        return self._scratch

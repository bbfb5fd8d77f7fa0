"""ZeRO Stage 3 on torch's FSDP2: the parameters sharded too.

shard_model() applies torch.distributed.fsdp.fully_shard to each unit (a transformer block; the
units of each model family are units_of()'s) and then to the root, over the data-parallel group.
Each rank then keeps its dim-0 shard of every parameter, in fp32: for a 16-bit model a
MixedPrecisionPolicy gathers each unit's parameters cast to the model dtype for its forward (and
again for its backward, reshard_after_forward) and reduce-scatters its gradients in fp32, so the
shards are the fp32 master copy. Per rank: parameters 4Ψ/N, gradients 4Ψ/N, AdamW's state 8Ψ/N:
16Ψ/N, the memory model's (p + g + K)·Ψ/N at stage 3 (workers/memory/model.py), plus one unit
gathered at a time.

ZeRO3AdamW is torch's AdamW on those shards with what ZeRO1AdamW adds around it: the global
gradient norm from one all-reduce of the shards' sums of squares, clipping by it, fp16 dynamic loss
scaling (a non-finite norm skips the step on every rank and backs the scale off), and micro-batch
accumulation by one backward each (each reduce-scatters into the sharded gradient, as stage 2's
buckets do: no_sync() holds nothing back). Its checkpoints are stage 1's format
(workers/zero/stage3_checkpoints.py), so a job resumes at another stage and N.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from workers import phases
from workers.memory.model import SHARD_ALIGNMENT_NUMEL
from workers.models.units import units_of
from workers.zero.loss_scale import DynamicLossScaler
from workers.zero.stage3_checkpoints import Stage3Checkpoints

_CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s, as ZeRO1AdamW's


def mesh_of(process_group: dist.ProcessGroup | None, device: torch.device) -> DeviceMesh:
    """The 1-D device mesh of the data-parallel group (the default group when None)."""
    group = process_group if process_group is not None else dist.group.WORLD
    return DeviceMesh.from_group(group, device.type)


def shard_model(
    model: nn.Module,
    *,
    compute_dtype: torch.dtype,
    process_group: dist.ProcessGroup | None = None,
    units: Iterable[nn.Module] | None = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """`model` (its parameters in fp32: the master copy) sharded in place over the group, computing in
    `compute_dtype`; returns it."""
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError("stage 3 shards an fp32 model (the master copy): build it in fp32, compute_dtype casts")
    device = next(model.parameters()).device
    policy = MixedPrecisionPolicy(
        param_dtype=None if compute_dtype == torch.float32 else compute_dtype, reduce_dtype=torch.float32
    )
    options = {"mesh": mesh_of(process_group, device), "mp_policy": policy}
    for unit in units_of(model) if units is None else units:
        fully_shard(unit, reshard_after_forward=reshard_after_forward, **options)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **options)
    return model


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class ZeRO3AdamW(Stage3Checkpoints, torch.optim.AdamW):
    """AdamW on the shards of a model shard_model() has sharded: clipping across the shards, fp16 loss
    scaling, accumulation by one backward per micro-batch (module docstring).

    `compute_dtype` is the dtype the model computes in (shard_model's): fp16 scales the loss
    (loss_scaler "auto")."""

    stage = 3

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        compute_dtype: torch.dtype = torch.float32,
        process_group: dist.ProcessGroup | None = None,
        max_grad_norm: float | None = None,
        loss_scaler: DynamicLossScaler | None | Literal["auto"] = "auto",
    ):
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=True)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(process_group) if dist.is_initialized() else 0
        self.alignment_numel = SHARD_ALIGNMENT_NUMEL
        self.device = _local(self.param_groups[0]["params"][0]).device
        self.max_grad_norm = max_grad_norm
        if loss_scaler == "auto":
            loss_scaler = DynamicLossScaler() if compute_dtype == torch.float16 else None
        self.loss_scaler = loss_scaler
        self.grad_norm: float | None = None
        self.skipped = False

    @property
    def loss_scale(self) -> float:
        return 1.0 if self.loss_scaler is None else self.loss_scaler.scale

    def scale_loss(self, loss: Tensor) -> Tensor:
        """The loss to call backward() on: multiplied by the loss scale under fp16."""
        return loss if self.loss_scaler is None else loss * self.loss_scaler.scale

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield  # every backward reduce-scatters into the sharded gradient: nothing to hold back

    def _grads(self) -> list[Tensor]:
        return [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]

    @torch.no_grad()
    def step(self, closure=None, *, also_sum: Tensor | None = None):
        """Unscale, clip by the global norm, step; or skip it on every rank when the norm is not finite.
        also_sum: fp32 values summed over the ranks in place by the norm's all-reduce (ZeRO1AdamW.step)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = self._grads()
        device = grads[0].device if grads else torch.device("cpu")
        extra = 0 if also_sum is None else also_sum.numel()
        stats = torch.zeros(1 + extra, dtype=torch.float32, device=device)
        for grad in grads:
            stats[0] += _local(grad).float().square().sum()
        if also_sum is not None:
            stats[1:] = also_sum.reshape(-1)
        if self.world_size > 1:
            phases.enter("all_reduce")
            dist.all_reduce(stats, group=self.process_group)
        if also_sum is not None:
            also_sum.copy_(stats[1:].view_as(also_sum))
        scale = self.loss_scale
        self.grad_norm = math.sqrt(stats[0].item()) / scale  # inf and nan pass through
        self.skipped = not math.isfinite(self.grad_norm)
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow=self.skipped)
        if self.skipped:
            return loss
        clip = 1.0
        if self.max_grad_norm is not None:
            clip = min(1.0, self.max_grad_norm / (self.grad_norm + _CLIP_EPS))
        if clip != 1.0 or scale != 1.0:
            torch._foreach_mul_([_local(g) for g in grads], clip / scale)
        phases.enter("update")
        super().step()
        return loss

    def model_state_bytes(self) -> int:
        """Bytes this rank keeps between steps: its shards of the parameters, the gradients and the state."""
        tensors = [p for group in self.param_groups for p in group["params"]]
        tensors += self._grads()
        tensors += [t for state in self.state.values() for t in state.values() if isinstance(t, Tensor) and t.dim()]
        return sum(_local(t).numel() * _local(t).element_size() for t in tensors)

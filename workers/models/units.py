"""A model's units at ZeRO stage 3: the modules FSDP2 shards one by one before the root
(workers/zero/stage3.py), the parameters a rank holds whole at once beside its shards (a closed
form's count), and Stage3Schedule, which plays FSDP2's gathers and frees on a model that is not
sharded, so that the planner's traces count a stage-3 step as a rank holds it (workers/models/trace.py);
and storage_resizes, which tells a counting meter of FSDP2's own gathers and frees on a sharded one.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten


class Meter(Protocol):
    """What Stage3Schedule tells: bytes held beyond what ops made, and a tensor no longer counted."""

    def hold(self, nbytes: int) -> None: ...

    def ignore(self, tensor: Tensor) -> None: ...

    def resized(self, storage: torch.UntypedStorage) -> None: ...


GATHERED_UNITS = 2
"""Units a stage-3 rank holds gathered at once: the one running and the next, which FSDP2 prefetches."""


def units_of(model: nn.Module) -> list[nn.Module]:
    """The modules sharded one by one before the root: a transformer's blocks (the built-in GPT's
    transformer.h; an hf model's lm.model.layers (Llama, Mistral, Qwen) or lm.transformer.h (GPT-2);
    the built-in MLP's layers), else the root's children that hold parameters and share none with
    another child (a tied embedding and head stay in the root's unit)."""
    for path in ("transformer.h", "lm.model.layers", "lm.transformer.h", "model.layers", "layers"):
        blocks = model.get_submodule(path) if _has_submodule(model, path) else None
        if isinstance(blocks, nn.ModuleList):
            return list(blocks)
    owners: dict[int, int] = {}
    for child in model.children():
        for param in child.parameters():
            owners[id(param)] = owners.get(id(param), 0) + 1
    return [
        child
        for child in model.children()
        if any(True for _ in child.parameters()) and all(owners[id(p)] == 1 for p in child.parameters())
    ]


def _has_submodule(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def gathered_numel(model: nn.Module) -> int:
    """Parameters a stage-3 rank holds whole at once: the root's (those in no unit, gathered for the
    whole step) and its GATHERED_UNITS largest units; each tensor once (a tied weight is one)."""
    units = units_of(model)
    in_units = {id(p) for unit in units for p in unit.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_units)
    largest = sorted((sum(p.numel() for p in unit.parameters()) for unit in units), reverse=True)
    return root + sum(largest[:GATHERED_UNITS])


class Stage3Schedule:
    """FSDP2's gathers and frees during one micro-batch (workers/zero/stage3.py shards each unit with
    reshard_after_forward, and the root), played on a model that is not sharded, for a meter with
    hold(nbytes) and ignore(tensor) (workers/models/trace.py's LiveBytes) to count: the root's
    parameters held for the whole step; a unit's gathered in its forward and freed after the next
    unit's (as a GPU frees it, in stream order); in backward a unit gathered again with the next one
    to run (FSDP2's prefetch) and, at its end, freed with its unsharded gradients (reduce-scattered
    into their shards, a state)."""

    def __init__(self, model: nn.Module, meter: Meter) -> None:
        self.meter = meter
        self.units = units_of(model)
        self.params = [_unique(unit.parameters()) for unit in self.units]
        in_units = {id(p) for params in self.params for p in params}
        self.root_bytes = _nbytes(p for p in _unique(model.parameters()) if id(p) not in in_units)
        self.unit_params = {id(p) for params in self.params for p in params}
        self._gathered = [False] * len(self.units)
        self._backward = [False] * len(self.units)  # its backward has begun and not ended
        self._handles: list = []

    def keeps_grad(self, param: Tensor) -> bool:
        """Whether param's gradient stays unsharded (counted) until its unit's backward ends."""
        return id(param) in self.unit_params

    def __enter__(self) -> Stage3Schedule:
        self.meter.hold(self.root_bytes)
        for index, unit in enumerate(self.units):
            self._handles.append(unit.register_forward_pre_hook(self._pre_forward(index), with_kwargs=True))
            self._handles.append(unit.register_forward_hook(self._post_forward(index)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        for index in range(len(self.units)):
            self._end_backward(index)
            self._free(index)
        self.meter.hold(-self.root_bytes)

    def _pre_forward(self, index: int):
        def hook(module, args, kwargs):
            self._gather(index)
            if self._backward[index]:  # recomputed in its backward (activation checkpointing)
                return
            first = _first_grad_tensor((args, kwargs))
            if first is not None:  # the gradient of the unit's input: its backward is done
                first.register_hook(lambda grad: self._end_backward(index))

        return hook

    def _post_forward(self, index: int):
        def hook(module, args, output):
            if self._backward[index]:  # recomputed in its backward: FSDP2 keeps it gathered
                return
            # FSDP2 frees a unit after its forward; on a GPU its memory returns in stream order, once
            # the kernels that read it have run: counted here as held until the next unit's are done
            self._free(index - 1)
            first = _first_grad_tensor(output)
            if first is not None:  # the gradient of the unit's output: its backward begins
                first.register_hook(lambda grad: self._begin_backward(index))

        return hook

    def _begin_backward(self, index: int) -> None:
        # FSDP2 ends the later unit's backward before this one's output gradient is complete
        for later in range(index + 1, len(self.units)):
            self._end_backward(later)
        self._backward[index] = True
        self._gather(index)
        self._gather(index - 1)  # prefetched

    def _end_backward(self, index: int) -> None:
        if not self._backward[index]:
            return
        self._backward[index] = False
        self._free(index)
        for param in self.params[index]:
            if param.grad is not None:
                self.meter.ignore(param.grad)

    def _gather(self, index: int) -> None:
        if index >= 0 and not self._gathered[index]:
            self._gathered[index] = True
            self.meter.hold(_nbytes(self.params[index]))

    def _free(self, index: int) -> None:
        if index >= 0 and self._gathered[index]:
            self._gathered[index] = False
            self.meter.hold(-_nbytes(self.params[index]))


def _unique(params) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for param in params:
        seen.setdefault(id(param), param)
    return list(seen.values())


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _first_grad_tensor(tree) -> Tensor | None:
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, Tensor) and leaf.requires_grad:
            return leaf
    return None


@contextlib.contextmanager
def storage_resizes(meter: Meter) -> Iterator[None]:
    """FSDP2 (ZeRO stage 3) frees a unit's gathered parameters by resizing their storages to 0 bytes and
    gathers the unit again into the same storages: no op the dispatch mode sees. Its two functions that
    do so (torch 2.13, `_fully_shard/_fsdp_param.py`, called through the module's globals) are wrapped
    to tell `meter` while it counts; without them a step would count every unit gathered at once."""
    fsdp_param = sys.modules.get("torch.distributed.fsdp._fully_shard._fsdp_param")
    if fsdp_param is None:  # FSDP2 never imported: nothing resizes
        yield
        return
    alloc = fsdp_param.alloc_storage
    free = fsdp_param.free_storage

    def told(resize: Callable[[Tensor], None]) -> Callable[[Tensor], None]:
        def call(tensor: Tensor) -> None:
            resize(tensor)
            meter.resized(tensor.untyped_storage())

        return call

    fsdp_param.alloc_storage = told(alloc)
    fsdp_param.free_storage = told(free)
    try:
        yield
    finally:
        fsdp_param.alloc_storage = alloc
        fsdp_param.free_storage = free

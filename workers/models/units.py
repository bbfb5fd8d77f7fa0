"""A model's units at ZeRO stage 3: the modules FSDP2 shards one by one before the root
(workers/zero/stage3.py), and the parameters a rank holds whole at once beside its shards, which
the planner's traces count (workers/models/trace.py).
"""

from __future__ import annotations

from torch import nn

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

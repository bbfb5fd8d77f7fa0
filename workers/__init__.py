"""Training workers: the memory model, the ZeRO-1 optimizer, models, data and Ray actors.

`workers.memory` loads with the standard library alone, so this package
imports nothing eagerly; `from workers import ZeRO1AdamW` loads torch then.
"""

from __future__ import annotations

from typing import Any

_LAZY = {"ZeRO1AdamW": "workers.optim", "DynamicLossScaler": "workers.loss_scale"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'workers' has no attribute {name!r}")

"""The workers: what a rank runs, and the memory model the control plane plans with. Its packages,
each opened by what it holds and what it may import, from the bottom up:

    memory/              the ZeRO memory model and the built-in models' closed forms (standard library only)
    config, limits,      what a job asks of the workers and what its ranks report: the contract with
    records              the control plane (standard library only)
    reach                which directory stops a uid on its way to a file (standard library only)
    phases               where a rank is in its step, and when its parent calls it hung (records only)
    health               a rank's test for a diverged run: a loss spike, a non-finite run (standard library only)
    zero/                ZeRO1AdamW: flat layout, sharded AdamW, collectives, loss scale, checkpoint formats
    data/                seeded sources, tokenized datasets, their files and digests
    models/              the built-in GPT and MLP, Hugging Face models, a user's code, the tracer
    training/            one rank's loop, its checkpoints' layout, the final model
    runtime/             the processes on top: Ray actors, the untrusted child a rank trains in, tasks
    containment          the keeper between a parent and its child: a PID namespace or a subreaper, so
                         that every process a child starts ends with it (standard library only)

This package imports nothing eagerly (`workers.memory` loads without torch); `from workers import
ZeRO1AdamW` loads torch then.
"""

from __future__ import annotations

from typing import Any

_LAZY = {"ZeRO1AdamW": "workers.zero.optimizer", "DynamicLossScaler": "workers.zero.loss_scale"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'workers' has no attribute {name!r}")

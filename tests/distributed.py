"""Run a function on N ranks in N processes (torch.multiprocessing, spawn; gloo by default)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, backend: str, init_file: str, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)  # N ranks share this machine's cores
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        # gloo aborts a process ("terminate called without an active exception") when a peer
        # tears its pairs down while this rank's are still in use: leave together
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable, *args, backend: str = "gloo") -> None:
    """fn(rank, world_size, *args) on every rank; re-raises the first rank's failure."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_entry, args=(world_size, backend, init_file, fn, args), nprocs=world_size, join=True)

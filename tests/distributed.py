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
        leave_together(world_size)
    finally:
        dist.destroy_process_group()


def leave_together(world_size: int) -> None:
    """gloo aborts a process ("terminate called without an active exception") when a peer tears
    its pairs down while this rank's are still in use. A gloo barrier alone leaves a window: a rank
    may return from it while a peer is still finishing it. The store's counter closes it: once it
    reaches world_size, every rank has finished every gloo operation."""
    dist.barrier()
    store = dist.distributed_c10d._get_default_store()
    if store.add("left", 1) == world_size:  # the last one to finish lets everyone go
        store.set("all-left", "1")
    store.wait(["all-left"])


def run_ranks(world_size: int, fn: Callable, *args, backend: str = "gloo") -> None:
    """fn(rank, world_size, *args) on every rank; re-raises the first rank's failure."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_entry, args=(world_size, backend, init_file, fn, args), nprocs=world_size, join=True)

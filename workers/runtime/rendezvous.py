"""How a job's ranks find each other: rank 0's parent holds the store, every rank's child joins
the process group over it. No Ray here: the child that trains imports this room, never Ray's."""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any


def open_rendezvous_store(host: str, *, world_size: int) -> Any:
    """Rank 0's torch.distributed store, listening on a port the kernel picks (port 0).

    The port is held from the moment it is chosen until the store is dropped. The old way
    (bind port 0, close the socket, hand the number to init_process_group) left it free in
    between, for any process to take: then every rank's init failed with EADDRINUSE. Retrying
    would need every rank to agree on a new port; holding it needs nothing. wait_for_workers=False:
    the store is opened before the ranks start, and they connect in init."""
    import torch.distributed as dist

    return dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False)


def join_process_group(*, rank: int, world_size: int, address: str, port: int, store: Any, timeout_s: float) -> None:
    """init_process_group over rank 0's store: pass the store where this process holds it, else
    None to connect to address:port (a rank's child, rank 0's too, connects to its parent's).
    NCCL when this process sees CUDA, else gloo: never decided from Ray's GPU ids, since a logical
    GPU has no CUDA behind it."""
    import torch
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
    else:
        store.set_timeout(timeout)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def parent_gone() -> Callable[[], bool]:
    """A check, cheap enough for every step, that this process's parent has exited since the
    call (the process was re-parented). A Ray worker's parent is its node's raylet: when a
    service with an embedded Ray is killed, the raylet dies at once but the core worker only
    notices seconds later, and meanwhile its loop would go on training and writing
    checkpoints that the restarted service is reading to relaunch the job. A rank's child asks
    the same of the Ray worker that started it."""
    parent = os.getppid()
    return lambda: os.getppid() != parent

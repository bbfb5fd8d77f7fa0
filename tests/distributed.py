"""Run a function on N ranks in N processes (torch.multiprocessing, forkserver; gloo by default).

forkserver rather than spawn: the server imports torch and the optimizer's modules once, and each
rank is a fork of it. A spawned rank imported torch again (about 2 s of CPU on these machines, more
than most of the tests' ranks compute), and the suite starts dozens of them. Forking pytest
itself (fork) is not safe: it runs Ray's threads."""

from __future__ import annotations

import json
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from workers.config import OptimizerSpec, TrainConfig
from workers.memory.model import GPTSpec

PRELOAD = [
    "pytest",
    "torch",
    "torch.testing",
    "torch.distributed",
    "torch._dynamo",  # loaded by torch.optim.AdamW's first add_param_group: the tests' reference optimizer
    "workers.zero.optimizer",
    "workers.zero.sharded_state",
    "workers.models.builtin",
    "transformers.modeling_utils",  # 2 s of CPU: once, not in every rank of an hf model
]
"""What the fork server imports before it forks a rank (what the ranks' functions import)."""
mp.set_forkserver_preload(PRELOAD)  # read when the server starts: at the first run_ranks

SMALL = GPTSpec(vocab_size=64, n_layer=2, n_head=2, n_embd=32, block_size=32)


def small_run(checkpoint_dir: str | Path, *, steps: int = 8, **overrides) -> TrainConfig:
    """SMALL for `steps` in fp32, global batches of 8 in micro-batches of 4 (2 ranks, or 1 accumulating),
    checkpointing into `checkpoint_dir`: the runs the checkpoint tests compare bit for bit."""
    values = {"precision": "fp32", "micro_batch_size": 4, "global_batch_size": 8, "optimizer": OptimizerSpec(lr=3e-3)}
    return TrainConfig(model=SMALL, steps=steps, checkpoint_dir=str(checkpoint_dir), **values | overrides)


def _entry(rank: int, world_size: int, backend: str, tmp: str, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)  # N ranks share this machine's cores
    dist.init_process_group(backend, init_method=f"file://{tmp}/init", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        Path(tmp, f"passed-{rank}").touch()  # every assertion of this rank held
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
    """fn(rank, world_size, *args) on every rank; re-raises the first rank's failure.

    A rank that gloo aborts (SIGABRT) while the group is torn down, after every rank's function
    returned, has failed nothing the test checks: a peer closed its connections first (seen
    about once a suite run on 2 loaded cores, after leave_together too). Any other failure,
    and an abort before every rank's function returned, is re-raised."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.start_processes(
                _entry, args=(world_size, backend, tmp, fn, args), nprocs=world_size, start_method="forkserver"
            )
        except mp.ProcessExitedException as exited:
            passed = all(Path(tmp, f"passed-{rank}").exists() for rank in range(world_size))
            if not (passed and exited.exit_code == -signal.SIGABRT):
                raise


def train_attempt(rank: int, world_size: int, root: str, stage: int, micro: int, stop_after, out: str) -> None:
    """One attempt of small_run through the training loop at ZeRO `stage` with micro-batches of `micro`,
    stopped with a checkpoint after step `stop_after` (None: to the end); rank 0 writes its
    [step, loss] rows to `out` as JSON."""
    from workers.training.loop import train  # the training loop's imports only in the ranks that train

    rows = []
    config = small_run(root, zero_stage=stage, micro_batch_size=micro)
    train(config, rank=rank, world_size=world_size, on_metrics=rows.append, stop_at=lambda step, _: step == stop_after)
    if rank == 0:
        Path(out).write_text(json.dumps([[row.step, row.loss] for row in rows]))

"""Checkpoints beside the step: how long a checkpoint holds the training thread up, and how fast it is
written, synchronous against asynchronous (workers/training/writer.py), on a directory and on an S3 server.

    .venv/bin/python benchmarks/checkpoint.py                              # docs/benchmarks.md's table
    .venv/bin/python benchmarks/checkpoint.py --checkpoints 2 --storages directory   # a quick look

Two ranks (spawned processes on gloo, one CPU thread each) each train a ZeRO1AdamW shard of a
GPT-2-small-shaped model (workers' built-in GPT at GPT-2 small's shape, 124M parameters, bf16
weights with fp32 master weights and moments: 12 bytes of checkpointed state a parameter), and
write --checkpoints checkpoints through CheckpointWriter in each mode and on each storage, with
real training steps (forward, backward, ZeRO-1 step) before each: --steps-between before a
synchronous one; before an asynchronous one enough for its write to end behind them (HIDE_FACTOR
times the synchronous write), as a checkpoint every few hundred steps does in a real run. Storages:

- directory: a checkpoint root both ranks share (rank 0 waits for the other rank's files, then
  writes complete.json);
- S3 server: moto's S3 server, started here on loopback and reached through the standard AWS_*
  variables; each rank writes into a spool of its own, and CheckpointIO.publish uploads each file
  with workers.training.storage's Store.put_file (rank 0's complete.json once the other rank's rows
  file is stored), then deletes it from the spool.

Per column, the median over the checkpoints of: the seconds save() held the training thread up
(the slower rank's), the seconds from the start of rank 0's write to its complete.json in the
storage (a background thread's when asynchronous), and the checkpoint's bytes (every shard) over
those seconds. The acceptance: asynchronous blocked time <= 10% of synchronous.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from workers.memory.model import GPTSpec
from workers.models.builtin import build_model
from workers.models.trace import loss_of
from workers.training.checkpoints import (
    COMPLETE,
    latest_checkpoint,
    prune_checkpoints,
    rows_name,
    shard_header,
    shard_name,
)
from workers.training.writer import CheckpointIO, CheckpointWriter, shared_directory
from workers.zero.optimizer import ZeRO1AdamW, decay_param_groups

GPT2_SMALL = GPTSpec(vocab_size=50257, n_layer=12, n_head=12, n_embd=768, block_size=1024)
WORLD_SIZE = 2
BUCKET = "zero1-bench"
TARGET_RATIO = 0.10
HIDE_FACTOR = 2.0
"""An asynchronous column's checkpoints are this many synchronous writes' time apart, at least: a step
is slower while a write competes with it for the CPU (two cores here, the S3 server on them too)."""
STORAGES = ("directory", "S3 server")
MB = 1e6


# --------------------------------------------------------------------------- storage


def s3_io(spool: Path, *, prefix: str, rank: int) -> CheckpointIO:
    """This rank's spool, each checkpoint's files uploaded to s3://BUCKET/prefix as they are written."""
    from workers.training.storage import open_store  # fsspec and s3fs: only for this column

    store = open_store(f"s3://{BUCKET}/{prefix}")

    def publish(step: int, files: list[Path]) -> None:
        for path in files:
            name = str(path.relative_to(spool))
            if path.name == COMPLETE:  # the checkpoint counts once every rank's files are stored
                peers = [rows_name(step, r, WORLD_SIZE) for r in range(1, WORLD_SIZE)]
                while not all(store.exists(peer) for peer in peers):
                    time.sleep(0.02)
            store.put_file(path, name)
            path.unlink()  # the publisher owns the spooled files
        if rank == 0:
            prune_checkpoints(store, keep_last=1)  # moto keeps what it stores: two checkpoints at most

    return CheckpointIO(latest=lambda: None, fetch=lambda name, ranges: spool / name, publish=publish)


# --------------------------------------------------------------------------- one rank


def run_rank(rank: int, world_size: int, init_file: str, out_file: str, scratch: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    model = build_model(GPT2_SMALL, dtype=torch.bfloat16, seed=0, compute_dtype=torch.float32)
    opt = ZeRO1AdamW(decay_param_groups(model, weight_decay=0.1), lr=1e-4)
    generator = torch.Generator().manual_seed(rank)
    results = {}
    for storage in args.storages:
        for asynchronous in (False, True):
            mode = "async" if asynchronous else "sync"
            steps_between = _steps_between(results.get(f"{storage}/sync"), args) if asynchronous else args.steps_between
            root = Path(scratch, f"{storage.split()[0]}-{mode}")
            spool = root / f"spool-{rank}"
            io = s3_io(spool, prefix=mode, rank=rank) if storage == "S3 server" else shared_directory(root)
            keep_last = 0 if io.publish else 2  # a spool's publisher prunes the store
            root = spool if io.publish else root
            writer = CheckpointWriter(opt, root=root, io=io, keep_last=keep_last, asynchronous=asynchronous)
            writes = _timed_writes(writer)
            blocked = []
            steps = []
            with writer:
                for checkpoint in range(args.checkpoints):
                    for _ in range(steps_between):
                        started = time.perf_counter()
                        _train_step(model, opt, generator, seq_len=args.seq_len)
                        steps.append(time.perf_counter() - started)
                    blocked.append(writer.save(checkpoint))
            shard_bytes = sum(4 * t.numel() for t in opt.owned_state().values())
            results[f"{storage}/{mode}"] = {
                "blocked_s": blocked,
                "write_s": writes,
                "step_s": steps,
                "steps_between": steps_between,
                "shard_bytes": shard_bytes,
            }
            dist.barrier()
    gathered = [None] * world_size
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(out_file).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


def _steps_between(sync: dict, args: argparse.Namespace) -> int:
    """Training steps before each asynchronous checkpoint: enough for the write to end behind them
    (HIDE_FACTOR times rank 0's synchronous write, in its synchronous steps), as a checkpoint every
    few hundred steps does in a real run; rank 0's count, on every rank."""
    need = [math.ceil(HIDE_FACTOR * statistics.median(sync["write_s"]) / statistics.median(sync["step_s"]))]
    dist.broadcast_object_list(need, src=0)
    return max(args.steps_between, need[0])


def _timed_writes(writer: CheckpointWriter) -> list[float]:
    """The seconds of each of the writer's writes (its files, then complete.json on rank 0), as they end:
    its _write, wrapped, whether the background thread or save() runs it."""
    seconds = []
    write = writer._write

    def timed(*args) -> None:
        started = time.perf_counter()
        write(*args)
        seconds.append(time.perf_counter() - started)

    writer._write = timed
    return seconds


def _train_step(model: torch.nn.Module, opt: ZeRO1AdamW, generator: torch.Generator, *, seq_len: int) -> None:
    tokens = torch.randint(0, GPT2_SMALL.vocab_size, (1, seq_len + 1), generator=generator)
    opt.scale_loss(loss_of(model(tokens[:, :-1], tokens[:, 1:]))).backward()
    opt.step()
    opt.zero_grad()


# --------------------------------------------------------------------------- the run and its table


def start_s3_server() -> object:
    """moto's S3 server on a free loopback port, the AWS_* variables pointing at it, the bucket made."""
    import boto3
    from moto.server import ThreadedMotoServer

    # a line per request otherwise, and a traceback for each retried CompleteMultipartUpload (botocore
    # retries it when moto answers late; the first one completed it): check_stored checks the result
    logging.getLogger("werkzeug").setLevel(logging.CRITICAL)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
        AWS_ACCESS_KEY_ID="zero1-bench",
        AWS_SECRET_ACCESS_KEY="zero1-bench-secret",
        AWS_REGION="us-east-1",
    )
    boto3.client("s3").create_bucket(Bucket=BUCKET)
    return server


def run(args: argparse.Namespace) -> list[dict]:
    """Both ranks' figures, each rank's by column."""
    server = start_s3_server() if "S3 server" in args.storages else None
    try:
        with tempfile.TemporaryDirectory(dir=args.scratch) as scratch:
            init_file = os.path.join(scratch, "init")
            out_file = os.path.join(scratch, "out.json")
            mp.spawn(run_rank, args=(WORLD_SIZE, init_file, out_file, scratch, args), nprocs=WORLD_SIZE, join=True)
            if server is not None:
                for mode in ("sync", "async"):
                    check_stored(mode, step=args.checkpoints - 1)
            return json.loads(Path(out_file).read_text())
    finally:
        if server is not None:
            server.stop()


def check_stored(prefix: str, *, step: int) -> None:
    """The S3 column's last checkpoint is complete in the store, each shard whole (its header's bytes)."""
    from workers.training.storage import open_store

    store = open_store(f"s3://{BUCKET}/{prefix}")
    assert latest_checkpoint(store) == (step, WORLD_SIZE), (prefix, latest_checkpoint(store))
    for rank in range(WORLD_SIZE):
        name = shard_name(step, rank, WORLD_SIZE)
        data_start, tensors, _ = shard_header(lambda a, b, name=name: store.read_range(name, a, b))
        assert store.size(name) == data_start + max(end for *_, end in tensors.values()), name


def columns(ranks: list[dict], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Per column: medians of the slower rank's blocked seconds and rank 0's write seconds; MB/s."""
    out = {}
    for column in ranks[0]:
        blocked = [max(values) for values in zip(*(rank[column]["blocked_s"] for rank in ranks), strict=True)]
        write_s = statistics.median(ranks[0][column]["write_s"])
        checkpoint_bytes = sum(rank[column]["shard_bytes"] for rank in ranks)
        out[column] = {
            "blocked_s": statistics.median(blocked),
            "blocked_max_s": max(blocked),
            "write_s": write_s,
            "step_s": statistics.median(ranks[0][column]["step_s"]),
            "steps_between": ranks[0][column]["steps_between"],
            "mb_per_s": checkpoint_bytes / MB / write_s,
            "checkpoint_mb": checkpoint_bytes / MB,
        }
    return out


def print_table(figures: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    names = list(figures)
    first = figures[names[0]]
    print(
        f"\n{GPT2_SMALL.num_params / 1e6:.1f}M parameters (GPT-2 small's shape), N = {WORLD_SIZE}, "
        f"{first['checkpoint_mb']:,.0f} MB a checkpoint ({first['checkpoint_mb'] / WORLD_SIZE:,.0f} MB a shard); "
        f"{args.checkpoints} checkpoints a column; medians\n"
    )
    print("| | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    rows = [
        ("training thread blocked, s (max)", lambda f: f"{f['blocked_s']:.3f} ({f['blocked_max_s']:.3f})"),
        ("write to complete.json, s", lambda f: f"{f['write_s']:.2f}"),
        ("write throughput, MB/s", lambda f: f"{f['mb_per_s']:,.0f}"),
        ("training steps before each checkpoint", lambda f: f"{f['steps_between']}"),
        ("a training step, s (a write in flight or not)", lambda f: f"{f['step_s']:.2f}"),
    ]
    for label, cell in rows:
        print(f"| {label} | " + " | ".join(cell(figures[n]) for n in names) + " |")
    print()
    for storage in args.storages:
        sync = figures[f"{storage}/sync"]
        asynchronous = figures[f"{storage}/async"]
        ratio = asynchronous["blocked_s"] / sync["blocked_s"]
        verdict = "met" if ratio <= TARGET_RATIO else "NOT met"
        print(f"{storage}: async blocked {ratio:.1%} of sync (target <= {TARGET_RATIO:.0%}: {verdict})")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=int, default=4, help="checkpoints per column")
    parser.add_argument(
        "--steps-between", type=int, default=2, help="training steps before each synchronous checkpoint"
    )
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per step and rank")
    parser.add_argument("--storages", nargs="+", choices=STORAGES, default=list(STORAGES))
    parser.add_argument(
        "--scratch", type=Path, default=None, help="where the directory column writes (default: TMPDIR)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write every rank's figures here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    ranks = run(args)
    if args.json:
        args.json.write_text(json.dumps(ranks, indent=1))
    print_table(columns(ranks, args), args)


if __name__ == "__main__":
    main()

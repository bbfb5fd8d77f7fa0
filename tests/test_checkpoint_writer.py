"""Checkpoints beside the step: the background writer against the synchronous one, bit for bit; the
metric rows' checkpoint_blocked_s; a checkpoint without its complete.json never resumed from; a
resharded resume that reads only the bytes its shard owns; the safetensors header parser.

Packages: workers.training, workers.zero, workers.records.
"""

from __future__ import annotations

import json
import shutil
import struct
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import workers.training.writer
from workers.config import TrainConfig
from workers.models.builtin import build_model
from workers.records import MetricRow
from workers.training.checkpoints import checkpointed_metrics, latest_checkpoint, shard_file, shard_header
from workers.training.loop import train
from workers.training.reader import read_shard, resume
from workers.training.writer import CheckpointIO, shared_directory
from workers.zero.optimizer import ZeRO1AdamW, decay_param_groups

from distributed import SMALL, run_ranks, small_run

# checkpoints at steps 1, 3, 5 and 7
STEPS = 8
EVERY = 2
CHECKPOINTS = [1, 3, 5, 7]


def _config(root: Path, *, asynchronous: bool = True) -> TrainConfig:
    return small_run(root, steps=STEPS, checkpoint_every=EVERY, async_checkpoints=asynchronous)


def _run(rank: int, world_size: int, root: str, asynchronous: bool) -> None:
    """Train on this rank; its rows go to root/../rows-<rank>.json."""
    rows: list[MetricRow] = []
    train(_config(Path(root), asynchronous=asynchronous), rank=rank, world_size=world_size, on_metrics=rows.append)
    Path(root).parent.joinpath(f"rows-{rank}.json").write_text(json.dumps([row.to_json() for row in rows]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The same 2-rank run with asynchronous and with synchronous checkpoints."""
    roots = {name: tmp_path_factory.mktemp(name) / "ck" for name in ("async", "sync")}
    for name, root in roots.items():
        run_ranks(2, _run, str(root), name == "async")
    return roots


def _shard_bytes(root: Path, step: int) -> list[bytes]:
    return [shard_file(root, step, rank, 2).read_bytes() for rank in range(2)]


def test_asynchronous_and_synchronous_checkpoints_are_equal_bit_for_bit(runs):
    for step in CHECKPOINTS:
        assert _shard_bytes(runs["async"], step) == _shard_bytes(runs["sync"], step), step
    got, want = (load_file(runs[name] / "final" / "model.safetensors") for name in ("async", "sync"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert latest_checkpoint(runs["async"]) == latest_checkpoint(runs["sync"]) == (STEPS - 1, 2)


def test_rows_carry_checkpoint_blocked_s_on_checkpoint_steps_only(runs):
    for name, root in runs.items():
        for rank in range(2):
            rows = [MetricRow.from_json(row) for row in json.loads((root.parent / f"rows-{rank}.json").read_text())]
            assert [row.step for row in rows] == list(range(STEPS))
            blocked = [row.step for row in rows if row.checkpoint_blocked_s is not None]
            assert blocked == CHECKPOINTS, name
            assert all(row.checkpoint_blocked_s >= 0 for row in rows if row.step in CHECKPOINTS)
    # saved with the checkpoint: the row of the checkpoint step itself carries it when the write is
    # asynchronous (known before the files are written), not when it is synchronous
    saved = {name: checkpointed_metrics(root, after_step=-1) for name, root in runs.items()}
    assert [row.step for row in saved["async"] if row.checkpoint_blocked_s is not None] == CHECKPOINTS
    assert [row.checkpoint_blocked_s for row in saved["sync"]] == [None] * STEPS
    assert [row.loss for row in saved["async"]] == [row.loss for row in saved["sync"]]


def test_a_checkpoint_without_its_complete_json_is_never_resumed_from(runs, tmp_path):
    """As if rank 0 died after every shard of step 7 was written, before its complete.json: the
    relaunch resumes from step 5, and ends where the uninterrupted run ends, bit for bit."""
    root = tmp_path / "ck"
    shutil.copytree(runs["async"], root)
    (root / f"step-{STEPS - 1:09d}" / "complete.json").unlink()
    shutil.rmtree(root / "final")
    assert latest_checkpoint(root) == (5, 2)
    run_ranks(2, _run, str(root), True)
    rows = json.loads((tmp_path / "rows-0.json").read_text())
    assert [row["step"] for row in rows] == [6, 7]
    assert _shard_bytes(root, STEPS - 1) == _shard_bytes(runs["async"], STEPS - 1)


# --------------------------------------------------------------------------- a private spool, published


def _spool_io(store: Path, spool: Path, *, rank: int, world_size: int, die_at: int | None) -> CheckpointIO:
    """A rank's spool published into `store` (a stand-in for an object store): files copied in
    order, rank 0's complete.json once every rank's rows of the step are there. At step `die_at`
    rank 0's publish dies after the shards, before complete.json."""

    def publish(step: int, files: list[Path]) -> None:
        for path in files:
            name = path.relative_to(spool)
            if path.name == "complete.json":
                if step == die_at:
                    raise OSError(f"publish of step {step} died")
                peers = [
                    store / f"step-{step:09d}/rank-{r:05d}-of-{world_size:05d}.metrics.json"
                    for r in range(1, world_size)
                ]
                while not all(peer.exists() for peer in peers):
                    time.sleep(0.01)
            (store / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, store / f"{name}.tmp")
            (store / f"{name}.tmp").rename(store / name)

    shared = shared_directory(store)
    return CheckpointIO(latest=shared.latest, fetch=shared.fetch, publish=publish)


def _published_run(rank: int, world_size: int, tmp: str, die_at: int | None) -> None:
    store = Path(tmp) / "store"
    spool = Path(tmp) / f"spool-{rank}"
    store.mkdir(exist_ok=True)
    io = _spool_io(store, spool, rank=rank, world_size=world_size, die_at=die_at if rank == 0 else None)
    cfg = _config(spool)
    if die_at is None:
        train(cfg, rank=rank, world_size=world_size, io=io)
        return
    # the failed write of step 5 surfaces at the next checkpoint, step 7, on both ranks at once
    message = "publish of step 5 died" if rank == 0 else "the checkpoint of step 5 was not written: another rank's"
    with pytest.raises((OSError, RuntimeError), match=message):
        train(cfg, rank=rank, world_size=world_size, io=io)


def test_a_checkpoint_whose_publish_died_is_never_resumed_from(runs, tmp_path):
    run_ranks(2, _published_run, str(tmp_path), 5)
    store = tmp_path / "store"
    assert sorted(p.name for p in (store / "step-000000005").iterdir()) == [
        "rank-00000-of-00002.metrics.json",
        "rank-00000-of-00002.safetensors",
        "rank-00001-of-00002.metrics.json",
        "rank-00001-of-00002.safetensors",
    ]
    assert latest_checkpoint(store) == (3, 2)
    assert (tmp_path / "spool-1" / "step-000000003" / "rank-00001-of-00002.safetensors").exists()  # never deleted

    run_ranks(2, _published_run, str(tmp_path), None)
    assert latest_checkpoint(store) == (STEPS - 1, 2)
    assert _shard_bytes(store, STEPS - 1) == _shard_bytes(runs["async"], STEPS - 1)


# --------------------------------------------------------------------------- a resharded resume


def _resharded(rank: int, world_size: int, root: str) -> None:
    """Rank `rank` of 4 resumes from the 2-rank checkpoint of step 7, through a fetch that counts."""
    fetched: list[tuple[int, int]] = []
    shared = shared_directory(Path(root))
    io = CheckpointIO(
        latest=shared.latest, fetch=lambda name, ranges: fetched.extend(ranges) or shared.fetch(name, ranges)
    )
    model = build_model(SMALL, dtype=torch.float32, seed=0)
    opt = ZeRO1AdamW(decay_param_groups(model, weight_decay=0.1), lr=3e-3)
    read = resume(opt, io)
    assert (read.step, read.saved_world_size) == (STEPS - 1, 2)
    headers = [8 + struct.unpack("<Q", shard_file(Path(root), read.step, r, 2).read_bytes()[:8])[0] for r in range(2)]
    assert read.header_bytes == sum(headers)
    assert read.bytes_read - read.header_bytes == read.shard_bytes  # the owned elements, each once, nothing else
    assert sum(b - a for a, b in fetched) == read.bytes_read and len(fetched) == read.num_ranges
    saved = [read_shard(shard_file(Path(root), read.step, r, 2)) for r in range(2)]
    for i, buf in enumerate(opt._buffers):
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            whole = torch.cat([shard["buffers"][i][kind] for shard in saved])
            assert torch.equal(buf.state_of(kind)[: buf.owned_numel], whole[buf.start : buf.start + buf.owned_numel])


def test_a_2_to_4_reshard_reads_only_the_bytes_each_rank_owns(runs):
    run_ranks(4, _resharded, str(runs["async"]))


# --------------------------------------------------------------------------- one rank


CHECKPOINT_STEPS_BEFORE_THE_STOP = (1, 3)
"""The checkpoints of the one-rank run stopped after step 3 (checkpoint_every 2)."""


class _HeldWrites:
    """Each checkpoint's write is held until the training thread waits for it (asynchronous: the next
    save, or leaving at the stop) and then let go; the events of the training thread, the writer's
    thread and the releasing thread go into `events`, in the order they happened."""

    def __init__(self, monkeypatch, *, hold: bool) -> None:
        self.events: list[str] = []
        self._hold = hold
        self._waiting = {step: threading.Event() for step in CHECKPOINT_STEPS_BEFORE_THE_STOP}
        self._released = {step: threading.Event() for step in CHECKPOINT_STEPS_BEFORE_THE_STOP}
        writer = workers.training.writer.CheckpointWriter
        save = writer.save
        wait = writer.wait
        write = writer._write

        def held_save(writer, step, metrics=()):
            self.events.append(f"save {step} begins")
            blocked_s = save(writer, step, metrics)
            self.events.append(f"save {step} returns")
            return blocked_s

        def held_wait(writer):
            if writer._pending is not None:
                self.events.append(f"waits for write {writer._pending_step}")
                self._waiting[writer._pending_step].set()
            wait(writer)

        def held_write(writer, step, *args):
            if self._hold:  # a bound on a failure (nothing let it go), not a duration
                assert self._released[step].wait(timeout=120), f"the write of step {step} was never let go"
            write(writer, step, *args)
            self.events.append(f"write {step} complete")

        monkeypatch.setattr(writer, "save", held_save)
        monkeypatch.setattr(writer, "wait", held_wait)
        monkeypatch.setattr(writer, "_write", held_write)

    def release_each_once_waited_for(self) -> threading.Thread:
        """A thread that lets each held write go once the training thread waits for it."""

        def release() -> None:
            for step in CHECKPOINT_STEPS_BEFORE_THE_STOP:
                self._waiting[step].wait(timeout=120)  # never set: let go anyway, the order tells
                self.events.append(f"write {step} released")
                self._released[step].set()

        thread = threading.Thread(target=release, daemon=True)
        thread.start()
        return thread


@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync"])
def test_a_stop_waits_for_the_write_in_flight(tmp_path, monkeypatch, asynchronous):
    """Asynchronous, a checkpoint step returns before its files are written, the next one waits for
    them, and the stop returns once its own checkpoint is complete; synchronous, each checkpoint step
    returns after its files. Asynchronous, each write is held until the training thread waits for it."""
    held = _HeldWrites(monkeypatch, hold=asynchronous)
    releaser = held.release_each_once_waited_for() if asynchronous else None
    rows: list[MetricRow] = []

    def stop_at(step: int, checkpointed: bool) -> bool:
        held.events.append(f"asked after {step}")
        return step == 3

    result = train(
        _config(tmp_path, asynchronous=asynchronous),
        on_metrics=lambda row: held.events.append(f"row {row.step}") or rows.append(row),
        stop_at=stop_at,
    )
    held.events.append("train returns")
    if releaser is not None:
        releaser.join()
    assert (result.stopped, result.last_step) == (True, 3)
    assert latest_checkpoint(tmp_path) == (3, 1)
    assert sorted(row.step for row in rows if row.checkpoint_blocked_s is not None) == [1, 3]
    steps_0_to_2 = ["row 0", "asked after 0", "save 1 begins"]
    if asynchronous:
        steps_0_to_2 += ["save 1 returns", "row 1", "asked after 1", "row 2", "asked after 2"]  # write 1 held
        step_3 = ["save 3 begins", "waits for write 1", "write 1 released", "write 1 complete", "save 3 returns"]
        the_stop = ["row 3", "asked after 3", "waits for write 3", "write 3 released", "write 3 complete"]
    else:
        steps_0_to_2 += ["write 1 complete", "save 1 returns", "row 1", "asked after 1", "row 2", "asked after 2"]
        step_3 = ["save 3 begins", "write 3 complete", "save 3 returns"]
        the_stop = ["row 3", "asked after 3"]
    assert held.events == [*steps_0_to_2, *step_3, *the_stop, "train returns"], held.events


def test_a_failed_background_write_is_raised_at_the_end(tmp_path, monkeypatch):
    write_json = workers.training.writer.write_json

    def failing(path: Path, value) -> None:
        if path.name == "complete.json" and value["step"] == STEPS - 1:
            raise OSError("disk full")
        write_json(path, value)

    monkeypatch.setattr(workers.training.writer, "write_json", failing)
    with pytest.raises(OSError, match="disk full"):
        train(_config(tmp_path))
    assert latest_checkpoint(tmp_path) == (5, 1) and not (tmp_path / "final").exists()


def test_a_pt_shard_of_the_same_world_size_still_resumes(tmp_path):
    """A checkpoint written before shards were safetensors files (a job running across the upgrade)."""
    train(_config(tmp_path))
    (tmp_path / "step-000000007" / "complete.json").unlink()
    shard = shard_file(tmp_path, 5, 0, 1)
    state = read_shard(shard)
    torch.save(state, shard.with_suffix(".pt"))
    shard.unlink()
    model = build_model(SMALL, dtype=torch.float32, seed=0)
    opt = ZeRO1AdamW(decay_param_groups(model, weight_decay=0.1), lr=3e-3)
    read = resume(opt, shared_directory(tmp_path))
    assert read.step == 5 and read.header_bytes == 0
    for i, buf in enumerate(opt._buffers):
        assert torch.equal(buf.state_of("exp_avg")[: buf.owned_numel], state["buffers"][i]["exp_avg"])


def test_the_shard_header_is_read_in_two_small_reads(tmp_path):
    train(TrainConfig(model=SMALL, steps=1, precision="fp32", checkpoint_dir=str(tmp_path)))
    path = shard_file(tmp_path, 0, 0, 1)
    data = path.read_bytes()
    reads = []
    start, tensors, metadata = shard_header(lambda a, b: reads.append((a, b)) or data[a:b])
    assert reads == [(0, 8), (8, start)]
    with safe_open(path, "pt") as file:
        assert sorted(file.keys()) == sorted(tensors) and file.metadata() == metadata
        for name, (dtype, shape, begin, end) in tensors.items():
            tensor = file.get_tensor(name)
            assert (dtype, shape) == ("F32", tuple(tensor.shape))
            assert data[start + begin : start + end] == tensor.numpy().tobytes()
    assert json.loads(metadata["zero1"])["format"] == "zero1.sharded.v1"
    for bad in (struct.pack("<Q", 1 << 40), struct.pack("<Q", 4) + b"[1] "):
        with pytest.raises(ValueError):
            shard_header(lambda a, b, bad=bad: bad[a:b])

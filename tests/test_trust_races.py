"""Issue 40, findings 2, 3 and 11 (hard links): a job's code swaps a directory on the service's way
for a link to another job's, in a loop (`renameat2(RENAME_EXCHANGE)`), while the service or a rank's
parent reads or creates below it: every path they open inside a job's storage is walked from a
trusted descriptor, no link followed on the way (workers.training.confined).

The attacker is the job's own uid (ZERO1_RUN_AS; the tests run as root, so the uid switches for
real), swapping in a process of its own; the downloads run against a real `zero1 serve`. Each race
counts what came back across its tries: not one byte of the other job's, and the honest case
still answers once the swapping stops.

Packages: workers.training, workers.runtime, service.store.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.errors import ServiceError
from service.store.checkpoint_files import open_checkpoint_file
from workers.config import FieldError, InitSpec
from workers.records import RunAs
from workers.runtime.spool import Spool, SpoolError
from workers.training import confined, staging
from workers.training.storage import DirectoryStore

from figures import record
from helpers import job_body, wait_for
from marks import starts
from served import ALICE, BOB, Served, running

IDS = {"alice": (2001, 2001), "bob": (2002, 2002)}
RUN_AS = "alice=2001:2001,bob=2002:2002,*=30000-30009"
TRIES = 400
STEP = 777
SHARD = "rank-00000-of-00001.safetensors"
SWAP = ".swap"
"""The link the attacker keeps beside the directory it swaps with it."""

SWAPPER = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD, RENAME_EXCHANGE = -100, 2
real, link, limit = os.fsencode(sys.argv[1]), os.fsencode(sys.argv[2]), int(sys.argv[3])
os.sched_setaffinity(0, {int(sys.argv[4])})  # a CPU of its own: it swaps while the victim runs
for i in range(limit):
    if libc.renameat2(AT_FDCWD, real, AT_FDCWD, link, RENAME_EXCHANGE) != 0:
        sys.exit("renameat2: " + os.strerror(ctypes.get_errno()))
    if i == 0:
        print("swapping", flush=True)
"""
MAX_SWAPS = 200_000_000
"""The attacker's bound: far more swaps than the tries take; it is ended when they are done."""


class Swapper:
    """`directory`/`name` exchanged with `directory`/.swap, a link to `target`, in a loop, by a process
    of `uid`: the attack. The swapper has a CPU of its own and the victim's threads (`victim`, a pid:
    the test's own thread by default) the others, so the two run at the same time, as on a loaded
    server, rather than in turns on one CPU. Ended, and `name` put back as the real directory, on
    leaving."""

    def __init__(self, directory: Path, name: str, *, target: Path, uid: tuple[int, int], victim: int = 0) -> None:
        self.real = directory / name
        self.link = directory / SWAP
        self.target = target
        self.uid = uid
        self.threads = [int(t) for t in os.listdir(f"/proc/{victim}/task")] if victim else [0]
        cpus = sorted(os.sched_getaffinity(0))
        self.swapper_cpu = cpus[-1]
        self.victim_cpus = set(cpus[:-1] or cpus)
        self.affinity = {thread: os.sched_getaffinity(thread) for thread in self.threads}

    def __enter__(self) -> Swapper:
        self.link.unlink(missing_ok=True)
        self.link.symlink_to(self.target)
        os.chown(self.link, *self.uid, follow_symlinks=False)
        for thread in self.threads:
            os.sched_setaffinity(thread, self.victim_cpus)
        argv = [sys.executable, "-c", SWAPPER, str(self.real), str(self.link), str(MAX_SWAPS), str(self.swapper_cpu)]
        self.process = subprocess.Popen(
            argv, user=self.uid[0], group=self.uid[1], extra_groups=[], stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout.readline().strip() == "swapping", self.process.wait()
        return self

    def __exit__(self, *exc: object) -> None:
        swapping = self.process.poll() is None  # it swapped all along: every try raced it
        self.process.kill()
        self.process.wait()
        for thread, cpus in self.affinity.items():
            with contextlib.suppress(OSError):  # a thread that has ended since
                os.sched_setaffinity(thread, cpus)
        if self.real.is_symlink():  # stopped between two swaps: the real directory back in its place
            _exchange(self.real, self.link)
        self.link.unlink()
        assert swapping, f"the swapper stopped early: {self.process.returncode}"


def _exchange(a: Path, b: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.renameat2(-100, os.fsencode(str(a)), -100, os.fsencode(str(b)), 2) == 0, ctypes.get_errno()


def _complete_steps(directory: Path) -> list[Path]:
    return [p for p in directory.glob("step-*") if (p / "complete.json").exists()]


def _owned_by(path: Path, uid: tuple[int, int]) -> None:
    for found, dirs, files in os.walk(path):
        for name in [found, *(os.path.join(found, n) for n in dirs + files)]:
            os.chown(name, *uid, follow_symlinks=False)


# --------------------------------------------------------------------------- the service and two jobs


@pytest.fixture(scope="module")
@starts("ray", "slow")
def served(searchable) -> Iterator[Served]:
    with running("zero1-races-", ZERO1_RUN_AS=RUN_AS) as service:
        yield service


@pytest.fixture(scope="module")
def jobs(served) -> dict[str, dict]:
    """A succeeded job of alice's and of bob's (one rank each): their ids and directories; alice's
    code then made a complete checkpoint of its own at step 777, as any job's code can."""
    found = {}
    for user, token, seed in (("alice", ALICE, 7), ("bob", BOB, 8)):  # seeds apart: weights apart
        body = job_body(name=user, num_gpus=1, steps=4, checkpoint_every=2, seed=seed)
        response = served.request("POST", "/v1/jobs", token, json=body)
        assert response.status_code == 201, response.text
        job = served.wait(response.json()["id"], token)
        assert job["status"] == "succeeded", job["error"]
        (directory,) = served.checkpoints.glob(f"job-{job['id']}-*")
        # the job reads as succeeded once its end is committed; its retirement (the newest
        # checkpoint kept, ZERO1_CHECKPOINT_KEEP_FINISHED = 1) follows that commit
        wait_for(
            lambda: _complete_steps(directory),
            lambda steps: len(steps) == 1,
            what=f"job {job['id']}'s retirement to its newest checkpoint",
        )
        found[user] = {"id": job["id"], "dir": directory}
    planted = found["alice"]["dir"] / f"step-{STEP:09d}"
    planted.mkdir()
    (planted / "complete.json").write_text(f'{{"step": {STEP}, "world_size": 1}}')
    (planted / SHARD).write_bytes(b"alice's own shard " * 100)
    _owned_by(planted, IDS["alice"])
    (bob_step,) = _complete_steps(found["bob"]["dir"])
    found["bob"]["step"] = bob_step
    found["bob"]["shard"] = (bob_step / SHARD).read_bytes()
    return found


# --------------------------------------------------------------------------- finding 2: downloads


def test_a_checkpoint_download_never_serves_another_jobs_shard_while_its_directory_is_swapped(served, jobs):
    alice = jobs["alice"]
    bob = jobs["bob"]
    url = f"/v1/jobs/{alice['id']}/checkpoints/{STEP}/{SHARD}"
    own = (alice["dir"] / f"step-{STEP:09d}" / SHARD).read_bytes()
    answers: dict[str, int] = {}
    swapper = Swapper(alice["dir"], f"step-{STEP:09d}", target=bob["step"], uid=IDS["alice"], victim=served.process.pid)
    with swapper:
        for _ in range(TRIES):
            try:
                response = served.request("GET", url, ALICE)
                answer = "alice's" if response.content == own else str(response.status_code)
            except httpx.RemoteProtocolError:  # sized as one job's file, streamed from the other's
                answer = "cut short"
            answers[answer] = answers.get(answer, 0) + 1
    assert set(answers) <= {"alice's", "404"}, f"of {TRIES} downloads: {answers} (bob's shard, or sized as it)"
    honest = served.request("GET", url, ALICE)
    assert honest.status_code == 200 and honest.content == own
    record(
        "a checkpoint download while its step directory is swapped for a link (finding 2)", tried=TRIES, refused=TRIES
    )


def test_the_store_never_opens_another_jobs_file_while_a_directory_is_swapped(jobs):
    alice = jobs["alice"]
    bob = jobs["bob"]
    store = DirectoryStore(alice["dir"])
    name = f"step-{STEP:09d}/{SHARD}"
    own = store.read(name)
    read = 0
    refused = 0
    with Swapper(alice["dir"], f"step-{STEP:09d}", target=bob["step"], uid=IDS["alice"]):
        for _ in range(TRIES):
            try:
                with store.open(name) as file:
                    assert file.read() == own, "bob's shard read through alice's store"
                read += 1
            except OSError as exc:
                assert f"step-{STEP:09d}" in str(exc), exc  # the refusal names the component
                refused += 1
            try:
                with open_checkpoint_file(store, alice["id"], STEP, SHARD)[0] as file:
                    assert file.read() == own, "bob's shard opened for alice's download"
            except ServiceError as exc:
                assert exc.status_code == 404, exc
    assert read + refused == TRIES
    assert store.read(name) == own
    record("DirectoryStore.open while a directory on the way is swapped (finding 2)", tried=TRIES, refused=TRIES)


# --------------------------------------------------------------------------- finding 2: init_from


def test_init_froms_weight_fetch_never_reads_another_jobs_weights_while_final_is_swapped(served, jobs, tmp_path):
    alice = jobs["alice"]
    bob = jobs["bob"]
    artifacts = served.request("GET", f"/v1/jobs/{alice['id']}/artifacts", ALICE).json()["data"]
    (weights,) = [a for a in artifacts if a["name"] == "model.safetensors"]
    init = InitSpec(job=alice["id"], uri=str(alice["dir"]), sha256=weights["sha256"], bytes=weights["bytes"])
    bobs = hashlib.sha256((bob["dir"] / "final" / "model.safetensors").read_bytes()).hexdigest()
    assert bobs != weights["sha256"]
    fetched = 0
    with Swapper(alice["dir"], "final", target=bob["dir"] / "final", uid=IDS["alice"]):
        for _ in range(TRIES):
            try:
                copy = Path(staging.fetch_weights(init, into=str(tmp_path / "copies")).path)
                fetched += 1
                assert hashlib.sha256(copy.read_bytes()).hexdigest() == weights["sha256"]
                copy.unlink()
            except FieldError as exc:
                assert bobs not in str(exc), f"bob's weights were read: {exc}"  # a mismatch quotes what it read
                assert "cannot be read" in str(exc), exc
    honest = staging.fetch_weights(init, into=str(tmp_path / "honest"))
    assert hashlib.sha256(Path(honest.path).read_bytes()).hexdigest() == weights["sha256"]
    record("init_from's weight fetch while final/ is swapped for a link (finding 2)", tried=TRIES, refused=TRIES)


# --------------------------------------------------------------------------- finding 3: the spool


def test_the_spool_creates_nothing_through_a_swapped_fetched_directory(searchable, tmp_path):
    stored = DirectoryStore(tmp_path / "stored")
    for step in range(TRIES + 1):
        stored.write(f"step-{step:09d}/{SHARD}", b"shard %d " % step * 8)
    home = Path(tempfile.mkdtemp(prefix="zero1-spool-home-"))
    private = Path(tempfile.mkdtemp(prefix="zero1-root-only-"))  # 0700, root's
    try:
        os.chown(home, *IDS["alice"])
        spool = Spool(stored, home=str(home), rank=0, world_size=1, keep_last=1, run_as=RunAs(*IDS["alice"]))
        (home / "fetched").mkdir()
        os.chown(home / "fetched", *IDS["alice"])
        made = 0
        refused = 0
        with Swapper(home, "fetched", target=private, uid=IDS["alice"]):
            for step in range(TRIES):
                try:
                    spool.fetch(f"step-{step:09d}/{SHARD}", [[0, 8]])
                    made += 1
                except (SpoolError, OSError) as exc:  # the attempt fails: nothing made
                    assert "fetched" in str(exc), exc
                    refused += 1
        assert os.listdir(private) == [], "the parent created the job's files in a root-only directory"
        assert made + refused == TRIES
        path = spool.fetch(f"step-{TRIES:09d}/{SHARD}", [[0, 16]])
        assert Path(path).read_bytes()[:16] == (b"shard %d " % TRIES * 8)[:16]
        assert (os.stat(path).st_uid, stat.S_IMODE(os.stat(path).st_mode)) == (IDS["alice"][0], 0o600)
        spool.close()
        record(
            "the spool's fetched/ swapped for a link to a root-only directory (finding 3)", tried=TRIES, refused=TRIES
        )
    finally:
        subprocess.run(["rm", "-rf", str(home), str(private)], check=False)


# --------------------------------------------------------------------------- finding 11: hard links; the walk


def test_a_hard_link_to_another_file_is_never_read(tmp_path):
    other = tmp_path / "other-job-shard"
    other.write_bytes(b"another job's bytes")
    root = tmp_path / "job"
    (root / f"step-{STEP:09d}").mkdir(parents=True)
    (root / f"step-{STEP:09d}" / "complete.json").write_text(f'{{"step": {STEP}, "world_size": 1}}')
    os.link(other, root / f"step-{STEP:09d}" / SHARD)
    store = DirectoryStore(root)
    with pytest.raises(OSError, match=f"step-{STEP:09d}/{SHARD} has 2 hard links"):
        store.open(f"step-{STEP:09d}/{SHARD}")
    with pytest.raises(ServiceError) as refused:
        open_checkpoint_file(store, 1, STEP, SHARD)
    assert refused.value.status_code == 404 and "2 hard links" in refused.value.message
    record("a hard link to another file in a checkpoint (finding 11)", tried=1, refused=1)


def test_a_link_anywhere_on_the_way_is_refused_and_named(tmp_path):
    (tmp_path / "elsewhere" / "b").mkdir(parents=True)
    (tmp_path / "elsewhere" / "b" / "c").write_bytes(b"not yours")
    (tmp_path / "root" / "a").mkdir(parents=True)
    (tmp_path / "root" / "a" / "b").symlink_to(tmp_path / "elsewhere" / "b")
    os.mkfifo(tmp_path / "root" / "fifo")
    with pytest.raises(OSError, match="a/b is a symbolic link"):
        confined.open_file(tmp_path / "root", "a/b/c")
    with pytest.raises(OSError, match="fifo is not a regular file"):  # opened without blocking
        confined.open_file(tmp_path / "root", "fifo")
    with pytest.raises(FileNotFoundError, match="a/missing does not exist"):
        confined.open_file(tmp_path / "root", "a/missing/c")
    with pytest.raises(ValueError, match="not a name inside"):
        confined.open_file(tmp_path / "root", "../elsewhere/b/c")
    assert confined.list_dir(tmp_path / "root", "a") == []  # the link is not listed
    assert confined.entry_stat(tmp_path / "root", "a/b/c") is None
    with pytest.raises(OSError, match="a/b is a symbolic link"):
        confined.create_file(tmp_path / "root", "a/b/new")
    confined.remove_tree(tmp_path / "root", "a/b/c")  # nothing through the link
    assert (tmp_path / "elsewhere" / "b" / "c").exists()


def test_a_tasks_spilled_token_file_is_adopted_only_as_a_plain_file(tmp_path):
    """A dataset check's child spills its token file in its home; the task copies it into the shared
    cache. A link or a hard link planted there (to a root-only file) is left, and nothing is chmod'ed
    through it."""
    from workers.runtime.isolated import SPILL_DIR, _adopt

    secret = tmp_path / "root-only"
    secret.write_bytes(b"the service's")
    secret.chmod(0o600)
    home = tmp_path / "homes" / "zero1-task-x"
    spill = home / SPILL_DIR / "tokens"
    spill.mkdir(parents=True)
    (spill / f"{'a' * 16}.bin").symlink_to(secret)
    os.link(secret, spill / f"{'b' * 16}.bin")
    (spill / f"{'c' * 16}.bin").write_bytes(b"tokens")
    cache = tmp_path / "cache" / "tokens"
    assert _adopt(home, cache) == {f"{'c' * 16}.bin": str(cache / f"{'c' * 16}.bin")}
    assert sorted(os.listdir(cache)) == [f"{'c' * 16}.bin"]
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE((cache / f"{'c' * 16}.bin").stat().st_mode) == 0o644

"""What the tests share: the tiny job they train, waiting with a deadline, free loopback ports,
where the service stored a job's files, the zips code bundle tests upload. One module, so no
test file keeps its own copy."""

from __future__ import annotations

import io
import random
import socket
import stat
import struct
import time
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx
from sqlalchemy import create_engine, text

from service.store.job_storage import checkpoint_dirname

T = TypeVar("T")

TINY = {"kind": "gpt", "vocab_size": 64, "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}
"""A GPT small enough that a few hundred steps on 2 CPU ranks take seconds."""
FAST = {"lr": 0.003, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0, "max_grad_norm": 1.0}
COSINE = FAST | {"schedule": {"kind": "cosine", "warmup_steps": 20, "min_lr_ratio": 0.1}}
"""FAST's peak after 20 steps of warmup, then down to a tenth by cosine: a retried or preempted job's
rates must be the uninterrupted run's at every step."""
"""Hyperparameters under which TINY's loss visibly falls within a few dozen steps."""
LLAMA_2_7B = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
"""A Llama-2-7B config.json's fields (6,738,415,616 parameters): planned, never built."""
TERMINAL = ("succeeded", "failed", "cancelled")


def job_body(**overrides) -> dict:
    """A POST /v1/jobs body: TINY on 2 GPUs in fp32 for 10 steps, with `overrides`."""
    return {
        "name": "tiny",
        "model": TINY,
        "num_gpus": 2,
        "precision": "fp32",
        "optimizer": FAST,
        "steps": 10,
        "micro_batch_size": 2,
        "seed": 7,
        **overrides,
    }


# --------------------------------------------------------------------------- waiting


T = TypeVar("T")


def bearer(token: str) -> dict[str, str]:
    """The Authorization header of an API token."""
    return {"Authorization": f"Bearer {token}"}


def wait_for(
    read: Callable[[], T],
    predicate: Callable[[T], bool],
    *,
    what: str,
    timeout_s: float = 180,
    interval_s: float = 0.02,
    max_interval_s: float = 0.25,
) -> T:
    """Poll read() until predicate holds; fail naming `what` and the last value at the deadline.

    The pause between reads starts at interval_s and grows by half after each read, up to
    max_interval_s: what happens at once is seen at once, and a wait of seconds (a job that
    trains) reads four times a second, not twenty. A read of the app costs its process about
    3.4 ms of CPU (a TestClient GET), which the job's ranks on the same 2 cores wait for."""
    deadline = time.monotonic() + timeout_s
    pause = interval_s
    while True:
        value = read()
        if predicate(value):
            return value
        assert time.monotonic() < deadline, f"waited {timeout_s:g} s for {what}; last: {value}"
        time.sleep(pause)
        pause = min(pause * 1.5, max(interval_s, max_interval_s))


def wait_job(
    client,
    job_id: int,
    predicate: Callable[[dict], bool],
    *,
    what: str = "the job",
    headers=None,
    timeout_s: float = 180,
) -> dict:
    """GET /v1/jobs/{id} until predicate(job) holds."""
    return wait_for(
        lambda: client.get(f"/v1/jobs/{job_id}", headers=headers).json(),
        predicate,
        what=f"{what} (job {job_id})",
        timeout_s=timeout_s,
    )


def wait_healthy(base: str, *, server=None, timeout_s: float = 120) -> dict:
    """GET {base}/healthz until it answers 200; its body. Fails at once if `server` (a Popen) exits."""

    def health() -> dict | None:
        assert server is None or server.poll() is None, f"zero1 serve exited with {server.returncode}"
        try:
            response = httpx.get(f"{base}/healthz", timeout=2)
        except httpx.TransportError:
            return None
        return response.json() if response.status_code == 200 else None

    return wait_for(health, lambda body: body is not None, what=f"{base}/healthz", timeout_s=timeout_s, interval_s=0.1)


# --------------------------------------------------------------------------- ports


_LOWEST = 20_000  # above Ray's worker ports (10002-19999) and its fixed ones (6379, 8265, 10001)


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
    except (OSError, ValueError):
        # Linux's default
        low = 32_768
        high = 60_999
    return low, high


def free_port() -> int:
    """A loopback port that is free now and outside the kernel's ephemeral range.

    bind(0) hands out a port inside that range, where any outgoing connection, or Ray's own
    bind(0) while a service starts its embedded cluster, can take it before the server binds
    it (seen in CI: a restarted `zero1 serve` failed with "address already in use")."""
    low, high = _ephemeral_range()
    candidates = [port for port in range(_LOWEST, 65_536) if not low <= port <= high]
    rng = random.Random()  # not the global one, which a test may have seeded
    for _ in range(200):
        port = rng.choice(candidates)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {_LOWEST}-65535 outside the ephemeral range {low}-{high}")


# --------------------------------------------------------------------------- stored files


def job_checkpoint_dir(database_url: str, checkpoints: Path, job_id: int) -> Path:
    """The job's checkpoint directory under `checkpoints`: named by its id and its run id."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as connection:
            run_id = connection.execute(text("SELECT run_id FROM jobs WHERE id = :id"), {"id": job_id}).scalar_one()
    finally:
        engine.dispose()
    return Path(checkpoints) / checkpoint_dirname(job_id, run_id)


# --------------------------------------------------------------------------- code bundles


def zip_of(files: dict[str, bytes], *, compression: int = zipfile.ZIP_DEFLATED) -> bytes:
    """A zip of `files` (name -> bytes; a name ending in "/" is a directory), in that order."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=compression) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def stored_bundle(path: Path, files: dict[str, bytes]) -> str:
    """A zip of `files` laid out as the code store keeps a bundle (every entry under bundle/), written
    to `path`: its file:// URI, as a rank's actor or a task is given one. Unchecked: a test may store
    what an upload would refuse, as a bundle stored before a rule would be."""
    path.write_bytes(zip_of({f"bundle/{name}": data for name, data in files.items()}))
    return path.as_uri()


def symlink_zip(name: str, target: str) -> bytes:
    """A zip whose one entry is a symlink `name` -> `target`, as `zip --symlinks` stores one."""
    info = zipfile.ZipInfo(name)
    info.create_system = 3  # Unix: the mode's file type counts
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(info, target)
    return buffer.getvalue()


EIGHT_MIB = 8 << 20


def deflated_zeros(*, num_blocks: int) -> bytes:
    """A raw deflate stream of num_blocks * 8 MiB zeros, made without compressing them all: one block,
    flushed so that it refers to nothing before it, repeated."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = compressor.compress(bytes(EIGHT_MIB)) + compressor.flush(zlib.Z_FULL_FLUSH)
    return block * num_blocks + compressor.flush()


def one_entry_zip(name: str, compressed: bytes, *, claimed_bytes: int, crc: int = 0) -> bytes:
    """A zip of one deflated entry whose headers (local and central) say `claimed_bytes` and `crc`."""
    raw = name.encode()
    sizes = (crc, len(compressed), claimed_bytes)
    local = struct.pack("<4s5H3I2H", b"PK\x03\x04", 20, 0, 8, 0, 0x21, *sizes, len(raw), 0) + raw
    central = struct.pack("<4s6H3I5H2I", b"PK\x01\x02", 20, 20, 0, 8, 0, 0x21, *sizes, len(raw), 0, 0, 0, 0, 0, 0)
    end = struct.pack("<4s4H2IH", b"PK\x05\x06", 0, 0, 1, 1, len(central) + len(raw), len(local) + len(compressed), 0)
    return local + compressed + central + raw + end

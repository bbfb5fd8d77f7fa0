"""A Ray cluster of two `ray start` nodes on this machine and `zero1 serve` on it with PostgreSQL:
docs/deployment.md "A multi-node Ray cluster", command for command, with ports, a Ray token and a
temporary directory of the test's own.

Each `ray start --block` runs in a session of its own, so stopping the cluster stops exactly
its processes: `ray stop` would stop every Ray on the machine, the test session's own too.

Packages: service.cli, service.planning, workers.runtime.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, text

from helpers import free_port, job_checkpoint_dir, wait_for
from marks import starts

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
EXAMPLE = ROOT / "examples" / "two-nodes.json"
BYO_EXAMPLE = ROOT / "examples" / "byo-model"
DOCS_GCS_PORT = 6379

# The commands of docs/deployment.md (there with the GCS on port 6379); `--temp-dir` is the test's addition.
# The head binds loopback: RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps --node-ip-address=127.0.0.1
# as given (Ray otherwise swaps 127.0.0.1 for the machine's network address), and a node of
# 127.0.0.1 binds its servers to 127.0.0.1 only. A joining node cannot take that variable
# (`ray start --address` refuses it), and Ray rewrites a literal 127.0.0.1 or localhost in
# --address the same way (ray-project/ray#59110), so it names the head LOCALHOST: the same
# host, which Ray's check does not match, and its node IP is then 127.0.0.1 as well.
HEAD_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
SERVICE_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def head_command(port: int) -> list[str]:
    return [
        "ray",
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        "--num-cpus=4",
        "--num-gpus=2",
        "--include-dashboard=false",
        "--disable-usage-stats",
        "--block",
    ]


def worker_command(port: int) -> list[str]:
    return [
        "ray",
        "start",
        f"--address=LOCALHOST:{port}",
        "--num-cpus=4",
        "--num-gpus=2",
        "--disable-usage-stats",
        "--block",
    ]


def status_command(port: int) -> list[str]:
    return ["ray", "status", f"--address=127.0.0.1:{port}"]


def backup_command(database: str) -> list[str]:
    return ["pg_dump", "-h", "127.0.0.1", "-U", "postgres", "-Fc", database]


def service_env(*, gcs_port: int, database_url: str, checkpoints: Path) -> dict[str, str]:
    return {
        "ZERO1_RAY_ADDRESS": f"127.0.0.1:{gcs_port}",
        "ZERO1_DATABASE_URL": database_url,
        "ZERO1_CHECKPOINT_URI": str(checkpoints),
    }


# --------------------------------------------------------------------------- processes


def session_pids(sid: int) -> list[int]:
    """Live (not zombie) processes of a session: `ray start` and every process it started."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        state = fields[0]
        session = int(fields[3])
        if session == sid and state != "Z":
            pids.append(int(entry.name))
    return pids


class Process:
    """A command in a session of its own, its output in a log file; stop() ends the session."""

    def __init__(self, command: list[str], *, env: dict[str, str], log_path: Path) -> None:
        self.command = command
        self.log_path = log_path
        with open(log_path, "ab") as log:
            argv = [str(BIN / command[0]), *command[1:]]
            self.process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, marker: str, *, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while marker not in self.log():
            assert self.process.poll() is None, f"{' '.join(self.command)} exited:\n{self.log()[-3000:]}"
            assert time.monotonic() < deadline, f"no {marker!r} within {timeout_s:g} s:\n{self.log()[-3000:]}"
            time.sleep(0.2)

    def stop(self, *, timeout_s: float = 60) -> None:
        """SIGTERM (a `ray start --block` then stops its node's processes), SIGKILL what is left."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        for pid in session_pids(self.process.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_for(
            lambda: session_pids(self.process.pid),
            lambda pids: not pids,
            what=f"the processes of {self.command[:2]} to end",
            timeout_s=30,
        )


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        pass  # gone meanwhile, or not ours to read
    return inodes


def _ip(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp{,6} print each 32-bit word of the address in host (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    ip = ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)))
    return getattr(ip, "ipv4_mapped", None) or ip  # a dual-stack socket's ::ffff:127.0.0.1 -> 127.0.0.1


def listening_addresses(pids: list[int]) -> dict[tuple[str, int], str]:
    """(address, port) of every TCP socket these processes listen on -> the listening command."""
    owners = {inode: pid for pid in pids for inode in _socket_inodes(pid)}
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local = fields[1]
            state = fields[3]
            inode = fields[9]
            if state == "0A" and inode in owners:  # 0A: LISTEN
                address, port = local.split(":")
                found[(str(_ip(address)), int(port, 16))] = _command(owners[inode])
    return found


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return f"pid {pid}"


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


# --------------------------------------------------------------------------- the cluster


@pytest.fixture
def ray_token() -> str:
    """A Ray token of the test's own, in RAY_AUTH_TOKEN: the user's ~/.ray/auth_token is left alone."""
    return secrets.token_hex(32)


@pytest.fixture
@starts("ray", "slow")
def two_nodes(ray_token) -> Iterator[tuple[int, list[Process]]]:
    """The docs' head and second node, 2 logical GPUs each, on loopback; stopped after."""
    temp_dir = tempfile.mkdtemp(prefix="z1n-")  # short: Ray's socket paths must fit 107 bytes
    port = free_port()
    base = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}
    base |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": ray_token}
    nodes: list[Process] = []
    try:
        head = Process(
            [*head_command(port), f"--temp-dir={temp_dir}"], env=base | HEAD_ENV, log_path=Path(temp_dir) / "head.out"
        )
        nodes.append(head)
        head.wait_for_log("block forever", timeout_s=90)
        worker = Process(
            [*worker_command(port), f"--temp-dir={temp_dir}"], env=base, log_path=Path(temp_dir) / "worker.out"
        )
        nodes.append(worker)
        worker.wait_for_log("block forever", timeout_s=90)
        yield port, nodes
    finally:
        for node in reversed(nodes):
            node.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)  # conftest's: a fresh database, dropped after
def test_a_job_spread_over_two_ray_nodes_trains_with_postgresql_and_shared_checkpoints(
    two_nodes, ray_token, database_url, tmp_path
):
    gcs_port, nodes = two_nodes
    checkpoints = tmp_path / "shared-checkpoints"  # the one filesystem both nodes and the service see
    api_port = free_port()
    env = {
        **os.environ,
        **SERVICE_ENV,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": ray_token,
        **service_env(gcs_port=gcs_port, database_url=database_url, checkpoints=checkpoints),
        "ZERO1_URL": f"http://127.0.0.1:{api_port}",
    }
    env.pop("RAY_ADDRESS", None)
    base = env["ZERO1_URL"]

    # Ray's token auth is on: the cluster answers the token, and refuses any other
    ray_env = {**env, **HEAD_ENV}
    ray_status = lambda: subprocess.run(
        [BIN / "ray", *status_command(gcs_port)[1:]],
        env=ray_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    # the second node logs "block forever" a moment before the head's status counts it
    status = wait_for(
        ray_status,
        lambda s: s.returncode != 0 or "0.0/4.0 GPU" in s.stdout,
        what="ray status to show both nodes",
        timeout_s=60,
    )
    assert status.returncode == 0 and "0.0/4.0 GPU" in status.stdout, status.stdout + status.stderr
    refused = subprocess.run(
        [BIN / "ray", *status_command(gcs_port)[1:]],
        env={**ray_env, "RAY_AUTH_TOKEN": "x" * 64},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode != 0 and "InvalidAuthToken" in refused.stdout + refused.stderr, refused.stderr

    upgraded = subprocess.run([BIN / "zero1", "db", "upgrade"], env=env, capture_output=True, text=True, timeout=120)
    assert upgraded.returncode == 0, upgraded.stderr
    service = Process(["zero1", "serve", "--port", str(api_port)], env=env, log_path=tmp_path / "serve.log")
    try:
        cluster = wait_for(
            lambda: _get(f"{base}/v1/cluster"),
            lambda c: c is not None and c["nodes"] == 2,
            what="the service on the two-node cluster",
            timeout_s=120,
        )
        assert cluster["num_gpus"] == 4 and cluster["simulated"] is True, cluster

        submitted = subprocess.run(
            [BIN / "zero1", "submit", str(EXAMPLE)], env=env, capture_output=True, text=True, timeout=60
        )
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        job_id = int(re.search(r"^job (\d+) queued", submitted.stdout, re.M).group(1))

        # while it trains: every server of the cluster and the service listens on loopback only.
        # Not checked: the ranks' torch.distributed rendezvous store, which rank 0's TrainWorker
        # opens on every interface (a worker's choice, not the cluster's)
        wait_for(
            lambda: _get(f"{base}/v1/jobs/{job_id}"),
            lambda j: j is not None and j["status"] not in ("queued", "starting"),
            what="the job to start",
            timeout_s=120,
        )
        pids = [pid for process in (*nodes, service) for pid in session_pids(process.process.pid)]
        listening = listening_addresses(pids)
        open_ = {
            where: command
            for where, command in listening.items()
            if not is_loopback(where[0]) and not command.startswith("ray::TrainWorker")
        }
        assert listening and not open_, open_
        assert ("127.0.0.1", gcs_port) in listening, sorted(listening)

        watched = subprocess.run(
            [BIN / "zero1", "watch", str(job_id)], env=env, capture_output=True, text=True, timeout=180
        )
        assert watched.returncode == 0, watched.stdout + watched.stderr + service.log()[-3000:]
        assert watched.stdout.rstrip().endswith("succeeded")

        # a model of the user's own code, its bundle uploaded by the CLI, its ranks on both nodes:
        # each rank's actor unpacks the bundle from the shared checkpoint storage (file://) for its child
        byo = _read_json(BYO_EXAMPLE / "job.json")
        python_job = tmp_path / "byo.json"
        python_job.write_text(
            json.dumps({**byo, "data": {"kind": "synthetic"}, "num_gpus": 4, "steps": 10, "checkpoint_every": 0})
        )
        submitted = subprocess.run(
            [BIN / "zero1", "submit", str(python_job), "--code", str(BYO_EXAMPLE)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        assert re.search(r"^code sha256:[0-9a-f]{64} \(stored\)$", submitted.stderr, re.M), submitted.stderr
        python_id = int(re.search(r"^job (\d+) queued", submitted.stdout, re.M).group(1))
        watched = subprocess.run(
            [BIN / "zero1", "watch", str(python_id)], env=env, capture_output=True, text=True, timeout=300
        )
        assert watched.returncode == 0, watched.stdout + watched.stderr + service.log()[-3000:]
        assert watched.stdout.rstrip().endswith("succeeded")
    finally:
        service.stop()

    python_events = _events(database_url, python_id)
    assert "4 ranks placed on 2 node(s)" in python_events[2][1], python_events
    assert _metric_steps(database_url, python_id) == list(range(10))

    spec = _read_json(EXAMPLE)
    steps = spec["steps"]
    world_size = spec["num_gpus"]
    every = spec["checkpoint_every"]
    events = _events(database_url, job_id)
    assert [status for status, _ in events] == ["queued", "starting", "running", "succeeded"], events
    assert f"{world_size} ranks placed on 2 node(s)" in events[2][1], events

    # every step's metrics row is in PostgreSQL, once
    assert database_url.startswith("postgresql+psycopg://")
    assert _metric_steps(database_url, job_id) == list(range(steps))

    # docs/deployment.md "Operations": the backup command dumps the job's rows
    database = database_url.rsplit("/", 1)[1]
    dump = tmp_path / "zero1.dump"
    with open(dump, "wb") as out:
        subprocess.run(backup_command(database), stdout=out, check=True, timeout=60)
    listing = subprocess.run(
        ["pg_restore", "--list", str(dump)], capture_output=True, text=True, check=True, timeout=60
    )
    assert "TABLE DATA public metrics" in listing.stdout and "TABLE DATA public job_events" in listing.stdout

    # the finished job's checkpoint (ZERO1_CHECKPOINT_KEEP_FINISHED=1 keeps the final one), each
    # rank's shard from both nodes and the marker, in the shared directory
    job_dir = job_checkpoint_dir(database_url, checkpoints, job_id)
    expected = {f"step-{steps - 1:09d}"}
    assert steps % every == 0
    wait_for(  # the retirement follows the commit of the job's end
        lambda: {d.name for d in job_dir.glob("step-*")},
        lambda names: names == expected,
        what=f"job {job_id}'s retirement to {expected}",
    )
    assert all((job_dir / name / "complete.json").is_file() for name in expected)
    for name in expected:
        shards = sorted(p.name for p in (job_dir / name).glob("rank-*.safetensors"))
        assert shards == [f"rank-{rank:05d}-of-{world_size:05d}.safetensors" for rank in range(world_size)]


def test_the_deployment_docs_run_these_commands():
    """docs/deployment.md "A multi-node Ray cluster" shows the commands above (GCS on 6379) and the settings."""
    docs = (ROOT / "docs" / "deployment.md").read_text()
    section = docs.split("## A multi-node Ray cluster", 1)[1].split("\n## ", 1)[0]
    lines = [" ".join(line.split()) for line in section.splitlines()]
    for env, command in ((HEAD_ENV, head_command), ({}, worker_command), (HEAD_ENV, status_command)):
        shown = " ".join([*(f"{k}={v}" for k, v in env.items()), ".venv/bin/" + " ".join(command(DOCS_GCS_PORT))])
        assert shown in lines, f"docs/deployment.md does not show: {shown}"
    settings = service_env(gcs_port=DOCS_GCS_PORT, database_url="", checkpoints=Path())
    for name in settings:
        assert f"{name}=" in section, name
    assert "RAY_AUTH_MODE=token" in section and "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 .venv/bin/zero1 serve" in section
    assert f".venv/bin/zero1 submit examples/{EXAMPLE.name}" in section
    assert " ".join(backup_command("zero1")) in docs.split("## Operations", 1)[1]


def _get(url: str) -> dict | None:
    try:
        response = httpx.get(url, timeout=10)
    except httpx.TransportError:
        return None  # not listening yet
    return response.json() if response.is_success else None


def _read_json(path: Path) -> dict:
    import json

    return json.loads(path.read_text())


def _events(database_url: str, job_id: int) -> list[tuple[str, str]]:
    engine = create_engine(database_url)
    try:
        with engine.connect() as connection:
            query = text("SELECT to_status, reason FROM job_events WHERE job_id = :id ORDER BY id")
            return [(status, reason) for status, reason in connection.execute(query, {"id": job_id})]
    finally:
        engine.dispose()


def _metric_steps(database_url: str, job_id: int) -> list[int]:
    engine = create_engine(database_url)
    try:
        with engine.connect() as connection:
            query = text("SELECT step FROM metrics WHERE job_id = :id AND NOT superseded ORDER BY step")
            return [step for (step,) in connection.execute(query, {"id": job_id})]
    finally:
        engine.dispose()

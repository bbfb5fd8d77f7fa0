"""A real `zero1 serve` in a process of its own, with three users' tokens (alice, bob, root the admin),
its state in a directory of its own: what the trust tests attack as a user with a token would.

Packages: service (as a deployment runs it).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from zero1.bundle import zip_directory

from helpers import TERMINAL, free_port, wait_for, wait_healthy

ZERO1 = str(Path(sys.executable).with_name("zero1"))
ALICE, BOB, ROOT = (f"{user}-{secrets.token_urlsafe(24)}" for user in ("alice", "bob", "root"))
TOKENS = {"alice": ALICE, "bob": BOB, "root": ROOT}


def _gcs_address(server_pid: int, *, ray_tmpdir: str) -> str:
    """The address of the GCS the service's embedded Ray started: its session directory (under
    `ray_tmpdir`) is named after the process that started it, and holds the port."""
    found = list(Path(ray_tmpdir).glob(f"**/session_*_{server_pid}/gcs_server_port_*"))
    assert len(found) == 1, found
    return f"127.0.0.1:{int(found[0].read_text().strip())}"


class Served:
    """`zero1 serve` with three users and ZERO1_RUN_AS, its state in a directory of its own."""

    def __init__(self, state: Path, **env: str) -> None:
        self.state = state
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.database = state / "zero1.db"
        self.checkpoints = state / "checkpoints"
        clean = {key: value for key, value in os.environ.items() if not key.startswith("ZERO1_")}
        self.env = {
            **clean,
            "ZERO1_API_TOKENS": f"alice:{ALICE},bob:{BOB},root:{ROOT}:admin",
            "ZERO1_DATABASE_URL": f"sqlite:///{self.database}",
            "ZERO1_CHECKPOINT_URI": str(self.checkpoints),
            "ZERO1_SIMULATED_GPUS": "2",
            "ZERO1_CPUS_PER_WORKER": "0.5",
            "ZERO1_SCHEDULER_INTERVAL_S": "0.05",
            **env,
        }
        self.log = state / "serve.log"
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [ZERO1, "serve", "--port", str(self.port)], env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        wait_healthy(self.base, server=self.process)
        self.gcs = _gcs_address(self.process.pid, ray_tmpdir=self.env["RAY_TMPDIR"])

    def request(self, method: str, path: str, token: str, **kwargs) -> httpx.Response:
        return httpx.request(
            method, self.base + path, headers={"Authorization": f"Bearer {token}"}, timeout=180, **kwargs
        )

    def upload(self, bundle: Path, token: str) -> str:
        data, _ = zip_directory(bundle)
        response = httpx.post(
            self.base + "/v1/code",
            content=data,
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/zip"},
            timeout=60,
        )
        assert response.status_code in (200, 201), response.text
        return response.json()["code"]

    def wait(self, job_id: int, token: str) -> dict:
        return wait_for(
            lambda: self.request("GET", f"/v1/jobs/{job_id}", token).json(),
            lambda job: job["status"] in TERMINAL,
            what=f"job {job_id}",
            timeout_s=240,
        )

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=120)


@contextmanager
def running(prefix: str, **env: str) -> Iterator[Served]:
    """A Served in a new state directory (named `prefix`…), stopped and removed after."""
    state = Path(tempfile.mkdtemp(prefix=prefix))
    service = Served(state, **env)
    try:
        yield service
    finally:
        service.stop()
        subprocess.run(["rm", "-rf", str(state)], check=False)

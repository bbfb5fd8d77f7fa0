"""The `zero1` command as a user runs it: `zero1 plan` and `zero1 serve`."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from service.cli import main

ZERO1 = str(Path(sys.executable).with_name("zero1"))
ENV = {**os.environ, "ZERO1_SIMULATED_GPUS": "4", "ZERO1_SIMULATED_GPU_MEMORY_GB": "80", "ZERO1_GPU_OVERHEAD_GB": "1"}


def run_zero1(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([ZERO1, *args], capture_output=True, text=True, timeout=60, env=ENV)


def test_plan_prints_the_breakdown_and_sweep():
    out = run_zero1("plan", "--params", "7.5e9", "--gpus", "64")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("7,500,000,000 parameters, fp16 + adamw, ZeRO stage 1, 64 GPUs of 80.000 GB")
    assert "total             31.406        31,406,250,000" in lines
    assert "min_gpus at stage 1: 2" in lines
    assert "     2          75.000  yes" in lines and "     1         120.000  no" in lines
    stages = lines[lines.index("stage       GB per GPU at N=64") + 1 :][:4]
    assert [line.split() for line in stages] == [["0", "120.000"], ["1", "31.406"], ["2", "16.641"], ["3", "1.875"]]


def test_plan_json_is_the_apis_json(client):
    out = run_zero1("plan", "--params", "7.5e9", "--gpus", "64", "--json")
    assert out.returncode == 0, out.stderr
    api = client.post("/v1/plan", json={"num_params": 7_500_000_000, "num_gpus": 64}).json()
    assert json.loads(out.stdout) == api


def test_plan_a_gpt_with_gpt2_head_width_default(client, capsys):
    assert main(["plan", "--model", "gpt", "--n-layer", "48", "--n-embd", "1600", "--gpus", "8", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    gpt2_xl = {"kind": "gpt", "vocab_size": 50257, "n_layer": 48, "n_head": 25, "n_embd": 1600, "block_size": 1024}
    assert cli == client.post("/v1/plan", json={"model": gpt2_xl, "num_gpus": 8}).json()
    assert cli["num_params"] == 1_557_611_200


def test_plan_an_mlp(capsys):
    assert main(["plan", "--model", "mlp", "--sizes", "784,1024,10", "--gpus", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_params"] == 784 * 1024 + 1024 + 1024 * 10 + 10


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--params", "7.5e9", "--gpus", "0"], "num_gpus: Input should be greater than or equal to 1 (got 0)"),
        (["--model", "gpt", "--n-layer", "2", "--n-embd", "100", "--n-head", "3"], "n_embd (100) must be divisible"),
        (["--model", "gpt", "--n-embd", "128"], "model.n_layer: Field required"),
        (["--params", "7.5e9", "--gpu-memory-gb", "nan"], "gpu_memory_gb: "),
    ],
)
def test_plan_rejects_bad_input_naming_the_field(args, message, capsys):
    assert main(["plan", *args]) == 2
    assert message in capsys.readouterr().err


def test_fractional_parameter_count_is_refused():
    out = run_zero1("plan", "--params", "7.5")
    assert out.returncode == 2 and "must be a whole number, got 7.5" in out.stderr


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_answers_over_http_on_loopback():
    port = _free_port()
    server = subprocess.Popen([ZERO1, "serve", "--port", str(port)], env=ENV, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:  # poll until the server accepts connections, with a deadline
            assert server.poll() is None, server.stderr.read()
            try:
                health = httpx.get(f"{base}/healthz", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "zero1 serve did not start within 30 s"
                time.sleep(0.1)
        assert health.json()["status"] == "ok"
        r = httpx.post(f"{base}/v1/plan", json={"num_params": 7_500_000_000, "num_gpus": 64}, timeout=10)
        assert r.json()["per_gpu"]["total_bytes"] == 31_406_250_000
        assert httpx.get(f"{base}/docs", timeout=10).status_code == 200
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
    # uvicorn shuts down gracefully, then re-raises SIGTERM so the exit status tells why it stopped
    assert server.returncode in (0, -signal.SIGTERM)
    log = server.stderr.read()
    assert f"Uvicorn running on http://127.0.0.1:{port}" in log
    assert "Application shutdown complete" in log

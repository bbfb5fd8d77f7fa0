"""The `zero1` command as a user runs it: `zero1 plan` and `zero1 serve`."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from service.cli import main

from helpers import free_port, wait_healthy

ZERO1 = str(Path(sys.executable).with_name("zero1"))
ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "ZERO1_SIMULATED_GPUS": "4", "ZERO1_SIMULATED_GPU_MEMORY_GB": "80", "ZERO1_GPU_OVERHEAD_GB": "1"}


def run_zero1(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([ZERO1, *args], capture_output=True, text=True, timeout=60, env=ENV)


def test_plan_prints_the_breakdown_and_sweep():
    out = run_zero1("plan", "--params", "7.5e9", "--gpus", "64")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(
        "7,500,000,000 parameters, fp16 + adamw, counted by formula, ZeRO stage 1, 64 GPUs of 80.000 GB"
    )
    assert "total             31.406        31,406,250,000" in lines
    assert "min_gpus at stage 1: 2" in lines
    assert "     2          75.000  yes" in lines and "     1         120.000  no" in lines
    stages = lines[lines.index("stage       GB per GPU at N=64") + 1 :][:4]
    assert [line.split() for line in stages] == [["0", "120.000"], ["1", "31.406"], ["2", "16.641"], ["3", "1.875"]]


def test_plan_trace_counts_the_step_in_the_cli_process():
    gpt = ("--model", "gpt", "--vocab-size", "256", "--n-layer", "2", "--n-embd", "64", "--block-size", "64")
    traced = run_zero1("plan", *gpt, "--micro-batch-size", "4", "--trace", "--json")
    closed = run_zero1("plan", *gpt, "--micro-batch-size", "4", "--json")
    assert traced.returncode == 0 == closed.returncode, traced.stderr + closed.stderr
    traced, closed = json.loads(traced.stdout), json.loads(closed.stdout)
    assert (traced["method"], closed["method"]) == ("traced", "model")
    assert traced["num_params"] == closed["num_params"]
    for kind in ("activations", "temporaries"):
        assert traced["per_gpu"][f"{kind}_bytes"] == pytest.approx(closed["per_gpu"][f"{kind}_bytes"], rel=0.02)
    table = run_zero1("plan", *gpt, "--trace")
    assert "counted by traced" in table.stdout.splitlines()[0], table.stdout + table.stderr
    assert any(line.startswith("temporaries") for line in table.stdout.splitlines())


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


GPT_7B_FLAGS = ["--model", "gpt", "--vocab-size", "59072", "--n-layer", "36", "--n-head", "32", "--n-embd", "4096"]
GPT_7B_FLAGS += ["--block-size", "2048", "--precision", "bf16"]


def test_plan_recommend_prints_the_table_of_what_fits_cheapest_first():
    out = run_zero1("plan", *GPT_7B_FLAGS, "--recommend", "--global-batch-size", "64", "--max-gpus", "64")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == (
        "7,500,029,952 parameters, global batch 64 (131,072 tokens), ZeRO stage 1 on up to 64 GPUs of 80.000 GB "
        "(GB = 1e9 bytes): 9 configurations that fit, cheapest first"
    )
    assert lines[1].startswith("cost in GPU-seconds per optimizer step at 400 TFLOP/s and 100 GB/s per GPU: cost = N")
    header = lines.index("     N  micro-batch   accum  ckpt  GB per GPU  headroom GB  cost GPU-s  why")
    rows = [line.split(maxsplit=7) for line in lines[header + 1 :]]
    assert len(rows) == 9
    assert rows[0] == [
        "4",
        "2",
        "8",
        "no",
        "75.820",
        "4.180",
        "15.65",
        "micro-batch 2 is the largest that fits on 4 GPUs: 4 would need 98.14 GB > 80.00 GB",
    ]
    costs = [float(row[6]) for row in rows]
    assert costs == sorted(costs)
    fewest = min(rows, key=lambda row: int(row[0]))
    assert fewest[:4] == ["2", "1", "32", "yes"] and fewest[7].startswith("the fewest GPUs it fits on: 1 would need")


def test_plan_recommend_json_is_the_apis_json(client, capsys):
    argv = ["plan", *GPT_7B_FLAGS, "--recommend", "--global-batch-size", "64", "--gpus", "64", "--json"]
    assert main(argv) == 0
    model = json.loads((ROOT / "examples" / "gpt-7.5b.json").read_text())["model"]
    body = {"model": model, "global_batch_size": 64, "max_gpus": 64, "precision": "bf16"}
    assert json.loads(capsys.readouterr().out) == client.post("/v1/plan/recommend", json=body).json()


def test_plan_recommend_that_fits_nowhere_says_why_and_shows_the_least_plan():
    out = run_zero1("plan", *GPT_7B_FLAGS, "--recommend", "--global-batch-size", "64", "--max-gpus", "1")
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.startswith("does not fit: nothing fits within max_gpus = 1: the least per-GPU plan found is")
    assert "N >= 2 would fit" in out.stderr and "min_gpus at stage 1: 2" in out.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--params", "7.5e9", "--recommend", "--global-batch-size", "8"], "--recommend needs a model"),
        (["--model", "gpt", "--n-layer", "2", "--n-embd", "128", "--recommend"], "global_batch_size: Field required"),
        (
            ["--model", "gpt", "--n-layer", "2", "--n-embd", "128", "--recommend", "--global-batch-size", "8"]
            + ["--micro-batch-size", "2"],
            "--micro-batch-size do not apply to --recommend",
        ),
        (
            ["--model", "gpt", "--n-layer", "2", "--n-embd", "128", "--recommend", "--global-batch-size", "0"],
            "global_batch_size: Input should be greater than or equal to 1 (got 0)",
        ),
        (["--params", "7.5e9", "--global-batch-size", "8"], "--global-batch-size and --max-gpus apply to --recommend"),
    ],
)
def test_plan_recommend_rejects_bad_input_naming_the_flag(args, message, capsys):
    assert main(["plan", *args]) == 2
    assert message in capsys.readouterr().err


def test_fractional_parameter_count_is_refused():
    out = run_zero1("plan", "--params", "7.5")
    assert out.returncode == 2 and "must be a whole number, got 7.5" in out.stderr


@pytest.mark.parametrize("params", ["1e1000000", "1e5000", "9" * 31])
def test_a_parameter_count_of_more_than_30_digits_is_refused_at_once(params, capsys):
    start = time.monotonic()
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--params", params])
    assert exit_.value.code == 2 and time.monotonic() - start < 1
    assert f"must have at most 30 digits, got {params}" in capsys.readouterr().err


def test_db_upgrade_names_the_database_but_not_its_password(monkeypatch, capsys):
    from service import config, db

    monkeypatch.setenv("ZERO1_DATABASE_URL", "postgresql+psycopg://zero1:Not-A-Real-Secret-42@db.example:5432/zero1")
    monkeypatch.setattr(db, "upgrade", lambda url: None)  # the output is the point here, not the migration
    config.get_settings.cache_clear()
    try:
        assert main(["db", "upgrade"]) == 0
    finally:
        config.get_settings.cache_clear()
    out = capsys.readouterr().out
    assert out == "database at revision head: postgresql+psycopg://zero1:***@db.example:5432/zero1\n"


GPT_7B5 = {"kind": "gpt", "vocab_size": 59072, "n_layer": 36, "n_head": 32, "n_embd": 4096, "block_size": 2048}


def test_serve_plans_admits_and_trains_as_a_user_would(tmp_path):
    """`zero1 serve` with an embedded Ray of 64 logical GPUs of 80 GB, driven over HTTP and by the CLI."""
    port = free_port()
    env = {
        **ENV,
        "ZERO1_SIMULATED_GPUS": "64",
        "ZERO1_DATABASE_URL": f"sqlite:///{tmp_path / 'zero1.db'}",
        "ZERO1_CHECKPOINT_URI": str(tmp_path / "checkpoints"),
        "ZERO1_URL": f"http://127.0.0.1:{port}",
    }
    server = subprocess.Popen([ZERO1, "serve", "--port", str(port)], env=env, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_healthy(base, server=server)["status"] == "ok"
        assert httpx.get(f"{base}/v1/cluster").json()["num_gpus"] == 64
        r = httpx.post(f"{base}/v1/plan", json={"num_params": 7_500_000_000, "num_gpus": 64}, timeout=10)
        assert r.json()["per_gpu"]["total_bytes"] == 31_406_250_000
        assert httpx.get(f"{base}/docs", timeout=10).status_code == 200

        job = {"name": "7.5B", "model": GPT_7B5, "num_gpus": 2, "steps": 10}
        rejected = httpx.post(f"{base}/v1/jobs", json=job, timeout=10).json()
        assert rejected["error"] == "does_not_fit" and "min_gpus = " in rejected["message"]
        admitted = httpx.post(
            f"{base}/v1/jobs", params={"dry_run": "true"}, json={**job, "num_gpus": 64}, timeout=10
        ).json()
        per_gpu = admitted["plan"]["per_gpu"]
        states = sum(per_gpu[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "padding_bytes"))
        assert admitted["admitted"] and round(states / 1e9, 1) == 31.4  # 4Ψ + 12Ψ/64, Ψ = 7.5e9
        assert per_gpu["activations_bytes"] > 0 and per_gpu["overhead_bytes"] == 10**9

        submitted = subprocess.run(
            [ZERO1, "submit", str(ROOT / "examples" / "tiny-gpt.json")],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert submitted.returncode == 0, submitted.stderr
        job_id = int(submitted.stdout.strip().splitlines()[-1].split()[1])
        watched = subprocess.run([ZERO1, "watch", str(job_id)], env=env, capture_output=True, text=True, timeout=300)
        assert watched.returncode == 0, watched.stdout + watched.stderr
        assert watched.stdout.rstrip().endswith("succeeded")
        metrics = httpx.get(f"{base}/v1/jobs/{job_id}/metrics", params={"limit": 10_000}).json()["data"]
        assert [m["step"] for m in metrics] == list(range(300))
        listed = subprocess.run([ZERO1, "jobs"], env=env, capture_output=True, text=True, timeout=60)
        assert f"{job_id:>6}  succeeded" in listed.stdout
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    # uvicorn shuts down gracefully, then re-raises SIGTERM so the exit status tells why it stopped
    assert server.returncode in (0, -signal.SIGTERM)
    log = server.stderr.read()
    assert f"Uvicorn running on http://127.0.0.1:{port}" in log
    assert "Application shutdown complete" in log


def test_the_deployment_docs_list_every_setting():
    from service.config import env_table

    docs = (ROOT / "docs" / "deployment.md").read_text()
    table = docs.split("<!-- env-table -->\n", 1)[1].split("\n<!-- /env-table -->", 1)[0]
    assert table == env_table()


@pytest.mark.parametrize("command", [["jobs"], ["status", "1"], ["watch", "1"], ["cancel", "1"]])
def test_a_client_command_with_no_server_says_where_it_looked_and_how_to_point_it(command):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = subprocess.run([ZERO1, *command, "--url", url], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # one line, no traceback
    assert f"cannot reach the zero1 API at {url}" in lines[0]
    assert "zero1 serve" in lines[0] and "ZERO1_URL" in lines[0] and "--url" in lines[0]


def test_output_into_a_closed_pipe_is_no_error():
    """`zero1 plan ... | head -1`: the reader went away, so the rest of the output goes nowhere, quietly."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to the pipe now fails with EPIPE
    try:
        result = subprocess.run(
            [ZERO1, "plan", "--params", "7.5e9"], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60
        )
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (0, "")


def test_submit_code_zips_the_directory_without_vcs_caches_virtualenvs_or_ignored_files(tmp_path):
    from service.cli.bundle import zip_directory

    root = tmp_path / "project"
    files = {
        "pkg/__init__.py": "",
        "pkg/model.py": "def build(): ...\n",
        "README.md": "mine\n",
        ".gitignore": "# build output\n*.log\n/data/\nscratch/\n",
        ".git/HEAD": "ref: refs/heads/main\n",
        "pkg/__pycache__/model.cpython-311.pyc": "x",
        "venv/pyvenv.cfg": "home = /usr/bin\n",
        "venv/lib/site.py": "x",
        "run.log": "x",
        "pkg/deep/run.log": "x",
        "data/big.bin": "x",
        "pkg/data/kept.txt": "a data/ below the top is not /data/\n",
        "pkg/scratch/tmp.txt": "x",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "pkg" / "link.py").symlink_to(root / "pkg" / "model.py")

    data, count = zip_directory(root)
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = archive.namelist()
        assert archive.read("pkg/model.py") == b"def build(): ...\n"
    assert names == [".gitignore", "README.md", "pkg/__init__.py", "pkg/data/kept.txt", "pkg/model.py"]
    assert count == len(names)
    (root / "README.md").touch()  # a newer mtime: the zip, and so the digest, depend on content only
    assert zip_directory(root)[0] == data


def test_the_jobs_table_shows_an_elastic_jobs_n_against_its_most():
    from service.cli.jobs import _gpus

    assert _gpus({"num_gpus": 4, "min_gpus": 4, "world_size": 4}) == "4"
    assert _gpus({"num_gpus": 4, "min_gpus": 2, "world_size": 2}) == "2/4"
    assert _gpus({"num_gpus": 4, "min_gpus": 2, "world_size": None}) == "-/4"  # queued: not started yet

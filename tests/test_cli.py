"""The `zero1` command as a user runs it: `zero1 plan`, `zero1 serve`, and the client commands
against a served API or a stand-in one, in a pipe and on a terminal.

Packages: service.cli.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import zipfile
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import httpx
import pytest

from service.cli import main
from zero1 import Client

from helpers import free_port, wait_healthy
from watched import watch_int

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
    assert "buckets            0.000                     0" in lines  # stage 2's line, none at stage 1
    stages = lines[lines.index("stage       GB per GPU at N=64") + 1 :][:4]
    stage2 = (16_640_625_000 + 3 * 25 * 2**20) / 1e9  # 2Ψ + 14Ψ/N and three 25 MiB buckets staged at once
    assert [line.split() for line in stages] == [
        ["0", "120.000"],
        ["1", "31.406"],
        ["2", f"{stage2:.3f}"],
        ["3", "1.875"],
    ]


def test_plan_trace_counts_the_step_in_the_cli_process():
    gpt = ("--model", "gpt", "--vocab-size", "256", "--n-layer", "2", "--n-embd", "64", "--block-size", "64")
    traced = run_zero1("plan", *gpt, "--micro-batch-size", "4", "--trace", "--json")
    closed = run_zero1("plan", *gpt, "--micro-batch-size", "4", "--json")
    assert traced.returncode == 0 == closed.returncode, traced.stderr + closed.stderr
    traced = json.loads(traced.stdout)
    closed = json.loads(closed.stdout)
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
        "7,500,029,952 parameters, global batch 64 (131,072 tokens), ZeRO stages 1-3 on up to 64 GPUs of "
        "80.000 GB (GB = 1e9 bytes): 12 configurations that fit, cheapest first"
    )
    assert lines[1].startswith("cost in GPU-seconds per optimizer step at 400 TFLOP/s and 100 GB/s per GPU: cost = N")
    header = lines.index("     N  micro-batch   accum  ckpt  stage  GB per GPU  headroom GB  cost GPU-s  why")
    rows = [line.split(maxsplit=8) for line in lines[header + 1 :]]
    assert len(rows) == 12
    assert rows[0] == [
        "4",
        "2",
        "8",
        "no",
        "1",
        "75.820",
        "4.180",
        "15.65",
        "micro-batch 2 is the largest that fits on 4 GPUs: 4 would need 98.14 GB > 80.00 GB",
    ]
    costs = [float(row[7]) for row in rows]
    assert costs == sorted(costs)
    fewest = min(rows, key=lambda row: (int(row[0]), float(row[7])))
    assert fewest[:5] == ["2", "1", "32", "no", "2"] and fewest[8].startswith(
        "the fewest GPUs it fits on: 1 would need"
    )
    stage2 = [row for row in rows if row[4] == "2" and row[0] == "8"]
    assert [row[1] for row in stage2] == ["4"] and "where 2 is the largest at stage 1" in stage2[0][8]


def test_plan_recommend_json_is_the_apis_json(client, capsys):
    argv = ["plan", *GPT_7B_FLAGS, "--recommend", "--global-batch-size", "64", "--gpus", "64", "--json"]
    assert main(argv) == 0
    model = json.loads((ROOT / "examples" / "gpt-7.5b.json").read_text())["model"]
    body = {"model": model, "global_batch_size": 64, "max_gpus": 64, "precision": "bf16"}
    assert json.loads(capsys.readouterr().out) == client.post("/v1/plan/recommend", json=body).json()


def test_plan_recommend_that_fits_nowhere_says_why_and_shows_the_least_plan():
    out = run_zero1("plan", *GPT_7B_FLAGS, "--recommend", "--global-batch-size", "64", "--max-gpus", "1")
    assert out.returncode == 1 and out.stderr == ""  # the answer, on stdout: a pipe to head shows it
    assert out.stdout.startswith("does not fit: nothing fits within max_gpus = 1: the least per-GPU plan found is")
    assert "N >= 2 would fit" in out.stdout and "min_gpus at stage 3: 2" in out.stdout


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
def test_a_parameter_count_of_more_than_30_digits_is_refused_at_once(params, capsys, monkeypatch):
    """Refused by its digits before int() is asked to expand it (int() is watched), and never planned."""
    expanded = watch_int(monkeypatch, "service.cli")
    planned: list[int] = []
    monkeypatch.setattr("service.cli.cmd_plan", lambda args: planned.append(args.params) or 0)
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--params", params])
    assert exit_.value.code == 2 and expanded.decimals == [] and planned == []
    assert f"must have at most 30 digits, got {params}" in capsys.readouterr().err
    assert main(["plan", "--params", "7.5e9"]) == 0  # the watch sees the int() a count within the bound is given
    assert expanded.decimals == [Decimal("7.5e9")] and planned == [7_500_000_000]


def test_db_upgrade_names_the_database_but_not_its_password(monkeypatch, capsys):
    from service import settings
    from service.store import db

    monkeypatch.setenv("ZERO1_DATABASE_URL", "postgresql+psycopg://zero1:Not-A-Real-Secret-42@db.example:5432/zero1")
    monkeypatch.setattr(db, "upgrade", lambda url: None)  # the output is the point here, not the migration
    settings.get_settings.cache_clear()
    try:
        assert main(["db", "upgrade"]) == 0
    finally:
        settings.get_settings.cache_clear()
    out = capsys.readouterr().out
    assert out == "database at revision head: postgresql+psycopg://zero1:***@db.example:5432/zero1\n"


REQUEST_TIMEOUT_S = 120
"""A bound on the requests that trace a model in a Ray task (the 7.5B job's admission): 10 s was past
under a busy loop per core beside the suite (a ReadTimeout), not a hang; no duration is asserted."""

GPT_7B5 = {"kind": "gpt", "vocab_size": 59072, "n_layer": 36, "n_head": 32, "n_embd": 4096, "block_size": 2048}


@pytest.mark.ray  # a `zero1 serve` with its embedded Ray
@pytest.mark.slow
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
    following = None
    try:
        assert wait_healthy(base, server=server)["status"] == "ok"
        assert httpx.get(f"{base}/v1/cluster").json()["num_gpus"] == 64
        r = httpx.post(f"{base}/v1/plan", json={"num_params": 7_500_000_000, "num_gpus": 64}, timeout=REQUEST_TIMEOUT_S)
        assert r.json()["per_gpu"]["total_bytes"] == 31_406_250_000
        assert httpx.get(f"{base}/docs", timeout=REQUEST_TIMEOUT_S).status_code == 200

        job = {"name": "7.5B", "model": GPT_7B5, "num_gpus": 2, "steps": 10}
        rejected = httpx.post(f"{base}/v1/jobs", json=job, timeout=REQUEST_TIMEOUT_S).json()
        assert rejected["error"] == "does_not_fit" and "min_gpus = " in rejected["message"]
        admitted = httpx.post(
            f"{base}/v1/jobs", params={"dry_run": "true"}, json={**job, "num_gpus": 64}, timeout=REQUEST_TIMEOUT_S
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
        # its lines as they come, from before it starts until the server's end event
        following = subprocess.Popen([ZERO1, "logs", "-f", str(job_id)], env=env, stdout=subprocess.PIPE, text=True)
        watched = subprocess.run([ZERO1, "watch", str(job_id)], env=env, capture_output=True, text=True, timeout=300)
        assert watched.returncode == 0, watched.stdout + watched.stderr
        assert watched.stdout.rstrip().endswith("succeeded")
        metrics = httpx.get(f"{base}/v1/jobs/{job_id}/metrics", params={"limit": 10_000}).json()["data"]
        assert [m["step"] for m in metrics] == list(range(300))
        listed = subprocess.run([ZERO1, "jobs"], env=env, capture_output=True, text=True, timeout=60)
        assert f"{job_id:>6}  succeeded" in listed.stdout
        code, drawn = run_on_a_terminal("jobs", env=env)
        assert code == 0 and f"{job_id}  \x1b[32msucceeded" in drawn, drawn  # a table, the status green

        followed, _ = following.communicate(timeout=60)
        logs = subprocess.run([ZERO1, "logs", str(job_id)], env=env, capture_output=True, text=True, timeout=60)
        assert following.returncode == 0 == logs.returncode, logs.stderr
        assert followed == logs.stdout and "\x1b" not in followed
        lines = followed.splitlines()
        assert {line.split("]")[0] for line in lines} == {"[rank 0", "[rank 1"}, lines[:5]
        assert any(line.startswith("[rank 1] INFO zero1.train: rank 1 of 2 on cpu") for line in lines), lines[:5]
        assert sum("INFO zero1.train: step " in line for line in lines) == 300  # rank 0's, a line a step
        one = subprocess.run(
            [ZERO1, "logs", str(job_id), "--rank", "1"], env=env, capture_output=True, text=True, timeout=60
        )
        assert one.stdout.splitlines() == [line for line in lines if line.startswith("[rank 1] ")]
    finally:
        if following is not None and following.poll() is None:
            following.kill()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    # uvicorn shuts down gracefully, then re-raises SIGTERM so the exit status tells why it stopped
    assert server.returncode in (0, -signal.SIGTERM)
    log = server.stderr.read()
    assert f"Uvicorn running on http://127.0.0.1:{port}" in log
    assert "Application shutdown complete" in log
    # ZERO1_ACCESS_LOG=changes: the writes and the refusals, not the polls that were most of the lines
    assert '"POST /v1/jobs HTTP/1.1" 422' in log and '"POST /v1/jobs?dry_run=true HTTP/1.1" 200' in log, log
    assert '"POST /v1/jobs?dry_run=false HTTP/1.1" 201' in log and '"GET /' not in log, log


def run_on_a_terminal(*args: str, env: dict[str, str]) -> tuple[int, str]:
    """`zero1 ARGS` with its stdout and stderr a pseudo-terminal 200 columns wide: its exit status and
    what it drew there."""
    import pty

    env = {key: value for key, value in env.items() if not key.startswith(("NO_COLOR", "FORCE_COLOR", "TTY_"))}
    env |= {"TERM": "xterm-256color", "COLUMNS": "200"}
    reader, writer = pty.openpty()
    process = subprocess.Popen([ZERO1, *args], env=env, stdout=writer, stderr=writer)
    os.close(writer)  # the child's copy is the last: reading past its exit is an EIO
    drawn = b""
    try:
        while chunk := os.read(reader, 1 << 16):
            drawn += chunk
    except OSError:
        pass
    finally:
        os.close(reader)
    return process.wait(timeout=60), drawn.decode()


def test_the_deployment_docs_list_every_setting():
    from service.settings import env_table

    docs = (ROOT / "docs" / "deployment.md").read_text()
    table = docs.split("<!-- env-table -->\n", 1)[1].split("\n<!-- /env-table -->", 1)[0]
    assert table == env_table()


@pytest.mark.parametrize("command", [["jobs"], ["status", "1"], ["watch", "1"], ["logs", "1", "-f"], ["cancel", "1"]])
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
    from zero1.bundle import zip_directory

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


# --------------------------------------------------------------------------- output: terminal or plain


class Terminal(io.StringIO):
    """A stream that says it is a tty: what rich draws on, captured."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def on_a_terminal(monkeypatch) -> Callable[[], Terminal]:
    """A call that makes stdout a 200-column colour terminal, whatever the environment running the
    tests says, and returns it. A call, not the fixture's value: pytest's capture takes sys.stdout
    back between a test's setup and its body."""
    for name in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.setenv("COLUMNS", "200")

    def swap() -> Terminal:
        monkeypatch.setattr(sys, "stdout", Terminal())
        return sys.stdout

    return swap


def fake_api(monkeypatch, handler) -> list[httpx.Request]:
    """The client commands talk to `handler` (an httpx.MockTransport's) instead of a server; the
    requests it was sent, in order."""
    from service.cli import jobs as cli_jobs

    requests = []

    def record(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return handler(request)

    transport = httpx.MockTransport(record)
    http = lambda args: httpx.Client(base_url=args.url, transport=transport)
    monkeypatch.setattr(cli_jobs, "_client", lambda args, **_: Client(args.url, http=http(args)))
    return requests


def job_json(**fields) -> dict:
    """A job as GET /v1/jobs/{id} answers it (JobPublic), these fields set."""
    job = {"id": 1, "name": "job", "status": "queued", "spec": None, "plan": {}, "num_gpus": 2, "min_gpus": 2}
    job |= {"world_size": None, "created_at": "2026-12-03T10:00:00Z", "started_at": None, "finished_at": None}
    job |= {"step": None, "steps": 300, "latest": None, "error": None, "attempt": 0, "queue_position": None}
    return job | fields


def test_output_is_plain_text_unless_stdout_is_a_terminal_rich_would_draw_on(on_a_terminal, monkeypatch):
    from zero1.output import terminal

    a_terminal = on_a_terminal()

    assert terminal(io.StringIO()) is None
    assert terminal(a_terminal) is not None and terminal() is not None  # stdout by default
    monkeypatch.setenv("FORCE_COLOR", "1")  # colours asked for: still no table in a pipe
    assert terminal(io.StringIO()) is None
    for name, value in (("TERM", "dumb"), ("TTY_COMPATIBLE", "0"), ("TTY_INTERACTIVE", "0")):
        with monkeypatch.context() as env:
            env.setenv(name, value)
            assert terminal(a_terminal) is None, name
    monkeypatch.setenv("NO_COLOR", "1")  # the layout, without colours
    assert terminal(a_terminal).no_color


def test_the_cli_loads_rich_only_in_the_commands_that_draw():
    """`zero1 plan` and `zero1 serve` start without it (100 ms of imports)."""
    code = "import sys, service.cli; print(sorted(m for m in sys.modules if m.split('.')[0] == 'rich'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout.strip()) == (0, "[]"), out.stderr


JOBS = [
    job_json(id=12, status="running", step=41, num_gpus=4, min_gpus=2, world_size=2)
    | {"latest": {"loss": 1.23456}, "name": "[bold]elastic[/]"},
    job_json(id=11, status="succeeded", step=299, num_gpus=2, min_gpus=2, latest=None, name="tiny"),
]


def _jobs_api(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"data": JOBS, "next_cursor": None})


def test_jobs_in_a_pipe_prints_the_plain_listing(monkeypatch, capsys):
    fake_api(monkeypatch, _jobs_api)
    assert main(["jobs"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "    id  status          step/steps      gpus      loss  name",
        "    12  running           42/300         2/4    1.2346  [bold]elastic[/]",
        "    11  succeeded        300/300           2         -  tiny",
    ]


def test_jobs_on_a_terminal_is_a_table_with_the_status_coloured(on_a_terminal, monkeypatch):
    a_terminal = on_a_terminal()
    fake_api(monkeypatch, _jobs_api)
    assert main(["jobs"]) == 0
    out = a_terminal.getvalue()
    assert "\x1b[32msucceeded" in out and "\x1b[36mrunning" in out  # green, cyan
    plain = [line.split() for line in re.sub(r"\x1b\[[0-9;]*m", "", out).splitlines()]
    assert plain == [
        ["id", "status", "step", "gpus", "loss", "name"],
        ["12", "running", "42/300", "2/4", "1.2346", "[bold]elastic[/]"],  # a name is text, never markup
        ["11", "succeeded", "300/300", "2", "-", "tiny"],
    ]


def _queue_api(request: httpx.Request) -> httpx.Response:
    """GET /v1/queue: a job estimated to start in 2 h 30 min, one unknown (it waits on a job of unknown length)."""
    soon = (datetime.now(UTC) + timedelta(hours=2.5, seconds=30)).isoformat()
    entry = {"name": "next", "owner": "alice", "priority": 50, "num_gpus": 2, "min_gpus": 2}
    entry |= {"created_at": "2026-12-03T10:00:00Z", "reason": "waiting for 2 GPUs, 0 free"}
    data = [
        entry | {"position": 1, "id": 7, "estimated_start": soon},
        entry | {"position": 2, "id": 8, "name": "later", "reason": "behind job 7", "estimated_start": None},
    ]
    return httpx.Response(200, json={"data": data, "count": 2, "owners": []})


def test_the_queue_shows_each_jobs_estimated_start_from_now(on_a_terminal, monkeypatch, capsys):
    from service.cli import jobs as cli_jobs
    from service.cli import queue as cli_queue
    from service.schemas.responses import starts_in

    fake_api(monkeypatch, _queue_api)
    monkeypatch.setattr(cli_queue, "_client", cli_jobs._client)  # the fake API's, as queue.py imported it
    assert main(["queue"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["#", "id", "priority", "gpus", "owner", "name", "starts", "reason"]
    assert lines[1].split() == [
        "1",
        "7",
        "50",
        "2",
        "alice",
        "next",
        "in",
        "2.5",
        "h",
        "waiting",
        "for",
        "2",
        "GPUs,",
        "0",
        "free",
    ]
    assert lines[2].split() == ["2", "8", "50", "2", "alice", "later", "-", "behind", "job", "7"]
    a_terminal = on_a_terminal()
    assert main(["queue"]) == 0
    table = re.sub(r"\x1b\[[0-9;]*m", "", a_terminal.getvalue()).splitlines()
    assert any(line.split()[:9] == ["1", "7", "next", "alice", "50", "2", "in", "2.5", "h"] for line in table)
    now = datetime(2026, 12, 3, 10, 0, tzinfo=UTC)
    assert [starts_in(now + timedelta(seconds=s), now=now) for s in (-5, 59, 61, 3599, 3600, 2 * 86_400)] == [
        "<1 min", "<1 min", "in 1 min", "in 59 min", "in 1.0 h", "in 2.0 d"
    ]  # fmt: skip
    assert starts_in(None, now=now) == "-" and starts_in(None, now=now, unknown="—") == "—"


def test_the_watch_line():
    from zero1.progress import progress_line as _progress

    job = {"step": 149, "steps": 300, "status": "running", "latest": {"loss": 1.5, "tokens_per_s": 37700.4}}
    assert _progress(job) == f"[{'#' * 15}{'.' * 15}] 150/300  loss 1.5000  37,700 tokens/s  running"
    assert _progress(job, eval_loss=1.75).endswith("150/300  loss 1.5000  eval 1.7500  37,700 tokens/s  running")
    queued = {"step": None, "steps": 300, "status": "queued", "latest": None}
    assert _progress(queued) == f"[{'.' * 30}] 0/300  loss -  - tokens/s  queued"


def test_submit_dry_run_that_does_not_fit_prints_why_and_the_plan_to_stdout(client, monkeypatch, capsys, tmp_path):
    """As a fit's plan does: `| head` shows it; the exit status says it does not fit."""
    spec = ROOT / "examples" / "gpt-7.5b.json"
    refused = client.post("/v1/jobs", params={"dry_run": True}, json=json.loads(spec.read_text()))
    assert refused.status_code == 422 and refused.json()["error"] == "does_not_fit"
    fake_api(monkeypatch, lambda request: httpx.Response(422, json=refused.json()))
    assert main(["submit", "--dry-run", str(spec)]) == 1
    out, err = capsys.readouterr()
    assert err == "", err
    assert out.startswith("does not fit: the per-GPU plan at N = 2, ZeRO stage 1, is 87.16 GB"), out
    assert "7,500,029,952 parameters" in out.splitlines()[1]


def test_status_shows_steps_done_beside_steps_both_counts(monkeypatch, capsys):
    """A finished 300-step job is 300 of 300, as watch and jobs say (GET's step is the last index, 299)."""
    done = job_json(id=3, status="succeeded", step=299)

    def api(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"data": []} if request.url.path.endswith("/events") else done)

    fake_api(monkeypatch, api)
    assert main(["status", "3"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["steps_done"], shown["steps"]) == (300, 300) and "step" not in shown


def _watched_api(statuses: list[str]):
    """A job that is polled through `statuses` a step at a time, the last with an error if it failed."""
    polls = iter(range(len(statuses)))

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/metrics"):
            return httpx.Response(200, json={"data": [{"step": 0, "eval_loss": 2.5}]})
        step = next(polls)
        status = statuses[step]
        job = job_json(id=5, status=status, step=step, steps=len(statuses))
        job |= {"latest": {"loss": 3.0 - step, "tokens_per_s": 1000.0}}
        died = {"rank": 1, "node_id": "n1", "exception": "RuntimeError", "message": "died", "traceback": []}
        return httpx.Response(200, json=job | ({"error": died} if status == "failed" else {}))

    return handler


def test_watch_in_a_pipe_redraws_its_line_and_exits_by_the_final_status(monkeypatch, capsys):
    fake_api(monkeypatch, _watched_api(["running", "running", "succeeded"]))
    assert main(["watch", "5", "--interval", "0"]) == 0
    out = capsys.readouterr().out
    assert out.count("\r") == 3 and out.endswith("3/3  loss 1.0000  eval 2.5000  1,000 tokens/s  succeeded\n")
    fake_api(monkeypatch, _watched_api(["running", "failed"]))
    assert main(["watch", "5", "--interval", "0"]) == 1
    assert capsys.readouterr().err == "error: rank 1 on node n1: RuntimeError: died\n"


def test_watch_on_a_terminal_draws_a_rich_bar(on_a_terminal, monkeypatch, capsys):
    a_terminal = on_a_terminal()
    fake_api(monkeypatch, _watched_api(["running", "running", "failed"]))
    assert main(["watch", "5", "--interval", "0"]) == 1
    out = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", a_terminal.getvalue())
    final = out.strip().splitlines()[-1].split()
    assert final[:2] == ["job", "5"] and final[3:] == [
        "3/3",
        "loss",
        "1.0000",
        "eval",
        "2.5000",
        "1,000",
        "tokens/s",
        "failed",
    ], out
    assert "\x1b[31mfailed" in a_terminal.getvalue()  # red
    assert capsys.readouterr().err == "error: rank 1 on node n1: RuntimeError: died\n"


def test_the_upload_bar_is_one_plain_line_unless_stderr_is_a_terminal(on_a_terminal):
    from zero1.bundle import UPLOAD_CHUNK_BYTES, upload_chunks

    on_a_terminal()  # a colour terminal's environment; the bar goes to the stream given

    data = bytes(range(256)) * (UPLOAD_CHUNK_BYTES // 128)  # two chunks
    plain = io.StringIO()
    assert b"".join(upload_chunks(data, label="uploading x", stream=plain)) == data
    assert plain.getvalue() == f"uploading x [{'#' * 30}] 100% 2.10/2.10 MB\n"
    small = io.StringIO()  # a python model's few kB: not 0.00/0.00 MB
    assert b"".join(upload_chunks(data[:3_210], label="uploading x", stream=small)) == data[:3_210]
    assert small.getvalue() == f"uploading x [{'#' * 30}] 100% 3.21/3.21 kB\n"
    tiny = io.StringIO()
    assert b"".join(upload_chunks(data[:640], label="uploading x", stream=tiny)) == data[:640]
    assert tiny.getvalue().endswith("100% 640/640 bytes\n")
    drawn = Terminal()
    assert b"".join(upload_chunks(data, label="uploading [x]", stream=drawn)) == data
    assert "uploading [x]" in drawn.getvalue() and "2.1/2.1 MB" in drawn.getvalue()


# --------------------------------------------------------------------------- zero1 logs


STREAM = (
    ": keep-alive\r\n"
    "id: 1\r\n"
    'data: {"seq": 1, "rank": 0, "line": "step 0"}\r\n'
    "\r\n"
    "retry: 100\n"
    "id: 2\n"
    "data:first\n"
    "data: second\n"
    "\n"
    "id\n"  # a field without a colon: the id emptied
    "event: end\r"
    'data: {"status": "succeeded"}\r'
    "\r"
    "data: never dispatched, no blank line after it"
)
MESSAGES = [("message", '{"seq": 1, "rank": 0, "line": "step 0"}', "1"), ("message", "first\nsecond", "2")]
MESSAGES += [("end", '{"status": "succeeded"}', "")]


def test_sse_messages_from_chunks_split_anywhere():
    from zero1.streams import sse_messages

    def parsed(chunks):
        return [(message.event, message.data, message.id) for message in sse_messages(chunks)]

    assert parsed([STREAM]) == MESSAGES
    assert parsed(list(STREAM)) == MESSAGES  # a character at a time: \r\n split between chunks
    for cut in range(1, len(STREAM)):
        assert parsed([STREAM[:cut], "", STREAM[cut:]]) == MESSAGES, cut
    assert parsed([": only comments\n\n", "event: end\n\n"]) == []  # no data: nothing dispatched


LOG_ROWS = [
    {"seq": 1, "time": "2025-01-01T00:00:00Z", "rank": None, "attempt": None, "stream": "marker"}
    | {"line": "1,000 older lines dropped"},
    {"seq": 2, "time": "2025-01-01T00:00:01Z", "rank": 0, "attempt": 1, "stream": "stdout", "line": "step 0 [x]"},
    {"seq": 3, "time": "2025-01-01T00:00:01Z", "rank": 1, "attempt": 1, "stream": "stderr", "line": "warning"},
    {"seq": 5, "time": "2025-01-01T00:00:02Z", "rank": 1, "attempt": 1, "stream": "log", "line": "INFO saved"},
]
LOG_LINES = ["[zero1] 1,000 older lines dropped", "[rank 0] step 0 [x]", "[rank 1] warning", "[rank 1] INFO saved"]


def _paged_logs(request: httpx.Request) -> httpx.Response:
    """GET /v1/jobs/7/logs in pages of 2 rows; any other job is unknown."""
    if request.url.path != "/v1/jobs/7/logs":
        return httpx.Response(404, json={"error": "not_found", "message": "job 8 not found"})
    after = int(request.url.params["after"])
    page = [row for row in LOG_ROWS if row["seq"] > after][:2]
    return httpx.Response(200, json={"data": page, "next": page[-1]["seq"] if page else after})


def test_logs_pages_until_a_page_is_empty(monkeypatch, capsys):
    requests = fake_api(monkeypatch, _paged_logs)
    assert main(["logs", "7", "--rank", "1", "--attempt", "1"]) == 0
    assert capsys.readouterr().out.splitlines() == LOG_LINES  # the fake filters nothing: the printing is the point
    assert [dict(request.url.params) for request in requests] == [
        {"rank": "1", "attempt": "1", "after": after} for after in ("0", "2", "5")
    ]
    assert main(["logs", "8"]) == 1
    assert capsys.readouterr() == ("", "zero1: 404 job 8 not found\n")


def test_logs_on_a_terminal_colour_stderr_red_and_log_lines_dim(on_a_terminal, monkeypatch):
    a_terminal = on_a_terminal()
    fake_api(monkeypatch, _paged_logs)
    assert main(["logs", "7"]) == 0
    out = a_terminal.getvalue()
    assert re.sub(r"\x1b\[[0-9;]*m", "", out).splitlines() == LOG_LINES
    assert "\x1b[31m[rank 1] warning" in out and "\x1b[2m[rank 1] INFO saved" in out
    assert "[rank 0] step 0 [x]\n" in out  # stdout unstyled, and a line is text, never markup


def _sse(row: dict) -> str:
    return f"id: {row['seq']}\ndata: {json.dumps(row)}\n\n"


@pytest.mark.parametrize(("status", "code"), [("succeeded", 0), ("failed", 1), ("cancelled", 1)])
def test_logs_follow_prints_each_line_as_it_arrives_until_the_end_event(status, code, monkeypatch, capsys):
    printed = []

    def body():
        for row in LOG_ROWS:
            text = _sse(row)
            yield f": keep-alive\n{text[:12]}".encode()  # a message split across chunks, mid-line
            yield text[12:].encode()
            printed.append(capsys.readouterr().out)  # what the CLI printed before the next chunk was sent
        yield f'event: end\ndata: {{"status": "{status}"}}\n\n'.encode()
        raise AssertionError("read past the end event")

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"Content-Type": "text/event-stream"}, content=body())

    requests = fake_api(monkeypatch, handler)
    assert main(["logs", "7", "-f", "--rank", "0"]) == code
    assert printed == [f"{line}\n" for line in LOG_LINES]
    assert dict(requests[0].url.params) == {"rank": "0", "follow": "true"}
    assert requests[0].extensions["timeout"]["read"] is None  # a quiet job sends only keep-alives


def test_logs_follow_of_an_unknown_job_a_broken_stream_and_ctrl_c(monkeypatch, capsys):
    fake_api(
        monkeypatch, lambda request: httpx.Response(404, json={"error": "not_found", "message": "job 9 not found"})
    )
    assert main(["logs", "9", "-f"]) == 1
    assert capsys.readouterr().err == "zero1: 404 job 9 not found\n"

    monkeypatch.setattr("zero1.streams.RECONNECT_DELAYS_S", (0, 0))
    rows = [LOG_ROWS[1], LOG_ROWS[2]]

    def breaks_after_each_line(request: httpx.Request) -> httpx.Response:  # a line, then the stream is gone
        after = int(request.url.params.get("after", 0))
        return httpx.Response(200, content=iter([_sse(row).encode() for row in rows if row["seq"] > after][:1]))

    requests = fake_api(monkeypatch, breaks_after_each_line)
    assert main(["logs", "9", "-f"]) == 1
    out, err = capsys.readouterr()
    assert out == "[rank 0] step 0 [x]\n[rank 1] warning\n"  # each line once: the new stream starts after it
    assert [request.url.params.get("after") for request in requests] == [None, "2", "3", "3"]
    assert err.splitlines() == [
        "zero1 logs: the stream broke off (it ended); again in 0 s, after line 2",
        "zero1 logs: the stream broke off (it ended); again in 0 s, after line 3",
        "zero1 logs: the stream broke off (it ended); again in 0 s, after line 3",
        "zero1 logs: the stream of job 9 broke off before the job ended (it ended)",
    ]

    def interrupted():
        yield _sse(LOG_ROWS[1]).encode()
        raise KeyboardInterrupt

    fake_api(monkeypatch, lambda request: httpx.Response(200, content=interrupted()))
    assert main(["logs", "9", "-f"]) == 130
    assert capsys.readouterr() == ("[rank 0] step 0 [x]\n", "")

"""Issue 27's rank side: a user's code runs as its owner in a child with no secret and no Ray.

A real `zero1 serve` with three users' tokens and ZERO1_RUN_AS (the tests run as root, so the uids
switch for real) runs a probe bundle: its build() at plan time and its forward() on each rank
write what they can see (uid, environment, /proc/*/environ, the database, Ray's token file,
another owner's job directory, a connection to Ray). The same job trains to the same losses with
and without ZERO1_RUN_AS; a rank whose child exits or is killed fails the attempt saying how; a
supervisor status the scheduler does not expect ends the attempt and frees its GPUs.

Packages: workers.runtime, service.scheduling.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.scheduling.ray_launcher import supervisor_name
from workers.records import RunAs
from workers.runtime.sandbox import check_runnable, child_environment, exit_reason
from zero1.bundle import zip_directory

from conftest import unsearchable_dirs
from figures import record
from helpers import TERMINAL, job_body, wait_job
from marks import starts
from s3 import SECRET_ACCESS_KEY
from served import ALICE, BOB, ROOT, Served, running

IDS = {"alice": (2001, 2001), "bob": (2002, 2002)}
NOBODY = (65534, 65534)
RUN_AS = "alice=2001:2001,bob=2002:2002,*=30000-30009"
NEEDLES = ["ZERO1_API_TOKENS", "ZERO1_DATABASE_URL", ALICE, BOB, ROOT, SECRET_ACCESS_KEY]

PROBE = """
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

CONNECT = "import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); print('CONNECTED')"


def _opens(path):
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            open(path, "rb").close()
        return "opened"
    except OSError as exc:
        return type(exc).__name__


def report(args, where):
    needles = [needle.encode() for needle in args["needles"]]
    exposing = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            data = Path("/proc", pid, "environ").read_bytes()
        except OSError:
            continue
        if any(needle in data for needle in needles):
            exposing.append(pid)
    found = {
        "uid": os.getuid(), "gid": os.getgid(), "euid": os.geteuid(), "groups": os.getgroups(),
        "env": dict(os.environ), "cwd": os.getcwd(), "environ_exposing": exposing,
        "opens": {name: _opens(args[name]) for name in ("database", "ray_token", "other_job_dir")},
    }
    if not args["try_ray"] or where == "forward-rank1":  # each refusal waits out the retries: tried where asked
        return _write(args, where, found)
    argv = [sys.executable, "-c", CONNECT, args["ray_address"]]
    # Ray's driver on loopback, as the GCS is; 2 tries of the GCS, not 20 (1 s each): refused as well
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_NUM_REDIS_GET_RETRIES": "2"}
    try:
        said = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        refused = "no token" if "InvalidAuthToken" in said.stderr else said.stderr[-300:]
        ray = "connected" if "CONNECTED" in said.stdout else refused
    except subprocess.TimeoutExpired:
        ray = "timed out"
    _write(args, where, {**found, "ray": ray})


def _write(args, where, found):
    Path(args["reports"], f"{where}-{os.getuid()}.json").write_text(json.dumps(found))


class Probe(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args, self.reported = args, False
        self.embed = nn.Embedding(64, 16)
        self.head = nn.Linear(16, 64)

    def forward(self, input_ids, labels):
        if not self.reported and not isinstance(input_ids, torch._subclasses.FakeTensor):
            report(self.args, f"forward-rank{torch.distributed.get_rank()}")
            self.reported = True
        logits = self.head(self.embed(input_ids))
        return nn.functional.cross_entropy(logits.reshape(-1, 64), labels.reshape(-1))


def build(**args):
    if not torch.distributed.is_initialized():  # at plan time (a rank reports from its forward)
        report(args, "build-plan")
    return Probe(args)


def leaky(**args):
    marked = ("ZERO1_", "RAY_", "AWS_", "PG")
    secrets = [f"{k}={v}" for k, v in os.environ.items() if k.startswith(marked) or "TOKEN" in k or "DATABASE" in k]
    raise RuntimeError(" ".join(secrets) or "nothing secret in an environment of " + " ".join(sorted(os.environ)))
"""


@pytest.fixture(scope="module")
@starts("ray", "slow")
def served(searchable, s3_server) -> Iterator[Served]:
    """The service with the S3 credentials in its environment (s3_server sets them), as a deployment
    on S3 has them: its ranks' parents hold them, their children must not."""
    with running("zero1-trust-", ZERO1_RUN_AS=RUN_AS) as service:
        yield service


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> Path:
    bundle = tmp_path_factory.mktemp("probe-bundle")
    (bundle / "probe.py").write_text(PROBE)
    return bundle


def probe_model(served: Served, reports: Path, *, other_job_dir: Path, try_ray: bool = False) -> dict:
    args = {
        "reports": str(reports),
        "database": str(served.database),
        "ray_token": str(Path.home() / ".ray" / "auth_token"),
        "other_job_dir": str(other_job_dir),
        "ray_address": served.gcs,
        "needles": NEEDLES,
        "try_ray": try_ray,
    }
    return {"kind": "python", "entrypoint": "probe:build", "args": args}


ESCAPES = ("a secret in its environment", "/proc/*/environ", "the database", "Ray's token", "another job", "Ray")
"""What each probe tries: every report counts one try of each."""


def assert_contained(report: dict, *, uid: int, gid: int, home_under: Path | None = None) -> None:
    """What a child of `uid` must see: its own ids, no secret, nothing of the service's."""
    assert (report["uid"], report["euid"], report["gid"]) == (uid, uid, gid), report
    assert report["groups"] in ([], [gid]), report["groups"]  # no supplementary groups
    names = set(report["env"])
    leaked = {n for n in names if n.startswith(("ZERO1_", "RAY_", "AWS_")) or "TOKEN" in n.split("_")}
    assert not leaked, leaked
    secrets_held = (ALICE, BOB, ROOT, SECRET_ACCESS_KEY)  # the last: the S3 key its rank's parent holds
    assert not any(secret in value for value in report["env"].values() for secret in secrets_held)
    assert report["environ_exposing"] == [], report["environ_exposing"]
    assert report["opens"] == {
        "database": "PermissionError",
        "ray_token": "PermissionError",
        "other_job_dir": "PermissionError",
    }, report["opens"]
    assert report.get("ray", "no token") == "no token", report.get("ray")  # refused by Ray's auth, quickly
    if home_under is not None:
        assert Path(report["env"]["HOME"]).parent == home_under, report["env"]["HOME"]


# --------------------------------------------------------------------------- the tests


def test_user_code_at_plan_time_and_on_every_rank_runs_as_its_owner_and_reaches_nothing_else(served, probe, reports):
    # the service and its ranks' parents hold storage credentials: the children's lack of them is tested
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"} <= set(served.env)
    code_alice = served.upload(probe, ALICE)
    # alice's job first: its directory is what bob's code then tries to open
    alice_body = job_body(name="alice", model=probe_model(served, reports, other_job_dir=served.state), seq_len=8)
    alice_body |= {"data": {"kind": "synthetic"}, "code": code_alice, "steps": 3}
    r = served.request("POST", "/v1/jobs", ALICE, json=alice_body)
    assert r.status_code == 201, r.text
    alice_job = served.wait(r.json()["id"], ALICE)
    assert alice_job["status"] == "succeeded", alice_job["error"]
    (alice_dir,) = served.checkpoints.glob(f"job-{alice_job['id']}-*")
    assert (alice_dir.stat().st_uid, stat.S_IMODE(alice_dir.stat().st_mode)) == (2001, 0o700)
    assert stat.S_IMODE(served.database.stat().st_mode) == 0o600
    for name in ("forward-rank0", "forward-rank1", "build-plan"):
        assert_contained(json.loads((reports / f"{name}-2001.json").read_text()), uid=2001, gid=2001)

    code_bob = served.upload(probe, BOB)
    model = probe_model(served, reports, other_job_dir=alice_dir, try_ray=True)
    # planned as the job below is (fp32, micro-batch 2): the job's admission then reuses this trace, cached
    planned = {"model": model, "code": code_bob, "seq_len": 8, "precision": "fp32", "micro_batch_size": 2}
    plan = served.request("POST", "/v1/plan", BOB, json=planned)
    assert plan.status_code == 200, plan.text
    bob_plan = json.loads((reports / "build-plan-2002.json").read_text())
    assert_contained(bob_plan, uid=2002, gid=2002)
    assert bob_plan["ray"] == "no token"

    bob_body = job_body(name="bob", model=model, seq_len=8) | {"data": {"kind": "synthetic"}, "code": code_bob}
    r = served.request("POST", "/v1/jobs", BOB, json={**bob_body, "steps": 3})
    assert r.status_code == 201, r.text
    assert served.wait(r.json()["id"], BOB)["status"] == "succeeded"
    for rank in (0, 1):
        report = json.loads((reports / f"forward-rank{rank}-2002.json").read_text())
        assert ("ray" in report) == (rank == 0)  # tried, and refused, at plan time and on rank 0
        assert_contained(report, uid=2002, gid=2002, home_under=served.checkpoints)
        assert report["cwd"].endswith("/working_dir_files/code")  # its own copy of its bundle
        assert report["env"]["PYTHONPATH"] == report["cwd"]
    found = [json.loads(path.read_text()) for path in reports.glob("*.json")]
    tried = sum(len(ESCAPES) - ("ray" not in report) for report in found)  # Ray tried by bob's plan and rank 0
    record("user code at plan time and on ranks, ZERO1_RUN_AS: 6 ways out", tried=tried, refused=tried, jobs_lost=0)


def test_an_exception_quoting_the_environment_shows_no_secret(served, probe):
    code = served.upload(probe, BOB)
    model = {"kind": "python", "entrypoint": "probe:leaky", "args": {}}
    r = served.request("POST", "/v1/plan", BOB, json={"model": model, "code": code, "seq_len": 8})
    assert r.status_code == 422, r.text
    assert "nothing secret in an environment of" in r.text and "HOME" in r.text, r.text
    assert not any(secret in r.text for secret in (*NEEDLES, "RAY_", "sqlite")), r.text
    record("a plan's error quoting the environment", tried=1, refused=1)


def test_the_same_job_trains_to_the_same_losses_bit_for_bit_with_and_without_run_as(served, app):
    client, _ = app
    body = job_body(steps=12, name="same")
    r = served.request("POST", "/v1/jobs", ALICE, json=body)
    assert r.status_code == 201, r.text
    plain_id = client.post("/v1/jobs", json=body).json()["id"]  # on the session's cluster, meanwhile
    assert served.wait(r.json()["id"], ALICE)["status"] == "succeeded"
    isolated = served.request("GET", f"/v1/jobs/{r.json()['id']}/metrics", ALICE).json()["data"]
    assert wait_job(client, plain_id, lambda j: j["status"] in TERMINAL)["status"] == "succeeded"
    plain = client.get(f"/v1/jobs/{plain_id}/metrics").json()["data"]
    assert [row["loss"] for row in isolated] == [row["loss"] for row in plain] and len(plain) == 12


def test_each_mapped_uid_is_checked_at_start_and_a_blocked_interpreter_is_named():
    blocked = unsearchable_dirs(os.path.realpath(sys.executable))
    if blocked:  # as here (/root is 0700): the service refuses to start rather than fail every job
        named = rf"ZERO1_RUN_AS: uid 65534 cannot search {blocked[-1]} \(mode 0.*chmod o\+x"  # the topmost that refuses
        with pytest.raises(ValueError, match=named):
            check_runnable(RunAs(*NOBODY))
    else:
        check_runnable(RunAs(*NOBODY))


def test_a_temporary_directory_a_mapped_uid_cannot_reach_is_named_at_start(searchable, tmp_path, monkeypatch):
    """A child enters its working directory before it drops root: a private TMPDIR would fail each
    child only at its first absolute path (a staged input, its code copy), so the start check says so."""
    check_runnable(RunAs(*NOBODY))  # the interpreter and zero1 are reachable (searchable), and so is TMPDIR
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    with pytest.raises(ValueError, match=rf"uid 65534 cannot reach the temporary directory {private}.*set TMPDIR"):
        check_runnable(RunAs(*NOBODY))


def test_the_childs_environment_is_built_from_an_allowlist():
    environ = {
        "PATH": "/usr/bin",
        "LC_ALL": "C.UTF-8",
        "NCCL_DEBUG": "INFO",
        "CUDA_VISIBLE_DEVICES": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "ZERO1_API_TOKENS": "alice:x",
        "ZERO1_DATABASE_URL": "postgresql://u:p@h/db",
        "RAY_AUTH_TOKEN": "t",
        "AWS_SECRET_ACCESS_KEY": "k",
        "HF_TOKEN": "h",
        "NCCL_AUTH_TOKEN": "n",
        "PGPASSWORD": "p",
        "DATABASE_URL": "d",
        "SOMETHING_ELSE": "s",
        "HOME": "/root",
    }
    env = child_environment(environ, home="/jobs/job-1", pythonpath="/jobs/job-1/working_dir_files/code-x")
    assert env == {
        "PATH": "/usr/bin",
        "LC_ALL": "C.UTF-8",
        "NCCL_DEBUG": "INFO",
        "CUDA_VISIBLE_DEVICES": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HOME": "/jobs/job-1",
        "TMPDIR": "/jobs/job-1/tmp",
        "PYTHONNOUSERSITE": "1",
        "PYTHONPATH": "/jobs/job-1/working_dir_files/code-x",
    }


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("os._exit(3)", "rank 1 exited with code 3"),
        ("os.kill(os.getpid(), signal.SIGKILL)", "rank 1 was killed by signal 9 (SIGKILL: out of memory?)"),
    ],
)
def test_a_child_that_dies_ends_the_attempt_saying_how(app, tmp_path, how, expected):
    client, _ = app
    bundle = tmp_path / "dies"
    bundle.mkdir()
    (bundle / "dies.py").write_text(
        PROBE.split("def build(**args):")[0]
        + f"""
import signal


class Dies(Probe):
    def forward(self, input_ids, labels):
        if torch.distributed.is_initialized() and torch.distributed.get_rank() == 1:
            {how}
        return super().forward(input_ids, labels)


def build(**args):
    module = Dies(args)
    module.reported = True  # probes nothing
    return module
"""
    )
    data, _ = zip_directory(bundle)
    code = client.post("/v1/code", content=data, headers={"Content-Type": "application/zip"}).json()["code"]
    model = {"kind": "python", "entrypoint": "dies:build", "args": {}}
    r = client.post("/v1/jobs", json=job_body(model=model, seq_len=8, code=code, data={"kind": "synthetic"}))
    assert r.status_code == 201, r.text
    job = wait_job(client, r.json()["id"], lambda j: j["status"] in TERMINAL)
    assert job["status"] == "failed", job
    assert job["error"]["exception"] == "ChildExited" and job["error"]["message"] == expected, job["error"]
    assert job["error"]["rank"] == 1
    record(f"a rank's child dies ({how.split('(')[0]})", faults=1, jobs_accepted=1, jobs_lost=0)


def test_exit_reasons_name_the_code_or_the_signal():
    assert exit_reason(0) == "exited with code 0"
    assert exit_reason(-signal.SIGSEGV) == "was killed by signal 11 (SIGSEGV)"
    assert exit_reason(-signal.SIGKILL) == "was killed by signal 9 (SIGKILL: out of memory?)"


def test_a_supervisor_cancelled_behind_the_schedulers_back_ends_the_attempt_and_frees_its_gpus(app):
    """Item 2: someone other than the scheduler cancels a running job's supervisor (user code could,
    before its child lost Ray); the job must not stay running with its GPUs counted as held."""
    import ray

    client, settings = app
    r = client.post("/v1/jobs", json=job_body(steps=100_000, name="long"))
    job = wait_job(client, r.json()["id"], lambda j: j["status"] == "running" and (j["step"] or 0) >= 1)
    waiting = client.post("/v1/jobs", json=job_body(steps=2, name="all four", num_gpus=4)).json()
    assert client.get(f"/v1/jobs/{waiting['id']}").json()["status"] == "queued"
    supervisor = ray.get_actor(supervisor_name(job["id"], job["attempt"]), namespace=settings.ray_namespace)
    # the scheduler may read "cancelled" and release the supervisor before its cancel returns: as well
    with contextlib.suppress(ray.exceptions.ActorDiedError):
        ray.get(supervisor.cancel.remote(), timeout=60)
    done = wait_job(client, job["id"], lambda j: j["status"] in TERMINAL, timeout_s=60)
    assert done["status"] == "failed", done
    assert "does not expect" in done["error"]["message"] and "'cancelled'" in done["error"]["message"], done
    # its 2 GPUs are free in the scheduler's count: the queued 4-GPU job runs
    assert wait_job(client, waiting["id"], lambda j: j["status"] in TERMINAL)["status"] == "succeeded"
    record("a supervisor cancelled behind the scheduler's back", faults=1, jobs_accepted=2, jobs_lost=0)


def test_what_a_jobs_code_plants_in_its_directory_is_not_followed_by_the_service(tmp_path):
    """The service reads and prunes a job's checkpoints as root: a linked step directory or marker
    (pointing it at files of the service's) and names that are no step are passed over, never followed."""
    from workers.training.checkpoints import COMPLETE, latest_checkpoint, prune_checkpoints, step_dir, write_json

    outside = tmp_path / "outside"
    outside.mkdir()
    write_json(outside / COMPLETE, {"step": 999, "world_size": 2})
    secret = tmp_path / "secret.json"
    write_json(secret, {"step": 998, "world_size": 2})
    job = tmp_path / "job"
    real = step_dir(job, 9)
    real.mkdir(parents=True)
    write_json(real / COMPLETE, {"step": 9, "world_size": 2})
    (job / "step-000000999").symlink_to(outside, target_is_directory=True)  # a linked step directory
    linked = step_dir(job, 998)
    linked.mkdir()
    (linked / COMPLETE).symlink_to(secret)  # a linked marker
    (job / "step-evil").mkdir()  # a name that is no step
    assert latest_checkpoint(job) == (9, 2)
    assert prune_checkpoints(job, keep_last=1, keep_newest_unfinished=False) == [998]  # the real unfinished one
    assert sorted(p.name for p in outside.iterdir()) == [COMPLETE] and secret.exists()  # nothing followed
    record("links and odd names planted in a job's checkpoint directory", tried=3, refused=3)

"""Issue 40, items 1, 6 and 12: a user's code bundle is never on the trusted side's import path, Ray's
temporary directory lies where no job's uid can enter, and S3 with the embedded Ray trains to the bucket.

A real `zero1 serve` with ZERO1_RUN_AS, its checkpoints (and so its code store) on the session's S3
server and its Ray's files under a world-writable RAY_TMPDIR (as /tmp is), is attacked as a user with
a token would: a bundle stored before the upload rule, holding a `sitecustomize.py` beside an
ordinary model, is planned and trained, and no hook runs as root; a job's uid tries Ray's session
directory; the children's environment and /proc hold no S3 key, while the job's checkpoints land in
the bucket. Lower down: the unpacking of a stored zip for a child (workers/training/bundles.py),
the start-up refusal of Ray's temporary directory, and what the embedded Ray keeps of the environment.

Packages: workers.training, workers.runtime, service.planning, service.store.code.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.planning.capacity import private_ray_temp_dir, without_service_secrets
from service.store.code.stores import CodeStore, ObjectCodeStore
from workers.training.bundles import BundleError, unpack_bundle
from workers.training.checkpoints import latest_checkpoint
from workers.training.storage import open_store
from workers.uris import join_uri

from figures import record
from helpers import free_port, job_body, stored_bundle, symlink_zip, zip_of
from marks import starts
from s3 import SECRET_ACCESS_KEY
from served import ALICE, ZERO1, Served, running

RUN_AS = "alice=2001:2001,bob=2002:2002,*=30000-30009"
ALICE_UID = 2001

MODEL = """
import json, os
from pathlib import Path

import torch
from torch import nn

REPORTS = "@REPORTS@"
NEEDLE = "@NEEDLE@".encode()


def report(where):
    exposing = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if NEEDLE in Path("/proc", pid, "environ").read_bytes():
                exposing.append(pid)
        except OSError:
            continue
    found = {"uid": os.getuid(), "env": sorted(os.environ), "exposing": exposing, "cwd": os.getcwd()}
    Path(REPORTS, f"{where}-{os.getuid()}.json").write_text(json.dumps(found))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head, self.reported = nn.Embedding(64, 16), nn.Linear(16, 64), False

    def forward(self, input_ids, labels):
        if not self.reported and not isinstance(input_ids, torch._subclasses.FakeTensor):
            report(f"rank{torch.distributed.get_rank()}")
            self.reported = True
        return nn.functional.cross_entropy(self.head(self.embed(input_ids)).reshape(-1, 64), labels.reshape(-1))


def build(**args):
    if not torch.distributed.is_initialized():  # at plan time
        report("plan")
    return Tiny()
"""

HOOK = """
import json, os, sys
from pathlib import Path

Path("@MARKERS@", f"{os.getuid()}-{os.getpid()}.json").write_text(json.dumps({"uid": os.getuid(), "argv": sys.argv}))
"""
"""A start-up hook that says who ran it: imported by any interpreter that has it on its sys.path."""

TRY_RAY_FILES = """
import json, os, sys

parent, session = sys.argv[1], sys.argv[2]
tries = {
    "list the private parent": lambda: os.listdir(parent),
    "list the session": lambda: os.listdir(session),
    "list the unpacked bundles": lambda: os.listdir(os.path.join(session, "runtime_resources")),
    "rename the session's logs": lambda: os.rename(os.path.join(session, "logs"), os.path.join(session, "planted")),
}
said = {}
for name, attempt in tries.items():
    try:
        attempt()
        said[name] = "done"
    except OSError as error:
        said[name] = type(error).__name__
print(json.dumps(said))
"""
"""What a job's code under its owner's uid tries on Ray's files (finding 6 renamed an unpacked bundle)."""


def shared_dir(prefix: str) -> Path:
    """A directory every uid may write in, sticky, as /tmp is."""
    directory = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(directory, 0o1777)
    return directory


@pytest.fixture(scope="module")
def world() -> Iterator[dict[str, Path]]:
    """The served Ray's RAY_TMPDIR, and where the models report and the hook marks: all world-writable."""
    dirs = {name: shared_dir(f"z1{name[0]}-") for name in ("ray", "reports", "markers")}
    try:
        yield dirs
    finally:
        for directory in dirs.values():
            subprocess.run(["rm", "-rf", str(directory)], check=False)


@pytest.fixture(scope="module")
@starts("ray", "slow")
def served(searchable, s3_server, world, tmp_path_factory) -> Iterator[Served]:
    """`zero1 serve` with ZERO1_RUN_AS, checkpoints and code on S3 (the AWS_* variables are in its
    environment: s3_server set them), and its embedded Ray's files under a world-writable RAY_TMPDIR."""
    uri = s3_server.uri(f"trust-bundles-{secrets.token_hex(4)}")
    local = tmp_path_factory.mktemp("bundles-local")
    env = {"ZERO1_RUN_AS": RUN_AS, "ZERO1_CHECKPOINT_URI": uri, "ZERO1_LOCAL_DIR": str(local)}
    with running("zero1-bundles-", RAY_TMPDIR=str(world["ray"]), **env) as service:
        yield service


def model_files(world: dict[str, Path]) -> dict[str, bytes]:
    body = MODEL.replace("@REPORTS@", str(world["reports"])).replace("@NEEDLE@", SECRET_ACCESS_KEY)
    return {"mymodel.py": body.encode()}


def post_code(served: Served, data: bytes) -> httpx.Response:
    headers = {"Authorization": f"Bearer {ALICE}", "Content-Type": "application/zip"}
    return httpx.post(served.base + "/v1/code", content=data, headers=headers, timeout=60)


# --------------------------------------------------------------------------- against zero1 serve


def test_a_bundles_startup_hook_never_runs_on_the_trusted_side_and_its_job_trains_to_the_bucket(served, world):
    """Finding 1, as stored before the upload rule (the store written directly), and finding 12."""
    files = model_files(world)
    response = post_code(served, zip_of(files))
    assert response.status_code == 201, response.text
    code = response.json()["code"]
    hook = HOOK.replace("@MARKERS@", str(world["markers"])).encode()
    tricked = zip_of({f"bundle/{name}": body for name, body in {**files, "sitecustomize.py": hook}.items()})
    open_store(join_uri(served.env["ZERO1_CHECKPOINT_URI"], "code")).write(
        f"{code.removeprefix('sha256:')}.zip", tricked
    )

    model = {"kind": "python", "entrypoint": "mymodel:build", "args": {}}
    # planned as the job below is (fp32, micro-batch 2): the job's admission then reuses this trace, cached
    planned = {"model": model, "code": code, "seq_len": 8, "precision": "fp32", "micro_batch_size": 2}
    plan = served.request("POST", "/v1/plan", ALICE, json=planned)
    assert plan.status_code == 200, plan.text
    body = job_body(name="tricked", model=model, seq_len=8, code=code, steps=4, checkpoint_every=2)
    r = served.request("POST", "/v1/jobs", ALICE, json={**body, "data": {"kind": "synthetic"}})
    assert r.status_code == 201, r.text  # finding 12: not a 503 NoCredentialsError of the embedded Ray
    job = served.wait(r.json()["id"], ALICE)
    assert job["status"] == "succeeded", job["error"]

    marks = [json.loads(path.read_text()) for path in world["markers"].glob("*.json")]
    assert [mark for mark in marks if mark["uid"] != ALICE_UID] == [], marks  # only a child, as alice, may import it
    (job_dir,) = [name for name in open_store(served.env["ZERO1_CHECKPOINT_URI"]).list() if name.startswith("job-")]
    stored = latest_checkpoint(open_store(join_uri(served.env["ZERO1_CHECKPOINT_URI"], job_dir)))
    assert stored is not None and stored[1] == 2, stored  # a complete checkpoint of both ranks, in the bucket
    for where in ("plan", "rank0", "rank1"):
        report = json.loads((world["reports"] / f"{where}-{ALICE_UID}.json").read_text())
        assert [name for name in report["env"] if name.startswith("AWS_")] == [] and report["exposing"] == []
        assert report["cwd"].endswith("/working_dir_files/code")  # its own copy of its bundle
    record("a bundle's sitecustomize.py on the trusted side (issue 40, item 1)", tried=3, refused=3, jobs_lost=0)


def test_a_stored_bundle_that_cannot_be_unpacked_is_a_422_naming_code_or_fails_the_attempt(served, world):
    """Trained while whole (its trace cached by its digest), then damaged in the store: a new plan's
    task refuses to unpack it (a 422 naming `code`), and so does each rank's actor of the same job
    again (the job fails saying so), as Ray's working_dir setup did."""
    code = post_code(served, zip_of({**model_files(world), "padding.txt": secrets.token_bytes(16)})).json()["code"]
    model = {"kind": "python", "entrypoint": "mymodel:build", "args": {}}
    body = {**job_body(name="damaged", model=model, seq_len=8, code=code, steps=2), "data": {"kind": "synthetic"}}
    first = served.request("POST", "/v1/jobs", ALICE, json=body).json()["id"]
    assert served.wait(first, ALICE)["status"] == "succeeded"
    damaged = zip_of({"bundle/mymodel.py": b"", "bundle/../escape.py": b""})
    open_store(join_uri(served.env["ZERO1_CHECKPOINT_URI"], "code")).write(
        f"{code.removeprefix('sha256:')}.zip", damaged
    )
    why = "the code bundle could not be unpacked for its child: entry 'bundle/../escape.py' is not a plain path"

    plan = served.request("POST", "/v1/plan", ALICE, json={"model": model, "code": code, "seq_len": 16})
    assert plan.status_code == 422 and plan.json()["detail"][0]["field"] == "code", plan.text
    assert why in plan.json()["message"]
    r = served.request("POST", "/v1/jobs", ALICE, json=body)
    assert r.status_code == 201, r.text
    job = served.wait(r.json()["id"], ALICE)
    assert job["status"] == "failed" and why in json.dumps(job["error"]), job["error"]


def test_the_hook_of_that_bundle_runs_wherever_it_is_on_the_path(world, tmp_path):
    """The control of the test above: the marker is written by any interpreter that has the hook on
    its path, so no marker of uid 0 there means no trusted process had it."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK.replace("@MARKERS@", str(tmp_path)))
    subprocess.run([sys.executable, "-c", "pass"], env={**os.environ, "PYTHONPATH": str(hook)}, check=True)
    assert [json.loads(path.read_text())["uid"] for path in tmp_path.glob("*.json")] == [os.getuid()]


@pytest.mark.parametrize(
    "entry", ["sitecustomize.py", "usercustomize.py", "x.pth", "json/__init__.py", "os.py", "torch/x.py", "numpy.py"]
)
def test_an_upload_that_would_shadow_a_module_is_a_422_naming_it(served, entry):
    response = post_code(served, zip_of({"mymodel.py": b"", entry: b"import os\n"}))
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["entry"] == entry and entry in response.json()["message"]


def test_an_upload_of_ordinary_modules_is_accepted(served):
    response = post_code(served, zip_of({"mymodel.py": b"", "mymodel_utils/__init__.py": b"", "README.md": b""}))
    assert response.status_code in (200, 201), response.text


def test_a_jobs_uid_cannot_reach_ray_s_session_directory(served, world):
    """Finding 6: Ray makes its temporary directory 0777; its parent, zero1's, is 0700 and root's."""
    (session,) = world["ray"].glob(f"**/session_*_{served.process.pid}")  # as a child reads it off its fds
    parent = session.parent.parent
    done = subprocess.run(
        [sys.executable, "-c", TRY_RAY_FILES, str(parent), str(session)],
        user=ALICE_UID,
        group=ALICE_UID,
        extra_groups=[],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    said = json.loads(done.stdout)
    assert set(said.values()) == {"PermissionError"}, said
    assert parent.name == "zero1-ray-0" and parent.parent == world["ray"]
    assert (parent.stat().st_uid, stat.S_IMODE(parent.stat().st_mode)) == (0, 0o700)
    record("a job's uid in Ray's session directory (issue 40, item 6)", tried=len(said), refused=len(said))


def test_serve_refuses_to_start_when_rays_private_parent_is_not_private(searchable, tmp_path):
    for kind in ("open", "link"):
        base = Path(tempfile.mkdtemp(prefix="z1p-", dir="/tmp"))
        parent = base / "zero1-ray-0"
        if kind == "open":
            parent.mkdir(mode=0o755)
            os.chmod(parent, 0o755)
        else:
            parent.symlink_to(tmp_path)
        env = {key: value for key, value in os.environ.items() if not key.startswith("ZERO1_")}
        env |= {"ZERO1_RUN_AS": RUN_AS, "ZERO1_DATABASE_URL": f"sqlite:///{tmp_path / 'z.db'}", "RAY_TMPDIR": str(base)}
        try:
            done = subprocess.run(
                [ZERO1, "serve", "--port", str(free_port())], env=env, capture_output=True, text=True, timeout=120
            )
        finally:
            subprocess.run(["rm", "-rf", str(base)], check=False)
        assert done.returncode == 2, done.stderr[-2000:]
        (line,) = done.stderr.strip().splitlines()
        assert line.startswith(f"zero1 serve: Ray's temporary directory's parent {parent} must be a directory of uid 0")


# --------------------------------------------------------------------------- lower down


FILES = {
    "pkg/": b"",
    "pkg/__init__.py": b"",
    "pkg/net.py": b"WIDTH = 7\n",
    "run.sh": b"#!/bin/sh\n",
    "notes.txt": b"hi",
}


def tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


@pytest.fixture
def private_tmp(tmp_path, monkeypatch) -> Path:
    """This test's own temporary directory: what an unpacking leaves behind is seen there."""
    directory = tmp_path / "tmp"
    directory.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(directory))
    return directory


def test_a_stored_bundle_unpacks_into_a_private_directory_given_to_the_childs_uid(tmp_path, private_tmp):
    store = CodeStore(tmp_path / "code")
    info, _ = store.put(zip_of(FILES))
    code = Path(unpack_bundle(store.uri(info.digest), owner=(ALICE_UID, ALICE_UID)))
    assert code.parts[-2:] == ("working_dir_files", "code") and code.parents[1].parent == private_tmp
    assert tree(code) == {
        "notes.txt": b"hi",
        "pkg": None,
        "pkg/__init__.py": b"",
        "pkg/net.py": b"WIDTH = 7\n",
        "run.sh": b"#!/bin/sh\n",
    }
    top = code.parents[1].stat()
    assert (top.st_uid, top.st_gid, stat.S_IMODE(top.st_mode)) == (ALICE_UID, ALICE_UID, 0o700)
    assert {path.stat().st_uid for path in code.rglob("*")} == {ALICE_UID}
    assert {stat.S_IMODE(path.stat().st_mode) for path in code.rglob("*") if path.is_file()} == {0o644}


def test_a_bundle_on_a_bucket_is_fetched_with_the_parents_credentials(s3_uri, private_tmp):
    store = ObjectCodeStore(open_store(join_uri(s3_uri, "code")))
    info, _ = store.put(zip_of(FILES))
    code = Path(unpack_bundle(store.uri(info.digest), owner=None))
    assert tree(code)["pkg/net.py"] == b"WIDTH = 7\n" and sorted(os.listdir(code.parents[1])) == ["working_dir_files"]


BAD_ZIPS = {
    "dotdot": (zip_of({"bundle/ok.py": b"", "bundle/../x.py": b""}), "entry 'bundle/../x.py' is not a plain path"),
    "absolute": (zip_of({"/etc/x.py": b""}), "entry '/etc/x.py' is not a plain path under bundle/"),
    "outside bundle/": (zip_of({"x.py": b""}), "entry 'x.py' is not a plain path under bundle/"),
    "symlink": (symlink_zip("bundle/escape", "/etc"), "entry 'bundle/escape' is not a regular file or a directory"),
    "file over dir": (zip_of({"bundle/x": b"", "bundle/x/y.py": b""}), "FileExistsError"),
}


@pytest.mark.parametrize(("data", "why"), BAD_ZIPS.values(), ids=BAD_ZIPS.keys())
def test_a_zip_that_could_land_outside_its_directory_is_refused_and_nothing_is_left(tmp_path, private_tmp, data, why):
    (tmp_path / "bad.zip").write_bytes(data)
    with pytest.raises(BundleError, match="the code bundle could not be unpacked for its child: ") as refused:
        unpack_bundle((tmp_path / "bad.zip").as_uri(), owner=None)
    assert why in str(refused.value)
    assert list(private_tmp.iterdir()) == []


def test_a_stored_zip_that_is_a_link_is_not_followed(tmp_path, private_tmp):
    real = stored_bundle(tmp_path / "real.zip", {"mine.py": b""})
    (tmp_path / "link.zip").symlink_to(tmp_path / "real.zip")
    assert (Path(unpack_bundle(real, owner=None)) / "mine.py").is_file()
    with pytest.raises(BundleError, match="Too many levels of symbolic links"):
        unpack_bundle((tmp_path / "link.zip").as_uri(), owner=None)


def test_rays_private_parent_is_made_0700_and_any_other_is_refused(tmp_path):
    base = Path(tempfile.mkdtemp(prefix="z1p-", dir="/tmp"))
    try:
        assert private_ray_temp_dir({"RAY_TMPDIR": str(base)}) == base / "zero1-ray-0" / "ray"
        assert stat.S_IMODE((base / "zero1-ray-0").stat().st_mode) == 0o700
        assert private_ray_temp_dir({"RAY_TMPDIR": str(base)}) == base / "zero1-ray-0" / "ray"  # again: as it is
        os.chown(base / "zero1-ray-0", ALICE_UID, ALICE_UID)  # planted by a job's uid before the service started
        with pytest.raises(ValueError, match=r"zero1-ray-0 must be a directory of uid 0 .* a directory of uid 2001"):
            private_ray_temp_dir({"RAY_TMPDIR": str(base)})
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False)
    with pytest.raises(ValueError, match=r"too long for Ray's socket paths: \d+ \+ 68 bytes > 107"):
        private_ray_temp_dir({"RAY_TMPDIR": str(tmp_path / ("x" * 40))})


def test_the_embedded_ray_keeps_the_stores_credentials_and_none_of_the_services_secrets():
    environ = {
        "AWS_ACCESS_KEY_ID": "a",
        "AWS_SECRET_ACCESS_KEY": "s",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
        "RAY_AUTH_TOKEN": "r",
        "ZERO1_API_TOKENS": "alice:x",
        "ZERO1_DATABASE_URL": "postgresql://u:p@h/db",
        "PGPASSWORD": "p",
        "HF_TOKEN": "h",
        "PATH": "/usr/bin",
    }
    with without_service_secrets(environ):
        during = dict(environ)
    assert sorted(during) == [
        "AWS_ACCESS_KEY_ID",
        "AWS_ENDPOINT_URL",
        "AWS_SECRET_ACCESS_KEY",
        "PATH",
        "RAY_AUTH_TOKEN",
    ]
    assert len(environ) == 9  # all back after

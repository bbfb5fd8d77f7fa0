"""Issue 40's owners: one uid per owner (item 7), ZERO1_RUN_AS start errors that name the directory that
blocks (item 13), format characters in names (item 11), roots that overlap the checkpoint storage (11).

A real `zero1 serve` with ZERO1_RUN_AS=alice=2001:2001,*=30000-30009 (tests/served.py: alice, bob, and
root, an admin and an owner like any other): root's and bob's jobs run under uids of their own from the
range, and bob's code, as an attacker's, tries root's job directory and final weights from disk. The
service restarts with a range that holds bob's uid alone: bob keeps it, root is told the range is full.
Beside it: the settings' refusals and `zero1 serve`'s one line, owners racing for uids on one database,
and a venv's link into a 0700 directory named at start.

Packages: service.run_as, service.store, service.settings, service.schemas, service.cli, workers.reach,
workers.runtime.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import tempfile
import threading
import unicodedata
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from service.run_as import parse_run_as
from service.schemas.printable import CONTROL, MULTILINE, escape
from service.settings import Settings
from service.store.db import Database, upgrade
from service.store.owner_uids import OwnerUids, UidRangeFull
from workers.records import RunAs
from workers.runtime.sandbox import check_runnable

from figures import record
from helpers import job_body
from marks import starts
from served import BOB, ROOT, ZERO1, Served

RANGE = range(30000, 30010)
RUN_AS = "alice=2001:2001,*=30000-30009"

PROBE = """
import json
import os
from pathlib import Path

import torch
from torch import nn


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
    found = {"uid": os.getuid(), "gid": os.getgid(), "opens": {k: _opens(v) for k, v in args["targets"].items()}}
    Path(args["reports"], f"{where}.json").write_text(json.dumps(found))


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
    if not torch.distributed.is_initialized():
        report(args, "build-plan")
    return Probe(args)
"""


class Owners:
    """The module's `zero1 serve`, which a test may restart on the same state (its database kept)."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.service = Served(state, ZERO1_RUN_AS=RUN_AS)

    def restart(self, **env: str) -> Served:
        self.service.stop()
        self.service = Served(self.state, **env)
        return self.service


@pytest.fixture(scope="module")
@starts("ray", "slow")
def owners(searchable) -> Iterator[Owners]:
    state = Path(tempfile.mkdtemp(prefix="zero1-owners-"))
    held = Owners(state)
    try:
        yield held
    finally:
        held.service.stop()
        subprocess.run(["rm", "-rf", str(state)], check=False)


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> Path:
    bundle = tmp_path_factory.mktemp("owners-probe")
    (bundle / "probe.py").write_text(PROBE)
    return bundle


def _job_dir(served: Served, job_id: int) -> Path:
    (directory,) = served.checkpoints.glob(f"job-{job_id}-*")
    return directory


def _stored_uids(served: Served) -> dict[str, int]:
    with sqlite3.connect(served.database) as connection:
        return dict(connection.execute("SELECT owner, uid FROM owner_uids"))


# --------------------------------------------------------------------------- item 7: one uid per owner


def test_unmapped_owners_run_as_uids_of_their_own_and_bob_reads_nothing_of_roots_job(owners, probe, reports):
    served = owners.service
    r = served.request("POST", "/v1/jobs", ROOT, json=job_body(name="root-weights", steps=3))
    assert r.status_code == 201, r.text
    assert served.wait(r.json()["id"], ROOT)["status"] == "succeeded"
    root_dir = _job_dir(served, r.json()["id"])
    final = root_dir / "final" / "model.safetensors"
    assert final.is_file()
    root_uid = root_dir.stat().st_uid
    assert root_uid in RANGE

    code = served.upload(probe, BOB)
    targets = {"job_dir": str(root_dir), "final_weights": str(final), "final_dir": str(final.parent)}
    model = {"kind": "python", "entrypoint": "probe:build", "args": {"reports": str(reports), "targets": targets}}
    # planned as the job below is (fp32, micro-batch 2): the job's admission then reuses this trace, cached
    planned = {"model": model, "code": code, "seq_len": 8, "precision": "fp32", "micro_batch_size": 2}
    plan = served.request("POST", "/v1/plan", BOB, json=planned)
    assert plan.status_code == 200, plan.text
    body = job_body(name="bob-probe", model=model, seq_len=8, steps=3) | {"data": {"kind": "synthetic"}, "code": code}
    r = served.request("POST", "/v1/jobs", BOB, json=body)
    assert r.status_code == 201, r.text
    assert served.wait(r.json()["id"], BOB)["status"] == "succeeded"

    found = {path.stem: json.loads(path.read_text()) for path in reports.glob("*.json")}
    assert set(found) == {"build-plan", "forward-rank0", "forward-rank1"}, found
    bob_uid = found["forward-rank0"]["uid"]
    assert bob_uid in RANGE and bob_uid != root_uid and _job_dir(served, r.json()["id"]).stat().st_uid == bob_uid
    for where, report in found.items():  # its trace and both ranks: the same uid, and root's files shut
        assert (report["uid"], report["gid"]) == (bob_uid, bob_uid), (where, report)
        assert report["opens"] == dict.fromkeys(targets, "PermissionError"), (where, report)
    assert _stored_uids(served) == {"root": root_uid, "bob": bob_uid}
    record("another owner's job directory and final weights, unmapped owners", tried=9, refused=9)


def test_bidi_and_format_characters_are_refused_in_every_text_field(owners):
    served = owners.service
    sneaky = "\u202e\ufeffname"
    dataset = {"kind": "dataset", "format": "jsonl", "path": "data/corpus.jsonl", "text_field": sneaky}
    bodies = {
        "name": job_body(name=sneaky),
        "data.path": job_body(data={"kind": "text", "path": f"data/{sneaky}.txt"}),
        "data.text_field": job_body(data=dataset, seq_len=8),
    }
    for field, body in bodies.items():
        r = served.request("POST", "/v1/jobs", BOB, json=body)
        assert r.status_code == 422, (field, r.text)
        assert r.json()["detail"][0]["field"] == field, r.text
        assert r.json()["message"].startswith(f"{field}: must not contain a format character (\\u202e at "), r.text
    record("bidi and format characters in names, paths, columns", tried=len(bodies), refused=len(bodies))


def test_after_a_restart_bob_keeps_his_uid_and_a_full_range_refuses_root_naming_it(owners, probe):
    before = _stored_uids(owners.service)
    bob_uid = before["bob"]
    star = f"*={bob_uid}-{bob_uid}"  # a range holding bob's uid alone: root's is outside it, and none is left
    served = owners.restart(ZERO1_RUN_AS=f"alice=2001:2001,{star}")

    r = served.request("POST", "/v1/jobs", ROOT, json=job_body(name="root-again", steps=2))  # root asks first
    assert r.status_code == 201, r.text
    failed = served.wait(r.json()["id"], ROOT)
    assert failed["status"] == "failed" and f"every uid of {star} (1) is another owner's" in json.dumps(failed)
    code = served.upload(probe, ROOT)  # a python model's plan runs its build() in a child of root's uid
    model = {"kind": "python", "entrypoint": "probe:build", "args": {"reports": "/nonexistent", "targets": {}}}
    plan = served.request("POST", "/v1/plan", ROOT, json={"model": model, "code": code, "seq_len": 8})
    assert (plan.status_code, plan.json()["error"]) == (503, "uid_range_full"), plan.text
    assert f"every uid of {star} (1) is another owner's, none is left for 'root'" in plan.json()["message"]

    r = served.request("POST", "/v1/jobs", BOB, json=job_body(name="bob-again", steps=2))
    assert r.status_code == 201, r.text
    assert served.wait(r.json()["id"], BOB)["status"] == "succeeded"
    assert _job_dir(served, r.json()["id"]).stat().st_uid == bob_uid
    assert _stored_uids(served)["bob"] == bob_uid


# --------------------------------------------------------------------------- ZERO1_RUN_AS's refusals at start


@pytest.mark.parametrize(
    ("run_as", "said"),
    [
        ("*=65534:65534", "entry '*=65534:65534' runs every owner it does not name as one uid"),
        ("alice=2001:2001,bob=2001:2002,*=30000-30009", "uid 2001 is named for 2 owners (alice, bob)"),
        ("alice=2001:2001,alice=2002:2002,*=30000-30009", "owner 'alice' is named twice"),
        ("*=0-100", "the range '*=0-100' holds uid 0, root"),
        ("alice=30005:30005,*=30000-30009", "the range *=30000-30009 holds uid 30005, alice's"),
        ("alice=2001:30001,*=30000-30009", "the range *=30000-30009 holds gid 30001, alice's"),
        ("alice=2001:2001", "needs a '*=LO-HI' entry"),
        ("*=9-3", "the range '*=9-3' is not LO-HI"),
    ],
)
def test_run_as_that_would_share_a_uid_is_refused_naming_it(run_as, said):
    with pytest.raises(ValidationError, match=f"ZERO1_RUN_AS.*{re.escape(said)}"):
        Settings(run_as=run_as)


def test_the_range_and_the_named_owners_are_read_and_checked_at_start():
    table = parse_run_as("alice=2001:2001,bob=2002:2003,*=30000-30009")
    assert table is not None and table.pool == RANGE and table.star == "*=30000-30009"
    assert table.checked_at_start() == [RunAs(2001, 2001), RunAs(2002, 2003), RunAs(30000, 30000)]
    assert parse_run_as(" , ") is None and Settings().run_as is None


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"ZERO1_RUN_AS": "*=65534:65534"}, "ZERO1_RUN_AS: entry '*=65534:65534' runs every owner it does not name"),
        (
            {"ZERO1_DATA_ROOTS": "{state}"},
            "ZERO1_DATA_ROOTS: the root {state} overlaps ZERO1_CHECKPOINT_URI, {state}/ck",
        ),
        (
            {"ZERO1_MODEL_ROOTS": "{state}/ck/x"},
            "ZERO1_MODEL_ROOTS: the root {state}/ck/x overlaps ZERO1_CHECKPOINT_URI",
        ),
    ],
)
def test_zero1_serve_refuses_in_one_line(tmp_path, env, said):
    state = os.path.realpath(tmp_path)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ZERO1_")} | {
        "ZERO1_CHECKPOINT_URI": f"{state}/ck",
        "ZERO1_DATABASE_URL": f"sqlite:///{state}/db/zero1.db",
        **{k: v.format(state=state) for k, v in env.items()},
    }
    done = subprocess.run([ZERO1, "serve"], env=environ, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [done.stderr.strip()] and done.stderr.startswith(
        f"zero1 serve: {said.format(state=state)}"
    ), done.stderr


@pytest.mark.parametrize(
    ("roots", "checkpoints", "kept"),
    [
        ({"data_roots": "s3://bucket"}, "s3://bucket/zero1", "ZERO1_CHECKPOINT_URI, s3://bucket/zero1"),
        ({"data_roots": "data,s3://bucket/zero1/datasets"}, "s3://bucket/zero1", "ZERO1_CHECKPOINT_URI"),
        ({"model_roots": "{tmp}"}, "s3://bucket/zero1", "ZERO1_LOCAL_DIR, {tmp}/local"),
        ({"data_roots": "{tmp}/db"}, "{tmp}/ck", "ZERO1_DATABASE_URL, {tmp}/db/zero1.db"),
    ],
)
def test_roots_that_overlap_what_the_service_keeps_are_refused_naming_both(tmp_path, roots, checkpoints, kept):
    tmp = os.path.realpath(tmp_path)
    values = {k: v.format(tmp=tmp) for k, v in roots.items()}
    with pytest.raises(ValidationError, match=re.escape(kept.format(tmp=tmp))):
        Settings(
            checkpoint_uri=checkpoints.format(tmp=tmp),
            local_dir=f"{tmp}/local",
            database_url=f"sqlite:///{tmp}/db/zero1.db",
            **values,
        )
    Settings(checkpoint_uri=f"{tmp}/ck", data_roots=f"{tmp}/data", model_roots="s3://bucket/models")  # apart


# --------------------------------------------------------------------------- owners racing for uids


def test_owners_taking_uids_at_once_each_get_their_own_and_the_rest_hear_the_range_is_full(database_url):
    upgrade(database_url)
    table = parse_run_as("alice=2001:2001,*=30000-30003")
    owners_of = [OwnerUids(Database(database_url), table=table) for _ in range(6)]  # six services, one database
    got: dict[str, object] = {}
    start = threading.Barrier(len(owners_of))

    def take(index: int) -> None:
        start.wait()
        try:
            got[f"owner-{index}"] = owners_of[index](f"owner-{index}")
        except UidRangeFull as exc:
            got[f"owner-{index}"] = exc

    threads = [threading.Thread(target=take, args=(index,)) for index in range(len(owners_of))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    given = {owner: run_as for owner, run_as in got.items() if isinstance(run_as, RunAs)}
    full = [exc for exc in got.values() if isinstance(exc, UidRangeFull)]
    assert sorted(run_as.uid for run_as in given.values()) == [30000, 30001, 30002, 30003]
    assert all(run_as.gid == run_as.uid for run_as in given.values()) and len(full) == 2
    assert full[0].status_code == 503 and "every uid of *=30000-30003 (4) is another owner's" in full[0].message
    again = OwnerUids(Database(database_url), table=table)  # a restart: each owner gets what it was given
    assert {owner: again(owner) for owner in given} == given and again("alice") == RunAs(2001, 2001)


# --------------------------------------------------------------------------- item 13: the directory that blocks


@pytest.fixture
def linked_python(searchable) -> Iterator[tuple[Path, Path]]:
    """A venv-like bin/python -> python3 -> <0700 home>/python3 -> this interpreter: every directory above
    bin/python is searchable, the link's target is not. (bin/python, the 0700 home)."""
    base = Path(tempfile.mkdtemp(prefix="zero1-venv-"))
    os.chmod(base, 0o755)
    home = base / "home"
    bin_dir = base / "venv" / "bin"
    home.mkdir(mode=0o700)
    bin_dir.mkdir(parents=True)
    (home / "python3").symlink_to(os.path.realpath(sys.executable))
    (bin_dir / "python3").symlink_to(home / "python3")
    (bin_dir / "python").symlink_to("python3")  # relative, as venv makes it
    try:
        yield bin_dir / "python", home
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False)


def _blocked_line(python: Path, home: Path) -> str:
    return (
        f"ZERO1_RUN_AS: uid 3101 cannot search {home} (mode 0700, owner 0:0), above {home}/python3, the target "
        f"of {python.parent}/python3 (reached from {python}): make each directory on the way searchable by it "
        "(chmod o+x) or use a Python it can reach"
    )


def test_a_python_linked_into_a_private_directory_is_named_in_one_line(linked_python, monkeypatch):
    python, home = linked_python
    monkeypatch.setattr(sys, "executable", str(python))
    with pytest.raises(ValueError) as raised:
        check_runnable(RunAs(3101, 3101))
    assert str(raised.value) == _blocked_line(python, home)


def test_zero1_serve_says_which_directory_blocks_in_one_line_not_a_traceback(linked_python, tmp_path):
    python, home = linked_python
    packages = Path(sys.executable).parents[1] / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    # bin/python is no venv: the venv's packages (zero1's editable install with them) its only site directory
    serve = f"import site, sys; site.addsitedir({str(packages / 'site-packages')!r}); from service.cli import main; "
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ZERO1_")} | {
        "ZERO1_RUN_AS": "alice=3101:3101,*=30000-30009",
        "ZERO1_CHECKPOINT_URI": str(tmp_path / "ck"),
        "ZERO1_DATABASE_URL": f"sqlite:///{tmp_path / 'db' / 'zero1.db'}",
    }
    done = subprocess.run(
        [str(python), "-S", "-c", serve + "sys.exit(main(['serve']))"],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stderr) == (2, f"zero1 serve: {_blocked_line(python, home)}\n")


# --------------------------------------------------------------------------- item 11: format characters printed


def test_every_format_character_is_escaped_where_stored_text_is_printed():
    assert escape("\u202e\ufeffgnp.exe\x1b[2J") == "\\u202e\\ufeffgnp.exe\\x1b[2J"
    for code_point in range(sys.maxunicode + 1):
        char = chr(code_point)
        category = unicodedata.category(char)
        if category == "Cf":  # this Python's Unicode: every format character is matched
            assert CONTROL.match(char), hex(code_point)
        elif CONTROL.match(char):  # and nothing else but C0, DEL, C1 and code points this Unicode leaves unassigned
            assert category in ("Cc", "Cn"), (hex(code_point), category)


def test_the_dashboards_script_escapes_what_the_server_escapes():
    """dashboard.js writes live text (names, log lines, reasons) with its own `visible`: the same escapes as
    printable.escape, run here by the node that playwright ships."""
    import playwright

    script = (Path(__file__).resolve().parents[1] / "service" / "dashboard" / "static" / "dashboard.js").read_text()
    visible = re.search(r"  const hex = .*?\n  \}\);\n", script, re.S)
    assert visible is not None, "dashboard.js's visible() moved"
    wanted = ("Cf", "Cc")
    sample = "".join(chr(c) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) in wanted) + "name"
    program = visible.group() + "process.stdout.write(JSON.stringify(visible(require('fs').readFileSync(0, 'utf8'))));"
    node = Path(playwright.__file__).parent / "driver" / "node"
    done = subprocess.run([str(node), "-e", program], input=sample, capture_output=True, text=True, timeout=60)
    assert json.loads(done.stdout) == escape(sample, keep=MULTILINE), done.stderr

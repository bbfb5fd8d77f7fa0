"""zero1 as a deployer installs it: a wheel, without extras, in a fresh virtual environment.

The development install is editable with the dev extras, which hides a module left out of the
wheel or a dependency only the extras bring. This test builds the wheel, installs it alone in a new
venv beside exactly the distributions its requirements (no extras) reach, and runs the commands a
deployer runs. Those distributions are linked from the development venv, where `make` installed them
(torch as TORCH_SPEC says), not downloaded and unpacked again: pip, offline, then installs the wheel
only if they satisfy every requirement it declares, and a package outside them cannot be imported.

Packages: service.cli, service.store.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from collections import defaultdict
from email.parser import Parser
from importlib import metadata
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from helpers import free_port, wait_for
from marks import starts

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str | Path, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == 0, f"{args}: {result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the tracked files: setuptools' build/ directory in the checkout could
    hold modules deleted since, which would ship."""
    source = tmp_path_factory.mktemp("source")
    out = tmp_path_factory.mktemp("wheel")
    tracked = _run("git", "ls-files", cwd=ROOT).stdout.splitlines()
    for name in tracked:
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    _run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", out, source)
    (built,) = out.glob("zero1-*.whl")
    return built


def requirements_of(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist, as pip reads them."""
    with zipfile.ZipFile(wheel) as archive:
        (name,) = (n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(archive.read(name).decode()).get_all("Requires-Dist")


def closure(requirements: list[str]) -> dict[str, metadata.Distribution]:
    """Every installed distribution `requirements` reach (no extras but those a requirement names,
    markers evaluated as pip does), by canonical name."""
    found: dict[str, tuple[metadata.Distribution, set[str]]] = {}
    todo = [(Requirement(text), "") for text in requirements]
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": extra}):
            continue
        dist = metadata.distribution(requirement.name)
        name = canonicalize_name(dist.metadata["Name"])
        extras = found.get(name, (dist, set()))[1]
        if name in found and set(requirement.extras) <= extras:
            continue
        found[name] = (dist, extras | set(requirement.extras))
        todo += [(Requirement(text), e) for text in dist.requires or [] for e in ["", *sorted(found[name][1])]]
    return {name: dist for name, (dist, _) in found.items()}


def link_installed(dists: dict[str, metadata.Distribution], site: Path) -> None:
    """Make `dists` installed in `site` by links to their files: a top-level entry only they hold
    (a package, its .dist-info) as one link, one other distributions share (a namespace package)
    file by file, so that nothing of a distribution outside `dists` is reachable."""
    holders: dict[str, set[str]] = defaultdict(set)
    for dist in metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        for line in (dist.read_text("RECORD") or "").splitlines():
            holders[line.split(",", 1)[0].split("/", 1)[0]].add(name)
    for name, dist in dists.items():
        assert dist.files is not None, f"{name} has no RECORD"
        for path in dist.files:
            top = path.parts[0]
            if top == ".." or (site / top).is_symlink():  # a script in bin/ (its #! names the old venv)
                continue
            whole = holders[top] == {name}
            target = site / (top if whole else path)
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.is_symlink():
                target.symlink_to(dist.locate_file(top if whole else path))


@pytest.fixture(scope="module")
@starts("slow")
def venv(wheel, tmp_path_factory) -> Path:
    """A new venv with the wheel (no extras) and what it requires: its bin/ directory."""
    root = tmp_path_factory.mktemp("venv")
    _run(sys.executable, "-m", "venv", "--without-pip", root)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    link_installed(closure(requirements_of(wheel)), root / "lib" / version / "site-packages")
    # --no-index: pip finds every requirement installed (the links) or fails naming the missing one
    pip = [sys.executable, "-m", "pip", "--python", root / "bin" / "python", "install", "--quiet", "--no-index"]
    _run(*pip, "--disable-pip-version-check", "--no-compile", wheel)
    return root / "bin"


def test_the_wheel_holds_every_module_the_templates_and_the_migrations(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = [p for folder in ("service", "workers") for p in (ROOT / folder).rglob("*") if p.is_file()]
    # the client ships as the package zero1 (pyproject's package-dir), every other folder as itself
    shipped = lambda p: str(p.relative_to(ROOT)).replace("service/client/", "zero1/", 1)
    expected = {shipped(p) for p in sources if "__pycache__" not in p.parts}
    expected |= {
        f"zero1_migrations/{p.relative_to(ROOT / 'migrations')}"
        for p in (ROOT / "migrations").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert expected - names == set()
    assert "zero1_migrations/versions/0001_initial.py" in names and "zero1_migrations/env.py" in names


def test_a_wheel_installed_without_extras_migrates_serves_plans_and_lists(venv, tmp_path):
    env = {key: value for key, value in os.environ.items() if not key.startswith("ZERO1_")}
    env |= {
        "ZERO1_DATABASE_URL": f"sqlite:///{tmp_path / 'zero1.db'}",
        "ZERO1_CHECKPOINT_URI": str(tmp_path / "ck"),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "PYTHONPATH": "",
    }
    zero1 = venv / "zero1"
    elsewhere = {"env": env, "cwd": tmp_path}  # not the checkout: nothing may come from the source tree

    assert "database at revision head" in _run(zero1, "db", "upgrade", **elsewhere).stdout
    plan = _run(zero1, "plan", "--params", "7.5e9", "--gpus", "64", **elsewhere).stdout
    assert "total             31.406        31,406,250,000" in plan.splitlines()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "serve.log", "w") as log:
        server = subprocess.Popen(
            [zero1, "serve", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, **elsewhere
        )
    try:
        health = wait_for(
            lambda: _health(url),
            lambda h: h is not None or server.poll() is not None,
            what="zero1 serve from the wheel to answer /healthz",
            timeout_s=120,
        )
        assert health is not None and health["status"] == "ok", (tmp_path / "serve.log").read_text()[-3000:]
        jobs = _run(zero1, "jobs", "--url", url, **elsewhere).stdout
        assert jobs.split() == ["id", "status", "step/steps", "gpus", "loss", "name"]
        # the Python client, as a script imports it from the wheel
        script = f"from zero1 import Client; print(Client({url!r}).cluster().num_gpus, Client.__module__)"
        assert _run(venv / "python", "-c", script, **elsewhere).stdout.split()[1] == "zero1.api"
    finally:
        server.terminate()
        server.wait(timeout=60)
    assert server.returncode in (0, -15)


def _health(url: str) -> dict | None:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).json()
    except httpx.HTTPError:
        return None


@pytest.mark.parametrize(
    ("given", "served"), [(None, "data,examples/data"), ("/srv/corpora", "data,examples/data,/srv/corpora")]
)
def test_make_run_adds_the_users_data_roots_to_the_tours(given, served):
    """A ZERO1_DATA_ROOTS of the user's no longer replaces examples/data under `make run` (the tour's
    dataset examples broke): it is added (issue 32)."""
    # not as a sub-make of `make test` (MAKELEVEL, MAKEFLAGS: it would print the directories it enters)
    outer = ("ZERO1_DATA_ROOTS", "MAKELEVEL", "MAKEFLAGS", "MFLAGS")
    env = {k: v for k, v in os.environ.items() if k not in outer} | ({"ZERO1_DATA_ROOTS": given} if given else {})
    printed = subprocess.run(["make", "-n", "run"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0, printed.stderr
    served_line = [line for line in printed.stdout.splitlines() if line.endswith("zero1 serve")]
    assert served_line == [f'ZERO1_DATA_ROOTS="{served}" .venv/bin/zero1 serve'], printed.stdout

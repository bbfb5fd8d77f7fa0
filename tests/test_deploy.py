"""docker-compose.yml, the Dockerfile and their secrets, checked without a Docker engine:
`docker-compose config` parses the file with an .env made from .env.example, and the wiring
is read from the YAML itself (docs/deployment.md, "Deploying with Docker Compose").

Packages: service.settings.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
SHARED = "/shared"
RAY_NODES = ("ray-head", "ray-worker")
STORAGE_ENV = {
    "AWS_ENDPOINT_URL": "http://minio:9000",
    "AWS_REGION": "us-east-1",
    "AWS_ACCESS_KEY_ID": "${MINIO_ROOT_USER:?set MINIO_ROOT_USER in .env}",
    "AWS_SECRET_ACCESS_KEY": "${MINIO_ROOT_PASSWORD:?set MINIO_ROOT_PASSWORD in .env}",
}
"""What the API and every Ray node hold to reach the checkpoints' bucket: the standard AWS variables."""


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def env_example() -> dict[str, str]:
    """.env.example's variables (name -> value)."""
    lines = (ROOT / ".env.example").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.lstrip().startswith("#"))


def _environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # the other spelling: ["KEY=value", ...]
        env = dict(item.split("=", 1) for item in env)
    return {key: str(value) for key, value in env.items()}


def _command(service: dict) -> str:
    command = service.get("command", "")
    return " ".join(command) if isinstance(command, list) else command


def test_docker_compose_config_accepts_the_file_with_the_example_env(tmp_path):
    """Debian's docker-compose parses and validates the file (and interpolates .env) without an engine."""
    docker_compose = shutil.which("docker-compose")
    if docker_compose is None:
        pytest.fail("docker-compose is not on PATH: .ci/run installs Debian's package", pytrace=False)
    shutil.copy(ROOT / ".env.example", tmp_path / ".env")
    # the committed file as it is; .env and the build context are looked up in the project directory
    command = [docker_compose, "--file", str(COMPOSE_FILE), "--project-directory", str(tmp_path), "config"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert set(resolved["services"]) == {"postgres", "minio", "minio-init", "ray-head", "ray-worker", "api"}
    api = _environment(resolved["services"]["api"])
    password = (tmp_path / ".env").read_text().split("POSTGRES_PASSWORD=", 1)[1].split()[0]
    assert api["ZERO1_DATABASE_URL"] == f"postgresql+psycopg://zero1:{password}@postgres:5432/zero1"
    minio_password = (tmp_path / ".env").read_text().split("MINIO_ROOT_PASSWORD=", 1)[1].split()[0]
    for name in ("api", *RAY_NODES):
        assert _environment(resolved["services"][name])["AWS_SECRET_ACCESS_KEY"] == minio_password, name

    # without the env file there is nothing to start: Compose says which file is missing
    (tmp_path / ".env").unlink()
    missing = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and ".env" in missing.stderr


def test_the_api_has_the_services_it_needs_and_migrates_before_serving(compose):
    services = compose["services"]
    api = services["api"]
    assert {"postgres", "ray-head"} <= set(services)
    assert api["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "ray-head" in api["depends_on"]
    assert services["postgres"]["healthcheck"]["test"]
    env = _environment(api)
    assert env["ZERO1_RAY_ADDRESS"] == "ray-head:6379"
    assert (
        env["ZERO1_DATABASE_URL"].startswith("postgresql+psycopg://") and "@postgres:5432/" in env["ZERO1_DATABASE_URL"]
    )
    command = _command(api)
    # the migration first; `&&`: the server never starts on a database the migration failed on
    assert re.search(r"zero1 db upgrade\s*&&.*\bzero1 serve\b", command, re.S), command
    assert "--host 0.0.0.0" in command
    # a Ray driver connects through a node of its own machine: the api joins the cluster first
    assert re.search(r"ray start --address=\S*ZERO1_RAY_ADDRESS\S* --num-cpus=0 --num-gpus=0", command), command
    assert "ray start --head" in _command(services["ray-head"]) and "--block" in _command(services["ray-head"])
    assert "--address=ray-head:6379" in _command(services["ray-worker"])
    for name in ("api", *RAY_NODES):
        assert services[name]["build"]["context"] == "." and services[name]["image"] == services["api"]["image"]


def test_every_published_port_is_bound_to_loopback(compose):
    published = {name: service.get("ports", []) for name, service in compose["services"].items()}
    assert published["api"] and published["ray-head"], published
    for name, ports in published.items():
        for port in ports:
            # the short syntax without an address ("8000:8000") binds every interface
            assert isinstance(port, str) and port.startswith("127.0.0.1:"), f"{name}: {port}"
    assert "127.0.0.1:8265:8265" in published["ray-head"]  # Ray's dashboard
    assert "127.0.0.1:8000:8000" in published["api"]
    assert {"127.0.0.1:9000:9000", "127.0.0.1:9001:9001"} <= set(published["minio"])  # S3 API, console
    assert "--dashboard-port=8265" in _command(compose["services"]["ray-head"])


def test_checkpoints_go_to_minio_and_the_shared_files_are_one_volume_at_the_same_path(compose):
    services = compose["services"]
    api = _environment(services["api"])
    # the checkpoints: in the bucket minio-init makes, reached by the API and by every Ray node
    uri = api["ZERO1_CHECKPOINT_URI"]
    assert uri.startswith("s3://"), uri
    bucket = uri.removeprefix("s3://").split("/")[0]
    assert f"mc mb --ignore-existing zero1/{bucket}" in _command_of(services["minio-init"], "entrypoint")
    for name in ("api", *RAY_NODES):
        env = _environment(services[name])
        assert {key: env.get(key) for key in STORAGE_ENV} == STORAGE_ENV, name
    assert any(v.startswith("minio-data:") for v in services["minio"]["volumes"])
    # code bundles and the token cache stay on a filesystem (ZERO1_LOCAL_DIR): one volume, one path
    mounts = {name: [v for v in services[name]["volumes"] if v.split(":")[1] == SHARED] for name in ("api", *RAY_NODES)}
    sources = {v.split(":")[0] for found in mounts.values() for v in found}
    assert all(len(found) == 1 for found in mounts.values()) and len(sources) == 1, mounts
    assert sources <= set(compose["volumes"])  # a named volume, not a host path
    assert api["ZERO1_LOCAL_DIR"] == SHARED
    # the image's user owns the mount point, so the volume Docker fills from it is writable
    assert re.search(rf"install -d -o zero1 -g zero1 .*{SHARED}\b", (ROOT / "Dockerfile").read_text())
    assert "postgres-data" in compose["volumes"]
    assert any(v.startswith("postgres-data:") for v in services["postgres"]["volumes"])


def _command_of(service: dict, key: str) -> str:
    command = service.get(key, "")
    return " ".join(command) if isinstance(command, list) else command


def test_minio_is_healthy_before_its_bucket_is_made_and_the_api_waits_for_the_bucket(compose):
    services = compose["services"]
    minio = services["minio"]
    init = services["minio-init"]
    assert minio["image"].startswith("minio/minio:") and init["image"].startswith("minio/mc:")
    assert _command(minio).startswith("server /data") and "--console-address :9001" in _command(minio)
    assert minio["healthcheck"]["test"] and init["depends_on"]["minio"]["condition"] == "service_healthy"
    assert services["api"]["depends_on"]["minio-init"]["condition"] == "service_completed_successfully"
    assert init.get("restart") == "no"  # a one-shot: it exits once the bucket exists


@pytest.mark.parametrize(
    ("password", "refused"),
    [("change-me-minio-root-password", True), ("Xchange_MEx-12345", True), ("a-real-secret-123", False)],
)
def test_minio_init_refuses_the_placeholder_password_and_makes_the_bucket(compose, tmp_path, password, refused):
    """minio-init's script, run by sh with a stand-in `mc` that logs its arguments."""
    init = compose["services"]["minio-init"]
    argv = [part.replace("$$", "$") for part in init["entrypoint"]]  # Compose's escape of a literal $
    (tmp_path / "mc").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "mc.log"}\n')
    (tmp_path / "mc").chmod(0o755)
    env = {**_environment(init), "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    env |= {"MINIO_ROOT_USER": "zero1", "MINIO_ROOT_PASSWORD": password}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    if refused:
        assert done.returncode != 0 and "MINIO_ROOT_PASSWORD is a placeholder" in done.stderr, done
        assert password not in done.stderr and not (tmp_path / "mc.log").exists()
    else:
        assert done.returncode == 0, done
        assert (tmp_path / "mc.log").read_text().splitlines() == [
            f"alias set zero1 http://minio:9000 zero1 {password}",
            "mb --ignore-existing zero1/zero1",
        ]


def test_the_worker_reserves_nvidia_gpus_and_can_be_scaled(compose):
    worker = compose["services"]["ray-worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices), devices
    # `--scale ray-worker=N`: a fixed name or host port would collide between replicas
    assert "container_name" not in worker and not worker.get("ports")
    assert "--num-gpus" not in _command(worker)  # Ray counts the GPUs the container sees


def test_secrets_come_from_the_git_ignored_env_file(compose, env_example):
    text = COMPOSE_FILE.read_text()
    secrets = ("POSTGRES_PASSWORD", "RAY_AUTH_TOKEN", "ZERO1_API_TOKENS", "MINIO_ROOT_PASSWORD")
    assert set(secrets) <= set(env_example)
    for value in env_example.values():
        assert value not in text
    for name, service in compose["services"].items():
        env = _environment(service)
        for key in (*secrets, "AWS_SECRET_ACCESS_KEY"):
            # only ever interpolated (${...}) from .env, never a literal
            assert key not in env or env[key].startswith("${"), f"{name}: {key} is inline"
        assert "ZERO1_API_TOKENS" not in env, name
        assert "RAY_AUTH_TOKEN" not in env or name in RAY_NODES, name
    for name in ("postgres", "api"):
        assert compose["services"][name]["env_file"] in (".env", [".env"]), name
    for name in ("minio", "minio-init"):  # MinIO's own credentials, nothing else of .env
        assert "env_file" not in compose["services"][name], name
        assert set(_environment(compose["services"][name])) == {"MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"}, name
    for name in RAY_NODES:
        # the nodes that start every job's ranks get Ray's token and the storage key, nothing else of
        # .env: a rank's Ray actor stores its checkpoints; its child never sees the key (an allowlist)
        service = compose["services"][name]
        assert "env_file" not in service, name
        assert _environment(service) == {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": "${RAY_AUTH_TOKEN:?set RAY_AUTH_TOKEN in .env}",
            **STORAGE_ENV,
        }
    assert "${POSTGRES_PASSWORD" in _environment(compose["services"]["api"])["ZERO1_DATABASE_URL"]
    for name in ("api", *RAY_NODES):
        assert _environment(compose["services"][name])["RAY_AUTH_MODE"] == "token", name

    def ignored(path: str) -> bool:
        return subprocess.run(["git", "check-ignore", "--quiet", path], cwd=ROOT, timeout=30).returncode == 0

    assert ignored(".env"), ".env is not git-ignored"
    assert not ignored(".env.example"), ".env.example must be committable"
    dockerignore = (ROOT / ".dockerignore").read_text().split()
    assert {".env", ".git", ".venv", ".zero1"} <= set(dockerignore)


def test_the_image_pins_the_versions_the_tests_ran_with():
    """docker/constraints.txt pins every runtime dependency of zero1 to the version in this venv."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.\d+-slim|^ARG PYTHON_IMAGE=python:3\.\d+-slim", dockerfile, re.M)
    assert re.search(r"^USER (?!root)\w+", dockerfile, re.M)
    torch = importlib.metadata.version("torch").split("+")[0]
    assert f"ARG TORCH_VERSION={torch}" in dockerfile and "ARG TORCH_INDEX_URL=" in dockerfile
    assert "--constraint /tmp/constraints.txt" in dockerfile

    pins = {}
    for line in (ROOT / "docker" / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version.strip()
    for name, version in pins.items():
        assert importlib.metadata.version(name) == version, f"{name}: pinned {version}, tested with another"
    requirements = [Requirement(r) for r in importlib.metadata.requires("zero1") or []]
    runtime = {canonicalize_name(r.name) for r in requirements if r.marker is None} - {"torch"}
    assert runtime <= set(pins), f"not pinned for the image: {sorted(runtime - set(pins))}"
    # the image installs the mlflow extra (an exporter needs it): its whole closure is pinned too
    assert '".[mlflow]"' in dockerfile
    extra = {canonicalize_name(r.name) for r in requirements if r.marker and r.marker.evaluate({"extra": "mlflow"})}
    assert extra and _closure(extra) <= set(pins), f"not pinned: {sorted(_closure(extra) - set(pins))}"


def _closure(names: set[str]) -> set[str]:
    """The installed distributions `names` need, themselves included (no extras of theirs)."""
    seen = set()
    todo = list(names)
    while todo:
        if (name := canonicalize_name(todo.pop())) in seen:
            continue
        seen.add(name)
        for text in importlib.metadata.requires(name) or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return seen

"""Shared fixtures."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
import time

# Ray reads this when it is first imported: nodes, GCS and actors then bind 127.0.0.1
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# the model hub is never reached: Hugging Face models in tests are built from configs
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# no Ray node of the tests (the session's, `zero1 serve`'s embedded ones) starts idle workers ahead
# of need: the suite starts dozens of nodes, and most such workers would exit unused (CPU time on 2 cores)
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
# Ray's files (sockets, logs, the cluster address) go to a directory of the test session's own,
# also for the `zero1 serve` subprocesses that start an embedded Ray. Short: socket paths must
# fit 107 bytes.
OWN_RAY_TMPDIR = None if "RAY_TMPDIR" in os.environ else tempfile.mkdtemp(prefix="zero1-ray-")
if OWN_RAY_TMPDIR:
    os.environ["RAY_TMPDIR"] = OWN_RAY_TMPDIR

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402
import pytest  # noqa: E402
from fakes import state_on_fakes  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from ordering import DURATIONS, StoreDurations, longest_first, read_durations  # noqa: E402

from service.main import create_app  # noqa: E402
from service.settings import Settings  # noqa: E402

from marks import apply_marks, check_no_ray_started, ray_is_up, starts  # noqa: E402
from s3 import S3Endpoint, S3Server, reserved_s3_endpoint, running_s3_server  # noqa: E402

TRACE_TIMEOUT_S = 600.0
"""ZERO1_PLAN_TIMEOUT_S of the tests' apps and tracers: a bound on a hang, not an expectation. A trace
takes seconds on a quiet machine; with a busy loop per core beside the suite, a GPT trace in a Ray
task ran past the default 120 s twice (the trace_timeout path has its own test, at 1 ms)."""


def make_settings(tmp_path: Path, **overrides) -> Settings:
    """A known simulated cluster (80 GB GPUs, 1 GB overhead) and a database of the test's own."""
    values = {
        "database_url": f"sqlite:///{tmp_path / 'zero1.db'}",
        "simulated_gpus": 4,
        "simulated_gpu_memory_gb": 80,
        "gpu_overhead_gb": 1,
        "checkpoint_uri": str(tmp_path / "checkpoints"),
        "cpus_per_worker": 0.5,
        "scheduler_interval_s": 0.05,
        "placement_timeout_s": 60,
        "plan_timeout_s": TRACE_TIMEOUT_S,
        "ray_namespace": f"zero1-test-{secrets.token_hex(4)}",  # each app's supervisors apart
    }
    return Settings(**{**values, **overrides})


@contextlib.contextmanager
def serve(settings: Settings) -> Iterator[TestClient]:
    """The app on `settings`, started and stopped by a TestClient. Its supervisors and placement
    groups end with it: a job a test leaves running (or a test that fails midway) never holds
    the session cluster's GPUs for the tests after it."""
    try:
        with TestClient(create_app(settings), raise_server_exceptions=False) as test_client:
            yield test_client
    finally:
        end_supervisors(settings.ray_namespace)


@contextlib.contextmanager
def serve_on_fakes(settings: Settings) -> Iterator[TestClient]:
    """The app on `settings` with stand-ins for Ray (tests/fakes.py): its API, scheduler and database as
    they are; a job it launches holds its logical GPUs and "runs" until it is cancelled. No Ray starts:
    a route that needs a Ray task (a python model's trace, a dataset's check) is for the Ray tests."""
    with TestClient(create_app(settings, make_state=state_on_fakes), raise_server_exceptions=False) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def fake_client(tmp_path_factory) -> Iterator[TestClient]:
    """The app on stand-ins for Ray (serve_on_fakes, 4 logical GPUs) with a SQLite database, per module."""
    with serve_on_fakes(make_settings(tmp_path_factory.mktemp("app"))) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def client(ray_cluster, tmp_path_factory) -> Iterator[TestClient]:
    """The app on the session's Ray cluster (4 logical GPUs) with a SQLite database, per module."""
    with serve(make_settings(tmp_path_factory.mktemp("app"))) as test_client:
        yield test_client


@pytest.fixture
def app(ray_cluster, tmp_path) -> Iterator[tuple[TestClient, Settings]]:
    """The app on the session's Ray cluster with a SQLite database of the test's own, and its settings."""
    settings = make_settings(tmp_path)
    with serve(settings) as test_client:
        yield test_client, settings


@pytest.fixture(scope="module")
def examples_app(ray_cluster, tmp_path_factory) -> Iterator[tuple[TestClient, Settings]]:
    """The app with the shipped examples' data among its data roots, as `make run` has them, per module."""
    settings = make_settings(
        tmp_path_factory.mktemp("examples"), data_roots=[str(Path(__file__).resolve().parents[1] / "examples" / "data")]
    )
    with serve(settings) as test_client:
        yield test_client, settings


def end_supervisors(namespace: str) -> None:
    """Kill every actor of a Ray namespace (an app's supervisors, a test's stand-ins) and remove its
    placement groups: a job a test leaves running never holds the session cluster's GPUs.

    ray.kill only asks: a supervisor may still be creating its group for a moment after it. The
    groups are removed once the namespace's actors are gone, so none is created after the pass."""
    import ray

    from service.scheduling.ray_launcher import remove_placement_groups

    named = lambda: [e for e in ray.util.list_named_actors(all_namespaces=True) if e["namespace"] == namespace]
    for entry in named():
        try:
            ray.kill(ray.get_actor(entry["name"], namespace=namespace), no_restart=True)
        except ValueError:  # it ended on its own since the listing
            continue
    deadline = time.monotonic() + 30
    while named() and time.monotonic() < deadline:
        time.sleep(0.05)
    remove_placement_groups(namespace)


@pytest.fixture(scope="module", autouse=True)
def _session_cluster_left_free(request) -> Iterator[None]:
    """After each module, every GPU of the session's Ray cluster is free again: a module that
    leaves one held fails here, by name, rather than the modules after it by placement timeouts."""
    import ray

    yield
    if not ray.is_initialized():  # the module ran no test on the session cluster, nor did any before
        return
    deadline = time.monotonic() + 60
    while (free := ray.available_resources().get("GPU", 0)) < 4:
        if time.monotonic() > deadline:
            held = [
                (entry["name"], entry["state"])
                for entry in ray.util.placement_group_table().values()
                if entry["state"] != "REMOVED"
            ]
            pytest.fail(f"{request.module.__name__} left {4 - free:g} of the session cluster's 4 GPUs held: {held}")
        time.sleep(0.1)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[S3Endpoint]:
    """Where the session's S3 server will answer, held from the start, and the standard AWS_* variables
    in os.environ pointing there (any others of the machine's removed): this process, the session's
    Ray nodes and every process started after reach it as production reaches S3. No server runs
    until a test asks for s3_server."""
    with reserved_s3_endpoint() as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
@starts("s3")
def s3_server(s3_endpoint) -> Iterator[S3Server]:
    """An S3 API on loopback for the session (moto's server, tests/s3.py) at s3_endpoint, with the
    bucket `zero1-test`. Its request log counts the bytes each GET sent."""
    with running_s3_server(s3_endpoint) as server:
        yield server


@pytest.fixture
def s3_uri(s3_server, request) -> str:
    """A prefix of the session's bucket that no other test writes under: s3://zero1-test/<test>-<hex>."""
    name = "".join(c if c.isalnum() or c in "-_" else "-" for c in request.node.name)[:60]
    return s3_server.uri(f"{name}-{secrets.token_hex(4)}")


@pytest.fixture(scope="session")
@starts("ray")
def ray_cluster(s3_endpoint):
    """Two Ray nodes on this machine, 2 logical GPUs each, on loopback; shut down after the session.

    Logical CPUs are 4 per node (more than the cores) so that 4 ranks of 0.5
    CPU each plus their supervisors fit; each rank runs torch on one thread. The nodes start
    after s3_endpoint: a rank's actor inherits its node's environment, and so its AWS_* variables
    (the S3 server itself starts only for the tests that use it).
    """
    import ray
    from ray.cluster_utils import Cluster

    # no log monitor: with log_to_driver=False no driver reads what it tails (it took 64 s of CPU a suite)
    node = {"num_cpus": 4, "num_gpus": 2, "include_dashboard": False, "include_log_monitor": False}
    cluster = Cluster(initialize_head=True, head_node_args=node)
    try:
        cluster.add_node(num_cpus=4, num_gpus=2)
        ray.init(address=cluster.address, namespace="zero1-tests", log_to_driver=False)
        assert {node["NodeManagerAddress"] for node in ray.nodes()} == {"127.0.0.1"}
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        if OWN_RAY_TMPDIR:
            shutil.rmtree(OWN_RAY_TMPDIR, ignore_errors=True)


import psycopg  # noqa: E402
from psycopg import sql  # noqa: E402

from service.store.db import Database, upgrade  # noqa: E402

POSTGRES_SERVER = "host=127.0.0.1 port=5432 user=postgres dbname=postgres connect_timeout=5"


def _postgres_admin() -> psycopg.Connection:
    """An autocommit connection to the server (CREATE/DROP DATABASE cannot run in a transaction)."""
    try:
        return psycopg.connect(POSTGRES_SERVER, autocommit=True)
    except psycopg.OperationalError as error:
        reason = f"PostgreSQL is unreachable at 127.0.0.1:5432 as user postgres: {error}"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}\n.ci/run must start PostgreSQL before the tests", pytrace=False)
        pytest.skip(reason)


@pytest.fixture(params=["sqlite", "postgresql"], ids=["sqlite", "postgresql"])
def database_url(request, tmp_path) -> Iterator[str]:
    """An empty database on each backend: a SQLite file, or a fresh PostgreSQL database dropped after."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'zero1.db'}"
        return
    name = f"zero1_test_{secrets.token_hex(8)}"
    with _postgres_admin() as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    finally:
        with _postgres_admin() as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture
def database(database_url) -> Iterator[Database]:
    """The migrated schema at head on `database_url`."""
    upgrade(database_url)
    db = Database(database_url)
    try:
        yield db
    finally:
        db.dispose()


def pytest_sessionfinish(session) -> None:
    """An xdist worker hands its figures to the controller, which prints the summary."""
    from figures import FIGURES

    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["figures"] = [[test, figures] for test, figures in FIGURES]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """The controller gathers the figures of each xdist worker as it finishes."""
    from figures import FIGURES

    FIGURES.extend((test, figures) for test, figures in node.workeroutput.get("figures", []))


def pytest_terminal_summary(terminalreporter) -> None:
    """The reliability figures of the fault, fuzz and load tests that ran (docs/guarantees.md)."""
    from figures import FIGURES, summary_lines

    if FIGURES:
        terminalreporter.write_sep("-", "reliability figures")
        for line in summary_lines():
            terminalreporter.write_line(line)


def unsearchable_dirs(*paths: str, inclusive: bool = False) -> list[Path]:
    """The directories above `paths` (and, `inclusive`, the paths themselves) that other users cannot
    search (as /root is here, above the interpreter)."""
    found: list[Path] = []
    for path in paths:
        resolved = Path(path).resolve()
        for directory in ([resolved] if inclusive else []) + list(resolved.parents):
            if not directory.stat().st_mode & stat.S_IXOTH and directory not in found:
                found.append(directory)
    return found


@pytest.fixture(scope="module")
def searchable() -> Iterator[None]:
    """Every uid can start this Python, import zero1 and reach the temporary directory, as ZERO1_RUN_AS
    needs (docs/security.md): each directory on the way that others cannot search gets o+x while a
    module needs it, and its mode back after (a CI machine's /tmp may be private).

    Held across processes: under pytest-xdist two workers' modules overlap, and the first to end must
    not take /root's o+x away from the other's running jobs. The holders' pids and the original modes
    live in a file under a lock; the last live holder restores them (a holder that died is dropped)."""
    with _searchable_ledger() as ledger:
        if not ledger["holders"]:
            blocked = unsearchable_dirs(os.path.realpath(sys.executable), str(Path(__file__).resolve().parents[1]))
            blocked += [d for d in unsearchable_dirs(tempfile.gettempdir(), inclusive=True) if d not in blocked]
            for directory in blocked:  # modes a dead holder left unrestored are the originals
                ledger["modes"].setdefault(str(directory), directory.stat().st_mode)
            for directory, mode in ledger["modes"].items():
                os.chmod(directory, mode | stat.S_IXOTH)
        ledger["holders"].append(os.getpid())
    try:
        yield
    finally:
        with _searchable_ledger() as ledger:
            ledger["holders"].remove(os.getpid())
            if not ledger["holders"]:
                for directory, mode in ledger.pop("modes").items():
                    os.chmod(directory, stat.S_IMODE(mode))
                ledger["modes"] = {}


@contextlib.contextmanager
def _searchable_ledger() -> Iterator[dict]:
    """The shared record of `searchable`: {"holders": [live pids], "modes": {directory: original mode}},
    read and written under an exclusive lock."""
    path = Path(tempfile.gettempdir()) / "zero1-tests-searchable.json"
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ledger = json.loads(path.read_text()) if path.exists() else {"holders": [], "modes": {}}
        ledger["holders"] = [pid for pid in ledger["holders"] if _alive(pid)]
        yield ledger
        path.write_text(json.dumps(ledger))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def reports() -> Iterator[Path]:
    """A directory every uid may write its report in (sticky: none replaces another's), for the
    probes of the trust tests, whose code runs under their owners' uids."""
    directory = Path(tempfile.mkdtemp(prefix="zero1-reports-"))
    os.chmod(directory, 0o1777)
    try:
        yield directory
    finally:
        subprocess.run(["rm", "-rf", str(directory)], check=False)


@pytest.fixture(scope="module")
@starts("slow")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` (tests/test_mlflow.py's MlflowServer) for the module's exports."""
    from test_mlflow import MlflowServer

    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    server.start()
    try:
        yield server
    finally:
        if server.process is not None and server.process.poll() is None:
            server.stop()


def client_on(api: TestClient, token: str | None = None, *, base_url: str = "http://zero1"):
    """A zero1 Client whose requests go to the TestClient `api`, each handed to it as it came (the same
    app, routes and database, without a socket), with `token` as its bearer token if given."""
    from zero1 import Client

    def forward(request: httpx.Request) -> httpx.Response:
        path = request.url.raw_path.decode()
        answer = api.request(request.method, path, content=request.content, headers=dict(request.headers))
        return httpx.Response(answer.status_code, headers=answer.headers, content=answer.content)

    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    return Client(http=httpx.Client(base_url=base_url, transport=httpx.MockTransport(forward), headers=headers))


@pytest.fixture
def cli_as(api, monkeypatch):
    """as_user(token): the CLI's client commands send that token (None: none) to the module's `api` (a
    TestClient), through client_on."""
    from service.cli import jobs as cli_jobs
    from service.cli import queue as cli_queue

    def as_user(token: str | None) -> None:
        def client(args, **_):
            return client_on(api, token, base_url=args.url)

        monkeypatch.setattr(cli_jobs, "_client", client)
        monkeypatch.setattr(cli_queue, "_client", client)

    return as_user


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--store-durations",
        action="store_true",
        help="write each file's seconds to tests/durations.json after a passing run (tests/ordering.py)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("store_durations"):
        config.pluginmanager.register(StoreDurations(DURATIONS), "zero1-store-durations")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test by what it starts (tests/marks.py): `make test-fast` leaves those out. Then put
    the longest files first (tests/ordering.py), the order xdist hands them to its workers in."""
    apply_marks(items)
    items[:] = longest_first(items, read_durations())


RAY_UP_BEFORE = pytest.StashKey[bool]()


def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[RAY_UP_BEFORE] = ray_is_up()


def pytest_runtest_teardown(item: pytest.Item) -> None:
    """A test not marked ray that connected this process to Ray errs here (tests/marks.py)."""
    check_no_ray_started(item, up_before=item.stash.get(RAY_UP_BEFORE, True))

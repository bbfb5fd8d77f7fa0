"""What the cluster offers: the GPUs that plans and admission are checked against."""

from __future__ import annotations

import logging
import os
import signal
import stat
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from service.placeholders import PLACEHOLDER_RULE, is_placeholder
from service.settings import Settings
from workers.memory.model import gpu_memory_bytes_from_gb
from workers.runtime.sandbox import is_secret_name

log = logging.getLogger(__name__)

CAPACITY_TTL_S = 0.5
KEPT_PREFIXES = ("RAY_", "AWS_")
"""Variables named like secrets that the embedded Ray keeps: its own token, the object store's credentials."""
SOCKET_PATH_MAX_BYTES = 107
"""The longest path of a unix socket (Linux's sun_path less its NUL)."""
_LONGEST_SOCKET = "/ray/session_2026-12-05_08-02-07_123456_4194304/sockets/plasma_store"
"""The longest path Ray makes below its temporary directory's parent: its session's object store socket."""
_PROBED: dict[str, int | None] = {}  # GCS address -> GPU memory bytes (None: logical GPUs)


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterCapacity:
    num_gpus: int
    gpu_memory_bytes: int
    simulated: bool
    """True where the GPUs are logical (a machine without CUDA)."""
    num_gpus_free: int = 0
    nodes: int = 1


def simulated_capacity(settings: Settings) -> ClusterCapacity:
    """The logical GPUs of ZERO1_SIMULATED_GPUS x ZERO1_SIMULATED_GPU_MEMORY_GB."""
    return ClusterCapacity(
        num_gpus=settings.simulated_gpus,
        gpu_memory_bytes=gpu_memory_bytes_from_gb(settings.simulated_gpu_memory_gb),
        simulated=True,
        num_gpus_free=settings.simulated_gpus,
    )


class RayCluster:
    """The Ray cluster jobs run on: an external one (ZERO1_RAY_ADDRESS), the one this
    process is already connected to, or an embedded one started here on loopback."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.owned = False
        self.simulated = True
        self._gpu_memory_bytes: int | None = None
        self._lock = threading.Lock()
        self._capacity: ClusterCapacity | None = None
        self._capacity_at = 0.0

    def connect(self) -> None:
        """Connect to Ray (starting it if embedded); the process keeps its own SIGTERM/SIGINT
        handling (uvicorn's graceful shutdown), which ray.init would otherwise replace."""
        handlers = _signal_handlers()
        try:
            self._connect()
        finally:
            _restore(handlers)

    def _connect(self) -> None:
        check_ray_auth_token(os.environ)
        try:
            self._connect_ray()
        finally:  # Ray writes a token file of its own when it starts a cluster with none
            private_ray_token(os.environ)

    def _connect_ray(self) -> None:
        if self.settings.ray_address is None:
            # read by Ray at import: its nodes, GCS and actors then bind 127.0.0.1
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        import ray

        if ray.is_initialized():
            log.info("using the Ray cluster this process is connected to")
        elif self.settings.ray_address:
            ray.init(address=self.settings.ray_address, namespace=self.settings.ray_namespace, log_to_driver=False)
            self.owned = True
        else:
            gpus = _cuda_device_count()
            num_gpus = gpus or self.settings.simulated_gpus
            # one logical CPU per rank, plus one: supervisors take none, the probe none
            with without_service_secrets(os.environ):  # Ray's processes, and every worker, start without them
                self._init_embedded(num_gpus)
            self.owned = True
            if not gpus:  # no driver: the GPUs are logical, and no worker need start (and load torch) to say so
                self._use_simulated()
                return
        self._probe_gpu_memory()

    def _init_embedded(self, num_gpus: int) -> None:
        import ray

        ray.init(
            address="local",  # a new instance of our own, never another Ray running on this machine
            _temp_dir=str(private_ray_temp_dir(os.environ)),
            num_gpus=num_gpus,
            num_cpus=max(os.cpu_count() or 1, num_gpus + 1),
            namespace=self.settings.ray_namespace,
            include_dashboard=False,
            log_to_driver=False,
        )

    def _probe_gpu_memory(self) -> None:
        """Real GPUs: ask one worker for its device's memory, once. Logical GPUs: the setting."""
        import ray

        from workers.runtime.cluster_tasks import probe_gpu_memory_bytes

        cluster_id = ray.get_runtime_context().gcs_address
        if cluster_id not in _PROBED:  # once per cluster and process
            try:
                _PROBED[cluster_id] = ray.get(probe_gpu_memory_bytes.remote(), timeout=60)
            except ray.exceptions.GetTimeoutError:
                log.warning("GPU memory probe timed out; using ZERO1_SIMULATED_GPU_MEMORY_GB")
                return self._use_simulated()
        probed = _PROBED[cluster_id]
        self.simulated = probed is None
        self._gpu_memory_bytes = probed or gpu_memory_bytes_from_gb(self.settings.simulated_gpu_memory_gb)

    def _use_simulated(self) -> None:
        self.simulated = True
        self._gpu_memory_bytes = gpu_memory_bytes_from_gb(self.settings.simulated_gpu_memory_gb)

    def capacity(self) -> ClusterCapacity:
        """GPUs, free GPUs and nodes from Ray's GCS: three round trips, so read at most
        once per CAPACITY_TTL_S however many requests ask."""
        with self._lock:
            now = time.monotonic()
            if self._capacity is None or now - self._capacity_at > CAPACITY_TTL_S:
                self._capacity = self._read_capacity()
                self._capacity_at = now
            return self._capacity

    def _read_capacity(self) -> ClusterCapacity:
        import ray

        total = ray.cluster_resources()
        available = ray.available_resources()
        return ClusterCapacity(
            num_gpus=int(total.get("GPU", 0)),
            # rounded, not floored: a probe task holds 0.01 of a GPU for a moment (start-up, storage checks)
            num_gpus_free=round(available.get("GPU", 0)),
            gpu_memory_bytes=self._gpu_memory_bytes or 0,
            simulated=self.simulated,
            nodes=sum(1 for node in ray.nodes() if node.get("Alive")),
        )

    def disconnect(self) -> None:
        import ray

        if self.owned:
            ray.shutdown()
            self.owned = False


@contextmanager
def without_service_secrets(environ: MutableMapping[str, str]) -> Iterator[None]:
    """`environ` without the service's settings and secrets (ZERO1_*, anything named like a token,
    password or key, the database's) while an embedded Ray starts: its GCS, raylet and every worker
    it forks inherit what is left. Ray's own variables stay (RAY_AUTH_TOKEN among them: Ray needs it),
    and so does the object store's AWS_*: a rank's actor and a task store and fetch a job's files
    with them, on one machine as on a cluster's nodes (their children never get them)."""
    removed = {
        name: environ.pop(name) for name in list(environ) if not name.startswith(KEPT_PREFIXES) and is_secret_name(name)
    }
    try:
        yield
    finally:
        environ.update(removed)


def private_ray_temp_dir(environ: Mapping[str, str]) -> Path:
    """The embedded Ray's temporary directory: ray/ in zero1-ray-<uid> of RAY_TMPDIR (else of the
    temporary directory), that parent made 0700 here if there is none. Ray makes its own temporary
    directory, and the working directories in it, mode 0777: only a parent that no other uid can enter
    keeps a job's code (ZERO1_RUN_AS) out of Ray's sockets, logs and files. ValueError naming the
    parent unless it is a directory (not a link) of this uid, mode 0700, short enough for Ray's sockets."""
    parent = Path(environ.get("RAY_TMPDIR") or tempfile.gettempdir()) / f"zero1-ray-{os.geteuid()}"
    num_bytes = len(os.fsencode(parent))
    if num_bytes + len(_LONGEST_SOCKET) > SOCKET_PATH_MAX_BYTES:
        raise ValueError(
            f"Ray's temporary directory's parent {parent} is too long for Ray's socket paths: {num_bytes} + "
            f"{len(_LONGEST_SOCKET)} bytes > {SOCKET_PATH_MAX_BYTES}; set RAY_TMPDIR to a shorter directory"
        )
    try:
        os.mkdir(parent, 0o700)
    except FileExistsError:
        pass
    except OSError as error:
        raise ValueError(f"Ray's temporary directory's parent {parent} cannot be made: {error.strerror}") from None
    _check_private(parent)
    return parent / "ray"


def _check_private(directory: Path) -> None:
    """ValueError, naming `directory` and what it is, unless it is a directory of this uid, mode 0700."""
    found = os.lstat(directory)
    uid = os.geteuid()
    mode = stat.S_IMODE(found.st_mode)
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != uid or mode & 0o077:
        kind = "a directory" if stat.S_ISDIR(found.st_mode) else "not a directory"
        raise ValueError(
            f"Ray's temporary directory's parent {directory} must be a directory of uid {uid} with mode 0700, so "
            f"that no job's uid reaches Ray's files, but it is {kind} of uid {found.st_uid} with mode {mode:04o}: "
            "remove it (zero1 makes it) or chmod 0700 it"
        )


def private_ray_token(environ: Mapping[str, str]) -> None:
    """Ray's token file (RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token) 0600 and its directory 0700 where
    this user owns them: Ray writes them world-readable, and anyone holding the token runs code on the
    cluster, a job's code under another uid (ZERO1_RUN_AS) among them."""
    path = Path(environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    for target, mode in ((path, 0o600), (path.parent, 0o700)):
        try:
            if target.lstat().st_uid == os.geteuid() and not target.is_symlink():
                os.chmod(target, mode)
        except OSError:  # no such file: nothing to keep private
            continue


def check_ray_auth_token(environ: Mapping[str, str]) -> None:
    """Refuse .env.example's RAY_AUTH_TOKEN: anyone who read the example could run code on the cluster."""
    if is_placeholder(environ.get("RAY_AUTH_TOKEN", "")):
        raise ValueError(
            f"RAY_AUTH_TOKEN is a placeholder ({PLACEHOLDER_RULE}): set the same secret of your own on every "
            "Ray node and the API, e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )


def _signal_handlers() -> dict[int, object]:
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}


def _restore(handlers: dict[int, object]) -> None:
    for sig, handler in handlers.items():
        if handler is not None:
            signal.signal(sig, handler)


def _cuda_device_count(driver_dir: str = "/proc/driver/nvidia/gpus") -> int:
    """NVIDIA GPUs this process may use, counted without loading torch into the API process: the
    driver's devices, no more than CUDA_VISIBLE_DEVICES names when it is set (CUDA stops at the
    first entry that is not a device: "0,1,-1,2" shows two)."""
    try:
        present = len(os.listdir(driver_dir))
    except OSError:  # no NVIDIA driver
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return present
    named = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        named += 1
    return min(named, present)

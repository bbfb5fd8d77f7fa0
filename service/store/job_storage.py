"""Where each job's files live and what they hold: its own place on the checkpoint storage
(job-<id>-<run_id>, a directory or an object store's prefix), the directory made for its uid, the
step a relaunch resumes at, the rows saved with its checkpoints, what a finished job keeps, the
dataset token cache, and whether every GPU node can write there.

    <checkpoint_uri>/                 0711 where jobs run as other uids: reached, never listed
        job-<id>-<run_id>/            0700, owned by the job's uid (ZERO1_RUN_AS): its children's HOME
            step-*/  final/           checkpoints and the final model (workers/training/checkpoints.py)
            tmp/  working_dir_files/  the children's TMPDIR and their copy of the code bundle

On an object store no directory is made: each rank's parent keeps a scratch home on its node
(workers/runtime/spool.py).

It stands apart from the launcher (service/scheduling/ray_launcher.py), as Ray Train v2's
StorageContext stands apart from its worker group: the routes, the MLflow exporter, init_from and the
scheduler ask it where a job's files are, never the code that talks to Ray.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

from service.settings import Settings
from service.store.tables import Job
from workers.records import MetricRow, RunAs
from workers.training import checkpoints, confined
from workers.training.storage import DirectoryStore, ObjectStore, Store, open_store
from workers.uris import is_remote, join_uri

log = logging.getLogger(__name__)

_ALL_STEPS = 2**62
STORAGE_PROBE_TTL_S = 60.0
"""How long the nodes' answer to storage_problems() is kept: a submit does not wait on Ray each time."""


def checkpoint_dirname(job_id: int, run_id: str | None) -> str:
    """job-<id>-<run_id>; job-<id> for a job stored before run ids existed."""
    return f"job-{job_id}" if run_id is None else f"job-{job_id}-{run_id}"


def dataset_cache_dir(shared_dir: str) -> Path:
    """Where `dataset` jobs' token files are cached: datasets/ in Settings.shared_dir (beside the jobs'
    directories when the checkpoints are in a directory), which every rank reads."""
    return Path(shared_dir).resolve() / "datasets"


class JobStorage:
    """Each job's files on the checkpoint storage (ZERO1_CHECKPOINT_URI): one for the service, shared
    by the launcher, the scheduler, the exporter and the routes."""

    def __init__(
        self, settings: Settings, *, run_as: Callable[[str | None], RunAs | None] = lambda owner: None
    ) -> None:
        self.settings = settings
        self.run_as = run_as
        """An owner -> the uid its children run under (ZERO1_RUN_AS); None: the service's own."""
        self._storage_problems: dict[str, str] = {}
        self._storage_checked_at = -math.inf

    @property
    def dataset_cache_dir(self) -> Path:
        """The dataset token cache every rank reads (see dataset_cache_dir)."""
        return dataset_cache_dir(self.settings.shared_dir)

    def checkpoint_uri(self, job: Job) -> str:
        """The job's own place on the storage: job-<id>-<run_id>, which no later job can be given
        (ids repeat after a database restore; run ids do not). A path, or s3://…"""
        return join_uri(self.settings.checkpoint_uri, checkpoint_dirname(job.id, job.run_id))

    def job_store(self, job: Job) -> Store:
        """The job's checkpoints and final model, wherever they live."""
        return open_store(self.checkpoint_uri(job))

    def checkpoint_dir(self, job: Job) -> Path | ObjectStore:
        """Where the job's final/ is read: its directory, or its prefix on the object store."""
        store = self.job_store(job)
        return store.root if isinstance(store, DirectoryStore) else store

    def prepare_job_dir(self, job: Job) -> tuple[str | None, RunAs | None]:
        """The job's directory, made before its ranks start (None on an object store: each rank's
        parent makes a scratch home on its node), and the uid its children run under (its owner's: run_as)."""
        run_as = self.run_as(job.owner)
        directory = self.checkpoint_uri(job)
        if is_remote(directory):
            return None, run_as
        make_job_dir(Path(directory), run_as=run_as, database_url=self.settings.database_url)
        return directory, run_as

    def resume_step(self, job: Job) -> int:
        """The step a relaunch starts at: after the latest complete checkpoint, else 0."""
        found = checkpoints.latest_checkpoint(self.job_store(job))
        return 0 if found is None else found[0] + 1

    def checkpoint_before(self, job: Job, *, step: int) -> int | None:
        """The step of the newest complete checkpoint before `step` (where a rollback resumes), else None."""
        found = checkpoints.latest_checkpoint(self.job_store(job), before=step)
        return None if found is None else found[0]

    def discard_checkpoints_from(self, job: Job, *, step: int) -> None:
        """Delete the job's checkpoints at `step` or later (a rollback's event): the next attempt, and
        resume_step, then find the newest before it."""
        discarded = checkpoints.discard_from(self.job_store(job), step=step)
        if discarded:
            log.info("job %s: discarded the checkpoints of steps %s (at or after step %s)", job.id, discarded, step)

    def checkpointed_metrics(self, job: Job, *, after_step: int) -> list[MetricRow]:
        """Rows saved with the job's checkpoints after `after_step` (see workers.training.checkpoints)."""
        return checkpoints.checkpointed_metrics(self.job_store(job), after_step=after_step)

    def discard_stored_metrics(self, job: Job, *, through_step: int) -> None:
        """Delete the job's pruned checkpoints whose rows are stored (see workers.training.checkpoints); a
        failure to delete is logged, not raised: it costs disk, not data."""
        try:
            checkpoints.discard_stored_metrics(self.job_store(job), through_step=through_step)
        except OSError as exc:
            log.warning("job %s: could not delete stored rows' checkpoint files: %s", job.id, exc)

    def retire(self, job: Job) -> None:
        """A finished job (its rows stored) keeps its newest ZERO1_CHECKPOINT_KEEP_FINISHED complete
        checkpoints, its final model (final/) and nothing else; with 0 every checkpoint goes. Logged,
        not raised, on failure."""
        try:
            retire_job_dir(self.job_store(job), keep=self.settings.checkpoint_keep_finished)
        except OSError as exc:
            log.warning("job %s: could not prune the finished job's checkpoints: %s", job.id, exc)

    def storage_problems(self) -> dict[str, str]:
        """Node id -> why that GPU node cannot write under ZERO1_CHECKPOINT_URI (empty when every
        one can), asked of the nodes themselves through a Ray task: on a cluster the path must be
        shared storage. Kept for STORAGE_PROBE_TTL_S."""
        if time.monotonic() - self._storage_checked_at < STORAGE_PROBE_TTL_S:
            return self._storage_problems
        answers = _probe_gpu_nodes(join_uri(self.settings.checkpoint_uri), timeout_s=self.settings.ray_rpc_timeout_s)
        if answers is None:  # not known either way: admit, and let a job that cannot checkpoint fail with the cause
            return {}
        self._storage_problems = {node: why for node, why in answers.items() if why}
        self._storage_checked_at = time.monotonic()
        return self._storage_problems


def _probe_gpu_nodes(uri: str, *, timeout_s: float) -> dict[str, str | None] | None:
    """Node id -> why that live GPU node cannot write under `uri` (None: it can), each asked by a Ray
    task pinned to it; None when Ray does not answer in `timeout_s`."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from workers.runtime.cluster_tasks import probe_writable

    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU", 0) > 0]
    refs = [
        probe_writable.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(uri)
        for node in nodes
    ]
    try:
        answers = ray.get(refs, timeout=timeout_s)
    except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:
        log.warning("could not probe the checkpoint storage: %s: %s", type(exc).__name__, exc)
        return None
    return dict(zip(nodes, answers, strict=True))


def make_job_dir(directory: Path, *, run_as: RunAs | None, database_url: str) -> None:
    """Make `directory` (mode 0700, whatever the umask), owned by `run_as` where jobs run as other
    uids; the private directories above it it must traverse become 0711 then."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    directory.mkdir(mode=0o700, exist_ok=True)
    if run_as is not None:
        for above in _state_dirs_above(directory, database_url):
            os.chmod(above, 0o711)
        os.chown(directory, run_as.uid, run_as.gid, follow_symlinks=False)
    os.chmod(directory, 0o700, follow_symlinks=False)


def _state_dirs_above(job_dir: Path, database_url: str) -> list[Path]:
    """The directories a job's uid must traverse that the service keeps private: the storage root,
    and the SQLite database's directory when the storage lies inside it (the default .zero1/)."""
    dirs = [job_dir.parent]
    if database_url.startswith("sqlite:///"):
        state = Path(database_url.removeprefix("sqlite:///")).resolve().parent
        if state in job_dir.parents and state != job_dir.parent:
            dirs.append(state)
    return dirs


def retire_job_dir(store: Store, *, keep: int) -> None:
    """What a finished job (its rows stored) keeps: its newest `keep` complete checkpoints and its
    final model (final/); with 0, final/ alone. In a directory, its children's scratch goes too."""
    local = isinstance(store, DirectoryStore)
    if keep == 0:
        if local:
            remove_except(store.root, keep_name=checkpoints.FINAL)
        else:
            for name in store.list():
                if name != checkpoints.FINAL:
                    store.remove_tree(name)
        return
    if local and not store.root.exists():
        return
    checkpoints.prune_checkpoints(store, keep_last=keep, keep_newest_unfinished=False)
    checkpoints.discard_stored_metrics(store, through_step=_ALL_STEPS)
    if local:
        remove_scratch(store.root)


def remove_scratch(directory: Path) -> None:
    """Delete what a finished job's children left beside its checkpoints and final model (their
    TMPDIR, their code copy, anything written to HOME); links are removed, never followed, and
    nothing is reached through one (workers/training/confined.py)."""
    for name in _entries(directory):
        if name != checkpoints.FINAL and not name.startswith("step-"):
            confined.remove_tree(directory, name)


def remove_except(directory: Path, *, keep_name: str) -> None:
    """Delete everything in directory but its entry keep_name; the directory too when that is absent."""
    if not directory.exists():
        return
    for name in _entries(directory):
        if name != keep_name:
            confined.remove_tree(directory, name)
    if not _entries(directory):
        directory.rmdir()


def _entries(directory: Path) -> list[str]:
    """Every name in the directory, links included (list_dir leaves them out: they are deleted too)."""
    with confined.opened_dir(directory) as fd:
        return sorted(os.listdir(fd))

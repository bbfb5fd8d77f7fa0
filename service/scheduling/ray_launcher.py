"""Dispatch to Ray: each job runs under a JobSupervisor, a named detached actor."""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from service.schemas.requests import JobSpec
from service.schemas.responses import PlanPublic
from service.settings import Settings
from service.store.job_dirs import prepare_job_dir, retire_job_dir
from service.store.tables import Job
from workers.records import MetricRow, RankError, RunAs
from workers.training.storage import DirectoryStore, ObjectStore, Store, open_store
from workers.uris import is_remote, join_uri

LogAcks = dict[int, int]
"""Rank -> the n of its last log line stored (service.store.log_lines.log_acks)."""

log = logging.getLogger(__name__)
_STORAGE_TTL_S = 60.0


def checkpoint_dirname(job_id: int, run_id: str | None) -> str:
    """job-<id>-<run_id>; job-<id> for a job stored before run ids existed."""
    return f"job-{job_id}" if run_id is None else f"job-{job_id}-{run_id}"


def dataset_cache_dir(shared_dir: str) -> Path:
    """Where `dataset` jobs' token files are cached: datasets/ in Settings.shared_dir (beside the jobs'
    directories when the checkpoints are in a directory), which every rank reads."""
    return Path(shared_dir).resolve() / "datasets"


def supervisor_name(job_id: int, attempt: int = 0) -> str:
    """Each attempt has its own supervisor: a retry never waits for the old name to be freed."""
    return f"zero1-job-{job_id}-a{attempt}"


_NAME = re.compile(r"zero1-job-(\d+)-a(\d+)")


def placement_group_name(namespace: str, job_id: int, attempt: int) -> str:
    """The placement group of an attempt: its supervisor's name, under this deployment's namespace
    (placement group names are not kept apart by namespace)."""
    return f"{namespace}/{supervisor_name(job_id, attempt)}"


_PG_NAME = re.compile(r"(.+)/zero1-job-(\d+)-a(\d+)")


def remove_placement_groups(namespace: str, *, keep=lambda job_id, attempt: False, orphans: bool = True) -> int:
    """Remove every live placement group of the namespace's attempts that keep(job id, attempt) does
    not hold; the number removed. A supervisor frees its group when its attempt ends; this catches a
    supervisor killed between asking Ray for its group and recording it, or one that died: Ray frees
    such a group only when this service exits. `orphans`: a warning each (False: an ended attempt's
    release, whose supervisor may not have freed it yet)."""
    import ray
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup

    from workers.runtime.cluster_tasks import remove_group

    removed = 0
    for group_id, entry in ray.util.placement_group_table().items():
        match = _PG_NAME.fullmatch(entry.get("name") or "")
        owner = (int(match[2]), int(match[3])) if match and match[1] == namespace else None
        if owner is None or entry.get("state") == "REMOVED" or keep(*owner):
            continue
        remove_group(PlacementGroup(PlacementGroupID.from_hex(group_id)), state=entry.get("state"))
        why = "its attempt is not running" if orphans else "its attempt was released"
        log.log(logging.WARNING if orphans else logging.DEBUG, "removed placement group %s: %s", entry["name"], why)
        removed += 1
    return removed


class RayLauncher:
    """Starts, polls, cancels and releases job supervisors, one per (job, attempt)."""

    def __init__(
        self,
        settings: Settings,
        *,
        code_uri: Callable[[str], str] | None = None,
        run_as: Callable[[str | None], RunAs | None] = lambda owner: None,
    ) -> None:
        self.settings = settings
        self.code_uri = code_uri
        """A code bundle's digest -> the stored zip's URI, which each rank's actor unpacks for its child."""
        self.run_as = run_as
        self._supervisors: dict[tuple[int, int], Any] = {}
        self._storage_problems: dict[str, str] = {}
        self._storage_checked_at = -math.inf

    def checkpoint_uri(self, job: Job) -> str:
        """The job's own place on the storage: job-<id>-<run_id>, which no later job can be given
        (ids repeat after a database restore; run ids do not). A path, or s3://…"""
        return join_uri(self.settings.checkpoint_uri, checkpoint_dirname(job.id, job.run_id))

    def job_store(self, job: Job) -> Store:
        """The job's checkpoints and final model, wherever they live."""
        return open_store(self.checkpoint_uri(job))

    def checkpoint_dir(self, job: Job) -> Path | ObjectStore:
        """Where the job's final/ is read: its directory, or its prefix on the object store."""
        return store.root if isinstance(store := self.job_store(job), DirectoryStore) else store

    def prepare_job_dir(self, job: Job) -> tuple[str | None, RunAs | None]:
        """The job's directory, made before its ranks start (None on an object store: each rank's
        parent makes a scratch home on its node), and the uid its children run under (its owner's: run_as)."""
        run_as, directory = self.run_as(job.owner), self.checkpoint_uri(job)
        if is_remote(directory):
            return None, run_as
        prepare_job_dir(Path(directory), run_as=run_as, database_url=self.settings.database_url)
        return directory, run_as

    def resume_step(self, job: Job) -> int:
        """The step a relaunch starts at: after the latest complete checkpoint, else 0."""
        from workers.training.checkpoints import latest_checkpoint

        found = latest_checkpoint(self.job_store(job))
        return 0 if found is None else found[0] + 1

    def storage_problems(self) -> dict[str, str]:
        """Node id -> why that GPU node cannot write under ZERO1_CHECKPOINT_URI (empty when every
        one can), asked of the nodes themselves: on a cluster the path must be shared storage.
        Cached for a minute: a submit does not wait on Ray for it each time."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from workers.runtime.cluster_tasks import probe_writable

        if time.monotonic() - self._storage_checked_at < _STORAGE_TTL_S:
            return self._storage_problems
        path = join_uri(self.settings.checkpoint_uri)
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU", 0) > 0]
        refs = [
            probe_writable.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(path)
            for node in nodes
        ]
        try:
            answers = ray.get(refs, timeout=self.settings.ray_rpc_timeout_s)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:
            # not known either way: admit, and let a job that cannot checkpoint fail with the cause
            log.warning("could not probe the checkpoint storage: %s: %s", type(exc).__name__, exc)
            return {}
        self._storage_problems = {node: why for node, why in zip(nodes, answers, strict=True) if why}
        self._storage_checked_at = time.monotonic()
        return self._storage_problems

    def checkpointed_metrics(self, job: Job, *, after_step: int) -> list[MetricRow]:
        """Rows saved with the job's checkpoints after `after_step` (see workers.training.checkpoints)."""
        from workers.training.checkpoints import checkpointed_metrics

        return checkpointed_metrics(self.job_store(job), after_step=after_step)

    def discard_stored_metrics(self, job: Job, *, through_step: int) -> None:
        """Delete the job's pruned checkpoints whose rows are stored (see workers.training.checkpoints); a
        failure to delete is logged, not raised: it costs disk, not data."""
        from workers.training.checkpoints import discard_stored_metrics

        try:
            discard_stored_metrics(self.job_store(job), through_step=through_step)
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

    def launch(self, job: Job) -> None:
        """Start the job's current attempt; an attempt already started is adopted, not started
        twice. The supervisor places the ranks in the background; poll() reports how it went."""
        from workers.runtime.actors import JobSupervisor, Placement

        job_dir, run_as = self.prepare_job_dir(job)
        config = JobSpec.model_validate(job.spec).to_config(
            checkpoint_dir=self.checkpoint_uri(job),
            keep_last=self.settings.checkpoint_keep_last,
            async_checkpoints=self.settings.async_checkpoints,
            resume=job.attempt > 0,
            data_roots=self.settings.data_roots,
            dataset_cache_dir=str(dataset_cache_dir(self.settings.shared_dir)),
            model_roots=self.settings.model_roots,
            plan=PlanPublic.model_validate(job.plan),
        )
        placement = Placement(
            num_workers=job.world_size or job.num_gpus,
            cpus_per_worker=self.settings.cpus_per_worker,
            timeout_s=self.settings.placement_timeout_s,
            rendezvous_timeout_s=self.settings.rendezvous_timeout_s,
            code_uri=self._code_uri(job.spec.get("code")),
            name=placement_group_name(self.settings.ray_namespace, job.id, job.attempt),
            log_max_bytes=self.settings.log_max_bytes,
            home=job_dir,
            run_as=run_as,
        )
        supervisor = JobSupervisor.options(
            name=supervisor_name(job.id, job.attempt),
            namespace=self.settings.ray_namespace,
            lifetime="detached",
            get_if_exists=True,
            scheduling_strategy=_on_head_node(),
        ).remote(str(job.id), config, placement)
        supervisor.start.remote()  # never raises: a start that fails is a "failed" status with its cause
        self._supervisors[(job.id, job.attempt)] = supervisor

    def _code_uri(self, code: str | None) -> str | None:
        if code is None:
            return None
        assert self.code_uri is not None, "a job with a code bundle needs the code store"
        return self.code_uri(code)

    def _handle(self, job_id: int, attempt: int) -> Any | None:
        import ray

        key = (job_id, attempt)
        if key not in self._supervisors:
            try:
                self._supervisors[key] = ray.get_actor(
                    supervisor_name(job_id, attempt), namespace=self.settings.ray_namespace
                )
            except ValueError:
                return None
        return self._supervisors[key]

    def exists(self, job_id: int, attempt: int) -> bool:
        """Whether the attempt's supervisor is alive in the Ray cluster (re-attaching to it). One
        that does not answer in time counts as alive: relaunching beside a live one would run two
        attempts at once; if it is dead, the next poll says so."""
        import ray

        supervisor = self._handle(job_id, attempt)
        if supervisor is None:
            return False
        try:
            ray.get(supervisor.ping.remote(), timeout=self.settings.ray_rpc_timeout_s)
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            log.warning("job %s: supervisor of attempt %s did not answer; taken as alive", job_id, attempt)
        except ray.exceptions.RayActorError:
            self._supervisors.pop((job_id, attempt), None)
            return False
        return True

    def poll(self, job_id: int, attempt: int, *, after_step: int, log_acks: LogAcks) -> dict[str, Any]:
        """The supervisor's poll(after_step, log_acks); see poll_many."""
        return self.poll_many([(job_id, attempt, after_step, log_acks)])[(job_id, attempt)]

    def poll_many(self, attempts: list[tuple[int, int, int, LogAcks]]) -> dict[tuple[int, int], dict[str, Any]]:
        """(job id, attempt) -> the supervisor's poll(after_step, log_acks) for each (job id,
        attempt, after_step, log_acks: what is stored), asked of all at once and waited for
        together, at most ZERO1_RAY_RPC_TIMEOUT_S.

        Status "lost" only when the supervisor is known dead (no such actor, or Ray says it died);
        a supervisor that did not answer in time is "unknown": asked again next tick, never
        taken for dead (a stalled head would otherwise fail every running job)."""
        import ray

        states, asked = {}, {}
        for job_id, attempt, after_step, log_acks in attempts:
            supervisor = self._handle(job_id, attempt)
            if supervisor is None:
                states[(job_id, attempt)] = _lost(
                    f"no supervisor {supervisor_name(job_id, attempt)} in the Ray cluster"
                )
            else:
                asked[supervisor.poll.remote(after_step, log_acks)] = (job_id, attempt)
        ready = []
        if asked:
            ready, _ = ray.wait(list(asked), num_returns=len(asked), timeout=self.settings.ray_rpc_timeout_s)
        for ref in asked:
            states[asked[ref]] = self._answer(ref, *asked[ref]) if ref in ready else _unknown()
        return states

    def _answer(self, ref: Any, job_id: int, attempt: int) -> dict[str, Any]:
        import ray

        try:
            return _in_protocol(ray.get(ref, timeout=0))
        except ray.exceptions.ActorUnavailableError:  # unreachable for now (restarting, a network blip)
            return _unknown()
        except ray.exceptions.RayActorError as exc:  # the actor died: a death
            self._supervisors.pop((job_id, attempt), None)
            cause = str(exc).strip().splitlines()
            name = supervisor_name(job_id, attempt)
            return _lost(f"supervisor {name} died: {type(exc).__name__}: {cause[0] if cause else ''}")

    def cancel(self, job_id: int, attempt: int) -> None:
        import ray

        supervisor = self._handle(job_id, attempt)
        if supervisor is not None:
            try:
                ray.get(supervisor.cancel.remote(), timeout=self.settings.ray_rpc_timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                log.warning("job %s: supervisor gone while cancelling", job_id)

    def gpus_free_to(self, job_id: int, attempt: int) -> int | None:
        """GPUs Ray could give the job's next attempt now: those unreserved, plus those the
        attempt's own placement group still holds on live nodes (freed when it is released).
        Counts what zero1 does not know of (another workload's reservations, a lost node);
        None when Ray does not say."""
        import ray

        try:
            free = ray.available_resources().get("GPU", 0)
            alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
            name = placement_group_name(self.settings.ray_namespace, job_id, attempt)
            held = sum(
                sum(1 for node in entry.get("bundles_to_node_id", {}).values() if node in alive)
                for entry in ray.util.placement_group_table().values()
                if entry.get("name") == name and entry.get("state") == "CREATED"
            )
        except Exception:  # a Ray that does not answer leaves the database's count
            log.warning("job %s: could not read Ray's free GPUs", job_id, exc_info=True)
            return None
        return round(free) + held  # rounded: a probe task holds 0.01 of a GPU for a moment

    def request_stop(self, job_id: int, attempt: int, *, now: bool = False) -> bool:
        """Ask the attempt's ranks to stop after their next checkpoint (`now`: at their next step,
        writing a checkpoint there); its poll then says "stopped". Whether the supervisor took it."""
        import ray

        supervisor = self._handle(job_id, attempt)
        if supervisor is None:
            return False
        try:
            ray.get(supervisor.request_stop.remote(now), timeout=self.settings.ray_rpc_timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            log.warning("job %s: supervisor of attempt %s did not take the stop request", job_id, attempt)
            return False
        return True

    def release(self, job_id: int, attempt: int) -> None:
        """End an attempt's supervisor, its workers and its placement group."""
        import ray

        supervisor = self._supervisors.pop((job_id, attempt), None) or self._handle(job_id, attempt)
        self._supervisors.pop((job_id, attempt), None)
        if supervisor is not None:
            ray.kill(supervisor, no_restart=True)
        remove_placement_groups(
            self.settings.ray_namespace, keep=lambda j, a: (j, a) != (job_id, attempt), orphans=False
        )

    def sweep(self, attempts: set[tuple[int, int]]) -> int:
        """Remove the placement groups of this deployment that no attempt in `attempts` (the
        active ones) owns; the number removed. See remove_placement_groups."""
        return remove_placement_groups(self.settings.ray_namespace, keep=lambda j, a: (j, a) in attempts)

    def supervisors(self) -> list[tuple[int, int]]:
        """(job id, attempt) of every zero1 supervisor alive in this deployment's namespace."""
        import ray

        found = []
        for entry in ray.util.list_named_actors(all_namespaces=True):
            match = _NAME.fullmatch(entry["name"])
            if match and entry["namespace"] == self.settings.ray_namespace:
                found.append((int(match[1]), int(match[2])))
        return found


def _on_head_node() -> Any:
    """Supervisors live on the head node (soft: anywhere if it has no room), so that losing a
    worker node costs the job its ranks there, which a retry replaces, not its supervisor."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    for node in ray.nodes():
        if node["Alive"] and "node:__internal_head__" in node["Resources"]:
            return NodeAffinitySchedulingStrategy(node_id=node["NodeID"], soft=True)
    return "DEFAULT"


def _in_protocol(state: dict[str, Any]) -> dict[str, Any]:
    """A poll's state; a failure when its status is outside the supervisor's protocol (one cancelled
    behind this service's back): the attempt ends, never left running with its GPUs counted as held."""
    if state.get("status") in ("starting", "running", "succeeded", "stopped", "failed"):
        return state
    why = f"the supervisor reported status {str(state.get('status'))[:40]!r}, which the scheduler does not expect"
    error = RankError(exception="SupervisorError", message=f"{why}: the attempt was ended and its GPUs freed")
    return {**state, "status": "failed", "error": error}


def _unknown() -> dict[str, Any]:
    return {"status": "unknown", "metrics": [], "nodes": [], "error": None, "logs": [], "log_dropped": (0, 0)}


def _lost(message: str) -> dict[str, Any]:
    return {**_unknown(), "status": "lost", "error": RankError(exception="SupervisorLost", message=message)}

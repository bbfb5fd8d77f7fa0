"""Dispatch to Ray: each job runs under a JobSupervisor, a named detached actor. This module only talks
to Ray (supervisors, placement groups, free GPUs); where a job's files live and what they hold is
service/store/job_storage.py's, which it is given."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from service.scheduling.health import relaunch_terms, rollbacks_of
from service.schemas.requests import JobSpec
from service.schemas.responses import PlanPublic
from service.settings import Settings
from service.store.job_storage import JobStorage
from service.store.tables import Job
from workers.records import AttemptPoll, AttemptStatus, RankError

LogAcks = dict[int, int]
"""Rank -> the n of its last log line stored (service.store.log_lines.log_acks)."""

log = logging.getLogger(__name__)


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
        storage: JobStorage,
        code_uri: Callable[[str], str] | None = None,
    ) -> None:
        self.settings = settings
        self.storage = storage
        """Where each job's directory is made and its checkpoints go, and the uid its children run under."""
        self.code_uri = code_uri
        """A code bundle's digest -> the stored zip's URI, which each rank's actor unpacks for its child."""
        self._supervisors: dict[tuple[int, int], Any] = {}

    def launch(self, job: Job) -> None:
        """Start the job's current attempt; an attempt already started is adopted, not started
        twice. The supervisor places the ranks in the background; poll() reports how it went."""
        from workers.runtime.actors import JobSupervisor, Placement

        job_dir, run_as = self.storage.prepare_job_dir(job)
        spec = JobSpec.model_validate(job.spec)
        skips, lr_scale = relaunch_terms(rollbacks_of(job.rollbacks), lr_factor=spec.health.lr_factor)
        config = spec.to_config(
            checkpoint_dir=self.storage.checkpoint_uri(job),
            keep_last=self.settings.checkpoint_keep_last,
            async_checkpoints=self.settings.async_checkpoints,
            resume=job.attempt > 0,
            data_roots=self.settings.data_roots,
            dataset_cache_dir=str(self.storage.dataset_cache_dir),
            model_roots=self.settings.model_roots,
            plan=PlanPublic.model_validate(job.plan),
            world_size=job.world_size or job.num_gpus,
            rollback_skips=skips,
            lr_scale=lr_scale,
        )
        placement = Placement(
            num_workers=job.world_size or job.num_gpus,
            cpus_per_worker=self.settings.cpus_per_worker,
            timeout_s=self.settings.placement_timeout_s,
            rendezvous_timeout_s=self.settings.rendezvous_timeout_s,
            code_uri=self._code_uri(spec.code),
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

    def poll(self, job_id: int, attempt: int, *, after_step: int, log_acks: LogAcks) -> AttemptPoll:
        """The supervisor's poll(after_step, log_acks); see poll_many."""
        return self.poll_many([(job_id, attempt, after_step, log_acks)])[(job_id, attempt)]

    def poll_many(self, attempts: list[tuple[int, int, int, LogAcks]]) -> dict[tuple[int, int], AttemptPoll]:
        """(job id, attempt) -> the supervisor's poll(after_step, log_acks) for each (job id,
        attempt, after_step, log_acks: what is stored), asked of all at once and waited for
        together, at most ZERO1_RAY_RPC_TIMEOUT_S.

        Status "lost" only when the supervisor is known dead (no such actor, or Ray says it died);
        a supervisor that did not answer in time is "unknown": asked again next tick, never
        taken for dead (a stalled head would otherwise fail every running job)."""
        import ray

        states = {}
        asked = {}
        for job_id, attempt, after_step, log_acks in attempts:
            supervisor = self._handle(job_id, attempt)
            if supervisor is None:
                states[(job_id, attempt)] = AttemptPoll.lost(
                    f"no supervisor {supervisor_name(job_id, attempt)} in the Ray cluster"
                )
            else:
                asked[supervisor.poll.remote(after_step, log_acks)] = (job_id, attempt)
        ready = []
        if asked:
            ready, _ = ray.wait(list(asked), num_returns=len(asked), timeout=self.settings.ray_rpc_timeout_s)
        for ref in asked:
            states[asked[ref]] = self._answer(ref, *asked[ref]) if ref in ready else AttemptPoll.unknown()
        return states

    def _answer(self, ref: Any, job_id: int, attempt: int) -> AttemptPoll:
        import ray

        try:
            return _in_protocol(ray.get(ref, timeout=0))
        except ray.exceptions.ActorUnavailableError:  # unreachable for now (restarting, a network blip)
            return AttemptPoll.unknown()
        except ray.exceptions.RayActorError as exc:  # the actor died: a death
            self._supervisors.pop((job_id, attempt), None)
            cause = str(exc).strip().splitlines()
            name = supervisor_name(job_id, attempt)
            return AttemptPoll.lost(f"supervisor {name} died: {type(exc).__name__}: {cause[0] if cause else ''}")

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


_EXPECTED = (
    AttemptStatus.STARTING,
    AttemptStatus.RUNNING,
    AttemptStatus.SUCCEEDED,
    AttemptStatus.STOPPED,
    AttemptStatus.FAILED,
)
"""The statuses the scheduler expects of a supervisor's poll."""


def _in_protocol(answer: object) -> AttemptPoll:
    """A poll's answer; a failure when it is outside the supervisor's protocol (not an AttemptPoll, or
    a status the scheduler does not expect: one cancelled behind this service's back): the attempt
    ends, never left running with its GPUs counted as held."""
    if isinstance(answer, AttemptPoll) and answer.status in _EXPECTED:
        return answer
    if isinstance(answer, AttemptPoll):
        what = f"status {str(getattr(answer.status, 'value', answer.status))[:40]!r}"
    else:
        what = f"a {type(answer).__name__[:40]} where an AttemptPoll belongs"
    why = f"the supervisor reported {what}, which the scheduler does not expect"
    error = RankError(exception="SupervisorError", message=f"{why}: the attempt was ended and its GPUs freed")
    if isinstance(answer, AttemptPoll):  # its rows and lines are still stored
        return replace(answer, status=AttemptStatus.FAILED, error=error)
    return AttemptPoll(status=AttemptStatus.FAILED, error=error)

"""Admission: the checks a job passes before it is stored: its plan fits the cluster (the memory
model), its data is inside the roots and reads, the checkpoint storage is writable.

Each check raises the 422 (503 for the storage) the API answers with; none touches the database.
Those that wait on a Ray task (a trace, a dataset's tokenizing) are awaited, holding no thread; those
that read files (a model directory's digest, a dataset's globs) are for a worker thread.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from service.errors import ServiceError, storage_unreachable
from service.planning.capacity import ClusterCapacity
from service.planning.dataset_checks import DatasetChecker, DatasetRequest, invalid_data
from service.planning.plans import fits_no_number, make_plan, model_shape, plan_public, trace_first, workload_for
from service.planning.traces import Tracer, Traces
from service.schemas.data_specs import DatasetDataSpec, TextDataSpec
from service.schemas.plan_requests import PlanRequest
from service.schemas.requests import RUNNABLE_STAGES, JobSpec
from service.schemas.responses import PlanPublic
from workers.config import ModelKind
from workers.data import datafiles
from workers.data.digests import tokenizer_digest
from workers.memory import fit
from workers.memory import model as memory
from workers.memory.model import GB
from workers.training import staging

if TYPE_CHECKING:
    from workers.records import DatasetSummary


async def admit_async(
    spec: JobSpec, *, cluster: ClusterCapacity, overhead_bytes: int, tracer: Tracer, user: str | None
) -> PlanPublic:
    """admit, with the model's trace (if it is planned by one) awaited first in one of `user`'s slots."""
    known = await trace_first(plan_request(spec, cluster=cluster), tracer=tracer, user=user)
    return admit(spec, cluster=cluster, overhead_bytes=overhead_bytes, tracer=known)


def admit(spec: JobSpec, *, cluster: ClusterCapacity, overhead_bytes: int, tracer: Traces | None = None) -> PlanPublic:
    """The plan a job is admitted by (an hf model's traced by `tracer`): at its zero_stage, or (auto) at
    the first stage that runs and fits; or a 422 does_not_fit that says what would fit."""
    for stage in spec.stages():
        request = plan_request(spec, cluster=cluster, stage=stage)
        plan = make_plan(request, cluster=cluster, overhead_bytes=overhead_bytes, tracer=tracer)
        if plan.fits:
            break
    public = plan_public(plan, shape=model_shape(request, tracer=tracer))
    fits = {"cluster": cluster, "request": request, "overhead_bytes": overhead_bytes, "tracer": tracer}
    if spec.num_gpus > cluster.num_gpus:
        raise _does_not_fit(
            public,
            f"num_gpus ({spec.num_gpus}) exceeds the cluster's {cluster.num_gpus} GPUs" + _what_fits(plan, **fits),
        )
    if not plan.fits:
        raise _does_not_fit(
            public,
            f"the per-GPU plan at N = {request.num_gpus}{_fewest(spec)}, ZeRO stage {plan.stage}{_auto(spec)}, is "
            f"{plan.per_gpu.total_bytes / GB:.2f} GB, above the {plan.gpu_memory_bytes / GB:.2f} GB of each GPU"
            + _what_fits(plan, **fits),
        )
    if spec.zero_stage == "auto" and len(spec.world_sizes()) > 1:
        workload = workload_for(request, overhead_bytes=overhead_bytes, tracer=tracer)
        public = public.model_copy(update={"stage_at": _stage_at(spec, plan, workload)})
    return public


def _stage_at(spec: JobSpec, plan: fit.Plan, workload: memory.Workload) -> dict[str, int]:
    """An elastic auto job's stage on each N it may run on: the first that fits there. At its fewest
    GPUs that is the plan's; on more, each GPU holds less, and an earlier stage may fit."""
    return {
        str(n): next(
            (s for s in spec.stages() if memory.total_bytes(workload, num_gpus=n, stage=s) <= plan.gpu_memory_bytes),
            plan.stage,
        )
        for n in spec.world_sizes()
    }


def plan_request(spec: JobSpec, *, cluster: ClusterCapacity, stage: int | None = None) -> PlanRequest:
    """The job's plan at `stage` (JobSpec.plan_request) against the cluster's GPU memory."""
    return spec.plan_request(stage=stage).model_copy(update={"gpu_memory_gb": cluster.gpu_memory_bytes / GB})


def _auto(spec: JobSpec) -> str:
    """zero_stage auto tried every stage that runs: say so."""
    return " (the last zero_stage auto tries)" if spec.zero_stage == "auto" else ""


def _fewest(spec: JobSpec) -> str:
    """An elastic job's plan is at the fewest GPUs it may run on: say so."""
    return "" if spec.world_sizes() == [spec.num_gpus] else " (the fewest this elastic job runs on)"


def check_data(spec: JobSpec, *, data_roots: Sequence[str]) -> JobSpec:
    """The spec with a text job's data.path made real (symlinks followed), or a 422 if that is outside the roots.

    The workers then read the very file that was checked, whatever their working directory.
    """
    if isinstance(spec.data, DatasetDataSpec):
        return _check_dataset_paths(spec, data=spec.data, data_roots=data_roots)
    if not isinstance(spec.data, TextDataSpec):
        return spec
    path = spec.data.path
    if staging.is_remote_path(path):
        raise invalid_data(f"data.path: {path!r}: a text job reads a local file (for an object store: kind dataset)")
    resolved = os.path.realpath(path)
    roots = datafiles.real_roots(data_roots)
    if not any(os.path.commonpath([resolved, root]) == root for root in roots):
        raise invalid_data(
            f"data.path: {path!r} is outside the data roots {roots} (ZERO1_DATA_ROOTS; symlinks are followed)"
        )
    if not os.path.isfile(resolved):
        raise invalid_data(f"data.path: no such file: {path!r}")
    return spec.model_copy(update={"data": TextDataSpec(kind="text", path=resolved)})


def _check_dataset_paths(spec: JobSpec, *, data: DatasetDataSpec, data_roots: Sequence[str]) -> JobSpec:
    """A 422 when a dataset's path or tokenizer is outside the roots or names no file (the standard
    library's checks: reading and tokenizing is check_dataset's, in a Ray task); the paths made absolute.
    token_uri is the service's to fill in (with_token_uri), never a user's."""
    data = data.model_copy(update={"token_uri": None})
    if staging.is_remote_path(data.tokenizer):
        raise invalid_data(
            f"data.tokenizer: {data.tokenizer!r}: a tokenizer is read from a local data root (or give 'bytes'), "
            "not from an object store"
        )
    remote = staging.is_remote_path(data.path)
    try:
        if not remote:
            datafiles.resolve_files(data.path, format=data.format, roots=data_roots)
        if data.tokenizer not in (None, datafiles.BYTES):
            datafiles.resolve_tokenizer(data.tokenizer, roots=data_roots)
    except ValueError as exc:
        raise invalid_data(str(exc)) from None
    if remote:
        _check_objects(data, data_roots=data_roots)
    absolute = {"path": data.path if remote else datafiles.absolute_path(data.path)}
    if data.tokenizer not in (None, datafiles.BYTES):
        absolute["tokenizer"] = os.path.realpath(data.tokenizer)
        absolute["tokenizer_digest"] = _tokenizer_digest(data, roots=data_roots)
    return spec.model_copy(update={"data": data.model_copy(update=absolute)})


def _check_objects(data: DatasetDataSpec, *, data_roots: Sequence[str]) -> None:
    """A 422 when data on an object store is outside its roots or names no file; a 503 when the store
    cannot be listed (its credentials, its endpoint)."""
    try:
        staging.resolve_objects(data.path, format=data.format, roots=data_roots)
    except ValueError as exc:
        raise invalid_data(str(exc)) from None
    except Exception as exc:  # noqa: BLE001  (any error of the store's client)
        raise storage_unreachable("data.path", exc) from None


def with_token_uri(spec: JobSpec, summary: DatasetSummary | None) -> JobSpec:
    """A dataset job on an object store with the token file its check stored in the store's token cache
    (workers/runtime/isolated.py): the URI its ranks fetch instead of the data."""
    if summary is None or not staging.is_remote_path(summary.token_file):
        return spec
    return spec.model_copy(update={"data": spec.data.model_copy(update={"token_uri": summary.token_file})})


def _tokenizer_digest(data: DatasetDataSpec, *, roots: Sequence[str]) -> str:
    """The digest of the files a rank's tokenizer reads (workers/data/digests.py), or a 422 naming
    data.tokenizer (data.tokenizer_digest when one was given and the files differ)."""
    try:
        digest = tokenizer_digest(datafiles.resolve_tokenizer(data.tokenizer, roots=roots))
    except ValueError as exc:
        raise invalid_data(str(exc)) from None
    if data.tokenizer_digest is not None and data.tokenizer_digest != digest:
        raise invalid_data(
            f"data.tokenizer_digest: the files of {data.tokenizer!r} have digest {digest}, not the "
            f"{data.tokenizer_digest} given"
        )
    return digest


async def check_dataset(
    spec: JobSpec,
    *,
    model: ModelKind,
    checker: DatasetChecker,
    data_roots: Sequence[str],
    cache_dir: str,
    user: str | None,
) -> DatasetSummary | None:
    """A dataset job's files read and tokenized into the cache (a Ray task, awaited in one of `user`'s
    slots), or a 422 naming the field: text_field absent, tokenizer invalid or above the model's
    vocab_size, the dataset empty or under one global batch of blocks. `model` is the job's workers'
    spec (vocab_size, block_size; an hf model's path)."""
    if not isinstance(spec.data, DatasetDataSpec):
        return None
    seq_len = spec.seq_len or model.block_size
    request = DatasetRequest(
        data=spec.data.to_spec(data_roots=data_roots, cache_dir=cache_dir),
        vocab_size=model.vocab_size,
        seq_len=seq_len,
        global_batch_size=spec.batch_size,
        seed=spec.seed,
        tokenizer_dir=getattr(model, "path", None),
    )
    return await checker.check_async(request, user=user)


def check_storage(problems: dict[str, str], *, uri: str) -> None:
    """A 503 when some GPU node cannot write checkpoints (a job there could never save one)."""
    if problems:
        node, why = next(iter(problems.items()))
        raise ServiceError(
            f"checkpoint storage ZERO1_CHECKPOINT_URI ({uri}) is not writable from {len(problems)} GPU node(s); "
            f"node {node}: {why}",
            status_code=503,
            error="checkpoint_storage_unwritable",
        )


def _what_fits(plan: fit.Plan, *, cluster: ClusterCapacity, request, overhead_bytes: int, tracer: Traces | None) -> str:
    """What would fit: this stage at more GPUs, or a later stage (its per-GPU bytes named)."""
    workload = workload_for(request, overhead_bytes=overhead_bytes, tracer=tracer)
    stage = plan.stage
    if plan.min_gpus is None:
        text = fits_no_number(plan, workload)
    elif plan.min_gpus > cluster.num_gpus:
        text = f"; it needs min_gpus = {plan.min_gpus} at stage {stage}, and the cluster has {cluster.num_gpus}"
    else:
        text = f"; min_gpus = {plan.min_gpus} at stage {stage} fits"
    higher = []
    for later in (s for s in RUNNABLE_STAGES if s > stage):
        n = fit.min_gpus(workload, stage=later, gpu_memory_bytes=plan.gpu_memory_bytes)
        if n is None:
            continue
        at = max(n, request.num_gpus)
        per_gpu = memory.total_bytes(workload, num_gpus=at, stage=later) / GB
        higher.append(
            f"ZeRO stage {later} on N >= {n} ({per_gpu:.2f} GB per GPU at N = {at}; zero_stage: {later} or auto)"
        )
    if higher and (plan.min_gpus is None or plan.min_gpus > cluster.num_gpus):
        text += "; " + ", or ".join(higher) + " would fit"
    return text


def _does_not_fit(plan: PlanPublic, message: str) -> ServiceError:
    return ServiceError(message, status_code=422, error="does_not_fit", plan=plan.model_dump(mode="json"))

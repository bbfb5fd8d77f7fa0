"""init_from at submit: the source job is resolved to the file its ranks will start from.

Choice points:
- The source is a succeeded job whose details the caller may read (its owner, or an admin); another
  owner's job is answered as its metrics' and artifacts' routes answer it, as if it did not exist
  ("no job with id N"). Every refusal is a 422 naming init_from.job.
- Its final/model.safetensors must be among the artifacts the service recorded when it succeeded
  (read now if it succeeded before artifacts were recorded); the new job keeps that record's sha256
  and size, and its ranks' parents load only a copy that matches them (workers/training/staging.py).
- Shapes are compared here for the built-in models (gpt, mlp), from the two jobs' specs (the service's
  own record, no file read); an hf or python model's parameters are known only once it is built, so a
  rank compares them before it loads (workers/training/init_weights.py) and fails the job with the
  same message.
- The plan and admission are the new job's own: the weights change no byte of either.
"""

from __future__ import annotations

from pydantic import ValidationError

from service.auth import Principal
from service.errors import ServiceError
from service.schemas.model_specs import GPTModelSpec, MLPModelSpec
from service.schemas.requests import JobSpec
from service.store.artifacts import recorded_artifacts
from service.store.db import Database
from service.store.job_repository import can_see
from service.store.job_storage import JobStorage
from service.store.tables import Job
from workers.memory.specs import first_mismatch

FIELD = "init_from.job"
WEIGHTS = "model.safetensors"


def resolve_init_from(db: Database, spec: JobSpec, *, principal: Principal, storage: JobStorage) -> JobSpec:
    """The spec with init_from's uri, sha256 and bytes filled in from the source job; a 422 naming
    init_from.job when it cannot be started from. A spec without init_from as it is. For a worker
    thread: it may read and record the source's final/ (in a transaction of its own)."""
    if spec.init_from is None:
        return spec
    job_id = spec.init_from.job
    with db.session() as session:
        source = session.get(Job, job_id)
        if source is None or not can_see(principal, source):
            raise invalid_init_from(f"no job with id {job_id}")
        if source.status != "succeeded":
            raise invalid_init_from(
                f"job {job_id} is {source.status}: a job starts from a succeeded job's final/ weights"
            )
        files = recorded_artifacts(session, source, job_dir=storage.checkpoint_dir(source))
        weights = next((f for f in files if f.name == WEIGHTS), None)
        if weights is None:
            held = ", ".join(f.name for f in files) or "nothing"
            raise invalid_init_from(f"job {job_id} has no final/{WEIGHTS} recorded (its final/ holds {held})")
        _check_shapes(spec, source)
        resolved = {"uri": storage.checkpoint_uri(source), "sha256": weights.sha256, "bytes": weights.bytes}
    return spec.model_copy(update={"init_from": spec.init_from.model_copy(update=resolved)})


def _check_shapes(spec: JobSpec, source: Job) -> None:
    """A 422 when both models are built-in and a parameter's name or shape differs (first_mismatch)."""
    try:
        trained = JobSpec.model_validate(source.spec).model
    except ValidationError:  # a spec stored by an older version: the rank compares the file itself
        return
    built_in = (GPTModelSpec, MLPModelSpec)
    if not isinstance(spec.model, built_in) or not isinstance(trained, built_in):
        return
    if trained.kind != spec.model.kind:
        raise invalid_init_from(
            f"job {source.id} trained a {trained.kind} model; this job's model is {spec.model.kind}"
        )
    why = first_mismatch(
        spec.model.to_spec().parameter_shapes(),
        trained.to_spec().parameter_shapes(),
        source=f"job {source.id}'s final weights",
    )
    if why is not None:
        raise invalid_init_from(why)


def invalid_init_from(why: str) -> ServiceError:
    """A 422 for init_from.job, naming it in its message and its detail."""
    detail = [{"field": FIELD, "message": why, "type": "value_error"}]
    return ServiceError(f"{FIELD}: {why}", status_code=422, error="invalid_request", detail=detail)

"""Settings: every ZERO1_* environment variable, read in one place.

May import: service.run_as, workers.uris.
"""

from __future__ import annotations

import ipaddress
import json
import re
from functools import lru_cache
from typing import Annotated, Literal

from pydantic import Field, InstanceOf, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from service.run_as import RunAsTable, parse_run_as
from workers.uris import is_remote, located, overlap, parse_uri


def sqlite_file(url: str) -> str | None:
    """The file a sqlite:/// URL names; None for another database or an in-memory one."""
    if not url.startswith("sqlite") or "///" not in url:
        return None
    database = url.split("///", 1)[1]
    return database if database and database != ":memory:" else None


class Settings(BaseSettings):
    """zero1's configuration; each field is read from ZERO1_<FIELD NAME>."""

    model_config = SettingsConfigDict(env_prefix="ZERO1_", use_attribute_docstrings=True, extra="ignore")

    database_url: str = "sqlite:///.zero1/zero1.db"
    """SQLAlchemy URL of the database; PostgreSQL: postgresql+psycopg://user@host/db. A password
    with .env.example's mark `change-me` is refused."""
    host: str = "127.0.0.1"
    """Address `zero1 serve` binds to."""
    port: int = Field(8000, ge=1, le=65535)
    """Port `zero1 serve` listens on."""
    simulated_gpus: int = Field(4, ge=1, le=4096)
    """Logical GPUs of the embedded cluster on a machine without CUDA; the
    planner's default num_gpus."""
    simulated_gpu_memory_gb: float = Field(80.0, gt=0, le=1e6, allow_inf_nan=False)
    """Memory of each logical GPU, in GB (1e9 bytes); the planner's default
    gpu_memory_gb."""
    gpu_overhead_gb: float = Field(1.0, ge=0, le=1e6, allow_inf_nan=False)
    """Fixed per-GPU bytes a job's plan reserves beyond model states and
    activations (CUDA context, communication buffers), in GB."""
    plan_gpu_tflops: float = Field(400.0, gt=0, le=1e9, allow_inf_nan=False)
    """Training throughput per GPU that POST /v1/plan/recommend's cost model states, in TFLOP/s: 400 is
    an H100-class GPU's dense bf16 peak (989) at about 40% model FLOPs utilisation."""
    plan_network_gb_per_s: float = Field(100.0, gt=0, le=1e9, allow_inf_nan=False)
    """Bandwidth per GPU of a reduce-scatter or all-gather that POST /v1/plan/recommend's cost model
    states, in GB/s (1e9 bytes): 100 lies between an H100 node's NVLink (450 each way) and a
    400 Gb/s InfiniBand link per GPU (50)."""
    ray_address: str | None = None
    """Address of an external Ray cluster (e.g. 10.0.0.5:6379); unset starts
    an embedded Ray inside the service, on loopback."""
    ray_namespace: str = "zero1"
    """Ray namespace of this deployment's job supervisors (zero1-job-<id>)."""
    checkpoint_uri: str = ".zero1/checkpoints"
    """Where each job keeps its checkpoints and final model (job-<id>-<run id>/: a random run id,
    so a job id reused after a database restore never meets another job's checkpoints): a
    directory (on a multi-node cluster one every node shares), or `s3://bucket/prefix` on S3 or
    any S3-compatible store, reached with the standard AWS_* variables and files. Any other
    scheme is refused at start."""
    local_dir: str = ".zero1"
    """Where the dataset token cache (datasets/) lives when ZERO1_CHECKPOINT_URI is on an object
    store (code bundles go to its code/ there); beside the checkpoints when it is a directory. On
    a multi-node cluster a directory every node shares."""
    checkpoint_keep_last: int = Field(3, ge=1, le=1_000_000)
    """Complete checkpoints each job keeps (the newest); older ones lose their
    shards as new ones complete, and their saved rows once the database has them."""
    checkpoint_keep_finished: int = Field(1, ge=0, le=1_000_000)
    """Complete checkpoints a finished job (succeeded, failed or cancelled) keeps, the newest;
    0 deletes its checkpoint directory once its rows are stored."""
    async_checkpoints: bool = True
    """Write each rank's checkpoint files in a background thread, the step held up only by the copy
    of its shard to host memory (and the previous checkpoint's write, if still going); false writes
    them, and marks the checkpoint complete, before training goes on."""
    cpus_per_worker: float = Field(1.0, gt=0, le=1024)
    """CPUs each rank reserves beside its GPU."""
    placement_timeout_s: float = Field(120.0, gt=0, le=86_400)
    """How long a job may wait for its ranks to be placed before it fails."""
    rendezvous_timeout_s: float = Field(120.0, gt=0, le=86_400)
    """How long a job's placed ranks may take to start and report their addresses."""
    start_timeout_s: float = Field(600.0, gt=0, le=86_400)
    """How long a job may stay starting or restarting before the attempt fails (a retry if it
    has one left); at least placement_timeout_s + rendezvous_timeout_s."""
    ray_rpc_timeout_s: float = Field(30.0, gt=0, le=3600)
    """How long the service waits for a supervisor's answer; no answer is asked again, never
    taken for a dead job."""
    plan_timeout_s: float = Field(120.0, gt=0, le=86_400)
    """How long a traced plan (a model's step run on fake tensors in a Ray task) may take before
    it is stopped and the request answered 422 trace_timeout."""
    data_timeout_s: float = Field(600.0, gt=0, le=86_400)
    """How long a submitted `dataset` job's files may take to be read and tokenized (in a Ray task, into
    the token cache under ZERO1_CHECKPOINT_URI/datasets) before it is stopped and the submit answered
    422 data_timeout; a dataset already in the cache is only hashed."""
    scheduler_interval_s: float = Field(0.2, gt=0, le=60)
    """How often the scheduler admits queued jobs and collects metrics."""
    scheduler_idle_interval_s: float = Field(1.0, gt=0, le=60)
    """How often the scheduler ticks while no job is active or queued; a request that may change one wakes it."""
    placement_sweep_interval_s: float = Field(10.0, gt=0, le=3600)
    """How often the scheduler looks for placement groups of this deployment that no active
    attempt owns (a supervisor killed while it placed its ranks leaves one) and frees them."""
    elastic_grow_interval_s: float = Field(300.0, ge=0, le=86_400)
    """How often at most an elastic job grows (from its start or last resize): it grows at its
    next checkpoint when GPUs are free and no job is queued."""
    default_priority: int = Field(50, ge=0, le=100)
    """A job's priority when its spec names none (0-100; the queue runs the highest first)."""
    priority_limits: Annotated[dict[str, int], NoDecode] = {}
    """The highest priority each owner may ask, comma-separated `owner=n`, `*` for every other owner
    (e.g. `research=80,*=50`); admins may ask 100. Unset: anyone may ask up to 100."""
    gpu_quotas: Annotated[dict[str, int], NoDecode] = {}
    """GPUs each owner's running jobs may hold together, comma-separated `owner=n`, `*` for every
    other owner (e.g. `research=4,intern=2,*=8`). Unset: no quotas."""
    quota_borrowing: bool = True
    """A job past its owner's quota runs anyway on GPUs nothing within its quota waits for,
    as borrowed: the first to be preempted when anyone within quota needs them."""
    preempt_min_runtime_s: float = Field(120.0, ge=0, le=86_400 * 365)
    """Seconds a job runs (from its start or resume) before the scheduler may preempt it."""
    preempt_grace_s: float = Field(60.0, gt=0, le=86_400)
    """Seconds a preempted or suspended job's ranks have to stop at a step with a checkpoint;
    past it they are killed and the job resumes from its last checkpoint."""
    preempt_victims: Literal["least_loss", "lowest_priority"] = "least_loss"
    """A waiting job's victims, borrowed GPUs first: `least_loss`, those whose stops lose the fewest GPU-seconds
    (a checkpoint unless one is due, the relaunch's start-up), then the lowest priority; `lowest_priority` (as
    before): elastic jobs shrunk first, then the lowest priority, then the most recently started."""
    queue_policy: Literal["priority", "fifo"] = "priority"
    """`priority`: by priority then submission, with backfill, quotas and preemption; `fifo`: one
    line by submission, the head waits for its GPUs (zero1 before priorities; no preemption)."""
    scheduler_stale_s: float = Field(120.0, gt=0, le=86_400)
    """/healthz answers 503 when the scheduler has not completed a tick for this long."""
    api_tokens: SecretStr | None = None
    """API tokens, comma-separated `user:token` or `user:token:admin` (tokens of 16+
    characters, none with .env.example's mark `change-me`). Unset, with no token file: auth is
    off, for loopback use only."""
    api_tokens_file: str | None = None
    """File of API tokens, one `user:token[:admin]` a line, `#` comments; adds to
    ZERO1_API_TOKENS."""
    public_read: bool = False
    """With tokens: let anyone read (GET /v1/*, /metrics, the dashboard) without one: jobs'
    names, owners, states and progress, not their specs, metrics or events; submitting and
    cancelling still need a token."""
    data_roots: Annotated[list[str], NoDecode] = ["data"]
    """Directories a `text` or `dataset` job's data.path (and tokenizer) must resolve into (symlinks followed),
    comma-separated or a JSON list; relative ones are under the service's working
    directory. An s3://bucket/prefix root holds a `dataset` job's data on an object store. A root that
    holds or lies in ZERO1_CHECKPOINT_URI (ZERO1_LOCAL_DIR beside an object store) or the SQLite
    database is refused at start."""
    model_roots: Annotated[list[str], NoDecode] = ["models"]
    """Directories an `hf` model's path (a save_pretrained directory) must resolve into (symlinks
    followed), comma-separated or a JSON list; relative ones are under the service's working
    directory. An s3://bucket/prefix root holds models on an object store. Nothing is downloaded from
    the hub: a hub id is refused. Refused at start where it overlaps the checkpoint storage, as
    ZERO1_DATA_ROOTS."""
    max_request_bytes: int = Field(1 << 20, ge=1024, le=1 << 30)
    """Largest request body the API reads, in bytes; larger ones get 413. A code bundle has its own
    limit, ZERO1_MAX_CODE_BYTES."""
    max_code_bytes: int = Field(100 << 20, ge=1024, le=1 << 32)
    """Largest code bundle (the zip of POST /v1/code) the API reads, in bytes; larger ones get 413. It is
    held in memory while it is checked."""
    access_log: Literal["changes", "all", "off"] = "changes"
    """uvicorn's request lines on `zero1 serve`'s stderr: changes logs every request but a GET or
    HEAD that succeeded (the dashboard's and `zero1 watch`'s polls, otherwise nearly every line of
    the log); all, or off."""
    log_max_bytes: int = Field(16 << 20, ge=1024, le=1 << 40)
    """Bytes of log lines (their text) kept per job: past it the oldest lines are dropped, and one
    marker line in their place says how many. It also bounds what a rank and a job's supervisor
    hold before the lines are stored."""
    max_queued_jobs_per_user: int = Field(1000, ge=1, le=1_000_000)
    """Queued jobs one user (one token's user; everyone when auth is off) may have;
    a submit past it gets 429."""
    code_quota_bytes: int = Field(1 << 30, ge=0, le=1 << 50)
    """Bytes of code bundles (zips as uploaded) one user (everyone when auth is off) may have
    recorded; an upload of a bundle the store does not hold yet that would pass it gets 413."""
    token_cache_max_bytes: int = Field(100 << 30, ge=0, le=1 << 50)
    """Bytes the dataset token cache (datasets/tokens in ZERO1_CHECKPOINT_URI's directory, or in
    ZERO1_LOCAL_DIR beside an object store) may hold: past it the least recently used token files are
    deleted (never one a queued or active job may need; a rank that finds its token file gone
    tokenizes it again). A bucket's token files are bounded by the bucket's lifecycle rule."""
    log_retention_days: float = Field(30.0, ge=0, le=100_000, allow_inf_nan=False)
    """Days a finished job's log lines are kept after it ended; then the service deletes them,
    leaving one marker line. 0 keeps them forever."""
    housekeeping_interval_s: float = Field(60.0, gt=0, le=86_400)
    """How often the service deletes expired log lines and trims the token cache to
    ZERO1_TOKEN_CACHE_MAX_BYTES."""
    max_tasks: int = Field(8, ge=1, le=100_000)
    """Traced plans and dataset checks (Ray tasks a plan or submit waits on) running at once, all users
    together; one more is answered 429 with Retry-After (a cached trace takes no slot)."""
    max_tasks_per_user: int = Field(2, ge=1, le=100_000)
    """Traced plans and dataset checks one user (everyone when auth is off) may have running at once;
    one more is answered 429 with Retry-After."""
    max_log_followers: int = Field(64, ge=1, le=100_000)
    """Log streams (GET /v1/jobs/{id}/logs?follow=true) open at once, all users together; one more is
    answered 429 with Retry-After."""
    max_log_followers_per_user: int = Field(8, ge=1, le=100_000)
    """Log streams one user (everyone when auth is off) may have open at once; one more is answered
    429 with Retry-After."""
    run_as: Annotated[InstanceOf[RunAsTable] | None, NoDecode] = None
    """uid:gid each owner's job children run under (its ranks' training, its plans' traces, its
    data's tokenizing), comma-separated `owner=uid:gid`, and `*=LO-HI`, a range from which every other
    owner gets a uid of its own (gid the same number), allocated on its first use and kept in the
    database (e.g. `team-a=2001:2001,*=30000-39999`); no supplementary groups. A uid named for two
    owners, a range holding a named uid or 0, and `*=uid:gid` (every other owner under one uid) are
    refused. Unset: they run as the service's user (one user on a laptop; docs/security.md, Trust
    model). Needs a service and Ray running as root."""
    auth_max_failures: int = Field(10, ge=1, le=1_000_000)
    """Wrong tokens one client (an IPv4 address, an IPv6 /64) may send within ZERO1_AUTH_FAILURE_WINDOW_S,
    by the Authorization header, the dashboard's cookie or its login form together; past it every token
    it sends is answered 429 with Retry-After until its oldest failure is that old, a valid one too unless
    it succeeded from that address within the last day (its user is not locked out by another's guesses)."""
    auth_failure_window_s: float = Field(60.0, gt=0, le=86_400)
    """The window, in seconds, within which ZERO1_AUTH_MAX_FAILURES wrong tokens lock a client out."""
    trusted_proxies: Annotated[list[str], NoDecode] = []
    """Addresses or networks of the reverse proxies in front of the service, comma-separated (e.g.
    `172.18.0.1,10.0.0.0/8`): only from them are X-Forwarded-For and X-Forwarded-Proto believed, and
    the address a request's lockout counts is the one the proxy saw. Unset: none, not even loopback."""
    public_url: str | None = None
    """The address users reach this service at (e.g. https://zero1.example.com), for the links it
    gives out (an MLflow run's zero1.url tag); unset: http://<ZERO1_HOST>:<ZERO1_PORT>."""
    mlflow_tracking_uri: str | None = None
    """An MLflow tracking server (e.g. http://mlflow:5000): set, every job becomes a run there, exported by
    the service in the background (docs/api.md, MLflow; needs the extra zero1[mlflow], which the
    image installs). Unset: none."""
    mlflow_experiment: str = Field("zero1", min_length=1, max_length=500)
    """The prefix of the MLflow experiments the jobs' runs go to, one per owner: `<prefix>/<owner>`
    (`zero1/(anonymous)` for jobs without one), each created when missing."""
    mlflow_interval_s: float = Field(1.0, gt=0, le=3600)
    """How often the MLflow exporter looks for new metric rows and status changes."""
    mlflow_max_backoff_s: float = Field(30.0, gt=0, le=86_400)
    """The longest wait between tries while MLflow does not answer (the wait doubles from
    ZERO1_MLFLOW_INTERVAL_S): a run catches up within about this long after MLflow is back."""
    webhook_url: str | None = Field(None, pattern=r"^https?://[^\s]+$", max_length=2000)
    """An http(s) URL that is POSTed each job's end (succeeded, failed, cancelled) as JSON with a Slack
    `text`, in order, each once, retried with backoff while it does not answer (docs/api.md, Webhooks)."""
    webhook_secret: SecretStr | None = None
    """The key of the HMAC-SHA256 of each webhook body, sent as `X-Zero1-Signature: sha256=<hex>`; unset: unsigned."""
    webhook_max_backoff_s: float = Field(60.0, gt=0, le=86_400)
    """The longest wait between tries while the webhook does not answer (doubling from 1 s)."""
    webhook_notify_hosts: Annotated[list[str], NoDecode] = []
    """The hosts a job's own `notify` URL may name, comma-separated, each a name or name:port (e.g.
    `hooks.slack.com,ci.example.com:8443`): the service POSTs to no other (a user's URL could reach what
    only the service can). Unset: a job's `notify` is refused."""

    @model_validator(mode="after")
    def _start_after_placement(self) -> Settings:
        floor = self.placement_timeout_s + self.rendezvous_timeout_s
        if self.start_timeout_s < floor:
            raise ValueError(
                f"start_timeout_s ({self.start_timeout_s:g}) must be at least placement_timeout_s "
                f"({self.placement_timeout_s:g}) + rendezvous_timeout_s ({self.rendezvous_timeout_s:g}) = {floor:g}"
            )
        return self

    @model_validator(mode="after")
    def _idle_ticks_not_stale(self) -> Settings:
        if (idle := self.scheduler_idle_interval_s) >= (stale := self.scheduler_stale_s):
            raise ValueError(f"scheduler_idle_interval_s ({idle:g}) must be less than scheduler_stale_s ({stale:g})")
        return self

    @field_validator("checkpoint_uri")
    @classmethod
    def _check_storage(cls, value: str) -> str:
        """A directory or s3://bucket/prefix: a URI of another scheme is never taken for a path."""
        try:
            parse_uri(value)
        except ValueError as exc:
            raise ValueError(f"ZERO1_CHECKPOINT_URI: {exc}") from None
        return value.strip()

    @field_validator("data_roots", "model_roots")
    @classmethod
    def _check_roots(cls, value: list[str], info: ValidationInfo) -> list[str]:
        """A root may be s3://bucket/prefix; a URI of another scheme is refused, never taken for a
        relative directory."""
        name = f"ZERO1_{info.field_name.upper()}"
        for root in value:
            if "://" not in root:
                continue
            try:
                parse_uri(root)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        return value

    @model_validator(mode="after")
    def _roots_outside_storage(self) -> Settings:
        """No data or model root overlaps what the service keeps (checkpoints, final weights, code
        bundles, the token cache, a SQLite database): a job's data is read by the trusted side and
        staged for its child, which would then read other jobs' files."""
        kept = [("ZERO1_CHECKPOINT_URI", self.checkpoint_uri)]
        if is_remote(self.checkpoint_uri):
            kept.append(("ZERO1_LOCAL_DIR", self.local_dir))
        if (database := sqlite_file(self.database_url)) is not None:
            kept.append(("ZERO1_DATABASE_URL", database))
        for name, roots in (("ZERO1_DATA_ROOTS", self.data_roots), ("ZERO1_MODEL_ROOTS", self.model_roots)):
            for root in roots:
                for kept_name, where in kept:
                    if overlap(root, where):
                        raise ValueError(
                            f"{name}: the root {located(root)} overlaps {kept_name}, {located(where)}: a job "
                            "reading under the root would be given the service's files there (other jobs' "
                            "checkpoints, weights and code, its database): keep the two apart"
                        )
        return self

    @property
    def shared_dir(self) -> str:
        """The directory that holds the token cache (and code bundles, beside directory checkpoints):
        the checkpoint directory itself, or ZERO1_LOCAL_DIR when the checkpoints are on an object store."""
        return self.local_dir if is_remote(self.checkpoint_uri) else self.checkpoint_uri

    @field_validator("run_as", mode="before")
    @classmethod
    def _parse_run_as(cls, value: object) -> object:
        """'a=2001:2001,*=30000-39999' -> its RunAsTable (service/run_as.py), each refusal naming its entry."""
        return parse_run_as(value) if isinstance(value, str) else value

    @field_validator("priority_limits", "gpu_quotas", mode="before")
    @classmethod
    def _parse_limits(cls, value: object, info: ValidationInfo) -> object:
        """'a=80,*=50' -> {"a": 80, "*": 50}, each entry named in its error."""
        if not isinstance(value, str):
            return value
        name, top = (
            ("ZERO1_PRIORITY_LIMITS", 100) if info.field_name == "priority_limits" else ("ZERO1_GPU_QUOTAS", None)
        )
        mapping: dict[str, int] = {}
        for entry in (part.strip() for part in value.split(",")):
            if not entry:
                continue
            owner, _, number = entry.partition("=")
            if not owner.strip() or not number.strip().isdigit() or (top is not None and int(number) > top):
                bound = f"0-{top}" if top is not None else "a count of GPUs"
                raise ValueError(f"{name}: entry {entry!r} is not owner=n with n {bound} (e.g. research=4)")
            mapping[owner.strip()] = int(number)
        return mapping

    def priority_limit(self, owner: str | None, *, admin: bool = False) -> int:
        """The highest priority `owner` may ask: 100 for admins and where ZERO1_PRIORITY_LIMITS is
        unset; else its entry, else `*`'s, else the default priority."""
        if admin or not self.priority_limits:
            return 100
        return self.priority_limits.get(owner or "", self.priority_limits.get("*", self.default_priority))

    def gpu_quota(self, owner: str | None) -> int | None:
        """The GPUs `owner`'s running jobs may hold together: its entry, else `*`'s; None: no quota."""
        return self.gpu_quotas.get(owner or "", self.gpu_quotas.get("*"))

    @field_validator("trusted_proxies")
    @classmethod
    def _check_proxies(cls, value: list[str]) -> list[str]:
        """Each an IP address or network: `*` (every client a proxy) is refused, as is a name."""
        for entry in value:
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(f"ZERO1_TRUSTED_PROXIES: {entry!r} is not an IP address or network") from None
        return value

    @field_validator("webhook_notify_hosts")
    @classmethod
    def _check_hosts(cls, value: list[str]) -> list[str]:
        """Each a host name or address, with a port or not; in lower case."""
        for entry in value:
            if not re.fullmatch(r"[A-Za-z0-9.-]+(:[0-9]{1,5})?|\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?", entry):
                raise ValueError(f"ZERO1_WEBHOOK_NOTIFY_HOSTS: {entry!r} is not a host or host:port")
        return [entry.lower() for entry in value]

    @field_validator("data_roots", "model_roots", "trusted_proxies", "webhook_notify_hosts", mode="before")
    @classmethod
    def _split_roots(cls, value: object) -> object:
        """'a,b' or '["a", "b"]' -> ["a", "b"] (an environment variable is one string)."""
        if not isinstance(value, str):
            return value
        if value.lstrip().startswith("["):
            return json.loads(value)
        return [part.strip() for part in value.split(",") if part.strip()]


@lru_cache
def get_settings() -> Settings:
    """The process's settings, read once from the environment."""
    return Settings()


def env_table() -> str:
    """The table of environment variables in docs/deployment.md, made from this class so it cannot drift."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for name, field in Settings.model_fields.items():
        default = "unset" if field.default in (None, {}) else f"`{field.default}`"
        meaning = " ".join((field.description or "").split())
        rows.append(f"| `ZERO1_{name.upper()}` | {default} | {meaning} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(env_table())

"""The `zero1` command: `serve` runs the API; `plan` plans a model offline; `submit`,
`jobs`, `status`, `watch`, `cancel` and `download` talk to a running API; `db upgrade` migrates."""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
from decimal import Decimal, InvalidOperation
from pathlib import Path

from pydantic import ValidationError

from service.config import get_settings
from service.fields import MAX_TEXT_DIGITS, too_many_digits
from workers.memory import GB, OPTIMIZERS, PRECISIONS, STAGES


def _count(text: str) -> int:
    """'7.5e9' -> 7500000000, exactly; a fractional count is an error."""
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if too_many_digits(value):
        raise argparse.ArgumentTypeError(f"must have at most {MAX_TEXT_DIGITS} digits, got {text}")
    if not value.is_finite() or value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text}")
    return int(value)


def _sizes(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"sizes must be comma-separated integers, got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zero1", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the REST API and dashboard")
    serve.add_argument("--host", help="bind address (default: ZERO1_HOST or 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default: ZERO1_PORT or 8000)")

    plan = commands.add_parser(
        "plan",
        help="per-GPU memory of a model under ZeRO, and the sweep over N",
        description="Plan by parameter count (--params 7.5e9) or by model (--model gpt ...). GB = 1e9 bytes.",
    )
    what = plan.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=_count, metavar="PSI", help="number of parameters, e.g. 7.5e9")
    what.add_argument("--model", choices=("gpt", "mlp"), help="plan a model spec (see the --n-* options)")
    plan.add_argument("--gpus", type=int, help="data-parallel GPUs N (default: the cluster's)")
    plan.add_argument("--gpu-memory-gb", type=float, help="memory per GPU in GB (default: the cluster's)")
    plan.add_argument("--precision", choices=PRECISIONS, default="fp16")
    plan.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    plan.add_argument("--stage", type=int, choices=STAGES, default=1)
    gpt = plan.add_argument_group("gpt model")
    gpt.add_argument("--vocab-size", type=int, default=50257)
    gpt.add_argument("--n-layer", type=int)
    gpt.add_argument("--n-head", type=int, help="default: n_embd / 64 (GPT-2's head width)")
    gpt.add_argument("--n-embd", type=int)
    gpt.add_argument("--block-size", type=int, default=1024)
    gpt.add_argument("--seq-len", type=int, help="default: block size")
    mlp = plan.add_argument_group("mlp model")
    mlp.add_argument("--sizes", type=_sizes, help="layer widths, e.g. 784,1024,10")
    jobs = plan.add_argument_group("model plans")
    jobs.add_argument("--micro-batch-size", type=int)
    jobs.add_argument("--activation-checkpointing", action="store_true", default=None)
    jobs.add_argument(
        "--trace", action="store_true", help="count the step by running it on fake tensors (method traced)"
    )
    recommend = plan.add_argument_group(
        "recommendations", "the configurations of a model that fit, cheapest first (POST /v1/plan/recommend)"
    )
    recommend.add_argument("--recommend", action="store_true", help="list GPUs x micro-batch x checkpointing")
    recommend.add_argument("--global-batch-size", type=int, metavar="G", help="samples per optimizer step")
    recommend.add_argument("--max-gpus", type=int, help="largest N considered (default: --gpus, else the cluster's)")
    plan.add_argument("--json", action="store_true", help="print the API's JSON instead of tables")

    url = {
        "default": os.environ.get("ZERO1_URL", "http://127.0.0.1:8000"),
        "help": "the API (default: ZERO1_URL or http://127.0.0.1:8000)",
    }
    submit = commands.add_parser("submit", help="submit a job spec (JSON file); prints its plan and id")
    submit.add_argument("spec", help="path of a JSON JobSpec, e.g. examples/tiny-gpt.json")
    submit.add_argument("--dry-run", action="store_true", help="plan and admit, store nothing")
    submit.add_argument("--url", **url)
    jobs = commands.add_parser("jobs", help="list jobs, newest first")
    jobs.add_argument("--status", action="append", help="only these statuses (repeatable)")
    jobs.add_argument("--limit", type=int, default=20)
    jobs.add_argument("--url", **url)
    for name, text in (
        ("status", "a job, with its events"),
        ("watch", "a live progress bar until the job ends"),
        ("cancel", "cancel a job"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("job_id", type=int)
        command.add_argument("--url", **url)
        if name == "watch":
            command.add_argument("--interval", type=float, default=0.5, help="seconds between refreshes")
    download = commands.add_parser("download", help="a succeeded job's final model, each file's sha256 checked")
    download.add_argument("job_id", type=int)
    download.add_argument("dir", help="where the files go (created)")
    download.add_argument("--url", **url)
    db = commands.add_parser("db", help="database maintenance")
    db.add_argument("action", choices=("upgrade",), help="upgrade: apply the migrations (ZERO1_DATABASE_URL)")
    return parser


def _plan_body(args: argparse.Namespace) -> dict:
    """The POST /v1/plan body the flags describe (validation is the API's own)."""
    body = {
        "num_gpus": args.gpus,
        "gpu_memory_gb": args.gpu_memory_gb,
        "precision": args.precision,
        "optimizer": args.optimizer,
        "stage": args.stage,
        "micro_batch_size": args.micro_batch_size,
        "seq_len": args.seq_len,
        "activation_checkpointing": args.activation_checkpointing,
        "method": "traced" if args.trace else None,
    }
    if args.params is not None:
        body["num_params"] = args.params
    elif args.model == "gpt":
        n_head = args.n_head or (args.n_embd // 64 if args.n_embd and args.n_embd >= 64 else None)
        gpt = {
            "kind": "gpt",
            "vocab_size": args.vocab_size,
            "n_layer": args.n_layer,
            "n_head": n_head,
            "n_embd": args.n_embd,
            "block_size": args.block_size,
        }
        body["model"] = {key: value for key, value in gpt.items() if value is not None}
    else:
        body["model"] = {"kind": "mlp", "sizes": args.sizes}
    return {key: value for key, value in body.items() if value is not None}


_PLAN_ONLY_FLAGS = {"micro_batch_size": "--micro-batch-size", "activation_checkpointing": "--activation-checkpointing"}


def _recommend_body(args: argparse.Namespace) -> dict:
    """The POST /v1/plan/recommend body the flags describe; a ValueError for flags that do not apply."""
    if args.model is None:
        raise ValueError("--recommend needs a model (--model gpt|mlp), not --params")
    given = [flag for name, flag in _PLAN_ONLY_FLAGS.items() if getattr(args, name) is not None]
    if given or args.stage != 1:
        given += ["--stage"] if args.stage != 1 else []
        raise ValueError(f"{', '.join(given)} do not apply to --recommend: it searches them, at ZeRO stage 1")
    plan = _plan_body(args)
    body = {key: plan[key] for key in ("model", "seq_len", "precision", "optimizer", "gpu_memory_gb") if key in plan}
    body |= {"global_batch_size": args.global_batch_size, "max_gpus": args.max_gpus or args.gpus}
    return {key: value for key, value in body.items() if value is not None}


def _gb(num_bytes: int) -> str:
    return f"{num_bytes / GB:,.3f}"


def format_plan(plan: dict) -> str:
    """The plan as tables a person reads: breakdown, stages at N, sweep over N."""
    n, stage, memory = plan["num_gpus"], plan["stage"], plan["gpu_memory_bytes"]
    per_gpu = plan["per_gpu"]
    lines = [
        f"{plan['num_params']:,} parameters, {plan['precision']} + {plan['optimizer']}, "
        f"counted by {plan['method']}, "
        f"ZeRO stage {stage}, {n} GPUs of {_gb(memory)} GB (GB = 1e9 bytes)",
        "",
        f"{'per GPU':<12}{'GB':>12}{'bytes':>22}",
    ]
    for kind in ("params", "grads", "optimizer", "padding", "activations", "temporaries", "overhead", "total"):
        lines.append(f"{kind:<12}{_gb(per_gpu[f'{kind}_bytes']):>12}{per_gpu[f'{kind}_bytes']:>22,}")
    verdict = "fits" if plan["fits"] else "does NOT fit"
    lines.append(f"{verdict}: headroom {_gb(plan['headroom_bytes'])} GB of {_gb(memory)} GB")
    min_gpus = plan["min_gpus"]
    lines.append(f"min_gpus at stage {stage}: {min_gpus}" if min_gpus else f"min_gpus at stage {stage}: none fits")
    lines += ["", f"{'stage':<8}{f'GB per GPU at N={n}':>22}"]
    lines += [f"{s:<8}{_gb(total):>22}" for s, total in plan["stages"].items()]
    lines += ["", f"{'N':>6}{f'stage {stage} GB':>16}  fits"]
    lines += [f"{p['num_gpus']:>6}{_gb(p['total_bytes']):>16}  {'yes' if p['fits'] else 'no'}" for p in plan["sweep"]]
    return "\n".join(lines)


def format_recommendations(body: dict) -> str:
    """The recommendations as a table a person reads, cheapest first, with the cost model above it."""
    cost = body["cost_model"]
    lines = [
        f"{cost['num_params']:,} parameters, global batch {body['global_batch_size']:,} "
        f"({cost['tokens_per_step']:,} tokens), ZeRO stage 1 on up to {body['max_gpus']:,} GPUs of "
        f"{_gb(body['gpu_memory_bytes'])} GB (GB = 1e9 bytes): {body['count']} configurations that fit, cheapest first",
        f"cost in {cost['unit']} at {cost['gpu_tflops']:g} TFLOP/s and {cost['network_gb_per_s']:g} GB/s per GPU: "
        f"{cost['formula']}",
        "",
        f"{'N':>6}  {'micro-batch':>11}  {'accum':>6}  {'ckpt':<4}  {'GB per GPU':>10}  {'headroom GB':>11}  "
        f"{'cost GPU-s':>10}  why",
    ]
    for item in body["recommendations"]:
        lines.append(
            f"{item['num_gpus']:>6}  {item['micro_batch_size']:>11}  {item['accumulation_steps']:>6}  "
            f"{'yes' if item['activation_checkpointing'] else 'no':<4}  {_gb(item['total_bytes']):>10}  "
            f"{_gb(item['headroom_bytes']):>11}  {item['cost']:>10.4g}  {item['why']}"
        )
    return "\n".join(lines)


def _cmd_recommend(args: argparse.Namespace) -> int:
    from service.cluster import simulated_capacity
    from service.errors import ServiceError, describe_validation_errors
    from service.recommendations import cost_model_of, recommend_public
    from service.schemas import RecommendRequest

    settings = get_settings()
    try:
        request = RecommendRequest.model_validate(_recommend_body(args))
    except ValueError as exc:  # pydantic's ValidationError is one
        message = describe_validation_errors(exc.errors())[0] if isinstance(exc, ValidationError) else str(exc)
        print(f"zero1 plan: {message}", file=sys.stderr)
        return 2
    overhead_bytes = round(settings.gpu_overhead_gb * GB)
    try:
        body = recommend_public(
            request,
            cluster=simulated_capacity(settings),
            overhead_bytes=overhead_bytes,
            cost_model=cost_model_of(settings),
        )
    except ServiceError as error:  # does_not_fit: why, and the plan of the least bytes found
        print(f"does not fit: {error.message}", file=sys.stderr)
        print(format_plan(error.extra["plan"]), file=sys.stderr)
        return 1
    public = body.model_dump(mode="json")
    print(json.dumps(public, indent=2) if args.json else format_recommendations(public))
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from service.cluster import simulated_capacity
    from service.errors import ServiceError, describe_validation_errors
    from service.planning import make_plan, plan_public
    from service.schemas import PlanRequest
    from service.tracing import Tracer

    if args.recommend:
        return _cmd_recommend(args)
    if args.global_batch_size is not None or args.max_gpus is not None:
        print("zero1 plan: --global-batch-size and --max-gpus apply to --recommend only", file=sys.stderr)
        return 2
    settings = get_settings()
    try:
        request = PlanRequest.model_validate(_plan_body(args))
    except ValidationError as exc:
        message, _ = describe_validation_errors(exc.errors())
        print(f"zero1 plan: {message}", file=sys.stderr)
        return 2
    tracer = Tracer(timeout_s=settings.plan_timeout_s, in_process=True)  # the CLI may import torch
    overhead_bytes = round(settings.gpu_overhead_gb * GB)
    try:
        plan = make_plan(request, cluster=simulated_capacity(settings), overhead_bytes=overhead_bytes, tracer=tracer)
    except ServiceError as exc:
        print(f"zero1 plan: {exc.message}", file=sys.stderr)
        return 2
    public = plan_public(plan).model_dump(mode="json")
    print(json.dumps(public, indent=2) if args.json else format_plan(public))
    return 0


def _client(args: argparse.Namespace):
    """An HTTP client of the API that sends ZERO1_TOKEN, when set, as its bearer token."""
    import httpx

    token = os.environ.get("ZERO1_TOKEN", "").strip()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=args.url, timeout=30, headers=headers)


def _api_error(response) -> int | None:
    """Print an API error the way a person reads it; its exit code, or None on success."""
    if response.is_success:
        return None
    try:
        body = response.json()
        message = body.get("message") or body
    except ValueError:
        message = response.text
    print(f"zero1: {response.status_code} {message}", file=sys.stderr)
    return 1


def _cmd_submit(args: argparse.Namespace) -> int:
    try:
        body = json.loads(Path(args.spec).read_text())
    except (OSError, ValueError) as exc:
        print(f"zero1 submit: cannot read {args.spec}: {exc}", file=sys.stderr)
        return 2
    with _client(args) as client:
        response = client.post("/v1/jobs", json=body, params={"dry_run": str(args.dry_run).lower()})
    if response.status_code == 422 and response.json().get("error") == "does_not_fit":
        print(f"does not fit: {response.json()['message']}", file=sys.stderr)
        print(format_plan(response.json()["plan"]), file=sys.stderr)
        return 1
    if (code := _api_error(response)) is not None:
        return code
    body = response.json()
    print(format_plan(body["plan"]))
    if args.dry_run:
        print("\ndry run: the job fits and would be admitted")
    else:
        print(f"\njob {body['id']} {body['status']} (queue position {body['queue_position']})")
    return 0


def _job_line(job: dict) -> str:
    latest = job.get("latest") or {}
    loss = latest.get("loss")
    step = "-" if job["step"] is None else job["step"] + 1
    return (
        f"{job['id']:>6}  {job['status']:<10}  {step:>8}/{job['steps']:<8}  {job['num_gpus']:>4}  "
        f"{'-' if loss is None else f'{loss:.4f}':>8}  {job['name']}"
    )


def _cmd_jobs(args: argparse.Namespace) -> int:
    with _client(args) as client:
        response = client.get(
            "/v1/jobs", params={"limit": args.limit, **({"status": args.status} if args.status else {})}
        )
    if (code := _api_error(response)) is not None:
        return code
    print(f"{'id':>6}  {'status':<10}  {'step':>8}/{'steps':<8}  {'gpus':>4}  {'loss':>8}  name")
    for job in response.json()["data"]:
        print(_job_line(job))
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        response = client.get(f"/v1/jobs/{args.job_id}")
        if (code := _api_error(response)) is not None:
            return code
        events = client.get(f"/v1/jobs/{args.job_id}/events")
    job = response.json()
    print(json.dumps({k: v for k, v in job.items() if k not in ("spec", "plan")}, indent=2))
    if not events.is_success:  # another user's job: its events are its owner's and admins'
        return 0
    for event in events.json()["data"]:
        print(f"{event['at']}  {event['from_status'] or '-':>10} -> {event['to_status']:<10}  {event['reason']}")
    return 0


def _progress(job: dict, *, eval_loss: float | None = None, width: int = 30) -> str:
    """The watch line; eval_loss: the latest held-out loss seen (rows carry it only on steps that evaluate)."""
    done = 0 if job["step"] is None else job["step"] + 1
    filled = width * done // job["steps"]
    latest = job.get("latest") or {}
    loss, speed = latest.get("loss"), latest.get("tokens_per_s")
    return (
        f"[{'#' * filled}{'.' * (width - filled)}] {done}/{job['steps']}  "
        f"loss {'-' if loss is None else f'{loss:.4f}'}  "
        f"{'' if eval_loss is None else f'eval {eval_loss:.4f}  '}"
        f"{'-' if speed is None else f'{speed:,.0f}'} tokens/s  {job['status']}"
    )


def _cmd_watch(args: argparse.Namespace) -> int:
    """A live progress line until the job ends; exit 0 only if it succeeded."""
    import time

    seen_step, evaluated = None, {"step": -1, "eval_loss": None}
    with _client(args) as client:
        while True:
            response = client.get(f"/v1/jobs/{args.job_id}")
            if (code := _api_error(response)) is not None:
                return code
            job = response.json()
            if job["step"] is not None and job["step"] != seen_step:
                seen_step = job["step"]
                evaluated = _latest_eval(client, args.job_id, after=evaluated)
            print(f"\r{_progress(job, eval_loss=evaluated['eval_loss'])}", end="", flush=True)
            if job["status"] in ("succeeded", "failed", "cancelled"):
                print()
                if job["error"]:
                    print(f"error: {job['error']}", file=sys.stderr)
                return 0 if job["status"] == "succeeded" else 1
            time.sleep(args.interval)


def _latest_eval(client, job_id: int, *, after: dict) -> dict:
    """The newest row that evaluated since `after` (a row, or its step -1 and no eval_loss), else
    `after`: rows carry eval_loss only on the steps that evaluate, which a poll may not land on."""
    response = client.get(
        f"/v1/jobs/{job_id}/metrics", params={"evaluated": "true", "after_step": after["step"], "limit": 10_000}
    )
    rows = response.json()["data"] if response.is_success else []  # another's job: its metrics are not ours
    return rows[-1] if rows else after


def _cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        response = client.post(f"/v1/jobs/{args.job_id}/cancel")
    if (code := _api_error(response)) is not None:
        return code
    print(f"job {args.job_id}: cancel requested ({response.json()['status']})")
    return 0


def _cmd_download(args: argparse.Namespace) -> int:
    """Every file of the job's final model into DIR, streamed to a temporary name, its sha256 checked
    against the listing before it takes its own name; a line per file. Exit 1 at the first mismatch."""
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    with _client(args) as client:
        listing = client.get(f"/v1/jobs/{args.job_id}/artifacts")
        if (code := _api_error(listing)) is not None:
            return code
        files = listing.json()["data"]
        if not files:
            print(f"zero1 download: job {args.job_id} has no artifacts", file=sys.stderr)
            return 1
        for entry in files:
            name = Path(entry["name"]).name  # a file name, never a path out of DIR
            part = directory / f".{name}.part"
            digest, size = hashlib.sha256(), 0
            with client.stream("GET", f"/v1/jobs/{args.job_id}/artifacts/{name}") as response:
                if (code := _api_error(response)) is not None:
                    return code
                with open(part, "wb") as file:
                    for chunk in response.iter_bytes(1 << 20):
                        digest.update(chunk)
                        size += len(chunk)
                        file.write(chunk)
            if digest.hexdigest() != entry["sha256"] or size != entry["bytes"]:
                part.unlink()
                print(
                    f"zero1 download: {name}: sha256 mismatch ({size:,} bytes, sha256 {digest.hexdigest()}; "
                    f"listed {entry['bytes']:,} bytes, sha256 {entry['sha256']})",
                    file=sys.stderr,
                )
                return 1
            part.replace(directory / name)
            print(f"{name}  {size:,} bytes  sha256 ok {entry['sha256'][:16]}")
    return 0


def _cmd_db(args: argparse.Namespace) -> int:
    from sqlalchemy import make_url

    from service.db import upgrade

    url = get_settings().database_url
    try:
        upgrade(url)
    except ValueError as error:  # a placeholder password: a message, not a traceback
        print(f"zero1 db upgrade: {error}", file=sys.stderr)
        return 2
    # the password stays out of the output, which goes to container logs
    print(f"database at revision head: {make_url(url).render_as_string(hide_password=True)}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from service.auth import check_bind, load_tokens
    from service.cluster import check_ray_auth_token
    from service.db import check_url

    settings = get_settings()
    host = args.host or settings.host
    try:  # before anything starts: a bad token entry, an open bind or a placeholder is a message, not a traceback
        tokens = load_tokens(settings)
        check_bind(host, tokens=tokens)
        check_ray_auth_token(os.environ)
        check_url(settings.database_url)
    except ValueError as error:
        print(f"zero1 serve: {error}", file=sys.stderr)
        return 2

    import uvicorn

    from service.main import create_app

    # zero1's own log lines (re-attachments, retries, the drain at shutdown) beside uvicorn's
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_app(settings, tokens=tokens), host=host, port=args.port or settings.port)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    commands = {
        "plan": _cmd_plan,
        "serve": _cmd_serve,
        "submit": _cmd_submit,
        "jobs": _cmd_jobs,
        "status": _cmd_status,
        "watch": _cmd_watch,
        "cancel": _cmd_cancel,
        "download": _cmd_download,
        "db": _cmd_db,
    }
    try:
        return commands[args.command](args)
    except BrokenPipeError:  # `zero1 jobs | head -3`: the reader left, which is no error
        _silence_stdout()
        return 0
    except Exception as exc:
        import httpx

        if not isinstance(exc, httpx.TransportError):
            raise
        print(
            f"zero1 {args.command}: cannot reach the zero1 API at {args.url} ({type(exc).__name__}: {exc}). "
            "Start it with `zero1 serve` (or `make run`), or point ZERO1_URL or --url at a running one.",
            file=sys.stderr,
        )
        return 1


def _silence_stdout() -> None:
    """Send what is still buffered for stdout to /dev/null: the flush at exit would fail on the
    closed pipe and print a traceback (https://docs.python.org/3/library/signal.html#note-on-sigpipe)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())

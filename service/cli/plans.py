"""`zero1 plan`: a model's plan, or the configurations that fit it (--recommend), made in this
process as the API makes them, printed as tables or as the API's JSON."""

from __future__ import annotations

import argparse
import json
import sys

from pydantic import ValidationError

from service.settings import get_settings
from workers.memory.model import GB


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
        raise ValueError(
            f"{', '.join(given)} do not apply to --recommend: it searches them, and the stages jobs run at"
        )
    plan = _plan_body(args)
    body = {key: plan[key] for key in ("model", "seq_len", "precision", "optimizer", "gpu_memory_gb") if key in plan}
    body |= {"global_batch_size": args.global_batch_size, "max_gpus": args.max_gpus or args.gpus}
    return {key: value for key, value in body.items() if value is not None}


def _gb(num_bytes: int) -> str:
    return f"{num_bytes / GB:,.3f}"


def format_plan(plan: dict) -> str:
    """The plan as tables a person reads: breakdown, stages at N, sweep over N."""
    n = plan["num_gpus"]
    stage = plan["stage"]
    memory = plan["gpu_memory_bytes"]
    per_gpu = plan["per_gpu"]
    lines = [
        f"{plan['num_params']:,} parameters, {plan['precision']} + {plan['optimizer']}, "
        f"counted by {plan['method']}, "
        f"ZeRO stage {stage}, {n} GPUs of {_gb(memory)} GB (GB = 1e9 bytes)",
        "",
        f"{'per GPU':<12}{'GB':>12}{'bytes':>22}",
    ]
    for kind in (
        "params",
        "grads",
        "buckets",
        "optimizer",
        "padding",
        "activations",
        "temporaries",
        "overhead",
        "total",
    ):
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
        f"({cost['tokens_per_step']:,} tokens), ZeRO stages 1-3 on up to {body['max_gpus']:,} GPUs of "
        f"{_gb(body['gpu_memory_bytes'])} GB (GB = 1e9 bytes): {body['count']} configurations that fit, cheapest first",
        f"cost in {cost['unit']} at {cost['gpu_tflops']:g} TFLOP/s and {cost['network_gb_per_s']:g} GB/s per GPU: "
        f"{cost['formula']}",
        "",
        f"{'N':>6}  {'micro-batch':>11}  {'accum':>6}  {'ckpt':<4}  {'stage':>5}  {'GB per GPU':>10}  "
        f"{'headroom GB':>11}  {'cost GPU-s':>10}  why",
    ]
    for item in body["recommendations"]:
        lines.append(
            f"{item['num_gpus']:>6}  {item['micro_batch_size']:>11}  {item['accumulation_steps']:>6}  "
            f"{'yes' if item['activation_checkpointing'] else 'no':<4}  {item['zero_stage']:>5}  "
            f"{_gb(item['total_bytes']):>10}  {_gb(item['headroom_bytes']):>11}  {item['cost']:>10.4g}  {item['why']}"
        )
    return "\n".join(lines)


def _recommend(args: argparse.Namespace) -> int:
    from service.errors import ServiceError, describe_validation_errors
    from service.planning.capacity import simulated_capacity
    from service.planning.recommendations import cost_model_of, recommend_public
    from service.schemas.plan_requests import RecommendRequest

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
        print(f"does not fit: {error.message}")  # the answer, as a fit's table is: to stdout (exit status 1)
        print(format_plan(error.extra["plan"]))
        return 1
    public = body.model_dump(mode="json")
    print(json.dumps(public, indent=2) if args.json else format_recommendations(public))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from service.errors import ServiceError, describe_validation_errors
    from service.planning.capacity import simulated_capacity
    from service.planning.plans import make_plan, plan_public
    from service.planning.traces import Tracer
    from service.schemas.plan_requests import PlanRequest

    if args.recommend:
        return _recommend(args)
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

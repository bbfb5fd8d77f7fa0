"""The `zero1` command: `zero1 serve` runs the API, `zero1 plan` plans a model."""

from __future__ import annotations

import argparse
import json
import sys
from decimal import Decimal, InvalidOperation

from pydantic import ValidationError

from service.config import get_settings
from workers.memory import GB, PRECISIONS, OPTIMIZERS, STAGES


def _count(text: str) -> int:
    """'7.5e9' -> 7500000000, exactly; a fractional count is an error."""
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
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
    plan.add_argument("--json", action="store_true", help="print the API's JSON instead of tables")
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


def _gb(num_bytes: int) -> str:
    return f"{num_bytes / GB:,.3f}"


def format_plan(plan: dict) -> str:
    """The plan as tables a person reads: breakdown, stages at N, sweep over N."""
    n, stage, memory = plan["num_gpus"], plan["stage"], plan["gpu_memory_bytes"]
    per_gpu = plan["per_gpu"]
    lines = [
        f"{plan['num_params']:,} parameters, {plan['precision']} + {plan['optimizer']}, "
        f"ZeRO stage {stage}, {n} GPUs of {_gb(memory)} GB (GB = 1e9 bytes)",
        "",
        f"{'per GPU':<12}{'GB':>12}{'bytes':>22}",
    ]
    for kind in ("params", "grads", "optimizer", "padding", "activations", "overhead", "total"):
        lines.append(f"{kind:<12}{_gb(per_gpu[f'{kind}_bytes']):>12}{per_gpu[f'{kind}_bytes']:>22,}")
    verdict = "fits" if plan["fits"] else "does NOT fit"
    lines.append(f"{verdict}: headroom {_gb(plan['headroom_bytes'])} GB of {_gb(memory)} GB")
    min_gpus = plan["min_gpus"]
    lines.append(
        f"min_gpus at stage {stage}: {min_gpus}" if min_gpus else f"min_gpus at stage {stage}: none fits"
    )
    lines += ["", f"{'stage':<8}{f'GB per GPU at N={n}':>22}"]
    lines += [f"{s:<8}{_gb(total):>22}" for s, total in plan["stages"].items()]
    lines += ["", f"{'N':>6}{f'stage {stage} GB':>16}  fits"]
    lines += [
        f"{p['num_gpus']:>6}{_gb(p['total_bytes']):>16}  {'yes' if p['fits'] else 'no'}" for p in plan["sweep"]
    ]
    return "\n".join(lines)


def _cmd_plan(args: argparse.Namespace) -> int:
    from service.cluster import simulated_capacity
    from service.errors import describe_validation_errors
    from service.planning import make_plan, plan_public
    from service.schemas import PlanRequest

    settings = get_settings()
    try:
        request = PlanRequest.model_validate(_plan_body(args))
    except ValidationError as exc:
        message, _ = describe_validation_errors(exc.errors())
        print(f"zero1 plan: {message}", file=sys.stderr)
        return 2
    plan = make_plan(
        request, cluster=simulated_capacity(settings), overhead_bytes=round(settings.gpu_overhead_gb * GB)
    )
    public = plan_public(plan).model_dump(mode="json")
    print(json.dumps(public, indent=2) if args.json else format_plan(public))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from service.main import create_app

    settings = get_settings()
    uvicorn.run(create_app(), host=args.host or settings.host, port=args.port or settings.port)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return {"plan": _cmd_plan, "serve": _cmd_serve}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())

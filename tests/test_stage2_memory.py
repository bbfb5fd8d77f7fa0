"""What a ZeRO stage-2 rank stages beside its gradient shards: a real ZeRO2AdamW rank's count, the
trace's (Stage2Schedule) and the built-in models' closed forms (buckets_bytes).

Packages: workers.models, workers.memory, workers.zero.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from service.planning.traces import TracedStep
from workers.memory.model import GPTSpec, MLPSpec, Workload, breakdown
from workers.models.builtin import DTYPES, GPT, build_model, trace_builtin
from workers.models.trace import StepMemory, measure_step, trace_layers, trace_step
from workers.zero.optimizer import decay_param_groups
from workers.zero.stage2 import ZeRO2AdamW

from distributed import run_ranks

TINY = GPTSpec(vocab_size=64, n_layer=2, n_head=2, n_embd=32, block_size=32)
WIDE = GPTSpec(vocab_size=512, n_layer=3, n_head=8, n_embd=512, block_size=64)
"""Wide on short sequences: the peak is in backward's blocks, beside the staged buckets."""


class AnyBuckets(ZeRO2AdamW):
    """ZeRO2AdamW that takes buckets below 1 MiB: a tiny model's buffers cut in many."""

    min_bucket_cap_mb = 1e-6


def _stage2_step(rank: int, world_size: int, cases: list, out: str) -> None:
    """One micro-batch's step of each case (spec, precision, checkpointing, bucket_cap_mb) at ZeRO stage 2
    on a gloo rank, counted as the training loop counts it; the StepMemory of each, as JSON."""
    counted = []
    for spec, precision, checkpointing, cap in cases:
        torch.manual_seed(0)
        model = build_model(spec, dtype=DTYPES[precision], activation_checkpointing=checkpointing)
        opt = AnyBuckets(decay_param_groups(model, weight_decay=0.1), lr=1e-3, bucket_cap_mb=cap)
        inputs = torch.randint(0, spec.vocab_size, (2, 2, spec.block_size))
        _, used = measure_step(model, inputs, lambda: model(*inputs), lambda loss: loss.backward())
        counted.append(dataclasses.asdict(used))
        assert opt._shards.sent == len(opt._buckets) > 0  # every bucket went once
    Path(out).write_text(json.dumps(counted))


CASES = [
    (TINY, "fp32", False, 25.0),  # one bucket a buffer: the whole gradient staged
    (TINY, "fp32", True, 0.01),  # 10 KB buckets: launched and finished while backward runs
    (TINY, "bf16", False, 0.002),
    (WIDE, "fp32", False, 1.0),
    (WIDE, "bf16", True, 1.0),
]


def test_a_stage_2_rank_stages_what_its_trace_counts_byte_for_byte(tmp_path):
    """gloo's sends go as each bucket fills, as the trace plays them; at N = 1 no receive buffer."""
    run_ranks(1, _stage2_step, CASES, str(tmp_path / "counted.json"))
    counted = [StepMemory(**used) for used in json.loads((tmp_path / "counted.json").read_text())]
    for (spec, precision, checkpointing, cap), used in zip(CASES, counted, strict=True):
        traced = trace_builtin(
            spec, precision=precision, micro_batch_size=2, activation_checkpointing=checkpointing, bucket_cap_mb=cap
        )
        assert traced.stage2_memory == used, (spec, precision, checkpointing, cap)
        assert traced.buckets_bytes == max(0, used.peak_bytes - traced.memory.peak_bytes)


@pytest.mark.parametrize(
    "spec",
    [TINY, GPTSpec(vocab_size=1024, n_layer=4, n_head=8, n_embd=128, block_size=128), WIDE],
    ids=["tiny", "small", "wide"],
)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["full", "checkpointed"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_gpts_closed_form_plans_at_least_what_its_trace_counts(spec, checkpointing, precision):
    """A bound by phase of backward (GPTSpec.buckets_bytes): never under the trace's count of the
    buckets, and the stage-2 plan within 2.5% over the trace's with 25 MiB buckets, within 6% with
    buckets of 1 MiB and 10 KB (the stage-1 closed forms are the trace's to a few bytes here)."""
    for cap, within in ((25.0, 1.025), (1.0, 1.06), (0.01, 1.06)):
        step = {"precision": precision, "micro_batch_size": 2, "activation_checkpointing": checkpointing}
        traced = trace_builtin(spec, **step, bucket_cap_mb=cap)
        counted = TracedStep.of(traced, bucket_cap_mb=cap).workload(precision=precision)
        closed = Workload.from_model(spec, **step, bucket_cap_mb=cap)
        assert closed.buckets_bytes >= traced.buckets_bytes, cap
        planned, measured = (breakdown(w, num_gpus=2, stage=2).total_bytes for w in (closed, counted))
        assert 0.9999 * measured <= planned <= within * measured, (cap, planned / measured)


@pytest.mark.parametrize("sizes", [(16, 64, 8, 32), (1024,) * 6 + (10,), (64, 256, 256, 10)])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_mlps_closed_form_plans_what_its_trace_counts_within_1_percent(sizes, precision):
    """Backward's moments walked layer by layer (MLPSpec.buckets_bytes), each layer's gradients staged
    as they are made: never under the trace's count of the buckets, the plan within 1% of the trace's."""
    spec = MLPSpec(sizes=sizes)
    for cap in (25.0, 1.0, 0.01):
        traced = trace_builtin(spec, precision=precision, micro_batch_size=2, bucket_cap_mb=cap)
        counted = TracedStep.of(traced, bucket_cap_mb=cap).workload(precision=precision)
        closed = Workload.from_model(spec, precision=precision, micro_batch_size=2, bucket_cap_mb=cap)
        assert closed.buckets_bytes >= traced.buckets_bytes > 0, cap
        planned, measured = (breakdown(w, num_gpus=2, stage=2).total_bytes for w in (closed, counted))
        assert planned == pytest.approx(measured, rel=0.01), cap


def test_a_deep_stack_counts_stage_2_on_the_whole_stack_as_two_shallow_ones_would_not():
    """A 6-layer 512-wide GPT cuts its 25 MiB buckets across two blocks each: backward stages more of
    them than a 2- or 3-layer stack does, as the blocks behind it hold less. trace_layers counts
    stage 2 on the whole stack: its count is the full trace's, above the shallow ones' extrapolation."""
    spec = dataclasses.replace(WIDE, n_layer=6, block_size=128)

    def build(num_layers: int) -> nn.Module:
        return GPT(dataclasses.replace(spec, n_layer=num_layers))

    def make_inputs():
        return torch.zeros(2, 128, dtype=torch.long), torch.zeros(2, 128, dtype=torch.long)

    deep = trace_layers(build, make_inputs, dtype=torch.float32, num_layers=6)
    full = trace_step(lambda: build(6), make_inputs, dtype=torch.float32)
    assert (deep.memory, deep.stage2_memory) == (full.memory, full.stage2_memory) and deep.buckets_bytes > 0
    low, high = (trace_step(lambda n=n: build(n), make_inputs, dtype=torch.float32).stage2_memory for n in (2, 3))
    assert deep.stage2_memory.peak_bytes > low.peak_bytes + (6 - 2) * (high.peak_bytes - low.peak_bytes)

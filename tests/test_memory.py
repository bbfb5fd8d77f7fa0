"""The ZeRO memory model against docs/memory-model.md's formulas and tables.

Packages: workers.memory.
"""

from __future__ import annotations

import math
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.memory import model as memory
from workers.memory.buckets import MAX_BUCKETS_IN_FLIGHT, MIB, Staging, cut_buckets
from workers.memory.fit import SWEEP_NUM_GPUS, min_gpus, plan
from workers.memory.model import GB, GPTSpec, MLPSpec, Workload, breakdown, total_bytes

PSI_7B5 = 7_500_000_000
BUCKETS_FP16 = (MAX_BUCKETS_IN_FLIGHT + 1) * 25 * MIB
"""A plan by parameter count at stage 2, fp16: the buckets in flight and the one filling, of 25 MiB each."""


def test_seed_worked_example():
    """Ψ = 7.5e9, fp16 AdamW: 120 GB for DDP, 31.40625 GB at N = 64, floor 30 GB; stage 2 adds its
    gradient buckets staged at once (3 x 25 MiB)."""
    result = plan(Workload.from_num_params(PSI_7B5), num_gpus=64, stage=1, gpu_memory_bytes=80 * GB)
    assert result.per_gpu.total_bytes == 31_406_250_000
    assert result.stages == {0: 120 * GB, 1: 31_406_250_000, 2: 16_640_625_000 + BUCKETS_FP16, 3: 1_875_000_000}
    assert result.per_gpu.buckets_bytes == 0  # stage 1's
    assert result.fits and result.headroom_bytes == 80 * GB - 31_406_250_000
    assert result.min_gpus == 2
    assert (result.per_gpu.params_bytes, result.per_gpu.grads_bytes) == (2 * PSI_7B5, 2 * PSI_7B5)
    assert result.per_gpu.optimizer_bytes == 12 * PSI_7B5 // 64
    assert result.per_gpu.padding_bytes == result.per_gpu.activations_bytes == result.per_gpu.overhead_bytes == 0


def test_sweep_melts_toward_the_4psi_floor():
    result = plan(Workload.from_num_params(PSI_7B5), num_gpus=64, stage=1, gpu_memory_bytes=80 * GB)
    assert [p.num_gpus for p in result.sweep] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    totals = [p.total_bytes for p in result.sweep]
    assert totals[0] == 16 * PSI_7B5  # N = 1: no partition, stage 1 == stage 0
    assert totals == [4 * PSI_7B5 + 12 * -(-PSI_7B5 // n) for n in SWEEP_NUM_GPUS]
    assert [p.fits for p in result.sweep] == [False] + [True] * 10
    assert all(t > 4 * PSI_7B5 for t in totals)


@pytest.mark.parametrize(
    ("precision", "optimizer", "p", "g", "k"),
    [
        ("fp16", "adamw", 2, 2, 12),
        ("bf16", "adam", 2, 2, 12),
        ("bf16", "sgd_momentum", 2, 2, 8),
        ("fp16", "sgd", 2, 2, 4),
        ("fp32", "adamw", 4, 4, 8),
        ("fp32", "adam", 4, 4, 8),
        ("fp32", "sgd_momentum", 4, 4, 4),
        ("fp32", "sgd", 4, 4, 0),
    ],
)
def test_design_tables(precision, optimizer, p, g, k):
    psi = 1_000_000
    n = 8
    w = Workload.from_num_params(psi, precision=precision, optimizer=optimizer)
    assert total_bytes(w, num_gpus=n, stage=0) == (p + g + k) * psi
    assert total_bytes(w, num_gpus=n, stage=1) == (p + g) * psi + k * psi // n
    cap = 25 * MIB // g
    buckets = g * min(psi, (MAX_BUCKETS_IN_FLIGHT + 1) * cap)
    assert total_bytes(w, num_gpus=n, stage=2) == p * psi + (g + k) * psi // n + buckets
    assert total_bytes(w, num_gpus=n, stage=3) == (p + g + k) * psi // n


def test_shards_hold_whole_elements():
    """N that does not divide Ψ: every rank holds ⌈Ψ/N⌉ elements of state."""
    w = Workload.from_num_params(10)
    assert breakdown(w, num_gpus=3, stage=1).optimizer_bytes == 12 * 4
    assert breakdown(w, num_gpus=3, stage=3).total_bytes == 16 * 4


def test_min_gpus_is_null_when_the_floor_does_not_fit():
    """Stage 1 never goes below 4Ψ: 30 GB of weights and grads cannot fit in 24 GB."""
    w = Workload.from_num_params(PSI_7B5)
    assert min_gpus(w, stage=1, gpu_memory_bytes=24 * GB) is None
    assert min_gpus(w, stage=2, gpu_memory_bytes=24 * GB) == 12  # 15 GB + 14Ψ/N <= 24 GB
    assert min_gpus(w, stage=0, gpu_memory_bytes=80 * GB) is None
    assert min_gpus(w, stage=0, gpu_memory_bytes=120 * GB) == 1


# GPT-2 small and XL with a tied LM head, counted the way a nn.Module reports them.
@pytest.mark.parametrize(
    ("n_layer", "n_head", "n_embd", "expected"),
    [(12, 12, 768, 124_439_808), (48, 25, 1600, 1_557_611_200)],
)
def test_gpt_param_count_matches_gpt2(n_layer, n_head, n_embd, expected):
    spec = GPTSpec(vocab_size=50257, n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=1024)
    assert spec.num_params == expected
    decay, no_decay = spec.param_groups()
    assert no_decay == n_layer * 13 * n_embd + 2 * n_embd


@given(
    vocab_size=st.integers(1, 300),
    n_layer=st.integers(1, 4),
    n_head=st.integers(1, 4),
    head_dim=st.integers(1, 16),
    block_size=st.integers(1, 64),
)
def test_gpt_formula_counts_every_named_parameter(vocab_size, n_layer, n_head, head_dim, block_size):
    """The hook the workers' GPT module is checked against: names, shapes, and their sum."""
    spec = GPTSpec(
        vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, n_embd=n_head * head_dim, block_size=block_size
    )
    shapes = spec.parameter_shapes()
    assert len(shapes) == 12 * n_layer + 4
    sizes = {name: math.prod(shape) for name, shape in shapes.items()}
    assert sum(sizes.values()) == spec.num_params
    decay = sum(size for name, size in sizes.items() if len(shapes[name]) >= 2)
    assert (decay, spec.num_params - decay) == spec.param_groups()


def test_gpt_spec_rejects_heads_that_do_not_divide_width():
    with pytest.raises(ValueError, match=r"n_embd \(1601\) must be divisible by n_head \(25\)"):
        GPTSpec(vocab_size=10, n_layer=1, n_head=25, n_embd=1601, block_size=8)


def test_mlp_param_count():
    assert MLPSpec(sizes=(784, 256, 10)).param_groups() == (784 * 256 + 256 * 10, 256 + 10)


def test_model_plan_padding_is_what_flat_aligned_buffers_allocate():
    """Two buffers (decay, no-decay), each padded to N x 128 elements, fp16 AdamW."""
    spec = GPTSpec(vocab_size=65, n_layer=2, n_head=2, n_embd=64, block_size=32)
    decay, no_decay = spec.param_groups()
    n = 3
    w = Workload.from_model(spec, precision="fp16", optimizer="adamw")
    padded = [-(-x // (n * 128)) * (n * 128) for x in (decay, no_decay)]
    shard = sum(padded) // n
    b = breakdown(w, num_gpus=n, stage=1)
    psi = spec.num_params
    # the rank's state (master, exp_avg, exp_avg_sq) plus the flat fp16 weight and grad buffers
    assert b.optimizer_bytes + b.params_bytes + b.grads_bytes + b.padding_bytes == 12 * shard + 4 * sum(padded)
    assert b.optimizer_bytes == 12 * -(-psi // n)
    assert b.padding_bytes > 0
    assert memory.shard_numel(w, num_gpus=n) == shard


def test_model_plan_min_gpus_is_the_smallest_fitting_n():
    spec = GPTSpec(vocab_size=50257, n_layer=48, n_head=25, n_embd=1600, block_size=1024)
    w = Workload.from_model(spec, micro_batch_size=1, overhead_bytes=GB)
    memory_bytes = 20 * GB
    found = min_gpus(w, stage=1, gpu_memory_bytes=memory_bytes)
    assert found is not None and total_bytes(w, num_gpus=found, stage=1) <= memory_bytes
    assert all(total_bytes(w, num_gpus=n, stage=1) > memory_bytes for n in range(1, found))


def test_activation_estimate_follows_its_formula():
    spec = GPTSpec(vocab_size=100, n_layer=4, n_head=4, n_embd=64, block_size=128)
    s = 128
    b = 2
    h = 64
    a = 4
    v = 100
    L = 4
    block = s * b * (16 * h * 2 + 16 + 4 * a)
    head = s * b * (2 * h * 2 + 8 + 4 * v)
    inputs = 2 * 8 * s * b + 8 * s  # token ids, targets, positions (int64)
    full = spec.activation_bytes(micro_batch_size=b, seq_len=s, bytes_per_element=2, checkpointing=False)
    ckpt = spec.activation_bytes(micro_batch_size=b, seq_len=s, bytes_per_element=2, checkpointing=True)
    assert full == inputs + L * block + head
    assert ckpt == inputs + L * s * b * h * 2 + head  # the recomputed block is a temporary
    assert ckpt < full
    double = spec.activation_bytes(micro_batch_size=2 * b, seq_len=s, bytes_per_element=2, checkpointing=False)
    assert double == 2 * full - 8 * s  # the positions are one row, whatever the batch


def test_temporaries_estimate_follows_its_formula():
    """The larger of the head's moment (two fp32 gradients of the logits) and the last block's
    (c_proj's gradients beside the arriving one, the recomputed block with checkpointing)."""
    kw = {"micro_batch_size": 2, "seq_len": 128, "bytes_per_element": 2}
    wide_vocab = GPTSpec(vocab_size=50_000, n_layer=4, n_head=4, n_embd=64, block_size=128)
    s = 128
    b = 2
    h = 64
    v = 50_000
    assert wide_vocab.temporaries_bytes(**kw, checkpointing=False) == 8 * s * b * v
    wide_model = GPTSpec(vocab_size=100, n_layer=4, n_head=8, n_embd=1024, block_size=128)
    s = 128
    b = 2
    h = 1024
    v = 100
    head = s * b * (2 * h * 2 + 8 + 4 * v)
    c_proj = (s * b * h + 4 * s * b * h + 4 * h * h + h) * 2
    tied = v * h * 2  # the LM head's weight gradient, waiting for the embedding's part
    block = s * b * (16 * h * 2 + 16 + 4 * 8)
    assert wide_model.temporaries_bytes(**kw, checkpointing=False) == c_proj + tied - head
    assert wide_model.temporaries_bytes(**kw, checkpointing=True) == block + c_proj + tied - head


def test_model_plan_adds_activations_and_overhead():
    spec = GPTSpec(vocab_size=100, n_layer=4, n_head=4, n_embd=64, block_size=128)
    w = Workload.from_model(spec, micro_batch_size=2, overhead_bytes=123)
    b = breakdown(w, num_gpus=2, stage=1)
    assert b.overhead_bytes == 123
    step = {"micro_batch_size": 2, "seq_len": 128, "bytes_per_element": 2, "checkpointing": False}
    assert b.activations_bytes == spec.activation_bytes(**step)
    assert b.temporaries_bytes == spec.temporaries_bytes(**step) > 0
    assert b.total_bytes == b.params_bytes + b.grads_bytes + b.optimizer_bytes + b.padding_bytes + sum(
        (b.activations_bytes, b.temporaries_bytes, 123)
    )
    assert w.method == "model"
    with pytest.raises(ValueError, match=r"seq_len must be in \[1, block_size=128\], got 129"):
        Workload.from_model(spec, seq_len=129)


def test_a_traced_stage_3_plan_holds_its_traced_gathered_bytes_in_place_of_its_gathered_units():
    """A traced model's stage-3 term is what its step was counted holding gathered (gathered_bytes); the
    other stages and a plan without a trace's count keep the gathered units' weights."""
    common = {"group_numels": (1000, 24), "frozen_numel": 0, "activations_bytes": 500, "temporaries_bytes": 50}
    counted = Workload.from_trace(**common, gathered_numel=300, gathered_bytes=777, precision="bf16")
    uncounted = Workload.from_trace(**common, gathered_numel=300, precision="bf16")
    for n in (1, 2, 4):
        with_count, without = (breakdown(w, num_gpus=n, stage=3) for w in (counted, uncounted))
        assert with_count.params_bytes - without.params_bytes == 777 - 2 * 300
        for stage in (0, 1, 2):
            assert breakdown(counted, num_gpus=n, stage=stage) == breakdown(uncounted, num_gpus=n, stage=stage)
    assert memory.floor_bytes(counted, stage=3) - memory.floor_bytes(uncounted, stage=3) == 777 - 600
    with pytest.raises(ValueError, match="gathered_bytes must be >= 0, got -1"):
        Workload.from_trace(**common, gathered_bytes=-1)


def test_a_stage_2_plan_adds_its_counted_buckets_and_no_other_stage_does():
    """A traced model's stage-2 term is what its step was counted staging (buckets_bytes); a plan by
    parameter count bounds it by the buckets that can be staged at once, of the job's cap."""
    common = {"group_numels": (1000, 24), "frozen_numel": 0, "activations_bytes": 500, "temporaries_bytes": 50}
    counted = Workload.from_trace(**common, buckets_bytes=777, precision="bf16")
    uncounted = Workload.from_trace(**common, precision="bf16")
    for n in (1, 2, 4):
        with_count, without = (breakdown(w, num_gpus=n, stage=2) for w in (counted, uncounted))
        assert with_count.buckets_bytes == 777
        assert without.buckets_bytes == 2 * (1000 + 24)  # the bound: every gradient, both buffers' one bucket
        assert with_count.total_bytes - without.total_bytes == 777 - 2048
        for stage in (0, 1, 3):
            assert breakdown(counted, num_gpus=n, stage=stage).buckets_bytes == 0
            assert breakdown(counted, num_gpus=n, stage=stage) == breakdown(uncounted, num_gpus=n, stage=stage)
    assert memory.floor_bytes(counted, stage=2) - memory.floor_bytes(uncounted, stage=2) == 777 - 2048
    assert memory.floor_bytes(counted, stage=1) == memory.floor_bytes(uncounted, stage=1)
    small = Workload.from_num_params(PSI_7B5, bucket_cap_mb=1.0)  # 1 MiB buckets in fp16
    assert breakdown(small, num_gpus=8, stage=2).buckets_bytes == (MAX_BUCKETS_IN_FLIGHT + 1) * MIB
    with pytest.raises(ValueError, match="buckets_bytes must be >= 0, got -1"):
        Workload.from_trace(**common, buckets_bytes=-1)
    with pytest.raises(ValueError, match="bucket_cap_mb must be a finite number > 0, got 0"):
        Workload.from_num_params(10, bucket_cap_mb=0)


def test_a_model_plan_at_stage_2_counts_the_buckets_of_the_jobs_cap():
    """A built-in model's term is its closed form's at the job's bucket_cap_mb: buckets of 1 MiB stage
    less of this 12 MB model at once than its two 25 MiB buckets (all of it)."""
    spec = GPTSpec(vocab_size=512, n_layer=6, n_head=8, n_embd=256, block_size=64)
    step = {"micro_batch_size": 2, "seq_len": 64, "bytes_per_element": 2, "checkpointing": False}
    terms = {}
    for cap in (25.0, 1.0):
        w = Workload.from_model(spec, micro_batch_size=2, bucket_cap_mb=cap)
        terms[cap] = breakdown(w, num_gpus=4, stage=2).buckets_bytes
        assert terms[cap] == spec.buckets_bytes(**step, bucket_cap_mb=cap) == w.buckets_bytes
        assert breakdown(w, num_gpus=4, stage=1).buckets_bytes == 0
    assert 0 < terms[1.0] < terms[25.0] <= 2 * spec.num_params


def test_buckets_are_cut_from_a_buffers_end_of_whole_parameters():
    """The optimizer's cut (workers/zero/buckets.py takes it from here): at most the cap, a larger
    parameter alone, backward's order first."""
    cuts = cut_buckets([3, 5, 2, 9, 1], cap=8)
    assert [(c.first, c.num_params, c.lo, c.hi) for c in cuts] == [
        (4, 1, 19, 20),
        (3, 1, 10, 19),
        (1, 2, 3, 10),
        (0, 1, 0, 3),
    ]
    assert sum(c.hi - c.lo for c in cuts) == 3 + 5 + 2 + 9 + 1


def test_staging_allocates_on_a_buckets_first_gradient_and_frees_it_when_a_later_launch_finishes_it():
    """Four one-parameter buckets of 4 bytes, backward in reverse: at most MAX_BUCKETS_IN_FLIGHT
    launched and one staging, then the oldest is finished before the next launch."""
    staging = Staging([[4, 4, 4, 4]], bytes_per_element=1, bucket_cap_mb=4 / MIB)
    live = []
    for index in reversed(range(4)):
        staging.stage(0, index)
        live.append(staging.live_bytes)
        staging.staged(0, index)
        live.append(staging.live_bytes)
    assert live == [4, 4, 8, 8, 12, 8, 12, 8]
    assert staging.peak_bytes == (MAX_BUCKETS_IN_FLIGHT + 1) * 4
    staging.end()
    assert staging.live_bytes == 0


def test_staging_holds_a_bucket_until_its_last_gradient_and_sends_one_without_any_at_the_end():
    """Two buckets of 8 bytes ([2, 3] and [0, 1]) and one of 4 ([4] of a second buffer) whose parameter
    gets no gradient: gradients of both buckets interleaved hold both; the end stages the third."""
    staging = Staging([[4, 4, 4, 4], [4]], bytes_per_element=1, bucket_cap_mb=8 / MIB)
    for index in (3, 0, 2):
        staging.stage(0, index)
        staging.staged(0, index)
    assert staging.live_bytes == 16 and staging.in_flight == deque([0])  # [2, 3] launched, [0, 1] filling
    staging.stage(0, 1)
    staging.staged(0, 1)
    assert staging.live_bytes == 16 and staging.in_flight == deque([0, 1])
    staging.end()  # [4]'s zeroed buffer is allocated before the oldest in flight is finished, as the optimizer does
    assert (staging.peak_bytes, staging.live_bytes) == (8 + 8 + 4, 0)
    assert staging.arrived == [0, 0, 0] and not any(staging.launched)  # ready for the next backward


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_params": 0}, r"num_params must be in \[1, 1e\+15\], got 0"),
        ({"num_params": 10, "precision": "fp8"}, r"precision must be one of .*got 'fp8'"),
        ({"num_params": 10, "optimizer": "lion"}, r"optimizer must be one of .*got 'lion'"),
    ],
)
def test_workload_rejects_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Workload.from_num_params(**kwargs)


def test_breakdown_rejects_bad_n_and_stage():
    w = Workload.from_num_params(10)
    with pytest.raises(ValueError, match="num_gpus must be >= 1, got 0"):
        breakdown(w, num_gpus=0, stage=1)
    with pytest.raises(ValueError, match=r"stage must be one of \(0, 1, 2, 3\), got 4"):
        breakdown(w, num_gpus=1, stage=4)


# ----------------------------------------------------------------------- properties

workloads = st.builds(
    Workload.from_num_params,
    st.integers(min_value=1, max_value=memory.MAX_NUM_PARAMS),
    precision=st.sampled_from(memory.PRECISIONS),
    optimizer=st.sampled_from(memory.OPTIMIZERS),
)
gpus = st.integers(min_value=1, max_value=1 << 20)


@given(w=workloads, n=gpus, stage=st.sampled_from(memory.STAGES))
def test_monotone_non_increasing_in_n(w, n, stage):
    assert total_bytes(w, num_gpus=n + 1, stage=stage) <= total_bytes(w, num_gpus=n, stage=stage)


@given(w=workloads, n=gpus)
def test_higher_stages_never_cost_more_but_stage_2s_buckets(w, n):
    t0, t1, t2, t3 = (total_bytes(w, num_gpus=n, stage=s) for s in memory.STAGES)
    buckets = breakdown(w, num_gpus=n, stage=2).buckets_bytes
    assert 0 < buckets <= memory.bytes_per_param(w.precision)[1] * w.num_params
    assert t3 <= t2 - buckets <= t1 <= t0


@given(w=workloads)
def test_one_gpu_collapses_every_stage_to_ddp_but_stage_2s_buckets(w):
    """A stage-2 rank stages its gradients bucket by bucket even alone (workers/zero/stage2.py)."""
    totals = [total_bytes(w, num_gpus=1, stage=s) for s in memory.STAGES]
    assert totals[0] == totals[1] == totals[3] == totals[2] - breakdown(w, num_gpus=1, stage=2).buckets_bytes


@given(w=workloads, n=gpus, stage=st.sampled_from(memory.STAGES))
def test_integer_bytes_never_below_the_formula(w, n, stage):
    b = breakdown(w, num_gpus=n, stage=stage)
    values = (b.params_bytes, b.grads_bytes, b.buckets_bytes, b.optimizer_bytes, b.padding_bytes, b.total_bytes)
    assert all(type(v) is int and v >= 0 for v in values)
    p, g = memory.bytes_per_param(w.precision)
    k = memory.optimizer_bytes_per_param(w.precision, w.optimizer)
    sharded = {0: 0, 1: k, 2: g + k, 3: p + g + k}[stage]
    psi = w.num_params
    exact_numerator = (p + g + k - sharded) * psi * n + sharded * psi + b.buckets_bytes * n  # formula x N
    assert b.total_bytes * n >= exact_numerator
    assert b.total_bytes * n < exact_numerator + sharded * n + n  # at most one element of rounding
    if stage == 1:
        assert b.total_bytes > (p + g) * psi or k == 0  # the floor is never crossed


@settings(max_examples=200)
@given(
    w=workloads,
    stage=st.sampled_from(memory.STAGES),
    memory_bytes=st.integers(min_value=1, max_value=10**17),
)
def test_min_gpus_is_the_smallest_n_that_fits(w, stage, memory_bytes):
    found = min_gpus(w, stage=stage, gpu_memory_bytes=memory_bytes)
    if found is None:
        # not even one element per rank fits
        assert total_bytes(w, num_gpus=w.num_params, stage=stage) > memory_bytes
    else:
        assert total_bytes(w, num_gpus=found, stage=stage) <= memory_bytes
        if found > 1:
            assert total_bytes(w, num_gpus=found - 1, stage=stage) > memory_bytes

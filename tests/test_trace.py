"""The step's memory beyond the model states: the closed forms, the trace on fake tensors, and the
count on real tensors agree, and an independent tracer (torch's MemTracker) agrees with them.

Packages: workers.models, workers.memory, service.planning.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.nn import functional as F

from service.errors import ServiceError
from service.planning.traces import Tracer, TraceRequest
from workers.memory.model import GPTSpec, MLPSpec, Workload, breakdown
from workers.models.builtin import DTYPES, GPT, build_model, trace_builtin
from workers.models.trace import (
    LiveBytes,
    ParamCounts,
    TraceError,
    materialize,
    measure_step,
    trace_layers,
    trace_step,
)

from conftest import TRACE_TIMEOUT_S
from helpers import LLAMA_2_7B

GPT2_SMALL = GPTSpec(vocab_size=50304, n_layer=12, n_head=12, n_embd=768, block_size=1024)


def planned_step(spec, *, micro_batch_size: int, seq_len: int, precision: str, checkpointing: bool) -> tuple[int, int]:
    step = {
        "micro_batch_size": micro_batch_size,
        "seq_len": seq_len,
        "bytes_per_element": DTYPES[precision].itemsize,
        "checkpointing": checkpointing,
    }
    return spec.activation_bytes(**step), spec.temporaries_bytes(**step)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["full", "checkpointed"])
@pytest.mark.parametrize("micro_batch_size", [1, 4])
def test_gpt2_small_plan_is_within_5_percent_of_a_memtracker_trace(micro_batch_size, checkpointing):
    """MemTracker (torch's own tracer, another author's accounting) sees at its peak the activations and
    temporaries the closed forms plan, for the built-in GPT at GPT-2 small's shape, bf16, seq 1024."""
    with torch.device("meta"):
        model = GPT(GPT2_SMALL, activation_checkpointing=checkpointing).to(torch.bfloat16)
    with FakeTensorMode(allow_non_fake_inputs=True):
        materialize(model)  # to_empty, with the LM head tied again
        idx = torch.zeros(micro_batch_size, 1024, dtype=torch.long)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            model(idx, idx).backward()
        (peak,) = tracker.get_tracker_snapshot("peak").values()
    by_kind = {kind.name: nbytes for kind, nbytes in peak.items() if kind != "Total"}
    assert by_kind["PARAM"] == 2 * GPT2_SMALL.num_params  # the tied weight once
    assert by_kind["GRAD"] == 0  # its peak is at the start of backward, before any gradient
    activations, temporaries = planned_step(
        GPT2_SMALL, micro_batch_size=micro_batch_size, seq_len=1024, precision="bf16", checkpointing=checkpointing
    )
    assert activations + temporaries == pytest.approx(by_kind["ACT"] + by_kind["TEMP"], rel=0.05)
    # and this repository's own trace of the same step
    traced = trace_builtin(
        GPT2_SMALL, precision="bf16", micro_batch_size=micro_batch_size, activation_checkpointing=checkpointing
    )
    assert traced.memory.peak_bytes == pytest.approx(by_kind["ACT"] + by_kind["TEMP"], rel=0.001)


SHAPES = [
    GPTSpec(vocab_size=64, n_layer=2, n_head=2, n_embd=32, block_size=32),  # small vocab: the block's moment peaks
    GPTSpec(vocab_size=1024, n_layer=4, n_head=8, n_embd=128, block_size=128),  # the head's moment peaks
    GPTSpec(vocab_size=512, n_layer=3, n_head=8, n_embd=512, block_size=64),  # wide: c_proj's weight gradient
]


@pytest.mark.parametrize(
    "spec",
    [*SHAPES, MLPSpec(sizes=(16, 64, 8, 32)), MLPSpec(sizes=(8, 4))],
    ids=["tiny", "small", "wide", "mlp", "mlp-one-layer"],
)
def test_what_a_stage_3_rank_gathers_is_found_in_the_built_model_as_its_closed_form_says(spec):
    """The root's parameters and the two largest units (GPT blocks, MLP layers), counted on the model
    the workers build (workers/models/units.py) and by the spec's closed form: one number."""
    traced = trace_builtin(spec, precision="fp32", micro_batch_size=2)
    assert traced.params.gathered_numel == spec.gathered_numel() > 0


@pytest.mark.parametrize("checkpointing", [False, True], ids=["full", "checkpointed"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("spec", SHAPES, ids=["tiny", "small", "wide"])
def test_gpt_closed_forms_match_a_count_of_the_step_on_real_tensors(spec, precision, checkpointing):
    """An eager CPU step of the real model (the ranks' own count): activations and temporaries each within 2%."""
    torch.manual_seed(0)
    model = build_model(spec, dtype=DTYPES[precision], activation_checkpointing=checkpointing)
    idx, targets = torch.randint(0, spec.vocab_size, (2, 2, spec.block_size))
    _, used = measure_step(model, (idx, targets), lambda: model(idx, targets), lambda loss: loss.backward())
    activations, temporaries = planned_step(
        spec, micro_batch_size=2, seq_len=spec.block_size, precision=precision, checkpointing=checkpointing
    )
    assert used.activations_bytes == pytest.approx(activations, rel=0.02)
    assert used.temporaries_bytes == pytest.approx(temporaries, rel=0.02)
    # the fake trace counts what the real step held
    traced = trace_builtin(spec, precision=precision, micro_batch_size=2, activation_checkpointing=checkpointing)
    assert traced.memory == used
    assert (traced.params.decay_numel, traced.params.no_decay_numel) == spec.param_groups()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize(
    ("sizes", "batch"), [((64, 256, 256, 10), 32), ((16, 16, 1000), 4), ((64, 256, 10), 512), ((1000, 10, 10), 64)]
)
def test_mlp_closed_forms_match_a_count_of_the_step_on_real_tensors(sizes, batch, precision):
    spec = MLPSpec(sizes=sizes)
    model = build_model(spec, dtype=DTYPES[precision])
    x = torch.randn(batch, sizes[0], dtype=DTYPES[precision])
    y = torch.randint(0, sizes[-1], (batch,))
    _, used = measure_step(model, (x, y), lambda: model(x, y), lambda loss: loss.backward())
    activations, temporaries = planned_step(
        spec, micro_batch_size=batch, seq_len=1, precision=precision, checkpointing=False
    )
    assert used.activations_bytes == pytest.approx(activations, rel=0.01)
    assert used.temporaries_bytes == pytest.approx(temporaries, rel=0.01)
    assert trace_builtin(spec, precision=precision, micro_batch_size=batch).memory == used


class TiedAndFrozen(nn.Module):
    """Not a built-in model: a tied embedding and head, a frozen projection, a buffer, GELU and a norm."""

    def __init__(self, vocab: int = 300, width: int = 48) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.frozen = nn.Linear(width, width)
        self.frozen.requires_grad_(False)
        self.mix = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(width))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.frozen(self.embed(ids)) * self.scale
        x = self.norm(x + self.mix(x))
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def saved_tensor_bytes(model: nn.Module, *inputs: torch.Tensor) -> int:
    """What autograd saves in an eager CPU forward, by storage, once each, parameters left out
    (the reference the trace is checked against: another way of counting activations)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(*inputs).backward()
    return sum(saved.values())


def test_a_traced_module_counts_every_parameter_once_and_the_saved_tensors_within_1_percent():
    ids = labels = None

    def make_inputs():
        return torch.randint(0, 300, (4, 64)), torch.randint(0, 300, (4, 64))

    traced = trace_step(TiedAndFrozen, make_inputs, dtype=torch.float32)
    eager = TiedAndFrozen()
    unique = {id(p): p for p in eager.parameters()}.values()
    assert traced.params.num_params == sum(p.numel() for p in eager.parameters()) == sum(p.numel() for p in unique)
    assert traced.params.frozen_numel == 48 * 48 + 48
    assert traced.params.decay_numel == 300 * 48 + 2 * 4 * 48 * 48  # the tied matrix once, and mix's two
    ids, labels = make_inputs()
    assert traced.memory.activations_bytes == pytest.approx(saved_tensor_bytes(eager, ids, labels), rel=0.01)
    workload = Workload.from_trace(
        group_numels=(traced.params.decay_numel, traced.params.no_decay_numel),
        frozen_numel=traced.params.frozen_numel,
        activations_bytes=traced.memory.activations_bytes,
        temporaries_bytes=traced.memory.temporaries_bytes,
        precision="fp32",
    )
    plan = breakdown(workload, num_gpus=1, stage=0)
    trainable = traced.params.num_params - traced.params.frozen_numel
    assert workload.num_params == traced.params.num_params and workload.method == "traced"
    assert (plan.params_bytes, plan.grads_bytes, plan.optimizer_bytes) == (
        4 * traced.params.num_params,
        4 * trainable,
        8 * trainable,  # fp32 AdamW: exp_avg and exp_avg_sq; a frozen weight has neither
    )


def test_a_deep_stack_extrapolated_from_two_shallow_traces_equals_its_full_trace():
    spec = GPTSpec(vocab_size=2048, n_layer=9, n_head=4, n_embd=128, block_size=64)

    def build(num_layers: int) -> nn.Module:
        return GPT(dataclasses.replace(spec, n_layer=num_layers), activation_checkpointing=True)

    def make_inputs():
        return torch.zeros(3, 64, dtype=torch.long), torch.zeros(3, 64, dtype=torch.long)

    extrapolated = trace_layers(build, make_inputs, dtype=torch.bfloat16, num_layers=9)
    assert extrapolated.traced_layers == (2, 3)
    assert extrapolated == dataclasses.replace(
        trace_step(lambda: build(9), make_inputs, dtype=torch.bfloat16), traced_layers=(2, 3)
    )


class CausalLM(nn.Module):
    """A transformers causal LM called as zero1 calls a model: model(input_ids, labels) -> .loss."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.lm = AutoModelForCausalLM.from_config(config)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor):
        return self.lm(input_ids=input_ids, labels=labels)


def llama(**overrides):
    from transformers import LlamaConfig

    fields = {k: v for k, v in LLAMA_2_7B.items() if k != "model_type"}
    return LlamaConfig(**(fields | overrides))


def test_a_llama_2_7b_config_has_its_published_parameter_count():
    with torch.device("meta"):
        model = CausalLM(llama())
    assert ParamCounts.of(model).num_params == 6_738_415_616


def test_a_hugging_face_model_extrapolated_per_layer_equals_its_full_trace():
    small = {"hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 4, "num_key_value_heads": 4}

    def build(num_layers: int) -> nn.Module:
        return CausalLM(llama(**small, num_hidden_layers=num_layers))

    def make_inputs():
        return torch.zeros(2, 128, dtype=torch.long), torch.zeros(2, 128, dtype=torch.long)

    extrapolated = trace_layers(build, make_inputs, dtype=torch.bfloat16, num_layers=6)
    full = trace_step(lambda: build(6), make_inputs, dtype=torch.bfloat16)
    assert extrapolated.memory == full.memory and extrapolated.params == full.params
    assert extrapolated.stage3_memory == full.stage3_memory
    assert extrapolated.stage2_memory == full.stage2_memory  # counted on the whole stack
    assert full.params.num_params == sum(p.numel() for p in build(6).parameters())


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = x[x > 0]  # a shape that depends on the values: fake tensors do not have them
        return self.linear(kept.view(-1, 8)).sum() if kept.numel() else self.linear(x).sum()


def test_a_model_that_cannot_be_traced_names_the_operation_that_failed():
    with pytest.raises(TraceError, match=r"running forward and backward on fake tensors failed: .*nonzero"):
        trace_step(DataDependent, lambda: (torch.randn(4, 8),), dtype=torch.float32)
    with pytest.raises(TraceError, match=r"building the model on fake tensors failed: ValueError: no"):
        trace_step(lambda: (_ for _ in ()).throw(ValueError("no")), lambda: (), dtype=torch.float32)


def test_live_bytes_counts_what_ops_allocate_until_it_is_freed():
    kept = torch.zeros(10)
    with LiveBytes(ignore=[kept]) as meter:
        a = torch.ones(100)  # 400 bytes
        view = a[:10]  # a view: nothing new
        kept.add_(1)  # in place on a state: nothing new
        b = a * 2  # 400 more
        assert meter.live_bytes == 800
        del a, b  # the view still holds a's storage
        assert meter.live_bytes == 400
        del view
    assert (meter.live_bytes, meter.peak_bytes) == (0, 800)


def test_a_tensor_counted_then_made_a_state_is_not_subtracted_again_when_freed():
    with LiveBytes() as meter:
        grad = torch.ones(100)  # counted: a gradient in flight
        meter.ignore(grad)  # then accumulated into .grad: a state
        assert meter.live_bytes == 0
        other = torch.ones(10)
        del grad
        assert meter.live_bytes == 40
        del other
    assert (meter.live_bytes, meter.peak_bytes) == (0, 400)


def test_a_unit_fsdp2_frees_and_gathers_again_in_place_is_counted_while_gathered():
    """FSDP2 (ZeRO stage 3) frees a gathered unit by resizing its storage to 0 bytes and gathers it again
    into the same storage: no op makes it. A step that gathers a unit of 40,000 bytes for its forward
    and again for its backward holds it in its peak, not when forward returns."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param as fsdp_param

    model = nn.Linear(4, 4)
    inputs = torch.randn(2, 4)
    unit = torch.empty(10_000)  # made before the step, as FSDP2 makes a unit's storage once
    fsdp_param.free_storage(unit)

    def gathered(run):
        fsdp_param.alloc_storage(unit)
        try:
            return run()
        finally:
            fsdp_param.free_storage(unit)

    _, plain = measure_step(model, (inputs,), lambda: model(inputs).sum(), lambda loss: loss.backward())
    _, used = measure_step(
        model,
        (inputs,),
        lambda: gathered(lambda: model(inputs).sum()),
        lambda loss: gathered(loss.backward),
    )
    assert used.activations_bytes == plain.activations_bytes  # freed by the time forward returns
    assert used.peak_bytes == plain.peak_bytes + 40_000  # and counted while it was gathered
    assert fsdp_param.alloc_storage.__name__ == "alloc_storage"  # FSDP2's own functions back after


# --------------------------------------------------------------------------- the service's traced plans


def test_a_traced_plan_in_a_ray_task_is_cached_by_digest(ray_cluster):
    tracer = Tracer(timeout_s=TRACE_TIMEOUT_S)
    request = TraceRequest(
        model={"kind": "gpt", "vocab_size": 1024, "n_layer": 4, "n_head": 8, "n_embd": 128, "block_size": 128},
        precision="bf16",
        micro_batch_size=2,
        seq_len=None,
        activation_checkpointing=False,
    )
    first = tracer.trace(request)
    assert tracer.trace(dataclasses.replace(request)) == first and tracer.traces_run == 1  # the cache answered
    spec = GPTSpec(vocab_size=1024, n_layer=4, n_head=8, n_embd=128, block_size=128)
    local = trace_builtin(spec, precision="bf16", micro_batch_size=2)
    assert (first.activations_bytes, first.temporaries_bytes) == (
        local.memory.activations_bytes,
        local.memory.temporaries_bytes,
    )
    assert first.group_numels == spec.param_groups() and first.frozen_numel == 0
    tracer.trace(dataclasses.replace(request, micro_batch_size=3))
    assert tracer.traces_run == 2  # another digest


def test_a_trace_that_fails_or_overruns_in_its_ray_task_is_a_422(ray_cluster):
    bad = TraceRequest(
        model={"kind": "gpt", "vocab_size": 10, "n_layer": 1, "n_head": 3, "n_embd": 8, "block_size": 8},
        precision="fp32",
        micro_batch_size=1,
        seq_len=None,
        activation_checkpointing=False,
    )
    with pytest.raises(ServiceError, match=r"n_embd \(8\) must be divisible by n_head \(3\)") as failed:
        Tracer(timeout_s=TRACE_TIMEOUT_S).trace(bad)
    assert (failed.value.status_code, failed.value.error) == (422, "trace_failed")
    deep = dataclasses.replace(
        bad, model={"kind": "gpt", "vocab_size": 50304, "n_layer": 48, "n_head": 16, "n_embd": 2048, "block_size": 2048}
    )
    # a 48-layer trace runs two shallow traces of a 100M-parameter model: never within 1 ms
    with pytest.raises(ServiceError, match=r"more than ZERO1_PLAN_TIMEOUT_S = 0.001 s") as slow:
        Tracer(timeout_s=0.001).trace(deep)
    assert (slow.value.status_code, slow.value.error) == (422, "trace_timeout")

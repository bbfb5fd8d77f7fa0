"""service/planning/configurations.py and service/planning/step_costs.py on their own: the cost model
against hand arithmetic, and the search against a brute force over every (N, micro-batch,
checkpointing) through the memory model.

Packages: service.planning.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.planning import configurations, step_costs
from workers.memory import model as memory
from workers.memory.model import GB

ROOT = Path(__file__).resolve().parents[1]
COST = step_costs.CostModel(gpu_tflops=400, network_gb_per_s=100)
SMALL_GPT = memory.GPTSpec(vocab_size=512, n_layer=4, n_head=4, n_embd=128, block_size=256)


def workloads(spec, *, precision="bf16", seq_len=None, overhead_bytes=0):
    return lambda m, ckpt: memory.Workload.from_model(
        spec,
        precision=precision,
        micro_batch_size=m,
        seq_len=seq_len,
        activation_checkpointing=ckpt,
        overhead_bytes=overhead_bytes,
    )


# --------------------------------------------------------------------------- cost


def test_the_cost_of_a_step_is_the_hand_arithmetic():
    # Ψ = 7.5e9, G = 64 x 2048 tokens, N = 8, bf16: 6·Ψ·tokens = 5.89824e15 FLOPs, 1/8 each at 400 TFLOP/s
    common = {"num_params": 7_500_000_000, "num_tokens": 64 * 2048, "bytes_per_param": 2, "cost_model": COST}
    plain = step_costs.step_cost(num_gpus=8, activation_checkpointing=False, **common)
    assert plain.compute_s == pytest.approx(1.8432)  # 5.89824e15 / 8 / 4e14
    assert plain.comm_s == pytest.approx(0.2625)  # 2 x 7/8 x 7.5e9 x 2 bytes = 26.25e9 bytes at 1e11 B/s
    assert plain.cost_gpu_s == pytest.approx(8 * (1.8432 + 0.2625))  # 16.8456 GPU-s
    checkpointed = step_costs.step_cost(num_gpus=8, activation_checkpointing=True, **common)
    assert checkpointed.compute_s == pytest.approx(2.4576)  # the forward again: 8Ψ per token instead of 6Ψ
    assert checkpointed.comm_s == plain.comm_s
    assert checkpointed.cost_gpu_s == pytest.approx(21.7608)


def test_one_gpu_communicates_nothing_and_fp32_sends_twice_the_bytes():
    assert step_costs.comm_bytes_per_gpu(num_params=1000, num_gpus=1, bytes_per_param=2) == 0
    assert step_costs.comm_bytes_per_gpu(num_params=1000, num_gpus=4, bytes_per_param=4) == 6000  # 2 x 3/4 x 1000 x 4
    alone = step_costs.step_cost(
        num_params=10**9,
        num_tokens=10**6,
        num_gpus=1,
        activation_checkpointing=False,
        bytes_per_param=2,
        cost_model=COST,
    )
    assert alone.comm_s == 0 and alone.cost_gpu_s == pytest.approx(6e15 / 4e14)


def test_a_cost_model_needs_positive_throughput_and_bandwidth():
    with pytest.raises(ValueError, match=r"gpu_tflops \(0\) and network_gb_per_s \(100\) must be > 0"):
        step_costs.CostModel(gpu_tflops=0, network_gb_per_s=100)


# --------------------------------------------------------------------------- candidates


def test_divisors_against_brute_force():
    for n in range(1, 400):
        assert configurations.divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    assert len(configurations.divisors(100_000_000)) == 81  # 2^8 x 5^8: 9 x 9


def brute_force(workload_of, *, search: configurations.Search) -> dict[tuple[int, bool], int]:
    """(N, checkpointing) -> the largest micro-batch that fits, over every allowed candidate."""
    largest = {}
    for n in search.num_gpus_allowed():
        for ckpt in (False, True) if search.checkpointing_applies else (False,):
            fitting = [
                m
                for m in range(1, min(search.global_batch_size // n, search.max_micro_batch_size) + 1)
                if search.global_batch_size % (m * n) == 0
                and memory.total_bytes(workload_of(m, ckpt), num_gpus=n, stage=1) <= search.gpu_memory_bytes
            ]
            if fitting:
                largest[n, ckpt] = max(fitting)
    return largest


@settings(max_examples=60, deadline=None)
@given(
    global_batch_size=st.integers(1, 96),
    max_gpus=st.integers(1, 64),
    gpu_memory_mb=st.integers(1, 400),
    seq_len=st.sampled_from([16, 64, 256]),
    max_micro_batch_size=st.integers(1, 100),
)
def test_the_list_is_every_undominated_largest_micro_batch_sorted_by_cost(
    global_batch_size, max_gpus, gpu_memory_mb, seq_len, max_micro_batch_size
):
    workload_of = workloads(SMALL_GPT, seq_len=seq_len)
    search = configurations.Search(
        global_batch_size=global_batch_size,
        num_tokens=global_batch_size * seq_len,
        max_gpus=max_gpus,
        gpu_memory_bytes=gpu_memory_mb * 10**6,
        checkpointing_applies=True,
        max_micro_batch_size=max_micro_batch_size,
    )
    result = configurations.recommend(workload_of, search=search, cost_model=COST)
    largest = brute_force(workload_of, search=search)
    expected = {
        (n, ckpt): m
        for (n, ckpt), m in largest.items()
        if not ckpt or largest.get((n, False), 0) < m  # checkpointing for the same micro-batch is dominated
    }
    assert {(r.num_gpus, r.activation_checkpointing): r.micro_batch_size for r in result.items} == expected
    keys = [(r.cost_gpu_s, r.num_gpus, -r.micro_batch_size, r.activation_checkpointing) for r in result.items]
    assert keys == sorted(keys)
    for item in result.items:
        workload = workload_of(item.micro_batch_size, item.activation_checkpointing)
        assert item.total_bytes == memory.total_bytes(workload, num_gpus=item.num_gpus, stage=1)
        assert item.headroom_bytes == search.gpu_memory_bytes - item.total_bytes >= 0
        assert item.num_gpus * item.micro_batch_size * item.accumulation_steps == global_batch_size
    fewest = min((n for n, _ in largest), default=None)
    assert fewest == min((r.num_gpus for r in result.items), default=None)
    if not result.items:
        floors = {n: memory.total_bytes(workload_of(1, True), num_gpus=n, stage=1) for n in search.num_gpus_allowed()}
        assert result.least_bytes == min(floors.values()) > search.gpu_memory_bytes


@settings(max_examples=60, deadline=None)
@given(
    global_batch_size=st.integers(1, 96),
    max_gpus=st.integers(1, 64),
    gpu_memory_mb=st.integers(4, 40),  # around SMALL_GPT's 16Ψ = 14.3 MB: where the stages differ
    seq_len=st.sampled_from([16, 64, 256]),
    stages=st.sampled_from([(1, 2), (1, 2, 3)]),
)
def test_with_later_stages_the_list_is_every_configuration_nothing_cheaper_fits_as_well(
    global_batch_size, max_gpus, gpu_memory_mb, seq_len, stages
):
    """Brute force over (N, stage, checkpointing, micro-batch): the largest micro-batch of each that fits,
    its cost by hand (stage 2 reduces every micro-batch; stage 3 makes 3 passes a micro-batch), and kept
    unless another at its N fits at least as large a micro-batch for no more cost (a tie kept by the
    lower stage, then no checkpointing)."""
    workload_of = workloads(SMALL_GPT, seq_len=seq_len)
    search = configurations.Search(
        global_batch_size=global_batch_size,
        num_tokens=global_batch_size * seq_len,
        max_gpus=max_gpus,
        gpu_memory_bytes=gpu_memory_mb * 10**6,
        checkpointing_applies=True,
        max_micro_batch_size=10**6,
        stages=stages,
    )
    result = configurations.recommend(workload_of, search=search, cost_model=COST)
    psi = workload_of(1, False).num_params
    candidates = {}  # (n, stage, ckpt) -> (m, cost)
    for n in search.num_gpus_allowed():
        for stage in stages:
            for ckpt in (False, True):
                fitting = [
                    m
                    for m in range(1, global_batch_size // n + 1)
                    if global_batch_size % (m * n) == 0
                    and memory.total_bytes(workload_of(m, ckpt), num_gpus=n, stage=stage) <= search.gpu_memory_bytes
                ]
                if not fitting:
                    continue
                m = max(fitting)
                acc = global_batch_size // (m * n)
                passes = {1: 2, 2: acc + 1, 3: 3 * acc}[stage]
                compute = 6 * psi * search.num_tokens / n / 400e12 * (4 / 3 if ckpt else 1)
                comm = passes * (n - 1) / n * psi * 2 / 100e9
                candidates[n, stage, ckpt] = (m, n * (compute + comm))

    def dominated(key):
        m, cost = candidates[key]
        return any(
            other[0] == key[0]
            and om >= m
            and ocost <= cost * (1 + 1e-12)
            and (om > m or ocost < cost * (1 - 1e-12) or other[1:] < key[1:])
            for other, (om, ocost) in candidates.items()
            if other != key
        )

    expected = {key: m for key, (m, _) in candidates.items() if not dominated(key)}
    got = {(r.num_gpus, r.stage, r.activation_checkpointing): r.micro_batch_size for r in result.items}
    assert got == expected
    for item in result.items:
        assert item.cost_gpu_s == pytest.approx(candidates[item.num_gpus, item.stage, item.activation_checkpointing][1])
        workload = workload_of(item.micro_batch_size, item.activation_checkpointing)
        assert item.total_bytes == memory.total_bytes(workload, num_gpus=item.num_gpus, stage=item.stage)


def test_why_names_the_limit_with_numbers():
    # Ψ = 891,648: 16Ψ = 14.27 MB does not fit 12 MB on one GPU; on two, 4Ψ + 12Ψ/2 = 8.92 MB leaves room for
    # micro-batch 1 only with checkpointing (1.98 MB of activations; 4.91 MB without)
    workload_of = workloads(SMALL_GPT, seq_len=256)
    search = configurations.Search(
        global_batch_size=64,
        num_tokens=64 * 256,
        max_gpus=64,
        gpu_memory_bytes=12 * 10**6,
        checkpointing_applies=True,
        max_micro_batch_size=10**6,
    )
    result = configurations.recommend(workload_of, search=search, cost_model=COST)
    by_key = {(r.num_gpus, r.activation_checkpointing): r for r in result.items}
    assert min(n for n, _ in by_key) == 2 and (2, False) not in by_key
    on_one = memory.total_bytes(workload_of(1, True), num_gpus=1, stage=1)
    assert by_key[2, True].why.startswith(
        f"the fewest GPUs it fits on: 1 would need {on_one / 1e6:.2f} MB > 12.00 MB even at micro-batch 1 with "
        "checkpointing; it fits only with activation checkpointing (a third more compute); micro-batch "
    )
    capped = [r for r in result.items if r.micro_batch_size * r.num_gpus == 64]
    assert capped and all(f"capped by the global batch: 64 / ({r.num_gpus} GPUs) = " in r.why for r in capped)
    for item in (r for r in result.items if r.micro_batch_size * r.num_gpus < 64):
        above = 2 * item.micro_batch_size  # 64 / N is a power of two: the next micro-batch up doubles
        need = memory.total_bytes(workload_of(above, item.activation_checkpointing), num_gpus=item.num_gpus, stage=1)
        assert (
            f"micro-batch {item.micro_batch_size} is the largest that fits on {item.num_gpus} GPUs: "
            f"{above} would need {need / 1e6:.2f} MB > 12.00 MB" in item.why
        )


def test_a_micro_batch_above_the_jobs_bound_is_never_proposed():
    search = configurations.Search(
        global_batch_size=8,
        num_tokens=8 * 16,
        max_gpus=2,
        gpu_memory_bytes=80 * GB,
        checkpointing_applies=True,
        max_micro_batch_size=2,
    )
    result = configurations.recommend(workloads(SMALL_GPT, seq_len=16), search=search, cost_model=COST)
    assert [(r.num_gpus, r.micro_batch_size, r.accumulation_steps) for r in result.items] == [(1, 2, 4), (2, 2, 2)]
    assert result.items[0].why == "the fewest GPUs it fits on; micro-batch is capped at 2, the largest a job takes"


def test_an_mlp_is_never_checkpointed_and_its_tokens_are_samples():
    mlp = memory.MLPSpec(sizes=(784, 1024, 10))
    search = configurations.Search(
        global_batch_size=8,
        num_tokens=8,
        max_gpus=4,
        gpu_memory_bytes=80 * GB,
        checkpointing_applies=False,
        max_micro_batch_size=10**6,
    )
    result = configurations.recommend(workloads(mlp), search=search, cost_model=COST)
    assert [(r.num_gpus, r.micro_batch_size, r.activation_checkpointing) for r in result.items] == [
        (1, 8, False),
        (2, 4, False),
        (4, 2, False),
    ]
    assert result.items[0].compute_s == pytest.approx(6 * mlp.num_params * 8 / 4e14)


def test_a_huge_batch_on_a_million_gpus_builds_each_workload_once():
    """73,513,440 has 768 divisors: the search binary-searches each N's micro-batches and builds a workload per
    (micro-batch, checkpointing) at most once, not per candidate."""
    built = []
    workload_of = workloads(memory.GPTSpec(vocab_size=59072, n_layer=36, n_head=32, n_embd=4096, block_size=2048))
    counting = lambda m, ckpt: built.append((m, ckpt)) or workload_of(m, ckpt)
    search = configurations.Search(
        global_batch_size=73_513_440,
        num_tokens=73_513_440 * 2048,
        max_gpus=1 << 20,
        gpu_memory_bytes=80 * GB,
        checkpointing_applies=True,
        max_micro_batch_size=10**6,
    )
    result = configurations.recommend(counting, search=search, cost_model=COST)
    assert len(built) == len(set(built)) <= 2 * 768
    assert result.items and min(r.num_gpus for r in result.items) == 2


def test_the_room_imports_only_the_standard_library():
    child = r"""
import sys
class RefuseThirdParty:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] not in (*sys.stdlib_module_names, "workers", "service"):
            raise ImportError(f"service.planning.configurations imported third-party module {name!r}")
sys.meta_path.insert(0, RefuseThirdParty())
import service.planning.configurations
print("ok")
"""
    out = subprocess.run([sys.executable, "-S", "-c", child], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr

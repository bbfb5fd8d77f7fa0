"""Recommendations: the ZeRO configurations of a model that fit, cheapest first.

A configuration is a world size N, a micro-batch m, activation checkpointing on or off and a ZeRO
stage (of those searched: the ones zero1 trains at), for a fixed global batch G =
N·m·accumulation_steps. Whether it fits is the memory model's answer
(workers/memory/model.py: total_bytes of the workload /v1/plan builds); what it costs, in GPU-seconds
per optimizer step, is the step cost model's (service/planning/step_costs.py).

Standard library only, like the memory model it calls: the API, the CLI and tests load it alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from service.planning.step_costs import CostModel, StepCost, step_cost
from workers.memory import model as memory
from workers.memory.model import GB

WorkloadOf = Callable[[int, bool], memory.Workload]
"""(micro_batch_size, activation_checkpointing) -> the workload /v1/plan would plan."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Recommendation:
    num_gpus: int
    micro_batch_size: int
    accumulation_steps: int
    activation_checkpointing: bool
    stage: int
    total_bytes: int
    headroom_bytes: int
    compute_s: float
    comm_s: float
    cost_gpu_s: float
    why: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Recommendations:
    """What fits, cheapest first; and the least per-GPU bytes found, which says by how much when nothing does."""

    items: tuple[Recommendation, ...]
    least_bytes: int
    least_bytes_num_gpus: int
    """The N of least_bytes (at micro-batch 1, with checkpointing where it applies)."""


# --------------------------------------------------------------------------- candidates


def divisors(n: int) -> list[int]:
    """The divisors of n >= 1, ascending (trial division to √n: 10,000 steps for 1e8)."""
    small = []
    large = []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Fit:
    """The largest micro-batch that fits at one (N, checkpointing), and what the next one up would need."""

    micro_batch_size: int
    total_bytes: int
    next_micro_batch_size: int | None
    next_total_bytes: int | None


class _Planner:
    """Per-GPU bytes of (N, m, checkpointing) through the memory model, each workload built once."""

    def __init__(self, workload_of: WorkloadOf, *, gpu_memory_bytes: int):
        self.workload_of = workload_of
        self.gpu_memory_bytes = gpu_memory_bytes
        self._workloads: dict[tuple[int, bool], memory.Workload] = {}

    def workload(self, *, micro_batch_size: int, activation_checkpointing: bool) -> memory.Workload:
        key = (micro_batch_size, activation_checkpointing)
        if key not in self._workloads:
            self._workloads[key] = self.workload_of(micro_batch_size, activation_checkpointing)
        return self._workloads[key]

    def total_bytes(
        self, *, num_gpus: int, micro_batch_size: int, activation_checkpointing: bool, stage: int = 1
    ) -> int:
        workload = self.workload(micro_batch_size=micro_batch_size, activation_checkpointing=activation_checkpointing)
        return memory.total_bytes(workload, num_gpus=num_gpus, stage=stage)

    def largest_fit(
        self, *, num_gpus: int, micro_batch_sizes: list[int], activation_checkpointing: bool, stage: int = 1
    ) -> _Fit | None:
        """Binary search of the ascending sizes: activations, and so the total, grow with the micro-batch."""
        total = lambda m: self.total_bytes(
            num_gpus=num_gpus, micro_batch_size=m, activation_checkpointing=activation_checkpointing, stage=stage
        )
        # sizes[:low] fit, sizes[high:] do not
        low = 0
        high = len(micro_batch_sizes)
        while low < high:
            mid = (low + high) // 2
            if total(micro_batch_sizes[mid]) <= self.gpu_memory_bytes:
                low = mid + 1
            else:
                high = mid
        if low == 0:
            return None
        above = micro_batch_sizes[low] if low < len(micro_batch_sizes) else None
        return _Fit(
            micro_batch_size=micro_batch_sizes[low - 1],
            total_bytes=total(micro_batch_sizes[low - 1]),
            next_micro_batch_size=above,
            next_total_bytes=None if above is None else total(above),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class _Choice:
    num_gpus: int
    activation_checkpointing: bool
    stage: int
    fit: _Fit
    cost: StepCost
    without_checkpointing: _Fit | None
    """At the same N and stage, for a checkpointed choice: what fits without it (None: nothing)."""
    earlier_stage: _Fit | None
    """At the same N and checkpointing, for a choice past the first stage searched: the largest
    micro-batch an earlier stage fits (None: nothing)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Search:
    """What is fixed: the global batch (and its tokens), the GPUs on offer and their memory, the stages."""

    global_batch_size: int
    num_tokens: int
    """Tokens per optimizer step: global_batch_size x seq_len (an MLP's sample is one)."""
    max_gpus: int
    gpu_memory_bytes: int
    checkpointing_applies: bool
    """False for a model with no activation checkpointing (an MLP)."""
    max_micro_batch_size: int
    """The largest micro-batch a job takes."""
    stages: tuple[int, ...] = (1,)
    """The ZeRO stages searched, ascending: the ones a job trains at."""
    num_gpus: int | None = None
    """Only this N (an out-of-memory replan keeps its attempt's, service/planning/replans.py); None: each."""
    micro_batch_divides: int | None = None
    """Only the micro-batches that divide this one (a replan's: its accumulation then multiplies)."""
    checkpointing_only: bool = False
    """Only configurations with activation checkpointing (a replan never turns it off)."""

    def __post_init__(self) -> None:
        counts = {name: getattr(self, name) for name in ("global_batch_size", "num_tokens", "max_gpus")}
        counts["max_micro_batch_size"] = self.max_micro_batch_size
        if min(counts.values()) < 1 or self.gpu_memory_bytes < 0:
            given = ", ".join(f"{name} ({value})" for name, value in counts.items())
            raise ValueError(f"{given} must be >= 1 and gpu_memory_bytes ({self.gpu_memory_bytes}) >= 0")
        if not self.stages or list(self.stages) != sorted(set(self.stages)) or not set(self.stages) <= {1, 2, 3}:
            raise ValueError(f"stages must be ascending, from (1, 2, 3), got {self.stages}")
        if self.checkpointing_only and not self.checkpointing_applies:
            raise ValueError("checkpointing_only needs a model with activation checkpointing (checkpointing_applies)")

    def num_gpus_allowed(self) -> list[int]:
        """The world sizes that can run the global batch: N <= max_gpus that divide it (num_gpus alone, if set)."""
        return [n for n in divisors(self.global_batch_size) if n <= self.max_gpus and self.num_gpus in (None, n)]

    def micro_batch_sizes(self, *, num_gpus: int) -> list[int]:
        """The micro-batches N GPUs can run the global batch with (accumulating the rest), ascending."""
        per_gpu = self.global_batch_size // num_gpus
        divides = self.micro_batch_divides
        return [
            m for m in divisors(per_gpu) if m <= self.max_micro_batch_size and (divides is None or divides % m == 0)
        ]

    def checkpointing(self) -> tuple[bool, ...]:
        """Activation checkpointing off and on, as the model and checkpointing_only allow."""
        if self.checkpointing_only:
            return (True,)
        return (False, True) if self.checkpointing_applies else (False,)


def _choices(planner: _Planner, *, search: Search, cost_of: Callable[..., StepCost]) -> list[_Choice]:
    """For each N that divides G, each stage and each checkpointing: the largest micro-batch that fits,
    kept unless another at the same N fits as large a micro-batch for no more cost (a tie goes to the
    lower stage, then to no checkpointing: each costs what the cost model does not count)."""
    choices = []
    for num_gpus in search.num_gpus_allowed():
        sizes = search.micro_batch_sizes(num_gpus=num_gpus)
        found: list[_Choice] = []
        earlier: dict[bool, _Fit] = {}  # by checkpointing: the largest micro-batch of the stages before
        for stage in search.stages:
            fits: dict[bool, _Fit] = {}
            for checkpointing in search.checkpointing():
                fit = planner.largest_fit(
                    num_gpus=num_gpus, micro_batch_sizes=sizes, activation_checkpointing=checkpointing, stage=stage
                )
                if fit is None:
                    continue
                cost = cost_of(
                    num_gpus=num_gpus, micro_batch_size=fit.micro_batch_size, checkpointing=checkpointing, stage=stage
                )
                found.append(
                    _Choice(
                        num_gpus=num_gpus,
                        activation_checkpointing=checkpointing,
                        stage=stage,
                        fit=fit,
                        cost=cost,
                        without_checkpointing=fits.get(False) if checkpointing else None,
                        earlier_stage=earlier.get(checkpointing),
                    )
                )
                fits[checkpointing] = fit
            for checkpointing, fit in fits.items():
                if checkpointing not in earlier or fit.micro_batch_size > earlier[checkpointing].micro_batch_size:
                    earlier[checkpointing] = fit
        choices += [c for i, c in enumerate(found) if not any(_dominates(d, c, i < j) for j, d in enumerate(found))]
    return choices


def _dominates(other: _Choice, choice: _Choice, later: bool) -> bool:
    """`other` fits at least choice's micro-batch for no more cost, and is better at one of them or, tied
    at both, comes first in the order searched (`later`: other comes after choice)."""
    if other is choice:
        return False
    m, om = choice.fit.micro_batch_size, other.fit.micro_batch_size
    cost, ocost = choice.cost.cost_gpu_s, other.cost.cost_gpu_s
    if om < m or ocost > cost:
        return False
    return om > m or ocost < cost or not later


# --------------------------------------------------------------------------- the list


def recommend(workload_of: WorkloadOf, *, search: Search, cost_model: CostModel) -> Recommendations:
    """Every (N, stage, checkpointing)'s largest micro-batch that fits and that nothing cheaper at its N
    fits as well, cheapest first (then fewer GPUs, larger micro-batch, lower stage, no checkpointing);
    the fewest GPUs that fit are always among them."""
    planner = _Planner(workload_of, gpu_memory_bytes=search.gpu_memory_bytes)
    workload = planner.workload(micro_batch_size=1, activation_checkpointing=False)

    def cost_of(*, num_gpus: int, micro_batch_size: int, checkpointing: bool, stage: int) -> StepCost:
        return step_cost(
            num_params=workload.num_params,
            num_tokens=search.num_tokens,
            num_gpus=num_gpus,
            activation_checkpointing=checkpointing,
            bytes_per_param=memory.bytes_per_param(workload.precision)[0],
            cost_model=cost_model,
            stage=stage,
            accumulation_steps=search.global_batch_size // (micro_batch_size * num_gpus),
        )

    choices = _choices(planner, search=search, cost_of=cost_of)
    floor = {n: _floor_bytes(planner, num_gpus=n, search=search) for n in search.num_gpus_allowed()}
    least_num_gpus = min(floor, key=lambda n: (floor[n], n))
    fewest = min((choice.num_gpus for choice in choices), default=None)
    items = [_recommendation(choice, search=search, fewest=fewest, floor=floor) for choice in choices]
    items.sort(key=lambda r: (r.cost_gpu_s, r.num_gpus, -r.micro_batch_size, r.stage, r.activation_checkpointing))
    return Recommendations(items=tuple(items), least_bytes=floor[least_num_gpus], least_bytes_num_gpus=least_num_gpus)


def _floor_bytes(planner: _Planner, *, num_gpus: int, search: Search) -> int:
    """The least a GPU can hold at N: micro-batch 1, the last stage searched, with checkpointing where it applies."""
    return planner.total_bytes(
        num_gpus=num_gpus,
        micro_batch_size=1,
        activation_checkpointing=search.checkpointing_applies,
        stage=search.stages[-1],
    )


def _recommendation(choice: _Choice, *, search: Search, fewest: int | None, floor: dict) -> Recommendation:
    n = choice.num_gpus
    m = choice.fit.micro_batch_size
    return Recommendation(
        num_gpus=n,
        micro_batch_size=m,
        accumulation_steps=search.global_batch_size // (m * n),
        activation_checkpointing=choice.activation_checkpointing,
        stage=choice.stage,
        total_bytes=choice.fit.total_bytes,
        headroom_bytes=search.gpu_memory_bytes - choice.fit.total_bytes,
        compute_s=choice.cost.compute_s,
        comm_s=choice.cost.comm_s,
        cost_gpu_s=choice.cost.cost_gpu_s,
        why=_why(choice, search=search, fewest=fewest, floor=floor),
    )


def _why(choice: _Choice, *, search: Search, fewest: int | None, floor: dict[int, int]) -> str:
    """One sentence of what limits a choice, with the numbers."""
    memory_size = _size(search.gpu_memory_bytes)
    n = choice.num_gpus
    fit = choice.fit
    clauses = []
    if n == fewest:
        fewer = [k for k in floor if k < n]
        least = f"micro-batch 1{' with checkpointing' if search.checkpointing_applies else ''}"
        if len(search.stages) > 1:
            least += f" at stage {search.stages[-1]}"
        clauses.append(
            f"the fewest GPUs it fits on: {fewer[-1]} would need {_size(floor[fewer[-1]])} > {memory_size} even at "
            + least
            if fewer
            else "the fewest GPUs it fits on"
        )
    if choice.stage > search.stages[0]:
        earlier = choice.earlier_stage
        setting = " with checkpointing" if choice.activation_checkpointing else ""
        stages = " or ".join(str(s) for s in search.stages if s < choice.stage)
        what = {
            2: "gradients sharded too; a reduce every micro-batch",
            3: "parameters sharded too; 3 passes a micro-batch",
        }
        clauses.append(
            f"ZeRO stage {choice.stage} ({what[choice.stage]}) "
            + (
                f"is the first stage it fits at{setting}"
                if earlier is None
                else f"fits micro-batch {fit.micro_batch_size}{setting} where {earlier.micro_batch_size} is the "
                f"largest at stage {stages}"
            )
        )
    if choice.activation_checkpointing:
        without = choice.without_checkpointing
        clauses.append(
            "it fits only with activation checkpointing (a third more compute)"
            if without is None
            else f"activation checkpointing (a third more compute) fits micro-batch {fit.micro_batch_size} "
            f"where {without.micro_batch_size} is the largest without"
        )
    batch = search.global_batch_size
    if fit.next_micro_batch_size is None and fit.micro_batch_size * n == batch:
        clauses.append(f"micro-batch is capped by the global batch: {batch} / ({_gpus(n)}) = {fit.micro_batch_size}")
    elif fit.next_micro_batch_size is None:
        clauses.append(f"micro-batch is capped at {search.max_micro_batch_size:,}, the largest a job takes")
    else:
        clauses.append(
            f"micro-batch {fit.micro_batch_size} is the largest that fits on {_gpus(n)}: "
            f"{fit.next_micro_batch_size} would need {_size(fit.next_total_bytes)} > {memory_size}"
        )
    return "; ".join(clauses)


def _gpus(num_gpus: int) -> str:
    return f"{num_gpus} GPU" if num_gpus == 1 else f"{num_gpus} GPUs"


def _size(num_bytes: int) -> str:
    """Decimal units, two decimals, as the planner counts (GB = 1e9 bytes): '91.20 GB', '13.80 MB'."""
    for scale, unit in ((10**12, "TB"), (GB, "GB"), (10**6, "MB"), (10**3, "kB")):
        if num_bytes >= scale:
            return f"{num_bytes / scale:,.2f} {unit}"
    return f"{num_bytes} B"

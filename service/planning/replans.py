"""After an attempt ran out of memory: its job's next configuration that keeps the global batch, in the
recommender's order (service/planning/configurations.py), and the words of the change.

The plan the job was admitted by said the configuration that failed fits; the GPU said otherwise, so
the plan's bytes for it become the bound the next one must stay under. The recommender searches, at the
attempt's N and the job's global batch, what gives up nothing already traded: a micro-batch that
divides the failed one (its accumulation multiplies), activation checkpointing kept on where it was on
(and tried where the model has it), a ZeRO stage from the failed one on where zero_stage is auto (that
stage alone where it is not). Its first, the cheapest by the step cost model, is the next. Each replan
lowers the planned bytes, so a job is replanned a bounded number of times; with nothing smaller left,
its failure is the failure policy's, as any other.

Standard library only, like configurations: tested without fixtures.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.planning.configurations import Recommendation, Search, WorkloadOf, recommend
from service.planning.step_costs import CostModel
from workers.memory import model as memory


@dataclass(frozen=True, slots=True, kw_only=True)
class Configuration:
    """What a replan may change: the micro-batch, activation checkpointing and the ZeRO stage."""

    micro_batch_size: int
    activation_checkpointing: bool
    stage: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Kept:
    """What a replan keeps: the attempt's N, the global batch (and its tokens), the stages the job may
    train at (zero_stage's, or 1-3 for auto), and whether its model has activation checkpointing."""

    num_gpus: int
    global_batch_size: int
    num_tokens: int
    stages: tuple[int, ...]
    checkpointing_applies: bool

    def accumulation_steps(self, micro_batch_size: int) -> int:
        return self.global_batch_size // (micro_batch_size * self.num_gpus)


def next_configuration(
    workload_of: WorkloadOf, *, failed: Configuration, kept: Kept, cost_model: CostModel
) -> Recommendation | None:
    """The recommender's first configuration below the failed one's planned bytes, within what it keeps
    and gives up nothing of (the module's docstring); None when there is none."""
    workload = workload_of(failed.micro_batch_size, failed.activation_checkpointing)
    failed_bytes = memory.total_bytes(workload, num_gpus=kept.num_gpus, stage=failed.stage)
    search = Search(
        global_batch_size=kept.global_batch_size,
        num_tokens=kept.num_tokens,
        max_gpus=kept.num_gpus,
        gpu_memory_bytes=failed_bytes - 1,
        checkpointing_applies=kept.checkpointing_applies,
        max_micro_batch_size=failed.micro_batch_size,
        stages=tuple(s for s in kept.stages if s >= failed.stage) or (failed.stage,),
        num_gpus=kept.num_gpus,
        micro_batch_divides=failed.micro_batch_size,
        checkpointing_only=failed.activation_checkpointing,
    )
    items = recommend(workload_of, search=search, cost_model=cost_model).items
    return items[0] if items else None


def configuration_of(recommendation: Recommendation) -> Configuration:
    return Configuration(
        micro_batch_size=recommendation.micro_batch_size,
        activation_checkpointing=recommendation.activation_checkpointing,
        stage=recommendation.stage,
    )


def replan_words(failed: Configuration, chosen: Configuration, *, kept: Kept, where: str) -> str:
    """The event's words: `out of memory at micro_batch_size 4 on rank 0: retrying at micro_batch_size 2
    with 2x accumulation (global batch 8 unchanged)`; `where` says on which rank, and why."""
    old_extras, new_extras = [], []
    if chosen.micro_batch_size != failed.micro_batch_size:
        new_extras.append(f"{kept.accumulation_steps(chosen.micro_batch_size)}x accumulation")
    if chosen.activation_checkpointing != failed.activation_checkpointing:
        old_extras.append("without activation checkpointing")
        new_extras.append("activation checkpointing")
    old = f"micro_batch_size {failed.micro_batch_size}" + "".join(f" {extra}" for extra in old_extras)
    new = f"micro_batch_size {chosen.micro_batch_size}" + (f" with {' and '.join(new_extras)}" if new_extras else "")
    if chosen.stage != failed.stage:
        old += f" at ZeRO stage {failed.stage}"
        new += f" at ZeRO stage {chosen.stage}"
    batch = f"global batch {kept.global_batch_size} unchanged"
    return f"out of memory at {old}{where}: retrying at {new} ({batch})"


def none_left_words(failed: Configuration, *, kept: Kept) -> str:
    """Why no replan: `no configuration that plans fewer bytes than micro_batch_size 1 at ZeRO stage 3
    keeps global batch 8 on 2 GPUs`."""
    at = f"micro_batch_size {failed.micro_batch_size}"
    if failed.activation_checkpointing:
        at += " with activation checkpointing"
    if len(kept.stages) > 1:
        at += f" at ZeRO stage {failed.stage}"
    gpus = f"{kept.num_gpus} GPU" + ("" if kept.num_gpus == 1 else "s")
    return f"no configuration that plans fewer bytes than {at} keeps global batch {kept.global_batch_size} on {gpus}"

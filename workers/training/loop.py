"""One rank's training loop, as plain functions: Ray actors call them, and so do tests.

A step: every micro-batch of this rank's slice of the global batch runs
forward and backward (gradients accumulate in the optimizer's flat buffer),
then ZeRO1AdamW reduces, updates its shard and gathers. Each step yields one
metrics row per rank; every `checkpoint_every` steps each rank checkpoints its
shard (which steps, and a stop's checkpoint: workers/training/checkpointer.py; the files:
workers/training/writer.py, a host copy, then the files in the background), and the row
carries the seconds that held the step up.
Every `eval_every` steps (and at the last) the row carries the held-out loss;
a run that completes its steps writes the final model (workers/training/artifacts.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from workers import phases
from workers.config import HFSpec, PythonSpec, TrainConfig, data_step
from workers.data.sources import Batches
from workers.health import DivergenceWatch
from workers.memory import model as memory
from workers.models.builtin import DTYPES, build_model
from workers.models.trace import loss_of, measure_step
from workers.records import Divergence, DivergenceError, DivergenceKind, MetricRow, NonFiniteError, TrainResult
from workers.training.artifacts import write_final
from workers.training.checkpointer import Checkpointer, first_step
from workers.training.checkpoints import final_dir
from workers.training.init_weights import load_initial_weights
from workers.training.reader import resume
from workers.training.schedule import lr_at
from workers.training.writer import CheckpointIO, save_checkpoint, shared_directory
from workers.zero.optimizer import ZeRO1AdamW, decay_param_groups
from workers.zero.stage2 import ZeRO2AdamW
from workers.zero.stage3 import ZeRO3AdamW, shard_model

# the names other modules and tests import from here, wherever they live now
__all__ = ["NonFiniteError", "resume", "save_checkpoint", "train"]

log = logging.getLogger("zero1.train")


def default_device() -> torch.device:
    """CUDA when this process sees a GPU (Ray sets CUDA_VISIBLE_DEVICES), else CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def planned_bytes(config: TrainConfig, *, world_size: int) -> int:
    """The planner's per-GPU bytes for this job: model states, activations and temporaries (no fixed overhead);
    the plan it was admitted by when the service traced it (an hf model)."""
    if config.planned_bytes is not None:
        return config.planned_bytes
    workload = memory.Workload.from_model(
        config.model,
        precision=config.precision,
        micro_batch_size=config.micro_batch_size,
        seq_len=config.seq_len,
        activation_checkpointing=config.activation_checkpointing,
        bucket_cap_mb=config.optimizer.bucket_cap_mb,
    )
    return memory.breakdown(workload, num_gpus=world_size, stage=config.zero_stage).total_bytes


def train(
    config: TrainConfig,
    *,
    rank: int = 0,
    world_size: int = 1,
    process_group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    on_metrics: Callable[[MetricRow], None] = lambda row: None,
    should_stop: Callable[[], bool] = lambda: False,
    stop_at: Callable[[int, bool], bool] = lambda step, checkpointed: False,
    io: CheckpointIO | None = None,
) -> TrainResult:
    """Train `config` as `rank` of `world_size`, resuming from the latest complete checkpoint.

    After each step but the last and a skipped one, rank 0's stop_at(step, checkpointed) decides for every
    rank whether to stop there (TrainResult.stopped) with a checkpoint of that step: just written at it
    (checkpointed), or written now. An elastic job's resize, a preempted job's stop. `io` reaches the
    checkpoints (None: config.checkpoint_dir, a directory every rank shares). A stop and the end wait
    for the checkpoint being written."""
    context = _step_context(
        config, rank=rank, world_size=world_size, process_group=process_group, device=device or default_device()
    )
    if config.checkpoint_dir and io is None:
        io = shared_directory(Path(config.checkpoint_dir))
    first = first_step(config, opt=context.opt, io=io)
    if first == 0 and config.init_from is not None:  # a resumed run's weights are its checkpoint's
        load_initial_weights(context.model, context.opt, config.init_from)
        log.info("rank %d: starting from job %d's final weights", rank, config.init_from.job)
    _log_start(context, first=first, steps=config.steps)
    checkpointer = Checkpointer.for_run(config, opt=context.opt, io=io, decide_stop=_stop_decision(stop_at, context))
    last = first - 1
    skipped = 0  # steps skipped in a row (nan/inf norm); a resumed run counts from 0 again
    watch = DivergenceWatch(config.health, max_nonfinite_steps=config.max_nonfinite_steps)
    with checkpointer:  # leaving it waits for the write in flight
        for step in range(first, config.steps):
            phases.begin_step(step)
            if should_stop():
                checkpointer.abandon()  # the write in flight still finishes; its error is logged, not raised
                return TrainResult(rank=rank, first_step=first, last_step=last, cancelled=True)
            row = _train_step(config, context, step=step)
            last = step
            skipped = skipped + 1 if row.skipped else 0
            _check_divergence(watch.check(row, skipped_in_a_row=skipped), row, config, on_metrics)
            row = checkpointer.maybe_save(row, skipped_in_a_row=skipped)  # after the test: none at a spike
            on_metrics(row)  # after the checkpoint: the row carries the seconds it held the step up
            if rank == 0:
                log.info("%s", _step_line(row, steps=config.steps))
            _check_skipped(skipped, row, limit=config.max_nonfinite_steps)
            if checkpointer.maybe_stop(row):
                return TrainResult(rank=rank, first_step=first, last_step=last, cancelled=False, stopped=True)
    if config.checkpoint_dir:  # every step is done (a resume past the last one too): the model goes out
        phases.enter("final")
        write_final(
            context.model,
            context.opt,
            config=config,
            directory=final_dir(Path(config.checkpoint_dir)),
            rank=rank,
            world_size=world_size,
            process_group=process_group,
        )
    return TrainResult(rank=rank, first_step=first, last_step=last, cancelled=False)


def _step_context(
    config: TrainConfig,
    *,
    rank: int,
    world_size: int,
    process_group: dist.ProcessGroup | None,
    device: torch.device,
) -> _StepContext:
    """This rank's data, the model (from its seed) and its optimizer (ZeRO1AdamW; ZeRO2AdamW at stage 2;
    at stage 3 the model sharded by FSDP2 and ZeRO3AdamW), before any resume."""
    batches = Batches(
        model=config.model,
        data=config.data,
        seed=config.seed,
        seq_len=config.seq_len,
        global_batch_size=config.global_batch(world_size),
        micro_batch_size=config.micro_batch_size,
        rank=rank,
        world_size=world_size,
    )
    hyper = config.optimizer
    common = {"lr": hyper.lr, "betas": hyper.betas, "eps": hyper.eps, "process_group": process_group}
    if config.zero_stage == 3:  # an fp32 master copy, sharded; each unit gathered in the job's precision
        model = shard_model(
            _build(config, device=device, dtype=torch.float32),
            compute_dtype=DTYPES[config.precision],
            process_group=process_group,
        )
        opt = ZeRO3AdamW(
            decay_param_groups(model, weight_decay=hyper.weight_decay),
            **common,
            compute_dtype=DTYPES[config.precision],
            max_grad_norm=hyper.max_grad_norm,
        )
    else:
        model = _build(config, device=device)
        optimizer_class = ZeRO2AdamW if config.zero_stage == 2 else ZeRO1AdamW
        opt = optimizer_class(
            decay_param_groups(model, weight_decay=hyper.weight_decay),
            **common,
            max_grad_norm=hyper.max_grad_norm,
            overlap_comm=hyper.overlap_comm,
            bucket_cap_mb=hyper.bucket_cap_mb,
        )
    return _StepContext(
        model=model,
        opt=opt,
        batches=batches,
        device=device,
        rank=rank,
        world_size=world_size,
        process_group=process_group,
        planned_bytes=planned_bytes(config, world_size=world_size),
        tokens_per_step=config.global_batch(world_size) * batches.seq_len,
    )


def _train_step(config: TrainConfig, context: _StepContext, *, step: int) -> MetricRow:
    """One step at its scheduled learning rate (scaled by its rollbacks' lr_scale) on the batch its data
    skips give it, and its held-out loss when it evaluates."""
    hyper = config.optimizer
    lr = lr_at(step, lr=hyper.lr, steps=config.steps, schedule=hyper.schedule) * config.lr_scale
    for group in context.opt.param_groups:  # a function of the step alone: a resumed run's is the same
        group["lr"] = lr
    row = replace(context.run_step(step, data_step=data_step(step, config.data_skips)), lr=lr)
    if _evaluates(config, step):
        row = replace(row, eval_loss=context.evaluate(num_batches=config.eval_batches))
    return row


def _stop_decision(stop_at: Callable[[int, bool], bool], context: _StepContext) -> Callable[[int, bool], bool]:
    """decide(step, checkpointed): rank 0 asks stop_at, and every rank gets its answer (a broadcast)."""
    return lambda step, checkpointed: _agree(stop_at(step, checkpointed) if context.rank == 0 else False, context)


def _log_start(context: _StepContext, *, first: int, steps: int) -> None:
    num_params = sum(p.numel() for p in context.model.parameters())
    log.info(
        "rank %d of %d on %s: %s parameters, %s",
        context.rank,
        context.world_size,
        context.device,
        f"{num_params:,}",
        f"steps {first} to {steps - 1}",
    )


def _step_line(row: MetricRow, *, steps: int) -> str:
    """Rank 0's log line of a step."""
    loss = "-" if row.loss is None else f"{row.loss:.4f}"
    evaluated = "" if row.eval_loss is None else f"  eval {row.eval_loss:.4f}"
    skipped = "  skipped (non-finite gradients)" if row.skipped else ""
    blocked = "" if row.checkpoint_blocked_s is None else f"  checkpoint {row.checkpoint_blocked_s * 1000:.1f} ms"
    return (
        f"step {row.step}/{steps - 1}  loss {loss}{evaluated}  {row.step_time_s * 1000:.1f} ms  "
        f"{row.tokens_per_s:,.0f} tokens/s{skipped}{blocked}"
    )


def _agree(decision: bool, context: _StepContext) -> bool:
    """Rank 0's decision, on every rank (one broadcast)."""
    phases.enter("broadcast")
    if context.world_size == 1:
        return decision
    flag = torch.tensor([int(decision)], device=context.device)
    dist.broadcast(flag, group_src=0, group=context.process_group)
    return bool(flag.item())


def _evaluates(config: TrainConfig, step: int) -> bool:
    """Whether `step` evaluates: every eval_every steps, and the last one (when eval_every > 0)."""
    return config.eval_every > 0 and ((step + 1) % config.eval_every == 0 or step + 1 == config.steps)


def _build(config: TrainConfig, *, device: torch.device, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The job's model, initialised from its seed (the same on every rank) or loaded (an hf path), in
    the job's precision or `dtype`."""
    build = build_model
    if isinstance(config.model, HFSpec):
        from workers.models.hf import build_hf as build  # transformers loads in a second or two: only when needed
    elif isinstance(config.model, PythonSpec):
        from workers.models.usercode import build_python as build
    return build(
        config.model,
        dtype=DTYPES[config.precision] if dtype is None else dtype,
        device=device,
        activation_checkpointing=config.activation_checkpointing,
        seed=config.seed,
    )


def _check_divergence(
    divergence: Divergence | None, row: MetricRow, config: TrainConfig, on_metrics: Callable[[MetricRow], None]
) -> None:
    """End the attempt with a DivergenceError (its row reported first) where the job may roll back;
    else a spike is only logged, and a non-finite run fails as _check_skipped says."""
    if divergence is None:
        return
    if config.health.max_rollbacks:
        on_metrics(row)
        raise DivergenceError(divergence)
    if divergence.kind == DivergenceKind.SPIKE:
        log.warning("%s (health.max_rollbacks is 0: training goes on)", divergence.describe())


def _check_skipped(skipped: int, row: MetricRow, *, limit: int) -> None:
    """NonFiniteError once `skipped` steps in a row (this one included) reach `limit`. Every rank skips
    the same steps (the norm is all-reduced), so every rank raises at the same step."""
    if skipped >= limit:
        step = row.step
        raise NonFiniteError(
            f"{skipped} steps in a row had a non-finite gradient norm (max_nonfinite_steps = {limit}) at step "
            f"{step}: steps {step - skipped + 1}-{step} were skipped (grad_norm {row.grad_norm}, loss "
            f"{row.loss}, loss_scale {row.loss_scale}); lower the learning rate or check the data"
        )


@dataclass(kw_only=True, slots=True)
class _StepContext:
    model: torch.nn.Module
    opt: ZeRO1AdamW | ZeRO3AdamW
    batches: Batches
    device: torch.device
    rank: int
    world_size: int
    process_group: dist.ProcessGroup | None
    planned_bytes: int
    tokens_per_step: int
    cpu_peak_bytes: int | None = None
    """On CPU, the attempt's first step's peak (model states and the step's bytes beyond them), counted
    op by op (a Python dispatch mode, which slows a small model's step severalfold): every later step
    has the same shapes and allocates the same bytes, so it reports this count. CUDA's allocator
    measures every step at no cost."""

    def micro_step(
        self, inputs: torch.Tensor, targets: torch.Tensor, *, accumulation: int, count: bool
    ) -> tuple[torch.Tensor, int]:
        """Forward and backward of one micro-batch: its loss, and when `count`, the bytes it held beyond
        the model states at its peak, counted as the plan counts them (workers/models/trace.py)."""

        def forward() -> torch.Tensor:
            phases.enter("forward")
            return loss_of(self.model(inputs, targets)) / accumulation

        def backward(loss: torch.Tensor) -> None:
            phases.enter("backward")
            self.opt.scale_loss(loss).backward()

        if not count:
            loss = forward()
            backward(loss)
            return loss, 0
        loss, used = measure_step(self.model, (inputs, targets), forward, backward)
        return loss, used.peak_bytes

    @torch.no_grad()
    def evaluate(self, *, num_batches: int) -> float:
        """Mean loss of this rank's first `num_batches` held-out micro-batches, in eval mode, averaged
        over the ranks (each rank's mean has the same weight: every rank evaluates as many)."""
        phases.enter("eval")
        was_training = self.model.training
        self.model.eval()
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        try:
            for index in range(num_batches):
                inputs, targets = (t.to(self.device) for t in self.batches.held_out_micro_batch(index))
                total += loss_of(self.model(inputs, targets)).float()
        finally:
            self.model.train(was_training)
        total /= num_batches
        if self.world_size > 1:
            dist.all_reduce(total, group=self.process_group)
            total /= self.world_size
        return total.item()

    def run_step(self, step: int, *, data_step: int | None = None) -> MetricRow:
        """Step `step` on the batch of `data_step` (default: its own)."""
        start = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        accumulation = self.batches.accumulation_steps
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        step_peak = 0
        count = self.device.type != "cuda" and self.cpu_peak_bytes is None
        for micro in range(accumulation):
            batch = self.batches.micro_batch(step if data_step is None else data_step, micro)
            inputs, targets = (t.to(self.device) for t in batch)
            # every micro-batch but the last accumulates locally; the last one's backward sends
            with self.opt.no_sync() if micro < accumulation - 1 else contextlib.nullcontext():
                loss, used = self.micro_step(inputs, targets, accumulation=accumulation, count=count)
            loss_sum += loss.detach()
            step_peak = max(step_peak, used)
        # the global batch's loss, the mean over ranks of each rank's mean: summed by the step's all-reduce
        self.opt.step(also_sum=loss_sum)
        # what the rank keeps across the step's micro-batches, gradients included: at stage 3 they are
        # made by the first micro-batch's backward and held through the others, then freed here
        kept = self.opt.model_state_bytes() if count else 0
        self.opt.zero_grad()
        loss_value = (loss_sum / self.world_size).item()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            mem_peak = torch.cuda.max_memory_allocated(self.device)
        else:
            if count:
                self.cpu_peak_bytes = kept + step_peak
            mem_peak = self.cpu_peak_bytes
        step_time_s = time.perf_counter() - start
        return MetricRow(
            step=step,
            rank=self.rank,
            loss=loss_value,
            grad_norm=self.opt.grad_norm,
            loss_scale=self.opt.loss_scale,
            skipped=self.opt.skipped,
            step_time_s=step_time_s,
            tokens_per_s=self.tokens_per_step / step_time_s,
            mem_peak_bytes=(mem_peak,),
            mem_planned_bytes=self.planned_bytes,
            world_size=self.world_size,
        )

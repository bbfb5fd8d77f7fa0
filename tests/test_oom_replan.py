"""Out of memory, planned again: an attempt that ran out of memory (torch's OutOfMemoryError, or a child
the kernel's OOM killer ended) is relaunched, no retry spent, at the recommender's next configuration
that keeps the global batch (a micro-batch that divides the failed one with more accumulation, activation
checkpointing, a later ZeRO stage where zero_stage is auto), its spec, plan and event saying so; with
nothing smaller left it fails as any failure does, the out-of-memory named.

The choice and the policy are pure functions, tested without fixtures; the scheduler carries them out
on stand-ins for Ray (tests/fakes.py) and, at the end, on real ranks: a python model that runs out of
memory on more than 2 samples a micro-batch, submitted at 4, succeeds at 2 with twice the accumulation,
and its loss curve is that of a job submitted at 2.

Packages: service.planning, service.intake, service.scheduling, workers.records, workers.runtime.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator

import pytest
import torch
from fakes import FakeClock, tick
from fastapi.testclient import TestClient

from service.planning import replans, step_costs
from service.scheduling.failure import AttemptFailure, FailureAction, FailurePolicy, Replan
from service.schemas.requests import JobSpec
from workers.memory import model as memory
from workers.records import OOM_KILLED, RankError
from workers.runtime.sandbox import exit_reason, oom_kills

from conftest import make_settings, serve_on_fakes
from helpers import TERMINAL, TINY, job_body, wait_job

COST = step_costs.CostModel(gpu_tflops=400, network_gb_per_s=100)
GPT = memory.GPTSpec(vocab_size=512, n_layer=4, n_head=4, n_embd=128, block_size=256)
MLP = memory.MLPSpec(sizes=(64, 256, 10))
OOM = RankError(
    exception="OutOfMemoryError", message="CUDA out of memory. Tried to allocate 2.00 GiB", rank=0, node_id="n1"
)


def workloads(spec):
    return lambda m, ckpt: memory.Workload.from_model(
        spec, precision="bf16", micro_batch_size=m, activation_checkpointing=ckpt
    )


def config(m: int, ckpt: bool = False, stage: int = 1) -> replans.Configuration:
    return replans.Configuration(micro_batch_size=m, activation_checkpointing=ckpt, stage=stage)


def kept(*, num_gpus=2, global_batch_size=8, stages=(1,), checkpointing=True) -> replans.Kept:
    return replans.Kept(
        num_gpus=num_gpus,
        global_batch_size=global_batch_size,
        num_tokens=global_batch_size * 256,
        stages=stages,
        checkpointing_applies=checkpointing,
    )


def chain(spec, start: replans.Configuration, fixed: replans.Kept) -> list[tuple[int, bool, int, int]]:
    """Each next configuration after `start` ran out of memory, until none is left: (m, ckpt, stage, accumulation)."""
    found = []
    failed = start
    while (
        chosen := replans.next_configuration(workloads(spec), failed=failed, kept=fixed, cost_model=COST)
    ) is not None:
        assert chosen.num_gpus == fixed.num_gpus
        assert chosen.micro_batch_size * chosen.accumulation_steps * chosen.num_gpus == fixed.global_batch_size
        failed = replans.configuration_of(chosen)
        found.append(
            (chosen.micro_batch_size, chosen.activation_checkpointing, chosen.stage, chosen.accumulation_steps)
        )
    return found


# --------------------------------------------------------------------------- the choice


def test_the_next_configuration_halves_the_micro_batch_and_doubles_the_accumulation_keeping_the_global_batch():
    chosen = replans.next_configuration(workloads(GPT), failed=config(4), kept=kept(), cost_model=COST)
    assert (chosen.num_gpus, chosen.micro_batch_size, chosen.accumulation_steps) == (2, 2, 2)
    assert (chosen.activation_checkpointing, chosen.stage) == (False, 1)
    failed_bytes = memory.total_bytes(workloads(GPT)(4, False), num_gpus=2, stage=1)
    assert chosen.total_bytes < failed_bytes  # below the bytes the GPU refused, as the plan counts them
    words = replans.replan_words(config(4), replans.configuration_of(chosen), kept=kept(), where=" on rank 0")
    assert words == (
        "out of memory at micro_batch_size 4 on rank 0: retrying at micro_batch_size 2 with 2x accumulation "
        "(global batch 8 unchanged)"
    )


def test_each_replan_plans_fewer_bytes_until_none_is_left_checkpointing_once_the_micro_batch_is_one():
    # the recommender's order at stage 1: a smaller micro-batch costs nothing more, checkpointing a third
    # more compute, so the micro-batch halves first; checkpointing, once on, stays on
    assert chain(GPT, config(4), kept()) == [(2, False, 1, 2), (1, False, 1, 4), (1, True, 1, 4)]
    assert replans.next_configuration(workloads(GPT), failed=config(1, True), kept=kept(), cost_model=COST) is None
    assert replans.none_left_words(config(1, True), kept=kept()) == (
        "no configuration that plans fewer bytes than micro_batch_size 1 with activation checkpointing keeps "
        "global batch 8 on 2 GPUs"
    )


def test_zero_stage_auto_goes_on_to_a_later_stage_and_never_back():
    # stage 2 at micro-batch 4 costs what stage 1 at 2 does (one reduce a micro-batch, one of them) and
    # keeps the larger micro-batch: the recommender's tie goes to it
    found = chain(GPT, config(4), kept(stages=(1, 2, 3)))
    assert found[0] == (4, False, 2, 1)
    assert [stage for _, _, stage, _ in found] == sorted(stage for _, _, stage, _ in found)
    assert found[-1] == (1, True, 3, 4)
    bytes_of = [memory.total_bytes(workloads(GPT)(m, c), num_gpus=2, stage=s) for m, c, s, _ in found]
    assert bytes_of == sorted(bytes_of, reverse=True) and len(set(bytes_of)) == len(bytes_of)
    words = replans.replan_words(config(4), config(4, stage=2), kept=kept(stages=(1, 2, 3)), where="")
    assert words == (
        "out of memory at micro_batch_size 4 at ZeRO stage 1: retrying at micro_batch_size 4 at ZeRO stage 2 "
        "(global batch 8 unchanged)"
    )


def test_the_micro_batch_that_replaces_one_divides_it_so_every_n_the_job_ran_at_still_divides_its_batch():
    # 24 samples on 2 GPUs: 12 each, micro-batch 4 x 3. 3 divides 12 but not 4; 2 divides both
    fixed = kept(global_batch_size=24, checkpointing=False)
    assert chain(MLP, config(4), fixed) == [(2, False, 1, 6), (1, False, 1, 12)]


def test_a_model_without_checkpointing_at_micro_batch_one_and_a_fixed_stage_has_nothing_smaller():
    fixed = kept(checkpointing=False, stages=(2,))
    assert replans.next_configuration(workloads(MLP), failed=config(1, stage=2), kept=fixed, cost_model=COST) is None
    assert replans.none_left_words(config(1, stage=2), kept=fixed) == (
        "no configuration that plans fewer bytes than micro_batch_size 1 keeps global batch 8 on 2 GPUs"
    )


# --------------------------------------------------------------------------- what is out of memory


@pytest.mark.parametrize(
    ("exception", "message", "oom"),
    [
        ("OutOfMemoryError", "CUDA out of memory. Tried to allocate 20.00 MiB", True),  # torch (and torch.cuda)
        ("OutOfMemoryError", "Task was killed due to the node running low on memory", True),  # Ray's memory monitor
        ("MemoryError", "", True),
        ("RuntimeError", "CUDA out of memory. Tried to allocate 8.00 GiB", True),  # an older torch's
        ("RuntimeError", "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: 4 GB", True),
        ("ChildExited", f"rank 1 was killed by signal 9 (SIGKILL: {OOM_KILLED})", True),
        ("ChildExited", "rank 1 was killed by signal 9 (SIGKILL: out of memory?)", False),  # no OOM kill counted
        ("RuntimeError", "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer", False),
        ("ValueError", "loss is nan", False),
    ],
)
def test_an_error_is_out_of_memory_by_its_exception_or_its_words(exception, message, oom):
    assert RankError(exception=exception, message=message).is_oom is oom


def test_a_child_killed_while_the_kernels_oom_killer_was_killing_says_so():
    assert exit_reason(-signal.SIGKILL, oom_killed=True) == f"was killed by signal 9 (SIGKILL: {OOM_KILLED})"
    assert exit_reason(-signal.SIGKILL) == "was killed by signal 9 (SIGKILL: out of memory?)"
    assert exit_reason(-signal.SIGSEGV, oom_killed=True) == "was killed by signal 11 (SIGSEGV)"  # not the killer's
    count = oom_kills()  # /proc/vmstat's, on Linux 4.13 and later
    assert count is None or count >= 0


# --------------------------------------------------------------------------- the policy


def spec_at(m: int) -> JobSpec:
    return JobSpec.model_validate(job_body(micro_batch_size=m, global_batch_size=8))


def test_an_out_of_memory_failure_with_a_replan_is_retried_at_it_and_spends_no_retry():
    replan = Replan(reason="out of memory at micro_batch_size 4 ...", spec=spec_at(2), plan=None)
    failure = AttemptFailure(error=OOM, num_retries=0, relaunch_size=2, replan=replan)
    decision = FailurePolicy(max_retries=0).make_decision(failure)
    assert (decision.action, decision.num_retries, decision.size, decision.replan) == (
        FailureAction.RETRY,
        0,
        2,
        replan,
    )
    assert decision.reason == "out of memory at micro_batch_size 4 ...; no retry spent"
    past_quota = FailurePolicy(max_retries=0).make_decision(
        AttemptFailure(error=OOM, num_retries=0, relaunch_size=None, replan=replan)
    )
    assert (past_quota.action, past_quota.num_retries, past_quota.replan) == (FailureAction.REQUEUE, 0, replan)


def test_an_out_of_memory_failure_with_nothing_smaller_left_fails_as_any_failure_naming_both():
    none_left = Replan(
        reason="no configuration that plans fewer bytes than micro_batch_size 1 keeps global batch 8 on 2 GPUs"
    )
    decision = FailurePolicy(max_retries=0).make_decision(
        AttemptFailure(error=OOM, num_retries=0, relaunch_size=2, replan=none_left)
    )
    assert (decision.action, decision.replan) == (FailureAction.FAIL, None)
    assert decision.reason == (
        "rank 0 on node n1: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB; no configuration that "
        "plans fewer bytes than micro_batch_size 1 keeps global batch 8 on 2 GPUs"
    )
    retried = FailurePolicy(max_retries=1).make_decision(
        AttemptFailure(error=OOM, num_retries=0, relaunch_size=2, replan=none_left)
    )
    assert (retried.action, retried.num_retries, retried.replan) == (FailureAction.RETRY, 1, None)


def test_a_replan_offered_for_another_failure_is_not_taken():
    replan = Replan(reason="out of memory ...", spec=spec_at(2), plan=None)
    error = RankError(exception="ValueError", message="bad batch", rank=0)
    decision = FailurePolicy(max_retries=0).make_decision(
        AttemptFailure(error=error, num_retries=0, relaunch_size=2, replan=replan)
    )
    assert (decision.action, decision.replan) == (FailureAction.FAIL, None)


# --------------------------------------------------------------------------- the scheduler, on stand-ins


@pytest.fixture
def api(tmp_path) -> Iterator[TestClient]:
    """The app on 4 logical GPUs whose scheduler ticks only when the test says, on stand-ins for Ray."""
    with serve_on_fakes(make_settings(tmp_path)) as client:
        client.app.state.runtime.scheduler.stop()
        client.app.state.runtime.launcher.clock = FakeClock()
        yield client


def events(api: TestClient, job_id: int) -> list[str]:
    return [event["reason"] for event in api.get(f"/v1/jobs/{job_id}/events").json()["data"]]


def test_the_scheduler_relaunches_an_out_of_memory_attempt_at_the_next_configuration_with_its_plan(api):
    launcher = api.app.state.runtime.launcher
    body = job_body(model=TINY, micro_batch_size=4, global_batch_size=8, steps=1_000_000)
    submitted = api.post("/v1/jobs", json=body).json()
    reference = api.post("/v1/jobs?dry_run=true", json={**body, "micro_batch_size": 2}).json()["plan"]
    tick(api, 2)
    launcher.fail(submitted["id"], 0, exception="OutOfMemoryError", message="CUDA out of memory")
    tick(api)
    job = api.get(f"/v1/jobs/{submitted['id']}").json()
    assert (job["status"], job["attempt"], job["num_retries"]) == ("restarting", 1, 0)  # max_retries 0: none spent
    assert (job["spec"]["micro_batch_size"], job["spec"]["global_batch_size"]) == (2, 8)
    assert job["plan"] == reference  # the plan of a job submitted at micro-batch 2
    assert job["plan"]["per_gpu"]["activations_bytes"] < submitted["plan"]["per_gpu"]["activations_bytes"]
    assert events(api, job["id"])[-1] == (
        "out of memory at micro_batch_size 4 (OutOfMemoryError: CUDA out of memory): retrying at micro_batch_size 2 "
        "with 2x accumulation (global batch 8 unchanged); no retry spent: attempt 1 resumes from the start (no "
        "checkpoint yet)"
    )
    assert [attempt for job_id, attempt, _ in launcher.launched if job_id == job["id"]] == [0, 1]


def test_with_nothing_smaller_left_the_job_fails_naming_the_out_of_memory(api):
    launcher = api.app.state.runtime.launcher
    body = job_body(model=TINY, micro_batch_size=1, activation_checkpointing=True, steps=1_000_000)
    job_id = api.post("/v1/jobs", json=body).json()["id"]
    tick(api, 2)
    launcher.fail(job_id, 0, exception="OutOfMemoryError", message="CUDA out of memory")
    tick(api)
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert (job["status"], job["error"]["exception"], job["spec"]["micro_batch_size"]) == (
        "failed",
        "OutOfMemoryError",
        1,
    )
    assert events(api, job_id)[-1] == (
        "OutOfMemoryError: CUDA out of memory; no configuration that plans fewer bytes than micro_batch_size 1 "
        "with activation checkpointing keeps global batch 2 on 2 GPUs"
    )


# --------------------------------------------------------------------------- real ranks


SQUEEZED = '''
import torch
from torch import nn


class Squeezed(nn.Module):
    """A small language model whose forward runs out of memory on more than max_samples samples, from
    its from_forward-th forward in this process on (as a GPU does once other steps have taken its memory)."""

    def __init__(self, max_samples, from_forward):
        super().__init__()
        self.max_samples = max_samples
        self.from_forward = from_forward
        self.forwards = 0
        self.embed = nn.Embedding(64, 16)
        self.head = nn.Linear(16, 64)

    def forward(self, input_ids, labels):
        if not isinstance(input_ids, torch._subclasses.FakeTensor):  # the plan's trace runs on fake tensors
            self.forwards += 1
            if input_ids.shape[0] > self.max_samples and self.forwards >= self.from_forward:
                raise torch.OutOfMemoryError(f"CUDA out of memory: a micro-batch of {input_ids.shape[0]} samples")
        logits = self.head(self.embed(input_ids))
        return nn.functional.cross_entropy(logits.reshape(-1, 64), labels.reshape(-1))


def build(max_samples, from_forward):
    return Squeezed(max_samples, from_forward)
'''


def test_a_model_out_of_memory_above_micro_batch_2_succeeds_at_2_with_the_loss_curve_of_a_job_submitted_there(
    client, tmp_path
):
    from zero1.bundle import zip_directory

    (tmp_path / "squeezed.py").write_text(SQUEEZED)
    data, _ = zip_directory(tmp_path)
    code = client.post("/v1/code", content=data, headers={"Content-Type": "application/zip"}).json()["code"]
    # steps 0-3 at micro-batch 4 (one forward a step on each rank), then out of memory at step 4's:
    # the retry resumes from a checkpoint written at micro-batch 4 and trains on at 2
    model = {"kind": "python", "entrypoint": "squeezed:build", "args": {"max_samples": 2, "from_forward": 5}}
    body = job_body(
        model=model, code=code, seq_len=8, data={"kind": "synthetic"}, steps=8, checkpoint_every=2, global_batch_size=8
    )
    squeezed = client.post("/v1/jobs", json={**body, "micro_batch_size": 4})
    assert squeezed.status_code == 201, squeezed.text
    job = wait_job(client, squeezed.json()["id"], lambda j: j["status"] in TERMINAL)
    assert (job["status"], job["attempt"], job["num_retries"]) == ("succeeded", 1, 0), job["error"]
    assert (job["spec"]["micro_batch_size"], job["spec"]["global_batch_size"]) == (2, 8)

    reasons = [event["reason"] for event in client.get(f"/v1/jobs/{job['id']}/events").json()["data"]]
    (replanned,) = [reason for reason in reasons if reason.startswith("out of memory")]
    found = re.fullmatch(
        r"out of memory at micro_batch_size 4 on rank [01] \(OutOfMemoryError: CUDA out of memory: a micro-batch of "
        r"4 samples\): retrying at micro_batch_size 2 with 2x accumulation \(global batch 8 unchanged\); no retry "
        r"spent: attempt 1 resumes from checkpoint step (\d+)\n.*",
        replanned,
        flags=re.DOTALL,
    )
    assert found and int(found[1]) in (1, 3), replanned  # step 3's checkpoint, or step 1's if 3's was not complete

    reference = client.post("/v1/jobs", json={**body, "micro_batch_size": 2, "name": "submitted at 2"}).json()
    done = wait_job(client, reference["id"], lambda j: j["status"] in TERMINAL)
    assert (done["status"], done["attempt"]) == ("succeeded", 0), done["error"]
    assert job["plan"] == done["plan"]  # the plan of a job submitted at micro-batch 2

    def losses(job_id: int) -> list[float]:
        rows = client.get(f"/v1/jobs/{job_id}/metrics", params={"limit": 100}).json()["data"]
        return [row["loss"] for row in rows]

    # steps up to the checkpoint ran at micro-batch 4 (one forward over the 4 samples of a rank), the rest
    # and the reference's at 2 (two of 2, each loss halved): each step's samples are the same, fixed by the
    # global batch, and only the float sums' order differs, by an ulp or two in fp32 (1e-7), which eight
    # AdamW steps carry on to the losses by no more than that times the few steps: 1e-5 holds it (one
    # run here: 7 of the 8 losses equal, step 1's 2.2e-7 of the loss apart)
    torch.testing.assert_close(torch.tensor(losses(job["id"])), torch.tensor(losses(done["id"])), rtol=1e-5, atol=1e-6)
    assert len(losses(job["id"])) == 8

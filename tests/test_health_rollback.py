"""Divergence rollback (docs/api.md, "Training health"): a loss spike or a non-finite run past
max_nonfinite_steps rolls the job back to its newest checkpoint before the event, skipping the
batches up to it, without spending a retry; past max_rollbacks it fails.

The pure parts first (the spike test on its window, the event's words, the policy, the data skips,
the checkpoint a rollback may use), then the scheduler on stand-ins for Ray, then two python models
on real Ray ranks, each poisoned by the content of one batch: the job succeeds after one rollback and
its rows equal those of a job given the same data skip from the start.

Packages: workers.health, workers.records, workers.config, workers.training, workers.runtime,
service.scheduling, service.store.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import pytest
from fakes import FakeClock
from fastapi.testclient import TestClient

from service.scheduling.health import Rollback, RollbackDecision, decide, relaunch_terms, rollbacks_of
from workers.config import DataSkip, HealthConfig, PythonSpec, SyntheticSpec, data_step
from workers.data.sources import Batches
from workers.health import DivergenceWatch, zscore
from workers.records import Divergence, DivergenceError, DivergenceKind, MetricRow, RankError
from workers.runtime.link import error_of
from workers.runtime.rank_parent import RankProcess
from workers.training import checkpoints

import helpers
from conftest import make_settings, serve_on_fakes
from test_python_jobs import upload, write_bundle

SPIKE = Divergence(kind=DivergenceKind.SPIKE, step=812, loss=61.0, zscore=9.74)
NONFINITE = Divergence(kind=DivergenceKind.NONFINITE, step=14, num_steps=3)


def row(step: int, loss: float, *, skipped: bool = False) -> MetricRow:
    return MetricRow(
        step=step, loss=loss, grad_norm=1.0, loss_scale=1.0, skipped=skipped, step_time_s=0.1, tokens_per_s=1.0,
        mem_peak_bytes=(1,), mem_planned_bytes=1,
    )  # fmt: skip


# --------------------------------------------------------------------------- the spike test


def test_the_zscore_is_the_distance_above_the_windows_mean_in_its_sample_deviations():
    window = [1.0, 2.0, 3.0, 4.0, 5.0]  # mean 3, sample deviation sqrt(2.5)
    assert zscore(10.0, window) == pytest.approx(7 / math.sqrt(2.5))
    assert zscore(2.0, window) < 0
    # a plateau's deviation counts at least a millionth of its mean: a wobble in the last bits is no spike
    assert zscore(3.0 + 3e-6, [3.0] * 4) == pytest.approx(1.0)
    assert zscore(1.0, [0.0] * 4) == 0.0


def test_a_spike_is_found_once_the_window_is_full_and_the_skipped_steps_stay_out_of_it():
    watch = DivergenceWatch(HealthConfig(max_rollbacks=1, spike_window=4), max_nonfinite_steps=3)
    losses = [4.0, 4.1, 3.9, 4.0]
    assert watch.check(row(0, 80.0), skipped_in_a_row=0) is None  # no window yet: it joins it
    watch = DivergenceWatch(HealthConfig(max_rollbacks=1, spike_window=4), max_nonfinite_steps=3)
    for step, loss in enumerate(losses):
        assert watch.check(row(step, loss), skipped_in_a_row=0) is None
    assert watch.check(row(4, math.nan, skipped=True), skipped_in_a_row=1) is None  # skipped: not in the window
    found = watch.check(row(5, 80.0), skipped_in_a_row=0)
    assert found is not None and (found.kind, found.step, found.loss) == (DivergenceKind.SPIKE, 5, 80.0)
    assert found.zscore == pytest.approx(zscore(80.0, losses))
    # the spike joined the window (with max_rollbacks 0 training goes on): the next 80 is no spike
    assert watch.check(row(6, 80.0), skipped_in_a_row=0) is None


def test_a_non_finite_run_diverges_at_max_nonfinite_steps_and_no_spike_test_without_a_threshold():
    watch = DivergenceWatch(HealthConfig(max_rollbacks=1, spike_zscore=None, spike_window=2), max_nonfinite_steps=3)
    for step, loss in enumerate([4.0, 4.0, 400.0]):
        assert watch.check(row(step, loss), skipped_in_a_row=0) is None
    assert watch.check(row(3, math.nan, skipped=True), skipped_in_a_row=1) is None
    assert watch.check(row(4, math.nan, skipped=True), skipped_in_a_row=2) is None
    found = watch.check(row(5, math.nan, skipped=True), skipped_in_a_row=3)
    assert found == Divergence(kind=DivergenceKind.NONFINITE, step=5, loss=None, num_steps=3)


# --------------------------------------------------------------------------- the record, rank to service


def test_the_divergence_crosses_from_the_child_to_the_parent_as_its_record_and_nothing_else_does():
    assert SPIKE.describe() == "loss spike 9.7σ at step 812"
    assert NONFINITE.describe() == "loss not finite for 3 steps at step 14"
    sent = json.loads(json.dumps(error_of(DivergenceError(SPIKE))))  # the child's socket carries JSON
    received = RankProcess._error(None, {"error": sent})
    assert (received.exception, received.divergence) == ("DivergenceError", SPIKE)
    assert received.message == "loss spike 9.7σ at step 812: the job rolls back to its last checkpoint before it"
    assert RankError(exception="E", message="m", divergence=NONFINITE).to_json()["divergence"] == {
        "kind": "nonfinite", "step": 14, "loss": None, "zscore": None, "num_steps": 3,
    }  # fmt: skip
    assert RankProcess._error(None, {"error": error_of(RuntimeError("boom"))}).divergence is None
    for forged in ({"kind": "spike", "step": 3}, {"kind": "other", "step": 3}, {"kind": "nonfinite", "step": -1}):
        assert Divergence.from_json(forged) is None, forged  # a spike without its z-score, a kind or step unknown


# --------------------------------------------------------------------------- the policy


def test_a_spike_rolls_back_to_the_checkpoint_before_it_skipping_the_batches_up_to_it():
    decision = decide(SPIKE, health=HealthConfig(max_rollbacks=2), num_rollbacks=0, checkpoint_step=799)
    assert decision == RollbackDecision(
        reason="loss spike 9.7σ at step 812: rolled back to step 799, skipping 13 batches (rollback 1 of 2)",
        rollback=Rollback(kind="spike", step=812, checkpoint_step=799, num_batches=13),
    )
    assert decision.rollback.skip() == DataSkip(step=800, num_batches=13)


def test_without_a_checkpoint_before_the_event_the_job_starts_again_and_the_lr_factor_is_said():
    health = HealthConfig(max_rollbacks=3, lr_factor=0.5)
    decision = decide(NONFINITE, health=health, num_rollbacks=1, checkpoint_step=None)
    assert decision.reason == (
        "loss not finite for 3 steps at step 14: rolled back to the start, skipping 15 batches, lr x0.25 "
        "(rollback 2 of 3)"
    )
    assert decision.rollback == Rollback(kind="nonfinite", step=14, checkpoint_step=None, num_batches=15)
    unskipped = decide(
        NONFINITE, health=HealthConfig(max_rollbacks=1, skip_batches=False), num_rollbacks=0, checkpoint_step=9
    )
    assert unskipped.reason == "loss not finite for 3 steps at step 14: rolled back to step 9 (rollback 1 of 1)"
    assert unskipped.rollback.skip() is None


def test_past_max_rollbacks_the_job_fails_naming_the_rollbacks_spent():
    decision = decide(SPIKE, health=HealthConfig(max_rollbacks=2), num_rollbacks=2, checkpoint_step=799)
    assert decision == RollbackDecision(
        reason="loss spike 9.7σ at step 812: no rollback left (2 of max_rollbacks 2 spent)", rollback=None
    )


def test_every_later_attempt_trains_with_the_rollbacks_skips_and_lr_scale():
    stored = [
        Rollback(kind="spike", step=30, checkpoint_step=24, num_batches=6).to_json(),
        Rollback(kind="spike", step=27, checkpoint_step=24, num_batches=0).to_json(),
        Rollback(kind="nonfinite", step=27, checkpoint_step=24, num_batches=3).to_json(),
    ]
    skips, lr_scale = relaunch_terms(rollbacks_of(stored), lr_factor=0.5)
    assert skips == (DataSkip(step=25, num_batches=6), DataSkip(step=25, num_batches=3))
    assert lr_scale == 0.125
    assert relaunch_terms(rollbacks_of(None), lr_factor=0.5) == ((), 1.0)


def test_a_data_skip_moves_every_later_step_past_its_batches_and_a_second_adds_to_the_first():
    one = (DataSkip(step=25, num_batches=6),)
    assert [data_step(step, one) for step in (0, 24, 25, 26)] == [0, 24, 31, 32]
    # rolled back again from checkpoint 24 after an event at step 27 (which read batch 33): step 25 reads 34
    two = (*one, DataSkip(step=25, num_batches=3))
    assert [data_step(step, two) for step in (24, 25)] == [24, 34]
    with pytest.raises(ValueError, match=r"num_batches \(0\) >= 1"):
        DataSkip(step=3, num_batches=0)


# --------------------------------------------------------------------------- the checkpoint a rollback uses


def complete(root: Path, step: int) -> None:
    directory = checkpoints.step_dir(root, step)
    directory.mkdir(parents=True)
    checkpoints.write_json(directory / checkpoints.COMPLETE, {"step": step, "world_size": 2})


def test_no_checkpoint_at_or_after_the_event_is_used_nor_kept(tmp_path):
    for step in (4, 9, 14, 19):
        complete(tmp_path, step)
    checkpoints.step_dir(tmp_path, 24).mkdir()  # being written when the event came
    assert checkpoints.latest_checkpoint(tmp_path, before=14) == (9, 2)
    assert checkpoints.latest_checkpoint(tmp_path, before=4) is None
    assert checkpoints.discard_from(tmp_path, step=14) == [14, 19, 24]
    assert checkpoints.latest_checkpoint(tmp_path) == (9, 2)  # where the relaunch's ranks resume
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000004", "step-000000009"]


# --------------------------------------------------------------------------- the scheduler, on stand-ins


@pytest.fixture
def api(tmp_path):
    """The app on stand-ins for Ray (tests/fakes.py) and its real job storage, ticked by the test."""
    with serve_on_fakes(make_settings(tmp_path)) as client:
        client.app.state.runtime.scheduler.stop()
        client.app.state.runtime.launcher.clock = FakeClock()
        yield client


def job_dir(api: TestClient, job_id: int) -> Path:
    settings = api.app.state.runtime.settings
    return helpers.job_checkpoint_dir(settings.database_url, Path(settings.checkpoint_uri), job_id)


def diverge(api: TestClient, job_id: int, divergence: Divergence) -> None:
    """The job's current attempt ends as its ranks end it for a rollback; the next tick settles it."""
    from workers.records import AttemptPoll, AttemptStatus

    launcher = api.app.state.runtime.launcher
    attempt = api.get(f"/v1/jobs/{job_id}").json()["attempt"]
    error = RankError.of(DivergenceError(divergence), rank=0, node_id="node-0")
    launcher.attempts[(job_id, attempt)].ended = AttemptPoll(status=AttemptStatus.FAILED, error=error)
    api.app.state.runtime.scheduler.tick()


def test_a_rollback_relaunches_from_the_checkpoint_spends_no_retry_and_the_last_one_fails_the_job(api):
    body = helpers.job_body(steps=1000, max_retries=2, health={"max_rollbacks": 1})
    job_id = api.post("/v1/jobs", json=body).json()["id"]
    api.app.state.runtime.scheduler.tick()
    for step in (9, 19, 29):  # 29: at a step after the event (written by no attempt of ours, but there)
        complete(job_dir(api, job_id), step)

    diverge(api, job_id, Divergence(kind=DivergenceKind.SPIKE, step=25, loss=40.0, zscore=12.25))
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert (job["status"], job["attempt"], job["num_retries"], job["num_rollbacks"]) == ("restarting", 1, 0, 1)
    reason = api.get(f"/v1/jobs/{job_id}/events").json()["data"][-1]["reason"]
    assert reason == (
        "loss spike 12.2σ at step 25: rolled back to step 19, skipping 6 batches (rollback 1 of 1): "
        "attempt 1 resumes from checkpoint step 19"
    )
    assert sorted(p.name for p in job_dir(api, job_id).iterdir()) == ["step-000000009", "step-000000019"]
    api.app.state.runtime.scheduler.tick()
    assert api.get(f"/v1/jobs/{job_id}").json()["status"] == "running"

    diverge(api, job_id, NONFINITE)  # retries are left, rollbacks are not
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert (job["status"], job["num_retries"], job["num_rollbacks"]) == ("failed", 0, 1)
    assert job["error"]["divergence"]["kind"] == "nonfinite"
    reason = api.get(f"/v1/jobs/{job_id}/events").json()["data"][-1]["reason"]
    assert reason == "loss not finite for 3 steps at step 14: no rollback left (1 of max_rollbacks 1 spent)"


def test_without_max_rollbacks_a_divergence_is_a_failure_as_any_other(api):
    job_id = api.post("/v1/jobs", json=helpers.job_body(steps=1000, max_retries=1)).json()["id"]
    api.app.state.runtime.scheduler.tick()
    diverge(api, job_id, SPIKE)
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert (job["status"], job["num_retries"], job["num_rollbacks"]) == ("restarting", 1, 0)
    assert "retry 1 of 1" in api.get(f"/v1/jobs/{job_id}/events").json()["data"][-1]["reason"]


# --------------------------------------------------------------------------- real ranks, a poisoned batch

POISONED = """
import hashlib

import torch
from torch import nn
from torch.nn import functional as F

POISON = set(@POISON@)
\"\"\"sha256 of the input_ids of every rank's micro-batch of the batch that poisons the run\"\"\"
FACTOR = @FACTOR@
STEPS = @STEPS@


class Poisoned(nn.Module):
    \"\"\"A bigram model whose loss is multiplied by FACTOR for STEPS steps from the poisoned batch on: the
    batch's content, never a step count, starts it (skipping the batch removes it).\"\"\"

    def __init__(self, vocab_size: int, n_embd: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, n_embd)
        self.head = nn.Linear(n_embd, vocab_size)
        self.left = 0

    def forward(self, input_ids, labels):
        loss = F.cross_entropy(self.head(self.tokens(input_ids)).flatten(0, 1), labels.flatten())
        if self.training and type(input_ids) is torch.Tensor and input_ids.device.type != "meta":  # not traced
            if hashlib.sha256(input_ids.cpu().numpy().tobytes()).hexdigest() in POISON:
                self.left = STEPS
            if self.left:
                self.left -= 1
                loss = loss * FACTOR
        return loss


def build(vocab_size: int = 64, n_embd: int = 32) -> Poisoned:
    return Poisoned(vocab_size, n_embd)
"""
VOCAB = 64
SEQ_LEN = 16
WORLD = 2
MICRO = 2  # a global batch of 4: one micro-batch a rank a step, so a forward is a step


def poison_digests(data_step_poisoned: int, *, seed: int) -> list[str]:
    """The digests of every rank's input_ids at the poisoned batch, as the ranks will draw them."""
    model = PythonSpec(entrypoint="poisoned:build", code="sha256:" + "0" * 64, vocab_size=VOCAB, block_size=SEQ_LEN)
    digests = []
    for rank in range(WORLD):
        batches = Batches(
            model=model, data=SyntheticSpec(), seed=seed, seq_len=SEQ_LEN, global_batch_size=WORLD * MICRO,
            micro_batch_size=MICRO, rank=rank, world_size=WORLD,
        )  # fmt: skip
        inputs, _ = batches.micro_batch(data_step_poisoned, 0)
        digests.append(hashlib.sha256(inputs.numpy().tobytes()).hexdigest())
    return digests


def poisoned_job(client, tmp_path: Path, *, factor: str, num_steps: int, poisoned_step: int, **fields) -> dict:
    seed = 3
    code = POISONED.replace("@POISON@", repr(poison_digests(poisoned_step, seed=seed)))
    code = code.replace("@FACTOR@", factor).replace("@STEPS@", str(num_steps))
    bundle = upload(client, write_bundle(tmp_path / f"bundle-{factor}", {"poisoned.py": code}))
    return {
        "name": "poisoned",
        "model": {"kind": "python", "entrypoint": "poisoned:build", "args": {"vocab_size": VOCAB}},
        "data": {"kind": "synthetic"},
        "code": bundle,
        "seq_len": SEQ_LEN,
        "num_gpus": WORLD,
        "precision": "fp32",
        "optimizer": {"lr": 0.01, "weight_decay": 0.0},
        "steps": 36,
        "micro_batch_size": MICRO,
        "seed": seed,
        "checkpoint_every": 5,
        **fields,
    }


def rows_of(client, job_id: int) -> list[tuple]:
    rows = client.get(f"/v1/jobs/{job_id}/metrics", params={"limit": 1000}).json()["data"]
    return [(r["step"], r["attempt"], r["loss"], r["grad_norm"], r["skipped"]) for r in rows]


def run_with_and_without(client, body: dict, *, skip: dict) -> tuple[dict, dict, list[dict]]:
    """The poisoned job, and the same job given the rollback's skip from the start: both ended."""
    rolled = client.post("/v1/jobs", json=body).json()["id"]
    skipped = client.post("/v1/jobs", json={**body, "name": "skipped", "data_skips": [skip]}).json()["id"]
    ended = [helpers.wait_job(client, j, lambda j: j["status"] in helpers.TERMINAL) for j in (rolled, skipped)]
    return *ended, client.get(f"/v1/jobs/{rolled}/events").json()["data"]


def assert_rolled_back_once(client, job: dict, reference: dict, events: list[dict], *, reason: str, resume: int):
    assert job["status"] == reference["status"] == "succeeded", (job["error"], reference["error"])
    assert (job["attempt"], job["num_retries"], job["num_rollbacks"]) == (1, 0, 1)
    assert (reference["attempt"], reference["num_rollbacks"]) == (0, 0)  # the same test found nothing there
    assert [e["to_status"] for e in events] == ["queued", "starting", "running", "restarting", "running", "succeeded"]
    assert events[3]["reason"] == f"{reason}: attempt 1 resumes from checkpoint step {resume - 1}"
    rows, expected = rows_of(client, job["id"]), rows_of(client, reference["id"])
    # the surviving curve: attempt 0's rows up to the checkpoint, attempt 1's after it, each step once
    assert [(step, attempt) for step, attempt, *_ in rows] == [(s, int(s >= resume)) for s in range(36)]
    # equal, bit for bit, to the run that never read the skipped batches: the same data and state at
    # every step on one machine (a resume is exact: tests/test_faults.py)
    assert [(step, *values) for step, _, *values in rows] == [(step, *values) for step, _, *values in expected]


def test_a_run_of_nan_steps_past_max_nonfinite_steps_is_rolled_back_once_past_the_batch_that_caused_it(
    client, tmp_path
):
    # the batch of step 17 makes the loss nan for 4 steps; the third skipped in a row (step 19) is the event
    body = poisoned_job(
        client, tmp_path, factor='float("nan")', num_steps=4, poisoned_step=17, max_nonfinite_steps=3,
        health={"max_rollbacks": 1},
    )  # fmt: skip
    job, reference, events = run_with_and_without(client, body, skip={"step": 15, "num_batches": 5})
    reason = "loss not finite for 3 steps at step 19: rolled back to step 14, skipping 5 batches (rollback 1 of 1)"
    assert_rolled_back_once(client, job, reference, events, reason=reason, resume=15)


def test_a_loss_spiking_x20_is_rolled_back_once_past_the_batch_that_caused_it(client, tmp_path):
    # the batch of step 23 makes the loss 20 times itself for 3 steps: the first is the event
    body = poisoned_job(
        client, tmp_path, factor="20.0", num_steps=3, poisoned_step=23, health={"max_rollbacks": 1, "spike_window": 8}
    )
    job, reference, events = run_with_and_without(client, body, skip={"step": 20, "num_batches": 4})
    zscore = re.fullmatch(r"loss spike (\d+\.\d)σ at step 23: .*", events[3]["reason"])
    assert zscore is not None and float(zscore[1]) > 6, events[3]["reason"]
    reason = f"loss spike {zscore[1]}σ at step 23: rolled back to step 19, skipping 4 batches (rollback 1 of 1)"
    assert_rolled_back_once(client, job, reference, events, reason=reason, resume=20)

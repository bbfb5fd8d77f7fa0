"""Elastic resizing at the optimizer: a sharded checkpoint saved by N ranks loads on M ranks, each
rank reading only the byte ranges it now owns (workers/zero/sharded_state.py, load_resharded_state).

Packages: workers.zero.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from test_optim import HYPER, MAX_NORM, make_model, train_zero1
from torch.testing import assert_close

from workers.zero.optimizer import ZeRO1AdamW, decay_param_groups
from workers.zero.sharded_state import owned_pieces

from distributed import run_ranks

PHASES = [4, 3, 2, 4]  # the world size of each phase of the resized run
STEPS_PER_PHASE = 3


def _optimizer(dtype: torch.dtype):
    model = make_model(dtype)
    return model, ZeRO1AdamW(decay_param_groups(model, weight_decay=0.1), **HYPER, max_grad_norm=MAX_NORM)


def _shards(directory: Path, world_size: int) -> list[dict]:
    return [torch.load(directory / f"rank-{r}.pt", mmap=True) for r in range(world_size)]


def _phase(rank: int, world_size: int, root: str, phase: int, saved_world: int | None, dtype: torch.dtype) -> None:
    """Load the previous phase's shards (saved by saved_world ranks), check the state is the saved
    one bit for bit, train this phase's steps, save this phase's shards and consolidated state."""
    root_path = Path(root)
    model, opt = _optimizer(dtype)
    if saved_world is not None:
        opt.load_resharded_state_dicts(_shards(root_path / f"phase-{phase - 1}", saved_world))
        loaded = opt.consolidated_state_dict()
        if rank == 0:
            saved = torch.load(root_path / f"phase-{phase - 1}" / "consolidated.pt")
            assert loaded["param_groups"] == saved["param_groups"]
            for name, entry in saved["params"].items():
                for kind in ("master", "exp_avg", "exp_avg_sq"):
                    assert torch.equal(loaded["params"][name][kind], entry[kind]), (phase, name, kind)
                assert loaded["params"][name]["step"] == entry["step"]
        for p, q in zip(model.parameters(), torch.load(root_path / f"phase-{phase - 1}" / "params.pt"), strict=True):
            assert torch.equal(p, q)  # the model's weights come back from the master copy, gathered
    train_zero1(rank, world_size, model, opt, steps=STEPS_PER_PHASE, first_step=phase * STEPS_PER_PHASE)
    out = root_path / f"phase-{phase}"
    out.mkdir(exist_ok=True)
    torch.save(opt.state_dict(), out / f"rank-{rank}.pt")
    consolidated = opt.consolidated_state_dict()
    if rank == 0:
        torch.save(consolidated, out / "consolidated.pt")
        torch.save([p.detach().clone() for p in model.parameters()], out / "params.pt")


def _uninterrupted(rank: int, world_size: int, root: str, dtype: torch.dtype) -> None:
    model, opt = _optimizer(dtype)
    train_zero1(rank, world_size, model, opt, steps=len(PHASES) * STEPS_PER_PHASE, first_step=0)
    consolidated = opt.consolidated_state_dict()
    if rank == 0:
        torch.save(consolidated, Path(root) / "uninterrupted.pt")


@pytest.mark.parametrize(("dtype", "phases"), [(torch.float32, PHASES), (torch.bfloat16, [4, 3])], ids=["fp32", "bf16"])
def test_a_sharded_checkpoint_reshards_4_3_2_4_to_the_uninterrupted_state(tmp_path, dtype, phases):
    """Each hop loads the state bit for bit (bf16, one hop: the fp32 master copy apart from the
    bf16 weights). In fp32 the run ends where an unresized 4-rank run ends, up to the order in
    which each step's gradients were summed; in bf16 each rank's sum rounds to bf16, so only the
    hop is compared."""
    saved_world = None
    for phase, world_size in enumerate(phases):
        run_ranks(world_size, _phase, str(tmp_path), phase, saved_world, dtype)
        saved_world = world_size
    if dtype == torch.bfloat16:
        return
    run_ranks(4, _uninterrupted, str(tmp_path), dtype)
    resized = torch.load(tmp_path / f"phase-{len(PHASES) - 1}" / "consolidated.pt")["params"]
    unresized = torch.load(tmp_path / "uninterrupted.pt")["params"]
    worst = 0.0
    for name, entry in unresized.items():
        assert resized[name]["step"] == entry["step"]
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            got = resized[name][kind]
            want = entry[kind]
            worst = max(worst, ((got - want).abs().max() / want.abs().max().clamp(min=1e-30)).item())
            assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    print(f"\n4 -> 3 -> 2 -> 4 against an unresized 4-rank run: largest difference of the state {worst:.1e} (relative)")


_MEMORY_PROBE = textwrap.dedent(
    """
    import json, sys, torch, torch.distributed as dist
    from pathlib import Path
    from torch import nn
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from workers.zero.optimizer import ZeRO1AdamW

    root, saved_world, world, rank = Path(sys.argv[1]), 4, 3, 1

    def optimizer(rank, world_size):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])  # 2.1 M parameters, fp32
        return ZeRO1AdamW(model.parameters(), process_group=dist.group.WORLD)

    for r in range(saved_world):  # each saving rank's shard: its state filled with values of its own
        opt = optimizer(r, saved_world)
        for buf in opt._buffers:
            for i, kind in enumerate(("master", "exp_avg", "exp_avg_sq")):
                state = buf.state_of(kind)
                state.copy_(torch.arange(state.numel(), dtype=torch.float32) + buf.start + i * 1e7)
        torch.save(opt.state_dict(), root / f"rank-{r}.pt")
        dist.destroy_process_group()

    opt = optimizer(rank, world)
    for buf in opt._buffers:
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            buf.state_of(kind).fill_(-1.0)  # the state's own pages are resident before the load
    shards = [torch.load(root / f"rank-{r}.pt", mmap=True) for r in range(saved_world)]
    def peak_rss():
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts from now
    before = peak_rss()
    opt.load_resharded_state_dicts(shards)
    grew = peak_rss() - before
    buf = opt._buffers[0]
    right = all(
        torch.equal(buf.state_of(kind)[: buf.owned_numel],
                    torch.arange(buf.owned_numel, dtype=torch.float32) + buf.start + i * 1e7)
        for i, kind in enumerate(("master", "exp_avg", "exp_avg_sq"))
    )
    own = sum(3 * 4 * b.owned_numel for b in opt._buffers)
    full = sum(3 * 4 * b.numel for b in opt._buffers)
    print(json.dumps({"grew": grew, "own": own, "full": full, "right": right}))
    """
)


def test_a_rank_reads_only_the_state_it_now_owns(tmp_path):
    """Rank 1 of 3 loads a checkpoint of 4 shards: its peak memory grows by about its own shard's
    bytes (the pages of the mapped files it reads), not by the whole state's (measured here: 10.6
    MiB for an 8.0 MiB shard of a 24 MiB state)."""
    result = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert result.returncode == 0, result.stderr
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["right"], "rank 1 of 3 did not get the state of its range"
    # beyond its own bytes: the kernel's readahead around the mapped ranges (a few MiB, growing slower
    # than the shard) and the shards' pickled headers
    assert measured["grew"] <= 1.25 * measured["own"] + 2 * 2**20, measured
    assert measured["grew"] <= measured["full"] / 2, measured
    print(
        f"\npeak memory during the load grew {measured['grew'] / 2**20:.1f} MiB; this rank's shard is "
        f"{measured['own'] / 2**20:.1f} MiB, the whole state {measured['full'] / 2**20:.1f} MiB"
    )


def test_a_checkpoint_missing_a_shard_is_refused():
    _, opt = _optimizer(torch.float32)
    state = opt.state_dict()
    state["world_size"] = 2
    with pytest.raises(ValueError, match=r"need every shard of one checkpoint in rank order: got ranks \[0\]"):
        owned_pieces(opt._buffers, [state])

"""benchmarks/gpu_check.py's smoke run: on CPU, a tiny GPT, rank 0 of 1, 2 and 4 on the fake backend.

Packages: workers.zero.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORLD_SIZES = (1, 2, 4)


def test_smoke_run_prints_a_row_per_world_size_with_exact_optimizer_state():
    command = [
        sys.executable,
        "benchmarks/gpu_check.py",
        "--device",
        "cpu",
        "--small",
        "--skip-tests",
        "--world-sizes",
        ",".join(map(str, WORLD_SIZES)),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    # a row: N right-aligned first, then the byte columns; the optimizer-state check last
    rows = {int(m[1]): m[2] for m in re.finditer(r"^ *(\d+) +(\d.*)$", done.stdout, flags=re.MULTILINE)}
    assert sorted(rows) == list(WORLD_SIZES), done.stdout
    for num_gpus, row in rows.items():
        assert row.rstrip().endswith("exact"), f"N={num_gpus}: {row}"
        assert "n/a" in row, f"N={num_gpus}: no max_memory_allocated off CUDA: {row}"

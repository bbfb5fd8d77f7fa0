"""The planner, and the job limits the API shares with the workers, load with the standard library
alone: no torch, no Ray, no pydantic."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A child interpreter whose importer refuses every module outside the standard
# library and this project, then plans the seed's worked example.
_CHILD = r"""
import sys

class RefuseThirdParty:
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top not in sys.stdlib_module_names and top != "workers":
            raise ImportError(f"workers.memory imported third-party module {name!r}")
        return None

sys.meta_path.insert(0, RefuseThirdParty())
from workers.memory import GB, Workload, plan
result = plan(Workload.from_num_params(7_500_000_000), num_gpus=64, gpu_memory_bytes=80 * GB)
assert result.per_gpu.total_bytes == 31_406_250_000, result
import workers.limits  # service/schemas.py takes its defaults and bounds from there
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in {"torch", "ray", "pydantic", "numpy"})
assert not loaded, loaded
print("ok")
"""


def test_memory_model_imports_only_the_standard_library():
    out = subprocess.run(
        [sys.executable, "-S", "-c", _CHILD], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"

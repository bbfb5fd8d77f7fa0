"""The planner, and what the API shares with the workers (a job's configuration and limits, the rows
and errors ranks report, the checkpoint layout), load with the standard library alone: no torch,
no Ray, no pydantic. The API process itself never loads torch, and a rank of the built-in models
never loads torch._dynamo.

Packages: workers.memory, workers.config, workers.runtime, service.main.
"""

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
from workers.memory.fit import plan
from workers.memory.model import GB, Workload
result = plan(Workload.from_num_params(7_500_000_000), num_gpus=64, gpu_memory_bytes=80 * GB)
assert result.per_gpu.total_bytes == 31_406_250_000, result
import workers.limits  # service/schemas/requests.py takes its defaults and bounds from there
# the control plane builds and reads these
import workers.config, workers.records, workers.training.checkpoints, workers.memory.specs
import workers.data.datafiles  # the API checks a dataset's paths with it
# untrusted work, in children
import workers.runtime.sandbox, workers.runtime.child, workers.runtime.isolated, workers.runtime.rendezvous
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in {"torch", "ray", "pydantic", "numpy"})
assert not loaded, loaded
print("ok")
"""


def test_memory_model_imports_only_the_standard_library():
    out = subprocess.run([sys.executable, "-S", "-c", _CHILD], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


_API = r"""
import sys
import service.main, service.cli
from service.main import create_app
create_app()  # the routes, the dashboard, the settings: still no torch (nor transformers, which loads it)
print(sorted(m for m in sys.modules if m.partition(".")[0] in ("torch", "transformers")))
"""


def test_the_api_process_does_not_import_torch():
    """Plans, lists and submits need no torch: only Ray workers load it (340 MB of RSS otherwise)."""
    out = subprocess.run([sys.executable, "-c", _API], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_embedded_cluster_counts_gpus_without_torch(tmp_path, monkeypatch):
    from service.planning.capacity import _cuda_device_count

    driver = tmp_path / "gpus"
    assert _cuda_device_count(str(driver)) == 0  # no driver: logical GPUs instead
    for bus in ("0000:17:00.0", "0000:65:00.0", "0000:ca:00.0"):
        (driver / bus).mkdir(parents=True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _cuda_device_count(str(driver)) == 3
    for visible, count in (("0,2", 2), ("1,-1,2", 1), ("", 0), ("GPU-8d1f", 1), ("0,1,2,3", 3)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert _cuda_device_count(str(driver)) == count, visible


_RANK = r"""
import sys
import torch.distributed as dist
sys.path.insert(0, "tests")
from helpers import job_body
from service.schemas.requests import JobSpec
from workers.training.loop import train

dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}/store", rank=0, world_size=1)
for model in ({}, {"model": {"kind": "mlp", "sizes": [16, 32, 16]}}):
    body = job_body(steps=12, checkpoint_every=5, **model)
    train(JobSpec.model_validate(body).to_config(checkpoint_dir=f"{sys.argv[1]}/{len(model)}"), rank=0, world_size=1)
print(sorted(m for m in sys.modules if m.startswith("torch._dynamo")))
"""


def test_a_rank_trains_the_built_in_models_without_loading_torch_dynamo(tmp_path):
    """torch._dynamo costs a rank about 1 s of CPU to import, and nothing a rank of the built-in
    models runs compiles: the optimizer's param groups and the step's memory count (a dispatch
    mode, every few steps on CPU) leave out torch's lazy guards that would load it."""
    out = subprocess.run(
        [sys.executable, "-c", _RANK, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


_PARENT = r"""
import sys
# a rank's parent, a task's: Ray, never torch
import workers.runtime.actors, workers.runtime.rank_actor, workers.runtime.rank_parent, workers.runtime.isolated
print(sorted(m for m in sys.modules if m.partition(".")[0] in ("torch", "transformers")))
"""


def test_a_ranks_parent_and_a_tasks_do_not_import_torch():
    """The trusted side of a rank and of a trace stays small: torch and the model load in the child."""
    out = subprocess.run([sys.executable, "-c", _PARENT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

"""Ray tasks the control plane sends to the cluster's nodes to learn what they have: a GPU's
memory, a checkpoint directory's writability."""

from __future__ import annotations

import ray


@ray.remote(num_gpus=0.01, num_cpus=0)
def probe_gpu_memory_bytes() -> int | None:
    """Total memory of the GPU this task lands on; None where the GPUs are logical (no CUDA)."""
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


@ray.remote(num_cpus=0)
def probe_writable(path: str) -> str | None:
    """None when this node can create, write and delete a file under path; else why not."""
    import os
    import tempfile

    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".zero1-probe-"):
            pass
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"
    return None

"""Defaults and bounds of a job that the API checks and the workers apply, one source of each.

Standard library only (and workers.memory, which is too): service/schemas/requests.py takes them
from here without loading torch.

May import: workers.memory.
"""

from __future__ import annotations

# the memory model counts a stage-2 rank's gradient buckets, so their default cap lives in its room
from workers.memory.buckets import DEFAULT_BUCKET_CAP_MB as DEFAULT_BUCKET_CAP_MB

DEFAULT_MAX_NONFINITE_STEPS = 50
"""Steps in a row whose global gradient norm may be nan or inf (each one skipped) before a run
fails. Above the 16 that fp16's loss scaler may skip in a row while its scale comes down from
2**16 to 1 (workers/zero/loss_scale.py, DynamicLossScaler), with room for a scale that has grown since."""

MIN_BUCKET_CAP_MB = 1.0
"""Smallest bucket_cap_mb a job or ZeRO1AdamW accepts, MiB: DDP's first bucket, the smallest it
ever makes (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES). The cap also sizes the slices of the
fused update, so each bucket costs a send per peer and each slice a kernel launch, every step:
a cap of a few bytes meant one of each per element."""

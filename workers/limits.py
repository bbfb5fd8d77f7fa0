"""Defaults and bounds of a job that the API checks and the workers apply, one source of each.

Standard library only: service/schemas.py takes them from here without loading torch.
"""

from __future__ import annotations

DEFAULT_MAX_NONFINITE_STEPS = 50
"""Steps in a row whose global gradient norm may be nan or inf (each one skipped) before a run
fails. Above the 16 that fp16's loss scaler may skip in a row while its scale comes down from
2**16 to 1 (workers/optim.py, DynamicLossScaler), with room for a scale that has grown since."""

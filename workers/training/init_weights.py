"""A job started from another job's weights (TrainConfig.init_from): the child loads the copy of the
source job's final/model.safetensors that its parent fetched and checked against the digest the service
recorded (workers/training/staging.py), with fresh optimizer state.

Choice points:
- Only a run that starts at step 0 loads them. A retried, preempted, suspended or resized job resumes
  from its own latest checkpoint (its own steps since the start are in it); one that failed before
  its first checkpoint starts over, from the same weights.
- The weights are final/'s fp32 master weights: they become the optimizer's master copy exactly (the
  model's 16-bit parameters are their rounding), through the optimizer's consolidated-state load with
  zero moments and step 0 (Adam's bias correction starts over). Frozen parameters and persistent
  buffers are copied into the model as they are.
- Names and shapes must match the model's, tensor for tensor (an hf model's are its `lm`'s, as
  final/ writes them); the first that does not fails the run with FieldError("init_from.job"), the
  message the API's 422 gives where it can check before the run (built-in models).
"""

from __future__ import annotations

from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor, nn

from workers.config import FieldError, InitSpec
from workers.memory.specs import first_mismatch
from workers.zero.consolidated import CONSOLIDATED_FORMAT, hyperparameters
from workers.zero.optimizer import ZeRO1AdamW

WEIGHTS = "model.safetensors"
FIELD = "init_from.job"


def saved_module(model: nn.Module) -> tuple[nn.Module, str]:
    """The module whose state final/ holds, and its names' prefix in `model`: a Hugging Face `lm`'s
    (save_pretrained's layout), else the model's own (workers/training/artifacts.py's rule)."""
    lm = getattr(model, "lm", None)
    return (lm, "lm.") if lm is not None and hasattr(lm, "save_pretrained") else (model, "")


def saved_tensors(module: nn.Module) -> dict[str, Tensor]:
    """Its state dict as final/ writes it: every tensor once, under its first name (a tied weight once)."""
    tensors: dict[int, tuple[str, Tensor]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        tensors.setdefault(id(tensor), (name, tensor))
    return dict(tensors.values())


def load_initial_weights(model: nn.Module, opt: ZeRO1AdamW, init: InitSpec) -> None:
    """Load the checked copy at init.path into `model` and `opt` (every rank calls it, before its first
    step); FieldError naming init_from.job when a name or shape differs."""
    if init.path is None:
        raise FieldError(FIELD, f"job {init.job}'s weights were not fetched for this rank")
    module, prefix = saved_module(model)
    tensors = saved_tensors(module)
    with safe_open(init.path, framework="pt") as file:
        shapes = {name: tuple(file.get_slice(name).get_shape()) for name in file.keys()}  # noqa: SIM118
        why = first_mismatch(
            {name: tuple(t.shape) for name, t in tensors.items()}, shapes, source=f"job {init.job}'s final weights"
        )
        if why is not None:
            raise FieldError(FIELD, why)
        trained = {id(p) for group in opt.param_groups for p in group["params"]}
        with torch.no_grad():
            for name, tensor in tensors.items():  # what the optimizer does not hold
                if id(tensor) not in trained:
                    tensor.copy_(file.get_tensor(name))
        opt.load_consolidated_state_dict(_fresh_state(opt, file, prefix=prefix))


def _fresh_state(opt: ZeRO1AdamW, file: Any, *, prefix: str) -> dict[str, Any]:
    """The consolidated form (workers/zero/consolidated.py) of the file's weights as master copies, with
    zero moments (one element, expanded: no memory per parameter) and step 0; the optimizer's own
    hyperparameters and no loss scaler state (a fresh scaler)."""
    params = {}
    for group in opt.param_groups:
        for name, param in zip(group["param_names"], group["params"], strict=True):
            zeros = torch.zeros(1, dtype=torch.float32).expand(param.numel())
            master = file.get_tensor(name.removeprefix(prefix)).float()
            params[name] = {"master": master, "exp_avg": zeros, "exp_avg_sq": zeros, "step": 0}
    groups = [{**group, "params": []} for group in hyperparameters(opt.param_groups)]
    return {"format": CONSOLIDATED_FORMAT, "param_groups": groups, "loss_scaler": None, "params": params}

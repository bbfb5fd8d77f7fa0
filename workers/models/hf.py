"""Hugging Face transformers causal LMs: configs resolved offline, models built for a rank or
traced for a plan, and called as zero1 calls a model: model(input_ids, labels) -> loss.

Nothing is ever downloaded: a config is built from its fields (`AutoConfig.for_model`) or read
from a local save_pretrained directory. The service never imports this room (transformers loads
torch); it runs in a trace's Ray task and in the ranks.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from workers.config import HFSpec, InvalidModelError
from workers.data.digests import check_digest, directory_digest
from workers.memory.buckets import DEFAULT_BUCKET_CAP_MB
from workers.models.trace import StepTrace, trace_layers

MAX_LAYERS = 10_000
"""Deepest model traced: its modules are built on the meta device (Python objects, not tensors)."""
ATTENTION = "sdpa"
"""Attention implementation of every hf model: torch's fused scaled_dot_product_attention."""


class CausalLM(nn.Module):
    """A transformers causal LM (attribute `lm`) called as zero1 calls a model."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        """Mean next-token cross-entropy. labels[:, t] is the target of input_ids[:, t]: zero1's
        batches are shifted already, so shift_labels keeps transformers from shifting them again; no KV
        cache is kept (training never decodes)."""
        labels = labels.contiguous()  # a slice of the batch's tokens; transformers' loss views it flat
        return self.lm(input_ids=input_ids, labels=labels, shift_labels=labels, use_cache=False).loss


def resolve_config(
    *, config: dict[str, Any] | None = None, path: str | None = None, roots: Sequence[str] | None = None
):
    """The transformers config of `config` (config.json's fields, with model_type) or of the
    save_pretrained directory `path`; InvalidModelError naming the field transformers refused."""
    from transformers import AutoConfig

    if config is not None:
        fields = dict(config)
        model_type = fields.pop("model_type", None)
        if not isinstance(model_type, str):
            raise InvalidModelError("model.config", f"needs model_type (a string), got {model_type!r}")
        try:
            return AutoConfig.for_model(model_type, **fields)
        except Exception as exc:  # transformers' own validation: its message is the user's to read
            raise InvalidModelError("model.config", _message(exc)) from exc
    real = model_dir(path, roots=roots)
    try:
        return AutoConfig.from_pretrained(real, local_files_only=True)
    except Exception as exc:
        raise InvalidModelError("model.path", f"{path!r}: {_message(exc)}") from exc


def model_dir(path: str, *, roots: Sequence[str] | None) -> str:
    """`path` resolved (symlinks followed), checked again where it is read: inside one of
    `roots` (None: anywhere) and a directory."""
    real = os.path.realpath(path)
    if roots is not None:
        resolved = [os.path.realpath(root) for root in roots]
        if not any(os.path.commonpath([real, root]) == root for root in resolved):
            raise InvalidModelError(
                "model.path", f"{path!r} resolves to {real}, outside the model roots {resolved} (ZERO1_MODEL_ROOTS)"
            )
    if not os.path.isdir(real):
        raise InvalidModelError("model.path", f"no such directory: {path!r}")
    return real


def model_shape(config) -> tuple[int, int]:
    """(vocab_size, max_position_embeddings) of a config (its text model's, for a multimodal one)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab_size = getattr(text, "vocab_size", None)
    max_positions = getattr(text, "max_position_embeddings", None)
    if not isinstance(vocab_size, int) or not isinstance(max_positions, int) or min(vocab_size, max_positions) < 1:
        raise InvalidModelError(
            "model.config",
            f"needs a positive vocab_size and max_position_embeddings, got {vocab_size!r} and {max_positions!r}",
        )
    return vocab_size, max_positions


def with_depth(config, num_layers: int):
    """A copy of `config` with `num_layers` hidden layers (per-layer lists cut to match)."""
    shallow = copy.deepcopy(config)
    shallow.num_hidden_layers = num_layers
    if isinstance(getattr(shallow, "layer_types", None), list):
        shallow.layer_types = shallow.layer_types[:num_layers]
    return shallow


def from_config(config, *, activation_checkpointing: bool = False) -> CausalLM:
    """A randomly initialised model of `config` (on the current default device), in training mode."""
    from transformers import AutoModelForCausalLM

    try:
        lm = AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION)
    except Exception as exc:  # e.g. a model_type with no causal LM
        raise InvalidModelError("model.config", f"transformers cannot build it: {_message(exc)}") from exc
    return _for_training(lm, activation_checkpointing=activation_checkpointing)


def _for_training(lm: nn.Module, *, activation_checkpointing: bool) -> CausalLM:
    lm.train()  # from_pretrained returns the model in eval mode: no checkpointing, no dropout
    if getattr(lm, "loss_type", None) is None:  # the loss transformers picks then, named: it warns on every rank
        lm.loss_type = "ForCausalLM"
    if activation_checkpointing:
        # transformers' own switch (renamed in 5.x; the old name warns), non-reentrant by default
        enable = getattr(lm, "activation_checkpointing_enable", None) or lm.gradient_checkpointing_enable
        enable()
    return CausalLM(lm)


def build_hf(
    spec: HFSpec,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
    activation_checkpointing: bool = False,
) -> CausalLM:
    """A rank's model: `config` initialised from `seed` (the same on every rank), or `path`'s
    weights, once its files are checked against the digest they had at admission (DigestError, a
    ValueError naming model.path, when they differ); in `dtype` on `device`."""
    if spec.config is not None:
        config = resolve_config(config=spec.config)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = from_config(config, activation_checkpointing=activation_checkpointing)
        return model.to(device=device, dtype=dtype)
    from transformers import AutoModelForCausalLM

    real = model_dir(spec.path, roots=spec.roots)
    if spec.digest is not None:  # the very files that were planned, with no link among them
        check_digest(directory_digest(real, field="model.path"), expected=spec.digest, field="model.path", path=real)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # a bar a rank, redrawn into every rank's log
    try:
        lm = AutoModelForCausalLM.from_pretrained(
            real, dtype=dtype, attn_implementation=ATTENTION, local_files_only=True
        )
    except Exception as exc:
        raise InvalidModelError("model.path", f"{spec.path!r}: {_message(exc)}") from exc
    return _for_training(lm, activation_checkpointing=activation_checkpointing).to(device=device, dtype=dtype)


def trace_hf(
    config,
    *,
    precision_dtype: torch.dtype,
    micro_batch_size: int,
    seq_len: int,
    activation_checkpointing: bool = False,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
) -> StepTrace:
    """One micro-batch of `config`'s training step on fake tensors, its depth extrapolated from
    two shallow traces (workers/models/trace.py); the parameters and stage 2's buckets (of
    bucket_cap_mb MiB) counted on the whole model."""
    num_layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(num_layers, int) or not 1 <= num_layers <= MAX_LAYERS:
        raise InvalidModelError("model.config", f"needs num_hidden_layers in [1, {MAX_LAYERS}], got {num_layers!r}")
    with torch.device("meta"):  # a config transformers cannot build is the user's error, named as such
        from_config(config)
    return trace_layers(
        lambda num_layers: from_config(
            with_depth(config, num_layers), activation_checkpointing=activation_checkpointing
        ),
        lambda: tuple(torch.zeros(micro_batch_size, seq_len, dtype=torch.long) for _ in range(2)),  # ids, labels
        dtype=precision_dtype,
        num_layers=num_layers,
        bucket_cap_mb=bucket_cap_mb,
    )


def _message(exc: Exception) -> str:
    """An exception's text on one line, bounded (transformers' validation errors span several)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:500]

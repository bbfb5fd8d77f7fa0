"""What a plan or job trains: the API's model specs (gpt, mlp, hf, python), each converted once into the
workers' spec by its to_spec()."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from service.schemas.fields import Body, Int, Text, no_nul, resolved_roots
from workers.config import FieldError, HFSpec, PythonSpec
from workers.memory import model as memory


class GPTModelSpec(Body):
    """A GPT-2-style decoder (tied LM head, biases, pre-LayerNorm)."""

    kind: Literal["gpt"]
    vocab_size: Int = Field(ge=1, le=10_000_000)
    n_layer: Int = Field(ge=1, le=100_000)
    n_head: Int = Field(ge=1, le=100_000)
    n_embd: Int = Field(ge=1, le=10_000_000)
    block_size: Int = Field(ge=1, le=100_000_000)

    @field_validator("n_embd")
    @classmethod
    def _heads_divide_width(cls, n_embd: int, info) -> int:
        n_head = info.data.get("n_head")
        if n_head and n_embd % n_head:
            raise ValueError(
                f"n_embd ({n_embd}) must be divisible by n_head ({n_head}): {n_embd} % {n_head} = {n_embd % n_head}"
            )
        return n_embd

    def to_spec(self) -> memory.GPTSpec:
        return memory.GPTSpec(**self.model_dump(exclude={"kind"}))


class MLPModelSpec(Body):
    """Linear layers of the given widths with ReLU between them."""

    kind: Literal["mlp"]
    sizes: list[Annotated[Int, Field(ge=1, le=10_000_000)]] = Field(min_length=2, max_length=10_000)

    def to_spec(self) -> memory.MLPSpec:
        return memory.MLPSpec(sizes=tuple(self.sizes))


MAX_CONFIG_DEPTH = 32
"""Nesting an hf model's config may have (config.json's are a few levels deep)."""


def _json_safe(value: Any, *, where: str = "config", depth: int = 0) -> None:
    """A stored spec must be JSON every database takes: no NUL in a string or key, no nan or inf."""
    if depth > MAX_CONFIG_DEPTH:
        raise ValueError(f"{where} is nested more than {MAX_CONFIG_DEPTH} levels deep")
    if isinstance(value, str):
        no_nul(value)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} must be finite, got {value}")
    elif isinstance(value, dict):
        for key, item in value.items():
            no_nul(key)
            _json_safe(item, where=f"{where}.{key}", depth=depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _json_safe(item, where=f"{where}[{i}]", depth=depth + 1)


class HFModelSpec(Body):
    """A Hugging Face transformers causal LM: exactly one of config or path. Nothing is downloaded."""

    kind: Literal["hf"]
    config: dict[str, Any] | None = Field(
        None, description="config.json's fields, with model_type: a randomly initialised model (the job's seed)."
    )
    path: Text | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="A save_pretrained directory (config and weights) inside ZERO1_MODEL_ROOTS: fine-tuning.",
    )
    digest: Text | None = Field(
        None,
        pattern=r"^sha256:[0-9a-f]{64}$",
        description="sha256 of path's files (names and contents), filled in at admission; given, the directory "
        "must still have it. A rank checks it again before it loads the weights.",
    )

    @field_validator("config")
    @classmethod
    def _has_model_type(cls, config: dict[str, Any] | None) -> dict[str, Any] | None:
        if config is None:
            return None
        if not isinstance(config.get("model_type"), str) or not config["model_type"]:
            raise ValueError(
                f"needs model_type, a transformers model type such as 'llama', got {config.get('model_type')!r}"
            )
        _json_safe(config)
        return config

    @model_validator(mode="after")
    def _one_source(self) -> HFModelSpec:
        if (self.config is None) == (self.path is None):
            given = "both" if self.config is not None else "neither"
            raise FieldError("path", f"exactly one of model.config or model.path is required, got {given}")
        if self.digest is not None and self.path is None:
            raise FieldError("digest", "model.digest applies to a model.path only")
        return self

    def to_spec(self, *, vocab_size: int, block_size: int, model_roots: Sequence[str] = ()) -> HFSpec:
        """With the model roots resolved here, for the ranks to check `path` again where they read it."""
        return HFSpec(
            config=self.config,
            path=self.path,
            roots=resolved_roots(model_roots),
            digest=self.digest,
            vocab_size=vocab_size,
            block_size=block_size,
        )


ENTRYPOINT_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
CODE_PATTERN = r"^sha256:[0-9a-f]{64}$"


class PythonModelSpec(Body):
    """A model of the user's own code, from the job's code bundle: entrypoint(**args) returns a
    torch.nn.Module whose model(input_ids, labels) is the mean loss. Always planned by its trace."""

    kind: Literal["python"]
    entrypoint: Text = Field(
        max_length=300,
        pattern=ENTRYPOINT_PATTERN,
        description="package.module:function in the code bundle, e.g. tinylm.model:build.",
    )
    args: dict[str, Any] = Field(default_factory=dict, description="The function's keyword arguments (JSON).")
    vocab_size: Int | None = Field(
        None,
        ge=1,
        le=10_000_000,
        description="Token ids the model takes; default: the rows of the nn.Embedding that looks up input_ids.",
    )

    @field_validator("args")
    @classmethod
    def _storable(cls, args: dict[str, Any]) -> dict[str, Any]:
        _json_safe(args, where="args")
        return args

    def to_spec(self, *, code: str, vocab_size: int, block_size: int) -> PythonSpec:
        return PythonSpec(
            entrypoint=self.entrypoint, args=self.args, code=code, vocab_size=vocab_size, block_size=block_size
        )


ModelSpec = Annotated[GPTModelSpec | MLPModelSpec | HFModelSpec | PythonModelSpec, Field(discriminator="kind")]
MODEL_KINDS = ("gpt", "mlp", "hf", "python")
TracedModelSpec = HFModelSpec | PythonModelSpec
"""The kinds planned by their trace only (no closed forms)."""

"""What a job trains on: the API's data specs (synthetic, text, dataset), each converted once into the
workers' data source by its to_spec()."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import Field, model_validator

from service.schemas.fields import Body, Float, Int, Text, resolved_roots
from workers.config import DATASET_FORMATS, DatasetSpec, FieldError, SyntheticSpec, TextSpec, default_of


class SyntheticDataSpec(Body):
    """A random Markov chain over the vocabulary (GPT) or a random teacher's labels (MLP)."""

    kind: Literal["synthetic"]
    branching: Int = Field(
        default_of(SyntheticSpec, "branching"), ge=1, le=1_000_000, description="Successors per token: lower is easier."
    )

    def to_spec(self, *, data_roots: Sequence[str] = (), cache_dir: str | None = None) -> SyntheticSpec:
        return SyntheticSpec(branching=self.branching)


class TextDataSpec(Body):
    """Characters of a UTF-8 file readable by the workers."""

    kind: Literal["text"]
    path: Text = Field(min_length=1, max_length=4096)

    def to_spec(self, *, data_roots: Sequence[str] = (), cache_dir: str | None = None) -> TextSpec:
        """With the data roots resolved here (a relative root is under the service's working directory),
        for the ranks to check again where they read the file: none given, they read none."""
        return TextSpec(path=self.path, roots=tuple(os.path.realpath(r) for r in data_roots if "://" not in r))


def _dataset(name: str):
    return default_of(DatasetSpec, name)


class DatasetDataSpec(Body):
    """Files (local, or on an object store) read with `datasets`, tokenized once (cached on the checkpoint
    storage), packed into seq_len + 1 blocks in a seeded order that does not depend on num_gpus."""

    kind: Literal["dataset"]
    format: Literal[DATASET_FORMATS]
    path: Text = Field(
        min_length=1,
        max_length=4096,
        description="A file, a directory or a glob, inside ZERO1_DATA_ROOTS (s3://bucket/... inside an s3:// root).",
    )
    text_field: Text = Field(
        _dataset("text_field"), min_length=1, max_length=200, description="The column read (text format: text)."
    )
    tokenizer: Text | None = Field(
        _dataset("tokenizer"),
        min_length=1,
        max_length=4096,
        description="A tokenizer.json or its directory inside ZERO1_DATA_ROOTS, or bytes (UTF-8 bytes, EOS 256); "
        "omitted: an hf model's own (its path's directory).",
    )
    tokenizer_digest: Text | None = Field(
        None,
        pattern=r"^sha256:[0-9a-f]{64}$",
        description="sha256 of the tokenizer's files, filled in at admission; given, they must still have it. "
        "A rank checks it again before it loads the tokenizer.",
    )
    token_uri: Text | None = Field(
        None,
        max_length=4096,
        description="Filled in at admission for data on an object store: the token file its check stored in "
        "the store's token cache, which the ranks fetch instead of the data. A given value is replaced.",
    )
    validation_fraction: Float = Field(
        _dataset("validation_fraction"), ge=0, le=0.5, allow_inf_nan=False, description="Blocks held out."
    )

    @model_validator(mode="after")
    def _text_reads_text(self) -> DatasetDataSpec:
        if self.format == "text" and self.text_field != "text":
            raise FieldError(
                "text_field", f"text_field ({self.text_field!r}) only applies to jsonl, parquet and csv: text is text"
            )
        if self.tokenizer_digest is not None and self.tokenizer in (None, "bytes"):
            raise FieldError(
                "tokenizer_digest",
                f"tokenizer_digest applies to a tokenizer file or directory, not to {self.tokenizer!r}",
            )
        return self

    def to_spec(self, *, data_roots: Sequence[str] = (), cache_dir: str | None = None) -> DatasetSpec:
        """With the data roots resolved here, for the ranks to check again where they read; cache_dir
        is the checkpoint storage's datasets/ directory."""
        return DatasetSpec(
            **self.model_dump(exclude={"kind"}),
            roots=resolved_roots(data_roots),
            cache_dir=cache_dir,
        )


DataSpec = Annotated[SyntheticDataSpec | TextDataSpec | DatasetDataSpec, Field(discriminator="kind")]
DATA_KINDS = ("synthetic", "text", "dataset")

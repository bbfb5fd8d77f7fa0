"""The `dataset` data kind: local files read with `datasets`, tokenized once into a cached token
file, packed into seq_len + 1 blocks, in a seeded order that does not depend on the world size.

The token stream is every document's tokens followed by the EOS token (documents in file order,
files sorted by path; empty documents skipped), cut into B = num_tokens // (seq_len + 1) blocks
that do not overlap (the tail shorter than a block is dropped). A seeded permutation of the block
ids holds out its first V = ceil(validation_fraction * B) for evaluation; the rest, in that order,
is `perm`, and sample i of step s is block perm[(s * G + i) mod len(perm)] for global batch G: the
same for any N, so a resume or resize continues at exactly the next sample.

The token file is keyed by the files' contents, the tokenizer's and the field read
(`<cache_dir>/tokens/<sha256>.bin`, flat little-endian uint16, or uint32 above 65,536 tokens, with
a JSON sidecar); written atomically, so ranks that find it absent may each write it and every rank
memory-maps the same bytes. The service trims the cache to ZERO1_TOKEN_CACHE_MAX_BYTES
(service/store/token_cache.py), least recently used first, by the sidecars' mtimes, which a hit touches:
a rank that finds its entry gone tokenizes it again.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from torch import Tensor

from workers.config import DatasetSpec
from workers.data.datafiles import BYTES, resolve_files, resolve_tokenizer
from workers.data.digests import check_digest, tokenizer_digest
from workers.records import DatasetSummary

CACHE_VERSION = 1
"""Bumped when the token stream of the same files and tokenizer would change."""
EOS_TOKENS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
"""The EOS rule, when the tokenizer's directory has no tokenizer_config.json naming its eos_token:
the first of these in its vocabulary."""
MAX_TOKENIZER_BYTES = 256 << 20
_ROWS_PER_BATCH = 1000
_HASH_CHUNK_BYTES = 1 << 20

tokenizations = 0
"""Token files this process has made (not found in the cache): what the tests count."""


class ByteTokenizer:
    """One token per UTF-8 byte (0-255), EOS 256."""

    vocab_size = 257
    eos_id = 256
    digest = BYTES

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode(), dtype=np.uint8) for text in texts]


class FileTokenizer:
    """A `tokenizers` tokenizer.json; its EOS as EOS_TOKENS says."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        with open(path, "rb") as file:
            data = file.read(MAX_TOKENIZER_BYTES + 1)
        if len(data) > MAX_TOKENIZER_BYTES:
            raise ValueError(f"data.tokenizer: {path} is above the limit of {MAX_TOKENIZER_BYTES} bytes")
        self.digest = hashlib.sha256(data).hexdigest()  # of the very bytes loaded below
        try:
            self.tokenizer = Tokenizer.from_str(data.decode())
        except Exception as exc:  # noqa: BLE001  (tokenizers raises a bare Exception for a file it cannot parse)
            raise ValueError(f"data.tokenizer: {path} is not a tokenizer.json that `tokenizers` loads: {exc}") from None
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        self.eos_id = _eos_id(vocab, config=Path(path).with_name("tokenizer_config.json"), path=path)

    def encode(self, texts: list[str]) -> list[list[int]]:
        # no special tokens: a post-processor's BOS/EOS would be added per document; EOS is joined here
        return [encoding.ids for encoding in self.tokenizer.encode_batch(texts, add_special_tokens=False)]


def _eos_id(vocab: dict[str, int], *, config: Path, path: str) -> int:
    """The eos_token of tokenizer_config.json beside the tokenizer, else the first of EOS_TOKENS."""
    named = None
    if config.is_file():
        try:
            named = json.loads(config.read_text()).get("eos_token")
        except (OSError, ValueError, AttributeError):
            named = None
        named = named.get("content") if isinstance(named, dict) else named
    for token in ([named] if isinstance(named, str) else []) + list(EOS_TOKENS):
        if token in vocab:
            return vocab[token]
    raise ValueError(f"data.tokenizer: {path} has no EOS token (none of {list(EOS_TOKENS)} is in its vocabulary)")


Tokenizer = ByteTokenizer | FileTokenizer


def load_tokenizer(spec: DatasetSpec, *, tokenizer_dir: str | None = None) -> Tokenizer:
    """spec.tokenizer, resolved inside the roots; None: tokenizer_dir's (an hf model's directory)."""
    if spec.tokenizer == BYTES:
        return ByteTokenizer()
    if spec.tokenizer is not None:
        path = resolve_tokenizer(spec.tokenizer, roots=spec.roots)
        if spec.tokenizer_digest is not None:  # the tokenizer that was admitted (workers/data/digests.py)
            check_digest(tokenizer_digest(path), expected=spec.tokenizer_digest, field="data.tokenizer", path=path)
        return FileTokenizer(path)
    if tokenizer_dir is None:
        raise ValueError(
            "data.tokenizer: required ('bytes', or a tokenizer.json or its directory inside the data roots) "
            "unless the model is an hf model with a path"
        )
    return FileTokenizer(resolve_tokenizer(tokenizer_dir, roots=None))  # the model roots were checked for it


# --------------------------------------------------------------------------- the token file


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenFile:
    tokens: np.ndarray
    """(num_tokens,) the token stream, memory-mapped from the cache (in memory without one)."""
    path: str | None
    vocab_size: int
    eos_id: int
    created: bool
    """Tokenized now, not found in the cache."""


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def cache_key(files: Sequence[str], *, spec: DatasetSpec, tokenizer: Tokenizer) -> str:
    """sha256 over each file's content digest, the tokenizer's digest, the format and the field read."""
    parts = [CACHE_VERSION, [_file_digest(f) for f in files], tokenizer.digest, spec.format, _field(spec)]
    return hashlib.sha256(json.dumps(parts, separators=(",", ":")).encode()).hexdigest()


def _file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _field(spec: DatasetSpec) -> str:
    return "text" if spec.format == "text" else spec.text_field


def prepare_tokens(spec: DatasetSpec, *, tokenizer: Tokenizer) -> TokenFile:
    """The dataset's token stream: from the cache when its key is there, else tokenized (and cached)."""
    dtype = token_dtype(tokenizer.vocab_size)
    meta = {"vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id, "dtype": dtype.str}
    if spec.token_uri is not None and spec.cache_dir is not None:  # fetched by this rank's parent: no data read
        key = spec.token_uri.rpartition("/")[2].removesuffix(".bin")
        path = Path(spec.cache_dir, "tokens", f"{key}.bin")
        sidecar = Path(spec.cache_dir, "tokens", f"{key}.json")
        if (found := _cached(path, sidecar, meta=meta)) is not None:
            return TokenFile(tokens=found, path=str(path), created=False, **_public(meta))
    files = resolve_files(spec.path, format=spec.format, roots=spec.roots)  # again, where this rank reads
    if spec.cache_dir is None:
        with tempfile.TemporaryFile() as out:
            num_tokens = _tokenize(files, spec=spec, tokenizer=tokenizer, out=out, dtype=dtype)
            out.seek(0)
            tokens = np.frombuffer(out.read(), dtype=dtype)
        return TokenFile(tokens=tokens, path=None, created=True, **_public(meta))
    directory = Path(spec.cache_dir) / "tokens"
    key = cache_key(files, spec=spec, tokenizer=tokenizer)
    path = directory / f"{key}.bin"
    sidecar = directory / f"{key}.json"
    found = _cached(path, sidecar, meta=meta)
    if found is not None:
        return TokenFile(tokens=found, path=str(path), created=False, **_public(meta))
    if not _writable(directory):  # a child under its owner's uid (ZERO1_RUN_AS): the cache is the service's
        spill = os.path.join(tempfile.gettempdir(), "zero1-cache")  # the child's own (workers/runtime/isolated.py)
        return prepare_tokens(replace(spec, cache_dir=None if spec.cache_dir == spill else spill), tokenizer=tokenizer)
    directory.mkdir(parents=True, exist_ok=True)
    with _atomic(path) as out:
        num_tokens = _tokenize(files, spec=spec, tokenizer=tokenizer, out=out, dtype=dtype)
    with _atomic(sidecar) as out:  # the sidecar last: its presence says the token file is whole
        out.write(json.dumps({**meta, "num_tokens": num_tokens, "version": CACHE_VERSION, "files": files}).encode())
    return TokenFile(tokens=_map(path, dtype, num_tokens), path=str(path), created=True, **_public(meta))


def _writable(directory: Path) -> bool:
    """Whether this process may create files in `directory` (or, while it does not exist, in the
    nearest directory above it that does)."""
    try:
        while not directory.exists() and directory != directory.parent:
            directory = directory.parent
    except PermissionError:  # a directory above it this process cannot search: not its to write
        return False
    return os.access(directory, os.W_OK)


def _public(meta: dict) -> dict:
    return {"vocab_size": meta["vocab_size"], "eos_id": meta["eos_id"]}


def _cached(path: Path, sidecar: Path, *, meta: dict) -> np.ndarray | None:
    """The cached token stream, or None when absent or not whole (then it is made again); a hit
    touches the sidecar, whose mtime is the entry's last use for the service's LRU trim."""
    try:
        stored = json.loads(sidecar.read_text())
        num_tokens = int(stored["num_tokens"])
        whole = path.stat().st_size == num_tokens * np.dtype(meta["dtype"]).itemsize
        if not whole or stored.get("version") != CACHE_VERSION or any(stored.get(k) != v for k, v in meta.items()):
            return None
        tokens = _map(path, np.dtype(meta["dtype"]), num_tokens)  # once mapped, an eviction cannot take it away
    except (OSError, ValueError, KeyError, TypeError):  # evicted under us too: made again
        return None
    _touch(sidecar)
    return tokens


def _touch(sidecar: Path) -> None:
    """Mark a cache entry used now; best effort (an entry another uid wrote may refuse it)."""
    with suppress(OSError):
        os.utime(sidecar)


def _map(path: Path, dtype: np.dtype, num_tokens: int) -> np.ndarray:
    return np.memmap(path, dtype=dtype, mode="r", shape=(num_tokens,))


@contextmanager
def _atomic(path: Path) -> Iterator[BinaryIO]:
    """A file written under a temporary name and renamed into place once whole (never seen half-written)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        with open(tmp, "wb") as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _tokenize(files: list[str], *, spec: DatasetSpec, tokenizer: Tokenizer, out: BinaryIO, dtype: np.dtype) -> int:
    """Write every document's tokens then EOS to `out`; the number of tokens written."""
    global tokenizations
    num_tokens = 0
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    for texts in _documents(files, spec=spec):
        pieces = []
        for ids in tokenizer.encode(texts):
            pieces += [np.asarray(ids, dtype=dtype), eos]
        if pieces:
            chunk = np.concatenate(pieces)
            out.write(chunk.tobytes())
            num_tokens += len(chunk)
    if num_tokens == 0:
        raise ValueError(f"data.path: {spec.path!r} holds no text in field {_field(spec)!r}: the dataset is empty")
    tokenizations += 1
    return num_tokens


def _documents(files: list[str], *, spec: DatasetSpec) -> Iterator[list[str]]:
    """The non-empty texts of the files, a batch of rows at a time, read with `datasets`."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    field = _field(spec)
    options = {"sample_by": "document"} if spec.format == "text" else {}  # a text file is one document
    builder = "json" if spec.format == "jsonl" else spec.format
    scratch = None if spec.cache_dir is None else Path(spec.cache_dir) / "tmp"
    if scratch is not None:
        scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="zero1-datasets-", dir=scratch) as arrow_cache:
        try:
            table = datasets.load_dataset(builder, data_files=files, split="train", cache_dir=arrow_cache, **options)
        except Exception as exc:  # noqa: BLE001  (any parser's error: pyarrow's, pandas', json's, wrapped by datasets)
            cause = exc.__cause__ or exc
            raise ValueError(f"data.path: {spec.path!r} could not be read as {spec.format}: {cause}") from None
        if field not in table.column_names:
            raise ValueError(
                f"data.text_field: {field!r} is not a column of {spec.path!r} (its columns: {table.column_names})"
            )
        for number, batch in enumerate(table.select_columns([field]).iter(batch_size=_ROWS_PER_BATCH)):
            texts = batch[field]
            wrong = next((t for t in texts if t is not None and not isinstance(t, str)), None)
            if wrong is not None:
                raise ValueError(
                    f"data.text_field: {field!r} holds a {type(wrong).__name__} near row {number * _ROWS_PER_BATCH}, "
                    "not text"
                )
            yield [t for t in texts if t]


# --------------------------------------------------------------------------- packing and order


def held_out_count(validation_fraction: float, num_blocks: int) -> int:
    """ceil(validation_fraction * num_blocks), exact for fractions like 0.01 (no float rounding up)."""
    return math.ceil(round(validation_fraction * num_blocks, 9))


class DatasetSource:
    """A dataset's blocks of seq_len + 1 tokens: the train order and the held-out split."""

    def __init__(
        self,
        *,
        spec: DatasetSpec,
        seq_len: int,
        seed: int,
        vocab_size: int | None = None,
        global_batch_size: int | None = None,
        tokenizer_dir: str | None = None,
    ) -> None:
        tokenizer = load_tokenizer(spec, tokenizer_dir=tokenizer_dir)
        if vocab_size is not None and tokenizer.vocab_size > vocab_size:
            raise ValueError(
                f"data.tokenizer: its vocabulary has {tokenizer.vocab_size} tokens, more than the model's "
                f"vocab_size ({vocab_size})"
            )
        self.token_file = prepare_tokens(spec, tokenizer=tokenizer)
        self.block_len = seq_len + 1
        num_tokens = len(self.token_file.tokens)
        self.num_blocks = num_tokens // self.block_len
        num_held_out = held_out_count(spec.validation_fraction, self.num_blocks)
        # one permutation: its first num_held_out blocks are held out, the rest is the train order
        order = np.random.default_rng(seed).permutation(self.num_blocks)
        self.held_out = order[:num_held_out]
        self.perm = order[num_held_out:]
        need = global_batch_size or 1
        if len(self.perm) < need:
            raise ValueError(
                f"data.path: {spec.path!r} has {num_tokens} tokens: {self.num_blocks} blocks of seq_len + 1 = "
                f"{self.block_len}, {num_held_out} held out (validation_fraction {spec.validation_fraction}), "
                f"leaving {len(self.perm)} train blocks, fewer than one global batch of {need}"
            )

    @property
    def vocab_size(self) -> int:
        return self.token_file.vocab_size

    def train_block_ids(self, step: int, indices: Sequence[int], global_batch: int) -> np.ndarray:
        """perm[(step * global_batch + i) mod len(perm)] for each sample index i of the step."""
        positions = (np.asarray(indices, dtype=np.int64) + step * global_batch) % len(self.perm)
        return self.perm[positions]

    def train_block_tokens(self, step: int, indices: Sequence[int], global_batch: int) -> Tensor:
        """(len(indices), seq_len + 1) int64: the blocks of samples `indices` of step `step`."""
        return self.block_tokens(self.train_block_ids(step, indices, global_batch))

    def held_out_tokens(self, indices: Sequence[int]) -> Tensor:
        """(len(indices), seq_len + 1) int64: held-out blocks, indices taken mod their number."""
        if len(self.held_out) == 0:
            raise ValueError("data.validation_fraction is 0: no blocks are held out to evaluate on")
        return self.block_tokens(self.held_out[np.asarray(indices, dtype=np.int64) % len(self.held_out)])

    def summary(self) -> DatasetSummary:
        return DatasetSummary(
            num_tokens=len(self.token_file.tokens),
            num_blocks=self.num_blocks,
            num_train_blocks=len(self.perm),
            num_held_out_blocks=len(self.held_out),
            vocab_size=self.token_file.vocab_size,
            eos_id=self.token_file.eos_id,
            tokenized=self.token_file.created,
            token_file=self.token_file.path,
        )

    def block_tokens(self, block_ids: np.ndarray) -> Tensor:
        offsets = np.asarray(block_ids, dtype=np.int64)[:, None] * self.block_len + np.arange(self.block_len)
        return torch.from_numpy(self.token_file.tokens[offsets].astype(np.int64))

"""A succeeded run's model, written once to `final/` beside its checkpoints.

The weights are the optimizer's fp32 master weights, gathered to rank 0 one parameter at a time
(ZeRO1AdamW.gather_master_weights: point-to-point pieces of at most CHUNK_NUMEL elements), and
kept in fp32 for fidelity, as DeepSpeed's zero_to_fp32 does: the model's 16-bit parameters are a
rounding of them. No rank ever holds the full fp32 optimizer state, nor the full weights: rank 0
writes each parameter into its place in model.safetensors as it arrives. A model with a Hugging
Face `lm` (the hf kind) is laid out as its save_pretrained lays it out, so that
AutoModelForCausalLM.from_pretrained(final/) loads it: its config through transformers' own
writer, the weights under the lm's names (a tied weight once, which from_pretrained ties again).

    final/
        model.safetensors   the unique parameters and persistent buffers under their state_dict names
        spec.json           other kinds: the model spec; hf kinds: config.json (generation_config.json)
        manifest.json       and the tokenizer the job's data were tokenized with: its files, or for
                            "bytes" a tokenizer.json that encodes each UTF-8 byte as its value and
                            EOS as 256 (an hf model's config then names that EOS)

Rank 0 writes into a temporary directory and renames it to final/ once complete; manifest.json
lists every other file with its size and sha256 (what GET /v1/jobs/{id}/artifacts serves).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import struct
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from workers.config import DatasetSpec, HFSpec, ModelKind, PythonSpec, TrainConfig
from workers.data.datafiles import TOKENIZER_FILES
from workers.data.datasets import ByteTokenizer, FileTokenizer
from workers.memory.model import GPTSpec, MLPSpec
from workers.training.checkpoints import MANIFEST, write_json
from workers.zero.optimizer import ZeRO1AdamW

CHUNK_NUMEL = 1 << 22
"""Elements per point-to-point message of the gather (16 MiB of fp32)."""
FORMAT = "zero1.final.v1"
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_final(
    model: nn.Module,
    opt: ZeRO1AdamW,
    *,
    config: TrainConfig,
    directory: Path,
    rank: int,
    world_size: int,
    process_group: dist.ProcessGroup | None,
    chunk_numel: int = CHUNK_NUMEL,
) -> None:
    """Every rank calls it after the last step; rank 0 writes `directory` (replacing an earlier
    attempt's), and every rank returns once it is in place."""
    gathered = opt.gather_master_weights(dst=0, chunk_numel=chunk_numel)
    if rank == 0:
        tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        lm = getattr(model, "lm", None)
        trained = {id(p) for group in opt.param_groups for p in group["params"] if p.requires_grad}
        if lm is not None and hasattr(lm, "save_pretrained"):
            _save_pretrained(lm, gathered, tmp, config=config, trained=trained)
        else:
            _save_safetensors(model, gathered, tmp / "model.safetensors", trained=trained)
            write_json(tmp / "spec.json", model_spec_json(config.model))
            write_tokenizer(config, tmp)
        _write_manifest(tmp)
        _replace_dir(tmp, directory)
    else:
        for _ in gathered:  # send this rank's pieces
            pass
    if world_size > 1:
        dist.barrier(group=process_group)


def model_spec_json(spec: ModelKind) -> dict[str, Any]:
    """The model spec as the API's `model` takes it (kind included; a python model's with its
    code digest and the vocab_size and block_size its trace resolved)."""
    kind = {GPTSpec: "gpt", MLPSpec: "mlp", HFSpec: "hf", PythonSpec: "python"}[type(spec)]
    fields = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(spec).items()}
    return {"kind": kind, **fields}


BYTES_EOS_TOKEN = "<|endoftext|>"
"""The bytes tokenizer's EOS (id 256) as its tokenizer.json in final/ names it."""

# --------------------------------------------------------------------------- built-in kinds: streamed


def _save_safetensors(model: nn.Module, gathered, path: Path, *, trained: set[int]) -> None:
    """model.safetensors of the model's state dict, every tensor once (a tied weight under its
    first name, as named_parameters() lists it; safetensors refuses shared storage): the
    optimizer's parameters in fp32 from `gathered`, written into place as each arrives; frozen
    parameters and persistent buffers as the model holds them (`trained`: the ids of the
    optimizer's parameters). Load it with
    safetensors.torch.load_model(build_model(spec), path), which re-ties the weights."""
    entries: dict[int, tuple[str, Tensor]] = {}  # id(tensor) -> (its first name, the tensor)
    for name, tensor in model.state_dict(keep_vars=True).items():
        entries.setdefault(id(tensor), (name, tensor))
    header = {}
    offsets = {}
    end = 0
    for key, (name, tensor) in entries.items():
        dtype = torch.float32 if key in trained else tensor.dtype
        size = tensor.numel() * dtype.itemsize
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(tensor.shape),
            "data_offsets": [end, end + size],
        }
        offsets[key] = end
        end += size
    header["__metadata__"] = {"format": "pt"}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    start = 8 + len(encoded)
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded)
        file.truncate(start + end)
        for key, (_, tensor) in entries.items():
            if key not in trained:
                _write_at(file, start + offsets[key], tensor.detach())
        for param, master in gathered:
            _write_at(file, start + offsets[id(param)], master)
        file.flush()
        os.fsync(file.fileno())


def _write_at(file: IO[bytes], position: int, tensor: Tensor) -> None:
    file.seek(position)
    file.write(tensor.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())


# --------------------------------------------------------------------------- hf kinds


def _save_pretrained(lm: nn.Module, gathered, directory: Path, *, config: TrainConfig, trained: set[int]) -> None:
    """What lm.save_pretrained writes, with the weights streamed as the built-in kinds' are: its
    config (and generation config) through transformers' writers, the fp32 weights under lm's own
    names into model.safetensors, and the tokenizer's files when the job has one."""
    eos_id = write_tokenizer(config, directory)
    if eos_id is not None:  # generate() stops where the data's documents ended
        lm.config.eos_token_id = eos_id
        if getattr(lm, "generation_config", None) is not None:
            lm.generation_config.eos_token_id = eos_id
    lm.config.save_pretrained(directory)
    if getattr(lm, "generation_config", None) is not None:
        lm.generation_config.save_pretrained(directory)
    _save_safetensors(lm, gathered, directory / "model.safetensors", trained=trained)


def write_tokenizer(config: TrainConfig, directory: Path) -> int | None:
    """The tokenizer the job's data were tokenized with, into `directory`: its files, or for "bytes"
    one made here; the EOS id joined between its documents (None: the data had no tokenizer)."""
    data = config.data
    if isinstance(data, DatasetSpec) and data.tokenizer == "bytes":
        _bytes_tokenizer(directory)
        return ByteTokenizer.eos_id
    sources = tokenizer_files(config)
    for source in sources:
        shutil.copyfile(source, directory / source.name)
    if "tokenizer.json" not in {source.name for source in sources}:
        return None
    try:
        return FileTokenizer(str(directory / "tokenizer.json")).eos_id
    except ValueError:  # none it names (a job's data check refuses such a tokenizer): the config's stays
        return None


def _bytes_tokenizer(directory: Path) -> None:
    """tokenizer.json and tokenizer_config.json of the bytes tokenizer (workers.data.datasets.ByteTokenizer)
    as `tokenizers` and transformers load them: the byte-level pre-tokenizer's alphabet (GPT-2's: a
    printable character standing for each byte), one token per byte whose id is the byte's value and
    no merges, so that encoding a text gives its UTF-8 bytes; EOS 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    vocab = {}
    shifted = 0
    for byte in range(256):  # the order GPT-2's bytes_to_unicode gives the bytes that print badly
        vocab[chr(byte) if byte in printable else chr(256 + shifted)] = byte
        shifted += byte not in printable
    tokenizer = Tokenizer(models.BPE(vocab=vocab | {BYTES_EOS_TOKEN: ByteTokenizer.eos_id}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BYTES_EOS_TOKEN])
    tokenizer.save(str(directory / "tokenizer.json"))
    write_json(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": BYTES_EOS_TOKEN,
            "clean_up_tokenization_spaces": False,
        },
    )


def tokenizer_files(config: TrainConfig) -> list[Path]:
    """The tokenizer files of the job's data (DatasetSpec.tokenizer: a tokenizer.json or a
    directory), else of the hf model's own directory; none for "bytes" or other data."""
    data = config.data
    model = config.model
    if isinstance(data, DatasetSpec) and data.tokenizer not in (None, "bytes"):
        where = Path(data.tokenizer)
    elif isinstance(data, DatasetSpec) and data.tokenizer is None and isinstance(model, HFSpec) and model.path:
        where = Path(model.path)
    else:
        return []
    if where.is_file():
        return [where]
    return [where / name for name in TOKENIZER_FILES if (where / name).is_file()]


# --------------------------------------------------------------------------- the directory


def _write_manifest(directory: Path) -> None:
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name != MANIFEST)
    write_json(
        directory / MANIFEST,
        {
            "format": FORMAT,
            "files": [{"name": p.name, "bytes": p.stat().st_size, "sha256": sha256_of(p)} for p in files],
        },
    )


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _replace_dir(tmp: Path, directory: Path) -> None:
    """tmp becomes directory; an earlier attempt's directory is moved aside first, then deleted."""
    old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
    if directory.exists():
        os.replace(directory, old)
    os.replace(tmp, directory)
    shutil.rmtree(old, ignore_errors=True)
    fd = os.open(directory.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""A job's inputs on an object store: a `dataset` job's `s3://` files inside an `s3://` data root,
and an hf model's directory inside an `s3://` model root.

Only the processes that hold the store's credentials call this: the API's admission (it lists the
files a path names), a dataset check's Ray task and a rank's parent (workers/runtime/isolated.py,
workers/runtime/rank_actor.py). The children that parse and tokenize never reach the store. The check's
child reads a copy of the matched files staged into a directory of its own, under the local rules
of workers/data/datafiles.py; its token file is then put in the store's token cache
(`<ZERO1_CHECKPOINT_URI>/datasets/tokens/<key>.bin` and its sidecar, the sidecar last), and the job
records that object's URI (DatasetSpec.token_uri). A rank's parent fetches that one object into a
private cache for its child and downloads none of the data; only when it is gone (a lifecycle rule
expired it) are the files staged again, and the child tokenizes them.

An hf model's directory may be on a store too (an s3:// model root): the API hashes its objects
as they stream (model_digest: the digest a local copy has), a trace's task stages its config.json,
a dataset check's its tokenizer files, and each rank's parent the whole directory, whose digest
the child checks against the admitted one before it loads the weights.

A job started from another's weights (init_from) has its rank's parent copy the source job's
final/model.safetensors, wherever it is stored (the child, another uid, cannot read the source's
directory), hashing it as it copies: a copy that is not the file the service recorded when the source
succeeded fails the attempt and never reaches the child. An attempt that resumes from a checkpoint in
a directory fetches nothing (the child would not load it).

A data path is a file, a prefix (every object under it with the format's extension, none with a hidden
component), or a glob whose `*`, `?` and `[...]` match within one '/'-separated component, as for
local files. Listing is bounded by datafiles.MAX_CANDIDATES objects, matching by MAX_FILES files.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import Any

from workers.config import DatasetSpec, FieldError, HFSpec, InitSpec
from workers.data.datafiles import EXTENSIONS, MAX_CANDIDATES, MAX_FILES, TOKENIZER_FILES
from workers.data.digests import MAX_FILES as MAX_MODEL_FILES
from workers.data.digests import digest_of
from workers.training.checkpoints import FINAL, latest_checkpoint
from workers.training.storage import filesystem, open_store
from workers.uris import is_remote, join_uri, parse_uri

_MAGIC = re.compile(r"[*?[]")
_TOKEN_NAME = re.compile(r"[0-9a-f]{16,128}\.bin")
_HASH_BYTES = 8 << 20
_OBJECT_DIGESTS: dict[tuple[str, int, str], str] = {}
"""sha256 of objects hashed by this process, by (key, size, ETag)."""


def is_remote_path(path: str | None) -> bool:
    """Whether a data path names an object (a scheme before '://') rather than a local file."""
    return path is not None and "://" in path


def remote_roots(roots: Sequence[str] | None) -> list[str]:
    """The object-store roots among `roots`, as "bucket/prefix" keys (parse_uri's rules)."""
    return [parse_uri(root)[1] for root in roots or () if is_remote_path(root)]


def _inside(path: str, *, roots: Sequence[str] | None, field: str, kind: str) -> tuple[str, str]:
    """(scheme, key) of `path`, an object-store URI inside one of the store's `roots`; ValueError
    ("<field>: ...") otherwise."""
    try:
        scheme, key = parse_uri(path)
    except ValueError as exc:
        raise ValueError(f"{field}: {exc}") from None
    allowed = remote_roots(roots)
    if not any(key == root or key.startswith(root + "/") for root in allowed):
        shown = [f"{scheme}://{root}" for root in allowed]
        raise ValueError(
            f"{field}: {path!r} is outside the object-store {kind} roots {shown} (ZERO1_{kind.upper()}_ROOTS)"
        )
    return scheme, key


def resolve_objects(
    path: str, *, format: str, roots: Sequence[str] | None, fs=None, max_candidates: int = MAX_CANDIDATES
) -> list[tuple[str, int]]:
    """(key, size) of each object `path` names, sorted by key; ValueError ("data.path: ...") for a
    path outside the object-store roots, naming no file or too many, or a listing past its bound."""
    scheme, key = _inside(path, roots=roots, field="data.path", kind="data")
    fs = fs if fs is not None else filesystem(scheme)
    parts = key.split("/")
    first = next((i for i, part in enumerate(parts) if _MAGIC.search(part)), len(parts))
    base = "/".join(parts[:first])
    pattern = parts[first:]
    if not pattern and fs.isfile(key):
        return [(key, int(fs.size(key)))]
    listing = fs.find(base, detail=True)
    if len(listing) > max_candidates:
        raise ValueError(f"data.path: {path!r} lists more than {max_candidates:,} objects; name fewer")
    found = []
    for name, info in listing.items():
        relative = name[len(base) + 1 :].split("/") if name.startswith(base + "/") else []
        if info.get("type") != "file" or not relative:
            continue
        if pattern:  # hidden names only where the component asks for one, as a local glob
            matched = len(relative) == len(pattern) and all(map(_matches, relative, pattern))
        else:
            matched = name.endswith(EXTENSIONS[format]) and not any(part.startswith(".") for part in relative)
        if matched:
            found.append((name, int(info.get("size") or 0)))
    if not found:
        raise ValueError(f"data.path: {path!r} matches no {format} files")
    if len(found) > MAX_FILES:
        raise ValueError(f"data.path: {path!r} names more than {MAX_FILES} files")
    return sorted(found)


def _matches(name: str, part: str) -> bool:
    return fnmatch.fnmatchcase(name, part) and (part.startswith(".") or not name.startswith("."))


def stage(spec: DatasetSpec, *, into: str) -> DatasetSpec:
    """The objects spec.path names downloaded below `into` (at their keys), and the spec with its
    path and roots pointing there: what a child reads as local files."""
    scheme, key = parse_uri(spec.path)
    fs = filesystem(scheme)
    for name, _ in resolve_objects(spec.path, format=spec.format, roots=spec.roots, fs=fs):
        local = Path(into, *PurePosixPath(name).parts)
        local.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(name, str(local))
    local_roots = tuple(root for root in spec.roots or () if not is_remote_path(root))
    return replace(spec, path=str(Path(into, *key.split("/"))), roots=(*local_roots, os.path.realpath(into)))


def model_objects(path: str, *, roots: Sequence[str] | None, fs=None) -> list[tuple[str, int, str]]:
    """(key relative to `path`, size, ETag) of every object of an hf model's directory on a store,
    sorted; ValueError ("model.path: ...") outside the object-store model roots, without a
    config.json, or past digests.MAX_FILES objects."""
    scheme, key = _inside(path, roots=roots, field="model.path", kind="model")
    fs = fs if fs is not None else filesystem(scheme)
    listing = fs.find(key, detail=True)
    if len(listing) > MAX_MODEL_FILES:
        raise ValueError(f"model.path: {path!r} holds more than {MAX_MODEL_FILES} objects")
    found = sorted(
        (name[len(key) + 1 :], int(info.get("size") or 0), str(info.get("ETag", "")))
        for name, info in listing.items()
        if info.get("type") == "file" and name.startswith(key + "/")
    )
    if not any(name == "config.json" for name, _, _ in found):
        raise ValueError(f"model.path: {path!r} is not a save_pretrained directory: it has no config.json")
    return found


def model_digest(path: str, *, roots: Sequence[str] | None) -> str:
    """The digest of an hf model's directory on a store, as digests.directory_digest gives for a local
    copy of it (relative names and contents), each object streamed and hashed, and remembered by
    (key, size, ETag) so that a model is hashed once per process."""
    scheme, key = parse_uri(path)
    fs = filesystem(scheme)
    entries = []
    for name, size, etag in model_objects(path, roots=roots, fs=fs):
        known = (f"{key}/{name}", size, etag)
        if known not in _OBJECT_DIGESTS:
            digest = hashlib.sha256()
            with fs.open(f"{key}/{name}", "rb", block_size=_HASH_BYTES, cache_type="none") as file:
                while chunk := file.read(_HASH_BYTES):
                    digest.update(chunk)
            if len(_OBJECT_DIGESTS) >= 100_000:
                _OBJECT_DIGESTS.clear()
            _OBJECT_DIGESTS[known] = digest.hexdigest()
        entries.append([name, _OBJECT_DIGESTS[known]])
    return digest_of(entries)


def stage_model(path: str, *, into: str, names: Sequence[str] | None = None) -> str:
    """An hf model's directory on a store downloaded below `into` (only `names` of it, where given:
    a trace reads its config.json, a dataset check its tokenizer); the local directory."""
    scheme, key = parse_uri(path)
    fs = filesystem(scheme)
    local = Path(into, *key.split("/"))
    local.mkdir(parents=True, exist_ok=True)
    for name, _, _ in model_objects(path, roots=[path], fs=fs):
        if names is None or name in names:
            target = Path(local, *name.split("/"))
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(f"{key}/{name}", str(target))
    return str(local)


def staged_inputs(argument: Any, *, into: str, owner: tuple[int, int] | None = None) -> Any:
    """A Ray task's request with what it names on a store staged below `into` for the child: a
    dataset's files (`data`), an hf model's config.json (`model`, a trace's dict) and its tokenizer
    (`tokenizer_dir`, a dataset check's); the argument itself when it names nothing remote. `owner`:
    the (uid, gid) the child runs as (ZERO1_RUN_AS), given the copy (hand_over)."""
    changes: dict[str, Any] = {}
    data = getattr(argument, "data", None)
    if isinstance(data, DatasetSpec) and is_remote_path(data.path):
        changes["data"] = stage(data, into=os.path.join(into, "data"))
    model = getattr(argument, "model", None)
    if isinstance(model, dict) and is_remote_path(model.get("path")):
        staged = stage_model(model["path"], into=os.path.join(into, "model"), names=("config.json",))
        changes["model"] = {**model, "path": staged}
    tokenizer_dir = getattr(argument, "tokenizer_dir", None)
    if is_remote_path(tokenizer_dir):
        changes["tokenizer_dir"] = stage_model(
            tokenizer_dir, into=os.path.join(into, "tokenizer"), names=TOKENIZER_FILES
        )
    if not changes:
        return argument
    hand_over(into, owner=owner)
    return replace(argument, **changes)


def for_child(config: Any, *, owner: tuple[int, int] | None = None) -> tuple[Any, str | None]:
    """A rank's TrainConfig as its child reads it, and the directory made for that (None: nothing in
    it is on a store). Data on a store: the token file the job's check stored (the child maps it by
    its key), or, when that is gone, the staged files (the child tokenizes them). An hf model on a
    store: its directory, staged (the child checks its digest against the admitted one). Weights to
    start from (init_from, local or not): fetch_weights' checked copy. The caller removes the directory
    after the run; `owner` as for staged_inputs."""
    data = config.data
    model = config.model
    remote_data = isinstance(data, DatasetSpec) and is_remote_path(data.path)
    remote_model = isinstance(model, HFSpec) and is_remote_path(model.path)
    init = config.init_from if config.init_from is not None and not _resumes(config) else None
    if not (remote_data or remote_model or init):
        return config, None
    directory = tempfile.mkdtemp(prefix="zero1-inputs-")
    try:
        changes = {}
        if remote_data:
            changes["data"] = data_for_child(data, into=os.path.join(directory, "data"))
        if remote_model:
            into = os.path.join(directory, "model")
            changes["model"] = replace(model, path=stage_model(model.path, into=into), roots=(os.path.realpath(into),))
        if init is not None:
            changes["init_from"] = fetch_weights(init, into=os.path.join(directory, "init"))
        hand_over(directory, owner=owner)
        return replace(config, **changes), directory
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise


def _resumes(config: Any) -> bool:
    """Whether the run resumes from a checkpoint this process can see (one in a directory; a spool's
    are the store's, and the weights are then fetched anyway: the child ignores them)."""
    directory = config.checkpoint_dir
    return bool(config.resume and directory and not is_remote(directory) and latest_checkpoint(directory))


def fetch_weights(init: InitSpec, *, into: str, chunk_bytes: int = _HASH_BYTES) -> InitSpec:
    """The source job's final/model.safetensors copied into `into`, hashed as it is copied (in a
    directory, no link followed anywhere below the source job's: DirectoryStore.open);
    FieldError("init_from.job") when it cannot be read or is not the size and sha256 recorded, and no
    copy is left."""
    name = f"{FINAL}/model.safetensors"
    local = os.path.join(into, "model.safetensors")
    os.makedirs(into, exist_ok=True)
    digest = hashlib.sha256()
    size = 0
    try:
        with open_store(init.uri).open(name) as source, open(local, "xb") as copy:
            while chunk := source.read(min(chunk_bytes, init.bytes + 1 - size)):  # one byte past: a larger file
                size += len(chunk)
                digest.update(chunk)
                copy.write(chunk)
                if size > init.bytes:
                    break
    except Exception as exc:  # noqa: BLE001  (an OSError, or any error of the store's client)
        Path(local).unlink(missing_ok=True)
        raise FieldError("init_from.job", f"job {init.job}'s final/model.safetensors cannot be read: {exc}") from None
    if size != init.bytes or digest.hexdigest() != init.sha256:
        os.unlink(local)
        raise FieldError(
            "init_from.job",
            f"job {init.job}'s final/model.safetensors is not the file recorded when it succeeded ({init.bytes} "
            f"bytes, sha256 {init.sha256}): it has {size}{'+' if size > init.bytes else ''} bytes, sha256 "
            f"{digest.hexdigest()}; not loaded",
        )
    return replace(init, path=local)


def data_for_child(data: DatasetSpec, *, into: str) -> DatasetSpec:
    """Data on a store as a rank's child reads them from `into`: the token file fetched (a private cache),
    else the files staged (the cache is the job's own, where the check may have left their tokens)."""
    os.makedirs(into, exist_ok=True)
    if data.token_uri is not None and fetch_tokens(data.token_uri, into=into):
        return replace(data, cache_dir=into)
    return replace(stage(data, into=into), token_uri=None)  # the child hashes them to find (or make) their tokens


def fetch_tokens(token_uri: str, *, into: str) -> bool:
    """The token file `token_uri` names and its sidecar copied into `into`/tokens, the sidecar last;
    False when either is gone from the store (the data is then staged instead)."""
    scheme, key = parse_uri(token_uri)
    name = PurePosixPath(key).name
    if not _TOKEN_NAME.fullmatch(name):
        raise ValueError(f"data.token_uri: {token_uri!r} does not name a token file")
    fs = filesystem(scheme)
    directory = Path(into, "tokens")
    directory.mkdir(parents=True, exist_ok=True)
    try:
        for suffix in (".bin", ".json"):
            local = directory / f"{name.removesuffix('.bin')}{suffix}"
            fs.get_file(key.removesuffix(".bin") + suffix, str(local))
    except FileNotFoundError:
        for stale in directory.iterdir():
            stale.unlink()
        return False
    return True


def publish_tokens(token_file: str, *, store_uri: str) -> str:
    """A cached token file (`<key>.bin`, its `<key>.json` beside it) put under `store_uri` unless its
    sidecar is there already, the sidecar last; the URI of the stored token file."""
    scheme, root = parse_uri(store_uri)
    local = Path(token_file)
    if not _TOKEN_NAME.fullmatch(local.name):
        raise ValueError(f"not a token file: {token_file!r}")
    fs = filesystem(scheme)
    key = f"{root}/{local.stem}"
    if not fs.exists(f"{key}.json"):
        fs.put_file(str(local), f"{key}.bin")
        fs.put_file(str(local.with_suffix(".json")), f"{key}.json")
    return f"{scheme}://{key}.bin"


def token_store(checkpoint_uri: str) -> str:
    """The store's token cache: datasets/tokens under the checkpoint storage."""
    return join_uri(checkpoint_uri, "datasets", "tokens")


def hand_over(directory: str, *, owner: tuple[int, int] | None) -> None:
    """A staged copy made the child's: everything under `directory` (a mkdtemp, 0700) given to the
    (uid, gid) its child runs as, and to no one else: another user's job on the node cannot read
    it. None: the child runs as this process's user, who owns it already. Bottom-up, the top last:
    until then only this process can enter it, so no process of that uid (another job of the same
    owner's) can swap a directory below for a link while the walk descends (it would chown through it)."""
    if owner is None:
        return
    uid, gid = owner
    for path, _, names in os.walk(directory, topdown=False):
        os.chown(path, uid, gid, follow_symlinks=False)
        for name in names:
            os.chown(os.path.join(path, name), uid, gid, follow_symlinks=False)

"""A Ray task whose work runs in a child (workers/runtime/sandbox.py): a plan's trace, a submit's dataset check.

The task's process is zero1's and Ray's; the work (a python model's build(), an hf model's files,
a dataset's parsers) runs in a child with a built environment, the owner's uid (ZERO1_RUN_AS) and
a scratch home, killed at its time limit. What the child answers is JSON, checked against the
result's dataclass before it is rebuilt; its failures come back as the exceptions the service
answers 422 (an InvalidModelError naming the field, a ValueError "data.x: why"). Files the child
made that the service keeps (a dataset's token file for the cache) are moved by this trusted side
into place, never written there by the child. A dataset on an object store is staged by this side
for the child, and its token file put in the store's token cache (workers/training/staging.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import re
import shutil
import tempfile
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.config import DatasetSpec, InvalidModelError
from workers.records import RunAs
from workers.runtime.sandbox import ChildError, ChildExited, call_in_child
from workers.training import confined, staging

SPILL_DIR = "tmp/zero1-cache"
"""Where, under a child's home, it writes the dataset cache entry it cannot write in the shared cache
(its TMPDIR's zero1-cache: workers.data.datasets.prepare_tokens)."""
_CACHE_NAME = re.compile(r"[0-9a-f]{16,128}\.(bin|json)")


@dataclass(frozen=True, slots=True, kw_only=True)
class IsolatedCall:
    """One unit of untrusted work: `function` ("module:name") applied to `argument` in a child."""

    function: str
    argument: Any
    result: type
    """The dataclass the child's JSON answer must fit, field by field."""
    blame: str
    """The request's field a crash of the child is blamed on (model.entrypoint, data...)."""
    timeout_s: float
    run_as: RunAs | None = None
    bundle: str | None = None
    """A code bundle as stored (file://….zip, s3://….zip): this task unpacks it for the child, its
    working directory and import path; never the task's own (workers/training/bundles.py)."""
    token_cache: str | None = None
    """The dataset cache's tokens/ directory: a token file the child made in its spill directory is
    moved there, and the result's token_file names it there."""
    token_store: str | None = None
    """The object store's token cache: where the token file of data staged from a store is put (the
    result's token_file then names it there)."""
    child: bool = True
    """False for work that runs no user code nor reads user files (a built-in model's trace): it runs
    in the task's process, without a child's start-up."""


def run_isolated(call: IsolatedCall) -> Any:
    """The Ray task's body: the call's work in a child, its answer checked and rebuilt."""
    if not call.child:
        module, _, name = call.function.partition(":")
        return getattr(importlib.import_module(module), name)(call.argument)
    with _staged(call.argument, call.run_as) as (argument, staged):
        result = _run_child(call, argument)
    if staged and call.token_store is not None and isinstance(getattr(result, "token_file", None), str):
        stored = staging.publish_tokens(result.token_file, store_uri=call.token_store)
        result = dataclasses.replace(result, token_file=stored)
    return result


@contextlib.contextmanager
def _staged(argument: Any, run_as: RunAs | None) -> Iterator[tuple[Any, bool]]:
    """(the argument, whether it named data on a store) with what it names on a store (a dataset's
    files, an hf model's config or tokenizer) downloaded by this side into a directory removed after,
    given to the child's uid alone: the child never reaches the store."""
    directory = tempfile.mkdtemp(prefix="zero1-inputs-")
    try:
        owner = None if run_as is None else (run_as.uid, run_as.gid)
        staged = staging.staged_inputs(argument, into=directory, owner=owner)
        data = getattr(argument, "data", None)
        yield staged, isinstance(data, DatasetSpec) and staging.is_remote_path(data.path)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _run_child(call: IsolatedCall, argument: Any) -> Any:
    kept: dict[str, str] = {}

    def keep(home: str) -> None:
        if call.token_cache is not None:
            kept.update(_adopt(Path(home), Path(call.token_cache)))

    try:
        answer = call_in_child(
            call.function,
            argument,
            timeout_s=call.timeout_s,
            run_as=call.run_as,
            bundle=call.bundle,
            keep=keep,
        )
    except ChildError as exc:
        raise _local(exc) from None
    except ChildExited as exc:
        message = f"the task's process {exc} while it ran the request's code"
        raise _blamed(call.blame, message) from None
    result = checked(call.result, answer)
    if call.token_cache is not None and hasattr(result, "token_file"):  # named by this side, never the child
        token_file = result.token_file
        name = Path(token_file).name if isinstance(token_file, str) else None
        token_file = kept.get(name) if name else None
        if token_file is None and name and (Path(call.token_cache) / name).is_file():
            token_file = str(Path(call.token_cache) / name)  # the child found it in the cache
        result = dataclasses.replace(result, token_file=token_file)
    return result


def checked(result_type: type, answer: Any) -> Any:
    """`answer` (a JSON object) as `result_type`, every field of the declared type; ValueError otherwise."""
    if not isinstance(answer, dict):
        raise ValueError(f"the child's answer is not an object but {type(answer).__name__}")
    hints = typing.get_type_hints(result_type)
    values = {}
    for field in dataclasses.fields(result_type):
        if field.name not in answer:
            if field.default is dataclasses.MISSING:
                raise ValueError(f"the child's answer has no {field.name}")
            continue
        value = answer[field.name]
        if not _conforms(value, hints[field.name]):
            raise ValueError(f"the child's {field.name} is not a {hints[field.name]}: {str(value)[:80]}")
        values[field.name] = tuple(value) if isinstance(value, list) else value
    return result_type(**values)


def _conforms(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, arg) for arg in args)
    if origin is tuple:
        return isinstance(value, list) and all(_conforms(item, args[0]) for item in value)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return False


def _adopt(home: Path, cache: Path) -> dict[str, str]:
    """Copy the child's cache entries (regular files with one link and a cache entry's name) into the
    cache, token files before their sidecars (a sidecar says its token file is whole); name -> new
    path. The child owns its home and may swap anything in it meanwhile: each is walked to from the
    directory above the home, no link followed (workers/training/confined.py)."""
    spill = f"{home.name}/{SPILL_DIR}/tokens"
    try:
        names = confined.list_dir(home.parent, spill)
    except OSError:  # none made, or not a directory
        return {}
    moved = {}
    cache.mkdir(parents=True, exist_ok=True)
    for name in sorted(filter(_CACHE_NAME.fullmatch, names), key=lambda n: not n.endswith(".bin")):
        try:
            source = confined.open_file(home.parent, f"{spill}/{name}")
        except OSError:
            continue  # a link, a FIFO, a hard link: not adopted
        temporary = f".{name}.{os.getpid()}.adopt"
        confined.unlink(cache, temporary)
        with source, os.fdopen(confined.create_file(cache, temporary, mode=0o644), "wb") as out:
            shutil.copyfileobj(source, out)
            os.fchmod(out.fileno(), 0o644)  # owned by this side, readable by every child, whatever the umask
        os.replace(cache / temporary, cache / name)
        moved[name] = str(cache / name)
    return moved


def _local(error: ChildError) -> Exception:
    """The child's exception as the service answers it: the field it names, else a ValueError or
    the error itself (a RuntimeError saying the child's type)."""
    if error.field:
        return InvalidModelError(error.field, error.message)
    if error.value_error:
        return ValueError(error.message)
    return error


def _blamed(field: str, message: str) -> Exception:
    return InvalidModelError(field, message) if field.startswith("model") else ValueError(f"{field}: {message}")

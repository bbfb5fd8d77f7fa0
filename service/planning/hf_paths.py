"""An hf model's path in the control plane: a save_pretrained directory confined to ZERO1_MODEL_ROOTS.

Checked here, in the API, without transformers (which loads torch): the path is made real
(symlinks followed) so that the trace and the ranks read the very directory that was checked,
and the ranks check it again against the roots (workers/models/hf.py). Its files are hashed
(workers/data/digests.py: a link inside is refused): the digest goes into the trace's key, so a
directory whose content changed is traced again, and into the job's spec, so a rank loads only
the content that was planned. A hub id is never downloaded. A directory on an object store
(s3://… inside an s3:// model root) is listed and its objects hashed by streaming them, to the
digest a local copy of it has: the trace and the ranks read copies their trusted parents download.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import TypeVar

from pydantic import BaseModel

from service.errors import storage_unreachable
from service.planning.traces import invalid_model
from service.schemas.model_specs import HFModelSpec
from workers.data.digests import DigestError, directory_digest
from workers.training import staging

Body = TypeVar("Body", bound=BaseModel)

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
"""What the Hugging Face hub names a model: `name` or `owner/name`."""


def check_model_path(body: Body, *, model_roots: Sequence[str]) -> Body:
    """`body` (a JobSpec or PlanRequest) with an hf model's path made real and its files' digest, or a
    422 naming model.path (model.digest when one was given and the files differ). Reads every file
    not hashed before in this process: call it in a worker thread."""
    model = getattr(body, "model", None)
    if not isinstance(model, HFModelSpec) or model.path is None:
        return body
    if staging.is_remote_path(model.path):
        real = model.path
        digest = _object_digest(model.path, model_roots=model_roots)
    else:
        real = resolve_model_dir(model.path, model_roots=model_roots)
        try:
            digest = directory_digest(real, field="model.path")
        except DigestError as exc:
            raise invalid_model(exc.field, exc.reason) from None
    if model.digest is not None and model.digest != digest:
        raise invalid_model(
            "model.digest", f"the files of {model.path!r} have digest {digest}, not the {model.digest} given"
        )
    return body.model_copy(update={"model": model.model_copy(update={"path": real, "digest": digest})})


def _object_digest(path: str, *, model_roots: Sequence[str]) -> str:
    """The digest of a model directory on an object store (its objects streamed and hashed, once per
    process: workers/training/staging.py), or a 422 naming model.path; a 503 when the store cannot be read."""
    try:
        return staging.model_digest(path, roots=model_roots)
    except ValueError as exc:
        raise invalid_model("model.path", str(exc).removeprefix("model.path: ")) from None
    except Exception as exc:  # noqa: BLE001  (any error of the store's client)
        raise storage_unreachable("model.path", exc) from None


def resolve_model_dir(path: str, *, model_roots: Sequence[str]) -> str:
    roots = [os.path.realpath(root) for root in model_roots if "://" not in root]
    if not os.path.lexists(path) and _HUB_ID.fullmatch(path):
        raise invalid_model(
            "model.path",
            f"{path!r} is not a directory inside the model roots {roots} (ZERO1_MODEL_ROOTS), and a hub id is "
            "never downloaded (HF_HUB_OFFLINE): save the model with save_pretrained under a model root",
        )
    real = os.path.realpath(path)
    if not any(os.path.commonpath([real, root]) == root for root in roots):
        raise invalid_model(
            "model.path",
            f"{path!r} is outside the model roots {roots} (ZERO1_MODEL_ROOTS; symlinks are followed)",
        )
    if not os.path.isdir(real):
        raise invalid_model("model.path", f"no such directory: {path!r}")
    if not os.path.isfile(os.path.join(real, "config.json")):
        raise invalid_model("model.path", f"{path!r} is not a save_pretrained directory: it has no config.json")
    return real

"""The tracking URI as it may be shown or logged: without its userinfo.

ZERO1_MLFLOW_TRACKING_URI may carry the service's credentials (`https://user:password@mlflow:5000`:
MLflow's client sends them as basic auth). Only the client holds them: a URL the API, the job page or
the CLI shows is made from the URI without them, and every message the exporter logs or stores (an
MLflow error names the URL it called, userinfo included) has them cut out.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit, urlunsplit

_USERINFO = re.compile(r"(?<=://)[^/?#@\s]*@")
"""`user:password@` after a scheme's `://`, in any text."""


def public_uri(uri: str) -> str:
    """`uri` without `user:password@` (the rest as it was)."""
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def scrubbed(text: str, *, uri: str) -> str:
    """`text` with every URL's userinfo cut out, and `uri`'s password wherever else it appears (decoded too)."""
    text = _USERINFO.sub("", text)
    password = urlsplit(uri).password
    for secret in {password, unquote(password or "")} - {None, ""}:
        text = text.replace(secret, "***")
    return text

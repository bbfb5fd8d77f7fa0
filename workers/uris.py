"""Storage URIs: a directory (a path or file:///path) or an object store prefix (s3://bucket/prefix),
parsed and joined by one set of rules that the settings, the control plane and the ranks share.

May import: the standard library only.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

SCHEMES = ("s3",)
"""The object stores a URI may name, beside a path (or file://)."""


def parse_uri(uri: str) -> tuple[str, str]:
    """("file", an absolute path) or ("s3", "bucket/prefix" without a trailing slash); ValueError,
    naming the URI and what is accepted, for anything else."""
    text = uri.strip()
    scheme, sep, rest = text.partition("://")
    if not sep:
        if not text:
            raise ValueError("the storage URI is empty: give a directory or s3://bucket/prefix")
        return "file", str(Path(text).expanduser().resolve())
    scheme = scheme.lower()
    if scheme == "file":
        if not rest.startswith("/"):
            raise ValueError(f"{uri!r}: a file:// URI needs an absolute path (file:///srv/zero1)")
        return "file", str(Path(rest).resolve())
    if scheme not in SCHEMES:
        raise ValueError(
            f"{uri!r}: storage scheme {scheme!r} is not supported: give a directory, file:///path or "
            "s3://bucket/prefix (any S3-compatible store, reached through the standard AWS_* settings)"
        )
    bucket, _, prefix = rest.partition("/")
    if not bucket or any(part in ("", ".", "..") for part in prefix.strip("/").split("/") if prefix.strip("/")):
        raise ValueError(f"{uri!r}: an s3 URI names a bucket and an optional prefix: s3://bucket/prefix")
    return "s3", f"{bucket}/{prefix.strip('/')}".rstrip("/")


def is_remote(uri: str) -> bool:
    """Whether `uri` names an object store rather than a directory (parse_uri's rules)."""
    return parse_uri(uri)[0] != "file"


def join_uri(uri: str, *names: str) -> str:
    """`uri` with `names` below it: a path for a directory, s3://… for an object store."""
    scheme, root = parse_uri(uri)
    joined = str(PurePosixPath(root, *names))
    return joined if scheme == "file" else f"{scheme}://{joined}"


def located(uri: str) -> str:
    """A directory or s3://bucket/prefix as the service reaches it: a directory resolved (symlinks followed)."""
    scheme, where = parse_uri(uri)
    return where if scheme == "file" else f"{scheme}://{where}"


def overlap(first: str, second: str) -> bool:
    """Whether two storage locations (directories, s3://bucket/prefix) are the same or one holds the other."""
    one = located(first).rstrip("/")
    other = located(second).rstrip("/")
    return one == other or one.startswith(other + "/") or other.startswith(one + "/")

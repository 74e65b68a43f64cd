"""Which locations are URLs of a remote store, and whether a URL is well formed.

Kept apart from the back ends so that checking a location imports no SDK: the `trainckpt`
command checks its arguments with it before any client is built.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from trainckpt.errors import ConfigurationError

SCHEMES = ("file://", "gs://", "s3://", "http://", "https://")
"""Every URL scheme a location may have (a plain path is local)."""

_BUCKET = re.compile(r"[A-Za-z0-9._-]{1,255}")


def scheme_of(location: str) -> str:
    """`gs`, `s3`, `http`, `https`, `file`, or "" for a plain path."""
    return location.split("://", 1)[0].lower() if "://" in location else ""


def is_remote(location: str) -> bool:
    """True for URLs served over the network (everything but plain paths and `file://`)."""
    return scheme_of(location) not in ("", "file")


def check_location(location: str) -> None:
    """Refuse a URL that no back end could reach (no host, a bad port, a bucket name with
    spaces), with a `ConfigurationError` naming it, before any request is made. Unknown
    schemes and missing buckets are left to `storage_for` and the back ends, which say so."""
    scheme = scheme_of(location)
    if scheme in ("http", "https"):
        try:
            parts = urlsplit(location)
            parts.port  # noqa: B018 (raises ValueError for a port that is not a number 0-65535)
        except ValueError as e:
            raise ConfigurationError(f"'{location}' is not a valid URL: {e}") from None
        if not parts.hostname:
            raise ConfigurationError(
                f"'{location}' is not a valid URL: it names no host; use {scheme}://host/path"
            )
    elif scheme in ("gs", "s3"):
        bucket = location.split("://", 1)[1].split("/", 1)[0]
        if bucket and not _BUCKET.fullmatch(bucket):
            raise ConfigurationError(
                f"'{location}' is not a valid URL: bucket name '{bucket}' may hold only "
                f"letters, digits, '.', '-' and '_'; use {scheme}://bucket/prefix"
            )

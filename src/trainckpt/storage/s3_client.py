"""The boto3 client of `S3Storage`: endpoint from the standard variables, boto3's standard
configuration with its own retries off (`S3Storage._call` retries, bounded by the deadline),
unsigned requests when there are no credentials.

Split from `s3.py` so the request code reads apart from how the client is set up. boto3 is
imported here only when a client is made (the `trainckpt[s3]` extra). Called on: any rank,
once per `S3Storage` (and endpoint).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from trainckpt.storage.base import StorageOptions

if TYPE_CHECKING:
    from botocore.client import BaseClient

log = logging.getLogger(__name__)


def endpoint_from_env() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def new_client(options: StorageOptions) -> BaseClient:
    """A client from boto3's standard configuration, with our retry loop instead of its own."""
    import boto3
    import botocore
    from botocore.config import Config

    session = boto3.session.Session()
    config = Config(
        retries={"total_max_attempts": 1},  # `S3Storage._call` retries, bounded by the deadline
        connect_timeout=min(10.0, options.retry_deadline),
        read_timeout=60.0,
        max_pool_connections=max(10, options.thread_count + 2),
        user_agent_extra="trainckpt",
    )
    if session.get_credentials() is None:
        log.warning(
            "no AWS credentials found; sending unsigned requests (public buckets only). Set "
            "AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
        )
        config = config.merge(Config(signature_version=botocore.UNSIGNED))
    return session.client("s3", config=config)

"""Shared fixtures. Back-end servers live in their own modules; this file stays small."""

from __future__ import annotations

import os

os.environ.setdefault("NO_GCE_CHECK", "true")  # before google.auth is imported anywhere

from s3_server import s3_bucket, s3_proxy, s3_server  # noqa: E402,F401
from servers import gcs_bucket, gcs_server, http_folder, http_server  # noqa: E402,F401

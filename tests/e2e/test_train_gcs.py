"""The example run with a `gs://` save folder on a real fake-gcs-server: saves, retention
deletes on the object store, and a second run resumes from the bucket."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.example_run import train, write_config

from trainckpt import Checkpointer

pytestmark = pytest.mark.slow


def test_example_saves_to_and_resumes_from_gcs(gcs_bucket: str, tmp_path: Path) -> None:
    config = write_config(tmp_path)
    folder = f"{gcs_bucket}/runs/tiny"
    out = train(config, folder, 12)
    assert re.search(r"checkpoint event: committed ephemeral 'gs://.*/step10'", out), out
    # Ephemeral step 5 and 10 were deleted from the bucket once a newer checkpoint committed.
    kinds = {
        s: Checkpointer.read_metadata(p).ephemeral for s, p in Checkpointer.find_checkpoints(folder)
    }
    assert kinds == {0: False, 12: False}
    assert "checkpoint event: delete ephemeral" in out

    out = train(config, folder, 14)
    assert f"resuming from '{folder}/step12' (step 12)" in out, out
    assert [s for s, _ in Checkpointer.find_checkpoints(folder)] == [0, 12, 14]

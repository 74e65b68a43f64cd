"""Shared fixtures. Back-end servers live in their own modules; this file stays small."""

from __future__ import annotations

import os

os.environ.setdefault("NO_GCE_CHECK", "true")  # before google.auth is imported anywhere

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

import pytest  # noqa: E402
from support.s3_server import s3_bucket, s3_proxy, s3_server  # noqa: E402,F401
from support.servers import gcs_bucket, gcs_server, http_folder, http_server  # noqa: E402,F401

from trainckpt import Checkpointer, CheckpointerConfig  # noqa: E402

if TYPE_CHECKING:
    from support.crash_worker import Launcher

# Files that take minutes each. They are collected first so that, under pytest-xdist
# (`--dist loadfile --no-loadscope-reorder`, as scripts/test.sh runs it), the workers start on
# them and finish together, instead of one worker picking up a long file at the end. Only the
# order changes; a file missing from this list just runs in its usual place.
SLOW_FILES = (  # paths under tests/, by their total time in a measured run, longest first
    "distributed/test_local_tier.py",  # ~150 s serially on a loaded 2-core machine (forked ranks)
    "cli/test_cli.py",
    "e2e/test_torchtitan_manager.py",
    "e2e/test_olmo_trainer.py",
    "crash/test_exit_without_close.py",
    "unit/test_docs_examples.py",
    "crash/test_fault_injection_s3.py",
    "crash/test_concurrent_saves_remote.py",
    "distributed/test_distributed.py",
    "distributed/test_resharding.py",
    "crash/test_fault_injection_gcs.py",
    "crash/test_fault_random.py",
    "unit/test_storage_errors.py",
    "integrity/test_item_checks.py",
    "integrity/test_hostile_records.py",
    "e2e/test_rollback_integrations.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    here = Path(__file__).parent

    def key(item: pytest.Item) -> int:
        inside = item.path.is_relative_to(here)
        return rank.get(item.path.relative_to(here).as_posix(), len(rank)) if inside else len(rank)

    items.sort(key=key)  # stable


@pytest.fixture
def ckpt(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Checkpointer]:
    """A Checkpointer with its work_dir under the test's folder, default settings but those of
    the nearest `@pytest.mark.ckpt(setting=value, ...)` (on the test, or a file's `pytestmark`)."""
    marker = request.node.get_closest_marker("ckpt")
    c = CheckpointerConfig(work_dir=tmp_path / "work", **(marker.kwargs if marker else {})).build()
    yield c
    c.close()


@pytest.fixture(scope="session")
def launcher() -> Launcher:
    """Starts the crash tests' training runs, forked from one forkserver that preloaded
    `support.crash_worker` (imported only here: it pays torch's slow lazy imports up front)."""
    from support.crash_worker import Launcher

    return Launcher.create()


@pytest.fixture
def single_rank(tmp_path: Path) -> Iterator[None]:
    """A gloo process group of one rank for the test, destroyed after it (torchtitan's manager
    needs one for retention and async saves; the torchtitan tests give trainckpt's one too)."""
    import torch.distributed as dist
    from support.titan_run import init_single_rank

    init_single_rank(tmp_path / "pg")
    yield
    dist.destroy_process_group()

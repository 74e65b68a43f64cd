"""`record_steps`: a test of DCP's `.metadata` reader runs once with the per-record steps in C
(`fast_records`, what every load uses) and once with the Python steps alone (what an install
without a C compiler uses), so that every crafted pickle is refused by both. `saved_once`
and its `metadata_bytes`: a real trainckpt save, for the tests to craft from."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.models import make_module

from trainckpt import CheckpointerConfig
from trainckpt.format.safe_unpickle import dcp_allow_list


@pytest.fixture(params=["C steps", "Python steps"])
def record_steps(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "C steps":
        assert dcp_allow_list.compiled is not None, (
            "trainckpt.format.safe_unpickle.fast_records was not built: install a C compiler "
            "and Python's headers (Debian: gcc python3-dev), then rerun scripts/setup.sh"
        )
    else:
        monkeypatch.setattr(dcp_allow_list, "compiled", None)
    yield request.param


@pytest.fixture(scope="module")
def saved_once(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real trainckpt checkpoint: a small model and optimizer, trainer state {"step": 2}."""
    root = tmp_path_factory.mktemp("saved")
    c = CheckpointerConfig(work_dir=root / "work").build()
    path = Path(c.save(root / "run" / "step2", make_module(), {"step": 2}))
    c.close()
    return path


@pytest.fixture(scope="module")
def metadata_bytes(saved_once: Path) -> bytes:
    return (saved_once / "model_and_optim" / ".metadata").read_bytes()

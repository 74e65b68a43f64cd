"""`record_steps`: a test of DCP's `.metadata` reader runs once with the per-record steps in C
(`fast_records`, what every load uses) and once with the Python steps alone (what an install
without a C compiler uses), so that every crafted pickle is refused by both."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

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

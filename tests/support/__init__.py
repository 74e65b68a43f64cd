"""Helpers shared by the tests: real servers, ranks, models, hostile payloads, worker scripts.

Imported as `support.<module>`: `tests/` is on `sys.path` (`pythonpath` in pyproject.toml), and
the scripts here that run as their own processes put it there themselves."""

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent  # scripts run by path: `SUPPORT / "rank_worker.py"`
TESTS = SUPPORT.parent  # the folder that makes `import support` work (for PYTHONPATH)

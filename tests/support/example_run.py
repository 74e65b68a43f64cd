"""Helpers to run `scripts/train.py` (the example) in real subprocesses and read its checkpoints."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import yaml

from trainckpt import CheckpointerConfig, ModelAndOptim

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "scripts" / "train.py"
sys.path.insert(0, str(ROOT / "scripts"))
from tinylm import ModelConfig, TinyLM  # noqa: E402


class Run:
    """A `scripts/train.py` process whose output lines are read on a thread, so the test can
    wait for a given line with a deadline instead of sleeping."""

    def __init__(self, *args: str, launcher: list[str] | None = None) -> None:
        cmd = (launcher or [sys.executable]) + [str(TRAIN), *args]
        env = {**os.environ, "NO_GCE_CHECK": "true", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match[str]:
        """The first new output line matching `pattern`; fails at exit or after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                msg = f"no line matching {pattern!r} in {timeout}s:\n{self.output}"
                raise AssertionError(msg) from None
            if line is None:
                raise AssertionError(f"exited before a line matching {pattern!r}:\n{self.output}")
            self.lines.append(line)
            if m := re.search(pattern, line):
                return m

    def finish(self, timeout: float = 240) -> int:
        """Wait for the exit; return the exit status with all output collected."""
        rc = self.proc.wait(timeout)
        while (line := self._queue.get(timeout=30)) is not None:
            self.lines.append(line)
        return rc

    @property
    def output(self) -> str:
        return "".join(self.lines)


def write_config(tmp_path: Path, name: str = "cfg.yaml", **policy: object) -> Path:
    """configs/train-tiny.yaml with a loss line every step and a policy that saves often
    (`policy` overrides its fields)."""
    cfg = yaml.safe_load((ROOT / "configs" / "train-tiny.yaml").read_text())
    cfg["train"]["log_every"] = 1
    cfg["policy"] = {
        "save_interval": 20,
        "ephemeral_save_interval": 5,
        "max_checkpoints": 2,
        "save_async": True,
        **policy,
    }
    cfg["checkpointer"]["work_dir"] = str(tmp_path / "work")
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def train(
    config: Path, folder: Path | str, steps: int, *, launcher: list[str] | None = None
) -> str:
    run = Run(str(config), "--save-folder", str(folder), "--steps", str(steps), launcher=launcher)
    rc = run.finish()
    assert rc == 0, run.output
    return run.output


def final_state(config: Path, checkpoint: Path) -> tuple[dict, dict, dict]:
    """Model tensors, optimizer state and trainer state of a checkpoint of the example."""
    model = TinyLM(ModelConfig(**yaml.safe_load(config.read_text())["model"]))
    optim = torch.optim.AdamW(model.parameters())
    ckpt = CheckpointerConfig(work_dir=checkpoint.parent / "load-work").build()
    trainer = ckpt.load(checkpoint, ModelAndOptim(model, optim))
    ckpt.close()
    assert trainer is not None
    return model.state_dict(), optim.state_dict(), trainer

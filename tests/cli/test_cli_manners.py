"""How the `trainckpt` command behaves towards the person at the terminal: `--help` and
`--version` without torch, each subcommand importing only what it uses, a quiet end when the
reader of its output goes away (`| head`), help naming every scheme, malformed URLs refused
naming the argument, and a status line while a slow remote keeps it waiting."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.models import make_module

from trainckpt import CheckpointerConfig
from trainckpt.cli.main import EXIT_PIPE_CLOSED, build_parser, main

TRAINCKPT = Path(sys.executable).with_name("trainckpt")


def imported_modules(*args: str) -> set[str]:
    """The top-level packages `python -m trainckpt ARGS` imports (from `-X importtime`)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "trainckpt", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    names = {
        line.rsplit("|", 1)[-1].strip()
        for line in proc.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    return {name.split(".")[0] for name in names}


@pytest.fixture(scope="module")
def save_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A save folder with one small committed checkpoint (`step1`)."""
    root = tmp_path_factory.mktemp("manners")
    ckpt = CheckpointerConfig(work_dir=str(root / "work")).build()
    ckpt.save(str(root / "run" / "step1"), make_module(seed=1, steps=1), {"step": 1})
    ckpt.close()
    return root / "run"


def test_help_and_version_do_not_import_torch():
    for args in (["--help"], ["--version"], ["ls", "--help"], ["export", "--help"]):
        modules = imported_modules(*args)
        assert "trainckpt" in modules
        assert not modules & {"torch", "pydantic", "tqdm", "google", "boto3", "requests"}, args


def test_subcommands_import_only_what_they_use(save_folder: Path):
    """Listing and checking sizes read JSON records: no torch (inspect and export need it)."""
    for args in (["ls", str(save_folder)], ["verify", str(save_folder / "step1")]):
        assert "torch" not in imported_modules(*args), args


def test_a_reader_that_goes_away_ends_the_command_quietly(save_folder: Path):
    """`trainckpt inspect X | head`: the read end of a real pipe is closed before the command
    writes; it exits with 141 (as a command SIGPIPE ended) and prints nothing on stderr."""
    proc = subprocess.Popen(
        [str(TRAINCKPT), "inspect", str(save_folder / "step1")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == EXIT_PIPE_CLOSED, err
    assert err == ""


def test_help_names_every_scheme(capsys: pytest.CaptureFixture[str]):
    parser = build_parser()
    for args in (["--help"], ["ls", "--help"], ["inspect", "--help"], ["export", "--help"]):
        with pytest.raises(SystemExit):
            parser.parse_args(args)
        text = capsys.readouterr().out
        for scheme in ("file://", "gs://", "s3://", "http(s)://"):
            assert scheme in text, (args, scheme)


@pytest.mark.parametrize(
    "args, argument",
    [
        (["inspect", "http://[::1/step1"], "ckpt"),
        (["verify", "http://127.0.0.1:99999/step1"], "ckpt"),
        (["verify", "https:///step1"], "ckpt"),
        (["ls", "gs://my bucket/run"], "folder"),
        (["export", "s3://b/step1", "s3://bad|bucket/out.safetensors"], "out"),
    ],
)
def test_a_malformed_url_is_refused_naming_the_argument(
    args: list[str], argument: str, capsys: pytest.CaptureFixture[str]
):
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argument}: '" in err and "is not a valid URL" in err, err
    assert "InvalidURL" not in err and "ParamValidationError" not in err and "Error:" not in err


def test_a_slow_remote_says_what_the_command_waits_for(http_server, http_folder):
    """A server that answers 503 to everything, each after 1 s: after about 2 s a line on
    stderr names the URL and the retry deadline; the command still ends with its one-line error.
    (The delay makes the command outlast the 2 s: with full-jitter backoff a request may give up
    well before its deadline, when the next drawn wait would end past it.)"""
    _, url = http_folder
    http_server.failures[:] = [503] * 100
    http_server.failure_delay = 1.0
    try:
        proc = subprocess.run(
            [str(TRAINCKPT), "--timeout", "3", "verify", f"{url}/step1"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        http_server.failures.clear()
        http_server.failure_delay = 0.0
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert lines[0] == (
        f"trainckpt verify: waiting for '{url}/step1' (each request is retried for up to 3s; "
        "--timeout SECONDS changes that)"
    ), proc.stderr
    assert lines[-1].startswith("trainckpt verify: error:") and "HTTP 503" in lines[-1]


def test_a_quick_command_prints_no_status_line(save_folder: Path):
    proc = subprocess.run(
        [str(TRAINCKPT), "latest", str(save_folder)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert proc.stdout.strip().endswith("step1") and proc.stderr == ""
    assert torch.__version__  # the test process itself may import torch

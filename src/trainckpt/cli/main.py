"""The `trainckpt` command: look after checkpoint folders between runs.

    trainckpt ls FOLDER            step folders: committed, uncommitted and -tmp leftovers
    trainckpt latest FOLDER        path of the newest committed checkpoint (exit 1 when none)
    trainckpt inspect CKPT         records, trainer-state keys, every DCP value
    trainckpt verify CKPT          sizes (or, with --deep, CRC32C) against the manifest
    trainckpt prune FOLDER -k N    delete all but the newest N permanent checkpoints
    trainckpt export CKPT OUT      one safetensors/torch file of the model weights

Exit codes: 0 success; 1 `verify` found problems or `latest` found no checkpoint; 2 the input
cannot be used (missing path, damaged record, bad option, a folder of checkpoints where one
checkpoint is wanted or the reverse, unreachable storage). Errors are one line on stderr naming
the path and what to do; `--debug` adds the traceback. `--timeout SECONDS` bounds how long a
storage request is retried (default 60).

This module parses the command line and turns every failure into that one line and exit code;
what each subcommand does is in `commands.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

# Only what parsing the command line needs is imported here: `trainckpt --help` and
# `--version` answer without torch, and each subcommand imports what it uses when it runs.
from trainckpt.cli.commands import (
    EXIT_UNUSABLE,
    cmd_export,
    cmd_inspect,
    cmd_latest,
    cmd_ls,
    cmd_prune,
    cmd_verify,
)
from trainckpt.cli.status import SlowRemoteNotice, silence_stdout
from trainckpt.errors import CheckpointError, ConfigurationError
from trainckpt.storage.urls import check_location, is_remote
from trainckpt.version import __version__

EXIT_PIPE_CLOSED = 141
"""The reader of stdout went away (`trainckpt ls X | head`): 128 + SIGPIPE, as a shell reports a
command the closed pipe killed; nothing is printed."""
DEFAULT_TIMEOUT = 60.0
"""Seconds a storage request is retried by default: a person waits at a terminal (a training
job's `retry_deadline` defaults to 300)."""


WHERE_HELP = """\
FOLDER, CKPT and OUT are local paths or URLs:
  path, file:///path       a local or shared (NFS) filesystem
  gs://bucket/prefix       Google Cloud Storage (credentials: GOOGLE_APPLICATION_CREDENTIALS)
  s3://bucket/prefix       S3 and S3-compatible stores (the [s3] extra; AWS_ENDPOINT_URL_S3)
  http(s)://host/path      read-only: inspect, verify and export one checkpoint (no listing)
"""
FOLDER_HELP = "save folder: a local path, file://, gs://bucket/prefix or s3://bucket/prefix"
CKPT_HELP = "one checkpoint folder: a local path, file://, gs://, s3:// or http(s):// URL"


def build_parser() -> argparse.ArgumentParser:
    # --debug/-v work before or after the subcommand: the subcommands' copies default to
    # SUPPRESS, so they do not reset a flag given before the subcommand.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show tracebacks and debug logs",
    )
    common.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="show logs"
    )
    common.add_argument(
        "--timeout",
        type=_seconds,
        default=argparse.SUPPRESS,
        metavar="SECONDS",
        help="how long a storage request is retried before the command fails "
        f"(retry_deadline; default {DEFAULT_TIMEOUT:g})",
    )
    bar = argparse.ArgumentParser(add_help=False)
    bar.add_argument(
        "--progress",
        dest="progress",
        action="store_true",
        default=None,
        help="show a progress bar even when stderr is not a terminal",
    )
    bar.add_argument(
        "--no-progress", dest="progress", action="store_false", help="never show a progress bar"
    )

    parser = argparse.ArgumentParser(
        prog="trainckpt",
        description="Look after trainckpt (and OLMo-core) checkpoint folders.",
        epilog=WHERE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"trainckpt {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    parser.add_argument("-v", "--verbose", action="store_true", help="show logs")
    parser.add_argument(
        "--timeout",
        type=_seconds,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help="how long a storage request is retried before the command fails",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(
        name: str,
        func: Callable[[argparse.Namespace], int],
        help: str,
        parents: Sequence[argparse.ArgumentParser] = (),
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            help=help,
            description=help,
            epilog=WHERE_HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            parents=[common, *parents],
        )
        p.set_defaults(func=func)
        return p

    p = add("ls", cmd_ls, "list the step folders of a save folder, committed or not")
    p.add_argument("folder", type=_location, help=FOLDER_HELP)
    p.add_argument("--json", action="store_true", help="print JSON for scripts")

    p = add("latest", cmd_latest, "print the path of the newest committed checkpoint")
    p.add_argument("folder", type=_location, help=FOLDER_HELP)

    p = add("inspect", cmd_inspect, "show a checkpoint's records, trainer state and tensors")
    p.add_argument("ckpt", type=_location, help=f"{CKPT_HELP} (e.g. runs/demo/step1000)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")

    p = add("verify", cmd_verify, "check a checkpoint's files against its manifest", [bar])
    p.add_argument("ckpt", type=_location, help=CKPT_HELP)
    p.add_argument("--deep", action="store_true", help="recompute every CRC32C (reads all bytes)")

    p = add(
        "prune",
        cmd_prune,
        "delete all but the newest N permanent checkpoints, and crash leftovers "
        "(the folders of saves still running are kept)",
    )
    p.add_argument("folder", type=_location, help=FOLDER_HELP)
    p.add_argument(
        "-k",
        "--keep-last",
        type=int,
        required=True,
        metavar="N",
        help="permanent checkpoints to keep (the newest committed one is always kept)",
    )
    p.add_argument("--keep-ephemeral", action="store_true", help="keep ephemeral checkpoints")
    p.add_argument("-n", "--dry-run", action="store_true", help="print what would be deleted")

    p = add(
        "export", cmd_export, "consolidate a checkpoint into one safetensors or torch file", [bar]
    )
    p.add_argument("ckpt", type=_location, help=CKPT_HELP)
    p.add_argument(
        "out",
        type=_location,
        help="output file: a local path, file://, gs://bucket/key or s3://bucket/key",
    )
    p.add_argument(
        "--format",
        choices=["safetensors", "torch"],
        default=None,
        help="default: torch for .pt/.pth/.bin, else safetensors",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16", "float64"],
        help="convert floating-point tensors to this dtype",
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument(
        "--model-only",
        action="store_true",
        help="model weights, keys without 'model.' (the default)",
    )
    what.add_argument(
        "--all", action="store_true", help="every value (model and optimizer) with its full key"
    )
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="where the file is assembled before it is published (default: temp)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `trainckpt` and `python -m trainckpt`; returns the exit code."""
    args = build_parser().parse_args(argv)
    level = logging.DEBUG if args.debug else logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    from trainckpt.storage import default_options
    from trainckpt.storage.base import DEFAULT_OPTIONS

    options = dataclasses.replace(DEFAULT_OPTIONS, retry_deadline=args.timeout)
    try:
        with (
            default_options(options),
            SlowRemoteNotice(args.command, _locations(args), args.timeout),
        ):
            code = int(args.func(args))
            sys.stdout.flush()  # a closed pipe shows here, not at the interpreter's exit
            return code
    except BrokenPipeError:
        silence_stdout()
        return EXIT_PIPE_CLOSED
    except KeyboardInterrupt:
        print(f"trainckpt {args.command}: interrupted", file=sys.stderr)
        return 130
    except BaseException as e:  # every failure is one line; --debug shows where it came from
        if isinstance(e, (SystemExit, GeneratorExit)):
            raise
        if args.debug:
            traceback.print_exc()
        print(f"trainckpt {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_UNUSABLE


def _location(text: str) -> str:
    """An argparse type: a malformed URL is refused as "argument ckpt: '…' is not a valid URL"."""
    try:
        check_location(text)
    except ConfigurationError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _locations(args: argparse.Namespace) -> list[str]:
    """The remote locations among the command's arguments: what a slow command waits for."""
    given = (getattr(args, name, None) for name in ("folder", "ckpt", "out"))
    return [str(loc) for loc in given if loc is not None and is_remote(str(loc))]


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    if "retry_deadline" in text:
        text += " (here: --timeout SECONDS)"
    if isinstance(e, CheckpointError):
        return text
    hint = "" if "--debug" in text else " (rerun with --debug for the traceback)"
    return f"{type(e).__name__}: {text or 'no message'}{hint}"

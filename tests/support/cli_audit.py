"""Run the `trainckpt` command in this process while recording every file removal it makes.

    python tests/cli_audit.py LOG [--die-in FOLDER] -- prune ...

An audit hook (`sys.addaudithook`, fired by the interpreter before each `os.remove`/`os.rmdir`/
`shutil.rmtree`) appends "event path" lines to LOG. With `--die-in FOLDER`, the process kills
itself (`os._exit`, no cleanup) at the first removal of a data file under FOLDER: a real crash
in the middle of deleting that checkpoint, at the point where the commit record is already gone
(if the order is right) and no data file is.
"""

from __future__ import annotations

import os
import sys

from trainckpt.cli.main import main


def run() -> int:
    log_path, rest = sys.argv[1], sys.argv[2:]
    die_in = None
    if rest[:1] == ["--die-in"]:
        die_in, rest = os.path.abspath(rest[1]) + os.sep, rest[2:]
    assert rest[:1] == ["--"], "usage: cli_audit.py LOG [--die-in FOLDER] -- ARGS..."
    log = open(log_path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process

    def hook(event: str, args: tuple) -> None:
        if event not in ("os.remove", "os.rmdir", "shutil.rmtree"):
            return
        path = os.path.abspath(os.fsdecode(args[0]))
        log.write(f"{event} {path}\n")
        data_file = event == "os.remove" and os.path.basename(path) != ".metadata.json"
        if die_in and data_file and path.startswith(die_in):
            log.write("died\n")
            log.flush()
            os._exit(9)

    sys.addaudithook(hook)
    return main(rest[1:])


if __name__ == "__main__":
    sys.exit(run())

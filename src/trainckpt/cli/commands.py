"""What each `trainckpt` subcommand does (`ls`, `latest`, `inspect`, `verify`, `prune`,
`export`), given its parsed arguments; returns the exit code.

Split from `main.py`, which parses the command line and reports errors. Each subcommand imports
what it uses when it runs, so `trainckpt --help` answers without torch. Called on: the one
process of the command.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from trainckpt.errors import CheckpointNotFoundError

if TYPE_CHECKING:
    from trainckpt.format.folder_scan import FolderEntry

EXIT_OK, EXIT_PROBLEMS, EXIT_UNUSABLE = 0, 1, 2
"""0 success; 1 `verify` found problems or `latest` found no checkpoint; 2 the input cannot be
used (`main.py`'s docstring)."""


def cmd_ls(args: argparse.Namespace) -> int:
    from trainckpt.cli.output import table
    from trainckpt.format import folder
    from trainckpt.format.folder_scan import scan_folder
    from trainckpt.storage import resolve

    storage, path = resolve(args.folder)
    entries = scan_folder(storage, path)
    if not entries and folder.is_checkpoint(storage, path):
        raise CheckpointNotFoundError(
            f"'{path}' is a checkpoint, not a folder of checkpoints; "
            f"`trainckpt inspect {path}` shows its contents"
        )
    if args.json:
        print(json.dumps([e.to_json() for e in entries], indent=1))
        return EXIT_OK
    if not entries:
        print(f"no step folders in '{path}'", file=sys.stderr)
        return EXIT_OK
    rows = [_ls_row(e) for e in entries]
    header = ["STEP", "NAME", "KIND", "STATE", "SIZE", "FILES", "AGE", "WORLD", "NOTE"]
    print(table(header, rows, right={"STEP", "SIZE", "FILES", "AGE", "WORLD"}))
    return EXIT_OK


def _ls_row(e: FolderEntry) -> list[str]:
    from trainckpt.cli.output import age_seconds, human_age, human_size

    kind = "-" if e.ephemeral is None else "ephemeral" if e.ephemeral else "permanent"
    world = str(e.world_size) if e.world_size is not None else "-"
    return [
        str(e.step),
        e.name,
        kind,
        e.state,
        human_size(e.size),
        str(e.files),
        human_age(age_seconds(e.created_at)),
        world,
        e.note,
    ]


def cmd_latest(args: argparse.Namespace) -> int:
    from trainckpt.format import folder
    from trainckpt.storage import resolve

    storage, path = resolve(args.folder)
    # a missing folder is unusable (exit 2), not "none found"
    if not folder.step_folders(storage, path):
        if folder.is_checkpoint(storage, path):
            raise CheckpointNotFoundError(
                f"'{path}' is a checkpoint, not a folder of checkpoints; pass the folder "
                f"that holds it: `trainckpt latest {storage.parent(path)}`"
            )
    try:
        print(folder.latest_checkpoint(storage, path))
    except CheckpointNotFoundError as e:
        print(f"trainckpt latest: {e}", file=sys.stderr)
        return EXIT_PROBLEMS
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    from trainckpt.cli.inspect import describe_checkpoint
    from trainckpt.cli.output import age_seconds, human_age, human_size, table

    report = describe_checkpoint(args.ckpt)
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
        return EXIT_OK
    out: list[str] = [f"checkpoint     {report.path}"]
    if report.metadata is not None:
        kind = "ephemeral" if report.metadata.ephemeral else "permanent"
        out.append(f"commit record  {kind}, written by version {report.metadata.version}")
    if report.manifest is not None:
        m = report.manifest
        size = sum(e.size for e in m.files.values())
        age = human_age(age_seconds(m.created_at))
        out.append(
            f"manifest       format {m.format}, step {m.step}, created {m.created_at} "
            f"({age} ago), world size {m.world_size}, {len(m.files)} files, {human_size(size)}"
        )
    out += [f"note           {n}" for n in report.notes]
    ranks = len(report.trainer_state_files)
    out.append(
        f"trainer state  {ranks} rank file(s); rank 0's keys:" if ranks else "trainer state  none"
    )
    out += [f"  {k} = {v}" for k, v in report.trainer_state.items()]
    groups = ", ".join(f"{g} {human_size(n)}" for g, n in report.bytes_by_group().items())
    out.append(f"DCP contents   {len(report.values)} values in {report.dcp_folder}: {groups}")
    tensors = [v for v in report.values if v.kind == "tensor"]
    rows = [
        [v.key, v.dtype or "", "x".join(map(str, v.shape or ())) or "-", human_size(v.nbytes)]
        for v in tensors
    ]
    out.append(table(["KEY", "DTYPE", "SHAPE", "SIZE"], rows, right={"SIZE"}, indent="  "))
    plain = [v.key for v in report.values if v.kind != "tensor"]
    if plain:
        under = sorted({".".join(k.split(".")[:2]) for k in plain})
        out.append(
            f"  and {len(plain)} plain (non-tensor) values under {', '.join(under)} "
            "(--json lists them)"
        )
    print("\n".join(out))
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from trainckpt.cli.checks import require_one_checkpoint
    from trainckpt.cli.output import progress_bar
    from trainckpt.format.folder import checkpoint_size
    from trainckpt.format.verify import verify_checkpoint
    from trainckpt.storage import resolve

    storage, path = resolve(args.ckpt)
    require_one_checkpoint(storage, path, "verify {}")
    with progress_bar("verifying", args.progress) as progress:
        if progress is not None:
            progress.set_total(checkpoint_size(storage, path))
        report = verify_checkpoint(storage, path, deep=args.deep, progress=progress)
    print(report)
    return EXIT_OK if report.ok else EXIT_PROBLEMS


def cmd_prune(args: argparse.Namespace) -> int:
    from trainckpt.cli.output import human_size
    from trainckpt.format.folder_scan import scan_folder
    from trainckpt.retention.prune import apply_prune, plan_prune
    from trainckpt.storage import resolve

    storage, path = resolve(args.folder)
    entries = scan_folder(storage, path)
    plan = plan_prune(path, entries, keep_last=args.keep_last, keep_ephemeral=args.keep_ephemeral)
    for d in plan.decisions:
        if not d.delete:
            print(f"keep          {d.entry.name:<16} {d.reason}")
    why = {d.entry.path: f"{d.reason}, {human_size(d.entry.size)}" for d in plan.decisions}
    if args.dry_run:
        for e in plan.to_delete:
            print(f"would delete  {e.name:<16} {why[e.path]}")
        n, size = len(plan.to_delete), human_size(plan.freed_bytes)
        print(f"dry run: would delete {n} folder(s), {size}; nothing was deleted")
        return EXIT_OK
    deleted: list[FolderEntry] = []

    def on_deleted(e: FolderEntry) -> None:
        deleted.append(e)
        print(f"deleted       {e.name:<16} {why[e.path]}")

    def on_kept(e: FolderEntry) -> None:
        print(f"keep          {e.name:<16} a save of this step is in progress")

    apply_prune(plan, on_deleted, on_kept)
    print(f"deleted {len(deleted)} folder(s), {human_size(sum(e.size for e in deleted))}")
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from trainckpt.cli.export import DTYPES, export_checkpoint, format_for
    from trainckpt.cli.output import human_size, progress_bar

    fmt = format_for(args.out, args.format)
    with progress_bar("loading", args.progress) as progress:
        result = export_checkpoint(
            args.ckpt,
            args.out,
            fmt=fmt,
            dtype=DTYPES[args.dtype] if args.dtype else None,
            model_only=not args.all,
            overwrite=args.overwrite,
            work_dir=args.work_dir,
            progress=progress,
            on_total=progress.set_total if progress is not None else None,
        )
    extra = f" and {result.values} plain values" if result.values else ""
    print(
        f"wrote {result.out} ({result.format}): {result.tensors} tensors{extra}, "
        f"{human_size(result.nbytes)}"
    )
    return EXIT_OK

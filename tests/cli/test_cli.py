"""The installed `trainckpt` command, run in subprocesses against real checkpoint folders: local
folders written by `Checkpointer.save` (one process, and two FSDP2 ranks for a really sharded
checkpoint) and a fake-gcs-server bucket. Each subcommand's output and exit code; prune's order
and crash safety (the command killed mid-delete); export's round trip of every tensor."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support import SUPPORT
from support.models import TinyNet, make_module
from support.multiproc import run_ranks
from torch.distributed.checkpoint import FileSystemReader

from trainckpt import Checkpointer, CheckpointerConfig
from trainckpt.format.folder_scan import scan_folder
from trainckpt.storage import resolve

TRAINCKPT = Path(sys.executable).with_name("trainckpt")
AUDIT = SUPPORT / "cli_audit.py"


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run the installed command; its environment is this process's (emulator host included)."""
    return subprocess.run(
        [str(TRAINCKPT), *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Exit code 2, nothing on stdout, one line on stderr naming what it should, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    err = proc.stderr.strip()
    if ": waiting for '" in err:  # a slow remote's status line (and retries) come first
        err = err.splitlines()[-1]
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("trainckpt "), err
    for needle in needles:
        assert needle in err, (needle, err)


def tree_digest(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under `folder`."""
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


# -- fixtures: real checkpoints ------------------------------------------------------------------


def save_run(ckpt: Checkpointer, folder: str) -> dict[str, dict[str, torch.Tensor]]:
    """Save steps 100, 200, 300 (permanent) and 250 (ephemeral), training between saves;
    return each step's model state."""
    module = make_module(seed=3, steps=1)
    states: dict[str, dict[str, torch.Tensor]] = {}
    for step, ephemeral in ((100, False), (200, False), (250, True), (300, False)):
        with torch.no_grad():
            for p in module.model.parameters():
                p.add_(0.01 * step)
        ckpt.save(f"{folder}/step{step}", module, {"step": step, "lr": 0.5}, ephemeral=ephemeral)
        states[f"step{step}"] = {k: v.clone() for k, v in module.model.state_dict().items()}
    return states


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A save folder with four committed checkpoints and two crash leftovers: `step350` (a
    folder without commit record) and `step400-tmp` (a save's working folder)."""
    root = tmp_path_factory.mktemp("cli")
    folder = root / "run"
    ckpt = CheckpointerConfig(work_dir=str(root / "work")).build()
    states = save_run(ckpt, str(folder))
    ckpt.close()
    shutil.copytree(folder / "step300", folder / "step350")
    (folder / "step350" / ".metadata.json").unlink()
    shutil.copytree(folder / "step350", folder / "step400-tmp")
    (folder / "step400-tmp" / ".manifest.json").unlink()
    return folder, states


@pytest.fixture
def run_folder(template: tuple[Path, dict], tmp_path: Path) -> Path:
    """A private copy of the template save folder, for tests that change it."""
    return Path(shutil.copytree(template[0], tmp_path / "run"))


def _save_sharded(rank: int, world: int, folder: str) -> dict[str, Any]:
    """Two FSDP2 ranks train one step and save; rank 0 returns the full (unsharded) state."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainckpt import ModelAndOptim

    torch.manual_seed(11)
    model = TinyNet(32)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 64, (4, 8))
    model(tokens).square().mean().backward()
    optim.step()
    ckpt = CheckpointerConfig(work_dir=f"{folder}/work{rank}").build()
    ckpt.save(f"{folder}/run/step10", ModelAndOptim(model, optim), {"step": 10})
    ckpt.close()
    full = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    return {
        "model": get_model_state_dict(model, options=full),
        "optim": get_optimizer_state_dict(model, optim, options=full),
    }


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A checkpoint written by two FSDP2 ranks (every parameter split across both), and the
    full state it holds."""
    root = tmp_path_factory.mktemp("sharded")
    full = run_ranks(_save_sharded, 2, str(root))[0]
    ckpt = root / "run" / "step10"
    assert sorted(p.name for p in (ckpt / "model_and_optim").glob("__1_*.distcp"))  # rank 1 wrote
    return ckpt, full


# -- ls, latest, inspect -------------------------------------------------------------------------


def test_ls_shows_committed_uncommitted_and_tmp(template: tuple[Path, dict]):
    folder, _ = template
    table = run_cli("ls", str(folder))
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:8] == [
        "STEP",
        "NAME",
        "KIND",
        "STATE",
        "SIZE",
        "FILES",
        "AGE",
        "WORLD",
    ]
    rows = {line.split()[1]: line.split() for line in lines[1:]}
    assert list(rows) == ["step100", "step200", "step250", "step300", "step350", "step400-tmp"]
    assert rows["step250"][2:4] == ["ephemeral", "committed"]
    assert rows["step300"][2:4] == ["permanent", "committed"]
    assert rows["step350"][2:4] == ["-", "uncommitted"]
    assert rows["step400-tmp"][2:4] == ["-", "tmp"]

    listed = json.loads(run_cli("ls", str(folder), "--json").stdout)
    by_name = {e["name"]: e for e in listed}
    for name, entry in by_name.items():
        files = [p for p in (folder / name).rglob("*") if p.is_file()]
        assert entry["files"] == len(files)
        assert entry["size"] == sum(p.stat().st_size for p in files)
        assert entry["path"] == str(folder / name)
    assert [by_name[n]["ephemeral"] for n in ("step100", "step250", "step350")] == [
        False,
        True,
        None,
    ]
    assert by_name["step300"]["world_size"] == 1 and by_name["step300"]["created_at"]
    assert by_name["step400-tmp"]["state"] == "tmp" and by_name["step400-tmp"]["world_size"] == 1


def test_ls_and_latest_errors(template: tuple[Path, dict], tmp_path: Path):
    folder, _ = template
    missing = tmp_path / "nowhere"
    assert_one_line_error(run_cli("ls", str(missing)), str(missing), "does not exist")
    assert_one_line_error(run_cli("latest", str(missing)), str(missing), "does not exist")

    debug = run_cli("--debug", "ls", str(missing))
    assert debug.returncode == 2 and "Traceback" in debug.stderr

    empty = tmp_path / "empty"
    shutil.copytree(folder / "step350", empty / "step350")  # only a leftover: no checkpoint
    none = run_cli("latest", str(empty))
    assert none.returncode == 1 and none.stdout == ""
    assert str(empty) in none.stderr and "no committed checkpoint" in none.stderr


def test_debug_and_verbose_flags_work_before_or_after_the_subcommand():
    from trainckpt.cli.main import build_parser

    parser = build_parser()
    for argv in (["--debug", "ls", "x"], ["ls", "x", "--debug"], ["ls", "--debug", "x"]):
        assert parser.parse_args(argv).debug is True, argv
    assert parser.parse_args(["ls", "x"]).debug is False
    assert parser.parse_args(["-v", "prune", "x", "-k", "1"]).verbose is True


def test_latest_prints_newest_committed(template: tuple[Path, dict]):
    """Through `python -m trainckpt`, which is the same command."""
    folder, _ = template
    proc = subprocess.run(
        [sys.executable, "-m", "trainckpt", "latest", str(folder)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{folder / 'step300'}\n"  # not step350 (uncommitted) nor step400-tmp


def test_inspect_lists_records_trainer_state_and_every_tensor(template: tuple[Path, dict]):
    folder, states = template
    model_state = states["step250"]
    text = run_cli("inspect", str(folder / "step250"))
    assert text.returncode == 0, text.stderr
    assert "ephemeral" in text.stdout and "world size 1" in text.stdout
    assert "step = 250" in text.stdout and "lr = 0.5" in text.stdout
    for key, tensor in model_state.items():
        line = next(ln for ln in text.stdout.splitlines() if ln.split()[:1] == [f"model.{key}"])
        assert line.split()[1] == str(tensor.dtype).removeprefix("torch.")
        assert line.split()[2] == "x".join(map(str, tensor.shape))

    report = json.loads(run_cli("inspect", str(folder / "step250"), "--json").stdout)
    assert report["metadata"]["ephemeral"] is True
    assert report["manifest"]["step"] == 250 and report["manifest"]["world_size"] == 1
    assert report["trainer_state_files"] == ["train/rank0.pt"]
    assert report["trainer_state"] == {"step": "250", "lr": "0.5"}
    tensors = {v["key"]: v for v in report["values"] if v["kind"] == "tensor"}
    for key, tensor in model_state.items():
        assert tensors[f"model.{key}"]["shape"] == list(tensor.shape)
    model_bytes = sum(t.numel() * t.element_size() for t in model_state.values())
    assert report["bytes_by_group"]["model"] == model_bytes
    # AdamW keeps two moments per parameter, plus a step scalar each: more than the model
    assert report["bytes_by_group"]["optim"] > 2 * model_bytes

    assert_one_line_error(
        run_cli("inspect", str(folder)), "holds checkpoints but is not one", str(folder / "step300")
    )


# -- verify --------------------------------------------------------------------------------------


def test_verify_exit_codes(run_folder: Path):
    good = run_cli("verify", str(run_folder / "step200"), "--deep")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "is ok" in good.stdout and "CRC32C" in good.stdout

    shard = next((run_folder / "step200" / "model_and_optim").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one flipped byte: only --deep sees it
    shard.write_bytes(bytes(data))
    assert run_cli("verify", str(run_folder / "step200")).returncode == 0
    deep = run_cli("verify", str(run_folder / "step200"), "--deep", "--progress")
    assert deep.returncode == 1, deep.stdout + deep.stderr
    assert shard.name in deep.stdout and "1 problem" in deep.stdout
    assert "verifying" in deep.stderr  # the byte progress bar was drawn

    assert_one_line_error(run_cli("verify", str(run_folder / "nowhere")), "does not exist")


# -- prune ---------------------------------------------------------------------------------------


def test_prune_dry_run_deletes_nothing(run_folder: Path):
    before = tree_digest(run_folder)
    proc = run_cli("prune", str(run_folder), "--keep-last", "1", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert tree_digest(run_folder) == before
    would = [ln.split()[2] for ln in proc.stdout.splitlines() if ln.startswith("would delete")]
    assert would == ["step100", "step200", "step250", "step350", "step400-tmp"]
    assert "nothing was deleted" in proc.stdout


def test_prune_keeps_newest_permanent_and_optionally_ephemeral(run_folder: Path):
    proc = run_cli("prune", str(run_folder), "--keep-last", "2", "--keep-ephemeral")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in run_folder.iterdir()) == ["step200", "step250", "step300"]
    assert [s for s, _ in Checkpointer.find_checkpoints(run_folder)] == [200, 250, 300]

    again = run_cli("prune", str(run_folder), "--keep-last", "1")
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in run_folder.iterdir()) == ["step300"]
    assert Checkpointer.verify(run_folder / "step300", deep=True).ok


def test_prune_never_deletes_the_newest_checkpoint_even_if_ephemeral(run_folder: Path):
    Checkpointer.delete(run_folder / "step300")
    proc = run_cli("prune", str(run_folder), "--keep-last", "1")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in run_folder.iterdir()) == ["step200", "step250"]
    assert "newest committed checkpoint" in proc.stdout


def test_prune_deletes_oldest_first_commit_record_first(run_folder: Path, tmp_path: Path):
    log = tmp_path / "removals.log"
    proc = subprocess.run(
        [sys.executable, str(AUDIT), str(log), "--", "prune", str(run_folder), "-k", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    removed = [ln.split(" ", 1)[1] for ln in log.read_text().splitlines() if ln.startswith("os.")]
    removed = [p for p in removed if p.startswith(str(run_folder) + os.sep)]
    removed = [p for p in removed if not p.endswith(".lock")]  # each deletion's claim (claim.py)
    folders = [Path(p).relative_to(run_folder).parts[0] for p in removed]
    order = list(dict.fromkeys(folders))
    assert order == ["step100", "step200", "step250", "step350", "step400-tmp"]
    for name in ("step100", "step200", "step250"):  # committed: the record goes first
        first = next(p for p, f in zip(removed, folders, strict=True) if f == name)
        assert first == str(run_folder / name / ".metadata.json")


def test_prune_killed_mid_delete_leaves_no_torn_checkpoint(run_folder: Path, tmp_path: Path):
    log = tmp_path / "removals.log"
    args = ["--die-in", str(run_folder / "step200"), "--", "prune", str(run_folder), "-k", "1"]
    died = subprocess.run(
        [sys.executable, str(AUDIT), str(log), *args], capture_output=True, timeout=300
    )
    assert died.returncode == 9 and log.read_text().endswith("died\n")
    # step100 is gone; step200 lost its commit record, then the process died: all its data
    # is still there, yet it is no checkpoint to any finder and `ls` calls it uncommitted.
    assert not (run_folder / "step100").exists()
    assert (run_folder / "step200" / ".manifest.json").is_file()
    assert [s for s, _ in Checkpointer.find_checkpoints(run_folder)] == [250, 300]
    states = {e.name: e.state for e in scan_folder(*resolve(str(run_folder)))}
    assert states["step200"] == "uncommitted"

    rerun = run_cli("prune", str(run_folder), "-k", "1")
    assert rerun.returncode == 0, rerun.stderr
    assert sorted(p.name for p in run_folder.iterdir()) == ["step300"]


def test_prune_refuses_folders_without_checkpoints(run_folder: Path, tmp_path: Path):
    leftovers = tmp_path / "leftovers"
    shutil.copytree(run_folder / "step350", leftovers / "step350")
    before = tree_digest(leftovers)
    assert_one_line_error(
        run_cli("prune", str(leftovers), "-k", "1"), str(leftovers), "no committed checkpoint"
    )
    assert tree_digest(leftovers) == before
    assert_one_line_error(run_cli("prune", str(run_folder), "-k", "0"), "--keep-last")


# -- export --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_export_sharded_checkpoint_round_trips(sharded: tuple[Path, dict], tmp_path: Path):
    from safetensors.torch import load_file

    ckpt, full = sharded
    out = tmp_path / "model.safetensors"
    proc = run_cli("export", str(ckpt), str(out))
    assert proc.returncode == 0, proc.stderr
    weights = load_file(out)
    assert weights.keys() == full["model"].keys()
    for key, tensor in full["model"].items():
        assert torch.equal(weights[key], tensor), key
    plain = TinyNet(32)
    plain.load_state_dict(weights, strict=True)  # a plain module takes it as it is

    bf16 = tmp_path / "model-bf16.safetensors"
    proc = run_cli("export", str(ckpt), str(bf16), "--dtype", "bfloat16")
    assert proc.returncode == 0, proc.stderr
    for key, tensor in load_file(bf16).items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, full["model"][key].to(torch.bfloat16)), key

    everything = tmp_path / "all.pt"
    proc = run_cli("export", str(ckpt), str(everything), "--all")
    assert proc.returncode == 0, proc.stderr
    state = torch.load(everything, weights_only=True)
    expected = {f"model.{k}": v for k, v in full["model"].items()}
    expected.update({f"optim.{k}": v for k, v in full["optim"].items()})
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(state[key], value), key
        else:
            assert state[key] == value, key


def test_export_refuses_to_overwrite_and_non_tensors_in_safetensors(
    template: tuple[Path, dict], tmp_path: Path
):
    folder, _ = template
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"keep me")
    assert_one_line_error(
        run_cli("export", str(folder / "step300"), str(out)), str(out), "--overwrite"
    )
    assert out.read_bytes() == b"keep me"
    assert_one_line_error(
        run_cli("export", str(folder / "step300"), str(tmp_path / "a.safetensors"), "--all"),
        "not a tensor",
        "--format torch",
    )
    assert not (tmp_path / "a.safetensors").exists()


def test_export_of_damaged_checkpoints_fails_in_one_line(run_folder: Path, tmp_path: Path):
    """A truncated shard is named from the manifest; without a manifest to check against, by
    the reader (its item record is gone): one line each time, never a traceback."""
    dcp_dir = run_folder / "step300" / "model_and_optim"
    # A shard that holds model weights (export reads only those; incremental saves keep the
    # frozen, the changing and the optimizer's items in files of their own).
    storage = FileSystemReader(str(dcp_dir)).read_metadata().storage_data
    shard = dcp_dir / next(
        i.relative_path for k, i in storage.items() if k.fqn.startswith("model.")
    )
    with open(shard, "r+b") as f:
        f.truncate(100)
    out = tmp_path / "model.safetensors"
    assert_one_line_error(run_cli("export", str(run_folder / "step300"), str(out)), str(shard))
    (run_folder / "step300" / ".manifest.json").unlink()
    assert_one_line_error(
        run_cli("export", str(run_folder / "step300"), str(out)), str(shard), "item record"
    )
    assert not out.exists()


# -- usage mistakes, read-only targets, unreachable storage (issue 13) ---------------------------


def test_usage_mistakes_exit_2_naming_the_command_to_use(template: tuple[Path, dict]):
    """The same mistake gets the same exit code from every command, and the message says what
    to run instead: a folder of checkpoints where one is wanted, the reverse, and a file."""
    folder, _ = template
    newest = folder / "step300"
    for command in ("verify", "inspect"):
        assert_one_line_error(
            run_cli(command, str(folder)),
            "holds checkpoints but is not one",
            f"`trainckpt {command} {newest}`",
        )
    assert_one_line_error(
        run_cli("export", str(folder), str(folder.parent / "out.safetensors")),
        "holds checkpoints but is not one",
        f"`trainckpt export {newest} OUT`",
    )
    assert_one_line_error(
        run_cli("latest", str(newest)),
        "is a checkpoint, not a folder",
        f"`trainckpt latest {folder}`",
    )
    rank_file = newest / "train" / "rank0.pt"
    for command in ("inspect", "verify"):
        assert_one_line_error(
            run_cli(command, str(rank_file)), str(rank_file), "is a file, not a checkpoint folder"
        )
    # an uncommitted step folder is a checkpoint with a problem, not a usage mistake
    leftover = run_cli("verify", str(folder / "step350"))
    assert leftover.returncode == 1 and "not a committed checkpoint" in leftover.stdout


def test_export_to_a_read_only_url_is_refused_before_any_request(
    template: tuple[Path, dict], http_folder: tuple[Path, str], http_server
):
    folder, _ = template
    _, url = http_folder
    before = len(http_server.requests)
    proc = run_cli("export", str(folder / "step300"), f"{url}/model.safetensors")
    assert_one_line_error(proc, f"{url}/model.safetensors", "read-only")
    assert http_server.requests[before:] == []  # refused without asking the server anything


def test_timeout_bounds_commands_against_a_dead_endpoint():
    """A closed port on 127.0.0.1 as the GCS endpoint: with `--timeout 1` (before or after the
    subcommand) `ls` and `latest` give up after the deadline, in one line naming it, where the
    default of a training job (300 s) would keep retrying past this test's own time limit."""
    from support.ports import free_port

    from trainckpt.cli.main import DEFAULT_TIMEOUT, build_parser

    env = {**os.environ, "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{free_port()}"}
    folder = "gs://trainckpt-dead/run"
    for args in (["ls", folder, "--timeout", "1"], ["--timeout", "1", "latest", folder]):
        proc = subprocess.run(
            [str(TRAINCKPT), *args], capture_output=True, text=True, timeout=120, env=env
        )
        assert_one_line_error(proc, folder, "retry_deadline=1s", "--timeout")
    assert build_parser().parse_args(["ls", "x"]).timeout == DEFAULT_TIMEOUT < 300
    assert build_parser().parse_args(["verify", "x", "--timeout", "2.5"]).timeout == 2.5


# -- gs:// ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_on_gcs(gcs_bucket: str, tmp_path: Path):
    folder = f"{gcs_bucket}/run"
    ckpt = CheckpointerConfig(work_dir=str(tmp_path / "work")).build()
    states = save_run(ckpt, folder)
    ckpt.close()
    storage, _ = resolve(folder)
    storage.delete_files([f"{folder}/step300/.metadata.json"])  # an uncommitted leftover

    listed = json.loads(run_cli("ls", folder, "--json").stdout)
    assert [(e["name"], e["state"]) for e in listed] == [
        ("step100", "committed"),
        ("step200", "committed"),
        ("step250", "committed"),
        ("step300", "uncommitted"),
    ]
    latest = run_cli("latest", folder)
    assert latest.returncode == 0 and latest.stdout.strip() == f"{folder}/step250"
    assert run_cli("verify", f"{folder}/step200", "--deep").returncode == 0

    out = f"{gcs_bucket}/exports/step200.safetensors"
    assert run_cli("export", f"{folder}/step200", out).returncode == 0
    from safetensors.torch import load as load_safetensors

    weights = load_safetensors(storage.read_bytes(out))
    assert weights.keys() == states["step200"].keys()
    for key, tensor in states["step200"].items():
        assert torch.equal(weights[key], tensor), key

    before = storage.list_files(folder)
    dry = run_cli("prune", folder, "-k", "1", "--dry-run")
    assert dry.returncode == 0 and storage.list_files(folder) == before
    pruned = run_cli("prune", folder, "-k", "1")
    assert pruned.returncode == 0, pruned.stderr
    # step200: newest permanent; step250: newest committed; step100 and the leftover: gone
    assert [s for s, _ in Checkpointer.find_checkpoints(folder)] == [200, 250]
    assert {rel.split("/", 1)[0] for rel in storage.list_files(folder)} == {"step200", "step250"}


def test_human_sizes_and_ages():
    from trainckpt.cli.output import human_age, human_size, table

    assert [human_size(n) for n in (0, 1023, 1024, 9_500_000, 3 * 1024**4)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "9.1 MiB",
        "3.0 TiB",
    ]
    assert [human_age(s) for s in (None, 5, 600, 3 * 3600, 5 * 86400)] == [
        "-",
        "5s",
        "10m",
        "3h",
        "5d",
    ]
    assert table(["A", "N"], [["x", "1"], ["long", "22"]], right={"N"}).splitlines() == [
        "A      N",
        "x      1",
        "long  22",
    ]

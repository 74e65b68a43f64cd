"""Hostile records (issue 13, case 6): a `.metadata.json` or `.manifest.json` that is deeply
nested, holds a 5,000-digit integer or is several GB large, and an oversized DCP `.metadata`.

Each must be a `CorruptCheckpointError` naming the file, never read whole into memory; finders
and `find_latest_good` skip the damaged checkpoint for the older good one; a retention round
keeps going and never deletes the newest good checkpoint for it; `trainckpt ls` lists it as
damaged. The multi-GB record is a sparse file: reading it whole would need gigabytes of memory,
so passing proves it was refused by its size.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from support.models import assert_same_state, fresh_module, make_module

from trainckpt import Checkpointer, CheckpointerConfig, CheckpointPolicy, CorruptCheckpointError
from trainckpt.format.records import (
    DCP_METADATA_FLOOR_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_METADATA_BYTES,
    dcp_metadata_bound,
)
from trainckpt.retention.remover import Remover
from trainckpt.storage import resolve

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TRAINCKPT = Path(sys.executable).with_name("trainckpt")


def nested(path: Path) -> None:
    path.write_bytes(b"[" * 100_000 + b"]" * 100_000)


def huge_integer(path: Path) -> None:
    record = json.loads(path.read_text())
    if "files" in record:  # the manifest: a file's size
        rel = next(iter(record["files"]))
        record["files"][rel]["size"] = 0
        text = json.dumps(record).replace('"size": 0', '"size": ' + "9" * 5000, 1)
    else:  # the commit record: OLMo-core's `version` field
        text = json.dumps(record).replace(f'"{record["version"]}"', "7" * 5000)
    path.write_text(text)


def multi_gb(path: Path) -> None:
    with open(path, "r+b") as f:  # sparse: no disk space, but 5 GiB to read
        f.truncate(5 * 1024**3)


HOSTILE: dict[str, Callable[[Path], None]] = {
    "nested": nested,
    "huge-integer": huge_integer,
    "multi-gb": multi_gb,
}
RECORDS = (".metadata.json", ".manifest.json")


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A save folder: step1 (permanent), step2 (ephemeral, the newest good one) and step3, the
    checkpoint each test damages."""
    root = tmp_path_factory.mktemp("hostile")
    ckpt = CheckpointerConfig(work_dir=root / "work").build()
    for step, ephemeral in ((1, False), (2, True), (3, False)):
        ckpt.save(
            root / "run" / f"step{step}",
            make_module(seed=step),
            {"step": step},
            ephemeral=ephemeral,
        )
    ckpt.close()
    return root / "run"


@pytest.fixture
def run(template: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(template, tmp_path / "run"))


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(TRAINCKPT), *args], capture_output=True, text=True, timeout=300, check=False
    )


@pytest.mark.parametrize("record", RECORDS)
@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_record_is_skipped_for_the_older_good_checkpoint(
    run: Path, ckpt: Checkpointer, record: str, kind: str, caplog: pytest.LogCaptureFixture
):
    bad = run / "step3" / record
    HOSTILE[kind](bad)

    # the checkpoint itself: a CorruptCheckpointError naming the file, from every entry point
    report = Checkpointer.verify(run / "step3")
    assert not report.ok and str(bad) in report.problems[0], report.problems
    dst, before = fresh_module(), fresh_module()
    with pytest.raises(CorruptCheckpointError, match=str(bad)):
        ckpt.load(run / "step3", dst)
    assert_same_state(before, dst)
    if record == ".metadata.json":
        with pytest.raises(CorruptCheckpointError, match=str(bad)):
            Checkpointer.read_metadata(run / "step3")

    # resuming finds the older good checkpoint, with a warning naming the damaged one
    with caplog.at_level(logging.WARNING):
        assert ckpt.find_latest_good(run) == str(run / "step2")
    assert str(bad) in caplog.text
    loaded = fresh_module()
    assert ckpt.load(ckpt.find_latest_good(run), loaded) == {"step": 2}
    assert_same_state(make_module(seed=2), loaded)
    if record == ".metadata.json":  # the commit record is what the finders read
        assert Checkpointer.latest_checkpoint(run) == str(run / "step2")
        assert [s for s, _ in Checkpointer.find_checkpoints(run)] == [1, 2]
        assert [s for s, _ in Checkpointer.find_checkpoints(run, ephemeral=False)] == [1]

    # retention: the round completes; step2, the newest good checkpoint, is not deleted for
    # step3 (which would be "newer"); the damaged folder itself is kept for a person to see
    deleted = Remover(str(run), CheckpointPolicy(max_checkpoints=1)).run_round()
    assert deleted == []
    assert (run / "step2" / ".metadata.json").exists() and bad.exists()


def test_command_lists_hostile_records_as_damaged(run: Path):
    """One save folder with every hostile record in its own step folder (steps 10-15, newer
    than the good ones): `ls` exits 0 listing each as damaged, `latest` skips the hostile
    commit records, `verify` names the file."""
    damaged: dict[str, Path] = {}
    step = 10
    for record in RECORDS:
        for kind in sorted(HOSTILE):
            folder = Path(shutil.copytree(run / "step3", run / f"step{step}"))
            HOSTILE[kind](folder / record)
            damaged[folder.name] = folder / record
            step += 1
    shutil.rmtree(run / "step3")

    ls = run_cli("ls", "--json", str(run))
    assert ls.returncode == 0, ls.stderr
    states = {e["name"]: (e["state"], e["note"]) for e in json.loads(ls.stdout)}
    for name, bad in damaged.items():
        assert states[name][0] == "damaged" and str(bad) in states[name][1], states[name]
    assert states["step2"][0] == states["step1"][0] == "committed"
    table = run_cli("ls", str(run))
    assert table.returncode == 0, table
    assert sum(" damaged " in line for line in table.stdout.splitlines()) == len(damaged)

    # steps 13-15 have a good commit record and a hostile manifest: the finders (which read
    # the commit record only) report step15; find_latest_good verifies and skips them
    latest = run_cli("latest", str(run))
    assert (latest.returncode, latest.stdout.strip()) == (0, str(run / "step15")), latest
    verify = run_cli("verify", str(run / "step10"))
    assert verify.returncode == 1 and str(damaged["step10"]) in verify.stdout, verify


def test_records_at_their_size_bound(run: Path):
    """A record at its bound is parsed (and found malformed); one byte more is refused unread."""
    meta = run / "step3" / ".metadata.json"
    good = json.loads(meta.read_text())
    padded = json.dumps(good).encode()
    meta.write_bytes(padded + b" " * (MAX_METADATA_BYTES - len(padded)))
    assert Checkpointer.read_metadata(run / "step3").ephemeral is False  # at the bound: read
    meta.write_bytes(padded + b" " * (MAX_METADATA_BYTES + 1 - len(padded)))
    with pytest.raises(CorruptCheckpointError, match=f"{meta} is larger than {MAX_METADATA_BYTES}"):
        Checkpointer.read_metadata(run / "step3")
    assert MAX_METADATA_BYTES < MAX_MANIFEST_BYTES < DCP_METADATA_FLOOR_BYTES


def test_oversized_dcp_metadata_is_refused_unread(run: Path, ckpt: Checkpointer):
    dcp_md = run / "step3" / "model_and_optim" / ".metadata"
    shards = sum(p.stat().st_size for p in dcp_md.parent.glob("*.distcp"))
    with open(dcp_md, "r+b") as f:  # sparse, past the bound (which grows with the shards)
        f.truncate(dcp_metadata_bound(shards) + 1)
    with pytest.raises(CorruptCheckpointError, match=str(dcp_md)):  # the manifest's size check
        ckpt.load(run / "step3", fresh_module())
    unchecked = CheckpointerConfig(work_dir=run.parent / "w2", verify_on_load="none").build()
    with pytest.raises(CorruptCheckpointError, match=f"{dcp_md} is larger than"):
        unchecked.load(run / "step3", fresh_module())  # the bound, where the pickle is read
    inspect = run_cli("inspect", str(run / "step3"))
    assert inspect.returncode == 2 and f"{dcp_md} is larger than" in inspect.stderr, inspect


def test_hostile_records_on_an_object_store(gcs_bucket: str, tmp_path: Path):
    """On fake-gcs-server the bound is a ranged read: a commit record past 64 KiB and a nested
    manifest are skipped for the older good checkpoint, as on a local disk."""
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work").build()
    run = f"{gcs_bucket}/run"
    for step in (1, 2, 3):
        ckpt.save(f"{run}/step{step}", make_module(seed=step), {"step": step})
    storage, _ = resolve(run)
    padded = b'{"ephemeral": false, "version": "x"}' + b" " * MAX_METADATA_BYTES
    storage.write_bytes(f"{run}/step3/.metadata.json", padded)
    storage.write_bytes(f"{run}/step2/.manifest.json", b"[" * 100_000 + b"]" * 100_000)

    with pytest.raises(CorruptCheckpointError, match=f"{run}/step3/.metadata.json is larger"):
        Checkpointer.read_metadata(f"{run}/step3")
    assert Checkpointer.latest_checkpoint(run) == f"{run}/step2"  # its commit record is fine
    assert ckpt.find_latest_good(run) == f"{run}/step1"
    assert Remover(run, CheckpointPolicy(max_checkpoints=1)).run_round() == []
    ckpt.close()

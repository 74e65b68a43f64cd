"""`format/folder.py`, the one model of a save folder, given what breaks readers: `-tmp`
leftovers, commit records that are missing, malformed or huge, a manifest that fails to parse,
torchtitan naming, symbolic links out of the save folder, a deletion killed midway, and the same
folder on fake-gcs-server.

The views built on it must agree: `scan_folder` (`trainckpt ls`, `prune`) and `step_states`
(retention) give every step folder the same state, and the finders report exactly the
committed ones.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from support.models import make_module

from trainckpt import (
    CheckpointerConfig,
    CheckpointNotFoundError,
    CheckpointPolicy,
    ConfigurationError,
)
from trainckpt.format import folder, folder_scan, layout
from trainckpt.format.records import MAX_METADATA_BYTES, read_manifest
from trainckpt.retention.remover import Remover
from trainckpt.storage import LocalStorage, Storage, resolve
from trainckpt.testing.faults import ENV_VAR

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

Files = dict[str, bytes]


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Files:
    """Every file of one real committed checkpoint, relative path -> bytes."""
    root = tmp_path_factory.mktemp("folder-template")
    ckpt = CheckpointerConfig(work_dir=root / "work").build()
    path = Path(ckpt.save(root / "run" / "step1", make_module(seed=1), {"step": 1}))
    ckpt.close()
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


@pytest.fixture(params=["local", "gcs"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty save folder: a local path, or a prefix in a fresh fake-gcs-server bucket."""
    if request.param == "local":
        return str(tmp_path / "run")
    return f"{request.getfixturevalue('gcs_bucket')}/run"


def put(storage: Storage, root: str, name: str, files: Files) -> None:
    for rel, data in files.items():
        storage.write_bytes(storage.join(root, name, rel), data)


def without(files: Files, *rels: str) -> Files:
    return {rel: data for rel, data in files.items() if rel not in rels}


def populate(storage: Storage, root: str, t: Files) -> dict[str, folder.State]:
    """One step folder of every kind under `root`; returns name -> the state it must have
    (folders that are not ours, and other names, are absent)."""
    meta, manifest = layout.METADATA_FILE, layout.MANIFEST_FILE
    kinds: dict[str, tuple[Files, folder.State | None]] = {
        "step1": (t, "committed"),
        "step2": (without(t, meta), "uncommitted"),
        "step3": ({**t, meta: b"{not json"}, "damaged"),
        "step4": ({**t, meta: b"{" + b" " * MAX_METADATA_BYTES + b"}"}, "damaged"),  # > limit
        "step5": ({**t, manifest: b"[" * 100_000 + b"]" * 100_000}, "damaged"),
        "step6-tmp": (without(t, meta), "tmp"),
        "step-7": (without(t, meta, manifest), None),  # torchtitan wrote it: not ours
        "step-8": (t, "committed"),
        "step-8-tmp": (without(t, meta), "tmp"),
        "step10": (without(t, manifest), "committed"),  # OLMo-core's: no manifest
        "step11-tmp-tmp": (t, None),
        "stepX": (t, None),
        "notes": (t, None),
    }
    for name, (files, _) in kinds.items():
        put(storage, root, name, files)
    storage.write_bytes(storage.join(root, "step12"), b"a file, not a step folder")
    return {name: state for name, (_, state) in kinds.items() if state is not None}


def test_names_are_parsed_in_one_place():
    assert layout.parse_step_folder("step5") == (5, False)
    assert layout.parse_step_folder("step-5") == (5, False)
    assert layout.parse_step_folder("step5-tmp") == (5, True)
    assert layout.parse_step_folder("step-5-tmp") == (5, True)
    for name in ("step5-tmp-tmp", "step", "steps5", "Step5", "step5.tmp", "step--5", "-tmp"):
        assert layout.parse_step_folder(name) is None, name


def test_every_view_agrees_on_every_kind_of_step_folder(root: str, template: Files):
    storage, path = resolve(root)
    expected = populate(storage, path, template)

    entries = folder_scan.scan_folder(storage, path)
    assert {e.name: e.state for e in entries} == expected
    steps = {n: step for n in expected if (step := layout.parse_step(layout.target_name(n)))}
    assert [e.name for e in entries] == sorted(expected, key=lambda n: (steps[n], n))
    states = folder.step_states(storage, path)  # retention's view: no listing per step folder
    assert {f.name: state for f, state, _ in states} == expected

    # The finders read commit records only: step5's is fine (its manifest is what is damaged;
    # verification, hence load and find_latest_good, refuses it). step3 and step4 are skipped.
    found = list(folder.find_checkpoints(storage, path))
    assert [storage.name(p) for _, p in found] == ["step1", "step5", "step-8", "step10"]
    assert folder.latest_checkpoint(storage, path) == storage.join(path, "step10")

    by_name = {e.name: e for e in entries}
    assert "is not JSON" in by_name["step3"].note and by_name["step3"].ephemeral is None
    assert f"larger than {MAX_METADATA_BYTES} bytes" in by_name["step4"].note
    assert "unreadable manifest" in by_name["step5"].note
    assert "no manifest (unverifiable)" in by_name["step10"].note
    assert by_name["step1"].ephemeral is False and by_name["step1"].world_size == 1
    assert by_name["step1"].size == sum(len(data) for data in template.values())
    assert by_name["step10"].world_size == 1  # counted from train/rank0.pt
    assert by_name["step6-tmp"].created_at is not None  # its manifest reads

    files = read_manifest(storage, storage.join(path, "step1")).files
    assert folder.checkpoint_size(storage, storage.join(path, "step1")) == sum(
        e.size for e in files.values()
    )
    for unknown in ("step5", "step10", "step2-missing"):  # damaged, none, no folder
        assert folder.checkpoint_size(storage, storage.join(path, unknown)) is None


def test_retention_keeps_damaged_and_foreign_folders(root: str, template: Files):
    storage, path = resolve(root)
    populate(storage, path, template)
    remover = Remover(path, CheckpointPolicy(max_checkpoints=1, remove="all_non_permanent"))
    try:
        deleted = sorted(storage.name(p) for p in remover.run_round())
    finally:
        remover.close()
    # step1 and step-8 are older than the newest permanent (step10); the leftovers older than
    # it go. Damaged step3-5 and torchtitan's step-7 are never touched.
    assert deleted == ["step-8", "step-8-tmp", "step1", "step2", "step6-tmp"]
    left = {e.name: e.state for e in folder_scan.scan_folder(storage, path)}
    assert left == {
        "step3": "damaged",
        "step4": "damaged",
        "step5": "damaged",
        "step10": "committed",
    }
    assert storage.list_files(storage.join(path, "step-7"))  # torchtitan's files are all there


class CountingStorage(LocalStorage):
    """A real local back end that counts the bytes each read returns."""

    def __init__(self) -> None:
        self.read: list[int] = []

    def read_bytes(self, location: str, start: int = 0, end: int | None = None) -> bytes:
        data = super().read_bytes(location, start, end)
        self.read.append(len(data))
        return data


def test_a_huge_commit_record_is_refused_by_its_size(tmp_path: Path, template: Files):
    storage = CountingStorage()
    step = tmp_path / "run" / "step3"
    put(storage, str(tmp_path / "run"), "step3", template)
    with open(step / layout.METADATA_FILE, "r+b") as f:  # sparse: 5 GiB to read whole
        f.truncate(5 * 1024**3)
    records = folder.read_records(storage, str(step))
    assert records.metadata is None and "larger than" in records.problems[0]
    assert folder.commit_record(storage, str(step)) is None
    assert max(storage.read) <= MAX_METADATA_BYTES + 1 < 5 * 1024**3


def test_missing_records_and_a_missing_folder(tmp_path: Path, template: Files):
    storage, path = resolve(str(tmp_path / "run"))
    assert folder.step_states(storage, path) == []  # retention: a missing folder holds nothing
    with pytest.raises(CheckpointNotFoundError):
        folder_scan.scan_folder(storage, path)
    with pytest.raises(CheckpointNotFoundError):
        folder.latest_checkpoint(storage, path)
    put(storage, path, "step2", without(template, layout.METADATA_FILE))
    with pytest.raises(CheckpointNotFoundError, match="is not a committed checkpoint"):
        folder.read_metadata(storage, storage.join(path, "step2"))
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        folder.latest_checkpoint(storage, path)
    assert not folder.contains_checkpoint(storage, path)
    # a commit record that vanished after the caller saw it is a problem, not "not committed"
    gone = folder.read_records(storage, storage.join(path, "step2"))
    assert gone.metadata is None and "unreadable commit record" in gone.problems[0]


def snapshot(where: Path) -> dict[str, bytes]:
    return {
        p.relative_to(where).as_posix(): p.read_bytes()
        for p in sorted(where.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def test_symlinked_step_folders_out_of_the_save_folder(tmp_path: Path, template: Files):
    storage, path = resolve(str(tmp_path / "run"))
    outside = tmp_path / "outside"
    put(storage, str(outside), "step9", template)  # a committed checkpoint elsewhere
    put(storage, path, "step1", template)
    for name in ("step9", "step7-tmp", "step5"):
        (Path(path) / name).symlink_to(outside / "step9", target_is_directory=True)
    before = snapshot(outside)

    assert [e.name for e in folder_scan.scan_folder(storage, path)] == ["step1"]
    assert [f.name for f, _, _ in folder.step_states(storage, path)] == ["step1"]
    assert [s for s, _ in folder.find_checkpoints(storage, path)] == [1]
    remover = Remover(path, CheckpointPolicy(max_checkpoints=1, remove="all_non_permanent"))
    assert remover.run_round() == []
    remover.close()
    for name in ("step9", "step7-tmp", "step5"):
        folder.delete_step_folder(storage, storage.join(path, name))
        assert not os.path.lexists(Path(path) / name)  # only the link went
    assert snapshot(outside) == before


def kill_during_delete(ckpt: str) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys\n"
        "from trainckpt.format.folder import delete_step_folder\n"
        "from trainckpt.storage import resolve\n"
        "delete_step_folder(*resolve(sys.argv[1]))\n"
    )
    env = {**os.environ, ENV_VAR: "during-delete"}
    return subprocess.run(
        [sys.executable, "-c", code, ckpt], env=env, capture_output=True, text=True, timeout=120
    )


def test_a_deletion_killed_midway_leaves_no_torn_checkpoint(root: str, template: Files):
    storage, path = resolve(root)
    put(storage, path, "step1", template)
    put(storage, path, "step2", template)
    step2 = storage.join(path, "step2")

    died = kill_during_delete(step2)
    assert died.returncode == -9, died.stderr
    left = storage.list_files(step2)
    assert set(left) == set(template) - {layout.METADATA_FILE}  # every data file, no record
    assert {e.name: e.state for e in folder_scan.scan_folder(storage, path)} == {
        "step1": "committed",
        "step2": "uncommitted",
    }
    assert folder.latest_checkpoint(storage, path) == storage.join(path, "step1")
    assert [s for s, _ in folder.find_checkpoints(storage, path)] == [1]

    folder.delete_step_folder(storage, step2)  # a rerun finishes the deletion
    assert [e.name for e in folder_scan.scan_folder(storage, path)] == ["step1"]


FINDERS: dict[str, Callable[[Storage, str], object]] = {
    "find_checkpoints": lambda s, p: list(folder.find_checkpoints(s, p)),
    "latest_checkpoint": folder.latest_checkpoint,
    "scan_folder": folder_scan.scan_folder,
}


@pytest.mark.parametrize("finder", FINDERS)
def test_a_folder_that_cannot_be_listed_is_refused(finder: str, http_folder: tuple[Path, str]):
    _, url = http_folder
    storage, path = resolve(url)
    with pytest.raises(ConfigurationError, match="cannot be listed"):
        FINDERS[finder](storage, path)

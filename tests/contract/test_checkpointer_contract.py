"""One contract for `Checkpointer` on every back end: a local folder, gs:// (a real
fake-gcs-server) and s3:// (moto) on 127.0.0.1, and for reading, http:// (a real static server
publishing a local folder). Each test runs once per back end.

What was saved is read back with each back end's own client (files, the GCS SDK, boto3), not
with trainckpt's, so a test sees what the back end really holds. Adding a back end is one entry
in `PLACES`. What only one back end does stays in its own file (`backends/`, `unit/`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from support.models import assert_same_state, fresh_module, make_module
from support.s3_server import MotoS3

from trainckpt import (
    Checkpointer,
    CheckpointerConfig,
    CheckpointExistsError,
    CheckpointManifest,
    CheckpointNotFoundError,
)
from trainckpt.storage import resolve
from trainckpt.storage.checksums import crc32c_bytes

RECORDS = (".manifest.json", ".metadata.json")


@dataclass
class Place:
    """An empty folder on one back end, and that back end's own reader and writer."""

    root: str  # where checkpoints are saved
    objects: Callable[[str], dict[str, bytes]]  # every file under a folder, by relative name
    put: Callable[[str], Callable[[bytes], None]]  # put(file)(data) replaces the file's bytes
    url: str = ""  # where what is saved under `root` is read (http://), when not at `root`

    def read(self, path: str) -> str:
        """Where the checkpoint saved at `path` is read."""
        return self.url + path.removeprefix(self.root) if self.url else path


def _files(folder: str) -> dict[str, bytes]:
    base = Path(folder)
    files = base.rglob("*") if base.is_dir() else []
    return {p.relative_to(base).as_posix(): p.read_bytes() for p in files if p.is_file()}


def _local(request: pytest.FixtureRequest) -> Place:
    root = request.getfixturevalue("tmp_path") / "root"
    root.mkdir()
    return Place(str(root), _files, lambda path: Path(path).write_bytes)


def _http(request: pytest.FixtureRequest) -> Place:
    """Saved to a local folder that the HTTP server publishes; read over http://."""
    folder, url = request.getfixturevalue("http_folder")
    return Place(str(folder), _files, lambda path: Path(path).write_bytes, url=url)


def _gcs(request: pytest.FixtureRequest) -> Place:
    from google.cloud import storage as gcs

    bucket: str = request.getfixturevalue("gcs_bucket")
    client = gcs.Client()

    def objects(folder: str) -> dict[str, bytes]:
        name, _, prefix = folder.removeprefix("gs://").partition("/")
        blobs = client.list_blobs(name, prefix=prefix + "/")
        return {b.name[len(prefix) + 1 :]: b.download_as_bytes() for b in blobs}

    def put(path: str) -> Callable[[bytes], None]:
        name, _, key = path.removeprefix("gs://").partition("/")
        return client.bucket(name).blob(key).upload_from_string

    return Place(f"{bucket}/root", objects, put)


def _s3(request: pytest.FixtureRequest) -> Place:
    bucket: str = request.getfixturevalue("s3_bucket")
    server: MotoS3 = request.getfixturevalue("s3_server")
    client = server.client()

    def put(path: str) -> Callable[[bytes], None]:
        name, _, key = path.removeprefix("s3://").partition("/")
        return lambda data: client.put_object(Bucket=name, Key=key, Body=data)

    return Place(f"{bucket}/root", server.objects, put)


PLACES: dict[str, Callable[[pytest.FixtureRequest], Place]] = {
    "local": _local,
    "gcs": _gcs,
    "s3": _s3,
    "http": _http,  # read-only: listed and written through its local folder
}
WRITABLE = ["local", "gcs", "s3"]


@pytest.fixture(params=WRITABLE)
def place(request: pytest.FixtureRequest) -> Place:
    """A back end that is saved to, listed and read at the same location."""
    return PLACES[request.param](request)


@pytest.fixture(params=list(PLACES))
def readable(request: pytest.FixtureRequest) -> Place:
    """Every back end, http:// included: tests that save, then only read the checkpoint."""
    return PLACES[request.param](request)


def _steps_in(place: Place, folder: str) -> set[str]:
    """The names of the entries directly in `folder` that hold files."""
    return {name.split("/")[0] for name in place.objects(folder)}


def test_round_trip_with_manifest_commit_record_and_verify(
    ckpt: Checkpointer, readable: Place
) -> None:
    place = readable
    src = make_module(steps=3)
    state = {"step": 3, "rng": torch.get_rng_state(), "data": {"epoch": 1, "offset": [4, 5]}}
    path = ckpt.save(f"{place.root}/run/step3/", src, state)
    assert path == f"{place.root}/run/step3"
    assert _steps_in(place, f"{place.root}/run") == {"step3"}, "no leftover beside it"
    objects = place.objects(path)
    path = place.read(path)
    assert Checkpointer.dir_is_checkpoint(path)

    manifest = CheckpointManifest.from_json(objects[".manifest.json"], "manifest")
    files = {name: data for name, data in objects.items() if name not in RECORDS}
    assert set(manifest.files) == set(files)
    assert {"train/rank0.pt", "model_and_optim/.metadata"} <= set(files)
    assert any(name.endswith(".distcp") for name in files)
    for name, data in files.items():  # what the back end holds is what the manifest vouches for
        entry = manifest.files[name]
        assert entry.size == len(data) > 0 and entry.crc32c == crc32c_bytes(data), name
    assert manifest.step == 3 and manifest.world_size == 1
    # object stores name the save attempt in the manifest, which makes it format 2
    assert manifest.format == (1 if manifest.attempt is None else 2)
    record = json.loads(objects[".metadata.json"])
    assert set(record) == {"ephemeral", "version"} and record["ephemeral"] is False
    report = Checkpointer.verify(path, deep=True)
    assert report.ok and report.files_checked == len(manifest.files), str(report)

    dst = fresh_module()
    loaded = ckpt.load(path, dst)
    assert_same_state(src, dst)
    assert loaded is not None and loaded["step"] == 3 and loaded["data"] == state["data"]
    assert torch.equal(loaded["rng"], state["rng"])
    assert not list(ckpt.work_dir.glob("staging-*")), "staging folders must be removed"


def test_finders_ascending_with_ephemeral_filter(ckpt: Checkpointer, place: Place) -> None:
    module = make_module()
    run = f"{place.root}/run"
    for step, eph in [(100, False), (2, True), (10, False), (20, True)]:
        ckpt.save(f"{run}/step{step}", module, {"step": step}, ephemeral=eph)
    assert [s for s, _ in Checkpointer.find_checkpoints(run)] == [2, 10, 20, 100]
    assert [s for s, _ in Checkpointer.find_checkpoints(run, ephemeral=True)] == [2, 20]
    assert [s for s, _ in Checkpointer.find_checkpoints(run, ephemeral=False)] == [10, 100]
    assert Checkpointer.latest_checkpoint(run) == f"{run}/step100"
    assert Checkpointer.contains_checkpoint(run)
    assert Checkpointer.dir_is_checkpoint(f"{run}/step2")
    assert Checkpointer.read_metadata(f"{run}/step2").ephemeral is True
    record = json.loads(place.objects(f"{run}/step2")[".metadata.json"])
    assert set(record) == {"ephemeral", "version"} and record["ephemeral"] is True
    assert Checkpointer.checkpoint_dirname(42) == "step42"


def test_save_async_holds_values_from_the_call(ckpt: Checkpointer, place: Place) -> None:
    module = make_module(steps=2)
    expected = {k: v.clone() for k, v in module.model.state_dict().items()}
    state = {"step": 1, "tokens": torch.arange(4)}
    future = ckpt.save_async(f"{place.root}/step1", module, state)
    with torch.no_grad():  # training goes on right away; the checkpoint must not see it
        for p in module.model.parameters():
            p.add_(1.0)
    state["step"] = 999
    state["tokens"].add_(100)
    path = future.result()
    assert path == f"{place.root}/step1"
    assert Checkpointer.latest_checkpoint(place.root) == path

    dst = fresh_module()
    loaded = ckpt.load(path, dst)
    for k, v in dst.model.state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert loaded is not None and loaded["step"] == 1
    assert torch.equal(loaded["tokens"], torch.arange(4))


def test_uncommitted_step_is_ignored_then_cleared_by_the_next_save(
    ckpt: Checkpointer, place: Place
) -> None:
    run = f"{place.root}/run"
    ckpt.save(f"{run}/step1", make_module(), {"step": 1})
    # A crashed save of step 2: files, but no commit record.
    storage, _ = resolve(run)
    storage.write_bytes(f"{run}/step2/model_and_optim/__7_0.distcp", b"half a shard")
    storage.write_bytes(f"{run}/step2/train/rank0.pt", b"stale")

    assert not Checkpointer.dir_is_checkpoint(f"{run}/step2")
    assert [s for s, _ in Checkpointer.find_checkpoints(run)] == [1]
    assert Checkpointer.latest_checkpoint(run) == f"{run}/step1"

    src = make_module(seed=5)
    ckpt.save(f"{run}/step2", src, {"step": 2})
    names = set(place.objects(f"{run}/step2"))
    assert "model_and_optim/__7_0.distcp" not in names, "the stale shard must be cleared"
    assert Checkpointer.verify(f"{run}/step2").ok  # nothing unexpected is left over
    dst = fresh_module()
    assert ckpt.load(f"{run}/step2", dst) == {"step": 2}
    assert_same_state(src, dst)


def test_committed_step_refused_then_replaced_with_save_overwrite(
    tmp_path: Path, place: Place
) -> None:
    target = f"{place.root}/step4"
    first = make_module(seed=1)
    c = CheckpointerConfig(work_dir=tmp_path / "w1").build()
    c.save(target, first, {"step": 4})
    before = place.objects(target)
    with pytest.raises(CheckpointExistsError, match="save_overwrite"):
        c.save(target, make_module(seed=2), {"step": 4})
    c.close()
    assert place.objects(target) == before, "the refused save changed a file"
    assert _steps_in(place, place.root) == {"step4"}, "the refused save left something beside it"
    dst = fresh_module()
    CheckpointerConfig(work_dir=tmp_path / "w2").build().load(target, dst)
    assert_same_state(first, dst)

    second = make_module(seed=2)
    c2 = CheckpointerConfig(work_dir=tmp_path / "w3", save_overwrite=True).build()
    c2.save(target, second, {"step": 4})
    dst2 = fresh_module()
    c2.load(target, dst2)
    c2.close()
    assert_same_state(second, dst2)


def test_missing_checkpoint_raises_file_not_found_naming_it(
    ckpt: Checkpointer, readable: Place
) -> None:
    missing = readable.read(f"{readable.root}/nothing/step5")
    with pytest.raises(FileNotFoundError, match="nothing/step5"):
        ckpt.load(missing, fresh_module())
    with pytest.raises(CheckpointNotFoundError, match="nothing/step5"):
        Checkpointer.read_metadata(missing)
    assert not Checkpointer.dir_is_checkpoint(missing)


def test_folder_without_checkpoints_raises_file_not_found_naming_it(place: Place) -> None:
    with pytest.raises(FileNotFoundError, match="nothing"):
        Checkpointer.latest_checkpoint(f"{place.root}/nothing")
    assert not Checkpointer.contains_checkpoint(f"{place.root}/nothing")


def test_deep_verify_finds_a_flipped_byte_that_sizes_miss(
    ckpt: Checkpointer, readable: Place
) -> None:
    place = readable
    path = ckpt.save(f"{place.root}/step1", make_module(), {"step": 1})
    shard = "model_and_optim/__0_0.distcp"
    data = bytearray(place.objects(path)[shard])
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size: bit rot
    place.put(f"{path}/{shard}")(bytes(data))

    path = place.read(path)
    assert Checkpointer.verify(path).ok  # sizes only
    report = Checkpointer.verify(path, deep=True)
    assert not report.ok
    assert any("__0_0.distcp" in p for p in report.problems), report.problems


@pytest.mark.parametrize("place", ["gcs", "s3"], indirect=True)
def test_objects_changed_during_the_save_are_never_committed(
    ckpt: Checkpointer, place: Place
) -> None:
    """Object stores: after every upload and before the commit record, the save lists its
    prefix against its manifest. Another process deleting, rewriting and adding objects there
    meanwhile makes the save fail, naming each of them, with no commit record; the step is
    free for the next save."""
    from trainckpt import CorruptCheckpointError
    from trainckpt.testing.faults import on_fault_point

    path = f"{place.root}/run/step1"
    storage, _ = resolve(path)
    deleted, resized, added = "train/rank0.pt", "model_and_optim/__0_0.distcp", "stray.bin"

    def meddle() -> None:  # another process's doing, through the back end's own client
        assert {deleted, resized} <= set(place.objects(path)), "uploaded before the manifest"
        storage.delete_files([f"{path}/{deleted}"])
        place.put(f"{path}/{resized}")(b"written by someone else")
        place.put(f"{path}/{added}")(b"written by someone else")

    with on_fault_point("before-manifest", meddle):
        with pytest.raises(CorruptCheckpointError, match="changed during the save") as caught:
            ckpt.save(path, make_module(), {"step": 1})
    message = str(caught.value)
    assert path in message and f"'{deleted}' is missing" in message
    assert f"'{resized}' has 23 bytes" in message
    assert f"'{added}' is not in the manifest" in message
    assert ".metadata.json" not in place.objects(path)
    assert not Checkpointer.dir_is_checkpoint(path)

    src = make_module(seed=4)
    assert ckpt.save(path, src, {"step": 1}) == path
    dst = fresh_module()
    assert ckpt.load(path, dst) == {"step": 1}
    assert_same_state(src, dst)
    assert Checkpointer.verify(path, deep=True).ok

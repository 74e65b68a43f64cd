"""Files read whole are bounded before they are read (docs/limits.md): a huge file is refused
by its size, and peak memory, read from `resource` in a child process, stays far below it."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.damage import read_manifest, unshare, write_manifest
from support.models import fresh_module, make_module
from support.peak_memory import run_measured

from trainckpt import CheckpointerConfig, CorruptCheckpointError, InvalidTrainStateError
from trainckpt.format.records import MAX_MANIFEST_BYTES

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

HUGE = 2 * 1024**3
"""A sparse file of this size costs no disk, but reading it whole costs 2 GiB of memory."""
MEMORY_BOUND = 64 * 1024**2
"""Growth of peak memory allowed while a huge file is refused: torch's lazy imports and the
load's own work, nothing near the file's size."""


def _grow_sparse(path: Path, size: int) -> None:
    unshare(path)  # a file of its own: incremental saves link unchanged files
    with open(path, "r+b") as f:
        f.truncate(size)


def test_a_2_gib_trainer_state_file_is_refused_by_its_size_before_it_is_read(tmp_path):
    c = CheckpointerConfig(work_dir=tmp_path / "work").build()
    unlisted = Path(c.save(tmp_path / "run" / "step1", make_module(), {"step": 1}))
    listed = Path(c.save(tmp_path / "run" / "step2", make_module(), {"step": 2}))
    intact = c.save(tmp_path / "run" / "step3", make_module(), {"step": 3})
    c.close()
    (unlisted / ".manifest.json").unlink()  # as OLMo-core writes them: no manifest
    for ckpt in (unlisted, listed):
        _grow_sparse(ckpt / "train" / "rank0.pt", HUGE)
    manifest = read_manifest(listed)  # a manifest that lists the huge size: the size check passes
    manifest["files"]["train/rank0.pt"]["size"] = HUGE
    write_manifest(listed, manifest)

    results = run_measured(
        f"""
        from support.models import fresh_module
        from trainckpt import CheckpointerConfig
        c = CheckpointerConfig(work_dir={str(tmp_path / "load-work")!r}).build()
        c.load({intact!r}, fresh_module())  # warm-up: torch's lazy imports cost memory
        for path in ({str(unlisted)!r}, {str(listed)!r}):
            results.append(measure(lambda: c.load(path, fresh_module())))
        """
    )
    for ckpt, outcome in zip((unlisted, listed), results, strict=True):
        assert outcome["growth"] < MEMORY_BOUND, outcome
        assert outcome.get("raised") == "CorruptCheckpointError", outcome
        assert str(ckpt / "train" / "rank0.pt") in outcome["message"]
        assert f"{HUGE} bytes" in outcome["message"]
        assert "max_trainer_state_bytes" in outcome["message"]


@pytest.mark.ckpt(max_trainer_state_bytes=4096)
def test_max_trainer_state_bytes_bounds_what_is_saved_and_what_is_loaded(ckpt, tmp_path):
    big = {"step": 1, "blob": b"x" * 8192}
    with pytest.raises(InvalidTrainStateError, match="max_trainer_state_bytes=4096"):
        ckpt.save(tmp_path / "run" / "step1", make_module(), big)
    assert not (tmp_path / "run" / "step1").exists()

    roomy = CheckpointerConfig(work_dir=tmp_path / "work2").build()
    path = roomy.save(tmp_path / "run" / "step1", make_module(), big)
    with pytest.raises(CorruptCheckpointError) as caught:
        ckpt.load(path, fresh_module())
    message = str(caught.value)
    assert str(Path(path) / "train" / "rank0.pt") in message and "bytes" in message
    assert roomy.load(path, fresh_module()) == big
    roomy.close()


def test_a_server_that_ignores_range_costs_no_more_memory_than_what_is_asked(
    http_server, http_folder, tmp_path
):
    """A server without Range support answers every read with the whole file: records,
    trainer state and `verify --deep` take only the bytes they need from the stream."""
    folder, url = http_folder
    c = CheckpointerConfig(work_dir=tmp_path / "work").build()
    module = make_module()
    for step in (1, 2, 3, 4, 5):
        c.save(folder / f"step{step}", module, {"step": step})
    c.close()
    _grow_sparse(folder / "step1" / ".metadata.json", HUGE // 2)
    _grow_sparse(folder / "step2" / ".manifest.json", HUGE // 2)
    (folder / "step3" / ".manifest.json").unlink()
    _grow_sparse(folder / "step3" / "train" / "rank0.pt", HUGE)
    shard = next((folder / "step4" / "model_and_optim").glob("*.distcp"))
    _grow_sparse(shard, 256 * 1024**2)
    manifest = read_manifest(folder / "step4")
    manifest["files"][f"model_and_optim/{shard.name}"]["size"] = 256 * 1024**2
    write_manifest(folder / "step4", manifest)
    http_server.ignore_range = True

    results = run_measured(
        f"""
        from support.models import fresh_module
        from trainckpt import Checkpointer, CheckpointerConfig
        c = CheckpointerConfig(work_dir={str(tmp_path / "load-work")!r}, retry_deadline=5).build()
        loaded = c.load({url + "/step5"!r}, fresh_module())  # warm-up, and the intact case
        assert loaded == {{"step": 5}}, loaded
        assert Checkpointer.verify({url + "/step5"!r}, deep=True).ok
        results.append(measure(lambda: Checkpointer.read_metadata({url + "/step1"!r})))
        results.append(measure(lambda: Checkpointer.verify({url + "/step2"!r}).problems))
        results.append(measure(lambda: c.load({url + "/step3"!r}, fresh_module())))
        results.append(measure(lambda: Checkpointer.verify({url + "/step4"!r}, deep=True).problems))
        """
    )
    # Each read costs at most twice what it asks for (the chunks, then the joined bytes): a
    # manifest up to its 64 MiB bound; nothing of a file refused by its size; 8 MiB pieces of
    # a file checked.
    bounds = (MEMORY_BOUND, MEMORY_BOUND + 2 * MAX_MANIFEST_BYTES, MEMORY_BOUND, MEMORY_BOUND)
    for outcome, bound in zip(results, bounds, strict=True):
        assert outcome["growth"] < bound, outcome
    metadata, manifest_problems, trainer_state, deep_problems = results
    assert metadata.get("raised") == "CorruptCheckpointError", metadata
    assert f"{url}/step1/.metadata.json is larger than" in metadata["message"]
    assert f"{url}/step2/.manifest.json is larger than" in manifest_problems["returned"]
    assert trainer_state.get("raised") == "CorruptCheckpointError", trainer_state
    assert f"'{url}/step3/train/rank0.pt' holds {HUGE} bytes" in trainer_state["message"]
    assert f"{shard.name}' is corrupt: CRC32C" in deep_problems["returned"], deep_problems
    assert f"over {256 * 1024**2} bytes" in deep_problems["returned"], deep_problems
    shard_path = f"{url[len(http_server.url) :]}/step4/model_and_optim/{shard.name}"
    gets = [p for m, p, _ in http_server.requests if m == "GET" and p == shard_path]
    assert len(gets) == 1, f"deep verify downloaded the whole shard {len(gets)} times"


def test_adding_a_file_to_a_checkpoint_reads_its_manifest_within_the_bound(ckpt, tmp_path):
    """`write_file` rewrites the manifest of a committed checkpoint: a manifest past its bound
    is refused by its size, not read whole and then found not to be JSON."""
    path = Path(ckpt.save(tmp_path / "run" / "step1", make_module(), {"step": 1}))
    with open(path / ".manifest.json", "wb") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)
    with pytest.raises(CorruptCheckpointError, match=f"larger than {MAX_MANIFEST_BYTES} bytes"):
        ckpt.write_file(path, "config.json", b"{}")

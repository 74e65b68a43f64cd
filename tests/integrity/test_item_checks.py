"""Same-size damage under the default `verify_on_load="size"`: shard files swapped within a
checkpoint or copied in from another one, a flipped byte, swapped trainer state or `.metadata`.
Each makes `load` raise `CorruptCheckpointError` naming the file (`format/shard_checksums.py`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from support.damage import flip_byte, item_record, rerecord, split_item_record, unshare

from trainckpt import Checkpointer, CheckpointerConfig, CorruptCheckpointError, ModelAndOptim

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.ckpt(save_thread_count=2),
]


def _module(seed: int) -> ModelAndOptim:
    """Two layers of one shape: saved on two threads, they make two shards of one size."""
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(64, 64, bias=False) for _ in range(2)]
    return ModelAndOptim(torch.nn.Sequential(*layers), None)


def _same(a: ModelAndOptim, b: ModelAndOptim) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture
def run(ckpt: Checkpointer, tmp_path: Path) -> Path:
    """`step1` and `step2`, each with two shard files of one size (checked: else a swap would
    be caught by sizes alone and the tests below would prove nothing)."""
    for step in (1, 2):
        ckpt.save(tmp_path / "run" / f"step{step}", _module(step), {"step": step})
    sizes = {p.stat().st_size for p in (tmp_path / "run").glob("step*/model_and_optim/*.distcp")}
    assert len(sizes) == 1, sizes
    return tmp_path / "run"


def _shard(run: Path, step: int, i: int) -> Path:
    return run / f"step{step}" / "model_and_optim" / f"__0_{i}.distcp"


def _load_fails(ckpt: Checkpointer, path: Path | str, match: str) -> None:
    """The default check passes sizes (shallow verify is ok), yet `load` raises naming the
    file, and the model keeps its own values (misplaced files are caught before any item)."""
    dst = _module(99)
    with pytest.raises(CorruptCheckpointError, match=match):
        ckpt.load(path, dst)
    assert _same(dst, _module(99))


def _swap(a: Path, b: Path) -> None:
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)


def test_clean_checkpoint_loads_checked(ckpt, run):
    dst = _module(99)
    assert ckpt.load(run / "step1", dst) == {"step": 1}
    assert _same(dst, _module(1))
    _, record = split_item_record(_shard(run, 1, 0))
    assert record["file"] == "__0_0.distcp" and record["save_id"].startswith("trainckpt-items-1:")


def test_shards_swapped_within_a_checkpoint(ckpt, run):
    _swap(_shard(run, 1, 0), _shard(run, 1, 1))
    assert Checkpointer.verify(run / "step1").ok  # sizes cannot see it
    _load_fails(ckpt, run / "step1", r"__0_\d\.distcp' is not the file .* holds '__0_\d\.distcp'")


def test_shard_copied_in_from_another_checkpoint(ckpt, run):
    shutil.copyfile(_shard(run, 2, 0), _shard(run, 1, 0))
    assert Checkpointer.verify(run / "step1").ok
    _load_fails(ckpt, run / "step1", r"step1/model_and_optim/__0_0\.distcp' is not the file")


def test_flipped_byte_in_a_shard(ckpt, run):
    flip_byte(_shard(run, 1, 1))
    with pytest.raises(
        CorruptCheckpointError, match=r"step1/model_and_optim/__0_1\.distcp' is corrupt"
    ):
        ckpt.load(run / "step1", _module(99))


def test_damaged_or_missing_item_record(ckpt, run):
    shard = _shard(run, 1, 0)
    items, _ = split_item_record(shard)
    shard.write_bytes(items + b"\0" * (shard.stat().st_size - len(items)))  # same size
    _load_fails(ckpt, run / "step1", r"__0_0\.distcp' has no trainckpt item record")


def _with_record(ckpt_dir: Path, i: int, record: bytes) -> None:
    """Shard `i` of `ckpt_dir` with its items and `record` at its end, the manifest made to
    agree (so only the record itself can refuse it)."""
    shard = ckpt_dir / "model_and_optim" / f"__0_{i}.distcp"
    items, _ = split_item_record(shard)
    unshare(shard)
    shard.write_bytes(items + record)
    rerecord(ckpt_dir, f"model_and_optim/__0_{i}.distcp")


def _json_record(record: dict) -> bytes:
    """The item record in the JSON layout that shards written before the columnar one have."""
    body = json.dumps(record).encode()
    return body + len(body).to_bytes(8, "little") + b"TCKPTIR1"


def test_a_shard_with_the_earlier_json_item_record_loads_and_is_still_checked(ckpt, run):
    step1 = run / "step1"
    items, record = split_item_record(_shard(run, 1, 0))
    assert record["items"] and all(len(row) == 3 for row in record["items"])
    _with_record(step1, 0, _json_record(record))
    dst = _module(99)
    assert ckpt.load(step1, dst) == {"step": 1}
    assert _same(dst, _module(1))
    offset, length, _ = record["items"][0]
    flip_byte(_shard(run, 1, 0), offset + length - 1)  # the item's last byte: its data
    rerecord(step1, "model_and_optim/__0_0.distcp")
    _load_fails(ckpt, step1, r"step1/model_and_optim/__0_0\.distcp' is corrupt: bytes")


def _damaged_records(record: dict) -> dict[str, bytes]:
    """Item records a writer never makes, each refused as damaged."""
    good = item_record(record)
    body = good[:-16]
    header_length = int.from_bytes(body[:4], "little")
    header = json.loads(body[4 : 4 + header_length])

    def framed(body: bytes) -> bytes:
        return body + len(body).to_bytes(8, "little") + b"TCKPTIR2"

    def with_header(**fields: object) -> bytes:
        text = json.dumps(dict(header, **fields)).encode()
        return framed(len(text).to_bytes(4, "little") + text + body[4 + header_length :])

    return {
        "header longer than the record": framed((1 << 31).to_bytes(4, "little") + body[4:]),
        "header not JSON": framed(body[:4] + b"{" * header_length + body[4 + header_length :]),
        "one item more than its bytes": with_header(items=header["items"] + 1),
        "an item count that is text": with_header(items=str(header["items"])),
        "a negative item count": with_header(items=-1),
        "no file name": with_header(file=None),
        "columns cut short": framed(body[:-4]),
        "a record of three bytes": framed(b"\0\0\0"),
    }


_DAMAGES = list(_damaged_records({"file": "f", "save_id": "s", "items": []}))


@pytest.mark.parametrize("damage", _DAMAGES)
def test_a_damaged_item_record_is_refused_naming_the_shard(ckpt, run, damage):
    _, record = split_item_record(_shard(run, 1, 0))
    _with_record(run / "step1", 0, _damaged_records(record)[damage])
    _load_fails(ckpt, run / "step1", r"__0_0\.distcp' has a damaged item record")


@pytest.mark.parametrize("rel", ["train/rank0.pt", "model_and_optim/.metadata.trainckpt"])
def test_whole_files_copied_in_from_another_checkpoint(ckpt, run, rel):
    """(DCP's `.metadata` is not read by a load: trainckpt reads its own record instead.)"""
    assert (run / "step1" / rel).stat().st_size == (run / "step2" / rel).stat().st_size
    shutil.copyfile(run / "step2" / rel, run / "step1" / rel)
    _load_fails(ckpt, run / "step1", f"step1/{rel}' is not the file this checkpoint was saved with")


def test_ranged_reads_over_http_are_checked(ckpt, run, http_folder):
    folder, url = http_folder
    shutil.copytree(run / "step1", folder / "step1")
    _swap(_shard(folder, 1, 0), _shard(folder, 1, 1))
    _load_fails(ckpt, f"{url}/step1", r"__0_\d\.distcp' is not the file")


def test_none_checks_nothing_and_find_latest_good_checks_by_level(run, tmp_path):
    """`none` loads without any check; `find_latest_good` checks sizes (`size`, which cannot
    see the copied-in shard; `load` then refuses it) or every CRC32C (`full`, which skips it)."""
    shutil.copyfile(_shard(run, 1, 0), _shard(run, 2, 0))
    unchecked = CheckpointerConfig(work_dir=tmp_path / "w1", verify_on_load="none").build()
    dst = _module(99)
    unchecked.load(run / "step2", dst)
    assert not _same(dst, _module(2))  # the damage went in unnoticed, as documented
    size = CheckpointerConfig(work_dir=tmp_path / "w2").build()
    assert size.find_latest_good(run) == str(run / "step2")
    full = CheckpointerConfig(work_dir=tmp_path / "w3", verify_on_load="full").build()
    assert full.find_latest_good(run) == str(run / "step1")
    for c in (unchecked, size, full):
        c.close()


def _save_two_ranks(rank: int, world: int, folder: str, step: int) -> None:
    from support.models import make_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    ckpt = CheckpointerConfig(work_dir=f"{folder}/work{rank}").build()
    src = make_module(seed=step)
    module = ModelAndOptim(DDP(src.model), src.optim)
    ckpt.save(f"{folder}/step{step}", module, {"rank": rank, "step": step})
    ckpt.close()


def _load_two_ranks(rank: int, world: int, path: str) -> str:
    """The error each rank's `load` raised (it must raise, on every rank, without hanging)."""
    from support.models import fresh_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    ckpt = CheckpointerConfig(work_dir=f"{path}-work{rank}", collective_timeout=60).build()
    dst = fresh_module()
    try:
        ckpt.load(path, ModelAndOptim(DDP(dst.model), dst.optim))
    except CorruptCheckpointError as e:
        return f"{type(e).__name__}: {e}"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        ckpt.close()
    return "loaded"


@pytest.mark.slow
def test_two_ranks_share_one_save_id_and_refuse_one_ranks_misplaced_file(tmp_path):
    """Both ranks' shards name the save id in `.metadata`; a trainer-state file of rank 1 copied
    in from another checkpoint fails rank 1's load and, with it, rank 0's (no rank hangs)."""
    from support.multiproc import run_ranks

    folder = tmp_path / "run"
    for step in (1, 2):
        run_ranks(_save_two_ranks, 2, str(folder), step)
    ckpt = folder / "step1"

    def save_ids(step: int) -> set[str]:
        shards = (folder / f"step{step}" / "model_and_optim").glob("*.distcp")
        return {split_item_record(p)[1]["save_id"] for p in shards}

    assert len(save_ids(1)) == 1 and save_ids(1) != save_ids(2)
    shutil.copyfile(folder / "step2" / "train" / "rank1.pt", ckpt / "train" / "rank1.pt")
    errors = run_ranks(_load_two_ranks, 2, str(ckpt))
    assert "train/rank1.pt' is not the file this checkpoint was saved with" in errors[1], errors
    assert errors[0].startswith("RankFailedError") and "rank 1" in errors[0], errors

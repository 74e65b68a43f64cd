"""trainckpt's own metadata record (`.metadata.trainckpt`, format/native_metadata.py): written
beside DCP's `.metadata` and covered by the manifest, read instead of unpickling `.metadata`,
never running code, bounded in memory, and refused with an error naming it when crafted.
Folders without it still load through the safe unpickler."""

from __future__ import annotations

import json
import os
import pickle
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from tests.support.damage import rerecord
from tests.support.hostile import Calls, shell
from tests.support.models import assert_same_state, fresh_module, make_module
from trainckpt import CheckpointerConfig, CorruptCheckpointError
from trainckpt.errors import UnsafeCheckpointError
from trainckpt.format import native_metadata
from trainckpt.format.layout import NATIVE_METADATA_FILE
from trainckpt.format.records import read_manifest
from trainckpt.format.safe_unpickle import load_dcp_metadata
from trainckpt.storage import resolve

DCP = "model_and_optim"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A committed checkpoint of a small model and AdamW, with a non-tensor value."""
    root = tmp_path_factory.mktemp("native")
    ckpt = CheckpointerConfig(work_dir=root / "work").build()
    ckpt.save(root / "step1", make_module(), {"step": 1})
    ckpt.close()
    return root / "step1"


def _copy(saved: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(saved, tmp_path / "step1"))


def _load(path: Path, verify: str = "none") -> Any:
    module = fresh_module()
    ckpt = CheckpointerConfig(work_dir=path.parent / "load-work", verify_on_load=verify).build()
    try:
        ckpt.load(path, module)
    finally:
        ckpt.close()
    return module


def test_it_is_written_listed_in_the_manifest_and_describes_the_same_metadata(
    saved: Path,
) -> None:
    native = (saved / DCP / NATIVE_METADATA_FILE).read_bytes()
    manifest = read_manifest(*resolve(str(saved)))
    assert manifest.files[f"{DCP}/{NATIVE_METADATA_FILE}"].size == len(native)
    pickled = load_dcp_metadata((saved / DCP / ".metadata").read_bytes(), "x")
    assert native_metadata.decode(native, "n") == pickled
    assert pickled.storage_data == native_metadata.decode(native, "n").storage_data


def test_without_the_manifest_a_load_reads_dcp_metadata_safely(saved: Path, tmp_path: Path) -> None:
    """At level none nothing vouches for the record (another writer may have rewritten the
    folder in place), so `.metadata` is read, through the allow-list: a hostile one runs
    nothing and is refused."""
    path = _copy(saved, tmp_path)
    marker = tmp_path / "pwned"
    evil = pickle.dumps(Calls(os.system, shell(marker)))
    pickle.loads(evil)  # the payload works when unpickled unsafely
    assert marker.exists()
    marker.unlink()
    (path / DCP / ".metadata").write_bytes(evil)
    with pytest.raises(UnsafeCheckpointError):
        _load(path)
    assert not marker.exists()


def test_without_it_a_load_unpickles_metadata_safely(saved: Path, tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    (path / DCP / NATIVE_METADATA_FILE).unlink()  # a folder of trainckpt before this record
    assert_same_state(_load(path), make_module())


def test_one_planted_after_the_commit_is_refused(saved: Path, tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    manifest = json.loads((path / ".manifest.json").read_bytes())
    del manifest["files"][f"{DCP}/{NATIVE_METADATA_FILE}"]
    (path / ".manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata\.trainckpt' is not in the"):
        _load(path, verify="size")


def test_a_swapped_one_is_refused_against_the_manifest(saved: Path, tmp_path: Path) -> None:
    """Its last byte is in the planner section, which a load never parses: the manifest's
    CRC32C of the whole file is what refuses it."""
    path = _copy(saved, tmp_path)
    where = path / DCP / NATIVE_METADATA_FILE
    data = bytearray(where.read_bytes())
    data[-1] ^= 1  # same size: only the CRC32C tells
    where.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata\.trainckpt.*CRC32C"):
        _load(path, verify="size")


def _split(data: bytes) -> tuple[dict[str, Any], bytes, bytes]:
    """A version 2 record's header, chunk table and planner section."""
    end = 16 + int.from_bytes(data[8:16], "little")
    header = json.loads(data[16:end])
    return header, data[end : end + 8 * header["ints"]], data[end + 8 * header["ints"] :]


def _spy_decode(monkeypatch: pytest.MonkeyPatch) -> list[Metadata]:
    """The metadata each `native_metadata.decode` returns from now on, as the load reads it."""
    decoded: list[Metadata] = []
    real = native_metadata.decode

    def decode(data: bytes, where: str) -> Metadata:
        decoded.append(real(data, where))
        return decoded[-1]

    monkeypatch.setattr(native_metadata, "decode", decode)
    return decoded


def test_a_record_of_version_1_still_loads(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint of trainckpt before version 2 (planner data in the header, no section)
    loads from its record as before, with DCP's own planner data."""
    path = _copy(saved, tmp_path)
    where = path / DCP / NATIVE_METADATA_FILE
    header, table, section = _split(where.read_bytes())
    assert header.pop("version") == 2 and header.pop("planner") == len(section)
    planner = [list(pair) for pair in zip(*json.loads(section), strict=True)]
    where.write_bytes(_record({"version": 1, "planner_data": planner} | header, table))
    rerecord(path, f"{DCP}/{NATIVE_METADATA_FILE}")  # as that version wrote it
    decoded = _spy_decode(monkeypatch)
    assert_same_state(_load(path, verify="size"), make_module())
    pickled = load_dcp_metadata((path / DCP / ".metadata").read_bytes(), "x")
    assert len(decoded) == 1 and decoded[0].planner_data == pickled.planner_data
    assert decoded[0] == pickled


def test_a_crafted_planner_section_the_manifest_vouches_for_is_never_read_by_a_load(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load of a whole state never reads the planner data, so it never parses the section:
    one that a writer of the manifest crafted loads (nothing in it is used), and reading it
    is refused, naming the file. One the manifest does not vouch for is refused by its
    CRC32C (`test_a_swapped_one_is_refused_against_the_manifest`)."""
    path = _copy(saved, tmp_path)
    where = path / DCP / NATIVE_METADATA_FILE
    header, table, _ = _split(where.read_bytes())
    section = json.dumps([["w"], [[{"__reduce__": "os.system"}]]]).encode()
    where.write_bytes(_record(header | {"planner": len(section)}, table + section))
    rerecord(path, f"{DCP}/{NATIVE_METADATA_FILE}")
    decoded = _spy_decode(monkeypatch)
    assert_same_state(_load(path, verify="size"), make_module())
    assert len(decoded) == 1 and not decoded[0].planner_built
    with pytest.raises(CorruptCheckpointError, match=f"'{where}'.*planner path of 'w'"):
        decoded[0].planner_data  # noqa: B018


# -- crafted records ---------------------------------------------------------------------------


def _record(header: dict[str, Any] | bytes, ints: bytes = b"") -> bytes:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    return native_metadata.MAGIC + len(head).to_bytes(8, "little") + head + ints


def _header(**changes: Any) -> dict[str, Any]:
    h: dict[str, Any] = {
        "version": 2,
        "dcp_version": "1.0.0",
        "storage_meta": None,
        "planner": None,
        "files": ["__0_0.distcp"],
        "tensors": [["w", "float32", False, False, [4], 1]],
        "bytes": [],
        "ints": 6,
    }
    return h | changes


def _v1(**changes: Any) -> dict[str, Any]:
    """A header of version 1: the planner data in it (`planner_data`), no planner section."""
    h = _header(version=1, **changes)
    return {"planner_data": h.pop("planner")} | h


def _ints(*values: int) -> bytes:
    return b"".join(v.to_bytes(8, "little", signed=True) for v in values)


GOOD_INTS = _ints(0, 4, 1, 0, 0, 100)  # offset 0, size 4, hint 0, file 0, at 0, 100 bytes


def test_a_minimal_record_is_read() -> None:
    md = native_metadata.decode(_record(_header(), GOOD_INTS), "ok")
    tensor = md.state_dict_metadata["w"]
    assert isinstance(tensor, TensorStorageMetadata)
    assert tensor.size == torch.Size([4]) and tensor.properties.dtype == torch.float32
    assert md.storage_data == {MetadataIndex("w", [0]): _StorageInfo("__0_0.distcp", 0, 100)}


def test_a_header_is_read_in_place_as_utf8_and_its_container_count_bounded() -> None:
    """The header is decoded from the record's bytes without slicing them first
    (`_Decoder.metadata`): names outside ASCII still read back, and the containers are
    counted within the header only, not in the chunk table after it."""
    name = "w\u00e9\u4e2d"
    head = json.dumps(
        _header(tensors=[[name, "float32", False, False, [4], 1]]), ensure_ascii=False
    )
    md = native_metadata.decode(_record(head.encode(), GOOD_INTS), "ok")
    assert list(md.state_dict_metadata) == [name]
    # A table of `[` bytes (0x5b) after a short header: counted, it would exceed the bound
    brackets = b"[" * 8 * 64
    record = _record(
        _header(tensors=[["w", "float32", False, False, [4], 64 + 1]], ints=6 * 65 + 64),
        GOOD_INTS * 65 + brackets,
    )
    with pytest.raises(CorruptCheckpointError) as refused:
        native_metadata.decode(record, "rec")
    assert "lists and objects" not in str(refused.value)


CRAFTED: dict[str, tuple[bytes, str]] = {
    "a pickle": (pickle.dumps({"a": 1}), "magic"),
    "truncated": (native_metadata.MAGIC + b"\x01", "truncated"),
    "header past the end": (native_metadata.MAGIC + (10**9).to_bytes(8, "little"), "header"),
    "header not JSON": (_record(b"{not json"), "not JSON"),
    "header not an object": (_record(b"[1, 2]"), "exactly the fields"),
    "header not UTF-8": (_record(b'{"version": 1, "\xff": 0}'), "not JSON.*UnicodeDecodeError"),
    # `json.loads` of the bytes guessed UTF-16 and read this; the record is UTF-8 (ASCII) only
    "header in UTF-16": (_record(json.dumps(_header()).encode("utf-16-le"), GOOD_INTS), "JSON"),
    "an extra field": (_record(_header(code="import os"), GOOD_INTS), "exactly the fields"),
    "another version": (_record(_header(version=3), GOOD_INTS), "version 3 is not"),
    "version 1 with a planner section": (
        _record(_header(version=1, planner=None), GOOD_INTS),
        "exactly the fields",
    ),
    "a planner section past the end": (_record(_header(planner=10), GOOD_INTS), "'planner'"),
    "ints not the table": (_record(_header(ints=7), GOOD_INTS), "'ints'"),
    "ints not a number": (_record(_header(ints="6"), GOOD_INTS), "'ints'"),
    "negative in the table": (_record(_header(), _ints(0, 4, 0, 0, -1, 100)), "negative"),
    "a dtype by name": (
        _record(_header(tensors=[["w", "os.system", False, False, [4], 1]]), GOOD_INTS),
        "dtype 'os.system' is unknown",
    ),
    "a dtype attribute": (
        _record(_header(tensors=[["w", "__class__", False, False, [4], 1]]), GOOD_INTS),
        "unknown",
    ),
    "chunks past the table": (
        _record(_header(tensors=[["w", "float32", False, False, [4], 10**15]]), GOOD_INTS),
        "overrun",
    ),
    "too many dimensions": (
        _record(_header(tensors=[["w", "float32", False, False, [1] * 65, 1]]), GOOD_INTS),
        "size",
    ),
    "a negative size": (
        _record(_header(tensors=[["w", "float32", False, False, [-4], 1]]), GOOD_INTS),
        "size",
    ),
    "a file not listed": (_record(_header(), _ints(0, 4, 0, 5, 0, 100)), "not listed"),
    "a table longer than the chunks": (
        _record(_header(ints=12), GOOD_INTS + GOOD_INTS),
        "longer",
    ),
    "a duplicate name": (
        _record(_header(tensors=[["w", "float32", False, False, [4], 0]] * 2, ints=0)),
        "tensor name",
    ),
    "a flag not a bool": (
        _record(_header(tensors=[["w", "float32", 0, False, [4], 1]]), GOOD_INTS),
        "flags",
    ),
    "a path element not plain (version 1)": (
        _record(_v1(planner_data=[["w", [{"__reduce__": "os.system"}]]]), GOOD_INTS),
        "planner_data",
    ),
    "storage meta with extras": (
        _record(
            _header(
                storage_meta={
                    "checkpoint_id": None,
                    "save_id": None,
                    "load_id": None,
                    "modules": [],
                    "x": 1,
                }
            ),
            GOOD_INTS,
        ),
        "storage_meta",
    ),
    "a bytes value past its file": (
        _record(_header(bytes=[["v", 0, 3, 0, 10]]), GOOD_INTS),
        "bytes value 'v'",
    ),
}


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_a_crafted_record_is_refused_naming_the_file(name: str, tmp_path: Path) -> None:
    data, why = CRAFTED[name]
    with pytest.raises(CorruptCheckpointError, match=f"'{tmp_path}/rec'.*{why}"):
        native_metadata.decode(data, f"{tmp_path}/rec")


def _with_planner(section: bytes) -> bytes:
    """A good record with `section` as its planner section."""
    return _record(_header(planner=len(section)), GOOD_INTS + section)


def test_a_record_never_runs_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = pickle.dumps(Calls(os.system, shell(marker)))
    code = f"__import__('os').system('touch {marker}')"
    for data in (
        native_metadata.MAGIC + evil,  # a pickle behind the magic
        _record(_header(dcp_version=evil.decode("latin-1")), GOOD_INTS),  # one in a string
        _with_planner(json.dumps([["w"], [[code]]]).encode()),
        _with_planner(evil),
    ):
        try:
            native_metadata.decode(data, "rec").planner_data  # noqa: B018
        except CorruptCheckpointError:
            pass
    assert not marker.exists()


def test_a_crafted_planner_section_is_refused_when_read_naming_the_file(tmp_path: Path) -> None:
    """The planner section is parsed on first use (`planner_data`), and checked then as the
    header is when decoded."""
    where = f"{tmp_path}/rec"
    for section, why in (
        (json.dumps([["w"], [[{"__reduce__": "os.system"}]]]).encode(), "planner path of 'w'"),
        (b"\x80\x04K\x01.", "not JSON"),  # a pickle
        (b'{"w": ["w"]}', "not two lists"),
    ):
        md = native_metadata.decode(_with_planner(section), where)
        with pytest.raises(CorruptCheckpointError, match=f"'{where}'.*{why}"):
            md.planner_data  # noqa: B018


def _peak(fn: Any) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _refused(data: bytes) -> None:
    with pytest.raises(CorruptCheckpointError):
        native_metadata.decode(data, "rec")


@pytest.mark.parametrize(
    "head",
    [
        b"[" * 200_000 + b"]" * 200_000,  # deep: refused by counting, before parsing
        b"[" * 20_000 + b" " * 200_000 + b"]" * 20_000,  # deep but sparse: the parser's limit
        b"[" + b"[]," * 100_000 + b"[]]",  # wide: a list per 3 bytes
        b"{" + b",".join(b'"%d":{}' % i for i in range(50_000)) + b"}",
    ],
    ids=["deep", "deep-sparse", "wide-lists", "wide-objects"],
)
def test_a_crafted_header_costs_memory_in_proportion_to_its_size(head: bytes) -> None:
    data = _record(head)
    peak = _peak(lambda: _refused(data))
    assert peak <= 20 * len(data) + (1 << 20), (peak, len(data))


@pytest.mark.parametrize(
    "section",
    [
        b'[["w"],[' + b"[" * 200_000 + b"]" * 200_000 + b"]]",
        b'[["w"],[' + b"[" * 20_000 + b" " * 200_000 + b"]" * 20_000 + b"]]",
        b"[[],[" + b"[]," * 100_000 + b"[]]]",
        b'[["w"],[[' + b",".join(b'"%d"' % i for i in range(50_000)) + b"]]]",
        b"[["
        + b",".join(b'"%d"' % i for i in range(50_000))
        + b"],["
        + b",".join(b'["%d",%d]' % (i, i) for i in range(50_000))
        + b"]]",
    ],
    ids=["deep", "deep-sparse", "wide-lists", "wide-strings", "good"],
)
def test_a_crafted_planner_section_costs_memory_in_proportion_to_its_size(section: bytes) -> None:
    """Read on first use, the section is bounded as the header is (`BYTES_PER_CONTAINER`);
    a good one as well as crafted ones."""
    data = _with_planner(section)
    md = native_metadata.decode(data, "rec")

    def read() -> None:
        try:
            md.planner_data  # noqa: B018
        except CorruptCheckpointError:
            pass

    peak = _peak(read)
    assert peak <= 20 * len(data) + (1 << 20), (peak, len(data))


def test_a_huge_declared_count_allocates_nothing() -> None:
    data = _record(_header(tensors=[["w", "float32", False, False, [4], 10**12]], ints=10**12))
    assert _peak(lambda: _refused(data)) < 1 << 20


def _synthetic(tensors: int, chunks: int) -> Metadata:
    """`tensors` tensors of `chunks` row chunks each, spread over 64 files."""
    entries: dict[str, Any] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for t in range(tensors):
        fqn = f"layers.{t}.weight"
        entries[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=torch.bfloat16),
            torch.Size([chunks * 8, 1024]),
            [
                ChunkStorageMetadata(torch.Size([c * 8, 0]), torch.Size([8, 1024]))
                for c in range(chunks)
            ],
        )
        for c in range(chunks):
            storage[MetadataIndex(fqn, [c * 8, 0], c)] = _StorageInfo(
                f"__{c % 64}_0.distcp", t * 16_384, 16_384
            )
    return Metadata(entries, planner_data={k: (k,) for k in entries}, storage_data=storage)


def test_a_large_record_round_trips_within_its_memory_bound() -> None:
    md = _synthetic(tensors=5, chunks=1_000)  # 5,000 chunks
    data = native_metadata.encode(md)
    assert data is not None
    decoded: list[Metadata] = []
    peak = _peak(lambda: decoded.append(native_metadata.decode(data, "big")))
    assert decoded[0] == md and decoded[0].storage_data == md.storage_data
    assert peak <= 20 * len(data), (peak, len(data))


def test_metadata_it_cannot_describe_is_left_to_dcp_metadata() -> None:
    md = _synthetic(tensors=1, chunks=2)
    key = next(iter(md.storage_data))
    md.storage_data[key] = _StorageInfo("__0_0.distcp", 0, 1, transform_descriptors=["zstd"])
    assert native_metadata.encode(md) is None
    md = _synthetic(tensors=1, chunks=2)
    md.storage_data.pop(key)  # a chunk without its stored piece
    assert native_metadata.encode(md) is None


# -- tensors of many chunks: kept in the table ---------------------------------------------------

MANY = native_metadata.LAZY_CHUNKS + 1


def _many_chunks(file_of_last: int = 0, negative: bool = False) -> bytes:
    """A tensor of `MANY` row chunks (kept in the table), its last chunk in file
    `file_of_last`, the last length negative with `negative`."""
    ints: list[int] = []
    for c in range(MANY):
        last = c == MANY - 1
        ints += [c, 0, 1, 4, c + 1, file_of_last if last else 0, c * 16]
        ints.append(-16 if negative and last else 16)
    header = _header(tensors=[["w", "float32", False, False, [MANY, 4], MANY]], ints=len(ints))
    return _record(header, _ints(*ints))


def test_a_tensor_of_many_chunks_is_read_from_the_table() -> None:
    md = native_metadata.decode(_many_chunks(), "ok")
    chunks = md.state_dict_metadata["w"].chunks
    assert isinstance(chunks, native_metadata.LazyChunks) and len(chunks) == MANY
    assert chunks[3] == ChunkStorageMetadata(torch.Size([3, 0]), torch.Size([1, 4]))
    assert chunks[-1].offsets == torch.Size([MANY - 1, 0])
    with pytest.raises(IndexError):
        chunks[MANY]
    assert list(chunks)[5] == chunks[5] and chunks == list(chunks)
    assert pickle.loads(pickle.dumps(chunks)) == list(chunks)  # a plain list
    storage = md.storage_data
    assert storage[MetadataIndex("w", [7, 0], 7)] == _StorageInfo("__0_0.distcp", 112, 16)
    # a wrong or missing index hint is only a hint: the piece is found by its offsets
    assert storage[MetadataIndex("w", [7, 0], 3)] == _StorageInfo("__0_0.distcp", 112, 16)
    assert storage[MetadataIndex("w", [7, 0])] == _StorageInfo("__0_0.distcp", 112, 16)
    for missing in (MetadataIndex("w", [7, 1], 7), MetadataIndex("w"), MetadataIndex("v", [0])):
        assert missing not in storage
        with pytest.raises(KeyError):
            storage[missing]
    assert len(storage) == MANY and len(dict(storage.items())) == MANY
    assert pickle.loads(pickle.dumps(md)) == md  # pickles as DCP's own types


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (_many_chunks(file_of_last=1), "not listed"),
        (_many_chunks(negative=True), "negative"),
    ],
    ids=["a file not listed", "a negative length"],
)
def test_a_crafted_tensor_of_many_chunks_is_refused(data: bytes, why: str, tmp_path: Path) -> None:
    with pytest.raises(CorruptCheckpointError, match=f"'{tmp_path}/rec'.*{why}"):
        native_metadata.decode(data, f"{tmp_path}/rec")


def test_a_large_record_costs_memory_only_for_what_is_read() -> None:
    """Tensors of many chunks are neither copied nor made into objects until used: a rank
    that reads a few chunks of each pays for those."""
    md = _synthetic(tensors=20, chunks=2_000)  # 40,000 chunks, 2.5 MB
    data = native_metadata.encode(md)
    assert data is not None
    decoded: list[Metadata] = []

    def decode_and_look_up() -> None:
        d = native_metadata.decode(data, "big")
        decoded.append(d)
        for t in range(20):
            d.storage_data[MetadataIndex(f"layers.{t}.weight", [8 * 1_000, 0], 1_000)]

    assert _peak(decode_and_look_up) <= len(data) // 10
    assert decoded[0] == md and decoded[0].storage_data == md.storage_data


def test_values_stored_at_one_place_share_it_and_a_damaged_place_is_refused(
    saved: Path, tmp_path: Path
) -> None:
    """The writer stores equal small values once (every parameter's hyperparameters): the
    decoded record gives the values at one place one `_StorageInfo`, and values at different
    places their own. The load hands each key its own value (`assert_same_state` compares every
    hyperparameter), and a flipped byte at a shared place is refused, though the manifest was
    made to agree with it: the first key that reads the place checks it."""
    path = _copy(saved, tmp_path)
    md = native_metadata.decode((path / DCP / NATIVE_METADATA_FILE).read_bytes(), "n")
    places: dict[tuple[str, int, int], list[str]] = {}
    for fqn, entry in md.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            info = md.pieces[fqn]
            places.setdefault((info.relative_path, info.offset, info.length), []).append(fqn)
    shared = max(places.values(), key=len)
    assert len(shared) > 2 and len(places) > 2
    for names in places.values():
        assert len({id(md.pieces[n]) for n in names}) == 1
    assert len({id(md.pieces[names[0]]) for names in places.values()}) == len(places)
    assert_same_state(_load(path), make_module())

    info = md.pieces[shared[0]]
    data = bytearray((path / DCP / info.relative_path).read_bytes())
    data[info.offset + info.length // 2] ^= 0x01
    (path / DCP / info.relative_path).write_bytes(bytes(data))
    rerecord(path, f"{DCP}/{info.relative_path}")
    with pytest.raises(CorruptCheckpointError, match="item"):
        _load(path, verify="size")

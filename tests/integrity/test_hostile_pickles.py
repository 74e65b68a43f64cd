"""Hostile pickles of every opcode family, planted where a checkpoint holds pickles (DCP's
`.metadata`, trainer state `train/rank0.pt`, a DCP non-tensor value), each run through every
entry point: `load`, `find_latest_good` then `load`, `trainckpt inspect`, `trainckpt export`, and
`load` from an http:// URL. Nothing runs (a marker file never appears) and the load is refused
with `UnsafeCheckpointError` (the CLI: exit 2, one line naming it).

Each live payload is first shown to run the command when unpickled the unsafe way (plain
`pickle.loads` / `torch.load(weights_only=False)`), so none of them is a dud. The checkpoint is
saved once per module; each (location, payload) is planted once and shared by the entry points.
"""

from __future__ import annotations

import copyreg
import io
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.damage import (
    RunsCommand,
    drop_native_metadata,
    read_manifest,
    split_item_record,
    write_item_record,
    write_manifest,
)
from support.hostile import (
    BINPERSID,
    BUILD,
    EMPTY_DICT,
    EMPTY_TUPLE,
    MARK,
    NEWOBJ,
    NEWOBJ_EX,
    NONE,
    OBJ,
    POP,
    TUPLE1,
    call,
    data_pkl_of,
    ext1,
    ext2,
    ext4,
    glob,
    inst,
    program,
    proto,
    stack_glob,
    text,
    torch_file_with_pickle,
    torch_save_bytes,
)
from support.models import WithExtra
from support.servers import StaticHTTPServer

from trainckpt import CheckpointerConfig, UnsafeCheckpointError
from trainckpt.cli.main import main as cli_main

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:Detected pickle protocol"),  # torch on protocol-4 payloads
]

DCP_FS = "torch.distributed.checkpoint.filesystem"  # imports os: `os.system` is a dotted walk
DCP_MD = "torch.distributed.checkpoint.metadata"
EXTENSIONS = {
    0xF1: ("os", "system"),
    0x1F1: ("posix", "system"),
    0x1F1F1: ("subprocess", "getoutput"),
}


def _int(n: int) -> bytes:
    return b"K" + bytes([n])  # BININT1


@dataclass
class Ctx:
    """What a payload is built from: the marker its command touches and the genuine pickle of
    the location it is planted in (program bytes and the object it holds)."""

    marker: Path
    location: str
    genuine_program: bytes
    genuine_obj: Any
    scratch: Path

    @property
    def cmd(self) -> str:
        return f"touch '{self.marker}'"

    @property
    def python(self) -> str:
        return f"import os; os.system({self.cmd!r})"


@dataclass
class Obj:
    """A payload that is an object, pickled the way its location is (pickle or torch.save)."""

    value: Any


def _evil_npy(ctx: Ctx) -> str:
    npy = ctx.scratch / f"evil-{ctx.marker.name}.npy"
    np.save(npy, np.array([RunsCommand(ctx.marker)], dtype=object), allow_pickle=True)
    return str(npy)


def _nested(ctx: Ctx) -> Obj:
    """The genuine object with a payload deep inside: loads fine if the payload is ignored."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    obj = ctx.genuine_obj
    if ctx.location == "metadata":
        obj.storage_meta = StorageMeta(modules=[RunsCommand(ctx.marker)])  # type: ignore[list-item]
        return Obj(obj)
    return Obj({"genuine": obj, "deep": [{"x": (1, RunsCommand(ctx.marker))}]})


def _in_front(ctx: Ctx) -> bytes:
    """The command, its result popped, then the genuine pickle: loads with the right value."""
    prefix = call(glob("os", "system"), text(ctx.cmd)) + POP
    return proto(ctx.genuine_program[1]) + prefix + ctx.genuine_program[2:]


# name -> (payload, runs the command when unpickled unsafely)
PAYLOADS: dict[str, tuple[Callable[[Ctx], bytes | Obj], bool]] = {
    "GLOBAL os.system": (lambda c: program(call(glob("os", "system"), text(c.cmd))), True),
    "GLOBAL dotted name": (
        lambda c: program(call(glob(DCP_FS, "os.system"), text(c.cmd)), protocol=4),
        True,
    ),
    "STACK_GLOBAL dotted name": (
        lambda c: program(call(stack_glob(DCP_FS, "os.system"), text(c.cmd)), protocol=4),
        True,
    ),
    "getattr of an import": (
        lambda c: program(
            call(
                call(
                    glob("builtins", "getattr"),
                    call(glob("builtins", "__import__"), text("os")),
                    text("system"),
                ),
                text(c.cmd),
            )
        ),
        True,
    ),
    "REDUCE OrderedDict with odd args": (
        lambda c: program(call(glob("collections", "OrderedDict"), text("abc"))),
        False,
    ),
    "REDUCE _rebuild_tensor_v2 misuse": (
        lambda c: program(
            call(
                glob("torch._utils", "_rebuild_tensor_v2"),
                text("not a storage"),
                _int(0),
                _int(4) + TUPLE1,
                _int(1) + TUPLE1,
                b"\x89",
                call(glob("collections", "OrderedDict")),
            )
        ),
        False,
    ),
    "BUILD __setstate__ gadget": (
        lambda c: program(
            stack_glob(DCP_MD, "BytesStorageMetadata") + EMPTY_TUPLE + NEWOBJ,
            NONE + EMPTY_DICT + text("__setstate__") + stack_glob(DCP_FS, "os.system") + b"s",
            b"\x86" + BUILD,
            text(c.cmd) + BUILD,
            protocol=4,
        ),
        True,
    ),
    "BUILD of foreign fields on a record": (
        lambda c: program(
            stack_glob(DCP_MD, "MetadataIndex") + EMPTY_TUPLE + NEWOBJ,
            EMPTY_DICT + text("__dict__") + EMPTY_DICT + b"s" + BUILD,
            protocol=4,
        ),
        False,
    ),
    "INST": (lambda c: program(MARK + text(c.cmd) + inst("os", "system")), True),
    "OBJ": (lambda c: program(MARK + glob("os", "system") + text(c.cmd) + OBJ), True),
    "NEWOBJ of a foreign class": (
        lambda c: program(glob("subprocess", "Popen") + MARK + text(c.cmd) + b"t" + NEWOBJ),
        False,
    ),
    "NEWOBJ_EX": (
        lambda c: program(
            stack_glob("subprocess", "Popen") + EMPTY_TUPLE + EMPTY_DICT + NEWOBJ_EX, protocol=4
        ),
        False,
    ),
    "EXT1": (lambda c: program(call(ext1(0xF1), text(c.cmd))), True),
    "EXT2": (lambda c: program(call(ext2(0x1F1), text(c.cmd))), True),
    "EXT4": (lambda c: program(call(ext4(0x1F1F1), text(c.cmd))), True),
    "persistent id": (lambda c: program(text("evil") + BINPERSID), False),
    "numpy.testing runstring": (
        lambda c: program(
            call(glob("numpy.testing._private.utils", "runstring"), text(c.python), EMPTY_DICT)
        ),
        True,
    ),
    "numpy.load allow_pickle": (
        lambda c: program(call(glob("numpy", "load"), text(_evil_npy(c)), NONE, b"\x88")),
        True,
    ),
    "numpy object array": (
        lambda c: Obj(np.array([RunsCommand(c.marker), 1], dtype=object)),
        True,
    ),
    "stealth: payload in front of the genuine pickle": (_in_front, True),
    "stealth: payload nested in the genuine value": (_nested, True),
}

LOCATIONS = {  # where it is planted -> the file
    "metadata": "model_and_optim/.metadata",
    "trainer_state": "train/rank0.pt",
    "dcp_value": None,  # inside a shard, at the value 'extra'
}
ENTRY_POINTS = ["load", "find_latest_good", "inspect", "export", "http"]
NOT_READ = {("trainer_state", "export"), ("dcp_value", "inspect")}  # never opened there


@pytest.fixture(scope="module", autouse=True)
def extension_codes() -> Iterator[None]:
    """Extension codes as a process might have registered them (copyreg is process-wide)."""
    for code, (module, name) in EXTENSIONS.items():
        copyreg.add_extension(module, name, code)
    yield
    for code, (module, name) in EXTENSIONS.items():
        copyreg.remove_extension(module, name, code)


# -- the checkpoint, saved once; hostile copies planted once each ---------------------------------


@dataclass
class Base:
    run: Path
    step: str
    genuine: dict[str, tuple[bytes, bytes, Any]]  # location -> (file bytes, program, object)


def _value_record(ckpt: Path) -> tuple[Any, Any, Any]:
    """(metadata, index, storage info) of the DCP value 'extra' (this test's own checkpoint,
    trusted: read with plain pickle)."""
    md = pickle.loads((ckpt / "model_and_optim" / ".metadata").read_bytes())
    index = next(i for i in md.storage_data if i.fqn == "extra")
    return md, index, md.storage_data[index]


@pytest.fixture(scope="module")
def base(http_server: StaticHTTPServer) -> Base:
    root = http_server.root / "hostile-base"
    c = CheckpointerConfig(work_dir=root / "work").build()
    state = {"step": 2, "rng": torch.get_rng_state()}
    ckpt = Path(c.save(root / "run" / "step2", WithExtra("epoch 3, shard 7"), state))
    c.close()
    md_bytes = (ckpt / LOCATIONS["metadata"]).read_bytes()  # type: ignore[operator]
    rank0 = (ckpt / LOCATIONS["trainer_state"]).read_bytes()  # type: ignore[operator]
    _md, _index, info = _value_record(ckpt)
    shard = (ckpt / "model_and_optim" / info.relative_path).read_bytes()
    value = shard[info.offset : info.offset + info.length]
    load = lambda b: torch.load(io.BytesIO(b), weights_only=False)  # noqa: E731 (own file)
    return Base(
        run=ckpt.parent,
        step=ckpt.name,
        genuine={
            "metadata": (md_bytes, md_bytes, pickle.loads(md_bytes)),
            "trainer_state": (rank0, data_pkl_of(rank0), load(rank0)),
            "dcp_value": (value, data_pkl_of(value), load(value)),
        },
    )


def _carrier(location: str, payload: bytes | Obj, genuine_file: bytes) -> bytes:
    """The file bytes that hold `payload` at `location`."""
    if isinstance(payload, Obj):
        return (
            pickle.dumps(payload.value, protocol=4)
            if location == "metadata"
            else (torch_save_bytes(payload.value))
        )
    return payload if location == "metadata" else torch_file_with_pickle(payload, genuine_file)


def _rerecord(ckpt: Path, *rels: str) -> None:
    """The manifest vouches for the planted bytes, as a careful attacker makes it."""
    import google_crc32c

    manifest = read_manifest(ckpt)
    for rel in rels:
        data = (ckpt / rel).read_bytes()
        manifest["files"][rel] = {"size": len(data), "crc32c": f"{google_crc32c.value(data):08x}"}
    write_manifest(ckpt, manifest)


def _plant_value(ckpt: Path, data: bytes) -> None:
    """Put `data` in the shard in place of the value 'extra', shifting what follows it."""
    md, index, info = _value_record(ckpt)
    shard = ckpt / "model_and_optim" / info.relative_path
    old, record = split_item_record(shard)
    items = old[: info.offset] + data + old[info.offset + info.length :]
    delta = len(data) - info.length
    for other in md.storage_data.values():
        if other.relative_path == info.relative_path and other.offset > info.offset:
            other.offset += delta
    info.length = len(data)
    (ckpt / "model_and_optim" / ".metadata").write_bytes(pickle.dumps(md))
    spans = [(o.offset, o.length) for o in md.storage_data.values()]
    mine = [o.relative_path == info.relative_path for o in md.storage_data.values()]
    write_item_record(shard, items, record, [sp for sp, m in zip(spans, mine, strict=True) if m])
    _rerecord(ckpt, f"model_and_optim/{info.relative_path}", "model_and_optim/.metadata")


_PLANTED: dict[tuple[str, str], Path] = {}


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in text)


def _ctx(base: Base, location: str, marker: Path) -> Ctx:
    _file, program_bytes, obj = base.genuine[location]
    fresh = pickle.loads(pickle.dumps(obj)) if location == "metadata" else obj
    return Ctx(marker, location, program_bytes, fresh, marker.parent)


def _planted(base: Base, location: str, name: str) -> tuple[Path, Path]:
    """(checkpoint folder, marker) of `name` planted at `location`, made once."""
    key = (location, name)
    if key not in _PLANTED:
        run = base.run.parent / "planted" / _slug(f"{location}-{name}")
        shutil.copytree(base.run, run)
        ckpt = run / base.step
        marker = run / "pwned"
        payload = PAYLOADS[name][0](_ctx(base, location, marker))
        data = _carrier(location, payload, base.genuine[location][0])
        rel = LOCATIONS[location]
        if rel is None:
            _plant_value(ckpt, data)
        else:
            (ckpt / rel).write_bytes(data)
            _rerecord(ckpt, rel)
        if location != "trainer_state":  # loads then read `.metadata`, through the allow-list
            drop_native_metadata(ckpt)
        _PLANTED[key] = ckpt
    ckpt = _PLANTED[key]
    return ckpt, ckpt.parent / "pwned"


CASES = [(loc, name) for loc in LOCATIONS for name in PAYLOADS]


@pytest.mark.parametrize(("location", "name"), [c for c in CASES if PAYLOADS[c[1]][1]])
def test_payload_runs_when_unpickled_unsafely(base, tmp_path, location, name):
    """Proof the payloads are live: the unsafe way of loading each does run its command."""
    proof = tmp_path / "proof"
    payload = PAYLOADS[name][0](_ctx(base, location, proof))
    data = _carrier(location, payload, base.genuine[location][0])
    try:
        if location == "metadata":
            pickle.loads(data)
        else:
            torch.load(io.BytesIO(data), weights_only=False)
    except Exception:
        pass  # some fail after running: what matters is that they ran
    assert proof.exists(), f"payload '{name}' at {location} is a dud"


def _run(entry: str, ckpt: Path, base: Base, http_server: StaticHTTPServer, tmp: Path) -> Any:
    """Run one entry point on `ckpt`: a library call's result, or (exit code, stderr)."""
    if entry in ("inspect", "export"):
        argv = ["inspect", str(ckpt)]
        if entry == "export":
            argv = ["export", str(ckpt), str(tmp / "out.pt"), "--all", "--format", "torch"]
        err = io.StringIO()
        real, sys.stderr = sys.stderr, err
        try:
            code = cli_main(argv)
        finally:
            sys.stderr = real
        return code, err.getvalue()
    c = CheckpointerConfig(work_dir=tmp / "work", verify_on_load="full").build()
    try:
        target = ckpt
        if entry == "find_latest_good":
            found = c.find_latest_good(ckpt.parent)
            assert found == str(ckpt), "the planted checkpoint passes verification"
        elif entry == "http":
            rel = ckpt.relative_to(http_server.root)
            target = f"{http_server.url}/{rel}"  # type: ignore[assignment]
        return c.load(target, WithExtra(None))
    finally:
        c.close()


@pytest.mark.usefixtures("record_steps")  # C and Python steps alike (conftest)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize(("location", "name"), CASES)
def test_hostile_pickle_runs_nothing(base, http_server, tmp_path, location, name, entry):
    ckpt, marker = _planted(base, location, name)
    said = str(ckpt / (LOCATIONS[location] or "model_and_optim"))
    if entry in ("inspect", "export"):
        code, err = _run(entry, ckpt, base, http_server, tmp_path)
        if (location, entry) in NOT_READ:
            assert code == 0, err
        else:
            assert code == 2, err
            assert "nothing from it was run" in err and said in err, err
            assert len(err.strip().splitlines()) == 1, err
    else:
        with pytest.raises(UnsafeCheckpointError) as info:
            _run(entry, ckpt, base, http_server, tmp_path)
        assert "nothing from it was run" in str(info.value)
        if entry != "http":
            assert said in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("location", "entry"),
    [
        ("metadata", "inspect"),
        ("trainer_state", "inspect"),
        ("metadata", "export"),
        ("dcp_value", "export"),
    ],
)
def test_the_installed_command_refuses_too(base, tmp_path, location, entry):
    """The `trainckpt` command itself (a subprocess), on the stealth payload."""
    ckpt, marker = _planted(base, location, "stealth: payload in front of the genuine pickle")
    argv = [sys.executable, "-m", "trainckpt", entry, str(ckpt)]
    if entry == "export":
        argv += [str(tmp_path / "out.pt"), "--all", "--format", "torch"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2, out.stderr
    assert "nothing from it was run" in out.stderr
    assert not marker.exists()


@pytest.mark.usefixtures("record_steps")
def test_genuine_checkpoint_loads_through_every_entry_point(base, http_server, tmp_path):
    """The unplanted checkpoint loads everywhere: the refusals above are not of everything."""
    ckpt = base.run / base.step
    rng = base.genuine["trainer_state"][2]["rng"]
    for entry in ("load", "find_latest_good", "http"):
        (tmp_path / entry).mkdir()
        state = _run(entry, ckpt, base, http_server, tmp_path / entry)
        assert state["step"] == 2 and torch.equal(state["rng"], rng)
    for entry in ("inspect", "export"):
        (tmp_path / entry).mkdir()
        code, err = _run(entry, ckpt, base, http_server, tmp_path / entry)
        assert code == 0, err
    exported = torch.load(tmp_path / "export" / "out.pt", weights_only=True)
    assert exported["extra"] == "epoch 3, shard 7"

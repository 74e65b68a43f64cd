"""Trainer state may hold numpy arrays of plain dtypes (OLMo-core's Trainer saves
`np.random.get_state()`); they load back exactly, by an allow-list that builds nothing else."""

from __future__ import annotations

import io
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import olmo_core.train.checkpoint as olmo_checkpoint
import pytest
import torch
from olmo_core.train.utils import EnvRngStates
from support.damage import RunsCommand, rerecord
from support.hostile import (
    Calls,
    call,
    glob,
    program,
    text,
    torch_file_with_pickle,
    torch_save_bytes,
)
from support.models import fresh_module, make_module

from trainckpt import CheckpointerConfig, InvalidTrainStateError, UnsafeCheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _numpy_state() -> dict[str, Any]:
    return {
        "rng": np.random.get_state(),
        "scalars": [np.float64(1.5), np.int8(-3), np.uint64(2**63), np.bool_(True)],
        "dtypes": (np.dtype("f2"), np.dtype(">i4")),
        "arrays": {
            "f16": np.arange(6, dtype=np.float16).reshape(2, 3),
            "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
            "big_endian": np.array([1, 2], dtype=">u4"),
            "complex": np.array([1 + 2j], dtype=np.complex64),
            "bools": np.array([True, False]),
            "empty": np.zeros((0, 4), dtype=np.int16),
            "zero_dim": np.array(5),
            "strided": np.arange(10)[::3],
        },
        "torch": torch.get_rng_state(),
    }


def _assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
        assert b.flags.writeable and b.flags.owndata
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b and (not isinstance(a, np.dtype) or a.str == b.str)


def test_numpy_trainer_state_round_trips(ckpt, tmp_path):
    state = _numpy_state()
    path = ckpt.save(tmp_path / "run" / "step1", make_module(), state)
    loaded = ckpt.load(path, fresh_module())
    _assert_same(state, loaded)
    np.random.set_state(loaded["rng"])  # usable as what it was
    expected = np.random.random(3)
    np.random.set_state(state["rng"])
    assert np.array_equal(np.random.random(3), expected)


def test_olmo_core_trainer_state_with_numpy_rng_loads(tmp_path):
    """OLMo-core's Trainer saves `EnvRngStates.current_state().as_dict()` (numpy's RNG state
    among it) in `train/rank0.pt` with plain `torch.save`."""
    rng = EnvRngStates.current_state().as_dict()
    state = {"global_step": 7, "rng": rng, "data_loader": {"tokens": np.int64(1 << 40)}}
    olmo = olmo_checkpoint.Checkpointer(work_dir=tmp_path / "olmo-work")
    olmo.save(str(tmp_path / "run" / "step7"), make_module(), state)
    c = CheckpointerConfig(work_dir=tmp_path / "w").build()
    loaded = c.load(tmp_path / "run" / "step7", fresh_module())
    c.close()
    _assert_same(state, loaded)
    assert EnvRngStates.from_dict(loaded["rng"]).restore()


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (np.array([None, 1], dtype=object), "numpy.ndarray of dtype object"),
        (np.array(["a"]), "numpy.ndarray of dtype <U1"),
        (np.zeros(2, dtype=[("a", "i4")]), "numpy.ndarray of dtype [('a', '<i4')]"),
        (np.ma.masked_array([1, 2]), "numpy.ma.MaskedArray"),
        (np.longdouble(1), "numpy scalar of dtype float128"),
        (np.datetime64("2020-01-01"), "numpy scalar of dtype datetime64[D]"),
        (np.dtype(object), "numpy dtype object"),
    ],
)
def test_non_plain_numpy_refused_at_save_naming_the_key(ckpt, tmp_path, value, says):
    with pytest.raises(InvalidTrainStateError, match=r"'loader\.state\[1\]' is ") as info:
        ckpt.save(tmp_path / "step1", make_module(), {"loader": {"state": [1, value]}})
    assert says in str(info.value)
    assert not (tmp_path / "step1").exists()


# -- hostile numpy pickles in train/rank0.pt: nothing runs -----------------------------------------


def _evil_npy(tmp_path: Path, marker: Path) -> Path:
    npy = tmp_path / "evil.npy"
    np.save(npy, np.array([RunsCommand(marker)], dtype=object), allow_pickle=True)
    return npy


def _hostile_numpy(name: str, marker: Path, tmp_path: Path) -> bytes:
    """`torch.save`-format bytes of the payload `name` (each would touch `marker` or build an
    unsafe array if loaded with weights_only=False)."""
    command = f"import os; os.system(\"touch '{marker}'\")"
    runstring = np.testing._private.utils.runstring
    payloads: dict[str, Any] = {
        "object array": lambda: {"a": np.array([RunsCommand(marker), 1], dtype=object)},
        "object array of plain values": lambda: {"a": np.array([1, "x"], dtype=object)},
        "numpy.load with allow_pickle": lambda: {
            "a": Calls(np.load, str(_evil_npy(tmp_path, marker)), None, True)
        },
        "numpy.testing runstring": lambda: {"a": Calls(runstring, command, {})},
        "numpy scalar of object dtype": lambda: {
            "a": Calls(np._core.multiarray.scalar, np.dtype(object), RunsCommand(marker))
        },
        "dtype with object flags": lambda: {
            "a": Calls(np.dtype, "u8", False, True, state=(3, "<", None, None, None, -1, -1, 63))
        },
        "array with less data than its shape": lambda: {
            "a": Calls(
                np._core.multiarray._reconstruct,
                np.ndarray,
                (0,),
                b"b",
                state=(1, (1 << 20,), np.dtype("u1"), False, b"xx"),
            )
        },
        "masked array": lambda: {"a": np.ma.masked_array([1, 2])},
    }
    if name == "numpy.lib load by its numpy.lib name":
        npy = _evil_npy(tmp_path, marker)
        lib_load = glob("numpy.lib._npyio_impl", "load")
        return torch_file_with_pickle(
            program(call(lib_load, text(str(npy)), b"N", b"\x88"), protocol=2)
        )
    return torch_save_bytes(payloads[name]())


HOSTILE_NUMPY = [
    "object array",
    "object array of plain values",
    "numpy.load with allow_pickle",
    "numpy.lib load by its numpy.lib name",
    "numpy.testing runstring",
    "numpy scalar of object dtype",
    "dtype with object flags",
    "array with less data than its shape",
    "masked array",
]
RUNS_WHEN_TRUSTED = {
    "object array",
    "numpy.load with allow_pickle",
    "numpy.lib load by its numpy.lib name",
    "numpy.testing runstring",
    "numpy scalar of object dtype",
}


@pytest.mark.parametrize("name", HOSTILE_NUMPY)
def test_hostile_numpy_pickle_in_trainer_state_runs_nothing(ckpt, tmp_path, saved_once, name):
    if name in RUNS_WHEN_TRUSTED:  # the payload is live: an unsafe loader does run it
        proof = tmp_path / "proof"
        data = _hostile_numpy(name, proof, tmp_path)
        try:
            torch.load(io.BytesIO(data), weights_only=False)
        except Exception:
            pass
        assert proof.exists(), f"payload '{name}' is a dud"
    marker = tmp_path / "pwned"
    run = tmp_path / "run"
    subprocess.run(["cp", "-r", str(saved_once.parent), str(run)], check=True)
    target = run / saved_once.name
    (target / "train" / "rank0.pt").write_bytes(_hostile_numpy(name, marker, tmp_path))
    rerecord(target, "train/rank0.pt")
    with pytest.raises(UnsafeCheckpointError, match=str(target / "train" / "rank0.pt")) as info:
        ckpt.load(target, fresh_module())
    assert "nothing from it was run" in str(info.value)
    assert not marker.exists()


def test_numpy_stays_optional(tmp_path):
    """Without numpy, trainckpt imports and plain trainer state still round-trips."""
    code = (
        "import sys; sys.modules['numpy'] = None\n"
        "import torch\n"
        "from trainckpt.format.trainer_state import serialize_trainer_state as s, "
        "deserialize_trainer_state as d\n"
        "assert d(s({'step': 3, 'rng': torch.get_rng_state()}, 'x'), 'x')['step'] == 3\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_numpy_allow_list_is_scoped_to_the_call():
    """The numpy globals are admitted only inside trainckpt's load, never process-wide."""
    from trainckpt.format import safe_unpickle

    before = set(map(str, torch.serialization.get_safe_globals()))
    safe_unpickle.load_torch_plain(torch_save_bytes({"a": np.ones(2)}), "x")
    assert set(map(str, torch.serialization.get_safe_globals())) == before
    with pytest.raises(pickle.UnpicklingError):
        torch.load(io.BytesIO(torch_save_bytes({"a": np.ones(2)})), weights_only=True)

"""The GPU path of staging, run on CPU: a recording fake stands in for every CUDA call
(`support.fake_cuda`), so the order and the device of the calls are checked without a GPU. Its
non-blocking copies happen only when their stream is synchronized: a stager that reads its
buffers (or lets them be written) before that reads nothing."""

from __future__ import annotations

import copy
import io
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from support.fake_cuda import Call, FakeStream, RecordingCuda
from support.models import assert_same_state, fresh_module, make_module
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from trainckpt import Checkpointer, ConfigurationError, ModelAndOptim
from trainckpt.core.cuda_calls import CudaCalls
from trainckpt.core.dcp import save_state
from trainckpt.core.shared_memory import ALIGN, locate
from trainckpt.core.staging import Stager
from trainckpt.errors import CorruptCheckpointError
from trainckpt.format.trainer_state import (
    FORMAT_KEY,
    deserialize_trainer_state,
    map_tensors,
    serialize_trainer_state,
)


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A default process group of one rank (a DeviceMesh asks for its rank), gone afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _claim_module(fake: RecordingCuda, module: ModelAndOptim, device: int) -> None:
    """The model's and optimizer's tensors live on GPU `device` (AdamW's step counts stay on
    the CPU, as they do on a GPU)."""
    for t in module.model.state_dict().values():
        fake.claim(t, device)
    assert module.optim is not None
    for state in module.optim.state_dict()["state"].values():
        for key, t in state.items():
            if key != "step":
                fake.claim(t, device)


def _dtensor(local: torch.Tensor, mesh: DeviceMesh, placement: object) -> DTensor:
    """A DTensor of this rank's `local` shard, as FSDP2 holds it, on `mesh` (built directly:
    `from_local` would move `local` to the mesh's device)."""
    shape = torch.Size([local.shape[0] * 2, *local.shape[1:]])
    meta = TensorMeta(shape, torch.empty(shape, device="meta").stride(), local.dtype)
    return DTensor(local, DTensorSpec(mesh, (placement,), meta), requires_grad=False)


@pytest.mark.usefixtures("one_rank")
def test_a_staged_dtensor_is_the_stagers_cpu_buffer_on_the_same_mesh() -> None:
    """FSDP2 state on a CUDA mesh: the staged DTensor's local tensor is the stager's own CPU
    buffer (no copy back to the mesh's device, which `DTensor.from_local` would make), in the
    shared memory a writer process reads (no scratch copy per save)."""
    fake = RecordingCuda(current_device=1)
    mesh = DeviceMesh("cuda", [0], _init_backend=False)  # claims CUDA; this machine has none
    local = torch.randn(3, 5)
    fake.claim(local, 1)
    stager = Stager(cuda=fake)
    staged = stager.stage({"w": _dtensor(local, mesh, Shard(0))}, shared=True)["w"]
    assert isinstance(staged, DTensor)
    assert staged.device_mesh is mesh and staged.placements == (Shard(0),)
    assert staged.shape == (6, 5)
    staged_local = staged.to_local()
    assert staged_local.device.type == "cpu"
    assert staged_local.data_ptr() == stager._by_position[0].data_ptr()  # its only tensor
    found = locate(staged_local)
    assert found is not None and found[0] in stager._arenas
    assert any(a <= staged_local.data_ptr() < a + n for a, n in fake.pinned.items())
    assert torch.equal(staged_local, local)


@pytest.mark.usefixtures("one_rank")
def test_partial_placements_are_refused() -> None:
    mesh = DeviceMesh("cpu", [0], _init_backend=False)
    state = {"model": {"grad_sum": _dtensor(torch.ones(2, 2), mesh, Partial())}}
    with pytest.raises(ConfigurationError, match=r"'model\.grad_sum'.*Partial.*reduce it first"):
        Stager().stage(state)


def test_overlapped_staging_orders_every_cuda_call_after_the_trainers_mark(
    ckpt: Checkpointer, tmp_path: Path
) -> None:
    """save_async(overlap_staging=True) on GPU 1: the mark on the trainer's stream during the
    call; then, on the save thread with device 1 current (never 0), page-locked arena, a side
    stream waiting on the mark, non-blocking copies on it, its synchronize, and only then the
    end of wait_for_staging and the write (the checkpoint holds the state as of the call)."""
    fake = RecordingCuda(current_device=1)
    ckpt._stager.cuda = fake
    module = make_module(width=16)
    _claim_module(fake, module, 1)
    expected = copy.deepcopy(module)
    trainer = threading.get_ident()

    future = ckpt.save_async(tmp_path / "step1", module, {"step": 1}, overlap_staging=True)
    ckpt.wait_for_staging()
    seen = list(fake.calls)
    with torch.no_grad():
        for p in module.model.parameters():
            p.mul_(-2.0)  # the next optimizer step: after wait_for_staging
    path = future.result()

    mark = seen[0]
    assert (mark.name, mark.device, mark.thread, mark.args[0]) == ("mark", 1, trainer, 1)
    assert all(c.thread != trainer for c in seen[1:])  # the rest: on the save thread
    assert (seen[1].name, seen[1].args) == ("on_device", (1,))  # first, from device 0
    assert {c.args[0] for c in seen if c.name == "on_device"} == {1}
    assert all(c.device == 1 for c in seen[2:]), [c for c in seen[2:] if c.device != 1]
    names = [c.name for c in seen]
    first_copy, last_copy = names.index("copy"), len(names) - 1 - names[::-1].index("copy")
    assert names.index("host_register") < names.index("wait") < first_copy
    assert names[last_copy + 1 :] == ["synchronize"]  # wait_for_staging ended after it
    (new_stream,) = fake.named("new_stream")
    side: FakeStream = new_stream.args[1]
    assert side.device == 1 and side is not fake.trainer_stream(1)
    (wait,) = fake.named("wait")
    assert wait.args == (side, mark.args[1])
    copies = [c for c in seen if c.name == "copy"]
    assert len(copies) == len([t for t in module.model.state_dict().values()]) + 2 * len(
        list(module.model.parameters())
    )
    assert all(c.args == (side, 1, True) for c in copies)  # on the side stream, into pinned
    assert seen[-1].args == (side,)

    loaded = fresh_module(width=16)
    assert ckpt.load(path, loaded) == {"step": 1}
    assert_same_state(expected, loaded)
    assert len(fake.named("host_register")) == 1  # one flat buffer for all of it


def test_state_on_two_gpus_waits_on_both_marks() -> None:
    """State on GPUs 0 and 1 of a rank whose device is 1: a mark on each device's trainer
    stream, each device's copies on its own side stream after its own mark."""
    fake = RecordingCuda(current_device=1)
    state = {"a": torch.randn(4), "b": torch.randn(3), "cpu": torch.randn(2)}
    fake.claim(state["a"], 0)
    fake.claim(state["b"], 1)
    staged = Stager(cuda=fake).stage(state)
    marks = {c.args[0]: c.args[1] for c in fake.named("mark")}
    assert set(marks) == {0, 1}
    waits = {c.args[0].device: c.args for c in fake.named("wait")}
    for device in (0, 1):
        stream, event = waits[device]
        assert event is marks[device] and event.stream is fake.trainer_stream(device)
    assert {c.args[1]: c.args[0].device for c in fake.named("copy")} == {0: 0, 1: 1}
    assert {c.args[0].device for c in fake.named("synchronize")} == {0, 1}
    for call in fake.calls:  # device 1 current, but for the copies from device 0
        assert call.device == (call.args[0].device if call.name == "copy" else 1), call
    for key, value in state.items():
        assert torch.equal(staged[key], value), key


def test_a_refused_registration_is_cleared_warned_once_and_not_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = RecordingCuda(refuse_pinning=True)
    state = {"w": torch.randn(50), "b": torch.randn(7)}
    for t in state.values():
        fake.claim(t, 0)
    stager = Stager(cuda=fake)
    with caplog.at_level(logging.WARNING, logger="trainckpt"):
        for _ in range(3):
            staged = stager.stage(state)
            assert all(torch.equal(staged[k], v) for k, v in state.items())
    names = [c.name for c in fake.calls]
    assert names.count("host_register") == 1
    assert names[names.index("host_register") + 1] == "get_last_error"
    assert fake.last_error == {}  # nothing left for the next kernel launch check
    warnings = [r for r in caplog.records if "cudaHostRegister" in r.getMessage()]
    assert len(warnings) == 1 and "unpinned" in warnings[0].getMessage()
    assert all(c.args[2] is False for c in fake.named("copy"))  # copies into unpinned memory

    state["w"] = torch.randn(60)  # a new shape: new buffers, still no new registration
    fake.claim(state["w"], 0)
    stager.stage(state)
    assert [c.name for c in fake.calls].count("host_register") == 1


def test_staging_memory_is_one_flat_buffer_of_the_states_size() -> None:
    """Tensors of odd sizes: one registration, of their bytes with each start aligned to 64
    (not rounded up to a power of two per tensor), holding every staged tensor."""
    fake = RecordingCuda()
    state = {
        "a": torch.randn(1000),
        "b": torch.randn(333),
        "c": torch.randn(77).to(torch.bfloat16),
        "d": torch.arange(5),
    }
    for t in state.values():
        fake.claim(t, 0)
    stager = Stager(cuda=fake)
    staged = stager.stage(state)
    sizes = [t.numel() * t.element_size() for t in state.values()]
    expected = sum(-(-n // ALIGN) * ALIGN for n in sizes[:-1]) + sizes[-1]
    assert expected == 4032 + 1344 + 192 + 40
    (register,) = fake.named("host_register")
    address, size = register.args
    assert size == expected == stager.nbytes
    for t in staged.values():
        assert address <= t.data_ptr() and t.data_ptr() + t.nbytes <= address + size
        assert locate(t) is None  # private memory (threads' writer): no memory file


def test_a_synchronous_save_waits_for_the_trainers_stream(
    ckpt: Checkpointer, tmp_path: Path
) -> None:
    """save() writes GPU state on the writer threads' own streams: it first waits for the
    trainer's current stream of the device holding the state."""
    fake = RecordingCuda(current_device=1)
    ckpt._stager.cuda = fake
    module = make_module(width=16)
    _claim_module(fake, module, 1)
    ckpt.save(tmp_path / "step1", module, {"step": 1})
    assert fake.calls == [Call("synchronize_current", 1, threading.get_ident(), (1,))]


@pytest.mark.usefixtures("one_rank")
def test_a_staged_dtensor_is_written_and_read_back_by_dcp(tmp_path: Path) -> None:
    """DCP plans and writes a staged DTensor (its local tensor the stager's buffer) as it does
    the original: the saved shard loads back into a DTensor of the same mesh exactly."""
    mesh = DeviceMesh("cpu", [0])
    original = distribute_tensor(torch.randn(6, 5), mesh, [Shard(0)])
    staged = Stager().stage({"w": original})
    save_state(staged, tmp_path / "dcp", group=None, thread_count=1)
    out = {"w": distribute_tensor(torch.zeros(6, 5), mesh, [Shard(0)])}
    dcp.load(out, checkpoint_id=str(tmp_path / "dcp"))
    assert torch.equal(out["w"].to_local(), original.to_local())


def _record_saves(monkeypatch: pytest.MonkeyPatch, fake: RecordingCuda) -> list[tuple[int, set]]:
    """Every `torch.save` call from now on, as (thread, devices of the tensors it writes)."""
    saves: list[tuple[int, set]] = []
    real_save = torch.save

    def recording_save(obj: object, *args: object, **kwargs: object) -> None:
        devices: set = set()
        map_tensors(obj, lambda _, t: devices.add(fake.device_of(t)))
        saves.append((threading.get_ident(), devices))
        real_save(obj, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "save", recording_save)
    return saves


@pytest.mark.parametrize("overlap", [False, True])
def test_gpu_trainer_state_is_staged_after_the_mark_and_comes_back_on_the_ranks_device(
    ckpt: Checkpointer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    """A trainer state with a tensor on GPU 3 (rank 3's device): copied with the module's
    state on the side stream after the mark, never `torch.save`d from the GPU, its structure
    as of the call; the file records cuda:3, and a load on a rank whose device is 1 puts it
    on GPU 1 (as map_location would), the CPU values staying on the CPU."""
    fake = RecordingCuda(current_device=3)
    ckpt._stager.cuda = fake
    module = make_module(width=8)
    _claim_module(fake, module, 3)
    scale = torch.tensor([2.0, 3.0])
    fake.claim(scale, 3)
    rng = torch.get_rng_state()
    train_state = {"step": 1, "amp": {"scale": scale}, "rng": [rng]}
    saves = _record_saves(monkeypatch, fake)

    future = ckpt.save_async(tmp_path / "step1", module, train_state, overlap_staging=overlap)
    train_state["step"] = 2  # the trainer's next step: the call took its values
    ckpt.wait_for_staging()
    scale.mul_(10)  # the next optimizer step, after wait_for_staging
    path = future.result()

    assert all(None in devices and len(devices) == 1 for _, devices in saves if devices), saves
    mark = fake.named("mark")[0]
    assert mark.args[0] == 3 and fake.calls.index(mark) == 0
    names = [c.name for c in fake.calls]
    n_module = len(module.model.state_dict()) + 2 * len(list(module.model.parameters()))
    assert names.count("copy") == n_module + 1  # the trainer state's tensor too
    assert names.index("wait") < names.index("copy")
    raw = torch.load(tmp_path / "step1" / "train" / "rank0.pt", weights_only=True)
    assert raw[FORMAT_KEY] == 2 and raw["devices"] == [(("amp", "scale"), 3)]

    loader = RecordingCuda(current_device=1)
    ckpt._stager.cuda = loader
    loaded = ckpt.load(path, fresh_module(width=8))
    assert loaded is not None and loaded["step"] == 1
    assert torch.equal(loaded["amp"]["scale"], torch.tensor([2.0, 3.0]))
    assert loader.device_of(loaded["amp"]["scale"]) == 1
    assert torch.equal(loaded["rng"][0], rng) and loader.device_of(loaded["rng"][0]) is None
    assert loader.named("to_device") == [Call("to_device", 1, threading.get_ident(), (1,))]


def test_gpu_trainer_state_loads_on_the_cpu_without_cuda(
    ckpt: Checkpointer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Loaded where CUDA is not available (this machine, the real `CudaCalls`), a tensor saved
    from a GPU stays on the CPU, with a warning naming its device."""
    fake = RecordingCuda(current_device=3)
    ckpt._stager.cuda = fake
    scale = torch.tensor([4.0])
    fake.claim(scale, 3)
    path = ckpt.save_async(tmp_path / "step1", make_module(width=8), {"scale": scale}).result()
    ckpt._stager.cuda = CudaCalls()
    with caplog.at_level(logging.WARNING, logger="trainckpt"):
        loaded = ckpt.load(path, fresh_module(width=8))
    assert loaded is not None and torch.equal(loaded["scale"], torch.tensor([4.0]))
    assert loaded["scale"].device.type == "cpu"
    assert any("cuda:3 stays on the CPU" in r.getMessage() for r in caplog.records)


def test_trainer_state_formats_1_and_2_load_and_others_are_refused() -> None:
    """Format 1 (a plain dict: what earlier saves and OLMo-core write) loads as it is; a
    format-2 file whose device list names no tensor, or a later format, is refused."""
    plain = {"step": 7, "trainckpt": 1, "t": torch.ones(2)}
    assert serialize_trainer_state(plain, "w") == _saved(plain)  # no GPU tensor: format 1
    loaded = deserialize_trainer_state(_saved(plain), "w", lambda t, d: pytest.fail("moved"))
    assert loaded["step"] == 7 and torch.equal(loaded["t"], plain["t"])
    bad = {FORMAT_KEY: 2, "state": {"step": 1}, "devices": [(("step",), 0)]}
    with pytest.raises(CorruptCheckpointError, match=r"'w'.*\('step',\).*does not hold"):
        deserialize_trainer_state(_saved(bad), "w")
    newer = {FORMAT_KEY: 3, "state": {}, "devices": []}
    with pytest.raises(CorruptCheckpointError, match="format 3.*reads formats 1 and 2"):
        deserialize_trainer_state(_saved(newer), "w")


def _saved(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_a_staged_cpu_state_is_an_independent_copy_of_every_value() -> None:
    """Thousands of CPU tensors (views, odd dtypes, non-contiguous) copied in one batch, and the
    values beside them: equal when staged, unchanged by later training, mutable containers not
    shared with the state."""
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    state: dict[str, object] = {
        f"w{i}": torch.randn(3, dtype=torch.bfloat16 if i % 3 else torch.float32)
        for i in range(3000)
    }
    state |= {
        "view": base[1:3],
        "transposed": base.t(),
        "hyper": {"lr": 0.5, "betas": (0.9, 0.999), "names": ["a", "b"], "flag": None},
    }
    expected = copy.deepcopy(state)
    staged = Stager().stage(state)
    for value in state.values():
        if isinstance(value, torch.Tensor):
            value.add_(1)  # training goes on
    state["hyper"]["names"].append("c")  # type: ignore[index]
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(staged[key], value), key
            assert staged[key].stride() == staged[key].contiguous().stride()
        else:
            assert staged[key] == value, key
    assert staged["hyper"]["names"] is not state["hyper"]["names"]  # type: ignore[index]

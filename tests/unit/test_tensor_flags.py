"""Tensor flags read without letting go of the interpreter lock (`format/tensor_flags.py`):
the same answers as PyTorch's own queries, the lock kept, and lazily conjugated or negated
views (whose storage does not hold their values) still saved and loaded by their values."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from trainckpt import CheckpointerConfig, ModelAndOptim
from trainckpt.core.dcp import load_state, save_state
from trainckpt.format import tensor_flags
from trainckpt.format.content_hash import tensor_kind
from trainckpt.format.dcp_metadata import read_dcp_metadata
from trainckpt.storage.local import LocalStorage


def _zoo() -> dict[str, torch.Tensor]:
    """Tensors with and without the conjugate and negative bits, views and not."""
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    neg = torch._neg_view(torch.arange(4.0))
    return {
        "plain": torch.arange(4.0),
        "int": torch.arange(3),
        "scalar": torch.tensor(2.5),
        "grad": torch.ones(2, requires_grad=True),
        "view": torch.arange(6.0)[1:4],
        "complex": z,
        "conj": z.conj(),
        "conj detached": z.conj().detach(),
        "conj cloned": z.conj().clone(),
        "imag of conj": z.conj().imag,
        "imag of conj detached": z.conj().imag.detach(),
        "neg": neg,
        "neg detached": neg.detach(),
        "neg sliced": neg[1:],
        "neg cloned": neg.clone(),
        "sparse": torch.eye(3).to_sparse(),
        "meta": torch.empty(3, device="meta"),
    }


@pytest.mark.parametrize("name", list(_zoo()))
def test_the_flags_are_pytorchs_own(name: str) -> None:
    t = _zoo()[name]
    assert tensor_flags.flips_values(t) == (t.is_conj() or t.is_neg())
    assert tensor_flags.is_pinned(t) == t.is_pinned()


@pytest.fixture
def lock_probe() -> Iterator[Callable[[Callable[[], Any]], int]]:
    """`probe(fn)`: how often another thread ran while `fn` ran. With a switch interval of
    1 s (`fn` takes milliseconds) that thread runs only when this one lets go of the
    interpreter lock itself (it gives the lock up after each of its own steps, so this
    thread never waits long for it)."""
    ran = [0]
    stop = threading.Event()

    def other() -> None:
        while not stop.is_set():
            ran[0] += 1
            os.sched_yield()  # lets go of the lock

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    thread = threading.Thread(target=other, daemon=True)
    thread.start()

    def probe(fn: Callable[[], Any]) -> int:
        before = ran[0]
        fn()
        return ran[0] - before

    try:
        yield probe
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)


def test_the_flags_keep_the_interpreter_lock(
    lock_probe: Callable[[Callable[[], Any]], int],
) -> None:
    tensors = [torch.zeros(4, 4) for _ in range(2000)]
    tensor_flags.is_pinned(tensors[0])  # the accelerator looked up once
    for _ in range(5):
        assert lock_probe(lambda: [tensor_flags.flips_values(t) for t in tensors]) == 0
        assert lock_probe(lambda: [tensor_flags.is_pinned(t) for t in tensors]) == 0
    # the probe sees a query that lets go of the lock: PyTorch's own
    assert any(lock_probe(lambda: [t.is_neg() for t in tensors]) > 0 for _ in range(20))


def test_no_accelerator_here_so_nothing_is_asked_if_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine has no accelerator; there `is_pinned` answers without PyTorch's query."""
    assert torch.accelerator.current_accelerator() is None

    def refuse(self: torch.Tensor, *args: Any) -> bool:
        raise AssertionError("is_pinned() asked")

    monkeypatch.setattr(torch.Tensor, "is_pinned", refuse)
    assert tensor_flags.is_pinned(torch.zeros(3)) is False


def test_lazy_views_are_saved_and_loaded_by_their_values(tmp_path: Path) -> None:
    """A conjugated or negated view's storage holds other values than it shows, and
    `torch.save` keeps the bit. Plain tensors of the same dtype, shape and strides come
    before and after each view, so the fast paths (the writer's template of a kind,
    `tensor_item.small_item`; the reader's skeleton of a kind and its one-copy path into a
    target, `shard_reader`) all meet the views, and each must see the bit."""
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    state = {
        "plain complex": z + 1,
        "conj": z.conj(),
        "plain": torch.arange(4.0),
        "plain 2": torch.arange(4.0) + 5,  # the second of its kind: the writer's quick path
        "neg": torch._neg_view(torch.arange(1.0, 5.0)),
        "plain again": torch.arange(4.0) + 10,
        "imag of conj": z.conj().imag.detach(),
        "last": torch.arange(4.0) + 20,
    }
    save_state(state, tmp_path / "dcp", group=None, thread_count=1)
    storage = LocalStorage()
    md = read_dcp_metadata(storage, str(tmp_path / "dcp"))
    out = {k: torch.zeros_like(v.resolve_conj().resolve_neg()) for k, v in state.items()}
    out["plain again"] = torch._neg_view(torch.zeros(4))  # targets whose storage is negated
    out["last"] = torch._neg_view(torch.zeros(4))
    load_state(out, storage, str(tmp_path / "dcp"), md, group=None, thread_count=1)
    for k, v in state.items():
        assert torch.equal(out[k], v), k
    assert tensor_kind(state["neg"]) is None and tensor_kind(state["conj"]) is None
    assert tensor_kind(state["plain"]) is not None


class _Views(torch.nn.Module):
    """A model whose buffers are lazy views, as a model's own state dict hands them out."""

    def __init__(self, fill: float) -> None:
        super().__init__()
        z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64) * fill
        self.register_buffer("plain", torch.arange(4.0) * fill)
        self.register_buffer("plain_2", torch.arange(4.0) * fill + 5)
        self.register_buffer("neg", torch._neg_view(torch.arange(1.0, 5.0) * fill))
        self.register_buffer("conj", z.conj())


@pytest.mark.parametrize("how", ["save", "threads", "process"])
def test_lazy_views_of_a_model_come_back_through_every_save(tmp_path: Path, how: str) -> None:
    """The Checkpointer's sync save, and its background saves with writer threads and with a
    writer process (staged copies), each loaded back by trainckpt."""
    ckpt = CheckpointerConfig(
        work_dir=tmp_path / "work", async_writer="process" if how == "process" else "thread"
    ).build()
    try:
        src = ModelAndOptim(_Views(1.0))
        if how == "save":
            ckpt.save(tmp_path / "step1", src, {"step": 1})
        else:
            ckpt.save_async(tmp_path / "step1", src, {"step": 1}).result()
        dst = _Views(0.0)
        ckpt.load(tmp_path / "step1", ModelAndOptim(dst))
    finally:
        ckpt.close()
    want = _Views(1.0).state_dict()
    for k, v in dst.state_dict().items():
        assert torch.equal(v, want[k]), k

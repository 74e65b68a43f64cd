"""Incremental saves on object stores (docs/incremental.md): from the second save on, the
frozen base is copied server-side, never uploaded, and each checkpoint, with every other one
deleted, verifies and loads exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from support.lora import BASE_BYTES, copy_of, lora_module, train
from support.models import assert_same_state
from support.s3_server import S3Proxy

from trainckpt import Checkpointer, CheckpointerConfig
from trainckpt.storage import StorageOptions
from trainckpt.storage.gcs import GCSStorage


def _three_saves(url: str, tmp_path: Path, sent: Any) -> list[Any]:
    """Three saves of a trained adapter over a frozen base; the bytes `sent()` reports for
    each save; then each checkpoint alone (the other two deleted) verifies and loads."""
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work").build()
    module = lora_module()
    uploaded, saved = [], []
    try:
        for step in (1, 2, 3):
            train(module, step)
            before = sent()
            ckpt.save(f"{url}/step{step}", module, {"step": step})
            uploaded.append(sent() - before)
            saved.append(copy_of(module))
        Checkpointer.delete(f"{url}/step1")
        Checkpointer.delete(f"{url}/step2")
        assert Checkpointer.verify(f"{url}/step3", deep=True).ok
        dst = lora_module(seed=5)
        assert ckpt.load(f"{url}/step3", dst) == {"step": 3}
        assert_same_state(saved[2], dst)
    finally:
        ckpt.close()
    return uploaded


def test_gcs_copies_the_frozen_base_server_side(gcs_bucket: str, tmp_path: Path) -> None:
    storage = GCSStorage.shared(StorageOptions())  # the instance the checkpointer uses
    bodies: list[int] = []

    def record(response: Any, *args: Any, **kwargs: Any) -> None:
        bodies.append(len(response.request.body or b""))

    hooks = storage.client._http.hooks["response"]
    hooks.append(record)
    try:
        uploaded = _three_saves(gcs_bucket, tmp_path, lambda: sum(bodies))
    finally:
        hooks.remove(record)
    assert uploaded[0] > BASE_BYTES
    assert all(n < BASE_BYTES / 10 for n in uploaded[1:]), uploaded


def test_s3_copies_the_frozen_base_server_side(
    s3_bucket: str, s3_proxy: S3Proxy, tmp_path: Path
) -> None:
    def sent() -> int:
        with s3_proxy.lock:
            return sum(len(r.body) for r in s3_proxy.requests)

    uploaded = _three_saves(s3_bucket, tmp_path, sent)
    assert uploaded[0] > BASE_BYTES
    assert all(n < BASE_BYTES / 10 for n in uploaded[1:]), uploaded
    assert s3_proxy.ops("CopyObject")

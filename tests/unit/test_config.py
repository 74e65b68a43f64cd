"""CheckpointerConfig: validation names the field, files load, build applies overrides."""

from __future__ import annotations

import json

import pytest

from trainckpt import Checkpointer, CheckpointerConfig, ConfigurationError


def test_defaults_build_a_checkpointer(tmp_path):
    ckpt = CheckpointerConfig(work_dir=tmp_path / "w").build()
    assert isinstance(ckpt, Checkpointer)
    assert ckpt.work_dir.is_dir() and ckpt.save_overwrite is False
    ckpt.close()


@pytest.mark.parametrize(
    "raw, field",
    [
        ({"save_thread_count": 0}, "save_thread_count"),
        ({"fs_timeout": -1}, "fs_timeout"),
        ({"verify_on_load": "sometimes"}, "verify_on_load"),
        ({"save_overwirte": True}, "save_overwirte"),
    ],
)
def test_invalid_settings_name_the_field(raw, field):
    with pytest.raises(ConfigurationError, match=field):
        CheckpointerConfig.validated(raw)


def test_from_yaml_and_json(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("checkpointer:\n  save_overwrite: true\n  load_thread_count: 3\n")
    assert CheckpointerConfig.from_file(y).load_thread_count == 3
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"pre_download": True, "work_dir": str(tmp_path)}))
    cfg = CheckpointerConfig.from_file(j)
    assert cfg.pre_download and cfg.work_dir == tmp_path


def test_shipped_example_config_is_valid():
    cfg = CheckpointerConfig.from_file("configs/checkpointer.yaml")
    assert cfg.verify_on_load == "size"


def test_bad_files_name_the_path(tmp_path):
    with pytest.raises(ConfigurationError, match="missing.yaml"):
        CheckpointerConfig.from_file(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("fs_timeout: [1, 2\n")
    with pytest.raises(ConfigurationError, match="bad.yaml"):
        CheckpointerConfig.from_file(bad)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("fs_timeout: soon\n")
    with pytest.raises(ConfigurationError, match="wrong.yaml.*fs_timeout"):
        CheckpointerConfig.from_file(wrong)


def test_build_overrides_are_validated(tmp_path):
    cfg = CheckpointerConfig(work_dir=tmp_path)
    ckpt = cfg.build(save_overwrite=True)
    assert ckpt.save_overwrite and not cfg.save_overwrite
    ckpt.close()
    with pytest.raises(ConfigurationError, match="collective_timeout"):
        cfg.build(collective_timeout=0)

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


def test_every_way_in_raises_configuration_error_naming_the_field(tmp_path):
    """The constructor, `model_validate`, `model_validate_json`, `from_file` and assignment
    all raise the library's `ConfigurationError` (also a `ValueError`), never pydantic's
    `ValidationError`; a misspelt field gets the real one suggested."""
    from pydantic import ValidationError

    bad_file = tmp_path / "c.yaml"
    bad_file.write_text("work_dirr: /tmp/x\n")
    attempts = {
        "constructor": lambda: CheckpointerConfig(work_dirr="/tmp/x"),
        "model_validate": lambda: CheckpointerConfig.model_validate({"work_dirr": "/tmp/x"}),
        "model_validate_json": lambda: CheckpointerConfig.model_validate_json(
            '{"work_dirr": "/tmp/x"}'
        ),
        "from_file": lambda: CheckpointerConfig.from_file(bad_file),
        "Checkpointer": lambda: Checkpointer(work_dirr="/tmp/x"),
    }
    for how, attempt in attempts.items():
        with pytest.raises(ConfigurationError) as info:
            attempt()
        assert not isinstance(info.value, ValidationError), how
        assert isinstance(info.value, ValueError), how
        assert "work_dirr" in str(info.value) and "did you mean 'work_dir'" in str(info.value)
    config = CheckpointerConfig()
    with pytest.raises(ConfigurationError, match="fs_timeout"):
        config.fs_timeout = -1
    assert CheckpointerConfig.model_validate({"fs_timeout": 5}).fs_timeout == 5


def test_shipped_example_config_shows_every_field_at_its_default():
    """configs/checkpointer.yaml lists every field of the class, in declaration order, each at
    its default except `work_dir` (a concrete path to show the form)."""
    import yaml

    raw = yaml.safe_load(open("configs/checkpointer.yaml").read())
    assert list(raw) == list(CheckpointerConfig.model_fields)
    defaults = CheckpointerConfig().model_dump(mode="json")
    shown = CheckpointerConfig.from_file("configs/checkpointer.yaml").model_dump(mode="json")
    assert {k: v for k, v in shown.items() if k != "work_dir"} == {
        k: v for k, v in defaults.items() if k != "work_dir"
    }

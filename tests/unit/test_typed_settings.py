"""A `Checkpointer`'s settings are typed attributes: a type checker knows each one's type and
refuses a misspelt one, and so does Python at run time; the package says it is typed (PEP 561)
in the wheel and the sdist it builds."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import typing
import zipfile
from pathlib import Path

import pytest

from trainckpt import Checkpointer, CheckpointerConfig, ConfigurationError
from trainckpt.config import Setting

ROOT = Path(__file__).resolve().parents[2]

SNIPPET = """
from trainckpt import Checkpointer, CheckpointerConfig

def use(ckpt: Checkpointer) -> None:
    ckpt.wrok_dir
    ckpt.wrok_dir = 1
    reveal_type(ckpt.work_dir)
    reveal_type(ckpt.verify_on_load)
    ckpt.fs_timeout = "soon"
    reveal_type(CheckpointerConfig().build())
"""

# torch, pydantic & co. are skipped (taken as Any): the check reads trainckpt's own hints only,
# in seconds instead of minutes
MYPY_INI = """
[mypy]
ignore_missing_imports = True
follow_imports = silent
incremental = False

[mypy-torch.*,numpy.*,google.*,pydantic.*,yaml.*,safetensors.*,boto3.*,botocore.*,cached_path.*,tqdm.*]
follow_imports = skip
"""


def test_mypy_knows_each_settings_type_and_refuses_a_misspelt_one(tmp_path: Path) -> None:
    (tmp_path / "snippet.py").write_text(SNIPPET)
    (tmp_path / "mypy.ini").write_text(MYPY_INI)
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "snippet.py"],
        cwd=tmp_path,
        env={"MYPYPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = run.stdout
    assert out.count('"Checkpointer" has no attribute "wrok_dir"; maybe "work_dir"?') == 2, out
    assert 'snippet.py:7: note: Revealed type is "pathlib.Path"' in out, out
    assert "Literal['none'] | Literal['size'] | Literal['full']" in out, out
    assert 'snippet.py:9: error: Incompatible types in assignment (expression has type "str"' in out
    assert 'Revealed type is "trainckpt.checkpointer.Checkpointer"' in out, out


def test_a_misspelt_setting_is_refused_at_run_time(ckpt: Checkpointer) -> None:
    with pytest.raises(AttributeError, match="'wrok_dir'.*did you mean 'work_dir'"):
        ckpt.wrok_dir  # type: ignore[attr-defined]  # noqa: B018
    with pytest.raises(ConfigurationError, match="'verfy_on_load'.*did you mean 'verify_on_load'"):
        ckpt.verfy_on_load = "full"  # type: ignore[attr-defined]
    assert not hasattr(ckpt, "verfy_on_load") and ckpt.verify_on_load == "size"
    ckpt.verify_on_load = "full"  # a real one: validated into the config
    assert ckpt.config.verify_on_load == "full"
    with pytest.raises(ConfigurationError, match="fs_timeout"):
        ckpt.fs_timeout = -1.0


def test_the_typed_attributes_are_the_configs_fields() -> None:
    """Each setting of `CheckpointerConfig` is a `Setting` of `Checkpointer` of the same type
    (None left out of the two that `with_defaults` always fills in)."""
    settings = {k: v for k, v in vars(Checkpointer).items() if isinstance(v, Setting)}
    assert list(settings) == list(CheckpointerConfig.model_fields)
    filled = {"work_dir", "save_overwrite"}
    for name, info in CheckpointerConfig.model_fields.items():
        declared = typing.get_args(settings[name].__orig_class__)[0]  # type: ignore[attr-defined]
        expected = info.annotation
        if name in filled:
            (expected,) = [t for t in typing.get_args(expected) if t is not type(None)]
        assert declared == expected, name


def test_the_wheel_and_the_sdist_ship_py_typed(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, tmp_path / name)
    build = (
        "from setuptools import build_meta as b; "
        "print(b.build_wheel('out')); print(b.build_sdist('out'))"
    )
    subprocess.run([sys.executable, "-c", build], cwd=tmp_path, check=True, capture_output=True)
    (wheel,) = (tmp_path / "out").glob("*.whl")
    (sdist,) = (tmp_path / "out").glob("*.tar.gz")
    assert "trainckpt/py.typed" in zipfile.ZipFile(wheel).namelist()
    with tarfile.open(sdist) as tar:
        assert any(n.endswith("/src/trainckpt/py.typed") for n in tar.getnames())

"""Deprecated alias of `trainckpt.integrations.olmo_core`.

Kept because OLMo-core writes a config's class path into every `config.json` it saves
(`"_CLASS_": "trainckpt.olmo.OLMoCheckpointerConfig"` in runs saved before the class moved) and
imports that path when it reads the config back.
New code: `from trainckpt import OLMoCheckpointerConfig`.
"""

import warnings

from trainckpt.integrations.olmo_core import OLMoCheckpointerConfig

__all__ = ["OLMoCheckpointerConfig"]

warnings.warn(
    "trainckpt.olmo is deprecated: use trainckpt.OLMoCheckpointerConfig (it lives in "
    "trainckpt.integrations.olmo_core)",
    DeprecationWarning,
    stacklevel=2,
)

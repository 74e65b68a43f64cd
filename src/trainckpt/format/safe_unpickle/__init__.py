"""Loaders that can only build data: the one package that decides what a checkpoint's pickles
may name. A security boundary: nothing read from a checkpoint is ever called, imported or
executed. One module per kind of pickle it loads (`docs/trust.md`):

- `torch_plain`: trainer state (`torch.save` files), `load_torch_plain`: PyTorch's
  `weights_only` unpickler plus, scoped to the call, numpy's reconstruction globals bound to
  the stand-ins of `numpy_values`, which build only plain numeric/bool arrays, scalars, dtypes.
- `no_globals`: pickled bytes a trainer keeps inside its state, `check_plain_pickles`: vetted
  by an unpickler that admits no global at all, before the trainer's own `pickle.loads`.
- `dcp_metadata`: DCP's `.metadata`, `load_dcp_metadata`: CPython's C unpickler, whose
  globals are an exact table of fully qualified names (`dcp_allow_list`): makers of DCP's
  records, whose every field is checked after the load, and immutable or checking
  constructors; the steps run once per record are in C where built (`fast_records.c`).

Every refusal is an `UnsafeCheckpointError`; a damaged file (a torn zip, a truncated pickle) is a
`CorruptCheckpointError`. Both name the file.
"""

from trainckpt.format.safe_unpickle.dcp_metadata import load_dcp_metadata
from trainckpt.format.safe_unpickle.no_globals import (
    NoGlobalsUnpickler,
    check_plain_pickle,
    check_plain_pickles,
    looks_like_pickle,
)
from trainckpt.format.safe_unpickle.numpy_values import numpy_value_problem
from trainckpt.format.safe_unpickle.torch_plain import load_torch_plain

__all__ = [
    "NoGlobalsUnpickler",
    "check_plain_pickle",
    "check_plain_pickles",
    "load_dcp_metadata",
    "load_torch_plain",
    "looks_like_pickle",
    "numpy_value_problem",
]

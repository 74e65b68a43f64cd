"""DCP's `.metadata` (a plain protocol-2..5 pickle, which PyTorch's `weights_only` unpickler
cannot read): `load_dcp_metadata` runs it opcode by opcode through the dispatch table of
`dcp_opcodes`, whose globals are the exact table of `dcp_globals`."""

from __future__ import annotations

import gc
from typing import Any

from trainckpt.errors import CorruptCheckpointError, UnsafeCheckpointError
from trainckpt.format.safe_unpickle.dcp_globals import DcpGlobals, dcp_globals
from trainckpt.format.safe_unpickle.dcp_machine import Machine, Malformed
from trainckpt.format.safe_unpickle.dcp_opcodes import DISPATCH
from trainckpt.format.safe_unpickle.refusal import Refused, short


def run(data: bytes, admitted: DcpGlobals) -> Any:
    """The object the pickle program in `data` builds. Raises `Refused` for anything the
    tables do not admit and `Malformed` (or the IndexError/KeyError of a stack or memo misuse)
    for a broken program."""
    m = Machine(data, admitted)
    dispatch = DISPATCH
    try:
        while True:
            op = data[m.pos]
            m.pos += 1
            done = dispatch[op](m)
            if done is not None:
                return done[0]
    except IndexError:
        if m.pos >= len(data):
            raise Malformed("truncated") from None
        raise


def load_dcp_metadata(data: bytes, where: str) -> Any:
    """The object DCP pickled into its `.metadata` file `where`, read by `run` (which
    builds only DCP's records, torch sizes/dtypes/layouts/devices and plain containers).
    Raises `UnsafeCheckpointError` for anything else, `CorruptCheckpointError` for a broken
    pickle. Called on: whichever ranks read the metadata."""
    collecting = gc.isenabled()
    gc.disable()  # a big metadata is ~100k young objects: collections would dominate the read
    try:
        return run(data, dcp_globals())
    except Refused as e:
        raise UnsafeCheckpointError(
            f"{where}: DCP metadata asks for {e}, which trainckpt does not load (it could run "
            "code); nothing from it was run. The checkpoint was crafted or is not a plain DCP "
            "checkpoint: load an older checkpoint or restore it from a trusted copy"
        ) from e
    except Exception as e:  # a broken program: truncated, stack or memo misuse
        raise CorruptCheckpointError(
            f"{where} cannot be read as DCP metadata ({type(e).__name__}: {short(str(e))}); "
            "the checkpoint is damaged: restore it from a copy or use an older checkpoint"
        ) from e
    finally:
        if collecting:
            gc.enable()

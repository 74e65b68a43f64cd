"""DCP's `.metadata` (a plain protocol-2..5 pickle, which PyTorch's `weights_only` unpickler
cannot read): `load_dcp_metadata` runs CPython's C unpickler with `find_class` restricted to
the allow-list of `dcp_allow_list` (the Python docs' "Restricting Globals"). What else that
unpickler can reach is closed here:

- persistent ids (PERSID, BINPERSID): `persistent_load` refuses them;
- out-of-band buffers (NEXT_BUFFER): the unpickler's buffers refuse to give one;
- extension codes (EXT1/2/4): the unpickler takes them from copyreg's process-wide registry
  and its cache, the cache without asking `find_class`. While the registry or the cache holds
  anything, the pickle's opcodes are scanned first and one naming an extension code is refused;
  with both empty (as Python starts), an extension code is an error of the unpickler.

- memo indices (PUT, LONG_BINPUT): the unpickler grows its memo to twice an index at once, 16
  bytes per index, so a 12-byte file could make it take tens of GB. Every index at or past the
  file's size (more than any pickle of that size can memoize) is refused by a walk of the
  opcodes first (`memo_beyond`).

Everything else the C unpickler does builds data only: its memory is at most a constant times
the file's size (the file is bounded, `records.dcp_metadata_bound`), and it keeps no recursion
(deep nesting costs no stack).
"""

from __future__ import annotations

import copyreg
import gc
import io
import pickle
import pickletools
from typing import TYPE_CHECKING, Any

from trainckpt.errors import CorruptCheckpointError, UnsafeCheckpointError
from trainckpt.format.safe_unpickle.dcp_allow_list import AllowList, NotMetadata, allow_list
from trainckpt.format.safe_unpickle.refusal import Refused, short

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata


class _NoBuffers:
    """The out-of-band buffers of a `.metadata`: none (DCP writes its pickle in one piece)."""

    def __iter__(self) -> _NoBuffers:
        return self

    def __next__(self) -> Any:
        raise Refused("opcode NEXT_BUFFER (its data lies outside the pickle)")


class _Unpickler(pickle.Unpickler):
    """The C unpickler, with globals from `allowed` only and no persistent ids."""

    def __init__(self, data: bytes, allowed: AllowList) -> None:
        super().__init__(io.BytesIO(data), buffers=_NoBuffers())
        self.find_class = allowed.find  # type: ignore[method-assign]

    def persistent_load(self, pid: Any) -> Any:
        raise Refused(f"persistent id {short(pid)} (an object outside the pickle)")


def _refuse_extension_codes(data: bytes) -> None:
    """Refuse EXT1/2/4 while copyreg's registry or cache could answer one (see the module)."""
    if not (copyreg._inverted_registry or copyreg._extension_cache):  # type: ignore[attr-defined]
        return
    for op, _arg, pos in pickletools.genops(data):
        if op.name in ("EXT1", "EXT2", "EXT4"):
            raise Refused(f"opcode {op.name} at byte {pos} (an extension code of copyreg)")


# Argument kinds of `_ARG_KINDS` besides n >= 0 bytes (the same numbers as fast_records.c's
# ARG_*): a line, a length of 1, 4 (signed), 4 or 8 bytes then as many bytes, two lines.
_LINE, _TWO_LINES, _STOP, _UNKNOWN = -1, -6, -7, -8
_LENGTH_BYTES = {-2: 1, -3: 4, -4: 4, -5: 8}
_SIGNED_LENGTH = -3


def _arg_kinds() -> tuple[int, ...]:
    """For each opcode byte, how its argument is laid out (pickletools' table): n >= 0 bytes,
    a line (-1), a length of 1, 4 (signed), 4 or 8 bytes then the data (-2 to -5), two lines
    (GLOBAL, INST), STOP, or not an opcode."""
    kinds = [_UNKNOWN] * 256
    for op in pickletools.opcodes:
        arg = op.arg
        kind = 0 if arg is None else arg.n
        if arg is not None and arg.name == "stringnl_noescape_pair":
            kind = _TWO_LINES
        kinds[ord(op.code.encode("latin-1"))] = _STOP if op.name == "STOP" else kind
    return tuple(kinds)


_ARG_KINDS = _arg_kinds()


def memo_beyond(data: bytes, kinds: tuple[int, ...], limit: int) -> int:
    """The offset of the first PUT or LONG_BINPUT before STOP whose memo index is `limit` or
    more, else -1: the reference of `fast_records.memo_beyond` (the same walk, a few times
    slower). The walk ends where the unpickler would stop reading."""
    at, size = 0, len(data)
    while at < size:
        start, arg, op = at, at + 1, data[at]
        kind = kinds[op]
        if kind in (_STOP, _UNKNOWN):
            return -1
        if kind >= 0:
            at = arg + kind
        elif kind in (_LINE, _TWO_LINES):
            at = data.find(b"\n", arg) + 1
            if at and kind == _TWO_LINES:
                at = data.find(b"\n", at) + 1
            if not at:
                return -1
        else:  # a length, then as many bytes
            width = _LENGTH_BYTES[kind]
            n = int.from_bytes(data[arg : arg + width], "little")
            too_long = (kind == _SIGNED_LENGTH and n >= 1 << 31) or n > size - arg - width
            if arg + width > size or too_long:
                return -1
            at = arg + width + n
        if at > size:
            return -1
        if op == 0x72 and kind == 4:  # LONG_BINPUT
            if int.from_bytes(data[arg : arg + 4], "little") >= limit:
                return start
        elif op == 0x70 and kind == _LINE:  # PUT, its line read as CPython reads it
            try:
                index = int(data[arg:at].split(b"\0", 1)[0])
            except ValueError:
                return -1
            if index >= limit:
                return start
    return -1


def _refuse_far_memo(data: bytes, fast: Any) -> None:
    """Refuse a memo index at or past the file's size (see the module)."""
    walk = memo_beyond if fast is None else fast.memo_beyond
    at = walk(data, _ARG_KINDS, len(data))
    if at >= 0:
        raise Refused(
            f"a memo index at byte {at} past the file's size (the unpickler would take memory "
            "out of all proportion to the file)"
        )


def load_dcp_metadata(data: bytes, where: str) -> Metadata:
    """The `Metadata` DCP pickled into its `.metadata` file `where`: DCP's records (each field
    checked), torch sizes/dtypes/layouts/devices and plain containers. Raises
    `UnsafeCheckpointError` for anything else, `CorruptCheckpointError` for a broken pickle or
    one of something other than a `Metadata`. Called on: whichever ranks read the metadata."""
    collecting = gc.isenabled()
    gc.disable()  # a big metadata is millions of young objects: collections would dominate
    try:
        _refuse_extension_codes(data)
        allowed = allow_list()
        _refuse_far_memo(data, allowed.fast)
        result = _Unpickler(data, allowed).load()
        allowed.check(result, len(data))
        return result
    except NotMetadata as e:
        raise CorruptCheckpointError(
            f"{where} holds a pickled {e} where DCP writes its Metadata; the checkpoint is "
            "damaged or not a DCP checkpoint: restore it from a copy or use an older checkpoint"
        ) from None
    except Refused as e:
        raise UnsafeCheckpointError(
            f"{where}: DCP metadata asks for {e}, which trainckpt does not load (it could run "
            "code); nothing from it was run. The checkpoint was crafted or is not a plain DCP "
            "checkpoint: load an older checkpoint or restore it from a trusted copy"
        ) from e
    except Exception as e:  # a broken pickle: truncated, stack or memo misuse, bad values
        raise CorruptCheckpointError(
            f"{where} cannot be read as DCP metadata ({type(e).__name__}: {short(str(e))}); "
            "the checkpoint is damaged: restore it from a copy or use an older checkpoint"
        ) from e
    finally:
        if collecting:
            gc.enable()

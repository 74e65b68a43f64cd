"""The C steps of the `.metadata` reader (`fast_records.c`) decide exactly as the Python steps
do: the install built them; crafted records, seeded at random over every record class, end
in the same read or the same refusal by both; the plain-data walk agrees with the Python one
on trees, shared and self-nesting containers and budgets to the value, without a C stack of
its depth; the walk of the opcodes for memo indices finds what the Python walk finds; the
record makers make bare records of DCP's classes only and refuse the rest."""

from __future__ import annotations

import pickle
import random
import tracemalloc
from collections import OrderedDict
from pathlib import PurePosixPath
from typing import Any

import pytest
import torch

from trainckpt.errors import CheckpointError
from trainckpt.format.safe_unpickle import dcp_allow_list, load_dcp_metadata
from trainckpt.format.safe_unpickle.dcp_allow_list import _NESTED, _PLAIN, AllowList
from trainckpt.format.safe_unpickle.refusal import Refused

fast = dcp_allow_list.compiled


def test_the_install_built_the_c_steps() -> None:
    """scripts/setup.sh builds them (a C compiler is on every machine CI runs on): without
    them every load would take the Python steps, correct but slower, and this would be a
    warning in the user's log, not an error."""
    assert fast is not None, "fast_records.c was not built: see tests/integrity/conftest.py"
    assert dcp_allow_list.allow_list().fast is fast


@pytest.fixture(scope="module")
def metadata(metadata_bytes: bytes) -> Any:
    return pickle.loads(metadata_bytes)  # ours (conftest): trusted


def _records(md: Any) -> list[Any]:
    """The records of `md` whose fields pickle as a dict (`TensorProperties` pickles a tuple
    of its own, which `test_dcp_opcodes` crafts)."""
    tensors = [v for v in md.state_dict_metadata.values() if hasattr(v, "chunks")]
    return [
        md,
        md.storage_meta,
        *md.state_dict_metadata.values(),
        *(c for t in tensors for c in t.chunks),
        *md.storage_data,
        *md.storage_data.values(),
    ]


VALUES = [None, 0, -1, 2**70, True, 1.5, "x", "../x", "/abs", b"b", [], (), {}, ["a"], [1]]
VALUES += [torch.Size([1, 2]), torch.float32, torch.strided]  # a memory format pickles not
VALUES += [torch.device("cpu"), OrderedDict(a=1), {1, 2}, PurePosixPath("p")]


def _outcome(data: bytes, steps: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """What `load_dcp_metadata` makes of `data` with the C steps (`fast`) or without (None)."""
    monkeypatch.setattr(dcp_allow_list, "compiled", steps)
    try:
        return load_dcp_metadata(data, "md")
    except CheckpointError as e:
        return type(e).__name__, str(e)


def test_crafted_records_end_alike_with_the_c_and_the_python_steps(
    metadata: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded: in each trial one to three records lose a field, gain one or have one set to
    a value of another kind (or of the right kind, out of range). Both steps must read the
    same `Metadata` or refuse with the same message; some trials of each kind happen."""
    assert fast is not None
    rng = random.Random(25)
    seen = {"read": 0, "UnsafeCheckpointError": 0}
    for _ in range(300):
        md = pickle.loads(pickle.dumps(metadata))
        records = _records(md)
        for _ in range(rng.randint(1, 3)):
            fields = vars(rng.choice(records))
            how = rng.choice(["drop", "add", "set", "set"])
            if how == "drop" and fields:
                del fields[rng.choice(sorted(fields, key=str))]
            elif how == "add":
                fields[rng.choice(["extra", "x", 1])] = rng.choice(VALUES)
            elif fields:
                fields[rng.choice(sorted(fields, key=str))] = rng.choice(VALUES)
        data = pickle.dumps(md, protocol=rng.choice([2, 4, 5]))
        by_c, by_python = _outcome(data, fast, monkeypatch), _outcome(data, None, monkeypatch)
        assert by_c == by_python, data
        kind = "read" if not isinstance(by_c, tuple) else by_c[0]
        seen[kind] = seen.get(kind, 0) + 1

    assert seen["read"] >= 10 and seen["UnsafeCheckpointError"] >= 100, seen


def _tree(rng: random.Random, depth: int) -> Any:
    """A random value: mostly plain, sometimes holding a value that is not."""
    if depth == 0 or rng.random() < 0.3:
        return rng.choice([*VALUES[:10], torch.Size([3]), object(), len, type("S", (str,), {})()])
    items = [_tree(rng, depth - 1) for _ in range(rng.randint(0, 4))]
    kind = rng.choice([list, tuple, dict, OrderedDict, set, frozenset])
    if kind in (dict, OrderedDict):
        return kind((str(i), v) for i, v in enumerate(items))
    if kind in (set, frozenset):
        return kind(v for v in items if isinstance(v, (str, int, tuple)) and _hashable(v))
    return kind(items)


def _hashable(v: Any) -> bool:
    try:
        hash(v)
    except TypeError:
        return False
    return True


def _python_plain(value: Any, budget: int) -> bool:
    return dcp_allow_list._plain_data_problem(value, budget) is None


def test_the_plain_data_walk_agrees_with_the_python_one_to_the_value() -> None:
    """Random trees, each at budgets around its own count of values: the C walk answers as
    the Python one at every budget (and both take the tree at its count, not one below)."""
    assert fast is not None
    rng = random.Random(7)
    agreed = {True: 0, False: 0}
    for _ in range(500):
        tree = _tree(rng, 5)
        for budget in (1, 2, 10, 10**6):
            answer = fast.plain(tree, budget, _PLAIN, _NESTED)
            assert answer == _python_plain(tree, budget), (tree, budget)
            agreed[answer] += 1
        if _python_plain(tree, 10**6) and _count(tree) > 1:  # a container: over budget at 1
            count = _count(tree)
            assert fast.plain(tree, count, _PLAIN, _NESTED)
            assert not fast.plain(tree, count - 1, _PLAIN, _NESTED)
            assert not _python_plain(tree, count - 1)
    assert min(agreed.values()) > 100, agreed


def _count(value: Any) -> int:
    """Values as the budget counts them: 1, plus n per container of n, 2n per dict."""
    if isinstance(value, dict):
        return 1 + sum(_count(k) + _count(v) for k, v in value.items())
    if type(value) in (list, tuple, set, frozenset):
        return 1 + sum(map(_count, value))
    return 1


def test_shared_self_nesting_and_deep_containers_stay_within_their_bound() -> None:
    """A list holding itself, a list shared a million times over, a nesting a million deep:
    the walk ends (refusing the first two by their budget), uses no C stack per level and
    allocates at most a pointer per value counted."""
    assert fast is not None
    loop: list[Any] = []
    loop.append(loop)
    assert not fast.plain(loop, 10**6, _PLAIN, _NESTED)
    shared = [[1] * 1000] * 1000  # a million values from two containers
    assert not fast.plain([shared] * 1000, 10**6, _PLAIN, _NESTED)
    deep: list[Any] = []
    for _ in range(10**6):
        deep = [deep]
    wide = list(range(10**6))
    tracemalloc.start()
    try:
        assert fast.plain(deep, 10**6 + 1, _PLAIN, _NESTED)
        assert not fast.plain(deep, 10**6, _PLAIN, _NESTED)
        assert fast.plain(wide, 10**6 + 1, _PLAIN, _NESTED)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= 2 * 8 * 10**6 + (1 << 16), peak  # the stack of the wide list, doubled


def test_containers_of_other_kinds_and_subclasses_are_not_walked() -> None:
    """Only the exact container types given are opened; a subclass of one is a value of
    another kind, as the Python walk has it; a container kind the C cannot open is an
    error, not a guess."""
    assert fast is not None

    class Sub(list):  # type: ignore[type-arg]
        pass

    for odd in (Sub([1]), type("D", (dict,), {})(a=1), [object()], {"a": [len]}):
        assert not fast.plain(odd, 100, _PLAIN, _NESTED) and not _python_plain(odd, 100)
    with pytest.raises(TypeError, match="cannot walk"):
        fast.plain(bytearray(b"x"), 100, _PLAIN, frozenset({bytearray}))


def test_c_makers_make_bare_records_of_dcp_classes_and_refuse_the_rest() -> None:
    """NEWOBJ on a maker (arguments ignored, as `object.__new__` ignores them) makes a bare
    record of DCP's class; calling a maker or setting on it is refused; the base makes
    nothing of its own and binds only its subclasses, once."""
    assert fast is not None
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    allowed = AllowList(fast)
    maker = allowed.find("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata")
    record = maker.__new__(maker, 1, 2, key=3)
    assert type(record) is ChunkStorageMetadata and vars(record) == {}
    with pytest.raises(Refused, match="called"):
        maker()
    with pytest.raises(Refused, match="BUILD of ChunkStorageMetadata"):
        maker.__new__ = object.__new__
    with pytest.raises(TypeError, match="not bound"):
        fast.RecordBase()
    with pytest.raises(TypeError, match="subclass of RecordBase"):
        fast.bind(fast.RecordBase, ChunkStorageMetadata)
    with pytest.raises(TypeError, match="subclass of RecordBase"):
        fast.bind(type("Other", (), {}), ChunkStorageMetadata)
    with pytest.raises(ValueError, match="bound already"):
        fast.bind(maker, ChunkStorageMetadata)


def test_check_records_refuses_ill_formed_field_tables() -> None:
    """Its caller's table, not the pickle's data: a mismatch is a TypeError or ValueError."""
    assert fast is not None
    with pytest.raises(ValueError, match="one name, kinds"):
        fast.check_records([], object, ("a",), (), (False,), (False,))
    with pytest.raises(TypeError, match="a field's name"):
        fast.check_records([], object, ("a",), ({int},), (False,), (False,))  # type: ignore[arg-type]


def test_the_memo_walk_agrees_with_the_python_one(metadata: Any) -> None:
    """Seeded: real `.metadata` pickles of protocols 0, 2 and 4, damaged (bytes flipped,
    inserted, deleted, opcodes that memoize far out spliced in), walked by both at limits
    below, at and past their size: the same first offending opcode, or none, every time."""
    assert fast is not None
    from trainckpt.format.safe_unpickle.dcp_metadata import _ARG_KINDS, memo_beyond

    sources = [pickle.dumps(metadata, protocol=p) for p in (0, 2, 4)]
    for data in sources:  # the real files: nothing far out, and both see the same indices
        assert fast.memo_beyond(data, _ARG_KINDS, len(data)) == -1
        assert fast.memo_beyond(data, _ARG_KINDS, 3) == memo_beyond(data, _ARG_KINDS, 3)
    splices = [b"r", b"p", b"p99999999\n", b"r\xff\xff\xff\x7f", b"\x95", b"c", b"p-1\n"]
    rng = random.Random(26)
    found = 0
    for _ in range(3000):
        damaged = bytearray(rng.choice(sources)[:20_000])  # the walk is per byte: a prefix
        for _ in range(rng.randint(1, 6)):
            i = rng.randrange(len(damaged))
            how = rng.choice(["flip", "insert", "delete", "splice"])
            if how == "flip":
                damaged[i] ^= 1 << rng.randrange(8)
            elif how == "insert":
                damaged.insert(i, rng.randrange(256))
            elif how == "splice":
                damaged[i:i] = rng.choice(splices)
            else:
                del damaged[i]
        data = bytes(damaged)
        limit = rng.choice([len(data), 10, 1000])
        at = fast.memo_beyond(data, _ARG_KINDS, limit)
        assert at == memo_beyond(data, _ARG_KINDS, limit), data
        found += at >= 0
    assert 300 < found < 2700, found  # both kinds of answer, many times

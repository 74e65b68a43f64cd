"""Incremental saves (docs/incremental.md): data unchanged since the previous save costs no
bytes written and none uploaded, and every checkpoint stays a complete DCP folder.

Each rank remembers (`History`, in memory, one per `Checkpointer`) the shard files of its last
committed save: for each item its key (DCP index and tensor kind), the xxh3-128 hash of its
bytes (`content_hash.py`), offset and length. At the next save (`Session.lay_out`), on the
same rank:

1. every tensor item is hashed (every save, in full: the hash decides; see "What is hashed" in
   docs/incremental.md for why no version counter is trusted to skip it);
2. a previous file whose every item is present again with the same key and hash is taken over
   as it is: hard-linked (or copied) into `-tmp`, or copied server-side into the claimed prefix
   (`Storage.copy_file`), then checked by its size and item record (it names the file and the
   save that wrote it, which this save's `.metadata` then also names);
3. the other unchanged items (and, with no record yet, items that look frozen: model entries the
   optimizer holds no state for) fill files of their own, so that the next save can take those
   over whole; changed items fill the rest.

A file that cannot be taken over (the previous checkpoint was deleted meanwhile, or its file is
not the one recorded) is written instead. The taken-over file is an independent name for the
same bytes: deleting either checkpoint never affects the other.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from trainckpt.errors import CheckpointError, CheckpointNotFoundError
from trainckpt.format import shard_checksums
from trainckpt.format.content_hash import (
    LARGE_ITEM,
    StorageDigests,
    StorageKey,
    bytes_digest,
    storage_key,
    tensor_digest,
    tensor_kind,
)
from trainckpt.storage import Storage
from trainckpt.storage.checksums import FileEntry
from trainckpt.testing.faults import fault_point

if TYPE_CHECKING:  # DCP loads with the first save; `History` is built with the Checkpointer
    from torch.distributed.checkpoint.planner import WriteItem

    from trainckpt.format.shard_writer import ItemData, Layout, Shard, WrittenShard

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SavedItem:
    """One item of a shard file as a save wrote it."""

    key: Hashable
    """DCP's index of the item and its tensor kind: equal keys hold bytes of equal layout."""
    digest: bytes | None
    """xxh3-128 of its bytes; None for an item never compared (an odd tensor: a subclass...)."""
    offset: int
    length: int


@dataclass(frozen=True)
class SavedFile:
    """One shard file of a committed save of this rank."""

    name: str
    """Its name in the DCP folder (what its item record names)."""
    rel: str
    """Its path relative to the checkpoint folder."""
    save_id: str
    """The save that wrote its bytes (named by its item record)."""
    entry: FileEntry
    items: tuple[SavedItem, ...]

    def unchanged_in(self, current: Mapping[Hashable, tuple[bytes | None, object]]) -> bool:
        """True when every item of this file is in `current` (key -> hash, item) with the same
        hash."""
        return bool(self.items) and all(
            i.digest is not None and current.get(i.key, _NONE)[0] == i.digest for i in self.items
        )


_NONE: tuple[None, None] = (None, None)


@dataclass(frozen=True)
class _Committed:
    storage: Storage
    dir: str
    files: tuple[SavedFile, ...]


class History:
    """This rank's record of the shard files of its last committed save; kept in memory by a
    `Checkpointer` (a restarted run starts with a full save). Called on: each rank, from the
    thread running its saves."""

    def __init__(self) -> None:
        self._last: _Committed | None = None
        self._pending: list[SavedFile] = []
        self._lock = threading.Lock()
        self.digests = StorageDigests()
        """Shared with the `Stager` of async saves (`content_hash.StorageDigests`)."""

    def previous(self, storage: Storage) -> _Committed | None:
        """The last committed save, if it went to the same kind of storage."""
        last = self._last
        return last if last is not None and type(last.storage) is type(storage) else None

    def begin(self) -> None:
        """A save starts: forget what an unfinished one recorded."""
        with self._lock:
            self._pending = []

    def add(self, files: list[SavedFile]) -> None:
        with self._lock:
            self._pending.extend(files)

    def committed(self, storage: Storage, dir: str) -> None:
        """The save that recorded its files since `begin` is committed as `dir`."""
        with self._lock:
            self._last = _Committed(storage, dir, tuple(self._pending))
            self._pending = []


@dataclass(frozen=True)
class Reuse:
    """Where a save puts the files it takes over unchanged from the previous checkpoint
    (`incremental.py`): a hard link into `-tmp`, or a server-side copy into the claimed prefix,
    instead of writing (and uploading) them."""

    storage: Storage
    into: str
    """The location standing for the checkpoint folder: `-tmp`, or the step's prefix."""
    done: set[str] = field(default_factory=set)
    """Paths (relative to the checkpoint) of the files placed so far: none is uploaded."""


class Session:
    """One rank's incremental save: lays its items out (`lay_out`), takes unchanged files over
    through `reuse`, and records what it wrote in `history` (`record`). `prefix`: the DCP
    folder relative to the checkpoint folder ("" or "model_and_optim/")."""

    def __init__(
        self, history: History, reuse: Reuse, prefix: str, state: dict[str, Any] | None = None
    ) -> None:
        """`state`: the state dict this save writes (live, or the staged copy of an async
        save; it does not change while the save runs): its large tensors start being hashed
        now, on other threads, while DCP plans (`Prehash`)."""
        self.history = history
        self.reuse = reuse
        self.prefix = prefix
        self._keys: dict[int, tuple[Hashable, bytes | None]] = {}  # id(WriteItem) -> key, hash
        self._prehash = Prehash(state, history.digests) if state else None
        history.begin()

    def lay_out(
        self,
        items: list[WriteItem],
        resolve: Callable[[WriteItem], ItemData],
        threads: int,
    ) -> Layout:
        """Hash every item, take over the previous files whose items are all unchanged, and
        group the rest: unchanged (or likely frozen) items, then the others. Called on: each
        rank, in DCP's `write_data`.

        Keys are plain tuples (fqn, offset, kind), hashed in C: DCP's `MetadataIndex` hashes
        in Python, and the lookups of a 3,000-item state were a large part of an incremental
        save's extra time."""
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        from trainckpt.format.shard_writer import Layout, ReusedResult

        storages: dict[int, StorageKey] = {}  # item number -> storage of a prehashed item
        keyed = _keyed_all(items, resolve, threads, self._prehash, storages)
        self._prehash = None
        self._keys = {id(item): k for item, k in zip(items, keyed, strict=True)}
        current = {k[0]: (k[1], item) for item, k in zip(items, keyed, strict=True)}
        previous = self.history.previous(self.reuse.storage)
        known: dict[Hashable, bytes | None] = {}
        candidates: list[SavedFile] = []
        if previous is not None:
            for f in previous.files:
                known.update((i.key, i.digest) for i in f.items)
                if f.rel == self.prefix + f.name and f.unchanged_in(current):
                    candidates.append(f)
        layout = Layout(groups=[])
        placed = self._take_over(previous, candidates, threads) if previous else []
        taken: set[Hashable] = set()
        for f in placed:
            layout.reused_files[f.name] = f.entry
            for i in f.items:
                taken.add(i.key)
                info = _StorageInfo(f.name, i.offset, i.length)
                layout.reused_results.append(
                    ReusedResult(current[i.key][1].index, i.length, info, source_save_id=f.save_id)
                )
        frozen: set[str] | None = None  # needed only for items the previous save did not hold
        stable: list[WriteItem] = []
        changing: list[WriteItem] = []
        unchanged: dict[StorageKey, bytes] = {}
        for n, (item, (key, digest)) in enumerate(zip(items, keyed, strict=True)):
            if key in taken:
                if n in storages and digest is not None:
                    unchanged[storages[n]] = digest
                continue
            if digest is None:
                same = False
            elif key in known:
                same = known[key] == digest
            else:
                if frozen is None:
                    frozen = _likely_frozen([i.index.fqn for i in items])
                same = item.index.fqn in frozen
            (stable if same else changing).append(item)
            if same and n in storages and digest is not None:
                unchanged[storages[n]] = digest
        # for the next async staging: the storages worth hashing there to skip their copy (a
        # trained state has none, and so pays no hash at staging)
        self.history.digests.hashed = unchanged
        layout.groups = [g for g in (stable, changing) if g]
        self.history.add(placed)
        return layout

    def record(
        self, shards: Sequence[Shard], written: Sequence[WrittenShard], save_id: str
    ) -> None:
        """Remember the files this rank wrote in this save. Called on: each rank, after its
        shards are written."""
        files = []
        for shard, done in zip(shards, written, strict=True):
            items = tuple(
                SavedItem(*self._keys[id(item)], offset, length)
                for item, (offset, length) in zip(shard.items, done.spans, strict=True)
            )
            files.append(
                SavedFile(shard.name, self.prefix + shard.name, save_id, done.entry, items)
            )
        self.history.add(files)

    def _take_over(
        self, previous: _Committed, files: list[SavedFile], threads: int
    ) -> list[SavedFile]:
        """Place each of `files` of the `previous` checkpoint into this save; return those
        placed (a file that could not be is written instead)."""
        if not files:
            return []
        first = threading.Event()

        def place(f: SavedFile) -> bool:
            ok = self._place(previous.dir, f)
            if ok and not first.is_set():
                first.set()
                fault_point("reused-file")
            return ok

        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="trainckpt-reuse") as pool:
            placed = [f for f, ok in zip(files, pool.map(place, files), strict=True) if ok]
        log.info(
            "incremental save: took over %d of %d unchanged file(s) (%.1f MB) from '%s'",
            len(placed),
            len(files),
            sum(f.entry.size for f in placed) / 1e6,
            previous.dir,
        )
        return placed

    def _place(self, source_dir: str, f: SavedFile) -> bool:
        """Link or copy file `f` of `source_dir` into this save and check that it is the file
        recorded (size, item record); False, with nothing left behind, if not."""
        storage = self.reuse.storage
        src, dst = storage.join(source_dir, f.rel), storage.join(self.reuse.into, f.rel)
        try:
            storage.copy_file(src, dst)
            _check(storage, dst, f)
        except (CheckpointNotFoundError, FileNotFoundError) as e:  # deleted meanwhile
            log.info("incremental save: writing '%s' anew: %s", dst, e)
            return False
        except (CheckpointError, OSError) as e:
            log.warning(
                "incremental save: writing '%s' anew, it could not be taken over: %s", dst, e
            )
            try:
                storage.delete_files([dst])
            except CheckpointError as cleanup:
                log.warning("could not remove '%s': %s", dst, cleanup)
            return False
        self.reuse.done.add(f.rel)
        return True


def _check(storage: Storage, location: str, f: SavedFile) -> None:
    """Raise unless `location` holds file `f` as recorded: its size, and an item record that
    names it and the save that wrote it (a save id is unique: no other file has that record)."""
    size = storage.size(location)
    if size != f.entry.size:
        raise CheckpointError(f"'{location}' has {size} bytes, not the {f.entry.size} recorded")
    with storage.open_read(location) as stream:
        record = shard_checksums.read(stream, location)
    record.check_identity(location, f.name, frozenset([f.save_id]))


class Prehash:
    """Hashes the large plain CPU tensors of a state dict on background threads from the
    start of a save, so that the frozen base's hashing overlaps the rest of the save instead
    of preceding its writes. Results are found by storage (`StorageKey`): an item that
    resolves to the same storage holds the same bytes, since the state does not change while
    it is saved and the storages are held here until then. A staged buffer whose copy the
    stager skipped (`StorageDigests.vouched`: it holds the bytes hashed by the last save) is
    not hashed again. The hashes of the storages found unchanged (or likely frozen) are then
    published (`StorageDigests.hashed`, by `Session.lay_out`) for the next staging. Hashes
    bytes, trusts no version counter (docs/incremental.md). Called on: the saving thread."""

    def __init__(self, state: dict[str, Any], shared: StorageDigests) -> None:
        tensors: dict[StorageKey, torch.Tensor] = {}
        for t in _plain_tensors(state):
            key = storage_key(t)
            if key[1] >= LARGE_ITEM and tensor_kind(t) is not None:
                tensors.setdefault(key, t)
        vouched = shared.vouched
        self._shared = shared
        self._known = {k: vouched[k] for k in tensors if k in vouched}
        self._tensors = tensors
        self._futures: list[Future[dict[StorageKey, bytes]]] = []
        keys = sorted((k for k in tensors if k not in self._known), key=lambda k: k[0])
        if not keys:
            return
        threads = min(PREHASH_THREADS, len(keys))
        pool = ThreadPoolExecutor(threads, thread_name_prefix="trainckpt-prehash")
        for n in range(threads):  # in address order: memory read in sequence
            self._futures.append(pool.submit(self._hash, keys[n::threads]))
        pool.shutdown(wait=False)

    def _hash(self, keys: list[StorageKey]) -> dict[StorageKey, bytes]:
        return {k: tensor_digest(self._tensors[k]) for k in keys}

    def digests(self) -> dict[StorageKey, bytes]:
        """Every hash, once all are computed."""
        done = dict(self._known)
        for future in self._futures:
            done.update(future.result())
        return done


PREHASH_THREADS = 2
"""Threads hashing a state's large tensors from the start of a save (xxh3 releases the
interpreter lock: two cores hash at twice the speed of one)."""


def _plain_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The plain tensors of a (nested) state dict."""
    if type(obj) is torch.Tensor:  # what `tensor_kind` accepts
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _plain_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _plain_tensors(v)


def _keyed_all(
    items: list[WriteItem],
    resolve: Callable[[WriteItem], ItemData],
    threads: int,
    prehash: Prehash | None = None,
    storages: dict[int, StorageKey] | None = None,
) -> list[tuple[Hashable, bytes | None]]:
    """`_keyed` of every item, in order: small ones on the calling thread, then large tensors
    with their hash from `prehash` (waiting for it; `storages` gets their storage), those it
    did not hash on `threads` threads (xxh3 releases the interpreter lock)."""
    keyed: list[tuple[Hashable, bytes | None] | None] = [None] * len(items)
    large: list[int] = []
    for k, item in enumerate(items):
        if _nbytes(item) >= LARGE_ITEM:
            large.append(k)
        else:
            keyed[k] = _keyed(item, resolve)
    known = prehash.digests() if prehash is not None else {}
    rest: list[int] = []
    for k in large:
        data = resolve(items[k])
        kind = tensor_kind(data) if isinstance(data, torch.Tensor) else None
        if kind is not None:
            assert isinstance(data, torch.Tensor)
            where = storage_key(data)
            digest = known.get(where)
            if digest is not None:
                keyed[k] = (_key(items[k], kind), digest)
                if storages is not None:
                    storages[k] = where
                continue
        rest.append(k)
    if rest:
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="trainckpt-hash") as pool:
            done = pool.map(lambda k: _keyed(items[k], resolve), rest)
            for k, one in zip(rest, done, strict=True):
                keyed[k] = one
    out = [k for k in keyed if k is not None]
    assert len(out) == len(items)
    return out


def _nbytes(item: WriteItem) -> int:
    """The bytes of a tensor item's data, from its plan (0 for a byte item)."""
    data = item.tensor_data
    if data is None:
        return 0
    return data.size.numel() * data.properties.dtype.itemsize


def _key(item: WriteItem, kind: Hashable) -> Hashable:
    """An item's key: DCP's index (fqn and offset: what `MetadataIndex` compares) plus
    its kind, as a tuple hashed in C."""
    index = item.index
    return (index.fqn, index.offset, kind)


def _keyed(
    item: WriteItem, resolve: Callable[[WriteItem], ItemData]
) -> tuple[Hashable, bytes | None]:
    """(key, hash) of one item: DCP's index plus tensor kind ("bytes" for a byte item), and
    the xxh3-128 of its bytes; a tensor `tensor_kind` refuses has no hash (never unchanged)."""
    data = resolve(item)
    if not isinstance(data, torch.Tensor):
        return _key(item, "bytes"), bytes_digest(data)
    kind = tensor_kind(data)
    if kind is None:
        return _key(item, None), None
    return _key(item, kind), tensor_digest(data)


def _likely_frozen(fqns: list[str]) -> set[str]:
    """The model entries (`model.<param>`) the optimizer holds no state or parameter-group
    entry for (`optim.state.<param>.<name>`, `optim.param_groups.<param>.<name>`): likely
    frozen, so they start in files of their own before any hash says so. Empty without an
    optimizer (nothing to tell by)."""
    optimized = {
        fqn.split(".", 2)[2].rsplit(".", 1)[0]
        for fqn in fqns
        if fqn.startswith(("optim.state.", "optim.param_groups.")) and fqn.count(".") >= 3
    }
    if not optimized:
        return set()
    return {
        fqn
        for fqn in fqns
        if fqn.startswith("model.") and fqn.removeprefix("model.") not in optimized
    }

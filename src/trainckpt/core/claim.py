"""Claims on object-store step prefixes: which save of a step may write it (docs/design.md §8).

An object store cannot rename a folder, so two saves of one step would write the same object
names into `<dir>/`. Before any data is written, rank 0 of a save creates `<dir>/.claim`
create-only, naming its attempt; only the holder of the claim writes into `<dir>`.

The claim is a lease. Its holder rewrites it every `lease / RENEWALS` seconds from a background
thread, each rewrite a compare-and-swap on the version it last wrote (GCS generation, S3 ETag).
A newcomer that finds a claim watches it for the lease period the claim itself declares (read,
wait, read again: no clock of another host is compared with ours). A claim that changed or
vanished belongs to a live save: the newcomer fails with `ConcurrentSaveError` having written
nothing. A claim that did not change belongs to a save that crashed, and is taken over with a
compare-and-swap on the version watched, so of two newcomers only one wins.

Before writing its commit record the holder renews once more (`Claim.confirm`): a save whose
claim was taken over (it stalled for longer than its lease) never commits. The commit record is
then sent at once; the design assumes it lands well within one lease period. After the commit
the claim is deleted; one that a crash left in a committed checkpoint is ignored by verify.

Deleting an uncommitted prefix (prune, retention) takes the claim the same way
(`delete_uncommitted`), so a deletion never removes the objects of a live save.

Called on: rank 0 of a save (the other ranks never touch claims), or the one deleting process.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from trainckpt.errors import CheckpointError, ConcurrentSaveError
from trainckpt.format.layout import ABANDONED_FILE, CLAIM_FILE, METADATA_FILE, target_name
from trainckpt.storage import Storage, Versioned

log = logging.getLogger(__name__)

DEFAULT_LEASE = 30.0
"""Seconds a claim stays live without renewal; what a save after a crash waits at most."""
MAX_LEASE = 3600.0
"""Longest lease a claim may declare: a newcomer never watches a claim for longer."""
RENEWALS = 6
"""Renewals per lease period: a live claim changes every `lease / RENEWALS` seconds."""


class Claim:
    """A claim this process holds on the step prefix `dir`, renewed until released."""

    def __init__(
        self, storage: Storage, dir: str, attempt: str, lease: float, purpose: str, version: str
    ) -> None:
        self.storage, self.dir, self.attempt = storage, dir, attempt
        self.lease, self.purpose = lease, purpose
        self.location = storage.join(dir, CLAIM_FILE)
        self._version = version
        self._renewals = 0
        self._lost: CheckpointError | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start_renewing(self) -> None:
        """Renew the claim every `lease / RENEWALS` seconds on a daemon thread."""
        self._thread = threading.Thread(
            target=self._renew_loop, name="trainckpt-claim", daemon=True
        )
        self._thread.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.lease / RENEWALS):
            try:
                self.renew()
            except ConcurrentSaveError:
                return  # lost for good; `confirm` raises it
            except CheckpointError as e:  # transient: the next renewal may get through
                log.warning("could not renew the claim '%s': %s", self.location, e)

    def renew(self) -> None:
        """Rewrite the claim over the version this process wrote last; raise
        `ConcurrentSaveError` (and remember it) when another process changed it."""
        with self._lock:
            if self._lost is not None:
                raise self._lost
            record = _record(self.attempt, self.lease, self.purpose, self._renewals + 1)
            try:
                self._version = self.storage.write_versioned(
                    self.location, record, version=self._version
                )
            except (FileExistsError, FileNotFoundError) as e:
                self._lost = ConcurrentSaveError(
                    f"this {self.purpose} of '{self.dir}' lost its claim '{self.location}': "
                    f"another process took the step over after this one had not renewed the "
                    f"claim for its lease of {self.lease:g}s (a stall or a network outage). "
                    "Nothing was committed by this attempt; save again"
                )
                raise self._lost from e
            self._renewals += 1

    def confirm(self) -> None:
        """Prove the claim is still ours right now (a renewal). Called just before a commit."""
        self.renew()

    def stop(self) -> None:
        """Stop renewing (the claim object stays)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    @property
    def lost(self) -> bool:
        with self._lock:
            return self._lost is not None

    def release(self) -> None:
        """Stop renewing and delete the claim object (best effort: a claim left behind is
        taken over by the next save of the step after its lease)."""
        self.stop()
        if self.lost:
            return
        try:
            self.storage.delete_files([self.location])
        except CheckpointError as e:
            log.warning("could not delete the claim '%s': %s", self.location, e)


def acquire(storage: Storage, dir: str, lease: float, purpose: str = "save") -> Claim:
    """Claim the step prefix `dir` for this process, taking over a stale claim; raise
    `ConcurrentSaveError` when a live save or deletion holds it. Waits at most the lease the
    existing claim declares (a crash leftover), less when its holder is alive."""
    where = storage.join(dir, CLAIM_FILE)
    attempt = uuid.uuid4().hex
    mine = _record(attempt, lease, purpose, 0)
    for _ in range(5):  # claims that vanish as they are looked at: saves finishing
        try:
            version = storage.write_versioned(where, mine, version=None)
            return Claim(storage, dir, attempt, lease, purpose, version)
        except (FileExistsError, FileNotFoundError):  # (not found: there, then gone)
            pass
        try:
            seen = storage.read_versioned(where)
        except FileNotFoundError:
            continue
        theirs = _parse(seen.data)
        log.info(
            "'%s' is claimed by %s attempt %s on %s: watching the claim for up to %.1fs to "
            "tell a live %s from a crashed one",
            dir,
            theirs["purpose"],
            theirs["attempt"],
            theirs["holder"],
            theirs["lease"],
            theirs["purpose"],
        )
        outcome = _watch(storage, where, seen, theirs["lease"])
        if outcome == "gone":
            continue
        if outcome == "changed":
            raise _busy(dir, where, theirs, purpose)
        log.warning(
            "taking over the claim '%s' of %s attempt %s on %s: not renewed for %.1fs, its "
            "process crashed",
            where,
            theirs["purpose"],
            theirs["attempt"],
            theirs["holder"],
            theirs["lease"],
        )
        try:
            version = storage.write_versioned(where, mine, version=seen.version)
        except (FileExistsError, FileNotFoundError):
            raise _busy(dir, where, theirs, purpose) from None  # another newcomer won
        return Claim(storage, dir, attempt, lease, purpose, version)
    raise ConcurrentSaveError(
        f"could not claim '{dir}' for this {purpose}: other saves kept claiming and releasing "
        f"'{where}'; save again, or to another step"
    )


def delete_uncommitted(storage: Storage, dir: str, lease: float = DEFAULT_LEASE) -> bool:
    """Delete the uncommitted step prefix `dir` (or the `<step>-replaced` copy a crashed save
    left) unless a live save owns its step (or it was committed meanwhile); return whether it
    was deleted. The claim is taken on the step itself, which a save of the step holds while
    it copies its old folder aside; `.abandoned.json` (an aside copy's completion marker) goes
    first, the claim last.

    Called on: the one process deleting (prune, retention).
    """
    step = storage.join(storage.parent(dir), target_name(storage.name(dir)))
    try:
        claim = acquire(storage, step, lease, purpose="deletion")
    except ConcurrentSaveError as e:
        log.info("leaving '%s' alone: %s", dir, e)
        return False
    claim.start_renewing()
    try:
        files = storage.list_files(dir)
        if METADATA_FILE in files:
            log.info("leaving '%s' alone: it was committed meanwhile", dir)
            return False
        if ABANDONED_FILE in files:
            storage.delete_files([storage.join(dir, ABANDONED_FILE)])
        storage.delete_files(
            storage.join(dir, rel) for rel in files if rel not in (CLAIM_FILE, ABANDONED_FILE)
        )
        return True
    finally:
        claim.release()


def _watch(storage: Storage, where: str, seen: Versioned, lease: float) -> str:
    """Watch a claim for `lease` seconds: "changed", "gone" or "stale" (unchanged)."""
    poll = min(max(lease / (2 * RENEWALS), 0.05), 5.0)
    deadline = time.monotonic() + lease
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return "stale"
        time.sleep(min(poll, left))
        try:
            now = storage.read_versioned(where)
        except FileNotFoundError:
            return "gone"
        if now.version != seen.version:
            return "changed"


def _busy(dir: str, where: str, theirs: dict[str, Any], purpose: str) -> ConcurrentSaveError:
    return ConcurrentSaveError(
        f"another {theirs['purpose']} of '{dir}' is in progress (attempt {theirs['attempt']} "
        f"on {theirs['holder']} holds '{where}' and renews it): this {purpose} wrote nothing. "
        "Wait for it and look at what it committed, or save to another step"
    )


def _record(attempt: str, lease: float, purpose: str, renewal: int) -> bytes:
    """The claim's bytes; `renewal` makes every write differ (S3 versions are hashes)."""
    holder = f"{socket.gethostname()}:{os.getpid()}"
    return json.dumps(
        {
            "attempt": attempt,
            "purpose": purpose,
            "holder": holder,
            "lease": lease,
            "renewal": renewal,
        }
    ).encode()


def _parse(data: bytes) -> dict[str, Any]:
    """A claim's fields; anything unreadable gets defaults (and the default lease): a
    damaged claim is treated as a crash leftover, never trusted for its numbers."""
    out: dict[str, Any] = {
        "attempt": "?",
        "purpose": "save",
        "holder": "an unknown host",
        "lease": DEFAULT_LEASE,
    }
    try:
        raw = json.loads(data[:4096]) if len(data) <= 4096 else None
    except (UnicodeDecodeError, ValueError, RecursionError):
        raw = None
    if not isinstance(raw, dict):
        return out
    for key in ("attempt", "purpose", "holder"):
        if isinstance(raw.get(key), str):
            out[key] = raw[key][:200]
    lease = raw.get("lease")
    if isinstance(lease, int | float) and not isinstance(lease, bool) and lease == lease:
        out["lease"] = min(max(float(lease), 0.0), MAX_LEASE)
    return out

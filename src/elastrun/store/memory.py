"""An in-process store: the reference implementation of the store model.

Used by a single node, by unit tests (several simulated nodes as threads sharing one
store), and as the state machine behind the tcp server. Lease expiry is evaluated
lazily on every operation and by waiting watchers, against an injected clock.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import threading
from dataclasses import dataclass, field

from elastrun.core.cancel import CancelScope, scope_or_default
from elastrun.core.clock import SYSTEM_CLOCK, Clock, Deadline
from elastrun.core.errors import (
    LeaseExpiredError,
    StoreCompactedError,
    StoreError,
    StoreTimeoutError,
)
from elastrun.store.api import EventKind, WatchEvent, WatchResult, check_lease_ttl

#: How many past changes a watch can resume from.
HISTORY = 65_536


def _folder(key: str) -> str:
    """``key`` up to and with its last "/" ("" when it has none)."""
    return key[: key.rfind("/") + 1]


@dataclass(slots=True, eq=False)
class _Lease:
    ttl: float
    deadline: float
    keys: set[str] = field(default_factory=set)


class MemoryStore:
    """A thread-safe store living in this process (implements ``Store``)."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK, history: int = HISTORY) -> None:
        self._clock = clock
        self._data: dict[str, bytes] = {}
        # The keys by folder (a key up to its last "/"): a prefix read looks at the
        # folders, then at the keys of the ones it can match. Scanning every key made
        # each read of a small folder cost the whole store (a rendezvous of N nodes reads
        # small folders N times: O(N^2)); a sorted key list costs O(N) per new key.
        self._folders: dict[str, dict[str, None]] = {}
        self._key_lease: dict[str, int] = {}
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = itertools.count(1)
        self._revision = 0
        self._events: collections.deque[WatchEvent] = collections.deque(maxlen=history)
        # The history by folder: a watch looks only at the folders under its prefix whose
        # latest change is past its revision, and scans only their changes. Scanning the
        # whole history made thousands of nodes that watch a quiet folder (a round's
        # ``out/``) from before thousands of joins elsewhere each walk every join: O(N^2)
        # for one re-formation.
        self._folder_events: dict[str, collections.deque[WatchEvent]] = {}
        self._history = history
        self._forget_at = 1024  # how many folders may keep a history before pruning
        self._expiries: list[tuple[float, int]] = []  # a heap; see _expire
        self._cond = threading.Condition()

    # -- internals (caller holds the lock) ---------------------------------------------

    def _record(self, kind: EventKind, key: str, value: bytes | None) -> int:
        self._revision += 1
        event = WatchEvent(kind, key, value, self._revision)
        self._events.append(event)
        folder = _folder(key)
        events = self._folder_events.get(folder)
        if events is None:
            events = self._folder_events[folder] = collections.deque(maxlen=self._history)
        events.append(event)
        if len(self._folder_events) > self._forget_at:
            self._forget_changes()
        self._cond.notify_all()
        return self._revision

    def _forget_changes(self) -> None:
        # A folder whose latest change is older than the oldest event kept cannot make
        # a watch scan: a watch from before that change fails as compacted.
        oldest = self._events[0].revision
        kept = {f: e for f, e in self._folder_events.items() if e[-1].revision >= oldest}
        self._folder_events = kept
        self._forget_at = 2 * len(kept) + 1024

    def _put(self, key: str, value: bytes, lease: int | None) -> int:
        self._expire()
        old = self._key_lease.pop(key, None)
        if old is not None and old in self._leases:
            self._leases[old].keys.discard(key)
        if lease is not None:
            held = self._leases.get(lease)
            if held is None:
                raise LeaseExpiredError(f"lease {lease} has expired or was revoked")
            held.keys.add(key)
            self._key_lease[key] = lease
        if key not in self._data:
            self._folders.setdefault(_folder(key), {})[key] = None
        self._data[key] = bytes(value)
        return self._record(EventKind.PUT, key, self._data[key])

    def _remove(self, key: str) -> bool:
        if key not in self._data:
            return False
        del self._data[key]
        folder = _folder(key)
        keys = self._folders[folder]
        del keys[key]
        if not keys:
            del self._folders[folder]
        lease = self._key_lease.pop(key, None)
        if lease is not None and lease in self._leases:
            self._leases[lease].keys.discard(key)
        self._record(EventKind.DELETE, key, None)
        return True

    def _drop_lease(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            for key in sorted(lease.keys):
                self._remove(key)

    def _expire(self) -> None:
        # The heap holds (deadline, lease) for every grant and keep-alive; an entry whose
        # lease was refreshed or dropped since is stale and skipped. Every operation
        # calls this, so it must cost O(log leases), not a scan of thousands of leases.
        now = self._clock.monotonic()
        heap = self._expiries
        while heap and heap[0][0] <= now:
            _, lease_id = heapq.heappop(heap)
            lease = self._leases.get(lease_id)
            if lease is not None and lease.deadline <= now:
                self._drop_lease(lease_id)

    def _next_expiry(self) -> float | None:
        heap = self._expiries
        while heap:
            deadline, lease_id = heap[0]
            lease = self._leases.get(lease_id)
            if lease is not None and lease.deadline == deadline:
                return deadline
            heapq.heappop(heap)  # stale: refreshed or dropped since
        return None

    # -- the store model ---------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        with self._cond:
            self._expire()
            return self._data.get(key)

    def set(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        with self._cond:
            return self._put(key, value, lease)

    def add(self, key: str, amount: int) -> int:
        with self._cond:
            self._expire()
            raw = self._data.get(key, b"0")
            try:
                current = int(raw) + amount
            except ValueError:
                raise StoreError(f"add: value of {key!r} is not an integer: {raw!r}") from None
            self._put(key, str(current).encode(), self._key_lease.get(key))
            return current

    def compare_set(
        self, key: str, expected: bytes | None, value: bytes, *, lease: int | None = None
    ) -> tuple[bool, bytes | None]:
        with self._cond:
            self._expire()
            current = self._data.get(key)
            if current != expected:
                return False, current
            self._put(key, value, lease)
            return True, self._data[key]

    def delete(self, key: str) -> bool:
        with self._cond:
            self._expire()
            return self._remove(key)

    def get_prefix(self, prefix: str) -> tuple[dict[str, bytes], int]:
        with self._cond:
            self._expire()
            data = self._data
            found: dict[str, bytes] = {}
            for folder, keys in self._folders.items():
                if folder.startswith(prefix):  # the whole folder is under the prefix
                    found.update((k, data[k]) for k in keys)
                elif prefix.startswith(folder):  # the prefix ends inside this folder
                    found.update((k, data[k]) for k in keys if k.startswith(prefix))
            return found, self._revision

    def grant_lease(self, ttl: float) -> int:
        check_lease_ttl(ttl)
        with self._cond:
            self._expire()
            lease_id = next(self._lease_ids)
            lease = self._leases[lease_id] = _Lease(ttl, self._clock.monotonic() + ttl)
            heapq.heappush(self._expiries, (lease.deadline, lease_id))
            self._cond.notify_all()  # watchers recompute their next expiry
            return lease_id

    def keep_alive(self, lease: int) -> bool:
        with self._cond:
            self._expire()
            held = self._leases.get(lease)
            if held is None:
                return False
            held.deadline = self._clock.monotonic() + held.ttl
            heapq.heappush(self._expiries, (held.deadline, lease))
            return True

    def revoke_lease(self, lease: int) -> None:
        with self._cond:
            self._drop_lease(lease)

    def watch(
        self,
        prefix: str,
        after_revision: int,
        timeout: float,
        *,
        scope: CancelScope | None = None,
    ) -> WatchResult:
        deadline = Deadline.after(timeout, self._clock)
        live = scope_or_default(scope)
        with self._cond, live.wakes(self._wake_all):
            while True:
                live.raise_if_cancelled()
                self._expire()
                if self._events and after_revision < self._events[0].revision - 1:
                    raise StoreCompactedError(
                        f"changes after revision {after_revision} are no longer kept "
                        f"(oldest kept: {self._events[0].revision})"
                    )
                found = self._since(prefix, after_revision)
                if found:
                    return WatchResult(found, found[-1].revision)
                if deadline.expired():
                    return WatchResult((), self._revision)
                _check_deadline(live, f"watch({prefix!r})")
                self._cond.wait(self._wait_time(deadline, live))

    def _since(self, prefix: str, after_revision: int) -> tuple[WatchEvent, ...]:
        # Only the folders under (or holding) the prefix that changed since the revision,
        # each scanned from its newest event backwards: a full history scan made every
        # change the tcp server fans out cost milliseconds.
        if after_revision >= self._revision:
            return ()
        folders = [
            events
            for folder, events in self._folder_events.items()
            if events[-1].revision > after_revision
            and (folder.startswith(prefix) or prefix.startswith(folder))
        ]
        if not folders:
            return ()
        oldest = self._events[0].revision
        found = []
        for events in folders:
            for event in reversed(events):
                if event.revision <= after_revision or event.revision < oldest:
                    break
                if event.key.startswith(prefix):
                    found.append(event)
        if len(folders) > 1:
            found.sort(key=lambda e: e.revision)
        else:
            found.reverse()
        return tuple(found)

    def _wake_all(self) -> None:
        """Wakes every waiter when a wait's scope is cancelled: the cancelled one raises,
        the others wait on. (The condition's lock is reentrant: registering on a scope
        already cancelled notifies from this very thread.)"""
        with self._cond:
            self._cond.notify_all()

    def _wait_time(self, deadline: Deadline, scope: CancelScope) -> float | None:
        """Until the first of the call's timeout, its scope's deadline and the next
        lease expiry (None: until woken)."""
        waits = [deadline.timeout(), scope.deadline.timeout()]
        expiry = self._next_expiry()
        if expiry is not None:
            waits.append(max(0.0, expiry - self._clock.monotonic()) + 0.001)
        return min((w for w in waits if w is not None), default=None)

    def wait(self, keys: list[str], timeout: float, *, scope: CancelScope | None = None) -> None:
        deadline = Deadline.after(timeout, self._clock)
        live = scope_or_default(scope)
        with self._cond, live.wakes(self._wake_all):
            while True:
                live.raise_if_cancelled()
                self._expire()
                missing = [k for k in keys if k not in self._data]
                if not missing:
                    return
                if deadline.expired():
                    raise StoreTimeoutError(f"timed out after {timeout}s waiting for {missing}")
                _check_deadline(live, f"wait({missing!r})")
                self._cond.wait(self._wait_time(deadline, live))

    @property
    def revision(self) -> int:
        with self._cond:
            return self._revision

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return (
            f"MemoryStore(keys={len(self._data)}, leases={len(self._leases)}, "
            f"revision={self._revision})"
        )


def _check_deadline(scope: CancelScope, what: str) -> None:
    """A wait still unanswered at its scope's deadline ends (see ``store.api``)."""
    if scope.expired():
        raise StoreTimeoutError(f"{what}: the caller's deadline passed first")

"""The store model shared by every implementation (DESIGN.md section 3).

A store holds byte values under string keys. Every change bumps one global revision.

* ``compare_set`` is the primitive rendezvous needs for consistency;
* a **lease** is a liveness token: keys written with ``lease=`` vanish when the lease
  expires (its owner stopped calling ``keep_alive`` for ``ttl`` seconds, or its
  connection to a networked store dropped) or is revoked;
* a **watch** reports every change under a prefix after a revision, with no polling:
  ``watch(prefix, after_revision, timeout)`` blocks until at least one change exists
  (or the timeout passes) and returns the changes in revision order.

Calls run in a cancel scope (``core.cancel``): the one a ``watch`` or ``wait`` is handed,
else the calling thread's current one. Cancelling it ends a call that waits (for the
store's answer, a connection, a change) at once with ``Cancelled``. When its deadline
passes first, the call ends with ``StoreTimeoutError`` -- a ``watch`` too, although its
own ``timeout`` ends it with an empty result: a deadline is the caller's bound on the
whole call, which then has no answer to give. A call whose scope's deadline has already
passed does not wait (a networked client raises before it sends anything). Calls that
never wait (the memory store's reads and writes) complete as usual. (What a deadline
does to the tcp client's connection: ``store.tcp.client``.)

Every implementation passes the same contract suite (``tests/contract``).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from elastrun.core.errors import StoreError

if TYPE_CHECKING:
    from elastrun.core.cancel import CancelScope


class EventKind(enum.Enum):
    PUT = "put"
    DELETE = "delete"


@dataclass(frozen=True)
class WatchEvent:
    """One change: a key written (``PUT``, with its new value) or removed (``DELETE``)."""

    kind: EventKind
    key: str
    value: bytes | None
    revision: int


@dataclass(frozen=True)
class WatchResult:
    """Changes after the requested revision; ``revision`` is where to resume from."""

    events: tuple[WatchEvent, ...]
    revision: int


@runtime_checkable
class Store(Protocol):
    """A key-value store with revisions, leases and watches.

    Blocking methods take a timeout in seconds. Errors are ``StoreError`` (the
    connection failed or the server refused), ``StoreTimeoutError`` (a wait ran out),
    ``LeaseExpiredError`` (writing with a dead lease) and ``StoreCompactedError``
    (a watch asked for history the store no longer has: re-read and resume).
    """

    def get(self, key: str) -> bytes | None:
        """The value of ``key``, or None when it does not exist."""
        ...

    def set(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        """Write ``value`` (bound to ``lease`` when given); returns the new revision."""
        ...

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to an integer counter (absent = 0); returns the new value."""
        ...

    def compare_set(
        self, key: str, expected: bytes | None, value: bytes, *, lease: int | None = None
    ) -> tuple[bool, bytes | None]:
        """Write ``value`` if the current value equals ``expected`` (None: key absent).

        Returns ``(swapped, current_value_after_the_call)``.
        """
        ...

    def delete(self, key: str) -> bool:
        """Remove ``key``; returns whether it existed."""
        ...

    def get_prefix(self, prefix: str) -> tuple[dict[str, bytes], int]:
        """Every key starting with ``prefix`` with its value, and the store revision."""
        ...

    def grant_lease(self, ttl: float) -> int:
        """A new lease that expires ``ttl`` seconds after its last keep-alive
        (``check_lease_ttl``)."""
        ...

    def keep_alive(self, lease: int) -> bool:
        """Refresh ``lease``; False when it has already expired (its keys are gone)."""
        ...

    def revoke_lease(self, lease: int) -> None:
        """End ``lease`` now, deleting its keys. Unknown leases are ignored."""
        ...

    def watch(
        self,
        prefix: str,
        after_revision: int,
        timeout: float,
        *,
        scope: CancelScope | None = None,
    ) -> WatchResult:
        """Changes under ``prefix`` with revision > ``after_revision``.

        Blocks until there is at least one, or ``timeout`` passes (then the result is
        empty and ``revision`` is the current one). Cancelling ``scope`` ends the wait
        at once with ``Cancelled``; its deadline, when it comes first, with
        ``StoreTimeoutError``.
        """
        ...

    def wait(self, keys: list[str], timeout: float, *, scope: CancelScope | None = None) -> None:
        """Block until every key exists; raises ``StoreTimeoutError`` after ``timeout``
        or at ``scope``'s deadline, and ``Cancelled`` when ``scope`` is cancelled."""
        ...

    def close(self) -> None:
        """Release the connection; leases granted through it expire by their TTL."""
        ...


def check_lease_ttl(ttl: float) -> None:
    """Every store's rule for a lease's ttl: a positive, finite number of seconds (a NaN
    or infinite one would hold its keys for good).

    Raises:
        StoreError: any other ttl.
    """
    if not 0 < ttl < math.inf:
        raise StoreError(f"a lease needs a positive, finite ttl, got {ttl}")

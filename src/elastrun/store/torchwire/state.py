"""What a torch TCPStore server holds: keys and values, queues, and blocked waiters.

Pure and single-threaded: the server calls it from its event loop only. A blocked
``wait`` or ``barrier`` is a :class:`Waiter` whose ``wake`` callback runs (once) when
it is released; the state never does I/O itself.

Semantics follow torch 2.13's own (libuv) server, which its client expects:

* ``get`` of a missing key answers an empty value (the client always waits first).
* ``add`` reads the stored value as ``std::stoll`` does (leading white space, a sign,
  decimal digits, anything after ignored), adds with 64-bit wrap-around and stores the
  decimal result. A value that is not a number is the client's error
  (:class:`NotANumberError`; torch closes that client's connection).
* ``compare_set``: on a missing key, an empty ``expected`` creates the key with
  ``desired`` and answers ``desired``; any other ``expected`` changes nothing and
  answers ``expected`` itself. On an existing key, equal ``expected`` replaces the
  value; the answer is the value now stored.
* A key is *there* for ``check`` and ``wait`` when it has a value or a non-empty
  queue of that name. ``num_keys`` and ``list_keys`` count values only.
* ``queue_push`` releases at most one waiter on the queue's name; every write of a
  value releases all of them.
* ``barrier(key, n)`` counts arrivals in the value of ``key``; the arrival that
  reaches ``n`` releases everyone blocked on it. A timed-out arrival still counts.

Where torch's server has an accident we do not copy it, and say so: it also wakes
waiters when ``compare_set`` fails on a missing key (the key still does not exist),
and its wake-one for queues can count one push against several waiters.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from elastrun.core.errors import StoreError

_INT64 = 1 << 64
_INT64_MAX = (1 << 63) - 1
_INT64_MIN = -(1 << 63)
# What std::stoll accepts: C-locale white space, an optional sign, decimal digits;
# the rest of the value is ignored.
_LEADING_INT = re.compile(rb"[ \t\n\v\f\r]*([+-]?[0-9]+)")


class NotANumberError(StoreError):
    """``add`` or ``barrier`` on a key whose value is not a 64-bit decimal integer."""


def parse_counter(value: bytes) -> int:
    """The integer at the start of ``value``, read as ``std::stoll`` reads it.

    Raises ``NotANumberError`` when there is none or it does not fit in 64 bits.
    """
    match = _LEADING_INT.match(value)
    if match is None:
        raise NotANumberError(f"the value {value[:40]!r} is not a number")
    number = int(match.group(1))
    if not _INT64_MIN <= number <= _INT64_MAX:
        raise NotANumberError(f"the value {value[:40]!r} does not fit in 64 bits")
    return number


def read_counter(value: bytes | None) -> int:
    """:func:`parse_counter`, 0 for a missing key, and quick for plain digits.

    A counter's value is nearly always what ``add`` itself stored: digits, which
    ``int`` reads as ``std::stoll`` does, in a fifth of the regular expression's time.
    """
    if value is None:
        return 0
    if value.isdigit():  # ASCII digits only (no sign, space or underscore)
        number = int(value)
        if number <= _INT64_MAX:
            return number
    return parse_counter(value)


def _wrap64(number: int) -> int:
    number %= _INT64
    return number - _INT64 if number > _INT64_MAX else number


@dataclass(slots=True, eq=False)
class Waiter:
    """A blocked ``wait`` (or ``barrier``): released once, by calling ``wake``."""

    missing: set[bytes]
    wake: Callable[[], None]
    barrier: bool

    def __repr__(self) -> str:
        kind = "barrier" if self.barrier else "wait"
        return f"Waiter({kind}, missing={sorted(self.missing)[:3]!r}, n={len(self.missing)})"


class TorchStoreState:
    """The server's table; every method is one request's effect."""

    def __init__(self) -> None:
        self._values: dict[bytes, bytes] = {}
        self._queues: dict[bytes, deque[bytes]] = {}
        # key -> waiters blocked on it, in arrival order (a dict as an ordered set:
        # a timed-out waiter leaves in O(1) even when thousands wait on one key).
        self._waiting: dict[bytes, dict[Waiter, None]] = {}

    def __repr__(self) -> str:
        return (
            f"TorchStoreState(keys={len(self._values)}, queues={len(self._queues)}, "
            f"waited_keys={len(self._waiting)})"
        )

    @property
    def num_keys(self) -> int:
        """How many keys hold a value (``get_num_keys``); queues are not counted."""
        return len(self._values)

    def list_keys(self) -> list[bytes]:
        return list(self._values)

    def get(self, key: bytes) -> bytes:
        return self._values.get(key, b"")

    def multi_get(self, keys: Iterable[bytes]) -> list[bytes]:
        return [self._values.get(k, b"") for k in keys]

    def set(self, key: bytes, value: bytes) -> None:
        self._values[key] = value
        self._release(key)

    def multi_set(self, keys: Sequence[bytes], values: Sequence[bytes]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def append(self, key: bytes, value: bytes) -> None:
        self._values[key] = self._values.get(key, b"") + value
        self._release(key)

    def add(self, key: bytes, amount: int) -> int:
        """Add ``amount`` to the counter in ``key`` (0 when missing); returns the sum.

        Raises ``NotANumberError`` when the stored value is not a number.
        """
        total = amount + read_counter(self._values.get(key))
        if not _INT64_MIN <= total <= _INT64_MAX:
            total = _wrap64(total)
        self._values[key] = b"%d" % total
        self._release(key)
        return total

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        current = self._values.get(key)
        if current is None:
            if expected:
                return expected
            current = self._values[key] = desired
        elif current == expected:
            current = self._values[key] = desired
        # Written even when unchanged, like torch: it releases the key's barrier.
        self._release(key)
        return current

    def delete(self, key: bytes) -> bool:
        """Remove ``key``'s value; waiters are not affected (as in torch)."""
        return self._values.pop(key, None) is not None

    def check(self, keys: Iterable[bytes]) -> bool:
        return all(map(self._there, keys))

    def wait(self, keys: Iterable[bytes], wake: Callable[[], None]) -> Waiter | None:
        """Block until every key is there; None when they already are.

        ``wake`` is called once, when the last missing key arrives -- unless the
        returned waiter is first passed to :meth:`cancel`.
        """
        missing = {k for k in keys if not self._there(k)}
        return self._block(Waiter(missing, wake, barrier=False)) if missing else None

    def barrier(self, key: bytes, world_size: int, wake: Callable[[], None]) -> Waiter | None:
        """Arrive at the barrier ``key`` of ``world_size``; None when this arrival
        completes it (releasing all others), else a waiter released when it completes.

        Raises ``NotANumberError`` when ``key`` holds something else than a count.
        """
        count = _wrap64(read_counter(self._values.get(key)) + 1)
        self._values[key] = b"%d" % count
        if count >= world_size:
            self._release(key)
            return None
        # The key exists now: plain waiters on it are done (torch leaves them blocked
        # until the barrier completes, which is not what "wait for a key" means).
        self._release(key, barriers=False)
        return self._block(Waiter({key}, wake, barrier=True))

    def cancel(self, waiter: Waiter) -> None:
        """Forget a waiter (its client gave up, or left); ``wake`` will not be called."""
        for key in waiter.missing:
            self._unindex(key, waiter)
        waiter.missing.clear()

    def queue_push(self, key: bytes, value: bytes) -> None:
        self._queues.setdefault(key, deque()).append(value)
        self._release_one(key)

    def queue_pop(self, key: bytes) -> tuple[int, bytes | None]:
        """The queue's length before popping, and its first item (None when empty)."""
        queue = self._queues.get(key)
        if not queue:
            return 0, None
        length = len(queue)
        value = queue.popleft()
        if not queue:
            del self._queues[key]  # empty queues hold no memory
        return length, value

    def queue_len(self, key: bytes) -> int:
        return len(self._queues.get(key, ()))

    # -- waiting -------------------------------------------------------------------------

    def _there(self, key: bytes) -> bool:
        return key in self._values or bool(self._queues.get(key))

    def _block(self, waiter: Waiter) -> Waiter:
        for key in waiter.missing:
            self._waiting.setdefault(key, {})[waiter] = None
        return waiter

    def _unindex(self, key: bytes, waiter: Waiter) -> None:
        waiters = self._waiting.get(key)
        if waiters is not None:
            waiters.pop(waiter, None)
            if not waiters:
                del self._waiting[key]

    def _release(self, key: bytes, *, barriers: bool = True) -> None:
        waiters = self._waiting.get(key)
        if not waiters:
            return
        released = [w for w in waiters if barriers or not w.barrier]
        for waiter in released:
            self._satisfy(key, waiter)

    def _release_one(self, key: bytes) -> None:
        # One pushed item is for one consumer: it counts for waiters in arrival order
        # until one of them has nothing left to wait for.
        for waiter in list(self._waiting.get(key, ())):
            if waiter.barrier:
                continue
            if self._satisfy(key, waiter):
                return

    def _satisfy(self, key: bytes, waiter: Waiter) -> bool:
        """``key`` is there for ``waiter``; True when that released it."""
        self._unindex(key, waiter)
        waiter.missing.discard(key)
        if waiter.missing:
            return False
        waiter.wake()
        return True

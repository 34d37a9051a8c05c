"""How the tcp store numbers revisions and leases on the wire.

Revisions and lease ids go on the wire offset by ``base`` (the server's start time in
microseconds), so they keep growing across server restarts. A client that outlived a
restart then holds numbers from before ``base``: its watch gets StoreCompactedError
(re-read, resume) instead of silently waiting for a revision the new store will not
reach for a while, and its old lease id can never name a lease the new store granted to
someone else.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

from elastrun.core.errors import LeaseExpiredError, StoreCompactedError
from elastrun.store.api import WatchEvent
from elastrun.store.tcp import protocol as p

#: A lease id the store never grants (its ids start at 1).
NO_LEASE = -1


@dataclasses.dataclass(frozen=True)
class Numbering:
    """Translates revisions and lease ids between the store and the wire."""

    base: int

    def rev_out(self, revision: int) -> int:
        """A store revision as the client sees it."""
        return revision + self.base

    def rev_in(self, revision: int) -> int:
        """A client's revision as the store's.

        Raises:
            StoreCompactedError: it is from before this server started.
        """
        if revision <= 0:
            return revision  # "from the very beginning"
        if revision < self.base:
            raise StoreCompactedError(
                f"revision {revision} is from before this store started (at revision "
                f"{self.base}); re-read and resume"
            )
        return revision - self.base

    def lease_out(self, lease: int) -> int:
        """A store lease id as the client knows it."""
        return lease + self.base

    def lease_in(self, lease: int) -> int:
        """A client's lease id as the store's (``NO_LEASE`` when it cannot be ours)."""
        return lease - self.base if lease > self.base else NO_LEASE

    def opt_lease_in(self, m: p.Message) -> int | None:
        """The request's optional ``lease`` field, as the store's lease id."""
        lease = p.get_opt_int(m, "lease")
        return None if lease is None else self.lease_in(lease)

    def event_out(self, event: WatchEvent) -> WatchEvent:
        """A change as the client sees it."""
        return dataclasses.replace(event, revision=self.rev_out(event.revision))

    @staticmethod
    @contextlib.contextmanager
    def lease_errors(m: p.Message) -> Iterator[None]:
        """Report a dead lease by the id the client knows it by."""
        try:
            yield
        except LeaseExpiredError:
            raise LeaseExpiredError(f"lease {m.get('lease')} has expired or was revoked") from None

"""Who watches a running round for whom: its closer and deputy follow ``ctl/``, every
other member is quiet and follows one key (``liveness`` runs both watches).

* The round's **closer** (the member that decided it, named in its result) and its
  **deputy** (rank 0, or rank 1 when rank 0 is the closer) follow ``ctl/`` from the
  revision the round was decided at (``running.RoundWatch`` says why to re-form). When
  a re-formation is due each also tries to decide the next round at once, for everyone
  (``closing.decide_ahead``; the first to claim it does, rank 0 when it lives:
  ``AHEAD_DEFER``), before its own agent has stopped its workers.
* Every other member is **quiet**: it watches only the closer's claim and the call left
  under it (``RunKeys.next_call``). The call wakes it once the next round is decided
  (it enters reading nothing: ``closing.Called``) or, after a failure, when the next
  round waits for every member's join. After the loss of one of N nodes the store sends
  N-1 wake-ups, instead of each survivor joining, racing for the claim and watching on.
* The claim's end (the closer's lease ended) wakes the quiet members too. They then
  wait up to ``DEPUTY_GRACE`` for the deputy's call (it saw the same loss), and re-form
  by joining, as every member did before, when none comes (the deputy is gone too). A
  closer that finished the round (its exit barrier) is no loss: the job is ending. They
  watch for that call again each after a random part of ``call_spread`` (the call waits
  in the store's history meanwhile): N-1 watches at once, while the deputy reads and
  writes its decision, had held it back about 1.9 s at 10,000 nodes.
* When the result names no closer (a round closed by a node auditing it, or by a
  closer that is not a member), every member follows ``ctl/`` itself.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from elastrun.core.cancel import CancelScope
from elastrun.core.errors import StoreCompactedError
from elastrun.rendezvous.keys import RunKeys
from elastrun.rendezvous.ops import load_doc
from elastrun.store.api import EventKind, Store, WatchEvent

#: How long the watcher that is not rank 0 leaves the decision to rank 0 (the other),
#: when rank 0 lives: rank 0's decision carries its address.
AHEAD_DEFER = 1.0

#: How long a quiet member waits for the deputy's call once the closer's claim ended
#: (the deputy decides the next round in about a second at 10,000 nodes), before it
#: re-forms by joining.
DEPUTY_GRACE = 5.0


def call_spread(size: int) -> float:
    """Over how many seconds the ``size`` members of a round whose closer's claim ended
    spread their watches for the deputy's call: a second per 10,000 (the store serves
    some 10,000 such requests a second), at most 2."""
    return min(2.0, size / 10_000)


def deputy_pause(watchers: Watchers, size: int) -> float | None:
    """How long a quiet member whose closer's claim ended without a call waits before it
    watches for the deputy's call (None: the round has no deputy to wait for)."""
    return None if watchers.deputy is None else random.uniform(0.0, call_spread(size))


@dataclass(frozen=True)
class Watchers:
    """Who watches a running round for the others, as its result names them: the
    ``closer`` and its ``deputy`` (None: no closer among the members, and every member
    watches), and rank 0's node (``head``)."""

    closer: str | None = None
    deputy: str | None = None
    head: str | None = None

    @classmethod
    def of(cls, result: Mapping[str, object]) -> Watchers:
        def node(key: str) -> str | None:
            value = result.get(key)
            return value if isinstance(value, str) else None

        return cls(node("closer"), node("deputy"), node("head"))

    def watches(self, node: str) -> bool:
        """Whether ``node`` watches the round for the others (and decides ahead)."""
        return node in (self.closer, self.deputy)

    def quiet(self, node: str) -> bool:
        """Whether ``node`` watches only the closer's claim."""
        return self.closer is not None and not self.watches(node)

    def defer(self, node: str, lost: Collection[str]) -> float:
        """How long watcher ``node`` leaves the next round's decision to rank 0 (alive,
        and not ``node`` itself)."""
        head = self.head
        return AHEAD_DEFER if head is not None and head != node and head not in lost else 0.0


#: A round whose result names no closer: every member watches it.
EVERYONE = Watchers()


def closer_news(keys: RunKeys, n: int, events: Sequence[WatchEvent]) -> tuple[bytes | None, bool]:
    """What a quiet member's watch of round ``n``'s closer's claim brought: the call
    under it (None: none yet), and whether the claim ended."""
    call = next((e.value for e in events if e.key == keys.next_call(n) and e.value), None)
    ended = any(e.key == keys.closer(n) and e.kind is EventKind.DELETE for e in events)
    return call, ended


def closer_state(keys: RunKeys, n: int, found: Mapping[str, bytes]) -> tuple[bytes | None, bool]:
    """``closer_news`` from a read of the claim's prefix (after the store compacted)."""
    return found.get(keys.next_call(n)), keys.closer(n) not in found


def follow_closer(
    store: Store,
    keys: RunKeys,
    n: int,
    watchers: Watchers,
    rev: int,
    *,
    scope: CancelScope,
    span: float,
    size: int,
) -> tuple[int, str | None, bytes | None]:
    """One watch of round ``n``'s closer's claim and the call under it (``span``
    seconds), as a quiet member of its ``size``. Returns the revision to watch on from,
    why the round re-forms (None: nothing yet) and the call, if any."""
    closer = watchers.closer
    assert closer is not None
    gone = waited = False
    while True:
        try:
            res = store.watch(keys.closer(n), rev, span, scope=scope)
        except StoreCompactedError:
            found, rev = store.get_prefix(keys.closer(n))
            call, ended = closer_state(keys, n, found)
        else:
            rev = res.revision
            call, ended = closer_news(keys, n, res.events)
        gone = gone or ended
        if call is not None:
            why = load_doc(call).get("why")  # the reason the call gives
            return rev, str(why) if why else f"round {n + 1} was decided", call
        if not gone:
            return rev, None, None
        if not waited and (pause := deputy_pause(watchers, size)) is not None:
            scope.sleep(pause)
            span, waited = DEPUTY_GRACE, True  # wait a while for the deputy's call
            continue
        if store.get(keys.done(n) + closer) is not None:
            return rev, None, None  # (a closer that finished: the job is ending)
        return rev, f"lost 1 node(s): {closer}", None

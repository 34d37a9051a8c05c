"""The dynamic rendezvous' ``ExclusionBoard``: one node's exclusions, in the run's store.

The decisions are ``exclusion``'s pure functions; this reads and writes their records.
A failure this node claims counts a strike (``strike``, within ``outcome``'s call: a
failure that excludes its node takes no restart); a failed node check excludes it at
once (``exclude``). Each call that reads the store runs as one of ``calls.AgentCalls``.
"""

from __future__ import annotations

from elastrun.core.clock import Clock
from elastrun.core.errors import StoreTimeoutError
from elastrun.rendezvous import condition
from elastrun.rendezvous.calls import AgentCalls
from elastrun.rendezvous.exclusion import (
    Exclusion,
    ExclusionRule,
    ExclusionVerdict,
    Strikes,
    check_failed,
    exclusion_verdict,
    load_exclusion,
    load_record,
    strikes_within,
)
from elastrun.rendezvous.keys import RunKeys
from elastrun.rendezvous.liveness import Liveness
from elastrun.store.api import Store


class Exclusions:
    """This node's exclusions with a cool-down, and the job's record of them.

    Args:
        store: the run's store.
        keys: the run's keys.
        liveness: the round this node is in, its lease and the live nodes.
        calls: the agent's calls in progress (each public call runs as one).
        node_id: this node.
        addr: this node's address (named in its exclusion).
        clock: the strikes' and the cool-downs' times (wall-clock: read on other hosts).
        min_nodes: the job's --nnodes minimum (no exclusion leaves fewer nodes).
    """

    def __init__(
        self,
        store: Store,
        keys: RunKeys,
        liveness: Liveness,
        calls: AgentCalls,
        *,
        node_id: str,
        addr: str,
        clock: Clock,
        min_nodes: int = 1,
    ) -> None:
        self._store = store
        self._keys = keys
        self._live = liveness
        self._calls = calls
        self._node_id = node_id
        self._addr = addr
        self._clock = clock
        self._min_nodes = min_nodes
        #: When this node is kept out of rounds; off by default.
        self.rule = ExclusionRule()
        #: Why this node should have been excluded but stayed (the minimum), once.
        self.kept_at_min: str | None = None

    def set_rule(self, rule: ExclusionRule) -> None:
        """When a failing node is kept out of the rounds (the agent tells it once)."""
        self.rule = rule

    def take_kept_at_min(self) -> str | None:
        """Why this node was to be excluded but stayed (the minimum), once."""
        note, self.kept_at_min = self.kept_at_min, None
        return note

    def strike(self) -> bool:
        """Count this node's failure (it claimed the round's, within ``outcome``'s call);
        exclude it at the limit. Returns whether it is excluded now."""
        rule, now = self.rule, self._clock.time()
        key = self._keys.strikes(self._node_id)
        record = load_record(self._store.get(key))
        times = strikes_within((*record.at, now), now, rule.window)
        record = Strikes(times, record.repeats, record.back)
        self._store.set(key, record.dump())
        count = len(times)
        if record.on_probation(now, rule.window):
            count = max(count, rule.after)  # back lately from an exclusion: out again
        if count < rule.after:
            return False  # (no store reads for the others on the way)
        others = self._others()
        verdict = exclusion_verdict(count, rule, others=others, min_nodes=self._min_nodes)
        why = f"its workers failed {len(times)} times within {rule.window:.0f}s"
        return self._apply(verdict, why, others, record) is not None

    def exclude(self, reason: str) -> Exclusion | None:
        """Keep this node out of the rounds for the rule's cool-down (longer for a repeat
        offender), for ``reason`` (a failed node check), unless the other nodes alone
        would be fewer than the minimum (then ``kept_at_min`` says so). Returns the
        exclusion that holds."""
        with self._calls.call():
            others = self._others()
            verdict = check_failed(others=others, min_nodes=self._min_nodes)
            record = load_record(self._store.get(self._keys.strikes(self._node_id)))
            return self._apply(verdict, reason, others, record)

    def _others(self) -> int:
        """The live nodes other than this one that are not excluded themselves."""
        found, _ = self._store.get_prefix(self._keys.excluded_prefix)
        excluded = {k[len(self._keys.excluded_prefix) :] for k in found}
        return len(self._live.live_nodes() - excluded - {self._node_id})

    def _apply(
        self, verdict: ExclusionVerdict, reason: str, others: int, record: Strikes
    ) -> Exclusion | None:
        me = self._node_id
        if verdict is ExclusionVerdict.KEPT_AT_MIN:
            self.kept_at_min = (
                f"{reason}, but it stays: without it {others} node(s) would remain "
                f"(--nnodes minimum {self._min_nodes})"
            )
            return None
        if verdict is ExclusionVerdict.STAYS:
            return None
        key = self._keys.excluded(me)
        current = self._store.get(key)
        if current is not None and (held := load_exclusion(me, current)) is not None:
            return held  # an exclusion that holds keeps its cool-down
        now = self._clock.time()
        after, repeats = record.excluded(now, self.rule.window)
        cooldown = self.rule.cooldown_after(repeats)
        if repeats:
            reason = f"{reason}; excluded {repeats + 1} times in a row, {cooldown:.0f}s this time"
        exclusion = Exclusion(me, now + cooldown, reason, self._addr)
        # Compare-and-set: an exclusion that holds keeps its cool-down.
        lease = self._live.now.lease
        won, current = self._store.compare_set(key, None, exclusion.dump(), lease=lease)
        if not won:
            return load_exclusion(me, current)
        self._store.set(self._keys.strikes(me), after.dump())
        return exclusion

    def exclusion(self) -> Exclusion | None:
        """This node's exclusion while it holds (it must not join until then)."""
        with self._calls.call():
            return load_exclusion(
                self._node_id, self._store.get(self._keys.excluded(self._node_id))
            )

    def readmit(self) -> None:
        """This node's cool-down is over: it may join rounds again, as a newcomer (its
        rank went to the node that replaced it; asking for it back with its last round's
        rank, it would be ordered ahead of spares that waited longer)."""
        with self._calls.call():
            key = self._keys.strikes(self._node_id)
            record = load_record(self._store.get(key))
            self._store.set(key, Strikes(record.at, record.repeats, self._clock.time()).dump())
            self._store.delete(self._keys.excluded(self._node_id))
            self._live.move(condition.forgotten)

    def excluded_nodes(self) -> list[Exclusion]:
        """The job's excluded nodes, by node id."""
        with self._calls.call():
            found, _ = self._store.get_prefix(self._keys.excluded_prefix)
            cut = len(self._keys.excluded_prefix)
            records = (load_exclusion(k[cut:], v) for k, v in sorted(found.items()))
            return [r for r in records if r is not None]

    def wait_closed(self, timeout: float) -> bool:
        """Whether the run closed within ``timeout`` s (ends an excluded node's wait)."""
        with self._calls.call():
            try:
                self._store.wait([self._keys.closed], timeout)
            except StoreTimeoutError:
                return False
            return True

    def __repr__(self) -> str:
        return (
            f"Exclusions(node={self._node_id!r}, rule={self.rule!r}, "
            f"kept_at_min={self.kept_at_min!r})"
        )

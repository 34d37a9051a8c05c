"""The dynamic rendezvous' ``ExclusionBoard``: one node's exclusions, in the run's store.

The decisions are ``exclusion``'s pure functions; this reads and writes their records.
A failure this node claims counts a strike (``strike``, within ``outcome``'s call: a
failure that excludes its node takes no restart); a failed node check excludes it at
once (``exclude``). Each call that reads the store runs as one of ``calls.AgentCalls``.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field

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


@dataclass(eq=False)
class Exclusions:
    """This node's exclusions with a cool-down, and the job's record of them.

    Args:
        store: the run's store.
        keys: the run's keys.
        live: the round this node is in, its lease and the live nodes.
        calls: the agent's calls in progress (each public call runs as one).
        node_id: this node.
        addr: this node's address (named in its exclusion).
        clock: the strikes' and the cool-downs' times (wall-clock: read on other hosts).
        min_nodes: the job's --nnodes minimum (no exclusion leaves fewer nodes).
    """

    store: Store
    keys: RunKeys
    live: Liveness
    calls: AgentCalls
    _: KW_ONLY
    node_id: str
    addr: str
    clock: Clock
    min_nodes: int = 1
    #: When this node is kept out of rounds; off by default.
    rule: ExclusionRule = field(default_factory=ExclusionRule, init=False)
    #: Why this node should have been excluded but stayed (the minimum), once.
    kept_at_min: str | None = field(default=None, init=False)

    def set_rule(self, rule: ExclusionRule) -> None:
        self.rule = rule

    def take_kept_at_min(self) -> str | None:
        note, self.kept_at_min = self.kept_at_min, None
        return note

    def strike(self) -> bool:
        """Count this node's failure (it claimed the round's, within ``outcome``'s call);
        exclude it at the limit. Returns whether it is excluded now."""
        rule, now = self.rule, self.clock.time()
        key = self.keys.strikes(self.node_id)
        record = load_record(self.store.get(key))
        times = strikes_within((*record.at, now), now, rule.window)
        record = Strikes(times, record.repeats, record.back)
        self.store.set(key, record.dump())
        count = len(times)
        if record.on_probation(now, rule.window):
            count = max(count, rule.after)  # back lately from an exclusion: out again
        if count < rule.after:
            return False  # (no store reads for the others on the way)
        others = self._others()
        verdict = exclusion_verdict(count, rule, others=others, min_nodes=self.min_nodes)
        why = f"its workers failed {len(times)} times within {rule.window:.0f}s"
        return self._apply(verdict, why, others, record) is not None

    def exclude(self, reason: str) -> Exclusion | None:
        """Keep this node out of the rounds for the rule's cool-down (longer for a repeat
        offender), for ``reason`` (a failed node check), unless the other nodes alone
        would be fewer than the minimum (then ``kept_at_min`` says so). Returns the
        exclusion that holds."""
        with self.calls.call():
            others = self._others()
            verdict = check_failed(others=others, min_nodes=self.min_nodes)
            record = load_record(self.store.get(self.keys.strikes(self.node_id)))
            return self._apply(verdict, reason, others, record)

    def _others(self) -> int:
        """The live nodes other than this one that are not excluded themselves."""
        found, _ = self.store.get_prefix(self.keys.excluded_prefix)
        excluded = {k[len(self.keys.excluded_prefix) :] for k in found}
        return len(self.live.live_nodes() - excluded - {self.node_id})

    def _apply(
        self, verdict: ExclusionVerdict, reason: str, others: int, record: Strikes
    ) -> Exclusion | None:
        me = self.node_id
        if verdict is ExclusionVerdict.KEPT_AT_MIN:
            self.kept_at_min = (
                f"{reason}, but it stays: without it {others} node(s) would remain "
                f"(--nnodes minimum {self.min_nodes})"
            )
            return None
        if verdict is ExclusionVerdict.STAYS:
            return None
        key = self.keys.excluded(me)
        current = self.store.get(key)
        if current is not None and (held := load_exclusion(me, current)) is not None:
            return held  # an exclusion that holds keeps its cool-down
        now = self.clock.time()
        after, repeats = record.excluded(now, self.rule.window)
        cooldown = self.rule.cooldown_after(repeats)
        if repeats:
            reason = f"{reason}; excluded {repeats + 1} times in a row, {cooldown:.0f}s this time"
        exclusion = Exclusion(me, now + cooldown, reason, self.addr)
        # Compare-and-set: an exclusion that holds keeps its cool-down.
        lease = self.live.now.lease
        won, current = self.store.compare_set(key, None, exclusion.dump(), lease=lease)
        if not won:
            return load_exclusion(me, current)
        self.store.set(self.keys.strikes(me), after.dump())
        return exclusion

    def exclusion(self) -> Exclusion | None:
        with self.calls.call():
            return load_exclusion(self.node_id, self.store.get(self.keys.excluded(self.node_id)))

    def readmit(self) -> None:
        """This node's cool-down is over: it may join rounds again, as a newcomer (its
        rank went to the node that replaced it; asking for it back with its last round's
        rank, it would be ordered ahead of spares that waited longer)."""
        with self.calls.call():
            key = self.keys.strikes(self.node_id)
            record = load_record(self.store.get(key))
            self.store.set(key, Strikes(record.at, record.repeats, self.clock.time()).dump())
            self.store.delete(self.keys.excluded(self.node_id))
            self.live.move(condition.forgotten)

    def excluded_nodes(self) -> list[Exclusion]:
        with self.calls.call():
            found, _ = self.store.get_prefix(self.keys.excluded_prefix)
            cut = len(self.keys.excluded_prefix)
            records = (load_exclusion(k[cut:], v) for k, v in sorted(found.items()))
            return [r for r in records if r is not None]

    def wait_closed(self, timeout: float) -> bool:
        with self.calls.call():
            try:
                self.store.wait([self.keys.closed], timeout)
            except StoreTimeoutError:
                return False
            return True

    def __repr__(self) -> str:
        return (
            f"Exclusions(node={self.node_id!r}, rule={self.rule!r}, "
            f"kept_at_min={self.kept_at_min!r})"
        )

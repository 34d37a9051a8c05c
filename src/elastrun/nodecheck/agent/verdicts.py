"""The node check's verdicts and its pairing of nodes, sans I/O.

The problem: a node with a slow accelerator or a bad link joins a round and slows every
collective of the job, or fails it. A short check before the node joins finds most of
them: a fixed matrix product on each local accelerator (compute), and a timed exchange
with a partner node (link). Compute is judged alone; a link is a pair's, so a slow pair
says only that one of its two nodes is bad.

How the bad node of a slow pair is found (DLRover's pre-flight check does the same): its
two nodes are suspects, and each is paired again with a node that passed (a fast pair
clears both of its nodes). A suspect that is slow with a node that passed is bad; one
that is fast with it passes. With one bad node among N that takes two rounds whatever
N; when suspects outnumber the nodes that passed, the rest are paired among themselves
with partners they have not tried, and the suspects left roughly halve each round, so
the check ends in O(log N) rounds (``Isolation.max_rounds`` bounds it: a suspect still
unresolved then is bad).

What "slow" means: slower than ``slowdown`` times the median of the peers' times (the
lower median: with four nodes in two pairs, one slow pair must not be its own
reference), and also more than ``SLACK`` seconds above it. Why the slack: a check that
takes milliseconds varies by several times under process scheduling alone (a loaded
machine, a CPU-only CI runner); a quarter of a second is far above that noise and far
below what a failing device or link costs a training step.

Every node of a check computes the same pairs from the same results (the pairing is a
deterministic function of them), so no node leads: ``nodecheck.agent.board`` publishes the
results through the rendezvous store and feeds them to this module on every node.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from elastrun.core.errors import ConfigError

__all__ = [
    "SLACK",
    "Isolation",
    "NodeCheckRule",
    "Pair",
    "compute_verdicts",
    "low_median",
]

#: Seconds above the peers' median that a time must also exceed to be slow (see above).
SLACK = 0.25


@dataclass(frozen=True)
class NodeCheckRule:
    """Whether nodes are checked before they join, and how.

    Attributes:
        enabled: check before the first round and before a rejoin after a failure of
            this node's workers (off by default, as torchrun).
        timeout: seconds the whole check of one node may take (a node that overruns it
            failed its check).
        script: a user's check run after the built-in one (exit status 0: healthy).
        slowdown: a node slower than this many times its peers' median fails.

    Raises:
        ConfigError: a field out of range, named.
    """

    enabled: bool = False
    timeout: float = 120.0
    script: str | None = None
    slowdown: float = 3.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.timeout) and self.timeout > 0):
            raise ConfigError("--node-check-timeout", self.timeout, "must be seconds > 0")
        if not (math.isfinite(self.slowdown) and self.slowdown > 1):
            raise ConfigError("--node-check-slowdown", self.slowdown, "must be a number > 1")
        if self.script is not None and not self.script:
            raise ConfigError("--node-check-script", self.script, "must name a file")


def low_median(values: Iterable[float]) -> float | None:
    """The median, the lower middle value for an even count (None: no values)."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2] if ordered else None


def _limit(base: float, slowdown: float, slack: float) -> float:
    return max(base * slowdown, base + slack)


def compute_verdicts(
    times: Mapping[str, float | None], *, slowdown: float, slack: float = SLACK
) -> dict[str, str]:
    """The nodes whose compute part failed (None) or was slow, each with why."""
    base = low_median(t for t in times.values() if t is not None)
    bad: dict[str, str] = {}
    for node, t in sorted(times.items()):
        if t is None:
            bad[node] = "its compute check failed"
        elif base is not None and t > _limit(base, slowdown, slack):
            bad[node] = (
                f"its compute check took {t:.2f}s, over {slowdown:g} x the median of "
                f"its peers ({base:.3f}s)"
            )
    return bad


@dataclass(frozen=True, order=True)
class Pair:
    """Two nodes whose link is tested together: ``serve`` listens, ``connect`` dials."""

    serve: str
    connect: str

    @classmethod
    def of(cls, a: str, b: str) -> Pair:
        return cls(min(a, b), max(a, b))

    def partner(self, node: str) -> str:
        return self.connect if node == self.serve else self.serve

    @property
    def nodes(self) -> tuple[str, str]:
        return (self.serve, self.connect)


class Isolation:
    """One check's pairing, round after round: feed each round's results, read the
    next round's pairs, until ``done``; then ``bad`` names the nodes that failed.

    Args:
        nodes: the nodes checking together (every node passes the same set).
        slowdown: see ``NodeCheckRule``.
        slack: see ``SLACK``.
        max_rounds: the most link rounds (default: 2 + log2 of the node count).
    """

    def __init__(
        self,
        nodes: Iterable[str],
        *,
        slowdown: float,
        slack: float = SLACK,
        max_rounds: int | None = None,
    ) -> None:
        self.nodes = tuple(sorted(set(nodes)))
        self._slowdown = slowdown
        self._slack = slack
        count = max(2, len(self.nodes))
        self.max_rounds = max_rounds if max_rounds is not None else 2 + math.ceil(math.log2(count))
        #: Nodes that failed, with why.
        self.bad: dict[str, str] = {}
        #: Nodes that passed (a fast pair, and no failed compute part).
        self.good: set[str] = set()
        self._tried: dict[str, set[str]] = {n: set() for n in self.nodes}
        self._slow_with: dict[str, set[str]] = {n: set() for n in self.nodes}
        self._times: list[float] = []  # every fast-or-slow pair time seen (the reference)
        #: The link round under way (0 first).
        self.round = 0
        n = self.nodes
        self.pairs = [Pair.of(n[i], n[i + 1]) for i in range(0, len(n) - 1, 2)]
        self.done = False
        if not self.pairs:
            self._finish()

    def feed_compute(self, compute: Mapping[str, float | None]) -> None:
        """Every node's compute time (None, or absent: its compute part failed), once,
        before the first round's links are fed (a node checking alone has no links)."""
        times = {n: compute.get(n) for n in self.nodes}
        found = compute_verdicts(times, slowdown=self._slowdown, slack=self._slack)
        for node, why in found.items():
            self.bad.setdefault(node, why)
            self.good.discard(node)

    def feed(self, link: Mapping[str, float | None]) -> None:
        """The results of the current round: each node's measured link time (None, or
        absent: its link failed). Sets the next ``pairs``, or ``done``."""
        if self.done:
            return
        measured = [(pair, self._pair_time(pair, link)) for pair in self.pairs]
        self._times.extend(t for _, t in measured if t is not None)
        base = low_median(self._times)
        limit = None if base is None else _limit(base, self._slowdown, self._slack)
        passed_before = set(self.good)
        for pair, t in measured:
            slow = t is None or (limit is not None and t > limit)
            for node in pair.nodes:
                partner = pair.partner(node)
                self._tried[node].add(partner)
                if node in self.bad or node in passed_before:
                    continue  # decided (a node that passed helps a suspect; it is not retried)
                if not slow:
                    self.good.add(node)
                elif partner not in self.bad:  # a failed partner says nothing: it is paired again
                    self._slow_with[node].add(partner)
                    if partner in passed_before:
                        shown = "failed" if t is None else f"took {t:.2f}s (limit {limit:.2f}s)"
                        self.bad[node] = f"its link check with {partner}, which passed, {shown}"
        self.round += 1
        self.pairs = self._next_pairs() if self.round < self.max_rounds else []
        if not self.pairs:
            self._finish()

    @staticmethod
    def _pair_time(pair: Pair, link: Mapping[str, float | None]) -> float | None:
        a, b = link.get(pair.serve), link.get(pair.connect)
        return None if a is None or b is None else max(a, b)

    def _next_pairs(self) -> list[Pair]:
        pending = [n for n in self.nodes if n not in self.good and n not in self.bad]
        helpers = sorted(self.good)
        # Rotate the helpers so that the same few nodes do not serve every round.
        if helpers:
            k = self.round % len(helpers)
            helpers = helpers[k:] + helpers[:k]
        pairs: list[Pair] = []
        unmatched: list[str] = []
        for node in pending:
            fallback = helpers[0] if helpers else None
            helper = next((h for h in helpers if h not in self._tried[node]), fallback)
            if helper is None:
                unmatched.append(node)
                continue
            helpers.remove(helper)
            pairs.append(Pair.of(node, helper))
        while unmatched:
            node = unmatched.pop(0)
            other = next((m for m in unmatched if m not in self._tried[node]), None)
            if other is not None:
                unmatched.remove(other)
                pairs.append(Pair.of(node, other))
        return pairs

    def _finish(self) -> None:
        self.done = True
        self.pairs = []
        for node in self.nodes:
            if node in self.good or node in self.bad:
                continue
            partners = sorted(self._slow_with[node])
            if partners:
                self.bad[node] = (
                    f"its link check was slow with every partner it was given "
                    f"({', '.join(partners)})"
                )
            else:
                self.good.add(node)  # alone: nothing to pair it with (compute only)

    def verdict(self, node: str) -> str | None:
        """Why ``node`` failed, or None when it passed (or the check is not done)."""
        return self.bad.get(node)

    def __repr__(self) -> str:
        return (
            f"Isolation(nodes={len(self.nodes)}, round={self.round}, pairs={len(self.pairs)}, "
            f"good={len(self.good)}, bad={sorted(self.bad)}, done={self.done})"
        )

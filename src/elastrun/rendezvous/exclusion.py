"""Keeping a node that keeps failing out of the job's rounds for a cool-down, sans I/O.

The problem: at scale most failures are bad hardware, and the costly ones repeat. A node
whose GPU or link is failing rejoins every round and fails it again, and every node pays
for each of its failures with a restart. When a spare waits at the maximum, the job is
better off without that node for a while.

Who decides, and when: only the node that claims a round's failure (``ctl/failed/<n>``,
a compare-and-set that one node per round wins) counts a strike, and only against
itself: the first failure seen is the root cause as far as the job knows (the others'
collectives broke because of it). Rounds follow one another, so the decisions are taken
one at a time for the whole job -- two nodes can never both decide that they may leave
when only one can go -- without a lock of their own. A failed node check (``reason``
other than strikes) feeds the same decision.

Why the clock is the wall clock: the records are read on other machines, whose monotonic
clocks share no origin. A cool-down lasts minutes; clock skew between NTP-synchronised
hosts is milliseconds.

Repeat offenders: a node that fails again within ``window`` seconds of its readmission
is excluded again at that failure, for twice as long as the last time
(``ExclusionRule.cooldown_after``), so a node that always fails costs the job a number
of readmissions that grows with the logarithm of the job's length, not with its length.
A failure that excludes its node is not charged to the job's restart budget
(``outcome``): the job goes on without that node, as after the loss of a node.

The records (``strikes/<node>``, ``Strikes``; ``ctl/excluded/<node>``, ``Exclusion``,
bound to the excluded node's lease, which every node of a round sees from its watch of
``ctl/``) are versioned JSON; the rendezvous (``excluding``) reads and writes the store.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from elastrun.core.errors import ConfigError
from elastrun.rendezvous.ops import load_doc

__all__ = [
    "MAX_GROWTH",
    "Exclusion",
    "ExclusionRule",
    "ExclusionVerdict",
    "Strikes",
    "check_failed",
    "exclusion_verdict",
    "load_exclusion",
    "load_record",
    "strikes_within",
]

#: The version of the records this module writes.
VERSION = 1
#: The longest cool-down of a repeat offender, in multiples of the rule's (the sixth
#: exclusion in a row and later ones: 32 x 300 s, 2 h 40 min with the defaults).
MAX_GROWTH = 32


@dataclass(frozen=True)
class ExclusionRule:
    """When a node is excluded and for how long.

    Attributes:
        after: failures of a node's workers within ``window`` that exclude it (0: never).
        window: seconds a failure counts for.
        cooldown: seconds an excluded node stays out of the rounds.
        exits: an excluded node's agent exits (status 75, replace this node) instead of
            waiting out the cool-down, for schedulers that replace nodes.

    Raises:
        ConfigError: a field out of range, named.
    """

    after: int = 0
    window: float = 600.0
    cooldown: float = 300.0
    exits: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.after, bool) or not isinstance(self.after, int) or self.after < 0:
            raise ConfigError("--exclude-after", self.after, "must be a whole number >= 0")
        for name, value in (
            ("--exclude-window", self.window),
            ("--exclude-cooldown", self.cooldown),
        ):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(name, value, "must be a finite number of seconds > 0")

    @property
    def enabled(self) -> bool:
        return self.after > 0

    def cooldown_after(self, repeats: int) -> float:
        """The cool-down of an exclusion that follows ``repeats`` exclusions in a row
        (each readmission ended by a failure within ``window``): doubled each time, at
        most ``MAX_GROWTH`` times the rule's."""
        return self.cooldown * float(min(2 ** min(repeats, 30), MAX_GROWTH))


class ExclusionVerdict(Enum):
    """What becomes of a node that failed (or whose check failed)."""

    STAYS = "stays"  # not enough strikes
    EXCLUDED = "excluded"
    KEPT_AT_MIN = "kept_at_min"  # it should go, but the job would fall below --nnodes min


def strikes_within(times: Iterable[float], now: float, window: float) -> tuple[float, ...]:
    """The strikes that still count at ``now`` (those of the last ``window`` seconds),
    oldest first; ``times`` may include ``now`` itself for the failure just seen."""
    return tuple(sorted(t for t in times if now - window < t <= now))


def exclusion_verdict(
    strikes: int, rule: ExclusionRule, *, others: int, min_nodes: int
) -> ExclusionVerdict:
    """Whether a node with ``strikes`` failures in the window leaves the rounds.

    ``others``: the live nodes of the job other than this one that are not excluded
    themselves (members and spares alike). The node goes only when they alone still make
    ``min_nodes``: a job that can run with a bad node is better than one that stops (the
    cool-down then starts at the next strike, once a spare has come).
    """
    if not rule.enabled or strikes < rule.after:
        return ExclusionVerdict.STAYS
    return ExclusionVerdict.KEPT_AT_MIN if others < min_nodes else ExclusionVerdict.EXCLUDED


def check_failed(*, others: int, min_nodes: int) -> ExclusionVerdict:
    """Whether a node whose check failed leaves the rounds (the same floor as strikes)."""
    return ExclusionVerdict.EXCLUDED if others >= min_nodes else ExclusionVerdict.KEPT_AT_MIN


# -- records ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Exclusion:
    """One node's exclusion: until when (wall-clock seconds), why, and from where."""

    node: str
    until: float
    reason: str
    addr: str = ""

    def remaining(self, now: float) -> float:
        return max(0.0, self.until - now)

    def dump(self) -> bytes:
        doc = {"v": VERSION, "until": self.until, "reason": self.reason, "addr": self.addr}
        return json.dumps(doc, sort_keys=True).encode()


def load_exclusion(node: str, raw: bytes | None) -> Exclusion | None:
    """The exclusion record of ``node`` (None: absent or unreadable)."""
    doc = versioned_doc(raw)
    until = doc.get("until") if doc is not None else None
    if doc is None or not isinstance(until, (int, float)):
        return None
    return Exclusion(node, float(until), str(doc.get("reason", "")), str(doc.get("addr", "")))


@dataclass(frozen=True)
class Strikes:
    """A node's record of failures (``strikes/<node>``).

    Attributes:
        at: the times of its failures that still count, oldest first.
        repeats: how many times in a row it was excluded: each readmission was ended by
            another exclusion within the window (0: never, or not lately).
        back: when it was last readmitted (wall-clock seconds; 0: never).
    """

    at: tuple[float, ...] = ()
    repeats: int = 0
    back: float = 0.0

    def on_probation(self, now: float, window: float) -> bool:
        """Whether the node came back from an exclusion less than ``window`` ago: one
        failure then excludes it again, however few strikes still count (a grown
        cool-down outlasts the window, and with it the strikes that led to it)."""
        return self.repeats > 0 and now - self.back < window

    def excluded(self, now: float, window: float) -> tuple[Strikes, int]:
        """The record after an exclusion at ``now``, and the exclusions in a row before
        it (what its cool-down grows with)."""
        repeats = self.repeats if self.on_probation(now, window) else 0
        return Strikes(self.at, repeats + 1, self.back), repeats

    def dump(self) -> bytes:
        doc = {"v": VERSION, "at": list(self.at), "repeats": self.repeats, "back": self.back}
        return json.dumps(doc).encode()


def load_record(raw: bytes | None) -> Strikes:
    """A ``strikes/<node>`` record (an empty one when absent or unreadable)."""
    doc = versioned_doc(raw)
    if doc is None:
        return Strikes()
    at, repeats, back = doc.get("at"), doc.get("repeats"), doc.get("back")
    times = tuple(
        float(t)
        for t in (at if isinstance(at, list) else ())
        if isinstance(t, (int, float)) and not isinstance(t, bool)
    )
    return Strikes(
        times,
        repeats if isinstance(repeats, int) and not isinstance(repeats, bool) else 0,
        float(back) if isinstance(back, (int, float)) and not isinstance(back, bool) else 0.0,
    )


def versioned_doc(raw: bytes | None, version: int = VERSION) -> dict[str, object] | None:
    """A JSON object the rendezvous keeps in its store, when it is one of ``version``
    (its ``"v"``); None for a missing key, another version or anything unreadable."""
    doc = load_doc(raw)
    return doc if doc.get("v") == version else None

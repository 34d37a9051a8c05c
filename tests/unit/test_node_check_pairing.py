"""The node check's pure logic: compute verdicts, and the pairing that isolates a bad
node by re-pairing slow pairs with nodes that passed."""

from __future__ import annotations

import math

import pytest

from elastrun.core.errors import ConfigError
from elastrun.nodecheck.agent.verdicts import (
    Isolation,
    NodeCheckRule,
    Pair,
    compute_verdicts,
    low_median,
)

FAST = 0.01
SLOW = 2.0


def nodes(n: int) -> list[str]:
    return [f"n{i:04d}" for i in range(n)]


def run(iso: Isolation, bad: set[str], dead: frozenset[str] = frozenset()) -> int:
    """Feed ``iso`` link times where a pair with a ``bad`` node is slow and a ``dead``
    node reports nothing; the rounds it took."""
    while not iso.done:
        link: dict[str, float | None] = {}
        for pair in iso.pairs:
            t = SLOW if set(pair.nodes) & bad else FAST
            for node in pair.nodes:
                if node not in dead:
                    link[node] = t
        iso.feed(link)
    return iso.round


def test_the_median_is_the_lower_middle_value() -> None:
    assert low_median([]) is None
    assert low_median([3.0, 1.0, 2.0]) == 2.0
    assert low_median([4.0, 1.0, 3.0, 2.0]) == 2.0


def test_a_failed_or_slow_compute_part_fails_and_the_slack_spares_noise() -> None:
    found = compute_verdicts({"a": 0.01, "b": 0.02, "c": None, "d": 1.5}, slowdown=3.0)
    assert sorted(found) == ["c", "d"]
    assert "failed" in found["c"] and "1.50s" in found["d"]
    # Ten times the median, but within the slack: process scheduling, not a bad node.
    assert compute_verdicts({"a": 0.001, "b": 0.001, "c": 0.01}, slowdown=3.0) == {}


def test_the_first_round_pairs_neighbours_and_leaves_the_odd_node_for_later() -> None:
    iso = Isolation(nodes(5), slowdown=3.0)
    assert iso.pairs == [Pair("n0000", "n0001"), Pair("n0002", "n0003")]
    run(iso, bad=set())
    assert iso.good == set(nodes(5)) and iso.bad == {}
    assert iso.round == 2  # the odd node was paired with one that passed


def test_one_slow_node_is_isolated_by_pairing_both_suspects_with_nodes_that_passed() -> None:
    iso = Isolation(nodes(8), slowdown=3.0)
    run(iso, bad={"n0005"})
    assert list(iso.bad) == ["n0005"]
    assert "n0004" in iso.good  # its first partner is cleared
    assert "which passed" in iso.bad["n0005"]
    assert iso.round == 2


def test_a_node_whose_link_fails_is_isolated_the_same_way() -> None:
    iso = Isolation(nodes(6), slowdown=3.0)
    run(iso, bad=set(), dead=frozenset({"n0002"}))
    assert list(iso.bad) == ["n0002"] and "failed" in iso.bad["n0002"]


@pytest.mark.parametrize("count", [16, 1000])
def test_one_bad_node_among_many_is_named_in_two_rounds(count: int) -> None:
    iso = Isolation(nodes(count), slowdown=3.0)
    rounds = run(iso, bad={"n0007"})
    assert list(iso.bad) == ["n0007"] and len(iso.good) == count - 1
    assert rounds == 2


def test_many_bad_nodes_are_isolated_within_the_logarithmic_bound() -> None:
    count = 64
    # Every fifth node: 13 slow pairs of 32, still fewer than half (the median is the
    # reference: when most pairs are slow, slow is the norm and no node stands out).
    bad = set(nodes(count)[::5])
    iso = Isolation(nodes(count), slowdown=3.0)
    rounds = run(iso, bad=bad)
    assert set(iso.bad) == bad
    assert rounds <= 2 + math.ceil(math.log2(count))


def test_a_compute_verdict_keeps_a_node_from_helping_and_a_lone_node_is_judged_on_compute() -> None:
    iso = Isolation(nodes(4), slowdown=3.0)
    iso.feed_compute({"n0000": FAST, "n0001": FAST, "n0002": None, "n0003": FAST})
    run(iso, bad=set())
    assert list(iso.bad) == ["n0002"]
    alone = Isolation(["x"], slowdown=3.0)
    assert alone.done and alone.pairs == []
    alone.feed_compute({"x": None})
    assert alone.verdict("x") == "its compute check failed"


def test_two_nodes_whose_link_fails_cannot_be_told_apart() -> None:
    iso = Isolation(nodes(2), slowdown=3.0)
    run(iso, bad=set(), dead=frozenset({"n0000"}))
    assert sorted(iso.bad) == nodes(2)


def test_the_rule_names_a_bad_value() -> None:
    assert not NodeCheckRule().enabled
    with pytest.raises(ConfigError, match="--node-check-slowdown"):
        NodeCheckRule(slowdown=1.0)
    with pytest.raises(ConfigError, match="--node-check-timeout"):
        NodeCheckRule(timeout=0.0)

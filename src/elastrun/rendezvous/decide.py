"""Rendezvous decisions as pure functions of (state, now): when a round closes, who is in
it and with which group rank. The handler (``dynamic.py``) gathers the state from the
store and applies the decision; these functions never touch the store or the clock.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Joiner:
    """A node that asked to join a round."""

    node_id: str
    revision: int  # store revision of its join: the join order
    prev_rank: int | None = None  # its group rank in the previous round, if any


class Verdict(enum.Enum):
    WAIT = "wait"  # not enough nodes yet, or last call still running
    CLOSE = "close"  # close the round now with the chosen members
    TIMEOUT = "timeout"  # the join deadline passed below the minimum


@dataclass(frozen=True)
class RoundDecision:
    verdict: Verdict
    members: tuple[str, ...] = ()  # node ids in group-rank order (CLOSE only)
    wake_at: float | None = None  # when to decide again if nothing changes (WAIT)


def order_members(joiners: Sequence[Joiner], max_nodes: int) -> tuple[str, ...]:
    """Pick at most ``max_nodes`` joiners and order them by group rank.

    Nodes of the previous round come first (they hold state and warm caches), then by
    join order. A node keeps its previous group rank when that rank is still below the
    world size and no one else claims it; the others fill the free ranks in join order.
    Deterministic: every agent computes the same answer from the same joiners.
    """
    ranked = sorted(
        joiners,
        key=lambda j: (j.prev_rank is None, j.prev_rank or 0, j.revision, j.node_id),
    )
    chosen = ranked[:max_nodes]
    world = len(chosen)
    slots: list[str | None] = [None] * world
    rest: list[Joiner] = []
    for j in chosen:
        if j.prev_rank is not None and j.prev_rank < world and slots[j.prev_rank] is None:
            slots[j.prev_rank] = j.node_id
        else:
            rest.append(j)
    rest.sort(key=lambda j: (j.revision, j.node_id))
    it = iter(rest)
    return tuple(s if s is not None else next(it).node_id for s in slots)


def decide_round(
    joiners: Sequence[Joiner],
    previous_live: set[str],
    *,
    min_nodes: int,
    max_nodes: int,
    now: float,
    call_started_at: float | None,
    last_call: float,
    join_deadline: float,
    first_round: bool,
) -> RoundDecision:
    """Whether a forming round should close now.

    ``previous_live`` are the members of the previous round that are still alive.

    * The job's first round closes at once with ``max_nodes`` joiners, or with at least
      ``min_nodes`` when the last call (started when the minimum was reached) ends;
      below the minimum it times out at the join deadline.
    * A later round is a re-formation. Until a previous member joins it, its joiners are
      spares waiting for room: it stays open, with no deadline. Once re-formation has
      begun it closes as soon as every live previous member has joined (a restart after
      a failure or the loss of a node waits for no one), or at ``max_nodes``, or with at
      least the minimum when the last call ends; below the minimum it times out.
    """
    joined = {j.node_id for j in joiners}
    count = len(joiners)
    pending = previous_live - joined
    if not first_round and pending and not previous_live & joined:
        return RoundDecision(Verdict.WAIT)
    if count >= max_nodes:
        return RoundDecision(Verdict.CLOSE, order_members(joiners, max_nodes))
    if count >= min_nodes:
        call_ends = (call_started_at if call_started_at is not None else now) + last_call
        if (not first_round and not pending) or now >= call_ends:
            return RoundDecision(Verdict.CLOSE, order_members(joiners, max_nodes))
        return RoundDecision(Verdict.WAIT, wake_at=call_ends)
    if now >= join_deadline:
        return RoundDecision(Verdict.TIMEOUT)
    return RoundDecision(Verdict.WAIT, wake_at=join_deadline)


def needs_reformation(
    members: Sequence[str],
    live_nodes: set[str],
    next_joiners: Mapping[str, int],
    *,
    max_nodes: int,
    round_failed: bool,
) -> bool:
    """Whether the members of a running round must stop and re-form.

    Yes when a member is gone (its lease vanished), when the round was marked failed (a
    worker died somewhere), when a member already asks for the next round, or when a
    newcomer waits and there is room for it. A waiting node at full size is a spare and
    disturbs no one.
    """
    member_set = set(members)
    if round_failed or not member_set <= live_nodes:
        return True
    if any(node in member_set for node in next_joiners):
        return True
    waiting = [n for n in next_joiners if n not in member_set and n in live_nodes]
    return bool(waiting) and len(members) < max_nodes

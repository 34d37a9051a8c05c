"""How a round of the dynamic rendezvous ends, the same for every member.

A worker failure takes one restart from the job-wide budget (``budget``), once per round
however many nodes see it: the first node to claim ``ctl/failed/<n>`` decides, and writes
its verdict there for the others. Members whose workers finished wait in the exit
barrier (``ctl/done/<n>/<node>``) for the round's outcome. When the budget is spent or
the job is done, the run is closed (``ctl/closed``, with why) and late agents are refused.
The node that claims a failure also counts a strike against itself, and may exclude
itself for a cool-down (``excluding``; ``exclusion``: the rule, and why the claim makes
it job-wide). A failure that excludes its node takes nothing from the budget: the others
go on without it, as after the loss of a node.

``Outcome`` is the dynamic rendezvous' ``elastic.JobOutcome``: the agent's calls (the
budget and the barrier) each run in a scope of their own (``calls.AgentCalls``), which a
signal or ``leave`` ends.
"""

from __future__ import annotations

import logging
from dataclasses import KW_ONLY, dataclass, field

from elastrun.core.cancel import Cancelled, CancelScope, current
from elastrun.core.clock import Clock, Deadline
from elastrun.core.errors import StoreCompactedError, StoreError
from elastrun.rendezvous import condition
from elastrun.rendezvous.api import BarrierResult, RoundOutcome
from elastrun.rendezvous.calls import AgentCalls
from elastrun.rendezvous.decide import Away
from elastrun.rendezvous.excluding import Exclusions
from elastrun.rendezvous.keys import RunKeys
from elastrun.rendezvous.liveness import Liveness
from elastrun.rendezvous.ops import dump, load
from elastrun.rendezvous.running import RoundWatch
from elastrun.store.api import Store

log = logging.getLogger("elastrun.rendezvous")

#: How long giving notice of stepping away (``step_away``) may take.
STEP_AWAY_BOUND = 2.0


@dataclass(eq=False)
class Outcome:
    """One node's part in ending its rounds: the restart budget, the exit barrier and
    the closing of the run.

    Args:
        store: the run's store.
        keys: the run's keys.
        live: the round this node is in and who its members are.
        calls: the agent's calls in progress (each public call runs as one).
        exclusions: this node's exclusions (a failure it claims counts a strike).
        node_id: this node.
        addr: this node's address (named in a failure's note).
        clock: for the exit barrier's deadline.
    """

    store: Store
    keys: RunKeys
    live: Liveness
    calls: AgentCalls
    exclusions: Exclusions
    _: KW_ONLY
    node_id: str
    addr: str
    clock: Clock
    #: Why ``report_failure`` refused a restart other than an exhausted budget.
    refusal: str | None = field(default=None, init=False)
    # This node left a round whose other members were still working (its exit
    # barrier timed out): leaving must not close the run under them.
    left_unfinished: bool = field(default=False, init=False)

    def close(self, reason: str) -> None:
        """Close the run with ``reason`` (the first reason stays)."""
        self.store.compare_set(self.keys.closed, None, reason.encode())

    def close_within(self, reason: str, life: CancelScope, timeout: float) -> bool:
        """Close the run, bounded by ``timeout`` (a deadline the store honours) and ended
        by cancelling ``life`` or the calling thread's current scope (a stop request);
        whether the store confirmed it."""
        outer = current()
        with (
            life.child(timeout) as scope,
            outer.wakes(lambda: scope.cancel(outer.reason or "cancelled")),
            scope.active(),
        ):
            try:
                self.close(reason)
            except (StoreError, Cancelled) as exc:
                log.debug("could not close the rendezvous: %s", exc)
                return False
        return True

    def step_away(self, why: str) -> None:
        """This node does not re-join the round after its current one at once, for ``why``:
        the closer of that round must not presume it (``decide.Away``). Never raises.

        In a scope of its own (a signal, the usual reason, has cancelled the caller's),
        bounded by ``STEP_AWAY_BOUND``, a deadline the store honours: the notice only
        spares the others a re-formation, and a store that does not answer must not hold
        the stop of this node's workers.
        """
        now = self.live.now
        n, lease = now.n, now.lease
        if n is None or lease is None or now.gone is not None:
            return
        self.live.move(condition.stepped_away)  # (as a watcher, it decides nothing ahead)
        with CancelScope(deadline=Deadline.after(STEP_AWAY_BOUND)) as scope, scope.active():
            try:
                self.store.set(self.keys.away(self.node_id), Away(n, why).dump(), lease=lease)
            except StoreError as exc:
                log.debug("could not give notice of stepping away: %s", exc)

    def restarts_used(self) -> int:
        with self.calls.call():
            raw = self.store.get(self.keys.budget)
            return int(raw) if raw else 0

    # -- a failure against the budget ------------------------------------------------------

    def report_failure(self, max_restarts: int, what: str = "") -> bool:
        """A local worker failed in the current round: take one restart from the job's
        budget, once per round however many nodes see the failure. Returns False (and
        closes the run) when the budget is exhausted.

        ``what`` says which worker failed and how; every node of the round learns it
        (``ctl/failed/<n>``), also nodes whose workers already finished.
        """
        with self.calls.call():
            live, now = self.live, self.live.now
            assert now.n is not None
            self.refusal = None
            if now.lost:
                self.refusal = "this node was dropped from the run (" + now.change_reason + ")"
                return False
            if not set(live.member_ids()) - self._finished() <= live.live_nodes():
                # A member is gone: the failure is the loss of a node (its peers' collectives
                # broke), which re-forms the group without spending the restart budget.
                return self._open_or_refuse()
            # The node whose workers failed joins the next round itself, once it is ready:
            # it may check itself, be excluded and sit out a cool-down first (``must_join``).
            # Its watch, woken by the claim below, must not join it ahead: the round would
            # then count it in, and wait for workers it never starts.
            live.move(condition.stepped_away)
            key = self.keys.failed(now.n)
            note = {"node": self.node_id, "addr": self.addr, "what": what}
            won, _ = self.store.compare_set(key, None, dump(note))
            if not won:
                return self._open_or_refuse()
            # Before the verdict, which nodes in the exit barrier re-form on. A closer
            # already forming the next round (it woke on the claim) learns of the exclusion
            # from its watch of ``ctl/`` and stops waiting for this node.
            excluded = self.exclusions.rule.enabled and self.exclusions.strike()
            restart = excluded or self.store.add(self.keys.budget, 1) <= max_restarts
            if not restart:
                self.close(f"restart budget exhausted ({max_restarts}): {self._where(what)}")
            # The verdict, for nodes waiting in the exit barrier of this round.
            self.store.set(key, dump({**note, "restart": restart}))
            return restart

    def report_final_failure(self, what: str, why: str) -> None:
        """No restart can help a local worker's failure (``why``, e.g. a crash loop):
        close the run and claim the round's failure with no restart, as a spent budget.

        The run is closed first: a node that claimed the round's failure before this one
        (its own workers failed too) then finds it closed when it re-forms."""
        with self.calls.call():
            self.close(f"{why}: {self._where(what)}")
            if (n := self.live.now.n) is not None:
                note = {"node": self.node_id, "addr": self.addr, "what": what}
                final = dump({**note, "restart": False, "why": why})
                self.store.compare_set(self.keys.failed(n), None, final)

    def _where(self, what: str) -> str:
        """The failure and this node's address, for the reason the run closes."""
        return f"{what} on {self.addr}" if what else f"a worker on {self.addr}"

    def _finished(self) -> set[str]:
        if (n := self.live.now.n) is None:
            return set()
        done = self.keys.done(n)
        found, _ = self.store.get_prefix(done)
        return {k[len(done) :] for k in found}

    def _open_or_refuse(self) -> bool:
        raw = self.store.get(self.keys.closed)
        if raw is None:
            return True
        self.refusal = f"the run has ended on another node: {raw.decode(errors='replace')}"
        return False

    # -- the exit barrier ------------------------------------------------------------------

    def exit_barrier(self, timeout: float) -> BarrierResult:
        """This node's workers finished: wait (up to ``timeout``) for the round's outcome.

        Every member ends a round with the same outcome: SUCCEEDED when all members
        finished; RESTART when a worker failed elsewhere (and the job's budget allows a
        restart) or a member was lost -- this node then re-forms and runs its workers
        again, as in a whole-group restart; FAILED when the run was closed because the
        budget is spent. TIMED_OUT leaves without deciding for the others.
        """
        with self.calls.call():
            live, r = self.live, self.live.now.round
            if r is None or r.size <= 1:
                return BarrierResult(RoundOutcome.SUCCEEDED)
            n, k = r.n, self.keys
            self.store.set(k.done(n) + self.node_id, b"1")
            deadline = Deadline.after(timeout, self.clock)
            view = live.watcher.round_watch(r)
            rev = live.watcher.reload(view, n)
            while True:
                result = self._verdict(r, view)
                if result is not None:
                    return result
                if deadline.expired():
                    self.left_unfinished = True
                    return BarrierResult(
                        RoundOutcome.TIMED_OUT,
                        f"{len(view.finished)} of {r.size} node(s) finished within {timeout:.0f}s",
                    )
                try:
                    res = self.store.watch(k.ctl, rev, deadline.remaining())
                except StoreCompactedError:
                    rev = live.watcher.reload(view, n)
                    continue
                view.apply(res.events)
                rev = res.revision

    def _verdict(self, r: condition.CurrentRound, view: RoundWatch) -> BarrierResult | None:
        """The round's outcome as far as ``view`` shows it; None while it is open."""
        if view.closed:
            reason = (self.store.get(self.keys.closed) or b"closed").decode(errors="replace")
            if reason == "finished":
                return BarrierResult(RoundOutcome.SUCCEEDED)
            return BarrierResult(RoundOutcome.FAILED, reason)
        if view.failed:
            verdict = self._failure_verdict(r.n)
            if verdict is not None:
                return verdict
            # The failing node is deciding; its verdict (or the run's closing) follows.
        if len(view.finished) >= r.size:
            self.close("finished")
            return BarrierResult(RoundOutcome.SUCCEEDED)
        if view.lost:
            return BarrierResult(
                RoundOutcome.RESTART, f"lost node(s): {', '.join(sorted(view.lost))}"
            )
        if any(view.member(j) for j in view.next_joiners):
            return BarrierResult(RoundOutcome.RESTART, "the other nodes re-form the group")
        return None

    def _failure_verdict(self, n: int) -> BarrierResult | None:
        """The failing node's verdict on round ``n``; None until it is written."""
        note = load(self.store.get(self.keys.failed(n)))
        if not (isinstance(note, dict) and "restart" in note):
            return None
        what = str(note.get("what") or "a worker failed")
        where = f"{what} on {note.get('addr', '?')}"
        if note["restart"]:
            return BarrierResult(RoundOutcome.RESTART, where)
        why = str(note.get("why") or "restart budget exhausted")
        return BarrierResult(RoundOutcome.FAILED, f"{where}; {why}")

    def __repr__(self) -> str:
        return (
            f"Outcome(node={self.node_id!r}, round={self.live.now.n}, "
            f"refusal={self.refusal!r}, left_unfinished={self.left_unfinished})"
        )

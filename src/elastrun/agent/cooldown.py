"""A node kept out of the rounds sits out its cool-down before it joins again.

The decision is the rendezvous' (``rendezvous.exclusion``: the node that claims a
round's failure counts a strike against itself, and at the limit it is excluded for the
whole job, unless the minimum keeps it in). This is the agent's side: before each round
it asks whether this node is excluded, and if so it waits, saying why and how long is
left in one line repeated every ``LINE_EVERY`` seconds, in the shutdown scope (a signal
ends the wait at once); the run's closing ends it too (a host serving the store would
otherwise wait for this node to leave). Then it readmits itself and joins as any
newcomer: as a spare when the job is at its maximum, else the running group re-forms to
take it in.

Why wait rather than exit by default: an excluded node is to rejoin after its cool-down,
and a waiting agent keeps its lease, so the job's tools see it. A scheduler that
replaces nodes (Kubernetes, Slurm with a requeue script) asks for ``--exclude-exit``:
the agent then leaves at once with exit status 75, "replace this node"
(``core.exitcodes``), and the run stays open for the others.
"""

from __future__ import annotations

import logging

from elastrun.core.cancel import CancelScope
from elastrun.core.clock import Clock
from elastrun.core.errors import NodeExcludedError
from elastrun.core.interrupt import Interruptible
from elastrun.observe.sinks import EventSink, MetricSink
from elastrun.rendezvous.elastic import ExclusionBoard
from elastrun.rendezvous.exclusion import Exclusion, ExclusionRule

__all__ = ["LINE_EVERY", "CoolDown"]

log = logging.getLogger("elastrun.agent")

#: How often a node sitting out its cool-down says so again (seconds).
LINE_EVERY = 30.0


class CoolDown:
    """This node's part in exclusions: sit out a cool-down, and know the excluded nodes.

    Args:
        board: the rendezvous' exclusions (it keeps the records).
        rule: when nodes are excluded (``rule.enabled`` False: nothing is read, ever).
        interruptible: runs the store reads and the wait so that a signal ends them.
        events, metrics: where exclusions are told.
        clock: the agent's (wall-clock time: the records are read on other hosts).
        line_every: how often the waiting line repeats.
        node_check: nodes are checked (``nodecheck.agent.check``): a failed check excludes a
            node even when ``rule`` excludes none for its failures.
    """

    def __init__(
        self,
        board: ExclusionBoard,
        rule: ExclusionRule,
        *,
        interruptible: Interruptible,
        events: EventSink,
        metrics: MetricSink,
        clock: Clock,
        line_every: float = LINE_EVERY,
        node_check: bool = False,
    ) -> None:
        self._board = board
        self._rule = rule
        self._interruptible = interruptible
        self._events = events
        self._metrics = metrics
        self._clock = clock
        self._line_every = line_every
        self._enabled = rule.enabled or node_check
        #: This node's exclusion while it sits one out.
        self.own: Exclusion | None = None
        #: The job's excluded nodes, as last read (before each round this node joins).
        self.excluded: list[Exclusion] = []
        #: Whether this node sat out a cool-down at any time in this run: one that then
        #: finds the job finished ends with success, as the job did (read by the loop).
        self.sat_out = False

    def start(self) -> None:
        """Tell the rendezvous the rule (before the first failure can be reported)."""
        self._board.set_rule(self._rule)

    def before_round(self) -> bool:
        """Before this node joins a round: say whether a failure should have excluded it
        and did not, sit out its cool-down if it is excluded, and read who else is.

        Returns whether it sat out a cool-down that ended (not the run): a node that was
        kept out for failing is checked again before it joins (``nodecheck``).

        Raises:
            ShutdownRequested: a signal during a read or the wait.
        """
        if not self._enabled:
            return False
        kept = self._board.take_kept_at_min()
        if kept is not None:
            log.warning("this node is not excluded: %s", kept)
            self._events.record("agent.exclusion_skipped", {"reason": kept})
        own = self._interruptible.run(self._board.exclusion, "exclusion record")
        readmitted = own is not None and self._sit_out(own)
        self._read_excluded()
        return readmitted

    def _sit_out(self, own: Exclusion) -> bool:
        self.own = own
        self.sat_out = True
        self._read_excluded()
        cooldown = own.remaining(self._clock.time())
        self._events.record(
            "agent.excluded", {"node": own.node, "reason": own.reason, "cooldown_s": cooldown}
        )
        if self._rule.exits:
            # Leaving revokes the lease, and the exclusion goes with it: the scheduler
            # replaces the node, and the job goes on without it meanwhile.
            raise NodeExcludedError(
                f"this node was kept out of the job's rounds ({own.reason}): it leaves, "
                "exit status 75 (replace this node; --exclude-exit)"
            )
        self._metrics.put("agent.excluded", 1)
        ended = self._interruptible(self._wait, "end of this node's cool-down")
        self._interruptible.run(self._board.readmit, "exclusion record")
        self.own = None
        self._metrics.put("agent.excluded", 0)
        if ended:
            log.info("the job ended while this node sat out its cool-down")
        else:
            log.info("this node's cool-down is over: it joins the job again")
        self._events.record("agent.readmitted", {"node": own.node})
        return not ended

    def _wait(self, _scope: CancelScope) -> bool:
        """Until the cool-down ends (False), or the run does (True: the job finished or
        failed while this node sat out; its next join says so, as to any late node)."""
        own = self.own
        assert own is not None, "waiting without an exclusion"
        while (left := own.remaining(self._clock.time())) > 0:
            log.warning(
                "this node is kept out of the job's rounds (%s): it rejoins in %.0fs",
                own.reason,
                left,
            )
            if self._board.wait_closed(min(left, self._line_every)):
                return True
        return False

    def _read_excluded(self) -> None:
        found = self._interruptible.run(self._board.excluded_nodes, "exclusions")
        self.excluded = found
        self._metrics.put("agent.excluded_nodes", len(found))

    def status(self) -> list[dict[str, object]]:
        """The excluded nodes as last read, for the health check: node, address, why,
        and the seconds of cool-down left."""
        now = self._clock.time()
        return [
            {"node": e.node, "addr": e.addr, "reason": e.reason, "remaining_s": e.remaining(now)}
            for e in self.excluded
        ]

    def __repr__(self) -> str:
        return f"CoolDown(rule={self._rule!r}, own={self.own!r}, excluded={len(self.excluded)})"

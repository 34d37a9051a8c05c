"""The node check, the agent's side: before this node joins, check it; keep it out if bad.

When: before the node's first round, and before it rejoins after a failure of its own
workers (``due``); a failure elsewhere, or a re-formation, does not check it again.
What: ``nodecheck.worker.runner`` in processes of its own, with the workers' interpreter and
base environment (the agent never imports torch, and never initialises CUDA): the
compute part, started first so that its imports overlap the wave's window; then the
user's script if any (it extends the built-in check: both must pass; the runner's
``script`` command runs it, and ends whatever it leaves running); then the link
rounds that ``nodecheck.agent.verdicts.Isolation`` pairs, met through the rendezvous store
(``nodecheck.agent.board``).

Deadlines: the whole check has ``--node-check-timeout``. A part of this node's own that
overruns it fails the node. Waiting for peers does not: a peer that never reports is
marked missing when this node's time is up, and this node then passes unless it was
already found bad (it is not at fault for a silent peer).

A node that fails is kept out as an excluded node is (``board.exclude``: a cool-down,
never below the ``--nnodes`` minimum) and sits it out before it joins (``cooldown``);
one line names it and why, with an ``agent.node_check_failed`` event and the
``agent.node_check_failed`` metric. After its cool-down it is checked again before it
joins (the loop asks, see ``own_failure``), and a failure of its workers checks it again.

What a check's process printed is quoted in the message at most ``QUOTE`` characters
long (its end): the message goes to the log, an event and the rendezvous' record.

Every wait runs in the shutdown scope (``Interruptible``): a signal ends the check at
once, and the check's processes are killed on the way out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import time
from dataclasses import dataclass

from elastrun.core.cancel import CancelScope
from elastrun.core.clock import Clock
from elastrun.core.errors import StoreTimeoutError
from elastrun.core.interrupt import Interruptible
from elastrun.nodecheck.agent.board import CheckBoard, LinkResult, Wave
from elastrun.nodecheck.agent.verdicts import Isolation, NodeCheckRule, Pair
from elastrun.observe.sinks import EventSink, MetricSink
from elastrun.rendezvous.elastic import ElasticRendezvous, ExclusionBoard
from elastrun.supervise.processes.helper import CUT, Helper
from elastrun.supervise.processes.interpreter import WorkerInterpreter

__all__ = ["QUOTE", "CheckOutcome", "NodeCheck", "quote"]

log = logging.getLogger("elastrun.agent")

MODULE = "elastrun.nodecheck.worker.runner"
#: The most characters of a check's output a message quotes.
QUOTE = 300


@dataclass(frozen=True)
class CheckOutcome:
    """What this node's check found: why it failed (None: it passed), and what it saw."""

    failed: str | None
    #: This node's id in the rendezvous ("" when it was checked alone, with no store).
    node: str = ""
    compute_s: float | None = None
    link_s: float | None = None
    peers: int = 0
    rounds: int = 0
    #: The peers that failed the same check, with why.
    peers_failed: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class _Run:
    """One check under way: the scope of its waits, its deadline (monotonic) and what
    closes the processes it started."""

    scope: CancelScope
    deadline: float
    helpers: contextlib.ExitStack


class NodeCheck:
    """Checks this node before it joins, when due.

    Args:
        rdzv: the rendezvous's rounds (its store is where checks meet; a node that fails
            is kept out on its exclusion board).
        rule: whether and how nodes are checked (``rule.enabled`` False: never).
        interpreter: the workers' interpreter and base environment (the check's).
        interruptible: runs every wait in the shutdown scope.
        events, metrics: where a failed check is told.
        clock: the agent's.
        host: this node's name in the line that says it failed.
    """

    def __init__(
        self,
        rdzv: ElasticRendezvous,
        rule: NodeCheckRule,
        *,
        interpreter: WorkerInterpreter,
        interruptible: Interruptible,
        events: EventSink,
        metrics: MetricSink,
        clock: Clock,
        host: str = "",
    ) -> None:
        self._host = host
        self._rdzv = rdzv
        self._board: ExclusionBoard = rdzv.exclusions
        self._rule = rule
        self._interpreter = interpreter
        self._interruptible = interruptible
        self._events = events
        self._metrics = metrics
        self._clock = clock
        #: Whether the next round needs a check first (the first one does).
        self.due = rule.enabled
        #: The last check's outcome.
        self.last: CheckOutcome | None = None

    def own_failure(self) -> None:
        """This node's workers failed: check it before it rejoins (meanwhile no one may
        count it in the next round: it may fail its check and be kept out)."""
        self.due = self._rule.enabled
        if self.due:
            self._rdzv.step_away("it checks itself before it re-joins")

    def before_round(self) -> None:
        """Check this node if due; keep it out of the rounds if it fails.

        Raises:
            ShutdownRequested: a signal during the check.
        """
        if not self.due:
            return
        self.due = False
        t0 = self._clock.monotonic()
        outcome = self._interruptible(self._check, "node check")
        self.last = outcome
        self._metrics.put("agent.node_check.duration_ms", (self._clock.monotonic() - t0) * 1000)
        self._metrics.put("agent.node_check_failed", 0 if outcome.failed is None else 1)
        for peer, why in sorted(outcome.peers_failed.items()):
            log.warning("node check: peer node %s failed its check: %s", peer, why)
        reason = outcome.failed
        if reason is None:
            log.info(
                "node check passed (compute %s, link %s, %d peer(s))",
                _seconds(outcome.compute_s),
                _seconds(outcome.link_s),
                outcome.peers,
            )
            return
        self._events.record(
            "agent.node_check_failed",
            {
                "node": outcome.node or self._host,
                "host": self._host,
                "reason": reason,
                "compute_s": outcome.compute_s,
                "link_s": outcome.link_s,
                "peers": outcome.peers,
            },
        )
        held = self._interruptible.run(lambda: self._board.exclude(reason), "exclusion")
        kept = None if held is not None else self._board.take_kept_at_min()
        log.error(
            "node %s (%s) failed its check: %s; %s",
            self._host,
            outcome.node or "checked alone",
            reason,
            "it is kept out of the rounds for a cool-down"
            if held is not None
            else f"it joins anyway ({kept or 'no job-wide record to keep it out in'})",
        )

    # -- the check itself ------------------------------------------------------------------

    def _check(self, parent: CancelScope) -> CheckOutcome:
        deadline = time.monotonic() + self._rule.timeout
        # A child scope: the descriptor its waits select on is released with it.
        with parent.child() as scope, scope.active(), contextlib.ExitStack() as helpers:
            run = _Run(scope, deadline, helpers)
            compute = self._start(["compute"], run)
            seat = self._rdzv.store_seat()
            board = None if seat is None else CheckBoard.at(seat)
            wave = None
            if board is not None:
                try:
                    wave = board.join(deadline)
                except StoreTimeoutError:
                    log.warning("node check: no peer to check with in time; compute only")
            compute_s, why = self._compute(compute, run)
            if why is None and self._rule.script is not None:
                why = self._script(run)
            if wave is None or board is None or len(wave.members) < 2:
                # Alone: compute only (nothing to compare it with, nor to link to).
                return CheckOutcome(why, board.node if board else "", compute_s)
            return self._rounds(run, board, wave, compute_s, why)

    def _start(self, args: list[str], run: _Run) -> Helper:
        left = max(1.0, run.deadline - time.monotonic())
        argv = [self._interpreter.python, "-m", MODULE, "--deadline", f"{left:.1f}", "--parent"]
        helper = Helper.start([*argv, str(os.getpid()), *args], self._interpreter.environ)
        run.helpers.callback(helper.close)
        return helper

    def _compute(self, helper: Helper, run: _Run) -> tuple[float | None, str | None]:
        doc, status, seconds = _reported(helper, run)
        if seconds is not None and doc.get("ok"):
            return seconds, None
        if status is None:
            return None, f"its compute check did not finish within {self._rule.timeout:.0f}s"
        shown = doc.get("error") or (helper.tail[-1] if helper.tail else f"exit status {status}")
        return None, f"its compute check failed: {quote(str(shown))}"

    def _script(self, run: _Run) -> str | None:
        script = self._rule.script
        assert script is not None, "called with a script"
        # A bare name is a file here (the launcher checked), not a command on PATH.
        path = script if os.sep in script else os.path.join(os.curdir, script)
        argv = [self._interpreter.python, path] if script.endswith(".py") else [path]
        # Run by the runner, which ends whatever the script leaves running.
        helper = self._start(["script", "--", *argv], run)
        status = helper.finish(run.scope, run.deadline)
        if status == 0:
            return None
        if status is None:
            return f"its check script {script} did not finish within {self._rule.timeout:.0f}s"
        last = quote(helper.tail[-1]) if helper.tail else ""
        return f"its check script {script} exited {status}" + (f": {last}" if last else "")

    def _rounds(
        self, run: _Run, board: CheckBoard, wave: Wave, compute_s: float | None, why: str | None
    ) -> CheckOutcome:
        me = board.node
        iso = Isolation(wave.members, slowdown=self._rule.slowdown)
        own_link: float | None = None
        while not iso.done:
            k = iso.round
            pair = next((p for p in iso.pairs if me in p.nodes), None)
            link = None if pair is None else self._link(run, board, wave, k, pair)
            own_link = link if link is not None else own_link
            board.publish(wave, k, LinkResult(link, compute_s if why is None else None))
            paired = [n for p in iso.pairs for n in p.nodes]
            results = board.results(wave, k, list(wave.members) if k == 0 else paired, run.deadline)
            if k == 0:
                iso.feed_compute({n: r.compute for n, r in results.items()})
            iso.feed({n: r.link for n, r in results.items()})
        failed = why or iso.verdict(me)
        others = {n: w for n, w in iso.bad.items() if n != me}
        peers = len(wave.members) - 1
        return CheckOutcome(failed, me, compute_s, own_link, peers, iso.round, others)

    def _link(self, run: _Run, board: CheckBoard, wave: Wave, k: int, pair: Pair) -> float | None:
        """This node's side of round ``k``'s link test: its time (None: it failed, or
        ran out of time; the pairing finds which side of the pair is at fault)."""
        if pair.serve == board.node:
            helper = self._start(["serve", board.addr], run)
            offer = helper.next_result(run.scope, run.deadline)
            port = offer.get("port") if offer is not None else None
            # Port 0 tells the partner at once that this side cannot serve.
            board.offer_port(wave, k, port if isinstance(port, int) else 0)
            return _reported(helper, run)[2] if isinstance(port, int) else None
        partner = pair.partner(board.node)
        found = board.partner_port(wave, k, partner, run.deadline)
        if found is None:
            return None
        host = wave.addrs.get(partner, "")
        helper = self._start(["connect", host, str(found)], run)
        seconds = _reported(helper, run)[2]
        if seconds is None:
            _hang_up(host, found)
        return seconds

    def __repr__(self) -> str:
        return f"NodeCheck(rule={self._rule!r}, due={self.due}, last={self.last!r})"


def _reported(helper: Helper, run: _Run) -> tuple[dict[str, object], int | None, float | None]:
    """What a check's process reported ({}: nothing), its exit status (None: it overran)
    and the seconds it timed (None: it failed or overran)."""
    doc = helper.next_result(run.scope, run.deadline) or {}
    status = helper.finish(run.scope, run.deadline)
    seconds = doc.get("seconds")
    if status == 0 and isinstance(seconds, (int, float)):
        return doc, status, float(seconds)
    return doc, status, None


def _hang_up(host: str, port: int) -> None:
    """Connect to a partner's link test and leave at once: this side's check process
    failed without reaching it, and the partner's would otherwise wait for it until its
    deadline. (A partner whose agent died is waited for until then.)"""
    with contextlib.suppress(OSError):  # it is gone already
        socket.create_connection((host, port), timeout=1.0).close()


def quote(text: str, limit: int = QUOTE) -> str:
    """``text`` for a message: at most ``limit`` characters, its end where it is longer
    (the last words of a failing script say most), after ``CUT``."""
    if len(text) <= limit:
        return text
    text = text.removeprefix(CUT)
    return CUT + text[len(text) - (limit - len(CUT)) :]


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"

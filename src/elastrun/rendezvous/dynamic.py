"""The dynamic rendezvous, written once against the store model (DESIGN.md section 4).

Keys of a run, under ``/elastrun/<run_id>/`` (``decide.RunKeys``):

``ctl/nodes/<node>``         bound to the node's lease: the node is alive
``ctl/join/<n>/<node>``      bound to the lease: the node asks to be in round n
``ctl/failed/<n>``           the first node whose worker failed in round n, what failed,
                             and whether the job restarts
``ctl/done/<n>/<node>``      exit barrier of round n (kept when the node leaves)
``ctl/closed``               why the run ended; late agents are refused
``rounds/<n>/out/closer``    bound to a lease: the one node deciding round n
``rounds/<n>/out/result``    the closed round: decision id, size, shape (small)
``rounds/<n>/decided/<id>``  the decision's members in group-rank order (read rarely)
``rounds/<n>/rank/<id>/<node>``  a member's group rank in that decision
``rounds/<n>/status``        the closer's progress (for the others' log lines)
``rounds/<n>/master``        MASTER_ADDR/PORT of round n, chosen by its rank 0
``current``                  the newest closed round
``budget``                   failure restarts used by the whole job

Every node writes O(1) keys per round, and liveness costs no writes at all (a lease
keep-alive). One node per round, the closer (whoever first claims ``out/closer``), keeps
a view of the joiners and live nodes from watch events on ``ctl/`` and decides; the
others watch only ``out/`` and take over if the closer's lease ends. Running members
watch ``ctl/`` from the revision the round was decided at. Each node reads only its own
rank and the small result, never the whole member list. So each change costs O(1) per
interested node and a round of N nodes costs O(N) store traffic. Nothing polls.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elastrun.core.clock import SYSTEM_CLOCK, Clock, Deadline
from elastrun.core.errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousTimeoutError,
    StoreCompactedError,
    StoreError,
    StoreUnavailableError,
)
from elastrun.rendezvous.api import (
    BarrierResult,
    MemberInfo,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
    RoundOutcome,
)
from elastrun.rendezvous.decide import RoundView, RoundWatch, RunKeys, Verdict, apply_events
from elastrun.rendezvous.local import free_port
from elastrun.rendezvous.progress import ProgressLine
from elastrun.store.api import EventKind, Store

log = logging.getLogger("elastrun.rendezvous")

PROGRESS_EVERY = 5.0
#: How often a waiting node that is not the closer checks the round itself once its
#: join deadline has passed (a closer that decides nothing must not hold it forever).
AUDIT_EVERY = 30.0


@dataclass(frozen=True)
class RendezvousSettings:
    """Timeouts (seconds) and bounds of a dynamic rendezvous."""

    run_id: str
    min_nodes: int
    max_nodes: int
    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    close_timeout: float = 30.0
    heartbeat_timeout: float = 10.0  # lease TTL: a silent node is dropped after this

    def __post_init__(self) -> None:
        # Validated data: the backends' parsers check --rdzv-conf first, naming the key;
        # this catches a Python caller's NaN, infinite or negative value.
        from elastrun.core.values import parse_int, parse_seconds

        parse_int(self.min_nodes, "min_nodes", low=1)
        parse_int(self.max_nodes, "max_nodes", low=self.min_nodes)
        for name in ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout"):
            parse_seconds(getattr(self, name), name, low_open=True)


@dataclass(frozen=True)
class NodeDesc:
    node_id: str
    addr: str
    role: str
    local_world_size: int

    @classmethod
    def create(cls, addr: str, role: str, local_world_size: int) -> NodeDesc:
        import os

        return cls(f"{addr}_{os.getpid()}_{uuid.uuid4().hex[:6]}", addr, role, local_world_size)


def _bounded(action: Callable[[], object], timeout: float) -> bool:
    """Run ``action`` for at most ``timeout`` seconds; True when it completed."""
    done = threading.Event()
    ok: list[bool] = []

    def run() -> None:
        try:
            action()
            ok.append(True)
        except StoreError as exc:
            log.debug("store call failed during shutdown: %s", exc)
        finally:
            done.set()

    threading.Thread(target=run, name="elastrun-rdzv-bounded", daemon=True).start()
    return done.wait(timeout) and bool(ok)


def _dump(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True).encode()


def _load(raw: bytes | None) -> object:
    return None if raw is None else json.loads(raw)


class DynamicRendezvousHandler(RendezvousHandler):
    """One node's side of the dynamic rendezvous over any ``Store``.

    Beyond torch's handler methods it offers what the agent uses for elasticity:
    ``set_change_callback`` (called from a watch thread when the running round must
    re-form), ``report_failure`` (the job-wide restart budget) and ``exit_barrier``.
    """

    def __init__(
        self,
        store: Store,
        settings: RendezvousSettings,
        node: NodeDesc,
        *,
        backend: str = "c10d",
        clock: Clock = SYSTEM_CLOCK,
        on_shutdown: Callable[[], None] | None = None,
        fixed_rank: int | None = None,
        hosting: bool = False,
    ) -> None:
        self._fixed_rank = fixed_rank
        self._hosting = hosting
        self._store = store
        self._settings = settings
        self._node = node
        self._backend = backend
        self._clock = clock
        self._on_shutdown = on_shutdown
        self._keys = RunKeys(f"/elastrun/{settings.run_id}/")
        self._lease: int | None = None
        self._round: int | None = None
        self._rank: int | None = None
        self._size = 0  # nodes in the current round
        self._decision = ""  # the id of the current round's decision
        self._membership: dict[str, bool] = {}  # nodes known to be in it, or not
        self._member_list: tuple[str, ...] | None = None  # read only when needed
        self._since = 0  # the store revision the current round was decided at
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._entered = threading.Event()  # set while a round runs and has not re-formed
        self._threads: list[threading.Thread] = []
        self._callback: Callable[[], None] | None = None
        self._reform = False
        self._lost = False
        # Set once the store is given up (it stopped answering for its whole reconnect
        # window): the one line saying so; every later call ends with it.
        self._gone: str | None = None
        #: Why the running round must re-form (for the agent's log line).
        self.change_reason = ""
        #: Why ``report_failure`` refused a restart other than an exhausted budget.
        self.refusal: str | None = None
        #: Joiners the last decision of this node saw, when it was the closer.
        self.seen = 0
        # This node left a round whose other members were still working (its exit
        # barrier timed out): leaving must not close the run under them.
        self._left_unfinished = False
        self._progress_line = ProgressLine(log, clock)

    # -- torch-compatible surface ------------------------------------------------------

    def get_backend(self) -> str:
        return self._backend

    @property
    def agent_hosts_bootstrap_store(self) -> bool:
        return True

    def get_run_id(self) -> str:
        return self._settings.run_id

    @property
    def settings(self) -> RendezvousSettings:
        return self._settings

    def is_closed(self) -> bool:
        return self._store.get(self._keys.closed) is not None

    def set_closed(self, reason: str = "closed") -> None:
        self._store.compare_set(self._keys.closed, None, reason.encode())

    def num_nodes_waiting(self) -> int:
        """1 when the running round must re-form (nodes waiting, lost, or a failure).

        Raises ``RendezvousConnectionError`` once the store is given up (as torch's
        handler does when its backend is unreachable): the agent stops its workers and
        exits with that one line instead of re-forming against a store that is gone.
        """
        if self._gone is not None:
            raise RendezvousConnectionError(self._gone)
        return 1 if (self._reform or self._lost) else 0

    def shutdown(self, close: bool = True) -> bool:
        """Close the run (once a job ends, late agents are refused) and leave.

        The node that serves the store waits (up to ``close_timeout``) for the other
        nodes to leave before its store goes away under them.
        """
        if self._gone is not None:
            self.leave()  # nothing to close: the store is gone
            return False
        if not close and not self._left_unfinished:
            # This node ends on an error of its own; the others decide for themselves.
            if self._hosting:
                self._wait_for_others_to_leave(self._settings.close_timeout)
            self.leave()
            return False
        if self._left_unfinished:
            # The job goes on without this node; its outcome is not known yet.
            if self._hosting:
                log.warning(
                    "this node serves the rendezvous store: it keeps serving until the "
                    "other nodes leave"
                )
                self._wait_for_others_to_leave(None)
            self.leave()
            return False
        closed = _bounded(lambda: self.set_closed("finished"), self._settings.close_timeout)
        if not closed:
            log.warning("could not close the rendezvous (the store is unreachable)")
        if self._hosting and closed:
            self._wait_for_others_to_leave(self._settings.close_timeout)
        self.leave()
        return closed

    def _wait_for_others_to_leave(self, timeout: float | None) -> None:
        """Wait until no other node holds a lease (None: for as long as it takes; a
        signal ends the launcher's wait, see the agent)."""
        deadline = Deadline.after(timeout if timeout is not None else 1e9, self._clock)
        nodes = self._keys.nodes
        try:
            found, rev = self._store.get_prefix(nodes)
            others = set(found) - {nodes + self._node.node_id}
            while others and not deadline.expired():
                try:
                    res = self._store.watch(nodes, rev, min(deadline.remaining(), 5.0))
                except StoreCompactedError:
                    found, rev = self._store.get_prefix(nodes)
                    others = set(found) - {nodes + self._node.node_id}
                    continue
                rev = res.revision
                for e in res.events:
                    (others.add if e.kind is EventKind.PUT else others.discard)(e.key)
                others.discard(nodes + self._node.node_id)
            if others:
                log.warning("%d node(s) still attached to the store; closing it", len(others))
        except StoreError as exc:
            log.debug("while waiting for the other nodes to leave: %s", exc)

    def leave(self) -> None:
        """Stop watching, revoke the lease (our keys vanish at once), close the store."""
        self._stop.set()
        self._entered.set()  # wake the watch thread so that it sees the stop
        lease, self._lease = self._lease, None
        if lease is not None and self._gone is None:
            # Bounded: a store that is already gone must not hold the exit for its whole
            # reconnect window; the lease then expires by itself.
            _bounded(lambda: self._store.revoke_lease(lease), 2.0)
        for t in self._threads:
            t.join(timeout=5)
        self._threads.clear()
        if self._on_shutdown is not None:
            self._on_shutdown()
            self._on_shutdown = None

    # -- elastrun's additions ------------------------------------------------------------

    def set_node_info(self, role: str, local_world_size: int) -> None:
        """What this node brings to a round (the agent tells it before joining)."""
        self._node = NodeDesc(self._node.node_id, self._node.addr, role, local_world_size)

    def set_change_callback(self, callback: Callable[[], None]) -> None:
        self._callback = callback

    def restarts_used(self) -> int:
        raw = self._store.get(self._keys.budget)
        return int(raw) if raw else 0

    def report_failure(self, max_restarts: int, what: str = "") -> bool:
        """A local worker failed in the current round: take one restart from the job's
        budget, once per round however many nodes see the failure. Returns False (and
        closes the run) when the budget is exhausted.

        ``what`` says which worker failed and how; every node of the round learns it
        (``ctl/failed/<n>``), also nodes whose workers already finished.
        """
        assert self._round is not None
        self.refusal = None
        if self._lost:
            self.refusal = "this node was dropped from the run (" + self.change_reason + ")"
            return False
        if not set(self._member_ids()) - self._finished() <= self._live_nodes():
            # A member is gone: the failure is the loss of a node (its peers' collectives
            # broke), which re-forms the group without spending the restart budget.
            return self._open_or_refuse()
        key = self._keys.failed(self._round)
        note = {"node": self._node.node_id, "addr": self._node.addr, "what": what}
        won, _ = self._store.compare_set(key, None, _dump(note))
        if not won:
            return self._open_or_refuse()
        used = self._store.add(self._keys.budget, 1)
        restart = used <= max_restarts
        if not restart:
            where = f"{what} on {self._node.addr}" if what else f"a worker on {self._node.addr}"
            self.set_closed(f"restart budget exhausted ({max_restarts}): {where}")
        # The verdict, for nodes waiting in the exit barrier of this round.
        self._store.set(key, _dump({**note, "restart": restart}))
        return restart

    def _finished(self) -> set[str]:
        if self._round is None:
            return set()
        done = self._keys.done(self._round)
        found, _ = self._store.get_prefix(done)
        return {k[len(done) :] for k in found}

    def _open_or_refuse(self) -> bool:
        raw = self._store.get(self._keys.closed)
        if raw is None:
            return True
        self.refusal = f"the run has ended on another node: {raw.decode(errors='replace')}"
        return False

    def exit_barrier(self, timeout: float) -> BarrierResult:
        try:
            return self._exit_barrier(timeout)
        except StoreUnavailableError as exc:
            raise RendezvousConnectionError(self._store_gone(exc)) from exc

    def _exit_barrier(self, timeout: float) -> BarrierResult:
        """This node's workers finished: wait (up to ``timeout``) for the round's outcome.

        Every member ends a round with the same outcome: SUCCEEDED when all members
        finished; RESTART when a worker failed elsewhere (and the job's budget allows a
        restart) or a member was lost -- this node then re-forms and runs its workers
        again, as in a whole-group restart; FAILED when the run was closed because the
        budget is spent. TIMED_OUT leaves without deciding for the others.
        """
        if self._round is None or self._size <= 1:
            return BarrierResult(RoundOutcome.SUCCEEDED)
        n, k = self._round, self._keys
        self._store.set(k.done(n) + self._node.node_id, b"1")
        deadline = Deadline.after(timeout, self._clock)
        view = self._round_watch(n, self._size)
        rev = self._reload(view, n)
        while True:
            result = self._barrier_verdict(n, view)
            if result is not None:
                return result
            if self._stop.is_set():
                raise self._left_error()
            if deadline.expired():
                self._left_unfinished = True
                return BarrierResult(
                    RoundOutcome.TIMED_OUT,
                    f"{len(view.finished)} of {self._size} node(s) finished within {timeout:.0f}s",
                )
            try:
                res = self._store.watch(k.ctl, rev, min(deadline.remaining(), 5.0))
            except StoreCompactedError:
                rev = self._reload(view, n)
                continue
            view.apply(res.events)
            rev = res.revision

    def _barrier_verdict(self, n: int, view: RoundWatch) -> BarrierResult | None:
        if view.closed:
            reason = (self._store.get(self._keys.closed) or b"closed").decode(errors="replace")
            if reason == "finished":
                return BarrierResult(RoundOutcome.SUCCEEDED)
            return BarrierResult(RoundOutcome.FAILED, reason)
        if view.failed:
            note = _load(self._store.get(self._keys.failed(n)))
            if isinstance(note, dict) and "restart" in note:
                what = str(note.get("what") or "a worker failed")
                where = f"{what} on {note.get('addr', '?')}"
                if note["restart"]:
                    return BarrierResult(RoundOutcome.RESTART, where)
                return BarrierResult(RoundOutcome.FAILED, f"{where}; restart budget exhausted")
            # The failing node is deciding; its verdict (or the run's closing) follows.
        if len(view.finished) >= self._size:
            self.set_closed("finished")
            return BarrierResult(RoundOutcome.SUCCEEDED)
        if view.lost:
            return BarrierResult(
                RoundOutcome.RESTART, f"lost node(s): {', '.join(sorted(view.lost))}"
            )
        if any(self._is_member(j) for j in view.next_joiners):
            return BarrierResult(RoundOutcome.RESTART, "the other nodes re-form the group")
        return None

    # -- joining -------------------------------------------------------------------------

    def next_rendezvous(self) -> RendezvousInfo:
        try:
            if self._gone is not None:
                raise RendezvousConnectionError(self._gone)
            return self._next_rendezvous()
        except StoreUnavailableError as exc:
            raise RendezvousConnectionError(self._store_gone(exc)) from exc
        except StoreError as exc:
            raise RendezvousConnectionError(f"rendezvous store failed: {exc}") from exc

    def _next_rendezvous(self) -> RendezvousInfo:
        self._register()
        prev_round, prev_rank = self._round, self._rank
        if self._fixed_rank is not None:
            prev_rank = self._fixed_rank  # static: the node's rank never changes
        self._reform = False
        deadline = self._clock.monotonic() + self._settings.join_timeout
        target = self._first_target(prev_round)
        while True:
            result = self._join_round(target, prev_rank, deadline)
            raw = self._store.get(self._keys.rank(target, result["id"], self._node.node_id))
            if raw is not None:
                break
            target += 1  # a spare: wait for room in the next round
        return self._enter_round(target, result, int(raw))

    def _first_target(self, prev_round: int | None) -> int:
        current = self._store.get(self._keys.current)
        latest = int(current) if current is not None else -1
        return max(latest, prev_round if prev_round is not None else -1) + 1

    def _join_round(self, n: int, prev_rank: int | None, deadline: float) -> dict[str, Any]:
        """Join round ``n`` and return its result.

        The first node to claim ``out/closer`` decides the round (``_decide``); the
        others watch only ``out/`` for the result, and one of them takes over when the
        closer's claim vanishes with its lease.
        """
        me, k = self._node, self._keys
        info = {"addr": me.addr, "role": me.role, "local_world_size": me.local_world_size}
        join = _dump({**info, "prev_rank": prev_rank})
        self._store.set(k.join_prefix(n) + me.node_id, join, lease=self._lease)
        out, result_key, closer_key = k.out(n), k.result(n), k.closer(n)
        found, rev = self._store.get_prefix(out)
        now = self._clock.monotonic()
        next_progress = now + PROGRESS_EVERY
        audit_at = deadline
        while True:
            raw = found.get(result_key)
            if raw is not None:
                return self._parse_result(raw)
            if self._stop.is_set():
                raise self._left_error()
            if closer_key not in found:
                won, _ = self._store.compare_set(
                    closer_key, None, me.node_id.encode(), lease=self._lease
                )
                if won:
                    return self._parse_result(self._decide(n, deadline))
                found, rev = self._store.get_prefix(out)
                continue
            now = self._clock.monotonic()
            if now >= audit_at:
                audit_at = self._audit(n, deadline, now)
                found, rev = self._store.get_prefix(out)
                continue
            if now >= next_progress:
                if self.is_closed():
                    raise self._closed_error()
                self._follower_progress(n)
                next_progress = now + PROGRESS_EVERY
            wait = max(0.0, min(next_progress, audit_at) - now) + 0.01
            try:
                res = self._store.watch(out, rev, wait)
            except StoreCompactedError:
                found, rev = self._store.get_prefix(out)
                continue
            rev = res.revision
            apply_events(found, res.events)

    def _decide(self, n: int, deadline: float) -> bytes:
        """As the closer of round ``n``: follow the joiners and live nodes from watch
        events and close the round when ``decide_round`` says so. Returns the result."""
        s, k = self._settings, self._keys
        view, rev = self._load_view(n)
        call_started: float | None = None
        next_progress = self._clock.monotonic()
        while True:
            if self._stop.is_set():
                raise self._left_error()
            if view.closed is not None:
                reason = view.closed.decode(errors="replace")
                return self._publish(n, _dump({"closed": reason}))
            joined = len(view.joins)
            self.seen = joined
            now = self._clock.monotonic()
            started = view.started()
            if call_started is None and started and joined >= s.min_nodes:
                call_started = now
            decision = view.decide(s, now=now, call_started_at=call_started, join_deadline=deadline)
            if decision.verdict is Verdict.CLOSE:
                return self._commit(n, view, decision.members, rev)
            if decision.verdict is Verdict.TIMEOUT:
                raise self._timeout_error(n, joined)
            if now >= next_progress:
                raw = self._store.get(k.result(n))  # closed by a node auditing the round
                if raw is not None:
                    return raw
                status = {
                    "joined": joined,
                    "started": started,
                    "last_call_in": (
                        decision.wake_at - now
                        if decision.wake_at is not None and joined >= s.min_nodes
                        else None
                    ),
                    "timeout_in": deadline - now,
                }
                self._store.set(k.status(n), _dump(status))
                self._progress(n, status)
                next_progress = now + PROGRESS_EVERY
            wait = max(0.0, next_progress - now) + 0.01
            if decision.wake_at is not None:
                wait = min(wait, max(0.0, decision.wake_at - now) + 0.01)
            try:
                res = self._store.watch(k.ctl, rev, wait)
            except StoreCompactedError:
                view, rev = self._load_view(n)
                continue
            view.apply(res.events)
            rev = res.revision

    def _load_view(self, n: int) -> tuple[RoundView, int]:
        """The closer's view of round ``n`` from full reads, and the revision to watch
        from (replaying changes made between the reads is harmless: each event sets or
        removes one key)."""
        k = self._keys
        view = RoundView(k, n, self._previous_members(n))
        joins, rev = self._store.get_prefix(k.join_prefix(n))
        nodes, _ = self._store.get_prefix(k.nodes)
        view.load(joins, list(nodes), self._store.get(k.closed))
        return view, rev

    def _audit(self, n: int, deadline: float, now: float) -> float:
        """Past its join deadline, a waiting node checks the round itself: it times out
        below the minimum, closes a round that should be closed, and otherwise waits on
        (the closer is in its last call, or this node is a spare). Returns when to check
        again."""
        view, rev = self._load_view(n)
        decision = view.decide(
            self._settings, now=now, call_started_at=None, join_deadline=deadline
        )
        if decision.verdict is Verdict.TIMEOUT:
            raise self._timeout_error(n, len(view.joins))
        if decision.verdict is Verdict.CLOSE:
            self._commit(n, view, decision.members, rev)
        return now + AUDIT_EVERY

    def _commit(self, n: int, view: RoundView, members: tuple[str, ...], rev: int) -> bytes:
        """Publish a decision: the full member list, one rank key per member, then the
        small result everyone waits for (the commit point: the first result written
        holds). Each node reads O(1) of it; only tools and the next round's closer read
        the full list. Returns the result that holds."""
        k = self._keys
        decision = uuid.uuid4().hex[:12]
        full, result = view.outcome(members, decision, rev)
        self._store.set(k.decided(n, decision), _dump(full))
        for rank, m in enumerate(members):
            self._store.set(k.rank(n, decision, m), str(rank).encode())
        return self._publish(n, _dump(result), len(members))

    def _publish(self, n: int, value: bytes, size: int | None = None) -> bytes:
        """Write the result of round ``n`` unless someone did; return the one that holds.

        ``size`` is the number of members (None: the result says the run was closed).
        """
        won, current = self._store.compare_set(self._keys.result(n), None, value)
        if not won:
            assert current is not None
            return current
        if size is not None:
            self._store.set(self._keys.current, str(n).encode())
            self._progress_line.end()
            log.info("rendezvous round %d closed with %d node(s)", n, size)
        return value

    def _parse_result(self, raw: bytes) -> dict[str, Any]:
        result = _load(raw)
        if not isinstance(result, dict):
            raise RendezvousConnectionError(f"unreadable rendezvous result: {raw[:80]!r}")
        if "closed" in result:
            raise self._closed_error()
        return result

    def _timeout_error(self, n: int, count: int) -> RendezvousTimeoutError:
        self._progress_line.end()
        return RendezvousTimeoutError(
            f"rendezvous round {n} timed out after {self._settings.join_timeout:.0f}s "
            f"with {count} node(s); at least {self._settings.min_nodes} needed"
        )

    def _follower_progress(self, n: int) -> None:
        status = _load(self._store.get(self._keys.status(n)))
        if isinstance(status, dict):
            self._progress(n, status)
        else:
            s = self._settings
            self._progress_line.show(
                (n, "follower"),
                f"rendezvous round {n}: waiting for it to close "
                f"(min {s.min_nodes}, max {s.max_nodes} node(s))",
            )

    def _progress(self, n: int, status: dict[str, Any]) -> None:
        s = self._settings
        if not status.get("started", True):
            self._progress_line.show(
                (n, "spare"),
                f"waiting as a spare for round {n}: the job runs at its maximum of "
                f"{s.max_nodes} node(s)",
            )
            return
        count = status.get("joined", 0)
        parts = [f"rendezvous round {n}: {count} node(s) in (min {s.min_nodes}, max {s.max_nodes})"]
        if status.get("last_call_in") is not None:
            parts.append(f"last call ends in {max(0.0, status['last_call_in']):.0f}s")
        elif status.get("timeout_in") is not None:
            parts.append(f"timeout in {max(0.0, status['timeout_in']):.0f}s")
        # A log gets a line when the count changes, else one every 30 s at most.
        self._progress_line.show((n, count), "; ".join(parts))

    def _live_nodes(self) -> set[str]:
        found, _ = self._store.get_prefix(self._keys.nodes)
        cut = len(self._keys.nodes)
        return {k[cut:] for k in found}

    def _decided_rows(self, n: int, decision: str | None = None) -> list[list[Any]]:
        """The full member list of round ``n`` (of its committed decision by default)."""
        if decision is None:
            result = _load(self._store.get(self._keys.result(n)))
            if not isinstance(result, dict) or "id" not in result:
                return []
            decision = str(result["id"])
        full = _load(self._store.get(self._keys.decided(n, decision)))
        return list(full["members"]) if isinstance(full, dict) else []

    def _previous_members(self, n: int) -> tuple[str, ...]:
        if n == 0:
            return ()
        return tuple(str(row[0]) for row in self._decided_rows(n - 1))

    def _member_ids(self) -> tuple[str, ...]:
        """The members of the current round (one full read, then remembered)."""
        with self._lock:
            n, decision, known = self._round, self._decision, self._member_list
        if known is not None or n is None:
            return known or ()
        ids = tuple(str(row[0]) for row in self._decided_rows(n, decision))
        with self._lock:
            if self._round == n:
                self._member_list = ids
        return ids

    def _is_member(self, node: str) -> bool:
        with self._lock:
            n, decision, known = self._round, self._decision, self._membership.get(node)
        if known is not None or n is None:
            return bool(known)
        found = self._store.get(self._keys.rank(n, decision, node)) is not None
        with self._lock:
            if self._round == n:
                self._membership[node] = found
        return found

    def _member_infos(self, n: int, decision: str) -> tuple[MemberInfo, ...]:
        return tuple(
            MemberInfo(str(r[0]), str(r[1]), str(r[2]), int(r[3]))
            for r in self._decided_rows(n, decision)
        )

    def _enter_round(self, n: int, result: dict[str, Any], rank: int) -> RendezvousInfo:
        self._progress_line.end()
        decision, size = str(result["id"]), int(result["size"])
        shape = tuple((str(r), int(lws), int(c)) for r, lws, c in result.get("shape", ()))
        with self._lock:
            self._round, self._rank, self._size, self._decision = n, rank, size, decision
            self._membership = {self._node.node_id: True}
            self._member_list = None
            self._since = int(result.get("rev", 0))
            self._reform = False
            self._entered.set()
        master = self._master(n, rank)
        self._start_watch()
        return RendezvousInfo(
            self._store, rank, size, master, round=n,
            members=functools.partial(self._member_infos, n, decision), shape=shape,
        )  # fmt: skip

    def _master(self, n: int, rank: int) -> RendezvousStoreInfo:
        key = self._keys.master(n)
        if rank == 0:
            self._store.set(key, _dump({"addr": self._node.addr, "port": free_port()}))
        self._store.wait([key], self._settings.join_timeout)
        data = _load(self._store.get(key))
        assert isinstance(data, dict)
        return RendezvousStoreInfo(str(data["addr"]), int(data["port"]))

    # -- liveness and watching -----------------------------------------------------------

    def _register(self) -> None:
        if self._lease is not None and not self._lost:
            # A node thawed after SIGSTOP (or back from a partition) may re-form before
            # its keep-alive thread noticed that the lease ended: ask the store.
            if self._store.keep_alive(self._lease):
                return
            self._mark_lost("this node's lease expired: the others consider it gone")
        if self.is_closed():
            raise self._closed_error()
        self._lost = False
        self._lease = self._store.grant_lease(self._settings.heartbeat_timeout)
        me = self._node
        self._store.set(
            self._keys.nodes + me.node_id,
            _dump({"addr": me.addr, "role": me.role, "local_world_size": me.local_world_size}),
            lease=self._lease,
        )
        if not self._threads:
            self._spawn(self._keep_alive_loop, "keepalive")

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=target, name=f"elastrun-rdzv-{name}", daemon=True)
        t.start()
        self._threads.append(t)

    def _keep_alive_loop(self) -> None:
        ttl = self._settings.heartbeat_timeout
        interval = ttl / 3
        last_ack = self._clock.monotonic()
        while not self._stop.wait(interval):
            lease = self._lease
            if lease is None or self._lost:
                last_ack = self._clock.monotonic()
                continue
            answer: list[bool] = []
            # Bounded by the interval: a store that does not answer (a partition leaves
            # the connection open and silent) must not hold this loop for its timeout.
            _bounded(functools.partial(self._ask_keep_alive, lease, answer), interval)
            now = self._clock.monotonic()
            if answer and answer[0]:
                last_ack = now
            elif answer:
                self._mark_lost("this node's lease expired: the others consider it gone")
            elif now - last_ack >= ttl - interval:
                # The others drop us when the TTL passes; stop our workers before that,
                # so a cut-off node never trains beside the re-formed group.
                self._mark_lost(
                    f"no keep-alive acknowledged for {now - last_ack:.0f}s: assuming this "
                    "node was dropped (network partition or store down)"
                )

    def _ask_keep_alive(self, lease: int, answer: list[bool]) -> None:
        try:
            answer.append(self._store.keep_alive(lease))
        except StoreUnavailableError as exc:
            # Also from a call the loop stopped waiting for: the store's window ends
            # when it ends, not at this loop's next tick.
            self._store_gone(exc)
            raise

    def _store_gone(self, exc: StoreUnavailableError) -> str:
        """The store stopped answering for its whole reconnect window (``read_timeout``
        after it went silent; the client shares that one window between all calls):
        give it up for good, wake the agent, and return the line that says so."""
        with self._lock:
            if self._gone is None:
                self._gone = (
                    f"the rendezvous store at {exc.address} stopped answering "
                    f"{exc.silent_for:.0f}s ago; stopping"
                )
                log.debug("giving up the store: %s", exc)
            gone = self._gone
        self.change_reason = gone
        self._lost = True
        if not self._stop.is_set():  # a late keep-alive thread: nobody to wake any more
            self._notify()
        return gone

    def _mark_lost(self, reason: str) -> None:
        log.warning("%s", reason)
        self.change_reason = reason
        self._lost = True
        self._notify()

    def _start_watch(self) -> None:
        if not any(t.name.endswith("watch") for t in self._threads):
            self._spawn(self._watch_loop, "watch")

    def _watch_loop(self) -> None:
        """Follow ``ctl/`` while a round runs; flag a re-formation when one is due.

        Between a re-formation and the next round this thread sleeps: the joining code
        watches what it needs, and N members reading every join of the next round would
        cost O(N^2).
        """
        watching: tuple[int, RoundWatch, int] | None = None  # round, view, revision
        while not self._stop.is_set():
            with self._lock:
                n, size, since, idle = self._round, self._size, self._since, self._reform
            if n is None or idle:
                self._entered.wait(1.0)
                continue
            try:
                if watching is None or watching[0] != n:
                    watching = (n, self._round_watch(n, size), since)
                _, view, rev = watching
                try:
                    res = self._store.watch(self._keys.ctl, rev, 1.0)
                except StoreCompactedError as exc:
                    # The store dropped old history (etcd auto-compaction): re-read.
                    log.debug("rendezvous watch resumes after compaction: %s", exc)
                    view = self._round_watch(n, size)
                    watching = (n, view, self._reload(view, n))
                    continue
                view.apply(res.events)
                watching = (n, view, res.revision)
                reason = view.reason()
                if reason is not None:
                    self._flag_reform(n, reason)
            except StoreUnavailableError as exc:
                self._store_gone(exc)
                self._stop.wait(1.0)
            except StoreError as exc:
                if not self._stop.is_set():
                    log.warning("rendezvous watch interrupted: %s", exc)
                    self._stop.wait(1.0)

    def _round_watch(self, n: int, size: int) -> RoundWatch:
        return RoundWatch(self._keys, n, size, self._settings.max_nodes, self._is_member)

    def _reload(self, view: RoundWatch, n: int) -> int:
        k = self._keys
        nodes, rev = self._store.get_prefix(k.nodes)
        joins, _ = self._store.get_prefix(k.join_prefix(n + 1))
        done, _ = self._store.get_prefix(k.done(n))
        failed = self._store.get(k.failed(n)) is not None
        view.load(
            self._member_ids(), list(nodes), list(joins), failed, self.is_closed(), list(done)
        )
        return rev

    def _flag_reform(self, n: int, reason: str) -> None:
        with self._lock:
            if self._round != n or self._reform:
                return
            self.change_reason = reason
            self._reform = True
            self._entered.clear()
        self._notify()

    def _check_reform(self) -> bool:
        """Whether the running round must re-form, from full reads (for tests and
        tools; the watch thread keeps the same answer from events)."""
        with self._lock:
            n, size = self._round, self._size
        if n is None or self._reform:
            return self._reform
        view = self._round_watch(n, size)
        self._reload(view, n)
        reason = view.reason()
        if reason is not None:
            self._flag_reform(n, reason)
        return self._reform

    def _notify(self) -> None:
        if self._callback is not None:
            self._callback()

    # -- helpers ---------------------------------------------------------------------------

    def _left_error(self) -> RendezvousClosedError:
        return RendezvousClosedError("this node left the rendezvous while it was waiting")

    def _closed_error(self) -> RendezvousClosedError:
        raw = self._store.get(self._keys.closed) or b"closed"
        return RendezvousClosedError(
            f"run {self._settings.run_id!r} has ended ({raw.decode(errors='replace')}); "
            "it accepts no more nodes"
        )

    def __repr__(self) -> str:
        return (
            f"DynamicRendezvousHandler(run_id={self._settings.run_id!r}, "
            f"node={self._node.node_id!r}, round={self._round}, rank={self._rank})"
        )

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

import contextlib
import functools
import json
import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from elastrun.core import cancel
from elastrun.core.cancel import Cancelled, CancelScope
from elastrun.core.clock import SYSTEM_CLOCK, Clock, Deadline
from elastrun.core.errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    StoreCompactedError,
    StoreError,
    StoreUnavailableError,
)
from elastrun.rendezvous import joining
from elastrun.rendezvous.api import (
    BarrierResult,
    MemberInfo,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
    RoundOutcome,
)
from elastrun.rendezvous.decide import RoundWatch, RunKeys
from elastrun.rendezvous.local import free_port
from elastrun.rendezvous.progress import ProgressLine
from elastrun.store.api import EventKind, Store

log = logging.getLogger("elastrun.rendezvous")

#: How long one watch of a running round lasts before it is renewed (``leave`` ends it
#: at once; renewing costs one request).
_WATCH_SPAN = 60.0

# The joining protocol's periods, re-exported for the benchmarks' participant.
PROGRESS_EVERY = joining.PROGRESS_EVERY
AUDIT_EVERY = joining.AUDIT_EVERY


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
        self._life = CancelScope()  # the handler's own threads: cancelled by ``leave``
        self._calls: set[CancelScope] = set()  # the agent's calls in progress
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

    # ``elastic.ElasticRendezvous``: its store waits observe the caller's current cancel
    # scope (the agent runs it in its shutdown scope), it keeps the job-wide budget in
    # its store and it has an exit barrier.
    observes_cancel_scope = True
    keeps_job_budget = True
    has_exit_barrier = True

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
        self._life.cancel("this node left the rendezvous")
        with self._lock:
            calls = list(self._calls)
        for scope in calls:
            scope.cancel("this node left the rendezvous")
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
        with self._agent_call():
            return self._report_failure(max_restarts, what)

    def _report_failure(self, max_restarts: int, what: str) -> bool:
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
            with self._agent_call():
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
            if deadline.expired():
                self._left_unfinished = True
                return BarrierResult(
                    RoundOutcome.TIMED_OUT,
                    f"{len(view.finished)} of {self._size} node(s) finished within {timeout:.0f}s",
                )
            try:
                res = self._store.watch(k.ctl, rev, deadline.remaining())
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
            with self._agent_call():
                return self._next_rendezvous()
        except StoreUnavailableError as exc:
            raise RendezvousConnectionError(self._store_gone(exc)) from exc
        except StoreError as exc:
            raise RendezvousConnectionError(f"rendezvous store failed: {exc}") from exc
        finally:
            self._progress_line.end()

    def _next_rendezvous(self) -> RendezvousInfo:
        self._register()
        prev_round, prev_rank = self._round, self._rank
        if self._fixed_rank is not None:
            prev_rank = self._fixed_rank  # static: the node's rank never changes
        self._reform = False
        joined = joining.drive(joining.join(self._context(), prev_round, prev_rank), self._perform)
        assert isinstance(joined, joining.Joined)
        return self._enter_round(joined)

    def _context(self) -> joining.Context:
        me = self._node
        return joining.Context(
            keys=self._keys,
            node_id=me.node_id,
            info={"addr": me.addr, "role": me.role, "local_world_size": me.local_world_size},
            bounds=self._settings,
            join_timeout=self._settings.join_timeout,
            run_id=self._settings.run_id,
            clock=self._clock,
            new_port=free_port,
        )

    def _perform(self, op: joining.Op) -> Any:
        """Carry out one operation of the joining protocol (see ``joining``)."""
        store = self._store
        match op:
            case joining.Get(key):
                return store.get(key)
            case joining.GetPrefix(prefix):
                return store.get_prefix(prefix)
            case joining.Put(key, value, leased):
                return store.set(key, value, lease=self._lease if leased else None)
            case joining.CompareSet(key, expected, value, leased):
                return store.compare_set(
                    key, expected, value, lease=self._lease if leased else None
                )
            case joining.Watch(prefix, after, timeout):
                return store.watch(prefix, after, timeout)
            case joining.Wait(keys, timeout):
                return store.wait(list(keys), timeout)
            case joining.Progress(n, status):
                return self._progress(n, status)
            case joining.Seen(_, joined):
                self.seen = joined
                return None
            case joining.Closed(n, size):
                self._progress_line.end()
                log.info("rendezvous round %d closed with %d node(s)", n, size)
                return None
        raise AssertionError(f"unknown rendezvous operation {op!r}")

    def _progress(self, n: int, status: dict[str, Any] | None) -> None:
        s = self._settings
        if status is None:
            self._progress_line.show(
                (n, "follower"),
                f"rendezvous round {n}: waiting for it to close "
                f"(min {s.min_nodes}, max {s.max_nodes} node(s))",
            )
            return
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

    @contextlib.contextmanager
    def _agent_call(self) -> Iterator[None]:
        """Run a call made for the agent (joining, the exit barrier, the budget) in a
        scope of its own below the caller's current one: a signal that cancels the
        agent's scope, or ``leave`` from another thread, ends its store waits at once."""
        with cancel.current().child() as calls, calls.active():
            with self._lock:
                self._calls.add(calls)
            try:
                yield
            except Cancelled:
                if self._stop.is_set():
                    raise self._left_error() from None
                raise
            finally:
                with self._lock:
                    self._calls.discard(calls)

    def _live_nodes(self) -> set[str]:
        found, _ = self._store.get_prefix(self._keys.nodes)
        cut = len(self._keys.nodes)
        return {k[cut:] for k in found}

    def _decided_rows(self, n: int, decision: str | None = None) -> list[list[Any]]:
        rows = joining.drive(joining.decided_rows(self._context(), n, decision), self._perform)
        assert isinstance(rows, list)
        return rows

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

    def _enter_round(self, joined: joining.Joined) -> RendezvousInfo:
        n, rank, result = joined.n, joined.rank, joined.result
        decision, size = str(result["id"]), int(result["size"])
        shape = tuple((str(r), int(lws), int(c)) for r, lws, c in result.get("shape", ()))
        with self._lock:
            self._round, self._rank, self._size, self._decision = n, rank, size, decision
            self._membership = {self._node.node_id: True}
            self._member_list = None
            self._since = int(result.get("rev", 0))
            self._reform = False
            self._entered.set()
        self._start_watch()
        return RendezvousInfo(
            self._store, rank, size, RendezvousStoreInfo(*joined.master), round=n,
            members=functools.partial(self._member_infos, n, decision), shape=shape,
        )  # fmt: skip

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
                self._entered.wait()  # set by the next round, and by ``leave``
                continue
            try:
                if watching is None or watching[0] != n:
                    watching = (n, self._round_watch(n, size), since)
                _, view, rev = watching
                try:
                    # Long: ``leave`` cancels it, and a new round's events reach the
                    # old watch too (then the loop moves on to the new round's view).
                    res = self._store.watch(self._keys.ctl, rev, _WATCH_SPAN, scope=self._life)
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
            except Cancelled:
                return
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

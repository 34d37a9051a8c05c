"""The dynamic rendezvous, written once against the store model (DESIGN.md section 4).

Keys of a run, under ``/elastrun/<run_id>/``:

``nodes/<node>``             bound to the node's lease: the node is alive
``rounds/<n>/join/<node>``   bound to the lease: the node asks to be in round n
``rounds/<n>/result``        the closed round: its members in group-rank order
``rounds/<n>/failed``        the first node whose worker failed in round n
``rounds/<n>/master``        MASTER_ADDR/PORT of round n, chosen by its rank 0
``rounds/<n>/done/<node>``   exit barrier of round n
``current``                  the newest closed round
``budget``                   failure restarts used by the whole job
``closed``                   why the run ended; late agents are refused

Every node writes O(1) keys per round, and liveness costs no writes at all (a lease
keep-alive), so a round is O(nodes) and no blob is rewritten by heartbeats. Changes are
seen through one watch on the run's prefix; nothing polls.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from elastrun.core.clock import SYSTEM_CLOCK, Clock, Deadline
from elastrun.core.errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousTimeoutError,
    StoreCompactedError,
    StoreError,
)
from elastrun.rendezvous.api import (
    MemberInfo,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
)
from elastrun.rendezvous.decide import Joiner, Verdict, decide_round, needs_reformation
from elastrun.rendezvous.local import free_port
from elastrun.store.api import Store

log = logging.getLogger("elastrun.rendezvous")

PROGRESS_EVERY = 5.0


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
        self._prefix = f"/elastrun/{settings.run_id}/"
        self._lease: int | None = None
        self._round: int | None = None
        self._members: tuple[str, ...] = ()
        self._rank: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._callback: Callable[[], None] | None = None
        self._reform = False
        self._lost = False
        #: Why the running round must re-form (for the agent's log line).
        self.change_reason = ""
        #: Why ``report_failure`` refused a restart other than an exhausted budget.
        self.refusal: str | None = None

    # -- torch-compatible surface ------------------------------------------------------

    def get_backend(self) -> str:
        return self._backend

    def get_run_id(self) -> str:
        return self._settings.run_id

    @property
    def settings(self) -> RendezvousSettings:
        return self._settings

    def is_closed(self) -> bool:
        return self._get("closed") is not None

    def set_closed(self, reason: str = "closed") -> None:
        self._store.compare_set(self._key("closed"), None, reason.encode())

    def num_nodes_waiting(self) -> int:
        """1 when the running round must re-form (nodes waiting, lost, or a failure)."""
        return 1 if (self._reform or self._lost) else 0

    def shutdown(self) -> bool:
        """Close the run (once a job ends, late agents are refused) and leave.

        The node that serves the store waits (up to ``close_timeout``) for the other
        nodes to leave before its store goes away under them.
        """
        closed = _bounded(lambda: self.set_closed("finished"), self._settings.close_timeout)
        if not closed:
            log.warning("could not close the rendezvous (the store is unreachable)")
        if self._hosting and closed:
            self._wait_for_others_to_leave()
        self.leave()
        return closed

    def _wait_for_others_to_leave(self) -> None:
        deadline = Deadline.after(self._settings.close_timeout, self._clock)
        mine = self._key(f"nodes/{self._node.node_id}")
        try:
            while True:
                found, rev = self._store.get_prefix(self._key("nodes/"))
                others = [k for k in found if k != mine]
                if not others or deadline.expired():
                    if others:
                        log.warning(
                            "%d node(s) still attached to the store; closing it", len(others)
                        )
                    return
                self._store.watch(self._key("nodes/"), rev, min(deadline.remaining(), 5.0))
        except StoreError as exc:
            log.debug("while waiting for the other nodes to leave: %s", exc)

    def leave(self) -> None:
        """Stop watching, revoke the lease (our keys vanish at once), close the store."""
        self._stop.set()
        lease, self._lease = self._lease, None
        if lease is not None:
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
        raw = self._get("budget")
        return int(raw) if raw else 0

    def report_failure(self, max_restarts: int) -> bool:
        """A local worker failed in the current round: take one restart from the job's
        budget, once per round however many nodes see the failure. Returns False (and
        closes the run) when the budget is exhausted.
        """
        assert self._round is not None
        self.refusal = None
        if self._lost:
            self.refusal = "this node was dropped from the run (" + self.change_reason + ")"
            return False
        if not set(self._members) <= self._live_nodes():
            # A member is gone: the failure is the loss of a node (its peers' collectives
            # broke), which re-forms the group without spending the restart budget.
            return self._open_or_refuse()
        won, _ = self._store.compare_set(
            self._key(f"rounds/{self._round}/failed"), None, self._node.node_id.encode()
        )
        if not won:
            return self._open_or_refuse()
        used = self._store.add(self._key("budget"), 1)
        if used > max_restarts:
            self.set_closed("restart budget exhausted")
            return False
        return True

    def _open_or_refuse(self) -> bool:
        raw = self._get("closed")
        if raw is None:
            return True
        self.refusal = f"the run has ended on another node: {raw.decode(errors='replace')}"
        return False

    def exit_barrier(self, timeout: float) -> bool:
        """Wait (up to ``timeout``) until every member of the round finished."""
        if self._round is None or len(self._members) <= 1:
            return True
        done = f"rounds/{self._round}/done/"
        self._store.set(self._key(done + self._node.node_id), b"1", lease=self._lease)
        deadline = Deadline.after(timeout, self._clock)
        while True:
            found, rev = self._store.get_prefix(self._key(done))
            if len(found) >= len(self._members) or self.is_closed():
                return True
            if deadline.expired():
                log.warning("exit barrier timed out after %.0fs", timeout)
                return False
            self._store.watch(self._key(done), rev, min(deadline.remaining(), 5.0))

    # -- joining -------------------------------------------------------------------------

    def next_rendezvous(self) -> RendezvousInfo:
        try:
            return self._next_rendezvous()
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
            members = self._join_round(target, prev_rank, deadline)
            if self._node.node_id in members:
                break
            target += 1  # a spare: wait for room in the next round
        return self._enter_round(target, members)

    def _first_target(self, prev_round: int | None) -> int:
        current = self._get("current")
        latest = int(current) if current is not None else -1
        return max(latest, prev_round if prev_round is not None else -1) + 1

    def _join_round(self, n: int, prev_rank: int | None, deadline: float) -> tuple[str, ...]:
        me = self._node
        info = {"addr": me.addr, "role": me.role, "local_world_size": me.local_world_size}
        self._store.set(
            self._key(f"rounds/{n}/join/{me.node_id}"),
            _dump({**info, "prev_rank": prev_rank}),
            lease=self._lease,
        )
        previous = self._previous_members(n)
        call_started: float | None = None
        next_progress = self._clock.monotonic()
        while True:
            if self.is_closed():
                raise self._closed_error()
            result = _load(self._get(f"rounds/{n}/result"))
            if isinstance(result, dict):
                return tuple(result["members"])
            joins, rev = self._store.get_prefix(self._key(f"rounds/{n}/join/"))
            joiners = self._joiners(joins)
            alive = self._live_nodes()
            prev_live = set(previous) & alive
            now = self._clock.monotonic()
            enough = len(joiners) >= self._settings.min_nodes
            started = n == 0 or bool(prev_live & {j.node_id for j in joiners})
            if call_started is None and enough and started:
                call_started = now
            decision = decide_round(
                joiners, prev_live, min_nodes=self._settings.min_nodes,
                max_nodes=self._settings.max_nodes, now=now, call_started_at=call_started,
                last_call=self._settings.last_call_timeout, join_deadline=deadline,
                first_round=n == 0,
            )  # fmt: skip
            if decision.verdict is Verdict.CLOSE:
                self._close_round(n, decision.members, joins)
                continue
            if decision.verdict is Verdict.TIMEOUT:
                raise RendezvousTimeoutError(
                    f"rendezvous round {n} timed out after {self._settings.join_timeout:.0f}s "
                    f"with {len(joiners)} node(s); at least {self._settings.min_nodes} needed"
                )
            if now >= next_progress:
                self._progress(n, len(joiners), decision.wake_at, deadline, now, started)
                next_progress = now + PROGRESS_EVERY
            wait = PROGRESS_EVERY
            if decision.wake_at is not None:
                wait = min(wait, max(0.0, decision.wake_at - now) + 0.01)
            self._watch_once(rev, wait)

    def _watch_once(self, rev: int, wait: float) -> None:
        try:
            self._store.watch(self._prefix, rev, wait)
        except StoreCompactedError:
            pass  # re-read everything on the next pass

    def _progress(
        self, n: int, count: int, wake_at: float | None, deadline: float, now: float, started: bool
    ) -> None:
        s = self._settings
        if not started:
            log.info(
                "waiting as a spare for round %d: the job runs at its maximum of %d node(s)",
                n, s.max_nodes,
            )  # fmt: skip
            return
        parts = [f"rendezvous round {n}: {count} node(s) in (min {s.min_nodes}, max {s.max_nodes})"]
        if count >= s.min_nodes and wake_at is not None:
            parts.append(f"last call ends in {max(0.0, wake_at - now):.0f}s")
        else:
            parts.append(f"timeout in {max(0.0, deadline - now):.0f}s")
        log.info("%s", "; ".join(parts))

    def _joiners(self, joins: dict[str, bytes]) -> list[Joiner]:
        out = []
        prefix_len = len(self._prefix)
        for key, raw in joins.items():
            node_id = key[prefix_len:].split("/", 3)[3]
            data = _load(raw)
            prev = data.get("prev_rank") if isinstance(data, dict) else None
            out.append(Joiner(node_id, 0, prev if isinstance(prev, int) else None))
        # Sorted by id so that every node computes the same membership from the same keys.
        return sorted(out, key=lambda j: j.node_id)

    def _live_nodes(self) -> set[str]:
        found, _ = self._store.get_prefix(self._key("nodes/"))
        cut = len(self._key("nodes/"))
        return {k[cut:] for k in found}

    def _previous_members(self, n: int) -> tuple[str, ...]:
        if n == 0:
            return ()
        result = _load(self._get(f"rounds/{n - 1}/result"))
        return tuple(result["members"]) if isinstance(result, dict) else ()

    def _close_round(self, n: int, members: tuple[str, ...], joins: dict[str, bytes]) -> None:
        prefix = self._key(f"rounds/{n}/join/")
        details = {m: _load(joins.get(prefix + m)) for m in members}
        won, _ = self._store.compare_set(
            self._key(f"rounds/{n}/result"),
            None,
            _dump({"members": list(members), "nodes": details}),
        )
        if won:
            self._store.set(self._key("current"), str(n).encode())
            log.info("rendezvous round %d closed with %d node(s)", n, len(members))

    def _enter_round(self, n: int, members: tuple[str, ...]) -> RendezvousInfo:
        result = _load(self._get(f"rounds/{n}/result"))
        assert isinstance(result, dict)
        nodes = result.get("nodes", {})
        infos = tuple(
            MemberInfo(m, nodes[m]["addr"], nodes[m]["role"], int(nodes[m]["local_world_size"]))
            for m in members
        )
        rank = members.index(self._node.node_id)
        with self._lock:
            self._round, self._members, self._rank = n, members, rank
            self._reform = False
        master = self._master(n, rank)
        self._start_watch()
        return RendezvousInfo(self._store, rank, len(members), master, round=n, members=infos)

    def _master(self, n: int, rank: int) -> RendezvousStoreInfo:
        key = f"rounds/{n}/master"
        if rank == 0:
            self._store.set(self._key(key), _dump({"addr": self._node.addr, "port": free_port()}))
        self._store.wait([self._key(key)], self._settings.join_timeout)
        data = _load(self._get(key))
        assert isinstance(data, dict)
        return RendezvousStoreInfo(str(data["addr"]), int(data["port"]))

    # -- liveness and watching -----------------------------------------------------------

    def _register(self) -> None:
        if self._lease is not None and not self._lost:
            return
        if self.is_closed():
            raise self._closed_error()
        self._lost = False
        self._lease = self._store.grant_lease(self._settings.heartbeat_timeout)
        me = self._node
        self._store.set(
            self._key(f"nodes/{me.node_id}"),
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
        answer.append(self._store.keep_alive(lease))

    def _mark_lost(self, reason: str) -> None:
        log.warning("%s", reason)
        self.change_reason = reason
        self._lost = True
        self._notify()

    def _start_watch(self) -> None:
        if not any(t.name.endswith("watch") for t in self._threads):
            self._spawn(self._watch_loop, "watch")

    def _watch_loop(self) -> None:
        rev = 0
        while not self._stop.is_set():
            try:
                if self._check_reform():
                    self._notify()
                # An empty prefix read returns the store's current revision: watch from there.
                _, rev = self._store.get_prefix(self._key("rounds/none/"))
                while not self._stop.is_set():
                    res = self._store.watch(self._prefix, rev, 1.0)
                    rev = res.revision
                    if res.events and self._check_reform():
                        self._notify()
            except StoreCompactedError as exc:
                # The store dropped old history (etcd auto-compaction): re-read from now.
                log.debug("rendezvous watch resumes after compaction: %s", exc)
            except StoreError as exc:
                if not self._stop.is_set():
                    log.warning("rendezvous watch interrupted: %s", exc)
                    self._stop.wait(1.0)

    def _check_reform(self) -> bool:
        with self._lock:
            n, members = self._round, self._members
        if n is None or self._reform:
            return self._reform
        joins, _ = self._store.get_prefix(self._key(f"rounds/{n + 1}/join/"))
        cut = len(self._key(f"rounds/{n + 1}/join/"))
        next_joiners = {k[cut:]: 0 for k in joins}
        failed = self._get(f"rounds/{n}/failed") is not None
        closed = self.is_closed()
        alive = self._live_nodes()
        if needs_reformation(
            members, alive, next_joiners,
            max_nodes=self._settings.max_nodes,
            round_failed=failed or closed,
        ):  # fmt: skip
            lost = [m for m in members if m not in alive]
            if closed:
                self.change_reason = "the run was closed by another node"
            elif failed:
                self.change_reason = "a worker failed on another node"
            elif lost:
                self.change_reason = f"lost {len(lost)} node(s): {', '.join(lost)}"
            else:
                self.change_reason = "new node(s) are waiting to join"
            self._reform = True
        return self._reform

    def _notify(self) -> None:
        if self._callback is not None:
            self._callback()

    # -- helpers ---------------------------------------------------------------------------

    def _key(self, suffix: str) -> str:
        return self._prefix + suffix

    def _get(self, suffix: str) -> bytes | None:
        return self._store.get(self._key(suffix))

    def _closed_error(self) -> RendezvousClosedError:
        raw = self._get("closed") or b"closed"
        return RendezvousClosedError(
            f"run {self._settings.run_id!r} has ended ({raw.decode(errors='replace')}); "
            "it accepts no more nodes"
        )

    def __repr__(self) -> str:
        return (
            f"DynamicRendezvousHandler(run_id={self._settings.run_id!r}, "
            f"node={self._node.node_id!r}, round={self._round}, rank={self._rank})"
        )

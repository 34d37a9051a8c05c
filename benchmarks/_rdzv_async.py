"""An asyncio participant of elastrun's dynamic rendezvous, for thousands of simulated nodes.

``elastrun.rendezvous.dynamic.DynamicRendezvousHandler`` is synchronous and costs two
threads and a store connection per node, which a 2-core machine cannot multiply by
thousands. This class drives the very same joining protocol (``rendezvous.joining``, a
generator of store operations) with coroutines instead of blocking calls, and keeps a
running round with the same pure views (``RoundWatch``). Each simulated node has its own
store connection and lease, so every one is a full participant as far as the server and
the other nodes can tell.

The keep-alive and the running round's watch are written here again as tasks (they are
loops around one store call each), with the handler's split (``rendezvous.liveness``):
the round's closer follows ``ctl/`` and decides the next round ahead
(``closing.decide_ahead``); every other member watches only the closer's claim and the
call under it. Progress notes of the protocol are not shown.
``protocol_traces()`` runs both participants side by side on a memory store and returns
the operations each issued, so a test can pin that they agree.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from elastrun.core.clock import SYSTEM_CLOCK
from elastrun.core.errors import (
    LeaseExpiredError,
    RendezvousClosedError,
    RendezvousError,
    StoreCompactedError,
    StoreError,
)
from elastrun.rendezvous import joining
from elastrun.rendezvous.keys import RunKeys
from elastrun.rendezvous.liveness import WATCH_SPAN
from elastrun.rendezvous.local import free_port
from elastrun.rendezvous.members import page_count, page_entries, page_of
from elastrun.rendezvous.quiet import (
    DEPUTY_GRACE,
    Watchers,
    closer_news,
    closer_state,
    deputy_pause,
)
from elastrun.rendezvous.running import RoundWatch
from elastrun.rendezvous.settings import NodeDesc, RendezvousSettings
from elastrun.store.api import EventKind


def _dump(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True).encode()


def _load(raw: bytes | None) -> object:
    return None if raw is None else json.loads(raw)


class AsyncNode:
    """One node's side of the dynamic rendezvous, over an async store (``AsyncStore``).

    ``next_rendezvous()`` returns ``(round, rank, world size)``; ``changed`` is set when the
    running round must re-form (what the handler's change callback reports).
    """

    def __init__(self, store: Any, settings: RendezvousSettings, node: NodeDesc) -> None:
        self._store = store
        self._settings = settings
        self._node = node
        self._keys = RunKeys(f"/elastrun/{settings.run_id}/")
        self._lease: int | None = None
        self._acked_at: float | None = None
        self._round: int | None = None
        self._rank: int | None = None
        self._size = 0
        self._decision = ""
        self._membership: dict[str, bool] = {}
        self._since = 0
        self._all_live = False
        self._watchers = Watchers()
        self._called: joining.Called | None = None
        self._ahead_idle = asyncio.Event()
        self._ahead_idle.set()
        self._reform = False
        self._lost = False
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._entered = asyncio.Event()
        self.changed = asyncio.Event()
        self.seen = 0  # joiners seen in the last decision, when this node was the closer
        self.waiting = False  # joined and waiting for the result (for the settling)
        self.joined = asyncio.Event()  # set once this node first waits for a result
        self.t_notice: float | None = None

    @property
    def node_id(self) -> str:
        return self._node.node_id

    @property
    def role(self) -> str:
        """What this node is in its round: its ``closer``, its ``deputy`` or a member."""
        me = self.node_id
        w = self._watchers
        return "closer" if w.closer == me else "deputy" if w.deputy == me else "member"

    # -- joining -------------------------------------------------------------------------

    async def next_rendezvous(self) -> tuple[int, int, int]:
        await self._ahead_idle.wait()  # as the handler: after deciding ahead, if it does
        await self._register()
        prev_round, prev_rank = self._round, self._rank
        self._reform = False
        self.changed.clear()
        called, self._called = self._called, None
        try:
            try:
                protocol = joining.join(self._context(), prev_round, prev_rank, None, called)
                joined = await self._drive(protocol)
            except LeaseExpiredError:  # as the handler: a fresh lease, and join again
                self._lost = True
                await self._register()
                joined = await self._drive(joining.join(self._context(), prev_round, prev_rank))
        finally:
            self.waiting = False
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
            clock=SYSTEM_CLOCK,
            new_port=free_port,
        )

    async def _drive(self, protocol: joining.Protocol) -> Any:
        """``joining.drive`` with each store operation awaited."""
        value: Any = None
        error: BaseException | None = None
        while not isinstance(op := joining.advance(protocol, value, error), joining.Finished):
            try:
                value, error = await self._perform(op), None
            except Exception as exc:  # thrown into the protocol, as the handler does
                value, error = None, exc
        return op.value

    async def _perform(self, op: joining.Op) -> Any:
        store = self._store
        match op:
            case joining.Get(key):
                return await store.get(key)
            case joining.GetPrefix(prefix):
                return await store.get_prefix(prefix)
            case joining.Put(key, value, leased):
                return await store.set(key, value, lease=self._lease if leased else None)
            case joining.ReadAll(reads):  # sent at once, answered together
                # Called here, in this task, so that the recording store sees the reads.
                calls = [
                    store.get(r.key) if isinstance(r, joining.Get) else store.get_prefix(r.prefix)
                    for r in reads
                ]
                return list(await asyncio.gather(*calls))
            case joining.PutAll(items):  # sent at once, answered together
                await asyncio.gather(*[store.set(key, value) for key, value in items])
                return None
            case joining.CompareSet(key, expected, value, leased):
                lease = self._lease if leased else None
                return await store.compare_set(key, expected, value, lease=lease)
            case joining.Watch(prefix, after, timeout):
                self.waiting = True  # joined: what the settling counts
                self.joined.set()
                return await store.watch(prefix, after, timeout)
            case joining.Wait(keys, timeout):
                return await store.wait(list(keys), timeout)
            case joining.Seen(_, joined):
                self.seen = joined
        return None  # progress notes: not shown for simulated nodes

    async def _decided_rows(self, n: int, decision: str | None = None) -> list[list[Any]]:
        rows = await self._drive(joining.decided_rows(self._context(), n, decision))
        assert isinstance(rows, list)
        return rows

    async def _is_member(self, node: str) -> bool:
        known = self._membership.get(node)
        if known is not None or self._round is None:
            return bool(known)
        n = self._round
        key = self._keys.members(n, self._decision, page_of(node, page_count(self._size)))
        entries = page_entries(await self._store.get(key))
        if self._round == n:
            self._membership.update(dict.fromkeys(entries, True))
            self._membership.setdefault(node, False)
        return node in entries

    def _enter_round(self, joined: joining.Joined) -> tuple[int, int, int]:
        n, rank, result = joined.n, joined.rank, joined.result
        decision, size = str(result["id"]), int(result["size"])
        for _role, lws, count in result.get("shape", ()):  # what the handler's shape holds
            int(lws), int(count)
        self._round, self._rank, self._size, self._decision = n, rank, size, decision
        self._membership = {self._node.node_id: True}
        self._since = int(result.get("rev", 0))
        self._all_live = bool(result.get("all_live"))
        self._watchers = Watchers.of(result)
        self._reform = False
        self._entered.set()
        self._start_watch()
        return n, rank, size

    # -- liveness and watching -----------------------------------------------------------

    async def is_closed(self) -> bool:
        return await self._store.get(self._keys.closed) is not None

    async def _register(self) -> None:
        if self._lease is not None and not self._lost:
            # As the handler's ``Liveness.renew``: a recent acknowledgement suffices.
            acked = self._acked_at
            if (
                acked is not None
                and time.monotonic() - acked < self._settings.heartbeat_timeout / 3
            ):
                return
            if await self._store.keep_alive(self._lease):
                self._acked_at = time.monotonic()
                return
            self._lost = True
        if await self.is_closed():
            raise RendezvousClosedError(f"run {self._settings.run_id!r} has ended")
        self._lost = False
        self._lease = await self._store.grant_lease(self._settings.heartbeat_timeout)
        self._acked_at = time.monotonic()
        me = self._node
        await self._store.set(
            self._keys.nodes + me.node_id,
            _dump({"addr": me.addr, "role": me.role, "local_world_size": me.local_world_size}),
            lease=self._lease,
        )
        if not self._tasks:
            self._spawn(self._keep_alive_loop())

    def _spawn(self, coro: Any) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(coro))

    async def _keep_alive_loop(self) -> None:
        interval = self._settings.heartbeat_timeout / 3
        while not self._stopping:
            await asyncio.sleep(interval)
            lease = self._lease
            if lease is None:
                continue
            try:
                alive = await self._store.keep_alive(lease)
            except StoreError:
                continue
            if alive:
                self._acked_at = time.monotonic()
            else:
                self._lost = True
                self._notify()

    def _start_watch(self) -> None:
        if len(self._tasks) < 2:
            self._spawn(self._watch_loop())

    async def _watch_loop(self) -> None:
        watching: tuple[int, RoundWatch, int] | None = None
        quiet: tuple[int, int] | None = None
        while not self._stopping:
            n, size, since, watchers = self._round, self._size, self._since, self._watchers
            if n is None or self._reform:
                self._entered.clear()
                await self._entered.wait()
                continue
            try:
                if watchers.quiet(self.node_id):
                    rev = quiet[1] if quiet is not None and quiet[0] == n else since
                    quiet = (n, await self._follow_closer(n, size, watchers, rev))
                    continue
                if watching is None or watching[0] != n:
                    watching = (n, self._round_watch(n, size), since)
                _, view, rev = watching
                try:
                    res = await self._store.watch(self._keys.ctl, rev, WATCH_SPAN)
                except StoreCompactedError:
                    view = self._round_watch(n, size)
                    watching = (n, view, await self._reload(view, n))
                    continue
                await self._learn_members(res.events, n, view)
                view.apply(res.events)
                watching = (n, view, res.revision)
                await self._learn_members((), n, view, view.next_joiners)
                reason = view.reason()
                if reason is not None and self._round == n and not self._reform:
                    self._reform = True
                    ahead = watchers.watches(self.node_id)
                    if ahead:
                        self._ahead_idle.clear()
                    self._notify()
                    if ahead:
                        defer = watchers.defer(self.node_id, view.lost)
                        joins = self.node_id not in view.excluded | view.finished
                        await self._decide_ahead(n, reason, joins, defer)
            except StoreError:
                if not self._stopping:
                    await asyncio.sleep(1.0)

    async def _decide_ahead(self, n: int, why: str, joins: bool, defer: float) -> None:
        try:
            ctx = self._context()
            protocol = joining.decide_ahead(ctx, n + 1, self._rank, why, joins=joins, defer=defer)
            await self._drive(protocol)
        except (StoreError, RendezvousError):
            pass  # its own join goes on as usual
        finally:
            self._ahead_idle.set()

    async def _follow_closer(self, n: int, size: int, watchers: Watchers, rev: int) -> int:
        """As ``quiet.follow_closer``: one watch of the closer's claim and its call."""
        k, closer = self._keys, watchers.closer
        assert closer is not None
        span, gone, waited = WATCH_SPAN, False, False
        while True:
            try:
                res = await self._store.watch(k.closer(n), rev, span)
            except StoreCompactedError:
                found, rev = await self._store.get_prefix(k.closer(n))
                call, ended = closer_state(k, n, found)
            else:
                rev = res.revision
                call, ended = closer_news(k, n, res.events)
            gone = gone or ended
            if call is not None:
                self._called = joining.Called.of(k, n + 1, call)
                self._flag(n)
                return int(rev)
            if not gone:
                return int(rev)
            if not waited and (pause := deputy_pause(watchers, size)) is not None:
                await asyncio.sleep(pause)
                span, waited = DEPUTY_GRACE, True
                continue
            if await self._store.get(k.done(n) + closer) is None:
                self._flag(n)
            return int(rev)

    def _flag(self, n: int) -> None:
        if self._round == n and not self._reform:
            self._reform = True
            self._notify()

    def _round_watch(self, n: int, size: int) -> RoundWatch:
        # The handler's is_member reads the store from the watch thread; here the same
        # reads happen first (``_learn_members``), so the view finds them remembered.
        return RoundWatch(
            self._keys, n, size, self._settings.max_nodes,
            lambda node: bool(self._membership.get(node)), all_live=self._all_live,
        )  # fmt: skip

    async def _learn_members(self, events: Any, n: int, view: RoundWatch, nodes: Any = ()) -> None:
        # The pages the view will ask about: none for a node ``all_live`` answers for.
        arrived = set(view.arrived)
        wanted = []
        for e in events:
            if not e.key.startswith(self._keys.nodes):
                continue
            node = e.key[len(self._keys.nodes) :]
            if e.kind is EventKind.PUT:
                arrived.add(node)
            elif not (view.all_live and node not in arrived):
                wanted.append(node)
        for node in [*wanted, *nodes]:
            if self._round == n and not (view.all_live and node not in arrived):
                await self._is_member(node)

    async def _reload(self, view: RoundWatch, n: int) -> int:
        k = self._keys
        rev: int  # the store's revision (the store is duck-typed: Any)
        nodes, rev = await self._store.get_prefix(k.nodes)
        joins, _ = await self._store.get_prefix(k.join_prefix(n + 1))
        done, _ = await self._store.get_prefix(k.done(n))
        failed = await self._store.get(k.failed(n)) is not None
        members = [str(row[0]) for row in await self._decided_rows(n, self._decision)]
        view.load(members, list(nodes), list(joins), failed, await self.is_closed(), list(done))
        return rev

    async def _check_reform(self) -> bool:
        """The handler's full-read check (what ``protocol_traces`` compares)."""
        n = self._round
        if n is None or self._reform:
            return self._reform
        view = self._round_watch(n, self._size)
        await self._reload(view, n)
        if view.reason() is not None:
            self._reform = True
            self._notify()
        return self._reform

    def _notify(self) -> None:
        if self.t_notice is None:
            self.t_notice = time.time()
        self.changed.set()

    async def stop(self) -> None:
        self._stopping = True
        self._entered.set()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def __repr__(self) -> str:
        return f"AsyncNode({self._node.node_id!r}, round={self._round}, rank={self._rank})"


# --------------------------------------------------------------------------- faithfulness


Trace = list[tuple[str, str, str]]


_DECISION_ID = re.compile(r'(/members/|"id": ")[0-9a-f]{12}')


def _norm(text: str) -> str:
    # A decision id is random: equal in kind, not in value.
    return _DECISION_ID.sub(r"\1<id>", text)


def _value(op: str, key: str, value: object) -> str:
    # The master port is a freshly chosen free port: equal in kind, not in value.
    if isinstance(value, bytes) and not key.endswith("/master"):
        return _norm(value.decode(errors="replace"))
    return ""


class _SyncRecorder:
    """A ``Store`` that records the operations of one thread, then delegates."""

    def __init__(self, inner: Any, trace: Trace) -> None:
        self._inner = inner
        self._trace = trace
        self.thread: int | None = None

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._inner, name)

        def call(*args: Any, **kw: Any) -> Any:
            if threading.get_ident() == self.thread:
                key = args[0] if args and isinstance(args[0], str) else repr(args[0])
                val = args[2] if name == "compare_set" else args[1] if name == "set" else None
                self._trace.append((name, _norm(key), _value(name, key, val)))
            return method(*args, **kw)

        return call


class _AsyncRecorder:
    """An async store over a ``MemoryStore``, recording the operations of one task."""

    def __init__(self, inner: Any, trace: Trace) -> None:
        self._inner = inner
        self._trace = trace
        self.task: asyncio.Task[Any] | None = None

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._inner, name)

        def call(*args: Any, **kw: Any) -> Any:
            # Recorded when called, not when awaited: a batch is awaited in other tasks.
            if asyncio.current_task() is self.task:
                key = args[0] if args and isinstance(args[0], str) else repr(args[0])
                val = args[2] if name == "compare_set" else args[1] if name == "set" else None
                self._trace.append((name, _norm(key), _value(name, key, val)))
            return perform(*args, **kw)

        async def perform(*args: Any, **kw: Any) -> Any:
            if name in ("watch", "wait"):
                return await asyncio.to_thread(method, *args, **kw)
            return method(*args, **kw)

        return call


def protocol_traces() -> tuple[Trace, Trace]:
    """The store operations of one node's first rendezvous and of one re-formation check,
    from the real handler and from ``AsyncNode``, each on a fresh memory store."""
    from elastrun.rendezvous.dynamic import DynamicRendezvousHandler
    from elastrun.store.memory import MemoryStore

    settings = RendezvousSettings("trace", 1, 1, join_timeout=10, last_call_timeout=1)
    node = NodeDesc("127.0.0.1_1_abcdef", "127.0.0.1", "default", 1)

    real: Trace = []
    sync_store = _SyncRecorder(MemoryStore(), real)
    sync_store.thread = threading.get_ident()
    handler = DynamicRendezvousHandler(sync_store, settings, node)
    try:
        handler.next_rendezvous()
        handler._check_reform()  # what the watch thread runs on every change
    finally:
        sync_store.thread = None
        handler.leave()

    mirrored: Trace = []

    async def go() -> None:
        store = _AsyncRecorder(MemoryStore(), mirrored)
        store.task = asyncio.current_task()
        anode = AsyncNode(store, settings, node)
        try:
            await anode.next_rendezvous()
            await anode._check_reform()
        finally:
            store.task = None
            await anode.stop()

    asyncio.run(go())
    return real, mirrored

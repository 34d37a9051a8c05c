"""An asyncio participant of elastrun's dynamic rendezvous, for thousands of simulated nodes.

``elastrun.rendezvous.dynamic.DynamicRendezvousHandler`` is synchronous and costs two
threads and a store connection per node, which a 2-core machine cannot multiply by
thousands. This class is the same participant written as coroutines: the same keys, the
same store operations in the same order, the same JSON values, and the very same pure
decisions (``decide_round``, ``needs_reformation`` and, through them, ``order_members``)
imported from the package. Each simulated node has its own store connection and lease,
so every one is a full participant as far as the server and the other nodes can tell.

It mirrors only what a rendezvous does with the store; progress logging is left out (it
reads nothing). ``protocol_traces()`` runs both implementations side by side on a
memory store and returns the operations each issued, so a test can pin that they agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable
from typing import Any

from elastrun.core.errors import (
    RendezvousClosedError,
    RendezvousTimeoutError,
    StoreCompactedError,
    StoreError,
)
from elastrun.rendezvous.decide import Joiner, Verdict, decide_round, needs_reformation
from elastrun.rendezvous.dynamic import PROGRESS_EVERY, NodeDesc, RendezvousSettings
from elastrun.rendezvous.local import free_port


def _dump(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True).encode()


def _load(raw: bytes | None) -> object:
    return None if raw is None else json.loads(raw)


class AsyncNode:
    """One node's side of the dynamic rendezvous, over an async store (``AsyncStore``).

    ``next_rendezvous()`` returns ``(round, rank, members)``; ``changed`` is set when the
    running round must re-form (what the handler's change callback reports).
    """

    def __init__(self, store: Any, settings: RendezvousSettings, node: NodeDesc) -> None:
        self._store = store
        self._settings = settings
        self._node = node
        self._prefix = f"/elastrun/{settings.run_id}/"
        self._lease: int | None = None
        self._round: int | None = None
        self._members: tuple[str, ...] = ()
        self._rank: int | None = None
        self._reform = False
        self._lost = False
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self.changed = asyncio.Event()
        self.seen = 0  # joiners seen in the last decision (for the benchmark's settling)
        self.t_notice: float | None = None

    @property
    def node_id(self) -> str:
        return self._node.node_id

    # -- joining -------------------------------------------------------------------------

    async def next_rendezvous(self) -> tuple[int, int, tuple[str, ...]]:
        await self._register()
        prev_round, prev_rank = self._round, self._rank
        self._reform = False
        self.changed.clear()
        deadline = time.monotonic() + self._settings.join_timeout
        target = await self._first_target(prev_round)
        while True:
            members = await self._join_round(target, prev_rank, deadline)
            if self._node.node_id in members:
                break
            target += 1
        return await self._enter_round(target, members)

    async def _first_target(self, prev_round: int | None) -> int:
        current = await self._get("current")
        latest = int(current) if current is not None else -1
        return max(latest, prev_round if prev_round is not None else -1) + 1

    async def _join_round(self, n: int, prev_rank: int | None, deadline: float) -> tuple[str, ...]:
        me = self._node
        info = {"addr": me.addr, "role": me.role, "local_world_size": me.local_world_size}
        await self._store.set(
            self._key(f"rounds/{n}/join/{me.node_id}"),
            _dump({**info, "prev_rank": prev_rank}),
            lease=self._lease,
        )
        previous = await self._previous_members(n)
        call_started: float | None = None
        while True:
            if await self.is_closed():
                raise RendezvousClosedError(f"run {self._settings.run_id!r} has ended")
            result = _load(await self._get(f"rounds/{n}/result"))
            if isinstance(result, dict):
                return tuple(result["members"])
            joins, rev = await self._store.get_prefix(self._key(f"rounds/{n}/join/"))
            joiners = self._joiners(joins)
            self.seen = len(joiners)
            alive = await self._live_nodes()
            prev_live = set(previous) & alive
            now = time.monotonic()
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
                await self._close_round(n, decision.members, joins)
                continue
            if decision.verdict is Verdict.TIMEOUT:
                raise RendezvousTimeoutError(f"rendezvous round {n} timed out")
            wait = PROGRESS_EVERY
            if decision.wake_at is not None:
                wait = min(wait, max(0.0, decision.wake_at - now) + 0.01)
            with contextlib.suppress(StoreCompactedError):
                await self._store.watch(self._prefix, rev, wait)

    def _joiners(self, joins: dict[str, bytes]) -> list[Joiner]:
        out = []
        prefix_len = len(self._prefix)
        for key, raw in joins.items():
            node_id = key[prefix_len:].split("/", 3)[3]
            data = _load(raw)
            prev = data.get("prev_rank") if isinstance(data, dict) else None
            out.append(Joiner(node_id, 0, prev if isinstance(prev, int) else None))
        return sorted(out, key=lambda j: j.node_id)

    async def _live_nodes(self) -> set[str]:
        found, _ = await self._store.get_prefix(self._key("nodes/"))
        cut = len(self._key("nodes/"))
        return {k[cut:] for k in found}

    async def _previous_members(self, n: int) -> tuple[str, ...]:
        if n == 0:
            return ()
        result = _load(await self._get(f"rounds/{n - 1}/result"))
        return tuple(result["members"]) if isinstance(result, dict) else ()

    async def _close_round(self, n: int, members: tuple[str, ...], joins: dict[str, bytes]) -> None:
        prefix = self._key(f"rounds/{n}/join/")
        details = {m: _load(joins.get(prefix + m)) for m in members}
        won, _ = await self._store.compare_set(
            self._key(f"rounds/{n}/result"),
            None,
            _dump({"members": list(members), "nodes": details}),
        )
        if won:
            await self._store.set(self._key("current"), str(n).encode())

    async def _enter_round(
        self, n: int, members: tuple[str, ...]
    ) -> tuple[int, int, tuple[str, ...]]:
        result = _load(await self._get(f"rounds/{n}/result"))
        assert isinstance(result, dict)
        nodes = result.get("nodes", {})
        for m in members:  # what the handler builds its MemberInfo tuple from
            int(nodes[m]["local_world_size"])
        rank = members.index(self._node.node_id)
        self._round, self._members, self._rank = n, members, rank
        self._reform = False
        await self._master(n, rank)
        self._start_watch()
        return n, rank, members

    async def _master(self, n: int, rank: int) -> tuple[str, int]:
        key = f"rounds/{n}/master"
        if rank == 0:
            await self._store.set(
                self._key(key), _dump({"addr": self._node.addr, "port": free_port()})
            )
        await self._store.wait([self._key(key)], self._settings.join_timeout)
        data = _load(await self._get(key))
        assert isinstance(data, dict)
        return str(data["addr"]), int(data["port"])

    # -- liveness and watching -----------------------------------------------------------

    async def is_closed(self) -> bool:
        return await self._get("closed") is not None

    async def _register(self) -> None:
        if self._lease is not None and not self._lost:
            return
        if await self.is_closed():
            raise RendezvousClosedError(f"run {self._settings.run_id!r} has ended")
        self._lost = False
        self._lease = await self._store.grant_lease(self._settings.heartbeat_timeout)
        me = self._node
        await self._store.set(
            self._key(f"nodes/{me.node_id}"),
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
            if not alive:
                self._lost = True
                self._notify()

    def _start_watch(self) -> None:
        if len(self._tasks) < 2:
            self._spawn(self._watch_loop())

    async def _watch_loop(self) -> None:
        rev = 0
        while not self._stopping:
            try:
                if await self._check_reform():
                    self._notify()
                _, rev = await self._store.get_prefix(self._key("rounds/none/"))
                while not self._stopping:
                    res = await self._store.watch(self._prefix, rev, 1.0)
                    rev = res.revision
                    if res.events and await self._check_reform():
                        self._notify()
            except StoreError:
                if not self._stopping:
                    await asyncio.sleep(1.0)

    async def _check_reform(self) -> bool:
        n, members = self._round, self._members
        if n is None or self._reform:
            return self._reform
        joins, _ = await self._store.get_prefix(self._key(f"rounds/{n + 1}/join/"))
        cut = len(self._key(f"rounds/{n + 1}/join/"))
        next_joiners = {k[cut:]: 0 for k in joins}
        failed = await self._get(f"rounds/{n}/failed") is not None
        closed = await self.is_closed()
        alive = await self._live_nodes()
        if needs_reformation(
            members, alive, next_joiners,
            max_nodes=self._settings.max_nodes,
            round_failed=failed or closed,
        ):  # fmt: skip
            self._reform = True
        return self._reform

    def _notify(self) -> None:
        if self.t_notice is None:
            self.t_notice = time.time()
        self.changed.set()

    async def stop(self) -> None:
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _key(self, suffix: str) -> str:
        return self._prefix + suffix

    async def _get(self, suffix: str) -> bytes | None:
        result: bytes | None = await self._store.get(self._key(suffix))
        return result

    def __repr__(self) -> str:
        return f"AsyncNode({self._node.node_id!r}, round={self._round}, rank={self._rank})"


# --------------------------------------------------------------------------- faithfulness


Trace = list[tuple[str, str, str]]


def _value(op: str, key: str, value: object) -> str:
    # The master port is a freshly chosen free port: equal in kind, not in value.
    if isinstance(value, bytes) and not key.endswith("/master"):
        return value.decode(errors="replace")
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
                self._trace.append((name, key, _value(name, key, val)))
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

        async def call(*args: Any, **kw: Any) -> Any:
            if asyncio.current_task() is self.task:
                key = args[0] if args and isinstance(args[0], str) else repr(args[0])
                val = args[2] if name == "compare_set" else args[1] if name == "set" else None
                self._trace.append((name, key, _value(name, key, val)))
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
    handler = DynamicRendezvousHandler(sync_store, settings, node)  # type: ignore[arg-type]
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

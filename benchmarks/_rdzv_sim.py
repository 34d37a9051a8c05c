"""A process of simulated rendezvous nodes, driven by ``bench_rendezvous.py``.

``python _rdzv_sim.py --impl IMPL --port P --first I --count K ...`` creates K nodes, each
with its own store connection, and obeys JSON commands on standard input:

``{"cmd": "join"}``       the nodes not held back call ``next_rendezvous()``
``{"cmd": "join-held"}``  the held-back node(s) call it (the "last join" of a trial)
``{"cmd": "rejoin"}``     (torch) every node calls it again, as after a worker failure
``{"cmd": "counters"}``   (elastrun-async) report the requests sent so far, by operation
``{"cmd": "quit"}``       exit at once

and reports JSON events on standard output: ``connected``; ``settled`` (every node that
joined waits for the result, and the closer has seen ``--expect`` joiners); ``ranked``
with, per node, the round, rank, world size and when it called and returned
(``time.time()``) -- once per rendezvous (``k``: 0 for the first, 1 for the re-formation
after a loss).

Implementations:

* ``elastrun-threads``: elastrun's own ``DynamicRendezvousHandler`` over ``TcpStore``,
  a thread per node (plus the handler's and the client's threads);
* ``elastrun-etcd``: the same handler over ``EtcdStore`` (etcd's JSON gateway), a
  thread per node;
* ``elastrun-async``: ``_rdzv_async.AsyncNode`` (the same protocol as coroutines) over
  ``_aiostore.AsyncStore``, all nodes on one event loop;
* ``torch``: torch's ``DynamicRendezvousHandler`` with its ``C10dRendezvousBackend`` over
  a ``TCPStore`` client per node, a thread per node.

elastrun nodes re-form by themselves when they see a member vanish (the handler's
change callback); torch's handler has no such signal, so the driver says ``rejoin``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from _common import raise_fd_limit

_OUT = threading.Lock()

#: Simulated nodes of one process joining at once (see ``_async_main``).
JOINING_AT_ONCE = 256


def emit(obj: dict[str, Any]) -> None:
    with _OUT:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()


Counters = Callable[[], dict[str, float]]


def _no_counters() -> dict[str, float]:
    return {}


def settle_heap() -> None:
    """Freeze what the process holds once its nodes are ranked: the collector then scans
    only what is made after. One process holds thousands of simulated nodes' objects; a
    full collection of them took 0.2-0.25 s of the re-formation's 1.4-2 s at 10,000
    nodes, a pause no real agent (one node's objects) has."""
    gc.collect()
    gc.freeze()


class Book:
    """Results per node and rendezvous; emits ``ranked`` once all nodes have one."""

    def __init__(self, count: int, counters: Counters = _no_counters) -> None:
        self._counters = counters
        self._count = count
        self._lock = threading.Lock()
        self._items: dict[int, list[list[Any]]] = {}

    def add(self, k: int, item: list[Any]) -> None:
        with self._lock:
            items = self._items.setdefault(k, [])
            items.append(item)
            done = len(items) == self._count
        if done:
            if k == 0:
                settle_heap()
            emit({"ev": "ranked", "k": k, "items": items, "counters": self._counters()})


class Settler:
    """Emits ``settled`` once every joining node counts ``expect`` (``settled_count``)."""

    def __init__(
        self,
        seen: Callable[[], list[int]],
        expect: int,
        latency: Callable[[], float] | None = None,
        counters: Counters = _no_counters,
    ) -> None:
        self._counters = counters
        self._latency = latency
        self._seen = seen
        self._expect = expect
        self._armed = threading.Event()

    def arm(self) -> None:
        self._armed.set()

    def run(self, extra_wait: float = 0.0) -> None:
        self._armed.wait()
        next_progress = time.monotonic() + 5.0
        while True:
            counts = self._seen()
            if counts and min(counts) >= self._expect:
                time.sleep(extra_wait)
                emit({"ev": "settled", "counters": self._counters()})
                return
            if time.monotonic() >= next_progress:
                done = sum(1 for c in counts if c >= self._expect)
                low = min(counts) if counts else 0
                lat = self._latency() if self._latency is not None else -1.0
                emit(
                    {
                        "ev": "progress",
                        "settled": done,
                        "of": len(counts),
                        "lowest": low,
                        "max_latency": round(lat, 3),
                    }
                )
                next_progress += 5.0
            # Each look walks every node of this process, holding the interpreter
            # lock that thousands of simulated nodes need: look a few times a second.
            time.sleep(0.02 if len(counts) < 1000 else 0.2)


def settled_count(waiting: bool, seen: int, expect: int) -> int:
    """``expect`` once a node has settled, else what it has seen.

    Only the round's closer follows the joiners (and has ``seen`` > 0); the others have
    settled once they wait for the result. The closer sits in exactly one process, so
    every process settled means the closer has seen every joiner.
    """
    if not waiting:
        return 0
    return expect if seen == 0 else seen


def node_ids(first: int, count: int) -> list[str]:
    # The shape of NodeDesc.create's ids (address, pid, 6 hex digits): realistic sizes.
    return [f"127.0.0.1_{os.getpid()}_{i:06x}" for i in range(first, first + count)]


# --------------------------------------------------------------------------- commands


class Commands:
    """Standard input, read by a thread; each command sets an event."""

    def __init__(self) -> None:
        self.join = threading.Event()
        self.join_held = threading.Event()
        self.rejoin = threading.Event()
        self.t_rejoin: float | None = None
        self.hooks: list[Callable[[str], None]] = []

    def run(self) -> None:
        for line in sys.stdin:
            try:
                cmd = json.loads(line).get("cmd")
            except ValueError:
                continue
            if cmd == "quit":
                break
            if cmd == "join":
                self.join.set()
            elif cmd == "join-held":
                self.join_held.set()
            elif cmd == "rejoin":
                self.t_rejoin = time.time()
                self.rejoin.set()
            for hook in self.hooks:
                hook(cmd)
        sys.stdout.flush()
        os._exit(0)


# --------------------------------------------------------------------------- elastrun threads


def run_elastrun_threads(args: argparse.Namespace, cmds: Commands) -> None:
    from elastrun.rendezvous.dynamic import (
        DynamicRendezvousHandler,
        NodeDesc,
        RendezvousSettings,
    )
    from elastrun.store.etcd import EtcdStore
    from elastrun.store.tcp import TcpStore

    settings = _elastrun_settings(args, RendezvousSettings)
    ids = node_ids(args.first, args.count)
    held = set(ids[len(ids) - args.hold :]) if args.hold else set()
    waiting: set[str] = set()
    out_suffix = "/rounds/0/out/"

    class Counting:
        """Delegates to a store; notes when its node waits for the round's result."""

        def __init__(self, inner: TcpStore | EtcdStore, node: str) -> None:
            self._inner = inner
            self._node = node

        def watch(self, prefix: str, after_revision: int, timeout: float, **options: Any) -> Any:
            if prefix.endswith((out_suffix, "/ctl/")):  # a follower's or the closer's wait
                waiting.add(self._node)
            return self._inner.watch(prefix, after_revision, timeout, **options)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

    handlers = []
    for node_id in ids:
        store: TcpStore | EtcdStore
        if args.impl == "elastrun-etcd":
            store = EtcdStore(f"127.0.0.1:{args.port}", connect_timeout=10, request_timeout=300)
        else:
            store = TcpStore("127.0.0.1", args.port, connect_timeout=60, request_timeout=300)
            store.connect()
        desc = NodeDesc(node_id, "127.0.0.1", "default", 1)
        handlers.append(DynamicRendezvousHandler(Counting(store, node_id), settings, desc))
    by_id = dict(zip(ids, handlers, strict=True))

    def settled_counts() -> list[int]:
        return [
            settled_count(i in waiting, by_id[i].seen, args.expect) for i in ids if i not in held
        ]

    book = Book(len(ids))
    settler = Settler(settled_counts, args.expect)

    def drive(node_id: str, handler: Any) -> None:
        changed = threading.Event()
        t_notice: list[float] = []

        def on_change() -> None:
            if not t_notice:
                t_notice.append(time.time())
            changed.set()

        handler.set_change_callback(on_change)
        (cmds.join_held if node_id in held else cmds.join).wait()
        for k in range(2):
            t_call = time.time()
            info = handler.next_rendezvous()
            t_ranked = time.time()
            notice = t_notice[0] if t_notice and k == 1 else None
            book.add(k, [node_id, info.round, info.rank, info.world_size, t_call, t_ranked, notice])
            changed.wait()

    for node_id, handler in zip(ids, handlers, strict=True):
        threading.Thread(target=_guarded(drive), args=(node_id, handler), daemon=True).start()
    cmds.hooks.append(lambda c: settler.arm() if c == "join" else None)
    threading.Thread(target=settler.run, daemon=True).start()
    emit({"ev": "connected"})


def _elastrun_settings(args: argparse.Namespace, cls: Any) -> Any:
    return cls(
        args.run_id,
        args.min,
        args.max,
        join_timeout=args.join_timeout,
        last_call_timeout=args.last_call,
        heartbeat_timeout=args.ttl,
    )


def _guarded(fn: Callable[..., None]) -> Callable[..., None]:
    def run(*a: Any) -> None:
        try:
            fn(*a)
        except BaseException as exc:
            emit({"ev": "error", "msg": "".join(traceback.format_exception(exc))[-2000:]})

    return run


# --------------------------------------------------------------------------- elastrun async


def run_elastrun_async(args: argparse.Namespace, cmds: Commands) -> None:
    asyncio.run(_async_main(args, cmds))


async def _async_main(args: argparse.Namespace, cmds: Commands) -> None:
    from _aiostore import AsyncStore
    from _rdzv_async import AsyncNode

    from elastrun.core.errors import StoreError
    from elastrun.rendezvous.settings import NodeDesc, RendezvousSettings

    loop = asyncio.get_running_loop()
    settings = _elastrun_settings(args, RendezvousSettings)
    ids = node_ids(args.first, args.count)
    stores: list[AsyncStore] = []
    # Bounded bursts of connections: the server closes the oldest of more than 256
    # unauthenticated ones, and two processes connect at once. Each process connects
    # from an address of its own on the loopback: one source address has fewer
    # ephemeral ports (about 28,000) than a large run has connections.
    source = args.source or None

    async def connect() -> AsyncStore:
        for attempt in range(5):
            try:
                return await AsyncStore.connect("127.0.0.1", args.port, source)
            except (OSError, StoreError):
                if attempt == 4:
                    raise
                await asyncio.sleep(0.5 * (attempt + 1))
        raise AssertionError("unreachable")

    # --per-connection K: K simulated nodes share one connection (each with a lease of
    # its own), for more nodes than the server's descriptor limit allows connections.
    share = max(1, args.per_connection)
    wanted = -(-len(ids) // share)
    for start in range(0, wanted, 64):
        batch = range(start, min(wanted, start + 64))
        stores += await asyncio.gather(*(connect() for _ in batch))
    nodes = [
        AsyncNode(stores[k // share], settings, NodeDesc(i, "127.0.0.1", "default", 1))
        for k, i in enumerate(ids)
    ]

    def counters() -> dict[str, float]:
        # Read from the command thread while the loop runs: plain int reads.
        out = {
            "requests": float(sum(s.requests for s in stores)),
            "bytes": float(sum(s.bytes_in for s in stores)),
        }
        for s in stores:
            for op, count in list(s.by_op.items()):
                out["op." + op] = out.get("op." + op, 0.0) + count
        return out

    book = Book(len(nodes), counters)
    held = set(ids[len(ids) - args.hold :]) if args.hold else set()
    join_ev, held_ev = asyncio.Event(), asyncio.Event()

    def on_cmd(cmd: str) -> None:
        if cmd == "join":
            loop.call_soon_threadsafe(join_ev.set)
        elif cmd == "join-held":
            loop.call_soon_threadsafe(held_ev.set)
        elif cmd == "counters":
            emit({"ev": "counters", "t": time.time(), "counters": counters()})

    cmds.hooks.append(on_cmd)
    joining = [n for n in nodes if n.node_id not in held]
    settler = Settler(
        lambda: [settled_count(n.waiting, n.seen, args.expect) for n in joining],
        args.expect,
        lambda: max((s.max_latency for s in stores), default=0.0),
        counters,
    )
    cmds.hooks.append(lambda c: settler.arm() if c == "join" else None)
    threading.Thread(target=settler.run, daemon=True).start()
    if cmds.join.is_set():
        join_ev.set()
    emit({"ev": "connected"})

    # At most JOINING_AT_ONCE nodes of this process are between their call and their
    # first wait for the result. A real cluster's nodes do not all start in the same
    # millisecond; here thousands at once queued each node's requests behind every
    # other's on 2 shared cores, for longer than the lease TTL between the grant of a
    # node's lease and its first use.
    gate = asyncio.Semaphore(JOINING_AT_ONCE)

    async def first_join(node: AsyncNode) -> tuple[int, int, int]:
        async with gate:
            call = asyncio.ensure_future(node.next_rendezvous())
            waiting = asyncio.ensure_future(node.joined.wait())
            await asyncio.wait({call, waiting}, return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()
        return await call

    async def drive(node: AsyncNode) -> None:
        await (held_ev if node.node_id in held else join_ev).wait()
        for k in range(2):
            t_call = time.time()
            rnd, rank, world = await (first_join(node) if k == 0 else node.next_rendezvous())
            t_ranked = time.time()
            notice = node.t_notice if k == 1 else None
            item = [node.node_id, rnd, rank, world, t_call, t_ranked, notice, node.role]
            book.add(k, item)
            await node.changed.wait()

    async def guarded(node: AsyncNode) -> None:
        try:
            await drive(node)
        except Exception as exc:
            emit({"ev": "error", "msg": "".join(traceback.format_exception(exc))[-2000:]})

    await asyncio.gather(*(guarded(n) for n in nodes))


# --------------------------------------------------------------------------- torch


def run_torch(args: argparse.Namespace, cmds: Commands) -> None:
    import pickle
    from datetime import timedelta

    from torch._C._distributed_c10d import TCPStore  # torch.distributed's, re-exported untyped
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )

    def client() -> TCPStore:
        return TCPStore("127.0.0.1", args.port, is_master=False, timeout=timedelta(seconds=600))

    timeout = RendezvousTimeout(
        join=timedelta(seconds=args.join_timeout), last_call=timedelta(seconds=args.last_call)
    )
    ids = node_ids(args.first, args.count)
    handlers = []
    for _ in ids:
        store = client()
        backend = C10dRendezvousBackend(store, args.run_id)
        handlers.append(
            DynamicRendezvousHandler.from_backend(
                args.run_id,
                store,
                backend,
                args.min,
                args.max,
                local_addr="127.0.0.1",
                timeout=timeout,
            )
        )
    monitor = C10dRendezvousBackend(client(), args.run_id)
    book = Book(len(ids))
    held = set(ids[len(ids) - args.hold :]) if args.hold else set()

    def participants() -> list[int]:
        got = monitor.get_state()
        if got is None:
            return [0]
        # torch's own state blob, written by torch's handlers in this very benchmark.
        state = pickle.loads(got[0])
        return [len(state.participants)]

    settler = Settler(participants, args.expect)

    def drive(node_id: str, handler: Any) -> None:
        (cmds.join_held if node_id in held else cmds.join).wait()
        for k in range(2):
            t_call = time.time() if k == 0 else (cmds.t_rejoin or time.time())
            info = handler.next_rendezvous()
            t_ranked = time.time()
            notice = cmds.t_rejoin if k == 1 else None
            book.add(k, [node_id, k, info.rank, info.world_size, t_call, t_ranked, notice])
            cmds.rejoin.wait()

    for node_id, handler in zip(ids, handlers, strict=True):
        threading.Thread(target=_guarded(drive), args=(node_id, handler), daemon=True).start()
    cmds.hooks.append(lambda c: settler.arm() if c == "join" else None)
    # torch's nodes sync the shared state once a second: let every one see it once.
    threading.Thread(target=settler.run, args=(1.2,), daemon=True).start()
    emit({"ev": "connected"})


# --------------------------------------------------------------------------- main


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--impl",
        required=True,
        choices=["elastrun-threads", "elastrun-etcd", "elastrun-async", "torch"],
    )
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--first", type=int, required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--hold", type=int, default=0, help="nodes that wait for join-held")
    p.add_argument("--min", type=int, required=True)
    p.add_argument("--max", type=int, required=True)
    p.add_argument("--expect", type=int, required=True, help="joiners seen when settled")
    p.add_argument("--ttl", type=float, default=10.0)
    p.add_argument("--join-timeout", type=float, default=600.0)
    p.add_argument("--last-call", type=float, default=30.0)
    p.add_argument("--nice", type=int, default=10)
    p.add_argument("--source", default="", help="loopback address to connect from")
    p.add_argument("--per-connection", type=int, default=1, help="nodes sharing a connection")
    args = p.parse_args(argv)
    # The simulated nodes share this machine's cores with the store server, which on a
    # real cluster has a machine to itself while every node decodes its own answers on
    # its own. Lower priority keeps the server from waiting behind the simulation.
    os.nice(args.nice)
    raise_fd_limit()
    cmds = Commands()
    reader = threading.Thread(target=cmds.run, daemon=True)
    try:
        if args.impl == "elastrun-async":
            reader.start()
            run_elastrun_async(args, cmds)
        else:
            runners = {
                "elastrun-threads": run_elastrun_threads,
                "elastrun-etcd": run_elastrun_threads,
                "torch": run_torch,
            }
            runners[args.impl](args, cmds)
            reader.start()
            reader.join()
    except Exception as exc:
        emit({"ev": "error", "msg": "".join(traceback.format_exception(exc))[-2000:]})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

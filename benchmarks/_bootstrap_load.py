"""A load process for ``bench_bootstrap_store.py``: ``python _bootstrap_load.py PORT``.

Thousands of asyncio clients of torch's TCPStore wire protocol (``_torchwire_client``)
in one process. It obeys JSON commands on standard input, one per line, and answers
one JSON line each:

``{"cmd": "connect", "clients": C, "tag": T}``
    open C connections (a few at a time: connecting is not what is measured), write
    each client's own key for every operation; ``{"ev": "ready"}``.
``{"cmd": "go", "op": OP, "start_at": WALL, "duration": D, "depth": K}`` (K requests in
flight per client; 1 when left out)
    every client runs OP back to back from WALL for D seconds; ``{"ev": "done",
    "ops": N}``.
``{"cmd": "close"}``
    close the connections; ``{"ev": "closed"}``.
``{"cmd": "burst", "clients": C, "first": I, "world": W, "start_at": WALL, "tag": T,
"timeout": S}``
    at WALL, C clients (ranks I .. I+C-1 of W) connect at once and bootstrap as an NCCL
    group does: rank 0 sets the unique id, every rank gets it (a wait, then a get),
    then a store barrier (an add on a counter; the last rank sets the release key;
    every rank waits on it). Answers each rank's moments (``time.time()``): TCP
    connected, ping answered, id read, barrier passed, and its connect retries.
``{"cmd": "check"}``
    a correctness check of every operation used here; ``{"ev": "checked"}`` or an
    ``error``.
``{"cmd": "quit"}``
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
import time
from collections.abc import Callable

from _torchwire_client import (
    BYTE_ANSWER,
    I64_ANSWER,
    U32_ANSWER,
    WireClient,
    connect,
    req_add,
    req_check,
    req_compare_set,
    req_get,
    req_ping,
    req_set,
    req_wait,
)

HOST = "127.0.0.1"
VALUE_A = b"a" * 64


def _requests(key: bytes) -> dict[str, tuple[bytes, int]]:
    """Each throughput operation: the bytes sent and the answer's fixed size."""
    return {
        # A set has no answer: a ping after it closes the loop (torch's client sends
        # sets without waiting, so this costs the server two requests per set).
        "set": (req_set(key, VALUE_A) + req_ping(7), U32_ANSWER),
        "get": (req_get(key), 8 + len(VALUE_A)),
        "add": (req_add(key + b"/n", 1), I64_ANSWER),  # a counter beside the value
        # Expected == current: every swap succeeds and answers the 64-byte value.
        "compare_set": (req_compare_set(key, VALUE_A, VALUE_A), 8 + len(VALUE_A)),
        "wait": (req_wait(key), BYTE_ANSWER),
    }


class Load:
    def __init__(self, port: int) -> None:
        self.port = port
        self.clients: list[WireClient] = []
        self.keys: list[bytes] = []

    async def connect(self, n: int, tag: str) -> None:
        await self.close()
        deadline = time.monotonic() + 300
        sem = asyncio.Semaphore(32)

        async def one(i: int) -> WireClient:
            async with sem:
                return await connect(HOST, self.port, deadline)

        self.clients = list(await asyncio.gather(*(one(i) for i in range(n))))
        self.keys = [f"tp/{tag}/{i}".encode() for i in range(n)]
        for client, key in zip(self.clients, self.keys, strict=True):
            client.set(key, VALUE_A)
        # Set before anyone reads: one round trip per client orders it.
        await asyncio.gather(*(c.request(req_ping(1), U32_ANSWER) for c in self.clients))

    async def go(self, op: str, start_at: float, duration: float, depth: int = 1) -> int:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, start_at - time.time()))
        stop = loop.time() + duration
        futs = []
        for client, key in zip(self.clients, self.keys, strict=True):
            data, size = _requests(key)[op]
            futs.append(client.run_loop(data, size, stop, depth))
        counts = await asyncio.gather(*futs)
        return int(sum(counts))

    async def close(self) -> None:
        for client in self.clients:
            client.close()
        self.clients = []
        await asyncio.sleep(0)

    async def burst(
        self, n: int, first: int, world: int, start_at: float, tag: str, timeout: float
    ) -> dict[str, object]:
        await self.close()
        uid_key, count_key, done_key = (f"nccl/{tag}/{k}".encode() for k in ("uid", "n", "go"))
        deadline = time.monotonic() + (start_at - time.time()) + timeout
        clients: list[WireClient] = []

        async def rank(r: int) -> dict[str, float]:
            stats: dict[str, float] = {}
            client = await connect(HOST, self.port, deadline, stats)
            clients.append(client)
            if r == 0:
                client.set(uid_key, b"u" * 128)  # ncclUniqueId: 128 bytes
            uid = await client.get(uid_key)
            if len(uid) != 128:
                raise ConnectionError(f"rank {r} read a {len(uid)}-byte id")
            stats["uid"] = time.time()
            if await client.add(count_key, 1) == world:
                client.set(done_key, b"1")
            await client.wait(done_key)
            stats["barrier"] = time.time()
            return stats

        await asyncio.sleep(max(0.0, start_at - time.time()))
        t0 = time.time()
        # The whole bootstrap is bounded, not only the connect: a rank that connected
        # waits on the barrier forever when another rank never arrives.
        left = deadline - time.monotonic()
        results = await asyncio.gather(
            *(asyncio.wait_for(rank(first + i), left) for i in range(n)),
            return_exceptions=True,
        )
        for client in clients:
            client.close()
        errors = [repr(r) for r in results if isinstance(r, BaseException)]
        ok = [r for r in results if isinstance(r, dict)]
        return {
            "ev": "burst",
            "t0": t0,
            "errors": errors[:5],
            "failed": len(errors),
            "ranks": [
                [r["start"], r["tcp"], r["hello"], r["uid"], r["barrier"], r["retries"]] for r in ok
            ],
        }

    async def check(self) -> None:
        """Every operation used here, against the server, with known answers."""
        deadline = time.monotonic() + 30
        a = await connect(HOST, self.port, deadline)
        b = await connect(HOST, self.port, deadline)
        key = f"check/{time.time_ns()}".encode()
        assert await a.request(req_check(key), BYTE_ANSWER) == b"\x01"  # NOT_READY
        waiting = asyncio.ensure_future(b.get(key))  # blocks until a sets it
        await asyncio.sleep(0.05)
        assert not waiting.done(), "a wait on a missing key returned"
        a.set(key, VALUE_A)
        assert await waiting == VALUE_A
        assert await a.request(req_check(key), BYTE_ANSWER) == b"\x00"  # READY
        ans = await a.request(req_compare_set(key, b"x", b"y"), 8 + len(VALUE_A))
        assert ans[8:] == VALUE_A, ans  # mismatch: answers the current value
        ans = await a.request(req_compare_set(key, VALUE_A, b"y" * 64), 8 + 64)
        assert ans[8:] == b"y" * 64, ans  # swapped: answers the new value
        assert await b.get(key) == b"y" * 64
        assert await a.add(key + b"/n", 5) == 5
        assert await b.add(key + b"/n", -2) == 3
        for op in ("set", "get", "compare_set", "wait", "add"):
            data, size = _requests(key + b"/" + op.encode())[op]
            if op in ("get", "compare_set", "wait"):
                a.set(key + b"/" + op.encode(), VALUE_A)
            got = await a.request(data, size)
            assert len(got) == size, (op, got)
        a.close()
        b.close()


async def _main(port: int) -> None:
    load = Load(port)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        cmd = json.loads(line)
        name = cmd["cmd"]
        try:
            if name == "quit":
                break
            if name == "connect":
                await load.connect(int(cmd["clients"]), str(cmd["tag"]))
                out: dict[str, object] = {"ev": "ready"}
            elif name == "go":
                ops = await load.go(
                    str(cmd["op"]),
                    float(cmd["start_at"]),
                    float(cmd["duration"]),
                    int(cmd.get("depth", 1)),
                )
                out = {"ev": "done", "ops": ops}
            elif name == "close":
                await load.close()
                out = {"ev": "closed"}
            elif name == "burst":
                out = await load.burst(
                    int(cmd["clients"]),
                    int(cmd["first"]),
                    int(cmd["world"]),
                    float(cmd["start_at"]),
                    str(cmd["tag"]),
                    float(cmd["timeout"]),
                )
            elif name == "check":
                await load.check()
                out = {"ev": "checked"}
            else:
                out = {"ev": "error", "error": f"unknown command {name!r}"}
        except Exception as exc:
            out = {"ev": "error", "error": repr(exc)}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
    await load.close()


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def main(argv: list[str]) -> int:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    # The clients, not the server, are what bounds a burst of thousands on a machine of
    # few cores: they run on uvloop when it is installed (the same clients for both
    # servers), so that the server is measured rather than the load.
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(_main(int(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

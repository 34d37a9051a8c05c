"""A load-generating process for ``bench_store.py``: ``python _store_load.py IMPL PORT``.

It obeys JSON commands on standard input, one per line:

``{"cmd": "connect", "clients": C, "first": I}``
    open C client connections (elastrun's ``TcpStore`` or torch's ``TCPStore``), one
    per client; answers ``{"ev": "ready"}``.
``{"cmd": "arm", "op": OP, "tag": T}``
    write each client's own key for OP; answers ``{"ev": "ready"}``.
``{"cmd": "go", "start_at": WALL, "duration": D}``
    every client, in a thread of its own, runs OP back to back (closed loop) from WALL
    for D seconds; answers ``{"ev": "done", "ops": N}``.
``{"cmd": "quit"}``

Each client uses its own key, so the numbers are the store's request path, not
contention on one key. Values are 64 bytes. Connections are kept across commands: torch's
server sometimes stalls a connecting client for seconds, and connecting is not measured.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

VALUE_A = b"a" * 64
VALUE_B = b"b" * 64


def _client(impl: str, port: int) -> Any:
    if impl == "elastrun":
        from elastrun.store.tcp import TcpStore

        store = TcpStore("127.0.0.1", port, connect_timeout=60, request_timeout=60)
        store.connect()
        return store
    from datetime import timedelta

    from torch._C._distributed_c10d import TCPStore  # torch.distributed's, re-exported untyped

    return TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))


def _operation(store: Any, op: str, key: str) -> Callable[[], None]:
    if op == "set":
        return lambda: store.set(key, VALUE_A)
    if op == "get":
        return lambda: store.get(key)
    if op == "add":
        return lambda: store.add(key, 1)
    # compare_set: swap between two values, so every call succeeds.
    state = {"cur": VALUE_A}

    def swap() -> None:
        cur = state["cur"]
        new = VALUE_B if cur == VALUE_A else VALUE_A
        store.compare_set(key, cur, new)
        state["cur"] = new

    return swap


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    impl, port = argv[0], int(argv[1])
    stores: list[Any] = []
    first = 0
    calls: list[Callable[[], None]] = []
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        if cmd["cmd"] == "connect":
            for store in stores:
                close = getattr(store, "close", None)
                if close is not None:
                    close()
            stores = [_client(impl, port) for _ in range(int(cmd["clients"]))]
            first = int(cmd["first"])
            _emit({"ev": "ready"})
        elif cmd["cmd"] == "arm":
            calls = []
            for i, store in enumerate(stores):
                key = f"bench/{cmd['tag']}/{first + i}"
                if cmd["op"] == "add":
                    store.add(key, 0)
                else:
                    store.set(key, VALUE_A)
                calls.append(_operation(store, cmd["op"], key))
            _emit({"ev": "ready"})
        elif cmd["cmd"] == "go":
            counts = [0] * len(calls)
            start = float(cmd["start_at"])
            stop = start + float(cmd["duration"])

            def loop(
                i: int,
                call: Callable[[], None],
                counts: list[int] = counts,
                start: float = start,
                stop: float = stop,
            ) -> None:
                time.sleep(max(0.0, start - time.time()))
                n = 0
                while time.time() < stop:
                    call()
                    n += 1
                counts[i] = n

            threads = [
                threading.Thread(target=loop, args=(i, c), daemon=True) for i, c in enumerate(calls)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            _emit({"ev": "done", "ops": sum(counts)})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

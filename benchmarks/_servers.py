"""Run one store server in a process of its own:
``python _servers.py elastrun|torchwire|torchwire-python|torch``.

Prints ``{"port": N}`` once listening, then serves until its standard input closes (or
it is killed). The rendezvous and store benchmarks start it so that the server has its
own interpreter and CPU, as it would on a real machine.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    kind = argv[0] if argv else "elastrun"
    if kind == "elastrun":
        from _common import raise_fd_limit

        from elastrun.core.collector import calm_full_collections
        from elastrun.store.tcp import TcpStoreServer

        raise_fd_limit()  # tens of thousands of simulated nodes connect
        calm_full_collections()  # as in `elastrun store` (``launch.entry``)
        server = TcpStoreServer("127.0.0.1", 0)
        server.start()
        print(json.dumps({"port": server.port}), flush=True)
        sys.stdin.read()
        server.stop()
        return 0
    if kind in ("torchwire", "torchwire-python"):  # the workers' store: torch's wire
        from elastrun.core.collector import calm_full_collections
        from elastrun.store.tcp import raise_fd_limit
        from elastrun.store.torchwire import TorchWireServer

        raise_fd_limit()
        calm_full_collections()  # as in the agent that serves it (``launch.entry``)
        # "torchwire": the engine the agent picks (the compiled one where it was built).
        engine = "python" if kind == "torchwire-python" else "auto"
        wire = TorchWireServer("127.0.0.1", 0, engine=engine)
        port = wire.start()
        print(json.dumps({"port": port, "engine": wire.engine}), flush=True)
        sys.stdin.read()
        wire.close()
        return 0
    if kind == "torch":
        import resource
        from datetime import timedelta

        from torch.distributed import TCPStore

        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        store = TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            multi_tenant=True,
            use_libuv=True,
            timeout=timedelta(seconds=600),
        )
        print(json.dumps({"port": store.port}), flush=True)
        sys.stdin.read()
        return 0
    print(f"unknown server kind {kind!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

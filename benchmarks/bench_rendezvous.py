"""Rendezvous at scale: N simulated nodes, elastrun's dynamic rendezvous vs torch's c10d.

Each simulated node is a full participant with its own store connection (see
``_rdzv_sim.py``); the store server runs in a process of its own and the nodes are
spread over a few processes. Two trials:

* **scale** (``min = max = N``): N-1 nodes join and settle (each has seen the other
  N-1 joiners); then the last node joins. Measured: from the moment the last node calls
  ``next_rendezvous()`` until every node has its rank.
* **loss** (``min = N-1, max = N``, the default timeouts): all N form a round; then the
  process holding one node is SIGKILLed. Measured: from the kill until every survivor
  has its rank in the new round. elastrun's survivors notice the loss themselves (the
  dead node's lease is revoked when its connection drops, after the server's grace);
  torch's handler has no such signal, so its survivors are told to re-join at the very
  moment of the kill (the best case for torch: in torchrun they re-join only when their
  workers' collectives fail). Before the kill, elastrun's nodes' requests are counted over
  a window while the round runs (steady traffic per node per second, by operation).

Implementations: ``elastrun-async`` (elastrun's protocol as coroutines, thousands of nodes
per process), ``elastrun-threads`` (elastrun's own handler class, a thread per node, as
far as threads go here) and ``torch-c10d`` (torch's ``DynamicRendezvousHandler`` over
``TCPStore``, threads, up to what it handles here). Run from the repository root::

    .venv/bin/python benchmarks/bench_rendezvous.py [--quick]
    .venv/bin/python benchmarks/bench_rendezvous.py --impls elastrun-async \
        --scale-ns 1000,4096,10000 --loss-ns 100,1000,10000
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import queue
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import (
    PYTHON,
    ScenarioFailure,
    kill_marked,
    new_marker,
    own_cpu_seconds,
    tagged_env,
)
from _report import (
    Headline,
    Section,
    common_parser,
    profile_of,
    run_section,
    write_section,
)

from elastrun.rendezvous.members import PAGE_SIZE

HERE = Path(__file__).resolve().parent
IMPLS = ("elastrun-async", "elastrun-threads", "torch-c10d")
#: Measured when named with --impls: elastrun's handler on an etcd member (its binary
#: from scripts/install-etcd.sh), a thread per simulated node.
OPTIONAL_IMPLS = ("elastrun-etcd",)
SIM_IMPL = {"elastrun-async": "elastrun-async", "elastrun-threads": "elastrun-threads"}
SIM_IMPL["torch-c10d"] = "torch"
SIM_IMPL["elastrun-etcd"] = "elastrun-etcd"
#: The ``_servers.py`` kind each impl's store runs as.
SERVER_KIND = {"torch-c10d": "torch", "elastrun-etcd": "etcd"}


@dataclass(frozen=True)
class Options:
    scale_ns: Mapping[str, tuple[int, ...]]
    loss_ns: Mapping[str, tuple[int, ...]]
    reps: int
    big_reps: int  # repetitions for N >= 1000
    trial_timeout_s: float
    stop_above_s: float  # a trial slower than this ends the escalation of its impl
    procs: int = 2
    ttl: float = 10.0  # the simulated nodes' lease TTL (the handler's default: 10 s)
    nice: int = 10  # the node processes' niceness (the store server's is 0)
    # Steady traffic: after a loss trial's round forms, requests are counted over this
    # window (after ``ops_settle_s``), before the kill. 0: not measured.
    ops_window_s: float = 0.0
    ops_settle_s: float = 3.0
    # Simulated nodes sharing one store connection (elastrun-async; each keeps a lease
    # of its own): more nodes than the server's descriptor limit allows connections.
    per_connection: int = 1
    # The node the loss trial kills (elastrun-async): "member", one that joined last
    # (neither the round's closer nor its deputy: what N-2 of N losses are), or
    # "closer", the node of the lone process, which claims the round first (its deputy
    # then decides the next round).
    lose: str = "member"


PROFILE_OPTIONS = {
    "smoke": Options(
        scale_ns={"elastrun-async": (2, 4), "elastrun-threads": (2,), "torch-c10d": (2,)},
        loss_ns={"elastrun-async": (3,)},
        reps=1,
        big_reps=1,
        trial_timeout_s=60,
        stop_above_s=60,
        ops_window_s=1.0,
        ops_settle_s=0.2,
        per_connection=2,  # nodes share connections (as at 50,000: see --nodes-per-connection)
    ),
    "quick": Options(
        scale_ns={
            "elastrun-async": (2, 16, 128, 512),
            "elastrun-threads": (2, 16, 64),
            "torch-c10d": (2, 16),
            "elastrun-etcd": (2, 16, 64),
        },
        loss_ns={"elastrun-async": (4, 100), "torch-c10d": (4,)},
        reps=1,
        big_reps=1,
        trial_timeout_s=90,
        stop_above_s=60,
        ops_window_s=10.0,
    ),
    "full": Options(
        scale_ns={
            "elastrun-async": (2, 8, 32, 128, 512, 1000, 2048, 4096, 10000),
            "elastrun-threads": (2, 8, 32, 128, 256, 512),
            "torch-c10d": (2, 8, 32, 128, 256),
            "elastrun-etcd": (2, 8, 32, 128, 256, 512, 1024),
        },
        loss_ns={
            "elastrun-async": (4, 100, 1000, 10000),
            "elastrun-threads": (4, 64),
            "torch-c10d": (4,),
        },
        reps=2,
        big_reps=1,
        trial_timeout_s=300,
        stop_above_s=280,
        ops_window_s=30.0,
    ),
}


# --------------------------------------------------------------------------- processes


@dataclass
class Child:
    """A child process whose stdout JSON lines land in a shared queue."""

    index: int
    proc: subprocess.Popen[str]
    events: queue.Queue[tuple[int, float, dict[str, object]]]
    lines: list[str] = field(default_factory=list)

    def start_reader(self) -> None:
        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if isinstance(ev, dict):
                    self.events.put((self.index, time.time(), ev))

        threading.Thread(target=read, daemon=True).start()

    def send(self, cmd: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"cmd": cmd}) + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass


class Trial:
    """One server and its node processes, all carrying one marker; always cleaned up."""

    def __init__(self, impl: str, timeout_s: float) -> None:
        self.impl = impl
        self.marker = new_marker()
        self.deadline = time.monotonic() + timeout_s
        extra = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if impl == "torch-c10d" else {}
        # This tree's package, not whatever copy the interpreter has installed.
        path = os.pathsep.join([str(HERE), str(HERE.parent / "src")])
        self.env = tagged_env(self.marker, {**extra, "PYTHONPATH": path})
        self.events: queue.Queue[tuple[int, float, dict[str, object]]] = queue.Queue()
        self.children: list[Child] = []
        self.errors: list[str] = []
        self.progress: dict[int, dict[str, object]] = {}
        self.server: subprocess.Popen[str] | None = None
        self.port = 0
        # The children's stderr goes to one file, whose tail a failure report shows.
        self._stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115  # closed in __exit__

    def __enter__(self) -> Trial:
        kind = SERVER_KIND.get(self.impl, "elastrun")
        self.server = subprocess.Popen(
            [PYTHON, str(HERE / "_servers.py"), kind],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=self.env,
        )
        assert self.server.stdout is not None
        line = self.server.stdout.readline()
        try:
            self.port = int(json.loads(line)["port"])
        except (ValueError, KeyError) as exc:
            raise ScenarioFailure(f"the {kind} store server did not start: {line!r}") from exc
        return self

    def spawn(self, first: int, count: int, **kw: object) -> Child:
        argv = [
            PYTHON,
            str(HERE / "_rdzv_sim.py"),
            f"--impl={SIM_IMPL[self.impl]}",
            f"--port={self.port}",
            f"--first={first}",
            f"--count={count}",
        ]
        argv += [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]
        if self.impl == "elastrun-async":  # a loopback address per process (_rdzv_sim.py)
            argv.append(f"--source=127.0.0.{len(self.children) + 2}")
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=self.env,
        )
        child = Child(len(self.children), proc, self.events)
        child.start_reader()
        self.children.append(child)
        return child

    def wait_all(
        self, ev: str, children: list[Child], k: int | None = None
    ) -> dict[int, dict[str, Any]]:
        """The `ev` event of every child in `children` (or ScenarioFailure on deadline);
        each a JSON line as the node process wrote it, its fields the callers' to read."""
        want = {c.index for c in children}
        got: dict[int, dict[str, Any]] = {}
        while want - set(got):
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise ScenarioFailure(
                    f"timed out waiting for {ev!r} from {len(want - set(got))} of "
                    f"{len(want)} node processes; last progress: {self._progress_text()}"
                    + self._error_text()
                )
            try:
                idx, _t, msg = self.events.get(timeout=min(left, 1.0))
            except queue.Empty:
                if any(c.proc.poll() is not None for c in children):
                    raise ScenarioFailure("a node process exited" + self._error_text()) from None
                continue
            if msg.get("ev") == "progress":
                self.progress[idx] = msg
                continue
            if msg.get("ev") == "error":
                self.errors.append(str(msg.get("msg")))
                raise ScenarioFailure("a node failed" + self._error_text())
            if msg.get("ev") == ev and idx in want and (k is None or msg.get("k") == k):
                got[idx] = msg
        return got

    def cpu(self) -> tuple[float, float]:
        """CPU seconds used so far by the server, and by all node processes together."""
        server = own_cpu_seconds(self.server.pid) if self.server is not None else None
        nodes = sum(own_cpu_seconds(c.proc.pid) or 0.0 for c in self.children)
        return server or 0.0, nodes

    def _progress_text(self) -> str:
        if not self.progress:
            return "none"
        return "; ".join(
            f"process {i}: {p['settled']}/{p['of']} nodes settled, lowest saw {p['lowest']}"
            for i, p in sorted(self.progress.items())
        )

    def _error_text(self) -> str:
        text = ("\n" + self.errors[-1][-1500:]) if self.errors else ""
        self._stderr.flush()
        self._stderr.seek(0)
        tail = self._stderr.read()[-1500:]
        return text + (f"\nstderr of the node processes:\n{tail}" if tail.strip() else "")

    def __exit__(self, *exc: object) -> None:
        for c in self.children:
            c.send("quit")
        for c in self.children:
            try:
                c.proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait(timeout=5)
        if self.server is not None:
            if self.server.stdin is not None:
                with contextlib.suppress(OSError):
                    self.server.stdin.close()
            try:
                self.server.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait(timeout=5)
        streams = [s for c in self.children for s in (c.proc.stdin, c.proc.stdout)]
        if self.server is not None:
            streams.append(self.server.stdout)
        for stream in streams:
            if stream is not None:
                with contextlib.suppress(OSError):  # a killed child's pipe is broken
                    stream.close()
        kill_marked(self.marker)
        self._stderr.close()


def _split(total: int, parts: int) -> list[int]:
    parts = max(1, min(parts, total))
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _counters(msgs: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for msg in msgs:
        for k, v in (msg.get("counters") or {}).items():
            total[k] = total.get(k, 0.0) + float(v)
    return total


def _check_ranks(items: list[list[object]], world: int) -> None:
    ranks = sorted(int(i[2]) for i in items)  # type: ignore[call-overload]  # a JSON number
    worlds = {int(i[3]) for i in items}  # type: ignore[call-overload]  # a JSON number
    if ranks != list(range(world)) or worlds != {world}:
        raise ScenarioFailure(f"bad ranking: ranks {ranks[:10]}..., world sizes {worlds}")


# --------------------------------------------------------------------------- trials


def scale_trial(impl: str, n: int, opts: Options) -> dict[str, float]:
    """N-1 nodes settle, then the last joins; seconds until all are ranked."""
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    common = {
        "run_id": run_id,
        "min": n,
        "max": n,
        "expect": n - 1,
        "ttl": opts.ttl,
        "nice": opts.nice,
        "per_connection": opts.per_connection,
    }
    with Trial(impl, opts.trial_timeout_s) as trial:
        sizes = _split(n - 1, opts.procs) if n > 1 else []
        first = 0
        for size in sizes:
            trial.spawn(first, size, **common)
            first += size
        last = trial.spawn(first, 1, hold=1, **common)
        kids = trial.children
        trial.wait_all("connected", kids)
        t0 = time.time()
        for c in kids:
            c.send("join")
        settled = trial.wait_all("settled", kids[:-1])
        t_settled = time.time()
        cpu0 = trial.cpu()
        last.send("join-held")
        ranked = trial.wait_all("ranked", kids, k=0)
        cpu1 = trial.cpu()
        items = [it for msg in ranked.values() for it in msg["items"]]
        _check_ranks(items, n)
        t_last = float(ranked[last.index]["items"][0][4])
        t_all = max(float(it[5]) for it in items)
        result = {
            "ranked": t_all - t_last,
            "settle": t_settled - t0,
            "server_cpu": cpu1[0] - cpu0[0],
            "nodes_cpu": cpu1[1] - cpu0[1],
        }
        before, after = _counters(settled.values()), _counters(ranked.values())
        if after:
            result["requests"] = after["requests"] - before.get("requests", 0.0)
            result["mb"] = (after["bytes"] - before.get("bytes", 0.0)) / 1e6
        return result


def loss_trial(impl: str, n: int, opts: Options) -> dict[str, float]:
    """All N ranked; one node's process is SIGKILLed; seconds until survivors re-rank."""
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    # The victim joins last (after the others settled) unless the round's closer is to
    # be lost: alone in its process, it then claims the round first.
    last = opts.lose == "member" and impl == "elastrun-async"
    common = {
        "run_id": run_id,
        "min": n - 1,
        "max": n,
        "expect": n - 1 if last else n,
        "ttl": opts.ttl,
        "nice": opts.nice,
        "per_connection": opts.per_connection,
    }
    with Trial(impl, opts.trial_timeout_s) as trial:
        first = 0
        for size in _split(n - 1, opts.procs):
            trial.spawn(first, size, **common)
            first += size
        victim = trial.spawn(first, 1, **({"hold": 1} if last else {}), **common)
        kids = trial.children
        survivors = kids[:-1]
        trial.wait_all("connected", kids)
        for c in kids:
            c.send("join")
        if last:
            trial.wait_all("settled", survivors)
            victim.send("join-held")
        ranked0 = trial.wait_all("ranked", kids, k=0)
        _check_ranks([it for m in ranked0.values() for it in m["items"]], n)
        role = ranked0[victim.index]["items"][0][7:8]
        steady = _steady_ops(trial, n, opts) if impl == "elastrun-async" else {}
        t_kill = time.time()
        victim.proc.kill()
        if impl == "torch-c10d":
            for c in survivors:
                c.send("rejoin")
        ranked = trial.wait_all("ranked", survivors, k=1)
        items = [it for m in ranked.values() for it in m["items"]]
        _check_ranks(items, n - 1)
        t_all = max(float(it[5]) for it in items)
        result = {"reranked": t_all - t_kill, **steady}
        notices = [float(it[6]) for it in items if it[6] is not None]
        if notices and impl != "torch-c10d":
            result["noticed"] = min(notices) - t_kill
            result["after_notice"] = t_all - min(notices)
        if role:  # what the victim was in the round (elastrun-async)
            result["victim_closer"] = float(role[0] == "closer")
            result["victim_deputy"] = float(role[0] == "deputy")
        return result


def _steady_ops(trial: Trial, n: int, opts: Options) -> dict[str, float]:
    """Requests per node per second over a window while the round runs and nothing
    changes (keep-alives and watch renewals): in total and by operation."""
    if opts.ops_window_s <= 0:
        return {}
    time.sleep(opts.ops_settle_s)  # the nodes' first watches of the running round
    t0, c0 = _counters_now(trial)
    time.sleep(opts.ops_window_s)
    t1, c1 = _counters_now(trial)
    rate = 1.0 / (n * (t1 - t0))
    out = {"ops": (c1["requests"] - c0["requests"]) * rate}
    for key in sorted(set(c1) - {"requests", "bytes"}):
        out[key] = (c1[key] - c0.get(key, 0.0)) * rate
    return out


def _counters_now(trial: Trial) -> tuple[float, dict[str, float]]:
    """The requests every node process has sent so far (summed), and about when."""
    t_ask = time.time()
    for c in trial.children:
        c.send("counters")
    got = trial.wait_all("counters", trial.children)
    return t_ask, _counters(got.values())


# --------------------------------------------------------------------------- the section


def _escalate(
    section: Section,
    what: str,
    ns_by_impl: Mapping[str, tuple[int, ...]],
    impls: list[str],
    opts: Options,
    trial: Callable[[str, int, Options], dict[str, float]],
    variable: Callable[[dict[str, float]], float] | None = None,
) -> dict[str, dict[int, list[dict[str, float]]]]:
    """Every impl over its N values, ascending, alternating impls at each N.

    An impl stops escalating after a failure, or after a trial slower than
    ``stop_above_s``. With ``variable`` (the part of a trial that grows with N), a size
    is not attempted when its predicted time exceeds the trial timeout: the fixed part
    (process start-up) plus the variable part scaled by (N / N_last)^k, k being the growth
    between the last two sizes (at least 2).
    """
    results: dict[str, dict[int, list[dict[str, float]]]] = {i: {} for i in impls}
    stopped: dict[str, str] = {}
    seen: dict[str, list[tuple[int, float, float]]] = {i: [] for i in impls}  # N, fixed, var
    all_ns = sorted({n for i in impls for n in ns_by_impl.get(i, ())})
    for n in all_ns:
        reps = opts.big_reps if n >= 100 else opts.reps
        for rep in range(reps):
            for impl in impls:
                if impl in stopped or n not in ns_by_impl.get(impl, ()):
                    continue
                if variable is not None and rep == 0 and seen[impl]:
                    predicted, why = _predict(seen[impl], n)
                    if predicted > opts.trial_timeout_s:
                        stopped[impl] = (
                            f"N={n} not attempted: {why}, so it would need about "
                            f"{predicted:.0f} s (over the {opts.trial_timeout_s:.0f} s limit)"
                        )
                        continue
                t0 = time.monotonic()
                try:
                    m = trial(impl, n, opts)
                except ScenarioFailure as exc:
                    section.fail(f"{what}, {impl}, N={n}", str(exc))
                    stopped[impl] = f"failed at N={n} (see Failures)"
                    continue
                took = time.monotonic() - t0
                if variable is not None:
                    var = variable(m)
                    seen[impl].append((n, max(0.0, took - var), var))
                results[impl].setdefault(n, []).append(m)
                shown = ", ".join(f"{k}={v:.3f}" for k, v in m.items())
                print(f"[bench] rendezvous {what} {impl} N={n} rep {rep + 1}: {shown}", flush=True)
                if took > opts.stop_above_s:
                    stopped[impl] = f"stopped after N={n} (that trial took {took:.0f} s)"
    for impl, why in stopped.items():
        section.notes.append(f"{what}, {impl}: {why}.")
    return results


def _predict(history: list[tuple[int, float, float]], n: int) -> tuple[float, str]:
    """Predicted seconds of a trial of size `n` from earlier ones, and why."""
    by_n: dict[int, tuple[float, float]] = {}
    for size, fixed, var in history:
        by_n[size] = (fixed, var)  # the latest repetition of each size
    sizes = sorted(by_n)
    n1 = sizes[-1]
    fixed1, var1 = by_n[n1]
    k = 2.0
    if len(sizes) >= 2:
        n0 = sizes[-2]
        var0 = by_n[n0][1]
        if var0 > 0 and var1 > 0 and n1 > n0:
            k = max(k, math.log(var1 / var0) / math.log(n1 / n0))
    predicted = fixed1 + var1 * (n / n1) ** k
    why = (
        f"at N={n1} the trial's N-dependent part took {var1:.1f} s (plus {fixed1:.0f} s of "
        f"start-up) and grew as N^{k:.1f}"
    )
    return predicted, why


def _fit_exponent(points: dict[int, float], n_min: int = 128) -> float | None:
    """k in time ~ N^k, least squares on log-log over N >= n_min (None if < 2 points)."""
    xs = [(math.log(n), math.log(t)) for n, t in points.items() if n >= n_min and t > 0]
    if len(xs) < 2:
        return None
    mx = sum(x for x, _ in xs) / len(xs)
    my = sum(y for _, y in xs) / len(xs)
    den = sum((x - mx) ** 2 for x, _ in xs)
    return sum((x - mx) * (y - my) for x, y in xs) / den if den else None


def _median(values: list[float]) -> float:
    import statistics

    return statistics.median(values)


def body(section: Section, opts: Options, impls: list[str]) -> None:
    conn = (
        "its own store connection"
        if opts.per_connection == 1
        else f"a store connection shared by {opts.per_connection} nodes (a lease each; the "
        "killed node has one of its own)"
    )
    section.intro = (
        f"Simulated nodes, each a full participant with {conn}; the store "
        "server in a process of its own, the nodes spread over "
        f"{opts.procs} processes (+1 for the held-back or the killed node). "
        "**scale**: `min = max = N`; N-1 nodes join and settle, then the last one joins: "
        "time from its `next_rendezvous()` call until every node is ranked. "
        "**loss**: `min = N-1, max = N`, default timeouts; the process of one node is "
        "SIGKILLed once all are ranked: time until every survivor is ranked again. The "
        + (
            "victim joins last (elastrun: neither the round's closer nor its deputy). "
            if opts.lose == "member"
            else "victim is alone in its process and claims the round first (elastrun: the "
            "round's closer; its deputy decides the next round). "
        )
        + "Before "
        f"the kill, the requests the nodes send are counted over {opts.ops_window_s:.0f} s "
        f"(steady traffic). Lease TTL of the simulated nodes: {opts.ttl:.0f} s. Load average "
        f"at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}."
    )
    scale = _escalate(
        section,
        "scale",
        opts.scale_ns,
        impls,
        opts,
        scale_trial,
        variable=lambda m: m["settle"] + m["ranked"],
    )
    loss = _escalate(section, "loss", opts.loss_ns, impls, opts, loss_trial)
    _tables(section, impls, scale, loss)
    _plot_data(section, scale)
    section.notes.append(
        "Load average at the end of this section: "
        + " ".join(f"{x:.2f}" for x in os.getloadavg())
        + " (2 cores, shared with other work)."
    )
    _verdicts(section, scale, loss, set(opts.scale_ns.get("elastrun-async", ())), opts.nice)
    section.extra += headline_table(section.headlines)


def headline_table(headlines: list[Headline]) -> list[str]:
    """The section's headlines as a Markdown table (they also head RESULTS.md)."""
    if not headlines:
        return []
    lines = ["**Targets**", "", "| measurement | result | target | met |", "|---|---|---|---|"]
    for h in headlines:
        met = "-" if h.met is None else ("yes" if h.met else "**no**")
        lines.append(f"| {h.what} | {h.value} | {h.target or '-'} | {met} |")
    return [*lines, ""]


def _tables(
    section: Section,
    impls: list[str],
    scale: dict[str, dict[int, list[dict[str, float]]]],
    loss: dict[str, dict[int, list[dict[str, float]]]],
) -> None:
    ref = "torch-c10d" if "torch-c10d" in impls else None
    t = section.table("Scale: last join → all ranked (s)", impls, ref)
    st = section.table(
        "Scale: joining phase, N-1 nodes joining at once → all have seen each other (s)",
        impls,
        ref,
    )
    ct = section.table(
        "Scale: work after the last join (store server's CPU s; node processes' CPU s; "
        "requests and MB answered, counted by the elastrun-async clients)",
        impls,
        None,
    )
    for n in sorted({n for r in scale.values() for n in r}):
        row = t.row(f"scale{n}", f"N={n}")
        srow = st.row(f"settle{n}", f"N={n}")
        crow = ct.row(f"cpu{n}", f"N={n}: server CPU (s)")
        nrow = ct.row(f"ncpu{n}", f"N={n}: node processes' CPU (s)")
        qrow = ct.row(f"req{n}", f"N={n}: requests", fmt=".0f")
        mrow = ct.row(f"mb{n}", f"N={n}: MB answered", fmt=".1f")
        for impl in impls:
            for m in scale[impl].get(n, []):
                row.add(impl, m["ranked"])
                srow.add(impl, m["settle"])
                crow.add(impl, m["server_cpu"])
                nrow.add(impl, m["nodes_cpu"])
                if "requests" in m:
                    qrow.add(impl, m["requests"])
                    mrow.add(impl, m["mb"])
    lt = section.table("Loss of one node: SIGKILL → survivors ranked again (s)", impls, ref)
    ot = section.table(
        "Steady traffic of a running round: store requests per node per second "
        "(sent by the elastrun-async nodes, counted over a window after ranking)",
        ["elastrun-async"],
        None,
    )
    for n in sorted({n for r in loss.values() for n in r}):
        row = lt.row(f"loss{n}", f"N={n}: SIGKILL → all survivors re-ranked")
        nrow = lt.row(f"loss{n}.noticed", f"N={n}: SIGKILL → first survivor notices")
        arow = lt.row(f"loss{n}.after", f"N={n}: first notice → all re-ranked")
        crow = lt.row(f"loss{n}.closer", f"N={n}: the lost node was the round's closer (1: yes)")
        for impl in impls:
            for m in loss[impl].get(n, []):
                row.add(impl, m["reranked"])
                if "noticed" in m:
                    nrow.add(impl, m["noticed"])
                    arow.add(impl, m["after_notice"])
                if "victim_closer" in m:
                    crow.add(impl, m["victim_closer"])
        for m in loss.get("elastrun-async", {}).get(n, []):
            if "ops" not in m:
                continue
            ot.row(f"ops{n}", f"N={n}: all requests", fmt=".3f").add("elastrun-async", m["ops"])
            parts = {op: m.get("op." + op, 0.0) for op in ("keep_alive", "watch")}
            parts["other"] = m["ops"] - sum(parts.values())
            for op, value in parts.items():
                ot.row(f"ops{n}.{op}", f"N={n}: {op}", fmt=".3f").add("elastrun-async", value)


def _plot_data(section: Section, scale: dict[str, dict[int, list[dict[str, float]]]]) -> None:
    section.raw["plot"] = {
        key: {
            impl: {str(n): [m[key] for m in ms] for n, ms in by_n.items()}
            for impl, by_n in scale.items()
        }
        for key in ("ranked", "settle")
    }


def _verdicts(
    section: Section,
    scale: dict[str, dict[int, list[dict[str, float]]]],
    loss: dict[str, dict[int, list[dict[str, float]]]],
    planned: set[int],
    opts_nice: int = 10,
) -> None:
    def med(
        impl: str, key: str, source: dict[str, dict[int, list[dict[str, float]]]]
    ) -> dict[int, float]:
        return {
            n: _median([m[key] for m in ms if key in m])
            for n, ms in source.get(impl, {}).items()
            if any(key in m for m in ms)
        }

    ea = med("elastrun-async", "ranked", scale)
    for n, limit in ((10000, 5.0), (50000, 30.0)):
        what = f"rendezvous of {n} simulated nodes, last join → all ranked (elastrun)"
        if n in ea:
            section.headlines.append(
                Headline(what, f"{ea[n]:.2f} s", f"≤ {limit:.0f} s", ea[n] <= limit)
            )
        elif n in planned:
            top = max(ea) if ea else None
            done = f"largest N done: {top}, {ea[top]:.2f} s" if top is not None else "none done"
            section.headlines.append(
                Headline(what, f"not reached ({done})", f"≤ {limit:.0f} s", False)
            )
    if ea and not any(n in planned for n in (10000, 50000)):
        top = max(ea)
        section.headlines.append(
            Headline(
                f"rendezvous of {top} simulated nodes, last join → all ranked (elastrun)",
                f"{ea[top]:.2f} s (N=10,000 is measured by the full profile)",
            )
        )
    if ea and any(
        n in planned and (n not in ea or ea[n] > lim) for n, lim in ((10000, 5.0), (50000, 30.0))
    ):
        top = max(ea)
        section.where_time_goes.append(_where_rdzv(scale, top, ea[top]))
    k = _fit_exponent(ea)
    if k is not None:
        section.headlines.append(
            Headline(
                "growth of the rendezvous time with N (elastrun, N ≥ 128)",
                f"time ∝ N^{k:.2f}",
                "linear (exponent ≤ 1.2)",
                k <= 1.2,
            )
        )
    after = med("elastrun-async", "after_notice", loss)
    if after:
        n = max(after)
        section.headlines.append(
            Headline(
                f"re-forming after the loss of 1 of {n} nodes, first survivor notices (the "
                "dead node's lease revoked) → all survivors ranked (elastrun)",
                f"{after[n]:.2f} s",
                "≤ 2 s" if n >= 10000 else "",
                after[n] <= 2.0 if n >= 10000 else None,
            )
        )
    ops = med("elastrun-async", "ops", loss)
    if len(ops) >= 2:
        shown = ", ".join(f"N={n}: {v:.3f}" for n, v in sorted(ops.items()))
        spread = max(ops.values()) / min(ops.values()) if min(ops.values()) > 0 else math.inf
        section.headlines.append(
            Headline(
                "steady store requests per node per second while a round runs (elastrun)",
                f"{shown} (largest / smallest: {spread:.2f})",
                "constant in N (within 1.5x)",
                spread <= 1.5,
            )
        )
    torch = med("torch-c10d", "ranked", scale)
    if torch:
        top = max(torch)
        compare = f" (elastrun at {top}: {ea[top]:.2f} s)" if top in ea else ""
        section.headlines.append(
            Headline(
                f"torch c10d, largest N it handled here: {top}",
                f"{torch[top]:.2f} s last join → all ranked{compare}",
            )
        )
    tset, eset = med("torch-c10d", "settle", scale), med("elastrun-async", "settle", scale)
    if tset:
        top = max(tset)
        compare = f"; elastrun {eset[top]:.2f} s" if top in eset else ""
        section.headlines.append(
            Headline(
                f"joining phase of {top - 1} nodes at once (torch c10d)",
                f"{tset[top]:.2f} s{compare}",
            )
        )
    for impl in ("elastrun-async", "torch-c10d"):
        by_n = med(impl, "reranked", loss)
        if by_n:
            n = max(by_n)
            section.headlines.append(
                Headline(f"re-rendezvous after losing 1 of {n} nodes ({impl})", f"{by_n[n]:.2f} s")
            )
    section.notes += [
        "elastrun's loss timeline: the server revokes a dropped connection's leases after its "
        "disconnect grace (2 s by default), which deletes the dead node's keys; the watches "
        "of the survivors fire (the round's result said every live node was a member, so "
        "none reads a page to know it) and they re-form at once: the first survivor to "
        "claim the next round decides it for every live member of the previous one "
        "(presumed joined, ranks kept, `decide.presume`), and the others read its result "
        "and the master address from `out/` (the few rank changes are listed in the "
        "result: no page read). The re-forming target is timed from the first notice, "
        "i.e. from the revocation of the dead node's lease. A silent node (no TCP close) "
        "would take the lease TTL (heartbeat timeout, 10 s) instead.",
        "Steady traffic: a running member keeps its lease alive every TTL/3 (10 s TTL: 0.3 "
        "requests per second) and renews its watch of the run's `ctl/` prefix every 60 s "
        "(what `elastrun.rendezvous.liveness` does); nothing else while nothing changes. "
        "A node waiting for a round to close shows the closer's progress every 30 s.",
        "torch's loss timeline: the dead node stays a participant until its last heartbeat "
        "is older than 15 s (keep-alive every 5 s, 3 misses); the round then re-opens, and "
        "with min < max it closes only when the last-call timeout (30 s) has passed.",
        "torch's nodes poll the shared state once a second (a 1 s sleep between syncs), so "
        "the last join is noticed by the others about a second later whatever N is; every "
        "state change is a compare-and-set of one pickled blob holding every node, which is "
        "what makes its joining phase slow.",
        f"The node processes run at niceness {opts_nice} (the server at 0). Each node process "
        "connects from a loopback address of its own (127.0.0.2, ...: one source address "
        "has about 28,000 ephemeral ports) and lets at most 256 of its nodes join at once "
        "(a real cluster's nodes do not all call in the same millisecond). The server's CPU "
        "after the last join is a lower bound of that time on a cluster.",
        "elastrun-async nodes run the same joining protocol as elastrun's handler "
        "(`rendezvous/joining.py`, driven by coroutines in `_rdzv_async.py`; "
        "`tests/process/test_benchmarks_smoke.py` pins that both issue the same "
        "operations), with the same pure `decide_round` / `order_members` functions "
        "and round watch (`RoundWatch.reason`).",
    ]


def _where_rdzv(scale: dict[str, dict[int, list[dict[str, float]]]], n: int, value: float) -> str:
    ms = scale["elastrun-async"][n]
    cpu = _median([m["server_cpu"] for m in ms])
    ncpu = _median([m["nodes_cpu"] for m in ms])
    req = [m["requests"] for m in ms if "requests" in m]
    volume = f", {_median(req):.0f} requests answered" if req else ""
    return (
        f"At N={n}, {value:.2f} s from the last join to all ranked{volume}; the store server "
        f"spent {cpu:.2f} s of CPU and the node processes {ncpu:.2f} s. After the last join "
        f"the closer writes N/{PAGE_SIZE} member pages at once and the small result; then every "
        "node "
        "gets the result from its watch (one encoded answer for all), reads its page, and "
        "watches `out/` on for the master address: about four requests per node, O(1) "
        "bytes each. On this machine the 2 "
        "cores are shared by the server, the node processes (thousands of nodes each) and "
        "other work (see the load average): each round trip waits for the scheduler, and "
        "the node processes decode every node's answers, which on a cluster each node "
        "does on its own machine."
    )


def run(profile: str, impls: list[str] | None = None, opts: Options | None = None) -> Section:
    impls = impls or list(IMPLS)
    opts = opts or PROFILE_OPTIONS[profile]
    return run_section("rendezvous", "Rendezvous at scale", lambda s: body(s, opts, impls), profile)


def _ns(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def main(argv: list[str] | None = None) -> int:
    p = common_parser(__doc__ or "")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma list")
    p.add_argument("--scale-ns", type=_ns, help="elastrun-async's N list for the scale trial")
    p.add_argument("--loss-ns", type=_ns, help="elastrun-async's N list for the loss trial")
    p.add_argument("--ops-window", type=float, help="seconds of steady traffic counted")
    p.add_argument("--ttl", type=float, help="the simulated nodes' lease TTL (s)")
    p.add_argument("--nice", type=int, help="the node processes' niceness")
    p.add_argument("--trial-timeout", type=float, help="seconds one trial may take")
    p.add_argument(
        "--nodes-per-connection", type=int, help="simulated nodes sharing a store connection"
    )
    p.add_argument(
        "--lose",
        choices=("member", "closer"),
        help="the loss trial's victim: a member that joined last, or the round's closer",
    )
    args = p.parse_args(argv)
    profile = profile_of(args)
    opts = PROFILE_OPTIONS[profile]
    changes: dict[str, object] = {}
    if args.scale_ns is not None:
        changes["scale_ns"] = {**opts.scale_ns, "elastrun-async": args.scale_ns}
    if args.loss_ns is not None:
        changes["loss_ns"] = {**opts.loss_ns, "elastrun-async": args.loss_ns}
    for field_name, value in (
        ("ops_window_s", args.ops_window),
        ("ttl", args.ttl),
        ("nice", args.nice),
        ("trial_timeout_s", args.trial_timeout),
        ("per_connection", args.nodes_per_connection),
        ("lose", args.lose),
    ):
        if value is not None:
            changes[field_name] = value
    if args.trial_timeout is not None:
        changes["stop_above_s"] = args.trial_timeout
    opts = dataclasses.replace(opts, **changes)  # type: ignore[arg-type]  # each its field's type
    section = run(profile, [x for x in args.impls.split(",") if x], opts)
    section.extra += ["![Rendezvous time against N](rendezvous.png)", ""]
    section.notes.append(
        f"Command: `python benchmarks/bench_rendezvous.py {shlex.join(argv or sys.argv[1:])}`."
    )
    print(section.render())
    write_section(section, args.output_dir)
    plot = section.raw.get("plot")
    try:
        from _plots import plot_rendezvous

        if isinstance(plot, dict) and plot_rendezvous(plot, args.output_dir / "rendezvous.png"):
            print(f"[bench] wrote {args.output_dir / 'rendezvous.png'}", flush=True)
    except ImportError as exc:
        print(f"[bench] no chart: {exc} (pip install matplotlib)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

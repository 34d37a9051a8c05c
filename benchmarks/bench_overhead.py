"""Agent overhead: the launcher's CPU and memory while its workers sit idle.

N = 4 and 8 workers that connect to the benchmark and block on a read (no CPU). Once all
are running, the launcher's own CPU seconds are read from ``/proc`` at the start and the
end of a window (30 s in the full profile) and its RSS is sampled every second; the
launcher's other descendants (helpers that are not workers, such as a store or a
template process) are measured too. Then the benchmark tells the workers to finish and
the launcher exits normally. Launchers alternate A B A B. Run from the repository root::

    .venv/bin/python benchmarks/bench_overhead.py [--quick]
"""

from __future__ import annotations

import sys
import tempfile
import textwrap
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil
from _collect import WORKER_SNIPPET, Collector, Conn
from _common import (
    MB,
    Launcher,
    Running,
    ScenarioFailure,
    display_command,
    elastrun,
    new_marker,
    own_cpu_seconds,
    require_clean,
    torchrun,
)
from _report import (
    Headline,
    Row,
    Section,
    alternate,
    common_parser,
    profile_of,
    ratio_check,
    ratio_text,
    run_section,
    write_section,
)

IDLE_WORKER = (
    textwrap.dedent(
        """\
    import os, sys, time
    COLLECTOR = sys.argv[1]
    """
    )
    + WORKER_SNIPPET
    + textwrap.dedent(
        """\
    tell("start", pid=os.getpid(), rank=int(os.environ["RANK"]))
    _SOCK.recv(1)  # blocks, using no CPU, until the benchmark says "finish"
    """
    )
)


@dataclass(frozen=True)
class Options:
    ns: tuple[int, ...]
    window_s: float
    reps: int
    timeout_s: float = 90.0


PROFILE_OPTIONS = {
    "smoke": Options(ns=(2,), window_s=1.0, reps=1),
    "quick": Options(ns=(8,), window_s=10.0, reps=1),
    "full": Options(ns=(4, 8), window_s=30.0, reps=2),
}


def _helpers(launcher: psutil.Process, workers: set[int]) -> list[psutil.Process]:
    """The launcher's descendants that are neither workers nor a worker's children."""
    worker_side = set(workers)
    for pid in workers:
        try:
            worker_side.update(c.pid for c in psutil.Process(pid).children(recursive=True))
        except psutil.NoSuchProcess:
            continue
    try:
        descendants = launcher.children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [c for c in descendants if c.pid not in worker_side]


#: What the helper processes were, by launcher name (for the report's notes).
HELPER_KINDS: dict[str, set[str]] = {}


def _describe(proc: psutil.Process) -> str:
    try:
        argv = proc.cmdline()
    except psutil.Error:
        return "?"
    if "-m" in argv and argv.index("-m") + 1 < len(argv):
        return "python -m " + argv[argv.index("-m") + 1]
    return Path(argv[0]).name if argv else "?"


def _cpu(pids: list[int]) -> float:
    return sum(own_cpu_seconds(p) or 0.0 for p in pids)


def idle_once(lch: Launcher, n: int, opts: Options) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-idle-") as tmp:
        work = Path(tmp)
        script = work / "idle_worker.py"
        script.write_text(IDLE_WORKER)
        with Collector(work / "c.sock") as col:
            running = Running(
                lch.command(n, script, [str(col.path)]),
                name=lch.name,
                marker=new_marker(),
                log_dir=work / "logs",
                env_extra=dict(lch.env),
            )
            try:
                result = _measure_window(running, col, n, opts)
            finally:
                col.send_all(b"f")
                outcome = running.finish(opts.timeout_s + opts.window_s)
        require_clean(outcome)
        return result


def _measure_window(running: Running, col: Collector, n: int, opts: Options) -> dict[str, float]:
    def all_started(conns: list[Conn]) -> bool:
        return sum(1 for c in conns if c.first("start")) >= n

    if not col.wait(all_started, opts.timeout_s):
        raise ScenarioFailure(f"not all {n} workers started within {opts.timeout_s:.0f} s")
    # call-overload: a JSON number
    workers = {int(c.hello["pid"]) for c in col.snapshot()}  # type: ignore[call-overload]
    launcher = psutil.Process(running.pid)
    # Helpers may start lazily; look for them once the workers run.
    time.sleep(0.5)
    found = _helpers(launcher, workers)
    helpers = [h.pid for h in found]
    for h in found:
        HELPER_KINDS.setdefault(running.name, set()).add(_describe(h))
    cpu0, hcpu0 = own_cpu_seconds(running.pid), _cpu(helpers)
    t0 = time.monotonic()
    peak = peak_all = 0.0
    end = t0 + opts.window_s
    while True:
        try:
            rss = launcher.memory_info().rss / MB
        except psutil.NoSuchProcess as exc:
            raise ScenarioFailure("the launcher exited during the idle window") from exc
        rss_helpers = 0.0
        for pid in helpers:
            try:
                rss_helpers += psutil.Process(pid).memory_info().rss / MB
            except psutil.NoSuchProcess:
                continue
        peak, peak_all = max(peak, rss), max(peak_all, rss + rss_helpers)
        left = end - time.monotonic()
        if left <= 0:
            break
        time.sleep(min(1.0, left))
    cpu1, hcpu1 = own_cpu_seconds(running.pid), _cpu(helpers)
    elapsed = time.monotonic() - t0
    if cpu0 is None or cpu1 is None:
        raise ScenarioFailure("could not read the launcher's CPU time")
    scale = opts.window_s / elapsed  # report per nominal window
    return {
        "cpu": (cpu1 - cpu0) * scale,
        "cpu_all": ((cpu1 - cpu0) + (hcpu1 - hcpu0)) * scale,
        "rss": peak,
        "rss_all": peak_all,
        "helpers": float(len(helpers)),
    }


def body(section: Section, opts: Options, launchers: list[Launcher]) -> None:
    w = f"{opts.window_s:.0f} s"
    section.intro = (
        f"The launcher's own CPU seconds over {w} of idle workers, and its peak RSS in that "
        'window (sampled every second); "+ helpers" adds the launcher\'s descendants that are '
        "not workers. Launchers alternate A B A B."
    )
    columns = [lch.name for lch in launchers]
    by_name = {lch.name: lch for lch in launchers}
    ref = "torchrun" if "torchrun" in columns else None
    table = section.table(f"Agent overhead over {w} of idle workers", columns, ref)
    for n in opts.ns:
        big = n == max(opts.ns)
        rows: dict[str, Row] = {
            "cpu": table.row(f"idle{n}.cpu", f"N={n}: launcher CPU over {w} (s)"),
            "cpu_all": table.row(f"idle{n}.cpu_all", f"N={n}: launcher + helpers CPU (s)"),
            "rss": table.row(f"idle{n}.rss", f"N={n}: launcher peak RSS (MB)", fmt=".1f"),
            "rss_all": table.row(
                f"idle{n}.rss_all",
                f"N={n}: launcher + helpers peak RSS (MB)",
                fmt=".1f",
                target="≤ 1/4 of torchrun's" if big else "",
                check=ratio_check("elastrun", "torchrun", 0.25) if big else None,
            ),
            "helpers": table.row(f"idle{n}.helpers", f"N={n}: helper processes", fmt=".0f"),
        }

        def measure(col: str, rep: int, n: int = n) -> dict[str, float]:
            return idle_once(by_name[col], n, opts)

        def record(col: str, m: Mapping[str, float], rows: dict[str, Row] = rows) -> None:
            for key, row in rows.items():
                if key in m:
                    row.add(col, m[key])

        alternate(section, f"idle N={n}", columns, opts.reps, measure, record)
        for col in columns:
            cmd = by_name[col].command(n, Path("/W/idle_worker.py"), ["/W/c.sock"])
            section.commands.setdefault(
                col,
                display_command(cmd, dict(by_name[col].env), Path("/W")).replace(
                    f"--nproc-per-node={n}", "--nproc-per-node=N"
                ),
            )
    n = max(opts.ns)
    if {"elastrun", "torchrun"} <= set(columns):
        for key, what in (
            ("rss_all", f"agent RSS with helpers, {n} idle workers"),
            ("rss", f"agent RSS, launcher process alone, {n} idle workers"),
            ("cpu", f"agent CPU over {w} idle, {n} workers"),
        ):
            row = table.rows[f"idle{n}.{key}"]
            section.headlines.append(
                Headline(
                    f"{what} (elastrun / torchrun)",
                    ratio_text(row, "elastrun", "torchrun"),
                    row.target,
                    row.verdict() if row.target else None,
                )
            )
        if table.rows[f"idle{n}.rss_all"].verdict() is False:
            section.where_time_goes.append(
                "Agent memory: see the launcher-alone row against the helpers row; helpers "
                "are the tcp store (multi-node only) and the worker template, which holds "
                "the preloaded modules once for all workers."
            )
    for name, kinds in sorted(HELPER_KINDS.items()):
        section.notes.append(f"{name}'s helper processes: {', '.join(sorted(kinds))}.")
    section.notes += [
        "CPU is user+system time from `/proc/<pid>/stat`, read at both ends of the window "
        "(workers excluded); RSS from psutil.",
        "torchrun polls its workers every 0.1 s (`monitor_interval`); elastrun waits on "
        "child-exit events.",
    ]


def run(profile: str, launchers: list[Launcher] | None = None) -> Section:
    launchers = launchers or [elastrun(), torchrun()]
    usable = [lch for lch in launchers if lch.available() is None]
    opts = PROFILE_OPTIONS[profile]

    def go(section: Section) -> None:
        for lch in launchers:
            if lch not in usable:
                section.fail(lch.name, f"not run: {lch.available()}")
        body(section, opts, usable)

    return run_section("overhead", "Agent overhead", go, profile)


def main(argv: list[str] | None = None) -> int:
    p = common_parser(__doc__ or "")
    p.add_argument("--launchers", default="elastrun,torchrun", help="comma list, in order")
    args = p.parse_args(argv)
    known = {"elastrun": elastrun(), "torchrun": torchrun()}
    section = run(profile_of(args), [known[x] for x in args.launchers.split(",") if x])
    print(section.render())
    write_section(section, args.output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())

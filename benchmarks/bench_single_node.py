"""Single-node launcher costs, elastrun side by side with torchrun, in one run.

Three scenarios, each repeated R times with the launchers alternating (A B A B ...), so
that drift in machine load hits both alike:

* launch: N trivial workers (N = 1, 2, 4, 8). Each worker's first statement records
  ``time.time()``. Measured: invoke -> every worker has run its first line; invoke ->
  launcher exited.
* recovery: 4 plain-Python workers, ``--max-restarts 1``. On attempt 0, local rank 1
  SIGKILLs itself once all four are up (recording the time just before); survivors trap
  SIGTERM and record when it arrives. Measured: kill -> last survivor signalled, kill ->
  first / all replacement workers of attempt 1 running.
* idle: 8 workers sleeping 10 s. 5 s after invoke: the launcher's RSS, and the RSS of the
  launcher plus its descendants that are not workers. The launcher's own CPU seconds
  over the whole run (read from its zombie, so workers' CPU is not included).

Run from the repository root::

    .venv/bin/python benchmarks/bench_single_node.py            # 5 repetitions
    .venv/bin/python benchmarks/bench_single_node.py --quick    # 2 repetitions

A launcher that fails is reported with its error and skipped for the rest of that
scenario; the other launcher's numbers are still measured.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil  # type: ignore[import-untyped]  # no stubs in the venv
from _common import MB, Launcher, RunOutcome, Summary, machine_info, read_float, run_launcher

REPO = Path(__file__).resolve().parents[1]
DEFAULT_BIN = REPO / ".venv" / "bin"
DEFAULT_OUTPUT = REPO / "benchmarks" / "results" / "single_node.md"

# Workers are plain Python with no imports beyond the standard library, so the numbers
# are the launcher's cost, not torch's import time.
LAUNCH_WORKER = (
    "import time; T = time.time(); import os, sys; "
    "open(os.path.join(sys.argv[1], os.environ['RANK']), 'a').write(repr(T) + '\\n')\n"
)

RECOVERY_WORKER = textwrap.dedent(
    """\
    import time; T = time.time()
    import os, signal, sys
    out = sys.argv[1]
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "?")
    local_rank = os.environ["LOCAL_RANK"]
    nproc = int(os.environ["LOCAL_WORLD_SIZE"])

    def put(name, text):
        # Write then rename, so a reader that sees the name sees all of its content.
        tmp = os.path.join(out, "." + name)
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(out, name))

    if attempt == "0":
        def on_term(signum, frame):
            put(f"term_{local_rank}", repr(time.time()))
            os._exit(128 + signum)
        signal.signal(signal.SIGTERM, on_term)
    put(f"start_{attempt}_{local_rank}", repr(T))
    if attempt != "0":
        sys.exit(0)
    if local_rank == "1":
        give_up = time.monotonic() + 60
        while not all(os.path.exists(os.path.join(out, f"start_0_{i}")) for i in range(nproc)):
            if time.monotonic() > give_up:
                sys.exit(3)
            time.sleep(0.002)
        # Let the launcher settle into watching its workers before the failure.
        time.sleep(0.5)
        put("kill", repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
    sys.exit(4)
    """
)

IDLE_WORKER = textwrap.dedent(
    """\
    import time; T = time.time()
    import os, sys
    with open(os.path.join(sys.argv[1], "pid_" + os.environ["LOCAL_RANK"]), "w") as f:
        f.write(f"{T!r} {os.getpid()}")
    time.sleep(float(sys.argv[2]))
    """
)

RECOVERY_NPROC = 4
IDLE_NPROC = 8
IDLE_SLEEP_S = 10.0
IDLE_PROBE_AT_S = 5.0
TORCHRUN_RECOVERY_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


class ScenarioFailure(Exception):
    """A launcher run that did not produce the measurement (with the reason)."""


# Whether elastrun meets a target, given its median and torchrun's (None when absent).
Check = Callable[[float, float | None], bool | None]


@dataclass(frozen=True)
class Command:
    """A launcher command line and the environment variables added for it."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Metric:
    """One report row's samples, per launcher."""

    row: Row
    samples: dict[str, list[float]] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.row.metric_key

    def add(self, launcher: str, value: float) -> None:
        self.samples.setdefault(launcher, []).append(value)


@dataclass
class Results:
    """Everything a run collected: samples, failures, the exact commands, notes."""

    metrics: dict[str, Metric] = field(default_factory=dict)
    errors: dict[tuple[str, str], str] = field(default_factory=dict)  # (scenario, launcher)
    commands: dict[tuple[str, str], str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- scenarios


def _require_clean(outcome: RunOutcome) -> None:
    failure = outcome.failure()
    if failure:
        raise ScenarioFailure(failure)


def launch_command(launcher: Launcher, nproc: int, work: Path) -> Command:
    return Command(launcher.command(nproc, work / "launch_worker.py", [str(work / "out")]))


def run_launch(cmd: Command, nproc: int, work: Path, timeout_s: float) -> dict[str, float]:
    (work / "launch_worker.py").write_text(LAUNCH_WORKER)
    out = work / "out"
    out.mkdir()
    outcome = run_launcher(cmd.argv, marker=str(work), log_dir=work / "logs", timeout_s=timeout_s)
    _require_clean(outcome)
    starts = [out / str(r) for r in range(nproc)]
    missing = [p.name for p in starts if not p.exists()]
    if missing:
        raise ScenarioFailure(f"ranks {missing} never ran their first line")
    first_lines = [read_float(p) for p in starts]
    result = {"all_running": max(first_lines) - outcome.t_invoke, "exited": outcome.wall_s}
    if outcome.cpu_s is not None:
        result["cpu"] = outcome.cpu_s
    return result


def recovery_command(launcher: Launcher, work: Path) -> Command:
    argv = launcher.command(
        RECOVERY_NPROC, work / "recovery_worker.py", [str(work / "out")], "--max-restarts=1"
    )
    return Command(argv, TORCHRUN_RECOVERY_ENV if launcher.name == "torchrun" else {})


def run_recovery(cmd: Command, work: Path, timeout_s: float) -> dict[str, float]:
    (work / "recovery_worker.py").write_text(RECOVERY_WORKER)
    out = work / "out"
    out.mkdir()
    outcome = run_launcher(
        cmd.argv, marker=str(work), log_dir=work / "logs", timeout_s=timeout_s, env_extra=cmd.env
    )
    _require_clean(outcome)
    kill_file = out / "kill"
    if not kill_file.exists():
        raise ScenarioFailure("local rank 1 never reached its kill point")
    killed = read_float(kill_file)
    replacements = [out / f"start_1_{r}" for r in range(RECOVERY_NPROC)]
    missing = [p.name for p in replacements if not p.exists()]
    if missing:
        raise ScenarioFailure(f"replacement workers {missing} never started")
    restarted = [read_float(p) for p in replacements]
    result = {
        "first_replacement": min(restarted) - killed,
        "all_replacements": max(restarted) - killed,
        "wall": outcome.wall_s,
    }
    terms = [out / f"term_{r}" for r in range(RECOVERY_NPROC) if r != 1]
    if all(p.exists() for p in terms):
        last_term = max(read_float(p) for p in terms)
        result["survivors_signalled"] = last_term - killed
        result["signalled_to_first_replacement"] = min(restarted) - last_term
    return result


def _idle_probe(out: Path) -> Callable[[psutil.Process], dict[str, float]]:
    def probe(agent: psutil.Process) -> dict[str, float]:
        workers: set[int] = set()
        for p in out.glob("pid_*"):
            workers.add(int(p.read_text().split()[1]))
        if len(workers) < IDLE_NPROC:
            raise ValueError(f"only {len(workers)} of {IDLE_NPROC} workers running after 5 s")
        # A worker's own children belong to the worker, not to the launcher.
        worker_side = set(workers)
        for pid in workers:
            try:
                worker_side.update(c.pid for c in psutil.Process(pid).children(recursive=True))
            except psutil.NoSuchProcess:
                continue
        agent_rss = agent.memory_info().rss
        helpers_rss = 0
        helpers = 0
        for child in agent.children(recursive=True):
            if child.pid in worker_side:
                continue
            try:
                helpers_rss += child.memory_info().rss
                helpers += 1
            except psutil.NoSuchProcess:
                continue
        return {
            "rss_launcher": agent_rss / MB,
            "rss_with_helpers": (agent_rss + helpers_rss) / MB,
            "helper_processes": float(helpers),
        }

    return probe


def idle_command(launcher: Launcher, work: Path) -> Command:
    script_args = [str(work / "out"), str(IDLE_SLEEP_S)]
    return Command(launcher.command(IDLE_NPROC, work / "idle_worker.py", script_args))


def run_idle(cmd: Command, work: Path, timeout_s: float) -> dict[str, float]:
    (work / "idle_worker.py").write_text(IDLE_WORKER)
    out = work / "out"
    out.mkdir()
    outcome = run_launcher(
        cmd.argv,
        marker=str(work),
        log_dir=work / "logs",
        timeout_s=timeout_s + IDLE_SLEEP_S,
        probe_at_s=IDLE_PROBE_AT_S,
        probe=_idle_probe(out),
    )
    _require_clean(outcome)
    if outcome.probe_error:
        raise ScenarioFailure(f"probe at {IDLE_PROBE_AT_S} s failed: {outcome.probe_error}")
    if outcome.cpu_s is None:
        raise ScenarioFailure("could not read the launcher's CPU time")
    return {**outcome.probe, "cpu": outcome.cpu_s, "wall": outcome.wall_s}


# --------------------------------------------------------------------------- driver


def _display_command(cmd: Command, work: Path) -> str:
    prefix = " ".join(f"{k}={v}" for k, v in cmd.env.items())
    text = shlex.join(cmd.argv).replace(str(work), "<tmp>").replace(str(REPO) + "/", "")
    return f"{prefix} {text}".strip()


@dataclass(frozen=True)
class Row:
    """How one measured value becomes a report row."""

    result_key: str
    metric_key: str
    label: str
    fmt: str = ".3f"
    target: str = ""
    check: Check | None = None


@dataclass(frozen=True)
class Scenario:
    """A named measurement: how to build the command, how to run it, what it reports."""

    name: str
    command: Callable[[Launcher, Path], Command]
    run: Callable[[Command, Path], dict[str, float]]
    rows: tuple[Row, ...]


def _launch8_check(elastrun: float, torchrun: float | None) -> bool | None:
    return None if torchrun is None else elastrun <= 0.25 * torchrun


def launch_scenario(n: int, timeout_s: float) -> Scenario:
    """The launch measurement for `n` workers."""

    def command(lch: Launcher, work: Path) -> Command:
        return launch_command(lch, n, work)

    def run(cmd: Command, work: Path) -> dict[str, float]:
        return run_launch(cmd, n, work, timeout_s)

    what = f"launch, {n} trivial worker{'s' if n != 1 else ''}"
    return Scenario(
        name=f"launch N={n}",
        command=command,
        run=run,
        rows=(
            Row(
                "all_running",
                f"launch{n}.running",
                f"{what}: invoke → all running (s)",
                target="≥ 4x sooner (ratio ≤ 0.25)" if n == 8 else "",
                check=_launch8_check if n == 8 else None,
            ),
            Row("exited", f"launch{n}.exit", f"{what}: invoke → launcher exited (s)"),
            *(
                # The launcher's CPU for a short job: start-up cost, to set against the
                # idle scenario's CPU over 10 s.
                [Row("cpu", f"launch{n}.cpu", f"{what}: launcher CPU (s)")] if n == 8 else []
            ),
        ),
    )


def build_scenarios(args: argparse.Namespace) -> list[Scenario]:
    t = args.timeout
    scenarios: list[Scenario] = []
    if "launch" in args.scenarios:
        scenarios += [launch_scenario(n, t) for n in args.nprocs]
    if "recovery" in args.scenarios:
        scenarios.append(
            Scenario(
                name="recovery",
                command=recovery_command,
                run=lambda cmd, w: run_recovery(cmd, w, t),
                rows=(
                    Row(
                        "survivors_signalled",
                        "rec.signalled",
                        "recovery, 4 workers: SIGKILL → last survivor got SIGTERM (s)",
                    ),
                    Row(
                        "signalled_to_first_replacement",
                        "rec.gap",
                        "recovery: last survivor SIGTERM → first replacement running (s)",
                    ),
                    Row(
                        "first_replacement",
                        "rec.first",
                        "recovery: SIGKILL → first replacement running (s)",
                    ),
                    Row(
                        "all_replacements",
                        "rec.all",
                        "recovery: SIGKILL → all 4 replacements running (s)",
                        target="< 0.2 s (+ survivors' shutdown, ≈ 0 here)",
                        check=lambda e, _t: e < 0.2,
                    ),
                    Row("wall", "rec.wall", "recovery: invoke → launcher exited (s)"),
                ),
            )
        )
    if "idle" in args.scenarios:
        what = f"idle, {IDLE_NPROC} workers"
        scenarios.append(
            Scenario(
                name="idle",
                command=idle_command,
                run=lambda cmd, w: run_idle(cmd, w, t),
                rows=(
                    Row("rss_launcher", "idle.rss", f"{what}: launcher RSS at 5 s (MB)", ".1f"),
                    Row(
                        "rss_with_helpers",
                        "idle.rss_all",
                        f"{what}: launcher + non-worker children RSS (MB)",
                        ".1f",
                        target="< 60 MB",
                        check=lambda e, _t: e < 60,
                    ),
                    Row(
                        "helper_processes",
                        "idle.helpers",
                        f"{what}: non-worker child processes of the launcher",
                        ".0f",
                    ),
                    Row(
                        "cpu",
                        "idle.cpu",
                        f"{what}: launcher CPU over the {IDLE_SLEEP_S:.0f} s run (s)",
                    ),
                ),
            )
        )
    return scenarios


def warm_up(launchers: Sequence[Launcher], timeout_s: float) -> None:
    """One discarded N=1 launch per launcher: fills the page cache for both alike."""
    for lch in launchers:
        with tempfile.TemporaryDirectory(prefix="bench-warm-") as tmp:
            work = Path(tmp)
            try:
                run_launch(launch_command(lch, 1, work), 1, work, timeout_s)
            except ScenarioFailure:
                pass  # the measured runs report the failure properly


def _run_once(sc: Scenario, lch: Launcher, rep: int, results: Results) -> dict[str, float] | None:
    with tempfile.TemporaryDirectory(prefix=f"bench-{lch.name}-") as tmp:
        work = Path(tmp)
        cmd = sc.command(lch, work)
        results.commands.setdefault((sc.name, lch.name), _display_command(cmd, work))
        try:
            return sc.run(cmd, work)
        except ScenarioFailure as exc:
            results.errors[(sc.name, lch.name)] = f"rep {rep + 1}: {exc}"
            lines = [ln for ln in str(exc).splitlines() if ln.strip()]
            summary = lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1].strip()}"
            print(
                f"[bench] {sc.name:>12} {lch.name:>8} rep {rep + 1}: FAILED: {summary}", flush=True
            )
            return None


def run_all(args: argparse.Namespace, launchers: Sequence[Launcher], results: Results) -> None:
    scenarios = build_scenarios(args)
    usable = []
    for lch in launchers:
        reason = lch.available()
        if reason is None:
            usable.append(lch)
            continue
        print(f"[bench] {lch.name}: unavailable ({reason})", flush=True)
        for sc in scenarios:
            results.errors[(sc.name, lch.name)] = f"not run: {reason}"
    if not args.no_warmup:
        warm_up(usable, args.timeout)
    for sc in scenarios:
        for row in sc.rows:
            results.metrics[row.metric_key] = Metric(row)
        failed: set[str] = set()
        for rep in range(args.reps):
            for lch in usable:
                if lch.name in failed:
                    continue
                measured = _run_once(sc, lch, rep, results)
                if measured is None:
                    # One failure is enough: the rest of this scenario would fail alike.
                    failed.add(lch.name)
                    continue
                for row in sc.rows:
                    if row.result_key in measured:
                        results.metrics[row.metric_key].add(lch.name, measured[row.result_key])
                shown = ", ".join(f"{k}={v:.3f}" for k, v in measured.items())
                print(f"[bench] {sc.name:>12} {lch.name:>8} rep {rep + 1}: {shown}", flush=True)


# --------------------------------------------------------------------------- report


def render_table(results: Results, a: str, b: str) -> str:
    """The Markdown table: launcher `b` (the reference) first, then `a` and a / b."""
    lines = [
        f"| metric | {b} median (min-max) | {a} median (min-max) | {a} / {b} | target | met |",
        "|---|---|---|---|---|---|",
    ]
    for m in results.metrics.values():
        sa = Summary(tuple(m.samples.get(a, ())))
        sb = Summary(tuple(m.samples.get(b, ())))
        have_a, have_b = bool(sa.samples), bool(sb.samples)
        ratio = f"{sa.median / sb.median:.2f}" if have_a and have_b and sb.median else "-"
        met = "-"
        if m.row.check is not None and have_a:
            verdict = m.row.check(sa.median, sb.median if have_b else None)
            met = "-" if verdict is None else ("yes" if verdict else "no")
        lines.append(
            f"| {m.row.label} | {sb.render(m.row.fmt)} | {sa.render(m.row.fmt)} | {ratio} | "
            f"{m.row.target} | {met} |"
        )
    return "\n".join(lines) + "\n"


def render_report(
    results: Results, info: dict[str, str], args: argparse.Namespace, a: str, b: str
) -> str:
    lines = [
        "# Single-node launcher benchmark: elastrun vs torchrun",
        "",
        f"Generated by `benchmarks/bench_single_node.py` ({args.reps} repetition"
        f"{'s' if args.reps != 1 else ''} per "
        "scenario, launchers alternating A B A B; median and min-max).",
        "",
        "## Machine",
        "",
        *(f"- {k}: {v}" for k, v in info.items()),
        "",
        "## Results",
        "",
        render_table(results, a, b),
    ]
    if results.errors:
        lines += ["## Failures", ""]
        for (scenario, launcher), msg in results.errors.items():
            lines += [
                f"- **{launcher}**, {scenario}:",
                "",
                "  ```",
                *("  " + ln for ln in msg.splitlines()),
                "  ```",
                "",
            ]
    lines += ["## Commands", ""]
    for (scenario, launcher), cmd in results.commands.items():
        lines.append(f"- {scenario}, {launcher}: `{cmd}`")
    lines += [
        "",
        "## Notes",
        "",
        "- Workers are plain Python (no torch); each records `time.time()` as its first "
        "statement. Launch latency = last worker's first line - the moment just before "
        "the launcher was started.",
        "- torchrun's recovery runs set `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`: its "
        "default shared rendezvous store can break the restart after a worker is "
        "SIGKILLed (reference §5.1). elastrun gets no extra environment.",
        '- Survivors exit at once on SIGTERM, so "SIGKILL → last survivor got SIGTERM" is '
        "the launcher's detection and signalling time, and the next row is its restart "
        "time (survivor exit, reaping, re-rendezvous, new interpreters).",
        '- RSS is sampled 5 s after invoke with psutil; "non-worker children" are the '
        "launcher's descendants minus the workers and their own children. Launcher CPU is "
        "its own user+system time read from its zombie, so its workers are excluded.",
        *(f"- {n}" for n in results.notes),
        "",
    ]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5, help="repetitions per scenario (default 5)")
    p.add_argument("--quick", action="store_true", help="2 repetitions")
    p.add_argument("--elastrun", type=Path, default=DEFAULT_BIN / "elastrun")
    p.add_argument("--torchrun", type=Path, default=DEFAULT_BIN / "torchrun")
    p.add_argument(
        "--launchers",
        default="elastrun,torchrun",
        help="comma list, in alternation order (default elastrun,torchrun)",
    )
    p.add_argument("--scenarios", default="launch,recovery,idle", help="comma list of scenarios")
    p.add_argument("--nprocs", default="1,2,4,8", help="worker counts for launch")
    p.add_argument("--timeout", type=float, default=60.0, help="per launcher run (s)")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="Markdown report path")
    args = p.parse_args(argv)
    if args.quick:
        args.reps = 2
    if args.reps < 1:
        p.error("--reps must be >= 1")
    args.launchers = [x for x in args.launchers.split(",") if x]
    unknown = set(args.launchers) - {"elastrun", "torchrun"}
    if unknown:
        p.error(f"unknown launchers: {sorted(unknown)}")
    args.scenarios = [x for x in args.scenarios.split(",") if x]
    bad = set(args.scenarios) - {"launch", "recovery", "idle"}
    if bad:
        p.error(f"unknown scenarios: {sorted(bad)}")
    args.nprocs = [int(x) for x in args.nprocs.split(",") if x]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    paths = {"elastrun": args.elastrun, "torchrun": args.torchrun}
    launchers = [Launcher(name, paths[name]) for name in args.launchers]
    info = machine_info()
    results = Results()
    run_all(args, launchers, results)
    report = render_report(results, info, args, "elastrun", "torchrun")
    print()
    print(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(report)
    raw = {
        "machine": info,
        "reps": args.reps,
        "samples": {m.key: m.samples for m in results.metrics.values()},
        "errors": {f"{s} / {lch}": e for (s, lch), e in results.errors.items()},
        "commands": {f"{s} / {lch}": c for (s, lch), c in results.commands.items()},
    }
    args.output.with_suffix(".json").write_text(json.dumps(raw, indent=2) + "\n")
    print(f"[bench] wrote {args.output} and {args.output.with_suffix('.json')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

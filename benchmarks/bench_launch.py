"""Launch latency, elastrun side by side with torchrun, in one run.

For N = 1, 2, 4, 8 workers on this node, and two workloads:

* **trivial**: a plain Python script whose first statement records ``time.time()``;
* **torch**: a script that records its first line, imports torch and joins a gloo
  process group (``init_process_group("gloo")``), recording each moment.

Measured from just before the launcher is started: every worker has run its first line;
(torch) every worker has joined the process group; the launcher has exited. The
launchers alternate A B A B, so drift in machine load hits both alike.

The trivial workload also has a **bare spawn** column, the floor no launcher can beat:
the N workers started directly from the benchmark (``python -u worker.py``, the same
environment plus their rank), timed the same way. Run from the repository root::

    .venv/bin/python benchmarks/bench_launch.py            # full
    .venv/bin/python benchmarks/bench_launch.py --quick
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from _common import (
    PYTHON,
    Launcher,
    ScenarioFailure,
    display_command,
    elastrun,
    elastrun_no_template,
    kill_marked,
    new_marker,
    read_float,
    require_clean,
    run_launcher,
    tagged_env,
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

#: The column of workers started without any launcher (trivial workload only).
BARE = "bare spawn"
#: The column of the least a Python launcher can do (trivial workload only): see
#: ``_minimal_launcher.py``.
MINIMAL = "minimal Python launcher"
MINIMAL_SCRIPT = Path(__file__).resolve().parent / "_minimal_launcher.py"

TRIVIAL_WORKER = (
    "import time; T = time.time(); import os, sys; "
    "open(os.path.join(sys.argv[1], 'first_' + os.environ['RANK']), 'w').write(repr(T))\n"
)

TORCH_WORKER = textwrap.dedent(
    """\
    import time; T = time.time()
    import os, sys
    PRE = "torch" in sys.modules  # already there: forked from a pre-imported template
    out, rank = sys.argv[1], os.environ["RANK"]

    def put(name, t):
        with open(os.path.join(out, f"{name}_{rank}"), "w") as f:
            f.write(f"{t!r} {int(PRE)}")

    put("first", T)
    import torch
    import torch.distributed as dist
    put("imported", time.time())
    dist.init_process_group("gloo")
    put("joined", time.time())
    dist.destroy_process_group()
    """
)


@dataclass(frozen=True)
class Options:
    trivial_ns: tuple[int, ...]
    torch_ns: tuple[int, ...]
    reps: int
    torch_reps: int
    timeout_s: float = 180.0


PROFILE_OPTIONS = {
    "smoke": Options(trivial_ns=(1,), torch_ns=(), reps=1, torch_reps=1),
    "quick": Options(trivial_ns=(1, 8), torch_ns=(1, 4), reps=2, torch_reps=1),
    "full": Options(trivial_ns=(1, 2, 4, 8), torch_ns=(1, 2, 4, 8), reps=5, torch_reps=3),
}


@contextmanager
def _work(worker: str) -> Iterator[tuple[Path, Path]]:
    """A temporary directory holding the worker script and its output folder."""
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(worker)
        out = Path(tmp) / "out"
        out.mkdir()
        yield script, out


def launch_once(lch: Launcher, workload: str, n: int, timeout_s: float) -> dict[str, float]:
    """One launch of `n` workers; seconds from invoke to each milestone."""
    with _work(TRIVIAL_WORKER if workload == "trivial" else TORCH_WORKER) as (script, out):
        cmd = lch.command(n, script, [str(out)])
        outcome = run_launcher(
            cmd,
            marker=new_marker(),
            log_dir=script.parent / "logs",
            timeout_s=timeout_s,
            env_extra=dict(lch.env),
        )
        require_clean(outcome)
        t0 = outcome.t_invoke
        result = {"exited": outcome.wall_s}
        if outcome.cpu_s is not None:
            result["cpu"] = outcome.cpu_s
        stages = ("first",) if workload == "trivial" else ("first", "imported", "joined")
        for stage in stages:
            files = [out / f"{stage}_{r}" for r in range(n)]
            missing = [f.name for f in files if not f.exists()]
            if missing:
                raise ScenarioFailure(f"{missing} were never written")
            result[stage] = max(read_float(f) for f in files) - t0
        if workload == "torch":
            flags = {(out / f"first_{r}").read_text().split()[1] for r in range(n)}
            result["template"] = 1.0 if flags == {"1"} else 0.0
        return result


def bare_spawn_once(n: int, timeout_s: float) -> dict[str, float]:
    """The floor: `n` trivial workers started directly from here, no launcher at all.

    Each gets the environment a launcher passes on (the run's marker) plus its rank; the
    environments are built before the clock starts, so only the spawns are timed.
    """
    marker = new_marker()
    with _work(TRIVIAL_WORKER) as (script, out):
        base = tagged_env(marker)
        envs = [
            {**base, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(n)} for r in range(n)
        ]
        argv = [PYTHON, "-u", str(script), str(out)]
        procs: list[subprocess.Popen[bytes]] = []
        t0 = time.time()
        try:
            for env in envs:
                procs.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL))
            deadline = time.monotonic() + timeout_s
            for proc in procs:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            exited = time.time() - t0
        except subprocess.TimeoutExpired as exc:
            raise ScenarioFailure(f"{n} bare workers did not exit within {timeout_s} s") from exc
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            kill_marked(marker)
        if any(proc.returncode for proc in procs):
            raise ScenarioFailure(f"bare workers exited with {[p.returncode for p in procs]}")
        return {"first": _last_first_line(out, n) - t0, "exited": exited}


def minimal_launch_once(n: int, timeout_s: float) -> dict[str, float]:
    """The yardstick: `n` trivial workers under ``_minimal_launcher.py``."""
    lch = Launcher(MINIMAL, Path(PYTHON))
    with _work(TRIVIAL_WORKER) as (script, out):
        cmd = lch.command(n, script, [str(out)])
        cmd.insert(1, str(MINIMAL_SCRIPT))
        logs = script.parent / "logs"
        outcome = run_launcher(cmd, marker=new_marker(), log_dir=logs, timeout_s=timeout_s)
        require_clean(outcome)
        first = _last_first_line(out, n) - outcome.t_invoke
        return {"first": first, "exited": outcome.wall_s}


def _last_first_line(out: Path, n: int) -> float:
    """The moment the last of `n` trivial workers ran its first line (their files)."""
    files = [out / f"first_{r}" for r in range(n)]
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise ScenarioFailure(f"{missing} were never written")
    return max(read_float(f) for f in files)


def warm_up(launchers: list[Launcher], torch_too: bool, timeout_s: float) -> None:
    """Discarded runs that fill the page cache for every launcher alike."""
    for lch in launchers:
        try:
            launch_once(lch, "trivial", 1, timeout_s)
        except ScenarioFailure:
            pass  # the measured runs report the failure properly
    if torch_too:
        import subprocess

        marker = new_marker()
        subprocess.run(
            [PYTHON, "-c", "import torch.distributed"],
            env=tagged_env(marker),
            timeout=timeout_s,
            check=False,
        )


def body(section: Section, opts: Options, launchers: list[Launcher], bare: bool = True) -> None:
    section.intro = (
        "From just before the launcher is started until every worker has run its first "
        "line, (torch workload) joined a gloo process group, and until the launcher exited. "
        "`--standalone --nproc-per-node=N`, the same flags for both; launchers alternate "
        f"A B A B. `{BARE}` (trivial workload): the workers started directly, no launcher "
        f"-- the floor. `{MINIMAL}` (trivial workload): the least a launcher written in "
        "Python can do (see `_minimal_launcher.py`)."
    )
    columns = [lch.name for lch in launchers]
    by_name = {lch.name: lch for lch in launchers}
    ref = "torchrun" if "torchrun" in columns else None
    warm_up(launchers, bool(opts.torch_ns), opts.timeout_s)
    plots: dict[str, dict[str, dict[str, list[float]]]] = {}
    for workload, ns, reps in (
        ("trivial", opts.trivial_ns, opts.reps),
        ("torch", opts.torch_ns, opts.torch_reps),
    ):
        if not ns:
            continue
        what_w = "trivial script" if workload == "trivial" else "import torch + gloo group"
        cols = [*columns, MINIMAL, BARE] if workload == "trivial" and bare else columns
        table = section.table(f"Launch, {what_w}", cols, ref)
        for n in ns:
            label = f"N={n}"
            main = "first" if workload == "trivial" else "joined"
            rows: dict[str, Row] = {
                "first": table.row(
                    f"{workload}{n}.first",
                    f"{label}: invoke → all workers running (s)",
                    target="≥ 4x sooner (ratio ≤ 0.25)" if workload == "trivial" and n == 8 else "",
                    check=ratio_check("elastrun", "torchrun", 0.25)
                    if workload == "trivial" and n == 8
                    else None,
                ),
            }
            if workload == "torch":
                rows["imported"] = table.row(
                    f"{workload}{n}.imported", f"{label}: invoke → all imported torch (s)"
                )
                rows["joined"] = table.row(
                    f"{workload}{n}.joined", f"{label}: invoke → all joined the gloo group (s)"
                )
            rows["exited"] = table.row(f"{workload}{n}.exited", f"{label}: invoke → exit (s)")
            if n == max(ns):
                rows["cpu"] = table.row(f"{workload}{n}.cpu", f"{label}: launcher's own CPU (s)")
            templated: dict[str, list[float]] = {}

            def measure(
                col: str, rep: int, workload: str = workload, n: int = n
            ) -> dict[str, float]:
                if col == BARE:
                    return bare_spawn_once(n, opts.timeout_s)
                if col == MINIMAL:
                    return minimal_launch_once(n, opts.timeout_s)
                return launch_once(by_name[col], workload, n, opts.timeout_s)

            def record(
                col: str,
                m: Mapping[str, float],
                rows: dict[str, Row] = rows,
                templated: dict[str, list[float]] = templated,
            ) -> None:
                for key, row in rows.items():
                    if key in m:
                        row.add(col, m[key])
                if "template" in m:
                    templated.setdefault(col, []).append(m["template"])

            alternate(section, f"launch {workload} N={n}", cols, reps, measure, record)
            for col in cols:
                if col == BARE:
                    argv = [PYTHON, "-u", "/W/worker.py", "/W/out"]
                    shown = "N x " + display_command(argv, {}, Path("/W")) + " (RANK=i)"
                elif col == MINIMAL:
                    argv = [PYTHON, "benchmarks/_minimal_launcher.py", "--standalone"]
                    argv += ["--nproc-per-node=N", "/W/worker.py", "/W/out"]
                    shown = display_command(argv, {}, Path("/W"))
                else:
                    cmd = by_name[col].command(n, Path("/W/worker.py"), ["/W/out"])
                    shown = display_command(cmd, dict(by_name[col].env), Path("/W"))
                    shown = shown.replace(f"--nproc-per-node={n}", "--nproc-per-node=N")
                section.commands.setdefault(f"{workload}, {col}", shown)
                s = rows[main].samples.get(col, [])
                plots.setdefault(workload, {}).setdefault(col, {}).setdefault(str(n), []).extend(
                    [float(x) for x in s]
                )
            for col, flags in templated.items():
                if col.startswith("elastrun"):
                    used = "yes" if all(flags) else "no" if not any(flags) else "in some runs"
                    template_used = section.raw.setdefault("template_used", {})
                    assert isinstance(template_used, dict)
                    template_used[f"{col} N={n}"] = used
    section.raw["plot"] = plots
    _headlines(section, columns)
    _notes(section)


def _headlines(section: Section, columns: list[str]) -> None:
    _floor_headline(section)
    for t in section.tables:
        for key in ("trivial8.first", "torch8.joined"):
            row = t.rows.get(key)
            if row is None or "elastrun" not in columns or "torchrun" not in columns:
                continue
            what = (
                "launch, 8 trivial workers: invoke → all running (elastrun / torchrun)"
                if key.startswith("trivial")
                else "launch, 8 torch workers: invoke → all in the gloo group (elastrun / torchrun)"
            )
            section.headlines.append(
                Headline(
                    what,
                    ratio_text(row, "elastrun", "torchrun"),
                    row.target or "",
                    row.verdict() if row.target else None,
                )
            )
            if row.target and row.verdict() is False:
                one = t.rows.get("trivial1.first")
                e1 = one.medians().get("elastrun") if one is not None else None
                e8 = row.medians().get("elastrun")
                split = ""
                if e1 is not None and e8 is not None:
                    split = (
                        f": {e1:.3f} s for one worker (the launcher's own start-up and the "
                        f"first worker), then {(e8 - e1) / 7 * 1000:.0f} ms per further worker"
                    )
                section.where_time_goes.append(
                    f"8 trivial workers under elastrun{split}; on 2 cores the interpreters "
                    "of the workers start partly one after another."
                )


#: elastrun's 8 trivial workers should be running within this factor of the bare floor.
FLOOR_TARGET = 1.5


def _floor_headline(section: Section) -> None:
    """elastrun against the bare-spawn floor: what the launcher itself adds."""
    for t in section.tables:
        row = t.rows.get("trivial8.first")
        if row is None or BARE not in row.samples or "elastrun" not in row.samples:
            continue
        verdict = ratio_check("elastrun", BARE, FLOOR_TARGET)(row.medians())
        section.headlines.append(
            Headline(
                "launch, 8 trivial workers: invoke → all running (elastrun / bare-spawn floor)",
                ratio_text(row, "elastrun", BARE),
                f"≤ {FLOOR_TARGET}x the floor",
                verdict,
            )
        )
        m = row.medians()
        if MINIMAL in m:
            section.headlines.append(
                Headline(
                    "launch, 8 trivial workers: invoke → all running "
                    "(elastrun / minimal Python launcher)",
                    ratio_text(row, "elastrun", MINIMAL),
                    "",
                    None,
                )
            )
        if verdict is False:
            least = ""
            if MINIMAL in m:
                least = (
                    f" The least a Python launcher can do (`{MINIMAL}`: its interpreter, the "
                    "standard modules any launcher imports, then a fork per worker) takes "
                    f"{m[MINIMAL]:.3f} s, {m[MINIMAL] / m[BARE]:.1f}x the floor."
                )
            section.where_time_goes.append(
                f"elastrun adds {m['elastrun'] - m[BARE]:.3f} s to the {m[BARE]:.3f} s it takes "
                "to start 8 interpreters at all: its own interpreter and imports, the "
                "rendezvous, the worker template's start and the forks (see `--dry-run` and "
                f"`python -X importtime -m elastrun` for the launcher's share).{least}"
            )


def _notes(section: Section) -> None:
    used = section.raw.get("template_used")
    if isinstance(used, dict) and used:
        shown = ", ".join(f"{k}: {v}" for k, v in used.items())
        section.notes.append(
            "Torch workload: workers forked from elastrun's pre-imported template (torch "
            f"already in `sys.modules` at the worker's first line): {shown}."
        )
    section.notes += [
        f"`{BARE}`: the N trivial workers started directly by the benchmark with "
        "`subprocess.Popen`, one after another, each with the launchers' environment and "
        "its RANK; the floor for any launcher on this machine.",
        f"`{MINIMAL}`: `benchmarks/_minimal_launcher.py`, started like a launcher; it imports "
        "argparse, logging, dataclasses, subprocess, socket, json, threading and tempfile, "
        "forks each worker from itself and runs the script with runpy (no rendezvous, store, "
        "logs or supervision): a lower bound for a launcher written in Python.",
        "Workers record `time.time()` in files named after their rank; latency = the last "
        "worker's moment - the moment just before the launcher was started. Exit is noticed "
        "through a pidfd.",
        "Launcher CPU is its own user+system time read from its zombie before it is reaped "
        "(workers excluded).",
        "One discarded N=1 launch per launcher (and one `import torch`) warms the page cache "
        "first.",
    ]


def cache_bytecode() -> str | None:
    """Let every interpreter of the run read and write cached bytecode, as from an install.

    With ``PYTHONDONTWRITEBYTECODE`` set (as in some development shells), an editable
    install compiles every elastrun module from source on each start -- tens of
    milliseconds that an installed package (whose ``.pyc`` files pip writes) never pays,
    while the bare-spawn floor and torch's installed modules do not pay them either. The
    bytecode goes to a private ``PYTHONPYCACHEPREFIX``, not into the source tree; the
    warm-up runs fill it. Returns the note for the report, or None when nothing changed.
    """
    if not sys.dont_write_bytecode and "PYTHONDONTWRITEBYTECODE" not in os.environ:
        return None
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="bench-launch-pyc-")
    return (
        "PYTHONDONTWRITEBYTECODE was set in the benchmark's environment: every launcher and "
        "worker ran with it unset and a private PYTHONPYCACHEPREFIX (filled by the warm-up "
        "runs), so that an editable install reads cached bytecode as an installed one does."
    )


def main(argv: list[str] | None = None) -> int:
    p = common_parser(__doc__ or "")
    p.add_argument(
        "--launchers",
        default="elastrun,torchrun,elastrun-no-template",
        help="comma list, in alternation order",
    )
    p.add_argument("--trivial-only", action="store_true", help="leave out the torch workload")
    p.add_argument(
        "--no-bare",
        action="store_true",
        help=f"leave out the {BARE!r} column (workers started without a launcher)",
    )
    args = p.parse_args(argv)
    profile = profile_of(args)
    known = {
        "elastrun": elastrun(),
        "torchrun": torchrun(),
        "elastrun-no-template": elastrun_no_template(),
    }
    launchers = [known[x] for x in args.launchers.split(",") if x]
    bytecode_note = cache_bytecode()
    section = run(profile, launchers, bare=not args.no_bare, torch=not args.trivial_only)
    if bytecode_note is not None:
        section.notes.append(bytecode_note)
    print(section.render())
    write_section(section, args.output_dir)
    return 0


def run(
    profile: str, launchers: list[Launcher] | None = None, bare: bool = True, torch: bool = True
) -> Section:
    launchers = launchers or [elastrun(), torchrun(), elastrun_no_template()]
    usable = [lch for lch in launchers if lch.available() is None]
    opts = PROFILE_OPTIONS[profile]
    if not torch:
        opts = dataclasses.replace(opts, torch_ns=())

    def go(section: Section) -> None:
        for lch in launchers:
            if lch not in usable:
                section.fail(lch.name, f"not run: {lch.available()}")
        body(section, opts, usable, bare)

    return run_section("launch", "Launch", go, profile)


if __name__ == "__main__":
    sys.exit(main())

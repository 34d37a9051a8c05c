"""Time to recover a gloo DDP job after one rank is SIGKILLed, broken into its phases.

The job: N = 2 and 4 workers train a small MLP with DistributedDataParallel over gloo, a
step every ~50 ms, rank 0 checkpointing every 10 steps. When the last rank reports step
25 of the first attempt, the benchmark SIGKILLs it (recording the moment just before).
The launcher restarts the group (``--max-restarts=1``); the new workers load the
checkpoint and run 10 more steps.

Every worker reports to the benchmark over a Unix socket (first line, torch imported,
process group joined, each step); the socket's EOF gives the moment each old worker died.
The launcher's own timeline comes from its log: elastrun's event log
(``--event-log-handler file:...``) and torchrun's INFO log (``LOGLEVEL=INFO``). Phases,
each ending when the slowest worker (or the launcher) is done with it:

detection (kill -> the launcher reacts), stopping the survivors (-> stopped), rendezvous
(-> complete), process start (-> every new worker runs its first line), torch import,
process-group init, first step after the restart (checkpoint load + one step).

Variants, alternating: elastrun (default: workers forked from the template that
pre-imports what the script imports), torchrun with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
(its default shared store cannot recover this job), ``elastrun --no-template`` and
``elastrun --preload torch,torch._dynamo`` (the template also holds what DDP imports
lazily). Run from the repository root::

    .venv/bin/python benchmarks/bench_recovery.py [--quick]
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from _collect import WORKER_SNIPPET, Collector, Conn
from _common import (
    Launcher,
    Running,
    ScenarioFailure,
    display_command,
    elastrun,
    elastrun_no_template,
    new_marker,
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

DDP_WORKER = (
    textwrap.dedent(
        """\
    import time; T0 = time.time()
    import os, sys
    PRE = "torch" in sys.modules  # forked from a template that already imported it
    COLLECTOR, CKPT_DIR = sys.argv[1], sys.argv[2]
    PERIOD, EVERY, AFTER = float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    """
    )
    + WORKER_SNIPPET
    + textwrap.dedent(
        """\
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tell("start", t=T0, pid=os.getpid(), rank=rank, attempt=attempt, pre=PRE)
    import datetime
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    tell("imported")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    tell("pg")
    torch.manual_seed(0)
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    tell("ddp")
    path = os.path.join(CKPT_DIR, "ckpt.pt")
    step = 0
    if os.path.exists(path):
        state = torch.load(path)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
    resumed = step
    tell("resumed", step=step)
    give_up = time.monotonic() + 120
    due = time.monotonic()
    while True:
        g = torch.Generator().manual_seed(step * world + rank)
        x = torch.randn(16, 32, generator=g)
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if rank == 0 and step % EVERY == 0:
            # Written aside, then renamed: a kill mid-write never leaves a torn checkpoint.
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}
            torch.save(state, path + ".tmp")
            os.replace(path + ".tmp", path)
        tell("step", step=step)
        if attempt > 0 and step >= resumed + AFTER:
            break
        if time.monotonic() > give_up:
            sys.exit(3)
        due += PERIOD
        time.sleep(max(0.0, due - time.monotonic()))
    dist.destroy_process_group()
    tell("done", step=step)
    """
    )
)

STEP_PERIOD_S = 0.05
CHECKPOINT_EVERY = 10
KILL_AT_STEP = 25
STEPS_AFTER_RESTART = 10
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "LOGLEVEL": "INFO"}

PHASES = (
    ("detection", "1. detection: SIGKILL → the launcher reacts"),
    ("stopping", "2. stopping the survivors"),
    ("rendezvous", "3. rendezvous"),
    ("start", "4. process start (→ every new worker runs its first line)"),
    ("import", "5. torch import"),
    ("pg", "6. process-group init"),
    ("step", "7. first step after the restart (= 7a + 7b + 7c)"),
    ("ddp", "7a. model + DDP wrapper (its first construction imports torch._dynamo)"),
    ("load", "7b. checkpoint load"),
    ("step1", "7c. one training step"),
)


@dataclass(frozen=True)
class Options:
    ns: tuple[int, ...]
    reps: int
    timeout_s: float = 240.0


PROFILE_OPTIONS = {
    "smoke": Options(ns=(2,), reps=1),
    "quick": Options(ns=(2,), reps=1),
    "full": Options(ns=(2, 4), reps=3),
}


def elastrun_preload_dynamo() -> Launcher:
    """elastrun whose template also preloads what DDP's first construction imports."""
    base = elastrun()
    return Launcher(f"{base.name} --preload torch,torch._dynamo", base.exe, (PRELOAD_DYNAMO,))


PRELOAD_DYNAMO = "--preload=torch,torch._dynamo"

# Why each phase costs what it does (for the "where the time goes" notes).
PHASE_WHY = {
    "detection": "detection",
    "stopping": "stopping the survivors",
    "rendezvous": "rendezvous",
    "start": "process start",
    "import": "torch import in every new worker",
    "pg": "process-group init",
    "ddp": "DDP's first construction (lazy torch._dynamo import)",
    "load": "checkpoint load",
    "step1": "one training step",
}

# --------------------------------------------------------------------------- launcher logs

_GLOG = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d+)\s+\d+\s+[^\]]*\]\s?(.*)$")


def torchrun_timeline(stderr: str, year: int) -> list[tuple[float, str]]:
    """(wall time, message) of every line of torch's glog-style log (local time)."""
    out = []
    for line in stderr.splitlines():
        m = _GLOG.match(line)
        if not m:
            continue
        mon, day, hh, mm, ss, frac, msg = m.groups()
        base = time.mktime((year, int(mon), int(day), int(hh), int(mm), int(ss), 0, 0, -1))
        out.append((base + float("0." + frac), msg))
    return out


def _first_after(timeline: list[tuple[float, str]], after: float, *needles: str) -> float | None:
    # Log timestamps are truncated to the millisecond: allow that much before `after`.
    for t, msg in timeline:
        if t >= after - 0.002 and any(n in msg for n in needles):
            return t
    return None


def launcher_marks(kind: str, work: Path, t_kill: float) -> dict[str, float]:
    """When the launcher reacted, had stopped the survivors, and finished rendezvous."""
    marks: dict[str, float] = {}
    if kind == "torchrun":
        text = (work / "logs" / "launcher.stderr").read_text(errors="replace")
        tl = torchrun_timeline(text, time.localtime(t_kill).tm_year)
        detect = _first_after(tl, t_kill, "closing signal", "failed (exitcode")
        if detect is not None:
            marks["detected"] = detect
            stopped = _first_after(tl, detect, "Rendezvous'ing worker group")
            if stopped is not None:
                marks["stopped"] = stopped
                rdzv = _first_after(tl, stopped, "Rendezvous complete for workers")
                if rdzv is not None:
                    marks["rendezvous"] = rdzv
        return marks
    events = []
    path = work / "events.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            events.append((float(ev["timestamp"]) / 1000.0, ev["name"], ev.get("metadata", {})))
    tl = [(t, name if name != "agent.state" else f"state:{md.get('to')}") for t, name, md in events]
    detect = _first_after(tl, t_kill, "agent.restart")
    if detect is not None:
        marks["detected"] = detect
        stopped = _first_after(tl, detect, "state:STOPPED")
        if stopped is not None:
            marks["stopped"] = stopped
            rdzv = _first_after(tl, stopped, "agent.rendezvous")
            if rdzv is not None:
                marks["rendezvous"] = rdzv
                spawned = _first_after(tl, rdzv, "agent.workers_started")
                if spawned is not None:
                    marks["spawned"] = spawned
    return marks


# --------------------------------------------------------------------------- one run


class _Killer:
    """Kills the victim from the collector's thread the moment it reports the step."""

    def __init__(self, victim_rank: int) -> None:
        self.victim_rank = victim_rank
        self.t_kill: float | None = None
        self.killed_step: int | None = None
        self._lock = threading.Lock()

    def __call__(self, conn: Conn, msg: dict[str, object]) -> None:
        hello = conn.hello
        if msg.get("ev") != "step" or hello.get("attempt") != 0:
            return
        if hello.get("rank") != self.victim_rank or msg.get("step") != KILL_AT_STEP:
            return
        with self._lock:
            if self.t_kill is not None:
                return
            self.t_kill = time.time()
            self.killed_step = KILL_AT_STEP
            # call-overload: a JSON number
            os.kill(int(hello["pid"]), signal.SIGKILL)  # type: ignore[call-overload]


def latest_report(conns: list[Conn], ev: str) -> float:
    """When the slowest of `conns` reported `ev` (its own timestamp)."""
    times = []
    for c in conns:
        m = c.first(ev)
        if m is None:
            raise ScenarioFailure(f"worker rank {c.hello.get('rank')} never reported {ev!r}")
        times.append(float(m["t"]))  # type: ignore[arg-type]  # a JSON number
    return max(times)


def kill_and_recover(
    lch: Launcher,
    kind: str,
    nproc: int,
    worker: str,
    worker_args: list[str],
    timeout_s: float,
    phases: Callable[[str, Path, float, list[Conn], int], dict[str, float]],
) -> dict[str, float]:
    """Run ``worker`` (script text; its arguments: the collector's socket, the checkpoint
    directory, then ``worker_args``) under ``lch`` with ``--max-restarts=1``, SIGKILL the
    last rank at step KILL_AT_STEP of the first attempt, and return ``phases`` of the
    recovery (``kind``, the work directory, the kill's time, the workers' connections,
    ``nproc``)."""
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
        work = Path(tmp)
        script = work / "worker.py"
        script.write_text(worker)
        (work / "ckpt").mkdir()
        killer = _Killer(victim_rank=nproc - 1)
        with Collector(work / "c.sock", on_message=killer) as col:
            extra = ["--max-restarts=1"]
            if kind == "elastrun":
                extra.append(f"--event-log-handler=file:{work / 'events.jsonl'}")
            args = [str(col.path), str(work / "ckpt"), *worker_args]
            env = {**dict(lch.env), **(TORCHRUN_ENV if kind == "torchrun" else {})}
            running = Running(
                lch.command(nproc, script, args, *extra),
                marker=new_marker(),
                log_dir=work / "logs",
                env_extra=env,
                name=lch.name,
            )
            outcome = running.finish(timeout_s)
            conns = col.snapshot()
        require_clean(outcome)
        if killer.t_kill is None:
            raise ScenarioFailure(f"rank {nproc - 1} never reached step {KILL_AT_STEP}")
        return phases(kind, work, killer.t_kill, conns, nproc)


def recover_once(lch: Launcher, kind: str, n: int, opts: Options) -> dict[str, float]:
    args = [str(STEP_PERIOD_S), str(CHECKPOINT_EVERY), str(STEPS_AFTER_RESTART)]
    return kill_and_recover(lch, kind, n, DDP_WORKER, args, opts.timeout_s, _phases)


def _phases(kind: str, work: Path, t_kill: float, conns: list[Conn], n: int) -> dict[str, float]:
    old = [c for c in conns if c.hello.get("attempt") == 0]
    new = [c for c in conns if c.hello.get("attempt") == 1]
    if len(new) != n:
        raise ScenarioFailure(f"{len(new)} of {n} replacement workers reported")
    t_start = latest_report(new, "start")
    t_imported = latest_report(new, "imported")
    t_pg = latest_report(new, "pg")
    t_ddp = latest_report(new, "ddp")
    t_loaded = latest_report(new, "resumed")
    t_step = latest_report(new, "step")
    marks = launcher_marks(kind, work, t_kill)
    result = {
        "total": t_step - t_kill,
        "running": t_start - t_kill,
        "import": t_imported - t_start,
        "pg": t_pg - t_imported,
        "step": t_step - t_pg,
        "ddp": t_ddp - t_pg,
        "load": t_loaded - t_ddp,
        "step1": t_step - t_loaded,
        "template": 1.0 if all(c.hello.get("pre") for c in new) else 0.0,
    }
    if all(c.t_eof is not None for c in old):
        result["old_gone"] = max(c.t_eof for c in old if c.t_eof is not None) - t_kill
    resumed = new[0].first("resumed")
    if resumed is not None:
        # call-overload: a JSON number
        result["redone"] = float(KILL_AT_STEP - int(resumed["step"]))  # type: ignore[call-overload]
    if {"detected", "stopped", "rendezvous"} <= set(marks):
        result["detection"] = marks["detected"] - t_kill
        result["stopping"] = marks["stopped"] - marks["detected"]
        result["rendezvous"] = marks["rendezvous"] - marks["stopped"]
        result["start"] = t_start - marks["rendezvous"]
    if "spawned" in marks:
        result["spawn_call"] = marks["spawned"] - marks["rendezvous"]
    return result


# --------------------------------------------------------------------------- the section


def body(section: Section, opts: Options, variants: list[tuple[Launcher, str]]) -> None:
    section.intro = (
        f"A gloo DDP job (a step every {STEP_PERIOD_S * 1000:.0f} ms, rank 0 checkpointing "
        f"every {CHECKPOINT_EVERY} steps); the last rank is SIGKILLed when it reports step "
        f"{KILL_AT_STEP}; `--max-restarts=1`. Each phase ends when the slowest worker (or the "
        "launcher) is done with it; the phases add up to the total. Variants alternate."
    )
    columns = [lch.name for lch, _ in variants]
    by_name = {lch.name: (lch, kind) for lch, kind in variants}
    ref = "torchrun" if "torchrun" in columns else None
    templated: dict[str, list[float]] = {}
    for n in opts.ns:
        table = section.table(f"Recovery, {n} workers (seconds)", columns, ref)
        rows: dict[str, Row] = {}
        rows["total"] = table.row(
            f"rec{n}.total",
            "**total: SIGKILL → first step after the restart done**",
            target="≤ 1/2 of torchrun's" if n == max(opts.ns) else "",
            check=ratio_check("elastrun", "torchrun", 0.5) if n == max(opts.ns) else None,
        )
        for key, label in PHASES:
            rows[key] = table.row(f"rec{n}.{key}", label)
        rows["running"] = table.row(f"rec{n}.running", "SIGKILL → all new workers running")
        rows["old_gone"] = table.row(f"rec{n}.old_gone", "SIGKILL → every old worker gone")
        rows["spawn_call"] = table.row(
            f"rec{n}.spawn_call", "rendezvous done → launcher's start call returned"
        )
        rows["redone"] = table.row(
            f"rec{n}.redone", "steps redone (from the checkpoint)", fmt=".0f"
        )

        def measure(col: str, rep: int, n: int = n) -> dict[str, float]:
            lch, kind = by_name[col]
            return recover_once(lch, kind, n, opts)

        def record(col: str, m: Mapping[str, float], rows: dict[str, Row] = rows) -> None:
            for key, row in rows.items():
                if key in m:
                    row.add(col, m[key])
            templated.setdefault(col, []).append(m.get("template", 0.0))

        alternate(section, f"recovery N={n}", columns, opts.reps, measure, record)
        for col in columns:
            lch, kind = by_name[col]
            extra = ["--max-restarts=1"]
            if kind == "elastrun":
                extra.append("--event-log-handler=file:/W/events.jsonl")
            cmd = lch.command(n, Path("/W/ddp_worker.py"), ["/W/c.sock", "/W/ckpt", "..."], *extra)
            env = {**dict(lch.env), **(TORCHRUN_ENV if kind == "torchrun" else {})}
            shown = display_command(cmd, env, Path("/W"))
            section.commands.setdefault(
                col, shown.replace(f"--nproc-per-node={n}", "--nproc-per-node=N")
            )
    _summarize(section, opts, columns, templated)


def _summarize(
    section: Section, opts: Options, columns: list[str], templated: dict[str, list[float]]
) -> None:
    n = max(opts.ns)
    table = next((t for t in section.tables if f"{n} workers" in t.title), None)
    for col, flags in templated.items():
        if col.startswith("elastrun"):
            used = "yes" if flags and all(flags) else "no" if not any(flags) else "in some runs"
            section.notes.append(
                f"{col}: new workers forked from the pre-imported template: {used}."
            )
    if table is None or "torchrun" not in columns:
        return
    total = table.rows[f"rec{n}.total"]
    for col in columns:
        if col == "torchrun":
            continue
        section.headlines.append(
            Headline(
                f"time to recover the {n}-worker DDP job, {col} / torchrun",
                ratio_text(total, col, "torchrun"),
                "≤ 1/2" if col == "elastrun" else "",
                ratio_check(col, "torchrun", 0.5)(total.medians()) if col == "elastrun" else None,
            )
        )
    for col in columns:
        if col not in total.medians():
            continue
        phases = {
            key: table.rows[f"rec{n}.{key}"].medians().get(col)
            for key, _ in PHASES
            if key != "step"  # 7 is the sum of 7a-7c
        }
        known = sorted(((v, k) for k, v in phases.items() if v is not None), reverse=True)
        if not known:
            continue
        top = "; ".join(f"{PHASE_WHY[k]}: {v:.2f} s" for v, k in known[:2])
        verdict = ""
        if col == "elastrun":
            verdict = " (target missed)" if total.verdict() is False else " (target met)"
        section.where_time_goes.append(
            f"{col}, {n} workers, total {total.medians()[col]:.2f} s{verdict}; the largest "
            f"phases: {top}."
        )
    section.notes += [
        "torchrun runs with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`: with its default shared "
        "rendezvous store the restart of this job cannot succeed (reference §5.1). It also "
        "gets `LOGLEVEL=INFO`, whose timestamped lines give its detection, stop and "
        "rendezvous moments; elastrun gets `--event-log-handler file:...` for the same.",
        "Launcher log timestamps have millisecond resolution; worker moments are `time.time()` "
        "as each worker reports them; the moment an old worker died is when its socket to "
        "the benchmark closed.",
        "The survivors usually fail on their own first (their gloo collective breaks when the "
        "peer dies), so 'stopping the survivors' is mostly reaping.",
        "DistributedDataParallel's first construction in a process imports torch._dynamo "
        "(and sympy) lazily: about 2 s per worker on this machine, under any launcher, in "
        "phase 7a. The template preloads only what the script imports at top level "
        f"(torch); `{PRELOAD_DYNAMO}` moves that import into the template too, which is "
        "the difference between the elastrun and the elastrun --preload columns.",
    ]


def run(profile: str, variants: list[tuple[Launcher, str]] | None = None) -> Section:
    if variants is None:
        variants = [(elastrun(), "elastrun")]
        if profile != "smoke":  # the smoke run checks the script, not the comparison
            variants += [
                (torchrun(), "torchrun"),
                (elastrun_no_template(), "elastrun"),
                (elastrun_preload_dynamo(), "elastrun"),
            ]
    usable = [(lch, k) for lch, k in variants if lch.available() is None]
    opts = PROFILE_OPTIONS[profile]

    def go(section: Section) -> None:
        for lch, _ in variants:
            if lch.available() is not None:
                section.fail(lch.name, f"not run: {lch.available()}")
        body(section, opts, usable)

    return run_section("recovery", "Time to recover a DDP job", go, profile)


def main(argv: list[str] | None = None) -> int:
    p = common_parser(__doc__ or "")
    p.add_argument(
        "--variants",
        default=None,
        help="comma list of elastrun, torchrun, elastrun-no-template, elastrun-preload-dynamo "
        "(alternation order; default: all four, elastrun alone with --smoke)",
    )
    args = p.parse_args(argv)
    known = {
        "elastrun-preload-dynamo": (elastrun_preload_dynamo(), "elastrun"),
        "elastrun": (elastrun(), "elastrun"),
        "torchrun": (torchrun(), "torchrun"),
        "elastrun-no-template": (elastrun_no_template(), "elastrun"),
    }
    variants = [known[x] for x in args.variants.split(",") if x] if args.variants else None
    section = run(profile_of(args), variants)
    print(section.render())
    write_section(section, args.output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())

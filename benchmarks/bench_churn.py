"""Churn soak: a 4-worker DDP job whose workers are SIGKILLed again and again until N failures.

The job (``_churn_job.py``): 4 gloo workers train a small MLP with DDP on the CPU; a step
is a sleep (``--step-sleep``, the compute of a real model, before the gradients'
all-reduce) then the forward, backward and optimizer step (~10 ms on 2 cores). The
killer (``_churn_killer.py``, a process of its own) SIGKILLs a random rank's worker at
random moments -- after a uniform wait around ``--interval``, at the victim's next step
end (between steps), or 20-400 ms after the previous kill (during its recovery), with
the weights of ``--mix`` -- until ``--failures`` kills; then the job is told its last
step and ends. Its victims are only the pids the job's workers wrote, checked to be live
processes of this run below its launcher. Modes, each run in turn:

* ``inplace``: elastrun, the script using ``elastrun.inprocess`` (a commit every step);
* ``group``: elastrun, a plain script that resumes from its checkpoint (rank 0 saves one
  with ``torch.save`` every 20 steps); elastrun forks the restarted workers from its
  template, which imported torch once;
* ``torchrun``: the same plain script under torchrun (with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, without which it cannot restart this job);
* ``sharded`` (run only when named): elastrun, the model sharded with FSDP2 instead of
  DDP, ``elastrun.inprocess`` with a memory checkpoint after every step
  (``elastrun.checkpoint``): survivors keep their sharded model, every rank loads the
  newest step in the node's memory; its reference is a plain fault-free FSDP2 run.

All of them run with ``--max-restarts`` 10x the failures, elastrun with those of its guards
against restarts that do not help turned off that a churn trips (``GROUP_FLAGS``,
``INPLACE_FLAGS``). Reported for
each: failures injected and survived (every rank completed a step after it; the job
survived them all when it ended with exit 0 and every rank at the last step), the final
parameters against a reference (a fault-free run of the same steps that builds a new DDP
wrapper at every step the surviving history computed first in a call or a process: bit
for bit), each
kill's recovery (kill -> every rank completed a step in a call started after it) and
what the job was doing when it came, descriptors, threads and RSS of the launcher (and
of elastrun's helper processes) and of the workers over the killer's window, and the
effective training time over it (see ``_churn_logs.py``). Targets: every failure
survived, exact, nothing growing, in place ETTR >= 95 % at one failure per
15 s. Run from the repository root::

    .venv/bin/python benchmarks/bench_churn.py           # ETTR: 3 modes, 20 failures, 1 per 15 s
    .venv/bin/python benchmarks/bench_churn.py --smoke   # 50 failures in place, 1 per ~0.7 s
    .venv/bin/python benchmarks/bench_churn.py --smoke --modes sharded   # the same, FSDP2
    .venv/bin/python benchmarks/bench_churn.py --smoke --modes hsdp      # HSDP, replicas
    nice -n 10 .venv/bin/python benchmarks/bench_churn.py --name soak_inplace --modes \\
        inplace --failures 2000 --interval 1.5 --step-sleep 0.05 --mix 3,1,1 --after-progress

Results go to ``benchmarks/results/churn/<name>.md`` and ``.json``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _churn_logs import (
    PHASES,
    RECOVERING,
    effective_time,
    kill_outcomes,
    largest_rollback,
    max_step,
    read_kills,
    read_ranks,
    rebuild_steps,
)
from _churn_usage import KEYS, Sample, oldest_worker, sample, series, summarise
from _common import (
    BIN,
    PYTHON,
    Running,
    ScenarioFailure,
    display_command,
    elastrun,
    machine_info,
    new_marker,
    tagged_env,
    torchrun,
    wait_until,
)
from _report import (
    RESULTS_DIR,
    Headline,
    Section,
    Table,
    common_parser,
    profile_of,
    run_section,
    write_section,
)

HERE = Path(__file__).resolve().parent
JOB, KILLER = HERE / "_churn_job.py", HERE / "_churn_killer.py"
COLUMNS = {
    "torchrun": "torchrun",
    "group": "elastrun group restart",
    "inplace": "elastrun in place",
    "sharded": "elastrun in place, FSDP2 from memory",
    "hsdp": "elastrun in place, HSDP from a replica",
}
#: The modes whose job recovers in place, and the sharded ones' reference jobs (FSDP2's
#: reductions do not depend on when its groups were made: no rebuild is mirrored).
IN_PLACE = ("inplace", "sharded", "hsdp")
SHARDED_REFERENCE = {"sharded": "sharded-reference", "hsdp": "hsdp-reference"}
# elastrun's guards against restarts that do not help judge a plain script by its
# optimizer steps counted from 1 in each attempt: three attempts in a row shorter than the
# longest one so far end the job (exit 93), and so may the same rank killed twice at the
# same count; a script that resumes from its checkpoint is not judged by its global step
# unless it calls elastrun.progress(step). Killed at random every few seconds, the plain
# script stops within a few restarts with them on; torchrun has neither.
GROUP_FLAGS = ["--stalled-restarts", "0", "--no-crash-loop-stop"]
# Kills that overlap a recovery (20-400 ms after the previous one) can land just after
# it completed, and two of them in a row restore the same commit three times: the
# guard against recoveries without progress would then end the soak (exit 93), which
# measures survival, not that guard (tests/e2e/test_inprocess.py pins it).
# A chain of kills that takes every worker holding the state makes the group restart
# from the checkpoint (as the plain script does), judged then like the plain script.
INPLACE_FLAGS = ["--stalled-restarts", "0", "--no-crash-loop-stop"]
WARMUP_STEPS, LAST_STEP_MARGIN = 10, 10
EVIDENCE_LINES = 800  # of each rank's step log, kept with a failed run's evidence
STALL_S = 180.0  # no step anywhere for this long: a stall (a recovery is bounded by 60 s)
# Lines of elastrun's log worth counting (a survivor replaced as stuck in a collective,
# a fallback to a group restart).
NOTABLE = {
    "in-place rounds": "recovering in place (round",
    "survivors replaced as stuck": "did not reach in-process round",
    "group restarts": "restarting all workers",
}


@dataclass(frozen=True)
class Options:
    modes: tuple[str, ...]
    failures: int
    interval: float  # mean seconds between kills (before the overlapping ones)
    step_sleep: float
    mix: str  # weights of the killer's moments: random, boundary, overlap
    after_progress: bool = False  # see _churn_killer
    # ELASTRUN_INPROCESS_JOIN_TIMEOUT: how long a survivor may take to reach a round
    # before it is replaced as stuck (elastrun's default, 30 s, when None).
    join_timeout: float | None = None
    checkpoint_every: int = 20
    workers: int = 4
    sample_s: float = 2.0
    seed: int = 0
    name: str = "churn"
    output_dir: Path = RESULTS_DIR / "churn"  # the results, and evidence of a failed run


PROFILE_OPTIONS = {
    # CI: 50 failures in place, every ~0.7 s, some between steps and some in a recovery.
    # A survivor stuck in a collective is replaced after 5 s, not 30, as in the tests.
    # Sampled every 0.2 s (the watch loop's tick): a third of its minute then holds about
    # 100 samples, not 15, and one or two chains of overlapping rounds (a kept group more
    # for a second or two) no longer move its 80th percentile.
    "smoke": Options(
        ("inplace",), 50, 0.8, 0.02, "3,1,1", after_progress=True, join_timeout=5, sample_s=0.2
    ),
    "quick": Options(("torchrun", "group", "inplace"), 6, 5.0, 0.1, "1,0,0"),
    # The effective training time at one failure per 15 s (about 5 minutes a mode).
    "full": Options(("torchrun", "group", "inplace"), 20, 15.0, 0.1, "1,0,0"),
}


# --------------------------------------------------------------------------- one soak


def _command(
    mode: str, opts: Options, out: Path, run_dir: Path
) -> tuple[list[str], dict[str, str]]:
    env = {"OMP_NUM_THREADS": "1"}
    lch = torchrun() if mode == "torchrun" else elastrun()
    if mode == "torchrun":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    elif opts.join_timeout is not None:
        env["ELASTRUN_INPROCESS_JOIN_TIMEOUT"] = f"{opts.join_timeout:g}"
    script_args = [str(out), mode if mode in IN_PLACE else "group"]
    script_args += [str(opts.step_sleep), str(opts.checkpoint_every)]
    restarts = str(10 * opts.failures + 100)
    extra = ["--max-restarts", restarts, "--log-dir", str(run_dir / "logs")]
    if mode == "group":
        extra += GROUP_FLAGS
    elif mode in IN_PLACE:
        extra += INPLACE_FLAGS
    return lch.command(opts.workers, JOB, script_args, *extra), env


def _sample(running: Running, out: Path, opts: Options) -> list[Sample]:
    return sample(running.pid, running.marker, out, opts.workers, time.time())


def _steps_logged(out: Path, workers: int) -> int:
    """The fewest step ends any rank has logged (for the warm-up)."""
    counts = []
    for rank in range(workers):
        path = out / f"steps_{rank}.log"
        counts.append(path.read_text().count("\nE ") if path.exists() else 0)
    return min(counts)


def _last_activity(out: Path) -> float:
    return max((p.stat().st_mtime for p in out.glob("steps_*.log")), default=0.0)


def _stacks(run_dir: Path, dest: Path) -> None:
    """``elastrun stacks`` of the newest attempt, into ``dest`` (evidence of a stall)."""
    try:
        proc = subprocess.run(
            [str(BIN / "elastrun"), "stacks", str(run_dir / "logs")],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        dest.write_text(proc.stdout + proc.stderr)
    except (OSError, subprocess.SubprocessError) as exc:
        dest.write_text(f"elastrun stacks failed: {exc}")


@dataclass
class Watch:
    """What happened while the killer ran."""

    status: str  # done, launcher exited, stalled
    w0: float
    w1: float
    samples: list[Sample]


def _start_killer(running: Running, out: Path, opts: Options) -> subprocess.Popen[bytes]:
    # The killer's window holds N kills in N+1 waits: one kill per ``interval`` on average.
    wait = opts.interval * opts.failures / (opts.failures + 1)
    cmd = [PYTHON, str(KILLER), str(out), str(running.pid), running.marker]
    cmd += ["--failures", str(opts.failures), "--interval", f"{wait:.4f}"]
    cmd += ["--mix", opts.mix, "--workers", str(opts.workers), "--seed", str(opts.seed)]
    cmd += ["--after-progress"] if opts.after_progress else []
    return subprocess.Popen(cmd, env=tagged_env(running.marker))


def _watch(running: Running, out: Path, opts: Options, mode: str) -> Watch:
    """Run the killer to its end, sampling the job's processes; stop at a stall (no step
    anywhere for STALL_S, evidence kept) or when the launcher exits."""
    w0 = time.time()
    killer = _start_killer(running, out, opts)
    samples = _sample(running, out, opts)
    status, next_sample, next_note = "done", time.monotonic(), time.monotonic() + 30
    try:
        while killer.poll() is None:
            if running.wait_exit(0.2):
                status = "launcher exited"
                break
            now = time.monotonic()
            if now >= next_sample:
                samples += _sample(running, out, opts)
                next_sample = now + opts.sample_s
            if time.time() - _last_activity(out) > STALL_S:
                status = "stalled"
                break
            if now >= next_note:
                kills = len(read_kills(out))
                print(
                    f"[bench] churn {mode}: {kills} of {opts.failures} kills, "
                    f"{time.time() - w0:.0f} s, load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
                next_note = now + 30
    finally:
        if killer.poll() is None:
            killer.kill()
        killer.wait()
    samples += _sample(running, out, opts)
    done = out / "killer_done"
    w1 = float(done.read_text().split()[0]) if done.exists() else time.time()
    return Watch(status, w0, w1, samples)


def _drive(running: Running, out: Path, opts: Options, mode: str) -> tuple[Watch, int]:
    """Warm up, run the killer, then tell the job its last step and wait for its end."""
    warm = wait_until(
        lambda: running.wait_exit(0) or _steps_logged(out, opts.workers) >= WARMUP_STEPS, 240, 0.2
    )
    if not warm or running.wait_exit(0):
        raise ScenarioFailure(f"{mode}: the job never completed {WARMUP_STEPS} steps")
    watch = _watch(running, out, opts, mode)
    last = max_step(read_ranks(out, opts.workers)) + LAST_STEP_MARGIN
    (out / "stop.tmp").write_text(str(last))
    os.replace(out / "stop.tmp", out / "stop")
    if watch.status == "done":
        t_stop = time.monotonic()  # the last recovery, then the steps to the last one
        while not running.wait_exit(1.0):
            if time.monotonic() - t_stop > STALL_S and time.time() - _last_activity(out) > 60:
                watch.status = "stalled after the last kill"
                break
    return watch, last


def _soak(mode: str, opts: Options, work: Path) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix=f"churn-{mode}-", dir=work))
    out = run_dir / "out"
    out.mkdir()
    cmd, env = _command(mode, opts, out, run_dir)
    evidence = opts.output_dir / f"{opts.name}_{mode}.evidence"
    running = Running(cmd, marker=new_marker(), log_dir=run_dir, env_extra=env)
    watch: Watch | None = None
    try:
        watch, last = _drive(running, out, opts, mode)
        if watch.status.startswith("stalled") and mode != "torchrun":
            evidence.mkdir(parents=True, exist_ok=True)
            _stacks(run_dir, evidence / "stacks_at_the_stall.txt")
    finally:
        outcome = running.finish(0)
        if outcome.failure() or watch is None:
            _keep_evidence(run_dir, evidence)
    result = _analyse(out, opts, watch, last)
    result.update(
        status=watch.status,
        returncode=outcome.returncode,
        left_behind=outcome.left_behind,
        wall_s=round(outcome.wall_s, 1),
        stderr_tail=outcome.stderr_tail[-3000:] if outcome.failure() else "",
        notable=_notable(run_dir / "launcher.stderr"),
        command=display_command(cmd, env, work),
    )
    reference = _reference(mode, out, last, opts, run_dir) if result["completed"] else {}
    result["reference"] = reference
    clean = result["status"] == "done" and bool(reference.get("exact"))
    if not clean or _unusual(mode, result):
        _keep_evidence(run_dir, evidence)
        result["evidence"] = str(evidence)
    if clean and not outcome.failure():
        shutil.rmtree(run_dir, ignore_errors=True)
    return result


def _unusual(mode: str, result: Mapping[str, Any]) -> bool:
    """An elastrun recovery over 5 s, a survivor replaced as stuck, or a group restart
    in place: worth keeping the launcher's log and the stacks it wrote."""
    if mode == "torchrun":
        return False  # its recoveries take longer than 5 s: nothing unusual
    notable = result["notable"]
    in_place = mode in IN_PLACE and notable["group restarts"] > 0
    slow = result["recovery_s"].get("over_5s", 0) > 0
    return slow or notable["survivors replaced as stuck"] > 0 or in_place


def _keep_evidence(run_dir: Path, dest: Path) -> None:
    """Into ``dest``: the launcher's stderr (compressed), every stacks file its workers
    wrote, the kills and the last lines of each rank's step log."""
    dest.mkdir(parents=True, exist_ok=True)
    with (
        open(run_dir / "launcher.stderr", "rb") as src,
        gzip.open(dest / "launcher.stderr.gz", "wb") as gz,
    ):
        shutil.copyfileobj(src, gz)
    for stacks in (run_dir / "logs").rglob("stacks*.txt"):
        if not stacks.stat().st_size:
            continue
        name = "_".join(stacks.relative_to(run_dir / "logs").parts[1:])
        shutil.copyfile(stacks, dest / name)
    out = run_dir / "out"
    if (out / "kills.jsonl").exists():
        shutil.copyfile(out / "kills.jsonl", dest / "kills.jsonl")
    for log in out.glob("steps_*.log"):
        lines = log.read_text(errors="replace").splitlines()[-EVIDENCE_LINES:]
        (dest / f"{log.stem}.tail.log").write_text("\n".join(lines) + "\n")


def _elastrun_source() -> str:
    """Where the launchers' interpreter finds elastrun (PYTHONPATH may name a copy)."""
    code = "import os, elastrun; print(os.path.dirname(elastrun.__file__))"
    proc = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, check=False)
    return proc.stdout.strip() or proc.stderr.strip()[-300:]


def _notable(stderr: Path) -> dict[str, int]:
    text = stderr.read_text(errors="replace") if stderr.exists() else ""
    return {name: text.count(needle) for name, needle in NOTABLE.items()}


# --------------------------------------------------------------------------- analysis


def _analyse(out: Path, opts: Options, watch: Watch, last: int) -> dict[str, object]:
    logs = read_ranks(out, opts.workers)
    kills = read_kills(out)
    outcomes = kill_outcomes(logs, kills)
    finals = [json.loads(p.read_text()) for p in sorted(out.glob("final_*.json"))]
    completed = len(finals) == opts.workers and all(f["step"] == last for f in finals)
    recovery = [o.recovered_s for o in outcomes if o.recovered_s is not None]
    phases: dict[str, int] = {}
    for o in outcomes:
        phases[o.phase] = phases.get(o.phase, 0) + 1
    eff = effective_time(logs, watch.w0, watch.w1)
    return {
        "injected": len(kills),
        "survived": len(recovery),
        "completed": completed,
        "last_step": last,
        "shas": sorted({f["sha"] for f in finals}),
        "rebuilds": rebuild_steps(logs),
        "largest_rollback": largest_rollback(logs),
        "phases": phases,
        "moments": {
            m: sum(1 for k in kills if k.moment == m) for m in ("random", "boundary", "overlap")
        },
        "recovery_s": _spread(recovery),
        "called_s": _spread([o.called_s for o in outcomes if o.called_s is not None]),
        "effective": dataclasses.asdict(eff),
        "seconds_per_failure": round(eff.window_s / max(1, len(kills)), 2),
        "resources": {
            **summarise(watch.samples, watch.w0, watch.w1),
            "oldest worker": oldest_worker(watch.samples, [(k.t, k.rank) for k in kills]),
        },
        "series": series(watch.samples, watch.w0),
        "kills": [
            {
                "t": o.kill.t,
                "rank": o.kill.rank,
                "moment": o.kill.moment,
                "phase": o.phase,
                "called_s": None if o.called_s is None else round(o.called_s, 3),
                "recovered_s": None if o.recovered_s is None else round(o.recovered_s, 3),
            }
            for o in outcomes
        ],
    }


def _spread(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {
        "median": round(statistics.median(ordered), 3),
        "p90": round(ordered[int(0.9 * (len(ordered) - 1))], 3),
        "max": round(ordered[-1], 3),
        "over_5s": sum(1 for v in ordered if v > 5),
    }


# --------------------------------------------------------------------------- reference


def _reference(mode: str, out: Path, last: int, opts: Options, run_dir: Path) -> dict[str, object]:
    """A fault-free run to the same step, with a new DDP wrapper at each rebuild step."""
    ref = run_dir / "reference"
    ref.mkdir()
    sharded = mode in SHARDED_REFERENCE
    steps = [] if sharded else rebuild_steps(read_ranks(out, opts.workers))
    (ref / "rebuild.txt").write_text(" ".join(map(str, steps)))
    (ref / "stop").write_text(str(last))
    job = SHARDED_REFERENCE.get(mode, "reference")
    cmd = elastrun().command(opts.workers, JOB, [str(ref), job, "0", "0"])
    running = Running(cmd, marker=new_marker(), log_dir=ref, env_extra={"OMP_NUM_THREADS": "1"})
    outcome = running.finish(120 + 0.05 * last)
    if outcome.failure():
        return {"failure": outcome.failure()}
    shas = sorted({json.loads(p.read_text())["sha"] for p in ref.glob("final_*.json")})
    mine = sorted({json.loads(p.read_text())["sha"] for p in out.glob("final_*.json")})
    result: dict[str, object] = {
        "shas": shas,
        "rebuilds": len(steps),
        "exact": mine == shas and len(shas) == 1,
    }
    if not result["exact"] and (out / "final.pt").exists():
        result["max_abs_diff"] = _max_abs_diff(out / "final.pt", ref / "final.pt")
    return result


def _max_abs_diff(a: Path, b: Path) -> float:
    import torch  # only here: the benchmark itself does not need it

    pa, pb = torch.load(a), torch.load(b)
    return max(float((x - y).abs().max()) for x, y in zip(pa, pb, strict=True))


# --------------------------------------------------------------------------- report


def body(section: Section, opts: Options) -> None:
    sharded = ""
    if "sharded" in opts.modes:
        sharded += (
            f" (FSDP2 ones, with a memory checkpoint after every step, in the mode "
            f"'{COLUMNS['sharded']}')"
        )
    if "hsdp" in opts.modes:
        sharded += (
            f" (HSDP 2 x 2 ones, the model and optimizer in the State, a replacement's "
            f"shard from a replica, else from a memory checkpoint saved every "
            f"{opts.checkpoint_every} steps, in the mode '{COLUMNS['hsdp']}')"
        )
    section.intro = (
        f"{opts.workers} gloo DDP workers on {os.cpu_count()} CPUs{sharded}, a step = "
        f"{opts.step_sleep} s of sleep + ~10 ms of compute; {opts.failures} SIGKILLs of a "
        "random rank, one per "
        f"{opts.interval:g} s on average before the overlapping ones (moments random, "
        f"between steps, during a recovery weighted {opts.mix}); checkpoints every "
        f"{opts.checkpoint_every} steps for the group restarts. "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}."
    )
    columns = [COLUMNS[m] for m in opts.modes]
    table = section.table("churn", columns, "torchrun" if "torchrun" in opts.modes else None)
    results: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="elastrun-churn-"))
    for mode in opts.modes:
        print(f"[bench] churn {mode}: {opts.failures} failures", flush=True)
        try:
            res = _soak(mode, opts, work)
        except ScenarioFailure as exc:
            section.fail(f"churn, {COLUMNS[mode]}", str(exc))
            continue
        results[mode] = res
        _record(table, COLUMNS[mode], res)
        _failures(section, mode, res)
        section.commands[COLUMNS[mode]] = str(res["command"])
        print(f"[bench] churn {mode}: {_line(res)}", flush=True)
    with contextlib.suppress(OSError):
        work.rmdir()  # what a failed run left there stays, for a look at its logs
    if work.exists():
        print(f"[bench] churn: the failed runs' files are kept in {work}", flush=True)
    options = {**dataclasses.asdict(opts), "output_dir": str(opts.output_dir)}
    section.raw = {"options": options, "machine": machine_info(), "modes": results}
    section.raw["elastrun imported from"] = _elastrun_source()
    _conclude(section, opts, results)


#: Key, label, format, how to read it from a result (None: not measured).
ROWS: list[tuple[str, str, str, Callable[[Mapping[str, Any]], float | None]]] = [
    ("injected", "failures injected", ".0f", lambda r: r["injected"]),
    ("survived", "failures survived (every rank stepped again)", ".0f", lambda r: r["survived"]),
    (
        "completed",
        "job ended with exit 0, every rank at the last step (1 = yes)",
        ".0f",
        lambda r: float(r["returncode"] == 0 and r["completed"]),
    ),
    (
        "exact",
        "final parameters bit for bit the reference's (1 = yes)",
        ".0f",
        lambda r: float(bool(r["reference"].get("exact"))),
    ),
    (
        "ettr",
        "effective training time: counted steps x their median step, over the window (%)",
        ".1f",
        lambda r: 100 * r["effective"]["ettr"],
    ),
    (
        "ettr_in_steps",
        "effective training time: time inside counted steps, over the window (%)",
        ".1f",
        lambda r: 100 * r["effective"]["ettr_in_steps"],
    ),
    (
        "per_failure",
        "seconds per failure (the killer's window / kills)",
        ".1f",
        lambda r: r["seconds_per_failure"],
    ),
    ("step_s", "median step (s)", ".3f", lambda r: r["effective"]["step_s"]),
    ("redone", "steps done again per rank", ".0f", lambda r: r["effective"]["redone_steps"]),
    (
        "rollback",
        "largest rollback: steps between the newest completed step and a resumption",
        ".0f",
        lambda r: r["largest_rollback"],
    ),
    (
        "called_median",
        "recovery: kill -> every rank began a new call or process, median (s)",
        ".2f",
        lambda r: r["called_s"].get("median"),
    ),
    (
        "rec_median",
        "recovery: kill -> every rank stepped again, median (s)",
        ".2f",
        lambda r: r["recovery_s"].get("median"),
    ),
    ("rec_p90", "recovery, 90th percentile (s)", ".2f", lambda r: r["recovery_s"].get("p90")),
    ("rec_max", "recovery, longest (s)", ".2f", lambda r: r["recovery_s"].get("max")),
    ("rec_over_5s", "recoveries over 5 s", ".0f", lambda r: r["recovery_s"].get("over_5s")),
]


# What counts as growing, from when the killer started to when it stopped: more than this
# many descriptors or threads, or MB of RSS (the allocator settles over the first
# recoveries), in the launcher or in the largest worker.
GROWTH = {"fds": 4, "threads": 4, "rss_mb": 32.0}


def _record(table: Table, column: str, res: Mapping[str, Any]) -> None:
    for key, label, fmt, read in ROWS:
        value = read(res)
        if value is not None:
            table.row(key, label, fmt=fmt).add(column, float(value))
    for phase in (*PHASES.values(), RECOVERING):
        n = res["phases"].get(phase, 0)
        table.row(f"phase {phase}", f"kills {phase}", fmt=".0f").add(column, float(n))
    if column != "torchrun":
        for name, n in res["notable"].items():
            table.row(f"log {name}", f"elastrun's log: {name}", fmt=".0f").add(column, float(n))


def growth(res: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """The launcher's and the largest worker's growth, the window's last third against
    its first (see _churn_usage)."""
    return {who: res["resources"].get(who, {}).get("growth", {}) for who in ("agent", "worker")}


def grew(res: Mapping[str, Any]) -> list[str]:
    return [
        f"{who} {k} +{v:g}"
        for who, by_key in growth(res).items()
        for k, v in by_key.items()
        if v > GROWTH[k]
    ]


def _resource_table(results: Mapping[str, Mapping[str, Any]]) -> list[str]:
    lines = [
        "**descriptors, threads and RSS: when the killer started / the level (80th "
        "percentile) over the first third of its window / over the last third**",
        "",
        "| mode | process | fds | threads | RSS (MB) |",
        "|---|---|---|---|---|",
    ]
    for mode, res in results.items():
        for who, spans in res["resources"].items():
            if not spans:
                continue
            points = ("start", "end") if who == "oldest worker" else ("start", "early", "end")
            cells = [" / ".join(f"{spans[p].get(k, 0):g}" for p in points) for k in KEYS]
            what = {"agent": "launcher", "worker": "workers (the largest of the 4)"}.get(who, who)
            if who == "oldest worker":
                what = (
                    f"oldest worker at the end (rank {spans['rank']}: {spans['seconds']:g} s, "
                    f"{spans['kills_lived_through']} kills of other ranks; first / last sample)"
                )
            lines.append(f"| {COLUMNS[mode]} | {what} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _failures(section: Section, mode: str, res: Mapping[str, Any]) -> None:
    what = f"churn, {COLUMNS[mode]}"
    if res["status"] != "done":
        section.fail(what, f"{res['status']} after {res['injected']} kills\n{res['stderr_tail']}")
    elif res["returncode"] != 0 or not res["completed"]:
        section.fail(
            what, f"exit {res['returncode']}, completed {res['completed']}\n{res['stderr_tail']}"
        )
    if res["left_behind"]:
        section.fail(what, f"left processes behind: {res['left_behind']}")
    ref = res["reference"]
    if "failure" in ref:
        section.fail(f"{what}: the reference run", str(ref["failure"]))
    elif res["completed"] and not ref.get("exact"):
        section.fail(what, f"parameters differ from the reference: {ref}")


def _line(res: Mapping[str, Any]) -> str:
    eff = res["effective"]
    return (
        f"{res['survived']}/{res['injected']} survived, exit {res['returncode']}, "
        f"exact {res['reference'].get('exact')}, ETTR {100 * eff['ettr']:.1f} %, "
        f"recovery {res['recovery_s']}, growth {growth(res)}"
    )


ETTR_TARGET, ETTR_INTERVAL = 0.95, 15.0  # in place, at one failure per 15 s


def _headline(mode: str, res: Mapping[str, Any], opts: Options) -> Headline:
    eff, exact = res["effective"], bool(res["reference"].get("exact"))
    survived = res["survived"] == res["injected"] and res["returncode"] == 0 and res["completed"]
    target, met = "all survived, exact, nothing growing", survived and exact and not grew(res)
    if mode == "inplace" and opts.interval >= ETTR_INTERVAL:
        target += f", ETTR >= {100 * ETTR_TARGET:.0f} %"
        met = met and eff["ettr"] >= ETTR_TARGET
    return Headline(
        f"churn, {COLUMNS[mode]}: {res['injected']} failures, one per "
        f"{res['seconds_per_failure']:g} s",
        f"{res['survived']}/{res['injected']} survived, {'exact' if exact else 'NOT exact'}, "
        f"ETTR {100 * eff['ettr']:.1f} % ({100 * eff['ettr_in_steps']:.1f} % inside counted "
        f"steps), growing: {', '.join(grew(res)) or 'nothing'}",
        target,
        met,
    )


def _conclude(section: Section, opts: Options, results: Mapping[str, Mapping[str, Any]]) -> None:
    if results:
        section.extra += _resource_table(results)
    section.headlines += [_headline(mode, res, opts) for mode, res in results.items()]
    section.notes += NOTES


NOTES = [
    "Survived: every rank completed a step in a call of the training function (or a "
    "process) that started after the kill. The job survived them all when, after the "
    "last, it ended with exit 0 and every rank reached the last step.",
    "Exact: the reference is a fault-free run (elastrun, no kills, no sleep) to the same "
    "last step that builds a new DDP wrapper at every step whose surviving computation "
    "(its last completion, which the final parameters descend from) was the first step of "
    "a call of the training function (in place) or of processes (group restarts); a call "
    "whose steps a group restart later did again from the checkpoint is not one. A new "
    "wrapper's first step buckets the gradients in the parameters' order and later steps "
    "in the order they became ready; gloo sums a bucket in another order then, which "
    "changes the last bits. A fault-free run without those rebuilds differs by ~1e-4 "
    "after 2,000 steps.",
    "Effective training time: over the killer's window (its start, after 10 warm-up "
    "steps, to one more interval after its last kill), per rank the steps that count "
    "(each step's last completion: steps done again after a rollback count once) times "
    "their median duration, over the window, averaged over the ranks. 'Time inside "
    "counted steps' sums their actual durations instead (a slow first step after a "
    "recovery counts in full there, and so does a rank's wait in an all-reduce while rank "
    "0 saves a checkpoint).",
    "Kills by what the job was doing: 'during a recovery' when an earlier kill's recovery "
    "had not ended; else from the victim's own log: in a step (sleep, forward, backward, "
    "optimizer), between steps (the commit, or the checkpoint) or starting (a process or "
    "call that had not begun a step).",
    "Resources are read from /proc every few seconds: the launcher (elastrun's agent or "
    "torchrun), elastrun's helpers (the template and the guard) and the workers; "
    f"'growing' means more than {GROWTH['fds']} descriptors or {GROWTH['threads']} "
    f"threads or {GROWTH['rss_mb']:g} MB more both at the level (the 80th percentile of "
    "the samples) and at the floor (the smallest sample) of the last third of the "
    "killer's window than at those of its first third "
    "(a survivor keeps the previous recovery's process groups for a while: its first "
    "recovery raises its counts once, and its counts alternate between holding them and "
    "not; a chain of overlapping rounds holds a few more groups for a second or two, a "
    "transient that the level leaves out and a leak would not).",
    "elastrun in place runs with `--stalled-restarts 0`: overlapping kills that land just "
    "after a recovery completed can make three recoveries in a row restore the same commit, "
    "and the guard would end the soak, which measures survival; a recovery that restores "
    "an older commit than the newest shows as the largest rollback and as parameters that "
    "differ from the reference.",
    "elastrun's group restarts run with `--stalled-restarts 0 --no-crash-loop-stop`: "
    "with its defaults the plain script, which resumes from its checkpoint, is judged by "
    "its optimizer steps counted from 1 in each attempt, and three attempts in a row "
    "shorter than the longest so far end the job with exit 93 although its checkpoint "
    "moves on (torchrun restarts it).",
    "elastrun in place also runs with `--no-crash-loop-stop`, and its script saves the "
    "same checkpoint as the plain one: a chain of kills that takes every worker holding "
    "the state (the replacements, then every survivor, before a round completed) makes "
    "the group restart from that checkpoint, judged then like the plain script.",
]


# --------------------------------------------------------------------------- CLI


def run(profile: str, overrides: Mapping[str, Any] | None = None) -> Section:
    opts = dataclasses.replace(PROFILE_OPTIONS[profile], **(overrides or {}))
    return run_section(
        opts.name, "Churn soak: thousands of failures in one job", lambda s: body(s, opts), profile
    )


def main(argv: list[str] | None = None) -> int:
    p = common_parser(__doc__ or "")
    p.set_defaults(output_dir=RESULTS_DIR / "churn")
    p.add_argument("--modes", help="comma list of inplace, group, torchrun, sharded, hsdp")
    p.add_argument("--failures", type=int, help="kills per mode")
    p.add_argument("--interval", type=float, help="mean seconds between kills")
    p.add_argument("--step-sleep", type=float, help="seconds of sleep in each step")
    p.add_argument("--mix", help="weights of the kills' moments: random,boundary,overlap")
    p.add_argument("--seed", type=int)
    p.add_argument(
        "--after-progress",
        action="store_true",
        default=None,
        help="no kill (but an overlapping one) before every rank stepped after the last",
    )
    p.add_argument("--sample-s", type=float, help="seconds between resource samples")
    p.add_argument("--name", help="the results' file name (default churn)")
    args = p.parse_args(argv)
    overrides: dict[str, Any] = {"output_dir": args.output_dir}
    overrides |= {
        k: getattr(args, k)
        for k in (
            "failures",
            "interval",
            "step_sleep",
            "mix",
            "after_progress",
            "seed",
            "sample_s",
            "name",
        )
        if getattr(args, k) is not None
    }
    if args.modes:
        overrides["modes"] = tuple(m for m in args.modes.split(",") if m)
        unknown = set(overrides["modes"]) - set(COLUMNS)
        if unknown:
            p.error(f"unknown modes: {sorted(unknown)}")
    section = run(profile_of(args), overrides)
    print(section.render())
    write_section(section, args.output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())

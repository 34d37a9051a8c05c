"""In-process recovery against restarting the group: time to recover and steps lost.

A 4-worker gloo DDP job (a step every 50 ms). When rank 2 reports step 25 the benchmark
SIGKILLs it (recording the moment just before). Three ways to recover, alternating:

* **elastrun, in place**: the script uses ``elastrun.inprocess`` (a commit after every
  step); only rank 2 is replaced, the others keep their processes and state.
* **elastrun, group restart**: the same script without the API; it checkpoints every
  10 steps (rank 0, to a file) and every restarted worker loads the checkpoint.
* **torchrun**: the group-restart script (with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``,
  without which torchrun cannot restart this job).

Every worker appends ``rank step time pid`` after each step. Measured from the kill:
the time until every rank has completed the next step (the first step no rank had
completed before the kill: a group restart first does again the steps since its
checkpoint), the time until every rank has completed any step, and the steps lost (the
steps done before the kill that were done again). Target: in place at most half the
group restart's time to the next step, and 0 committed steps lost. Run from the repository root::

    .venv/bin/python benchmarks/bench_inprocess.py [--quick | --smoke]
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import textwrap
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from _common import (
    ONE_FAILURE_RESTARTS,
    Launcher,
    Running,
    ScenarioFailure,
    elastrun,
    new_marker,
    require_clean,
    torchrun,
    wait_until,
)
from _report import (
    Benchmark,
    Headline,
    Row,
    Section,
    alternate,
)

KILL_RANK, KILL_AT, STEPS, CHECKPOINT_EVERY = 2, 25, 40, 10

SCRIPT = (
    textwrap.dedent(
        """\
    import os, sys, time
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    out, inprocess = sys.argv[1], sys.argv[2] == "inprocess"
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    log = os.open(os.path.join(out, f"steps_{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    ckpt = os.path.join(out, "ckpt.pt")

    def one_step(ddp, step):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step * 1000 + rank))
        opt.zero_grad()
        ddp(x).sum().backward()
        opt.step()
        os.write(log, f"{rank} {step} {time.time():.6f} {os.getpid()}\\n".encode())

    if inprocess:
        import elastrun.inprocess as ip

        state = ip.State(model=model, optimizer=opt, step=0)

        @ip.run
        def train(state):
            dist.init_process_group("gloo")
            ddp = DistributedDataParallel(model)
            while state.step < STEPS:
                one_step(ddp, state.step)
                state.step += 1
                state.commit()
                time.sleep(0.05)
            dist.barrier()
            dist.destroy_process_group()

        train(state)
    else:
        step = 0
        if os.path.exists(ckpt):
            saved = torch.load(ckpt, weights_only=True)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            step = saved["step"]
        dist.init_process_group("gloo")
        ddp = DistributedDataParallel(model)
        while step < STEPS:
            one_step(ddp, step)
            step += 1
            if rank == 0 and step % CHECKPOINT_EVERY == 0:
                saved = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}
                torch.save(saved, ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)
            time.sleep(0.05)
        dist.barrier()
        dist.destroy_process_group()
    """
    )
    .replace("STEPS", str(STEPS))
    .replace("CHECKPOINT_EVERY", str(CHECKPOINT_EVERY))
)


COLUMNS = ["torchrun", "elastrun group restart", "elastrun in place"]


@dataclass(frozen=True)
class Options:
    reps: int
    workers: int = 4
    columns: tuple[str, ...] = tuple(COLUMNS)


# The smoke run only keeps the script working: two workers (rank 1 is killed) cost half
# the interpreters of four, and torchrun (fresh interpreters: the costliest column) is
# launched the same way by the smoke runs of the other recovery benchmarks.
PROFILE_OPTIONS = {
    "smoke": Options(reps=1, workers=2, columns=("elastrun group restart", "elastrun in place")),
    "quick": Options(reps=2),
    "full": Options(reps=4),
}


def _lines(out: Path) -> list[tuple[int, int, float, int]]:
    found = []
    for path in out.glob("steps_*.log"):
        for line in path.read_text().splitlines():
            rank, step, t, pid = line.split()
            found.append((int(rank), int(step), float(t), int(pid)))
    return found


def _kill_at(out: Path, victim: int) -> tuple[float, int]:
    """Wait for rank ``victim``'s step KILL_AT, SIGKILL it; returns (time, pid)."""
    target = out / f"steps_{victim}.log"

    def reached() -> tuple[int, int] | None:
        if not target.exists():
            return None
        for line in target.read_text().splitlines():
            _, step, _, pid = line.split()
            if int(step) == KILL_AT:
                return int(step), int(pid)
        return None

    if not wait_until(lambda: reached() is not None, 120):
        raise ScenarioFailure(f"rank {victim} never reached step {KILL_AT}")
    found = reached()
    assert found is not None
    t_kill = time.time()
    os.kill(found[1], signal.SIGKILL)
    return t_kill, found[1]


def _measure(column: str, work: Path, workers: int) -> dict[str, float]:
    run_dir = Path(tempfile.mkdtemp(prefix="inprocess-", dir=work))
    out = run_dir / "out"
    out.mkdir()
    script = run_dir / "job.py"
    script.write_text(SCRIPT)
    mode = "inprocess" if column == "elastrun in place" else "restart"
    lch: Launcher = torchrun() if column == "torchrun" else elastrun()
    env = {"OMP_NUM_THREADS": "1"}
    if column == "torchrun":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    cmd = lch.command(workers, script, [str(out), mode], "--max-restarts", ONE_FAILURE_RESTARTS)
    running = Running(cmd, marker=new_marker(), log_dir=run_dir, env_extra=env)
    try:
        t_kill, _ = _kill_at(out, min(KILL_RANK, workers - 1))
    finally:
        outcome = running.finish(240)
    require_clean(outcome)
    lines = sorted(_lines(out), key=lambda x: x[2])
    done: dict[int, int] = {}  # each rank's last step before the kill
    after: dict[int, float] = {}  # each rank's first step after it
    redone: dict[int, int] = {}  # steps a rank did again after the kill
    for rank, step, t, _ in lines:
        if t <= t_kill:
            done[rank] = max(done.get(rank, -1), step)
            continue
        after.setdefault(rank, t)
        if step <= done.get(rank, -1):
            redone[rank] = redone.get(rank, 0) + 1
    if sorted(after) != list(range(workers)):
        raise ScenarioFailure(f"ranks that stepped after the kill: {sorted(after)}")
    following = max(done.values()) + 1  # the next step: no rank had completed it
    caught_up: dict[int, float] = {}
    for rank, step, t, _ in lines:
        if t > t_kill and step >= following:
            caught_up.setdefault(rank, t)
    if sorted(caught_up) != list(range(workers)):
        raise ScenarioFailure(f"ranks that reached step {following}: {sorted(caught_up)}")
    # A rank finishing, just after the kill, the step another logged just before it
    # does it for the first time: only a step a rank had done already counts as lost.
    return {
        "next_s": max(caught_up.values()) - t_kill,
        "recover_s": max(after.values()) - t_kill,
        "lost": float(max(redone.values(), default=0)),
    }


def body(section: Section, opts: Options) -> None:
    section.intro = (
        f"A {opts.workers}-worker gloo DDP job (a step every 50 ms); rank "
        f"{min(KILL_RANK, opts.workers - 1)} is SIGKILLed when "
        f"it reports step {KILL_AT}. The group-restart script checkpoints every "
        f"{CHECKPOINT_EVERY} steps; the in-place one commits every step in memory. "
        f"{opts.reps} alternating runs each, on {os.cpu_count()} CPUs, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}."
    )
    reference = "torchrun" if "torchrun" in opts.columns else None
    table = section.table("recovering from one killed rank", opts.columns, reference)
    following = table.row("next_s", "kill -> every rank completed the next step (s)", fmt=".2f")
    recover = table.row("recover_s", "kill -> every rank completed a step (s)", fmt=".2f")
    lost = table.row("lost", "steps lost (done again)", fmt=".0f")
    with tempfile.TemporaryDirectory(prefix="elastrun-inprocess-") as tmp:

        def measure(col: str, _rep: int) -> dict[str, float]:
            return _measure(col, Path(tmp), opts.workers)

        def record(col: str, m: Mapping[str, float]) -> None:
            following.add(col, m["next_s"])
            recover.add(col, m["recover_s"])
            lost.add(col, m["lost"])

        alternate(section, "recovery", opts.columns, opts.reps, measure, record)
    _conclude(section, following, lost, opts.workers)


def _conclude(section: Section, following: Row, lost: Row, workers: int) -> None:
    m, m_lost = following.medians(), lost.medians()
    inplace, group = m.get("elastrun in place"), m.get("elastrun group restart")
    if inplace is not None and group is not None:
        section.headlines.append(
            Headline(
                f"in-process recovery vs group restart ({workers} workers, one killed): kill -> "
                "every rank completed the next step",
                f"{inplace:.2f} s vs {group:.2f} s (x{inplace / group:.2f}); torchrun "
                f"{m.get('torchrun', float('nan')):.2f} s; steps lost: "
                f"{m_lost.get('elastrun in place', float('nan')):.0f} vs "
                f"{m_lost.get('elastrun group restart', float('nan')):.0f}",
                "<= 0.5x the group restart, 0 steps lost",
                inplace <= 0.5 * group and m_lost.get("elastrun in place") == 0,
            )
        )
    section.notes.append(
        "In place: the agent sees the exit through its pidfd, forks the replacement from "
        "the template and announces the round; the survivors' failed allreduce raises, "
        "they cut their connections to the other workers, roll back (the buffers and plain "
        "values; the parameters were never copied), join a short-lived gloo group to hand "
        "the newest commit to the replacement (read from the survivors' memory), and "
        "call the training function again (a new process group and DDP wrapper). The "
        "group restart stops every worker, starts them all from the template, and they load "
        "the checkpoint of step 20; its steps since then are done again."
    )
    section.notes.append(
        "The next step is the first one no rank had completed before the kill; the "
        "group restart reaches it only after doing again the steps since its checkpoint "
        "(a step every 50 ms). 'Completed a step' counts those steps done again too."
    )
    section.commands["elastrun in place"] = (
        f"elastrun --standalone --nproc-per-node={workers} --max-restarts 3 job.py OUT inprocess"
    )
    section.commands["elastrun group restart"] = (
        f"elastrun --standalone --nproc-per-node={workers} --max-restarts 3 job.py OUT restart"
    )
    section.commands["torchrun"] = (
        f"TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node={workers} "
        "--max-restarts 3 job.py OUT restart"
    )


BENCHMARK = Benchmark(
    "inprocess",
    "In-process recovery: time and steps lost after a killed rank",
    body,
    PROFILE_OPTIONS,
    __doc__ or "",
)
run, main = BENCHMARK.run, BENCHMARK.main


if __name__ == "__main__":
    sys.exit(main())

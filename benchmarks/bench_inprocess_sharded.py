"""In-process recovery of sharded training (HSDP, FSDP2) against state size.

Four gloo ranks on one node train a stack of LAYERS linear layers (F x F, no bias, tanh
between them), each layer sharded with ``fully_shard`` and then the whole model, with
Adam: a rank's state is its shard of the parameters and of Adam's two moments, three
times its local parameter shard. F is chosen per way of sharding so that this local
state is 0.1, 0.4 and 1.6 GB per rank: on HSDP 2 x 2 a rank holds half of the model
(F = 2048, 4096, 8192), on FSDP2 over 4 ranks a quarter (F = 2880, 5760, 11520). Rank 1
SIGKILLs itself right after it committed (or saved) step KILL_AT, writing the moment
first. The ways to recover, each a separate job measured side by side (alternating):

* **HSDP, in place, from a replica**: ``elastrun.inprocess`` with the model and the
  optimizer in the ``State`` (``fully_shard`` at the process's first call, then
  ``state.restore()`` at every call), a commit after every step, no copy of the state;
  rank 1's replacement takes its shard from rank 3 (the same shard in the other replica
  group), the survivors keep their processes and shards;
* **FSDP2, in place, from the memory checkpoint**: ``elastrun.checkpoint.MemoryCheckpoint``
  saved after every step, ``inprocess.rebind`` on a survivor's model, and every rank
  loads the newest complete step with ``ckpt.load_latest`` (docs/inprocess.md); the
  ``State`` holds only the step counter;
* **FSDP2, group restart from the memory checkpoint**: the same script without
  ``inprocess.run``: elastrun restarts every worker, and each loads the newest complete
  step from the node's memory (docs/checkpoints.md, "A group restart");
* **torchrun, DCP to disk**: the same FSDP2 training under torchrun
  (``--max-restarts 3``), ``torch.distributed.checkpoint.save`` to a temporary directory
  after every CHECKPOINT_EVERY-th step and ``dcp.load`` of the newest after the restart
  (with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, as in ``bench_inprocess_state``). The
  kill comes one step after a save: torchrun's best case (on average a failure falls
  half an interval after a save).

Measured from the kill: until every rank has restored its state (after ``restore()``,
``load_latest`` or ``dcp.load``), until every rank has completed the next step (the
first that no rank had completed before the kill: a recovery that goes back re-does the
steps since first), and the steps lost (done again). The training step before the kill
is shown too: the next step is one of them. Targets at 0.4 GB per rank: HSDP in place
<= 1.5 s kill -> every rank's next step and no step lost; FSDP2 in place from the memory
checkpoint <= 2 s.

``ELASTRUN_BENCH_SIZES=1.6`` (a comma list, GB per rank) measures those sizes only,
``ELASTRUN_BENCH_COLUMNS`` (a comma list of ``replica``, ``memory_inplace``,
``memory_restart``, ``dcp``) those columns only, ``ELASTRUN_BENCH_REPS`` that many runs
of each. Run from
the repository root::

    .venv/bin/python benchmarks/bench_inprocess_sharded.py [--quick | --smoke]
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import (
    ONE_FAILURE_RESTARTS,
    Running,
    ScenarioFailure,
    elastrun,
    new_marker,
    require_clean,
    torchrun,
)
from _report import Benchmark, Check, Headline, Section, alternate

LAYERS = 4  # linear layers of F x F, each sharded with fully_shard
BATCH = 8  # a small batch: the step is the shards' collectives and Adam, not a matmul
KILL_AT = 4  # rank 1 kills itself right after committing (or saving) this step
CHECKPOINT_EVERY = 4  # torchrun's DCP save after steps 3, 7, ...: the kill is one step on
STEPS = KILL_AT + 3

SCRIPT = textwrap.dedent(
    """\
    import json, os, signal, sys, time, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    out, mode = sys.argv[1], sys.argv[2]
    features, layers, batch, steps, kill_at, every = map(int, sys.argv[3:9])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    log = os.open(os.path.join(out, f"steps_{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)

    def record(**fields):
        os.write(log, (json.dumps({"rank": rank, "pid": os.getpid(), **fields}) + "\\n").encode())

    torch.manual_seed(0)
    stack = []
    for _ in range(layers):
        stack += [torch.nn.Linear(features, features, bias=False), torch.nn.Tanh()]
    model = torch.nn.Sequential(*stack)
    x = torch.randn(batch, features, generator=torch.Generator().manual_seed(rank))

    def shard(model, mesh):
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)

    def one_step(model, opt, step):
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        record(step=step, at=time.time(), step_s=time.perf_counter() - t0)

    def after(step):  # right after the step's commit (or save): rank 1 dies once
        if rank == 1 and step == kill_at and not os.path.exists(os.path.join(out, "killed")):
            with open(os.path.join(out, "killed"), "w") as fh:
                fh.write(f"{time.time():.6f}")
            os.kill(os.getpid(), signal.SIGKILL)

    if mode == "replica":
        import elastrun.inprocess as inprocess

        @inprocess.run
        def train(state):
            dist.init_process_group("gloo")
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
            if not isinstance(state.model, FSDPModule):  # this process's first call
                shard(state.model, mesh)
                state.optimizer = torch.optim.Adam(state.model.parameters(), lr=1e-4)
            state.restore()
            record(restored=state.step, at=time.time())
            while state.step < steps:
                one_step(state.model, state.optimizer, state.step)
                state.step += 1
                state.commit()
                after(state.step - 1)
            dist.barrier()
            dist.destroy_process_group()

        train(inprocess.State(model=model, optimizer=None, step=0))
        sys.exit(0)

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.stateful import Stateful
    opt = None

    class Training(Stateful):
        def __init__(self, model, opt):
            self.model, self.opt = model, opt
        def state_dict(self):
            m, o = get_state_dict(self.model, self.opt)
            return {"model": m, "optim": o}
        def load_state_dict(self, sd):
            set_state_dict(self.model, self.opt,
                           model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    def setup():
        global opt
        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (world,))
        if opt is None:  # this process's first call
            shard(model, mesh)
            opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        else:  # a survivor's model, after an in-process recovery
            inprocess.rebind(model)
        return {"training": Training(model, opt)}

    if mode == "dcp":
        import torch.distributed.checkpoint as dcp
        disk = os.path.join(out, "disk")
        app = setup()
        start = 0
        if os.path.exists(os.path.join(disk, "latest")):
            with open(os.path.join(disk, "latest")) as fh:
                resumed = int(fh.read())
            dcp.load(app, checkpoint_id=os.path.join(disk, f"step-{resumed}"))
            start = resumed + 1
        record(restored=start, at=time.time())
        for step in range(start, steps):
            one_step(model, opt, step)
            if (step + 1) % every == 0:
                dcp.save(app, checkpoint_id=os.path.join(disk, f"step-{step}"))
                if rank == 0:
                    with open(os.path.join(disk, "latest.tmp"), "w") as fh:
                        fh.write(str(step))
                    os.replace(os.path.join(disk, "latest.tmp"), os.path.join(disk, "latest"))
            after(step)
        dist.barrier()
        dist.destroy_process_group()
        sys.exit(0)

    from elastrun.checkpoint import MemoryCheckpoint
    ckpt = MemoryCheckpoint()

    def loop(commit):
        app = setup()
        last = ckpt.load_latest(app)
        start = 0 if last is None else last + 1
        record(restored=start, at=time.time())
        for step in range(start, steps):
            one_step(model, opt, step)
            ckpt.save(step, app)
            commit(step + 1)
            after(step)
        ckpt.close()
        dist.barrier()
        dist.destroy_process_group()

    if mode == "memory_inplace":
        import elastrun.inprocess as inprocess

        @inprocess.run
        def train(state):
            def commit(step):  # no tensors: how far the training got, for the agent
                state.step = step
                state.commit()

            loop(commit)

        train(inprocess.State(step=0))
    else:
        loop(lambda step: None)
    """
)

REPLICA = "elastrun HSDP, in place from a replica"
MEMORY_INPLACE = "elastrun FSDP2, in place from memory"
MEMORY_RESTART = "elastrun FSDP2, group restart from memory"
TORCHRUN = "torchrun FSDP2, DCP to disk"
COLUMNS = (TORCHRUN, MEMORY_RESTART, MEMORY_INPLACE, REPLICA)
MODES = {
    REPLICA: "replica",
    MEMORY_INPLACE: "memory_inplace",
    MEMORY_RESTART: "memory_restart",
    TORCHRUN: "dcp",
}
#: Of the model, the share a rank holds: HSDP 2 x 2 shards over 2 ranks, FSDP2 over 4.
SHARDS = {REPLICA: 2, MEMORY_INPLACE: 4, MEMORY_RESTART: 4, TORCHRUN: 4}
#: The targets at 0.4 GB per rank: kill -> every rank's next step (s), steps lost.
TARGETS = {REPLICA: (1.5, 0.0), MEMORY_INPLACE: (2.0, None)}
TARGET_GB = 0.4


@dataclass(frozen=True)
class Options:
    reps: int
    sizes: tuple[float, ...]  # GB of state per rank
    columns: tuple[str, ...] = COLUMNS


PROFILE_OPTIONS = {
    # The smoke run checks that the benchmark runs: a tiny state (HSDP F = 128, FSDP2
    # F = 192), one run of each way to recover (about 100 s on 2 loaded cores, torchrun's
    # restart 20 of them; the test runs the two in-place columns only).
    "smoke": Options(reps=1, sizes=(0.0004,)),
    "quick": Options(reps=2, sizes=(0.1, 0.4)),
    "full": Options(reps=3, sizes=(0.1, 0.4, 1.6)),
}


def features(gb: float, column: str) -> int:
    """F (a multiple of 64) that gives a rank ``gb`` of state: its share of LAYERS F x F
    float32 layers, three times (the parameters and Adam's two moments)."""
    per_f2 = 3 * 4 * LAYERS / SHARDS[column]
    return max(64, round(math.sqrt(gb * 1e9 / per_f2) / 64) * 64)


def state_gb(f: int, column: str) -> float:
    return 3 * 4 * LAYERS * f * f / SHARDS[column] / 1e9


def _sizes(opts: Options) -> tuple[float, ...]:
    chosen = os.environ.get("ELASTRUN_BENCH_SIZES", "")
    return tuple(float(s) for s in chosen.split(",") if s) or opts.sizes


def _columns(opts: Options) -> tuple[str, ...]:
    chosen = {m for m in os.environ.get("ELASTRUN_BENCH_COLUMNS", "").split(",") if m}
    unknown = chosen - set(MODES.values())
    if unknown:
        raise ValueError(f"ELASTRUN_BENCH_COLUMNS: unknown modes {sorted(unknown)}")
    return tuple(c for c in COLUMNS if MODES[c] in chosen) or opts.columns


def _measure(column: str, gb: float, work: Path) -> dict[str, float]:
    run_dir = Path(tempfile.mkdtemp(prefix="sharded-", dir=work))
    out = run_dir / "out"
    out.mkdir()
    script = run_dir / "job.py"
    script.write_text(SCRIPT)
    f = features(gb, column)
    args = [str(out), MODES[column], str(f), str(LAYERS), str(BATCH), str(STEPS), str(KILL_AT),
            str(CHECKPOINT_EVERY)]  # fmt: skip
    launcher = torchrun() if column == TORCHRUN else elastrun()
    cmd = launcher.command(4, script, args, "--max-restarts", ONE_FAILURE_RESTARTS)
    env = {"OMP_NUM_THREADS": "1"}
    if column == TORCHRUN:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # (see the module's docstring)
    running = Running(cmd, marker=new_marker(), log_dir=run_dir, env_extra=env)
    outcome = running.finish(900)
    require_clean(outcome)
    killed = out / "killed"
    if not killed.exists():
        raise ScenarioFailure("rank 1 never reached the kill")
    lines: list[dict[str, Any]] = []
    for path in out.glob("steps_*.log"):
        lines += [json.loads(ln) for ln in path.read_text().splitlines() if ln]
    m = after_kill(lines, float(killed.read_text()))
    # A survivor that gloo left blocked in a collective is replaced after
    # ELASTRUN_INPROCESS_JOIN_TIMEOUT (docs/inprocess.md): counted, as it costs seconds.
    m["blocked"] = float("did not reach in-process round" in outcome.stderr_tail)
    return m


def after_kill(lines: list[dict[str, Any]], t_kill: float) -> dict[str, float]:
    """From every rank's records (steps and restores, of every process) and the kill's
    moment: the training step before the kill, and from the kill until every rank
    restored its state and completed the next step, and the steps lost (done again)."""
    before = [ln["step_s"] for ln in lines if "step" in ln and ln["at"] < t_kill]
    steps = [ln for ln in lines if "step" in ln and ln["at"] > t_kill]
    restored = [ln for ln in lines if "restored" in ln and ln["at"] > t_kill]
    ranks = sorted({ln["rank"] for ln in steps})
    if ranks != [0, 1, 2, 3] or sorted({ln["rank"] for ln in restored}) != ranks:
        raise ScenarioFailure(f"ranks that went on after the kill: {ranks}")
    nxt = KILL_AT + 1
    first = {r: min((ln["at"] for ln in steps if ln["rank"] == r and ln["step"] == nxt),
                    default=math.inf) for r in ranks}  # fmt: skip
    if math.inf in first.values():
        raise ScenarioFailure(f"not every rank completed step {nxt} after the kill: {first}")
    back = {r: min(ln["at"] for ln in restored if ln["rank"] == r) for r in ranks}
    return {
        "step_s": statistics.median(before),
        "restored_s": max(back.values()) - t_kill,
        "next_s": max(first.values()) - t_kill,
        "over_s": max(first.values()) - t_kill - statistics.median(before),
        "lost": float(max(_done_again(lines, r) for r in ranks)),
    }


def _done_again(lines: list[dict[str, Any]], rank: int) -> int:
    """How many steps ``rank`` (its processes one after the other) completed twice: a
    step in flight at the kill that a survivor completes after it is not one of them."""
    done = [ln["step"] for ln in lines if "step" in ln and ln["rank"] == rank]
    return len(done) - len(set(done))


def body(section: Section, opts: Options) -> None:
    columns = _columns(opts)
    reps = int(os.environ.get("ELASTRUN_BENCH_REPS", "0")) or opts.reps
    section.intro = (
        f"Four gloo ranks on one node, {LAYERS} linear layers F x F (each sharded with "
        "fully_shard, then the model), Adam (a rank's state: three times its parameter "
        f"shard), a batch of {BATCH}. Rank 1 SIGKILLs itself right after committing (or "
        f"saving) step {KILL_AT}. HSDP 2 x 2: a commit every step. FSDP2 over 4 ranks: a "
        f"memory checkpoint every step; torchrun: dcp.save to disk after every "
        f"{CHECKPOINT_EVERY}th step (the kill one step after a save). "
        f"{reps} alternating run(s) each, on {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f} at the start, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}."
    )
    blocked: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="elastrun-inprocess-sharded-") as tmp:
        for gb in _sizes(opts):
            _one_size(section, gb, columns, reps, Path(tmp), blocked)
    section.raw["survivors_blocked_in_gloo"] = blocked
    section.extra += _targets(section)
    section.notes.append(
        "Restored: every rank past state.restore() (HSDP), ckpt.load_latest or dcp.load. "
        "Next step: every rank completed the first step that no rank had completed before "
        "the kill; a recovery that goes back to an earlier step re-does the steps since "
        "first. Steps lost: the most steps a rank (its processes one after the other) "
        "completed twice. The training step: the median of the steps before the kill "
        "(every rank), of which the next step is one."
    )
    section.notes.append(
        "The same state per rank is a model twice as large on FSDP2 over 4 ranks as on "
        "HSDP 2 x 2, so its step (all-gathers and reduce-scatters of the whole model "
        "among 4 ranks) is slower; HSDP's step also all-reduces the gradients' shards "
        "between the replica groups."
    )
    if any(blocked.values()):
        section.notes.append(
            "Runs where a survivor that gloo left blocked in a collective was replaced "
            f"after ELASTRUN_INPROCESS_JOIN_TIMEOUT (30 s): {blocked}."
        )
    job = f"job.py OUT MODE F {LAYERS} {BATCH} {STEPS} {KILL_AT} {CHECKPOINT_EVERY}"
    run = "--standalone --nproc-per-node=4 --max-restarts 3"
    for column in columns:
        launcher = "torchrun" if column == TORCHRUN else "elastrun"
        prefix = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 " if column == TORCHRUN else ""
        command = f"{prefix}{launcher} {run} {job}".replace("MODE", MODES[column])
        section.commands[column] = command


def _one_size(
    section: Section,
    gb: float,
    columns: tuple[str, ...],
    reps: int,
    work: Path,
    blocked: dict[str, int],
) -> None:
    shown = [c for c in (REPLICA, MEMORY_INPLACE) if c in columns]
    if MEMORY_INPLACE not in columns and set(columns) - {REPLICA}:
        shown.append(MEMORY_INPLACE)  # (the same F as every FSDP2 column)
    sizes = ", ".join(
        f"{'HSDP' if c == REPLICA else 'FSDP2'} F = {features(gb, c)}, "
        f"{state_gb(features(gb, c), c):.3f} GB"
        for c in shown
    )
    reference = TORCHRUN if TORCHRUN in columns else columns[0]
    table = section.table(f"state {gb:g} GB per rank ({sizes})", list(columns), reference)
    targeted = math.isclose(gb, TARGET_GB)
    next_check: Check | None = _next_check if targeted else None
    lost_check: Check | None = _lost_check if targeted else None
    rows = {
        "step_s": table.row("step_s", "training step before the kill (s)", fmt=".2f"),
        "restored_s": table.row("restored_s", "kill -> every rank restored (s)", fmt=".2f"),
        "next_s": table.row(
            "next_s",
            "kill -> every rank completed the next step (s)",
            fmt=".2f",
            target=_target_text("next") if targeted else "",
            check=next_check,
        ),
        # What the recovery adds to the step it interrupts (informative: the targets are
        # the row above; where one step takes longer than a target, as on 2 CPUs at 0.4
        # GB, this row shows the recovery's own share).
        "over_s": table.row(
            "over_s", "kill -> every rank's next step, less one training step (s)", fmt=".2f"
        ),
        "lost": table.row(
            "lost",
            "steps lost (done again)",
            fmt=".0f",
            target=_target_text("lost") if targeted else "",
            check=lost_check,
        ),
    }

    def measure(col: str, _rep: int) -> dict[str, float]:
        return _measure(col, gb, work)

    def record(col: str, m: Mapping[str, float]) -> None:
        for key, row in rows.items():
            row.add(col, m[key])
        blocked[col] = blocked.get(col, 0) + int(m["blocked"])

    alternate(section, f"state {gb:g} GB", list(columns), reps, measure, record)
    _headlines(section, gb, rows["next_s"].medians(), rows["lost"].medians(), targeted)


def _headlines(
    section: Section,
    gb: float,
    nxt: Mapping[str, float],
    lost: Mapping[str, float],
    targeted: bool,
) -> None:
    """One headline per column with a target (met or not only at TARGET_GB)."""
    for col, (at_most, lost_at_most) in TARGETS.items():
        if col not in nxt:
            continue
        value = f"{nxt[col]:.2f} s; {lost[col]:.0f}"
        if TORCHRUN in nxt:
            value += f" (torchrun, DCP: {nxt[TORCHRUN]:.2f} s; {lost[TORCHRUN]:.0f})"
        target, met = "-", None
        if targeted:
            target = f"<= {at_most:g} s" + ("; 0 lost" if lost_at_most == 0 else "")
            met = nxt[col] <= at_most and (lost_at_most is None or lost[col] <= lost_at_most)
        section.headlines.append(
            Headline(
                f"{col}, {gb:g} GB of state per rank: kill -> every rank's next step; steps lost",
                value,
                target,
                met,
            )
        )


def _target_text(what: str) -> str:
    if what == "next":
        return "; ".join(f"{c}: <= {t[0]:g} s" for c, t in TARGETS.items())
    return "; ".join(f"{c}: {t[1]:g}" for c, t in TARGETS.items() if t[1] is not None)


def _next_check(m: Mapping[str, float]) -> bool | None:
    measured = [m[c] <= t[0] for c, t in TARGETS.items() if c in m]
    return all(measured) if measured else None


def _lost_check(m: Mapping[str, float]) -> bool | None:
    measured = [m[c] <= t[1] for c, t in TARGETS.items() if c in m and t[1] is not None]
    return all(measured) if measured else None


def _targets(section: Section) -> list[str]:
    """The report's last block: every headline with its target and whether it was met."""
    if not section.headlines:
        return []
    lines = ["**Targets**", "", "| measurement | result | target | met |", "|---|---|---|---|"]
    for h in section.headlines:
        met = "-" if h.met is None else ("yes" if h.met else "**no**")
        lines.append(f"| {h.what} | {h.value} | {h.target or '-'} | {met} |")
    return [*lines, ""]


BENCHMARK = Benchmark(
    "inprocess_sharded",
    "In-process recovery of sharded training (HSDP, FSDP2) against state size",
    body,
    PROFILE_OPTIONS,
    __doc__ or "",
)
run, main = BENCHMARK.run, BENCHMARK.main


if __name__ == "__main__":
    sys.exit(main())

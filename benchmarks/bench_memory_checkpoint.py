"""Memory checkpoints every step (group restart, and in place) against torchrun with DCP
to local disk every 20 steps.

Two gloo workers train one linear layer (F x 2F, no bias) sharded with FSDP2
(``fully_shard``) and Adam, so a rank's state is its half of the parameters and of
Adam's two moments: 12 F^2 bytes, 0.1 and 0.4 GB per rank for F = 2880 and 5760. The
job is written as FSDP2's documentation advises for a large model: the layer is built on
the meta device, sharded, then given memory, and its weights are drawn (each rank its
shard) only when no checkpoint was loaded; Adam is torch's fused implementation. The
ways to checkpoint:

* **elastrun, memory every step**: ``elastrun.checkpoint.MemoryCheckpoint``, a save
  after every step (the copy into the node's shared memory on the training thread, the
  rest in the background), ``load_latest`` after a restart;
* **elastrun, memory every step, in place**: the same, with the training in a function
  decorated with ``elastrun.inprocess.run``: the survivor keeps its process and its
  sharded model (``elastrun.inprocess.rebind``) and loads the newest step from memory;
* **torchrun, DCP to disk**: the same training under torchrun, ``dcp.save`` (the
  collective save, ``FileSystemWriter``) to a directory on the local disk after every
  20th step, ``dcp.load`` of the newest after a restart (with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, as in ``bench_inprocess_state``).

Measured in a run without a failure: the training step (forward, backward, optimizer
step); the time a save blocks the training thread (the whole call: the state dict,
DCP's planning, the copy or the write); the throughput cost. For the memory checkpoints
the run alternates blocks of 4 steps without a save and with a save every step, and the
cost is the mean step of the blocks that save (their saves included) over the mean step
of those that do not, less one: the machine's load hits both alike, and the background
work's contention with training counts. The blocks measured come after a first block
with saves, whose extra time is a row of its own: the first two saves allocate the
node's memory for the steps (a step in progress, the newest complete one and the spare
that the next save writes over), a cost once per job (once per node's memory, which
outlives restarts). For the disk, one save over 20 training steps.

Then a run with a failure: rank 1 SIGKILLs itself before a step's training (step 6 with
memory checkpoints; with the disk step 29, nine steps after the last save: a failure
between two saves costs on average half the interval). From the kill: until every rank
has loaded its checkpoint, completed its next step, and is back at the killed step, and
the steps lost (done again); and where the time to the load goes: until the new
processes run the job script (the launcher's restart), and the load call itself (the
rest is the job's own model, its sharding and its optimizer's state). Targets at 0.4 GB
per rank (issue 43): blocked <= 0.1 s per save, throughput cost <= 10 % with a save
every step, <= 2 s from the kill to the next step and <= 1 step lost.

Then, for the memory checkpoints, a node killed whole (its agent and its workers) while
a spare waits: two agents of one worker each and a spare on loopback
(``_memory_checkpoint_node``); from the kill until every rank's next step, and the
steps lost. torchrun's figure there is its own restart from DCP on disk (the same files
and the same restart of every worker whichever process was lost; not run again).
``ELASTRUN_BENCH_SIZES=0.4`` (a comma list, GB per rank) measures those sizes only,
``ELASTRUN_BENCH_REPS`` that many runs of each. ``ELASTRUN_BENCH_DEVICE=cuda`` measures
instead one rank with its state on the GPU (1.6 GB unless sizes are given): the time a
save blocks (the copy into the pinned buffer) and the throughput cost, against
``dcp.save`` to disk (issue 43: <= 0.2 s at 1.6 GB); ``=cpu`` runs the same on the CPU.
Run from the repository root::

    .venv/bin/python benchmarks/bench_memory_checkpoint.py [--quick | --smoke]
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Mapping, Sequence
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
from _memory_checkpoint_node import node_killed
from _report import Benchmark, Headline, Row, Section, alternate

WARMUP = 2  # steps left out of the step-time figures (first allocations, first gathers)
EVERY = 20  # torchrun's checkpoint interval
BLOCK = 4  # memory checkpoints without a failure: blocks without and with saves
#: Memory checkpoints without a failure: the blocks measured, after a first block
#: without saves (the warm-up in it) and a first block with saves (the node's memory
#: allocated for the steps and the spare: a cost once per job, shown on a row of its own).
MEASURED_BLOCKS = 6
KILL_MEMORY = 6  # memory checkpoints: the step rank 1 is killed at
#: A node killed: the steps of the job, and its pause after each until the kill (s).
NODE_STEPS, NODE_PACE = 20, 0.1

SCRIPT = textwrap.dedent(
    """\
    import json, os, signal, sys, time, warnings
    started_at = time.time()  # (the process runs the script; torch is imported below)
    warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.stateful import Stateful
    from torch.distributed.fsdp import fully_shard

    out, mode, features, batch, steps, every, block, kill_at = sys.argv[1:9]
    features, batch, steps, every, block, kill_at = map(
        int, (features, batch, steps, every, block, kill_at))
    pace = float(sys.argv[9]) if len(sys.argv) > 9 else 0.0  # (while out/PACE_FILE exists)
    rank = int(os.environ["RANK"])
    device = os.environ.get("BENCH_DEVICE", "cpu")  # (cuda: a rank per GPU, over NCCL)
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    log = os.open(os.path.join(out, f"steps_{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)

    def record(**fields):
        os.write(log, (json.dumps({"rank": rank, **fields}) + "\\n").encode())

    # FSDP2's way for a large model: built on the meta device, sharded, then given
    # memory; its weights are drawn only when no checkpoint was loaded (see init_weights).
    with torch.device("meta"):
        model = torch.nn.Linear(features, 2 * features, bias=False)
    opt = None
    x = torch.randn(batch, features, generator=torch.Generator().manual_seed(rank)).to(device)

    class Training(Stateful):
        def state_dict(self):
            m, o = get_state_dict(model, opt)
            return {"model": m, "optim": o}

        def load_state_dict(self, sd):
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    state = {"training": Training()}
    disk = os.path.join(out, "disk")
    ckpt = None
    if mode in ("memory", "inplace"):
        from elastrun.checkpoint import MemoryCheckpoint
        ckpt = MemoryCheckpoint()

    def setup():
        # The world's group; the model sharded at this process's first call (a survivor
        # of an in-process recovery keeps it, pointed at the new world's groups).
        global opt
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
        if opt is None:
            fully_shard(model)
            model.to_empty(device=device)
            opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
        else:
            inprocess.rebind(model)

    def init_weights():
        # (each rank draws its own shard: the same seed on every rank)
        torch.manual_seed(0)
        with torch.no_grad():
            model.reset_parameters()

    def loop(commit=None):
        start = 0
        t_load = time.perf_counter()
        if ckpt is not None:
            resumed = ckpt.load_latest(state)
            start = 0 if resumed is None else resumed + 1
        elif os.path.exists(os.path.join(disk, "latest")):
            with open(os.path.join(disk, "latest")) as fh:
                resumed = int(fh.read())
            dcp.load(state, checkpoint_id=os.path.join(disk, f"step-{resumed}"))
            start = resumed + 1
        if start == 0:
            init_weights()
        record(loaded_at=time.time(), pid=os.getpid(), started_at=started_at,
               load_s=time.perf_counter() - t_load)
        for step in range(start, steps):
            if rank == 1 and step == kill_at and not os.path.exists(os.path.join(out, "killed")):
                with open(os.path.join(out, "killed"), "w") as fh:
                    fh.write(f"{time.time():.6f}")
                os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.perf_counter()
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            if device == "cuda":
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            saved = False
            if ckpt is not None and (kill_at >= 0 or (step // block) % 2 == 1):
                ckpt.save(step, state)
                saved = True
            elif ckpt is None and (step + 1) % every == 0:
                dcp.save(state, checkpoint_id=os.path.join(disk, f"step-{step}"))
                if rank == 0:
                    with open(os.path.join(disk, "latest.tmp"), "w") as fh:
                        fh.write(str(step))
                    os.replace(os.path.join(disk, "latest.tmp"), os.path.join(disk, "latest"))
                saved = True
            t2 = time.perf_counter()
            record(step=step, at=time.time(), train_s=t1 - t0, save_s=t2 - t1 if saved else None)
            if commit is not None:
                commit(step + 1)
            if pace and os.path.exists(os.path.join(out, "pace")):  # (PACE_FILE)
                time.sleep(pace)
        if ckpt is not None:
            ckpt.close()
        dist.barrier()
        dist.destroy_process_group()

    if mode == "inplace":
        import elastrun.inprocess as inprocess

        @inprocess.run
        def train(progress):
            def commit(step):  # no tensors: how far the training got, for the agent
                progress.step = step
                progress.commit()

            setup()
            loop(commit)

        train(inprocess.State(step=0))
    else:
        setup()
        loop()
    """
)

MEMORY, DISK = "elastrun, memory every step", "torchrun, DCP to disk"
INPLACE = "elastrun, memory every step, in place"
COLUMNS = (DISK, MEMORY, INPLACE)
MODES = {MEMORY: "memory", DISK: "disk", INPLACE: "inplace"}


@dataclass(frozen=True)
class Options:
    reps: int
    features: tuple[int, ...]
    batch: int = 64
    every: int = EVERY
    node_killed: bool = True  # the scenario of a node killed whole (see the module)
    device_features: tuple[int, ...] = (8160,)  # ELASTRUN_BENCH_DEVICE: 1.6 GB, one rank


PROFILE_OPTIONS = {
    # The smoke run (CI) checks that the benchmark runs: a tiny state, a short interval.
    # Without the node killed: three agents and a standalone store on loopback took 10-35 s
    # of the smoke test, and tests/e2e/test_memory_checkpoint_buddies.py runs the same
    # scenario (a node killed whole, a spare taking its place from the buddy's copy, bit
    # for bit); the smoke test pins the scenario's figures (_memory_checkpoint_node).
    "smoke": Options(
        reps=1, features=(256,), batch=8, every=4, node_killed=False, device_features=(256,)
    ),
    "quick": Options(reps=1, features=(2880, 5760)),
    "full": Options(reps=3, features=(2880, 5760)),
}


#: A rank's state in bytes over F^2: half of the layer and of Adam's two moments on each
#: of two ranks, all of them on one.
RANK_BYTES, ONE_RANK_BYTES = 12, 24


def _gb(features: int) -> float:
    return RANK_BYTES * features * features / 1e9


def _sizes() -> list[float]:
    """``ELASTRUN_BENCH_SIZES``: GB per rank (a comma list; none: the profile's)."""
    return [float(v) for v in os.environ.get("ELASTRUN_BENCH_SIZES", "").split(",") if v]


def _features_for(sizes: Sequence[float], bytes_per_f2: int) -> tuple[int, ...]:
    """The layer's F for each state size (a multiple of 32)."""
    return tuple(round(math.sqrt(gb * 1e9 / bytes_per_f2) / 32) * 32 for gb in sizes)


def _run(
    column: str, features: int, opts: Options, work: Path, kill: bool, device: str = ""
) -> list[dict[str, Any]]:
    """Run the job (``device``: one rank on it, see the module; else two on the CPU);
    every rank's records, of every attempt (and the kill's)."""
    run_dir = Path(tempfile.mkdtemp(prefix="ckpt-", dir=work))
    out = run_dir / "out"
    out.mkdir()
    script = run_dir / "job.py"
    script.write_text(SCRIPT)
    mode = MODES[column]
    if kill:
        kill_at = KILL_MEMORY if mode != "disk" else opts.every + opts.every // 2 - 1
        steps = kill_at + 2
    else:
        kill_at = -1
        steps = WARMUP + opts.every if mode == "disk" else (2 + MEASURED_BLOCKS) * BLOCK
    args = [str(out), mode, str(features), str(opts.batch), str(steps), str(opts.every),
            str(BLOCK), str(kill_at)]  # fmt: skip
    launcher = torchrun() if mode == "disk" else elastrun()
    cmd = launcher.command(1 if device else 2, script, args, "--max-restarts", ONE_FAILURE_RESTARTS)
    env = {"OMP_NUM_THREADS": "1", **({"BENCH_DEVICE": device} if device else {})}
    if mode == "disk":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    running = Running(cmd, marker=new_marker(), log_dir=run_dir, env_extra=env)
    require_clean(running.finish(900))
    lines = []
    for path in out.glob("steps_*.log"):
        lines += [json.loads(ln) for ln in path.read_text().splitlines() if ln]
    if kill:
        killed = out / "killed"
        if not killed.exists():
            raise ScenarioFailure("rank 1 never reached the kill")
        lines.append({"killed_at": float(killed.read_text()), "kill_step": kill_at})
    return lines


def _node_killed(features: int, opts: Options, work: Path) -> dict[str, float]:
    """Memory checkpoints, a node killed whole with a spare waiting (see the module)."""
    run_dir = Path(tempfile.mkdtemp(prefix="ckpt-node-", dir=work))
    out = run_dir / "out"
    out.mkdir()
    script = run_dir / "job.py"
    script.write_text(SCRIPT)
    # (a kill step past the end: rank 1 never kills itself, and every step saves)
    job = [str(script), str(out), "memory", str(features), str(opts.batch), str(NODE_STEPS),
           str(opts.every), str(BLOCK), str(NODE_STEPS), str(NODE_PACE)]  # fmt: skip
    return node_killed(job, out, run_dir, KILL_MEMORY)


def _steady(lines: list[dict[str, Any]], column: str, every: int) -> dict[str, float]:
    """Step and save times, and the throughput cost, of a run without a failure."""
    measured = [ln for ln in lines if ln.get("step", -1) >= WARMUP]
    saves = [ln["save_s"] for ln in measured if ln["save_s"] is not None]
    m = {"blocked_s": statistics.median(saves)}
    if column == DISK:
        train = statistics.median(ln["train_s"] for ln in measured)
        m["train_s"] = train
        m["cost_pct"] = statistics.fmean(saves) / (every * train) * 100
        return m
    steady = [ln for ln in measured if ln["step"] >= 2 * BLOCK]
    plain = [ln["train_s"] for ln in steady if ln["save_s"] is None]
    saving = [ln["train_s"] + ln["save_s"] for ln in steady if ln["save_s"] is not None]
    m["train_s"] = statistics.median(plain)
    m["cost_pct"] = (statistics.fmean(saving) / statistics.fmean(plain) - 1) * 100
    # The first block with saves, over the same steps saving in the steady state (each
    # rank's steps end together: a rank's figures are the job's).
    first = [ln for ln in measured if BLOCK <= ln["step"] < 2 * BLOCK and ln["rank"] == 0]
    if len(first) == BLOCK:
        spent = sum(ln["train_s"] + (ln["save_s"] or 0.0) for ln in first)
        m["first_s"] = spent - BLOCK * statistics.fmean(saving)
    return m


def _after_kill(lines: list[dict[str, Any]]) -> dict[str, float]:
    """From the kill: every rank loaded its checkpoint, completed its next step, and was
    back at the killed step; the steps lost (done again)."""
    mark = next(ln for ln in lines if "killed_at" in ln)
    t_kill, kill_step = mark["killed_at"], mark["kill_step"]
    after = [ln for ln in lines if "step" in ln and ln["at"] > t_kill]
    loaded = {ln["rank"]: ln["loaded_at"] for ln in lines if ln.get("loaded_at", 0) > t_kill}
    ranks = {ln["rank"] for ln in after}
    if ranks != {0, 1} or sorted(loaded) != [0, 1]:
        raise ScenarioFailure(f"ranks that went on after the kill: {sorted(ranks)}")
    first = {r: min(ln["at"] for ln in after if ln["rank"] == r) for r in ranks}
    new = [ln for ln in lines if ln.get("started_at", 0) > t_kill]  # (the processes started)
    back = {r: min((ln["at"] for ln in after if ln["rank"] == r and ln["step"] >= kill_step),
                   default=float("nan")) for r in ranks}  # fmt: skip
    return {
        "loaded_s": max(loaded.values()) - t_kill,
        "next_s": max(first.values()) - t_kill,
        "back_s": max(back.values()) - t_kill,
        "lost": float(kill_step - min(ln["step"] for ln in after)),
        "started_s": max(ln["started_at"] for ln in new) - t_kill,
        "load_s": max(ln["load_s"] for ln in lines if ln.get("loaded_at", 0) > t_kill),
    }


def _chosen(opts: Options) -> Options:
    """The profile's options, less what ``ELASTRUN_BENCH_SIZES`` (GB per rank, a comma
    list) and ``ELASTRUN_BENCH_REPS`` narrow (see the module)."""
    features = _features_for(_sizes(), RANK_BYTES)
    reps = int(os.environ.get("ELASTRUN_BENCH_REPS", "0")) or opts.reps
    return dataclasses.replace(opts, features=features or opts.features, reps=reps)


def body(section: Section, opts: Options) -> None:
    opts = _chosen(opts)
    device = os.environ.get("ELASTRUN_BENCH_DEVICE", "")
    if device:
        _on_device(section, opts, device)
        return
    section.intro = (
        "Two gloo workers, one linear layer F x 2F sharded with FSDP2 (built on the meta "
        "device, its weights drawn only when no checkpoint was loaded), fused Adam (a rank's "
        f"state: 12 F^2 bytes), a batch of {opts.batch}. Memory checkpoints: a save after "
        f"every step. torchrun: dcp.save to the local disk after every {opts.every}th step. "
        f"{opts.reps} alternating run(s) each, on {os.cpu_count()} CPUs, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}."
    )
    with tempfile.TemporaryDirectory(prefix="elastrun-memory-checkpoint-") as tmp:
        for features in opts.features:
            _one_size(section, features, opts, Path(tmp))
    section.notes.append(
        "Blocked per save: the whole call on the training thread (the state dict, DCP's "
        "planning, the copy or the write; for memory checkpoints the metadata, the marker, "
        "the ranks' agreement and the removal of the older step run on a background "
        f"thread). Throughput cost: for memory checkpoints, blocks of {BLOCK} steps with a "
        "save every step against blocks without, alternating in one run (the mean step, "
        f"its save included, over the mean step without), {MEASURED_BLOCKS} blocks after "
        "a first block with saves (first saves: its extra time, the node's memory "
        "allocated once); for the disk, one save over "
        f"{opts.every} training steps."
    )
    section.notes.append(
        "The failure: rank 1 SIGKILLs itself before a step's training; for the disk "
        f"{opts.every // 2 - 1} steps after the last save (a failure between two saves "
        "costs on average half the interval). Loaded: every rank's checkpoint loaded into "
        "its model and optimizer; back: every rank completed the step it was killed at."
    )
    section.notes.append(
        "In place: the same job in a function decorated with elastrun.inprocess.run "
        "(issue 44): rank 0 keeps its process and its sharded model "
        "(elastrun.inprocess.rebind), the replacement of rank 1 builds its own, and both "
        "load the newest step in the node's memory; the group restart starts both "
        "processes again (from elastrun's template)."
    )
    if opts.node_killed:
        section.notes.append(
            "Node killed: elastrun on two nodes of one worker each and a spare node "
            "waiting (three agents on loopback, a standalone elastrun store); the job saves "
            f"every step (paused {NODE_PACE} s after each until the kill, so that the spare "
            f"waits first); once every rank recorded step {KILL_MEMORY}, the process group "
            "of rank 1's agent is SIGKILLed (its workers die with it); the spare takes its "
            "place with rank 1's piece from the copy on the other node. Next step: every "
            "rank of the new world completed its first step. torchrun's figures there are "
            "those of its restart from DCP on disk above (every worker restarts from the "
            "same files whichever process was lost; not run again with a node killed)."
        )
    section.commands[MEMORY] = (
        "elastrun --standalone --nproc-per-node=2 --max-restarts 3 job.py OUT memory F 64 N 20 4 K"
    )
    section.commands[INPLACE] = (
        "elastrun --standalone --nproc-per-node=2 --max-restarts 3 job.py OUT inplace F 64 N 20 4 K"
    )
    section.commands[DISK] = (
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node=2 "
        "--max-restarts 3 job.py OUT disk F 64 N 20 4 K"
    )


def _one_size(section: Section, features: int, opts: Options, work: Path) -> None:
    size = f"{_gb(features):.2f} GB"
    table = section.table(f"state {size} per rank (F = {features})", list(COLUMNS), DISK)
    rows = [
        table.row("train_s", "training step (s)", fmt=".3f"),
        table.row("blocked_s", "blocked per save (s)", fmt=".3f"),
        table.row("cost_pct", "throughput cost of saving (%)", fmt=".1f"),
        table.row("first_s", "first saves: once per job (s)", fmt=".2f"),
        table.row("started_s", "kill -> the new processes run the job script (s)", fmt=".2f"),
        table.row("loaded_s", "kill -> every rank loaded its checkpoint (s)", fmt=".2f"),
        table.row("load_s", "of which the load call (s, the slowest rank)", fmt=".2f"),
        table.row("next_s", "kill -> every rank's next step (s)", fmt=".2f"),
        table.row("back_s", "kill -> every rank back at the killed step (s)", fmt=".2f"),
        table.row("lost", "steps lost (done again)", fmt=".0f"),
        table.row(
            "node_next_s",
            "node killed, a spare waiting: kill -> every rank's next step (s)",
            fmt=".2f",
        ),
        table.row("node_lost", "node killed, a spare waiting: steps lost", fmt=".0f"),
    ]

    def measure(col: str, _rep: int) -> dict[str, float]:
        m = _steady(_run(col, features, opts, work, kill=False), col, opts.every)
        m.update(_after_kill(_run(col, features, opts, work, kill=True)))
        if col == MEMORY and opts.node_killed:
            m.update(_node_killed(features, opts, work))
        elif col == DISK and opts.node_killed:  # (its restart from DCP on disk: see the module)
            m.update(node_next_s=m["next_s"], node_lost=m["lost"])
        return m

    alternate(section, f"state {size}", list(COLUMNS), opts.reps, measure, _recorder(rows))
    _headline(section, size, {r.key: r for r in rows})


def _on_device(section: Section, opts: Options, device: str) -> None:
    """One rank with its state on ``device`` (see the module): blocked per save and the
    throughput cost, memory checkpoints every step against DCP to disk."""
    section.intro = (
        f"One rank on {device} (NCCL on a GPU), one linear layer F x 2F with FSDP2 over a "
        f"world of one, Adam (its state: 24 F^2 bytes), a batch of {opts.batch}; "
        f"{opts.reps} alternating run(s) each, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}."
    )
    chosen = _features_for(_sizes(), ONE_RANK_BYTES)
    with tempfile.TemporaryDirectory(prefix="elastrun-memory-checkpoint-") as tmp:
        for features in chosen or opts.device_features:
            _device_size(section, features, opts, Path(tmp), device)


def _device_size(section: Section, features: int, opts: Options, work: Path, device: str) -> None:
    size = f"{ONE_RANK_BYTES * features * features / 1e9:.2f} GB"
    columns = [DISK, MEMORY]
    table = section.table(f"on {device}: state {size} (F = {features})", columns, DISK)
    rows = [
        table.row("train_s", "training step (s)", fmt=".3f"),
        table.row("blocked_s", "blocked per save (s)", fmt=".3f"),
        table.row("cost_pct", "throughput cost of saving (%)", fmt=".1f"),
        table.row("first_s", "first saves: once per job (s)", fmt=".2f"),
    ]

    def measure(col: str, _rep: int) -> dict[str, float]:
        lines = _run(col, features, opts, work, kill=False, device=device)
        return _steady(lines, col, opts.every)

    alternate(section, f"{device} {size}", columns, opts.reps, measure, _recorder(rows))
    blocked = rows[1].medians().get(MEMORY)
    if blocked is not None:
        section.headlines.append(
            Headline(
                f"memory checkpoints on {device}, {size} per rank: blocked per save",
                f"{blocked:.3f} s",
                "<= 0.2 s (at 1.6 GB, on a GPU)",
                blocked <= 0.2,
            )
        )


def _recorder(rows: Sequence[Row]) -> Callable[[str, Mapping[str, float]], None]:
    """What ``alternate`` calls with a column's measurement: each row takes its key."""

    def record(col: str, m: Mapping[str, float]) -> None:
        for row in rows:
            if row.key in m:
                row.add(col, m[row.key])

    return record


def _headline(section: Section, size: str, rows: Mapping[str, Row]) -> None:
    med = {k: r.medians() for k, r in rows.items()}
    if any(MEMORY not in med[k] for k in ("blocked_s", "cost_pct", "next_s", "lost")):
        return
    mem = {k: v[MEMORY] for k, v in med.items() if MEMORY in v}
    disk = {k: v[DISK] for k, v in med.items() if DISK in v}
    shown = f"{mem['blocked_s']:.3f} s; {mem['cost_pct']:.1f} %; {mem['next_s']:.2f} s; "
    shown += f"{mem['lost']:.0f}"
    if len(disk) == len(mem):
        shown += (
            f" (torchrun, DCP to disk every {EVERY}: {disk['blocked_s']:.3f} s; "
            f"{disk['cost_pct']:.1f} %; {disk['next_s']:.2f} s; {disk['lost']:.0f})"
        )
    inplace = {k: v[INPLACE] for k, v in med.items() if INPLACE in v}
    if "next_s" in inplace and "lost" in inplace:
        section.headlines.append(
            Headline(
                f"FSDP2 in place from memory checkpoints, {size} per rank: kill -> every "
                "rank's next step; steps lost",
                f"{inplace['next_s']:.2f} s; {inplace['lost']:.0f}",
                "<= 2 s (at 0.4 GB)",
                inplace["next_s"] <= 2,
            )
        )
    section.headlines.append(
        Headline(
            f"memory checkpoints of {size} per rank, a save every step: blocked per save; "
            "throughput cost; kill -> every rank's next step; steps lost",
            shown,
            "<= 0.1 s; <= 10 %; <= 2 s; <= 1 (at 0.4 GB)",
            mem["blocked_s"] <= 0.1
            and mem["cost_pct"] <= 10
            and mem["next_s"] <= 2
            and mem["lost"] <= 1,
        )
    )


BENCHMARK = Benchmark(
    "memory_checkpoint",
    "Memory checkpoints against DCP to disk",
    body,
    PROFILE_OPTIONS,
    __doc__ or "",
)
run, main = BENCHMARK.run, BENCHMARK.main


if __name__ == "__main__":
    sys.exit(main())

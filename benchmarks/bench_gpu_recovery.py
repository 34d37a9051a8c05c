"""Time to recover a GPU training job after a rank is SIGKILLed, elastrun beside torchrun.

Two jobs, each run under every launcher in turn (alternating):

(a) **1 rank, NCCL DDP** -- one GPU per node, the commonest small-cluster layout, with
    the user's environment left as it is (no ``OMP_NUM_THREADS``: elastrun sets it only
    for several workers, as torchrun does);
(b) **4 ranks sharing one GPU, gloo on CUDA tensors**; the ``--no-template`` column is
    the same job with every worker started as a fresh interpreter.

The rank is SIGKILLed when it reports step 25; the launcher restarts the group
(``--max-restarts=1``) and the new workers load the step-20 checkpoint. Measured: kill →
the first step after the restart done, split into detection, stopping, rendezvous,
process start, torch import, CUDA initialisation (the device's first tensor), process
group (``init_process_group`` and a first collective, which creates NCCL's
communicator), and the first step (model + DDP wrapper, checkpoint load, one step).

Without a GPU the same jobs run on the CPU (gloo, CPU tensors; the CUDA phase is then
empty), which is what CI's smoke test runs. Run from the repository root::

    .venv/bin/python benchmarks/bench_gpu_recovery.py [--quick]
"""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from _collect import WORKER_SNIPPET, Conn
from _common import (
    Launcher,
    ScenarioFailure,
    display_command,
    elastrun,
    elastrun_no_template,
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
from bench_recovery import (
    KILL_AT_STEP,
    TORCHRUN_ENV,
    kill_and_recover,
    latest_report,
    launcher_marks,
)

GPU_WORKER = (
    textwrap.dedent(
        """\
    import time; T0 = time.time()
    import os, sys
    PRE = "torch" in sys.modules  # forked from a template that already imported it
    COLLECTOR, CKPT_DIR = sys.argv[1], sys.argv[2]
    PERIOD, EVERY, AFTER = float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    DEVICE, BACKEND, WIDTH = sys.argv[6], sys.argv[7], int(sys.argv[8])
    """
    )
    + WORKER_SNIPPET
    + textwrap.dedent(
        """\
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"])
    tell("start", t=T0, pid=os.getpid(), rank=rank, attempt=attempt, pre=PRE)
    import datetime
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    tell("imported", threads=torch.get_num_threads())
    if DEVICE == "cuda":
        torch.cuda.set_device(local % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
        torch.zeros(1, device=dev)
        torch.cuda.synchronize()
    else:
        dev = torch.device("cpu")
    tell("cuda")
    dist.init_process_group(BACKEND, timeout=datetime.timedelta(seconds=60))
    probe = torch.ones(1, device=dev)
    dist.all_reduce(probe)  # NCCL creates its communicator on the first collective
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    tell("pg")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.ReLU(), nn.Linear(4 * WIDTH, WIDTH))
    model = DistributedDataParallel(net.to(dev))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    tell("ddp")
    path = os.path.join(CKPT_DIR, "ckpt.pt")
    step = 0
    if os.path.exists(path):
        state = torch.load(path, map_location=dev)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
    resumed = step
    tell("resumed", step=step)
    give_up = time.monotonic() + 180
    due = time.monotonic()
    while True:
        g = torch.Generator().manual_seed(step * world + rank)
        x = torch.randn(32, WIDTH, generator=g).to(dev)
        loss = nn.functional.mse_loss(model(x), x)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        step += 1
        if rank == 0 and step % EVERY == 0:
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
STEPS_AFTER_RESTART = 5

PHASES = (
    ("detection", "1. detection: SIGKILL → the launcher reacts"),
    ("stopping", "2. stopping the survivors"),
    ("rendezvous", "3. rendezvous"),
    ("start", "4. process start (→ every new worker runs its first line)"),
    ("import", "5. torch import"),
    ("cuda", "6. CUDA initialisation (set_device, the first tensor)"),
    ("pg", "7. process group (init + first collective)"),
    ("step", "8. first step after the restart (model + DDP, checkpoint load, one step)"),
)


@dataclass(frozen=True)
class Job:
    """One job: its ranks, backend and device."""

    key: str
    title: str
    nproc: int
    backend: str
    device: str
    width: int


@dataclass(frozen=True)
class Options:
    reps: int
    timeout_s: float = 300.0


PROFILE_OPTIONS = {
    "smoke": Options(reps=1),
    "quick": Options(reps=1),
    "full": Options(reps=3),
}


def has_cuda() -> bool:
    """Whether a CUDA device is usable, asked of a separate interpreter (the benchmark
    itself never imports torch, like the launcher)."""
    import subprocess

    probe = "import torch; print(torch.cuda.is_available() and torch.cuda.device_count() > 0)"
    try:
        out = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.stdout.strip() == "True"


def jobs_for(cuda: bool, profile: str) -> list[Job]:
    device = "cuda" if cuda else "cpu"
    width = 1024 if cuda else 128
    one = Job(
        "one",
        f"(a) 1 rank, {'NCCL DDP on one GPU' if cuda else 'gloo DDP on the CPU'}",
        1,
        "nccl" if cuda else "gloo",
        device,
        width,
    )
    four = Job(
        "four",
        f"(b) 4 ranks sharing one {'GPU, gloo on CUDA tensors' if cuda else 'CPU, gloo'}",
        4,
        "gloo",
        device,
        width,
    )
    return [one] if profile == "smoke" else [one, four]


def recover_once(lch: Launcher, kind: str, job: Job, opts: Options) -> dict[str, float]:
    args = [
        str(STEP_PERIOD_S),
        str(CHECKPOINT_EVERY),
        str(STEPS_AFTER_RESTART),
        job.device,
        job.backend,
        str(job.width),
    ]
    return kill_and_recover(lch, kind, job.nproc, GPU_WORKER, args, opts.timeout_s, _phases)


def _phases(kind: str, work: Path, t_kill: float, conns: list[Conn], n: int) -> dict[str, float]:
    new = [c for c in conns if c.hello.get("attempt") == 1]
    if len(new) != n:
        raise ScenarioFailure(f"{len(new)} of {n} replacement workers reported")
    t = {ev: latest_report(new, ev) for ev in ("start", "imported", "cuda", "pg", "step")}
    result = {
        "total": t["step"] - t_kill,
        "import": t["imported"] - t["start"],
        "cuda": t["cuda"] - t["imported"],
        "pg": t["pg"] - t["cuda"],
        "step": t["step"] - t["pg"],
        "template": 1.0 if all(c.hello.get("pre") for c in new) else 0.0,
    }
    marks = launcher_marks(kind, work, t_kill)
    if {"detected", "stopped", "rendezvous"} <= set(marks):
        result["detection"] = marks["detected"] - t_kill
        result["stopping"] = marks["stopped"] - marks["detected"]
        result["rendezvous"] = marks["rendezvous"] - marks["stopped"]
        result["start"] = t["start"] - marks["rendezvous"]
    return result


def body(section: Section, opts: Options, variants: list[tuple[Launcher, str]], cuda: bool) -> None:
    device = "GPU" if cuda else "CPU (no GPU here: gloo on CPU tensors)"
    section.intro = (
        f"Device: {device}. A DDP job (Adam, a step every {STEP_PERIOD_S * 1000:.0f} ms, rank 0 "
        f"checkpointing every {CHECKPOINT_EVERY} steps); the last rank is SIGKILLed when it "
        f"reports step {KILL_AT_STEP}; `--max-restarts=1`. Each phase ends when the slowest "
        "worker (or the launcher) is done with it. Launchers alternate. The user's "
        "environment is left as it is (no OMP_NUM_THREADS)."
    )
    columns = [lch.name for lch, _ in variants]
    by_name = {lch.name: (lch, kind) for lch, kind in variants}
    ref = "torchrun" if "torchrun" in columns else None
    # On a GPU the target is 5x sooner than torchrun; on the CPU, 3x.
    at_most = 0.2 if cuda else 1 / 3
    for job in jobs_for(cuda, section.profile):
        table = section.table(f"{job.title} (seconds)", columns, ref)
        rows: dict[str, Row] = {
            "total": table.row(
                f"{job.key}.total",
                "**total: SIGKILL → first step after the restart done**",
                target=f"≤ {at_most:.2f} of torchrun's",
                check=ratio_check("elastrun", "torchrun", at_most),
            )
        }
        for key, label in PHASES:
            rows[key] = table.row(f"{job.key}.{key}", label)
        templated: dict[str, list[float]] = {}

        def measure(col: str, rep: int, job: Job = job) -> dict[str, float]:
            lch, kind = by_name[col]
            return recover_once(lch, kind, job, opts)

        def record(
            col: str,
            m: Mapping[str, float],
            rows: dict[str, Row] = rows,
            templated: dict[str, list[float]] = templated,
        ) -> None:
            for key, row in rows.items():
                if key in m:
                    row.add(col, m[key])
            templated.setdefault(col, []).append(m.get("template", 0.0))

        alternate(section, job.title, columns, opts.reps, measure, record)
        for col, flags in templated.items():
            if col.startswith("elastrun"):
                used = "yes" if flags and all(flags) else "no" if not any(flags) else "some runs"
                section.notes.append(f"{job.title}, {col}: workers forked from a template: {used}.")
        total = rows["total"]
        for col in columns:
            if col != "torchrun" and "torchrun" in columns:
                section.headlines.append(
                    Headline(
                        f"{job.title}: recovery, {col} / torchrun",
                        ratio_text(total, col, "torchrun"),
                        f"≤ {at_most:.2f}" if col == "elastrun" else "",
                        ratio_check(col, "torchrun", at_most)(total.medians())
                        if col == "elastrun"
                        else None,
                    )
                )
    for col in columns:
        lch, kind = by_name[col]
        extra = ["--max-restarts=1"]
        env = {**dict(lch.env), **(TORCHRUN_ENV if kind == "torchrun" else {})}
        cmd = lch.command(1, Path("/W/gpu_worker.py"), ["/W/c.sock", "/W/ckpt", "..."], *extra)
        section.commands.setdefault(col, display_command(cmd, env, Path("/W")))
    section.notes.append(
        "torchrun runs with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (its default shared store "
        "cannot recover a job whose worker was SIGKILLed) and `LOGLEVEL=INFO` for its timeline."
    )


def run(
    profile: str, variants: list[tuple[Launcher, str]] | None = None, reps: int | None = None
) -> Section:
    if variants is None:
        variants = [(elastrun(), "elastrun")]
        if profile != "smoke":
            variants += [(torchrun(), "torchrun"), (elastrun_no_template(), "elastrun")]
    usable = [(lch, k) for lch, k in variants if lch.available() is None]
    opts = PROFILE_OPTIONS[profile]
    if reps is not None:
        opts = Options(reps=reps, timeout_s=opts.timeout_s)
    cuda = os.environ.get("ELASTRUN_BENCH_DEVICE", "auto") != "cpu" and has_cuda()

    def go(section: Section) -> None:
        for lch, _ in variants:
            if lch.available() is not None:
                section.fail(lch.name, f"not run: {lch.available()}")
        body(section, opts, usable, cuda)

    return run_section("gpu_recovery", "Time to recover a GPU job", go, profile)


def main(argv: list[str] | None = None) -> int:
    p = common_parser(__doc__ or "")
    p.add_argument(
        "--variants",
        default=None,
        help="comma list of elastrun, torchrun, elastrun-no-template (alternation order; "
        "default: all three, elastrun alone with --smoke)",
    )
    p.add_argument("--reps", type=int, default=None, help="repetitions of each launcher")
    args = p.parse_args(argv)
    known = {
        "elastrun": (elastrun(), "elastrun"),
        "torchrun": (torchrun(), "torchrun"),
        "elastrun-no-template": (elastrun_no_template(), "elastrun"),
    }
    variants = [known[x] for x in args.variants.split(",") if x] if args.variants else None
    section = run(profile_of(args), variants, args.reps)
    print(section.render())
    write_section(section, args.output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())

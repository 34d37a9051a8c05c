"""In-process recovery against state size: recovery time, transfer rate, peak memory.

Two gloo workers train one linear layer (F x 2F, no bias) with Adam, so the state is
three times the parameters: 0.1, 0.4 and 1.6 GB per rank for F = 2048, 4096, 8192. The
gradients' all-reduce is the step's collective. Rank 1 kills itself (SIGKILL) right
after it committed step KILL_AT, writing the moment first. The ways to recover:

* **in place**: ``elastrun.inprocess`` (a commit after every step, no copy of the
  state); rank 1 is replaced and takes the newest commit from rank 0, tensor by tensor,
  read from rank 0's memory (``inprocess.local_copy``);
* **in place, over gloo**: the same, the commit's bytes streamed over gloo (as between
  machines);
* **group restart**: the same training without the API; rank 0 saves a checkpoint
  (``torch.save``) after step CHECKPOINT_AT, every restarted worker loads it and does
  again the steps since;
* **torchrun**: the group restart's script under torchrun (``--max-restarts 3``), with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with its default (the workers share the
  agent's store, under the same prefix for every restart), the restarted workers' gloo
  group read the killed attempt's addresses and failed to connect (connection refused)
  in every run on this machine.

``ELASTRUN_BENCH_DEVICE=cuda`` keeps the model, its gradients and Adam's moments on the
GPU (both ranks on ``cuda:0``; the all-reduce is gloo's on CUDA tensors), so that a
commit is copied to host memory and the replacement's tensors are filled on the GPU;
``ELASTRUN_BENCH_FEATURES=8192`` (a comma list) measures those sizes only.

Measured from the kill: the time until every rank has completed the next step (the
first that no rank had completed), the commit's transfer (bytes over seconds, on the
replacement, from the commit's description to the last byte in its tensors), and each run's peak
RSS (the larger of the two ranks': the in-place survivor against the group restart's
ranks, which hold the same training without the API). Target: the transfer at least
2 GB/s on loopback, the in-place peak at most 1.15x. Run from the repository root::

    .venv/bin/python benchmarks/bench_inprocess_state.py [--quick | --smoke]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import textwrap
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from _common import (
    ONE_FAILURE_RESTARTS,
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
    Section,
    alternate,
)

KILL_AT, CHECKPOINT_AT = 3, 2

SCRIPT = textwrap.dedent(
    """\
    import json, os, signal, sys, time
    import torch, torch.distributed as dist

    out, mode, features, steps, kill_at, ckpt_at = sys.argv[1:7]
    features, steps, kill_at, ckpt_at = int(features), int(steps), int(kill_at), int(ckpt_at)
    rank = int(os.environ["RANK"])
    log = os.open(os.path.join(out, f"steps_{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    device = torch.device(os.environ.get("STATE_DEVICE", "cpu"))
    torch.manual_seed(0)
    model = torch.nn.Linear(features, 2 * features, bias=False).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(8, features, generator=torch.Generator().manual_seed(rank)).to(device)
    ckpt = os.path.join(out, "ckpt.pt")

    def peak():
        with open("/proc/self/status") as fh:
            return next(int(l.split()[1]) * 1024 for l in fh if l.startswith("VmHWM"))

    def one_step(step):
        opt.zero_grad()
        model(x).square().mean().backward()
        dist.all_reduce(model.weight.grad)
        opt.step()
        os.write(log, f"{rank} {step} {time.time():.6f} {os.getpid()}\\n".encode())

    def after(step, state=None):
        if rank == 1 and step == kill_at and not os.path.exists(os.path.join(out, "killed")):
            with open(os.path.join(out, "killed"), "w") as fh:
                fh.write(f"{time.time():.6f}")
            os.kill(os.getpid(), signal.SIGKILL)

    if mode == "inprocess":
        import elastrun.inprocess as ip
        import elastrun.inprocess.worker.transfer as transfer

        real_move, real_targets, allocated = transfer._move_bytes, ip.State.targets, []
        transfer.LOCAL = os.environ.get("OVER_GLOO") != "1"

        def targets(self, desc, *rest):  # the description is in: from here on it is timed
            allocated.append(time.perf_counter())
            return real_targets(self, desc, *rest)

        def move(tensors, plan, me, world, *rest):
            real_move(tensors, plan, me, world, *rest)
            if any(me in p.receivers for p in plan):  # (a plan per shard)
                size = sum(t.numel() * t.element_size() for t in tensors)
                with open(os.path.join(out, f"transfer_{me}.json"), "w") as fh:
                    json.dump({"bytes": size, "seconds": time.perf_counter() - allocated[-1]}, fh)

        ip.State.targets = targets
        transfer._move_bytes = move
        state = ip.State(model=model, optimizer=opt, step=0)

        @ip.run
        def train(state):
            dist.init_process_group("gloo")
            while state.step < steps:
                one_step(state.step)
                state.step += 1
                state.commit()
                after(state.step - 1)
            dist.barrier()
            dist.destroy_process_group()

        train(state)
    else:
        step = 0
        if os.path.exists(ckpt):
            saved = torch.load(ckpt, weights_only=True, mmap=True, map_location="cpu")
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            step = saved["step"]
            del saved
        dist.init_process_group("gloo")
        while step < steps:
            one_step(step)
            step += 1
            if rank == 0 and step == ckpt_at + 1:
                saved = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}
                torch.save(saved, ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)
            after(step - 1)
        dist.barrier()
        dist.destroy_process_group()
    with open(os.path.join(out, f"peak_{rank}_{os.getpid()}"), "w") as fh:
        fh.write(str(peak()))
    """
)


COLUMNS = ("torchrun", "group restart", "in place, over gloo", "in place")


@dataclass(frozen=True)
class Options:
    reps: int
    features: tuple[int, ...]
    columns: tuple[str, ...] = COLUMNS


PROFILE_OPTIONS = {
    # The smoke run (CI) checks that the benchmark runs: its smallest state, one run of
    # each way the script recovers (the commit over gloo is the in-place script with one
    # variable set, and tests/e2e/test_inprocess_scale.py moves one that way).
    "smoke": Options(reps=1, features=(512,), columns=("group restart", "in place")),
    "quick": Options(reps=1, features=(2048, 4096)),
    "full": Options(reps=3, features=(2048, 4096, 8192)),
}


def _device() -> str:
    return os.environ.get("ELASTRUN_BENCH_DEVICE", "cpu")


def _features(opts: Options) -> tuple[int, ...]:
    chosen = os.environ.get("ELASTRUN_BENCH_FEATURES", "")
    return tuple(int(f) for f in chosen.split(",") if f) or opts.features


def _gb(features: int) -> float:
    return 3 * 2 * features * features * 4 / 1e9


def _measure(column: str, features: int, work: Path) -> dict[str, float]:
    run_dir = Path(tempfile.mkdtemp(prefix="state-", dir=work))
    out = run_dir / "out"
    out.mkdir()
    script = run_dir / "job.py"
    script.write_text(SCRIPT)
    mode = "inprocess" if column.startswith("in place") else "restart"
    steps = KILL_AT + 3
    args = [str(out), mode, str(features), str(steps), str(KILL_AT), str(CHECKPOINT_AT)]
    launcher = torchrun() if column == "torchrun" else elastrun()
    cmd = launcher.command(2, script, args, "--max-restarts", ONE_FAILURE_RESTARTS)
    env = {
        "OMP_NUM_THREADS": "1",
        "OVER_GLOO": "1" if "gloo" in column else "0",
        "STATE_DEVICE": _device(),
    }
    if column == "torchrun":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # (see the module's docstring)
    running = Running(cmd, marker=new_marker(), log_dir=run_dir, env_extra=env)
    try:
        if not wait_until((out / "killed").exists, 600):
            raise ScenarioFailure("rank 1 never reached the kill")
    finally:
        outcome = running.finish(600)
    require_clean(outcome)
    t_kill = float((out / "killed").read_text())
    first: dict[int, float] = {}
    for path in out.glob("steps_*.log"):
        for line in path.read_text().splitlines():
            rank, step, t, _ = line.split()
            if int(step) == KILL_AT + 1 and float(t) > t_kill:
                first[int(rank)] = min(first.get(int(rank), float("inf")), float(t))
    if sorted(first) != [0, 1]:
        raise ScenarioFailure(f"ranks that completed step {KILL_AT + 1}: {sorted(first)}")
    m = {
        "next_s": max(first.values()) - t_kill,
        "peak_gb": max(int(p.read_text()) for p in out.glob("peak_*")) / 1e9,
    }
    moved = out / "transfer_1.json"
    if moved.exists():
        data = json.loads(moved.read_text())
        m["gbps"] = data["bytes"] / data["seconds"] / 1e9
        m["transfer_s"] = data["seconds"]
    return m


def body(section: Section, opts: Options) -> None:
    section.intro = (
        "Two gloo workers, one linear layer F x 2F with Adam (state: 3x the parameters), "
        f"the gradients' all-reduce each step; rank 1 is killed after committing step "
        f"{KILL_AT}. In place: a commit every step (no copy). Group restart: the same "
        f"training without the API, a checkpoint after step {CHECKPOINT_AT}. "
        f"The state on {_device()}. "
        f"{opts.reps} alternating run(s) each, on {os.cpu_count()} CPUs, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}."
    )
    with tempfile.TemporaryDirectory(prefix="elastrun-inprocess-state-") as tmp:
        for features in _features(opts):
            _one_size(section, features, opts, Path(tmp))
    section.notes.append(
        "The transfer is timed on the replacement, from the moment the commit's description "
        "is in and it finds its tensors (its own parameters, Adam's moments: State.targets) "
        "to the last byte in them and every rank's report. Adam's moments were allocated "
        "before, from the shapes the first holder left on the round's store, and a thread "
        "faulted their pages in while the replacement joined the round's process group "
        "(inprocess.early); what it had not faulted in by then is faulted in during the "
        "copy, and timed. The kill -> next step row holds all of it."
    )
    section.notes.append(
        "Peak RSS: the larger of the two ranks' VmHWM at the end (the survivor's, in "
        "place); the group restart runs the same training without the API."
    )
    section.commands["in place"] = (
        "elastrun --standalone --nproc-per-node=2 --max-restarts 3 job.py OUT inprocess F 6 3 2"
    )
    section.commands["in place, over gloo"] = "OVER_GLOO=1 " + section.commands["in place"]
    section.commands["group restart"] = (
        "elastrun --standalone --nproc-per-node=2 --max-restarts 3 job.py OUT restart F 6 3 2"
    )
    section.commands["torchrun"] = (
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node=2 "
        "--max-restarts 3 job.py OUT restart F 6 3 2"
    )


def _one_size(section: Section, features: int, opts: Options, work: Path) -> None:
    size = f"{_gb(features):.2f} GB"
    columns = list(opts.columns)
    reference = "torchrun" if "torchrun" in columns else "group restart"
    table = section.table(f"state {size} per rank (F = {features})", columns, reference)
    following = table.row("next_s", "kill -> every rank completed the next step (s)", fmt=".2f")
    peak = table.row("peak_gb", "peak RSS of a rank (GB)", fmt=".2f")
    rate = table.row("gbps", "commit transfer (GB/s)", fmt=".2f")
    took = table.row("transfer_s", "commit transfer (s)", fmt=".2f")

    def measure(col: str, _rep: int) -> dict[str, float]:
        return _measure(col, features, work)

    def record(col: str, m: Mapping[str, float]) -> None:
        following.add(col, m["next_s"])
        peak.add(col, m["peak_gb"])
        if "gbps" in m:
            rate.add(col, m["gbps"])
            took.add(col, m["transfer_s"])

    alternate(section, f"state {size}", columns, opts.reps, measure, record)
    m_next, m_peak, m_rate = following.medians(), peak.medians(), rate.medians()
    inplace, group = m_next.get("in place"), m_next.get("group restart")
    if inplace is None or group is None:
        return
    under_torchrun = m_next.get("torchrun")
    if under_torchrun is not None:
        section.headlines.append(
            Headline(
                f"in-process recovery of a {size} state per rank against torchrun's restart "
                "from a checkpoint: kill -> every rank's next step",
                f"{inplace:.2f} s vs {under_torchrun:.2f} s "
                f"(x{under_torchrun / inplace:.1f} sooner)",
                "sooner than torchrun",
                inplace < under_torchrun,
            )
        )
    ratio = m_peak.get("in place", float("nan")) / m_peak.get("group restart", float("nan"))
    gbps = m_rate.get("in place", float("nan"))
    section.headlines.append(
        Headline(
            f"in-process recovery of a {size} state per rank: kill -> every rank's next "
            "step; commit transfer rate (from memory); peak RSS against the group restart's",
            f"{inplace:.2f} s (group restart {group:.2f} s); {gbps:.2f} GB/s; x{ratio:.2f}",
            "transfer >= 2 GB/s, peak <= 1.15x",
            gbps >= 2.0 and ratio <= 1.15,
        )
    )


BENCHMARK = Benchmark(
    "inprocess_state",
    "In-process recovery against state size",
    body,
    PROFILE_OPTIONS,
    __doc__ or "",
)
run, main = BENCHMARK.run, BENCHMARK.main


if __name__ == "__main__":
    sys.exit(main())

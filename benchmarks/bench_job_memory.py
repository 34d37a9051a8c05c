"""Total memory of a whole job: the launcher and every process it started.

Four workers import torch and join a gloo group, then idle; once every worker has
reported, the memory of the launcher and all its descendants is summed. RSS counts
shared pages once per process; PSS splits each shared page among the processes sharing
it, so PSS shows what forking workers from the pre-imported template saves
(copy-on-write). Launchers alternate A B A B.

Usage: python benchmarks/bench_job_memory.py [--reps N] [--nproc N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
from _common import (
    elastrun,
    elastrun_no_template,
    kill_marked,
    new_marker,
    tagged_env,
    torchrun,
    wait_until,
)

WORKER = textwrap.dedent(
    """
    import os, sys, time
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    open(os.path.join(sys.argv[1], os.environ["RANK"]), "w").close()
    while not os.path.exists(os.path.join(sys.argv[1], "stop")):
        time.sleep(0.1)
    dist.destroy_process_group()
    """
)


def _tree_memory(root: int) -> tuple[float, float, int]:
    """(RSS MB, PSS MB, process count) of ``root`` and all its descendants."""
    procs = [psutil.Process(root)]
    procs += procs[0].children(recursive=True)
    rss = pss = 0.0
    for p in procs:
        try:
            info = p.memory_full_info()
        except psutil.Error:
            continue
        rss += info.rss
        pss += getattr(info, "pss", info.rss)
    return rss / 2**20, pss / 2**20, len(procs)


def measure(
    launcher_cmd: list[str], env: dict[str, str], work: Path, nproc: int
) -> dict[str, float]:
    marker = new_marker()
    proc = subprocess.Popen(
        launcher_cmd, env=tagged_env(marker, env), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        ready = wait_until(lambda: len(list(work.glob("[0-9]*"))) >= nproc, 120)
        if not ready:
            raise RuntimeError("workers did not start in 120 s")
        time.sleep(1.0)  # let import-time allocations settle
        rss, pss, count = _tree_memory(proc.pid)
    finally:
        (work / "stop").touch()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        kill_marked(marker)
    return {"rss_mb": rss, "pss_mb": pss, "processes": count}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument(
        "--output", default=str(Path(__file__).parent / "results" / "job_memory.md")
    )
    args = parser.parse_args(argv)
    launchers = [
        (elastrun(), {}),
        (elastrun_no_template(), {}),
        (torchrun(), {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
    ]
    samples: dict[str, list[dict[str, float]]] = {la.name: [] for la, _ in launchers}
    for _ in range(args.reps):
        for launcher, env in launchers:
            with tempfile.TemporaryDirectory(prefix="elastrun-mem-") as tmp:
                work = Path(tmp)
                script = work / "worker.py"
                script.write_text(WORKER)
                out = work / "out"
                out.mkdir()
                cmd = launcher.command(args.nproc, script, [str(out)])
                samples[launcher.name].append(measure(cmd, env, out, args.nproc))
    lines = [
        "# Total memory of a job: the launcher and all its processes",
        "",
        f"{args.nproc} workers that import torch and join a gloo group, then idle; medians of "
        f"{args.reps} alternating runs on {os.cpu_count()} CPUs, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "PSS divides shared pages among the processes that share them: it shows the "
        "copy-on-write sharing of workers forked from the pre-imported template.",
        "",
        "| launcher | total RSS (MB) | total PSS (MB) | processes |",
        "|---|---|---|---|",
    ]
    for name, runs in samples.items():
        rss = statistics.median(r["rss_mb"] for r in runs)
        pss = statistics.median(r["pss_mb"] for r in runs)
        count = statistics.median(r["processes"] for r in runs)
        lines.append(f"| {name} | {rss:.0f} | {pss:.0f} | {count:.0f} |")
    text = "\n".join(lines) + "\n"
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

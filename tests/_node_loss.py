"""A node lost in a memory-checkpoint job: its node directory found in ``/dev/shm``, its
agent SIGKILLed with its workers once its ranks agreed on a step, and the agents ended."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from _helpers import finish, wait_for


def end_all(procs: list[subprocess.Popen[str]], timeout: float = 180) -> list[Any]:
    """Each agent's result once it ends (within ``timeout`` each); any still running
    then is killed."""
    try:
        return [finish(p, timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def node_dirs(run_id: str) -> list[str]:
    """The node directories of the run's memory checkpoints in this machine's memory."""
    return glob.glob(f"/dev/shm/elastrun-ckpt-{run_id}-*")


def _agreed(directory: str) -> int | None:
    """The newest step the node's ranks reported agreed on (None: none yet)."""
    steps = []
    for path in glob.glob(os.path.join(directory, "report-rank-*.json")):
        try:
            newest = json.loads(Path(path).read_text())["newest"]
        except (OSError, ValueError, KeyError):
            continue
        if newest is not None:
            steps.append(newest)
    return max(steps) if steps else None


def _agent_of(directory: str, agents: dict[int, subprocess.Popen[str]]) -> int:
    """The pid of the agent whose node directory ``directory`` is: a worker's (from its
    report) ancestor."""
    for path in glob.glob(os.path.join(directory, "report-rank-*.json")):
        pid = int(json.loads(Path(path).read_text())["pid"])
        while pid > 1:
            if pid in agents:
                return pid
            status = Path(f"/proc/{pid}/status").read_text()
            pid = int(next(ln for ln in status.splitlines() if ln.startswith("PPid:")).split()[1])
    raise AssertionError(f"no agent of {directory}")


def kill_a_node(
    run_id: str, agents: list[subprocess.Popen[str]], after: int
) -> tuple[int, float, int]:
    """Once the ranks agreed on step ``after``, SIGKILL the agent of the node that holds
    rank 3 (its workers die with it): its pid, the time, and the newest step agreed
    just before."""

    def rank3_dir() -> str | None:
        found = [d for d in node_dirs(run_id) if os.path.exists(f"{d}/report-rank-3.json")]
        return found[0] if found else None

    def trained() -> bool:
        where = rank3_dir()
        return where is not None and (_agreed(where) or -1) >= after

    wait_for(trained, 120, "training")
    where = rank3_dir()
    assert where is not None
    victim = _agent_of(where, {a.pid: a for a in agents})
    agreed = max(_agreed(d) or -1 for d in node_dirs(run_id))
    os.killpg(victim, signal.SIGKILL)
    return victim, time.time(), agreed

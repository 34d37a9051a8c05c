"""The node-killed scenario of ``bench_memory_checkpoint``: a whole node is lost (its
agent and its workers, SIGKILLed together) while a spare node waits.

Three agents of one worker each start through a standalone ``elastrun store`` on
loopback: the first two in the round form the job (a world of two ranks, as in the
other scenarios), the third waits as a spare (the job runs at its maximum of two
nodes). The job saves a memory checkpoint
every step, paced while a file ``pace`` exists in its output directory (so that the
spare is waiting before the kill, and the steps after it run at full speed). Once the
spare waits and every rank recorded step ``kill_after``, the benchmark SIGKILLs the
process group of rank 1's agent: its workers die with it (their parent-death signal),
and its node directory goes (the orphan guard). The spare takes its place, pulls rank 1's
piece of the newest complete step from the copy on the surviving node, and every rank
loads that step from its node's memory.

Measured from the kill: until every rank of the new world completed its first step
(``node_next_s``), and the steps done again (``node_lost``: the step after the last one
every rank had completed before the kill, less the step the new world resumed at).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from _common import BIN, Running, ScenarioFailure, new_marker, require_clean, tagged_env

__all__ = ["PACE_FILE", "node_killed"]

#: In the job's output directory: while it exists, each step is followed by a pause.
PACE_FILE = "pace"
#: The longest the spare, the kill's step and the end of the job are waited for (s).
_WAIT = 120.0


def node_killed(job: Sequence[str], out: Path, run_dir: Path, kill_after: int) -> dict[str, float]:
    """Run ``job`` (the script and its arguments) on two nodes and a spare, kill rank
    1's node once every rank recorded ``kill_after`` (see the module); the figures.

    Raises:
        ScenarioFailure: the job did not get there, or did not end cleanly.
    """
    env = {"OMP_NUM_THREADS": "1"}
    (out / PACE_FILE).write_text("")
    with _store(run_dir) as (endpoint, token):
        args = [str(BIN / "elastrun"), "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                "--rdzv-id", f"bench-node-{new_marker()}"[:40],
                "--rdzv-conf", f"is_host=false,token_file={token},last_call_timeout=1",
                "--local-addr", "127.0.0.1", "--max-restarts", "1", *job]  # fmt: skip
        # (a marker each: finishing one agent kills what carries its marker, only its own)
        agents: list[Running] = []
        try:
            # Three at once: the first two in the round form the job, the third waits.
            for name in ("node0", "node1", "node2"):
                agents.append(Running(args, marker=new_marker(), log_dir=run_dir / name,
                                      env_extra=env, name=name))  # fmt: skip
            errs = [run_dir / name / "launcher.stderr" for name in ("node0", "node1", "node2")]
            _until(lambda: any("a spare" in e.read_text() for e in errs), "the spare to wait")
            _until(lambda: (_newest_everywhere(out) or -1) >= kill_after, "the kill's step")
            victim = _agent_of(_pid_of_rank(out, 1), [a.pid for a in agents])
            killed_at = time.time()
            os.killpg(victim, signal.SIGKILL)
            (out / PACE_FILE).unlink()
            for agent in agents:
                if agent.pid != victim:
                    require_clean(agent.finish(600))
        finally:
            for agent in agents:
                agent.finish(10)  # (the victim's, and any left by a failure: killed)
    return _figures(_records(out), killed_at)


@contextlib.contextmanager
def _store(run_dir: Path) -> Iterator[tuple[str, Path]]:
    """A standalone ``elastrun store`` on a free loopback port: its endpoint and token
    file; stopped on exit."""
    token = run_dir / "token"
    token.write_text("bench\n")
    proc = subprocess.Popen(
        [str(BIN / "elastrun"), "store", "--host", "127.0.0.1", "--port", "0",
         "--token-file", str(token)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env=tagged_env(new_marker()), start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if "serving on" not in line:
            raise ScenarioFailure(f"the store did not start: {line!r}")
        yield line.rsplit(" ", 1)[1].strip(), token
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


def _until(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + _WAIT
    while True:
        with contextlib.suppress(OSError, ValueError):
            if predicate():
                return
        if time.monotonic() > deadline:
            raise ScenarioFailure(f"no {what} within {_WAIT:.0f} s")
        time.sleep(0.01)


def _records(out: Path) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = []
    for path in out.glob("steps_*.log"):
        lines += [json.loads(ln) for ln in path.read_text().splitlines() if ln]
    return lines


def _newest_everywhere(out: Path) -> int | None:
    """The newest step that every rank (of two) recorded (None: not every rank did)."""
    newest: dict[int, int] = {}
    for ln in _records(out):
        if "step" in ln:
            newest[ln["rank"]] = max(newest.get(ln["rank"], -1), ln["step"])
    return min(newest.values()) if len(newest) == 2 else None


def _pid_of_rank(out: Path, rank: int) -> int:
    loads = [ln for ln in _records(out) if ln["rank"] == rank and "pid" in ln]
    if not loads:
        raise ScenarioFailure(f"rank {rank} never said its pid")
    return int(max(loads, key=lambda ln: ln["loaded_at"])["pid"])


def _agent_of(pid: int, agents: list[int]) -> int:
    """The agent among ``agents`` that ``pid`` descends from."""
    while pid > 1:
        if pid in agents:
            return pid
        status = Path(f"/proc/{pid}/status").read_text()
        pid = int(next(ln for ln in status.splitlines() if ln.startswith("PPid:")).split()[1])
    raise ScenarioFailure("rank 1's worker descends from none of the agents")


def _figures(lines: list[dict[str, Any]], killed_at: float) -> dict[str, float]:
    """From the kill: every rank of the new world completed its first step; the steps
    done again (see the module)."""
    loaded = {ln["rank"]: ln["loaded_at"] for ln in lines if ln.get("loaded_at", 0) > killed_at}
    if sorted(loaded) != [0, 1]:
        raise ScenarioFailure(f"ranks that loaded after the node was killed: {sorted(loaded)}")
    after = [ln for ln in lines if "step" in ln and ln["at"] > loaded[ln["rank"]]]
    before = [ln for ln in lines if "step" in ln and ln["at"] <= killed_at]
    first = {r: min(ln["at"] for ln in after if ln["rank"] == r) for r in loaded}
    done = min(max(ln["step"] for ln in before if ln["rank"] == r) for r in loaded)
    return {
        "node_next_s": max(first.values()) - killed_at,
        "node_lost": float(done + 1 - min(ln["step"] for ln in after)),
    }

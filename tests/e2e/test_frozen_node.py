"""A frozen node (its agent stopped with SIGSTOP) is dropped; thawed, it stops its workers.

The others notice the lease of the frozen agent end and re-form without it within the
TTL; after SIGCONT the agent finds it was dropped and stops the workers it left running
(they would train beside the re-formed group otherwise), then rejoins as a new node.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from _helpers import elastrun_store, finish, freeze, pid_alive, start_nodes, wait_for, write_script

pytestmark = pytest.mark.slow

# Workers started before the test thaws the frozen node run long (a loaded machine must
# not end them before the test looks); those started after run briefly, so the run ends.
WORKER = """
import os, sys, time
name = f"w_{os.environ['GROUP_RANK']}_{os.environ['WORLD_SIZE']}_{os.getpid()}"
thawed = os.path.exists(os.path.join(sys.argv[1], "thawed"))
open(os.path.join(sys.argv[1], name), "w").close()
time.sleep(3 if thawed else 60)
"""


def _files(d: Path, world: int) -> list[Path]:
    return sorted(d.glob(f"w_*_{world}_*"))


def test_a_frozen_node_is_dropped_and_stops_its_workers_when_thawed(tmp_path: Path) -> None:
    agents: list[subprocess.Popen[str]] = []
    with elastrun_store(tmp_path) as (endpoint, token):
        try:
            _run_frozen(tmp_path, endpoint, token, agents)
        finally:
            for a in agents:
                if a.poll() is None:
                    a.send_signal(signal.SIGCONT)
                    a.kill()
                    a.communicate()


def _run_frozen(
    tmp_path: Path, endpoint: str, token: Path, agents: list[subprocess.Popen[str]]
) -> None:
    script = write_script(tmp_path / "w.py", WORKER)
    conf = f"is_host=false,token_file={token},heartbeat_timeout=3,last_call_timeout=1"
    args = ["--no-template", "--rdzv-conf", conf, str(script), str(tmp_path)]
    agents.extend(start_nodes(2, "1:2", endpoint, "frozen", args, cwd=tmp_path))
    wait_for(lambda: len(_files(tmp_path, 2)) == 2, 30, "a world of 2")
    frozen = agents[1]
    (frozen_file,) = (p for p in _files(tmp_path, 2) if p.name.startswith("w_1"))
    frozen_worker = int(frozen_file.name.rsplit("_", 1)[1])
    alone_before = set(_files(tmp_path, 1))  # node 0 may have started alone, before node 1
    freeze(frozen.pid)
    t0 = time.monotonic()
    wait_for(lambda: set(_files(tmp_path, 1)) - alone_before, 15, "the survivor alone")
    assert time.monotonic() - t0 < 3 + 4  # the TTL, plus detection and restart
    assert pid_alive(frozen_worker)  # frozen agent: its worker still runs
    (tmp_path / "thawed").touch()
    frozen.send_signal(signal.SIGCONT)
    wait_for(lambda: not pid_alive(frozen_worker), 10, "the thawed node to stop its worker")
    results = [finish(a, 60) for a in agents]
    for r in results:
        assert r.returncode == 0, "\n=====\n".join(x.stderr for x in results)
    assert "lease expired" in results[1].stderr

"""Nothing left in /dev/shm when an agent is killed: its orphan guard removes the node
directory; and when the guard is killed too (a sweep that ends every process of a
container or of a test's namespace), the next agent on the node removes it.

The first test lists the node directories of its own run id in /dev/shm before and
after (other jobs may use the same /dev/shm meanwhile). The second gives its agents a
/dev/shm of their own (a directory bound there in a mount namespace the test makes):
in the shared one, any agent that another test starts meanwhile removes the directory
left behind first, as it should, and this test's agent would find nothing to remove.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from _helpers import ELASTRUN, finish, free_port, pid_alive, start, wait_for, write_script

# The worker says where its node directory is and who it is, then waits to be killed.
WORKER = """
import os, sys, time
with open(sys.argv[1] + ".tmp", "w") as fh:
    fh.write(f"{os.environ['ELASTRUN_CHECKPOINT_DIR']} {os.getpid()}")
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(120)
"""


def _node_dirs(run_id: str, shm: str = "/dev/shm") -> set[str]:
    return set(glob.glob(f"{shm}/elastrun-ckpt-{run_id}-*"))


def _start(args: Sequence[str], *, cwd: Path, shm: Path | None) -> subprocess.Popen[str]:
    """``elastrun ARGS``, with ``shm`` bound on /dev/shm for it and its children alone
    (None: the node's own /dev/shm). The process is elastrun's itself (each wrapper
    execs the next), so its pid is the agent's."""
    if shm is None:
        return start(args, cwd=cwd)
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs unshare(1) (util-linux) for a /dev/shm of the test's own")
    prefix = [unshare, "--mount", "--propagation", "private"]
    if os.geteuid() != 0:
        prefix[1:1] = ["--user", "--map-root-user"]  # (root in a user namespace may bind)
    script = 'mount --bind "$1" /dev/shm && shift && exec "$@"'
    return subprocess.Popen(
        [*prefix, "--", "sh", "-c", script, "sh", str(shm), *ELASTRUN, *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _agent(
    tmp_path: Path, run_id: str, shm: Path | None = None
) -> tuple[subprocess.Popen[str], str, int]:
    """An agent of one worker, the agent hosting its run's store: the agent, its node
    directory (as the agent names it: in /dev/shm) and its worker's pid, once the
    worker runs."""
    script = write_script(tmp_path / "worker.py", WORKER)
    said = tmp_path / f"{run_id}.said"
    agent = _start(
        ["--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", run_id,
         str(script), str(said)],
        cwd=tmp_path, shm=shm,
    )  # fmt: skip
    wait_for(said.exists, 60, "the worker")
    directory, worker = said.read_text().split()
    return agent, directory, int(worker)


def _guard_of(agent: int) -> int:
    """The pid of ``agent``'s orphan guard (its child running the guard's module)."""
    for name in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if int(stat[1]) == agent and b"elastrun.supervise.processes.guard" in cmdline:
            return int(name)
    raise AssertionError(f"agent {agent} has no orphan guard")


def _kill(pid: int, *, group: bool = False) -> None:
    try:
        os.killpg(pid, signal.SIGKILL) if group else os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_a_killed_agents_node_directory_is_removed_by_its_orphan_guard(tmp_path: Path) -> None:
    run_id = f"leftover-guard-{os.getpid()}"
    before = _node_dirs(run_id)
    agent, directory, worker = _agent(tmp_path, run_id)
    assert _node_dirs(run_id) - before == {directory}
    _kill(agent.pid)  # the agent alone: its guard and its worker's group live on
    agent.communicate()
    wait_for(lambda: not os.path.exists(directory), 20, "the guard to remove the directory")
    wait_for(lambda: not pid_alive(worker), 20, "the worker to end")
    assert _node_dirs(run_id) == before


def test_a_node_directory_left_by_an_agent_killed_with_its_guard_goes_with_the_next_agent(
    tmp_path: Path,
) -> None:
    run_id = f"leftover-swept-{os.getpid()}"
    shm = tmp_path / "shm"
    shm.mkdir()
    agent, directory, worker = _agent(tmp_path, run_id, shm)
    assert directory.startswith("/dev/shm/")
    seen = shm / os.path.basename(directory)  # (where the test sees it)
    # Everything killed at once, as a sweep does: the guard first, so it cannot clean.
    _kill(_guard_of(agent.pid))
    _kill(agent.pid, group=True)
    _kill(worker, group=True)  # (its own session)
    agent.communicate()
    wait_for(lambda: not pid_alive(worker), 20, "the worker to end")
    assert _node_dirs(run_id, str(shm)) == {str(seen)}  # nobody left to remove it
    # The next agent on the node (any job) removes it before it makes its own.
    script = write_script(tmp_path / "quick.py", "print('done')\n")
    quick = ["--standalone", "--nproc-per-node", "1", str(script)]
    res = finish(_start(quick, cwd=tmp_path, shm=shm))
    assert res.returncode == 0, res.stderr
    assert f"removed {directory}, left behind by an agent that died" in res.stderr
    assert not seen.exists()
    assert os.listdir(shm) == []  # (and its own, removed as it ended)

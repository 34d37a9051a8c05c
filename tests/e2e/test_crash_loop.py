"""Crash loops as a user meets them: a script that fails the same way every time stops
after two attempts with the do-not-requeue status; one whose failure changes gets all of
its restarts. The scripts import nothing heavy (no torch): each attempt costs little."""

from __future__ import annotations

from pathlib import Path

from _helpers import finish, free_port, run, start_nodes, write_script

SCRIPT = """
import os, sys
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
open(os.path.join(sys.argv[1], "attempt_" + restart), "w").close()
message = "bad learning rate" if sys.argv[2] == "same" else "bad shard " + restart
raise ValueError(message)
"""


def _attempts(directory: Path) -> int:
    return len(list(directory.glob("attempt_*")))


def test_the_same_failure_twice_stops_the_job_with_do_not_requeue(tmp_path: Path) -> None:
    script = write_script(tmp_path / "crash.py", SCRIPT)
    same, varying = tmp_path / "same", tmp_path / "varying"
    same.mkdir()
    varying.mkdir()

    res = run(["--max-restarts", "5", str(script), str(same), "same"], cwd=tmp_path)
    assert res.returncode == 93, res.stderr
    assert _attempts(same) == 2  # the budget allowed six
    assert "the failure looks deterministic: rank 0 failed with ValueError: bad learning rate" in (
        res.stderr
    )
    assert "1 of 5 restart(s) used; --no-crash-loop-stop restarts anyway" in res.stderr
    assert "raise ValueError(message)" in res.stderr  # the repeated error, with its traceback

    res = run(["--max-restarts", "2", str(script), str(varying), "varying"], cwd=tmp_path)
    assert res.returncode == 1, res.stderr
    assert _attempts(varying) == 3  # another message each time: every restart is spent
    assert "restart budget exhausted: 2 of 2" in res.stderr and "deterministic" not in res.stderr


ONE_NODE_CRASHES = """
import os, sys, time
open(os.path.join(sys.argv[1], "attempt_" + os.environ["TORCHELASTIC_RESTART_COUNT"]), "w").close()
if os.environ["RANK"] == "1":
    raise ValueError("bad shard")
time.sleep(60)  # stopped when the other node's worker fails
"""


def test_a_crash_loop_on_one_node_ends_the_job_on_every_node(tmp_path: Path) -> None:
    script = write_script(tmp_path / "crash.py", ONE_NODE_CRASHES)
    endpoint = f"127.0.0.1:{free_port()}"
    args = ["--max-restarts", "5", "--no-template", str(script), str(tmp_path)]
    procs = start_nodes(2, "2", endpoint, "crashloop", args, cwd=tmp_path)
    results = [finish(p, 90) for p in procs]
    codes = sorted(r.returncode for r in results)
    err = "".join(r.stderr for r in results)
    # The node of rank 1 decides (93, with the report); the other stops at once and
    # names it (1) instead of re-forming without it.
    assert codes == [1, 93], err[-4000:]
    assert "the failure looks deterministic: rank 1 failed with ValueError: bad shard" in err
    assert "has ended (crash loop: rank 1 failed with ValueError: bad shard" in err
    assert _attempts(tmp_path) == 2

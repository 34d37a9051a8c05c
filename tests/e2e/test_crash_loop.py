"""Crash loops as a user meets them: a script that fails the same way every time stops
after two attempts with the do-not-requeue status; one whose failure changes gets all of
its restarts. The scripts import nothing heavy (no torch): each attempt costs little."""

from __future__ import annotations

from pathlib import Path

from _helpers import run, write_script

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

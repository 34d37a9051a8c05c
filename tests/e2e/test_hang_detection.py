"""What does not exit is found: a hung rank is named, its stacks kept, the job restarted.

The progress comes from torch's optimizer steps (no code change in the script) or from
``elastrun.progress()``; a rank that never reports is never called hung.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from _helpers import REPO, finish, free_port, read_json_lines, run, start_nodes, write_script

pytestmark = pytest.mark.slow

DEMO = REPO / "examples" / "ddp_demo.py"


@pytest.mark.torch
def test_a_rank_hung_in_ddp_is_found_its_stacks_kept_and_the_job_restarts(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    result_file = tmp_path / "result.json"
    t0 = time.monotonic()
    res = run(
        ["--nproc-per-node", "2", "--hang-timeout", "5", "--max-restarts", "1",
         "--log-dir", str(logs), str(DEMO), "--steps", "30", "--checkpoint-every", "5",
         "--step-time", "0.05", "--crash-at-step", "12", "--crash-rank", "1",
         "--crash-mode", "hang", "--checkpoint-dir", str(tmp_path / "ckpt"),
         "--result-file", str(result_file)],
        cwd=tmp_path,
        timeout=120,
    )  # fmt: skip
    took = time.monotonic() - t0
    assert res.returncode == 0, res.stderr
    hung_lines = [line for line in res.stderr.splitlines() if "is hung" in line]
    assert hung_lines, res.stderr
    assert any("rank 1 (local rank 1" in line for line in hung_lines), hung_lines
    assert "after step 12" in res.stderr or "after step 11" in res.stderr
    # The evidence: rank 1's stacks show the script's line where it hangs.
    stacks = next(logs.glob("*/attempt_0/1/stacks.txt")).read_text()
    assert "hang_forever" in stacks and "ddp_demo.py" in stacks
    result = json.loads(result_file.read_text())
    assert result["identical"] is True and result["restart_count"] == 1
    assert took < 90


def test_no_false_verdicts(tmp_path: Path) -> None:
    script = write_script(
        tmp_path / "slow.py",
        """
        import os, time
        import elastrun
        if os.environ["RANK"] == "0":
            time.sleep(4)          # never reports: never called hung
        else:
            for step in range(4):  # steady steps slower than a second, under a 3 s timeout
                time.sleep(1.2)
                elastrun.progress(step)
        """,
    )
    res = run(["--nproc-per-node", "2", "--hang-timeout", "3", str(script)], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "hung" not in res.stderr


def test_a_hang_with_explicit_progress_and_no_torch(tmp_path: Path) -> None:
    script = write_script(
        tmp_path / "loop.py",
        """
        import os, sys, time
        import elastrun
        for step in range(100):
            if step == 5 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
                while True:
                    time.sleep(1)  # the data loader stopped
            elastrun.progress(step)
            time.sleep(0.05)
        """,
    )
    events = tmp_path / "events.jsonl"
    t0 = time.monotonic()
    res = run(
        ["--nproc-per-node", "1", "--hang-timeout", "2", "--max-restarts", "1",
         "--event-log-handler", f"file:{events}", str(script)],
        cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "is hung: no progress for" in res.stderr
    assert "after step 4" in res.stderr
    assert time.monotonic() - t0 < 20
    # The verdict is an event, written before the failure and the restart it caused.
    names = [e["name"] for e in read_json_lines(events)]
    assert names.count("agent.hang") == 1
    assert (
        names.index("agent.hang")
        < names.index("agent.worker_failed")
        < names.index("agent.restart")
    )
    hang = next(e for e in read_json_lines(events) if e["name"] == "agent.hang")
    assert isinstance(hang["metadata"], dict) and hang["metadata"]["stopped_first"] == "rank 0"


def test_restarts_that_make_no_progress_end_with_do_not_requeue(tmp_path: Path) -> None:
    script = write_script(
        tmp_path / "same_crash.py",
        """
        import os, sys, time
        import elastrun
        open("attempt_" + os.environ["TORCHELASTIC_RESTART_COUNT"], "w").close()
        for step in range(5):
            elastrun.progress(step)
            time.sleep(0.01)
        sys.exit(7)  # the same crash at the same step, every time
        """,
    )
    # (The crash-loop stop would end it after two attempts: the guard under test here is
    # the one for restarts that make no progress.)
    args = ["--nproc-per-node", "1", "--max-restarts", "10", "--no-crash-loop-stop"]
    res = run([*args, str(script)], cwd=tmp_path)
    assert res.returncode == 93, res.stderr
    assert "restarts made no progress" in res.stderr
    # The first attempt made progress; three restarts in a row did not.
    assert sorted(p.name for p in tmp_path.glob("attempt_*")) == [f"attempt_{i}" for i in range(4)]
    silent = write_script(
        tmp_path / "silent_crash.py", "import sys, time\ntime.sleep(0.05)\nsys.exit(7)\n"
    )
    res = run(["--nproc-per-node", "1", "--max-restarts", "4", str(silent)], cwd=tmp_path)
    assert res.returncode == 1, res.stderr  # no reports: only the budget stops it
    assert "restart budget exhausted: 4 of 4" in res.stderr


@pytest.mark.parametrize("hung", ["1", "both"])
def test_a_hang_on_two_nodes_restarts_each_node_once(tmp_path: Path, hung: str) -> None:
    script = write_script(
        tmp_path / "loop.py",
        f"""
        import os, sys, time
        import elastrun
        rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
        open(f"ran_{{rank}}_{{attempt}}", "w").close()
        for step in range(40):
            if step == 5 and attempt == "0" and (rank == "{hung}" or "{hung}" == "both"):
                while True:
                    time.sleep(1)  # a collective that never returns
            elastrun.progress(step)
            time.sleep(0.05)
        """,
    )
    endpoint = f"127.0.0.1:{free_port()}"
    args = ["--hang-timeout", "2", "--max-restarts", "1", "--no-template", str(script)]
    procs = start_nodes(2, "2", endpoint, "hang2", args, cwd=tmp_path)
    results = [finish(p, 90) for p in procs]
    for r in results:
        assert r.returncode == 0, "\n=====\n".join(x.stderr for x in results)
    # One restart for the job: every rank ran in attempts 0 and 1, and no attempt 2.
    assert sorted(p.name for p in tmp_path.glob("ran_*")) == [
        "ran_0_0", "ran_0_1", "ran_1_0", "ran_1_1",
    ]  # fmt: skip
    assert any("is hung" in r.stderr for r in results)

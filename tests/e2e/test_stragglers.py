"""Stragglers: a rank (or a node) whose steps stay slower than its peers' is reported --
a warning, an event, a metric -- and never stopped; workers of equal speed are not.

The workers report with ``elastrun.progress()`` (no torch) and pace their steps with
sleeps. ``--straggler-window 1`` makes the three windows before a report last 3 s.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import pytest

from _helpers import (
    finish,
    free_port,
    read_json_lines,
    run,
    start,
    start_nodes,
    wait_for,
    write_script,
)

pytestmark = pytest.mark.slow

# Each worker steps for argv[2] seconds; the ranks listed in argv[1] step 3x slower.
PACED = """
import os, sys, time
import elastrun
slow = os.environ["RANK"] in sys.argv[1].split(",")
step_time = 0.3 if slow else 0.1
t0 = time.monotonic()
step = 0
while time.monotonic() - t0 < float(sys.argv[2]):
    time.sleep(step_time)
    step += 1
    elastrun.progress(step)
"""


def scrape(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return str(resp.read().decode())
    except (urllib.error.URLError, OSError):
        return ""


def test_a_rank_three_times_slower_is_reported_in_stderr_the_event_log_and_metrics(
    tmp_path: Path,
) -> None:
    script = write_script(tmp_path / "paced.py", PACED)
    events = tmp_path / "events.jsonl"
    port = free_port()
    proc = start(
        ["--nproc-per-node", "3", "--straggler-window", "1", "--metrics-port", str(port),
         "--event-log-handler", f"file:{events}", str(script), "1", "8"],
        cwd=tmp_path,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/metrics"
    gauge = 'elastrun_worker_straggler{local_rank="1",rank="1"} 1.0'
    seen: list[str] = []

    def straggler_shown() -> bool:
        seen.append(scrape(url))
        return gauge in seen[-1] or proc.poll() is not None

    try:
        wait_for(straggler_shown, 60, "the straggler gauge of rank 1, or the end")
    finally:
        res = finish(proc, 60)
    text = seen[-1]
    assert gauge in text, res.stderr
    assert res.returncode == 0, res.stderr
    # Every rank's steps are counted and timed; only rank 1 is a straggler.
    for rank in range(3):
        assert f'elastrun_worker_steps_total{{local_rank="{rank}",rank="{rank}"}}' in text
        assert f'elastrun_worker_step_seconds_count{{local_rank="{rank}",rank="{rank}"}}' in text
    assert 'elastrun_worker_straggler{local_rank="0",rank="0"}' not in text
    assert "elastrun_straggler_reports_total 1.0" in text
    warned = [line for line in res.stderr.splitlines() if "is a straggler" in line]
    assert len(warned) == 1, res.stderr
    assert "rank 1 (local rank 1) is a straggler" in warned[0] and "median" in warned[0]
    found = [e for e in read_json_lines(events) if e["name"] == "agent.straggler"]
    assert len(found) == 1
    meta = found[0]["metadata"]
    assert isinstance(meta, dict)
    assert meta["rank"] == 1 and meta["scope"] == "rank" and 2.0 < meta["ratio"] < 4.0


def test_workers_of_equal_speed_are_not_reported(tmp_path: Path) -> None:
    script = write_script(tmp_path / "paced.py", PACED)
    events = tmp_path / "events.jsonl"
    res = run(
        ["--nproc-per-node", "4", "--straggler-window", "1",
         "--event-log-handler", f"file:{events}", str(script), "none", "6"],
        cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "straggler" not in res.stderr
    assert not [e for e in read_json_lines(events) if "straggler" in str(e["name"])]


def test_a_slow_node_is_reported_by_the_agent_of_group_rank_0(tmp_path: Path) -> None:
    script = write_script(tmp_path / "paced.py", PACED)
    endpoint = f"127.0.0.1:{free_port()}"
    args = ["--straggler-window", "1", "--no-template", str(script), "1", "8"]
    procs = start_nodes(2, "2", endpoint, "pace2", args, cwd=tmp_path)
    results = [finish(p, 90) for p in procs]
    for r in results:
        assert r.returncode == 0, "\n=====\n".join(x.stderr for x in results)
    # Alone on its node, each rank has no peer there: only the job-wide view sees it.
    reports = [line for r in results for line in r.stderr.splitlines() if "is a straggler" in line]
    assert len(reports) == 1, reports
    assert "node of group rank" in reports[0] and "(its slowest: rank 1)" in reports[0]

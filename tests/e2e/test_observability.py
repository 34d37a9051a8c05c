"""Timers, events, metrics, health check and NUMA binding through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from _helpers import finish, free_port, run, start, wait_for, write_script

TIMED = """
import os, sys, time
from elastrun.timer import FileTimerClient, configure, expires
configure(FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
rank, restart = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
open(os.path.join(sys.argv[1], f"start_{restart}_{rank}"), "w").close()
if rank == "1" and restart == "0":
    with expires(after=0.5, scope="slow-step"):
        time.sleep(60)  # hangs: the timer must end this worker only
time.sleep(1)
"""


def test_an_expired_timer_kills_only_its_worker_and_counts_as_a_failure(tmp_path: Path) -> None:
    script = write_script(tmp_path / "timed.py", TIMED)
    result = run(
        ["--nproc-per-node", "2", "--max-restarts", "1", str(script), str(tmp_path)],
        cwd=tmp_path,
        env={"TORCHELASTIC_ENABLE_FILE_TIMER": "1"},
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "expiration timer expired (scope slow-step)" in result.stderr
    assert "restarting all workers (restart 1 of 1)" in result.stderr
    assert (tmp_path / "start_1_0").exists() and (tmp_path / "start_1_1").exists()


def test_an_expired_timer_with_no_budget_is_named_in_the_report(tmp_path: Path) -> None:
    script = write_script(tmp_path / "timed.py", TIMED)
    result = run(
        ["--nproc-per-node", "2", str(script), str(tmp_path)],
        cwd=tmp_path,
        env={"TORCHELASTIC_ENABLE_FILE_TIMER": "1"},
        timeout=60,
    )
    assert result.returncode == 1
    root = result.stderr[result.stderr.index("Root cause") :]
    assert "its expiration timer expired (scope slow-step)" in root
    assert "SIGKILL" in root


def test_event_file_and_timeline(tmp_path: Path) -> None:
    script = write_script(
        tmp_path / "flaky.py",
        """
        import os, sys
        if os.environ["RANK"] == "0" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            sys.exit(4)
        """,
    )
    events = tmp_path / "events.jsonl"
    result = run(
        ["--nproc-per-node", "2", "--max-restarts", "1", "--event-log-handler", f"file:{events}",
         str(script)],
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = [json.loads(x) for x in events.read_text().splitlines()]
    names = [e["name"] for e in lines]
    assert names.count("agent.workers_started") == 2
    assert "agent.restart" in names and "agent.succeeded" in names
    assert all(e["timestamp"] > 1_600_000_000_000 for e in lines)  # real ms timestamps
    assert all({"name", "source", "timestamp", "metadata"} <= set(e) for e in lines)
    restart = next(e for e in lines if e["name"] == "agent.restart")
    assert restart["metadata"]["exitcode"] == 4 and restart["metadata"]["run_id"]
    # The recovered failure is an event of its own, before the restart it caused.
    failed = [e for e in lines if e["name"] == "agent.worker_failed"]
    assert [f["metadata"]["rank"] for f in failed if not f["metadata"]["by_agent"]] == [0]
    first = next(f for f in failed if f["metadata"]["rank"] == 0)
    assert first["metadata"]["exitcode"] == 4 and first["metadata"]["restart"] is True
    assert first["metadata"]["attempt"] == 0 and first["metadata"]["local_rank"] == 0
    assert names.index("agent.worker_failed") < names.index("agent.restart")
    html = tmp_path / "timeline.html"
    shown = subprocess.run(
        [sys.executable, "-m", "elastrun", "timeline", str(events), "--html", str(html)],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "restart" in shown.stdout
    assert "agent.worker_failed" in shown.stdout
    assert "<svg" in html.read_text()


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_metrics_endpoint_and_health_check_while_running(tmp_path: Path) -> None:
    script = write_script(
        tmp_path / "wait.py",
        """
        import os, sys, time
        if os.environ["RANK"] == "0" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            sys.exit(3)
        import elastrun
        elastrun.progress(7 + int(os.environ["RANK"]))
        while not os.path.exists(sys.argv[1]):
            time.sleep(0.05)
        """,
    )
    stop = tmp_path / "stop"
    mport, hport = free_port(), free_port()
    proc = start(
        [
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--metrics-port",
            str(mport),
            str(script),
            str(stop),
        ],
        cwd=tmp_path,
        env={"TORCHELASTIC_HEALTH_CHECK_PORT": str(hport)},
    )
    try:
        wait_for(lambda: "elastrun_world_size" in _get_or_empty(f"http://127.0.0.1:{mport}/metrics"),
                 30, "metrics")  # fmt: skip
        status, body = _get(f"http://127.0.0.1:{mport}/metrics")
        assert status == 200 and "elastrun_workers_start_duration_seconds" in body
        wait_for(lambda: "elastrun_restart_duration_seconds_count 1.0" in _get_or_empty(
            f"http://127.0.0.1:{mport}/metrics"), 30, "the restart")  # fmt: skip
        body = _get(f"http://127.0.0.1:{mport}/metrics")[1]
        assert 'elastrun_worker_group_state{state="HEALTHY"} 1.0' in body
        assert "elastrun_restarts_total 1.0" in body
        assert 'elastrun_worker_group_state{state="STOPPED"} 0.0' in body
        assert "elastrun_membership_changes_total 0.0" in body
        wait_for(lambda: '"HEALTHY"' in _get_or_empty(f"http://127.0.0.1:{hport}/health"), 30,
                 "a healthy group")  # fmt: skip
        status, body = _get(f"http://127.0.0.1:{hport}/health")
        health = json.loads(body)
        assert status == 200 and health["healthy"] is True
        assert health["state"] == "HEALTHY" and len(health["workers"]) == 2
        assert health["phase"] == "running"

        # Each local rank's last reported step, and how long ago it came.
        def _progress() -> dict[str, dict[str, float]]:
            body = _get_or_empty(f"http://127.0.0.1:{hport}/health")
            return json.loads(body).get("progress", {}) if body else {}

        wait_for(lambda: len(_progress()) == 2, 20, "progress in the health document")
        progress = _progress()
        assert {lr: p["step"] for lr, p in progress.items()} == {"0": 7, "1": 8}
        assert all(0 <= p["age_s"] < 60 for p in progress.values())
    finally:
        stop.touch()
        result = finish(proc, 30)
    assert result.returncode == 0, result.stderr


def _get_or_empty(url: str) -> str:
    try:
        return _get(url)[1]
    except OSError:
        return ""


def test_numa_exclusive_binding_gives_each_worker_its_own_cpus(tmp_path: Path) -> None:
    script = write_script(
        tmp_path / "aff.py",
        "import os, sys\nopen(os.path.join(sys.argv[1], os.environ['LOCAL_RANK']), 'w')"
        ".write(','.join(map(str, sorted(os.sched_getaffinity(0)))))\n",
    )
    ncpu = len(os.sched_getaffinity(0))
    result = run(
        ["--nproc-per-node", str(ncpu), "--numa-binding", "exclusive", str(script), str(tmp_path)],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    sets = [set((tmp_path / str(r)).read_text().split(",")) for r in range(ncpu)]
    assert all(len(s) >= 1 for s in sets)
    for i in range(ncpu):
        for j in range(i + 1, ncpu):
            assert not sets[i] & sets[j]


def test_stacks_command_shows_where_every_worker_is(tmp_path: Path) -> None:
    script = write_script(
        tmp_path / "hang.py",
        """
        import os, sys, time
        def waiting_for_godot():
            open(os.path.join(sys.argv[1], "up_" + os.environ["RANK"]), "w").close()
            while not os.path.exists(os.path.join(sys.argv[1], "stop")):
                time.sleep(0.05)
        waiting_for_godot()
        """,
    )
    logs = tmp_path / "logs"
    proc = start(["--nproc-per-node", "2", "--log-dir", str(logs), str(script), str(tmp_path)],
                 cwd=tmp_path)  # fmt: skip
    try:
        wait_for(lambda: (tmp_path / "up_0").exists() and (tmp_path / "up_1").exists(), 30, "up")
        shown = subprocess.run(
            [sys.executable, "-m", "elastrun", "stacks", str(logs)],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert shown.returncode == 0, shown.stdout + shown.stderr
        assert shown.stdout.count("waiting_for_godot") == 2
        assert "=== local rank 1" in shown.stdout
    finally:
        (tmp_path / "stop").touch()
        result = finish(proc, 30)
    assert result.returncode == 0, result.stderr

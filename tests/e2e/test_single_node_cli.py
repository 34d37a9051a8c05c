"""The ``elastrun`` command on one node, as a user runs it: real processes throughout."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from _helpers import finish, pid_alive, run, start, wait_for, write_script

ENV_DUMP = """
import json, os, sys
keys = [k for k in os.environ if k in {names}]
path = os.path.join(sys.argv[1], "env_" + os.environ["RANK"] + ".json")
with open(path, "w") as fh:
    json.dump({{"env": {{k: os.environ[k] for k in keys}}, "argv": sys.argv,
               "name": __name__, "file": __file__}}, fh)
"""
ELASTIC_VARS = [
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
]


def _env_script(tmp_path: Path) -> Path:
    return write_script(tmp_path / "envdump.py", ENV_DUMP.format(names=repr(set(ELASTIC_VARS))))


@pytest.mark.parametrize("nproc", [1, 4])
def test_workers_get_the_torchrun_environment(tmp_path: Path, nproc: int) -> None:
    script = _env_script(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.pop("OMP_NUM_THREADS", None)
    result = run(
        [
            "--nproc-per-node",
            str(nproc),
            "--max-restarts",
            "2",
            str(script),
            str(tmp_path),
            "--x=1",
        ],
        cwd=tmp_path,
        env={"OMP_NUM_THREADS": ""} if False else None,
    )
    assert result.returncode == 0, result.stderr
    dumps = [json.loads((tmp_path / f"env_{r}.json").read_text()) for r in range(nproc)]
    ports = {d["env"]["MASTER_PORT"] for d in dumps}
    run_ids = {d["env"]["TORCHELASTIC_RUN_ID"] for d in dumps}
    assert len(ports) == 1 and len(run_ids) == 1
    for rank, d in enumerate(dumps):
        e = d["env"]
        assert d["argv"] == [str(script), str(tmp_path), "--x=1"]
        assert d["name"] == "__main__" and d["file"] == str(script)
        assert e["RANK"] == e["LOCAL_RANK"] == e["ROLE_RANK"] == str(rank)
        assert e["GROUP_RANK"] == "0" and e["GROUP_WORLD_SIZE"] == "1"
        assert e["WORLD_SIZE"] == e["LOCAL_WORLD_SIZE"] == e["ROLE_WORLD_SIZE"] == str(nproc)
        assert e["ROLE_NAME"] == "default"
        assert e["MASTER_ADDR"] == "127.0.0.1" and int(e["MASTER_PORT"]) > 0
        assert e["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert e["TORCHELASTIC_MAX_RESTARTS"] == "2"
        # The agent serves the workers' store: it outlives rank 0.
        assert e["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert e["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        assert e["TORCHELASTIC_ERROR_FILE"].endswith(f"attempt_0/{rank}/error.json")
        if "OMP_NUM_THREADS" not in os.environ:
            assert e.get("OMP_NUM_THREADS") == ("1" if nproc > 1 else None)


FLAKY = """
import os, sys, signal, time
rank = int(os.environ["RANK"]); restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
with open(os.path.join(sys.argv[1], f"start_{restart}_{rank}"), "w") as fh:
    fh.write(str(os.getpid()))
mode = sys.argv[2]
if rank == 1 and restart < int(sys.argv[3]):
    if mode == "raise":
        raise ValueError(f"boom on attempt {restart}")
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(3)
time.sleep(float(sys.argv[4]) if len(sys.argv) > 4 else 0)
"""


@pytest.mark.parametrize("mode", ["raise", "kill", "exit"])
def test_a_failed_worker_restarts_the_group_until_it_succeeds(tmp_path: Path, mode: str) -> None:
    script = write_script(tmp_path / "flaky.py", FLAKY)
    result = run(
        [
            "--nproc-per-node",
            "3",
            "--max-restarts",
            "2",
            str(script),
            str(tmp_path),
            mode,
            "2",
            "0.3",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    started = {p.name for p in tmp_path.glob("start_*")}
    # Rank 1 ran in every attempt; survivors may be stopped before their first line.
    assert {f"start_{a}_1" for a in range(3)} <= started
    assert {f"start_2_{r}" for r in range(3)} <= started
    assert not any(name.startswith("start_3") for name in started)
    assert "restarting all workers (restart 1 of 2)" in result.stderr
    assert "restart 2 of 2" in result.stderr


def test_restarts_exhausted_exit_1_with_the_root_cause(tmp_path: Path) -> None:
    script = write_script(tmp_path / "flaky.py", FLAKY)
    logs = tmp_path / "logs"
    result = run(
        [
            "--nproc-per-node",
            "3",
            "--max-restarts",
            "1",
            "--log-dir",
            str(logs),
            "--redirects",
            "2",
            str(script),
            str(tmp_path),
            "raise",
            "5",
            "30",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 1
    err = result.stderr
    assert "Traceback" in err  # the worker's traceback, not the launcher's
    report = err[err.index("FAILED") :]
    assert "restart budget exhausted: 1 of 1" in report
    root = report[report.index("Root cause") :]
    assert ("rank" in root and "1 (local" in root.replace("rank       : ", "")) or "rank 1" in root
    assert "ValueError: boom on attempt 1" in root
    assert 'raise ValueError(f"boom on attempt {restart}")' in root
    # Siblings stopped by elastrun are not blamed.
    assert "terminated by elastrun" in report
    # Each attempt kept its own directory; nothing was wiped.
    run_dir = next(logs.iterdir())
    assert sorted(p.name for p in run_dir.iterdir() if p.is_dir()) == ["attempt_0", "attempt_1"]
    for attempt in ("attempt_0", "attempt_1"):
        assert (run_dir / attempt / "1" / "error.json").exists()
    # The launcher itself printed no traceback of its own.
    assert "elastrun/launch" not in err and "elastrun/agent" not in err


def test_a_killed_worker_is_reported_with_its_signal(tmp_path: Path) -> None:
    script = write_script(tmp_path / "flaky.py", FLAKY)
    result = run(
        ["--nproc-per-node", "2", str(script), str(tmp_path), "kill", "5", "30"], cwd=tmp_path
    )
    assert result.returncode == 1
    assert "SIGKILL" in result.stderr
    assert "restart budget exhausted: 0 of 0" in result.stderr


HANG_ON_TERM = """
import os, signal, sys, time
d = sys.argv[1]
rank = os.environ["RANK"]; restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
def on_term(signum, frame):
    open(os.path.join(d, f"got_{signal.Signals(signum).name}_{restart}_{rank}"), "w").close()
    if sys.argv[2] == "ignore":
        return
    sys.exit(0)
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, on_term)
open(os.path.join(d, f"ready_{restart}_{rank}"), "w").close()
if rank == "1" and restart == "0" and len(sys.argv) > 3:
    time.sleep(0.5)
    sys.exit(1)
while True:
    time.sleep(0.05)
"""


def test_shutdown_timeout_is_honoured_on_restarts(tmp_path: Path) -> None:
    script = write_script(tmp_path / "hang.py", HANG_ON_TERM)
    t0 = time.monotonic()
    proc = start(
        [
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--shutdown-timeout",
            "1",
            str(script),
            str(tmp_path),
            "ignore",
            "fail-once",
        ],
        cwd=tmp_path,
    )
    wait_for((tmp_path / "ready_1_0").exists, 30, "the restarted workers")
    elapsed = time.monotonic() - t0
    # Rank 0 ignored SIGTERM: it was SIGKILLed after the 1 s grace, not torch's fixed 30 s.
    assert (tmp_path / "got_SIGTERM_0_0").exists()
    assert elapsed < 15
    os.killpg(proc.pid, signal.SIGTERM)
    result = finish(proc, 30)
    assert result.returncode == 128 + signal.SIGTERM


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signals_are_forwarded_and_the_launcher_exits_non_zero(tmp_path: Path, sig: int) -> None:
    script = write_script(tmp_path / "hang.py", HANG_ON_TERM)
    proc = start(["--nproc-per-node", "2", str(script), str(tmp_path), "exit"], cwd=tmp_path)
    wait_for(lambda: all((tmp_path / f"ready_0_{r}").exists() for r in (0, 1)), 30, "workers")
    os.kill(proc.pid, sig)
    result = finish(proc, 30)
    name = signal.Signals(sig).name
    assert result.returncode == 128 + sig, result.stderr
    for r in (0, 1):
        assert (tmp_path / f"got_{name}_0_{r}").exists()
    assert f"stopped by {name}" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_signal_before_the_workers_start_stops_the_launch(tmp_path: Path) -> None:
    script = write_script(tmp_path / "hang.py", HANG_ON_TERM)
    proc = start(["--nproc-per-node", "2", str(script), str(tmp_path), "exit"], cwd=tmp_path)
    os.kill(proc.pid, signal.SIGTERM)
    result = finish(proc, 30)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr


ORPHAN = """
import os, subprocess, sys, time
d = sys.argv[1]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
with open(os.path.join(d, "pids_" + os.environ["RANK"]), "w") as fh:
    fh.write(f"{os.getpid()} {child.pid}")
time.sleep(300)
"""


def test_killing_the_launcher_leaves_no_worker_or_grandchild(tmp_path: Path) -> None:
    script = write_script(tmp_path / "orphan.py", ORPHAN)
    proc = start(["--nproc-per-node", "2", str(script), str(tmp_path)], cwd=tmp_path)
    wait_for(lambda: all((tmp_path / f"pids_{r}").exists() for r in (0, 1)), 30, "workers")
    pids = [int(p) for r in (0, 1) for p in (tmp_path / f"pids_{r}").read_text().split()]
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=10)
    wait_for(lambda: not any(pid_alive(p) for p in pids), 5, "workers and their children to die")


def test_module_binary_and_run_path_workers(tmp_path: Path) -> None:
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    write_script(pkg / "train.py", ENV_DUMP.format(names=repr(set(ELASTIC_VARS))))
    out = tmp_path / "m"
    out.mkdir()
    result = run(["--nproc-per-node", "2", "-m", "mypkg.train", str(out)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    dump = json.loads((out / "env_1.json").read_text())
    assert dump["name"] == "__main__" and dump["argv"][0].endswith("mypkg/train.py")

    result = run(
        ["--nproc-per-node", "2", "--no-python", "sh", "-c", 'echo "bin $RANK"'], cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.split("\n")[:2]) == ["bin 0", "bin 1"]

    rp = tmp_path / "rp"
    rp.mkdir()
    script = _env_script(tmp_path)
    result = run(["--nproc-per-node", "2", "--run-path", str(script), str(rp)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads((rp / "env_0.json").read_text())["argv"] == [str(script), str(rp)]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--nnodes", "4:2", "x.py"], "--nnodes"),
        (["--nproc-per-node", "abc", "x.py"], "--nproc-per-node"),
        (["--redirects", "9", "x.py"], "--redirects"),
        (["--max-restarts", "-1", "x.py"], "--max-restarts"),
        (["does_not_exist.py"], "does_not_exist.py"),
        (["--rdzv-backend", "nosuch", "--rdzv-endpoint", "h:1", "x.py"], "nosuch"),
        (["--rdzv-conf", "a=1,,b", "x.py"], "--rdzv-conf"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path: Path, args: list[str], needle: str) -> None:
    (tmp_path / "x.py").write_text("open('started', 'w').close()\n")
    result = run(args, cwd=tmp_path, timeout=30)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert needle in lines[0] and lines[0].startswith("elastrun: error:")
    assert not (tmp_path / "started").exists()


def test_dry_run_prints_the_plan_and_starts_nothing(tmp_path: Path) -> None:
    (tmp_path / "x.py").write_text("open('started', 'w').close()\n")
    result = run(
        ["--nproc-per-node", "2", "--tee", "3", "--dry-run", "x.py", "--lr", "1"], cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "worker local_rank=1 rank=1" in out
    assert "-m elastrun.worker.bootstrap x.py --lr 1" in out
    assert "RANK=1" in out and "stdout.log (file and console)" in out
    assert not (tmp_path / "started").exists()
    assert list(tmp_path.iterdir()) == [tmp_path / "x.py"]


def test_worker_exit_is_an_event_not_a_monitor_poll(tmp_path: Path) -> None:
    # With a 60 s monitor interval a polling agent would sit on the failure for a minute.
    script = write_script(tmp_path / "flaky.py", FLAKY)
    t0 = time.monotonic()
    result = run(
        [
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--monitor-interval",
            "60",
            str(script),
            str(tmp_path),
            "exit",
            "1",
        ],
        cwd=tmp_path,
        timeout=50,
    )
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - t0 < 40


def test_dry_run_shows_whether_workers_fork_from_the_template(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text("import torch\n")
    shown = run(["--nproc-per-node", "2", "--dry-run", "t.py"], cwd=tmp_path)
    assert "forked from a template process (preloading: torch)" in shown.stdout
    plain = run(["--nproc-per-node", "2", "--dry-run", "--no-template", "t.py"], cwd=tmp_path)
    assert "fresh interpreter per worker (--no-template)" in plain.stdout

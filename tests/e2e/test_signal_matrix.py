"""Every phase answers a signal: template start, running, restarting, a second Ctrl-C.

The rendezvous wait and the exit barrier are in test_round_outcome.py. Each case: the
launcher stops within ``SLACK`` (plus ``--shutdown-timeout`` where workers ignore the stop
signal), exits 128+N, and leaves no process behind (the suite's leak check).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _helpers import elastrun_store, finish, free_port, start, wait_for, write_script

pytestmark = pytest.mark.slow

SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
# The launcher sees a signal within 100 ms; stopping the workers and exiting (reaping,
# the report, the template's end) take well under a second on an idle machine, but up to
# about 2 s on 2 cores shared by two test workers. What matters is seconds, not a wait
# for a collective, a fixed 30 s grace (torchrun's on restarts) or a hang.
SLACK = 4.0

WORKER = """
import os, signal, sys, time
import torch  # the template preloads it: seconds of start-up to interrupt
out = sys.argv[1]
rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
mode = sys.argv[2] if len(sys.argv) > 2 else ""
if (mode == "stubborn" and rank == "1") or mode == "deaf":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
open(os.path.join(out, f"started_{rank}_{attempt}"), "w").close()
if mode == "stubborn" and rank == "0" and attempt == "0":
    time.sleep(0.5)
    sys.exit(3)
time.sleep(120)
"""


def _template_of(pid: int) -> bool:
    """Whether the launcher ``pid`` has started its worker template."""
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat", encoding="utf-8") as fh:
                parent = int(fh.read().rsplit(")", 1)[1].split()[1])
            if parent == pid:
                with open(f"/proc/{name}/cmdline", "rb") as fh:
                    if b"elastrun.template.worker.serve" in fh.read():
                        return True
        except (OSError, IndexError, ValueError):
            continue  # not a process, or it ended meanwhile
    return False


def _stop_and_time(proc: subprocess.Popen[str], sig: int) -> tuple[float, int, str]:
    t0 = time.monotonic()
    proc.send_signal(sig)
    res = finish(proc, 60)
    return time.monotonic() - t0, res.returncode, res.stderr


@pytest.mark.parametrize("inherited", ["default", "ignored"])
@pytest.mark.parametrize("sig", SIGNALS)
def test_a_signal_while_the_launcher_checks_its_options_waits_for_its_handlers(
    tmp_path: Path, sig: int, inherited: str
) -> None:
    # Before its handlers are installed the launcher parses and checks its options, which
    # can take a second on a loaded machine; here longer: PYTHON_EXEC is an interpreter
    # that takes 1.5 s to start, and the launcher runs it once to check it is Python. A
    # signal meanwhile must stop the launch like any other (128+N, no traceback), not
    # kill the launcher by its default action or raise KeyboardInterrupt.
    slow_python = tmp_path / "slow-python"
    slow_python.write_text(f'#!/bin/sh\nsleep 1.5\nexec {sys.executable} "$@"\n')
    slow_python.chmod(0o755)
    started = tmp_path / "started"
    script = write_script(tmp_path / "w.py", f"open({str(started)!r}, 'w').close()\n")
    # "ignored": started as a shell starts a background job (SIGINT ignored), or under
    # nohup (SIGHUP): the launcher handles the signal all the same, from its first line.
    previous = signal.signal(sig, signal.SIG_IGN if inherited == "ignored" else signal.SIG_DFL)
    try:
        proc = start(
            ["--nproc-per-node", "1", str(script)],
            cwd=tmp_path,
            env={"PYTHON_EXEC": str(slow_python)},
        )
    finally:
        signal.signal(sig, previous)
    time.sleep(0.8)  # checking PYTHON_EXEC
    took, code, err = _stop_and_time(proc, sig)
    assert code == 128 + sig, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert f"stopped by {signal.Signals(sig).name}" in err, err
    assert not started.exists()  # nothing ran
    assert took < SLACK + 1.5, err


# What the launcher's own code finds, the moment it starts loading: the signal mask.
MASK_AT_LOAD = """
import signal, sys

class Spy:
    def find_spec(self, name, path=None, target=None):
        if name == "elastrun.launch.cli":
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
            print("MASK", sorted(int(s) for s in blocked), flush=True)
        return None

sys.meta_path.insert(0, Spy())
sys.argv = ["elastrun", "--dry-run", "--nproc-per-node", "1", "train.py"]
from elastrun.launch.entry import main
code = main()
print("AFTER", sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])))
sys.exit(code)
"""


def test_the_stop_signals_are_held_back_before_the_launcher_loads(tmp_path: Path) -> None:
    # Loading the launcher takes a tenth of a second (more on a loaded machine): a signal
    # in that time must wait for the handlers, whatever the disposition it inherited.
    write_script(tmp_path / "train.py", "pass\n")
    res = subprocess.run(
        [sys.executable, "-c", MASK_AT_LOAD], cwd=tmp_path, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    lines = dict(line.split(" ", 1) for line in res.stdout.splitlines() if " " in line)
    held = set(json.loads(lines["MASK"]))
    assert {int(s) for s in (*SIGNALS, signal.SIGQUIT)} <= held, res.stdout
    assert json.loads(lines["AFTER"]) == [], res.stdout  # and let through again at the end


# Runs elastrun with SIGTERM blocked, as a parent that blocked it and forgot would.
BLOCKED_PARENT = """
import os, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
os.execv(sys.executable, [sys.executable, "-m", "elastrun", *sys.argv[1:]])
"""


@pytest.mark.torch
def test_a_stop_signal_the_parent_left_blocked_is_still_answered(tmp_path: Path) -> None:
    script = write_script(tmp_path / "w.py", WORKER)
    proc = subprocess.Popen(
        [sys.executable, "-c", BLOCKED_PARENT, "--nproc-per-node", "2", str(script),
         str(tmp_path)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    wait_for(lambda: len(list(tmp_path.glob("started_*"))) == 2, 30, "the workers")
    took, code, err = _stop_and_time(proc, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, err
    assert took < SLACK, err
    assert "unblocking ['SIGTERM']" in err, err


@pytest.mark.torch
@pytest.mark.parametrize("sig", SIGNALS)
def test_a_signal_while_the_template_starts(tmp_path: Path, sig: int) -> None:
    script = write_script(tmp_path / "w.py", WORKER)
    proc = start(["--nproc-per-node", "2", str(script), str(tmp_path)], cwd=tmp_path)
    # The launcher is up once it has started the template, which then imports torch for
    # seconds. (Not a fixed sleep: on a loaded machine the interpreter alone may take
    # longer to start, and a signal before it runs any code kills it by default action.)
    wait_for(lambda: _template_of(proc.pid), 30, "the worker template")
    took, code, err = _stop_and_time(proc, sig)
    assert code == 128 + sig, err
    assert took < SLACK, err
    assert "Traceback" not in err


@pytest.mark.torch
@pytest.mark.parametrize("sig", SIGNALS)
def test_a_signal_while_workers_run(tmp_path: Path, sig: int) -> None:
    script = write_script(tmp_path / "w.py", WORKER)
    proc = start(["--nproc-per-node", "2", str(script), str(tmp_path)], cwd=tmp_path)
    wait_for(lambda: len(list(tmp_path.glob("started_*"))) == 2, 30, "the workers")
    took, code, err = _stop_and_time(proc, sig)
    assert code == 128 + sig, err
    assert took < SLACK, err


@pytest.mark.torch
def test_a_signal_while_restarting_waits_at_most_the_grace(tmp_path: Path) -> None:
    script = write_script(tmp_path / "w.py", WORKER)
    proc = start(
        ["--nproc-per-node", "2", "--max-restarts", "1", "--shutdown-timeout", "3",
         str(script), str(tmp_path), "stubborn"],
        cwd=tmp_path,
    )  # fmt: skip
    wait_for(lambda: len(list(tmp_path.glob("started_*_0"))) == 2, 30, "the workers")
    time.sleep(1.0)  # rank 0 failed; the agent waits for rank 1, which ignores SIGTERM
    took, code, err = _stop_and_time(proc, signal.SIGINT)
    assert code == 128 + signal.SIGINT, err
    assert took < SLACK + 3, err


@pytest.mark.torch
def test_a_second_ctrl_c_skips_the_grace(tmp_path: Path) -> None:
    script = write_script(tmp_path / "w.py", WORKER)
    proc = start(
        ["--nproc-per-node", "2", "--shutdown-timeout", "30", str(script), str(tmp_path),
         "deaf"],
        cwd=tmp_path,
    )  # fmt: skip
    wait_for(lambda: len(list(tmp_path.glob("started_*"))) == 2, 30, "the workers")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    res = finish(proc, 40)
    assert time.monotonic() - t0 < 3, res.stderr
    assert res.returncode == 130, res.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_ends_the_rendezvous_wait_through_an_elastrun_store(
    tmp_path: Path, sig: int
) -> None:
    with elastrun_store(tmp_path) as (endpoint, token):
        script = write_script(tmp_path / "w.py", "import time\ntime.sleep(60)\n")
        proc = start(
            ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", endpoint, "--rdzv-id", "alone",
             "--rdzv-conf", f"is_host=false,token_file={token}", "--local-addr", "127.0.0.1",
             str(script)],
            cwd=tmp_path,
        )  # fmt: skip
        time.sleep(1.5)
        took, code, err = _stop_and_time(proc, sig)
        assert code == 128 + sig, err
        assert took < SLACK, err


def test_a_signal_ends_the_wait_for_an_unreachable_rendezvous_store(tmp_path: Path) -> None:
    # The c10d handler reaches its store while the agent is built (before any round):
    # nothing listens, and it would retry for read_timeout (60 s).
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    script = write_script(tmp_path / "w.py", "pass\n")
    proc = start(
        ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", endpoint, "--rdzv-id", "gone",
         "--rdzv-conf", "is_host=false,read_timeout=60", "--local-addr", "127.0.0.1",
         str(script)],
        cwd=tmp_path,
    )  # fmt: skip
    time.sleep(2.0)  # connecting, and reconnecting
    took, code, err = _stop_and_time(proc, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, err
    assert took < SLACK, err

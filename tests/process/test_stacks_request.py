"""Asking workers for their stacks: what a worker writes is collected, and the wait for a
worker that never answers ends at its bound or at once on a stop request."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from elastrun.core.cancel import CancelScope
from elastrun.core.procinfo import process_start_time
from elastrun.launch.commands.stacks import stacks_main
from elastrun.supervise.processes.stacks import request_stacks
from elastrun.wire import workers

# Dumps its stacks on SIGUSR1, as the bootstrap makes every Python worker do.
ANSWERS = (
    "import faulthandler, signal, sys, time\n"
    "faulthandler.register(signal.SIGUSR1, file=open(sys.argv[1], 'a'), all_threads=True)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)
# Takes SIGUSR1 and writes nothing (a worker whose bootstrap was bypassed).
SILENT = (
    "import signal, time\n"
    "signal.signal(signal.SIGUSR1, lambda *_: None)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def _start(code: str, path: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def test_a_worker_that_answers_is_collected_and_a_stop_request_ends_the_wait(
    tmp_path: Path,
) -> None:
    answers = _start(ANSWERS, tmp_path / "0.txt")
    silent = _start(SILENT, tmp_path / "1.txt")
    workers = {0: (answers.pid, str(tmp_path / "0.txt")), 1: (silent.pid, str(tmp_path / "1.txt"))}
    try:
        scope = CancelScope()
        threading.Timer(0.5, scope.cancel, ("received SIGTERM",)).start()
        began = time.monotonic()
        with scope.active():  # the agent's loop runs with its shutdown scope current
            dumps = request_stacks(workers, timeout=60.0)
        took = time.monotonic() - began
        assert took < 10.0, took  # not the 60 s bound: the stop request ended it
        assert 'File "<string>"' in dumps[0].text, dumps[0]  # its main thread's frame
        assert dumps[1].text == ""
        assert silent.poll() is None  # asked, never harmed
    finally:
        for proc in (answers, silent):
            proc.kill()
            proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()
    assert not os.path.exists(tmp_path / "1.txt") or not (tmp_path / "1.txt").read_text()


def test_elastrun_stacks_says_why_a_worker_gave_no_stacks_instead_of_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Local rank 0 runs but its stacks file cannot be opened (its directory is gone);
    # local rank 1 has ended. The command names both and exits 1.
    attempt = tmp_path / "run_x" / "attempt_0"
    attempt.mkdir(parents=True)
    silent = _start(SILENT, tmp_path / "unused")
    try:
        listed = {
            0: workers.WorkerEntry(
                silent.pid, str(tmp_path / "gone" / "stacks.txt"), process_start_time(silent.pid)
            ),
            1: workers.WorkerEntry(silent.pid, str(tmp_path / "s1.txt"), 1),  # another start
        }
        (attempt / workers.FILE_NAME).write_text(workers.encode(listed))
        assert stacks_main([str(tmp_path), "--timeout", "0.3"]) == 1
    finally:
        silent.kill()
        silent.wait(10)
        assert silent.stdout is not None
        silent.stdout.close()
    out = capsys.readouterr().out
    assert f"no answer: cannot read {tmp_path / 'gone' / 'stacks.txt'}" in out, out
    assert "=== local rank 1" in out and "  not running" in out, out

"""Asking workers for their stacks: what a worker writes is collected, and the wait for a
worker that never answers ends at its bound or at once on a stop request."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from elastrun.core.cancel import CancelScope
from elastrun.supervise.processes.stacks import request_stacks

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

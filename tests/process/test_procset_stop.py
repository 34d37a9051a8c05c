"""The shutdown ladder's record of who ended each worker."""

from __future__ import annotations

import logging
import os
import signal
import sys

import pytest

from elastrun.supervise.processes.procset import ProcessSet
from elastrun.supervise.processes.spawn import ProcessSpec, SubprocessStarter

# Says "ready" once its SIGTERM handler is in place; the handler aborts (SIGABRT), as a
# worker whose native teardown crashes while it is being stopped.
ABORTS_ON_SIGTERM = (
    "import os, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: os.abort())\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)
STOPS_ON_SIGTERM = "import time\nprint('ready', flush=True)\ntime.sleep(60)\n"


def test_a_worker_that_dies_of_its_own_signal_while_stopped_is_not_counted_as_stopped() -> None:
    starter = SubprocessStarter()
    procs = []
    for lr, code in enumerate((STOPS_ON_SIGTERM, ABORTS_ON_SIGTERM)):
        r, w = os.pipe()
        spec = ProcessSpec(lr, dict(os.environ), argv=(sys.executable, "-c", code), stdout_fd=w)
        procs.append(starter.start(spec))
        os.close(w)
        with os.fdopen(r) as out:
            assert out.readline() == "ready\n"
    group = ProcessSet(procs)
    report = group.stop(signal.SIGTERM, timeout=30.0)
    group.close()
    exits = {ex.local_rank: ex for ex in report.exits}
    assert (exits[0].exitcode, exits[0].by_agent) == (-signal.SIGTERM, True)
    assert (exits[1].exitcode, exits[1].by_agent) == (-signal.SIGABRT, False)


IGNORES_SIGTERM = (
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def test_a_worker_that_outlives_the_grace_is_described_before_its_sigkill(
    caplog: pytest.LogCaptureFixture,
) -> None:
    r, w = os.pipe()
    argv = (sys.executable, "-c", IGNORES_SIGTERM)
    spec = ProcessSpec(0, dict(os.environ), argv=argv, stdout_fd=w)
    proc = SubprocessStarter().start(spec)
    os.close(w)
    with os.fdopen(r) as out:
        assert out.readline() == "ready\n"
    group = ProcessSet([proc])
    with caplog.at_level(logging.WARNING, logger="elastrun"):
        report = group.stop(signal.SIGTERM, timeout=0.5)
    group.close()
    assert report.killed == (0,)
    (line,) = [r.getMessage() for r in caplog.records if f"(pid {proc.pid}):" in r.getMessage()]
    ignored = int(line.split("SigIgn: ")[1].split(",")[0], 16)
    assert ignored & (1 << (signal.SIGTERM - 1)), line  # the evidence: SIGTERM ignored
    assert "State: " in line and "SigPnd: " in line and "SigBlk: " in line, line

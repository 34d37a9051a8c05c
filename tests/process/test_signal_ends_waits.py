"""A signal ends every kind of wait of the agent at once, whichever thread receives it.

The kernel delivers a process-directed signal to any thread that has it unblocked. Python
runs its handler only on the main thread, between two bytecodes: a main thread blocked
in a wait is not interrupted when another thread receives the signal. Each test runs a
small launcher-like process whose main thread blocks the signal (so another thread, with
it unblocked, receives it), waits in one of the agent's waits, and reports how the wait
ended; the test sends the signal once the wait has begun.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# Seconds within which the wait must end after the signal: generous for a loaded 2-core
# machine; every wait here would otherwise last 60 s.
PROMPT = 5.0

CHILD = """\
import os, signal, sys, threading, time

from elastrun.core.cancel import Cancelled
from elastrun.core.clock import Deadline
from elastrun.core.errors import ShutdownRequested
from elastrun.core.shutdown import ShutdownRequest
from elastrun.launch.signals import install_signal_handlers
from elastrun.supervise.processes.procset import ProcessSet
from elastrun.supervise.processes.spawn import ProcessSpec, SubprocessStarter
from elastrun.template.agent.starter import TemplateStarter

kind, workdir = sys.argv[1], sys.argv[2]
# The main thread never receives SIGTERM; the relay thread (made next) inherits that.
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
request = ShutdownRequest()
restore = install_signal_handlers([signal.SIGTERM], request)
parked = threading.Event()


def receiver():
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    parked.wait()


threading.Thread(target=receiver, daemon=True).start()
SLEEPER = (sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)")
STUBBORN = (
    sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('up', flush=True); time.sleep(60)",
)


def spec(argv, rank=0):
    return ProcessSpec(rank, dict(os.environ), argv=argv)


def started(argv):
    r, w = os.pipe()
    proc = SubprocessStarter().start(ProcessSpec(0, dict(os.environ), argv=argv, stdout_fd=w))
    os.close(w)
    with os.fdopen(r) as out:
        assert out.readline() == "up\\n"
    return ProcessSet([proc])


def script(name, body):
    path = os.path.join(workdir, name)
    with open(path, "w") as fh:
        fh.write(body)
    return path


def bootstrap(path):
    return (sys.executable, "-m", "elastrun.worker.bootstrap", path)


cleanup = []
if kind == "exits":
    procs = started(SLEEPER)
    cleanup.append(lambda: (procs.stop(signal.SIGKILL, 5), procs.close()))
    wait = lambda: procs.wait_for_exits(Deadline.after(60), request.scope)
elif kind == "ladder":
    procs = started(STUBBORN)
    cleanup.append(procs.close)
    request.request(signal.SIGTERM)  # the first stop request: the ladder gives its grace
    wait = lambda: procs.stop(signal.SIGTERM, 60, grace=request.grace)
elif kind == "ready":
    starter = TemplateStarter(preload=["slow_import"], shutdown=request)
    cleanup.append(starter.close)
    wait = lambda: starter.start(spec(bootstrap(script("ok.py", "pass\\n"))))
elif kind == "spawn":
    starter = TemplateStarter(shutdown=request)
    cleanup.append(starter.close)
    first = starter.start(spec(bootstrap(script("ok.py", "pass\\n"))))
    while first.poll() is None:
        time.sleep(0.01)
    first.release()
    os.kill(starter.template_pid, signal.SIGSTOP)  # wedged: it answers no request
    wait = lambda: starter.start(spec(bootstrap(script("ok.py", "pass\\n"))))
elif kind == "store":
    from elastrun.store.memory import MemoryStore

    store = MemoryStore()

    def wait():
        with request.scope.active():  # as the agent's rendezvous and barrier run
            store.wait(["never"], 60)
else:
    raise SystemExit(f"unknown kind {kind}")

print("waiting", flush=True)
try:
    wait()
    outcome = "returned"
except (Cancelled, ShutdownRequested) as exc:
    outcome = type(exc).__name__
print(outcome, flush=True)
for step in cleanup:
    step()
restore()
"""

SLOW_IMPORT = "import time\ntime.sleep(60)\n"


def _readline(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline().strip() if ready else ""


@pytest.mark.parametrize(
    ("kind", "outcome"),
    [
        ("exits", "Cancelled"),
        ("ready", "ShutdownRequested"),
        ("spawn", "ShutdownRequested"),
        ("ladder", "returned"),  # the second request cut the grace: SIGKILL at once
        ("store", "Cancelled"),
    ],
)
def test_a_signal_another_thread_receives_ends_the_main_threads_wait_at_once(
    tmp_path: Path, kind: str, outcome: str
) -> None:
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    (tmp_path / "slow_import.py").write_text(textwrap.dedent(SLOW_IMPORT))
    path = [str(tmp_path), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    proc = subprocess.Popen(
        [sys.executable, str(child), kind, str(tmp_path)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert _readline(proc, 60) == "waiting"
        time.sleep(0.3)  # into the wait (a signal before it would end it at once too)
        os.kill(proc.pid, signal.SIGTERM)
        sent = time.monotonic()
        got = _readline(proc, 60)
        took = time.monotonic() - sent
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.stderr is not None
    err = proc.stderr.read()
    proc.stderr.close()
    proc.stdout.close()  # type: ignore[union-attr]  # Optional: a pipe here
    assert got == outcome, err
    assert took < PROMPT, err

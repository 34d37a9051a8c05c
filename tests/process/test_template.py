"""The template ("zygote") starter: workers forked from a pre-imported interpreter.

Most tests are differential: the same worker is started once by ``SubprocessStarter``
(a fresh interpreter) and once by ``TemplateStarter``, and what the worker can observe --
argv, ``__main__``, environment, streams, signals, exit status, process group, parent
-- must be the same.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from _helpers import children, freeze, pid_alive, wait_for
from elastrun.core.errors import ProcessStartError, ShutdownRequested
from elastrun.core.shutdown import ShutdownRequest
from elastrun.supervise.processes.spawn import (
    FunctionCall,
    ProcessSpec,
    ProcessStarter,
    SubprocessStarter,
    WorkerProcess,
    start_each,
)
from elastrun.template.agent.process import Template
from elastrun.template.agent.starter import (
    BootstrapCommand,
    TemplateStarter,
    default_preload,
    parse_bootstrap_command,
)
from elastrun.wire.template import BATCH_MAX

PY = sys.executable
BOOT = "elastrun.worker.bootstrap"
TIMEOUT = 30.0
LOGGER = "elastrun.template.agent.starter"

# Everything a script can observe about how it was started, except what is unique to
# each process (pids) -- those are compared separately.
PROBE = """\
import faulthandler, json, os, signal, sys
main = sys.modules["__main__"]
def stream(s):
    if s is None:
        return None
    b = getattr(s, "buffer", None)
    raw = getattr(b, "raw", b)
    return {
        "type": type(s).__name__, "buffer": type(b).__name__, "name": getattr(raw, "name", None),
        "fileno": s.fileno(), "encoding": s.encoding, "errors": s.errors,
        "line_buffering": s.line_buffering, "write_through": s.write_through, "mode": s.mode,
    }
def fds():
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            os.fstat(int(name))
        except OSError:
            continue
        out.append(int(name))
    return sorted(out)
print(json.dumps({
    "argv": sys.argv,
    "orig_argv": sys.orig_argv[1:],
    "name": __name__,
    "file": globals().get("__file__"),
    "path0": sys.path[0],
    "path": sys.path[1:],
    "cwd": os.getcwd(),
    "package": __package__,
    "spec": getattr(__spec__, "name", None),
    "loader": type(__loader__).__name__,
    "main_is_me": main.__dict__ is globals(),
    "globals": sorted(globals()),
    "env": dict(os.environ),
    "session_leader": os.getsid(0) == os.getpid(),
    "group_leader": os.getpgid(0) == os.getpid(),
    "parent": os.getppid(),
    "signals": {s.name: repr(signal.getsignal(s)) for s in signal.valid_signals()
                if isinstance(s, signal.Signals)},
    "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "umask": os.umask(0o22),
    "stdin": stream(sys.stdin), "stdout": stream(sys.stdout), "stderr": stream(sys.stderr),
    "dunder_streams": [sys.stdin is sys.__stdin__, sys.stdout is sys.__stdout__],
    "fds": fds(),
    "faulthandler": faulthandler.is_enabled(),
    "excepthook_is_default": sys.excepthook is sys.__excepthook__,
    "flags": list(sys.flags),
    "executable": sys.executable,
}))
sys.stderr.write("probe on stderr\\n")
"""


def _write(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(body))
    return path


def _argv(*args: str) -> tuple[str, ...]:
    return (PY, "-u", "-m", BOOT, *args)


class _Run:
    """One finished worker: exit code and what it wrote."""

    def __init__(self, code: int, out: str, err: str, pid: int) -> None:
        self.code, self.out, self.err, self.pid = code, out, err, pid

    def probe(self) -> dict[str, object]:
        assert self.code == 0, self.err
        data: dict[str, object] = json.loads(self.out)
        return data


def _signal_state(pid: int) -> dict[str, str]:
    """A process's state and signal masks, and where it waits in the kernel."""
    found: dict[str, str] = {}
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key in ("State", "SigQ", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt"):
                    found[key] = value.strip()
        with open(f"/proc/{pid}/wchan") as fh:
            found["wchan"] = fh.read()
    return found


def _abort_for_stack(proc: WorkerProcess) -> str:
    """SIGABRT the worker (its faulthandler prints its Python stack to stderr)."""
    proc.signal_group(signal.SIGABRT)
    select.select([proc.exit_fd()], [], [], 3.0)
    return "stack on stderr"


def _wait(proc: WorkerProcess, timeout: float = TIMEOUT) -> int:
    ready, _, _ = select.select([proc.exit_fd()], [], [], timeout)
    assert ready, f"worker {proc.pid} did not exit within {timeout}s"
    code = proc.poll()
    assert code is not None
    proc.release()
    return code


def _run(
    starter: ProcessStarter,
    tmp: Path,
    argv: tuple[str, ...],
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    tag: str = "w",
) -> _Run:
    out_path, err_path = tmp / f"{tag}.out", tmp / f"{tag}.err"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        spec = ProcessSpec(
            0,
            dict(os.environ) if env is None else env,
            argv=argv,
            stdout_fd=out.fileno(),
            stderr_fd=err.fileno(),
            cwd=None if cwd is None else str(cwd),
        )
        proc = starter.start(spec)
    code = _wait(proc)
    return _Run(code, out_path.read_text(), err_path.read_text(), proc.pid)


@pytest.fixture
def template() -> Iterator[TemplateStarter]:
    starter = TemplateStarter()
    try:
        yield starter
    finally:
        starter.close()


def _both(
    template: TemplateStarter,
    tmp: Path,
    argv: tuple[str, ...],
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> tuple[_Run, _Run]:
    """The same worker started fresh and forked from the template."""
    fresh = _run(SubprocessStarter(), tmp, argv, env=env, cwd=cwd, tag="fresh")
    forked = _run(template, tmp, argv, env=env, cwd=cwd, tag="forked")
    assert template.forked == 1, template
    return fresh, forked


# --- what the worker sees ----------------------------------------------------------------


def test_a_forked_script_worker_observes_exactly_what_a_fresh_one_does(
    template: TemplateStarter, tmp_path: Path
) -> None:
    script = _write(tmp_path / "scripts" / "probe.py", PROBE)
    env = {**os.environ, "ELASTRUN_PROBE": "value with spaces", "RANK": "3"}
    fresh, forked = _both(
        template, tmp_path, _argv(str(script), "--flag", "x y"), env=env, cwd=tmp_path
    )
    a, b = fresh.probe(), forked.probe()
    assert a["parent"] == b["parent"] == os.getpid()
    assert a == b
    assert b["argv"] == [str(script), "--flag", "x y"]
    # index: the probe's parsed JSON: its values are typed object
    assert b["env"]["ELASTRUN_PROBE"] == "value with spaces"  # type: ignore[index]
    assert b["fds"] == [0, 1, 2]
    assert fresh.err == forked.err == "probe on stderr\n"


def test_signals_the_agent_ignores_or_blocks_are_passed_on_as_exec_would(
    template: TemplateStarter, tmp_path: Path
) -> None:
    script = _write(tmp_path / "probe.py", PROBE)
    # The template starts before the agent changes its signals: it must not matter.
    template.prepare(ProcessSpec(0, dict(os.environ), argv=_argv(str(script))))
    old_handler = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    try:
        fresh, forked = _both(template, tmp_path, _argv(str(script)))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        signal.signal(signal.SIGHUP, old_handler)
    a, b = fresh.probe(), forked.probe()
    assert a == b
    # index: the probe's parsed JSON: its values are typed object
    assert b["signals"]["SIGHUP"] == "<Handlers.SIG_IGN: 1>"  # type: ignore[index]
    assert b["blocked"] == [int(signal.SIGUSR2)]


# How the worker looks to ps, pgrep -f, top and psutil, from its first line on; then it
# waits (for pgrep and psutil to look at it from outside) until stopped.
TITLE = """\
import json, os, sys, time
with open("/proc/self/cmdline", "rb") as fh:
    cmdline = fh.read()
with open("/proc/self/comm") as fh:
    comm = fh.read().strip()
print(json.dumps({"cmdline": cmdline.rstrip(b"\\0").replace(b"\\0", b" ").decode(), "comm": comm}))
with open(sys.argv[1] + ".tmp", "w") as fh:
    pass
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(60)
"""


def test_a_forked_worker_shows_the_command_line_and_name_of_a_fresh_one(
    template: TemplateStarter, tmp_path: Path
) -> None:
    psutil = pytest.importorskip("psutil")
    script = _write(tmp_path / "train.py", TITLE)
    seen = {}
    ready = tmp_path / "ready"
    for name, starter in (("fresh", SubprocessStarter()), ("forked", template)):
        ready.unlink(missing_ok=True)
        with open(tmp_path / f"{name}.out", "wb") as out:
            proc = starter.start(
                ProcessSpec(
                    0,
                    dict(os.environ),
                    argv=_argv(str(script), str(ready), "--lr", "0.1"),
                    stdout_fd=out.fileno(),
                )
            )
        try:
            wait_for(ready.exists, TIMEOUT, f"the {name} worker to start")
            with open(f"/proc/{proc.pid}/environ", "rb") as fh:
                environ = fh.read().split(b"\0")
            pgrep = subprocess.run(
                ["pgrep", "-f", f"{script} {ready} --lr 0.1"],
                capture_output=True,
                text=True,
                check=False,
            )
            seen[name] = {
                "psutil": psutil.Process(proc.pid).cmdline(),
                "comm": psutil.Process(proc.pid).name(),
                "pgrep": [int(pid) for pid in pgrep.stdout.split()] == [proc.pid],
                # What the suite's leak check finds processes by.
                "tagged": f"ELASTRUN_TEST_TAG={os.environ['ELASTRUN_TEST_TAG']}".encode()
                in environ,
            }
        finally:
            proc.signal_group(signal.SIGKILL)
            _wait(proc)
        seen[name]["own view"] = json.loads((tmp_path / f"{name}.out").read_text())
    assert template.forked == 1
    fresh, forked = seen["fresh"], seen["forked"]
    assert fresh["psutil"] == list(_argv(str(script), str(ready), "--lr", "0.1"))
    assert forked == fresh
    assert forked["comm"] == os.path.basename(PY)[:15]
    assert forked["own view"]["cmdline"] == " ".join(fresh["psutil"])


def test_without_setproctitle_a_forked_worker_keeps_the_templates_title(
    template: TemplateStarter, tmp_path: Path
) -> None:
    _write(tmp_path / "lib" / "setproctitle.py", "raise ImportError('not installed')\n")
    script = _write(tmp_path / "train.py", TITLE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "lib")}
    ready = tmp_path / "ready"
    with open(tmp_path / "out", "wb") as out:
        spec = ProcessSpec(
            0, env, argv=_argv(str(script), str(ready)), stdout_fd=out.fileno()
        )  # fmt: skip
        proc = template.start(spec)
    try:
        wait_for(ready.exists, TIMEOUT, "the worker to start")
    finally:
        proc.signal_group(signal.SIGKILL)
        _wait(proc)
    assert template.forked == 1
    view = json.loads((tmp_path / "out").read_text())
    assert "-m elastrun.template.worker.serve" in view["cmdline"]
    assert view["comm"] == os.path.basename(PY)[:15]


def test_a_forked_module_worker_gets_its_own_cwd_on_sys_path(
    template: TemplateStarter, tmp_path: Path
) -> None:
    workdir = tmp_path / "work"
    _write(workdir / "pkg" / "__init__.py", "")
    _write(workdir / "pkg" / "probe.py", PROBE)
    fresh, forked = _both(template, tmp_path, _argv("-m", "pkg.probe", "arg"), cwd=workdir)
    a, b = fresh.probe(), forked.probe()
    assert a == b
    assert b["path0"] == str(workdir)
    assert b["cwd"] == str(workdir)
    assert b["name"] == "__main__"
    assert b["spec"] == "pkg.probe"


def test_two_forked_workers_do_not_share_random_state(tmp_path: Path) -> None:
    script = _write(
        tmp_path / "rand.py",
        """\
        import multiprocessing, random
        print(random.getrandbits(64), multiprocessing.current_process().authkey.hex())
        """,
    )
    with TemplateStarter(preload=["multiprocessing"]) as starter:
        first = _run(starter, tmp_path, _argv(str(script)), tag="a")
        second = _run(starter, tmp_path, _argv(str(script)), tag="b")
    assert first.code == second.code == 0, first.err + second.err
    a, b = first.out.split(), second.out.split()
    assert a[0] != b[0]
    assert a[1] != b[1]


# Every generator a fresh interpreter seeds from the OS when these modules are imported
# (sympy is imported by torch._dynamo, which the template preloads for DDP scripts), and
# whether anything has touched CUDA's lazy state.
TORCH_RANDOM = """\
import json, random
import numpy, sympy.core.random as sr, torch
import torch.cuda
print(json.dumps({
    "torch": [torch.initial_seed(), torch.rand(2).tolist()],
    "numpy": numpy.random.random(),
    "sympy": [sr.rng.random(), sr._assumptions_rng.random()],
    "random": random.random(),
    "cuda": [torch.cuda.is_initialized(), len(torch.cuda._queued_calls)],
}))
"""


@pytest.mark.torch
def test_forked_workers_reseed_torch_numpy_and_sympy_without_touching_cuda(
    tmp_path: Path,
) -> None:
    script = _write(tmp_path / "rand.py", TORCH_RANDOM)
    # As the launcher sets it: torch's import starts no OpenMP thread with one.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    fresh = _run(SubprocessStarter(), tmp_path, _argv(str(script)), env=env, tag="fresh")
    with TemplateStarter(preload=["torch", "numpy", "sympy.core.random"]) as starter:
        forked = [
            _run(starter, tmp_path, _argv(str(script)), env=env, tag=f"forked{i}").probe()
            for i in range(2)
        ]
        assert (starter.forked, starter.fell_back) == (2, 0)
    runs = [fresh.probe(), *forked]
    for key in ("torch", "numpy", "sympy", "random"):
        values = [json.dumps(r[key]) for r in runs]
        assert len(set(values)) == 3, (key, values)
    # Reseeding torch must not initialise CUDA or queue work for its lazy start.
    assert forked[0]["cuda"] == forked[1]["cuda"] == runs[0]["cuda"]


def test_preloaded_modules_are_imported_once_in_the_template_not_in_workers(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "imports.log"
    _write(
        tmp_path / "lib" / "heavy.py",
        f"""\
        import os
        with open({str(marker)!r}, "a") as fh:
            fh.write(f"{{os.getpid()}}\\n")
        """,
    )
    script = _write(tmp_path / "use.py", "import heavy\nprint('ok')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "lib")}
    with TemplateStarter(preload=["heavy"]) as starter:
        runs = [_run(starter, tmp_path, _argv(str(script)), env=env, tag=str(i)) for i in range(2)]
        template_pid = starter.template_pid
    assert [r.code for r in runs] == [0, 0], runs[0].err
    assert marker.read_text().split() == [str(template_pid)]


# --- streams and exit status -----------------------------------------------------------


EXITS = """\
import sys
def inner():
    raise ValueError("boom")
mode = sys.argv[1]
print("out line")
sys.stderr.write("err line\\n")
if mode == "three":
    sys.exit(3)
if mode == "message":
    sys.exit("a message")
if mode == "raise":
    inner()
if mode == "interrupt":
    raise KeyboardInterrupt
"""


@pytest.mark.parametrize(
    ("mode", "code"),
    [("zero", 0), ("three", 3), ("message", 1), ("raise", 1), ("interrupt", -signal.SIGINT)],
)
def test_exit_status_streams_and_error_file_match_a_fresh_start(
    template: TemplateStarter, tmp_path: Path, mode: str, code: int
) -> None:
    script = _write(tmp_path / "exits.py", EXITS)
    runs = []
    for name, starter in (("fresh", SubprocessStarter()), ("forked", template)):
        error_file = tmp_path / f"{name}.json"
        env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)}
        run = _run(starter, tmp_path, _argv(str(script), mode), env=env, tag=name)
        recorded = json.loads(error_file.read_text()) if error_file.exists() else None
        runs.append((run, recorded))
    (fresh, fresh_file), (forked, forked_file) = runs
    assert fresh.code == forked.code == code
    assert fresh.out == forked.out == "out line\n"
    assert fresh.err == forked.err  # the same traceback, no template frames in it
    assert fresh.err.startswith("err line\n")
    assert (fresh_file is None) == (forked_file is None) == (mode != "raise")
    if forked_file is not None:
        assert fresh_file is not None
        message = forked_file["message"]
        assert message["message"] == fresh_file["message"]["message"] == "ValueError: boom"
        stack = message["extraInfo"]["py_callstack"]
        assert stack == fresh_file["message"]["extraInfo"]["py_callstack"]
        assert "elastrun/template/" not in stack


def test_output_to_inherited_streams_goes_to_the_agents_stdout(tmp_path: Path) -> None:
    # stdout_fd None means "inherit": the agent's own descriptors at start time.
    script = _write(tmp_path / "hello.py", "print('inherited hello')\n")
    driver = _write(
        tmp_path / "driver.py",
        f"""\
        import os, select, sys
        from elastrun.supervise.processes.spawn import ProcessSpec
        from elastrun.template.agent.starter import TemplateStarter
        with TemplateStarter() as starter:
            proc = starter.start(ProcessSpec(0, dict(os.environ),
                argv=({PY!r}, "-u", "-m", {BOOT!r}, {str(script)!r})))
            select.select([proc.exit_fd()], [], [], 30)
            sys.exit(proc.poll())
        """,
    )
    result = subprocess.run(
        [PY, str(driver)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "inherited hello\n"


# --- signals and process groups ---------------------------------------------------------

SLEEPER = """\
import os, subprocess, sys, time
ready = sys.argv[1]
child = None
if len(sys.argv) > 2:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
try:
    with open(ready + ".tmp", "w") as fh:
        fh.write(str(child.pid if child else 0))
    os.replace(ready + ".tmp", ready)
    time.sleep(60)
except KeyboardInterrupt:
    print("caught KeyboardInterrupt")
    sys.exit(7)
"""


def _start_sleeper(
    starter: ProcessStarter, tmp: Path, tag: str, *extra: str
) -> tuple[WorkerProcess, Path]:
    script = _write(tmp / "sleeper.py", SLEEPER)
    ready = tmp / f"{tag}.ready"
    with open(tmp / f"{tag}.out", "wb") as out:
        proc = starter.start(
            ProcessSpec(
                0,
                dict(os.environ),
                argv=_argv(str(script), str(ready), *extra),
                stdout_fd=out.fileno(),
            )
        )
    wait_for(ready.exists, TIMEOUT, f"{tag} worker to start")
    return proc, ready


@pytest.mark.parametrize(
    ("sig", "code", "output"),
    [
        (signal.SIGTERM, -signal.SIGTERM, ""),
        (signal.SIGKILL, -signal.SIGKILL, ""),
        (signal.SIGINT, 7, "caught KeyboardInterrupt\n"),
    ],
)
def test_signals_to_the_worker_group_act_as_on_a_fresh_worker(
    template: TemplateStarter, tmp_path: Path, sig: int, code: int, output: str
) -> None:
    # A test runner started in the background inherits SIGINT ignored, and so would its
    # workers (exec keeps ignored signals); the launcher itself always handles SIGINT,
    # so its workers start with the default. Do as the launcher does for this test.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _check_group_signals(template, tmp_path, sig, code, output)
    finally:
        signal.signal(signal.SIGINT, previous)


def _check_group_signals(
    template: TemplateStarter, tmp_path: Path, sig: int, code: int, output: str
) -> None:
    for name, starter in (("fresh", SubprocessStarter()), ("forked", template)):
        proc, _ = _start_sleeper(starter, tmp_path, name)
        proc.signal_group(sig)
        assert _wait(proc) == code, name
        assert (tmp_path / f"{name}.out").read_text() == output, name
    assert template.forked == 1


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_sent_as_soon_as_a_worker_is_started_is_not_lost(
    template: TemplateStarter, tmp_path: Path, sig: int
) -> None:
    # start() returns while the forked worker still sets itself up; the agent may signal
    # it from then on (a Ctrl-C during a restart). It must act as on a fresh worker,
    # not vanish into the template's ignored SIGINT.
    # Short sleeps: python's handler only sets a flag, checked between bytecodes and when
    # a blocking call returns with EINTR. A SIGINT handled just before the script's
    # sleep(60) starts its system call (a worker preempted in that window on a loaded
    # machine) is seen only when the sleep ends, under plain python as under any
    # launcher: that race is CPython's, and the 60 s sleep lost it twice in full runs.
    script = _write(tmp_path / "sleep.py", "import time\nwhile True:\n    time.sleep(0.05)\n")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as the launcher
    try:
        for i in range(10):
            for name, starter in (("fresh", SubprocessStarter()), ("forked", template)):
                proc = starter.start(ProcessSpec(0, dict(os.environ), argv=_argv(str(script))))
                proc.signal_group(sig)
                ready, _, _ = select.select([proc.exit_fd()], [], [], 5.0)
                if not ready:  # the worker's signal state, and its Python stack (the
                    # bootstrap's faulthandler prints it on SIGABRT), whole on stderr
                    print(name, i, _signal_state(proc.pid), file=sys.stderr)
                assert ready, (name, i, _abort_for_stack(proc))
                assert _wait(proc, 5.0) == -sig, (name, i)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert template.forked == 10


def test_exited_does_not_reap_a_forked_worker(template: TemplateStarter, tmp_path: Path) -> None:
    proc, _ = _start_sleeper(template, tmp_path, "w")
    assert not proc.exited()
    proc.signal_group(signal.SIGKILL)
    wait_for(proc.exited, TIMEOUT, "the worker to exit")
    assert os.path.exists(f"/proc/{proc.pid}")  # still a zombie: its pid stays reserved
    assert _wait(proc) == -signal.SIGKILL


def test_killing_the_group_reaches_the_workers_children(
    template: TemplateStarter, tmp_path: Path
) -> None:
    proc, ready = _start_sleeper(template, tmp_path, "w", "with-child")
    child = int(ready.read_text())
    assert pid_alive(child)
    proc.signal_group(signal.SIGKILL)
    assert _wait(proc) == -signal.SIGKILL
    wait_for(lambda: not pid_alive(child), TIMEOUT, "the worker's child to die")


AGENT = """\
import json, os, sys, time
from elastrun.supervise.processes.spawn import ProcessSpec, SubprocessStarter
from elastrun.template.agent.starter import TemplateStarter
starter = TemplateStarter() if sys.argv[1] == "template" else SubprocessStarter()
proc = starter.start(ProcessSpec(0, dict(os.environ), argv=tuple(sys.argv[2:])))
print(json.dumps({"worker": proc.pid, "template": getattr(starter, "template_pid", None)}),
      flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("kind", ["fresh", "template"])
def test_workers_and_the_template_die_when_the_agent_is_killed(tmp_path: Path, kind: str) -> None:
    agent_script = _write(tmp_path / "agent.py", AGENT)
    script = _write(tmp_path / "sleeper.py", SLEEPER)
    ready = tmp_path / "ready"
    agent = subprocess.Popen(
        [PY, str(agent_script), kind, *_argv(str(script), str(ready))],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert agent.stdout is not None
        pids = json.loads(agent.stdout.readline())
        wait_for(ready.exists, TIMEOUT, "the worker to start")
        assert (pids["template"] is None) == (kind == "fresh")
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait(TIMEOUT)
        for pid in filter(None, (pids["worker"], pids["template"])):
            wait_for(lambda pid=pid: not pid_alive(pid), TIMEOUT, f"pid {pid} to die")
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        if agent.stdout is not None:
            agent.stdout.close()


# --- the template's own life ----------------------------------------------------------


def test_a_killed_template_is_recreated_and_its_workers_live_on(
    template: TemplateStarter, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first, _ = _start_sleeper(template, tmp_path, "first")
    old = template.template_pid
    assert old is not None
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: template.template_pid is None, TIMEOUT, "the template to die")
    assert not first.exited()  # the worker does not depend on its template
    with caplog.at_level(logging.INFO, logger=LOGGER):
        second, _ = _start_sleeper(template, tmp_path, "second")
    assert template.template_pid not in (None, old)
    assert template.templates_started == 2
    assert template.forked == 2
    died = [r.getMessage() for r in caplog.records if "died" in r.getMessage()]
    assert died == [f"worker template (pid {old}) died (killed by SIGKILL); starting a new one"]
    for proc in (first, second):
        proc.signal_group(signal.SIGTERM)
        assert _wait(proc) == -signal.SIGTERM


def test_a_preload_that_starts_a_thread_falls_back_to_fresh_starts_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _write(
        tmp_path / "lib" / "threaded.py",
        """\
        import threading, time
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        """,
    )
    script = _write(tmp_path / "ok.py", "import os; print(os.getppid())\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "lib")}
    with (
        caplog.at_level(logging.WARNING, logger=LOGGER),
        TemplateStarter(preload=["threaded"]) as starter,
    ):
        runs = [_run(starter, tmp_path, _argv(str(script)), env=env, tag=str(i)) for i in range(2)]
        assert starter.template_pid is None
        assert starter.fell_back == 2
        assert starter.forked == 0
    assert [r.code for r in runs] == [0, 0]
    warnings = [r.getMessage() for r in caplog.records]
    # Once, naming the cause and what to change.
    assert len(warnings) == 1
    assert warnings[0].startswith(
        "worker template disabled (importing threaded started 1 thread(s)); "
        "starting workers as fresh processes"
    )
    assert "take it out of --preload" in warnings[0]


def test_a_preload_that_fails_to_import_falls_back_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    script = _write(tmp_path / "ok.py", "print('ok')\n")
    with (
        caplog.at_level(logging.WARNING, logger=LOGGER),
        TemplateStarter(preload=["no_such_module_xyz"]) as starter,
    ):
        run = _run(starter, tmp_path, _argv(str(script)))
    assert run.code == 0 and run.out == "ok\n"
    assert len(caplog.records) == 1
    assert (
        "cannot preload no_such_module_xyz: ModuleNotFoundError" in caplog.records[0].getMessage()
    )


def test_a_worker_the_template_cannot_start_falls_back_to_a_normal_start(
    template: TemplateStarter, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    script = _write(tmp_path / "ok.py", "print('ok')\n")
    assert _run(template, tmp_path, _argv(str(script))).code == 0  # the template is up
    missing = tmp_path / "no" / "such" / "dir"
    with caplog.at_level(logging.WARNING, logger=LOGGER), pytest.raises(ProcessStartError):
        # The fresh start fails the way it always does for a missing directory.
        template.start(ProcessSpec(0, dict(os.environ), argv=_argv(str(script)), cwd=str(missing)))
    assert template.fell_back == 1
    (record,) = caplog.records
    assert "could not start local rank 0 (FileNotFoundError" in record.getMessage()
    assert template.template_pid is not None  # one refused worker does not end the template


class _RecordingStarter:
    def __init__(self) -> None:
        self.specs: list[ProcessSpec] = []

    def start(self, spec: ProcessSpec) -> WorkerProcess:
        self.specs.append(spec)
        raise ProcessStartError("recorded")

    def start_many(self, specs: Sequence[ProcessSpec]) -> list[WorkerProcess]:
        return start_each(self.start, specs)


def _noop() -> None:
    pass


@pytest.mark.parametrize(
    "spec",
    [
        ProcessSpec(0, {}, call=FunctionCall(_noop, (), "/nonexistent")),
        ProcessSpec(0, {}, argv=("/bin/true",)),
        ProcessSpec(0, {}, argv=(PY, "-u", "script.py")),
        ProcessSpec(0, {}, argv=("/usr/bin/python3-other", "-u", "-m", BOOT, "script.py")),
        ProcessSpec(0, {}, argv=(PY, "-c", "pass", "-m", BOOT, "x")),
    ],
    ids=["function", "binary", "no-bootstrap", "other-python", "dash-c"],
)
def test_workers_the_template_cannot_run_go_to_the_fallback(spec: ProcessSpec) -> None:
    fallback = _RecordingStarter()
    starter = TemplateStarter(fallback=fallback)
    with pytest.raises(ProcessStartError, match="recorded"):
        starter.start(spec)
    assert fallback.specs == [spec]
    assert starter.templates_started == 0
    starter.close()


def test_a_change_of_shared_environment_replaces_the_template_but_ranks_do_not(
    template: TemplateStarter, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    script = _write(tmp_path / "ok.py", "import os; print(os.environ['RANK'], os.environ['X'])\n")
    outputs = []
    runs = [("0", "0", "a"), ("1", "0", "a"), ("0", "1", "a"), ("0", "1", "b")]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for i, (rank, restart, x) in enumerate(runs):
            env = {**os.environ, "RANK": rank, "TORCHELASTIC_RESTART_COUNT": restart, "X": x}
            run = _run(template, tmp_path, _argv(str(script)), env=env, tag=str(i))
            outputs.append(run.out)
    assert outputs == ["0 a\n", "1 a\n", "0 a\n", "0 b\n"]
    assert template.templates_started == 2
    assert template.forked == 4
    assert (
        "the workers' shared environment changed (variables X); replacing the worker template"
        in caplog.messages
    )


def test_prepare_starts_the_template_without_waiting_for_its_imports(tmp_path: Path) -> None:
    _write(tmp_path / "lib" / "slow_import.py", "import time\ntime.sleep(1.0)\n")
    script = _write(tmp_path / "s.py", "import slow_import\nprint('up')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "lib")}
    with TemplateStarter(preload=["slow_import"]) as starter:
        t0 = time.monotonic()
        starter.prepare(ProcessSpec(0, env, argv=_argv(str(script))))
        assert time.monotonic() - t0 < 0.9
        assert starter.template_pid is not None
        run = _run(starter, tmp_path, _argv(str(script)), env=env)
        assert (run.code, run.out) == (0, "up\n")
        assert (starter.templates_started, starter.forked) == (1, 1)


def test_close_stops_the_template_and_is_idempotent(tmp_path: Path) -> None:
    starter = TemplateStarter()
    script = _write(tmp_path / "ok.py", "print('ok')\n")
    assert _run(starter, tmp_path, _argv(str(script))).code == 0
    pid = starter.template_pid
    assert pid is not None and pid_alive(pid)
    assert f"pid={pid}" in repr(starter)
    starter.close()
    starter.close()
    assert not pid_alive(pid)
    assert "closed" in repr(starter)


# --- what to preload -------------------------------------------------------------------


def test_default_preload_finds_torch_and_numpy_imported_at_module_level(tmp_path: Path) -> None:
    script = _write(
        tmp_path / "train.py",
        """\
        import os, json
        import torch
        import torch.distributed as dist
        from torch.utils.data import DataLoader
        try:
            import numpy as np
        except ImportError:
            np = None
        from . import sibling_is_ignored
        def later():
            import torchvision
        class Model:
            import torch.nn
        """,
    )
    argv = _argv(str(script), "--lr", "1")
    assert default_preload(argv) == ["torch", "torch.distributed", "torch.utils.data", "numpy"]


def test_default_preload_adds_what_ddp_imports_lazily(tmp_path: Path) -> None:
    ddp = _write(
        tmp_path / "ddp.py",
        """\
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP
        def main():
            return DDP(torch.nn.Linear(1, 1))
        """,
    )
    assert default_preload(_argv(str(ddp))) == [
        "torch", "torch.nn.parallel", "torch._dynamo"
    ]  # fmt: skip
    attr = _write(
        tmp_path / "attr.py", "import torch\nm = torch.nn.parallel.DistributedDataParallel\n"
    )
    assert default_preload(_argv(str(attr))) == ["torch", "torch._dynamo"]
    no_torch = _write(tmp_path / "plain.py", "DistributedDataParallel = 1\n")
    assert default_preload(_argv(str(no_torch))) == []


def test_default_preload_adds_what_an_optimizer_imports_lazily(tmp_path: Path) -> None:
    # A replacement worker builds its optimizer before it can take the newest commit:
    # torch._dynamo, imported there, costs it seconds.
    adam = _write(tmp_path / "adam.py", "import torch\nopt = torch.optim.Adam([])\n")
    assert default_preload(_argv(str(adam))) == ["torch", "torch._dynamo"]
    both = _write(
        tmp_path / "both.py",
        "import torch\nfrom torch.nn.parallel import DistributedDataParallel\n"
        "opt = torch.optim.SGD([])\n",
    )
    # Named once, though both uses import it (the start-up line listed it twice).
    assert default_preload(_argv(str(both))) == ["torch", "torch.nn.parallel", "torch._dynamo"]


def test_default_preload_adds_a_recovering_scripts_nested_imports_and_the_recovery(
    tmp_path: Path,
) -> None:
    # A script with in-process recovery starts a replacement at every failure: what it
    # imports inside its functions, and what a recovery imports, is on that path.
    script = _write(
        tmp_path / "recovering.py",
        """\
        import json
        import torch
        def main():
            import elastrun.inprocess as ip
            from elastrun.checkpoint import MemoryCheckpoint
            from torch.distributed.fsdp import fully_shard
            import yaml
        """,
    )
    assert default_preload(_argv(str(script))) == [
        "torch",
        "elastrun.inprocess",
        "elastrun.checkpoint",
        "torch.distributed.fsdp",
        "elastrun.inprocess.worker.sync",
        "elastrun.inprocess.worker.sharded",
    ]
    # Without elastrun.inprocess, nested imports stay where they are.
    plain = _write(tmp_path / "plain.py", "import torch\ndef f():\n    import numpy\n")
    assert default_preload(_argv(str(plain))) == ["torch"]


def test_default_preload_reads_a_module_relative_to_the_cwd(tmp_path: Path) -> None:
    _write(tmp_path / "pkg" / "train.py", "import numpy\n")
    assert default_preload(_argv("-m", "pkg.train"), cwd=str(tmp_path)) == ["numpy"]
    assert default_preload(_argv("-m", "pkg.missing"), cwd=str(tmp_path)) == []


def test_default_preload_is_empty_for_what_it_cannot_read(tmp_path: Path) -> None:
    broken = _write(tmp_path / "broken.py", "import torch\ndef (:\n")
    assert default_preload(_argv(str(broken))) == []
    assert default_preload(_argv(str(tmp_path / "missing.py"))) == []
    assert default_preload(("/bin/true",)) == []


def test_parse_bootstrap_command_keeps_interpreter_options() -> None:
    argv = (PY, "-u", "-X", "dev", "-W", "error", "-m", BOOT, "-m", "pkg", "a")
    assert parse_bootstrap_command(argv, PY) == BootstrapCommand(
        ("-u", "-X", "dev", "-W", "error"), ("-m", "pkg", "a")
    )
    assert parse_bootstrap_command((PY, "-m", BOOT), PY) is None
    assert parse_bootstrap_command((PY, "-u", "x.py"), PY) is None


def test_a_forked_worker_leaves_the_templates_objects_frozen_and_collects_its_own(
    template: TemplateStarter, tmp_path: Path
) -> None:
    # The template freezes what its imports left alive, so that the collections and the
    # exit of a worker do not write to (and copy) its pages; the worker's own garbage is
    # collected as in a fresh interpreter.
    script = _write(
        tmp_path / "gc_probe.py",
        """\
        import gc, json
        class Node:
            pass
        node = Node()
        node.me = node
        del node
        print(json.dumps({"frozen": gc.get_freeze_count(), "collected": gc.collect()}))
        """,
    )
    fresh, forked = _both(template, tmp_path, _argv(str(script)))
    assert json.loads(fresh.out)["frozen"] == 0
    assert json.loads(forked.out)["frozen"] > 1000, forked.out
    assert json.loads(fresh.out)["collected"] >= 1
    assert json.loads(forked.out)["collected"] >= 1


def test_a_worker_starts_fast_once_the_template_has_imported_its_modules(
    tmp_path: Path,
) -> None:
    # A stand-in for torch: a module that takes a noticeable time to import.
    _write(tmp_path / "lib" / "slow_import.py", "import time\ntime.sleep(1.0)\n")
    script = _write(tmp_path / "s.py", "import slow_import\nprint('up')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "lib")}
    with TemplateStarter(preload=["slow_import"]) as starter:
        _run(starter, tmp_path, _argv(str(script)), env=env, tag="warm-up")
        t0 = time.monotonic()
        run = _run(starter, tmp_path, _argv(str(script)), env=env, tag="fast")
        took = time.monotonic() - t0
    assert run.out == "up\n"
    assert took < 0.9, f"a forked start took {took:.2f}s"


def test_a_worker_writing_to_a_terminal_is_line_buffered_like_a_fresh_one(
    tmp_path: Path,
) -> None:
    # Without -u python line-buffers a terminal; the template's own stdout is not one.
    script = _write(
        tmp_path / "tty.py",
        """\
        import sys
        s = sys.stdout
        print(s.isatty(), s.line_buffering, s.write_through, type(s.buffer).__name__)
        """,
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    argv = (PY, "-m", BOOT, str(script))
    seen = []
    with TemplateStarter() as template:
        for starter in (SubprocessStarter(), template):
            master, slave = os.openpty()
            try:
                proc = starter.start(ProcessSpec(0, env, argv=argv, stdout_fd=slave))
                os.close(slave)
                slave = -1
                assert _wait(proc) == 0
                seen.append(os.read(master, 4096).decode())
            finally:
                os.close(master)
                if slave >= 0:
                    os.close(slave)
        assert template.forked == 1
    assert seen[0] == seen[1] == "True True False BufferedWriter\r\n"


def test_a_template_that_gains_a_thread_later_is_abandoned_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A preloaded module whose at-fork hook starts a thread in the template.
    _write(
        tmp_path / "lib" / "sneaky.py",
        """\
        import os, threading, time
        def _start():
            threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        os.register_at_fork(after_in_parent=_start)
        """,
    )
    script = _write(tmp_path / "ok.py", "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "lib")}
    with (
        caplog.at_level(logging.WARNING, logger=LOGGER),
        TemplateStarter(preload=["sneaky"]) as starter,
    ):
        runs = [_run(starter, tmp_path, _argv(str(script)), env=env, tag=str(i)) for i in range(3)]
        assert (starter.forked, starter.fell_back) == (1, 2)
        assert starter.template_pid is None
    assert [(r.code, r.out) for r in runs] == [(0, "ok\n")] * 3
    assert len(caplog.messages) == 1
    assert caplog.messages[0].startswith(
        "worker template disabled (the template now runs 1 extra thread(s)); "
        "starting workers as fresh processes"
    )


def test_declared_per_worker_variables_do_not_replace_the_template(tmp_path: Path) -> None:
    script = _write(tmp_path / "ok.py", "import os; print(os.environ['MY_RANK_FILE'])\n")
    with TemplateStarter(per_worker_variables=["MY_RANK_FILE"]) as starter:
        outs = [
            _run(
                starter,
                tmp_path,
                _argv(str(script)),
                env={**os.environ, "MY_RANK_FILE": f"f{i}"},
                tag=str(i),
            ).out
            for i in range(2)
        ]
        assert (starter.templates_started, starter.forked) == (1, 2)
    assert outs == ["f0\n", "f1\n"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to bind to one")
def test_a_forked_worker_is_bound_to_its_cpus_like_a_fresh_one(
    template: TemplateStarter, tmp_path: Path
) -> None:
    script = _write(tmp_path / "cpus.py", "import os; print(sorted(os.sched_getaffinity(0)))\n")
    cpu = min(os.sched_getaffinity(0))
    outs = []
    for starter in (SubprocessStarter(), template):
        with open(tmp_path / "out", "wb") as out:
            spec = ProcessSpec(
                0, dict(os.environ), argv=_argv(str(script)), stdout_fd=out.fileno(),
                cpus=frozenset({cpu}),
            )  # fmt: skip
            assert _wait(starter.start(spec)) == 0
        outs.append((tmp_path / "out").read_text())
    assert outs == [f"[{cpu}]\n"] * 2
    assert template.forked == 1


def _group_specs(
    tmp: Path, argvs: list[tuple[str, ...]], cwds: dict[int, Path] | None = None
) -> tuple[list[ProcessSpec], list[Path]]:
    """One spec per argv, each with its own stdout file (opened descriptors closed by
    the caller through ``_close``)."""
    specs, outs = [], []
    for lr, argv in enumerate(argvs):
        out = tmp / f"g{lr}.out"
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        cwd = (cwds or {}).get(lr)
        specs.append(
            ProcessSpec(
                lr,
                {**os.environ, "LOCAL_RANK": str(lr)},
                argv=argv,
                stdout_fd=fd,
                cwd=None if cwd is None else str(cwd),
            )
        )
        outs.append(out)
    return specs, outs


def _close(specs: list[ProcessSpec]) -> None:
    for spec in specs:
        assert spec.stdout_fd is not None
        os.close(spec.stdout_fd)


def test_a_group_is_forked_in_one_batch_and_no_worker_holds_another_workers_descriptors(
    template: TemplateStarter, tmp_path: Path
) -> None:
    probe = _write(tmp_path / "probe.py", PROBE)
    alone = _run(template, tmp_path, _argv(str(probe))).probe()
    specs, outs = _group_specs(tmp_path, [_argv(str(probe))] * 4)
    try:
        procs = template.start_many(specs)
    finally:
        _close(specs)
    assert [p.local_rank for p in procs] == [0, 1, 2, 3]
    assert [_wait(p) for p in procs] == [0, 0, 0, 0]
    assert (template.forked, template.fell_back, template.templates_started) == (5, 0, 1)
    probes = [json.loads(out.read_text()) for out in outs]
    assert [p["env"]["LOCAL_RANK"] for p in probes] == ["0", "1", "2", "3"]
    # Each worker holds what a worker started alone holds: nothing of the others
    # (their stdout files, the template's pipes to their intermediates).
    assert all(p["fds"] == alone["fds"] for p in probes), [p["fds"] for p in probes]
    assert {p["parent"] for p in probes} == {os.getpid()}


def test_a_group_with_a_worker_no_one_can_start_starts_none(
    template: TemplateStarter, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sleeper = _write(tmp_path / "sleep.py", "import time; time.sleep(60)\n")
    specs, _ = _group_specs(
        tmp_path, [_argv(str(sleeper))] * 3, cwds={1: tmp_path / "no" / "such" / "dir"}
    )
    before = children()
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER), pytest.raises(ProcessStartError):
            template.start_many(specs)
    finally:
        _close(specs)
    # Ranks 0 and 2 were forked, rank 1's fresh start failed: the forked two are gone.
    assert template.forked == 2 and template.fell_back == 1
    assert children() - {template.template_pid} == before
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "worker template could not start local rank 1"
    ]


def test_a_group_mixing_scripts_and_other_executables_keeps_its_order(
    template: TemplateStarter, tmp_path: Path
) -> None:
    script = _write(tmp_path / "ok.py", "import os; print('script', os.environ['LOCAL_RANK'])\n")
    echo = ("/bin/sh", "-c", 'echo binary "$LOCAL_RANK"')
    specs, outs = _group_specs(tmp_path, [_argv(str(script)), echo, _argv(str(script))])
    try:
        procs = template.start_many(specs)
    finally:
        _close(specs)
    assert [_wait(p) for p in procs] == [0, 0, 0]
    assert [out.read_text() for out in outs] == ["script 0\n", "binary 1\n", "script 2\n"]
    assert (template.forked, template.fell_back) == (2, 1)


def test_a_group_larger_than_one_batch_is_forked_batch_by_batch_in_order(
    template: TemplateStarter, tmp_path: Path
) -> None:
    n = BATCH_MAX + 6
    # One write per worker: print() under -u writes the line and its end separately.
    script = _write(
        tmp_path / "rank.py", "import os; os.write(1, os.environ['LOCAL_RANK'].encode() + b' ')\n"
    )
    out = tmp_path / "ranks.out"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        specs = [
            ProcessSpec(
                lr, {**os.environ, "LOCAL_RANK": str(lr)}, argv=_argv(str(script)), stdout_fd=fd
            )
            for lr in range(n)
        ]
        procs = template.start_many(specs)
    finally:
        os.close(fd)
    assert [p.local_rank for p in procs] == list(range(n))
    assert all(_wait(p) == 0 for p in procs)
    assert (template.forked, template.fell_back) == (n, 0)
    assert sorted(int(line) for line in out.read_text().split()) == list(range(n))


@pytest.fixture
def shutdown() -> Iterator[ShutdownRequest]:
    request = ShutdownRequest()
    try:
        yield request
    finally:
        request.close()


def test_a_signal_ends_the_wait_for_a_wedged_template_and_the_template_is_killed(
    tmp_path: Path, shutdown: ShutdownRequest
) -> None:
    script = _write(tmp_path / "ok.py", "print('ok')\n")
    with TemplateStarter(shutdown=shutdown) as starter:
        assert _run(starter, tmp_path, _argv(str(script))).code == 0  # the template is up
        pid = starter.template_pid
        assert pid is not None
        freeze(pid)  # wedged: it reads no request
        specs, _ = _group_specs(tmp_path, [_argv(str(script))] * 2)
        signalled: list[float] = []

        def signal_now() -> None:
            signalled.append(time.monotonic())
            shutdown.request(signal.SIGTERM)

        timer = threading.Timer(0.3, signal_now)
        timer.start()
        try:
            with pytest.raises(ShutdownRequested):
                starter.start_many(specs)
            ended = time.monotonic()
        finally:
            timer.cancel()
            _close(specs)
        # Seen at once, not after the 30 s a wedged template is otherwise given.
        assert ended - signalled[0] < 1.0
        assert starter.template_pid is None
        assert not pid_alive(pid)


def test_a_signal_before_the_start_starts_no_worker(
    tmp_path: Path, shutdown: ShutdownRequest
) -> None:
    script = _write(tmp_path / "ok.py", "print('ok')\n")
    with TemplateStarter(shutdown=shutdown) as starter:
        assert _run(starter, tmp_path, _argv(str(script))).code == 0
        pid = starter.template_pid
        before = children()
        shutdown.request(signal.SIGINT)
        specs, outs = _group_specs(tmp_path, [_argv(str(script))] * 2)
        try:
            with pytest.raises(ShutdownRequested):
                starter.start_many(specs)
        finally:
            _close(specs)
        assert starter.template_pid is None and pid is not None and not pid_alive(pid)
        # The workers the template had forked but not released end by themselves.
        wait_for(lambda: children() <= before - {pid}, 10, "the held-back workers to exit")
        assert [out.read_text() for out in outs] == ["", ""]


# Preloaded into the template: it stops itself (SIGSTOP) right after forking a batch's
# intermediates, before it reaps them or answers.
STALL_BEFORE_ANSWER = """
import os, signal
from elastrun.template.worker import fork

_fork = fork._fork_intermediates

def _stalled(*args):
    out = _fork(*args)
    if not isinstance(out, fork.Job):
        os.kill(os.getpid(), signal.SIGSTOP)
    return out

fork._fork_intermediates = _stalled
"""


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.parametrize("workers", [1, 4])
def test_a_batch_abandoned_midway_leaves_no_process_behind(
    tmp_path: Path,
    shutdown: ShutdownRequest,
    monkeypatch: pytest.MonkeyPatch,
    workers: int,
) -> None:
    # The template stalls after forking a batch's intermediates; they hand their
    # workers to the agent (a subreaper then) and exit, unreaped, before any answer.
    # Then a signal: the agent kills the template, whose intermediates come to it as
    # zombies too. It never learnt any of their pids from an answer, and must reap
    # them all before the start ends (they stayed its zombies for good).
    _write(tmp_path / "stall_answer.py", STALL_BEFORE_ANSWER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    before = children()

    def stalled_then_signalled(self: Template, timeout: float, sd: object) -> bool:
        wait_for(lambda: _stopped(self.pid), 30, "the template to stall")
        handed = lambda: len(children() - before - {self.pid}) == workers  # noqa: E731
        wait_for(handed, 30, "the workers to be handed over")
        shutdown.request(signal.SIGTERM)
        return False

    monkeypatch.setattr(Template, "_await_answer", stalled_then_signalled)
    script = _write(tmp_path / "ok.py", "print('ok')\n")
    with TemplateStarter(preload=["stall_answer"], shutdown=shutdown) as starter:
        specs, outs = _group_specs(tmp_path, [_argv(str(script))] * workers)
        try:
            with pytest.raises(ShutdownRequested):
                starter.start_many(specs)
        finally:
            _close(specs)
        assert starter.template_pid is None
        # Reaped by the time the start has ended: no zombie, nothing still running.
        assert children() == before
        assert [out.read_text() for out in outs] == [""] * workers


def test_workers_the_killed_template_had_released_are_returned_to_be_stopped(
    tmp_path: Path, shutdown: ShutdownRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The signal is seen just after the template answered: its answer is still read,
    # so the agent knows (and will stop) every worker that may run.
    def answered_then_signalled(self: Template, timeout: float, sd: object) -> bool:
        select.select([self._sock], [], [], timeout)
        shutdown.request(signal.SIGTERM)
        return False

    monkeypatch.setattr(Template, "_await_answer", answered_then_signalled)
    script = _write(tmp_path / "ok.py", "print('ok')\n")
    with TemplateStarter(shutdown=shutdown) as starter:
        specs, _ = _group_specs(tmp_path, [_argv(str(script))] * 3)
        try:
            procs = starter.start_many(specs)
        finally:
            _close(specs)
        assert starter.template_pid is None  # killed
        assert [p.local_rank for p in procs] == [0, 1, 2]
        assert {p.pid for p in procs} <= children()
        # Each ran (go-ahead sent before the kill) or exited for want of it.
        assert all(_wait(p) in (0, 1) for p in procs)

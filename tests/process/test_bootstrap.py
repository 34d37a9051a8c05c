"""The worker bootstrap, run as the agent runs it: ``python -u -m elastrun.worker.bootstrap``.

Most tests are differential: the same script is run once under plain ``python -u`` and
once under the bootstrap, and what the script sees (argv, __main__, sys.path, exit code,
stderr) must be the same.
"""

from __future__ import annotations

import json
import os
import py_compile
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ENV_VAR = "TORCHELASTIC_ERROR_FILE"
BOOTSTRAP = [sys.executable, "-u", "-m", "elastrun.worker.bootstrap"]
PLAIN = [sys.executable, "-u"]

# What a script can observe about how it was started.
PROBE = """\
import json, sys
main = sys.modules["__main__"]
print(json.dumps({
    "argv": sys.argv,
    "name": __name__,
    "file": __file__,
    "path0": sys.path[0],
    "globals": sorted(globals()),
    "package": __package__,
    "spec": getattr(__spec__, "name", None),
    "loader": type(__loader__).__name__,
    "cached": __cached__,
    "main_is_me": main.__dict__ is globals(),
    "builtins_is_module": type(__builtins__).__name__,
    "orig_argv": sys.orig_argv[1:],
}))
"""


def _env(error_file: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop(ENV_VAR, None)
    env.pop("PYTHONFAULTHANDLER", None)
    if error_file is not None:
        env[ENV_VAR] = str(error_file)
    return env


def _run(
    argv: list[str], cwd: Path, error_file: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        cwd=cwd,
        env=_env(error_file),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _script(directory: Path, name: str, body: str) -> Path:
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(body))
    return path


def _probe(result: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert result.returncode == 0, result.stderr
    probe: dict[str, object] = json.loads(result.stdout)
    return probe


# --- what the script sees --------------------------------------------------------------


def test_script_sees_the_same_main_module_and_argv_as_under_plain_python(tmp_path: Path) -> None:
    _script(tmp_path, "sub/probe.py", PROBE)
    args = ["sub/probe.py", "--lr", "0.1", "-m", "x"]
    plain = _probe(_run([*PLAIN, *args], tmp_path))
    booted = _probe(_run([*BOOTSTRAP, *args], tmp_path))
    assert booted == plain
    assert booted["argv"] == args
    assert booted["name"] == "__main__"
    assert booted["file"] == str(tmp_path / "sub" / "probe.py")
    assert booted["path0"] == str(tmp_path / "sub")
    assert booted["main_is_me"] is True
    assert booted["orig_argv"] == ["-u", *args]


def test_script_path_through_a_symlink_matches_plain_python(tmp_path: Path) -> None:
    _script(tmp_path, "real/probe.py", PROBE)
    (tmp_path / "link.py").symlink_to(tmp_path / "real" / "probe.py")
    plain = _probe(_run([*PLAIN, "link.py"], tmp_path))
    booted = _probe(_run([*BOOTSTRAP, "link.py"], tmp_path))
    assert booted == plain
    assert booted["path0"] == str(tmp_path / "real")  # symlink resolved, as python does
    assert booted["file"] == str(tmp_path / "link.py")


def test_module_mode_sees_the_same_as_python_dash_m(tmp_path: Path) -> None:
    _script(tmp_path, "pkg/__init__.py", "")
    _script(tmp_path, "pkg/probe.py", PROBE)
    plain = _probe(_run([*PLAIN, "-m", "pkg.probe", "a", "b"], tmp_path))
    booted = _probe(_run([*BOOTSTRAP, "-m", "pkg.probe", "a", "b"], tmp_path))
    assert booted == plain
    assert booted["argv"] == [str(tmp_path / "pkg" / "probe.py"), "a", "b"]
    assert booted["spec"] == "pkg.probe"
    assert booted["path0"] == str(tmp_path)
    assert booted["orig_argv"] == ["-u", "-m", "pkg.probe", "a", "b"]


def test_directory_with_main_module_runs_as_under_plain_python(tmp_path: Path) -> None:
    _script(tmp_path, "app/__main__.py", PROBE)
    plain = _probe(_run([*PLAIN, "app", "x"], tmp_path))
    booted = _probe(_run([*BOOTSTRAP, "app", "x"], tmp_path))
    assert booted == plain


def test_compiled_script_runs_as_under_plain_python(tmp_path: Path) -> None:
    source = _script(tmp_path, "src_probe.py", PROBE)
    py_compile.compile(str(source), cfile=str(tmp_path / "probe.pyc"), doraise=True)
    plain = _probe(_run([*PLAIN, "probe.pyc", "x"], tmp_path))
    booted = _probe(_run([*BOOTSTRAP, "probe.pyc", "x"], tmp_path))
    assert booted == plain
    assert booted["loader"] == "SourcelessFileLoader"


def test_script_does_not_inherit_the_bootstraps_future_imports(tmp_path: Path) -> None:
    _script(
        tmp_path,
        "ann.py",
        """\
        def f(x: int) -> int:
            return x
        print(type(f.__annotations__["x"]).__name__)
        """,
    )
    result = _run([*BOOTSTRAP, "ann.py"], tmp_path)
    assert result.stdout.strip() == "type"  # evaluated, not a postponed string


def test_classes_defined_in_the_script_pickle_during_the_run_and_at_exit(tmp_path: Path) -> None:
    _script(
        tmp_path,
        "pick.py",
        """\
        import atexit, pickle

        class Point:
            def __init__(self, x):
                self.x = x

        def at_exit():
            print("atexit", pickle.loads(pickle.dumps(Point(2))).x)

        atexit.register(at_exit)
        print("run", pickle.loads(pickle.dumps(Point(1))).x)
        """,
    )
    result = _run([*BOOTSTRAP, "pick.py"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["run 1", "atexit 2"]


MP_SCRIPT = """\
import multiprocessing as mp

class Item:
    def __init__(self, x):
        self.x = x

def double(item):
    return item.x * 2

if __name__ == "__main__":
    with mp.get_context("spawn").Pool(1) as pool:
        print(pool.map(double, [Item(1), Item(2)]))
"""


def test_multiprocessing_spawn_from_the_script_works(tmp_path: Path) -> None:
    _script(tmp_path, "mpspawn.py", MP_SCRIPT)
    result = _run([*BOOTSTRAP, "mpspawn.py"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[2, 4]"


def test_multiprocessing_spawn_from_a_module_works(tmp_path: Path) -> None:
    _script(tmp_path, "mpkg/__init__.py", "")
    _script(tmp_path, "mpkg/spawner.py", MP_SCRIPT)
    result = _run([*BOOTSTRAP, "-m", "mpkg.spawner"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[2, 4]"


def test_faulthandler_is_enabled_for_the_script(tmp_path: Path) -> None:
    _script(tmp_path, "fh.py", "import faulthandler; print(faulthandler.is_enabled())")
    assert _run([*BOOTSTRAP, "fh.py"], tmp_path).stdout.strip() == "True"


def test_native_crash_leaves_a_python_stack_on_stderr(tmp_path: Path) -> None:
    _script(
        tmp_path,
        "crash.py",
        """\
        import ctypes
        def crash():
            ctypes.string_at(0)
        crash()
        """,
    )
    result = _run([*BOOTSTRAP, "crash.py"], tmp_path)
    assert result.returncode == -signal.SIGSEGV
    assert "Fatal Python error: Segmentation fault" in result.stderr
    assert f'File "{tmp_path / "crash.py"}", line 3 in crash' in result.stderr


# --- exits and failures -------------------------------------------------------------------

EXIT_SCRIPTS = {
    "sys_exit_3": "import sys; sys.exit(3)",
    "sys_exit_message": "import sys; sys.exit('fatal: bad config')",
    "sys_exit_none": "import sys; sys.exit()",
    "exception": """\
        def main():
            try:
                {}["missing"]
            except KeyError as exc:
                raise RuntimeError("wrapped") from exc
        main()
        """,
    "keyboard_interrupt": "raise KeyboardInterrupt",
    "syntax_error": "x = 1\ndef (:\n",
    "custom_excepthook": """\
        import sys
        sys.excepthook = lambda t, v, tb: print("hook:", t.__name__, v, file=sys.stderr)
        raise ValueError("handled by hook")
        """,
    "atexit_after_exception": """\
        import atexit
        atexit.register(lambda: print("atexit ran"))
        raise ValueError("boom")
        """,
}


@pytest.mark.parametrize("case", sorted(EXIT_SCRIPTS))
def test_exit_code_stdout_and_stderr_match_plain_python(tmp_path: Path, case: str) -> None:
    _script(tmp_path, "job.py", EXIT_SCRIPTS[case])
    plain = _run([*PLAIN, "job.py"], tmp_path)
    booted = _run([*BOOTSTRAP, "job.py"], tmp_path)
    assert (booted.returncode, booted.stdout, booted.stderr) == (
        plain.returncode,
        plain.stdout,
        plain.stderr,
    )


def test_exit_codes_are_those_of_python(tmp_path: Path) -> None:
    codes = {}
    for case in ("sys_exit_3", "exception", "keyboard_interrupt", "sys_exit_none"):
        _script(tmp_path, f"{case}.py", EXIT_SCRIPTS[case])
        codes[case] = _run([*BOOTSTRAP, f"{case}.py"], tmp_path).returncode
    assert codes == {
        "sys_exit_3": 3,
        "exception": 1,
        "keyboard_interrupt": -signal.SIGINT,
        "sys_exit_none": 0,
    }


def test_missing_script_fails_like_python(tmp_path: Path) -> None:
    plain = _run([*PLAIN, "nope.py"], tmp_path)
    booted = _run([*BOOTSTRAP, "nope.py"], tmp_path)
    assert booted.returncode == plain.returncode == 2
    assert booted.stderr == plain.stderr


def test_missing_module_fails_like_python(tmp_path: Path) -> None:
    plain = _run([*PLAIN, "-m", "no_such_module_here"], tmp_path)
    booted = _run([*BOOTSTRAP, "-m", "no_such_module_here"], tmp_path)
    assert booted.returncode == plain.returncode == 1
    assert booted.stderr == plain.stderr


def test_without_arguments_prints_usage_and_exits_2(tmp_path: Path) -> None:
    result = _run(BOOTSTRAP, tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("usage:")


def test_module_traceback_starts_at_the_module(tmp_path: Path) -> None:
    _script(tmp_path, "mods/__init__.py", "")
    _script(tmp_path, "mods/fail.py", "raise ValueError('from module')\n")
    result = _run([*BOOTSTRAP, "-m", "mods.fail"], tmp_path)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "Traceback (most recent call last):",
        f'  File "{tmp_path / "mods" / "fail.py"}", line 1, in <module>',
        "    raise ValueError('from module')",
        "ValueError: from module",
    ]
    assert "runpy" not in result.stderr and "bootstrap" not in result.stderr


# --- the error file -------------------------------------------------------------------------


def test_uncaught_exception_is_written_to_the_error_file(tmp_path: Path) -> None:
    _script(
        tmp_path,
        "train.py",
        """\
        def main():
            raise ValueError("boom at step 7")

        main()
        """,
    )
    error_file = tmp_path / "logs" / "0" / "error.json"
    result = _run([*BOOTSTRAP, "train.py"], tmp_path, error_file)
    assert result.returncode == 1
    message = json.loads(error_file.read_text())["message"]
    assert message["message"] == "ValueError: boom at step 7"
    callstack = message["extraInfo"]["py_callstack"]
    assert callstack.startswith("Traceback (most recent call last):\n")
    assert f'File "{tmp_path / "train.py"}", line 2, in main' in callstack
    assert "bootstrap" not in callstack and "runpy" not in callstack
    assert int(message["extraInfo"]["timestamp"]) > 0
    # The recorded traceback is the one printed.
    assert result.stderr == callstack


def test_uncaught_exception_in_module_mode_is_written(tmp_path: Path) -> None:
    _script(tmp_path, "mm/__init__.py", "")
    _script(tmp_path, "mm/job.py", "raise OSError('disk gone')\n")
    error_file = tmp_path / "error.json"
    assert _run([*BOOTSTRAP, "-m", "mm.job"], tmp_path, error_file).returncode == 1
    message = json.loads(error_file.read_text())["message"]
    assert message["message"] == "OSError: disk gone"


def test_syntax_error_in_the_script_is_written(tmp_path: Path) -> None:
    _script(tmp_path, "bad.py", EXIT_SCRIPTS["syntax_error"])
    error_file = tmp_path / "error.json"
    assert _run([*BOOTSTRAP, "bad.py"], tmp_path, error_file).returncode == 1
    message = json.loads(error_file.read_text())["message"]
    assert message["message"].startswith("SyntaxError: invalid syntax")
    assert "bad.py" in message["extraInfo"]["py_callstack"]


def test_existing_error_file_is_not_overwritten(tmp_path: Path) -> None:
    _script(tmp_path, "job.py", "raise ValueError('late')\n")
    error_file = tmp_path / "error.json"
    error_file.write_text('{"message": "written by the script\'s own record"}')
    assert _run([*BOOTSTRAP, "job.py"], tmp_path, error_file).returncode == 1
    assert json.loads(error_file.read_text()) == {"message": "written by the script's own record"}


@pytest.mark.parametrize("case", ["sys_exit_3", "sys_exit_message", "keyboard_interrupt"])
def test_exits_that_are_not_exceptions_write_no_error_file(tmp_path: Path, case: str) -> None:
    _script(tmp_path, "job.py", EXIT_SCRIPTS[case])
    error_file = tmp_path / "error.json"
    result = _run([*BOOTSTRAP, "job.py"], tmp_path, error_file)
    assert result.returncode != 0
    assert not error_file.exists()


def test_no_error_file_variable_writes_nothing_and_still_fails(tmp_path: Path) -> None:
    _script(tmp_path, "job.py", "raise ValueError('x')\n")
    result = _run([*BOOTSTRAP, "job.py"], tmp_path)
    assert result.returncode == 1
    assert sorted(os.listdir(tmp_path)) == ["job.py"]


def test_unwritable_error_file_is_reported_without_hiding_the_exception(tmp_path: Path) -> None:
    _script(tmp_path, "job.py", "raise ValueError('the real error')\n")
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    result = _run([*BOOTSTRAP, "job.py"], tmp_path, blocker / "error.json")
    assert result.returncode == 1
    assert "elastrun bootstrap: could not write error file" in result.stderr
    assert result.stderr.rstrip().endswith("ValueError: the real error")


# --- a SIGINT while the bootstrap sets itself up -----------------------------------------

SHOWS_ITS_SIGINT_HANDLER = """\
import signal
print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, flush=True)
"""


def _caught_signals(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        line = next(ln for ln in fh if ln.startswith("SigCgt:"))
    return int(line.split()[1], 16)


@pytest.mark.parametrize("interrupt", [False, True])
def test_a_sigint_during_the_setup_ends_the_worker_and_the_script_gets_pythons_handler(
    tmp_path: Path, interrupt: bool
) -> None:
    # The setup opens the stacks file; a FIFO holds it there (an open for writing waits
    # for a reader). Meanwhile SIGINT must have its default disposition: python's
    # handler would raise KeyboardInterrupt wherever the setup is, and raised in the
    # import system's cleanup callbacks it was printed as "ignored" and lost, the worker
    # running on until its agent killed it.
    script = _script(tmp_path, "shows.py", SHOWS_ITS_SIGINT_HANDLER)
    fifo = tmp_path / "stacks"
    os.mkfifo(fifo)
    env = {**_env(), "ELASTRUN_STACKS_FILE": str(fifo)}
    proc = subprocess.Popen(
        [*BOOTSTRAP, str(script)], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not _opening_a_fifo(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _opening_a_fifo(proc.pid), "the bootstrap never reached the stacks file"
        assert not _caught_signals(proc.pid) & (1 << (signal.SIGINT - 1))
        if interrupt:
            proc.send_signal(signal.SIGINT)
            assert proc.wait(10) == -signal.SIGINT
        else:
            with open(fifo):  # the reader: the setup goes on, then the script runs
                out, err = proc.communicate(timeout=30)
            assert (proc.returncode, out) == (0, "True\n"), err
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _opening_a_fifo(pid: int) -> bool:
    """Whether ``pid`` sleeps in the kernel's open of a FIFO, waiting for the other end
    (``wait_for_partner``; older kernels name the FIFO's own function)."""
    try:
        with open(f"/proc/{pid}/wchan") as fh:
            wchan = fh.read()
    except OSError:
        return False
    return wchan == "wait_for_partner" or "fifo" in wchan


# Prints whether SIGINT is blocked and whether the starter's variable is set.
SIGINT_STATE = """\
import os, signal
print(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []),
      "ELASTRUN_SIGINT_HELD" in os.environ, flush=True)
"""


def _start_and_read(argv: list[str], tmp_path: Path) -> str:
    from elastrun.supervise.processes.spawn import ProcessSpec, SubprocessStarter

    r, w = os.pipe()
    proc = SubprocessStarter().start(
        ProcessSpec(0, dict(os.environ), argv=tuple(argv), stdout_fd=w)
    )
    os.close(w)
    with os.fdopen(r) as out:
        line = out.read().strip()
    select.select([proc.exit_fd()], [], [], 30)
    assert proc.poll() == 0, line
    proc.release()
    return line


def test_a_fresh_worker_starts_with_sigint_held_until_its_bootstrap_can_take_it(
    tmp_path: Path,
) -> None:
    # A SIGINT between the interpreter's start and the bootstrap's set-up must not be
    # lost in an import: the starter blocks it across exec; the bootstrap unblocks it
    # once the default disposition is in place, and the script sees neither the block
    # nor the starter's variable.
    script = _script(tmp_path, "state.py", SIGINT_STATE)
    assert _start_and_read([*BOOTSTRAP, str(script)], tmp_path) == "False False"
    # Before the bootstrap runs (a command that names it but runs other code first):
    held = [sys.executable, "-c", SIGINT_STATE, "-m", "elastrun.worker.bootstrap"]
    assert _start_and_read(held, tmp_path) == "True True"
    # Any other command starts as it would anyway.
    assert _start_and_read([*PLAIN, str(script)], tmp_path) == "False False"

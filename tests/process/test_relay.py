"""The output relay with real child processes: files, console, filters, draining, bounds."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastrun.core.errors import ElastrunError
from elastrun.supervise.processes.logs import DefaultLogsSpecs, LogsDest, Std
from elastrun.supervise.processes.relay import (
    MAX_LINE,
    PYTHON_CONSOLE,
    FdConsole,
    OutputRelay,
    WorkerStdio,
)

PY = sys.executable


def _open_fds() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/fd")}


@pytest.fixture(autouse=True)
def no_fd_leak() -> Iterator[None]:
    before = _open_fds()
    yield
    # listdir itself opens one fd, present in both snapshots.
    assert _open_fds() - before == set()


class Console:
    """A file standing in for the launcher's console stdout and stderr."""

    def __init__(self, tmp: Path) -> None:
        self.out_path = tmp / "console_out"
        self.err_path = tmp / "console_err"
        self.out = os.open(self.out_path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self.err = os.open(self.err_path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def close(self) -> None:
        os.close(self.out)
        os.close(self.err)

    def stdout(self) -> bytes:
        return self.out_path.read_bytes()

    def stderr(self) -> bytes:
        return self.err_path.read_bytes()


@pytest.fixture
def console(tmp_path: Path) -> Iterator[Console]:
    c = Console(tmp_path)
    yield c
    c.close()


def relay_for(console: Console, **kw: object) -> OutputRelay:
    # arg-type: kw: object, the options each test passes
    return OutputRelay(console=FdConsole(console.out, console.err), **kw)  # type: ignore[arg-type]


def start(code: str, stdio: WorkerStdio, **kw: object) -> subprocess.Popen[bytes]:
    try:
        return subprocess.Popen(  # type: ignore[call-overload, no-any-return]  # **kw: object
            [PY, "-c", code], stdout=stdio.stdout_fd, stderr=stdio.stderr_fd, **kw
        )
    finally:
        stdio.close_in_parent()


def run(code: str, stdio: WorkerStdio) -> None:
    proc = start(code, stdio)
    assert proc.wait(timeout=60) == 0


def tee_dest(tmp: Path, ranks: range, *, out: bool = True, err: bool = True) -> LogsDest:
    dest = LogsDest(
        filtered_stdout=str(tmp / "filtered_stdout.log"),
        filtered_stderr=str(tmp / "filtered_stderr.log"),
    )
    for lr in ranks:
        (tmp / str(lr)).mkdir()
        o, e = str(tmp / str(lr) / "stdout.log"), str(tmp / str(lr) / "stderr.log")
        dest.stdouts[lr] = o if out else ""
        dest.stderrs[lr] = e if err else ""
        if out:
            dest.tee_stdouts[lr] = o
        if err:
            dest.tee_stderrs[lr] = e
    return dest


WRITE_BOTH = (
    "import os\n"
    "os.write(1, b'out line 1\\nout \\xff\\xfe raw\\nno newline at end')\n"
    "os.write(2, b'err line\\n')\n"
)


def test_tee_writes_exact_bytes_to_files_and_prefixed_lines_to_console(
    tmp_path: Path, console: Console
) -> None:
    dest = tee_dest(tmp_path, range(1))
    relay = relay_for(console)
    run(WRITE_BOTH, relay.wire(0, dest, "[default0]:", show_on_console=True))
    relay.close()
    assert Path(dest.stdouts[0]).read_bytes() == b"out line 1\nout \xff\xfe raw\nno newline at end"
    assert Path(dest.stderrs[0]).read_bytes() == b"err line\n"
    assert console.stdout() == (
        b"[default0]:out line 1\n[default0]:out \xff\xfe raw\n[default0]:no newline at end\n"
    )
    assert console.stderr() == b"[default0]:err line\n"


def test_lines_end_at_newline_crlf_or_lone_cr_and_keep_their_terminator(
    tmp_path: Path, console: Console
) -> None:
    dest = tee_dest(tmp_path, range(1), err=False)
    relay = relay_for(console)
    # "\r" at the end of the first write must wait: a "\n" follows in the second one.
    code = (
        "import os, time\n"
        "os.write(1, b'10%\\r20%\\r')\n"
        "time.sleep(0.05)\n"
        "os.write(1, b'\\ndone\\n')\n"
    )
    run(code, relay.wire(0, dest, "P:", show_on_console=True))
    relay.close()
    assert console.stdout() == b"P:10%\rP:20%\r\nP:done\n"


def test_line_longer_than_the_limit_is_shown_in_prefixed_pieces(
    tmp_path: Path, console: Console
) -> None:
    dest = tee_dest(tmp_path, range(1), err=False)
    relay = relay_for(console)
    size = MAX_LINE * 3 + 100
    run(
        f"import sys\nsys.stdout.write('x' * {size})\n",
        relay.wire(0, dest, "P:", show_on_console=True),
    )
    relay.close()
    assert Path(dest.stdouts[0]).read_bytes() == b"x" * size
    lines = console.stdout().split(b"\n")
    assert lines[-1] == b""
    pieces = lines[:-1]
    assert all(p.startswith(b"P:") for p in pieces)
    assert all(len(p) <= len(b"P:") + MAX_LINE for p in pieces)
    assert b"".join(p[2:] for p in pieces) == b"x" * size


def test_large_output_from_several_ranks_is_not_lost_and_never_interleaves_mid_line(
    tmp_path: Path, console: Console
) -> None:
    nranks, nlines = 2, 40_000  # about 2.7 MB per rank, on both streams
    dest = tee_dest(tmp_path, range(nranks))
    relay = relay_for(console)
    code = (
        "import sys\n"
        "lr = sys.argv[1]\n"
        "line = 'rank ' + lr + ' line {:06d} ' + 'y' * 40 + '\\n'\n"
        f"out = ''.join(line.format(i) for i in range({nlines}))\n"
        "sys.stdout.write(out)\n"
        "sys.stderr.write(out[: len(out) // 2])\n"
    )
    procs = []
    for lr in range(nranks):
        stdio = relay.wire(lr, dest, f"[r{lr}]:", show_on_console=True)
        try:
            procs.append(
                subprocess.Popen(
                    [PY, "-c", code, str(lr)], stdout=stdio.stdout_fd, stderr=stdio.stderr_fd
                )
            )
        finally:
            stdio.close_in_parent()
    for proc in procs:
        assert proc.wait(timeout=60) == 0
    relay.close(timeout=30)

    console_lines = console.stdout().splitlines()
    assert len(console_lines) == nranks * nlines
    for lr in range(nranks):
        expected = [f"rank {lr} line {i:06d} ".encode() + b"y" * 40 for i in range(nlines)]
        assert Path(dest.stdouts[lr]).read_bytes() == b"".join(x + b"\n" for x in expected)
        prefix = f"[r{lr}]:".encode()
        mine = [line[len(prefix) :] for line in console_lines if line.startswith(prefix)]
        assert mine == expected  # complete, in order, each line whole
    assert len(console.stderr().splitlines()) == nranks * (nlines // 2)


def test_redirect_only_gives_the_file_to_the_child_without_the_relay(
    tmp_path: Path, console: Console
) -> None:
    specs = DefaultLogsSpecs(log_dir=str(tmp_path), redirects=Std.ALL)
    dest = specs.reify({0: {"TORCHELASTIC_RUN_ID": "r"}})
    relay = relay_for(console)
    stdio = relay.wire(0, dest, "[x]:", show_on_console=True)
    assert stdio.stdout_fd is not None
    assert stdio.stderr_fd is not None
    run(WRITE_BOTH, stdio)
    assert "thread=none" in repr(relay)
    relay.close()
    assert Path(dest.stdouts[0]).read_bytes() == b"out line 1\nout \xff\xfe raw\nno newline at end"
    assert Path(dest.stderrs[0]).read_bytes() == b"err line\n"
    assert console.stdout() == b""
    assert console.stderr() == b""


def test_neither_redirected_nor_teed_is_inherited_when_shown_and_discarded_when_hidden(
    tmp_path: Path, console: Console
) -> None:
    dest = LogsDest(stdouts={0: "", 1: ""}, stderrs={0: "", 1: ""})
    relay = relay_for(console)
    shown = relay.wire(0, dest, "", show_on_console=True)
    assert (shown.stdout_fd, shown.stderr_fd) == (None, None)
    hidden = relay.wire(1, dest, "", show_on_console=False)
    try:
        assert hidden.stdout_fd is not None
        assert hidden.stderr_fd is not None
        devnull = os.stat(os.devnull)
        for fd in (hidden.stdout_fd, hidden.stderr_fd):
            st = os.fstat(fd)
            assert stat.S_ISCHR(st.st_mode)
            assert st.st_rdev == devnull.st_rdev
            assert not os.get_inheritable(fd)
    finally:
        hidden.close_in_parent()
        hidden.close_in_parent()  # idempotent
    relay.close()


def test_ranks_hidden_by_the_filter_still_write_files_but_not_the_console(
    tmp_path: Path, console: Console
) -> None:
    dest = tee_dest(tmp_path, range(2))
    relay = relay_for(console, stdout_filters=["line"], filtered_stdout=dest.filtered_stdout)
    code = "import os, sys\nos.write(1, b'line from ' + sys.argv[1].encode() + b'\\n')\n"
    for lr in range(2):
        stdio = relay.wire(lr, dest, f"[{lr}]:", show_on_console=lr == 1)
        try:
            proc = subprocess.Popen([PY, "-c", code, str(lr)], stdout=stdio.stdout_fd)
        finally:
            stdio.close_in_parent()
        assert proc.wait(timeout=60) == 0
    relay.close()
    assert Path(dest.stdouts[0]).read_bytes() == b"line from 0\n"
    assert Path(dest.stdouts[1]).read_bytes() == b"line from 1\n"
    assert console.stdout() == b"[1]:line from 1\n"
    assert Path(dest.filtered_stdout).read_bytes() == b"[1]:line from 1\n"


def test_duplicate_filters_copy_matching_prefixed_lines_of_teed_streams(
    tmp_path: Path, console: Console
) -> None:
    dest = tee_dest(tmp_path, range(1))
    relay = relay_for(
        console,
        filtered_stdout=dest.filtered_stdout,
        filtered_stderr=dest.filtered_stderr,
        stdout_filters=["apple", "or,ange"],
        stderr_filters=["nothing matches this"],
    )
    code = (
        "import os\n"
        "os.write(1, b'an apple\\na pear\\nan or,ange\\nlast apple')\n"
        "os.write(2, b'apple on stderr\\n')\n"
    )
    run(code, relay.wire(0, dest, "<0> ", show_on_console=True))
    relay.close()
    assert (
        Path(dest.filtered_stdout).read_bytes() == b"<0> an apple\n<0> an or,ange\n<0> last apple\n"
    )
    # Filters are set for stderr, so its file exists (as with torchrun), but nothing matched.
    assert Path(dest.filtered_stderr).read_bytes() == b""


def test_no_filtered_file_without_filters(tmp_path: Path, console: Console) -> None:
    dest = tee_dest(tmp_path, range(1))
    relay = relay_for(console, filtered_stdout=dest.filtered_stdout)
    run(WRITE_BOTH, relay.wire(0, dest, "", show_on_console=True))
    relay.close()
    assert not Path(dest.filtered_stdout).exists()


def test_close_waits_for_a_worker_that_is_still_writing(tmp_path: Path, console: Console) -> None:
    dest = tee_dest(tmp_path, range(1), err=False)
    relay = relay_for(console)
    code = "import os, time\ntime.sleep(0.3)\nos.write(1, b'late line\\n')\n"
    proc = start(code, relay.wire(0, dest, "", show_on_console=True))
    relay.close(timeout=30)  # returns once the worker's pipe is closed
    assert console.stdout() == b"late line\n"
    assert proc.wait(timeout=60) == 0


def test_close_is_bounded_when_a_grandchild_holds_the_pipe(
    tmp_path: Path, console: Console
) -> None:
    dest = tee_dest(tmp_path, range(1), err=False)
    relay = relay_for(console)
    code = (
        "import os, subprocess\n"
        "subprocess.Popen(['sleep', '60'])\n"  # inherits stdout: the pipe's write end
        "os.write(1, b'parent done\\npartial')\n"
    )
    proc = start(code, relay.wire(0, dest, "P:", show_on_console=True), start_new_session=True)
    try:
        assert proc.wait(timeout=60) == 0
        began = time.monotonic()
        relay.close(timeout=0.3)
        elapsed = time.monotonic() - began
        assert 0.25 <= elapsed < 3.0
        assert console.stdout() == b"P:parent done\nP:partial\n"
        assert Path(dest.stdouts[0]).read_bytes() == b"parent done\npartial"
    finally:
        # The grandchild is in the worker's process group, which we created.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_close_is_idempotent_and_wire_after_close_fails(tmp_path: Path, console: Console) -> None:
    dest = tee_dest(tmp_path, range(1))
    relay = relay_for(console)
    run(WRITE_BOTH, relay.wire(0, dest, "", show_on_console=True))
    relay.close()
    relay.close()
    assert "closing" in repr(relay)
    with pytest.raises(ElastrunError, match="closed"):
        relay.wire(0, dest, "", show_on_console=True)


def test_close_without_any_stream_closes_the_filtered_files(
    tmp_path: Path, console: Console
) -> None:
    dest = LogsDest(
        stdouts={0: ""}, stderrs={0: ""}, filtered_stdout=str(tmp_path / "filtered_stdout.log")
    )
    relay = relay_for(console, filtered_stdout=dest.filtered_stdout, stdout_filters=["x"])
    assert relay.wire(0, dest, "", show_on_console=True) == WorkerStdio(None, None)
    relay.close()  # the fd-leak fixture checks that the filtered file was closed
    assert Path(dest.filtered_stdout).exists()


def test_wire_failure_leaves_nothing_open(
    tmp_path: Path, console: Console, monkeypatch: pytest.MonkeyPatch
) -> None:
    dest = tee_dest(tmp_path, range(1))
    real_pipe2 = os.pipe2
    calls: list[int] = []

    def pipe2_fails_the_second_time(flags: int) -> tuple[int, int]:
        calls.append(flags)
        if len(calls) == 2:
            raise OSError(24, "Too many open files")
        return real_pipe2(flags)

    monkeypatch.setattr(os, "pipe2", pipe2_fails_the_second_time)
    relay = relay_for(console)
    with pytest.raises(OSError, match="Too many open files"):
        relay.wire(0, dest, "", show_on_console=True)
    relay.close()  # the stdout stream's pipe and log file were closed (fd-leak fixture)


def test_a_log_file_that_cannot_be_opened_goes_to_the_console_prefixed(
    tmp_path: Path, console: Console, caplog: pytest.LogCaptureFixture
) -> None:
    dest = tee_dest(tmp_path, range(2), out=False)
    missing = tmp_path / "removed"
    for lr in (0, 1):
        # Redirected only: these streams would not reach the console otherwise.
        dest.stderrs[lr] = str(missing / str(lr) / "stderr.log")
    dest.tee_stderrs.clear()
    relay = relay_for(console)
    run(WRITE_BOTH, relay.wire(0, dest, "[r0]:", show_on_console=False))
    run(WRITE_BOTH, relay.wire(1, dest, "[r1]:", show_on_console=True))
    relay.close()
    assert console.stderr() == b"[r0]:err line\n[r1]:err line\n"
    problem = f"cannot write worker logs to {missing}/0/stderr.log: No such file or directory"
    assert relay.log_problem(0) == problem
    assert relay.log_problem(1) == problem.replace("/0/", "/1/")
    assert relay.log_problem(2) is None
    # One warning for the attempt, however many files fail.
    (line,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert line == (
        f"{problem}; this attempt's streams whose log file cannot be opened go to the "
        "agent's console"
    )


def test_without_a_log_dir_streams_meant_for_files_go_to_the_console(
    console: Console,
) -> None:
    problem = "cannot write worker logs to /logs/attempt_1: No space left on device"
    dest = LogsDest(
        stdouts={0: "", 1: ""},
        stderrs={0: "", 1: ""},
        error_files={0: "", 1: ""},
        problem=problem,
        to_console={0: Std.ERR, 1: Std.ALL},
    )
    relay = relay_for(console)
    # Rank 1 is hidden by the local-ranks filter: the console is its only copy now.
    run(WRITE_BOTH, relay.wire(1, dest, "[r1]:", show_on_console=False))
    stdio = relay.wire(0, dest, "[r0]:", show_on_console=True)
    assert stdio.stdout_fd is None  # not meant for a file: inherited, as before
    run("import os; os.write(2, b'rank 0 err\\n')", stdio)
    relay.close()
    assert console.stdout() == b"[r1]:out line 1\n[r1]:out \xff\xfe raw\n[r1]:no newline at end\n"
    assert sorted(console.stderr().splitlines()) == [b"[r0]:rank 0 err", b"[r1]:err line"]
    assert relay.log_problem(0) == f"{problem} (its output went to the agent's console)"


def test_a_log_file_that_fills_up_is_noted_and_the_console_copy_goes_on(
    console: Console,
) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full, where every write fails with ENOSPC")
    dest = LogsDest(stdouts={0: ""}, stderrs={0: "/dev/full"}, tee_stderrs={0: "/dev/full"})
    relay = relay_for(console)
    run(WRITE_BOTH, relay.wire(0, dest, "[r0]:", show_on_console=True))
    relay.close()
    assert console.stderr() == b"[r0]:err line\n"
    assert relay.log_problem(0) == (
        "cannot write worker logs to /dev/full: No space left on device"
    )


def test_a_dead_console_does_not_stop_the_log_files(tmp_path: Path) -> None:
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    os.close(read_end)  # writing to the console now fails with EPIPE
    try:
        dest = tee_dest(tmp_path, range(1), err=False)
        relay = OutputRelay(console=FdConsole(stdout=write_end))
        run(WRITE_BOTH, relay.wire(0, dest, "", show_on_console=True))
        relay.close()
    finally:
        os.close(write_end)
    assert Path(dest.stdouts[0]).read_bytes() == b"out line 1\nout \xff\xfe raw\nno newline at end"


def test_a_python_console_writes_to_sys_stdout_as_it_was_when_the_relay_was_made(
    tmp_path: Path,
) -> None:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        relay = OutputRelay(console=PYTHON_CONSOLE)
    # The workers run, and the relay writes, after the redirect ended.
    dest = tee_dest(tmp_path, range(1))
    run(WRITE_BOTH, relay.wire(0, dest, "[default0]:", show_on_console=True))
    relay.close()
    assert out.getvalue() == (
        "[default0]:out line 1\n[default0]:out \ufffd\ufffd raw\n[default0]:no newline at end\n"
    )
    assert err.getvalue() == "[default0]:err line\n"
    # The log file keeps the bytes exactly.
    assert Path(dest.stdouts[0]).read_bytes() == b"out line 1\nout \xff\xfe raw\nno newline at end"


class Refuses(io.StringIO):
    """A text stream whose writes fail, as a closed or broken one's do."""

    def write(self, s: str) -> int:
        raise ValueError("I/O operation on closed file")


def test_a_failing_python_console_does_not_stop_the_log_files(tmp_path: Path) -> None:
    with contextlib.redirect_stdout(Refuses()):
        relay = OutputRelay(console=PYTHON_CONSOLE)
    dest = tee_dest(tmp_path, range(1), err=False)
    run(WRITE_BOTH, relay.wire(0, dest, "", show_on_console=True))
    relay.close()
    assert Path(dest.stdouts[0]).read_bytes() == b"out line 1\nout \xff\xfe raw\nno newline at end"
    assert relay.log_problem(0) is None


def test_no_sys_stdout_drops_console_lines_as_print_does(tmp_path: Path) -> None:
    with contextlib.redirect_stdout(None):
        relay = OutputRelay(console=PYTHON_CONSOLE)
    dest = tee_dest(tmp_path, range(1), err=False)
    run(WRITE_BOTH, relay.wire(0, dest, "", show_on_console=True))
    relay.close()
    assert Path(dest.stdouts[0]).read_bytes() == b"out line 1\nout \xff\xfe raw\nno newline at end"


def test_relay_pipes_are_not_leaked_into_other_children(tmp_path: Path, console: Console) -> None:
    dest = tee_dest(tmp_path, range(2), err=False)
    relay = relay_for(console)
    first = relay.wire(0, dest, "", show_on_console=True)
    second = relay.wire(1, dest, "", show_on_console=True)
    try:
        assert first.stdout_fd is not None
        assert not os.get_inheritable(first.stdout_fd)
        # A child started for rank 1 must not hold rank 0's pipe, or rank 0's stream
        # would only end when rank 1 exits.
        code = (
            "import os\n"
            "try:\n"
            f"    os.fstat({first.stdout_fd})\n"
            "    print('leaked')\n"
            "except OSError:\n"
            "    print('clean')\n"
        )
        proc = start(code, second)
        assert proc.wait(timeout=60) == 0
    finally:
        first.close_in_parent()
    relay.close()
    assert Path(dest.stdouts[1]).read_bytes() == b"clean\n"

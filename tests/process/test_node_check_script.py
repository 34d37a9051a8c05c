"""The user's check script runs under the node check's runner (``script``), as the agent
runs it: whatever the script starts ends with it -- in the background, in a session of
its own, orphaned by a parent that exited -- when it exits and when the agent stops the
check early. Its exit status comes through as its own."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from _helpers import pid_alive, wait_for, write_script
from elastrun.core.cancel import CancelScope
from elastrun.nodecheck.worker.runner import NOT_RUN
from elastrun.supervise.processes.helper import Helper

#: The sleeps the scripts start, by a length nothing else on the machine uses.
SLEEP = "313"

# A check script that leaves three processes behind: one in a session of its own, one
# in a session of its own whose parent exits at once (it is orphaned), one in the
# background of its own process group; each writes its pid to a file.
LEAVES = f"""#!/bin/sh
setsid sleep {SLEEP} </dev/null >/dev/null 2>&1 &
echo $! > "$1/own-session"
sh -c 'setsid sleep {SLEEP} </dev/null >/dev/null 2>&1 & echo $! > "$1/orphan"' sh "$1"
sleep {SLEEP} &
echo $! > "$1/background"
echo "disk 3 is bad"
exit 3
"""


def _finish(helper: Helper) -> int | None:
    with CancelScope() as scope:
        return helper.finish(scope, time.monotonic() + 30)


def _start(script: Path, *args: str) -> Helper:
    argv = [sys.executable, "-m", "elastrun.nodecheck.worker.runner", "--parent", str(os.getpid())]
    return Helper.start([*argv, "script", "--", str(script), *args], os.environ)


def _ours(pid: int) -> bool:
    """Whether ``pid`` is still one of the sleeps a script here started (by its command
    line: a pid reused by another process is not ours)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().split(b"\0")[:2] == [b"sleep", SLEEP.encode()]
    except OSError:
        return False


@contextlib.contextmanager
def _left_behind(tmp_path: Path, names: tuple[str, ...]) -> Iterator[dict[str, int]]:
    """The pids the script wrote, read after the block; any still running is killed by
    pid on the way out (the test then fails on it)."""
    pids: dict[str, int] = {}
    try:
        yield pids
    finally:
        for name in names:
            path = tmp_path / name
            if path.exists() and path.read_text().strip():
                pids[name] = int(path.read_text())
        for pid in pids.values():
            if _ours(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_script_that_exits_leaves_no_process_behind_and_its_status_comes_through(
    tmp_path: Path,
) -> None:
    script = write_script(tmp_path / "check.sh", LEAVES)
    script.chmod(0o755)
    names = ("own-session", "orphan", "background")
    with _left_behind(tmp_path, names) as pids:
        helper = _start(script, str(tmp_path))
        try:
            status = _finish(helper)
        finally:
            helper.close()
    assert status == 3 and list(helper.tail) == ["disk 3 is bad"]
    assert sorted(pids) == sorted(names)
    assert [name for name, pid in pids.items() if pid_alive(pid) and _ours(pid)] == []


def test_stopping_the_check_ends_the_script_and_what_it_started_at_once(tmp_path: Path) -> None:
    script = write_script(
        tmp_path / "hangs.sh",
        f"""#!/bin/sh
        trap '' TERM
        setsid sleep {SLEEP} </dev/null >/dev/null 2>&1 &
        echo $! > "$1/own-session"
        echo $$ > "$1/script"
        while :; do sleep 1; done
        """,
    )
    script.chmod(0o755)
    with _left_behind(tmp_path, ("own-session",)) as pids:
        helper = _start(script, str(tmp_path))
        try:
            started = tmp_path / "script"
            wait_for(lambda: started.exists() and started.read_text().strip(), 20, "the script")
            shell = int(started.read_text())
            t0 = time.monotonic()
            helper.close()  # what a signal to the agent, or the check's timeout, does
            took = time.monotonic() - t0
        finally:
            helper.close()
    assert pids and not any(_ours(pid) for pid in pids.values())
    assert not pid_alive(shell)
    # The runner answered the SIGTERM itself (no wait for the SIGKILL after the grace),
    # although the script ignores it.
    assert took < 1.5, took


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ("#!/bin/sh\nkill -9 $$\n", -signal.SIGKILL, None),
        ("no interpreter line\n", NOT_RUN, "could not be run: Exec format error"),
    ],
    ids=["killed-by-a-signal", "not-runnable"],
)
def test_how_a_script_ended_comes_through(
    tmp_path: Path, body: str, status: int, says: str | None
) -> None:
    script = write_script(tmp_path / "check", body)
    script.chmod(0o755)
    helper = _start(script)
    try:
        assert _finish(helper) == status
    finally:
        helper.close()
    assert (helper.tail[-1] if helper.tail else None) == says

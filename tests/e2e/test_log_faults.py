"""The log directory under faults, through the CLI with real processes.

- The log directory removed during a run: the next attempt makes it again (one warning
  line), the run restarts and fails as its budget says, and the report names the stderr
  log that could not be read instead of showing no stderr.
- The log file system out of inodes at a restart: the attempt's directory cannot be
  made; one warning line names it and the OS error, the workers still start with their
  output on the agent's console (prefixed), and the report says why there is no error
  file instead of blaming a missing ``elastrun.record``.
- The log file system out of space: the worker could write neither its error file nor
  its stderr; the report says that writing there fails with "No space left on device".

The full file systems are small tmpfs mounts inside a private mount namespace that the
test makes with ``unshare`` for the elastrun process alone: the mount goes away with the
last process in the namespace, so nothing can leak to the machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from _helpers import ELASTRUN, finish, run, write_script

#: Fails at every attempt after removing the whole --log-dir (argv[1]): attempt 0 with
#: an exit code (no error file, so nothing makes its directory again), attempt 1 with
#: an exception (the bootstrap makes the rank directory again for its error file).
REMOVES_LOG_DIR = """
import os, shutil, sys
n = os.environ["TORCHELASTIC_RESTART_COUNT"]
print(f"attempt {n} starts", file=sys.stderr, flush=True)
shutil.rmtree(sys.argv[1])
if n == "0":
    sys.exit(3)
raise RuntimeError(f"attempt {n} failed after removing the log directory")
"""

#: Attempt 0 uses up every inode of the log file system (argv[1]) and fails; attempt 1
#: says something on stderr and fails.
FILLS_INODES = """
import os, sys
n = os.environ["TORCHELASTIC_RESTART_COUNT"]
if n == "0":
    i = 0
    try:
        while True:
            os.close(os.open(os.path.join(sys.argv[1], f"inode_{i}"), os.O_CREAT | os.O_WRONLY))
            i += 1
    except OSError:
        pass
    sys.exit(1)
print(f"attempt {n} speaks on stderr", file=sys.stderr, flush=True)
raise ValueError(f"attempt {n} failed")
"""

#: Fills the log file system (argv[1]) with one file, then dies of an exception: its
#: error file and its traceback have nowhere to go.
FILLS_SPACE = """
import os, sys
try:
    with open(os.path.join(sys.argv[1], "ballast"), "wb", buffering=0) as f:
        while True:
            f.write(b"\\0" * 65536)
except OSError:
    pass
raise ValueError("boom after the disk filled")
"""


def _agent_traceback(stderr: str) -> bool:
    """A traceback printed by elastrun itself (workers' lines carry a rank prefix)."""
    return any(line.startswith("Traceback") for line in stderr.splitlines())


def _unshare_prefix() -> list[str]:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs unshare(1) (util-linux) to mount a private tmpfs")
    prefix = [unshare, "--mount", "--propagation", "private"]
    if os.geteuid() != 0:
        # Unprivileged: a user namespace where we are root may mount a tmpfs.
        prefix[1:1] = ["--user", "--map-root-user"]
    return prefix


def _in_private_tmpfs(mountpoint: Path, options: str, command: Sequence[str]) -> list[str]:
    """``command`` run with a fresh tmpfs (mount ``options``) at ``mountpoint``, visible
    to it and its children only."""
    script = 'mount -t tmpfs -o "$1" elastrun-test "$2" && shift 2 && exec "$@"'
    return [*_unshare_prefix(), "--", "sh", "-c", script, "sh", options, str(mountpoint), *command]


@pytest.fixture(scope="module")
def private_tmpfs(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Skips unless this machine lets us mount a tmpfs in a private mount namespace."""
    where = tmp_path_factory.mktemp("probe-mount")
    probe = subprocess.run(
        _in_private_tmpfs(where, "size=64k,nr_inodes=16", ["true"]),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if probe.returncode != 0:
        pytest.skip(
            "cannot mount a tmpfs in a private mount namespace here (needs root, or "
            f"unprivileged user namespaces): {probe.stderr.strip()}"
        )


def _run_on_tmpfs(
    tmp_path: Path, log_dir: Path, options: str, args: Sequence[str]
) -> subprocess.CompletedProcess[str]:
    log_dir.mkdir()
    proc = subprocess.Popen(
        _in_private_tmpfs(log_dir, options, [*ELASTRUN, "--log-dir", str(log_dir), *args]),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    return finish(proc, timeout=30)


def test_log_dir_removed_during_the_run_is_made_again_and_the_report_is_printed(
    tmp_path: Path,
) -> None:
    script = write_script(tmp_path / "remove_logs.py", REMOVES_LOG_DIR)
    logs = tmp_path / "logs"
    result = run(
        ["--nproc-per-node", "1", "--log-dir", str(logs), "--max-restarts", "1",
         "--redirects", "3", str(script), str(logs)],
        cwd=tmp_path,
        timeout=30,
    )  # fmt: skip
    err = result.stderr
    assert result.returncode == 1, err
    assert not _agent_traceback(err), err
    assert "was removed during the run; made it again for attempt 1" in err, err
    assert "restart budget exhausted: 1 of 1 restart(s) used" in err, err
    # The worker recreated its rank directory to write the error file; its stderr log,
    # open while the worker removed it, is gone: the report says so.
    assert "RuntimeError: attempt 1 failed after removing the log directory" in err, err
    (run_dir,) = logs.iterdir()
    stderr_log = run_dir / "attempt_1" / "0" / "stderr.log"
    assert f"cannot read {stderr_log}: No such file or directory" in err, err
    assert "decorate" not in err, err


def test_log_fs_out_of_inodes_at_restart_starts_the_workers_with_console_output(
    tmp_path: Path, private_tmpfs: None
) -> None:
    script = write_script(tmp_path / "fill_inodes.py", FILLS_INODES)
    logs = tmp_path / "logs"
    result = _run_on_tmpfs(
        tmp_path,
        logs,
        "size=4m,nr_inodes=64",
        ["--nproc-per-node", "1", "--max-restarts", "1", "--redirects", "3",
         str(script), str(logs)],
    )  # fmt: skip
    err = result.stderr
    assert result.returncode == 1, err
    assert not _agent_traceback(err), err
    warnings = [
        line for line in err.splitlines() if line.startswith("[elastrun] warning: cannot write")
    ]
    assert len(warnings) == 1, err
    assert f"{logs}/" in warnings[0] and "attempt_1: No space left on device" in warnings[0]
    assert "goes to the agent's console" in warnings[0]
    # Attempt 1 ran, and its output, meant for files, reached the console.
    assert "[default0]:attempt 1 speaks on stderr" in err, err
    assert "[default0]:ValueError: attempt 1 failed" in err, err
    assert "restart budget exhausted: 1 of 1 restart(s) used" in err, err
    report = err[err.index("FAILED") :]
    message = next(line for line in report.splitlines() if "message" in line)
    assert "exited with code 1; no error file: cannot write worker logs to" in message, report
    assert "No space left on device" in message, report
    assert "its output went to the agent's console" in message, report
    assert "decorate" not in report, report


def test_log_fs_out_of_space_report_names_the_io_error(tmp_path: Path, private_tmpfs: None) -> None:
    script = write_script(tmp_path / "fill_space.py", FILLS_SPACE)
    logs = tmp_path / "logs"
    result = _run_on_tmpfs(
        tmp_path,
        logs,
        "size=1m,nr_inodes=1024",
        ["--nproc-per-node", "1", "--redirects", "3", str(script), str(logs)],
    )
    err = result.stderr
    assert result.returncode == 1, err
    assert not _agent_traceback(err), err
    report = err[err.index("FAILED") :]
    assert "decorate" not in report, report
    message = next(line for line in report.splitlines() if "message" in line)
    assert "exited with code 1; no error file:" in message, report
    assert "No space left on device" in message, report
    stderr_line = next(line for line in report.splitlines() if line.lstrip().startswith("stderr"))
    assert "stderr.log is empty" in stderr_line and "No space left on device" in stderr_line


if __name__ == "__main__":  # pragma: no cover - run this file alone
    sys.exit(pytest.main([__file__, "-q"]))

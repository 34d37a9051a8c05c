"""A worker that left no error file: ``ProcessFailure.message`` is torch's text (code
written for torch compares it, as torch's own tests do), and the failure report, which
the launcher prints, carries elastrun's explanation of why there is no error file."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from _helpers import run, write_script
from elastrun import (
    ChildFailedError,
    DefaultLogsSpecs,
    LaunchConfig,
    elastic_launch,
    start_processes,
)

TORCH_NO_ERROR_FILE = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
#: What the report says of a worker that did not record its exception.
NOT_RECORDED = "no error file (the worker did not report an exception"


def test_a_worker_exiting_1_has_torchs_message_and_the_report_says_why(tmp_path: Path) -> None:
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=1,
        max_restarts=0,
        logs_specs=DefaultLogsSpecs(log_dir=os.fspath(tmp_path)),
    )
    with pytest.raises(ChildFailedError) as info:
        elastic_launch(config, sys.executable)("-c", "import sys; sys.exit(1)")
    _, failure = info.value.get_first_failure()
    assert failure.exitcode == 1
    assert failure.error_file == "<N/A>"
    assert failure.message == TORCH_NO_ERROR_FILE
    assert failure.explanation.startswith(f"exited with code 1; {NOT_RECORDED}")
    report = str(info.value)
    assert f"  message   : {failure.explanation}" in report.splitlines()
    assert "To enable traceback" not in report


@pytest.mark.parametrize(
    ("code", "exitcode"),
    [
        ("import sys; sys.exit(138)", 138),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9),
    ],
    ids=["exit-138", "sigkill"],
)
def test_start_processes_failure_without_error_file_has_torchs_message(
    tmp_path: Path, code: str, exitcode: int
) -> None:
    ctx = start_processes(
        "echo",
        sys.executable,
        args={0: ("-c", code)},
        envs={0: {}},
        logs_specs=DefaultLogsSpecs(log_dir=os.fspath(tmp_path)),
    )
    result = ctx.wait()
    assert result is not None and result.is_failed()
    failure = result.failures[0]
    assert failure.exitcode == exitcode
    assert failure.error_file == "<N/A>"
    assert failure.error_file_data["message"] == "<NONE>"
    if exitcode < 0:
        expected = f"Signal 9 (SIGKILL) received by PID {failure.pid}"
        assert failure.message == failure.explanation == expected
        assert failure.signal_name() == "SIGKILL"
    else:
        assert failure.message == TORCH_NO_ERROR_FILE
        assert failure.explanation.startswith(f"exited with code {exitcode}; {NOT_RECORDED}")
        assert failure.signal_name() == "<N/A>"


def test_the_commands_report_explains_a_missing_error_file(tmp_path: Path) -> None:
    script = write_script(tmp_path / "exit3.py", "import sys\nsys.exit(3)\n")
    done = run(["--nproc-per-node", "1", "--max-restarts", "0", os.fspath(script)], cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert f"exited with code 3; {NOT_RECORDED}" in done.stderr
    assert "To enable traceback" not in done.stderr

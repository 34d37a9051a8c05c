"""Worker output, log files and failure reports through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _helpers import run, write_script

SPEAK = """
import os, sys
r = os.environ["LOCAL_RANK"]
print(f"out from {r}", flush=True)
print(f"err from {r}", file=sys.stderr, flush=True)
"""


def _run_dir(logs: Path) -> Path:
    (run_dir,) = list(logs.iterdir())
    return run_dir


def test_tee_prefixes_console_lines_and_keeps_files(tmp_path: Path) -> None:
    script = write_script(tmp_path / "speak.py", SPEAK)
    logs = tmp_path / "logs"
    result = run(
        [
            "--nproc-per-node",
            "3",
            "--log-dir",
            str(logs),
            "--tee",
            "0:3,1:1",
            "--redirects",
            "2:3",
            str(script),
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "[default0]:out from 0" in result.stdout
    assert "[default1]:out from 1" in result.stdout
    assert "[default0]:err from 0" in result.stderr
    assert "err from 1" in result.stderr and "[default1]:err from 1" not in result.stderr
    assert "from 2" not in result.stdout + result.stderr.replace("err from 1", "")
    attempt = _run_dir(logs) / "attempt_0"
    assert (attempt / "0" / "stdout.log").read_text() == "out from 0\n"
    assert (attempt / "2" / "stderr.log").read_text() == "err from 2\n"
    assert not (attempt / "1" / "stderr.log").exists()


def test_prefix_template_filters_and_duplicates(tmp_path: Path) -> None:
    script = write_script(tmp_path / "speak.py", SPEAK)
    logs = tmp_path / "logs"
    result = run(
        [
            "--nproc-per-node",
            "12",
            "--log-dir",
            str(logs),
            "--tee",
            "3",
            "--local-ranks-filter",
            "0,11",
            "--duplicate-stdout-filters",
            "from 1,,x,from 11",
            str(script),
        ],
        cwd=tmp_path,
        env={"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "<${role_name}|${rank}|${local_rank}> "},
    )
    assert result.returncode == 0, result.stderr
    shown = sorted(line for line in result.stdout.splitlines() if line.startswith("<"))
    assert shown == ["<default|0|0> out from 0", "<default|11|11> out from 11"]
    attempt = _run_dir(logs) / "attempt_0"
    assert (attempt / "5" / "stdout.log").read_text() == "out from 5\n"
    assert (attempt / "filtered_stdout.log").read_text() == "<default|11|11> out from 11\n"


def test_uncaught_exception_is_reported_without_record_and_with_redirects(tmp_path: Path) -> None:
    script = write_script(
        tmp_path / "crash.py",
        """
        import os
        def inner():
            raise KeyError("missing-key-" + os.environ["RANK"])
        if os.environ["RANK"] == "1":
            inner()
        """,
    )
    result = run(["--nproc-per-node", "2", "--redirects", "3", str(script)], cwd=tmp_path)
    assert result.returncode == 1
    report = result.stderr
    assert "KeyError: 'missing-key-1'" in report
    assert "in inner" in report  # the traceback of the worker
    assert "last" in report and "stderr" in report  # the tail of rank 1's redirected stderr


@pytest.mark.torch
def test_torch_record_decorated_script_is_reported(tmp_path: Path) -> None:
    script = write_script(
        tmp_path / "rec.py",
        """
        import os, time
        from torch.distributed.elastic.multiprocessing.errors import record
        @record
        def main():
            if os.environ["RANK"] == "0":
                raise RuntimeError("torch-recorded failure")
            time.sleep(30)
        main()
        """,
    )
    logs = tmp_path / "logs"
    result = run(["--nproc-per-node", "2", "--log-dir", str(logs), str(script)], cwd=tmp_path)
    assert result.returncode == 1
    assert "RuntimeError: torch-recorded failure" in result.stderr
    data = json.loads((_run_dir(logs) / "attempt_0" / "0" / "error.json").read_text())
    assert "torch-recorded failure" in data["message"]["message"]


def test_invalid_error_file_is_reported_not_fatal(tmp_path: Path) -> None:
    script = write_script(
        tmp_path / "bad.py",
        """
        import os, sys
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as fh:
            fh.write('{"message": {"message": "trunc')
        sys.exit(7)
        """,
    )
    result = run(["--nproc-per-node", "1", str(script)], cwd=tmp_path)
    assert result.returncode == 1
    assert "exitcode" in result.stderr and "7" in result.stderr
    assert "not valid JSON" in result.stderr


def test_clean_run_leaves_no_temporary_log_dir(tmp_path: Path) -> None:
    script = write_script(tmp_path / "speak.py", SPEAK)
    result = run(
        ["--nproc-per-node", "2", str(script)], cwd=tmp_path, env={"TMPDIR": str(tmp_path)}
    )
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["speak.py"]

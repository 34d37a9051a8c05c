"""ProcessFailure (what one failed worker reported) and the ChildFailedError report."""

from __future__ import annotations

import json
import pickle
from datetime import datetime
from pathlib import Path

import pytest

from elastrun.core.errorfile import exception_payload, write_error_file
from elastrun.core.errors import ElastrunError, WorkerFailure
from elastrun.supervise.failures import (
    ChildFailedError,
    ProcessFailure,
    copy_root_cause_error_file,
)

T0 = 1_700_000_000.25
HOST = "node-a.example"

TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/job/train.py", line 7, in <module>\n'
    "    main()\n"
    '  File "/job/train.py", line 4, in main\n'
    '    raise ValueError("boom")\n'
    "ValueError: boom\n"
)


def _nested_error_file(path: Path, message: str = "ValueError: boom", stamp: str = "1") -> str:
    doc = {
        "message": {
            "message": message,
            "extraInfo": {"py_callstack": TRACEBACK, "timestamp": stamp},
        }
    }
    path.write_text(json.dumps(doc))
    return str(path)


def _ms(ts: float) -> str:
    return datetime.fromtimestamp(ts).isoformat(sep="_", timespec="milliseconds")


def _failure(
    rank: int,
    exitcode: int,
    error_file: str = "",
    *,
    at: float = T0,
    terminated: bool = False,
    stderr_file: str | None = None,
    host: str = HOST,
    log_problem: str | None = None,
) -> ProcessFailure:
    return ProcessFailure(
        local_rank=rank,
        pid=1000 + rank,
        exitcode=exitcode,
        error_file=error_file,
        global_rank=rank,
        host=host,
        observed_at=at,
        terminated_by_agent=terminated,
        stderr_file=stderr_file,
        log_problem=log_problem,
    )


# --- ProcessFailure ------------------------------------------------------------------


def test_failure_takes_message_traceback_and_time_from_nested_error_file(
    tmp_path: Path,
) -> None:
    path = _nested_error_file(tmp_path / "e.json", stamp="1700000100")
    failure = _failure(1, 1, path)
    assert failure.message == "ValueError: boom"
    assert failure.traceback == TRACEBACK
    assert failure.timestamp == 1700000100 and isinstance(failure.timestamp, int)
    assert failure.error_file_problem is None
    assert failure.has_error_file
    assert failure.error_file_data == json.loads(Path(path).read_text())


def test_failure_reads_flat_error_file(tmp_path: Path) -> None:
    path = tmp_path / "e.json"
    path.write_text(json.dumps({"message": "custom failure text", "timestamp": "1700000005"}))
    failure = _failure(0, 2, str(path))
    assert failure.message == "custom failure text"
    assert failure.traceback is None
    assert failure.timestamp == 1700000005.0


def test_failure_whose_error_file_was_never_written_says_not_available(
    tmp_path: Path,
) -> None:
    failure = _failure(0, 1, str(tmp_path / "error.json"), at=T0)
    assert failure.error_file == "<N/A>"
    assert failure.timestamp == int(T0) and isinstance(failure.timestamp, int)
    assert _failure(0, -9, "").error_file == "<N/A>"


def test_failure_without_error_file_and_signal_names_the_signal() -> None:
    failure = _failure(0, -9)
    assert failure.message == "Signal 9 (SIGKILL) received by PID 1000"
    assert failure.signal_name() == "SIGKILL"
    assert failure.error_file_problem is None
    assert not failure.has_error_file
    assert failure.error_file_data == {"message": "<NONE>"}


@pytest.mark.parametrize("exitcode", [1, 138])
def test_failure_without_error_file_and_exit_code_has_torchs_message(
    tmp_path: Path, exitcode: int
) -> None:
    # Code written for torch compares the message word for word; elastrun's own
    # account of the missing error file is the explanation, which the report shows.
    failure = _failure(0, exitcode, str(tmp_path / "never-written.json"))
    assert failure.message == (
        "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
    )
    assert failure.error_file == "<N/A>"
    assert failure.signal_name() == "<N/A>"
    assert failure.error_file_data == {
        "message": "<NONE>",
        "errorTraits": {"category": "system_terminated_error", "retryability": "False"},
    }
    assert failure.explanation.startswith(f"exited with code {exitcode}; no error file")
    report = ChildFailedError("train.py", {0: failure}).format_msg()
    assert f"  message   : {failure.explanation}" in report.splitlines()
    assert "To enable traceback" not in report


def test_failure_without_error_file_under_a_relative_path_has_torchs_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch's own test names a relative file that does not exist: the write probe
    # then tries the working directory.
    monkeypatch.chdir(tmp_path)
    failure = ProcessFailure(local_rank=0, pid=997, exitcode=138, error_file="ignored.json")
    assert failure.message.startswith("To enable traceback see: ")
    assert failure.error_file == "<N/A>"
    assert failure.write_problem is None
    assert list(tmp_path.iterdir()) == []


def test_reason_elastrun_ended_a_worker_leads_the_explanation_not_torchs_message() -> None:
    failure = ProcessFailure(
        local_rank=0, pid=1000, exitcode=-9, error_file="", reason="its timer expired"
    )
    assert failure.message == "Signal 9 (SIGKILL) received by PID 1000"
    assert failure.explanation == "its timer expired: Signal 9 (SIGKILL) received by PID 1000"
    report = ChildFailedError("train.py", {0: failure}).format_msg()
    assert f"  message   : {failure.explanation}" in report.splitlines()


def test_failure_with_error_file_explains_it_with_its_message(tmp_path: Path) -> None:
    path = tmp_path / "e.json"
    write_error_file(str(path), exception_payload(ValueError("boom"), now=9))
    failure = _failure(0, 1, str(path))
    assert failure.message == failure.explanation == "ValueError: boom"
    assert "errorTraits" not in failure.error_file_data


def test_failure_without_error_file_and_exit_code_explains_how_to_get_one(
    tmp_path: Path,
) -> None:
    failure = _failure(0, 3, str(tmp_path / "never-written.json"))
    assert failure.explanation.startswith("exited with code 3; no error file")
    assert "record" in failure.explanation and "stderr" in failure.explanation
    assert failure.signal_name() == "<N/A>"
    assert failure.error_file_problem is None  # no file is not a problem


def test_failure_whose_error_file_cannot_be_written_names_the_os_error_not_the_hint(
    tmp_path: Path,
) -> None:
    removed = tmp_path / "removed"
    failure = _failure(0, 1, str(removed / "error.json"))
    assert failure.explanation == (
        f"exited with code 1; no error file: writing to {removed} fails now: "
        "No such file or directory"
    )
    assert failure.write_problem is not None and "record" not in failure.explanation


def test_write_probe_of_a_writable_directory_keeps_the_hint_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    failure = _failure(0, 1, str(tmp_path / "error.json"), stderr_file=str(tmp_path / "e.log"))
    assert "decorate its main with elastrun.record" in failure.explanation
    assert failure.write_problem is None
    assert list(tmp_path.iterdir()) == []


def test_no_write_probe_for_a_worker_killed_by_a_signal(tmp_path: Path) -> None:
    failure = _failure(0, -9, str(tmp_path / "removed" / "error.json"))
    assert failure.message == "Signal 9 (SIGKILL) received by PID 1000"
    assert failure.write_problem is None


def test_no_write_probe_for_a_sibling_that_elastrun_stopped(tmp_path: Path) -> None:
    failure = _failure(0, 1, str(tmp_path / "removed" / "error.json"), terminated=True)
    assert failure.write_problem is None
    assert "decorate its main" in failure.explanation


def test_log_problem_known_to_the_agent_replaces_the_hint() -> None:
    problem = "cannot write worker logs to /logs/attempt_1: No space left on device"
    failure = _failure(0, 1, log_problem=problem)
    assert failure.explanation == f"exited with code 1; no error file: {problem}"
    assert failure.write_problem == problem


def test_failure_with_truncated_error_file_reports_the_problem_instead_of_raising(
    tmp_path: Path,
) -> None:
    path = tmp_path / "e.json"
    path.write_text('{"message": {"message": "ValueError: bo')
    failure = _failure(0, 1, str(path))
    assert failure.error_file_problem is not None
    assert "not valid JSON (truncated?)" in failure.error_file_problem
    assert failure.explanation.startswith("exited with code 1; its error file could not be used")
    assert failure.traceback is None


def test_failure_with_signal_and_broken_error_file_keeps_the_signal_message(
    tmp_path: Path,
) -> None:
    path = tmp_path / "e.json"
    path.write_text("")
    failure = _failure(0, -15, str(path))
    assert failure.message == "Signal 15 (SIGTERM) received by PID 1000"
    assert failure.error_file_problem == "error file is empty"


def test_failure_time_is_observation_time_without_error_file_timestamp() -> None:
    failure = _failure(0, 1, at=T0)
    assert failure.timestamp == int(T0)
    expected = datetime.fromtimestamp(T0).isoformat(sep="_", timespec="seconds")
    assert failure.timestamp_isoformat() == expected
    assert len(failure.timestamp_isoformat()) == len("YYYY-MM-DD_HH:MM:SS")


def test_failure_defaults_host_and_observation_time() -> None:
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file="")
    assert failure.host
    assert failure.observed_at > 0
    assert failure.global_rank == -1


def test_unknown_signal_number_has_no_name() -> None:
    assert _failure(0, -200).signal_name() == "<N/A>"


def test_stderr_tail_keeps_the_last_twenty_lines(tmp_path: Path) -> None:
    log = tmp_path / "stderr.log"
    log.write_text("".join(f"line {i}\n" for i in range(50)) + "\n\n")
    failure = _failure(0, 1, stderr_file=str(log))
    assert failure.stderr_tail == [f"line {i}" for i in range(30, 50)]


def test_stderr_tail_decodes_invalid_utf8_with_replacement(tmp_path: Path) -> None:
    log = tmp_path / "stderr.log"
    log.write_bytes(b"ok\n\xff\xfebad bytes\n")
    failure = _failure(0, 1, stderr_file=str(log))
    assert failure.stderr_tail == ["ok", "\ufffd\ufffdbad bytes"]


def test_stderr_tail_of_missing_log_is_empty(tmp_path: Path) -> None:
    assert _failure(0, 1, stderr_file=str(tmp_path / "none.log")).stderr_tail == []


def test_stderr_tail_of_huge_log_reads_only_the_end(tmp_path: Path) -> None:
    log = tmp_path / "stderr.log"
    log.write_text("x" * 1_000_000 + "\n" + "".join(f"end {i}\n" for i in range(5)))
    failure = _failure(0, 1, stderr_file=str(log))
    assert failure.stderr_tail == [f"end {i}" for i in range(5)]


def test_stderr_tail_leaves_out_a_trailing_copy_of_the_recorded_traceback(
    tmp_path: Path,
) -> None:
    path = _nested_error_file(tmp_path / "e.json")
    log = tmp_path / "stderr.log"
    log.write_text("loading data\nwarning: slow disk\n" + TRACEBACK)
    failure = _failure(0, 1, path, stderr_file=str(log))
    assert failure.stderr_tail == ["loading data", "warning: slow disk"]
    assert failure.stderr_tail_omits_traceback


def test_stderr_tail_keeps_a_traceback_that_differs_from_the_recorded_one(
    tmp_path: Path,
) -> None:
    path = _nested_error_file(tmp_path / "e.json")
    log = tmp_path / "stderr.log"
    log.write_text("Traceback (most recent call last):\nOtherError: x\n")
    failure = _failure(0, 1, path, stderr_file=str(log))
    assert failure.stderr_tail == ["Traceback (most recent call last):", "OtherError: x"]
    assert not failure.stderr_tail_omits_traceback


# --- root cause ----------------------------------------------------------------------


def test_empty_failures_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="at least one failure"):
        ChildFailedError("train.py", {})


def test_child_failed_error_is_a_worker_failure() -> None:
    err = ChildFailedError("train.py", {0: _failure(0, 1)})
    assert isinstance(err, WorkerFailure)
    assert isinstance(err, ElastrunError)


def test_root_cause_is_the_first_observed_failure() -> None:
    failures = {0: _failure(0, 1, at=T0 + 0.2), 1: _failure(1, 1, at=T0 + 0.1)}
    assert ChildFailedError("x", failures).get_first_failure() == (1, failures[1])


def test_root_cause_tie_goes_to_the_smaller_global_rank() -> None:
    failures = {3: _failure(3, 1, at=T0), 2: _failure(2, 1, at=T0)}
    assert ChildFailedError("x", failures).get_first_failure()[0] == 2


def test_root_cause_skips_workers_terminated_by_the_agent() -> None:
    failures = {
        0: _failure(0, -15, at=T0, terminated=True),
        1: _failure(1, 1, at=T0 + 5),
    }
    assert ChildFailedError("x", failures).get_first_failure()[0] == 1


def test_root_cause_among_only_terminated_workers_is_the_earliest() -> None:
    failures = {
        0: _failure(0, -15, at=T0 + 1, terminated=True),
        1: _failure(1, -15, at=T0, terminated=True),
    }
    assert ChildFailedError("x", failures).get_first_failure()[0] == 1


def test_root_cause_ignores_coarse_error_file_timestamps(tmp_path: Path) -> None:
    # torch would pick rank 0 here (smaller error-file timestamp); the agent saw rank 1
    # exit first.
    early = _nested_error_file(tmp_path / "0.json", stamp="100")
    late = _nested_error_file(tmp_path / "1.json", stamp="200")
    failures = {0: _failure(0, 1, early, at=T0 + 1), 1: _failure(1, 1, late, at=T0)}
    assert ChildFailedError("x", failures).get_first_failure()[0] == 1


# --- the report ----------------------------------------------------------------------


def test_report_layout_with_root_cause_first(tmp_path: Path) -> None:
    (tmp_path / "1").mkdir()
    error_file = _nested_error_file(tmp_path / "1" / "error.json", stamp="1700000000")
    log = tmp_path / "1" / "stderr.log"
    log.write_text("step 10 loss 0.5\n" + TRACEBACK)
    failures = {
        0: _failure(0, -15, str(tmp_path / "0.json"), at=T0 + 0.5, terminated=True),
        1: _failure(1, 1, error_file, at=T0, stderr_file=str(log)),
        2: _failure(2, -9, at=T0 + 0.25, host="node-b.example"),
    }
    err = ChildFailedError(
        "train.py",
        failures,
        budget_note="restart budget exhausted: 3 of 3 restarts used (--max-restarts 3)",
    )
    body = [
        "train.py FAILED",
        "restart budget exhausted: 3 of 3 restarts used (--max-restarts 3)",
        "-",
        "Root cause (first observed failure):",
        "  rank      : 1 (local 1)",
        f"  host      : {HOST}",
        "  pid       : 1001",
        "  exitcode  : 1",
        f"  time      : {_ms(T0)}",
        f"  error_file: {error_file}",
        "  message   : ValueError: boom",
        "  traceback :",
        "    Traceback (most recent call last):",
        '      File "/job/train.py", line 7, in <module>',
        "        main()",
        '      File "/job/train.py", line 4, in main',
        '        raise ValueError("boom")',
        "    ValueError: boom",
        f"  stderr    : last 1 line of {log} before the traceback",
        "    step 10 loss 0.5",
        "-",
        "Other failures:",
        f"  rank 2 (local 2): exitcode -9 (SIGKILL), pid 1002, host node-b.example, "
        f"at {_ms(T0 + 0.25)}",
        "    Signal 9 (SIGKILL) received by PID 1002",
        "  rank 0 (local 0): terminated by elastrun (SIGTERM) after rank 1 failed",
    ]
    width = min(max(len(line) for line in body), 80)
    expected = ["=" * width, *(("-" * width) if line == "-" else line for line in body)]
    expected.append("=" * width)
    assert err.format_msg().splitlines() == expected


def test_str_of_error_is_the_full_report_on_its_own_lines() -> None:
    err = ChildFailedError("train.py", {0: _failure(0, 1)})
    assert str(err) == "\n" + err.format_msg()


def test_report_without_other_failures_says_none() -> None:
    report = ChildFailedError("train.py", {0: _failure(0, 1)}).format_msg()
    lines = report.splitlines()
    assert lines[lines.index("Other failures:") + 1] == "  <none>"
    assert "restart budget" not in report


def test_report_of_exit_code_without_error_file_shows_na_and_the_hint() -> None:
    report = ChildFailedError("train.py", {0: _failure(0, 3)}).format_msg()
    assert "  error_file: <N/A>" in report.splitlines()
    assert "  exitcode  : 3" in report.splitlines()
    assert "  message   : exited with code 3; no error file" in report
    assert "traceback :" not in report
    assert "stderr    :" not in report


def test_report_names_a_stderr_log_that_cannot_be_read(tmp_path: Path) -> None:
    log = tmp_path / "removed" / "stderr.log"
    failure = _failure(0, 1, _nested_error_file(tmp_path / "e.json"), stderr_file=str(log))
    assert failure.stderr_problem == f"cannot read {log}: No such file or directory"
    report = ChildFailedError("t", {0: failure}).format_msg().splitlines()
    assert f"  stderr    : cannot read {log}: No such file or directory" in report


def test_report_says_why_a_stderr_log_is_empty_when_writing_there_fails(tmp_path: Path) -> None:
    log = tmp_path / "stderr.log"
    log.write_text("")
    problem = f"cannot write worker logs to {tmp_path}: No space left on device"
    report = ChildFailedError(
        "t", {0: _failure(0, 1, stderr_file=str(log), log_problem=problem)}
    ).format_msg()
    assert f"  stderr    : stderr.log is empty; {problem}" in report.splitlines()
    elsewhere = "cannot write worker logs to /other: No space left on device"
    report = ChildFailedError(
        "t", {0: _failure(0, 1, stderr_file=str(log), log_problem=elsewhere)}
    ).format_msg()
    assert f"  stderr    : {log} is empty; {elsewhere}" in report.splitlines()


def test_report_of_an_empty_stderr_log_that_could_be_written_shows_no_stderr(
    tmp_path: Path,
) -> None:
    log = tmp_path / "stderr.log"
    log.write_text("")
    report = ChildFailedError("t", {0: _failure(0, 1, stderr_file=str(log))}).format_msg()
    assert "stderr    :" not in report
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stderr.log"]


def test_report_marks_a_stderr_tail_that_may_be_incomplete(tmp_path: Path) -> None:
    log = tmp_path / "stderr.log"
    log.write_text("epoch 1\n")
    problem = f"cannot write worker logs to {log}: No space left on device"
    failure = _failure(0, 1, stderr_file=str(log), log_problem=problem)
    report = ChildFailedError("t", {0: failure}).format_msg().splitlines()
    assert f"  stderr    : last 1 line of {log} (may be incomplete: {problem})" in report
    assert "    epoch 1" in report


def test_report_shows_an_unusable_error_file_and_why(tmp_path: Path) -> None:
    path = tmp_path / "e.json"
    path.write_text("{")
    report = ChildFailedError("t", {0: _failure(0, 1, str(path))}).format_msg()
    assert f"  error_file: {path} (unusable: error file is not valid JSON" in report


def test_report_shows_signal_name_next_to_exit_code() -> None:
    report = ChildFailedError("t", {0: _failure(0, -11)}).format_msg()
    assert "  exitcode  : -11 (SIGSEGV)" in report.splitlines()
    assert "  message   : Signal 11 (SIGSEGV) received by PID 1000" in report.splitlines()


def test_report_of_flat_error_file_shows_the_message_without_traceback(tmp_path: Path) -> None:
    path = tmp_path / "e.json"
    path.write_text(json.dumps({"message": "line one\nline two", "timestamp": 5}))
    lines = ChildFailedError("t", {0: _failure(0, 1, str(path))}).format_msg().splitlines()
    i = lines.index("  message   : line one")
    assert lines[i + 1] == "              line two"
    assert not any(line.startswith("  traceback") for line in lines)


def test_report_marks_the_root_when_every_worker_was_terminated_by_the_agent() -> None:
    failures = {
        0: _failure(0, -15, at=T0, terminated=True),
        1: _failure(1, -15, at=T0 + 1, terminated=True),
    }
    report = ChildFailedError("t", failures).format_msg()
    assert "  note      : terminated by elastrun; no worker failed on its own" in report
    assert "  rank 1 (local 1): terminated by elastrun (SIGTERM)" in report.splitlines()


def test_report_shows_how_a_terminated_sibling_exited_when_not_by_signal() -> None:
    failures = {0: _failure(0, 1, at=T0), 1: _failure(1, 143, at=T0 + 1, terminated=True)}
    report = ChildFailedError("t", failures).format_msg()
    expected = "  rank 1 (local 1): terminated by elastrun after rank 0 failed; exitcode 143"
    assert expected in report.splitlines()


def test_report_lists_other_failures_in_observation_order(tmp_path: Path) -> None:
    failures = {
        5: _failure(5, 1, at=T0 + 3),
        4: _failure(4, 1, at=T0 + 2),
        9: _failure(9, 1, at=T0),
    }
    lines = ChildFailedError("t", failures).format_msg().splitlines()
    others = lines[lines.index("Other failures:") + 1 :]
    heads = [line for line in others if line.startswith("  rank ")]
    assert heads[0].startswith("  rank 4 ") and heads[1].startswith("  rank 5 ")


def test_report_other_failure_with_error_file_shows_its_message_and_path(
    tmp_path: Path,
) -> None:
    path = _nested_error_file(tmp_path / "e.json", message="RuntimeError: second")
    failures = {0: _failure(0, 1, at=T0), 1: _failure(1, 1, path, at=T0 + 1)}
    lines = ChildFailedError("t", failures).format_msg().splitlines()
    i = lines.index("Other failures:")
    assert lines[i + 2 : i + 4] == ["    RuntimeError: second", f"    error_file: {path}"]


def test_report_width_is_capped() -> None:
    failures = {0: _failure(0, 3, host="h" * 200)}
    lines = ChildFailedError("t", failures).format_msg().splitlines()
    assert lines[0] == "=" * 80 and lines[-1] == "=" * 80


def test_report_width_follows_short_content() -> None:
    failures = {0: _failure(0, -9, host="h")}
    lines = ChildFailedError("t", failures).format_msg().splitlines()
    longest = max(len(line) for line in lines if set(line) - {"=", "-"})
    assert lines[0] == "=" * min(longest, 80)


def test_report_accepts_torchs_delimiter_arguments() -> None:
    err = ChildFailedError("t", {0: _failure(0, 1)})
    lines = err.format_msg(boarder_delim="#", section_delim="~").splitlines()
    assert set(lines[0]) == {"#"}
    assert set(lines[2]) == {"~"}


def test_error_survives_pickling() -> None:
    err = ChildFailedError("t", {0: _failure(0, 1)}, budget_note="note")
    copy = pickle.loads(pickle.dumps(err))
    assert copy.format_msg() == err.format_msg()
    assert copy.budget_note == "note"


def test_repr_names_the_root_cause() -> None:
    err = ChildFailedError("t", {0: _failure(0, 1, at=T0 + 1), 1: _failure(1, 1, at=T0)})
    assert repr(err) == "ChildFailedError(name='t', ranks=[0, 1], root_cause_rank=1)"


# --- copying the root cause upwards --------------------------------------------------


def test_copy_root_cause_writes_its_file_with_the_exit_code(tmp_path: Path) -> None:
    src = tmp_path / "1.json"
    write_error_file(str(src), exception_payload(ValueError("boom"), now=9))
    failures = {0: _failure(0, -15, at=T0 + 1, terminated=True), 1: _failure(1, 7, str(src))}
    dest = tmp_path / "agent" / "error.json"
    assert copy_root_cause_error_file(ChildFailedError("t", failures), str(dest))
    copied = json.loads(dest.read_text())
    assert copied["message"]["message"] == "ValueError: boom"
    assert copied["message"]["errorCode"] == 7


def test_copy_root_cause_without_error_file_writes_nothing(tmp_path: Path) -> None:
    dest = tmp_path / "error.json"
    assert not copy_root_cause_error_file(ChildFailedError("t", {0: _failure(0, -9)}), str(dest))
    assert not dest.exists()


def test_copy_root_cause_to_unwritable_destination_returns_false(tmp_path: Path) -> None:
    src = _nested_error_file(tmp_path / "e.json")
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    err = ChildFailedError("t", {0: _failure(0, 1, src)})
    assert not copy_root_cause_error_file(err, str(blocker / "error.json"))

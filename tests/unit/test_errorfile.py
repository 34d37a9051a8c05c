"""The error-file format: torch's layout written, both layouts read, nothing ever raised."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

from elastrun.core import errorfile
from elastrun.core.errorfile import (
    ErrorFileContents,
    ErrorFileProblem,
    copy_with_error_code,
    exception_payload,
    read_error_file,
    write_error_file,
)
from elastrun.wire.env import ERROR_FILE_ENV


def _raise_and_catch() -> ValueError:
    try:
        raise ValueError("boom")
    except ValueError as exc:
        return exc


def _contents(path: Path) -> ErrorFileContents:
    result = read_error_file(str(path))
    assert isinstance(result, ErrorFileContents), result
    return result


def _problem(path: Path) -> ErrorFileProblem:
    result = read_error_file(str(path))
    assert isinstance(result, ErrorFileProblem), result
    return result


def test_error_file_env_is_torchs_variable_name() -> None:
    assert ERROR_FILE_ENV == "TORCHELASTIC_ERROR_FILE"


def test_exception_payload_has_torchs_nested_layout() -> None:
    exc = _raise_and_catch()
    payload = exception_payload(exc, now=1700000000.9)
    assert set(payload) == {"message"}
    message = payload["message"]
    assert isinstance(message, dict)
    assert set(message) == {"message", "extraInfo"}
    assert message["message"] == "ValueError: boom"
    assert set(message["extraInfo"]) == {"py_callstack", "timestamp"}
    # torch writes integer epoch seconds, as a string.
    assert message["extraInfo"]["timestamp"] == "1700000000"
    callstack = message["extraInfo"]["py_callstack"]
    assert callstack.startswith("Traceback (most recent call last):\n")
    assert "_raise_and_catch" in callstack
    assert callstack.endswith("ValueError: boom\n")


def test_exception_payload_defaults_timestamp_to_now() -> None:
    payload = exception_payload(ValueError("x"))
    message = payload["message"]
    assert isinstance(message, dict)
    assert abs(int(message["extraInfo"]["timestamp"]) - time.time()) < 60


def test_exception_payload_without_traceback_still_formats() -> None:
    payload = exception_payload(KeyError("k"), now=5)
    message = payload["message"]
    assert isinstance(message, dict)
    assert message["message"] == "KeyError: 'k'"
    assert message["extraInfo"]["py_callstack"] == "KeyError: 'k'\n"


def test_write_then_read_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    write_error_file(str(path), exception_payload(_raise_and_catch(), now=1700000000))
    contents = _contents(path)
    assert contents.message == "ValueError: boom"
    assert contents.traceback is not None and "raise ValueError" in contents.traceback
    assert contents.timestamp == 1700000000.0
    assert contents.error_code is None
    assert json.loads(path.read_text()) == contents.raw


def test_write_creates_parent_directories(tmp_path: Path) -> None:
    path = tmp_path / "attempt_0" / "3" / "error.json"
    write_error_file(str(path), {"message": "x"})
    assert json.loads(path.read_text()) == {"message": "x"}


def test_write_replaces_an_existing_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    path.write_text("old contents that are longer than the new ones")
    write_error_file(str(path), {"message": "new"})
    assert json.loads(path.read_text()) == {"message": "new"}
    assert os.listdir(tmp_path) == ["error.json"]


def test_written_file_is_readable_by_others(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    old = os.umask(0o022)
    try:
        write_error_file(str(path), {"message": "x"})
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_write_of_unserializable_payload_raises_and_leaves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    with pytest.raises(TypeError):
        write_error_file(str(path), {"message": object()})
    assert os.listdir(tmp_path) == []


def test_write_into_unwritable_location_raises_oserror(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError):
        write_error_file(str(blocker / "error.json"), {"message": "x"})


def test_reads_flat_layout_with_int_timestamp(tmp_path: Path) -> None:
    path = tmp_path / "e.json"
    path.write_text(json.dumps({"message": "worker exploded", "timestamp": 1700000001}))
    contents = _contents(path)
    assert contents.message == "worker exploded"
    assert contents.timestamp == 1700000001.0
    assert contents.traceback is None
    assert contents.error_code is None


def test_reads_flat_layout_with_string_timestamp(tmp_path: Path) -> None:
    path = tmp_path / "e.json"
    path.write_text(json.dumps({"message": "m", "timestamp": "1700000002"}))
    assert _contents(path).timestamp == 1700000002.0


def test_reads_flat_layout_without_timestamp(tmp_path: Path) -> None:
    path = tmp_path / "e.json"
    path.write_text(json.dumps({"message": "m"}))
    assert _contents(path).timestamp is None


def test_reads_nested_layout_with_error_code(tmp_path: Path) -> None:
    path = tmp_path / "e.json"
    doc = {
        "message": {
            "message": "RuntimeError: x",
            "extraInfo": {"py_callstack": "Traceback...\nRuntimeError: x\n", "timestamp": "12"},
            "errorCode": -9,
        }
    }
    path.write_text(json.dumps(doc))
    contents = _contents(path)
    assert contents.message == "RuntimeError: x"
    assert contents.traceback == "Traceback...\nRuntimeError: x\n"
    assert contents.timestamp == 12.0
    assert contents.error_code == -9


@pytest.mark.parametrize("stamp", ["not a number", None, True, [1], "nan", -5, "inf"])
def test_bad_timestamp_is_tolerated_as_unknown(tmp_path: Path, stamp: object) -> None:
    path = tmp_path / "e.json"
    doc = {"message": {"message": "E: x", "extraInfo": {"timestamp": stamp}}}
    path.write_text(json.dumps(doc))
    contents = _contents(path)
    assert contents.message == "E: x"
    assert contents.timestamp is None


def test_nested_layout_without_extra_info_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "e.json"
    path.write_text(json.dumps({"message": {"message": "E: x", "extraInfo": "junk"}}))
    contents = _contents(path)
    assert (contents.message, contents.traceback, contents.timestamp) == ("E: x", None, None)


def test_missing_file_is_a_problem_marked_missing(tmp_path: Path) -> None:
    problem = _problem(tmp_path / "nope.json")
    assert problem.missing
    assert problem.path == str(tmp_path / "nope.json")


def test_empty_path_is_a_problem_marked_missing() -> None:
    problem = read_error_file("")
    assert isinstance(problem, ErrorFileProblem)
    assert problem.missing


@pytest.mark.parametrize(
    ("content", "reason_part"),
    [
        (b"", "empty"),
        (b"  \n", "empty"),
        (b'{"message": {"message": "ValueError: bo', "not valid JSON (truncated?)"),
        (b"not json at all", "not valid JSON"),
        (b"\xff\xfe\x00garbage", "not valid UTF-8"),
        (b"[1, 2]", "JSON list, not an object"),
        (b'"just a string"', "JSON str, not an object"),
        (b'{"msg": "x"}', "no 'message' field"),
        (b'{"message": 42}', "'message' is a JSON int"),
        (b'{"message": {"extraInfo": {}}}', "no string 'message' field"),
        (b"[" * 100_000, "not valid JSON"),
    ],
)
def test_unusable_content_is_a_problem_with_a_reason(
    tmp_path: Path, content: bytes, reason_part: str
) -> None:
    path = tmp_path / "e.json"
    path.write_bytes(content)
    problem = _problem(path)
    assert reason_part in problem.reason
    assert not problem.missing


def test_directory_in_place_of_file_is_a_problem(tmp_path: Path) -> None:
    problem = _problem(tmp_path)
    assert "directory" in problem.reason
    assert not problem.missing


def test_unreadable_path_is_a_problem(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    assert "could not be read" in _problem(tmp_path / "file" / "e.json").reason


def test_fifo_in_place_of_file_is_a_problem_and_does_not_block(tmp_path: Path) -> None:
    path = tmp_path / "e.json"
    os.mkfifo(path)
    assert "not a regular file" in _problem(path).reason


def test_oversized_file_is_a_problem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(errorfile, "MAX_ERROR_FILE_BYTES", 10)
    path = tmp_path / "e.json"
    path.write_text(json.dumps({"message": "a message longer than ten bytes"}))
    assert "larger than 10 bytes" in _problem(path).reason


def test_copy_adds_error_code_to_nested_layout(tmp_path: Path) -> None:
    src = tmp_path / "child.json"
    write_error_file(str(src), exception_payload(_raise_and_catch(), now=7))
    dest = tmp_path / "parent" / "error.json"
    copy_with_error_code(_contents(src), str(dest), -9)
    copied = json.loads(dest.read_text())
    original = json.loads(src.read_text())
    assert copied["message"]["errorCode"] == -9
    del copied["message"]["errorCode"]
    assert copied == original
    assert "errorCode" not in original["message"]  # the source is not modified


def test_copy_with_zero_code_adds_nothing(tmp_path: Path) -> None:
    src = tmp_path / "child.json"
    write_error_file(str(src), exception_payload(ValueError("x"), now=7))
    dest = tmp_path / "parent.json"
    copy_with_error_code(_contents(src), str(dest), 0)
    assert json.loads(dest.read_text()) == json.loads(src.read_text())


def test_copy_of_flat_layout_is_unchanged(tmp_path: Path) -> None:
    src = tmp_path / "child.json"
    src.write_text(json.dumps({"message": "flat", "timestamp": 3}))
    dest = tmp_path / "parent.json"
    dest.write_text("previous contents")
    copy_with_error_code(_contents(src), str(dest), 1)
    assert json.loads(dest.read_text()) == {"message": "flat", "timestamp": 3}


def test_contents_are_immutable(tmp_path: Path) -> None:
    path = tmp_path / "e.json"
    path.write_text(json.dumps({"message": "m"}))
    contents = _contents(path)
    with pytest.raises(AttributeError):
        contents.message = "other"  # type: ignore[misc]  # frozen: the set must raise

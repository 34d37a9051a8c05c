"""``elastrun.worker.record``: torch's semantics, and error files that cross with torch both ways.

The torch tests run torch in subprocesses: importing torch into the test process would
trip the suite's warnings-as-errors guard (torch warns when numpy is missing) and cost
seconds of memory for every later test.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from elastrun.core.errorfile import (
    ErrorFileContents,
    exception_payload,
    read_error_file,
    write_error_file,
)
from elastrun.supervise.failures import ChildFailedError, ProcessFailure
from elastrun.worker.record import ErrorHandler, get_error_handler, record

ENV_VAR = "TORCHELASTIC_ERROR_FILE"


@pytest.fixture
def error_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "error.json"
    monkeypatch.setenv(ENV_VAR, str(path))
    return path


def _read(path: Path) -> ErrorFileContents:
    contents = read_error_file(str(path))
    assert isinstance(contents, ErrorFileContents), contents
    return contents


def _run_python(code: str, cwd: Path, env_error_file: Path | None = None) -> str:
    env = dict(os.environ)
    env.pop(ENV_VAR, None)
    if env_error_file is not None:
        env[ENV_VAR] = str(env_error_file)
    result = subprocess.run(
        [sys.executable, "-u", "-c", textwrap.dedent(code)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


# --- torch's semantics, in process ------------------------------------------------------


def test_bare_decorator_records_the_exception_and_reraises(error_file: Path) -> None:
    @record
    def main() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        main()
    contents = _read(error_file)
    assert contents.message == "ValueError: boom"
    assert contents.traceback is not None
    assert 'raise ValueError("boom")' in contents.traceback


def test_called_decorator_and_return_values_pass_through(error_file: Path) -> None:
    @record()
    def add(a: int, b: int = 0) -> int:
        return a + b

    assert add(2, b=3) == 5
    assert add.__name__ == "add"
    assert not error_file.exists()


def test_system_exit_zero_returns_none(error_file: Path) -> None:
    @record
    def main() -> int:
        raise SystemExit(0)

    assert main() is None
    assert not error_file.exists()


@pytest.mark.parametrize("code", [3, "fatal", None])
def test_other_system_exit_propagates_without_error_file(error_file: Path, code: object) -> None:
    @record
    def main() -> None:
        raise SystemExit(code)

    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == code
    assert not error_file.exists()


def test_keyboard_interrupt_is_not_recorded(error_file: Path) -> None:
    @record
    def main() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        main()
    assert not error_file.exists()


def test_without_error_file_variable_nothing_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.chdir(tmp_path)

    @record
    def main() -> None:
        raise ValueError("x")

    with pytest.raises(ValueError):
        main()
    assert os.listdir(tmp_path) == []


def test_unwritable_error_file_does_not_hide_the_exception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "blocker").write_text("")
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "blocker" / "error.json"))

    @record
    def main() -> None:
        raise ValueError("the real error")

    with caplog.at_level(logging.WARNING), pytest.raises(ValueError, match="the real error"):
        main()
    assert "could not write error file" in caplog.text


def test_custom_error_handler_chooses_the_path(tmp_path: Path) -> None:
    target = tmp_path / "custom.json"

    class Handler(ErrorHandler):
        def _get_error_file_path(self) -> str | None:
            return str(target)

    @record(error_handler=Handler())
    def main() -> None:
        raise RuntimeError("custom")

    with pytest.raises(RuntimeError):
        main()
    assert _read(target).message == "RuntimeError: custom"


def test_record_with_function_and_handler_positionally(tmp_path: Path) -> None:
    target = tmp_path / "positional.json"

    class Handler(ErrorHandler):
        def _get_error_file_path(self) -> str | None:
            return str(target)

    def main() -> None:
        raise LookupError("pos")

    with pytest.raises(LookupError):
        record(main, Handler())()
    assert _read(target).message == "LookupError: pos"


def _child_failed(tmp_path: Path, *, with_file: bool, exitcode: int = -9) -> ChildFailedError:
    child_file = tmp_path / "child" / "error.json"
    if with_file:
        try:
            raise ValueError("child boom")
        except ValueError as exc:
            write_error_file(str(child_file), exception_payload(exc))
    failure = ProcessFailure(
        local_rank=1, pid=99, exitcode=exitcode, error_file=str(child_file), host="h"
    )
    return ChildFailedError("train.py", {1: failure})


def test_child_failed_error_forwards_the_root_cause_with_its_exit_code(
    tmp_path: Path, error_file: Path
) -> None:
    err = _child_failed(tmp_path, with_file=True, exitcode=-9)

    @record
    def main() -> None:
        raise err

    with pytest.raises(ChildFailedError):
        main()
    contents = _read(error_file)
    assert contents.message == "ValueError: child boom"
    assert contents.error_code == -9
    assert contents.traceback is not None and "child boom" in contents.traceback


def test_child_failed_error_without_child_file_records_the_report(
    tmp_path: Path, error_file: Path
) -> None:
    err = _child_failed(tmp_path, with_file=False)

    @record
    def main() -> None:
        raise err

    with pytest.raises(ChildFailedError):
        main()
    contents = _read(error_file)
    assert contents.message.startswith("ChildFailedError: \n")
    assert "train.py FAILED" in contents.message


def test_broken_get_first_failure_falls_back_to_recording_the_exception(
    error_file: Path,
) -> None:
    class Odd(Exception):
        def get_first_failure(self) -> None:
            raise RuntimeError("not what you think")

    @record
    def main() -> None:
        raise Odd("odd")

    with pytest.raises(Odd):
        main()
    assert _read(error_file).message == "Odd: odd"


def test_dump_error_file_of_broken_child_file_writes_nothing(
    tmp_path: Path, error_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    child = tmp_path / "child.json"
    child.write_text('{"message": ')
    with caplog.at_level(logging.WARNING):
        get_error_handler().dump_error_file(str(child), 1)
    assert not error_file.exists()
    assert "not valid JSON" in caplog.text


def test_dump_error_file_replaces_an_existing_own_file(tmp_path: Path, error_file: Path) -> None:
    child = tmp_path / "child.json"
    write_error_file(str(child), exception_payload(KeyError("k"), now=1))
    error_file.write_text("stale")
    get_error_handler().dump_error_file(str(child), 7)
    assert _read(error_file).error_code == 7


def test_handler_repr_shows_the_path(error_file: Path) -> None:
    assert repr(ErrorHandler()) == f"ErrorHandler(error_file={str(error_file)!r})"


def test_record_enables_faulthandler(tmp_path: Path) -> None:
    out = _run_python(
        """\
        import faulthandler
        from elastrun.worker.record import record

        @record
        def main():
            return faulthandler.is_enabled()

        print(faulthandler.is_enabled(), main())
        """,
        tmp_path,
    )
    assert out.split() == ["False", "True"]


# --- interoperation with torch ----------------------------------------------------------


@pytest.mark.torch
def test_torch_reads_our_error_file_and_forwards_it_with_an_error_code_we_read(
    tmp_path: Path, error_file: Path
) -> None:
    # One torch subprocess for both directions of the agent-side path: importing torch
    # costs seconds.
    @record
    def main() -> None:
        raise ValueError("ours")

    with pytest.raises(ValueError):
        main()
    ours = _read(error_file)
    parent = tmp_path / "parent.json"
    out = _run_python(
        f"""\
        import json
        from torch.distributed.elastic.multiprocessing.errors import (
            ChildFailedError, ErrorHandler, ProcessFailure,
        )
        failure = ProcessFailure(local_rank=0, pid=5, exitcode=1, error_file={str(error_file)!r})
        err = ChildFailedError("train", {{0: failure}})
        ErrorHandler().dump_error_file({str(error_file)!r}, -11)
        print(json.dumps({{
            "message": failure.message, "timestamp": failure.timestamp,
            "report": err.format_msg(),
        }}))
        """,
        tmp_path,
        env_error_file=parent,
    )
    seen = json.loads(out)
    assert seen["message"]["message"] == "ValueError: ours"
    assert seen["timestamp"] == ours.timestamp
    assert 'raise ValueError("ours")' in seen["report"]
    forwarded = _read(parent)
    assert forwarded.message == "ValueError: ours"
    assert forwarded.error_code == -11
    assert forwarded.timestamp == ours.timestamp


TORCH_RECORD_SCRIPT = """\
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    raise KeyError("from torch record")

main()
"""


@pytest.mark.torch
def test_torchs_record_file_is_kept_by_the_bootstrap_and_read_by_us(tmp_path: Path) -> None:
    script = tmp_path / "torch_job.py"
    script.write_text(TORCH_RECORD_SCRIPT)
    error_file = tmp_path / "error.json"
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    result = subprocess.run(
        [sys.executable, "-u", "-m", "elastrun.worker.bootstrap", str(script)],
        env={**env, ENV_VAR: str(error_file)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 1
    # Read by ours: elastrun's reader and failure report understand torch's file.
    contents = _read(error_file)
    assert contents.message == "KeyError: 'from torch record'"
    assert contents.traceback is not None
    assert f'File "{script}", line 5, in main' in contents.traceback
    assert contents.timestamp is not None
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
    assert failure.message == contents.message
    assert failure.traceback == contents.traceback
    # Kept by the bootstrap: torch's record formats the traceback from inside its
    # wrapper, so the wrapper frame, not the script's module level, comes first.
    assert "torch/distributed/elastic/multiprocessing/errors" in contents.traceback
    assert "line 7, in <module>" not in contents.traceback


@pytest.mark.torch
def test_our_record_forwards_torchs_child_failed_error(tmp_path: Path) -> None:
    child = tmp_path / "child.json"
    write_error_file(str(child), exception_payload(ValueError("in the child"), now=5))
    parent = tmp_path / "parent.json"
    _run_python(
        f"""\
        from torch.distributed.elastic.multiprocessing.errors import (
            ChildFailedError, ProcessFailure,
        )
        from elastrun.worker.record import record

        @record
        def main():
            failure = ProcessFailure(local_rank=0, pid=7, exitcode=-6, error_file={str(child)!r})
            raise ChildFailedError("trainer", {{3: failure}})

        try:
            main()
        except ChildFailedError:
            pass
        """,
        tmp_path,
        env_error_file=parent,
    )
    contents = _read(parent)
    assert contents.message == "ValueError: in the child"
    assert contents.error_code == -6

"""Where tee'd worker lines are shown: through ``sys.stdout``/``sys.stderr`` for the
Python API and the launcher's ``main()`` called from Python (so
``contextlib.redirect_stdout``, pytest's capsys and notebook cells get them, as with
torch), and straight to descriptors 1 and 2 for the ``elastrun`` command."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _helpers import REPO
from elastrun import (
    DefaultLogsSpecs,
    LaunchConfig,
    LocalElasticAgent,
    Std,
    WorkerSpec,
    WorkerState,
    elastic_launch,
    start_processes,
)
from elastrun.launch.main import main

LINES = 200

#: A worker that writes LINES stdout lines, one stderr line, and a last stdout line
#: without a newline (shown only when its stream ends).
WORKER_CODE = textwrap.dedent(
    f"""
    import os, sys
    rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "?"))
    for i in range({LINES}):
        print(f"out {{rank}} line {{i}}")
    print(f"err {{rank}}", file=sys.stderr)
    sys.stdout.write(f"tail {{rank}}")
    """
)


def write_lines() -> None:
    exec(WORKER_CODE)


def expected_out(prefix: str, rank: int) -> list[str]:
    lines = [f"{prefix}out {rank} line {i}\n" for i in range(LINES)]
    return [*lines, f"{prefix}tail {rank}\n"]


def lines_of(text: str, prefix: str) -> list[str]:
    return [line for line in text.splitlines(keepends=True) if line.startswith(prefix)]


def test_elastic_launch_shows_tee_lines_through_a_redirected_sys_stdout(tmp_path: Path) -> None:
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=2,
        max_restarts=0,
        logs_specs=DefaultLogsSpecs(log_dir=os.fspath(tmp_path), tee=Std.ALL),
    )
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert elastic_launch(config, write_lines)() == {0: None, 1: None}
    for rank in range(2):
        prefix = f"[{config.role}{rank}]:"
        assert lines_of(out.getvalue(), prefix) == expected_out(prefix, rank)
        assert lines_of(err.getvalue(), prefix) == [f"{prefix}err {rank}\n"]


def test_start_processes_shows_tee_lines_where_sys_stdout_was_when_it_started(
    tmp_path: Path,
) -> None:
    # Resolved when the context starts, as torch does: the lines of this run go to the
    # redirected stream even though the caller's redirect ended before the wait.
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        ctx = start_processes(
            "trainer",
            sys.executable,
            args={0: ("-c", WORKER_CODE), 1: ("-c", WORKER_CODE)},
            envs={0: {"RANK": "0"}, 1: {"RANK": "1"}},
            logs_specs=DefaultLogsSpecs(log_dir=os.fspath(tmp_path), tee=Std.ALL),
        )
    result = ctx.wait()
    assert result is not None and not result.is_failed()
    for rank in range(2):
        prefix = f"[trainer{rank}]:"
        assert lines_of(out.getvalue(), prefix) == expected_out(prefix, rank)
        assert lines_of(err.getvalue(), prefix) == [f"{prefix}err {rank}\n"]


def test_local_agent_tee_lines_reach_capsys_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Four workers' lines written by the relay thread into one text stream: every line
    # arrives whole, none is lost.
    agent = LocalElasticAgent(
        WorkerSpec(local_world_size=4, entrypoint=write_lines),
        logs_specs=DefaultLogsSpecs(log_dir=os.fspath(tmp_path), tee=Std.OUT),
    )
    assert agent.run().state is WorkerState.SUCCEEDED
    shown = capsys.readouterr().out
    relayed = [line for line in shown.splitlines(keepends=True) if line.startswith("[default")]
    assert all(re.fullmatch(r"\[default\d\]:(out \d line \d+|tail \d)\n", x) for x in relayed)
    for rank in range(4):
        prefix = f"[default{rank}]:"
        assert lines_of(shown, prefix) == expected_out(prefix, rank)


def test_main_called_from_python_shows_tee_lines_through_a_redirected_sys_stdout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As torch's own test of torch.distributed.run.main does: the launcher's main(),
    # called in this process under redirect_stdout, with the prefix template.
    script = tmp_path / "worker.py"
    script.write_text(WORKER_CODE)
    monkeypatch.setenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank${rank}]: ")
    argv = ["--nproc-per-node", "2", "--redirects", "3", "--tee", "3"]
    argv += ["--log-dir", os.fspath(tmp_path / "logs"), os.fspath(script)]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(argv) == 0
    for rank in range(2):
        prefix = f"[rank{rank}]: "
        assert lines_of(out.getvalue(), prefix) == expected_out(prefix, rank)
        assert lines_of(err.getvalue(), prefix) == [f"{prefix}err {rank}\n"]


def test_the_command_writes_tee_lines_to_descriptor_one_not_sys_stdout(tmp_path: Path) -> None:
    # The command owns its process's stdout: its entry point chooses the descriptors,
    # so a replaced sys.stdout does not see the lines.
    script = tmp_path / "worker.py"
    script.write_text(WORKER_CODE)
    argv = ["--nproc-per-node", "2", "--tee", "3", "--log-dir", os.fspath(tmp_path / "logs")]
    driver = textwrap.dedent(
        f"""
        import io, sys
        sys.stdout = io.StringIO()
        sys.argv = ["elastrun", *{[*argv, os.fspath(script)]!r}]
        from elastrun.launch.entry import main
        rc = main()
        assert "[default" not in sys.stdout.getvalue(), sys.stdout.getvalue()
        sys.exit(rc)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.fspath(REPO / "src")}
    done = subprocess.run(
        [sys.executable, "-c", driver],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    for rank in range(2):
        prefix = f"[default{rank}]:"
        assert lines_of(done.stdout, prefix) == expected_out(prefix, rank)
        assert lines_of(done.stderr, prefix) == [f"{prefix}err {rank}\n"]

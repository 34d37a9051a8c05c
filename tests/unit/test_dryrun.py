"""``--dry-run`` plans through the agent's own constructors, so it refuses what they do."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastrun.core.errors import ConfigError
from elastrun.launch.cli import parse_launch
from elastrun.launch.dryrun import render_plan
from elastrun.launch.main import command_of
from elastrun.wire.env import INPROCESS_TIMEOUT_ENV


@pytest.fixture(autouse=True)
def _no_shutdown_timeout_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # LaunchConfig resolves this variable from the process environment.
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)


def _plan(tmp_path: Path, environ: dict[str, str]) -> str:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    launch = parse_launch(["--nproc-per-node", "2", "--dry-run", str(script)], environ)
    entrypoint, args = command_of(launch)
    return render_plan(launch, entrypoint, args, environ)


def test_a_dry_run_shows_the_signals_the_launcher_exports_and_the_services_of_the_agent(
    tmp_path: Path,
) -> None:
    shown = _plan(tmp_path, {"TORCHELASTIC_ENABLE_FILE_TIMER": "1", "ELASTRUN_INPROCESS": "0"})
    (env, _) = [line for line in shown.splitlines() if line.startswith("  env : ")]
    assert "TORCHELASTIC_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT" in env
    assert "TORCHELASTIC_TIMER_FILE=" in env
    assert "ELASTRUN_INPROCESS_SOCKET" not in env  # in-process recovery turned off


def test_a_dry_run_refuses_an_agent_variable_the_launch_would_refuse(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=INPROCESS_TIMEOUT_ENV):
        _plan(tmp_path, {INPROCESS_TIMEOUT_ENV: "soon"})

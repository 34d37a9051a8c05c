"""Real torch gloo DDP training whose workers are forked from a torch-preloaded template."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from _helpers import REPO
from elastrun import DefaultLogsSpecs, LocalElasticAgent, WorkerSpec
from elastrun.agent.parts import World
from elastrun.template.agent.starter import TemplateStarter

pytestmark = pytest.mark.torch

DEMO = REPO / "examples" / "ddp_demo.py"


class _Events:
    def __init__(self) -> None:
        self.seen: list[tuple[float, str, dict[str, object]]] = []

    def record(self, name: str, metadata: dict[str, object]) -> None:
        self.seen.append((time.monotonic(), name, dict(metadata)))


def test_ddp_job_recovers_from_a_sigkilled_rank_through_the_template(tmp_path: Path) -> None:
    result_file = tmp_path / "result.json"
    args = (
        "-u",
        str(DEMO),
        "--steps",
        "24",
        "--checkpoint-every",
        "10",
        "--crash-at-step",
        "14",
        "--crash-rank",
        "1",
        "--crash-mode",
        "kill",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--result-file",
        str(result_file),
    )
    spec = WorkerSpec(local_world_size=3, entrypoint=sys.executable, args=args, max_restarts=2)
    events = _Events()
    starter = TemplateStarter(preload=["torch"])
    agent = LocalElasticAgent(
        spec,
        DefaultLogsSpecs(log_dir=str(tmp_path / "logs")),
        # arg-type: its record() takes dict[str, object]
        world=World(starter=starter, events=events),  # type: ignore[arg-type]
    )
    try:
        result = agent.run()
        template_pid = starter.template_pid
    finally:
        starter.close()
    assert not result.is_failed(), result.failures
    outcome = json.loads(result_file.read_text())
    assert outcome["identical"] is True
    assert outcome["restart_count"] == 1
    assert outcome["resumed_from"] == 10
    assert outcome["steps"] == 24
    # Both attempts' workers came from the one template, none from a fresh interpreter.
    assert template_pid is not None
    assert starter.templates_started == 1
    assert (starter.forked, starter.fell_back) == (6, 0)
    starts = [meta for _, name, meta in events.seen if name == "agent.workers_started"]
    assert len(starts) == 2
    # Forking three workers takes milliseconds; a fresh start imports torch three times.
    # arg-type: the recorded metadata's values are typed object
    assert float(starts[1]["duration_ms"]) < 2000, starts  # type: ignore[arg-type]

"""Real torch gloo DDP training under elastrun, with a rank SIGKILLed mid-training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _helpers import REPO, run

pytestmark = pytest.mark.torch

DEMO = REPO / "examples" / "ddp_demo.py"


def test_ddp_job_recovers_from_a_sigkilled_rank_and_ends_identical(tmp_path: Path) -> None:
    result_file = tmp_path / "result.json"
    result = run(
        [
            "--nproc-per-node",
            "3",
            "--max-restarts",
            "2",
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
        ],
        cwd=tmp_path,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result_file.read_text())
    assert outcome["identical"] is True
    assert outcome["restart_count"] == 1
    assert outcome["resumed_from"] == 10
    assert outcome["steps"] == 24
    assert "was killed by SIGKILL; restarting all workers (restart 1 of 2)" in result.stderr

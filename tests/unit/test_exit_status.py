"""The launcher's exit statuses: a contract with schedulers, pinned and documented."""

from __future__ import annotations

import re

from _helpers import REPO
from elastrun.core.exitcodes import ExitStatus, signal_status


def test_the_statuses_are_pinned_and_ordered_for_srun() -> None:
    assert {s.name: int(s) for s in ExitStatus} == {
        "SUCCESS": 0,
        "WORKER_FAILED": 1,
        "BAD_CONFIG": 2,
        "REPLACE_NODE": 75,
        "DO_NOT_REQUEUE": 93,
    }
    # srun reports the highest status of a step's tasks: "do not requeue" on one node
    # wins over "replace me", which wins over the others' "failed on another node".
    assert ExitStatus.WORKER_FAILED < ExitStatus.REPLACE_NODE < ExitStatus.DO_NOT_REQUEUE
    assert signal_status(1) > ExitStatus.DO_NOT_REQUEUE and signal_status(15) == 143


def test_every_status_has_a_row_in_the_documented_table() -> None:
    text = (REPO / "docs" / "failures.md").read_text()
    section = text.split("## Exit statuses and what to do", 1)[1].split("\n#", 1)[0]
    rows = set(re.findall(r"^\| (128\+N|\d+)\b", section, re.M))
    assert rows == {*(str(int(s)) for s in ExitStatus), "128+N"}

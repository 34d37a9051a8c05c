"""Memory checkpoints' events end to end: the agent, which never imports torch, reads
what its workers report in the node directory and records it in the event log.

``examples/memory_checkpoint.py`` on one node of two ranks (FSDP2, gloo, CPU), a save
every step; rank 1 exits at step 5 once step 4 is saved on every rank, so the restarted
group restores step 4 on both ranks, as the restart's line says it will.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from _helpers import REPO, run

pytestmark = [pytest.mark.slow, pytest.mark.torch]
pytest.importorskip("torch")

EXAMPLE = REPO / "examples" / "memory_checkpoint.py"
STEPS = 8
FAIL_STEP = 5


def test_the_event_log_says_which_step_each_rank_restored_and_what_its_saves_cost(
    tmp_path: Path,
) -> None:
    res = run(
        ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
         "--event-log-handler", "file:events.jsonl",
         str(EXAMPLE), "--steps", str(STEPS), "--width", "16", "--fail-rank", "1",
         "--fail-step", str(FAIL_STEP), "--fail-mode", "exit", "--result-dir", "result"],
        cwd=tmp_path, env={"OMP_NUM_THREADS": "1"}, timeout=90,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    events: list[tuple[str, dict[str, Any]]] = []
    for line in (tmp_path / "events.jsonl").read_text().splitlines():
        event = json.loads(line)
        events.append((event["name"], event["metadata"]))

    # The restart's line and event say where the state comes from: rank 1 reported step
    # 4 complete on every rank before it exited.
    assert f"restarting all workers, state from memory at step {FAIL_STEP - 1}" in res.stderr
    (restart,) = [m for name, m in events if name == "agent.restart"]
    assert restart["from_memory_step"] == FAIL_STEP - 1

    restored = {m["rank"]: m for name, m in events if name == "agent.checkpoint_restored"}
    assert sorted(restored) == [0, 1], events
    assert {m["step"] for m in restored.values()} == {FAIL_STEP - 1}
    assert all(m["duration_ms"] > 0 for m in restored.values())
    assert f"restored step {FAIL_STEP - 1} from memory" in res.stderr

    # One summary per worker process that saved: the first attempt's two (closed when
    # their successors reported) and the second's two (at the end of the run).
    summaries = [m for name, m in events if name == "agent.checkpoint_saves"]
    pids = {m["pid"] for m in restored.values()}
    first = {m["rank"]: m for m in summaries if m["pid"] not in pids}
    second = {m["rank"]: m for m in summaries if m["pid"] in pids}
    assert len(summaries) == 4 and sorted(first) == sorted(second) == [0, 1], summaries
    # Rank 1 exited once its save of the step before was complete on every rank; rank 0
    # was stopped then, perhaps before its own report of that step.
    assert first[1]["newest"] == FAIL_STEP - 1
    assert first[0]["newest"] in (FAIL_STEP - 2, FAIL_STEP - 1)
    for m in second.values():  # only their own saves: not their predecessors'
        assert (m["saves"], m["complete"], m["newest"]) == (STEPS - FAIL_STEP,) * 2 + (STEPS - 1,)
    for m in summaries:
        assert m["complete"] >= 1 and m["blocked_ms"] > 0
        assert m["save_ms"] <= m["lag_ms"]  # written on this rank, then on every rank

"""The agent's side of the node check with a stand-in for the check's process: it runs
before the first round and again only after a failure of this node's own workers; a
failed check is told in an event and a metric, and with no job-wide record to keep the
node out in (a torch-style rendezvous) the node joins anyway."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from pathlib import Path

import pytest

from _helpers import wait_for
from elastrun.agent.options import AgentOptions
from elastrun.agent.parts import World
from elastrun.agent.spec import WorkerSpec, WorkerState
from elastrun.core.errors import ShutdownRequested
from elastrun.core.shutdown import ShutdownRequest
from elastrun.launch.local_agent import LocalElasticAgent
from elastrun.nodecheck.agent.verdicts import NodeCheckRule
from elastrun.observe.sinks import MemoryEventSink
from elastrun.supervise.processes.logs import DefaultLogsSpecs
from elastrun.testing import FakeClock, FakeStarter, NullGuard


class Metrics:
    """Keeps every value put (tests)."""

    def __init__(self) -> None:
        self.put_values: list[tuple[str, float]] = []

    def put(self, name: str, value: float) -> None:
        self.put_values.append((name, value))

    def values(self, name: str) -> list[float]:
        return [v for n, v in self.put_values if n == name]


# Stands in for the workers' interpreter: each check's command line goes to a file, and
# its answer is the check process' last line.
FAKE_PYTHON = """#!/bin/sh
echo "$@" >> {calls}
{before}
echo '{answer}'
"""


def _agent(
    tmp_path: Path,
    starter: FakeStarter,
    world: World | None = None,
    *,
    ok: bool,
    before: str = "",
) -> tuple[LocalElasticAgent, Path]:
    calls = tmp_path / "calls"
    good, bad = '{"ok": true, "seconds": 0.01}', '{"ok": false, "error": "bad GPU"}'
    answer = good if ok else bad
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON.format(calls=calls, answer=answer, before=before))
    python.chmod(0o755)
    spec = WorkerSpec(local_world_size=2, entrypoint="/bin/prog", max_restarts=3)
    options = AgentOptions(
        environ={}, run_id="unit", python=str(python), hostname="node-a",
        node_check=NodeCheckRule(enabled=True, timeout=30.0),
    )  # fmt: skip
    world = dataclasses.replace(
        world or World(), starter=starter, guard=NullGuard(), clock=FakeClock()
    )
    logs = DefaultLogsSpecs(log_dir=str(tmp_path / "logs"))
    agent = LocalElasticAgent(spec, logs, options=options, world=world)
    return agent, calls


def test_a_node_is_checked_before_its_first_round_and_after_its_own_failure(
    tmp_path: Path,
) -> None:
    # Rank 1 fails in attempt 0: one restart after a failure of this node's workers.
    starter = FakeStarter(script=lambda a, r: 1 if (a, r) == (0, 1) else 0)
    metrics = Metrics()
    agent, calls = _agent(tmp_path, starter, World(metrics=metrics), ok=True)
    assert agent.run().state is WorkerState.SUCCEEDED
    checks = calls.read_text().splitlines()
    assert len(checks) == 2 and all(c.endswith(" compute") for c in checks)
    assert "-m elastrun.nodecheck.worker.runner" in checks[0]
    assert metrics.values("agent.node_check_failed") == [0, 0]


def test_a_failed_check_is_told_and_with_nowhere_to_be_kept_out_the_node_joins(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    events, metrics = MemoryEventSink(), Metrics()
    agent, _ = _agent(tmp_path, FakeStarter(), World(events=events, metrics=metrics), ok=False)
    with caplog.at_level(logging.ERROR, logger="elastrun.agent"):
        assert agent.run().state is WorkerState.SUCCEEDED
    (failed,) = [meta for name, meta in events.events if name == "agent.node_check_failed"]
    assert failed["host"] == "node-a"
    assert "its compute check failed: bad GPU" in str(failed["reason"])
    assert metrics.values("agent.node_check_failed") == [1]
    assert "node node-a (checked alone) failed its check" in caplog.text
    assert "it joins anyway (no job-wide record to keep it out in)" in caplog.text


def test_a_signal_ends_the_check_at_once_and_its_process_with_it(tmp_path: Path) -> None:
    request = ShutdownRequest()
    starter = FakeStarter()
    # The check never answers (its process sleeps far past the test's time).
    pid_file = tmp_path / "pid"
    before = f"echo $$ > {pid_file}; exec sleep 600"
    agent, calls = _agent(tmp_path, starter, World(shutdown=request), ok=True, before=before)

    def signal_once_it_runs() -> None:
        wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), 30, "the check")
        request.request(signal.SIGTERM)

    threading.Thread(target=signal_once_it_runs, daemon=True).start()
    with pytest.raises(ShutdownRequested) as info:
        agent.run()
    assert info.value.signum == signal.SIGTERM
    assert calls.read_text().count("compute") == 1 and starter.started == []
    with pytest.raises(ProcessLookupError):  # killed and reaped on the way out
        os.kill(int(pid_file.read_text()), 0)
    request.close()

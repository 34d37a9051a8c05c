"""Memory checkpoints outlive the node: FSDP2 (gloo, CPU) on 4 ranks, two nodes of two
workers (agents on loopback, a standalone rendezvous store), a save every step, and a
whole node killed (its agent and, with it, its workers; its node directory goes too).

Each node's steps are copied to the other (its buddy), and a rank's save waits for the
copy, so the step the ranks last agreed on is on two nodes. When the node is lost:

- with a spare waiting (``--nnodes 2``, a third agent), the spare takes its place, pulls
  the lost ranks' pieces from the buddy's copy before its workers start, and every rank
  resumes from the same step: the run ends with exactly the parameters of a run
  restarted at that step on purpose;
- with no spare (``--nnodes 1:2``), the job goes on with the other node alone, 2 ranks:
  they load the 4 ranks' pieces (their own and the copy) resharded by DCP, and the run
  ends with exactly the parameters of a run that saved the same step with DCP's own
  file-system writer on 4 ranks and loaded it into 2.

The job is ``_buddy_job.py``: its data is a function of the step, the rank and the
world size, and each rank writes the step it resumed from, the time each step finished
and a SHA-256 of the full parameters.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from _helpers import elastrun_store, start, wait_for
from _node_loss import end_all, kill_a_node, node_dirs

pytestmark = [pytest.mark.slow, pytest.mark.torch]
pytest.importorskip("torch")

JOB = Path(__file__).resolve().parent / "_buddy_job.py"
STEPS = 24
_NODES = "\n=====\n"


def _args(endpoint: str, token: Path, run_id: str, nnodes: str, job: Sequence[str]) -> list[str]:
    return ["--nnodes", nnodes, "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
            "--rdzv-conf", f"is_host=false,token_file={token},last_call_timeout=1",
            "--local-addr", "127.0.0.1", "--max-restarts", "3", str(JOB),
            "--width", "32", *job]  # fmt: skip


def _start(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    return start(args, cwd=cwd, env={"OMP_NUM_THREADS": "1"})


def _results(out: Path, *, first: bool = False) -> dict[int, dict[str, Any]]:
    """Each rank's result of its last attempt (``first``: of the first that wrote one)."""
    chosen: dict[int, dict[str, Any]] = {}
    for path in sorted(out.glob("rank_*.json")):
        result = json.loads(path.read_text())
        held = chosen.get(result["rank"])
        if held is None or (result["restart"] < held["restart"]) == first:
            chosen[result["rank"]] = result
    return chosen


def _one(values: set[Any], what: str, ranks: object) -> Any:
    assert len(values) == 1, f"{what}: {ranks}"
    return values.pop()


@pytest.mark.timeout(400)  # three launches of 4 ranks in a row (the suite's guard: one)
def test_a_spare_takes_a_lost_nodes_place_with_its_shards_from_the_buddy_copy(
    tmp_path: Path,
) -> None:
    run_id = f"bud-spare-{tmp_path.name}"[:40]
    out = tmp_path / "spare"
    with elastrun_store(tmp_path) as (endpoint, token):
        job = ["--steps", str(STEPS), "--step-time", "0.25", "--result-dir", str(out)]
        args = _args(endpoint, token, run_id, "2", job)
        agents = [_start(args, tmp_path)]
        time.sleep(0.3)
        agents.append(_start(args, tmp_path))
        try:
            wait_for(lambda: len(node_dirs(run_id)) == 2, 60, "two node directories")
            spare = _start(args, tmp_path)  # waits: the job runs at its maximum
            victim, killed_at, agreed = kill_a_node(run_id, agents, after=6)
        except BaseException:
            end_all(agents, 1)
            raise
        survivors = [a for a in agents if a.pid != victim]
        results = end_all([*survivors, spare])
        lost = next(a for a in agents if a.pid == victim)
        lost.communicate(timeout=10)
    err = _NODES.join(r.stderr for r in results)
    assert [r.returncode for r in results] == [0, 0], err
    assert node_dirs(run_id) == [], err
    ranks = _results(out)
    assert sorted(ranks) == [0, 1, 2, 3], err
    resumed = _one({r["resumed_from"] for r in ranks.values()}, "resumed", ranks)
    # The spare pulled its ranks' pieces of that step (the lost node's, from the copy).
    pulled = re.search(r"pulled rank\(s\) (\d), (\d) of step (\d+) from", results[1].stderr)
    assert pulled is not None, err
    assert int(pulled.group(3)) == resumed, err
    # The step agreed before the kill was on two nodes: nothing agreed is lost.
    assert isinstance(resumed, int) and resumed >= agreed, (resumed, agreed, err)
    # (The restart count may be 0: a loss the rendezvous noticed first re-forms the round
    # as a membership change, without charging a restart.)
    for r in ranks.values():
        assert r["trained"] == list(range(resumed + 1, STEPS)), err
    _report_recovery("spare", killed_at, ranks, resumed)

    # The reference: the same job restarted at the same step on purpose (rank 3 exits 1
    # before step resumed + 1, once step resumed is saved on every rank).
    ref = tmp_path / "reference"
    with elastrun_store(tmp_path) as (endpoint, token):
        job = ["--steps", str(STEPS), "--result-dir", str(ref), "--fail-rank", "3",
               "--fail-step", str(resumed + 1)]  # fmt: skip
        args = _args(endpoint, token, f"bud-sref-{tmp_path.name}"[:40], "2", job)
        agents = [_start(args, tmp_path)]
        time.sleep(0.3)
        agents.append(_start(args, tmp_path))
        again = end_all(agents)
    assert [r.returncode for r in again] == [0, 0], _NODES.join(r.stderr for r in again)
    reference = _results(ref)
    assert {r["resumed_from"] for r in reference.values()} == {resumed}
    digest = _one({r["sha256"] for r in ranks.values()}, "digest", ranks)
    assert digest == _one({r["sha256"] for r in reference.values()}, "digest", reference)


@pytest.mark.timeout(400)  # three launches in a row (the suite's guard: one)
def test_a_lost_node_with_no_spare_resumes_on_the_other_resharded(tmp_path: Path) -> None:
    run_id = f"bud-shrink-{tmp_path.name}"[:40]
    out = tmp_path / "shrink"
    with elastrun_store(tmp_path) as (endpoint, token):
        job = ["--steps", str(STEPS), "--step-time", "0.25", "--result-dir", str(out)]
        args = _args(endpoint, token, run_id, "1:2", job)
        agents = [_start(args, tmp_path)]
        time.sleep(0.3)
        agents.append(_start(args, tmp_path))
        try:
            wait_for(lambda: len(node_dirs(run_id)) == 2, 60, "two node directories")
            victim, killed_at, agreed = kill_a_node(run_id, agents, after=6)
        except BaseException:
            end_all(agents, 1)
            raise
        (survivor,) = [a for a in agents if a.pid != victim]
        (result,) = end_all([survivor])
        next(a for a in agents if a.pid == victim).communicate(timeout=10)
    assert result.returncode == 0, result.stderr
    # The attempt that resumed after the kill (the killed ranks, and the attempt they died
    # in, wrote none). The reference retraces its history: 4 ranks to the step it
    # resumed from, 2 from there. A later attempt (seen once: the survivors' workers
    # restarted after that one had finished) resumes at the last step and trains nothing.
    now = _results(out, first=True)
    assert {r["sha256"] for r in _results(out).values()} == {r["sha256"] for r in now.values()}
    assert sorted(now) == [0, 1], result.stderr
    assert {r["world"] for r in now.values()} == {2}, now
    resumed = _one({r["resumed_from"] for r in now.values()}, "resumed", now)
    assert isinstance(resumed, int) and resumed >= agreed, (resumed, agreed, result.stderr)
    for r in now.values():
        assert r["trained"] == list(range(resumed + 1, STEPS))
    _report_recovery("no spare", killed_at, now, resumed)

    # The reference: 4 ranks train to the same step and save it with DCP's own writer;
    # then 2 ranks on one node load it (DCP reshards) and train the rest.
    dcp_dir = tmp_path / "dcp"
    first, second = tmp_path / "ref-first", tmp_path / "ref-second"
    with elastrun_store(tmp_path) as (endpoint, token):
        job = ["--steps", str(STEPS), "--stop-after", str(resumed), "--dcp-dir", str(dcp_dir),
               "--result-dir", str(first)]  # fmt: skip
        args = _args(endpoint, token, f"bud-r1-{tmp_path.name}"[:40], "2", job)
        agents = [_start(args, tmp_path)]
        time.sleep(0.3)
        agents.append(_start(args, tmp_path))
        done = end_all(agents)
        assert [r.returncode for r in done] == [0, 0], _NODES.join(r.stderr for r in done)
        job = ["--steps", str(STEPS), "--dcp-dir", str(dcp_dir), "--result-dir", str(second)]
        args = _args(endpoint, token, f"bud-r2-{tmp_path.name}"[:40], "1", job)
        (done2,) = end_all([_start(args, tmp_path)])
        assert done2.returncode == 0, done2.stderr
    reference = _results(second)
    assert sorted(reference) == [0, 1]
    assert {r["resumed_from"] for r in reference.values()} == {resumed}
    digest = _one({r["sha256"] for r in now.values()}, "digest", now)
    assert digest == _one({r["sha256"] for r in reference.values()}, "digest", reference)


def _report_recovery(
    what: str, killed_at: float, ranks: dict[int, dict[str, Any]], resumed: int
) -> None:
    """Print (``-s`` shows it) how long after the kill each rank finished its next step."""
    after = {
        rank: r["times"][str(resumed + 1)] - killed_at
        for rank, r in sorted(ranks.items())
        if str(resumed + 1) in r["times"]
    }
    loaded = {rank: r["loaded_at"] - killed_at for rank, r in sorted(ranks.items())}
    print(
        f"\n[{what}] node killed -> state loaded: "
        + ", ".join(f"rank {k} {v:.2f} s" for k, v in loaded.items())
        + "; -> next step done: "
        + ", ".join(f"rank {k} {v:.2f} s" for k, v in after.items())
    )

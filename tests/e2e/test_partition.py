"""A network partition, for real: every participant in its own network namespace.

The store runs in namespace S and one agent in each of A, B and C, all on a private
bridge (see ``tests/_netns.py``); the test process itself only runs ``ip`` and reads
files. Cutting C's switch port is a silent partition: C's sockets stay open and nothing
is reset, so only the lease TTL (``heartbeat_timeout``) can tell the store that C is gone.
Skipped where network namespaces cannot be created (not root).

Known defect, reported as XFAIL at the very end of the first test once everything else
has passed: a node cut off from the store does not stop its own workers when its lease
must have expired; they run on, as ranks of a world that no longer exists, until the
network heals. When the agent learns to fence itself, the test simply passes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from _helpers import REPO, pid_alive, wait_for, write_script
from _netns import NetnsUnavailable, Topology

pytestmark = pytest.mark.slow

HEARTBEAT = 3.0  # lease TTL: the store drops a silent node after this
#: Beyond the TTL: the store's expiry, the watch, stopping the old workers, one
#: rendezvous round (its last call) and starting the new ones. Generous for a loaded
#: 2-core machine; on an idle one the whole re-formation takes about TTL + 1.5 s.
REFORM_SLACK = 7.0
#: How long after the cut the partitioned node's old worker may still run.
FENCE_SLACK = 3.0
PORT = 29400  # the namespaces are private, so a fixed port cannot collide
DEMO = REPO / "examples" / "ddp_demo.py"
AGENT = [sys.executable, "-m", "elastrun", "--nnodes", "2:3", "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-id", "partition", "--max-restarts", "1"]  # fmt: skip

# Each worker appends one JSON line when it starts. In a world of three it then ticks
# until it is stopped (it is the generation the partition interrupts); in any smaller
# world it waits for the test's go-ahead, then says "done" and exits 0. A line is one
# small O_APPEND write, so lines from concurrent workers never interleave.
WORKER = """
import json, os, sys, time
log, release = sys.argv[1], sys.argv[2]
env = os.environ
me = {"node": env["ELR_NODE"], "pid": os.getpid(), "rank": int(env["RANK"]),
      "world": int(env["WORLD_SIZE"]), "group_rank": int(env["GROUP_RANK"]),
      "restart": int(env["TORCHELASTIC_RESTART_COUNT"]), "master": env["MASTER_ADDR"]}

def say(event):
    line = json.dumps({**me, "event": event, "t": time.monotonic()}) + "\\n"
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)

say("start")
if me["world"] == 3:
    while True:
        time.sleep(0.5)
        say("tick")
while not os.path.exists(release):
    time.sleep(0.05)
say("done")
"""


@pytest.fixture
def net() -> Iterator[Topology]:
    try:
        topo = Topology(["S", "A", "B", "C"])
    except NetnsUnavailable as exc:
        pytest.skip(f"network namespaces are not available here: {exc}")
    try:
        yield topo
    finally:
        topo.close()


def _records(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _starts(records: list[dict[str, object]], world: int) -> dict[str, dict[str, object]]:
    """The latest start record of each node in a world of ``world``."""
    return {str(r["node"]): r for r in records if r["event"] == "start" and r["world"] == world}


class _Job:
    """The store in S and one agent in each of A, B and C, all logging to files."""

    def __init__(self, net: Topology, tmp_path: Path, script: list[str], **env: str) -> None:
        self.net = net
        self.logs = {n: tmp_path / f"{n}.log" for n in "SABC"}
        token = tmp_path / "token"
        token.write_text("partition-secret\n")
        net.start("S", [sys.executable, "-m", "elastrun", "store", "--host", net.addr("S"),
                        "--port", str(PORT), "--token-file", str(token)],
                  cwd=tmp_path, log=self.logs["S"])  # fmt: skip
        self.wait(lambda: "serving on" in self.log("S"), 20, "the store to serve")
        conf = (f"is_host=false,token_file={token},heartbeat_timeout={HEARTBEAT:g},"
                "last_call_timeout=1,join_timeout=60")  # fmt: skip
        self.agents = {
            n: net.start(n, [*AGENT, "--rdzv-endpoint", f"{net.addr('S')}:{PORT}",
                             "--local-addr", net.addr(n), "--rdzv-conf", conf, *script],
                         cwd=tmp_path, log=self.logs[n], env={"ELR_NODE": n, **env})
            for n in "ABC"
        }  # fmt: skip

    def log(self, node: str) -> str:
        return self.logs[node].read_text()

    def dump(self) -> str:
        return "\n".join(f"--- {n}:\n{self.log(n)[-3000:]}" for n in self.logs)

    def wait(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        try:
            wait_for(predicate, timeout, what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.dump()}") from None

    def exit_code(self, node: str, timeout: float) -> int:
        try:
            return self.agents[node].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"agent {node} still running after {timeout:g}s\n{self.dump()}"
            ) from None

    def assert_left_with_one_error(self, node: str, timeout: float) -> None:
        """The agent exits non-zero, saying why in one line, without a traceback."""
        code = self.exit_code(node, timeout)
        text = self.log(node)
        errors = [x for x in text.splitlines() if x.startswith("elastrun: error:")]
        assert code != 0, self.dump()
        assert len(errors) == 1 and "Traceback" not in text, self.dump()


def test_a_partitioned_node_is_dropped_and_the_rest_finish_without_it(
    tmp_path: Path, net: Topology
) -> None:
    events = tmp_path / "events.jsonl"
    release = tmp_path / "release"
    script = write_script(tmp_path / "worker.py", WORKER)
    job = _Job(net, tmp_path, [str(script), str(events), str(release)])

    # Whatever order the agents arrive in, they end up as one world of three.
    # (If C comes late, A and B first run as a world of two, then grow.)
    job.wait(lambda: set(_starts(_records(events), 3)) == {"A", "B", "C"}, 40, "a world of three")
    three = _starts(_records(events), 3)
    assert sorted(_int(r["rank"]) for r in three.values()) == [0, 1, 2]
    stale_pid = _int(three["C"]["pid"])

    net.partition("C")
    cut = time.monotonic()
    seen = len(_records(events))  # only what starts after the cut counts below
    job.wait(lambda: set(_starts(_records(events)[seen:], 2)) == {"A", "B"},
             HEARTBEAT + REFORM_SLACK, "A and B to re-form as a world of two")  # fmt: skip
    reformed_after = time.monotonic() - cut
    two = _starts(_records(events)[seen:], 2)
    assert sorted(_int(r["rank"]) for r in two.values()) == [0, 1]
    assert sorted(_int(r["group_rank"]) for r in two.values()) == [0, 1]
    assert {r["restart"] for r in two.values()} == {0}, "a lost node spent a restart"
    assert {r["master"] for r in two.values()} <= {net.addr("A"), net.addr("B")}
    assert all("lost 1 node(s)" in job.log(n) for n in "AB"), job.dump()

    release.write_text("go")
    for n in "AB":
        assert job.exit_code(n, 30) == 0, job.dump()

    # By now the store has dropped C for a while. Does C know? Its agent cannot hear
    # the store, but it can tell that no keep-alive was acknowledged for a whole TTL.
    time.sleep(max(0.0, cut + HEARTBEAT + FENCE_SLACK - time.monotonic()))
    fenced = not pid_alive(stale_pid)

    # Healed, C learns that its lease is gone and that the run it belonged to has
    # ended: it stops its stale worker and leaves with an error, touching nothing.
    net.heal("C")
    job.assert_left_with_one_error("C", 30)
    assert not pid_alive(stale_pid)
    records = _records(events)
    assert {str(r["node"]) for r in records if r["event"] == "done"} == {"A", "B"}
    assert all(r["world"] == 3 for r in records if r["node"] == "C"), "C joined a later world"

    late = [r for r in records if r["node"] == "C" and _float(r["t"]) > cut + HEARTBEAT]
    assert fenced, (
        f"cut off, C kept running its worker (pid {stale_pid}, rank {three['C']['rank']} of a "
        f"world of 3, {len(late)} ticks after the TTL) although A and B re-formed without it "
        f"{reformed_after:.1f}s after the cut"
    )


@pytest.mark.torch
def test_ddp_training_survives_a_partitioned_node_and_finishes_at_two(
    tmp_path: Path, net: Topology
) -> None:
    ckpt = tmp_path / "ckpt" / "checkpoint.pt"
    result = tmp_path / "result.json"
    demo = [str(DEMO), "--steps", "60", "--checkpoint-every", "5", "--step-time", "0.1",
            "--checkpoint-dir", str(ckpt.parent), "--result-file", str(result)]  # fmt: skip
    # gloo picks its interface from the host name, which names no address in here.
    job = _Job(net, tmp_path, demo, GLOO_SOCKET_IFNAME="eth0")

    # A third rank exists only in a world of three; a checkpoint newer than its start
    # means that world is training.
    job.wait(lambda: any("rank 2: pid" in job.log(n) for n in "ABC"), 90, "a world of three")
    three_started = time.time()
    job.wait(lambda: ckpt.exists() and ckpt.stat().st_mtime > three_started, 60,
             "a checkpoint by the world of three")  # fmt: skip

    net.partition("C")
    for n in "AB":
        assert job.exit_code(n, 90) == 0, job.dump()
    outcome = json.loads(result.read_text())
    assert outcome["world_size"] == 2 and outcome["steps"] == 60, outcome
    assert outcome["identical"] is True, outcome
    assert outcome["restart_count"] == 0, "the partition cost a restart"
    assert outcome["resumed_from"], "the world of two did not resume from the checkpoint"
    assert all("lost 1 node(s)" in job.log(n) for n in "AB"), job.dump()
    # C is still cut off (its worker blocked in a collective with peers that are gone);
    # it never joined the world of two. The fixture ends it.
    assert "attempt 1" not in job.log("C"), job.dump()


def _float(value: object) -> float:
    assert isinstance(value, float), value
    return value


def _int(value: object) -> int:
    assert isinstance(value, int), value
    return value

"""In-process recovery end to end: real processes, real torch gloo DDP, on one node
and on two (two agents on loopback, a standalone rendezvous store).

The script trains a small model with DDP, commits after every step and takes its
failures from the command line (``RANK:STEP`` items, each once per job). Every process
records its pid and the step each call of the training function began at; at the end
every rank writes its parameters' SHA-256, compared with a run without failures.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _helpers import elastrun_store, finish, once_per_run, start, wait_for, write_script

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "etcd"))
from etcd_cluster import EtcdCluster, find_etcd

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")

SCRIPT = """
import hashlib, json, os, signal, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
import elastrun.inprocess as inprocess

out, steps, plan = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rank = int(os.environ["RANK"])
calls, usage = [], []

def once(name):
    try:
        fd = os.open(os.path.join(out, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True

def peers_committed(step):
    # Until every other rank committed after ``step`` (at most 10 s): gloo's ring lets a
    # rank leave an all-reduce while a peer still reads its last chunk, which a kill at
    # once would cut; that peer would then come back one step earlier than the others.
    world = int(os.environ["WORLD_SIZE"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(out, f"committed_{r}_{step + 1}"))
               for r in range(world) if r != rank):
            return
        time.sleep(0.005)

def fail(kind, step):
    if kind == "kill":
        peers_committed(step)
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "raise":
        raise ValueError(f"rank {rank} fails on purpose at step {step}")
    if kind == "hang":
        open(os.path.join(out, f"hung_{rank}_{os.getpid()}"), "w").close()
        time.sleep(3600)
    if kind == "glooblock":  # as torch's gloo leaves a send that can no longer end
        import ctypes, threading
        sent = threading.Event()
        def send():
            ctypes.CDLL(None).prctl(15, b"pt_gloo_runloop", 0, 0, 0)  # PR_SET_NAME
            sent.wait(3600)  # a gloo work thread waits with the group's timeout
        threading.Thread(target=send, daemon=True).start()
        sent.wait()  # and the training thread for it
    if kind == "fakegloo":  # looks like a failed collective, but no peer failed
        raise RuntimeError(f"gloo socket closed by user code\\nrank {rank}, step {step}")
    if kind == "mark":
        open(os.path.join(out, f"mark_{rank}_{step}"), "w").close()

def planned(step):
    for item in plan:
        who, when, kind = item.split(":")
        if kind in ("sync", "syncdie"):
            continue  # taken at the start of a replacement, or of a synchronisation
        if kind == "loop":
            continue  # taken before the step's collectives, below
        if int(who) == rank and int(when) == step and once(f"did_{item}"):
            return kind
    return None

import elastrun.inprocess.worker.sync as sync
real_synchronise = sync.synchronise

def synchronise(*args):
    # RANK:MS:syncdie: the process of that rank dies MS ms into a synchronisation.
    me = int(os.environ["RANK"])
    for item in plan:
        who, when, kind = item.split(":")
        if kind == "syncslow" and int(who) == me and once(f"did_{item}"):
            time.sleep(int(when) / 1000)  # a survivor slow to reach the round's store
        if kind == "syncdie" and int(who) == me and once(f"did_{item}"):
            if int(when) == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            import threading
            threading.Timer(int(when) / 1000, os.kill, (os.getpid(), signal.SIGKILL)).start()
            break
    return real_synchronise(*args)

sync.synchronise = synchronise

def resources():
    threads = len(os.listdir("/proc/self/task"))
    with open("/proc/self/statm") as fh:
        rss = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return [len(os.listdir("/proc/self/fd")), threads, rss]

if os.environ.get("ELASTRUN_INPROCESS_ROUND", "0") != "0":
    for item in plan:
        who, when, kind = item.split(":")
        if kind == "sync" and int(who) == rank and once(f"did_{item}"):
            os._exit(7)  # a replacement dying before the state synchronisation

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
state = inprocess.State(model=model, optimizer=opt, step=0)

@inprocess.run
def train(state):
    global rank
    rank = int(os.environ["RANK"])  # a round may renumber the ranks (a lost node)
    calls.append(state.step)
    usage.append(resources())
    dist.init_process_group("gloo")
    ddp = DistributedDataParallel(state.model, find_unused_parameters=True)
    while state.step < steps:
        if f"{rank}:{state.step}:loop" in plan:  # every time, before the others commit
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(state.step * 1000 + rank)
        x = torch.randn(16, 8, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True)).backward()
        opt.step()
        kind = planned(state.step)
        if kind:
            fail(kind, state.step)
        state.step += 1
        state.commit()
        open(os.path.join(out, f"committed_{rank}_{state.step}"), "w").close()
        time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
    dist.barrier()
    dist.destroy_process_group()

train(state)
h = hashlib.sha256()
for p in model.parameters():
    h.update(p.detach().numpy().tobytes())
with open(os.path.join(out, f"rank_{rank}_{os.getpid()}.json"), "w") as fh:
    json.dump({"rank": rank, "pid": os.getpid(), "calls": calls, "sha": h.hexdigest(),
               "restarts": os.environ["TORCHELASTIC_RESTART_COUNT"], "usage": usage}, fh)
"""

NO_API = """
import os, sys, time
out = sys.argv[1]
rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
open(os.path.join(out, f"ran_{rank}_{attempt}_{os.getpid()}"), "w").close()
if rank == "1" and attempt == "0":
    sys.exit(3)
time.sleep(0.5)
"""

STEPS = 40
# A survivor stuck in a collective (see _kept) is replaced after 5 s, not 30.
FAST = {"OMP_NUM_THREADS": "1", "ELASTRUN_INPROCESS_JOIN_TIMEOUT": "5"}


def _run(
    tmp_path: Path,
    name: str,
    plan: list[str],
    *extra: str,
    restarts: int = 5,
    nproc: int = 4,
    steps: int = STEPS,
) -> tuple[int, str, list[dict[str, Any]]]:
    out = tmp_path / name
    out.mkdir()
    script = write_script(tmp_path / "train.py", SCRIPT)
    env = {**os.environ, **FAST, **dict(e.split("=", 1) for e in extra)}
    proc = start(
        ["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", str(restarts),
         str(script), str(out), str(steps), *plan],
        cwd=tmp_path, env=env,
    )  # fmt: skip
    res = finish(proc, 180)
    results = [json.loads(p.read_text()) for p in sorted(out.glob("rank_*.json"))]
    return res.returncode, res.stderr, results


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> str:
    """The parameters' SHA-256 after a run without failures (one run for all workers)."""

    def make() -> str:
        code, err, results = _run(tmp_path_factory.mktemp("clean"), "out", [])
        assert code == 0, err
        shas: set[str] = {r["sha"] for r in results}
        assert len(results) == 4 and len(shas) == 1, results
        return shas.pop()

    if worker_id == "master":  # not under xdist: the temp root's parent is not this run's
        return make()
    return once_per_run(tmp_path_factory.getbasetemp().parent, "inprocess-fault-free", make)


def _by_rank(results: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    ranks = {r["rank"]: r for r in results}
    assert sorted(ranks) == [0, 1, 2, 3], results
    return ranks


def _kept(result: dict[str, Any], calls: list[int], err: str) -> None:
    """``result``'s rank kept its process and was called again at each of ``calls``.

    torch 2.13's gloo now and then (about one run in thirty here) leaves a survivor
    blocked in a collective whose peer died, never failing it; the agent then replaces
    that survivor after the join bound and says so. That, and only that, is accepted:
    the rank is then a replacement that started at one of the later commits."""
    if result["calls"] == calls:
        return
    said = f"rank {result['rank']} (local rank" in err and _replaced_stuck(err)
    assert said, (result, err)
    assert result["calls"] == calls[-len(result["calls"]) :], (result, calls)


def _replaced_stuck(err: str) -> bool:
    """Whether the agent replaced a survivor stuck in a collective (see _kept)."""
    return "did not reach in-process round" in err


def _completed(err: str, round_no: int) -> bool:
    """Round ``round_no`` completed, or a later one did because a survivor stuck in a
    collective (see _kept) was replaced in a round of its own."""
    return f"in-process round {round_no} complete" in err or _replaced_stuck(err)


def test_a_killed_rank_is_replaced_and_the_others_keep_their_processes(
    tmp_path: Path, fault_free: str
) -> None:
    code, err, results = _run(tmp_path, "out", ["2:25:kill"])
    assert code == 0, err
    ranks = _by_rank(results)
    for r in (0, 1, 3):
        _kept(ranks[r], [0, 26], err)  # the same process, called again
    assert ranks[2]["calls"] == [26]  # the replacement starts at the committed step
    assert {r["sha"] for r in results} == {fault_free}  # bit for bit
    assert "replacing it in place" in err and _completed(err, 1), err
    assert "restarting all workers" not in err


def test_rank_zero_failing_twice_and_an_exception_are_recovered_in_place(
    tmp_path: Path, fault_free: str
) -> None:
    code, err, results = _run(tmp_path, "out", ["0:10:kill", "0:20:kill", "3:30:raise"])
    assert code == 0, err
    ranks = _by_rank(results)
    _kept(ranks[1], [0, 11, 21, 31], err)
    _kept(ranks[2], [0, 11, 21, 31], err)
    _kept(ranks[0], [21, 31], err)  # rank 0's second replacement, then a survivor
    assert ranks[3]["calls"] == [31]
    assert {r["sha"] for r in results} == {fault_free}
    assert _completed(err, 3), err
    assert "ValueError: rank 3 fails on purpose at step 30" in err
    assert ranks[1]["restarts"] == str(3 + err.count("did not reach in-process"))


def _own_error(err: str, rank: int, step: int) -> None:
    """``err`` shows rank ``rank``'s own error, raised at ``step``, as it was raised: its
    type, its whole message and its traceback down to the script's frame; no survivor
    took it for a peer's failure."""
    assert "Traceback (most recent call last)" in err and ", in fail\n" in err, err
    assert "RuntimeError: gloo socket closed by user code\n" in err, err
    assert f"rank {rank}, step {step}" in err, err  # the message's second line
    assert "gloo socket closed by user code) and a peer failed" not in err, err
    assert "no new round within" not in err, err


def test_an_error_that_only_looks_like_a_failed_collective_is_the_workers_own(
    tmp_path: Path, fault_free: str
) -> None:
    code, err, results = _run(tmp_path, "out", ["1:8:fakegloo"])
    assert code == 0, err
    _own_error(err, 1, 8)
    # Raised in the user's own frame: the worker names it at once, without asking.
    assert "raised an error of its own" not in err, err
    ranks = _by_rank(results)
    assert ranks[1]["calls"] == [9]  # replaced in place after its own error
    _kept(ranks[0], [0, 9], err)
    assert {r["sha"] for r in results} == {fault_free}


def test_a_users_error_that_reads_like_gloos_ends_the_job_at_once_as_it_was_raised(
    tmp_path: Path,
) -> None:
    t0 = time.monotonic()
    code, err, results = _run(tmp_path, "out", ["1:1:fakegloo"], nproc=2, restarts=0, steps=3)
    took = time.monotonic() - t0
    assert code == 1 and results == [], err
    _own_error(err, 1, 1)
    # The agent's failure report takes the error file, written from the exception.
    report = err[err.index("Root cause (first observed failure):") :]
    assert "gloo socket closed by user code" in report and "rank 1, step 1" in report, err
    assert took < 60, (took, err)  # a worker waiting for a round would wait 120 s


def test_a_replacement_dying_before_it_said_hello_is_replaced_in_a_new_round(
    tmp_path: Path, fault_free: str
) -> None:
    # Rank 2's replacement exits before it calls the decorated function: it was started
    # for an in-process round, so it is an in-process worker and round 2 replaces it.
    code, err, results = _run(tmp_path, "out", ["2:15:kill", "2:0:sync"])
    assert code == 0, err
    ranks = _by_rank(results)
    for r in (0, 1, 3):
        _kept(ranks[r], [0, 16], err)
    assert ranks[2]["calls"] == [16]
    assert _completed(err, 2) and "restarting all workers" not in err, err
    assert {r["sha"] for r in results} == {fault_free}


def test_a_replacement_killed_at_the_start_of_the_synchronisation_twice_is_replaced_again(
    tmp_path: Path, fault_free: str
) -> None:
    code, err, results = _run(tmp_path, "out", ["2:15:kill", "2:0:syncdie", "2:1:syncdie"])
    assert code == 0, err
    ranks = _by_rank(results)
    for r in (0, 1, 3):
        _kept(ranks[r], [0, 16], err)
    assert ranks[2]["calls"] == [16]
    assert _completed(err, 3) and "restarting all workers" not in err, err
    assert "without progress" not in err and "no newer commit" not in err
    assert {r["sha"] for r in results} == {fault_free}


def test_two_ranks_killed_at_once_are_replaced_in_place(tmp_path: Path, fault_free: str) -> None:
    code, err, results = _run(tmp_path, "out", ["1:10:kill", "2:10:kill"])
    assert code == 0, err
    ranks = _by_rank(results)
    for r in (0, 3):
        _kept(ranks[r], [0, 11], err)
    assert ranks[1]["calls"] == ranks[2]["calls"] == [11]
    assert "restarting all workers" not in err
    assert {r["sha"] for r in results} == {fault_free}


def test_a_survivor_killed_during_the_synchronisation_is_replaced_in_the_next_round(
    tmp_path: Path, fault_free: str
) -> None:
    # Rank 2 dies at step 15; in round 1 rank 0 dies as it starts synchronising, and
    # rank 3 reaches round 1's store only after the agent has abandoned that round and
    # stopped its store: it must move on to round 2 at once, not retry the dead port.
    plan = ["2:15:kill", "0:0:syncdie", "3:1500:syncslow"]
    code, err, results = _run(tmp_path, "out", plan)
    assert code == 0, err
    ranks = _by_rank(results)
    for r in (1, 3):
        _kept(ranks[r], [0, 16], err)
    assert ranks[0]["calls"] == ranks[2]["calls"] == [16]
    # Round 2 completes, or a later one when a survivor stuck in a collective (see
    # _kept) was replaced in a round of its own.
    assert _completed(err, 2), err
    assert "restarting all workers" not in err
    assert "in-process round 1 was superseded" in err  # rank 3, at once
    assert {r["sha"] for r in results} == {fault_free}


@pytest.mark.parametrize(
    "plan",
    [
        ["1:10:kill", "2:10:kill"],  # two ranks killed together
        ["2:15:kill", "0:0:syncdie"],  # a survivor killed as it enters the synchronisation
        ["2:15:kill", "2:0:syncdie", "0:50:syncdie"],  # the replacement, then a survivor
        ["2:15:kill", "0:20:syncdie"],  # a survivor killed 20 ms into the synchronisation
    ],
    ids=["two-together", "survivor-at-sync-entry", "replacement-then-survivor", "survivor-20ms"],
)
def test_overlapping_failures_are_recovered_in_place_with_no_worker_left_behind(
    tmp_path: Path, fault_free: str, plan: list[str]
) -> None:
    # A replacement started for a round that is abandoned (a second failure) before its
    # hello reaches the agent is told the newest round with its hello: it never waits
    # on the abandoned round's stopped store, so nobody is killed as stuck in a
    # collective. The join bound is the default's 30 s: a late worker would cost that.
    code, err, results = _run(tmp_path, "out", plan, "ELASTRUN_INPROCESS_JOIN_TIMEOUT=30")
    assert code == 0, err
    assert "did not reach in-process round" not in err, err
    assert "restarting all workers" not in err, err
    killed = {int(item.split(":")[0]) for item in plan}
    ranks = _by_rank(results)
    for r in set(ranks) - killed:
        # The same process, kept: called first at step 0, then again at the commit each
        # recovery restored (twice when the second failure came after it resumed).
        calls = ranks[r]["calls"]
        assert calls[0] == 0 and len(calls) >= 2 and calls[1] >= 10, (ranks[r], err)
    assert {r["sha"] for r in results} == {fault_free}


def test_when_every_worker_holding_the_state_is_gone_the_group_restarts(tmp_path: Path) -> None:
    # Two ranks: rank 1 is killed at step 10, and rank 0, the one survivor holding the
    # commit, dies as it enters the synchronisation, before the replacement took the
    # commit. No running worker holds the state any more: a round of the two fresh
    # replacements would train again from step 0 as if nothing was lost. The group
    # restarts instead (the script loads its own checkpoint), and says why.
    code, err, results = _run(tmp_path, "out", ["1:10:kill", "0:0:syncdie"], nproc=2)
    assert code == 0, err
    assert "every worker that held the training's state has failed" in err, err
    assert "restarting all workers" in err, err
    assert "in-process round 2" not in err, err
    ranks = {r["rank"]: r for r in results}
    assert sorted(ranks) == [0, 1], results
    for r in ranks.values():
        assert r["calls"] == [0] and r["restarts"] != "0", (r, err)
    assert ranks[0]["sha"] == ranks[1]["sha"]


def test_rotating_failures_over_every_rank_are_recovered_in_place_with_default_options(
    tmp_path: Path, fault_free: str
) -> None:
    # 12 recoveries, one a step, each of another rank (every rank three times): the job
    # progresses through every one of them (the committed step), so the stall guard
    # (--stalled-restarts 3, the default: four recoveries in a row would trip it) must
    # not stop it.
    plan = [f"{i % 4}:{5 + i}:kill" for i in range(12)]
    code, err, results = _run(tmp_path, "out", plan, restarts=20)
    assert code == 0, err
    assert err.count("recovering in place (round") >= 12
    assert "restarting all workers" not in err and "without progress" not in err
    assert {r["sha"] for r in results} == {fault_free}


def test_a_step_that_fails_again_and_again_is_stopped_by_the_stall_guard(tmp_path: Path) -> None:
    # Rank 1 dies at step 10 every time it gets there: every recovery restores commit 10.
    # The first recovery made progress; the next three did not: the fourth failure after
    # them ends the job (exit 93: do not requeue), with restarts left in the budget.
    code, err, _ = _run(tmp_path, "out", ["1:10:loop"], restarts=20)
    assert code == 93, err
    assert "in-process recoveries in a row restored no newer commit than commit 10" in err
    # Four recoveries; a survivor stuck in a collective (see _kept) is replaced in a
    # round of its own, which belongs to the same recovery.
    # Every recovery finds the survivors holding commit 10, though DDP's construction
    # in each new call rewrote their parameters in place.
    assert "CommitLostError" not in err, err
    rounds = err.count("recovering in place (round")
    assert rounds == 4 or (rounds > 4 and _replaced_stuck(err)), err


def test_fifty_recoveries_leave_the_survivors_resources_as_after_the_first(
    tmp_path: Path,
) -> None:
    # Two ranks, rank 1 killed at each of 50 steps: rank 0 keeps its process through 50
    # recoveries, and what it holds (descriptors, threads, memory) must not grow with them.
    code, err, clean = _run(tmp_path, "clean", [], nproc=2, steps=60)
    assert code == 0, err
    plan = [f"1:{s}:kill" for s in range(5, 55)]
    code, err, results = _run(tmp_path, "out", plan, nproc=2, steps=60, restarts=60)
    assert code == 0, err
    assert {r["sha"] for r in results} == {r["sha"] for r in clean} and len(clean) == 2
    (survivor,) = [r for r in results if r["rank"] == 0]
    usage = survivor["usage"]
    assert len(usage) > 10, survivor  # (kept through most recoveries, at least)
    (fds, threads, _), (fds_end, threads_end, rss_end) = usage[1], usage[-1]
    print(f"after recovery 1: {usage[1]}; after {len(usage) - 1}: {usage[-1]}")
    assert fds_end - fds <= 4, usage
    assert threads_end - threads <= 4, usage
    # The memory settles during the first recoveries (the allocator's per-thread arenas
    # for each new group's threads, torch's caches: ~10 MB over about 20 of them, more
    # under load, then flat): over the second half, a leak of 0.16 MB a recovery adds
    # 4 MB.
    rss = usage[len(usage) // 2][2]
    assert rss_end - rss <= 4 << 20, usage


def test_a_survivor_that_never_reaches_the_round_restarts_the_group(
    tmp_path: Path, fault_free: str
) -> None:
    # Rank 1 hangs at step 12 (in the sleep, not in a collective); rank 2 dies at 12.
    code, err, results = _run(
        tmp_path, "out", ["1:12:hang", "2:12:kill"], "ELASTRUN_INPROCESS_TIMEOUT=3"
    )
    assert code == 0, err
    assert "not every worker synchronised in time" in err
    assert {r["sha"] for r in results} == {fault_free}


def test_a_survivor_stuck_past_the_join_bound_is_replaced_in_place(
    tmp_path: Path, fault_free: str
) -> None:
    # Rank 1 hangs at step 12 (it stands for a collective that never fails); rank 2
    # dies at 12. Rank 1 does not reach round 1 within 2 s: its stacks are kept, it is
    # killed and replaced in round 2, and the others move on to that round.
    code, err, results = _run(
        tmp_path, "out", ["1:12:hang", "2:12:kill"], "ELASTRUN_INPROCESS_JOIN_TIMEOUT=2"
    )
    assert code == 0, err
    assert "did not reach in-process round 1 within 2s" in err
    # Its stacks outlive the clean run's temporary log directory, and the run says so.
    stacks = re.search(r"stacks: (\S+stacks\.txt)\)", err)
    assert stacks is not None and "Thread" in Path(stacks[1]).read_text(), err
    assert "the run wrote diagnostics (1 stack dump(s)); kept in" in err
    _ranks_1_and_2_replaced_in_round_2(err, results, fault_free)


def test_a_survivor_blocked_for_good_in_gloo_is_replaced_before_the_join_bound(
    tmp_path: Path, fault_free: str
) -> None:
    # Rank 1 blocks at step 12 as torch's gloo now and then leaves a survivor: one of its
    # gloo work threads waits, with the group's timeout, on a send that can no longer
    # end (here on an event), and the training thread waits on it. Rank 2 dies at 12.
    # Once the round's message has cut rank 1's connections, nothing but the timeout
    # could end its wait: the agent replaces it 2 s into the round, not at the join
    # bound (30 s here), and the others move on to round 2.
    code, err, results = _run(
        tmp_path, "out", ["1:12:glooblock", "2:12:kill"], "ELASTRUN_INPROCESS_JOIN_TIMEOUT=30"
    )
    assert code == 0, err
    assert "did not reach in-process round 1 (blocked for good in a gloo collective" in err, err
    assert "within 30s" not in err
    _ranks_1_and_2_replaced_in_round_2(err, results, fault_free)


def test_without_the_api_a_failure_restarts_the_whole_group(tmp_path: Path) -> None:
    script = write_script(tmp_path / "plain.py", NO_API)
    res = finish(
        start(["--standalone", "--nproc-per-node", "3", "--max-restarts", "1",
               str(script), str(tmp_path)], cwd=tmp_path),
        60,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    ran = sorted(p.name for p in tmp_path.glob("ran_*"))
    assert sorted(r.split("_")[1] for r in ran if r.split("_")[2] == "1") == ["0", "1", "2"]
    assert "restarting all workers" in res.stderr
    assert "in place" not in res.stderr


# -- two nodes ---------------------------------------------------------------------------


def _node_args(
    tmp_path: Path, endpoint: str, token: Path | None, nnodes: str, plan: list[str]
) -> list[str]:
    """Two workers per node on an ``elastrun store`` (``token``) or, None, on etcd."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    script = write_script(tmp_path / "train.py", SCRIPT)
    conf = "heartbeat_timeout=3,last_call_timeout=1"
    if token is not None:
        conf = f"is_host=false,token_file={token},{conf}"
    backend = "c10d" if token is not None else "etcd"
    args = ["--nnodes", nnodes, "--nproc-per-node", "2", "--rdzv-backend", backend,
            "--rdzv-endpoint", endpoint, "--rdzv-id", "ip2", "--rdzv-conf", conf,
            "--local-addr", "127.0.0.1", "--max-restarts", "5",
            str(script), str(out), str(STEPS), *plan]  # fmt: skip
    return args


def _start_two_nodes(
    tmp_path: Path, endpoint: str, token: Path | None, nnodes: str, plan: list[str]
) -> tuple[Path, list[subprocess.Popen[str]]]:
    args = _node_args(tmp_path, endpoint, token, nnodes, plan)
    agents = []
    for _ in range(2):
        agents.append(start(args, cwd=tmp_path, env=FAST))
        time.sleep(0.3)
    return tmp_path / "out", agents


def _end(agents: list[subprocess.Popen[str]]) -> None:
    for a in agents:
        if a.poll() is None:
            os.killpg(a.pid, signal.SIGKILL)
        a.communicate()  # reaps it and closes its pipes


#: Between the two agents' stderr in an assertion's message.
_NODES = "\n=====\n"


def _two_nodes_to_the_end(tmp_path: Path, plan: list[str]) -> tuple[dict[int, dict[str, Any]], str]:
    """Two nodes of two workers run ``plan`` to the end, both successfully: each rank's
    result, and both agents' stderr."""
    with elastrun_store(tmp_path) as (endpoint, token):
        out, agents = _start_two_nodes(tmp_path, endpoint, token, "2", plan)
        try:
            results = [finish(a, 180) for a in agents]
        finally:
            _end(agents)
    err = _NODES.join(r.stderr for r in results)
    assert [r.returncode for r in results] == [0, 0], err
    ranks = _by_rank([json.loads(p.read_text()) for p in sorted(out.glob("rank_*.json"))])
    return ranks, err


def _last_round(node_err: str) -> int:
    """The last in-process round that completed on a node (0: none)."""
    done = re.findall(r"in-process round (\d+) complete", node_err)
    return max((int(n) for n in done), default=0)


def test_two_nodes_a_killed_rank_is_replaced_in_place(tmp_path: Path, fault_free: str) -> None:
    ranks, err = _two_nodes_to_the_end(tmp_path, ["2:35:kill"])
    for r in (0, 1, 3):
        _kept(ranks[r], [0, 36], err)  # the same process, called again
    assert ranks[2]["calls"] == [36]  # the replacement starts at the committed step
    assert {r["sha"] for r in ranks.values()} == {fault_free}  # bit for bit
    # Round 1 completes on both nodes; or, when a survivor stuck in a collective (see
    # _kept) was replaced, its node's failure re-forms the group: both nodes then
    # complete the same later round (seen once in a CI run, and 1 of 19 runs here).
    rounds = [_last_round(node) for node in err.split(_NODES)]
    assert rounds == [1, 1] or (_replaced_stuck(err) and rounds[0] == rounds[1] > 1), err
    assert "restarting all workers" not in err and "restarting them" not in err


def test_two_nodes_a_replacement_dying_before_it_said_hello_is_replaced_in_place(
    tmp_path: Path, fault_free: str
) -> None:
    ranks, err = _two_nodes_to_the_end(tmp_path, ["2:15:kill", "2:0:sync"])
    for r in (0, 1, 3):
        _kept(ranks[r], [0, 16], err)  # the same processes, through two rounds
    assert ranks[2]["calls"] == [16]
    assert {r["sha"] for r in ranks.values()} == {fault_free}
    assert "restarting all workers" not in err and "restarting them" not in err


@contextlib.contextmanager
def _rendezvous(kind: str, tmp_path: Path) -> Iterator[tuple[str, Path | None]]:
    """A standalone elastrun store (endpoint, token file), or a one-member etcd."""
    if kind == "store":
        with elastrun_store(tmp_path) as (endpoint, token):
            yield endpoint, token
        return
    binary = find_etcd()
    assert binary is not None
    cluster = EtcdCluster(binary, tmp_path / "etcd", 1).start()
    try:
        yield cluster.endpoints[0], None
    finally:
        cluster.stop()


@pytest.mark.parametrize(
    ("lost_rank", "kind"),
    [
        pytest.param(2, "store", id="second-node"),
        pytest.param(0, "store", id="store-host-node"),
        pytest.param(
            2, "etcd", id="etcd",
            marks=pytest.mark.skipif(find_etcd() is None, reason="no etcd binary"),
        ),
    ],
)  # fmt: skip
def test_two_nodes_a_lost_node_shrinks_the_world_in_place(
    tmp_path: Path, lost_rank: int, kind: str
) -> None:
    # The node of ``lost_rank`` is SIGKILLed while that rank sleeps at step 20 (the others
    # then block in a collective); with rank 0 goes the node that serves the workers' store.
    plan = [f"{lost_rank}:20:hang"]
    with _rendezvous(kind, tmp_path) as (endpoint, token):
        out, agents = _start_two_nodes(tmp_path, endpoint, token, "1:2", plan)
        try:
            wait_for(lambda: list(out.glob(f"hung_{lost_rank}_*")), 60, "the rank to hang")
            (hung,) = out.glob(f"hung_{lost_rank}_*")
            node = _parent(int(hung.name.rsplit("_", 1)[1]))
            lost = next(a for a in agents if a.pid == node)
            lost.send_signal(signal.SIGKILL)  # the node is gone: its workers die with it
            survivor = next(a for a in agents if a is not lost)
            res = finish(survivor, 120)
        finally:
            _end(agents)
    assert res.returncode == 0, res.stderr
    results = {r["rank"]: r for r in (json.loads(p.read_text()) for p in out.glob("rank_*"))}
    assert sorted(results) == [0, 1], results  # the world shrank to the survivors
    for r in results.values():
        _kept(r, [0, 21], res.stderr)  # the same processes, called again at world 2
    assert len({r["sha"] for r in results.values()}) == 1  # agreeing on the parameters
    assert _completed(res.stderr, 1), res.stderr  # (round 2 when _kept allowed a stuck one)
    assert "the world goes from 4 to 2 ranks" in res.stderr
    assert "restarting" not in res.stderr


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[1])


def test_two_nodes_a_node_that_joins_grows_the_world_in_place(tmp_path: Path) -> None:
    # One node trains alone (world 2, a step every 0.1 s); when rank 0 reaches step 5 a
    # second node joins: the first node's workers keep their processes and state, the
    # new ones take the newest commit, and the job ends at world 4.
    env = {**FAST, "STEP_SLEEP": "0.1"}
    out = tmp_path / "out"
    with elastrun_store(tmp_path) as (endpoint, token):
        args = _node_args(tmp_path, endpoint, token, "1:2", ["0:5:mark"])
        first = start(args, cwd=tmp_path, env=env)
        agents = [first]
        try:
            wait_for((out / "mark_0_5").exists, 60, "rank 0 to reach step 5")
            agents.append(start(args, cwd=tmp_path, env=env))
            results = [finish(a, 120) for a in agents]
        finally:
            _end(agents)
    err = "\n=====\n".join(r.stderr for r in results)
    assert [r.returncode for r in results] == [0, 0], err
    ranks = _by_rank([json.loads(p.read_text()) for p in sorted(out.glob("rank_*.json"))])
    kept, joined = ranks[0]["calls"], ranks[2]["calls"]
    if _replaced_stuck(err):
        # A survivor stuck in a collective (see _kept) was replaced; its node's failure
        # re-formed the group once more (seen once in a loaded CI run): every rank still
        # ends in the same last call.
        assert len({r["calls"][-1] for r in ranks.values()}) == 1, (ranks, err)
    else:
        assert kept[0] == 0 and len(kept) == 2 and kept[1] > 5, (kept, err)  # kept, called again
        assert ranks[1]["calls"] == kept
        assert joined == ranks[3]["calls"] == kept[1:]  # the new ones start at the commit
    assert len({r["sha"] for r in ranks.values()}) == 1  # agreeing on the parameters
    assert "growing in place (round 1)" in results[0].stderr
    assert "the world goes from 2 to 4 ranks" in results[0].stderr
    assert "joining in-process round 1" in results[1].stderr
    assert "restarting" not in err


def _ranks_1_and_2_replaced_in_round_2(
    err: str, results: list[dict[str, Any]], fault_free: str
) -> None:
    """Ranks 0 and 3 kept their processes all along, ranks 1 and 2 were replaced and
    went on from step 13, and the run ends with the fault-free parameters."""
    assert "in-process round 2 complete" in err and "restarting all workers" not in err
    ranks = _by_rank(results)
    _kept(ranks[0], [0, 13], err)
    _kept(ranks[3], [0, 13], err)
    assert ranks[1]["calls"] == ranks[2]["calls"] == [13]  # the replacements
    assert {r["sha"] for r in results} == {fault_free}

"""In-process recovery of sharded training (FSDP2, HSDP) from memory checkpoints, end to
end: real processes, gloo on the CPU, one node of four ranks (and two nodes of two, for a
lost node).

The script shards a small model with ``fully_shard`` (on a 1-D mesh: FSDP2; on a 2 x 2
mesh: HSDP), saves a memory checkpoint every N steps, and is decorated with
``elastrun.inprocess.run``. When a rank is killed, the survivors keep their processes
and their model (``inprocess.rebind`` points it at the new world's groups), the
replacement builds and shards its own, and every rank loads the newest step in the
node's memory (the replacement its predecessor's shards) and goes on from there. A
step's data is a pure function of the step and the rank, so the run ends with the
parameters of the run without the failure, bit for bit.

When a whole node is lost, its shards are nowhere in the survivors' memory, but each
node's steps are copied to its buddy: a spare takes the lost node's place in the next
round, pulls the lost ranks' pieces from the buddy's copy before its workers start, and
the round is recovered in place: the surviving node's workers keep their processes.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from _helpers import elastrun_store, finish, once_per_run, start, wait_for, write_script
from _node_loss import end_all, kill_a_node, node_dirs

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")

SCRIPT = """
import hashlib, json, os, signal, sys, time, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import elastrun.inprocess as inprocess
from elastrun.checkpoint import MemoryCheckpoint

out, mode, plan = sys.argv[1], sys.argv[2], sys.argv[5:]
steps, every = int(sys.argv[3]), int(sys.argv[4])
step_sleep = float(os.environ.get("STEP_SLEEP", "0"))
loads = []

class Training(Stateful):
    def __init__(self, model, opt):
        self.model, self.opt = model, opt
    def state_dict(self):
        model, optim = get_state_dict(self.model, self.opt)
        return {"model": model, "optim": optim}
    def load_state_dict(self, sd):
        set_state_dict(self.model, self.opt,
                       model_state_dict=sd["model"], optim_state_dict=sd["optim"])

def once(name):
    try:
        os.close(os.open(os.path.join(out, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = None
ckpt = MemoryCheckpoint()
state = inprocess.State(step=0)  # the state itself comes from the memory checkpoint

@inprocess.run
def train(state):
    global opt
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    if mode == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    if opt is None:  # this process's first call: shard the model
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    else:  # a survivor's model, after an in-process recovery
        inprocess.rebind(model)
    app = {"training": Training(model, opt)}
    last = ckpt.load_latest(app)
    loads.append(last)
    step = 0 if last is None else last + 1
    while step < steps:
        if f"{rank}:{step}" in plan and once(f"killed_{rank}_{step}"):
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step * 100 + rank))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        if step % every == every - 1:
            ckpt.save(step, app)
        time.sleep(step_sleep)
        step += 1
        state.step = step
        state.commit()  # (no tensors: tells the agent how far the training got)
    ckpt.close()
    full = [p.full_tensor() for p in model.parameters()]
    dist.barrier()
    dist.destroy_process_group()
    return full

full = train(state)
h = hashlib.sha256()
for t in full:
    h.update(t.detach().numpy().tobytes())
rank = int(os.environ["RANK"])
with open(os.path.join(out, f"rank_{rank}_{os.getpid()}.json"), "w") as fh:
    json.dump({"rank": rank, "pid": os.getpid(), "loads": loads, "sha": h.hexdigest()}, fh)
"""

STEPS = 24


def _run(
    tmp_path: Path, name: str, mode: str, every: int, plan: list[str]
) -> tuple[int, str, dict[int, dict[str, Any]]]:
    out = tmp_path / name
    out.mkdir()
    script = write_script(tmp_path / "sharded.py", SCRIPT)
    proc = start(
        ["--standalone", "--nproc-per-node", "4", "--max-restarts", "10",
         str(script), str(out), mode, str(STEPS), str(every), *plan],
        # (a survivor that gloo leaves blocked in a collective is replaced after 5 s)
        cwd=tmp_path, env={"OMP_NUM_THREADS": "1", "ELASTRUN_INPROCESS_JOIN_TIMEOUT": "5"},
    )  # fmt: skip
    res = finish(proc, 180)
    results = [json.loads(p.read_text()) for p in out.glob("rank_*.json")]
    return res.returncode, res.stderr, {r["rank"]: r for r in results}


@pytest.fixture
def clean_sha(
    tmp_path_factory: pytest.TempPathFactory, worker_id: str
) -> Callable[[str, int], str]:
    """The parameters' SHA-256 of a run without failures, by (mode, save interval): one
    run each for all the tests (and pytest workers) that compare with it."""

    def get(mode: str, every: int) -> str:
        def make() -> str:
            code, err, clean = _run(tmp_path_factory.mktemp("clean"), "out", mode, every, [])
            return _the_sha(code, err, {r: [v] for r, v in clean.items()})

        return _once(tmp_path_factory, worker_id, f"inprocess-sharded-{mode}-{every}", make)

    return get


def _once(
    factory: pytest.TempPathFactory, worker_id: str, key: str, make: Callable[[], str]
) -> str:
    """``make()``, run once for all the tests (and pytest workers) that ask for ``key``."""
    if worker_id == "master":  # not under xdist
        return make()
    return once_per_run(factory.getbasetemp().parent, key, make)


def _the_sha(code: int, err: str, ranks: dict[int, list[dict[str, Any]]]) -> str:
    """The one parameters' SHA-256 of a run without failures that every rank ended with."""
    assert code == 0, err
    shas = {str(r["sha"]) for results in ranks.values() for r in results}
    assert sorted(ranks) == [0, 1, 2, 3] and len(shas) == 1, ranks
    return shas.pop()


@pytest.mark.parametrize(
    ("mode", "every", "resumed"),
    [
        # FSDP2 on 4 ranks, a save every step: rank 2 killed before step 13, when its
        # save of step 12 may still be in flight: every rank resumes after step 12 or 11.
        ("fsdp", 1, (11, 12)),
        # HSDP 2 x 2, a save every 5 steps (4, 9, 14, ...): rank 1 killed before step
        # 13: every rank resumes after step 9, in place.
        ("hsdp", 5, (9,)),
    ],
    ids=["fsdp-every-step", "hsdp-every-5"],
)
def test_sharded_survivors_keep_their_processes_and_resume_from_memory_in_place(
    tmp_path: Path,
    clean_sha: Callable[[str, int], str],
    mode: str,
    every: int,
    resumed: tuple[int, ...],
) -> None:
    victim = 2 if mode == "fsdp" else 1
    code, err, ranks = _run(tmp_path, "killed", mode, every, [f"{victim}:13"])
    assert code == 0, err
    assert sorted(ranks) == [0, 1, 2, 3], (ranks, err)
    assert "replacing it in place" in err and "restarting all workers" not in err, err
    step = ranks[victim]["loads"][0]
    assert step in resumed, (ranks, err)
    for r, result in ranks.items():
        # Each survivor is the same process, called again: it loaded the same step.
        if r == victim:
            assert result["loads"] == [step], (result, err)  # the replacement
        elif result["loads"] != [None, step]:
            # torch 2.13's gloo now and then leaves a survivor blocked in a collective
            # whose peer died (see test_inprocess._kept): the agent replaces it, and says
            # so; it then loads a step of its own as a replacement.
            assert "did not reach in-process round" in err, (result, err)
            assert result["loads"][-1] in resumed, (result, err)
    # The parameters of the run without the failure, on every rank.
    assert {r["sha"] for r in ranks.values()} == {clean_sha(mode, every)}


def test_sharded_recoveries_one_after_another_stay_in_place(
    tmp_path: Path, clean_sha: Callable[[str, int], str]
) -> None:
    # Four ranks killed one after another (rank 0 too, whose agent serves the store):
    # each recovery is in place, the stall guard sees the training move on (the empty
    # State's commits), and the parameters are those of the run without failures.
    plan = ["1:5", "2:9", "3:14", "0:19"]
    code, err, ranks = _run(tmp_path, "killed", "fsdp", 1, plan)
    assert code == 0, err
    # (and one more for each survivor that gloo left blocked, which the agent replaced:
    # see test_sharded_survivors_keep_their_processes_and_resume_from_memory_in_place)
    assert err.count("replacing it in place") == 4 + err.count("did not reach in-process"), err
    assert "restarting all workers" not in err and "no newer commit" not in err, err
    assert {r["sha"] for r in ranks.values()} == {clean_sha("fsdp", 1)}


# -- the state in the State: a replacement takes its shard from a replica ---------------

REPLICA_SCRIPT = """
import hashlib, json, logging, os, signal, sys, time, warnings
warnings.filterwarnings("ignore")
logging.basicConfig(level=logging.WARNING)
logging.getLogger("elastrun.inprocess").setLevel(logging.INFO)
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
import elastrun.inprocess as inprocess
from elastrun.checkpoint import MemoryCheckpoint

out, mode, steps, plan = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
# KILL_PAUSE: a rank planned to die at step S dies as soon as it has committed step S - 1,
# while every rank pauses this long before step S (see the HSDP test).
pause = float(os.environ.get("KILL_PAUSE", "0"))
calls = []

def once(name):
    try:
        os.close(os.open(os.path.join(out, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
state = inprocess.State(model=model, optimizer=None, step=0)
# fsdp-memory: the State saved into a memory checkpoint every 5 steps, restore's way back
ckpt = MemoryCheckpoint() if mode == "fsdp-memory" else None

@inprocess.run
def train(state):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    if mode.startswith("hsdp"):
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    if mode == "hsdp-gloo":  # the shards over gloo, as between machines
        import elastrun.inprocess.worker.transfer as transfer
        transfer.LOCAL = False
    if not isinstance(state.model, FSDPModule):  # this process's first call
        for layer in state.model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(state.model, mesh=mesh)
        state.optimizer = torch.optim.Adam(state.model.parameters(), lr=1e-2)
    if f"{rank}:restore" in plan and os.environ.get("ELASTRUN_INPROCESS_ROUND", "0") != "0":
        if once(f"killed_{rank}_restore"):  # a survivor killed as the shards are to move
            os.kill(os.getpid(), signal.SIGKILL)
    state.restore(ckpt)
    calls.append(state.step)
    while state.step < steps:
        step = state.step
        if f"{rank}:{step}" in plan and once(f"killed_{rank}_{step}"):
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step * 100 + rank))
        state.optimizer.zero_grad()
        state.model(x).pow(2).mean().backward()
        state.optimizer.step()
        state.step += 1
        state.commit()
        if ckpt is not None and state.step % 5 == 0:
            ckpt.save(state.step, {"state": state})
        if pause and any(p.endswith(f":{state.step}") for p in plan):
            if f"{rank}:{state.step}" in plan and once(f"killed_{rank}_{state.step}"):
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(pause)
    if ckpt is not None:
        ckpt.close()
    full = [p.full_tensor() for p in state.model.parameters()]
    dist.barrier()
    dist.destroy_process_group()
    return full

full = train(state)
h = hashlib.sha256()
for t in full:
    h.update(t.detach().numpy().tobytes())
rank = int(os.environ["RANK"])
with open(os.path.join(out, f"rank_{rank}_{os.getpid()}.json"), "w") as fh:
    json.dump({"rank": rank, "pid": os.getpid(), "calls": calls, "sha": h.hexdigest()}, fh)
"""


def _run_replica(
    tmp_path: Path,
    name: str,
    mode: str,
    steps: int,
    plan: list[str],
    inprocess: bool = True,
    pause: float = 0.0,
) -> tuple[int, str, dict[int, list[dict[str, Any]]]]:
    out = tmp_path / name
    out.mkdir()
    script = write_script(tmp_path / "replica.py", REPLICA_SCRIPT)
    proc = start(
        ["--standalone", "--nproc-per-node", "4", "--max-restarts", "10",
         str(script), str(out), mode, str(steps), *plan],
        cwd=tmp_path, env={"OMP_NUM_THREADS": "1", "ELASTRUN_INPROCESS_JOIN_TIMEOUT": "5",
                           "ELASTRUN_INPROCESS": "1" if inprocess else "0",
                           "KILL_PAUSE": str(pause)},
    )  # fmt: skip
    res = finish(proc, 180)
    ranks: dict[int, list[dict[str, Any]]] = {}
    for p in out.glob("rank_*.json"):
        result = json.loads(p.read_text())
        ranks.setdefault(result["rank"], []).append(result)
    return res.returncode, res.stderr, ranks


@pytest.fixture
def clean_replica_sha(
    tmp_path_factory: pytest.TempPathFactory, worker_id: str
) -> Callable[[str], str]:
    """The parameters' SHA-256 of the run without failures, by mode (one run each for
    all the tests and pytest workers that compare with it)."""

    def get(mode: str) -> str:
        def make() -> str:
            out = tmp_path_factory.mktemp("clean")
            return _the_sha(*_run_replica(out, "out", mode, 24, []))

        return _once(tmp_path_factory, worker_id, f"inprocess-replica-{mode}", make)

    return get


@pytest.mark.parametrize(
    ("plan", "victims"),
    [
        # HSDP 2 x 2 (replica groups {0, 1} and {2, 3}; rank r's shard is also rank
        # (r + 2) % 4's). Both ranks of one replica group killed together: their shards
        # come from the other group (ranks 2 and 3), over gloo (two shards at once).
        (["0:13", "1:13"], (0, 1)),
        # Rank 1 killed before step 13, and rank 0 in its recovery, as the shards are
        # about to move: the round fails on every rank, the next replaces rank 0 too,
        # and each takes its shard from the other group (rank 1's from rank 3).
        (["1:13", "0:restore"], (0, 1)),
    ],
    ids=["a-whole-replica-group", "a-kill-during-the-transfer"],
)
def test_hsdp_replacement_takes_its_shard_from_a_replica_and_no_step_is_lost(
    tmp_path: Path,
    clean_replica_sha: Callable[[str], str],
    plan: list[str],
    victims: tuple[int, ...],
) -> None:
    # The step-13 victims die as every rank pauses after step 12 (KILL_PAUSE), not while
    # the survivors exchange a step's shards with each other. There, a connection that one
    # survivor cuts on the round's message can reset under a send the other is writing,
    # and torch 2.13's gloo then leaves that send waiting for the group's timeout (see
    # docs/inprocess.md, "A survivor stuck in a collective"): the join timeout replaces
    # that survivor, and with it the last replica of its shard. That fallback is not what
    # this test is about.
    gloo = plan == ["0:13", "1:13"]
    mode = "hsdp-gloo" if gloo else "hsdp"
    code, err, ranks = _run_replica(tmp_path, "killed", mode, 24, plan, pause=1.0)
    assert code == 0, err
    assert sorted(ranks) == [0, 1, 2, 3], (ranks, err)
    assert "restarting all workers" not in err, err
    for rank, results in ranks.items():
        assert len(results) == 1, (results, err)  # one process per rank finished
        calls = results[0]["calls"]
        if rank in victims:
            # The replacement: its first call starts at step 13 (a commit every step:
            # nothing lost), its shard from the other replica group's rank.
            assert calls == [13], (rank, results, err)
            source = (rank + 2) % 4
            assert f"rank {rank} took commit 13 of its shard from rank {source}" in err, err
        elif calls != [0, 13]:
            # See test_sharded_survivors_keep_their_processes_and_resume_from_memory_in_place.
            assert "did not reach in-process round" in err, (rank, results, err)
            assert calls[-1] == 13, (rank, results, err)
    # No survivor took anything: each kept its own shard, rolled back to its commit.
    survivors = sorted(set(range(4)) - set(victims))
    assert not any(f"rank {r} took commit" in err for r in survivors), err
    assert {r[0]["sha"] for r in ranks.values()} == {clean_replica_sha("hsdp")}


@pytest.mark.parametrize("inprocess", [True, False], ids=["in-place", "group-restart"])
def test_fsdp2_state_without_replicas_resumes_from_the_memory_checkpoint(
    tmp_path: Path, clean_replica_sha: Callable[[str], str], inprocess: bool
) -> None:
    # FSDP2 on 4 ranks, the State saved into a memory checkpoint every 5 steps (after
    # steps 5, 10, 15, ...), rank 2 killed at step 13. In place: it has no replica, so
    # every rank loads step 10 from the node's memory, in place, and goes on from there.
    # With in-process recovery off: the group restarts, and every new process loads
    # step 10 in state.restore() too.
    clean = {clean_replica_sha("fsdp-memory")}
    code, err, ranks = _run_replica(tmp_path, "killed", "fsdp-memory", 24, ["2:13"], inprocess)
    assert code == 0, err
    assert sorted(ranks) == [0, 1, 2, 3], (ranks, err)
    if not inprocess:
        assert err.count("restarting all workers") == 1, err
        assert all(r[-1]["calls"] == [10] for r in ranks.values()), (ranks, err)
        assert {r[-1]["sha"] for r in ranks.values()} == clean
        return
    assert "restarting all workers" not in err, err
    assert "every rank loaded step 10 from the memory checkpoint instead, in place" in err, err
    for rank, results in ranks.items():
        assert len(results) == 1, (results, err)
        calls = results[0]["calls"]
        if rank == 2:
            assert calls == [10], (results, err)
        elif calls != [0, 10]:
            assert "did not reach in-process round" in err, (rank, results, err)
            assert calls[-1] == 10, (rank, results, err)
    assert {r[0]["sha"] for r in ranks.values()} == clean


def test_fsdp2_state_without_replicas_restarts_the_group_once_saying_why(tmp_path: Path) -> None:
    # FSDP2 on 4 ranks: a rank's shard is in no other rank. A killed rank's replacement
    # finds it lost; every rank says so, and the agent restarts the group at once (one
    # restart from the budget, not one per rank ending with the error).
    code, err, ranks = _run_replica(tmp_path, "killed", "fsdp", 8, ["2:5"])
    assert code == 0, err
    assert sorted(ranks) == [0, 1, 2, 3], (ranks, err)
    assert "no rank holding the shard of rank 2 holds commit 5 intact" in err, err
    assert "newest commit held by no rank (CommitLostError)" in err, err
    assert err.count("restarting all workers") == 1 and "(restart 2 of 10)" in err, err
    assert all(results[-1]["calls"] == [0] for results in ranks.values()), ranks


#: Between two agents' stderr in an assertion's message.
_NODES = "\n=====\n"


def _lose_a_node(
    tmp_path: Path, spare: bool
) -> tuple[list[Any], dict[int, list[dict[str, Any]]], int, str]:
    """Two nodes of two workers run the FSDP2 script with a memory checkpoint every
    step; once rank 3's node agreed on step 6 it is killed (with a spare waiting:
    ``--nnodes 2``; else ``--nnodes 1:2``). The remaining agents' results, each rank's
    results, the newest step agreed before the kill, and the agents' stderr."""
    run_id = f"ip-node-{tmp_path.name}"[:40]
    out = tmp_path / "out"
    out.mkdir()
    script = write_script(tmp_path / "sharded.py", SCRIPT)
    env = {"OMP_NUM_THREADS": "1", "STEP_SLEEP": "0.25", "ELASTRUN_INPROCESS_JOIN_TIMEOUT": "5"}
    with elastrun_store(tmp_path) as (endpoint, token):
        args = ["--nnodes", "2" if spare else "1:2", "--nproc-per-node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
                "--rdzv-conf", f"is_host=false,token_file={token},last_call_timeout=1",
                "--local-addr", "127.0.0.1", "--max-restarts", "3",
                str(script), str(out), "fsdp", str(STEPS), "1"]  # fmt: skip
        agents = [start(args, cwd=tmp_path, env=env)]
        time.sleep(0.3)
        agents.append(start(args, cwd=tmp_path, env=env))
        waiting = []
        try:
            wait_for(lambda: len(node_dirs(run_id)) == 2, 60, "two node directories")
            if spare:  # it waits: the job runs at its maximum
                waiting.append(start(args, cwd=tmp_path, env=env))
            victim, _, agreed = kill_a_node(run_id, agents, after=6)
        except BaseException:
            print(_NODES.join(r.stderr for r in end_all([*agents, *waiting], 1)))
            raise
        results = end_all([*(a for a in agents if a.pid != victim), *waiting])
        next(a for a in agents if a.pid == victim).communicate(timeout=10)
    err = _NODES.join(r.stderr for r in results)
    assert all(r.returncode == 0 for r in results), err
    assert node_dirs(run_id) == [], err
    ranks: dict[int, list[dict[str, Any]]] = {}
    for path in out.glob("rank_*.json"):
        result = json.loads(path.read_text())
        ranks.setdefault(result["rank"], []).append(result)
    return results, ranks, agreed, err


@pytest.mark.timeout(300)  # (and the run without the failure, when no test made it yet)
def test_a_lost_nodes_shards_come_from_the_buddy_copy_and_the_survivors_stay_in_place(
    tmp_path: Path, clean_sha: Callable[[str, int], str]
) -> None:
    results, ranks, agreed, err = _lose_a_node(tmp_path, spare=True)
    assert sorted(ranks) == [0, 1, 2, 3] and all(len(r) == 1 for r in ranks.values()), err
    # The spare pulled the lost ranks' pieces of one step from the buddy's copy, and
    # every rank loaded that step: nothing the ranks had agreed on before the kill is lost.
    pulled = re.search(r"pulled rank\(s\) 2, 3 of step (\d+) from", results[1].stderr)
    assert pulled is not None, err
    step = int(pulled.group(1))
    assert step >= agreed, (step, agreed, err)
    assert ranks[2][0]["loads"] == ranks[3][0]["loads"] == [step], (ranks, err)
    for r in (0, 1):
        # The surviving node's workers are the same processes, called again.
        if ranks[r][0]["loads"] != [None, step]:
            # gloo now and then leaves a survivor blocked in a collective whose peer
            # died (see test_inprocess._kept): the agent replaces it, and says so.
            assert "did not reach in-process round" in err, (ranks, err)
    # Round 1 completes, or the round after it where a stuck survivor was replaced.
    completed = "in-process round 1 complete" in results[0].stderr
    assert completed or "did not reach in-process round" in err, err
    assert "restarting" not in err, err
    # The parameters of the run without the failure, on every rank. That run rebuilds
    # nothing, and is still the right reference: FSDP2 reduces each parameter group in an
    # order fixed by the module's structure, so the spare's freshly sharded model and the
    # survivors' rebuilt groups (the same ranks) reduce as the first ones did (unlike
    # DDP, which regroups its buckets after its first step: docs/inprocess.md).
    assert {r[0]["sha"] for r in ranks.values()} == {clean_sha("fsdp", 1)}, (ranks, err)


@pytest.mark.timeout(300)
def test_a_lost_node_with_no_spare_restarts_the_group_resharded_from_memory(
    tmp_path: Path,
) -> None:
    # The survivors cannot keep a model sharded for 4 ranks in a world of 2: rebind
    # says so, and the group restarts once; the two new ranks load the four ranks'
    # pieces (their node's own and its copy of the lost node's) resharded by DCP.
    _, ranks, agreed, err = _lose_a_node(tmp_path, spare=False)
    assert "the model's shards are laid out for 4 ranks along a mesh dimension that has 2" in err
    assert err.count("restarting all workers") == 1, err
    restored = re.search(r"restarting all workers, state from memory at step (\d+)", err)
    assert restored is not None, err
    step = int(restored.group(1))
    assert step >= agreed, (step, agreed, err)
    assert sorted(ranks) == [0, 1] and all(len(r) == 1 for r in ranks.values()), err
    assert [r[0]["loads"] for r in ranks.values()] == [[step], [step]], (ranks, err)
    # (Agreeing on the state; that a resharded load is exact is test_memory_checkpoint_buddies's.)
    assert len({r[0]["sha"] for r in ranks.values()}) == 1, ranks

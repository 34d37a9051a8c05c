"""In-process recovery of a sizeable and realistic state, end to end: three ranks, real
gloo, a commit after every step, three recoveries in one job.

The state holds a linear layer with Adam (57 MB per rank: big enough that its tensors
go in several chunks, split across the ranks that hold the commit) and a small network
with dropout and batch norm, trained from a sampler whose position is its state. Three
recoveries, each over another path:

1. rank 2 is killed: its replacement takes the commit over gloo, chunks from ranks 0
   and 1 (as between machines);
2. rank 1 is killed; rank 2 dies as the commit's bytes start to move;
3. both replacements read the commit straight from rank 0's memory (process_vm_readv).

Rank 0 keeps its process through all three (it must: the batch-norm statistics are each
rank's own after its forward pass, and rank 0's go to the others before the next, as
with DDP; a replacement of rank 0 would take another rank's). The result is bit for
bit that of the same training without the API, and the kept rank's peak memory grows
by less than half the state (a commit that copied the state would add all of it).

A second test runs the issue's size, 0.4 GB per rank on two ranks: one recovery, bit
for bit, the survivor's process kept, its peak RSS within 15 % of the same training's
without the API. The timings at real sizes (0.4 and 1.6 GB per rank, GB/s, the peak
against a group restart's, kill -> every rank's next step) are the benchmark's
(benchmarks/bench_inprocess_state.py, benchmarks/RESULTS.md); a commit read from a
process of another machine is refused in tests/unit/test_inprocess_commit.py.

Each rank records its parameters' SHA-256 (with the batch-norm statistics and Adam's
moments), its peak RSS and how each transfer went.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from _helpers import finish, start, write_script

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")

SCRIPT = """
import hashlib, json, os, signal, sys
import torch, torch.distributed as dist

out, mode, features, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
plan = sys.argv[5:]
rank = int(os.environ["RANK"])
calls = []

def once(name):
    try:
        os.close(os.open(os.path.join(out, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True

def planned(kind, when):
    # RANK:WHEN:KIND, each once per job (WHEN: a step, or for movedie a round).
    item = f"{rank}:{when}:{kind}"
    return item in plan and once(f"did_{item}")

class Sampler:
    # Indices into the data set, shuffled per epoch; its position is its state.
    def __init__(self, n, batch):
        self.n, self.batch, self.epoch, self.pos = n, batch, 0, 0
    def next_batch(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch))
        if self.pos + self.batch > self.n:
            self.epoch, self.pos = self.epoch + 1, 0
            return self.next_batch()
        idx = order[self.pos : self.pos + self.batch]
        self.pos += self.batch
        return idx
    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos}
    def load_state_dict(self, sd):
        self.epoch, self.pos = sd["epoch"], sd["pos"]

torch.manual_seed(0)
model = torch.nn.ModuleDict({
    "big": torch.nn.Linear(features, 2 * features, bias=False),
    "net": torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64),
                               torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(64, 1)),
})
gen = torch.Generator().manual_seed(1)
big_x, small_x = torch.randn(48, features, generator=gen), torch.randn(48, 16, generator=gen)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
sampler = Sampler(len(small_x), 8)

import elastrun.inprocess.worker.sync as sync
import elastrun.inprocess.worker.transfer as transfer
real_commit, real_move, real_local = sync.move_commit, transfer._move_bytes, transfer._read_locally

def move_commit(*args):
    # Round 1 over gloo, as between machines.
    transfer.LOCAL = int(os.environ["ELASTRUN_INPROCESS_ROUND"]) != 1
    return real_commit(*args)

def move(tensors, moving, me, world, *rest):
    round_no = int(os.environ["ELASTRUN_INPROCESS_ROUND"])
    if planned("movedie", round_no):
        os.kill(os.getpid(), signal.SIGKILL)
    real_move(tensors, moving, me, world, *rest)
    with open(os.path.join(out, f"moved_{round_no}_{me}.json"), "w") as fh:
        json.dump({"sources": list(moving[0].sources), "receivers": list(moving[0].receivers),
                   "local": transfer.LOCAL and read[-1:] == [True]}, fh)

read = []

def read_locally(*args):
    read.append(real_local(*args))
    return read[-1]

sync.move_commit, transfer._move_bytes, transfer._read_locally = move_commit, move, read_locally

def one_step():
    idx = sampler.next_batch()
    for b in model.buffers():  # as DistributedDataParallel does (broadcast_buffers)
        dist.broadcast(b, 0)
    opt.zero_grad()
    big, net = model["big"](big_x[idx] + rank), model["net"](small_x[idx] + rank)
    (big.square().mean() + net.square().mean()).backward()
    for p in model.parameters():  # the gradients' all-reduce: where a peer's death shows
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    opt.step()

def train(state):
    calls.append(state.step)
    dist.init_process_group("gloo")
    while state.step < steps:
        one_step()
        state.step += 1
        state.commit()
        if planned("kill", state.step - 1):
            os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    dist.destroy_process_group()

class Plain:  # without the API: the same steps, no State
    step = 0
    def commit(self):
        pass

if mode == "api":
    import elastrun.inprocess as inprocess
    state = inprocess.State(model=model, optimizer=opt, sampler=sampler, step=0)
    inprocess.run(train)(state)
else:
    train(Plain())
h = hashlib.sha256()
for t in [*model.state_dict().values(), *(v for s in opt.state.values() for v in s.values())]:
    h.update(t.detach().numpy().tobytes())
with open("/proc/self/status") as fh:
    peak = next(int(l.split()[1]) * 1024 for l in fh if l.startswith("VmHWM"))
with open(os.path.join(out, f"rank_{rank}_{os.getpid()}.json"), "w") as fh:
    json.dump({"rank": rank, "pid": os.getpid(), "calls": calls, "sha": h.hexdigest(),
               "peak": peak}, fh)
"""

# A fixed mmap threshold: glibc's own rises to the largest block freed, after which
# blocks of a state tensor's size (Adam's temporaries, gradients) stay in the heap once
# freed, and the peak RSS of two identical runs differed by up to a state's worth. With
# it the kept rank peaks 5-6 MB above the same training without the API; with every
# tensor copied at each commit (copy_state=True), 62 MB.
ENV = {
    "OMP_NUM_THREADS": "1",
    "ELASTRUN_INPROCESS_JOIN_TIMEOUT": "5",
    "MALLOC_MMAP_THRESHOLD_": "131072",
}
#: 1536 x 3072 float32 parameters and Adam's two moments: 57 MB per rank, each tensor in
#: two chunks of transfer.CHUNK (16 MB).
FEATURES = 1536
STATE_BYTES = 3 * 2 * FEATURES * FEATURES * 4
STEPS = 10


def _run(
    tmp_path: Path,
    mode: str,
    plan: list[str],
    nproc: int = 3,
    features: int = FEATURES,
    steps: int = STEPS,
) -> tuple[str, dict[int, list[dict[str, Any]]], Path]:
    out = tmp_path / mode
    out.mkdir()
    script = write_script(tmp_path / "train.py", SCRIPT)
    proc = start(
        ["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "5",
         str(script), str(out), mode, str(features), str(steps), *plan],
        cwd=tmp_path, env=ENV,
    )  # fmt: skip
    res = finish(proc, 240)
    assert res.returncode == 0, res.stderr
    ranks: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(out.glob("rank_*.json")):
        result = json.loads(path.read_text())
        ranks.setdefault(result["rank"], []).append(result)
    assert sorted(ranks) == list(range(nproc)), ranks
    return res.stderr, ranks, out


def _one(ranks: dict[int, list[dict[str, Any]]]) -> dict[int, dict[str, Any]]:
    """Each rank's one process that finished."""
    return {rank: r for rank, (r,) in ranks.items()}


def test_three_recoveries_over_gloo_and_from_memory_keep_the_state_bit_for_bit(
    tmp_path: Path,
) -> None:
    _, plain, _ = _run(tmp_path, "plain", [])
    plan = ["2:3:kill", "1:6:kill", "2:2:movedie"]
    err, ranks, out = _run(tmp_path, "api", plan)
    done, clean = _one(ranks), _one(plain)
    # Bit for bit: the parameters, Adam's moments, the batch-norm statistics; dropout's
    # masks and the sampler's position came back with the commit.
    assert {r: d["sha"] for r, d in done.items()} == {r: c["sha"] for r, c in clean.items()}
    assert done[0]["calls"] == [0, 4, 7], done  # the same process, called again
    assert done[1]["calls"] == [7] and done[2]["calls"] == [7], done  # replacements
    assert "in-process round 3 complete" in err and "restarting all workers" not in err
    # Round 1: the commit streamed over gloo, its chunks from both ranks that hold it.
    moved = json.loads((out / "moved_1_2.json").read_text())
    assert moved == {"sources": [0, 1], "receivers": [2], "local": False}, moved
    # Round 3: both replacements read it from the kept rank's memory.
    for r in (1, 2):
        moved = json.loads((out / f"moved_3_{r}.json").read_text())
        assert moved == {"sources": [0], "receivers": [1, 2], "local": True}, moved
    # No second copy of the state: the kept rank (a source of the commit in two rounds)
    # peaks within half a state of the same rank without the API.
    growth = done[0]["peak"] - clean[0]["peak"]
    print(f"kept rank's peak RSS +{growth / 1e6:.1f} MB, state {STATE_BYTES / 1e6:.0f} MB")
    assert growth < STATE_BYTES / 2, (done[0]["peak"], clean[0]["peak"])


def test_a_state_of_0_4_gb_per_rank_recovers_in_place_bit_for_bit_within_its_memory_bound(
    tmp_path: Path,
) -> None:
    # The size: 4096 x 8192 float32 parameters and Adam's two moments, 0.40 GB
    # per rank (plus the small network), two ranks; rank 1 is killed after step 3 and
    # its replacement takes the commit over gloo (the script's first round).
    features = 4096
    sized = {"nproc": 2, "features": features, "steps": 6}
    _, plain, _ = _run(tmp_path, "plain", [], **sized)
    err, ranks, _ = _run(tmp_path, "api", ["1:3:kill"], **sized)
    done, clean = _one(ranks), _one(plain)
    assert {r: d["sha"] for r, d in done.items()} == {r: c["sha"] for r, c in clean.items()}
    assert done[0]["calls"] == [0, 4], done  # the survivor kept its process
    assert done[1]["calls"] == [4], done
    assert "in-process round 1 complete" in err and "restarting all workers" not in err
    # No second copy: the survivor's peak within 15 % of the same training's without
    # the API (the bound; about 1 % measured).
    ratio = done[0]["peak"] / clean[0]["peak"]
    print(f"survivor's peak RSS {ratio:.3f}x the training's without the API")
    assert ratio <= 1.15, (done[0]["peak"], clean[0]["peak"])

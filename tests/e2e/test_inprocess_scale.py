"""In-process recovery of real-sized and realistic state, end to end: two ranks, real
gloo, a commit after every step.

- a 0.4 GB state per rank (a linear layer and its Adam moments): bit for bit a run
  without the API, the survivor keeps its process, peak memory at most 1.15x the same
  training without the API, every rank's next step within 2 s of the kill;
- dropout, a batch-norm layer and a sampler whose position is its state: what a user
  expects to come back does;
- a rank killed while the commit is being transferred: the next round completes it.

Each rank records the moment it completes each step, its peak RSS and its parameters'
SHA-256 (with Adam's moments).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from _helpers import finish, start, write_script

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")

SCRIPT = """
import hashlib, json, os, signal, sys, time
import torch, torch.distributed as dist

out, mode, features, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
plan = sys.argv[5:]
rank = int(os.environ["RANK"])
log = os.open(os.path.join(out, f"steps_{rank}_{os.getpid()}.log"),
              os.O_WRONLY | os.O_CREAT | os.O_APPEND)
calls = []

def once(name):
    try:
        os.close(os.open(os.path.join(out, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True

def planned(kind, step=None):
    for item in plan:
        who, when, what = item.split(":")
        if what == kind and int(who) == rank and (step is None or int(when) == step):
            if once(f"did_{item}"):
                return int(when)
    return None

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
if features:  # big: one linear layer, Adam (the state: 3x the parameters)
    model = torch.nn.Linear(features, 2 * features, bias=False)
    data = torch.randn(64, features, generator=torch.Generator().manual_seed(1))
else:  # small, with what a user expects back: dropout, batch norm
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64),
                                torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(64, 1))
    data = torch.randn(96, 16, generator=torch.Generator().manual_seed(1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
sampler = Sampler(len(data), 8)

import elastrun.inprocess.transfer as transfer
real_move = transfer._move_bytes
transfer.LOCAL = os.environ.get("OVER_GLOO") != "1"  # else read from the peer's memory

def move(*args):
    # RANK:0:movedie: that rank dies as the commit's bytes start to move.
    if planned("movedie") is not None:
        os.kill(os.getpid(), signal.SIGKILL)
    return real_move(*args)

transfer._move_bytes = move

def one_step(step):
    idx = sampler.next_batch()
    x = data[idx] + rank
    for b in model.buffers():  # as DistributedDataParallel does (broadcast_buffers)
        dist.broadcast(b, 0)
    opt.zero_grad()
    model(x).square().mean().backward()
    for p in model.parameters():  # the gradients' all-reduce: where a peer's death shows
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    opt.step()

def train(state):
    calls.append(state.step)
    dist.init_process_group("gloo")
    while state.step < steps:
        one_step(state.step)
        os.write(log, f"{state.step} {time.time():.6f}\\n".encode())
        state.step += 1
        state.commit()
        if planned("kill", state.step - 1) is not None:
            with open(os.path.join(out, "killed_at"), "w") as fh:
                fh.write(f"{state.step - 1} {time.time():.6f}")
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

ENV = {"OMP_NUM_THREADS": "1", "ELASTRUN_INPROCESS_JOIN_TIMEOUT": "5"}
#: 4096 x 8192 float32 parameters and Adam's two moments: 0.40 GB per rank.
BIG = 4096


def _run(
    tmp_path: Path,
    name: str,
    mode: str,
    features: int,
    steps: int,
    plan: list[str],
    nproc: int,
    **env: str,
) -> tuple[str, dict[int, list[dict]], Path]:
    out = tmp_path / name
    out.mkdir()
    script = write_script(tmp_path / "train.py", SCRIPT)
    proc = start(
        ["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "5",
         str(script), str(out), mode, str(features), str(steps), *plan],
        cwd=tmp_path, env={**ENV, **env},
    )  # fmt: skip
    res = finish(proc, 150)
    assert res.returncode == 0, res.stderr
    ranks: dict[int, list[dict]] = {}
    for path in sorted(out.glob("rank_*.json")):
        result = json.loads(path.read_text())
        ranks.setdefault(result["rank"], []).append(result)
    assert sorted(ranks) == list(range(nproc)), ranks
    return res.stderr, ranks, out


def _shas(ranks: dict[int, list[dict]]) -> dict[int, str]:
    """Each rank's hash (of its one process that finished)."""
    return {rank: r["sha"] for rank, (r,) in ranks.items()}


def _completed(out: Path) -> dict[int, list[tuple[int, float]]]:
    """Each rank's completed steps (step, time), over all its processes."""
    done: dict[int, list[tuple[int, float]]] = {}
    for path in out.glob("steps_*.log"):
        rank = int(path.name.split("_")[1])
        for line in path.read_text().splitlines():
            step, t = line.split()
            done.setdefault(rank, []).append((int(step), float(t)))
    return done


def test_a_big_state_recovers_bit_for_bit_within_two_seconds_and_a_sixth_more_memory(
    tmp_path: Path,
) -> None:
    steps, kill_at = 5, 2
    _, plain, plain_out = _run(tmp_path, "plain", "plain", BIG, steps, [], 2)
    err, ranks, out = _run(tmp_path, "api", "api", BIG, steps, [f"1:{kill_at}:kill"], 2)
    (survivor,) = ranks[0]
    (replacement,) = ranks[1]
    assert survivor["calls"] == [0, kill_at + 1]  # the same process, called again
    assert replacement["calls"] == [kill_at + 1]
    shas = {r["sha"] for rs in plain.values() for r in rs}
    assert len(shas) == 1 and {survivor["sha"], replacement["sha"]} == shas  # bit for bit
    peak_plain = max(r["peak"] for rs in plain.values() for r in rs)
    ratio = max(survivor["peak"], replacement["peak"]) / peak_plain
    killed = float((out / "killed_at").read_text().split()[1])
    done = _completed(out)
    next_step = max(min(t for s, t in done[r] if s == kill_at + 1) for r in (0, 1)) - killed
    # 2 s where a step of this size takes 0.5 s (fwd/bwd and Adam on one core); on a
    # machine shared with other work everything slows alike (a step took 2.5 s at a load
    # of 7 on 2 cores): the bound grows with the fault-free run's slowest step.
    step = max(
        b - a
        for done_plain in _completed(plain_out).values()
        for (_, a), (_, b) in itertools.pairwise(sorted(done_plain))
    )
    print(f"peak RSS {ratio:.3f}x without the API; kill -> every rank's next step "
          f"{next_step:.2f} s (a step: up to {step:.2f} s)")  # fmt: skip
    assert ratio <= 1.15, (survivor["peak"], replacement["peak"], peak_plain)
    assert next_step <= 2.0 * max(1.0, step / 0.5), (next_step, step, err)
    assert "in-process round 1 complete" in err and "restarting all workers" not in err


def test_dropout_batch_norm_and_a_samplers_position_come_back_bit_for_bit(
    tmp_path: Path,
) -> None:
    # The killed rank's peer has drawn its dropout masks, moved its batch-norm statistics
    # and its sampler for the step whose all-reduce fails: all of it is rolled back. (The
    # statistics are each rank's own after its forward pass; rank 0's go to the others
    # before the next, as with DDP: the replacement of rank 1 takes rank 0's commit.)
    _, plain, _ = _run(tmp_path, "plain", "plain", 0, 30, [], 2)
    err, ranks, _ = _run(tmp_path, "api", "api", 0, 30, ["1:9:kill", "1:20:kill"], 2)
    assert _shas(ranks) == _shas(plain), err
    assert "in-process round 2 complete" in err and "restarting all workers" not in err


@pytest.mark.parametrize("over_gloo", ["0", "1"], ids=["from-memory", "over-gloo"])
def test_a_rank_killed_while_the_commit_moves_is_replaced_and_the_next_round_completes(
    tmp_path: Path, over_gloo: str
) -> None:
    # Three ranks: rank 2 dies; its replacement takes the commit from ranks 0 and 1 (the
    # chunks split between them), and rank 0 dies as the bytes start to move. Round 2
    # hands the commit from rank 1 to both replacements, one of them half written.
    _, plain, _ = _run(tmp_path, "plain", "plain", 256, 16, [], 3)
    plan = ["2:6:kill", "0:0:movedie"]
    err, ranks, _ = _run(tmp_path, "api", "api", 256, 16, plan, 3, OVER_GLOO=over_gloo)
    assert _shas(ranks) == _shas(plain) and len(set(_shas(plain).values())) == 1, err
    (kept,) = ranks[1]
    assert kept["calls"] == [0, 7]
    assert "in-process round 2 complete" in err and "restarting all workers" not in err

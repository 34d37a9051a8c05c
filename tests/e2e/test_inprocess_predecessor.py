"""In-process recovery gives a replacement its predecessor's own state, end to end.

Every rank seeds torch's generator with its rank (dropout then masks other units on
every rank) and reads its own stream of data through a per-rank cursor named in
``State(own=...)``. A replacement that took the sending rank's generators and cursor
would train on other masks and other data, and the parameters would differ from the
run without the failure: with its predecessor's, they are the same bit for bit.
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
from torch.nn.parallel import DistributedDataParallel
import elastrun.inprocess as inprocess

out, steps, plan = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rank = int(os.environ["RANK"])
calls = []

class Cursor:
    # A rank's position in its own data: it moves by another stride on every rank.
    def __init__(self, pos):
        self.pos = pos
    def state_dict(self):
        return {"pos": self.pos}
    def load_state_dict(self, sd):
        self.pos = sd["pos"]

def once(name):
    try:
        os.close(os.open(os.path.join(out, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True

torch.manual_seed(1000 + rank)
model = torch.nn.Sequential(
    torch.nn.Linear(8, 32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 1)
)
torch.manual_seed(0)  # the same initial parameters everywhere (DDP broadcasts them anyway)
for p in model.parameters():
    torch.nn.init.normal_(p, std=0.1)
torch.manual_seed(1000 + rank)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
state = inprocess.State(
    model=model, optimizer=opt, step=0, cursor=Cursor(rank * 100000), own=("cursor",)
)

@inprocess.run
def train(state):
    calls.append(state.step)
    dist.init_process_group("gloo")
    # (find_unused_parameters: its buckets keep the parameters' order, so a wrapper
    # built anew at a recovery sums every gradient in the same order as the first)
    ddp = DistributedDataParallel(state.model, find_unused_parameters=True)
    while state.step < steps:
        # Killed before the step's all-reduce: the survivors roll back to the commit
        # this rank made last, which its replacement then finds on the node.
        if f"{rank}:{state.step}" in plan and once(f"killed_{rank}_{state.step}"):
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(state.cursor.pos))
        state.cursor.pos += 1 + rank
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True)).backward()
        opt.step()
        state.step += 1
        state.commit()
    dist.barrier()
    dist.destroy_process_group()

train(state)
h = hashlib.sha256()
for p in model.parameters():
    h.update(p.detach().numpy().tobytes())
with open(os.path.join(out, f"rank_{rank}_{os.getpid()}.json"), "w") as fh:
    json.dump({"rank": rank, "calls": calls, "sha": h.hexdigest(),
               "cursor": state.cursor.pos, "rng": torch.rand(1).item()}, fh)
"""

STEPS = 24


def _run(tmp_path: Path, name: str, plan: list[str]) -> tuple[int, str, dict[int, dict[str, Any]]]:
    out = tmp_path / name
    out.mkdir()
    script = write_script(tmp_path / "own.py", SCRIPT)
    proc = start(
        ["--standalone", "--nproc-per-node", "3", "--max-restarts", "3",
         str(script), str(out), str(STEPS), *plan],
        cwd=tmp_path, env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    res = finish(proc, 120)
    results = [json.loads(p.read_text()) for p in out.glob("rank_*.json")]
    return res.returncode, res.stderr, {r["rank"]: r for r in results}


def test_a_replacement_takes_its_predecessors_generators_and_own_items(tmp_path: Path) -> None:
    code, err, clean = _run(tmp_path, "clean", [])
    assert code == 0, err
    assert sorted(clean) == [0, 1, 2]
    code, err, ranks = _run(tmp_path, "killed", ["1:9", "2:17"])
    assert code == 0, err
    assert "replacing it in place" in err and "restarting all workers" not in err, err
    assert ranks[1]["calls"][0] == 9 and ranks[2]["calls"][0] == 17, (ranks, err)
    assert "no own state of this rank" not in err, err
    for r in (0, 1, 2):
        # The same data position and the same generator's next number as without the
        # failures, so the same dropout masks and batches, and the same parameters.
        assert ranks[r]["cursor"] == clean[r]["cursor"], (r, ranks[r], clean[r])
        assert ranks[r]["rng"] == clean[r]["rng"], (r, ranks[r], clean[r])
    assert {r["sha"] for r in ranks.values()} == {clean[0]["sha"]}

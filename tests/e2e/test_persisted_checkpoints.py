"""Memory checkpoints persisted to disk end to end: elastrun jobs on two ranks (gloo, CPU)
write steps to a directory in the background, and a separate plain-torch process (no
elastrun) loads them with ``torch.distributed.checkpoint.load`` into another world size.

FSDP2 is ``examples/memory_checkpoint.py`` (``--persist-dir``, ``--persist-every``): its
ranks write a SHA-256 of the full parameters at the end, which the persisted last step
must reproduce. A replicated (DDP) state is a script of its own here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _helpers import REPO, free_port, run, write_script

pytestmark = [pytest.mark.slow, pytest.mark.torch]
pytest.importorskip("torch")

EXAMPLE = REPO / "examples" / "memory_checkpoint.py"
ENV = {"OMP_NUM_THREADS": "1"}

#: Loads persisted steps of the example's model with plain torch and prints the SHA-256
#: of the full parameters of each, as the example computes it, one a line: each
#: ``WORLD:PATH`` into a world of ``WORLD`` ranks (FSDP2 over gloo when more than one).
#: One process for all (each a Python with torch to start, 2-3 CPU-s on 2 busy cores):
#: the worlds of several ranks fork from it first, before it loads anything itself
#: (a forked child inherits no thread and no state of a load).
LOADER = """\
import hashlib, os, sys, tempfile, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist, torch.multiprocessing as mp
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

width, port = int(sys.argv[1]), sys.argv[2]
loads = [(int(world), path) for world, path in (a.split(":", 1) for a in sys.argv[3:])]


def build():
    torch.manual_seed(123)  # not the example's: every value must come from the checkpoint
    return torch.nn.Sequential(
        torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
        torch.nn.ReLU(), torch.nn.Linear(width, 1))


def digest(model):
    h = hashlib.sha256()
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        h.update(full.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def one_rank(rank, path, world, result):
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    from torch.distributed.fsdp import fully_shard
    model = build()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    state = {"training": {"model": get_model_state_dict(model)}}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["training"]["model"])
    text = digest(model)
    if rank == 0:
        with open(result, "w") as fh:
            fh.write(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    found = {}
    sharded = [(i, w, p) for i, (w, p) in enumerate(loads) if w > 1]
    assert len(sharded) <= 1, "one world of several ranks a call (one port)"
    for i, world, path in sharded:
        with tempfile.TemporaryDirectory() as tmp:
            result = os.path.join(tmp, "digest")
            mp.start_processes(one_rank, args=(path, world, result), nprocs=world,
                               start_method="fork")
            with open(result) as fh:
                found[i] = fh.read()
    for i, (world, path) in enumerate(loads):
        if world == 1:
            model = build()
            state = {"training": {"model": model.state_dict()}}
            dcp.load(state, checkpoint_id=path)
            model.load_state_dict(state["training"]["model"])
            found[i] = digest(model)
    for i in range(len(loads)):
        print(found[i])
    assert "elastrun" not in sys.modules
"""


def _load_plain(tmp_path: Path, width: int, *loads: tuple[Path, int]) -> list[str]:
    """The digests plain torch loads, each of a step directory into a world of that many
    ranks (at most one world of several ranks)."""
    script = write_script(tmp_path / "plain_loader.py", LOADER)
    res = subprocess.run(
        [sys.executable, "-I", str(script), str(width), str(free_port()),
         *(f"{world}:{step_dir}" for step_dir, world in loads)],
        check=False, capture_output=True, text=True, timeout=150, cwd=tmp_path,
        env={**os.environ, **ENV},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    digests = res.stdout.split()[-len(loads) :]
    assert len(digests) == len(loads), res.stdout
    return digests


def _results(out: Path) -> dict[int, dict[str, object]]:
    return {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in out.glob("rank_*_0.json")}


@pytest.mark.timeout(300)  # a launch and a plain loader (three loads, one in three processes)
def test_an_fsdp2_job_persists_every_n_steps_and_plain_torch_loads_them_into_other_worlds(
    tmp_path: Path,
) -> None:
    # 10 steps, a persist after every 3 complete ones (steps 2, 5 and 8; one that falls
    # due while the last is still being written waits for a later save) and the last
    # step at the end (9); two kept.
    res = run(
        ["--standalone", "--nproc-per-node", "2", str(EXAMPLE), "--steps", "10",
         "--width", "24", "--persist-dir", "persisted", "--persist-every", "3",
         "--result-dir", "result"],
        cwd=tmp_path, env=ENV, timeout=110,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    persisted = tmp_path / "persisted"
    names = os.listdir(persisted)
    assert len(names) == 2 and "step-9" in names, (names, res.stderr)
    (older,) = set(names) - {"step-9"}
    assert 2 <= int(older.removeprefix("step-")) < 9
    assert sorted(os.listdir(persisted / "step-9")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    ranks = _results(tmp_path / "result")
    assert {r["persisted"] for r in ranks.values()} == {9}
    (trained,) = {r["sha256"] for r in ranks.values()}
    # Saved by two ranks of FSDP2: loaded by one (whole tensors) and by three (uneven shards).
    one, three, old = _load_plain(
        tmp_path, 24, (persisted / "step-9", 1), (persisted / "step-9", 3), (persisted / older, 1)
    )
    assert one == trained
    assert three == trained
    assert old != trained


REPLICATED = """\
import hashlib, json, sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from elastrun.checkpoint import MemoryCheckpoint

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with MemoryCheckpoint(persist_dir=sys.argv[1]) as ckpt:
    for step in range(4):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step * 10 + rank))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        ckpt.save(step, {"model": model.module.state_dict(), "meta": {"step": step}})
    ckpt.persist()
if rank == 0:
    h = hashlib.sha256()
    for p in model.module.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    with open("trained.json", "w") as fh:
        json.dump({"sha256": h.hexdigest(), "persisted": ckpt.persisted}, fh)
dist.destroy_process_group()
"""

REPLICATED_LOADER = """\
import hashlib, json, sys, warnings
warnings.filterwarnings("ignore")
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader

model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8))
state = {"model": model.state_dict(), "meta": {"step": -1}}
dcp.load(state, checkpoint_id=sys.argv[1])
model.load_state_dict(state["model"])
h = hashlib.sha256()
for p in model.parameters():
    h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
metadata = FileSystemReader(sys.argv[1]).read_metadata()
files = sorted({info.relative_path for info in metadata.storage_data.values()})
chunks = {k: len(v.chunks) for k, v in metadata.state_dict_metadata.items() if hasattr(v, "chunks")}
assert "elastrun" not in sys.modules
print(json.dumps({"sha256": h.hexdigest(), "step": state["meta"]["step"], "files": files,
                  "chunks": chunks}))
"""


@pytest.mark.timeout(200)  # a launch and a plain load
def test_a_replicated_ddp_state_is_persisted_once_across_the_ranks_and_loads_plainly(
    tmp_path: Path,
) -> None:
    script = write_script(tmp_path / "replicated.py", REPLICATED)
    res = run(
        ["--standalone", "--nproc-per-node", "2", str(script), str(tmp_path / "persisted")],
        cwd=tmp_path, env=ENV, timeout=90,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    trained = json.loads((tmp_path / "trained.json").read_text())
    assert trained["persisted"] == 3
    loader = write_script(tmp_path / "replicated_loader.py", REPLICATED_LOADER)
    loaded = subprocess.run(
        [sys.executable, "-I", str(loader), str(tmp_path / "persisted" / "step-3")],
        check=False, capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert loaded.returncode == 0, loaded.stderr
    found = json.loads(loaded.stdout)
    assert found["sha256"] == trained["sha256"]
    assert found["step"] == 3
    # Each tensor once (one piece), the four spread over both ranks' files.
    assert set(found["chunks"].values()) == {1} and len(found["chunks"]) == 4
    assert found["files"] == ["__0_0.distcp", "__1_0.distcp"]


@pytest.mark.timeout(300)  # two launches and a plain load
def test_a_worker_killed_in_a_persist_leaves_no_step_under_its_final_name(
    tmp_path: Path,
) -> None:
    # Rank 0 (which renames) is killed in the first persist (step 2), after every rank's
    # files are written and before the rename; no restart.
    persisted = tmp_path / "persisted"
    res = run(
        ["--standalone", "--nproc-per-node", "2", "--max-restarts", "0", str(EXAMPLE),
         "--steps", "10", "--width", "16", "--persist-dir", str(persisted),
         "--persist-every", "3", "--fail-rank", "0", "--fail-mode", "kill-in-persist",
         "--result-dir", "first"],
        cwd=tmp_path, env=ENV, timeout=90,
    )  # fmt: skip
    assert res.returncode != 0
    assert "killed in the persist of step 2" in res.stdout, res.stdout + res.stderr
    names = os.listdir(persisted)
    assert [n for n in names if not n.startswith(".")] == [], names
    (leftover,) = names
    assert leftover.startswith(".step-2.tmp-")
    assert ".metadata" in os.listdir(persisted / leftover)  # it was written, not renamed
    # The next run's first persist removes the leftover; what it persists is complete.
    res = run(
        ["--standalone", "--nproc-per-node", "2", str(EXAMPLE), "--steps", "5",
         "--width", "16", "--persist-dir", str(persisted), "--persist-every", "2",
         "--result-dir", "second"],
        cwd=tmp_path, env=ENV, timeout=90,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    names = os.listdir(persisted)  # (step 1 or 3 before the last, as the disk allowed)
    assert len(names) == 2 and "step-4" in names and not any(n.startswith(".") for n in names)
    (trained,) = {r["sha256"] for r in _results(tmp_path / "second").values()}
    assert _load_plain(tmp_path, 16, (persisted / "step-4", 1)) == [trained]


FULL_DISK = """\
import os, resource, signal, sys, warnings
warnings.filterwarnings("ignore")
import torch
from elastrun.checkpoint import MemoryCheckpoint

node, out, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
# Many small tensors: DCP's file (a torch.save of each) outgrows the memory step's.
state = {f"t{i}": torch.full((16,), float(i)) for i in range(200)}
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
with MemoryCheckpoint(node, persist_dir=out, persist_every=1) as ckpt:
    for step in range(3):
        for t in state.values():
            t.add_(1)
        assert ckpt.save(step, state)
        assert ckpt.wait() == step
    assert ckpt.persisted is None, ckpt.persisted
print("trained on", flush=True)
"""


def test_a_persist_that_runs_out_of_disk_is_logged_removed_and_training_goes_on(
    tmp_path: Path,
) -> None:
    node = tmp_path / "node"
    node.mkdir()
    script = write_script(tmp_path / "full_disk.py", FULL_DISK)
    res = subprocess.run(
        [sys.executable, str(script), str(node), str(tmp_path / "out"), str(64 * 1024)],
        check=False, capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={**os.environ, **ENV},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "trained on" in res.stdout
    assert "persisting step 0 failed" in res.stderr and "File too large" in res.stderr, res.stderr
    assert os.listdir(tmp_path / "out") == []  # every half-written one removed

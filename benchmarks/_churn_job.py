"""The churn benchmark's training job (run by a launcher, never imported).

    _churn_job.py OUT MODE SLEEP CHECKPOINT_EVERY

A 4-rank gloo DDP job: a small MLP, SGD with momentum, each step's data drawn from a
generator seeded by (step, rank), so that a step done again computes the same gradients.
A step is ``SLEEP`` seconds (the compute a real model would do, before the gradients'
all-reduce: a peer's death is then seen in the all-reduce, before the optimizer steps)
then a forward, backward and optimizer step. Modes:

* ``inplace``: ``elastrun.inprocess`` with a commit after every step, and the
  checkpoint as below for a group restart (when every worker holding the state failed);
* ``group``: a plain script; rank 0 saves a checkpoint (``torch.save``, written aside and
  renamed) every ``CHECKPOINT_EVERY`` steps, and every process starts from it;
* ``reference``: no failures; DDP is built anew at each step listed in
  ``OUT/rebuild.txt``, as the recovered run built it anew at each of its restarts;
* ``sharded``: the model sharded with FSDP2 (``fully_shard`` on a 1-D mesh) instead of
  DDP, ``elastrun.inprocess`` with a memory checkpoint (``elastrun.checkpoint``) saved
  after every step: a survivor keeps its sharded model (``inprocess.rebind``), and every
  rank, a replacement too, loads the newest step in the node's memory;
* ``sharded-reference``: the same without failures (FSDP2's reductions do not depend on
  when its groups were made, so no rebuild is mirrored);
* ``hsdp``: HSDP (a 2 x 2 mesh) with the model and optimizer in the ``State``
  (``state.restore(ckpt)`` at every call, a commit after every step): a replacement
  takes its shard from the other replica group; where both replicas of a shard were
  lost, every rank loads the memory checkpoint the State is saved into every
  ``CHECKPOINT_EVERY`` steps, as a group restart's processes do;
* ``hsdp-reference``: the same without failures.

The job runs until the step written in ``OUT/stop`` (the benchmark writes it when its
killer is done). Every process writes, for the benchmark:

* ``pid_RANK``: its pid, first thing (the killer's only source of victims);
* ``steps_RANK.log``: ``C pid step t`` when a call of the training function (or a process)
  starts at ``step``; ``S pid step t`` when a step starts (its sleep), ``A pid step t`` when
  its forward pass starts (then the backward with the all-reduce, the optimizer step);
  ``E pid step t0 t1`` when it ends (before the commit or the checkpoint);
* ``final_RANK.json`` at the end: the parameters' SHA-256 and the last step (rank 0 also
  ``final.pt``, the parameters).
"""

from __future__ import annotations

import os
import sys
import time

OUT, MODE = sys.argv[1], sys.argv[2]
SLEEP, CHECKPOINT_EVERY = float(sys.argv[3]), int(sys.argv[4])
RANK, PID = int(os.environ["RANK"]), os.getpid()


def _write_atomically(path: str, text: str) -> None:
    with open(f"{path}.{PID}", "w") as fh:
        fh.write(text)
    os.replace(f"{path}.{PID}", path)


_write_atomically(os.path.join(OUT, f"pid_{RANK}"), str(PID))

import gc  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any, cast  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

LOG = os.open(os.path.join(OUT, f"steps_{RANK}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
STOP = os.path.join(OUT, "stop")
CKPT = os.path.join(OUT, "ckpt.pt")
_last: list[int] = []


def event(*fields: object) -> None:
    os.write(LOG, (" ".join(str(f) for f in fields) + "\n").encode())


def last_step() -> int:
    """The step to stop at, once the benchmark wrote it (a very large one until then)."""
    if not _last and os.path.exists(STOP):
        with open(STOP) as fh:
            _last.append(int(fh.read()))
    return _last[0] if _last else 1 << 40


torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(32, 128),
    torch.nn.ReLU(),
    torch.nn.Linear(128, 128),
    torch.nn.ReLU(),
    torch.nn.Linear(128, 1),
)
opt = torch.optim.SGD(model.parameters(), lr=0.002, momentum=0.9)


def one_step(net: torch.nn.Module, step: int) -> None:
    t0 = time.time()
    event("S", PID, step, f"{t0:.6f}")
    time.sleep(SLEEP)
    event("A", PID, step, f"{time.time():.6f}")
    world = int(os.environ["WORLD_SIZE"])
    g = torch.Generator().manual_seed(step * world + RANK)
    x = torch.randn(32, 32, generator=g)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(net(x), x.sum(1, keepdim=True))
    loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    opt.step()
    event("E", PID, step, f"{t0:.6f}", f"{time.time():.6f}")


def finish(step: int, params: list[torch.Tensor] | None = None) -> None:
    params = [p.detach() for p in model.parameters()] if params is None else params
    h = hashlib.sha256()
    for p in params:
        h.update(p.numpy().tobytes())
    if RANK == 0:
        torch.save([p.clone() for p in params], os.path.join(OUT, "final.pt"))
    _write_atomically(
        os.path.join(OUT, f"final_{RANK}.json"),
        json.dumps({"rank": RANK, "pid": PID, "step": step, "sha": h.hexdigest()}),
    )


def end_world() -> None:
    """The last barrier, then the process group destroyed after a pause: freeing a gloo
    group joins its threads holding the GIL, and one still finishing the barrier needs
    the GIL (torch 2.13; see elastrun.inprocess.worker.parking). Freed at once, a
    reference job hung so once, a rank's main thread waiting in that join."""
    dist.barrier()
    time.sleep(0.2)
    dist.destroy_process_group()


def load_checkpoint() -> int:
    """The step of the checkpoint loaded into the model and optimizer (0: none yet)."""
    if not os.path.exists(CKPT):
        return 0
    saved = torch.load(CKPT, weights_only=True)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    step: int = saved["step"]
    return step


def save_checkpoint(step: int) -> None:
    """Rank 0 saves a checkpoint every ``CHECKPOINT_EVERY`` steps (written aside, renamed)."""
    if RANK == 0 and step % CHECKPOINT_EVERY == 0:
        saved = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}
        torch.save(saved, CKPT + ".tmp")
        os.replace(CKPT + ".tmp", CKPT)


def inplace() -> None:
    import elastrun.inprocess as ip

    # A process started into an in-process round takes the survivors' commit; one that
    # starts the job, or a group restart (every worker that held the state had failed),
    # resumes from the checkpoint, as the plain script does.
    fresh = os.environ.get("ELASTRUN_INPROCESS_ROUND", "0") in ("", "0")
    state = ip.State(model=model, optimizer=opt, step=load_checkpoint() if fresh else 0)

    @ip.run
    def train(state: ip.State) -> None:
        event("C", PID, state.step, f"{time.time():.6f}")
        dist.init_process_group("gloo")
        ddp = DistributedDataParallel(model)
        while state.step < last_step():
            one_step(ddp, state.step)
            state.step += 1
            state.commit()
            save_checkpoint(state.step)
        end_world()

    train(state)
    finish(state.step)


def group() -> None:
    step = load_checkpoint()
    event("C", PID, step, f"{time.time():.6f}")
    dist.init_process_group("gloo")
    ddp = DistributedDataParallel(model)
    while step < last_step():
        one_step(ddp, step)
        step += 1
        save_checkpoint(step)
    end_world()
    finish(step)


def reference() -> None:
    with open(os.path.join(OUT, "rebuild.txt")) as fh:
        rebuild = {int(s) for s in fh.read().split()}
    dist.init_process_group("gloo")
    ddp, step = DistributedDataParallel(model), 0
    while step < last_step():
        if step in rebuild and step > 0:
            # As after a restart: a new wrapper (its first step buckets the gradients in
            # the order of the parameters, later ones in the order they became ready).
            # The old one's reducer unhooks from the parameters when it is freed.
            del ddp
            gc.collect()
            ddp = DistributedDataParallel(model)
        one_step(ddp, step)
        step += 1
    end_world()
    finish(step)


def sharded(failures: bool = True) -> None:
    """FSDP2 in place from memory checkpoints (``failures``), or its reference."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.stateful import Stateful
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import elastrun.inprocess as ip
    from elastrun.checkpoint import MemoryCheckpoint

    class Training(Stateful):
        def state_dict(self) -> dict[str, Any]:
            sd_model, sd_optim = get_state_dict(model, opt)
            return {"model": sd_model, "optim": sd_optim}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    ckpt, app = MemoryCheckpoint(), {"training": Training()}
    sharded_yet: list[bool] = []

    def train(state: ip.State) -> tuple[int, list[torch.Tensor]]:
        global opt
        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
        if not sharded_yet:  # this process's first call
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.SGD(model.parameters(), lr=0.002, momentum=0.9)
            sharded_yet.append(True)
        else:  # a survivor's model, after an in-process recovery
            ip.rebind(model)
        last = ckpt.load_latest(app) if failures else None
        step = 0 if last is None else last + 1
        event("C", PID, step, f"{time.time():.6f}")
        while step < last_step():
            one_step(model, step)
            if failures:
                ckpt.save(step, app)
            step += 1
            state.step = step
            state.commit()  # no tensors: tells the agent how far the training got
        ckpt.close()
        # fully_shard made every parameter a DTensor (the type only says Parameter).
        full = [cast(DTensor, p).full_tensor().detach() for p in model.parameters()]
        end_world()
        return step, full

    state = ip.State(step=0)  # the model's state comes from the memory checkpoint
    step, full = (ip.run(train) if failures else train)(state)
    finish(step, full)


def hsdp(failures: bool = True) -> None:
    """HSDP from a replica, else from a memory checkpoint (``failures``), or its
    reference."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor

    import elastrun.inprocess as ip
    from elastrun.checkpoint import MemoryCheckpoint

    ckpt = MemoryCheckpoint() if failures else None

    def train(state: ip.State) -> tuple[int, list[torch.Tensor]]:
        global opt
        dist.init_process_group("gloo")
        world = int(os.environ["WORLD_SIZE"])
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        if not isinstance(model, FSDPModule):  # this process's first call
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.SGD(model.parameters(), lr=0.002, momentum=0.9)
            state.optimizer = opt
        state.restore(ckpt)
        event("C", PID, state.step, f"{time.time():.6f}")
        while state.step < last_step():
            one_step(model, state.step)
            state.step += 1
            state.commit()
            if ckpt is not None and state.step % CHECKPOINT_EVERY == 0:
                ckpt.save(state.step, {"state": state})
        if ckpt is not None:
            ckpt.close()
        # fully_shard made every parameter a DTensor (the type only says Parameter).
        full = [cast(DTensor, p).full_tensor().detach() for p in model.parameters()]
        end_world()
        return int(state.step), full

    state = ip.State(model=model, optimizer=None, step=0)
    step, full = (ip.run(train) if failures else train)(state)
    finish(step, full)


MODES: dict[str, Callable[[], None]] = {
    "inplace": inplace,
    "group": group,
    "reference": reference,
    "sharded": sharded,
    "sharded-reference": lambda: sharded(failures=False),
    "hsdp": hsdp,
    "hsdp-reference": lambda: hsdp(failures=False),
}
MODES[MODE]()

"""FSDP2 training that resumes from memory after a restart: ``elastrun.checkpoint``.

    elastrun --standalone --nproc-per-node 4 --max-restarts 3 examples/memory_checkpoint.py \\
        --steps 40 --fail-rank 2 --fail-step 25

The model is sharded with ``fully_shard`` (FSDP2, gloo on the CPU) and trained with
Adam. After every step, ``MemoryCheckpoint.save`` copies the rank's shards and its
optimizer state into the node's shared memory (the rest of the save runs in the
background). When global rank ``--fail-rank`` reaches ``--fail-step`` on the first
attempt, it fails (``--fail-mode``):

- ``kill``: SIGKILL, before the step's training (its previous step's save may be
  unfinished);
- ``kill-in-save``: SIGKILL inside that step's save, after its files and before its
  marker: the step is half written;
- ``exit``: exit 1 once the previous step is saved on every rank (a restart that loses
  nothing);
- ``kill-in-persist``: SIGKILL in the first persist to ``--persist-dir`` (its files
  written, before it is renamed into place): no step appears there half written.

elastrun restarts the group; each restarted worker loads the newest step that every
rank holds complete in its node's memory (``load_latest``), and goes on from the step
after it. Nothing is read from disk.

With ``--persist-dir DIR --persist-every N``, the newest step complete on every rank is
also written to ``DIR/step-<S>/`` after every N complete steps, and the last step at
the end, in DCP's own format (in the background): plain
``torch.distributed.checkpoint.load`` reads it, into any world size.

The data of a step is a pure function of the step and the rank, so the run ends with
the parameters of any run that resumed at the same step. Every rank writes
``<result-dir>/rank_<R>_<restart>.json``: the step it resumed from (null: from
scratch), the steps it trained, and a SHA-256 of the full parameters (the same on every
rank).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402  (after the warning filter)
import torch.distributed as dist  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.checkpoint.stateful import Stateful  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from elastrun.checkpoint import MemoryCheckpoint  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--width", type=int, default=64, help="hidden width of the model")
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-step", type=int, default=-1)
    p.add_argument(
        "--fail-mode", choices=["kill", "kill-in-save", "exit", "kill-in-persist"], default="kill"
    )
    p.add_argument("--on-overlap", choices=["wait", "skip"], default="wait")
    p.add_argument("--step-time", type=float, default=0.0, help="pad each step to this")
    p.add_argument("--result-dir", type=Path, default=Path("memory-checkpoint-result"))
    p.add_argument("--persist-dir", type=Path, default=None, help="persist steps to disk here")
    p.add_argument("--persist-every", type=int, default=None, help="every N complete steps")
    return p.parse_args()


class Training(Stateful):
    """The model and the optimizer as one DCP ``Stateful``: their sharded state dicts
    (DTensors) out, and back in."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )


def build(width: int) -> torch.nn.Module:
    torch.manual_seed(0)  # every rank, every restart: the same initial parameters
    model = torch.nn.Sequential(
        torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
        torch.nn.ReLU(), torch.nn.Linear(width, 1),
    )  # fmt: skip
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(32, 16, generator=g)
    return x, x[:, :4].sum(dim=1, keepdim=True)


def checksum(model: torch.nn.Module) -> str:
    """SHA-256 of the full parameters (a collective: every rank gathers every shard)."""
    h = hashlib.sha256()
    for p in model.parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        h.update(full.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    args = parse()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    failing = rank == args.fail_rank and restart == 0

    def kill_in_save(step: int) -> None:
        if failing and args.fail_mode == "kill-in-save" and step == args.fail_step:
            print(f"rank {rank}: killed in the save of step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def kill_in_persist(step: int) -> None:
        if failing and args.fail_mode == "kill-in-persist":
            print(f"rank {rank}: killed in the persist of step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    model = build(args.width)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = {"training": Training(model, optimizer)}
    ckpt = MemoryCheckpoint(
        on_overlap=args.on_overlap,
        before_marker=kill_in_save,
        persist_dir=args.persist_dir,
        persist_every=args.persist_every,
        before_persisted=kill_in_persist,
    )
    resumed = ckpt.load_latest(state)
    start = 0 if resumed is None else resumed + 1
    if rank == 0:
        how = "from scratch" if resumed is None else f"from step {resumed} in memory"
        print(f"[restart {restart}] starting at step {start}, {how}", flush=True)
    trained = []
    for step in range(start, args.steps):
        if failing and step == args.fail_step and args.fail_mode in ("kill", "exit"):
            print(f"rank {rank}: fails ({args.fail_mode}) at step {step}", flush=True)
            if args.fail_mode == "exit":
                ckpt.wait()  # the previous step is saved on every rank
                sys.exit(1)
            os.kill(os.getpid(), signal.SIGKILL)
        began = time.monotonic()
        x, y = batch(step, rank)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        ckpt.save(step, state)
        trained.append(step)
        if rank == 0 and step % 10 == 0:
            print(f"[restart {restart}] step {step} loss {loss.item():.4f}", flush=True)
        time.sleep(max(0.0, args.step_time - (time.monotonic() - began)))
    if args.persist_dir is not None:
        ckpt.persist()  # the last step, if not persisted already
    ckpt.close()
    digest = checksum(model)
    args.result_dir.mkdir(parents=True, exist_ok=True)
    result = {"rank": rank, "restart": restart, "resumed_from": resumed, "trained": trained,
              "sha256": digest, "persisted": ckpt.persisted}  # fmt: skip
    (args.result_dir / f"rank_{rank}_{restart}.json").write_text(json.dumps(result))
    if rank == 0:
        print(f"[restart {restart}] done: parameters {digest[:16]}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The job of tests/e2e/test_memory_checkpoint_buddies.py: FSDP2 (gloo, CPU) training
with a memory checkpoint saved every step, as in examples/memory_checkpoint.py, plus
what the node-loss tests need:

- every rank records the wall-clock time each step finished (``times``), so a test can
  measure how long after a node was killed each rank trained its next step;
- ``--stop-after S``: once step S is saved on every rank, save the state with DCP's own
  collective file-system writer to ``--dcp-dir`` and end (the first half of a reference
  that resumes from step S in another world size);
- ``--dcp-dir`` without ``--stop-after``: start from the step saved there (DCP's
  resharding loads it into this world's size), not from memory: the second half;
- ``--fail-rank R --fail-step S``: on the first attempt, rank R exits 1 before step S,
  once step S-1 is saved on every rank (a restart from step S-1 that loses nothing).

The data of a step is a pure function of the step, the rank and the world size, so a run
ends with the parameters of any run that resumed at the same step into the same world.
Every rank writes ``<result-dir>/rank_<R>_<restart>.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402  (after the warning filter)
import torch.distributed as dist  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load  # noqa: E402
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save  # noqa: E402
from torch.distributed.checkpoint.stateful import Stateful  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from elastrun.checkpoint import MemoryCheckpoint  # noqa: E402


class Training(Stateful):
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
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
        torch.nn.ReLU(), torch.nn.Linear(width, 1),
    )  # fmt: skip
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank * 10 + world)
    x = torch.randn(32, 16, generator=g)
    return x, x[:, :4].sum(dim=1, keepdim=True)


def checksum(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        h.update(full.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--stop-after", type=int, default=-1)
    p.add_argument("--dcp-dir", type=Path, default=None)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-step", type=int, default=-1)
    p.add_argument("--result-dir", type=Path, required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model = build(args.width)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = {"training": Training(model, optimizer)}
    ckpt = MemoryCheckpoint()
    if args.dcp_dir is not None and args.stop_after < 0:
        dcp_load(state, checkpoint_id=str(args.dcp_dir))
        resumed: int | None = int((args.dcp_dir / "step.txt").read_text())
        ckpt.load_latest({})  # (sets the checkpoint up; nothing is in this node's memory)
    else:
        resumed = ckpt.load_latest(state)
    loaded_at = time.time()
    times: dict[int, float] = {}
    trained = []
    for step in range(0 if resumed is None else resumed + 1, args.steps):
        if rank == args.fail_rank and restart == 0 and step == args.fail_step:
            ckpt.wait()
            sys.exit(1)
        began = time.monotonic()
        x, y = batch(step, rank, world)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]  # (torch leaves it unannotated)
        optimizer.step()
        ckpt.save(step, state)
        trained.append(step)
        times[step] = time.time()
        if step == args.stop_after:
            ckpt.wait()
            break
        time.sleep(max(0.0, args.step_time - (time.monotonic() - began)))
    ckpt.close()
    if args.stop_after >= 0 and args.dcp_dir is not None:
        dcp_save(state, checkpoint_id=str(args.dcp_dir))
        if rank == 0:
            (args.dcp_dir / "step.txt").write_text(str(args.stop_after))
    digest = checksum(model)
    args.result_dir.mkdir(parents=True, exist_ok=True)
    result = {"rank": rank, "world": world, "restart": restart, "resumed_from": resumed,
              "trained": trained, "times": times, "loaded_at": loaded_at,
              "sha256": digest}  # fmt: skip
    (args.result_dir / f"rank_{rank}_{restart}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

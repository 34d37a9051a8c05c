"""DDP training that survives a worker's failure in place: ``elastrun.inprocess``.

    elastrun --standalone --nproc-per-node 4 --max-restarts 3 examples/inprocess_demo.py \\
        --steps 60 --fail-rank 2 --fail-step 35

When global rank ``--fail-rank`` reaches ``--fail-step`` (after that step's optimizer
step, before its commit), it dies by SIGKILL (``--fail-mode kill``, the default) or
raises (``--fail-mode raise``) -- once per job. elastrun replaces only that worker; the
others keep their processes, roll back to their last commit (made after every step),
hand it to the replacement and go on. Nothing is read from disk.

The data of a step is a pure function of the step and the rank, so the run ends with
exactly the parameters of a run without the failure. Every rank writes
``<result-dir>/rank_<R>.json``: its pid, how often the training function ran, the last
step and a SHA-256 of its parameters (bit-identical on every rank, and equal to a
fault-free run's).

Under torchrun or plain python the decorator simply calls the function once.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402  (after the warning filter)
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from elastrun import inprocess  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-step", type=int, default=-1)
    p.add_argument("--fail-mode", choices=["kill", "raise"], default="kill")
    p.add_argument("--fail-times", type=int, default=1, help="fail this many times in a row")
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--result-dir", type=Path, default=Path("inprocess-result"))
    return p.parse_args()


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True) * 0.5


def checksum(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def should_fail(args: argparse.Namespace, step: int) -> bool:
    """Fail at the chosen step, ``--fail-times`` times per job (counted in files)."""
    if int(os.environ.get("RANK", "0")) != args.fail_rank or step != args.fail_step:
        return False
    done = len(list(args.result_dir.glob("failed_*")))
    if done >= args.fail_times:
        return False
    (args.result_dir / f"failed_{done}").touch()
    return True


def main() -> None:
    args = parse()
    args.result_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state = inprocess.State(model=model, optimizer=optimizer, step=0, calls=0)

    @inprocess.run
    def train(state: inprocess.State) -> str:
        state.calls += 1
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        # DDP regroups its gradient buckets after its first step unless it looks for
        # unused parameters; a DDP made anew after a recovery would then sum a few
        # gradients in another order and end a few bits away from a run without failure.
        ddp = DistributedDataParallel(state.model, find_unused_parameters=True)
        while state.step < args.steps:
            x, y = batch(state.step, rank)
            state.optimizer.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            state.optimizer.step()
            if should_fail(args, state.step):
                if args.fail_mode == "raise":
                    raise RuntimeError(f"rank {rank} fails on purpose at step {state.step}")
                os.kill(os.getpid(), signal.SIGKILL)
            state.step += 1
            state.commit()
            if args.step_time:
                time.sleep(args.step_time)
        dist.barrier()
        dist.destroy_process_group()
        return checksum(state.model)

    digest = train(state)
    rank = int(os.environ.get("RANK", "0"))
    out = {"rank": rank, "pid": os.getpid(), "calls": state.calls, "step": state.step,
           "checksum": digest, "world_size": int(os.environ.get("WORLD_SIZE", "1"))}  # fmt: skip
    (args.result_dir / f"rank_{rank}.json").write_text(json.dumps(out))
    print(f"rank {rank}: step {state.step}, parameters {digest[:16]}", flush=True)


if __name__ == "__main__":
    main()

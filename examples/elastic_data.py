"""Elastic data loading: every sample once per epoch, whatever the world size does.

A ``DistributedSampler`` splits an epoch by rank when it starts. If the world shrinks
from 4 to 3 ranks mid-epoch (a node is lost) or grows, its split is no longer valid,
and resuming "at step k" re-reads some samples and skips others. This example tracks
progress in the unit that survives a change of world size: the number of samples of the
epoch consumed so far, by the whole job (the *global offset*). The checkpoint stores it;
on resume, the rest of the epoch, from that offset on, is split among the ranks that
exist now. Training sees every sample of every epoch exactly once, and the example checks
that it did: each step the ranks add up which samples they used, and at the end of each
epoch every sample's count must be exactly 1.

It is a plain PyTorch script (gloo, CPU, a linear model), and runs unchanged under
``torchrun`` and ``elastrun``::

    # 3 workers are stopped after 4 steps (a preemption), then 2 workers finish the job
    elastrun --nproc-per-node 3 examples/elastic_data.py --checkpoint-dir ck --stop-after-steps 4
    elastrun --nproc-per-node 2 examples/elastic_data.py --checkpoint-dir ck

How a step works: the epoch's order is one permutation of all samples, fixed by the epoch
number (not by the world size). A step takes the next ``world_size * batch_size`` samples
from the global offset; rank r takes every world_size-th of them starting at r. The last
step of an epoch may be short, so ranks can hold different numbers of samples (even
none): the loss is summed and the gradients are all-reduced and divided by the number of
samples in the whole step, which makes every update the mean over the step's samples, as
if one process had computed it. (DDP's averaging would weigh uneven ranks wrongly.)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

CHECKPOINT_NAME = "elastic_data.pt"
DATA_SEED = 99
MODEL_SEED = 5
ORDER_SEED = 1234
FEATURES = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=600, help="samples in the data set")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--checkpoint-dir", default="./elastic_data_ckpt")
    p.add_argument("--checkpoint-every", type=int, default=2, help="steps between checkpoints")
    p.add_argument(
        "--stop-after-steps",
        type=int,
        default=None,
        help="checkpoint and exit 0 after this many steps of this run (a preemption)",
    )
    p.add_argument(
        "--crash-at-step",
        type=int,
        default=None,
        help="rank --crash-rank SIGKILLs itself at this global step, first attempt only",
    )
    p.add_argument("--crash-rank", type=int, default=0)
    p.add_argument("--result-file", default=None, help="rank 0 writes a JSON summary here")
    return p.parse_args(argv)


class ElasticSampler:
    """The sample indices of one rank for one step, from the epoch's global offset.

    Pure function of (epoch, offset, rank, world size): nothing about earlier steps or
    earlier world sizes is needed, which is what makes resuming at another size exact.
    """

    def __init__(self, num_samples: int, batch_size: int, seed: int = ORDER_SEED) -> None:
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self._orders: dict[int, list[int]] = {}

    def order(self, epoch: int) -> list[int]:
        """The epoch's permutation of all samples; the same for every rank and size."""
        if epoch not in self._orders:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._orders = {epoch: torch.randperm(self.num_samples, generator=g).tolist()}
        return self._orders[epoch]

    def step_size(self, offset: int, world_size: int) -> int:
        """How many samples the whole job consumes in the step starting at ``offset``."""
        return min(world_size * self.batch_size, self.num_samples - offset)

    def indices(self, epoch: int, offset: int, rank: int, world_size: int) -> list[int]:
        """This rank's samples for the step that starts at the global ``offset``."""
        end = offset + self.step_size(offset, world_size)
        return self.order(epoch)[offset + rank : end : world_size]

    def __repr__(self) -> str:
        return f"ElasticSampler(num_samples={self.num_samples}, batch_size={self.batch_size})"


def init_distributed() -> None:
    if "RANK" not in os.environ:  # plain `python elastic_data.py`: a group of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))


def make_data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(n, FEATURES, generator=g)
    y = x @ torch.randn(FEATURES, 1, generator=g) + 0.01 * torch.randn(n, 1, generator=g)
    return x, y


def save(path: Path, state: dict[str, object]) -> None:
    """Atomically: a crash mid-write leaves the previous checkpoint in place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    tag = f"[restart {restart}] rank {rank}"
    x, y = make_data(args.samples)
    sampler = ElasticSampler(args.samples, args.batch_size)
    torch.manual_seed(MODEL_SEED)
    model = nn.Linear(FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)

    # Progress: epoch, global offset in it, and how often each sample of the current
    # epoch has been used (the proof that nothing is read twice or skipped).
    epoch, offset, step = 0, 0, 0
    counts = torch.zeros(args.samples, dtype=torch.int64)
    sizes: list[int] = []
    ok = True  # every finished epoch used every sample exactly once
    ckpt = Path(args.checkpoint_dir) / CHECKPOINT_NAME
    dist.barrier()  # every rank looks at the checkpoint at the same moment
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        epoch, offset, step = int(state["epoch"]), int(state["offset"]), int(state["step"])
        counts = state["counts"]
        sizes = list(state["world_sizes"])
        ok = bool(state["exact"])
        if rank == 0:
            print(
                f"{tag}: resumed at epoch {epoch}, sample {offset}/{args.samples} "
                f"(step {step}), now {world} ranks (before: {sizes[-1]})",
                flush=True,
            )
    elif rank == 0:
        print(f"{tag}: starting fresh with {world} ranks", flush=True)
    if not sizes or sizes[-1] != world:
        sizes.append(world)

    def checkpoint() -> None:
        if rank == 0:
            save(
                ckpt,
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "epoch": epoch,
                    "offset": offset,
                    "step": step,
                    "counts": counts,
                    "world_sizes": sizes,
                    "exact": ok,
                },
            )

    steps_this_run = 0
    while epoch < args.epochs:
        if args.crash_at_step == step and rank == args.crash_rank and restart == 0:
            print(f"{tag}: injected crash at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        mine = sampler.indices(epoch, offset, rank, world)
        in_step = sampler.step_size(offset, world)
        optimizer.zero_grad(set_to_none=True)
        loss = ((model(x[mine]) - y[mine]) ** 2).sum() / in_step
        loss.backward()  # a rank without samples contributes zero gradients
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
        optimizer.step()
        used = torch.zeros(args.samples, dtype=torch.int64)
        used[mine] = 1
        dist.all_reduce(used)
        counts += used
        offset += in_step
        step += 1
        steps_this_run += 1
        if offset == args.samples:  # the epoch is complete: check, then start the next
            exact = bool((counts == 1).all())
            ok = ok and exact
            if rank == 0:
                print(
                    f"{tag}: epoch {epoch} done at step {step}: every sample used exactly "
                    f"once: {exact}",
                    flush=True,
                )
            epoch, offset = epoch + 1, 0
            counts = torch.zeros(args.samples, dtype=torch.int64)
        if step % args.checkpoint_every == 0 or epoch == args.epochs:
            checkpoint()
        if args.stop_after_steps is not None and steps_this_run >= args.stop_after_steps:
            checkpoint()
            if rank == 0:
                print(
                    f"{tag}: stopping after {steps_this_run} steps (epoch {epoch}, "
                    f"sample {offset})",
                    flush=True,
                )
            dist.barrier()
            dist.destroy_process_group()
            return 0

    if rank == 0:
        print(
            f"{tag}: finished {args.epochs} epochs in {step} steps; world sizes {sizes}; "
            f"exact: {ok}",
            flush=True,
        )
        if args.result_file:
            with open(args.result_file, "w") as f:
                json.dump(
                    {
                        "exact": ok,
                        "steps": step,
                        "world_sizes": sizes,
                        "restart_count": restart,
                        "epochs": epoch,
                    },
                    f,
                )
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

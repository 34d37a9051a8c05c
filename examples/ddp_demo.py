"""A small fault-tolerant DDP training job: the first thing to launch with elastrun.

It is a plain PyTorch script. It reads its place in the job from the environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``TORCHELASTIC_RESTART_COUNT``) and calls
``torch.distributed.init_process_group("gloo")`` itself, so it runs unchanged under
``torchrun`` and ``elastrun``::

    elastrun --standalone --nproc-per-node 4 --max-restarts 2 examples/ddp_demo.py \\
        --crash-at-step 25 --crash-rank 1

What it does:

* trains a two-layer MLP on synthetic regression data (fixed seeds) with DDP over gloo
  on the CPU, a ``DistributedSampler`` and SGD with momentum;
* every ``--checkpoint-every`` steps, rank 0 writes model, optimizer and step to
  ``--checkpoint-dir`` atomically (temporary file, fsync, ``os.replace``), so a crash
  mid-write never leaves a torn checkpoint behind;
* at start, after a barrier, every rank loads the latest checkpoint, so a group restarted
  by the launcher resumes where the last checkpoint left it. The data order is a pure
  function of the step, so a resumed run sees the same batches an uninterrupted one would;
* ``--crash-at-step S --crash-rank R`` makes global rank R die (``--crash-mode raise`` or
  ``kill``, i.e. SIGKILL) on reaching step S, but only on the first attempt
  (``TORCHELASTIC_RESTART_COUNT == "0"``), so the restart succeeds;
* at the end every rank prints a SHA-256 checksum of its parameters; rank 0 gathers them
  and says whether all ranks hold bit-identical parameters. The exit status is 0 only if
  they do.

Without a launcher (no ``RANK`` in the environment) it runs as a single process group of
one, which is handy for a quick look.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import os
import signal
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Any

# torch warns once per process when numpy is missing; numpy is optional for this demo and
# four copies of the warning would bury its output. Filter it before torch is imported.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DistributedSampler, TensorDataset  # noqa: E402

CHECKPOINT_NAME = "checkpoint.pt"
DATA_SEED = 1234
MODEL_SEED = 42
SAMPLER_SEED = 7
NUM_SAMPLES = 4096
IN_FEATURES = 32
HIDDEN = 128


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the demo's command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60, help="optimizer steps in total (default 60)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument(
        "--checkpoint-dir",
        default="./ddp_demo_ckpt",
        help="where rank 0 keeps the latest checkpoint; must be shared by all nodes "
        "(default ./ddp_demo_ckpt)",
    )
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints")
    p.add_argument(
        "--crash-at-step",
        type=int,
        default=None,
        help="inject a crash when this many steps are done (first attempt only)",
    )
    p.add_argument("--crash-rank", type=int, default=0, help="global rank that crashes")
    p.add_argument(
        "--crash-mode",
        choices=("raise", "kill", "hang"),
        default="raise",
        help="raise an exception, SIGKILL the process, or hang forever (its peers then "
        "block in their next collective; see --hang-timeout) (default raise)",
    )
    p.add_argument(
        "--step-time",
        type=float,
        default=0.03,
        help="pad every step to at least this many seconds so progress is watchable "
        "(default 0.03; 0 disables)",
    )
    p.add_argument("--result-file", default=None, help="rank 0 writes a JSON summary here")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.checkpoint_every < 1:
        p.error("--checkpoint-every must be >= 1")
    return args


class Context:
    """Where this process sits in the job, read once from the launcher's environment."""

    def __init__(self) -> None:
        self.launched = "RANK" in os.environ
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        # None when no elastic launcher started us (plain `python ddp_demo.py`).
        raw = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        self.restart_count: int | None = int(raw) if raw is not None else None
        self.first_attempt = raw == "0"

    @property
    def tag(self) -> str:
        return f"[restart {self.restart_count or 0}]"

    def __repr__(self) -> str:
        return (
            f"Context(rank={self.rank}, world_size={self.world_size}, "
            f"local_rank={self.local_rank}, restart_count={self.restart_count})"
        )


def log(ctx: Context, msg: str) -> None:
    """Print one line, prefixed with the rank, flushed at once (logs are often files)."""
    print(f"{ctx.tag} rank {ctx.rank}: {msg}", flush=True)


def init_distributed(ctx: Context) -> None:
    """Join the process group the launcher described, or make a group of one."""
    if not ctx.launched:
        # Standalone run: a one-process group on a free loopback port.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))


def make_dataset() -> TensorDataset:
    """Synthetic regression data, identical on every rank and every attempt."""
    g = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(NUM_SAMPLES, IN_FEATURES, generator=g)
    w = torch.randn(IN_FEATURES, 1, generator=g) / IN_FEATURES**0.5
    z = x @ w
    y = z + 0.3 * torch.sin(3.0 * z) + 0.05 * torch.randn(NUM_SAMPLES, 1, generator=g)
    return TensorDataset(x, y)


def make_model() -> nn.Module:
    torch.manual_seed(MODEL_SEED)
    return nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


def batch_indices(sampler: DistributedSampler[Any], step: int, batch_size: int) -> list[int]:
    """This rank's sample indices for global step `step` (0-based).

    The order depends only on the step, not on how many steps this process has run, so a
    group resumed at step k reads exactly the batches an uninterrupted run reads there.
    """
    per_epoch = len(sampler) // batch_size
    epoch, offset = divmod(step, per_epoch)
    sampler.set_epoch(epoch)
    order = list(iter(sampler))
    return order[offset * batch_size : (offset + 1) * batch_size]


def save_checkpoint(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int
) -> None:
    """Write the checkpoint atomically: readers see the old file or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    # Make the rename itself durable, so a machine crash cannot bring the old file back.
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int | None:
    """Restore model and optimizer from `path` if it exists; return its step, else None."""
    if not path.exists():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def parameter_digest(model: nn.Module) -> bytes:
    """SHA-256 over the exact bytes of every parameter: equal only if bit-identical."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(bytes(p.detach().contiguous().view(-1).view(torch.uint8).tolist()))
    return h.digest()


def gather_digests(ctx: Context, digest: bytes) -> list[str]:
    """Every rank's digest, as short hex strings in rank order.

    A fixed-size uint8 tensor is gathered rather than using `all_gather_object`, which
    needs numpy on the CPU and pickles; 32 bytes per rank need neither.
    """
    mine = torch.tensor(list(digest), dtype=torch.uint8)
    gathered = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, mine)
    return [bytes(t.tolist()).hex()[:16] for t in gathered]


def maybe_crash(ctx: Context, args: argparse.Namespace, step: int) -> None:
    """Inject the requested failure, but only on the launcher's first attempt."""
    if args.crash_at_step is None or step != args.crash_at_step:
        return
    if ctx.rank != args.crash_rank or not ctx.first_attempt:
        return
    if args.crash_mode == "kill":
        log(ctx, f"injected crash at step {step}: SIGKILL to myself")
        os.kill(os.getpid(), signal.SIGKILL)
    if args.crash_mode == "hang":
        log(ctx, f"injected hang at step {step}: sleeping forever")
        hang_forever()
    log(ctx, f"injected crash at step {step}: raising")
    raise RuntimeError(f"injected crash at step {step} on rank {ctx.rank}")


def hang_forever() -> None:
    """What a stuck data loader or a deadlock looks like from outside: no progress."""
    while True:
        time.sleep(3600)


def write_result(path: str, result: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)


def train(ctx: Context, args: argparse.Namespace) -> int:
    """Run the training loop; return the process exit status."""
    dataset = make_dataset()
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=SAMPLER_SEED
    )
    if len(sampler) < args.batch_size:
        raise SystemExit(f"--batch-size {args.batch_size} exceeds {len(sampler)} samples per rank")
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    ckpt = Path(args.checkpoint_dir) / CHECKPOINT_NAME
    # Rank 0 of a previous attempt may have been mid-way through a write when the group
    # died; the barrier makes every rank of *this* attempt look at the same moment.
    dist.barrier()
    resumed_from = load_checkpoint(ckpt, model, optimizer)
    step = resumed_from or 0
    if resumed_from is not None and ctx.rank == 0:
        log(ctx, f"resumed from checkpoint at step {step} (restart {ctx.restart_count or 0})")
        if step >= args.steps:
            log(ctx, f"nothing left to train ({args.steps} steps); use a fresh --checkpoint-dir")
    elif ctx.rank == 0:
        log(ctx, f"starting fresh: {ctx.world_size} ranks, {args.steps} steps")

    # DDP broadcasts rank 0's parameters here, so all ranks start identical either way.
    ddp = DistributedDataParallel(model)
    loss_fn = nn.MSELoss()
    x_all, y_all = dataset.tensors
    loss_value = float("nan")
    while step < args.steps:
        maybe_crash(ctx, args, step)
        started = time.monotonic()
        idx = batch_indices(sampler, step, args.batch_size)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x_all[idx]), y_all[idx])
        loss.backward()
        optimizer.step()
        loss_value = loss.item()
        step += 1
        if ctx.rank == 0 and (step % 10 == 0 or step == args.steps):
            print(f"{ctx.tag} step {step}/{args.steps} loss {loss_value:.4f}", flush=True)
        if ctx.rank == 0 and (step % args.checkpoint_every == 0 or step == args.steps):
            save_checkpoint(ckpt, model, optimizer, step)
        pad = args.step_time - (time.monotonic() - started)
        if pad > 0:
            time.sleep(pad)

    digest = parameter_digest(model)
    checksum = digest.hex()[:16]
    log(ctx, f"done at step {step}, parameter checksum {checksum}")
    gathered = gather_digests(ctx, digest)
    identical = all(c == checksum for c in gathered)
    if ctx.rank == 0:
        print(
            f"{ctx.tag} final parameters identical on all {ctx.world_size} ranks: "
            f"{identical} (checksum {checksum})",
            flush=True,
        )
        if not identical:
            print(f"{ctx.tag} checksums by rank: {gathered}", flush=True)
        if args.result_file:
            write_result(
                args.result_file,
                {
                    "steps": step,
                    "checksum": checksum,
                    "identical": identical,
                    "restart_count": ctx.restart_count,
                    "resumed_from": resumed_from,
                    "world_size": ctx.world_size,
                    "final_loss": loss_value,
                },
            )
    # Release DDP now, while the interpreter is fully alive. Left to interpreter exit, its
    # reducer (which holds the gloo group) was sometimes destroyed during finalization and
    # aborted the process ("terminate called without an active exception", about 1 run
    # in 8 with 4 ranks on 2 cores), turning a finished job into a failed one.
    del ddp
    gc.collect()
    return 0 if identical else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Four gloo workers on a two-core machine: intra-op threads would only fight each other.
    torch.set_num_threads(1)
    ctx = Context()
    init_distributed(ctx)
    try:
        return train(ctx, args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())

"""Restoring a sharded state (FSDP2, HSDP) after an in-process recovery.

With FSDP2 each rank holds its own shard of the model and optimizer; with HSDP, the
ranks at the same place of the shard dimension in every replica group hold the same
shard. A replacement can take its predecessor's shard from such a replica, and only
from one: a commit moves between the ranks of one *shard key* (``shard_key``), and
every rank of the round must end on the same commit, the newest one intact anywhere.

The shards exist only once the model is sharded, and sharding needs the world's device
mesh, made in the training function; so the synchronisation before the call moves
nothing when any rank's commit is sharded (``inprocess.transfer``), and the training
function calls ``State.restore`` once its model is sharded: survivors rebind their
model to the new world's groups (``inprocess.fsdp``), every rank says which commit it
holds for which shard, and each shard's newest commit goes to the ranks of that shard
that lack it, as raw buffers into their local shards (from another process's memory
on the same machine, else over gloo), in the training's own process group. Where a
shard has no replica left (FSDP2, or every replica lost), given the memory checkpoint
the job saves the State into, every rank loads its newest step complete on every rank
instead (the replacement its predecessor's shards, from its node's memory; the
survivors roll back to it), in place.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from elastrun.inprocess.worker.fsdp import rebind
from elastrun.inprocess.worker.snapshot import walk
from elastrun.wire.inprocess import first_round

if TYPE_CHECKING:
    from elastrun.inprocess.worker.state import State

__all__ = ["restore", "shard_key"]

log = logging.getLogger("elastrun.inprocess")

#: The key under which ``restore`` loads the State from the checkpoint: save it as
#: ``checkpoint.save(step, {"state": state})``.
KEY = "state"


def restore(state: State, checkpoint: Any = None) -> None:
    """See ``State.restore``."""
    import torch
    import torch.distributed as dist

    from elastrun.inprocess.worker.parking import park_process_groups
    from elastrun.inprocess.worker.transfer import CommitLostError, move_commit

    items = [getattr(state, name) for name in state.names()]
    for item in items:
        if isinstance(item, torch.nn.Module):
            rebind(item)  # a survivor's model; a model sharded in this world is left as is
    if not state._pending:
        # At an attempt's start (every process new) the checkpoint's newest step, if
        # any, is every rank's commit.
        at_start = checkpoint is not None and first_round()
        if at_start and checkpoint.load_latest({KEY: state}) is not None:
            state._hold(state.commit_id)
        return
    key = shard_key(items)
    state._restored()  # (a failure from here on leads to the next round, which defers again)
    park_process_groups()  # the training's groups: see inprocess.parking
    rank = dist.get_rank()
    try:
        plans = move_commit(state, rank, dist.get_world_size(), key=key)
    except CommitLostError as lost:  # (every rank finds so, at once)
        if checkpoint is None or lost.newest is None:
            raise
        step = checkpoint.load_latest({KEY: state})  # (a collective, on every rank)
        if step is None:
            raise
        state._hold(lost.newest + 1)
        log.warning(
            "%s; every rank loaded step %d from the memory checkpoint instead, in place",
            str(lost).split(" (", 1)[0], step,
        )  # fmt: skip
        plans = []
    state._after_sync()
    for plan in plans:
        if rank in plan.receivers:
            log.info(
                "rank %d took commit %d of its shard from rank %s", rank, plan.commit,
                ", ".join(map(str, plan.sources)),
            )  # fmt: skip


def shard_key(items: list[Any]) -> Hashable:
    """Which shard of the state this rank holds: for each device mesh of the items'
    DTensors, its coordinates along the dimensions they are sharded over (not
    replicated). Ranks with equal keys hold the same tensors (an HSDP shard's replicas);
    a state without DTensors has the empty key, the same on every rank."""
    parts: set[tuple[Any, ...]] = set()
    for item in items:
        if not callable(getattr(item, "state_dict", None)):
            continue
        for _, t in walk(item.state_dict()):
            placements = getattr(t, "placements", None)
            if placements is None:
                continue
            mesh = t.device_mesh  # type: ignore[attr-defined]  # a DTensor's
            coordinate = mesh.get_coordinate() or ()
            dims = tuple(i for i, p in enumerate(placements) if not p.is_replicate())
            parts.add((tuple(mesh.shape), dims, tuple(coordinate[i] for i in dims)))
    return tuple(sorted(parts))

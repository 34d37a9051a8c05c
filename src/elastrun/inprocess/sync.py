"""Synchronising the state of a round's ranks: the newest commit goes to every rank
whose commit is older (a replacement's is 0).

It runs on a process group of its own (gloo, on the round's bootstrap store under a
prefix of its own), made and destroyed around the exchange, so the training function's
``init_process_group`` finds the default group free and the store's keys untouched.
"""

from __future__ import annotations

import datetime
import os

from elastrun.inprocess.parking import keep_parked, park_process_groups
from elastrun.inprocess.state import State

#: Bounds the exchange (a rank that never comes makes the others fail, and the agent
#: restarts the group).
SYNC_TIMEOUT = datetime.timedelta(seconds=120)


def synchronise(state: State, round_no: int) -> None:
    import torch.distributed as dist
    from torch._C._distributed_c10d import PrefixStore, TCPStore

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
        is_master=False, timeout=SYNC_TIMEOUT,
    )  # fmt: skip
    prefixed = PrefixStore(f"elastrun/inprocess/{round_no}/", store)
    dist.init_process_group(
        "gloo", store=prefixed, rank=rank, world_size=world, timeout=SYNC_TIMEOUT
    )
    park_process_groups()  # see inprocess.parking
    try:
        commits: list[int | None] = [None] * world
        dist.all_gather_object(commits, state.commit_id)
        newest = max(c for c in commits if c is not None)
        source = commits.index(newest)
        if any(c != newest for c in commits):
            blob = [state.export_commit() if rank == source else None]
            dist.broadcast_object_list(blob, src=source)
            if state.commit_id != newest:
                assert isinstance(blob[0], bytes)
                state.import_commit(blob[0])
    finally:
        dist.destroy_process_group()
        # Kept: releasing it would need a pause (see inprocess.parking) on the recovery's
        # critical path; a synchronisation group costs a few threads until exit.
        keep_parked()

"""Moving the newest commit to the ranks that lack it, as raw tensor buffers.

Pickling a commit (``broadcast_object_list``) moves ~0.13 GB/s and needs the whole
pickle in memory on both sides. Here:

1. every rank says which commit it holds, and whether its live state still is that
   commit (``State.held_commit``); ``decide`` picks the newest intact commit, the ranks
   that hold it (the *sources*) and the ranks that take it (the *receivers*: a
   replacement, a rank behind, a rank whose state moved on since its commit);
2. the first source broadcasts the commit's description: its plain values and, for
   each tensor, its place, shape and dtype (a small pickle);
3. each receiver finds its own tensor at each place (or allocates one: an optimizer's
   state is created at its first step, so a fresh replacement has none) and the
   tensors' bytes are broadcast in chunks straight into them: no copy, no pickle, the
   chunks split across the sources and across a few groups, several in flight, so that
   the transfer streams over every link it can use. Ranks of one machine skip the
   network: each receiver reads the chunks from its sources' memory
   (``inprocess.local_copy``; the sources said where their tensors lie in step 1), and
   the whole commit goes over gloo when any receiver cannot. Meanwhile a thread faults
   in the receiver's new tensors (``inprocess.prefault``);
4. every rank reports (a receiver: whether it could take the commit); until then the
   sources' tensors stay as they are.

The groups are gloo for CPU tensors and NCCL for CUDA ones where the machine has GPUs
(torch picks by the tensor's device).
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from elastrun.core.errors import ElastrunError
from elastrun.inprocess.worker import early, local_copy, prefault
from elastrun.inprocess.worker.parking import park_process_groups
from elastrun.inprocess.worker.receive import CommitDescription
from elastrun.inprocess.worker.snapshot import local
from elastrun.inprocess.worker.state import State

if TYPE_CHECKING:
    import torch

#: Bytes per chunk: small enough that a transfer streams, large enough that each
#: collective's fixed cost does not count.
CHUNK = 16 << 20
#: Groups per source: the chunks of one source go round-robin over them.
STREAMS = 2
#: Chunks in flight per group.
WINDOW = 4
#: Whether ranks of one machine read the commit from each other's memory (else gloo).
LOCAL = True


class CommitLostError(ElastrunError, RuntimeError):
    """No rank of the round holds the newest commit intact: the ranks whose state moved
    on past their commit are ahead of every intact one, or a shard has no replica that
    holds it (see docs/inprocess.md). ``newest``: that commit, where one is known."""

    def __init__(self, message: str, newest: int | None = None) -> None:
        super().__init__(message)
        self.newest = newest


class ShardedWorldChangedError(CommitLostError):
    """The world's size changed under a sharded model (``rebind``): its shards are laid
    out for ``laid_out`` ranks along a mesh dimension that now has ``now``. A survivor
    cannot keep them; the group restarts, and a memory checkpoint loads the state
    resharded (DCP) into the new world."""

    def __init__(self, laid_out: int, now: int) -> None:
        super().__init__(
            f"the model's shards are laid out for {laid_out} ranks along a mesh "
            f"dimension that has {now} in the new world (a node was lost or joined): "
            "they cannot be kept in place"
        )
        self.laid_out, self.now = laid_out, now


class TransferAborted(RuntimeError):
    """Another rank of the round could not take the commit; this one waits for the
    next round (the agent, asked, names the other rank's failure)."""


@dataclass(frozen=True)
class Plan:
    """Who hands the commit to whom."""

    commit: int
    sources: tuple[int, ...]
    receivers: tuple[int, ...]


def decide(held: Sequence[tuple[int, bool]]) -> Plan:
    """The plan for ranks holding ``held[rank]`` = (commit number, intact).

    Raises:
        CommitLostError: a rank whose state moved on had a newer commit than every
            intact one.
    """
    intact = [c for c, ok in held if ok]
    if not intact:
        raise CommitLostError("no rank holds its last commit intact")
    newest = max(intact)
    ahead = [(r, c) for r, (c, ok) in enumerate(held) if not ok and c > newest]
    if ahead:
        rank, commit = ahead[0]
        raise CommitLostError(
            f"rank {rank}'s state moved on past its commit {commit} (its optimizer "
            f"stepped, or a collective after the step failed), and no rank holds a commit "
            f"newer than {newest} intact: use State(copy_state=True) for training whose "
            f"collectives can fail after the optimizer step"
        )
    sources = tuple(r for r, (c, ok) in enumerate(held) if ok and c == newest)
    receivers = tuple(r for r, (c, ok) in enumerate(held) if not (ok and c == newest))
    return Plan(newest, sources, receivers)


@dataclass(frozen=True)
class Chunk:
    tensor: int  # index among the commit's tensors
    start: int  # elements
    stop: int
    source: int
    stream: int


def chunks(sizes: Sequence[tuple[int, int]], sources: Sequence[int]) -> list[Chunk]:
    """Split tensors of (elements, bytes per element) into chunks of about ``CHUNK``
    bytes, dealt round-robin to the sources and to each source's streams."""
    out: list[Chunk] = []
    k = 0
    for index, (numel, size) in enumerate(sizes):
        step = max(1, CHUNK // max(1, size))
        for start in range(0, numel, step):
            source = sources[k % len(sources)]
            stream = (k // len(sources)) % STREAMS
            out.append(Chunk(index, start, min(numel, start + step), source, stream))
            k += 1
    return out


def decide_sharded(held: Sequence[tuple[int, bool, Hashable]]) -> list[Plan]:
    """The plans for sharded ranks holding ``held[rank]`` = (commit number, intact,
    shard key): the ranks of one key hold the same tensors (``sharded.shard_key``: an
    HSDP shard's replicas), so each key's newest commit goes to that key's ranks only.
    Every rank must end on the same commit: the newest intact one of all.

    Raises:
        CommitLostError: no rank of some key holds that commit intact (its shard is
            nowhere else: FSDP2 without replicas, or every replica lost).
    """
    intact = [c for c, ok, _ in held if ok]
    if not intact:
        raise CommitLostError("no rank holds its last commit intact")
    newest = max(intact)
    plans = []
    for key in dict.fromkeys(k for _, _, k in held):
        ranks = [r for r, (_, _, k) in enumerate(held) if k == key]
        if not any(held[r][1] and held[r][0] == newest for r in ranks):
            raise CommitLostError(
                f"no rank holding the shard of rank{'s' if len(ranks) > 1 else ''} "
                f"{', '.join(map(str, ranks))} holds commit {newest} intact (a shard "
                f"without a surviving replica)",
                newest,
            )
        sub = decide([(held[r][0], held[r][1]) for r in ranks])
        sources = tuple(ranks[i] for i in sub.sources)
        plans.append(Plan(sub.commit, sources, tuple(ranks[i] for i in sub.receivers)))
    return plans


def move_commit(
    state: State,
    rank: int,
    world: int,
    pool: early.Pool | None = None,
    key: Hashable | None = None,
) -> list[Plan]:
    """Hand the newest commit of the round to every rank that lacks it (run by every
    rank of the round's synchronisation group, the default group; the steps: the
    module's docstring). ``pool``: tensors this rank allocated ahead
    (``inprocess.early``), taken where the description agrees.

    ``key``: this rank's shard (``sharded.shard_key``) when a sharded commit moves in the
    training's own group (``State.restore``), a plan per shard. Without it, a round in
    which any rank holds a sharded commit moves nothing: every rank's state waits for
    ``State.restore`` (returns no plan)."""
    import torch.distributed as dist

    intact = state.held_commit() is not None
    offer = local_copy.whereabouts(state.commit_tensors()) if LOCAL and intact else None
    offered = offer is not None and offer.spans is not None
    if offered:
        local_copy.allow_readers()
    try:
        held: list[Any] = [None] * world
        mark = key if key is not None else state.sharded()
        dist.all_gather_object(held, (state.commit_id, intact, offer, mark))
        if key is None and any(h[3] for h in held):
            state._defer_restore()
            return []
        # (Without a key every mark is False here: one shard, one plan.)
        plans = decide_sharded([(int(c), bool(ok), k) for c, ok, _, k in held])
        active = [p for p in plans if p.receivers]
        if not active:
            return plans
        mine = next((p for p in active if rank in (*p.sources, *p.receivers)), None)
        desc = _description(state, active, mine, rank, world)
        receiving = desc is not None and mine is not None and rank in mine.receivers
        ahead = {id(t) for t in (pool or {}).values()}  # already being faulted in
        targets, error = _prepare(state, desc, pool) if desc and receiving else ([], None)
        offers = {s: held[s][2] for p in active for s in p.sources}
        data = [local(t) for t in targets] if receiving else state.commit_tensors()
        new = [t for t in data if id(t) not in ahead] if receiving else []
        with prefault.populating(new):  # new tensors' pages, while the rest goes on
            _move_bytes(data, active, rank, world, offers, error)
    finally:
        if offered:
            local_copy.forbid_readers()
    if receiving and desc is not None:
        state.adopt(desc, targets)
    return plans


def _description(
    state: State, active: list[Plan], mine: Plan | None, rank: int, world: int
) -> CommitDescription | None:
    """The description of the commit this rank's plan moves, from the plan's first
    source (one broadcast, or with a plan per shard every first source's at once)."""
    import torch.distributed as dist

    if len(active) == 1:
        box: list[Any] = [state.describe() if rank == active[0].sources[0] else None]
        dist.broadcast_object_list(box, src=active[0].sources[0])
        return box[0] if mine is not None else None
    firsts = {p.sources[0] for p in active}
    descs: list[Any] = [None] * world
    dist.all_gather_object(descs, state.describe() if rank in firsts else None)
    return descs[mine.sources[0]] if mine is not None else None


def _prepare(
    state: State, desc: CommitDescription, pool: early.Pool | None
) -> tuple[list[torch.Tensor], ElastrunError | None]:
    try:
        return state.targets(desc, pool), None
    except ElastrunError as exc:
        return [], exc


def _move_bytes(
    tensors: list[torch.Tensor],
    plans: list[Plan],
    rank: int,
    world: int,
    offers: dict[int, local_copy.Whereabouts | None],
    error: ElastrunError | None,
) -> None:
    """The commit's bytes, from the sources' ``tensors`` into the receivers', plan by
    plan (a rank is in one plan at most).

    A receiver reads them from its sources' memory where it can, then every rank reports
    (the sources' tensors stay as they are until then); if any receiver could not
    prepare its tensors the round ends, else if any could not read them all, every
    plan's commit goes over gloo."""
    import torch.distributed as dist

    read = False
    mine = next((p for p in plans if rank in p.receivers), None)
    if mine is not None and error is None and LOCAL:
        read = _read_locally(tensors, mine, offers)
    reports: list[Any] = [None] * world
    dist.all_gather_object(reports, str(error) if error is not None else read)
    failed = [(r, e) for r, e in enumerate(reports) if isinstance(e, str)]
    if failed:
        if error is not None:
            raise error  # this rank's own: it ends with it, and is replaced
        r, e = failed[0]
        commit = plans[0].commit
        raise TransferAborted(f"processgroup: rank {r} could not take commit {commit}: {e}")
    if not all(reports[r] is True for p in plans for r in p.receivers):
        _stream(tensors, plans, rank)


def _read_locally(
    tensors: list[torch.Tensor], plan: Plan, offers: dict[int, local_copy.Whereabouts | None]
) -> bool:
    """This receiver reads every chunk from its sources' memory
    (``inprocess.local_copy``); whether it could."""
    if any(offers[s] is None for s in plan.sources):
        return False
    sizes = [(t.numel(), t.element_size()) for t in tensors]
    parts = [
        (c.tensor, c.start * sizes[c.tensor][1], c.stop * sizes[c.tensor][1], c.source)
        for c in chunks(sizes, plan.sources)
    ]
    sources = {s: w for s, w in offers.items() if w is not None}
    return local_copy.read_chunks(tensors, parts, sources)


def _stream(tensors: list[torch.Tensor], plans: list[Plan], rank: int) -> None:
    """Broadcast every chunk of this rank's plan from its source into the receivers'
    tensors."""
    import torch.distributed as dist

    groups = _groups(plans)
    at = next((i for i, p in enumerate(plans) if rank in (*p.sources, *p.receivers)), None)
    if at is None:
        return
    plan = plans[at]
    flat, staged = [], []
    for t in tensors:
        if t.is_contiguous():
            flat.append(t.view(-1))
        else:  # rare: a view of another tensor
            tmp = t.contiguous()
            staged.append((t, tmp))
            flat.append(tmp.view(-1))
    sizes = [(t.numel(), t.element_size()) for t in flat]
    pending: dict[tuple[int, int], collections.deque[Any]] = collections.defaultdict(
        collections.deque
    )
    for c in chunks(sizes, plan.sources):
        if rank != c.source and rank not in plan.receivers:
            continue
        key = (c.source, c.stream)
        queue = pending[key]
        if len(queue) >= WINDOW:
            queue.popleft().wait()
        part = flat[c.tensor][c.start : c.stop]
        group = groups[(at, c.source, c.stream)]
        queue.append(dist.broadcast(part, src=c.source, group=group, async_op=True))
    for queue in pending.values():
        while queue:
            queue.popleft().wait()
    if rank in plan.receivers:
        for target, tmp in staged:
            target.copy_(tmp)


def _groups(plans: list[Plan]) -> dict[tuple[int, int, int], Any]:
    """A group per (plan, source, stream): the source and its plan's receivers. Every
    rank makes every group, in the same order (torch requires it), members or not."""
    import torch.distributed as dist

    out = {}
    for at, plan in enumerate(plans):
        for source in plan.sources:
            ranks = sorted({source, *plan.receivers})
            for stream in range(STREAMS):
                out[(at, source, stream)] = dist.new_group(ranks)
    park_process_groups()  # freed with the synchronisation's group (see inprocess.parking)
    return out

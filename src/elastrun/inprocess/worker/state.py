"""What a worker keeps across in-process recoveries: its objects and their last commit.

A commit holds no second copy of the training state on CPU (see ``inprocess.snapshot``
for why that is safe, and how a rank finds out that it was not); it copies a module's
buffers, the plain values of every state dict, the random number generators and, for
tensors on a GPU or when asked, the tensors themselves into host memory it reuses.
"""

from __future__ import annotations

import copy
import logging
import pickle
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from elastrun.core.errors import ElastrunError
from elastrun.inprocess.worker import own as own_part
from elastrun.inprocess.worker import rng
from elastrun.inprocess.worker.parking import park_process_groups, release_idle
from elastrun.inprocess.worker.receive import (
    CommitDescription,
    StateMismatchError,
    dtype_of,
    is_module,
    new_tensor,
    stateful,
    where,
)
from elastrun.inprocess.worker.snapshot import (
    ItemSnapshot,
    TensorSpec,
    local,
    rebuild,
    take,
    walk,
)
from elastrun.wire.inprocess import first_round

if TYPE_CHECKING:
    import torch

log = logging.getLogger("elastrun.inprocess")


class RestoreMissingError(ElastrunError, RuntimeError):
    """A sharded state was not restored after an in-process recovery (``restore``)."""


class State:
    """The training state ``elastrun.inprocess.run`` recovers: objects with
    ``state_dict()``/``load_state_dict()`` (a model, an optimizer, a scheduler, a
    sampler or data loader) and plain values (a step counter), read and written as
    attributes.

    ``commit()`` marks the point a recovery comes back to; a recovery rolls every item
    back to it and, when a peer holds a newer one, takes the peer's, tensor by tensor
    into this rank's own objects. The state right after construction is commit 0.

    Args:
        restore_rng: include the random number generators (torch CPU and CUDA, numpy,
            ``random``) in every commit (default).
        copy_state: copy every tensor at each commit (into memory reused from one
            commit to the next) instead of relying on the live state being the commit
            at a failure: for training whose collectives can fail after its optimizer
            changed the state (see docs/inprocess.md). Tensors on a GPU are always
            copied, to host memory.
        own: the names of the items that are each rank's own (a data loader's
            position, a per-rank counter): a replacement takes its predecessor's, not
            the sending rank's (as it does the generators: ``inprocess.worker.own``).
            They are pickled at every commit: keep them small.
        items: the objects and values, by name (not starting with ``_``).

    Raises:
        ValueError: ``own`` names an item that is not given.
    """

    def __init__(
        self,
        *,
        restore_rng: bool = True,
        copy_state: bool = False,
        own: Iterable[str] = (),
        **items: Any,
    ) -> None:
        own_names = frozenset(own)
        unknown = sorted(own_names - set(items))
        if unknown:
            raise ValueError(f"own names items that are not given: {', '.join(unknown)}")
        object.__setattr__(self, "_items", {})
        object.__setattr__(self, "_rng_on", restore_rng)
        object.__setattr__(self, "_copy_all", copy_state)
        object.__setattr__(self, "_commit", 0)
        object.__setattr__(self, "_stepped", False)  # an optimizer stepped since the commit
        object.__setattr__(self, "_hooks", {})
        object.__setattr__(self, "_rebase", False)  # re-read versions at the next forward
        object.__setattr__(self, "_snap", {})
        object.__setattr__(self, "_plain", {})
        object.__setattr__(self, "_rng", None)
        object.__setattr__(self, "_intact", True)
        object.__setattr__(self, "_own", own_names)
        object.__setattr__(self, "_own_saved", b"")  # the own items, pickled at the commit
        object.__setattr__(self, "_own_path", own_part.record_path())
        object.__setattr__(self, "_pending", False)  # a sharded commit awaits restore()
        for name, value in items.items():
            setattr(self, name, value)
        self._take()
        self._after_sync()
        # A process started into an in-process round (a replacement, a joining node's
        # worker) holds no commit until it takes one: what it built is not the round's
        # commit 0, which its peers' script may have loaded from a checkpoint.
        object.__setattr__(self, "_holds", first_round())
        if self._holds:
            self._keep_own()  # over a record an earlier attempt's worker left

    # -- attributes -----------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        items = object.__getattribute__(self, "_items")
        try:
            return items[name]
        except KeyError:
            raise AttributeError(f"State has no item {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            raise AttributeError(f"State items may not start with '_': {name!r}")
        self._items[name] = value
        self._watch(name, value)

    def names(self) -> list[str]:
        return sorted(self._items)

    def _watch(self, name: str, value: object) -> None:
        """An optimizer's step changes the state in place; torch's fused optimizers do
        so without bumping the tensors' version counters, so a step hook says it."""
        old = self._hooks.pop(name, None)
        if old is not None:
            old.remove()
        register = getattr(value, "register_step_pre_hook", None)
        if callable(register):
            self._hooks[name] = register(self._mark_stepped)
            return
        forward = getattr(value, "register_forward_pre_hook", None)
        if callable(forward):
            self._hooks[name] = forward(self._before_forward)

    def _mark_stepped(self, *_: object) -> None:
        object.__setattr__(self, "_stepped", True)

    def _after_sync(self) -> None:
        """The training function is about to run (again) on this commit: its setup may
        rewrite the commit's own values in place before the first forward pass.
        DDP's construction broadcasts rank 0's parameters into every rank's, bumping
        every version counter (rank 0's too) while every value stays the commit's; a
        failure in the first step would otherwise find no rank holding the commit."""
        object.__setattr__(self, "_rebase", True)

    def _before_forward(self, *_: object) -> None:
        """At the first forward pass after ``_after_sync``: the tensors kept by
        reference are the commit's as they are now, unless an optimizer stepped."""
        if not self._rebase:
            return
        object.__setattr__(self, "_rebase", False)
        if self._stepped:
            return
        for snap in self._snap.values():
            for leaf in snap.leaves:
                if leaf.saved is None:
                    leaf.version = leaf.data._version

    # -- commits --------------------------------------------------------------------------

    @property
    def commit_id(self) -> int:
        """How many times ``commit`` ran (0: the state as constructed), or the number of
        the commit this rank took from a peer."""
        return int(self._commit)

    def commit(self) -> None:
        """Mark the point a recovery comes back to (see the class docstring).

        Raises:
            RestoreMissingError: the state is sharded and this call of the training
                function did not call ``restore()`` after a recovery.
        """
        if self._pending:
            raise RestoreMissingError(
                "a sharded state (FSDP2, HSDP) was not restored after an in-process "
                "recovery: call state.restore() in the training function once the model "
                "is sharded and its optimizer made, before the first step"
            )
        park_process_groups()  # see inprocess.parking: the training's own group too
        release_idle(generations=False)  # what an earlier chain of recoveries kept
        self._hold(self._commit + 1)

    def restore(self, checkpoint: Any = None) -> None:
        """After an in-process recovery of a sharded state (FSDP2, HSDP): bring every
        rank to the round's commit, in the training's own process group. A survivor's
        model is rebound to the new world's groups (``inprocess.rebind``) and keeps its
        shards (rolled back to its commit); a rank that lacks the commit (the
        replacement) takes its shards from a replica of the same shard. Where a shard
        has none, every rank loads the newest step of ``checkpoint`` (a
        ``MemoryCheckpoint`` the job saves this State into as ``{"state": state}``),
        as it does at an attempt's start (the job's, a group restart's).

        Call it in every call of the training function once the model is sharded and
        its optimizer made, before the first step (see docs/inprocess.md).

        Raises:
            CommitLostError: a shard has no replica left, nor ``checkpoint`` a step.
        """
        from elastrun.inprocess.worker.sharded import restore

        restore(self, checkpoint)

    def state_dict(self) -> dict[str, Any]:
        """The items as a checkpoint takes them (a ``Stateful`` of
        ``torch.distributed.checkpoint``: see ``inprocess.worker.checkpointing``)."""
        from elastrun.inprocess.worker.checkpointing import state_dict

        return state_dict(self._items)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from elastrun.inprocess.worker.checkpointing import load_state_dict

        load_state_dict(self._items, state_dict)

    def _defer_restore(self) -> None:
        """The round's commit is sharded: it moves at ``restore`` (inprocess.transfer)."""
        object.__setattr__(self, "_pending", True)

    def _restored(self) -> None:
        object.__setattr__(self, "_pending", False)

    def _hold(self, commit: int) -> None:
        """The live state (committed, adopted, or loaded from a checkpoint on every rank)
        is commit ``commit``, which this rank now holds."""
        self._take()
        object.__setattr__(self, "_commit", commit)
        object.__setattr__(self, "_holds", True)
        self._keep_own()

    def _keep_own(self) -> None:
        """Write this rank's own part of its last commit for a replacement (see
        ``inprocess.worker.own``): only when there is one to keep."""
        path = self._own_path
        if path is None or (self._rng is None and not self._own):
            return
        own_part.write(path, own_part.OwnRecord(self._commit, self._rng, self._own_saved))

    def _take_own_from(self, commit: int) -> bool:
        """Take this local rank's predecessor's own part of ``commit`` (its generators,
        its own items); False when there is none."""
        path = self._own_path
        if path is None or (self._rng is None and not self._own):
            return True  # nothing of its own to take
        record = own_part.read(path, commit)
        if record is None:
            return False
        if record.rng is not None and self._rng_on:
            rng.restore(record.rng)
        if self._own and record.items:
            self._load_own(record.items)
        return True

    def _load_own(self, saved: bytes) -> None:
        values: dict[str, Any] = pickle.loads(saved)
        for name, value in values.items():
            if name not in self._own:
                continue
            item = self._items.get(name)
            if stateful(item):
                item.load_state_dict(value)
            else:
                self._items[name] = value

    def copied_bytes(self) -> int:
        """How many bytes of tensors the last commit copied (buffers; every tensor with
        ``copy_state`` or on a GPU)."""
        return sum(s.nbytes_copied() for s in self._snap.values())

    def intact(self) -> bool:
        """Whether the live state is still the last commit's, as far as one can tell:
        no optimizer stepped since, and no tensor kept by reference was written in
        place. (Writes through ``.data`` or numpy bypass the version counters.)"""
        leaves = [leaf for snap in self._snap.values() for leaf in snap.leaves]
        if self._stepped and any(leaf.saved is None for leaf in leaves):
            return False
        return all(leaf.intact() for leaf in leaves)

    def held_commit(self) -> int | None:
        """The commit this rank can hand to others: its number, or None when the live
        state moved on since (checked at the last ``rollback``) or when this process was
        started into an in-process round and has not taken a commit yet."""
        return self.commit_id if self._intact and self._holds else None

    def rollback(self) -> None:
        """Put every item back as it was at the last commit, as far as the commit holds
        it: a tensor kept by reference that moved on stays as it is, and the rank then
        no longer holds its commit (``held_commit``): it takes a peer's.

        A process started into an in-process round that has not taken a commit yet
        (its round failed before) is left as it is: what it made since it was
        constructed (a sharded model, the optimizer of it) is no commit's, and the
        next round's commit comes from a peer."""
        if not self._holds:
            return
        self._before_forward()  # a failure before the first forward pass (in DDP's setup)
        object.__setattr__(self, "_intact", self.intact())
        for name, snap in self._snap.items():
            for leaf in snap.leaves:
                leaf.restore()
            if not snap.is_module:
                self._items[name].load_state_dict(rebuild(snap.skeleton, snap.tensors()))
        for name, value in self._plain.items():
            self._items[name] = copy.deepcopy(value)
        if self._own_saved:
            self._load_own(self._own_saved)
        if self._rng is not None:
            rng.restore(self._rng)

    def _take(self) -> None:
        snaps: dict[str, ItemSnapshot] = {}
        plain: dict[str, Any] = {}
        own: dict[str, Any] = {}
        for name, value in self._items.items():
            if name in self._own:
                own[name] = value.state_dict() if stateful(value) else value
            elif stateful(value):
                state_dict = value.state_dict()
                snaps[name] = take(
                    state_dict,
                    is_module=is_module(value),
                    copy_names=_buffer_names(value, state_dict),
                    copy_all=self._copy_all,
                    previous=self._snap.get(name),
                )
            else:
                plain[name] = copy.deepcopy(value)
        object.__setattr__(self, "_snap", snaps)
        object.__setattr__(self, "_plain", plain)
        saved = pickle.dumps(own, protocol=pickle.HIGHEST_PROTOCOL) if own else b""
        object.__setattr__(self, "_own_saved", saved)
        object.__setattr__(self, "_rng", rng.capture() if self._rng_on else None)
        object.__setattr__(self, "_stepped", False)
        object.__setattr__(self, "_intact", True)
        object.__setattr__(self, "_rebase", False)

    # -- moving a commit between ranks ------------------------------------------------------

    def describe(self) -> CommitDescription:
        """The last commit without its tensors' bytes (see ``CommitDescription``)."""
        return CommitDescription(
            commit=self._commit,
            plain=self._plain,
            skeletons={name: snap.skeleton for name, snap in self._snap.items()},
            specs={name: snap.specs() for name, snap in self._snap.items()},
            modules=frozenset(name for name, snap in self._snap.items() if snap.is_module),
            rng=self._rng,
        )

    def commit_tensors(self) -> list[torch.Tensor]:
        """The last commit's tensors' bytes (a DTensor's local shard), item by item in
        ``describe``'s order (call after ``rollback``, when the live tensors are the
        commit's)."""
        return [t for snap in self._snap.values() for t in snap.data()]

    def sharded(self) -> bool:
        """Whether the last commit holds sharded tensors (DTensors: FSDP2, HSDP), which
        only the ranks of the same shard hold too (see ``inprocess.worker.sharded``)."""
        return any(snap.sharded() for snap in self._snap.values())

    def lacking_specs(self) -> dict[str, list[TensorSpec]]:
        """The specs of the last commit's tensors that a fresh rank has none of: those of
        the items that are not modules (an optimizer's state is created at its first
        step; a module's tensors exist once it is built)."""
        return {name: snap.specs() for name, snap in self._snap.items() if not snap.is_module}

    def allocate(self, published: dict[str, list[TensorSpec]]) -> dict[tuple[str, Any], Any]:
        """New CPU tensors for the entries of ``published`` (``lacking_specs`` of another
        rank) that this rank's items lack, by (item name, place); nothing is written."""
        import torch

        out: dict[tuple[str, Any], torch.Tensor] = {}
        for name, item_specs in published.items():
            value = self._items.get(name)
            if not stateful(value) or is_module(value):
                continue
            own = dict(walk(value.state_dict()))
            for spec in item_specs:
                if spec.path not in own and spec.device_type == "cpu":
                    out[(name, spec.path)] = torch.empty(spec.shape, dtype=dtype_of(spec.dtype))
        return out

    def targets(
        self, desc: CommitDescription, pool: dict[tuple[str, Any], Any] | None = None
    ) -> list[torch.Tensor]:
        """Where this rank receives each tensor of ``desc``: its own tensor at the same
        place of the same item, written in place, or a new one where it has none yet
        (an optimizer's state, created at its first step): taken from ``pool``
        (``allocate``) where one of the same shape and dtype is there. A sharded
        tensor's bytes go into its local shard (``snapshot.local``); a new one is a
        DTensor sharded as its parameter is.

        Raises:
            StateMismatchError: an item is missing, or a tensor has another shape or
                dtype here.
        """
        # From here on the live state is no longer this rank's commit, until ``adopt``
        # (a transfer that fails half way leaves it half written).
        self._mark_stepped()
        object.__setattr__(self, "_intact", False)
        out: list[torch.Tensor] = []
        for name, item_specs in desc.specs.items():
            value = self._items.get(name)
            if not stateful(value):
                raise StateMismatchError(
                    f"the commit has a stateful item {name!r}; this rank has "
                    f"{'none' if value is None else type(value).__name__}"
                )
            own = dict(walk(value.state_dict()))
            for spec in item_specs:
                mine = own.get(spec.path)
                if mine is None:
                    if name in desc.modules:
                        raise StateMismatchError(
                            f"{name}: the commit has {where(spec.path)} "
                            f"{list(spec.shape)}; this rank's module has no such entry"
                        )
                    out.append(new_tensor(name, value, own, spec, pool or {}))
                    continue
                data, dtype = local(mine), dtype_of(spec.dtype)
                if tuple(data.shape) != spec.shape or data.dtype != dtype:
                    raise StateMismatchError(
                        f"{name}: {where(spec.path)} is {list(data.shape)} {data.dtype} "
                        f"here and {list(spec.shape)} {spec.dtype} in the commit (build the "
                        f"model and optimizer the same way on every rank)"
                    )
                out.append(mine)
        return out

    def adopt(self, desc: CommitDescription, tensors: list[torch.Tensor]) -> None:
        """Make ``desc``, whose tensors were received into ``tensors`` (``targets``),
        this rank's state and its last commit."""
        at = 0
        for name, skeleton in desc.skeletons.items():
            count = len(desc.specs[name])
            mine, at = tensors[at : at + count], at + count
            value = self._items[name]
            modular = name in desc.modules
            own = {_place(t) for _, t in walk(value.state_dict())} if modular else set()
            # A module whose tensors all came in place needs no load_state_dict (which
            # would copy every parameter onto itself).
            if not modular or any(_place(t) not in own for t in mine):
                value.load_state_dict(rebuild(skeleton, mine))
        for name, plain in desc.plain.items():
            self._items[name] = copy.deepcopy(plain)
        if desc.rng is not None and self._rng_on:
            rng.restore(desc.rng)
        if not self._take_own_from(desc.commit):
            log.info(
                "no own state of this rank for commit %d on this node: it keeps the "
                "sending rank's generators%s", desc.commit,
                " and own items as constructed" if self._own else "",
            )  # fmt: skip
        self._hold(desc.commit)

    def __repr__(self) -> str:
        return f"State({', '.join(self.names())}; commit {self._commit})"


def _buffer_names(value: object, state_dict: dict[str, Any]) -> frozenset[str]:
    """The state dict keys of a module that are not parameters: its buffers (updated by
    the forward pass, before a failed all-reduce) and extra state, copied at a commit."""
    import torch

    if not isinstance(value, torch.nn.Module):
        return frozenset()
    params = {name for name, _ in value.named_parameters(remove_duplicate=False)}
    return frozenset(key for key in state_dict if key not in params)


def _place(t: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    d = local(t)
    return d.data_ptr(), tuple(d.shape)

"""What a commit holds of one item's ``state_dict()``: the plain values, and the tensors
by reference, not by copy.

Copying the training state at every commit doubles it in memory (a model and its Adam
state: 1.7x the peak of the same training without the API). On CPU no copy is needed:
a survivor learns of a peer's death when the gradient all-reduce fails, before its
optimizer applies the step, so the tensors it holds then are those of its last commit.
A commit therefore keeps

- the plain values of the state dict (a deep copy: learning rates, step counters, a
  sampler's position), with every tensor replaced by a ``Slot``;
- each tensor by reference, with its version counter (torch bumps it at every in-place
  write) to check, at a rollback, that it is still the committed one;
- a *copy* of the tensors that change before the all-reduce can fail: a module's
  buffers (batch-norm running statistics, updated by the forward pass; small), of
  tiny tensors (an optimizer's step counters: a copy costs less than a check), and,
  where the state lives on a GPU (whose collectives fail asynchronously, after later
  kernels may have run) or the user asks for it, every tensor, in host memory that the
  next commit reuses.

``intact()`` says whether the live state still equals the commit; a rank whose state
moved on (an optimizer stepped since the commit: caught by a step hook, as torch's
fused optimizers do not bump version counters) takes the commit from a rank whose state
did not (see ``inprocess.sync``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

#: Tensors this small (scalars: an optimizer's step counters) are copied at every commit: no
#: check needed, and nothing to speak of in memory.
SMALL = 16

#: A path from a state dict's root to one tensor (its keys and indices).
Path = tuple[object, ...]
L = TypeVar("L")


@dataclass(frozen=True)
class Slot:
    """Where a tensor was in a state dict (its index among the dict's tensors)."""

    index: int


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver needs to know of a tensor before its bytes come."""

    path: Path
    shape: tuple[int, ...]
    dtype: str  # str(torch.dtype), e.g. "torch.float32"
    device_type: str  # "cpu" or "cuda": where the sender keeps it
    sharded: bool = False  # a DTensor's local shard (``shape`` is the shard's)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose bytes a commit holds: a DTensor's local shard (FSDP2, HSDP),
    else the tensor itself."""
    inner: torch.Tensor | None = getattr(t, "_local_tensor", None)
    return t if inner is None else inner


@dataclass
class Leaf:
    """One tensor of a commit: its path in the state dict, the live tensor (a DTensor's
    bytes are its local shard's: ``data``), its version then, and a copy where the live
    tensor may move on before a failure is seen."""

    path: Path
    live: torch.Tensor
    version: int
    saved: torch.Tensor | None = None

    @property
    def data(self) -> torch.Tensor:
        return local(self.live)

    def intact(self) -> bool:
        return self.saved is not None or self.data._version == self.version

    def restore(self) -> None:
        if self.saved is not None:
            self.data.copy_(self.saved)
            self.version = self.data._version


@dataclass
class ItemSnapshot:
    """One item's commit: its state dict's skeleton (tensors replaced by slots) and
    its tensors."""

    skeleton: Any
    leaves: list[Leaf]
    is_module: bool

    def tensors(self) -> list[torch.Tensor]:
        """The commit's tensors as its state dict holds them (DTensors, where sharded)."""
        return [leaf.live for leaf in self.leaves]

    def data(self) -> list[torch.Tensor]:
        """The tensors whose bytes the commit holds (a DTensor's local shard)."""
        return [leaf.data for leaf in self.leaves]

    def sharded(self) -> bool:
        return any(leaf.data is not leaf.live for leaf in self.leaves)

    def specs(self) -> list[TensorSpec]:
        """What a receiver must allocate or find for each tensor."""
        return [
            TensorSpec(leaf.path, tuple(d.shape), str(d.dtype), d.device.type, d is not leaf.live)
            for leaf in self.leaves
            for d in (leaf.data,)
        ]

    def nbytes_copied(self) -> int:
        return sum(leaf.saved.nbytes for leaf in self.leaves if leaf.saved is not None)


def walk(value: object) -> Iterator[tuple[Path, torch.Tensor]]:
    """Every tensor of a nested state dict (dicts, lists, tuples), with its path."""
    import torch

    return _leaves(value, torch.Tensor, ())


def _leaves(value: object, kind: type[L], path: Path) -> Iterator[tuple[Path, L]]:
    if isinstance(value, kind):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, kind, (*path, key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _leaves(item, kind, (*path, i))


def take(
    state_dict: Any,
    *,
    is_module: bool,
    copy_names: frozenset[str],
    copy_all: bool,
    previous: ItemSnapshot | None,
) -> ItemSnapshot:
    """A commit of one item's ``state_dict``.

    Args:
        copy_names: the top-level keys whose tensors are copied (a module's buffers).
        copy_all: copy every tensor (opt-in, and for tensors on a GPU: see the module's
            docstring); CUDA tensors are always copied, to host memory.
        previous: the last commit of this item, whose copies are reused when they fit.
    """
    found = list(walk(state_dict))
    # The skeleton: a deep copy of the plain values in which each tensor is a Slot (the
    # memo makes deepcopy take the slot for the tensor; OrderedDict's _metadata, which
    # load_state_dict needs, comes along).
    memo: dict[int, Any] = {id(t): Slot(i) for i, (_, t) in enumerate(found)}
    skeleton = copy.deepcopy(state_dict, memo)
    old = previous.leaves if previous is not None else []
    leaves = []
    for i, (path, tensor) in enumerate(found):
        data = local(tensor)
        leaf = Leaf(path, tensor, data._version)
        wanted = (
            copy_all
            or data.is_cuda
            or data.nbytes <= SMALL
            or (bool(path) and path[0] in copy_names)
        )
        if wanted:
            reuse = old[i].saved if i < len(old) else None
            leaf.saved = _copy_into(data, reuse)
        leaves.append(leaf)
    return ItemSnapshot(skeleton, leaves, is_module)


def _copy_into(tensor: torch.Tensor, reuse: torch.Tensor | None) -> torch.Tensor:
    """A copy of ``tensor`` (in host memory for a CUDA tensor: pinned, written without
    waiting, ordered before the next step's kernels on the same stream), into ``reuse``
    when it fits."""
    import torch

    fits = (
        reuse is not None
        and reuse.shape == tensor.shape
        and reuse.dtype == tensor.dtype
        and reuse.device.type == "cpu"
    )
    if reuse is not None and fits:
        reuse.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
        return reuse
    if tensor.is_cuda:
        out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        out.copy_(tensor.detach(), non_blocking=True)
        return out
    return tensor.detach().clone()


def rebuild(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """The state dict again: ``skeleton`` with each slot replaced by its tensor."""
    memo: dict[int, Any] = {id(s): tensors[s.index] for _, s in _leaves(skeleton, Slot, ())}
    return copy.deepcopy(skeleton, memo)

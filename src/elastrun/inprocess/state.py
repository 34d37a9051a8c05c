"""What a worker keeps across in-process recoveries: its objects and their last commit."""

from __future__ import annotations

import copy
import pickle
from typing import Any

from elastrun.inprocess.parking import park_process_groups


def _stateful(value: object) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


class State:
    """The training state ``elastrun.inprocess.run`` recovers: objects with
    ``state_dict()``/``load_state_dict()`` (a model, an optimizer, a scheduler, a
    sampler) and plain values (a step counter), read and written as attributes.

    ``commit()`` snapshots all of them in memory; a recovery rolls every one back to the
    last commit and, when a peer holds a newer one, takes the peer's. The state right
    after construction is commit 0.
    """

    def __init__(self, **items: Any) -> None:
        object.__setattr__(self, "_items", dict(items))
        object.__setattr__(self, "_commit", 0)
        object.__setattr__(self, "_snapshot", self._take())

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

    def names(self) -> list[str]:
        return sorted(self._items)

    # -- commits --------------------------------------------------------------------------

    @property
    def commit_id(self) -> int:
        """How many times ``commit`` ran (0: the state as constructed)."""
        return int(self._commit)

    def commit(self) -> None:
        """Snapshot every item in memory (the point a recovery comes back to)."""
        park_process_groups()  # see inprocess.parking: the training's own group too
        snapshot = self._take()
        object.__setattr__(self, "_snapshot", snapshot)
        object.__setattr__(self, "_commit", self._commit + 1)

    def rollback(self) -> None:
        """Put every item back as it was at the last commit."""
        self._put(self._snapshot)

    def _take(self) -> dict[str, tuple[bool, Any]]:
        out: dict[str, tuple[bool, Any]] = {}
        for name, value in self._items.items():
            if _stateful(value):
                out[name] = (True, copy.deepcopy(value.state_dict()))
            else:
                out[name] = (False, copy.deepcopy(value))
        return out

    def _put(self, snapshot: dict[str, tuple[bool, Any]]) -> None:
        for name, (stateful, saved) in snapshot.items():
            current = self._items.get(name)
            if stateful and _stateful(current):
                current.load_state_dict(copy.deepcopy(saved))
            else:
                self._items[name] = copy.deepcopy(saved)

    # -- moving a commit between ranks ------------------------------------------------------

    def export_commit(self) -> bytes:
        """The last commit, as bytes another rank can ``import_commit``."""
        return pickle.dumps((self._commit, self._snapshot), protocol=pickle.HIGHEST_PROTOCOL)

    def import_commit(self, blob: bytes) -> None:
        """Take another rank's commit as this one's, and roll back to it."""
        commit, snapshot = pickle.loads(blob)  # from a peer of this very job
        object.__setattr__(self, "_snapshot", snapshot)
        object.__setattr__(self, "_commit", int(commit))
        self.rollback()

    def __repr__(self) -> str:
        return f"State({', '.join(self.names())}; commit {self._commit})"

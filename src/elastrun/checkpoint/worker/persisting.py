"""When a memory checkpoint persists a step (the how is ``persist``'s): decided by the
checkpoint's background thread, in the order of the saves, so the same on every rank."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch.distributed as dist

from elastrun.checkpoint.worker.persist import Persister, PersistSettings
from elastrun.checkpoint.worker.steps import RankSteps

__all__ = ["Agree", "Newest", "PersistScheduler"]

log = logging.getLogger("elastrun.checkpoint")

#: The ranks' agreement whether ``here`` holds on every rank, told what it is for (the
#: words after "the ranks lost each other" when it fails); None: they lost each other.
Agree = Callable[[bool, str], bool | None]
#: The newest step complete on every rank, as the checkpoint knows it now.
Newest = Callable[[], int | None]


class PersistScheduler:
    """When to persist, and the persister that does it (see the module).

    Args:
        settings: where and how often steps are persisted (None: never; every call
            does nothing).
        before_persisted: ``MemoryCheckpoint``'s, the persister's ``before_rename``.

    :meth:`hold`, :meth:`if_due` and :meth:`on_request` are the checkpoint's background
    thread's; the rest the training thread's.
    """

    def __init__(
        self,
        settings: PersistSettings | None,
        *,
        before_persisted: Callable[[int], object] | None = None,
    ) -> None:
        self.settings = settings
        self._before_persisted = before_persisted
        self._persister: Persister | None = None
        self._group: dist.ProcessGroup | None = None
        # A persist is due after every ``every`` steps complete on every rank (None:
        # only on request), counted since the last one began.
        self._every = None if settings is None else settings.every
        self._complete = 0

    @property
    def persisted(self) -> int | None:
        """The newest step this process persisted (None: none yet)."""
        persister = self._persister
        return None if persister is None else persister.persisted

    # -- the training thread's -------------------------------------------------------

    def start(self, rank: int, world: int, directory: str) -> None:
        """With ``persist_dir``: the persister, with a gloo group of its own (made
        here, by every rank, at the checkpoint's setting up)."""
        settings = self.settings
        if settings is None:
            return
        # A group, unlike the checkpoint's agreements (which go through the store): the
        # persist is DCP's collective save, which needs one; its own, so that it never
        # interleaves with the training's collectives from another thread. It is made
        # again, as this persister, when a world rebuilt in place sets up again.
        group = dist.new_group(backend="gloo") if world > 1 else None
        self._persister = Persister(
            settings,
            RankSteps(directory, rank, world),
            group,
            before_rename=self._before_persisted,
        )
        self._group = group

    def close(self) -> None:
        """Finish the persist in flight and release the persister's group."""
        if self._persister is not None:
            self._persister.close()  # (kept: ``persisted`` still answers)
        group, self._group = self._group, None
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)

    def forget(self) -> None:
        """The world was rebuilt under the checkpoint: its persister's group went with
        it; drop the persister (:meth:`start` makes another)."""
        self._group = None  # (destroyed with the world)
        self.close()
        self._persister = None

    def wait(self) -> None:
        """Until the persist in flight is written."""
        persister = self._persister
        if persister is not None:
            persister.wait()

    # -- the background thread's -----------------------------------------------------

    def hold(self) -> None:
        """Before a step is removed: until the persist in flight copied its step out."""
        if self._persister is not None:
            self._persister.wait_snapshot()

    def if_due(self, agreed: bool, agree: Agree, newest: Newest) -> None:
        """After a save (``agreed``: its step is complete on every rank): begin a
        persist of the newest step when one is due and every rank's persister is ready
        (else at a later save). The same on every rank: it follows the ranks'
        agreements."""
        persister = self._persister
        if persister is None:
            return
        self._complete += agreed
        due = self._every is not None and self._complete >= self._every
        if due and self._all_ready(persister, agree):
            self._begin(persister, newest)

    def on_request(self, agree: Agree, newest: Newest) -> None:
        """A ``persist()`` call: after the persist in flight, begin one of the newest
        step."""
        persister = self._persister
        if persister is not None:
            persister.wait()  # (on every rank: then every rank's is idle)
            if self._all_ready(persister, agree):
                self._begin(persister, newest)

    def _all_ready(self, persister: Persister, agree: Agree) -> bool:
        """Whether every rank's persister is idle and unbroken: agreed, so that no rank
        begins a persist (a collective) that another does not."""
        ready = agree(persister.ready(), "before a persist")
        if ready is None:
            return False
        if not ready:
            log.debug("memory checkpoint: a persist waits: one is in flight or stopped")
        return ready

    def _begin(self, persister: Persister, newest: Newest) -> None:
        """Persist the newest step (every rank's persister idle)."""
        self._complete = 0
        step = newest()
        if step is None:
            log.info("memory checkpoint: no step is complete on every rank: nothing to persist")
        elif step == persister.persisted:
            log.info("memory checkpoint: step %d is persisted already", step)
        else:
            persister.begin(step)

    def __repr__(self) -> str:
        return (
            f"PersistScheduler(settings={self.settings!r}, complete={self._complete}, "
            f"persister={self._persister!r})"
        )

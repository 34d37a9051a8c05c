"""Rendezvous for a job that runs on one node: no network, no external service.

Each round is numbered, and each round gets a freshly chosen bootstrap port: the agent
serves a fresh store for its workers there, so a restarted group can never read the keys of a dead
attempt (torch's shared agent store does, see the reference's section 5.1).
"""

from __future__ import annotations

import socket

from elastrun.core.errors import RendezvousClosedError
from elastrun.rendezvous.api import RendezvousHandler, RendezvousInfo, RendezvousStoreInfo
from elastrun.store.memory import MemoryStore

LOOPBACK = "127.0.0.1"


def free_port(host: str = "") -> int:
    """A TCP port that is free right now.

    The port is released before the workers bind it, so another process could take it
    in between; with the kernel's ephemeral range that is rare, and a fresh port is
    chosen on every round, so a clash costs one restart, never a stale connection.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class LocalRendezvousHandler(RendezvousHandler):
    """The rendezvous of a single node: always rank 0 of 1.

    Args:
        run_id: the job's run id.
        master_addr: address exported as MASTER_ADDR.
        master_port: a fixed bootstrap port (static backend); None picks a free port
            every round.
        backend: the backend name this handler stands for.
    """

    def __init__(
        self,
        run_id: str,
        master_addr: str = LOOPBACK,
        master_port: int | None = None,
        backend: str = "c10d",
    ) -> None:
        self._run_id = run_id
        self._addr = master_addr
        self._fixed_port = master_port
        self._backend = backend
        self._store = MemoryStore()
        self._round = -1
        self._closed = False

    def get_backend(self) -> str:
        return self._backend

    @property
    def agent_hosts_bootstrap_store(self) -> bool:
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        if self._closed:
            raise RendezvousClosedError(f"run {self._run_id!r} is closed")
        self._round += 1
        port = self._fixed_port if self._fixed_port else free_port()
        return RendezvousInfo(
            store=self._store,
            rank=0,
            world_size=1,
            bootstrap_store_info=RendezvousStoreInfo(self._addr, port),
            round=self._round,
        )

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        self._closed = True
        return True

    def __repr__(self) -> str:
        return (
            f"LocalRendezvousHandler(run_id={self._run_id!r}, backend={self._backend!r}, "
            f"round={self._round}, closed={self._closed})"
        )

"""The workers' bootstrap store (MASTER_ADDR/PORT) of a round, served by an agent.

With elastrun's own rendezvous handlers the agent of group rank 0 serves the store the
workers bootstrap from, as torchrun's does, so it outlives every worker of the round:
a worker can exit while its peers still use the store.
"""

from __future__ import annotations

import ipaddress
import logging

from elastrun.agent.plan import LaunchPlan
from elastrun.core.errors import RendezvousError, StoreError
from elastrun.store.torchwire.lazy import LazyTorchWireServer

log = logging.getLogger("elastrun.agent")


class BootstrapStore:
    """The store this agent serves for the current round's workers, if any."""

    def __init__(self) -> None:
        self._server: LazyTorchWireServer | None = None

    def host(self, plan: LaunchPlan, *, agents_host: bool) -> None:
        """Serve the round's store when the agents host the workers' store
        (``agents_host``: elastrun's own handlers) and this node is the round's group
        rank 0 (every node's workers reach it there).

        Raises:
            RendezvousError: the store cannot listen at the round's address and port.
        """
        facts = plan.facts
        if facts.group_rank != 0 or not agents_host:
            return
        self._serve(facts.master_addr, facts.master_port)
        log.debug("serving the workers' store for round %d: %r", facts.round, self._server)

    def rehost(self, addr: str) -> int:
        """Serve a fresh store for the next in-process round, on a new port of ``addr``
        (the previous one is closed: its workers left it); returns the port.

        Raises:
            RendezvousError: the store cannot listen.
        """
        self.close()
        return self._serve(addr, 0)

    def _serve(self, addr: str, port: int) -> int:
        """Serve the store at ``addr`` and ``port`` (0: a free one); returns the port."""
        server = LazyTorchWireServer(listen_host(addr), port)
        try:
            bound = server.start()
        except StoreError as exc:
            where = f"{addr}:{port}" if port else addr
            raise RendezvousError(f"cannot serve the workers' store at {where}: {exc}") from exc
        self._server = server
        return bound

    @property
    def serving(self) -> bool:
        """Whether this agent serves the current round's workers' store."""
        return self._server is not None

    def close(self) -> None:
        """Stop serving (the round is over for every node); idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.close()

    def __repr__(self) -> str:
        return f"BootstrapStore(server={self._server!r})"


def listen_host(addr: str) -> str:
    """Where the workers' store listens: only on loopback when the workers reach it
    there (a single node), else on every interface, as torch's own store does."""
    if addr == "localhost":
        return addr
    try:
        return addr if ipaddress.ip_address(addr).is_loopback else ""
    except ValueError:
        return ""  # a host name: the other nodes resolve it to one of our interfaces

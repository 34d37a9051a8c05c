"""The rendezvous handler interface (torch-compatible) and its parameters."""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from elastrun.core.errors import ConfigError
from elastrun.store.api import Store

_TRUE = {"1", "true", "t", "yes", "y"}
_FALSE = {"0", "false", "f", "no", "n"}


@dataclass(frozen=True)
class RendezvousStoreInfo:
    """Where the workers of a round find their bootstrap store (MASTER_ADDR/PORT)."""

    MASTER_ADDR_KEY: ClassVar[str] = "MASTER_ADDR"
    MASTER_PORT_KEY: ClassVar[str] = "MASTER_PORT"

    master_addr: str
    master_port: int


class RoundOutcome(enum.Enum):
    """How a round ended for a node whose own workers finished (its exit barrier)."""

    SUCCEEDED = "succeeded"  # every member's workers finished
    RESTART = "restart"  # a failure or a lost node elsewhere, and the job goes on: re-form
    FAILED = "failed"  # the job ended elsewhere (its restart budget is spent)
    TIMED_OUT = "timed_out"  # the others did not finish in time; this node leaves


@dataclass(frozen=True)
class BarrierResult:
    """The outcome of an exit barrier, and why (for the agent's log line)."""

    outcome: RoundOutcome
    reason: str = ""


@dataclass(frozen=True)
class MemberInfo:
    """One node of a round, as the rendezvous saw it (for rank assignment)."""

    node_id: str
    addr: str
    role: str
    local_world_size: int


class RendezvousInfo:
    """The result of one rendezvous round for this node: its ``rank`` of ``world_size``,
    the ``round`` number (every per-round key lives under its round), the rendezvous
    ``store`` and where the workers find their bootstrap store."""

    def __init__(
        self,
        store: Store,
        rank: int,
        world_size: int,
        bootstrap_store_info: RendezvousStoreInfo,
        round: int = 0,
        members: tuple[MemberInfo, ...] | Callable[[], tuple[MemberInfo, ...]] = (),
        shape: tuple[tuple[str, int, int], ...] = (),
    ) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.bootstrap_store_info = bootstrap_store_info
        self.round = round
        self._members = members
        #: ``(role, local_world_size, count)`` runs of the nodes in group-rank order
        #: (empty: see ``members``).
        self.shape = shape

    @property
    def members(self) -> tuple[MemberInfo, ...]:
        """Every node of the round in group-rank order (empty: identical nodes assumed).

        A handler may read it from its store on first use (O(nodes) bytes): code that
        only needs the nodes' roles and worker counts should use ``shape``.
        """
        if callable(self._members):
            self._members = self._members()
        return self._members

    def __repr__(self) -> str:
        return (
            f"RendezvousInfo(round={self.round}, rank={self.rank}, "
            f"world_size={self.world_size}, bootstrap={self.bootstrap_store_info})"
        )


class RendezvousHandler(abc.ABC):
    """One node's view of a rendezvous (the torch-compatible method set)."""

    @abc.abstractmethod
    def get_backend(self) -> str:
        """The backend name, e.g. ``"c10d"``."""

    @property
    def use_agent_store(self) -> bool:
        """Whether workers should use the agent's store as their bootstrap store.

        True means the rendezvous store itself is shared with the workers (torch's
        c10d handler); elastrun's handlers serve a separate, fresh store every round
        (``agent_hosts_bootstrap_store``) and say False here.
        """
        return False

    @property
    def agent_hosts_bootstrap_store(self) -> bool:
        """Whether the agent of group rank 0 serves the workers' store at the round's
        bootstrap address (elastrun's handlers: it then outlives every worker of the
        round). False leaves it to the workers' rank 0, as torch-style handlers expect.
        """
        return False

    @abc.abstractmethod
    def next_rendezvous(self) -> RendezvousInfo:
        """Block until this node is part of a completed round.

        Raises:
            RendezvousClosedError: the run id was closed.
            RendezvousTimeoutError: the round did not complete in time.
            RendezvousConnectionError: the backend could not be reached.
        """

    @abc.abstractmethod
    def is_closed(self) -> bool: ...

    @abc.abstractmethod
    def set_closed(self) -> None: ...

    @abc.abstractmethod
    def num_nodes_waiting(self) -> int:
        """Nodes waiting to join; > 0 makes the agent re-rendezvous."""

    @abc.abstractmethod
    def get_run_id(self) -> str: ...

    @abc.abstractmethod
    def shutdown(self) -> bool:
        """Close the rendezvous for this run; returns whether that succeeded."""


class RendezvousParameters:
    """Backend name, endpoint, run id, node bounds and backend-specific settings.

    Raises:
        ConfigError: empty backend, ``min_nodes < 1`` or ``max_nodes < min_nodes``.
    """

    def __init__(
        self,
        backend: str,
        endpoint: str,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None = None,
        **kwargs: str,
    ) -> None:
        if not backend:
            raise ConfigError("--rdzv-backend", backend, "must not be empty")
        if min_nodes < 1:
            raise ConfigError("--nnodes", min_nodes, "the minimum must be at least 1")
        if max_nodes < min_nodes:
            raise ConfigError("--nnodes", f"{min_nodes}:{max_nodes}", "maximum below minimum")
        self.backend = backend
        self.endpoint = endpoint
        self.run_id = run_id
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.local_addr = local_addr
        self.config: dict[str, str] = dict(kwargs)

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.config.get(key, default)

    def get_as_bool(self, key: str, default: bool | None = None) -> bool | None:
        raw = self.config.get(key)
        if raw is None:
            return default
        text = str(raw).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ConfigError(f"--rdzv-conf {key}", raw, "must be a boolean (true/false/1/0)")

    def get_as_int(self, key: str, default: int | None = None) -> int | None:
        raw = self.config.get(key)
        if raw is None:
            return default
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"--rdzv-conf {key}", raw, "must be an integer") from None

    def __repr__(self) -> str:
        return (
            f"RendezvousParameters(backend={self.backend!r}, endpoint={self.endpoint!r}, "
            f"run_id={self.run_id!r}, nodes={self.min_nodes}:{self.max_nodes}, "
            f"config={self.config!r})"
        )

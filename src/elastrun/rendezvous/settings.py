"""What a node of the dynamic rendezvous is told at the edge: the run's settings
(bounds and timeouts, validated) and this node's description."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from elastrun.rendezvous.api import MemberInfo


@dataclass(frozen=True)
class RendezvousSettings:
    """Timeouts (seconds) and bounds of a dynamic rendezvous."""

    run_id: str
    min_nodes: int
    max_nodes: int
    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    close_timeout: float = 30.0
    heartbeat_timeout: float = 10.0  # lease TTL: a silent node is dropped after this

    def __post_init__(self) -> None:
        # Validated data: the backends' parsers check --rdzv-conf first, naming the key;
        # this catches a Python caller's NaN, infinite or negative value.
        from elastrun.core.values import parse_int, parse_seconds

        parse_int(self.min_nodes, "min_nodes", low=1)
        parse_int(self.max_nodes, "max_nodes", low=self.min_nodes)
        for name in ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout"):
            parse_seconds(getattr(self, name), name, low_open=True)


@dataclass(frozen=True)
class NodeDesc(MemberInfo):
    """This node, as it joins rounds."""

    @classmethod
    def create(cls, addr: str, role: str, local_world_size: int) -> NodeDesc:
        import os

        return cls(f"{addr}_{os.getpid()}_{uuid.uuid4().hex[:6]}", addr, role, local_world_size)

"""A server for torch's own ``TCPStore`` clients, written without torch.

The agent hosts its workers' bootstrap store (``MASTER_ADDR``/``MASTER_PORT`` with
``TORCHELASTIC_USE_AGENT_STORE=True``) with :class:`TorchWireServer`, so the store
lives as long as the agent rather than as long as rank 0, and the agent never imports
torch. ``codec`` holds the wire format, ``state`` the table and its waiting rules,
``connection`` one client's handling and ``server`` the sockets and the thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastrun.core.lazy import lazy_getattr

if TYPE_CHECKING:
    from elastrun.store.torchwire.codec import DEFAULT_MAX_FRAME, DEFAULT_MAX_KEY
    from elastrun.store.torchwire.lazy import LazyTorchWireServer
    from elastrun.store.torchwire.limits import DEFAULT_MAX_CONNECTIONS
    from elastrun.store.torchwire.server import TorchWireServer

# Resolved on first use: the agent imports this package on its launch path, and the
# server's modules (asyncio among them) are needed only once a worker connects.
_LAZY = {
    "DEFAULT_MAX_FRAME": "elastrun.store.torchwire.codec",
    "DEFAULT_MAX_KEY": "elastrun.store.torchwire.codec",
    "DEFAULT_MAX_CONNECTIONS": "elastrun.store.torchwire.limits",
    "LazyTorchWireServer": "elastrun.store.torchwire.lazy",
    "TorchWireServer": "elastrun.store.torchwire.server",
}


__getattr__ = lazy_getattr(__name__, _LAZY)

__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_FRAME",
    "DEFAULT_MAX_KEY",
    "LazyTorchWireServer",
    "TorchWireServer",
]

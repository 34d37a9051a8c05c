"""The tcp store: our asyncio server and its synchronous client (DESIGN.md section 3).

``TcpStoreServer`` serves one in-memory store to many agents -- embedded in an agent
or on its own with ``elastrun store`` (:mod:`elastrun.launch.commands.store`);
``TcpStore`` is the client, implementing the ``Store`` protocol. The wire format is in
``protocol``.

Names are loaded on first use: an agent that is only a client never imports asyncio.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastrun.core.lazy import lazy_getattr

if TYPE_CHECKING:
    from elastrun.store.tcp.client import TcpStore
    from elastrun.store.tcp.limits import raise_fd_limit
    from elastrun.store.tcp.protocol import DEFAULT_MAX_FRAME, PROTOCOL_VERSION
    from elastrun.store.tcp.server import (
        DEFAULT_DISCONNECT_GRACE,
        TcpStoreServer,
        read_token_file,
    )

_WHERE = {
    "TcpStore": "client",
    "DEFAULT_MAX_FRAME": "protocol",
    "PROTOCOL_VERSION": "protocol",
    "DEFAULT_DISCONNECT_GRACE": "server",
    "TcpStoreServer": "server",
    "raise_fd_limit": "limits",
    "read_token_file": "server",
}
__getattr__ = lazy_getattr(__name__, {name: f"{__name__}.{m}" for name, m in _WHERE.items()})

__all__ = [
    "DEFAULT_DISCONNECT_GRACE",
    "DEFAULT_MAX_FRAME",
    "PROTOCOL_VERSION",
    "TcpStore",
    "TcpStoreServer",
    "raise_fd_limit",
    "read_token_file",
]

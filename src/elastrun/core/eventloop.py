"""The event loop elastrun's busiest asyncio server runs on: uvloop's, when installed.

The workers' bootstrap store (``store.torchwire``) answers every worker of a job at
once when its process groups start. Under the bootstrap-store benchmark's load, on the
shared 2-core machine, uvloop's loop cut that server's CPU per request from 33-48 us to
26-35 us (torch's own libuv server: 23-26 us) and its CPU for a burst of 1,024 clients
from 0.38-0.54 s to 0.24-0.29 s: most of what the standard library's loop spends per
request is its own Python (selector, handles, transport), which uvloop does in C.

uvloop is optional (the ``scale`` extra): the agent imports no third-party package
unconditionally, and without it the standard loop serves the same protocol, slower.
The choice is made here only, when a server starts (never at import time).
"""

from __future__ import annotations

import asyncio


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's when it is installed, else the standard one."""
    try:
        import uvloop  # optional, and tens of milliseconds to import: only when asked
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()

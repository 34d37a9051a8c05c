"""``python -m elastrun.store.tcp``: the same as ``elastrun store``."""

from __future__ import annotations

import sys

from elastrun.store.tcp.server import serve_main

if __name__ == "__main__":
    sys.exit(serve_main(sys.argv[1:]))

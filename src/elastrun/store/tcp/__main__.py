"""``python -m elastrun.store.tcp``: the same as ``elastrun store``.

The command lives in the launch layer (:mod:`elastrun.launch.commands.store`); this
entry point is never imported by anything, so it may reach up to it (pyproject's layer
contract names this one exception).
"""

from __future__ import annotations

import sys

from elastrun.launch.commands.store import store_main

if __name__ == "__main__":
    sys.exit(store_main(sys.argv[1:]))

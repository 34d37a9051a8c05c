"""What a process starter tells the worker bootstrap through its environment.

``SIGINT_HELD_ENV``: set (to ``VERSION``) when the starter started the interpreter with
SIGINT blocked. Python installs its SIGINT handler first thing, and a SIGINT during the
imports before the bootstrap puts the default disposition in place could be lost (a
``KeyboardInterrupt`` raised in the import system's cleanup callbacks is printed as
"ignored"). Blocked, it stays pending until the bootstrap unblocks it, and then ends the
worker at once. The bootstrap takes the variable out of the environment before the
worker's code runs; a value it does not know is ignored (SIGINT stays as inherited).
"""

from __future__ import annotations

VERSION = 1

#: The module a Python worker's command runs (``python -m BOOTSTRAP_MODULE ...``).
BOOTSTRAP_MODULE = "elastrun.worker.bootstrap"
SIGINT_HELD_ENV = "ELASTRUN_SIGINT_HELD"

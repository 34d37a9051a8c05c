"""``elastrun <name> ...``: the tools beside the launcher, one module per subcommand.

Each module parses its subcommand's arguments, calls into the layer that does the work
and returns an exit status (0, 1, or 2 for bad arguments with one line on stderr).
``elastrun.launch.main.SUBCOMMANDS`` maps each name to its ``module:function``, loaded
only when that subcommand runs.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

from elastrun.core.errors import ConfigError


class CommandParser(argparse.ArgumentParser):
    """argparse whose errors are one ``ConfigError`` naming the command (``prog``), not a
    usage message and an exit."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(self.prog, None, message)

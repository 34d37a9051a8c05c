"""What the workers run: the script, module or program the user named, and with what.

``-m`` runs a module, ``--no-python`` a program, ``--run-path`` the script through
``runpy.run_path`` in a child interpreter; otherwise ``python -u script``. The
interpreter is ``PYTHON_EXEC`` when set, else the launcher's own.
"""

from __future__ import annotations

import enum
import os
import shutil
import sys
from collections.abc import Mapping

from elastrun.core.errors import ConfigError
from elastrun.launch.argv import Values

__all__ = ["ScriptKind", "check_script", "interpreter", "script_kind"]


class ScriptKind(enum.Enum):
    """How the workers run the script the user named."""

    SCRIPT = "script"  # python -u <script> ...
    MODULE = "module"  # python -u -m <module> ...
    BINARY = "binary"  # <program> ... (--no-python)
    RUN_PATH = "run_path"  # runpy.run_path(<script>) in a child (--run-path)


def script_kind(values: Values, notices: list[str]) -> ScriptKind:
    """``-m``, ``--no-python`` and ``--run-path`` as one :class:`ScriptKind`.

    Raises:
        ConfigError: ``-m`` together with ``--no-python``.
    """
    module, no_python = values.flag("module"), values.flag("no_python")
    if module and no_python:
        raise ConfigError(values.source("no_python"), True, "cannot be combined with -m/--module")
    if values.flag("run_path"):
        if module or no_python:
            notices.append("--run-path takes precedence over -m/--module and --no-python")
        return ScriptKind.RUN_PATH
    if module:
        return ScriptKind.MODULE
    return ScriptKind.BINARY if no_python else ScriptKind.SCRIPT


def check_script(kind: ScriptKind, script: str, environ: Mapping[str, str]) -> None:
    """Refuse a script file that does not exist or a program not on ``PATH``.

    A module is not checked: importing it here would run user code in the launcher.

    Raises:
        ConfigError: naming ``script`` and the value.
    """
    if kind is ScriptKind.MODULE:
        return
    if kind is ScriptKind.BINARY:
        if shutil.which(script, path=environ.get("PATH", os.defpath)) is None:
            where = "is not an executable file" if os.sep in script else "is not found on PATH"
            raise ConfigError("script", script, f"{where} (--no-python)")
        return
    if not os.path.exists(script):
        raise ConfigError("script", script, "no such file")


def interpreter(kind: ScriptKind, environ: Mapping[str, str]) -> str:
    """The interpreter of script and module workers: ``PYTHON_EXEC``, else ours.

    Raises:
        ConfigError: a ``PYTHON_EXEC`` that is not an executable (script and module
            workers only; the others do not use it).
    """
    python = environ.get("PYTHON_EXEC") or sys.executable
    if kind not in (ScriptKind.SCRIPT, ScriptKind.MODULE) or not environ.get("PYTHON_EXEC"):
        return python
    if shutil.which(python, path=environ.get("PATH", os.defpath)) is None:
        where = "is not an executable file" if os.sep in python else "is not found on PATH"
        raise ConfigError("PYTHON_EXEC", python, where)
    return python

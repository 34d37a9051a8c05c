"""What the workers run: the script, module or program the user named, and with what.

``-m`` runs a module, ``--no-python`` a program, ``--run-path`` the script through
``runpy.run_path`` in a child interpreter; otherwise ``python -u script``. The
interpreter is ``PYTHON_EXEC`` when set, else the launcher's own.
"""

from __future__ import annotations

import enum
import os
import shutil
import stat
import sys
from collections.abc import Mapping

from elastrun.core.errors import ConfigError
from elastrun.launch.argv import Values

__all__ = ["ScriptKind", "check_script", "find_module", "interpreter", "script_kind"]


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


def check_script(
    kind: ScriptKind, script: str, environ: Mapping[str, str], python: str | None = None
) -> None:
    """Refuse what the workers could not run, before any of them starts.

    * a script (or ``--run-path`` file) that does not exist, a directory without a
      ``__main__.py``, or something that is not a regular file (``/dev/zero``: every
      worker would read it until memory ran out);
    * a ``-m`` name that is not a dotted module name, or (when the workers use this
      interpreter, ``python``) a module that cannot be found: see :func:`find_module`;
    * a ``--no-python`` program that is not an executable file or not on ``PATH``.

    Raises:
        ConfigError: naming ``script`` (``-m`` for a module) and the value.
    """
    if kind is ScriptKind.MODULE:
        _check_module(script, python)
        return
    if kind is ScriptKind.BINARY:
        if shutil.which(script, path=environ.get("PATH", os.defpath)) is None:
            where = "is not an executable file" if os.sep in script else "is not found on PATH"
            raise ConfigError("script", script, f"{where} (--no-python)")
        return
    try:
        mode = os.stat(script).st_mode
    except FileNotFoundError:
        raise ConfigError("script", script, "no such file") from None
    except OSError as exc:
        raise ConfigError("script", script, f"cannot be read: {exc.strerror or exc}") from None
    if stat.S_ISDIR(mode):
        # Python runs a directory through its __main__ module, as it runs a zip file.
        if not any(
            os.path.isfile(os.path.join(script, f"__main__.{ext}")) for ext in ("py", "pyc")
        ):
            raise ConfigError("script", script, "is a directory with no __main__.py")
    elif not stat.S_ISREG(mode):
        raise ConfigError("script", script, "is not a regular file (a device, FIFO or socket)")


def _check_module(name: str, python: str | None) -> None:
    parts = name.split(".")
    if not all(part.isidentifier() for part in parts):
        raise ConfigError("-m", name, "is not a module name (dotted Python identifiers)")
    if python is None or not _same_interpreter(python):
        return  # another interpreter has another sys.path: only the workers can tell
    if not find_module(name):
        raise ConfigError(
            "-m",
            name,
            "no such module on the workers' path (the working directory, then this "
            "interpreter's sys.path)",
        )


def _same_interpreter(python: str) -> bool:
    """Whether ``python`` is this very interpreter, by path. Not by the file it links to:
    a virtual environment's ``python`` links to the base interpreter, whose
    ``sys.path`` is another one."""
    found = shutil.which(python) if os.sep not in python else python
    return found is not None and os.path.abspath(found) == os.path.abspath(sys.executable)


def find_module(name: str, cwd: str | None = None) -> bool:
    """Whether ``python -m name`` run in ``cwd`` would find ``name``, importing nothing.

    ``importlib.util.find_spec`` of a submodule imports its parent packages, which
    would run user code (a training package's ``__init__`` may import torch) in the
    launcher. Instead: the top-level name is looked up the way the import system
    starts, which imports nothing (the working directory first, as workers run with it
    as ``sys.path[0]``, then this interpreter's finders and ``sys.path``); each
    submodule is then looked for by its file in its parent's directories, plus the
    same directory under every ``sys.path`` entry (what ``pkgutil.extend_path`` adds
    for old-style namespace packages). A package whose ``__init__`` creates its
    submodules in code is not seen: such a name is reported missing.
    """
    import importlib.machinery
    import importlib.util

    top, *rest = name.split(".")
    path = [cwd or os.getcwd(), *sys.path]
    spec = importlib.machinery.PathFinder.find_spec(top, path)
    if spec is None:
        try:
            spec = importlib.util.find_spec(top)  # builtins, frozen, installed finders
        except (ImportError, ValueError):  # ValueError: in sys.modules without a spec
            return top in sys.modules
    prefix = top
    for part in rest:
        if spec is None or spec.submodule_search_locations is None:
            return False  # not a package: it has no submodules
        extra = [os.path.join(entry, *prefix.split(".")) for entry in path]
        search = [*spec.submodule_search_locations, *(d for d in extra if os.path.isdir(d))]
        prefix = f"{prefix}.{part}"
        spec = importlib.machinery.PathFinder.find_spec(prefix, search)
    return spec is not None


#: How long the ``PYTHON_EXEC`` check waits for an answer: a container wrapper may be
#: slow to start. Past it, the interpreter is given the benefit of the doubt.
PROBE_TIMEOUT = 30.0


def interpreter(kind: ScriptKind, environ: Mapping[str, str]) -> str:
    """The interpreter of script and module workers: ``PYTHON_EXEC``, else ours.

    A ``PYTHON_EXEC`` other than this interpreter is run once with ``-c`` (see
    :func:`check_python`): ``/bin/true`` reported success without running anything.

    Raises:
        ConfigError: a ``PYTHON_EXEC`` that is not an executable, or that does not run
            Python code (script and module workers only; the others do not use it).
    """
    python = environ.get("PYTHON_EXEC") or sys.executable
    if kind not in (ScriptKind.SCRIPT, ScriptKind.MODULE) or not environ.get("PYTHON_EXEC"):
        return python
    found = shutil.which(python, path=environ.get("PATH", os.defpath))
    if found is None:
        where = "is not an executable file" if os.sep in python else "is not found on PATH"
        raise ConfigError("PYTHON_EXEC", python, where)
    if not _same_interpreter(found):
        check_python(python, environ)
    return python


def check_python(python: str, environ: Mapping[str, str], timeout: float = PROBE_TIMEOUT) -> None:
    """Refuse a program that does not run Python code: ``python -c 'print(6*7)'`` must
    print 42 as its last line.

    Why run it: nothing in a file tells a Python interpreter apart from a wrapper
    script, a shim or ``/bin/true``, and only the last would make every worker "succeed"
    without running the script. The check costs one interpreter start, and only when
    ``PYTHON_EXEC`` names another interpreter than ours. It runs in its own session,
    and is killed with all it started if it does not answer within ``timeout`` seconds
    (then it is accepted: a slow wrapper is not a wrong one).

    Raises:
        ConfigError: naming ``PYTHON_EXEC``, its value and what the check saw.
    """
    import signal
    import subprocess

    try:
        proc = subprocess.Popen(
            [python, "-c", "print(6*7)"],
            env=dict(environ),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError as exc:
        raise ConfigError("PYTHON_EXEC", python, f"cannot be run: {exc.strerror or exc}") from None
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return
    lines = out.decode(errors="replace").split()
    if proc.returncode != 0 or not lines or lines[-1] != "42":
        raise ConfigError(
            "PYTHON_EXEC",
            python,
            f"is not a Python interpreter: `{python} -c 'print(6*7)'` exited "
            f"{proc.returncode} without printing 42",
        )

"""Which worker commands the template can run, and which modules it preloads for them.

Only Python script workers go through the template: an argv of the form
``(python, [OPTS], "-m", "elastrun.worker.bootstrap", ...)`` whose ``python`` is the
starter's interpreter (:func:`parse_bootstrap_command`). What it preloads besides
``--preload`` is what the worker's script imports at top level among
:data:`AUTO_PRELOAD_ROOTS` (:func:`default_preload`), read from the script's syntax
tree, never by running it.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Sequence
from dataclasses import dataclass

from elastrun.wire.bootstrap import BOOTSTRAP_MODULE

#: Modules preloaded automatically when a worker script imports them at top level.
#: Both are known to import without starting threads or touching a GPU.
AUTO_PRELOAD_ROOTS = ("torch", "numpy")
#: What torch imports only on first use of a name, worth preloading when a script that
#: imports torch uses it: DistributedDataParallel's first construction imports
#: torch._dynamo (and sympy), seconds per new worker on every restart; so does the
#: first optimizer's (``torch.optim.X``, ``from torch import optim``).
LAZY_TORCH_IMPORTS = {"DistributedDataParallel": "torch._dynamo", "optim": "torch._dynamo"}


#: A script that uses in-process recovery starts a replacement worker at every failure,
#: and each import on the replacement's way to its first step is on the recovery's
#: critical path: for such a script the imports inside its functions are preloaded too
#: (those of ``AUTO_PRELOAD_ROOTS`` and elastrun's worker side), and so are the modules
#: a recovery imports only when it starts (tens of milliseconds a replacement).
INPROCESS_MODULE = "elastrun.inprocess"
INPROCESS_PRELOAD = (
    "elastrun.inprocess",
    "elastrun.inprocess.worker.sync",
    "elastrun.inprocess.worker.sharded",
)
_WORKER_SIDE = ("elastrun.inprocess", "elastrun.checkpoint")

#: Interpreter options that take a separate value (``-W error``, ``-X dev``).
OPTS_WITH_VALUE = frozenset({"-W", "-X", "--check-hash-based-pycs"})
# Scripts larger than this are not scanned for imports (a generated file, not a script).
_MAX_SCAN_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class BootstrapCommand:
    """A worker argv that the template can run: interpreter options and bootstrap args."""

    options: tuple[str, ...]
    args: tuple[str, ...]  # what follows ``-m elastrun.worker.bootstrap``


def parse_bootstrap_command(argv: Sequence[str], python: str) -> BootstrapCommand | None:
    """Split ``(python, [OPTS], "-m", BOOTSTRAP, ARGS...)``; None for any other argv.

    ``argv[0]`` must be ``python`` (the same file, after resolving links).
    """
    if len(argv) < 4 or not same_file(argv[0], python):
        return None
    end = options_end(argv[1:])
    if end is None or tuple(argv[end + 1 : end + 3]) != ("-m", BOOTSTRAP_MODULE):
        return None
    args = tuple(argv[end + 3 :])
    return BootstrapCommand(tuple(argv[1 : end + 1]), args) if args else None


def options_end(args: Sequence[str]) -> int | None:
    """Where the interpreter options that ``args`` (a command line without the
    interpreter) begins with end: the index of ``-m`` or of the script; None for
    ``-c`` and ``-`` (stdin)."""
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "-m":
        if args[i] in ("-c", "-"):
            return None
        i += 2 if args[i] in OPTS_WITH_VALUE else 1
    return i


def same_file(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name the same file (after resolving links)."""
    if a == b:
        return True
    try:
        return os.path.realpath(a) == os.path.realpath(b)
    except OSError:
        return False


def default_preload(argv: Sequence[str], cwd: str | None = None) -> list[str]:
    """The modules worth preloading for a worker: those of ``AUTO_PRELOAD_ROOTS`` that
    the worker's script imports outside functions and classes, in the script's order.

    ``argv`` is the worker's argv (``python ... -m elastrun.worker.bootstrap SCRIPT``
    or ``... -m MODULE``); a module is looked up as ``MODULE.py`` or
    ``MODULE/__main__.py`` under ``cwd``. Anything that cannot be read or parsed gives
    an empty list: preloading is an optimisation, never a reason to fail.
    """
    cmd = parse_bootstrap_command(argv, argv[0]) if argv else None
    if cmd is None:
        return []
    base = os.getcwd() if cwd is None else cwd
    if cmd.args[0] == "-m":
        if len(cmd.args) < 2:
            return []
        rel = cmd.args[1].replace(".", os.sep)
        candidates = [rel + ".py", os.path.join(rel, "__main__.py")]
    else:
        candidates = [cmd.args[0]]
    for candidate in candidates:
        path = os.path.join(base, candidate)
        if os.path.isfile(path):
            return _scan_imports(path)
    return []


def _name_of(node: ast.AST) -> str | None:
    """The name a node uses: ``x``, ``a.x`` and ``import a.x as y`` all use ``x``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.alias):
        return node.name.rpartition(".")[2]
    return None


def _scan_imports(path: str) -> list[str]:
    try:
        if os.path.getsize(path) > _MAX_SCAN_BYTES:
            return []
        with open(path, "rb") as fh:
            tree = ast.parse(fh.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return []
    found: list[str] = []

    def visit(body: Sequence[ast.stmt]) -> None:
        for node in body:
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                # if/try/with blocks at module level run at import time too.
                for field in ("body", "orelse", "finalbody", "handlers"):
                    inner = getattr(node, field, None)
                    if isinstance(inner, list):
                        visit([n for n in inner if isinstance(n, ast.stmt)])
                        for handler in inner:
                            if isinstance(handler, ast.ExceptHandler):
                                visit(handler.body)
            for name in _imported(node):
                if name.split(".")[0] in AUTO_PRELOAD_ROOTS and name not in found:
                    found.append(name)

    visit(tree.body)
    _add_recovery_path(tree, found)
    if any(name.split(".")[0] == "torch" for name in found):
        used = {_name_of(n) for n in ast.walk(tree)}
        for name, mod in LAZY_TORCH_IMPORTS.items():
            if name in used and mod not in found:
                found.append(mod)
    return found


def _imported(node: ast.AST) -> list[str]:
    """The absolute modules ``node`` imports (none: it is no import)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module]
    return []


def _add_recovery_path(tree: ast.AST, found: list[str]) -> None:
    """For a script that imports ``elastrun.inprocess`` (anywhere): add what it imports
    inside functions too, and what a recovery imports (see ``INPROCESS_PRELOAD``)."""
    anywhere = [name for node in ast.walk(tree) for name in _imported(node)]
    if not any(n == INPROCESS_MODULE or n.startswith(INPROCESS_MODULE + ".") for n in anywhere):
        return
    for name in [*anywhere, *INPROCESS_PRELOAD]:
        ours = name.split(".")[0] in AUTO_PRELOAD_ROOTS or name.startswith(_WORKER_SIDE)
        if ours and name not in found:
            found.append(name)

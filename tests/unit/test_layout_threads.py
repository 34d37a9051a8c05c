"""Every thread in the package starts in an ``elastrun.core.threads.Nursery``.

One place names the threads, picks the daemon flag and bounds the joins; a
``threading.Thread(...)`` anywhere else is a thread the next reader has to audit alone.
The check reads the source's syntax tree, so a type annotation (``threading.Thread |
None``) is not a start, while a subclass of ``Thread`` or ``from threading import
Thread`` is. The helper's thread makers outside a nursery (``start_thread``,
``new_thread``) went: such a thread was stopped by an idiom of its owner's, which is
what the nursery replaced (a thread whose owner waits for its result is
``Nursery.call``; one that ends on its own is joined by closing its nursery with a
deadline). The second check keeps them from coming back under those names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import elastrun

PACKAGE_DIR = Path(elastrun.__file__).resolve().parent

#: The helper itself.
HELPER = "core/threads.py"
#: Places that start their own threads, each for a reason: none now. One added must say
#: why, and leave the list once it uses the helper (checked below).
ALLOWED: dict[str, str] = {}


def thread_starts(source: str, filename: str = "<source>") -> list[int]:
    """The lines of ``source`` that make a thread without the helper: a call of
    ``threading.Thread``, a class derived from it, or an import of the name ``Thread``
    from ``threading``."""

    def is_thread(node: ast.expr) -> bool:
        return (
            isinstance(node, ast.Attribute)
            and node.attr == "Thread"
            and isinstance(node.value, ast.Name)
            and node.value.id == "threading"
        )

    def makes_one(node: ast.stmt | ast.expr) -> bool:
        if isinstance(node, ast.Call):
            return is_thread(node.func)
        if isinstance(node, ast.ClassDef):
            return any(is_thread(base) for base in node.bases)
        if isinstance(node, ast.ImportFrom) and node.module == "threading":
            return any(alias.name == "Thread" for alias in node.names)
        return False

    nodes = [n for n in ast.walk(ast.parse(source, filename)) if isinstance(n, ast.stmt | ast.expr)]
    return sorted(node.lineno for node in nodes if makes_one(node))


def _where(path: Path) -> str:
    return path.relative_to(PACKAGE_DIR).as_posix()


def _allowed(where: str) -> bool:
    return where == HELPER or any(where.startswith(place) for place in ALLOWED)


def _starts_by_file() -> dict[str, list[int]]:
    found = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        lines = thread_starts(path.read_text(encoding="utf-8"), str(path))
        if lines:
            found[_where(path)] = lines
    return found


def test_no_thread_is_started_outside_the_helper_and_the_allow_list() -> None:
    strays = {where: lines for where, lines in _starts_by_file().items() if not _allowed(where)}
    assert strays == {}, (
        f"start threads in an elastrun.core.threads.Nursery, not threading.Thread: {strays}"
    )


def test_every_place_on_the_allow_list_still_starts_a_thread_of_its_own() -> None:
    found = _starts_by_file()
    stale = [place for place in ALLOWED if not any(where.startswith(place) for where in found)]
    assert stale == [], f"these places use the helper now; drop them from ALLOWED: {stale}"
    assert HELPER in found  # the check looks where the threads are really made


def test_the_check_sees_calls_subclasses_and_imports_but_not_annotations() -> None:
    source = "\n".join([
        "import threading",
        "t: threading.Thread | None = None",
        "t = threading.Thread(target=f, daemon=True)",  # 3
        "class Worker(threading.Thread):",  # 4
        "    pass",
        "from threading import Event, Thread as T",  # 6
        "threading.Thread",
        "u = start_thread(f, name='x')",
    ])  # fmt: skip
    assert thread_starts(source) == [3, 4, 6]


def nursery_bypasses(source: str, filename: str = "<source>") -> list[int]:
    """The lines of ``source`` that start a thread with ``start_thread`` or
    ``new_thread`` (by name or as an attribute), not in a nursery."""
    lines = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Call):
            f = node.func
            name = (
                f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            )
            if name in ("start_thread", "new_thread"):
                lines.append(node.lineno)
    return sorted(lines)


def _bypasses_by_file() -> dict[str, list[int]]:
    found = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        where = _where(path)
        lines = nursery_bypasses(path.read_text(encoding="utf-8"), str(path))
        if lines and where != HELPER:
            found[where] = lines
    return found


def test_every_thread_starts_in_a_nursery() -> None:
    strays = _bypasses_by_file()
    assert strays == {}, (
        "start an owner's threads in an elastrun.core.threads.Nursery (start, or call "
        f"for a thread whose result the owner waits for): {strays}"
    )


def test_the_nursery_check_sees_calls_by_name_and_by_attribute() -> None:
    source = "\n".join([
        "from elastrun.core import threads",
        "t = start_thread(f, name='x')",  # 2
        "u = threads.new_thread(f, name='y')",  # 3
        "nursery.start(f, name='z')",
        "start_thread",
    ])  # fmt: skip
    assert nursery_bypasses(source) == [2, 3]

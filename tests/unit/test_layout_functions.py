"""No function in the package is longer than 60 lines (STYLE.md, rule 3), and no module
longer than 500.

A function past that length is doing orchestration and work at once. The length is
counted from the ``def`` line to the function's last line, docstring and comments
included (decorators not): a function is not made shorter by joining its lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import elastrun

PACKAGE_DIR = Path(elastrun.__file__).resolve().parent
MAX_LINES = 60

#: Functions allowed past the limit, ``"<path under elastrun/>:<qualified name>"``, each
#: with its length when listed. This list may only shrink: never add to it (split the
#: function instead); remove an entry once its function is split (the test below fails
#: for an entry that is no longer too long, or no longer exists). It is empty: every
#: function in the package fits.
ALLOWED: dict[str, int] = {}


def long_functions(source: str, limit: int = MAX_LINES) -> dict[str, int]:
    """The functions of ``source`` longer than ``limit`` lines: qualified name -> length.

    Methods are named ``Class.method`` and nested functions ``outer.inner``; a nested
    function counts within its outer function too.
    """
    found: dict[str, int] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                length = (child.end_lineno or child.lineno) - child.lineno + 1
                if length > limit:
                    found[name] = length
                walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")
            else:
                walk(child, prefix)

    walk(ast.parse(source), "")
    return found


def package_long_functions() -> dict[str, int]:
    found: dict[str, int] = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        where = path.relative_to(PACKAGE_DIR).as_posix()
        for name, length in long_functions(path.read_text(encoding="utf-8")).items():
            found[f"{where}:{name}"] = length
    return found


def test_no_function_in_the_package_is_longer_than_60_lines() -> None:
    found = package_long_functions()
    too_long = {name: n for name, n in found.items() if name not in ALLOWED}
    assert not too_long, (
        f"functions over {MAX_LINES} lines (split them by what they do): {too_long}"
    )


def test_the_allow_list_of_long_functions_only_shrinks() -> None:
    found = package_long_functions()
    stale = [name for name in ALLOWED if name not in found]
    assert not stale, f"no longer over {MAX_LINES} lines: remove from ALLOWED: {stale}"
    grown = {name: found[name] for name, n in ALLOWED.items() if found[name] > n}
    assert not grown, f"allowed functions that grew (split them instead): {grown}"


def test_the_length_check_counts_methods_nested_functions_and_docstrings() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(57))
    source = "\n".join(
        [
            "class A:",
            "    @property",
            "    def short(self) -> int:",
            "        return 1",
            "",
            "    def method(self) -> None:",
            '        """Docstring lines count."""',
            "        def inner() -> None:",
            "            pass",
            *[f"    {line}" for line in body.splitlines()],
            "",
            "def at_the_limit() -> None:",
            *body.splitlines()[:-1],
            '    """And so do blank and comment lines."""',
            "    # a comment",
            "    pass",
        ]
    )
    assert long_functions(source) == {"A.method": 61}
    # Counted from the def line (not the decorator's) to the last line.
    everything = {"A.short": 2, "A.method": 61, "A.method.inner": 2, "at_the_limit": 60}
    assert long_functions(source, limit=1) == everything


#: No module is longer than this: past it, a module holds two things (split it by them).
MAX_MODULE_LINES = 500


def test_no_module_in_the_package_is_longer_than_500_lines() -> None:
    too_long = {
        path.relative_to(PACKAGE_DIR).as_posix(): n
        for path in sorted(PACKAGE_DIR.rglob("*.py"))
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines (split them): {too_long}"

"""No module outside ``elastrun.wire`` spells out an ``ELASTRUN_*`` or ``TORCHELASTIC_*`` name.

Each such variable is defined once, as a constant of the wire (most in ``wire.env``), and
every other module imports it: two spellings of one name drift apart unnoticed (a typo
reads as "unset"). The check reads the syntax tree: a string constant that *is* such a
name counts wherever it stands (a subscript, a call's argument, a dict's key, a piece of
an f-string); a docstring or a message that mentions one inside a sentence does not, nor
does an entry of ``__all__`` (a Python name that happens to look the same).
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import elastrun

PACKAGE_DIR = Path(elastrun.__file__).resolve().parent
WIRE = "wire/"
NAME = re.compile(r"(ELASTRUN|TORCHELASTIC)_[A-Z0-9_]*[A-Z0-9]")


def _all_entries(tree: ast.AST) -> set[int]:
    """The ids of the string constants in ``__all__ = [...]`` (and ``+=``)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            found.update(id(c) for c in ast.walk(node) if isinstance(c, ast.Constant))
    return found


def spelled_names(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """(line, name) of each string constant of ``source`` that is exactly a variable's
    name, ``__all__``'s entries aside."""
    tree = ast.parse(source, filename)
    skip = _all_entries(tree)
    return sorted(
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and NAME.fullmatch(node.value)
        and id(node) not in skip
    )


def _where(path: Path) -> str:
    return path.relative_to(PACKAGE_DIR).as_posix()


def _spelled_by_file() -> dict[str, list[tuple[int, str]]]:
    found = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        names = spelled_names(path.read_text(encoding="utf-8"), str(path))
        if names:
            found[_where(path)] = names
    return found


def test_no_module_outside_the_wire_spells_out_a_variable_name() -> None:
    strays = {where: names for where, names in _spelled_by_file().items() if WIRE not in where}
    assert strays == {}, f"import these names' constants from elastrun.wire: {strays}"


def test_the_wire_defines_each_variable_name_once() -> None:
    found = _spelled_by_file()
    counts = Counter(name for where, names in found.items() if WIRE in where for _, name in names)
    assert "TORCHELASTIC_ERROR_FILE" in counts  # the check looks where the names are
    assert [name for name, n in counts.items() if n > 1] == []


def test_the_check_sees_bare_names_but_not_sentences_docstrings_or_all() -> None:
    source = "\n".join([
        '"""Reads ELASTRUN_PROGRESS_FILE."""',
        '__all__ = ["ELASTRUN_X"]',
        'a = os.environ["TORCHELASTIC_RUN_ID"]',  # 3
        'b = env.get("ELASTRUN_INPROCESS", "1")',  # 4
        'c = {"TORCHELASTIC_RESTART_COUNT": "0"}',  # 5
        'log.info("set ELASTRUN_STACKS_FILE to %s", p)',
        'd = f"{x} ELASTRUN_Y"',
        'e = "TORCHELASTIC_".startswith(n)',
        'f = ConfigError("ELASTRUN_STORE_TOKEN", v, "bad")',  # 9
    ])  # fmt: skip
    assert spelled_names(source) == [
        (3, "TORCHELASTIC_RUN_ID"),
        (4, "ELASTRUN_INPROCESS"),
        (5, "TORCHELASTIC_RESTART_COUNT"),
        (9, "ELASTRUN_STORE_TOKEN"),
    ]

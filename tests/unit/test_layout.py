"""Rules about the package's layout that import-linter cannot state.

import-linter's contracts are about which *modules* import which (layers, forbidden,
independence); a contract sees ``from elastrun.a import _b`` only as the edge
``elastrun.x -> elastrun.a``, never the imported name. Whether what crosses a module
boundary is private is therefore checked here, on the source's syntax tree.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
import tomllib
from collections.abc import Iterable
from pathlib import Path

import grimp

import elastrun

PACKAGE_DIR = Path(elastrun.__file__).resolve().parent


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_name(path: Path) -> tuple[str, bool]:
    """The dotted name of the module in ``path`` and whether it is a package."""
    parts = ("elastrun", *path.relative_to(PACKAGE_DIR).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _imported_module(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    here = module.split(".") if is_package else module.split(".")[:-1]
    base = here[: len(here) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def private_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """Every import in ``source`` (the text of ``module``) of an underscored name, or of
    an underscored module, from an elastrun module: ``"<line>: <module>.<name>"``."""
    found = []
    for node in ast.walk(ast.parse(source, module)):
        if isinstance(node, ast.ImportFrom):
            origin = _imported_module(node, module, is_package)
            if origin != "elastrun" and not origin.startswith("elastrun."):
                continue
            names = [f"{origin}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("elastrun.")]
        else:
            continue
        for dotted in names:
            if any(_is_private(part) for part in dotted.split(".")):
                found.append(f"{node.lineno}: {dotted}")
    return found


def test_no_module_of_the_package_imports_another_modules_private_names() -> None:
    offenders = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        module, is_package = _module_name(path)
        hits = private_imports(path.read_text(encoding="utf-8"), module, is_package)
        if hits:
            offenders[module] = hits
    assert offenders == {}, (
        "private names imported across modules (make them public and documented, "
        f"or move them): {offenders}"
    )


def test_the_private_import_check_sees_absolute_relative_and_module_imports() -> None:
    source = (
        "from elastrun.supervise.processes.spawn import _Handle, adopt_child\n"
        "from .template import _x, __version__\n"
        "from .. import failures\n"
        "import elastrun._private.mod\n"
        "from os import _exit\n"
        "from . import _sibling\n"
    )
    hits = private_imports(source, "elastrun.supervise.processes.probe")
    assert hits == [
        "1: elastrun.supervise.processes.spawn._Handle",
        "2: elastrun.supervise.processes.template._x",
        "4: elastrun._private.mod",
        "6: elastrun.supervise.processes._sibling",
    ]
    in_package = private_imports("from .spawn import _Handle\n", "elastrun.supervise", True)
    assert in_package == ["1: elastrun.supervise.spawn._Handle"]


#: Concepts whose two sides run in different processes, each one folder: no module
#: outside it is named after it. The wire formats are the one exception by design
#: (``elastrun.wire``: every format in one place, versioned).
CONCEPT_FOLDERS = {
    "template": ("template", "zygote"),
    "pace": ("pace", "progress", "straggler", "hang"),
    "inprocess": ("inprocess",),
    "nodecheck": ("nodecheck", "checkboard"),
}
#: Modules named like a concept that are another thing.
NOT_THE_CONCEPT = {
    "elastrun.rendezvous.progress": "the rendezvous's waiting line, not the workers' progress",
}


def test_each_cross_process_concept_lives_in_one_folder() -> None:
    strays = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        module, _ = _module_name(path)
        parts = module.split(".")[1:]
        if not parts or parts[0] == "wire" or module in NOT_THE_CONCEPT:
            continue
        for folder, words in CONCEPT_FOLDERS.items():
            named = [p for p in parts if any(p.startswith(w) for w in words)]
            if named and parts[0] != folder:
                strays.append(f"{module} (belongs in elastrun.{folder})")
    assert strays == []
    for folder in CONCEPT_FOLDERS:
        assert (PACKAGE_DIR / folder / "__init__.py").is_file()


# -- the import contracts name packages, and every module is under one of them -----------

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
#: The two contracts that place every module: the agent side's layers, and the worker
#: side (the source of the contract that keeps it from importing the agent side).
LAYERS = "Layers point one way (DESIGN.md section 2)"
WORKER_SIDE = "Worker-side helpers never import the agent side"
#: Modules no side owns, by design: the package's facade and entry point, the concept
#: folders' own ``__init__`` (each re-exports its public names by name, loading neither
#: side until one is read), and the fakes for tests.
FACADES = {
    "elastrun",
    "elastrun.__main__",
    "elastrun.checkpoint",
    "elastrun.inprocess",
    "elastrun.nodecheck",
    "elastrun.pace",
    "elastrun.template",
    "elastrun.testing",
}


def contract_sides(pyproject: str) -> list[str]:
    """The packages the layers contract and the worker side's contract name, in order
    (a layer row's siblings, split at ``:`` and ``|``, one each)."""
    contracts = tomllib.loads(pyproject)["tool"]["importlinter"]["contracts"]
    by_name = {contract["name"]: contract for contract in contracts}
    rows = by_name[LAYERS]["layers"]
    layers = [part.strip() for row in rows for part in re.split(r"[:|]", row)]
    return [*layers, *by_name[WORKER_SIDE]["source_modules"]]


def owners(module: str, sides: list[str]) -> list[str]:
    """The sides ``module`` falls under (itself or a package above it)."""
    return [side for side in sides if module == side or module.startswith(side + ".")]


def test_every_module_falls_under_exactly_one_side_of_the_import_contracts() -> None:
    sides = contract_sides(PYPROJECT.read_text(encoding="utf-8"))
    misplaced = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        module, _ = _module_name(path)
        found = owners(module, sides)
        if len(found) != (0 if module in FACADES else 1):
            misplaced[module] = found
    assert misplaced == {}, (
        "each module belongs to exactly one package the import contracts name (a facade "
        f"to none): {misplaced}"
    )


def test_the_import_contracts_name_packages_not_modules() -> None:
    sides = contract_sides(PYPROJECT.read_text(encoding="utf-8"))
    modules = [
        side
        for side in sides
        if not (PACKAGE_DIR.joinpath(*side.split(".")[1:]) / "__init__.py").is_file()
    ]
    assert modules == []
    assert len(sides) == len(set(sides))


def test_the_side_check_sees_a_module_under_none_and_under_two() -> None:
    pyproject = """
[[tool.importlinter.contracts]]
name = "Layers point one way (DESIGN.md section 2)"
layers = ["elastrun.a", "elastrun.b : elastrun.b.agent | elastrun.c"]
[[tool.importlinter.contracts]]
name = "Worker-side helpers never import the agent side"
source_modules = ["elastrun.b.worker"]
"""
    sides = contract_sides(pyproject)
    assert sides == [
        "elastrun.a",
        "elastrun.b",
        "elastrun.b.agent",
        "elastrun.c",
        "elastrun.b.worker",
    ]
    assert owners("elastrun.a.x", sides) == ["elastrun.a"]
    assert owners("elastrun.ab", sides) == []
    assert owners("elastrun.b.agent.x", sides) == ["elastrun.b", "elastrun.b.agent"]


def side_cycles(imports: Iterable[tuple[str, str]], sides: list[str]) -> list[list[str]]:
    """The groups of packages named in ``sides`` that import one another in a circle,
    each sorted; ``imports`` are (importer, imported) module pairs, and a module under no
    side stands for itself."""

    def side(module: str) -> str:
        return max(owners(module, sides), key=len, default=module)

    graph: dict[str, set[str]] = {}
    for importer, imported in imports:
        a, b = side(importer), side(imported)
        if a != b:
            graph.setdefault(a, set()).add(b)
            graph.setdefault(b, set())

    def reachable(start: str) -> set[str]:
        seen: set[str] = set()
        todo = list(graph[start])
        while todo:
            node = todo.pop()
            if node not in seen:
                seen.add(node)
                todo.extend(graph[node])
        return seen

    reach = {node: reachable(node) for node in graph}
    groups = {frozenset(m for m in reach[n] if n in reach[m]) for n in graph if n in reach[n]}
    return sorted(sorted(group) for group in groups)


def test_no_two_packages_of_the_layer_map_import_each_other_even_in_a_circle() -> None:
    # The layers contract forbids an upward import, but not a circle inside one layer row
    # nor through the worker side, which no layer holds; this holds the whole map to it.
    text = PYPROJECT.read_text(encoding="utf-8")
    contracts = tomllib.loads(text)["tool"]["importlinter"]["contracts"]
    ignored = {
        tuple(pair.split(" -> "))
        for contract in contracts
        for pair in contract.get("ignore_imports", [])
    }
    graph = grimp.build_graph("elastrun", cache_dir=None)
    imports = [
        (module, imported)
        for module in graph.modules
        for imported in graph.find_modules_directly_imported_by(module)
        if imported.startswith("elastrun") and (module, imported) not in ignored
    ]
    assert side_cycles(imports, contract_sides(text)) == []


def test_the_cycle_check_finds_a_circle_through_three_packages() -> None:
    sides = ["elastrun.a", "elastrun.b", "elastrun.b.agent", "elastrun.c"]
    imports = [
        ("elastrun.a.x", "elastrun.b.y"),
        ("elastrun.b.y", "elastrun.c.z"),
        ("elastrun.c.z", "elastrun.a.w"),
        ("elastrun.b.agent.q", "elastrun.c.z"),  # into the circle, not back: not in it
    ]
    assert side_cycles(imports, sides) == [["elastrun.a", "elastrun.b", "elastrun.c"]]
    assert side_cycles(imports[:2], sides) == []


#: What the loop may not import: the recovery strategies are rungs of the ladder
#: (``agent.ladder``), assembled by ``launch.assemble``; the loop knows none by name.
STRATEGIES = (
    "elastrun.agent.rungs",
    "elastrun.agent.policy",
    "elastrun.inprocess",
    "elastrun.nodecheck",
    "elastrun.supervise.failures.crashloop",
)


def test_the_loop_imports_no_recovery_strategy() -> None:
    path = PACKAGE_DIR / "agent" / "loop.py"
    tree = ast.parse(path.read_text())
    imported = [
        node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
    ] + [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    ]
    assert [m for m in imported if m.startswith(STRATEGIES)] == []
    # Nor does a method of the loop name in-process recovery.
    assert "inprocess" not in path.read_text()


# Every source in the tree, the package's and the tests', benchmarks' and examples': an
# inline ignore names its code and its reason (STYLE.md 16).
REPO = Path(__file__).resolve().parents[2]
CHECKED_TREES = ("src", "tests", "benchmarks", "examples")

_TYPE_IGNORE = re.compile(r"type:\s*ignore\b(?P<rest>.*)")
_CODES = re.compile(r"\[(?P<codes>[a-z0-9_-]+(?:,\s*[a-z0-9_-]+)*)\]\s*")
#: Comments that tell a tool what to do, none of them a reason.
_TOOL_COMMENT = re.compile(r"(fmt:\s*(skip|off|on)|noqa\b|pragma:|type:|mypy:)")


def _codes(text: str) -> list[str]:
    return [code.strip() for code in text.split(",")]


def type_ignores_without_reason(source: str) -> list[int]:
    """The lines of ``source`` whose ``type: ignore`` names no code or gives no reason.

    The form is ``# type: ignore[code]  # the reason``. Where the line has no room for
    the reason, it is the comment line just above, led by the same code(s) and a colon:
    ``# arg-type: the reason``. A tool's comment (``# fmt: skip``, ``# noqa``) after the
    ignore is no reason.
    """
    lines = source.splitlines()
    offenders = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        parts = [part.strip() for part in token.string.split("#")]
        found = [i for i, part in enumerate(parts) if _TYPE_IGNORE.match(part)]
        if not found:
            continue
        line = token.start[0]
        match = _TYPE_IGNORE.match(parts[found[0]])
        codes = _CODES.fullmatch(match["rest"]) if match else None
        if codes is None:
            offenders.append(line)
            continue
        after = [p for p in parts[found[0] + 1 :] if p and not _TOOL_COMMENT.match(p)]
        above = lines[line - 2].strip() if line > 1 else ""
        lead, colon, reason = above.removeprefix("#").partition(":")
        reason_above = (
            above.startswith("#")
            and bool(colon)
            and bool(reason.strip())
            and _codes(lead) == _codes(codes["codes"])
        )
        if not after and not reason_above:
            offenders.append(line)
    return offenders


def test_the_type_ignore_check_wants_a_code_and_a_reason() -> None:
    source = "\n".join([
        "a = f()  # type: ignore[arg-type]  # a fake with only what f calls",  # 1: fine
        "b = f()  # type: ignore[arg-type]",  # 2: no reason
        "c = f()  # type: ignore  # a reason but no code",  # 3
        "d = f()  # type: ignore[arg-type]  # fmt: skip",  # 4: a tool's comment
        "# arg-type, misc: the reason, above as the line has no room",
        "e = f()  # type: ignore[arg-type, misc]",  # 6: fine
        "# index: a reason for another code",
        "g = f()  # type: ignore[arg-type]",  # 8
        "h = 'type: ignore[arg-type]'",  # 9: not a comment
        "i = f()  # type: ignore[misc]  # its reason  # fmt: skip",  # 10: fine
    ])  # fmt: skip
    assert type_ignores_without_reason(source) == [2, 3, 4, 8]


def test_every_type_ignore_in_src_tests_benchmarks_and_examples_gives_its_reason() -> None:
    paths = sorted(path for tree in CHECKED_TREES for path in (REPO / tree).rglob("*.py"))
    assert any(path.is_relative_to(REPO / "src" / "elastrun") for path in paths)
    offenders = [
        f"{path.relative_to(REPO)}:{line}"
        for path in paths
        for line in type_ignores_without_reason(path.read_text())
    ]
    assert offenders == [], "a type: ignore without its code or reason: " + ", ".join(offenders)

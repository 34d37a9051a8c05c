"""The user guide cannot rot: every command it shows is run, or names the test that runs it.

Conventions in ``docs/*.md`` (HTML comments, invisible on GitHub and in mkdocs):

* ``<!-- run -->`` before a fenced ``bash`` block: the block runs (``bash -e -o pipefail``)
  and must exit 0. Attributes: ``exit=N`` (the documented exit status), ``expect="TEXT"``
  (TEXT must appear in its stdout or stderr; may repeat), ``requires=etcd`` (skipped,
  with the reason, when no etcd backend and server are available).
* ``<!-- file: NAME -->`` before any fenced block: its text is written to NAME first,
  so a page can show a script and then run it.
* ``<!-- tested-by: tests/FILE.py::test_name -->`` before a ``bash`` block whose command
  needs something a unit run does not have (a Slurm allocation, a Kubernetes cluster):
  the named test must exist; it runs the same command for real.

Every ``bash`` block must carry one of ``run`` or ``tested-by``. The blocks of one page
run in order in one fresh directory, with ``examples/`` of this checkout available and
the virtual environment's ``elastrun`` and ``python`` first on ``PATH``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from _helpers import REPO

DOCS = REPO / "docs"
PAGES = sorted(DOCS.glob("*.md"))
BLOCK_TIMEOUT = 120

_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*(?P<kind>run|file:|tested-by:)(?P<rest>.*?)-->\s*$")
_ATTR = re.compile(r'(\w+)=("([^"]*)"|\S+)')


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    marker: str | None = None  # "run", "file:", "tested-by:"
    arg: str = ""
    attrs: dict[str, list[str]] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def parse_blocks(page: Path) -> list[Block]:
    """Fenced blocks of a page, each with the marker comment just above it (if any)."""
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        start, indent = i, len(fence["indent"])
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        block = Block(page, start + 1, fence["lang"], "\n".join(body) + "\n")
        above = start - 1
        while above >= 0 and not lines[above].strip():
            above -= 1
        if above >= 0 and (marker := _MARKER.match(lines[above])):
            block.marker = marker["kind"]
            rest = marker["rest"].strip()
            if block.marker == "run":
                for key, raw, quoted in _ATTR.findall(rest):
                    block.attrs.setdefault(key, []).append(quoted if raw.startswith('"') else raw)
            else:
                block.arg = rest
        blocks.append(block)
        i += 1
    return blocks


def _etcd_available() -> str | None:
    if importlib.util.find_spec("elastrun.rendezvous.etcd") is None:
        return "the etcd rendezvous backend is not part of this checkout yet"
    if shutil.which("etcd") is None:
        return "no etcd server on PATH"
    return None


REQUIREMENTS = {"etcd": _etcd_available}


def _env() -> dict[str, str]:
    venv_bin = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"}


def _run_block(block: Block, cwd: Path) -> None:
    expected = int(block.attrs.get("exit", ["0"])[0])
    proc = subprocess.Popen(
        ["bash", "-e", "-o", "pipefail", "-c", block.text], cwd=cwd, env=_env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=BLOCK_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"{block.where}: still running after {BLOCK_TIMEOUT}s\n{block.text}")
    shown = f"\n--- command\n{block.text}--- stdout\n{out[-4000:]}--- stderr\n{err[-4000:]}"
    assert proc.returncode == expected, (
        f"{block.where}: exit status {proc.returncode}, the guide says {expected}{shown}"
    )
    for text in block.attrs.get("expect", []):
        assert text in out or text in err, f"{block.where}: {text!r} not in the output{shown}"


def _write_file_block(block: Block, cwd: Path) -> None:
    (cwd / block.arg).parent.mkdir(parents=True, exist_ok=True)
    (cwd / block.arg).write_text(block.text)


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_command_of_the_page_runs_as_documented(page: Path, tmp_path: Path) -> None:
    (tmp_path / "examples").symlink_to(REPO / "examples")
    for block in parse_blocks(page):
        if block.marker == "file:":
            _write_file_block(block, tmp_path)
        elif block.marker == "run" and not block.attrs.get("requires"):
            _run_block(block, tmp_path)


NEEDY = [b for p in PAGES for b in parse_blocks(p) if b.attrs.get("requires")]


@pytest.mark.slow
@pytest.mark.parametrize("block", NEEDY, ids=[b.where for b in NEEDY])
def test_commands_that_need_a_service_run_where_it_is_available(
    block: Block, tmp_path: Path
) -> None:
    missing = [r for need in block.attrs["requires"] if (r := REQUIREMENTS[need]()) is not None]
    if missing:
        pytest.skip(f"{block.where}: {'; '.join(missing)}")
    (tmp_path / "examples").symlink_to(REPO / "examples")
    for other in parse_blocks(block.page):  # the page's files, as the reader has them
        if other.marker == "file:":
            _write_file_block(other, tmp_path)
    _run_block(block, tmp_path)


def test_every_bash_block_is_run_or_names_its_test() -> None:
    unmarked = [
        b.where for p in PAGES for b in parse_blocks(p)
        if b.lang in ("bash", "sh", "shell") and b.marker not in ("run", "tested-by:")
    ]  # fmt: skip
    assert not unmarked, f"bash blocks neither run nor tested elsewhere: {unmarked}"


def test_every_named_test_exists() -> None:
    for page in PAGES:
        for block in parse_blocks(page):
            if block.marker != "tested-by:":
                continue
            path, _, name = block.arg.partition("::")
            target = REPO / path
            assert target.is_file(), f"{block.where}: no test file {path}"
            assert re.search(rf"^def {re.escape(name)}\(", target.read_text(), re.M), (
                f"{block.where}: no test {name} in {path}"
            )


def test_requirements_and_attributes_are_known() -> None:
    for page in PAGES:
        for block in parse_blocks(page):
            assert set(block.attrs) <= {"exit", "expect", "requires"}, block.where
            for need in block.attrs.get("requires", []):
                assert need in REQUIREMENTS, f"{block.where}: unknown requirement {need}"


def test_every_launcher_option_is_documented_in_the_cli_page() -> None:
    from elastrun.launch.argv import build_parser

    text = (DOCS / "cli.md").read_text()
    missing = []
    for action in build_parser()._actions:
        longs = [o for o in action.option_strings if o.startswith("--") and o != "--help"]
        if longs and not any(f"`{o}" in text for o in longs):
            missing.append(longs[0])
    assert not missing, f"options missing from docs/cli.md: {missing}"


def test_every_page_is_in_the_index_and_the_mkdocs_nav() -> None:
    index = (DOCS / "index.md").read_text()
    nav = (REPO / "mkdocs.yml").read_text()
    for page in PAGES:
        if page.name == "index.md":
            continue
        assert f"({page.name})" in index, f"{page.name} is not linked from docs/index.md"
        assert page.name in nav, f"{page.name} is not in mkdocs.yml's nav"


def test_relative_links_point_at_existing_files() -> None:
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.name} -> {target}")
    assert not broken, f"broken links: {broken}"


def test_the_block_parser_sees_markers_and_attributes(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text(
        '<!-- run exit=2 expect="a b" expect=c -->\n```bash\nfalse\n```\n\n'
        "<!-- file: t.py -->\n```python\nprint(1)\n```\n```bash\necho unmarked\n```\n"
    )
    blocks = parse_blocks(page)
    assert [(b.marker, b.lang) for b in blocks] == [
        ("run", "bash"),
        ("file:", "python"),
        (None, "bash"),
    ]
    assert blocks[0].attrs == {"exit": ["2"], "expect": ["a b", "c"]}
    assert blocks[1].arg == "t.py" and blocks[1].text == "print(1)\n"

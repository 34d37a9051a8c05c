"""The README's "deliberately differs" list names every behaviour that departs from
torchrun on purpose; a difference found later is either fixed or added there, and this
list of the ones decided (issues 27 and 41) keeps them from being dropped by an edit."""

from __future__ import annotations

import re

import pytest

from _helpers import REPO

#: A behaviour, and the words of the README entry that must describe it.
DECIDED = {
    "record writes the report when the child left no error file": ["`elastrun.record`", "no error"],
    "a log_dir that is a file is a ConfigError, not NotADirectoryError": [
        "NotADirectoryError",
        "`log_dir`",
    ],
    "--rdzv-conf keys torchrun ignores are errors, also with a stray quote": [
        "an unknown key is an error",
        "'join_timeout=60'",
    ],
    "non-termination signals are refused": ["SIGCHLD"],
    "PYTHON_EXEC is run once to see that it is Python": ["PYTHON_EXEC", "/bin/true"],
    "-m is looked up without importing": ["without importing any package"],
    "the command shows tee'd lines on its descriptors, main() and the Python API through "
    "sys.stdout": ["descriptors 1 and 2", "launcher's `main()`", "`contextlib.redirect_stdout`"],
    "the report explains a missing error file; ProcessFailure.message stays torch's": [
        "`ProcessFailure.message` keeps torch's text",
        "`ProcessFailure.explanation`",
    ],
}


def _differences() -> str:
    text = (REPO / "README.md").read_text()
    match = re.search(r"^## Where elastrun deliberately differs.*?(?=^## )", text, re.S | re.M)
    assert match, "the README lost its list of differences"
    return " ".join(match.group(0).split())  # line breaks do not matter


@pytest.mark.parametrize("behaviour", DECIDED)
def test_the_readme_lists_each_deliberate_difference(behaviour: str) -> None:
    section = _differences()
    for words in DECIDED[behaviour]:
        assert words in section, f"{behaviour}: {words!r} is not in the list"

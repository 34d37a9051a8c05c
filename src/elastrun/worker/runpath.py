"""``--run-path``: run a script with ``runpy.run_path`` inside a function worker."""

from __future__ import annotations

import runpy
import sys


def run_script_path(training_script: str, *training_script_args: str) -> None:
    """Run ``training_script`` as ``__main__`` with ``sys.argv = [script, *args]``."""
    sys.argv = [training_script, *training_script_args]
    runpy.run_path(training_script, run_name="__main__")

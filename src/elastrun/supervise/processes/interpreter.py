"""The interpreter and base environment of the processes the agent starts for the job.

The workers, the node check's processes and the launch plan all read the same pair,
taken once from the agent's options (``AgentOptions.python`` and ``.environ``) at the
composition root: one frozen value instead of two loose arguments that every part must
be handed together, and that could otherwise drift apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["WorkerInterpreter"]


@dataclass(frozen=True)
class WorkerInterpreter:
    """The interpreter of subprocess workers, and the environment under their own
    variables (the agent's).

    Args:
        python: the interpreter's path.
        environ: the base environment (read, never changed).
    """

    python: str
    environ: Mapping[str, str]

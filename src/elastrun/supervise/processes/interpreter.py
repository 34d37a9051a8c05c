"""The interpreter and base environment of the processes the agent starts for the job:
the workers, the node check's processes and the launch plan read this one frozen pair,
taken once from ``AgentOptions.python`` and ``.environ``, so the two cannot drift apart."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["WorkerInterpreter"]


@dataclass(frozen=True)
class WorkerInterpreter:
    """The interpreter's path, and the environment under the processes' own variables
    (the agent's; read, never changed)."""

    python: str
    environ: Mapping[str, str]

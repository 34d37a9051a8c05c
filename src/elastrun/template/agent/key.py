"""What one worker template serves: the interpreter options and the shared environment.

Templates are keyed by the interpreter options and the environment minus the per-worker
variables: modules imported in the template read the environment at import time, so a
template serves only workers whose shared environment is the one it was started with.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from elastrun.template.agent.preload import BootstrapCommand
from elastrun.wire import env as wire_env
from elastrun.wire.checkpoint import CHECKPOINT_DIR_ENV
from elastrun.wire.inprocess import ROUND_ENV, SOCKET_ENV

#: Variables that differ between the workers of one node or between restarts (and every
#: ``TORCHELASTIC_*`` one). They are not part of the template's own environment (a worker
#: gets its complete environment when it is forked), so one template serves every worker
#: and every restart. Any other difference starts a new template.
PER_WORKER_VARIABLES = frozenset({
    *wire_env.RANK_VARIABLES, "ROLE_NAME", wire_env.RESTART_COUNT_ENV, wire_env.RUN_ID_ENV,
    wire_env.MAX_RESTARTS_ENV, wire_env.USE_AGENT_STORE_ENV, wire_env.ERROR_FILE_ENV,
    wire_env.NCCL_ASYNC_ERROR_HANDLING_ENV,
    # Per-rank files under the attempt's log directory.
    wire_env.STACKS_FILE_ENV,
    # Each worker's progress record (the file is the agent's, the same for all).
    wire_env.PROGRESS_SLOT_ENV,
    # The in-process round a replacement worker starts in (elastrun.inprocess).
    ROUND_ENV,
    # The agent's own paths (its progress board, its in-process channel, its node's
    # memory checkpoints), made when it runs and read by elastrun's worker side only
    # when it runs, never at import: so the launcher can start the template before
    # the agent made them.
    wire_env.PROGRESS_FILE_ENV, SOCKET_ENV, CHECKPOINT_DIR_ENV,
    # Read by CUDA when it initialises, which the template never does; it differs
    # per worker with --virtual-local-rank.
    "CUDA_VISIBLE_DEVICES",
})  # fmt: skip


def is_per_worker_variable(name: str, extra: Collection[str] = ()) -> bool:
    """Whether ``name`` may differ between the workers served by one template."""
    return name in PER_WORKER_VARIABLES or name in extra or name.startswith("TORCHELASTIC_")


@dataclass(frozen=True)
class TemplateKey:
    """The interpreter options and the shared environment (sorted) of a template."""

    options: tuple[str, ...]
    env: tuple[tuple[str, str], ...]

    @staticmethod
    def of(cmd: BootstrapCommand, env: Mapping[str, str], extra: Collection[str]) -> TemplateKey:
        """The key of a worker's command and environment; ``extra``: more per-worker
        variables (see :func:`is_per_worker_variable`)."""
        shared = sorted((k, v) for k, v in env.items() if not is_per_worker_variable(k, extra))
        return TemplateKey(cmd.options, tuple(shared))


def describe_change(old: TemplateKey, new: TemplateKey) -> str:
    """What differs between two keys, in a few words for a log line."""
    if old.options != new.options:
        return f"interpreter options {list(old.options)} -> {list(new.options)}"
    before, after = dict(old.env), dict(new.env)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
    return f"variables {shown}"

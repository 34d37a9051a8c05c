"""Every ``ELASTRUN_*`` and ``TORCHELASTIC_*`` variable's name, defined once, in the wire.

What the agent gives its workers, what they read of what they inherit, and the user's
settings for the launcher and the agent: every module imports the names from here (a
unit test holds them to it). A format's own variables live with its module (``.inprocess``,
``.checkpoint``, ``.bootstrap``, ``.template``), but the worker bootstrap's are here.

**Version.** :data:`VERSION` counts the set of names; a name never changes meaning,
and a new variable is a new name. Nothing here is carried on a wire, so no reader
checks it.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "ERROR_FILE_ENV", "HEALTH_CHECK_PORT_ENV", "INPROCESS_ENV", "INPROCESS_JOIN_TIMEOUT_ENV",
    "INPROCESS_TIMEOUT_ENV", "LOG_LINE_PREFIX_TEMPLATE_ENV", "MAX_RESTARTS_ENV",
    "NCCL_ASYNC_ERROR_HANDLING_ENV", "NODE_CHECK_FAULT_ENV", "POD_RUN_ID_ENV", "PROGRESS_FILE_ENV",
    "PROGRESS_SLOT_ENV", "RANK_VARIABLES", "RESTART_COUNT_ENV", "RUN_ID_ENV",
    "SHUTDOWN_TIMEOUT_ENV", "SIGNALS_TO_HANDLE_ENV", "STACKS_FILE_ENV", "STORE_ENGINE_ENV",
    "STORE_TOKEN_ENV", "TIMER_FILE_ENV", "TORCH_WORKER_SERVER_SOCKET_ENV",
    "UNINTERRUPTIBLE_STATE_TIMEOUT_ENV", "USE_AGENT_STORE_ENV", "WORKER_SERVER_SOCKET_ENV",
    "inprocess_wanted",
]  # fmt: skip

#: The set of names (see the module's docstring).
VERSION = 1

# What the agent sets for each worker.
#: torch's names of a worker's place in its round (DESIGN.md section 1), but ROLE_NAME.
RANK_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip
#: torchelastic's: the group restarts so far, their bound, the run, the store's owner.
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS_ENV = "TORCHELASTIC_MAX_RESTARTS"
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"
USE_AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
NCCL_ASYNC_ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
#: Where a worker writes its uncaught exception (torch's ``@record`` format).
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
#: Where a worker dumps its threads' stacks on SIGUSR1 (``elastrun stacks``).
STACKS_FILE_ENV = "ELASTRUN_STACKS_FILE"
#: The expiration timers' FIFO (torch's file-based timer).
TIMER_FILE_ENV = "TORCHELASTIC_TIMER_FILE"
#: The signals a worker's ``record`` turns into an error file (torch's variable).
SIGNALS_TO_HANDLE_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"
#: The progress board the agent created; its presence is the agent asking for reports.
PROGRESS_FILE_ENV = "ELASTRUN_PROGRESS_FILE"
#: This worker's record in the board (an index, not a rank: see ProgressBoard.reset).
PROGRESS_SLOT_ENV = "ELASTRUN_PROGRESS_SLOT"

# What a worker reads of its inherited environment.
#: Where torch's worker server listens (``elastrun.control_plane``).
TORCH_WORKER_SERVER_SOCKET_ENV = "TORCH_WORKER_SERVER_SOCKET"
#: Where elastrun's bootstrap serves for *every* worker (see ``serve_from_env``); a
#: separate variable so that a script calling torch's own ``worker_main`` (whose C++
#: server refuses a path that exists) can still use ``TORCH_WORKER_SERVER_SOCKET``.
WORKER_SERVER_SOCKET_ENV = "ELASTRUN_WORKER_SERVER_SOCKET"
#: The node check's test-only fault injection: ``fail`` or ``slow:SECONDS``.
NODE_CHECK_FAULT_ENV = "ELASTRUN_TEST_NODE_CHECK"

# The user's settings, read by the launcher and the agent.
#: ``ELASTRUN_INPROCESS=0`` turns in-process recovery off (:func:`inprocess_wanted`):
#: every failure restarts the whole group.
INPROCESS_ENV = "ELASTRUN_INPROCESS"
INPROCESS_TIMEOUT_ENV = "ELASTRUN_INPROCESS_TIMEOUT"
INPROCESS_JOIN_TIMEOUT_ENV = "ELASTRUN_INPROCESS_JOIN_TIMEOUT"
STORE_ENGINE_ENV = "ELASTRUN_STORE_ENGINE"
STORE_TOKEN_ENV = "ELASTRUN_STORE_TOKEN"
#: A Kubernetes pod's run id, from its label (``launch.k8s.manifest``).
POD_RUN_ID_ENV = "ELASTRUN_RUN_ID"
HEALTH_CHECK_PORT_ENV = "TORCHELASTIC_HEALTH_CHECK_PORT"
UNINTERRUPTIBLE_STATE_TIMEOUT_ENV = "TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT"
LOG_LINE_PREFIX_TEMPLATE_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"


def inprocess_wanted(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` leaves in-process recovery on (``INPROCESS_ENV``)."""
    return environ.get(INPROCESS_ENV, "1") != "0"

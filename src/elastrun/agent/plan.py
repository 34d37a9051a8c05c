"""The launch plan: ranks, environment and command of every worker, computed purely.

Nothing here touches the system: the base environment, the interpreter path and the
round's facts are arguments. The executor (``elastrun.agent.workers``) applies a plan;
``--dry-run`` prints one.

Every variable elastrun sets for a worker is named here, including those whose values
exist only once the agent runs (its temporary files, the attempt's log directory, a
progress slot): the plan holds those as :class:`RunTimeValue` placeholders, the executor
fills them in with :func:`resolve_env` (and cannot add a variable the plan does not
name), and ``--dry-run`` shows them as ``<run time: ...>``. So the dry run lists exactly
the variables the worker gets.
"""

from __future__ import annotations

import enum
import os
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from elastrun.core.errors import ConfigError
from elastrun.template.agent.preload import options_end, same_file
from elastrun.wire.bootstrap import BOOTSTRAP_MODULE
from elastrun.wire.checkpoint import CHECKPOINT_DIR_ENV
from elastrun.wire.env import (
    ERROR_FILE_ENV,
    MAX_RESTARTS_ENV,
    NCCL_ASYNC_ERROR_HANDLING_ENV,
    RESTART_COUNT_ENV,
    RUN_ID_ENV,
    SIGNALS_TO_HANDLE_ENV,
    STACKS_FILE_ENV,
    TIMER_FILE_ENV,
    USE_AGENT_STORE_ENV,
)
from elastrun.wire.inprocess import SOCKET_ENV as INPROCESS_SOCKET_ENV
from elastrun.wire.progress import PROGRESS_FILE_ENV, PROGRESS_SLOT_ENV

if TYPE_CHECKING:  # annotations only: ``--dry-run`` plans without a rendezvous
    from elastrun.agent.options import AgentOptions
    from elastrun.agent.spec import WorkerSpec
    from elastrun.rendezvous.api import RendezvousInfo


@dataclass(frozen=True)
class NodeSlot:
    """One node's share of the world, in group-rank order: its role and worker count."""

    role: str
    local_world_size: int


@dataclass(frozen=True)
class WorkerRanks:
    local_rank: int
    global_rank: int
    role_rank: int
    world_size: int
    role_world_size: int


def assign_ranks(group_rank: int, nodes: Sequence[NodeSlot]) -> list[WorkerRanks]:
    """Ranks of the workers of node ``group_rank``.

    Global ranks are consecutive in group-rank order; role ranks are consecutive among
    the workers of the same role, also in group-rank order. Handles nodes with
    different worker counts and roles.

    Raises:
        ConfigError: ``group_rank`` outside ``nodes``.
    """
    if not 0 <= group_rank < len(nodes):
        raise ConfigError("group_rank", group_rank, f"must be in [0, {len(nodes)})")
    me = nodes[group_rank]
    world = sum(n.local_world_size for n in nodes)
    base = sum(n.local_world_size for n in nodes[:group_rank])
    same_role = [n for n in nodes if n.role == me.role]
    role_world = sum(n.local_world_size for n in same_role)
    role_base = sum(n.local_world_size for n in nodes[:group_rank] if n.role == me.role)
    return [
        WorkerRanks(i, base + i, role_base + i, world, role_world)
        for i in range(me.local_world_size)
    ]


@dataclass(frozen=True)
class RoundFacts:
    """What one rendezvous round decided for this node."""

    run_id: str
    round: int
    group_rank: int
    group_world_size: int
    master_addr: str
    master_port: int
    restart_count: int
    max_restarts: int
    use_agent_store: bool = False


class RunTimeValue(enum.Enum):
    """A variable's value that exists only once the agent runs; the plan names the
    variable, the executor provides the value (see :func:`resolve_env`)."""

    ERROR_FILE = "the worker error.json in the attempt log directory"
    STACKS_FILE = "stacks.txt beside the error file"
    PROGRESS_FILE = "the progress board, a temporary file"
    PROGRESS_SLOT = "the worker record on the progress board"
    TIMER_FILE = "the file timers FIFO, a temporary path"
    INPROCESS_SOCKET = "the in-process recovery socket, a temporary path"
    CHECKPOINT_DIR = "the node's memory checkpoint directory, in /dev/shm"

    @property
    def placeholder(self) -> str:
        """How ``--dry-run`` shows the value."""
        return f"<run time: {self.value}>"


@dataclass(frozen=True)
class WorkerServices:
    """What the agent provides every worker beyond its ranks; each adds variables.

    Attributes:
        file_timer: the expiration-timer watchdog runs (``TORCHELASTIC_TIMER_FILE``).
        inprocess: the in-process recovery socket listens (``ELASTRUN_INPROCESS_SOCKET``).
        signals_to_handle: what the launcher set ``TORCHELASTIC_SIGNALS_TO_HANDLE`` to,
            in its own environment, which the workers inherit (None: not launched so).
    """

    file_timer: bool = False
    inprocess: bool = False
    signals_to_handle: str | None = None

    @classmethod
    def of(cls, options: AgentOptions, *, file_timer: bool) -> WorkerServices:
        """The services an agent with ``options`` provides (``file_timer``: it runs the
        expiration-timer watchdog)."""
        return cls(
            file_timer=file_timer,
            inprocess=options.inprocess,
            signals_to_handle=options.signals_to_handle,
        )


def service_env(
    services: WorkerServices, base_env: Mapping[str, str]
) -> tuple[dict[str, str], dict[str, RunTimeValue]]:
    """The variables the agent's services set for every worker: those known now, and
    those whose values the running agent provides.

    Every worker has an error file, a stacks file beside it, a progress slot and the
    node's memory checkpoint directory (an agent that cannot make them leaves them empty
    or out, and says so).
    """
    known: dict[str, str] = {}
    runtime = {
        ERROR_FILE_ENV: RunTimeValue.ERROR_FILE,
        STACKS_FILE_ENV: RunTimeValue.STACKS_FILE,
        PROGRESS_FILE_ENV: RunTimeValue.PROGRESS_FILE,
        PROGRESS_SLOT_ENV: RunTimeValue.PROGRESS_SLOT,
        CHECKPOINT_DIR_ENV: RunTimeValue.CHECKPOINT_DIR,
    }
    if services.file_timer:
        given = base_env.get(TIMER_FILE_ENV)
        if given:
            known[TIMER_FILE_ENV] = given  # the user's FIFO: the watchdog serves that one
        else:
            runtime[TIMER_FILE_ENV] = RunTimeValue.TIMER_FILE
    if services.inprocess:
        runtime[INPROCESS_SOCKET_ENV] = RunTimeValue.INPROCESS_SOCKET
    if services.signals_to_handle is not None:
        known[SIGNALS_TO_HANDLE_ENV] = services.signals_to_handle
    return known, runtime


def stacks_file_beside(error_file: str) -> str | None:
    """Where a worker dumps its stacks on request: beside its error file (None when it
    has none)."""
    if not error_file or error_file == os.devnull:
        return None
    return os.path.join(os.path.dirname(error_file), "stacks.txt")


@dataclass(frozen=True)
class WorkerPlan:
    """One worker: its ranks, its own environment variables and its command."""

    ranks: WorkerRanks
    env: dict[str, str]  # the variables elastrun sets (merged over the agent's environment)
    argv: tuple[str, ...] | None  # None for function workers
    args: tuple[object, ...] = ()  # function workers' arguments
    #: The variables elastrun sets whose values the running agent provides.
    runtime: dict[str, RunTimeValue] = field(default_factory=dict)

    @property
    def local_rank(self) -> int:
        return self.ranks.local_rank


@dataclass(frozen=True)
class LaunchPlan:
    role: str
    facts: RoundFacts
    workers: tuple[WorkerPlan, ...]
    function: Callable[..., object] | None = field(default=None, compare=False)


def substitute_local_rank(args: Sequence[object], local_rank: int) -> tuple[object, ...]:
    """Replace ``${local_rank}`` in every string argument."""
    return tuple(
        string.Template(a).safe_substitute(local_rank=str(local_rank)) if isinstance(a, str) else a
        for a in args
    )


def with_bootstrap(args: Sequence[str]) -> tuple[str, ...] | None:
    """Insert the worker bootstrap into a Python command line.

    ``("-u", "train.py", "--lr", "1")`` becomes
    ``("-u", "-m", "elastrun.worker.bootstrap", "train.py", "--lr", "1")``, and
    ``("-u", "-m", "pkg.train")`` becomes ``(..., "-m", BOOTSTRAP, "-m", "pkg.train")``.
    Returns None for command lines the bootstrap cannot stand in for (``-c``, stdin).
    """
    i = options_end(args)
    if i is None or i >= len(args) or (args[i] == "-m" and i + 1 == len(args)):
        return None
    return (*args[:i], "-m", BOOTSTRAP_MODULE, *args[i:])


def worker_env(
    facts: RoundFacts,
    ranks: WorkerRanks,
    *,
    role: str,
    local_world_size: int,
    base_env: Mapping[str, str],
    virtual_local_rank: bool = False,
) -> dict[str, str]:
    """The variables elastrun sets for one worker (DESIGN.md section 1).

    Raises:
        ConfigError: ``virtual_local_rank`` with fewer ``CUDA_VISIBLE_DEVICES`` entries
            than workers.
    """
    env = {
        "LOCAL_RANK": "0" if virtual_local_rank else str(ranks.local_rank),
        "RANK": str(ranks.global_rank),
        "GROUP_RANK": str(facts.group_rank),
        "ROLE_RANK": str(ranks.role_rank),
        "ROLE_NAME": role,
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "WORLD_SIZE": str(ranks.world_size),
        "GROUP_WORLD_SIZE": str(facts.group_world_size),
        "ROLE_WORLD_SIZE": str(ranks.role_world_size),
        "MASTER_ADDR": facts.master_addr,
        "MASTER_PORT": str(facts.master_port),
        RESTART_COUNT_ENV: str(facts.restart_count),
        MAX_RESTARTS_ENV: str(facts.max_restarts),
        RUN_ID_ENV: facts.run_id,
        USE_AGENT_STORE_ENV: str(facts.use_agent_store),
        NCCL_ASYNC_ERROR_HANDLING_ENV: base_env.get(NCCL_ASYNC_ERROR_HANDLING_ENV, "1"),
    }
    if "OMP_NUM_THREADS" not in base_env and local_world_size > 1:
        env["OMP_NUM_THREADS"] = "1"
    if virtual_local_rank:
        visible = base_env.get("CUDA_VISIBLE_DEVICES")
        if visible:
            devices = [d.strip() for d in visible.split(",")]
            if ranks.local_rank >= len(devices):
                raise ConfigError(
                    "CUDA_VISIBLE_DEVICES",
                    visible,
                    f"--virtual-local-rank needs one device per worker ({local_world_size})",
                )
            env["CUDA_VISIBLE_DEVICES"] = devices[ranks.local_rank]
        else:
            env["CUDA_VISIBLE_DEVICES"] = str(ranks.local_rank)
    return env


def resolve_env(
    base_env: Mapping[str, str], worker: WorkerPlan, provided: Mapping[str, str]
) -> dict[str, str]:
    """A worker's complete environment: the agent's, the plan's variables over it, and
    the values ``provided`` for the plan's run-time variables (by name). A run-time
    variable with no value provided is left out (the agent could not make it, and said
    so); a provided name the plan does not list is ignored."""
    env = {**base_env, **worker.env}
    env.update((name, provided[name]) for name in worker.runtime if name in provided)
    return env


def build_plan(
    facts: RoundFacts,
    *,
    role: str,
    local_world_size: int,
    nodes: Sequence[NodeSlot],
    entrypoint: Callable[..., object] | str,
    args: Sequence[object],
    base_env: Mapping[str, str],
    python: str,
    virtual_local_rank: bool = False,
    services: WorkerServices = WorkerServices(),
) -> LaunchPlan:
    """The plan of one round for this node: every worker's ranks, env and command."""
    known, runtime = service_env(services, base_env)
    workers = []
    for ranks in assign_ranks(facts.group_rank, nodes):
        env = worker_env(
            facts,
            ranks,
            role=role,
            local_world_size=local_world_size,
            base_env=base_env,
            virtual_local_rank=virtual_local_rank,
        )
        env.update(known)
        wargs = substitute_local_rank(args, ranks.local_rank)
        argv: tuple[str, ...] | None = None
        if isinstance(entrypoint, str):
            str_args = tuple(str(a) for a in wargs)
            boot = with_bootstrap(str_args) if same_file(entrypoint, python) else None
            argv = (entrypoint, *(boot if boot is not None else str_args))
            wargs = ()
        workers.append(
            WorkerPlan(ranks=ranks, env=env, argv=argv, args=wargs, runtime=dict(runtime))
        )
    return LaunchPlan(
        role=role,
        facts=facts,
        workers=tuple(workers),
        function=None if isinstance(entrypoint, str) else entrypoint,
    )


def node_slots(info: RendezvousInfo, role: str, local_world_size: int) -> list[NodeSlot]:
    """Every node's share of the round's world, in group-rank order: from the round's
    shape, else from its members, else ``world_size`` nodes like this one."""
    return (
        [NodeSlot(r, lws) for r, lws, count in info.shape for _ in range(count)]
        or [NodeSlot(m.role, m.local_world_size) for m in info.members]
        or [NodeSlot(role, local_world_size)] * info.world_size
    )


def round_plan(
    facts: RoundFacts,
    spec: WorkerSpec,
    nodes: Sequence[NodeSlot],
    *,
    base_env: Mapping[str, str],
    python: str,
    services: WorkerServices = WorkerServices(),
) -> LaunchPlan:
    """This node's plan for a round whose decisions ``facts`` holds, and ``nodes`` every
    node's share of the world (``node_slots``)."""
    assert spec.entrypoint is not None
    return build_plan(
        facts,
        role=spec.role,
        local_world_size=spec.local_world_size,
        nodes=nodes,
        entrypoint=spec.entrypoint,
        args=spec.args,
        base_env=base_env,
        python=python,
        virtual_local_rank=spec.virtual_local_rank,
        services=services,
    )

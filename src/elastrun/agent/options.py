"""What an agent is told: its options, one frozen value built once at the edge.

The launcher builds ``AgentOptions`` from its launch config and its environment
(``AgentOptions.from_environ``, called in the launch layer); the agent and everything it
is made of read the typed fields, never the environment. Only the workers' base
environment (``environ``) is carried as a mapping: it is what every worker inherits,
under the variables its plan sets.

Why a mapping argument rather than ``os.environ`` read here: a deeper layer that reads
the process environment cannot be told otherwise by a test or by the Python API, and
a typo in a variable would surface only when the value is first used, mid-run. Parsed
here from the mapping it is given, a bad value is a ``ConfigError`` naming the variable
before anything starts.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass

from elastrun.agent.watches import STUCK_EXIT_TIMEOUT
from elastrun.core.errors import ConfigError
from elastrun.core.values import parse_seconds
from elastrun.nodecheck.agent.verdicts import NodeCheckRule
from elastrun.pace import AutoTimeout, StragglerSettings
from elastrun.rendezvous.exclusion import ExclusionRule
from elastrun.wire.env import (
    INPROCESS_JOIN_TIMEOUT_ENV,
    INPROCESS_TIMEOUT_ENV,
    SIGNALS_TO_HANDLE_ENV,
    inprocess_wanted,
)

__all__ = [
    "DEFAULT_INPROCESS_JOIN_TIMEOUT",
    "DEFAULT_INPROCESS_TIMEOUT",
    "START_METHODS",
    "AgentOptions",
    "inprocess_timeout",
    "join_timeout",
]

#: How long the survivors and the replacements of an in-process round have to
#: synchronise (seconds) by default; ``ELASTRUN_INPROCESS_TIMEOUT`` sets it.
DEFAULT_INPROCESS_TIMEOUT = 60.0
#: How long a worker kept through a round may take to reach it (its collectives fail, or
#: the cut makes them fail) before it counts as stuck and is replaced (seconds);
#: ``ELASTRUN_INPROCESS_JOIN_TIMEOUT`` sets it. Generous: a worker computing without
#: collectives (gradient accumulation) reaches the round only at its next collective.
DEFAULT_INPROCESS_JOIN_TIMEOUT = 30.0

#: How function workers may be started (``forkserver`` behaves as ``spawn``).
START_METHODS = ("spawn", "fork", "forkserver")


def join_timeout(environ: Mapping[str, str]) -> float:
    """How long a kept worker may take to reach a round (``ELASTRUN_INPROCESS_JOIN_TIMEOUT``).

    Raises:
        ConfigError: not a positive, finite number of seconds.
    """
    return _seconds(environ, INPROCESS_JOIN_TIMEOUT_ENV, DEFAULT_INPROCESS_JOIN_TIMEOUT)


def inprocess_timeout(
    environ: Mapping[str, str], hang_timeout: float | AutoTimeout | None = None
) -> float:
    """The bound on an in-process round: ``ELASTRUN_INPROCESS_TIMEOUT``, or a fixed
    ``--hang-timeout`` when that is shorter (a survivor that cannot reach the round is
    hung, and the hang detection's bound is the user's word for how long that takes).

    Raises:
        ConfigError: not a positive, finite number of seconds.
    """
    bound = _seconds(environ, INPROCESS_TIMEOUT_ENV, DEFAULT_INPROCESS_TIMEOUT)
    if isinstance(hang_timeout, (int, float)) and hang_timeout > 0:
        bound = min(bound, float(hang_timeout))
    return bound


def _seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name, "")
    return parse_seconds(raw, name, low_open=True) if raw else default


@dataclass(frozen=True)
class AgentOptions:
    """Everything an agent is configured with, checked once (see the module docstring).

    Attributes:
        environ: the workers' base environment (the agent's own, as the launcher saw it).
        start_method: for function workers: ``spawn`` (fresh interpreter; the default,
            ``forkserver`` behaves the same) or ``fork``.
        exit_barrier_timeout: how long a finished node waits for its peers.
        log_line_prefix_template: template for tee'd lines (``${role_name}``,
            ``${rank}``, ``${local_rank}``).
        shutdown_timeout: grace between the stop signal and SIGKILL, for restarts and
            the final stop alike.
        run_id: the run id when the spec has no rendezvous handler (None: a new one).
        python: the interpreter that runs script workers and the agent's helpers.
        hostname: this node's name in reports (None: the fully qualified host name).
        stuck_exit_timeout: seconds a worker may keep running after every other local
            worker exited successfully before its stacks are dumped and a warning
            names it (it is not stopped); None turns the check off.
        hang_timeout: seconds without progress after which a worker that reported
            progress is hung (``AutoTimeout``: derived from its step times); its stacks
            are dumped, then it is killed and counts as a failure. None: off.
        stalled_restarts: stop restarting (the loop's ``stalled`` is then set) after
            this many consecutive attempts in which no rank passed the step it had
            reached before; None turns it off. Scripts that report no progress are
            never stopped by it.
        crash_loop_stop: stop restarting (the loop's ``crash_loop`` is then set) when a
            rank fails twice in a row with the same error at the same step
            (``elastrun.supervise.failures.crashloop``); False: spend the whole budget.
        stragglers: how ranks (and nodes) slower than their peers are found and
            reported (never stopped); None: off (step metrics are still put).
        inprocess: the in-process recovery socket listens (``ELASTRUN_INPROCESS``).
        signals_to_handle: what the launcher set ``TORCHELASTIC_SIGNALS_TO_HANDLE`` to
            (None: not launched so).
        inprocess_timeout: the bound on an in-process round's synchronisation.
        inprocess_join_timeout: the bound on a kept worker's reaching a round.
        exclusion: when a node whose workers keep failing sits out a cool-down (off by
            default, as torchrun: a node is never kept out).
        node_check: whether and how this node is checked before it joins (off by
            default); a node that fails it sits out ``exclusion``'s cool-down.

    Raises:
        ConfigError: a field out of range, named.
    """

    environ: Mapping[str, str] = dataclasses.field(default_factory=dict)
    start_method: str = "spawn"
    exit_barrier_timeout: float = 300.0
    log_line_prefix_template: str | None = None
    shutdown_timeout: float = 30.0
    run_id: str | None = None
    python: str = sys.executable
    hostname: str | None = None
    stuck_exit_timeout: float | None = STUCK_EXIT_TIMEOUT
    hang_timeout: float | AutoTimeout | None = None
    stalled_restarts: int | None = 3
    crash_loop_stop: bool = True
    stragglers: StragglerSettings | None = StragglerSettings()  # noqa: RUF009 (frozen)
    inprocess: bool = True
    signals_to_handle: str | None = None
    inprocess_timeout: float = DEFAULT_INPROCESS_TIMEOUT
    inprocess_join_timeout: float = DEFAULT_INPROCESS_JOIN_TIMEOUT
    exclusion: ExclusionRule = ExclusionRule()  # noqa: RUF009 (frozen)
    node_check: NodeCheckRule = NodeCheckRule()  # noqa: RUF009 (frozen)

    def __post_init__(self) -> None:
        # A read-only copy: the caller's mapping may change, the options may not.
        object.__setattr__(self, "environ", types.MappingProxyType(dict(self.environ)))
        if self.start_method not in START_METHODS:
            raise ConfigError("start_method", self.start_method, f"not one of {START_METHODS}")
        for name in ("exit_barrier_timeout", "shutdown_timeout"):
            value = getattr(self, name)
            if not value >= 0:  # (also refuses NaN)
                raise ConfigError(name, value, "must be a number of seconds >= 0")
        for name in ("inprocess_timeout", "inprocess_join_timeout"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(name, value, "must be a number of seconds > 0")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], **fields: object) -> AgentOptions:
        """The options of an agent whose environment is ``environ``: the settings read
        from its variables, ``fields`` for the rest (the launcher's, or the defaults).

        Raises:
            ConfigError: a variable with a bad value, named.
        """
        hang = fields.get("hang_timeout")
        return cls(
            environ=environ,
            inprocess=inprocess_wanted(environ),
            # Set by the launcher in its own environment, as torchrun does.
            signals_to_handle=environ.get(SIGNALS_TO_HANDLE_ENV),
            inprocess_timeout=inprocess_timeout(
                environ, hang if isinstance(hang, (int, float, AutoTimeout)) else None
            ),
            inprocess_join_timeout=join_timeout(environ),
            **fields,  # type: ignore[arg-type]  # checked by the dataclass' own fields
        )

    def __repr__(self) -> str:
        shown = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if f.name != "environ"
        ]
        return f"AgentOptions({', '.join(shown)}, environ=<{len(self.environ)} variables>)"

"""The ``elastrun`` command line: argv + environment -> one validated :class:`Launch`.

Parity with torchrun 2.13: every option with its dash and underscore spellings, the
``PET_<DEST>`` environment fallbacks (an explicit option beats the variable), the same
defaults, unambiguous prefixes, and everything after the script handed to the script
untouched, even when it looks like one of our options.

:func:`parse_launch` only orders the steps; each lives with its concept, in the
modules beside this one (``argv``, ``settings``, ``script``, ``rdzv_policy``...).

Deliberate differences from torchrun (improvements):

* A prefix is accepted when every option it matches is a spelling of the *same* option:
  ``--nproc=2`` means ``--nproc-per-node=2`` here, while torchrun calls it ambiguous
  because its dash and underscore aliases are distinct strings.
* Every bad input, whether from argv or a ``PET_*`` variable, is a :class:`ConfigError`
  naming where the value came from (``--max-restarts`` or ``PET_MAX_RESTARTS``) and the
  value, never an ``AssertionError``, a traceback or an argparse exit.
* An empty ``PET_*`` variable counts as unset (torchrun would feed ``""`` to the option).
* Nothing here changes the process: ``OMP_NUM_THREADS`` is reported as a notice for the
  launcher to export to the workers, instead of being written into ``os.environ``.
* Unknown rendezvous backends, event handlers and log specs are rejected up front
  instead of failing at first use; the GPU count is read without importing torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elastrun.core.errors import ConfigError
from elastrun.launch.argv import Values, blame, split_argv
from elastrun.launch.config import LaunchConfig
from elastrun.launch.logs_options import duplicate_filters, logs_specs
from elastrun.launch.options import OPTIONS
from elastrun.launch.rdzv_policy import (
    Rendezvous,
    refuse_not_implemented,
    resolve_rendezvous,
    slurm_settings,
)
from elastrun.launch.script import ScriptKind, check_script, interpreter, script_kind
from elastrun.launch.settings import Runtime, runtime_settings, sizes
from elastrun.supervise.processes.logs import LogsSpecs
from elastrun.wire.env import LOG_LINE_PREFIX_TEMPLATE_ENV

if TYPE_CHECKING:
    from elastrun.launch.slurm import SlurmSettings

__all__ = ["Launch", "ScriptKind", "parse_launch"]


@dataclass(frozen=True)
class Launch:
    """One parsed and validated ``elastrun`` invocation.

    Attributes:
        config: the launch configuration.
        kind: how the workers run ``script``.
        script: the script path, module name or program, as the user gave it.
        script_args: the arguments after the script, untouched.
        python: the interpreter for SCRIPT and MODULE (``PYTHON_EXEC`` or ours).
        dry_run: print the plan and exit instead of launching.
        standalone: a single node hosting its own rendezvous (explicit or implicit).
        notices: lines the launcher should log when it starts.
    """

    config: LaunchConfig
    kind: ScriptKind
    script: str
    script_args: tuple[str, ...]
    python: str
    dry_run: bool
    standalone: bool
    notices: tuple[str, ...]


def parse_launch(argv: Sequence[str], environ: Mapping[str, str]) -> Launch:
    """Parse an ``elastrun`` command line into a validated :class:`Launch`.

    Args:
        argv: the arguments after the program name.
        environ: the environment to read ``PET_*``, ``PYTHON_EXEC``, ``PATH``,
            ``OMP_NUM_THREADS``, ``CUDA_VISIBLE_DEVICES`` and
            ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` from, and to check the agent's
            torch variables in (``TORCHELASTIC_HEALTH_CHECK_PORT``...); it is never
            modified. (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` is read by
            :class:`LaunchConfig` from the process environment.)

    Everything that would only fail once something started is checked here too: the
    rendezvous parameters as the backend will read them, the log directory, the event
    log and the interpreter.

    Raises:
        ConfigError: any invalid option, variable or script, naming it and the value;
            also ``etcd-v2``, whose etcd API is gone (use ``etcd``).
        SystemExit: only for ``-h``/``--help``, after printing the help.
    """
    namespace = split_argv(argv)
    values = Values(namespace, environ)
    notices: list[str] = []
    min_nodes, max_nodes, nproc = sizes(values, environ, notices)
    slurm = slurm_settings(values, environ, notices)
    if slurm is not None and not values.given("nnodes"):
        min_nodes = max_nodes = slurm.nnodes
    runtime = runtime_settings(values)
    rdzv = resolve_rendezvous(values, max_nodes, notices, slurm)
    kind = script_kind(values, notices)
    script: str = namespace.training_script
    python = interpreter(kind, environ)
    check_script(kind, script, environ, python)
    logs = logs_specs(values, nproc)
    # Everything is valid; now what this version cannot do yet.
    refuse_not_implemented(values, rdzv.backend)
    config = _config(values, environ, (min_nodes, max_nodes, nproc), runtime, rdzv, logs, slurm)
    return Launch(
        config=config,
        kind=kind,
        script=script,
        script_args=tuple(namespace.training_script_args),
        python=python,
        dry_run=values.flag("dry_run"),
        standalone=rdzv.standalone,
        notices=tuple(notices),
    )


def _config(
    values: Values,
    environ: Mapping[str, str],
    size: tuple[int, int, int],
    runtime: Runtime,
    rdzv: Rendezvous,
    logs: LogsSpecs,
    slurm: SlurmSettings | None,
) -> LaunchConfig:
    """The :class:`LaunchConfig` of the parsed steps, checked before anything starts.

    Raises:
        ConfigError: what ``LaunchConfig`` or the agent's environment refuses, naming
            the option as the user gave it (the variable or the other spelling).
    """
    min_nodes, max_nodes, nproc = size
    sources = {opt.canonical: values.source(opt.dest) for opt in OPTIONS}
    try:
        config = LaunchConfig(
            **runtime,
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            nproc_per_node=nproc,
            logs_specs=logs,
            run_id=rdzv.run_id,
            rdzv_endpoint=rdzv.endpoint,
            rdzv_backend=rdzv.backend,
            rdzv_configs=rdzv.configs,
            log_line_prefix_template=environ.get(LOG_LINE_PREFIX_TEMPLATE_ENV),
            local_addr=values.text("local_addr")[0] or (slurm.local_addr if slurm else None),
            use_template=not values.flag("no_template"),
            duplicate_stdout_filters=duplicate_filters(values, "duplicate_stdout_filters"),
            duplicate_stderr_filters=duplicate_filters(values, "duplicate_stderr_filters"),
            virtual_local_rank=values.flag("virtual_local_rank"),
            crash_loop_stop=not values.flag("no_crash_loop_stop"),
            node_rank=rdzv.node_rank,
            master_addr=rdzv.master_addr,
            master_port=rdzv.master_port,
        )
        config.check_before_start(environ)
    except ConfigError as exc:
        raise blame(exc, sources) from exc
    return config

"""The ``elastrun`` command: argv and environment in, exit status out.

Exit status (``core.exitcodes.ExitStatus``, the table in docs/failures.md): 0 success;
1 worker failure (after the report) or a runtime error; 2 bad configuration (one line,
no traceback, nothing started); 93 more restarts would not help (no progress, a crash
loop: do not requeue); 75 this node was found bad (replace it); 128+N after signal N.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from elastrun.core.errors import ConfigError, ElastrunError, NodeExcludedError, ShutdownRequested
from elastrun.core.exitcodes import ExitStatus, signal_status
from elastrun.core.values import parse_int
from elastrun.launch.cli import Launch, ScriptKind, parse_launch
from elastrun.launch.entry import EARLY_SIGNALS
from elastrun.wire.env import ERROR_FILE_ENV

if TYPE_CHECKING:  # not loaded at run time: a bad option must not pay for the agent
    from elastrun.agent.spec import Entrypoint
    from elastrun.supervise.processes.logs import LogsSpecs
    from elastrun.supervise.processes.relay import Console

log = logging.getLogger("elastrun.launch")


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        if record.levelno >= logging.WARNING:
            msg = f"{record.levelname.lower()}: {msg}"
        if record.exc_info:
            msg += "\n" + self.formatException(record.exc_info)
        return f"[elastrun] {msg}"


#: ``LOGLEVEL`` names (any case) and what they mean; a number 0..50 is accepted too.
LOG_LEVELS = logging.getLevelNamesMapping()


def parse_log_level(raw: str, source: str = "LOGLEVEL") -> int:
    """``LOGLEVEL``: a level name (any case) or a number from 0 to 50.

    Raises:
        ConfigError: anything else, naming ``source`` (torch's ``setLevel`` raises a
            ValueError with a traceback).
    """
    name = raw.strip().upper()
    if name in LOG_LEVELS:
        return LOG_LEVELS[name]
    if name.lstrip("+-").isdigit():
        return parse_int(name, source, low=0, high=logging.CRITICAL)
    names = ", ".join(n for n in LOG_LEVELS if n not in ("FATAL", "WARN"))
    raise ConfigError(source, raw, f"must be one of {names}, or a number from 0 to 50")


def configure_logging(environ: os._Environ[str] | dict[str, str]) -> None:
    """elastrun's own lines go to stderr, ``[elastrun]``-prefixed; LOGLEVEL sets the level.

    Raises:
        ConfigError: a ``LOGLEVEL`` that is not a level (nothing is changed then).
    """
    raw = environ.get("LOGLEVEL", "").strip()
    level = parse_log_level(raw) if raw else logging.INFO
    root = logging.getLogger("elastrun")
    if not any(isinstance(h.formatter, _Formatter) for h in root.handlers):  # not ours yet
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_Formatter())
        root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False


def command_of(launch: Launch) -> tuple[Entrypoint, list[object]]:
    """The entrypoint and its arguments, exactly as torchrun builds them."""
    if launch.kind is ScriptKind.RUN_PATH:
        from elastrun.worker.runpath import run_script_path

        return run_script_path, [launch.script, *launch.script_args]
    if launch.kind is ScriptKind.BINARY:
        return launch.script, list(launch.script_args)
    module = ["-m"] if launch.kind is ScriptKind.MODULE else []
    return launch.python, ["-u", *module, launch.script, *launch.script_args]


#: ``elastrun <name> ...`` runs a tool instead of launching; a script of the same name
#: in the working directory still wins (``elastrun store`` with a file called ``store``).
SUBCOMMANDS: dict[str, str] = {
    "store": "elastrun.launch.commands.store:store_main",
    "timeline": "elastrun.launch.commands.timeline:timeline_main",
    "stacks": "elastrun.launch.commands.stacks:stacks_main",
    "k8s": "elastrun.launch.commands.k8s:k8s_main",
}


def main(
    argv: Sequence[str] | None = None,
    *,
    held_mask: set[int | signal.Signals] | None = None,
    console: Console | None = None,
) -> int:
    """Run the launcher; returns the exit status (see the module docstring).

    ``held_mask``: the signal mask the process had before the entry point blocked the
    early signals (``launch.entry``); None blocks them here.

    ``console``: where tee'd worker lines go. None, for a caller in Python, is
    ``sys.stdout``/``sys.stderr`` as they are when the workers start, as torch's
    ``torch.distributed.run.main`` does: ``contextlib.redirect_stdout`` gets them. The
    ``elastrun`` command (``launch.entry``), which owns its process's descriptors,
    passes ``FD_CONSOLE``.
    """
    # From here until the handlers are installed (_run), a stop signal waits, blocked,
    # instead of acting by its inherited disposition half-way through parsing (exit -N,
    # a KeyboardInterrupt traceback, or nothing at all where it was ignored): on a
    # loaded machine the imports and checks before the handlers take a second or more.
    # Nothing is started meanwhile that could inherit the mask: the handlers are in
    # place, and the signals unblocked, before the first child (the worker template) is.
    if held_mask is None:
        held_mask = signal.pthread_sigmask(signal.SIG_BLOCK, EARLY_SIGNALS)
    try:
        try:
            configure_logging(os.environ)
        except ConfigError as exc:
            print(f"elastrun: error: {exc}", file=sys.stderr)
            return ExitStatus.BAD_CONFIG
        args = list(sys.argv[1:] if argv is None else argv)
        if args and args[0] in SUBCOMMANDS and not os.path.exists(args[0]):
            # A tool (``elastrun store``) installs its own handlers, if any.
            signal.pthread_sigmask(signal.SIG_SETMASK, held_mask)
            import pkgutil

            code: int = pkgutil.resolve_name(SUBCOMMANDS[args[0]])(args[1:])
            return code
        try:
            launch = parse_launch(args, os.environ)
            if launch.dry_run:
                from elastrun.launch.dryrun import render_plan

                print(render_plan(launch, *command_of(launch), os.environ))
                return 0
        except ConfigError as exc:
            print(f"elastrun: error: {exc}", file=sys.stderr)
            return ExitStatus.BAD_CONFIG
        for notice in launch.notices:
            log.info("%s", notice)
        return _run(launch, held_mask, console)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held_mask)


def _run(launch: Launch, mask: set[int | signal.Signals], console: Console | None) -> int:
    """Launch with the early signals blocked; ``mask``: the mask to restore once the
    launcher's own handlers are installed; ``console``: see :func:`main`."""
    # Imported here, not at the top: a dry run, a subcommand or a bad option must not pay
    # for loading the agent and everything it runs.
    from elastrun.core.shutdown import ShutdownRequest
    from elastrun.launch.api import launch_agent
    from elastrun.launch.config import parse_signals
    from elastrun.launch.signals import install_signal_handlers
    from elastrun.store.tcp.limits import raise_fd_limit
    from elastrun.supervise.failures.report import ChildFailedError, copy_root_cause_error_file

    # Before anything opens a descriptor: an agent serving the rendezvous store holds
    # one per connected node, and the common soft limit (1024) is below what a large
    # job, or a flood of strangers, needs. Children inherit the raised limit.
    raise_fd_limit()
    entry, args = command_of(launch)
    specs = launch.config.logs_specs
    # The CLI owns signals: its handlers are installed here, and only then are the
    # signals held back since the start let through (one that came meanwhile is now a
    # stop request, which the launch answers before it starts anything).
    shutdown = ShutdownRequest()
    handled = parse_signals(launch.config.signals_to_handle)
    restore = install_signal_handlers(handled, shutdown)
    # A handled signal the parent left blocked is let through too: the launcher answers
    # it, and forwards it to workers, which inherit this mask.
    inherited = sorted(s.name for s in handled if s in mask)
    if inherited:
        log.info("unblocking %s (blocked by the parent process) to handle it", inherited)
    signal.pthread_sigmask(signal.SIG_SETMASK, set(mask) - set(handled))
    try:
        launch_agent(launch.config, entry, args, console=console, shutdown=shutdown)
    except ChildFailedError as exc:
        print(exc.format_msg(), file=sys.stderr)
        _mention_logs(specs)
        own = os.environ.get(ERROR_FILE_ENV)
        if own:
            copy_root_cause_error_file(exc, own)
        return exc.exit_status
    except ShutdownRequested as exc:
        print(f"elastrun: stopped by {exc.signal_name}", file=sys.stderr)
        _mention_logs(specs)
        return signal_status(exc.signum)
    except ElastrunError as exc:  # a configuration, a rendezvous, a worker start, a store...
        print(f"elastrun: error: {exc}", file=sys.stderr)
        if isinstance(exc, ConfigError):
            return ExitStatus.BAD_CONFIG
        excluded = isinstance(exc, NodeExcludedError)
        return ExitStatus.REPLACE_NODE if excluded else ExitStatus.WORKER_FAILED
    finally:
        restore()
        shutdown.close()
    _cleanup_temporary_logs(specs)
    return ExitStatus.SUCCESS


def _mention_logs(specs: LogsSpecs | None) -> None:
    run_dir = getattr(specs, "run_log_dir", None)
    if run_dir:
        print(f"elastrun: worker logs and error files are in {run_dir}", file=sys.stderr)


def _cleanup_temporary_logs(specs: LogsSpecs | None) -> None:
    """A clean run leaves nothing behind in a log directory the user did not ask for --
    unless it wrote diagnostics there (the stacks of a worker found stuck or hung, which
    a warning named during the run): those are kept, and the last line says where."""
    from elastrun.supervise.processes.logs import DefaultLogsSpecs
    from elastrun.supervise.processes.stacks import dump_size

    if not (isinstance(specs, DefaultLogsSpecs) and specs.is_temporary):
        return
    root = specs.root_log_dir
    stacks = sorted(
        os.path.join(top, name)
        for top, _, names in os.walk(root)
        for name in names
        if name == "stacks.txt" and dump_size(os.path.join(top, name)) > 0
    )
    if stacks:
        print(
            f"elastrun: the run wrote diagnostics ({len(stacks)} stack dump(s)); kept in "
            f"{root}: {', '.join(stacks)}",
            file=sys.stderr,
        )
        return
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    from elastrun.supervise.processes.relay.console import FD_CONSOLE

    sys.exit(main(console=FD_CONSOLE))  # run as a command, like launch.entry

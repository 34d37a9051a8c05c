"""The ``elastrun`` command's first lines (and ``python -m elastrun``'s).

The stop signals are held back (blocked) before anything else is imported: loading the
launcher takes a tenth of a second, seconds on a loaded machine, and a signal in that
time would otherwise act by its inherited disposition -- kill the launcher half-way
through, or vanish unanswered where the parent left it ignored (a shell's background
job ignores SIGINT), while the launcher goes on to start the job. Held back, it waits
until the launcher's own handler is in place, which then answers it before anything
is started.
"""

from __future__ import annotations

import signal

#: The default ``--signals-to-handle``: held back from the first line until handled.
EARLY_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT})


def main() -> int:
    """The console script: block the early signals, then load and run the launcher."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, EARLY_SIGNALS)
    try:
        from elastrun.core.collector import calm_full_collections
        from elastrun.launch.main import main as run_launcher
        from elastrun.supervise.processes.relay.console import FD_CONSOLE
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        raise
    calm_full_collections()  # a store of thousands of nodes may be served from here
    # The command owns its process's stdout and stderr: tee'd lines go straight to
    # descriptors 1 and 2 (no encoding round trip, nothing left in a Python buffer at
    # exit). main() called from Python writes them through sys.stdout, as torch's does.
    return run_launcher(held_mask=held, console=FD_CONSOLE)

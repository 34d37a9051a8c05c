"""The output relay: tee'd worker streams to their log files, the console and filter files.

torchrun implements ``--tee`` by letting the worker write to its log file and tailing
that file from a thread per file, polling every 0.1 s. That delays output, costs a
thread per file, and the tail can lose the end of a file when it is stopped early.

Here a tee'd stream goes into a pipe. One relay thread waits on all pipes with a
selector; for each chunk read it writes the raw bytes to the log file (byte-exact), and
each complete line, with the rank's prefix, to the console and, when the line contains
one of the duplicate filters, to the filtered file. :meth:`OutputRelay.close` drains
every pipe until its writers are gone, bounded by a deadline, so nothing written by a
worker that has exited is lost. Which streams go through the relay:
:meth:`OutputRelay.wire`.

Line handling:

* lines end at ``\\n``, ``\\r\\n`` or a lone ``\\r`` (so progress bars that redraw with
  ``\\r`` still show progress, as with torchrun, whose tail reads in universal-newline
  mode); each console line keeps its own terminator;
* bytes are passed through unchanged to log files and descriptor consoles (no
  decoding, non-UTF-8 output survives; a Python text console gets them decoded);
* a line longer than 64 KiB is shown in 64 KiB pieces, each with the prefix and a
  newline, so one endless line cannot grow memory without bound; the log file still
  gets the line unchanged;
* a last line without a newline is shown, with a newline added, when its stream ends
  or the relay closes;
* console writes are whole lines, at most ``PIPE_BUF`` bytes each (``stream.render``),
  so lines of different ranks, and of other writers to the pipe, never interleave.

The console is the ``elastrun`` command's descriptors 1 and 2 (:data:`FD_CONSOLE`), or
the Python API's ``sys.stdout``/``sys.stderr`` (:data:`PYTHON_CONSOLE`); ``console``
says why. The filtered file of a stream is created (empty) at the first
:meth:`OutputRelay.wire` when filters for that stream are set, as torchrun does, so
that it can be watched before any line matches.

Log files that cannot be written (a full disk, a removed directory) never stop a worker
from starting: a stream whose file cannot be opened, or whose attempt has no log
directory (``LogsDest.problem``), is shown on the console with the rank's prefix
instead, with one warning line; a log file that fails later is dropped while the
console copy goes on. :meth:`OutputRelay.log_problem` tells the failure report why a
rank's log files may be missing or incomplete.
"""

from __future__ import annotations

from elastrun.supervise.processes.relay.console import (
    FD_CONSOLE,
    PYTHON_CONSOLE,
    Console,
    FdConsole,
    PythonConsole,
)
from elastrun.supervise.processes.relay.output import OutputRelay
from elastrun.supervise.processes.relay.sinks import WorkerStdio
from elastrun.supervise.processes.relay.stream import MAX_LINE

__all__ = [
    "FD_CONSOLE",
    "MAX_LINE",
    "PYTHON_CONSOLE",
    "Console",
    "FdConsole",
    "OutputRelay",
    "PythonConsole",
    "WorkerStdio",
]

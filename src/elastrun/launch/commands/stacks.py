"""``elastrun stacks LOG_DIR``: every worker's Python stacks, from a job that seems hung.

Each Python worker started through elastrun's bootstrap dumps all its threads' stacks
to ``<attempt>/<local_rank>/stacks.txt`` when it receives SIGUSR1 (faulthandler, so it
answers even from native code). This command finds the newest attempt under a log
directory, signals the workers listed in its ``workers.json`` (:mod:`elastrun.wire.workers`)
-- after checking by start time that each pid still is that worker -- and prints what
they wrote.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from elastrun.core.errors import ConfigError
from elastrun.core.procinfo import process_start_time
from elastrun.core.values import parse_seconds
from elastrun.launch.commands import CommandParser
from elastrun.supervise.processes.stacks import dump_size
from elastrun.wire import workers as workers_file


def _is_that_worker(pid: int, start_time: int | None) -> bool:
    """The pid still runs the worker the agent started (not a reused pid)."""
    now = process_start_time(pid)
    return now is not None and (start_time is None or now == start_time)


def stacks_main(argv: list[str]) -> int:
    """``elastrun stacks LOG_DIR``: 0 when every worker answered, 1 when some did not,
    2 for bad arguments (one line on stderr) or no workers under ``LOG_DIR``."""
    parser = CommandParser(
        prog="elastrun stacks",
        description="Print the Python stacks of every worker of a running job.",
    )
    parser.add_argument("log_dir", help="the job's --log-dir (or its run directory)")
    parser.add_argument(
        "--timeout", default="3.0", help="seconds to wait for dumps, at most a year (default: 3)"
    )
    try:
        args = parser.parse_args(argv)  # -h/--help prints and exits here
        timeout = parse_seconds(args.timeout, "--timeout")
    except ConfigError as exc:
        # argparse's own messages carry no value: leave out ConfigError's "(got None)".
        text = exc.reason if exc.value is None else str(exc)
        print(f"elastrun stacks: error: {text}", file=sys.stderr)
        return 2
    found = [p.parent for p in Path(args.log_dir).glob(f"**/{workers_file.FILE_NAME}")]
    attempts = sorted(found, key=lambda p: p.stat().st_mtime)
    if not attempts:
        print(f"elastrun stacks: no {workers_file.FILE_NAME} under {args.log_dir}", file=sys.stderr)
        return 2
    attempt = attempts[-1]
    try:
        workers = workers_file.decode((attempt / workers_file.FILE_NAME).read_bytes())
    except (OSError, workers_file.WorkersFileError) as exc:
        print(f"elastrun stacks: {attempt / workers_file.FILE_NAME}: {exc}", file=sys.stderr)
        return 2
    return _dump(attempt, workers, timeout)


def _dump(attempt: Path, workers: dict[int, workers_file.WorkerEntry], timeout: float) -> int:
    """Signal ``workers`` and print what each wrote within ``timeout`` seconds: 0 when
    every worker answered, 1 when some did not."""
    sizes: dict[int, int] = {}
    missing: dict[int, str] = {}  # why a worker was not asked
    for lr, info in sorted(workers.items()):
        sizes[lr] = dump_size(info.stacks)
        try:
            if _is_that_worker(info.pid, info.start_time):
                os.kill(info.pid, signal.SIGUSR1)
                continue
            missing[lr] = "not running"
        except ProcessLookupError:
            missing[lr] = "not running"  # it ended after the look
        except OSError as exc:  # another user's worker
            missing[lr] = f"cannot signal it: {exc.strerror}"
    deadline = time.monotonic() + timeout
    pending = {lr for lr in workers if lr not in missing}
    while pending and time.monotonic() < deadline:
        pending = {lr for lr in pending if dump_size(workers[lr].stacks) <= sizes[lr]}
        time.sleep(0.05)
    time.sleep(0.1)  # let a dump that has begun finish
    print(f"stacks of {attempt}")
    for lr, info in sorted(workers.items()):
        print(f"=== local rank {lr} (pid {info.pid}) ===")
        if lr in missing:
            print(f"  {missing[lr]}")
            continue
        try:
            with open(info.stacks, encoding="utf-8", errors="replace") as fh:
                fh.seek(sizes[lr])
                text = fh.read().rstrip()
        except OSError as exc:  # no dump was ever written there, or it cannot be read
            text = f"  no answer: cannot read {info.stacks}: {exc.strerror}"
        print(text or "  no answer (not a Python worker, or SIGUSR1 is handled elsewhere)")
    return 1 if pending or any(why != "not running" for why in missing.values()) else 0

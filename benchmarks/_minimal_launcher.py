"""The least a Python launcher of Python workers can do, as a yardstick for elastrun.

``python _minimal_launcher.py --standalone --nproc-per-node=N script.py ARGS`` imports
what any such launcher needs (argument parsing, logging, dataclasses, subprocess,
sockets, json, threads, temporary files), then forks its N workers from itself -- no
fresh interpreter, faster than any exec -- and runs the script in each with ``runpy``
(``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` set), and waits for them. No rendezvous,
no store, no log files, no supervision, no error report: a lower bound for a launcher
written in Python, not a launcher.
"""

import argparse
import dataclasses  # noqa: F401 - imported for its cost: every launcher's config uses it
import json  # noqa: F401
import logging  # noqa: F401
import os
import runpy
import socket  # noqa: F401
import subprocess  # noqa: F401
import sys
import tempfile  # noqa: F401
import threading  # noqa: F401


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--standalone", action="store_true")
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    pids = []
    for rank in range(args.nproc_per_node):
        pid = os.fork()
        if pid == 0:
            os.environ.update(
                RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc_per_node)
            )
            sys.argv = [args.script, *args.script_args]
            try:
                runpy.run_path(args.script, run_name="__main__")
            finally:
                os._exit(0)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    return max(codes, default=0)


if __name__ == "__main__":
    sys.exit(main())

"""Facts about processes read from /proc."""

from __future__ import annotations

import os


def _stat(pid: int | str, proc_root: str = "/proc") -> list[bytes]:
    """The fields of ``<proc_root>/<pid>/stat`` from the state on (state, parent, ...),
    empty if the process is gone. They follow the *last* ``)``: the command name in
    parentheses before them may itself contain spaces and parentheses."""
    try:
        with open(f"{proc_root}/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return []  # the process ended (or /proc is not mounted)
    _, sep, rest = raw.rpartition(b")")
    return rest.split() if sep else []


def read_proc_state(pid: int, proc_root: str = "/proc") -> str | None:
    """The state letter of ``pid`` from ``<proc_root>/<pid>/stat``, or None if gone."""
    fields = _stat(pid, proc_root)
    return fields[0].decode("ascii", "replace") if fields else None


def parent_pid(pid: int | str) -> int | None:
    """The parent of ``pid``, None if it is gone."""
    fields = _stat(pid)
    return int(fields[1]) if len(fields) > 1 else None


def children(parent: int) -> list[int]:
    """The children of ``parent``, from /proc (those exited and not reaped included)."""
    return [
        int(name) for name in os.listdir("/proc") if name.isdigit() and parent_pid(name) == parent
    ]


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), None if it is gone.

    Together with the pid it names one process for good: a reused pid gets a later
    start time, so a recorded (pid, start time) is never mistaken for a stranger.
    """
    fields = _stat(pid)
    return int(fields[19]) if len(fields) > 19 else None


def is_open(fd: int) -> bool:
    """Whether this process holds the descriptor ``fd``."""
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


#: The lines of /proc/<pid>/status that say where a signal sent to the process is
#: (``CoreDumping``: 1 while it writes a core, dying of a fatal signal of its own).
SIGNAL_FIELDS = (
    "State", "Threads", "CoreDumping", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt",
)  # fmt: skip


def signal_state(pid: int) -> str | None:
    """``pid``'s state, signal masks and the kernel function it sleeps in, as /proc
    shows them ("State: S (sleeping), ..., SigPnd: 0000000000000000, ..., wchan:
    pipe_read"), None if it is gone: the evidence for a process that did not end on a
    signal (was the signal pending, blocked or ignored, and where did it wait?)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            fields = dict(line.rstrip("\n").split(":\t", 1) for line in fh if ":\t" in line)
    except OSError:
        return None
    shown = [f"{name}: {fields[name].strip()}" for name in SIGNAL_FIELDS if name in fields]
    try:
        with open(f"/proc/{pid}/wchan", encoding="ascii", errors="replace") as fh:
            shown.append(f"wchan: {fh.read().strip() or '-'}")
    except OSError:
        pass
    return ", ".join(shown)


def core_dumping(pid: int) -> bool:
    """Whether ``pid`` is writing a core dump: it is dying of a fatal signal of its own
    (SIGABRT, SIGSEGV...), and ends once the dump is written. A SIGKILL meanwhile cuts
    the dump short, and the kernel then reports the process as killed by SIGKILL, not
    by its own signal."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            return any(line.split() == ["CoreDumping:", "1"] for line in fh)
    except OSError:
        return False

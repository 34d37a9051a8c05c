"""Facts about processes read from /proc."""

from __future__ import annotations


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), None if it is gone.

    Together with the pid it names one process for good: a reused pid gets a later
    start time, so a recorded (pid, start time) is never mistaken for a stranger.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return int(fh.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


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

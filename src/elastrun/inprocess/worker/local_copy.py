"""Taking a commit's bytes straight from another process's memory on the same machine.

Over gloo a tensor's bytes cross a loopback TCP connection: the sender copies them into
the kernel, the receiver out of it, both in 16 MiB collectives; on a shared 2-core
machine that is 0.5-1.5 GB/s. Ranks of one machine can do better: the receiver reads
the sender's tensors with ``process_vm_readv`` (Linux), one copy from the sender's
pages into its own tensor, several chunks at once on a few threads (ctypes releases the
GIL), several GB/s.

It needs the two processes in one PID namespace of one boot (the ``Whereabouts`` key:
a PID means the same process on both sides) and the permission to read the sender's
memory: the same user, and where Yama restricts ptrace to descendants, the sender names
the agent (whose descendants all the workers are) with ``PR_SET_PTRACER`` for the
duration of the transfer. Anything else (another machine, CUDA tensors, a refusal)
falls back to gloo: every receiver reports, and one failure sends the whole commit
over gloo again.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elastrun.core import linux

if TYPE_CHECKING:
    import torch

#: Threads a receiver reads with (each ``process_vm_readv`` call is one memcpy).
THREADS = 4


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


@dataclass(frozen=True)
class Whereabouts:
    """Where a rank's commit lies: its machine and namespace, its pid, and each tensor's
    address and length (None: this rank's tensors cannot be read from outside)."""

    key: str
    pid: int
    spans: tuple[tuple[int, int], ...] | None


def whereabouts(tensors: Sequence[torch.Tensor] | None) -> Whereabouts:
    """This rank's ``Whereabouts``; ``tensors``: the commit it sends (None: it sends
    none)."""
    spans = None
    if tensors is not None and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        spans = tuple((t.data_ptr(), t.nbytes) for t in tensors)
    return Whereabouts(_machine_key(), os.getpid(), spans)


def allow_readers() -> None:
    """Let the other workers (the agent's descendants) read this process's memory where
    Yama restricts it (a no-op elsewhere)."""
    linux.set_ptracer(os.getppid())


def forbid_readers() -> None:
    linux.set_ptracer(0)


def read_chunks(
    targets: Sequence[torch.Tensor],
    parts: Sequence[tuple[int, int, int, int]],
    sources: dict[int, Whereabouts],
) -> bool:
    """Copy each part (tensor index, start byte, stop byte, source rank) of the sources'
    tensors into ``targets`` (contiguous CPU tensors); False when any cannot be read
    (then nothing may be assumed about ``targets``)."""
    libc = _libc()
    mine = _machine_key()
    if libc is None or any(w.key != mine or w.spans is None for w in sources.values()):
        return False
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in targets):
        return False
    jobs = []
    for index, start, stop, source in parts:
        where = sources[source]
        assert where.spans is not None
        address, length = where.spans[index]
        if length != targets[index].nbytes:
            return False
        jobs.append((where.pid, address + start, targets[index].data_ptr() + start, stop - start))
    with concurrent.futures.ThreadPoolExecutor(THREADS, "elastrun-commit-read") as pool:
        return all(pool.map(lambda job: _read(libc, *job), jobs))


def _read(libc: ctypes.CDLL, pid: int, remote: int, local: int, length: int) -> bool:
    done = 0
    while done < length:
        here = _IoVec(local + done, length - done)
        there = _IoVec(remote + done, length - done)
        got = libc.process_vm_readv(pid, ctypes.byref(here), 1, ctypes.byref(there), 1, 0)
        if got <= 0:
            return False
        done += got
    return True


def _machine_key() -> str:
    """Equal for two processes exactly when a pid means the same process to both."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            boot = fh.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return f"unknown/{os.getpid()}"  # matches no other process


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """libc with ``process_vm_readv`` typed, or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    lib = linux.libc()
    func = getattr(lib, "process_vm_readv", None)
    if lib is None or func is None:
        return None
    func.restype = ctypes.c_ssize_t
    func.argtypes = [
        ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
        ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong,
    ]  # fmt: skip
    return lib

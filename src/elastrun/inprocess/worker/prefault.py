"""Faulting in a receiver's new tensors while the rest of the transfer goes on.

A replacement receives Adam's moments (two thirds of the state) into tensors it has
just allocated: untouched memory, each 4 KiB page of which the kernel must allocate,
zero and map at the first write. On this project's machines that costs about 2.5 us a
page (half again to twice the copy itself), and it is the bulk of a same-machine
transfer's time (``inprocess.local_copy``).

That work cannot be skipped, but it need not wait for the bytes: as soon as the tensors
exist, a thread asks the kernel to populate them (``madvise(MADV_POPULATE_WRITE)``,
Linux 5.14+; ctypes releases the GIL) while the readers copy (or, over gloo, while
the ranks report and the streams start). It walks the tensors from the last page back,
so that it meets the readers, who go forward, instead of faulting the same pages beside
them.

Rejected: populating in ``State.targets`` before the exchange (the same work, just
moved in front of the timer); transparent huge pages (512 times fewer faults, but a
fresh process's first huge pages cost several times more than small ones here, and
compaction stalls under load); a guess of the moments' shapes before the commit's
description arrives (an optimizer's state is not known until then).

Populating never changes a page's contents (a page already written is left as it is),
so the thread may race the readers freely; it stops between two slices when asked, and
a kernel without the call (EINVAL) or any other refusal just ends it: the readers then
fault the pages in themselves, as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from elastrun.core import linux
from elastrun.core.cancel import CancelScope
from elastrun.core.threads import Nursery

if TYPE_CHECKING:
    import torch

#: Bytes per madvise call: small enough that a stop request is seen within a few ms.
SLICE = 8 << 20
#: Tensors smaller than this are left to the readers (a thread costs more).
MINIMUM = 1 << 20

_MADV_POPULATE_WRITE = 23
_PAGE = mmap.PAGESIZE


def spans(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """The whole pages (start address, length) of the CPU tensors worth populating, in
    the order the thread takes them: last tensor first, each from its end."""
    out = []
    for t in reversed(tensors):
        if t.device.type != "cpu":
            continue
        begin = t.data_ptr()
        end = begin + t.nbytes
        first, last = -(-begin // _PAGE) * _PAGE, end // _PAGE * _PAGE
        if last - first < MINIMUM:
            continue
        for stop in range(last, first, -SLICE):
            start = max(first, stop - SLICE)
            out.append((start, stop - start))
    return out


@contextlib.contextmanager
def populating(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Populate ``tensors``' pages on a thread for the duration of the block; the thread
    is stopped and joined when the block ends, however it ends."""
    work = spans(tensors)
    madvise = _madvise() if work else None
    if madvise is None:
        yield
        return
    with Nursery(join_timeout=None) as nursery:  # (closed, and joined, however it ends)
        nursery.start(_populate, madvise, work, name="elastrun-prefault")
        yield


#: madvise(2): (address, length, advice) -> 0 or -1.
_Madvise = Callable[[int, int, int], int]


def _populate(scope: CancelScope, madvise: _Madvise, work: list[tuple[int, int]]) -> None:
    for start, length in work:
        if scope.cancelled or madvise(start, length, _MADV_POPULATE_WRITE) != 0:
            return


@functools.cache
def _madvise() -> _Madvise | None:
    if not sys.platform.startswith("linux"):
        return None
    func = getattr(linux.libc(), "madvise", None)
    if func is None:
        return None
    func.restype = ctypes.c_int
    func.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise: _Madvise = func
    return madvise

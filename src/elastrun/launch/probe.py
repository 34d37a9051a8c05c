"""What the machine offers, counted without importing torch: GPUs and CPUs.

``--nproc-per-node gpu|cpu|auto`` reads these.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

__all__ = ["NVIDIA_GPUS_DIR", "count_cpus", "count_nvidia_gpus"]

#: A plain path, not a ``pathlib.Path``: pathlib (and urllib.parse behind it) would be
#: imported by every launch for this one constant.
NVIDIA_GPUS_DIR = "/proc/driver/nvidia/gpus"


def count_nvidia_gpus(
    environ: Mapping[str, str], gpus_dir: str | os.PathLike[str] = NVIDIA_GPUS_DIR
) -> int:
    """Count the NVIDIA GPUs this process may use, without importing torch.

    The driver lists one entry per GPU under ``/proc/driver/nvidia/gpus``. When
    ``CUDA_VISIBLE_DEVICES`` is set in ``environ`` it narrows the count the way CUDA
    reads it: entries up to the first invalid one, and none at all if one repeats.
    """
    try:
        physical = len(os.listdir(gpus_dir))
    except OSError:
        return 0
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return physical
    seen: set[str | int] = set()
    for raw in visible.split(","):
        item = raw.strip()
        ident: str | int
        if item.startswith(("GPU-", "MIG-")):
            ident = item
        else:
            match = re.match(r"[+-]?\d+", item)
            if match is None:
                break
            ident = int(match.group())
            if not 0 <= ident < physical:
                break
        if ident in seen:
            return 0
        seen.add(ident)
    return min(len(seen), physical)


def count_cpus() -> int:
    """The CPUs this process may run on (its affinity mask), as torchrun counts them."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1  # pragma: no cover - platforms without affinity masks

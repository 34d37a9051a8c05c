"""The random number generators a commit includes: torch's (CPU and every CUDA device
already initialised), numpy's global one (when numpy is imported) and ``random``'s.

A step that draws from them (dropout, augmentation, a shuffled batch) done again after
a rollback draws the same numbers, so a recovery stays bit-identical. A replacement
takes its predecessor's generators from the node's memory (``inprocess.worker.own``),
else those of the rank whose commit it takes.
"""

from __future__ import annotations

import random
import sys
from typing import Any

#: What ``capture`` returns: plain values (bytes, tuples), small enough to pickle.
RngState = dict[str, Any]


def capture() -> RngState:
    import torch

    out: RngState = {
        "torch": bytes(torch.get_rng_state().numpy().tobytes()),
        "random": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        out["cuda"] = [bytes(s.numpy().tobytes()) for s in torch.cuda.get_rng_state_all()]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        out["numpy"] = numpy.random.get_state()
    return out


def restore(saved: RngState) -> None:
    import torch

    torch.set_rng_state(_byte_tensor(saved["torch"]))
    random.setstate(saved["random"])
    cuda = saved.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([_byte_tensor(s) for s in cuda])
    numpy = sys.modules.get("numpy")
    if numpy is not None and "numpy" in saved:
        numpy.random.set_state(saved["numpy"])


def _byte_tensor(data: bytes) -> Any:
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8)

"""``init_process_group`` from the environment elastrun (or torchrun) gives a worker."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from elastrun.core.errors import ConfigError

REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_process_group(
    backend: str | None = None, *, timeout: timedelta | None = None, **kwargs: Any
) -> None:
    """Initialise torch.distributed from the launcher's environment (``env://``).

    Args:
        backend: ``"gloo"``, ``"nccl"``, ...; None picks nccl when CUDA is available,
            gloo otherwise.
        timeout: passed to torch.
        kwargs: further arguments for ``torch.distributed.init_process_group``.

    Raises:
        ConfigError: the process was not started by elastrun or torchrun (the rank
            variables are missing), naming what is missing and how to launch.
    """
    missing = [name for name in REQUIRED if not os.environ.get(name)]
    if missing:
        raise ConfigError(
            "environment",
            ",".join(missing),
            "this process was not started by elastrun (or torchrun); launch it with "
            "`elastrun --nproc-per-node N script.py` so that the rank variables are set",
        )
    import torch
    import torch.distributed as dist

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if timeout is not None:
        kwargs["timeout"] = timeout
    dist.init_process_group(backend=backend, init_method="env://", **kwargs)

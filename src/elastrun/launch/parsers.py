"""Parsers of single ``elastrun`` option values; each raises ConfigError naming ``source``."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence

from elastrun.core.errors import ConfigError
from elastrun.core.values import parse_int
from elastrun.launch.config import MAX_NODES, MAX_NPROC_PER_NODE
from elastrun.launch.probe import NVIDIA_GPUS_DIR, count_cpus, count_nvidia_gpus

__all__ = ["parse_nnodes", "parse_nproc_per_node", "parse_rdzv_conf", "to_choice"]


def parse_nnodes(value: str, source: str = "--nnodes") -> tuple[int, int]:
    """Parse ``N`` or ``MIN:MAX`` into ``(min_nodes, max_nodes)``.

    Raises:
        ConfigError: not one or two integers, or not ``1 <= min <= max <= MAX_NODES``.
    """
    parts = value.split(":")
    if len(parts) > 2:
        raise ConfigError(source, value, "must be N or MIN:MAX")
    numbers = []
    for part in parts:
        try:
            numbers.append(parse_int(part, source, low=1, high=MAX_NODES))
        except ConfigError as exc:
            raise ConfigError(source, value, f"N or MIN:MAX: each {exc.reason}") from None
    low, high = numbers[0], numbers[-1]
    if high < low:
        raise ConfigError(source, value, "the maximum must not be below the minimum")
    return low, high


def parse_nproc_per_node(
    value: str,
    environ: Mapping[str, str],
    source: str = "--nproc-per-node",
    gpus_dir: str | os.PathLike[str] = NVIDIA_GPUS_DIR,
) -> tuple[int, str | None]:
    """Resolve ``--nproc-per-node`` into a worker count.

    Returns ``(count, device)``: ``device`` is ``"cpu"`` or ``"gpu"`` when the count
    was derived from the machine, None for a plain number.

    Raises:
        ConfigError: not an integer from 1 to ``MAX_NPROC_PER_NODE`` nor ``cpu``,
            ``gpu``, ``auto``; ``gpu`` without any GPU; ``xpu``, which elastrun does not
            support.
    """
    if re.fullmatch(r"\s*[+-]?\d+\s*", value):
        return parse_int(value, source, low=1, high=MAX_NPROC_PER_NODE), None
    if value == "cpu":
        cpus = count_cpus()
        if cpus > MAX_NPROC_PER_NODE:
            raise ConfigError(
                source, value, f"{cpus} CPUs: more than {MAX_NPROC_PER_NODE} workers per node"
            )
        return cpus, "cpu"
    if value == "gpu":
        gpus = count_nvidia_gpus(environ, gpus_dir)
        if gpus == 0:
            raise ConfigError(source, value, "no GPU found (counted NVIDIA GPUs only)")
        return gpus, "gpu"
    if value == "auto":
        gpus = count_nvidia_gpus(environ, gpus_dir)
        return (gpus, "gpu") if gpus else (count_cpus(), "cpu")
    if value == "xpu":
        raise ConfigError(source, value, "XPU devices are not supported by elastrun")
    raise ConfigError(
        source, value, f"must be an integer from 1 to {MAX_NPROC_PER_NODE}, cpu, gpu or auto"
    )


def parse_rdzv_conf(value: str, source: str = "--rdzv-conf") -> dict[str, str]:
    """Parse ``KEY=VALUE,KEY=VALUE`` into a dict of strings (torchrun's rules).

    Items are split on ``,`` and each on its first ``=``; keys and values are stripped.

    Raises:
        ConfigError: an item with an empty key or an empty value, naming the item.
    """
    config: dict[str, str] = {}
    if not value.strip():
        return config
    for item in value.strip().split(","):
        key, sep, val = item.partition("=")
        if not key.strip():
            what = "an empty item" if not item.strip() else "an item with an empty key"
            raise ConfigError(source, item, f"{what} in {value!r}; expected KEY=VALUE,...")
        if not sep or not val.strip():
            raise ConfigError(source, item, f"the key {key.strip()!r} has no value")
        config[key.strip()] = val.strip()
    return config


def to_choice(raw: str, source: str, choices: Sequence[str]) -> str:
    """``raw`` itself when it is one of ``choices``; else a ConfigError naming ``source``."""
    if raw not in choices:
        raise ConfigError(source, raw, f"must be one of {', '.join(choices)}")
    return raw

"""The worker-log options (``--log-dir``, ``--redirects``, ``--tee``, ``--logs-specs``...)
as one checked :class:`LogsSpecs`.

``--logs-specs NAME`` is an entry point in ``elastrun.logs_specs`` or
``torchrun.logs_specs``, loaded here; ``default`` is always ours (loading torch's entry
point of that name would import torch into the launcher).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from elastrun.core.errors import ConfigError
from elastrun.launch.argv import Values
from elastrun.launch.entry_points import find_entry_point
from elastrun.launch.paths import check_log_dir
from elastrun.supervise.processes.logs import (
    DefaultLogsSpecs,
    LogsSpecs,
    Std,
    parse_duplicate_filters,
    parse_local_ranks_filter,
)

__all__ = ["LOGS_SPECS_ENTRY_POINT_GROUPS", "duplicate_filters", "logs_specs"]

LOGS_SPECS_ENTRY_POINT_GROUPS = ("elastrun.logs_specs", "torchrun.logs_specs")


def logs_specs(values: Values, nproc: int) -> LogsSpecs:
    """The log layout of this launch, its options checked against ``nproc`` workers.

    Raises:
        ConfigError: a bad ranks filter or stream spec, a local rank this node does not
            have, an unknown or broken ``--logs-specs`` plugin, or an unusable
            ``--log-dir``.
    """
    ranks_raw, ranks_source = values.required("local_ranks_filter")
    try:
        ranks = parse_local_ranks_filter(ranks_raw)
    except ValueError as exc:
        raise ConfigError(
            ranks_source, ranks_raw, "must be a comma-separated list of local ranks"
        ) from exc
    _check_local_ranks(ranks or (), nproc, ranks_raw, ranks_source)
    streams: dict[str, object] = {}
    for dest in ("redirects", "tee"):
        raw, source = values.required(dest)
        try:
            streams[dest] = std = Std.from_str(raw)
        except ValueError as exc:
            raise ConfigError(source, raw, "must be 0-3, or LOCAL_RANK:0-3,...") from exc
        if isinstance(std, dict):
            _check_local_ranks(std, nproc, raw, source)
    log_dir, log_dir_source = values.text("log_dir")
    specs = _build_logs_specs(
        *values.text("logs_specs"), log_dir=log_dir, local_ranks_filter=ranks, **streams
    )
    if isinstance(specs, DefaultLogsSpecs) and log_dir and log_dir != os.devnull:
        check_log_dir(log_dir, log_dir_source)
    return specs


def duplicate_filters(values: Values, dest: str) -> list[str] | None:
    """``--duplicate-stdout-filters`` or ``--duplicate-stderr-filters``; None when empty."""
    return parse_duplicate_filters(values.required(dest)[0]) or None


def _check_local_ranks(ranks: Iterable[int], nproc: int, raw: str, source: str) -> None:
    """A local rank that no worker of this node has is a typo, not an empty filter."""
    missing = sorted(rank for rank in ranks if rank >= nproc)
    if missing:
        raise ConfigError(
            source,
            raw,
            f"local rank {missing[0]} does not exist: this node runs {nproc} worker(s), "
            f"local ranks 0 to {nproc - 1}",
        )


def _build_logs_specs(name: str | None, source: str, /, **arguments: object) -> LogsSpecs:
    """The ``--logs-specs`` class ``name`` (None: ours) built with ``arguments``."""
    factory: object = DefaultLogsSpecs
    # ``default`` is ours even though torch registers the same name: loading torch's
    # entry point would import torch into the launcher.
    if name is not None and name != "default":
        entry = find_entry_point(LOGS_SPECS_ENTRY_POINT_GROUPS, name)
        if entry is None:
            groups = " or ".join(LOGS_SPECS_ENTRY_POINT_GROUPS)
            raise ConfigError(source, name, f"no entry point of that name in {groups}")
        try:
            factory = entry.load()
        except Exception as exc:  # a plugin can fail to import in any way
            raise ConfigError(source, name, f"cannot load {entry.value}: {exc}") from exc
    if not callable(factory):
        raise ConfigError(source, name, "the entry point is not a class")
    try:
        specs = factory(**arguments)
    except (TypeError, ValueError) as exc:
        raise ConfigError(source, name, f"cannot be built: {exc}") from exc
    if not isinstance(specs, LogsSpecs):
        raise ConfigError(source, name, f"built a {type(specs).__name__}, not a LogsSpecs")
    return specs

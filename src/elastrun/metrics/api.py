"""Metric handlers and streams, with torch's names and behaviour.

Torch keeps the group -> handler table in module globals, and user code written for it
calls ``configure`` and ``put_metric`` without passing anything around, so this facade
keeps that table global too. Inside elastrun the agent uses injected
:class:`~elastrun.observe.sinks.MetricSink` objects instead; :class:`MetricsApiSink`
connects the two, so handlers configured here also see the agent's metrics.
"""

from __future__ import annotations

import abc
import functools
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, ParamSpec, TypeVar, overload

from elastrun.observe.sinks import MetricSink

__all__ = [
    "ConsoleMetricHandler",
    "FanoutMetricSink",
    "MetricData",
    "MetricHandler",
    "MetricStream",
    "MetricsApiSink",
    "MetricsConfig",
    "NullMetricHandler",
    "SinkMetricHandler",
    "configure",
    "getStream",
    "get_elapsed_time_ms",
    "prof",
    "profile",
    "publish_metric",
    "put_metric",
]

DEFAULT_GROUP = "torchelastic"

P = ParamSpec("P")
R = TypeVar("R")


class MetricData(NamedTuple):
    """One metric value: wall-clock ``timestamp`` (seconds), group, name and value."""

    timestamp: float
    group_name: str
    name: str
    value: float


class MetricsConfig:
    """Free-form metric settings (``params``, a str -> str dict); kept for torch's API."""

    __slots__ = ["params"]

    def __init__(self, params: dict[str, str] | None = None) -> None:
        self.params: dict[str, str] = params if params is not None else {}

    def __repr__(self) -> str:
        return f"MetricsConfig(params={self.params!r})"


class MetricHandler(abc.ABC):
    """Receives every metric value of the groups it is configured for."""

    @abc.abstractmethod
    def emit(self, metric_data: MetricData) -> None:
        """Handle one value."""


class ConsoleMetricHandler(MetricHandler):
    """Prints ``[<timestamp>][<group>]: <name>=<value>`` to stdout."""

    def emit(self, metric_data: MetricData) -> None:
        print(
            f"[{metric_data.timestamp}][{metric_data.group_name}]: "
            f"{metric_data.name}={metric_data.value}"
        )


class NullMetricHandler(MetricHandler):
    """Discards every value (the default handler)."""

    def emit(self, metric_data: MetricData) -> None:
        pass


class SinkMetricHandler(MetricHandler):
    """Forwards values to a :class:`~elastrun.observe.sinks.MetricSink` as ``<group>.<name>``.

    For example ``configure(SinkMetricHandler(server.sink), "trainer")`` sends the
    ``trainer`` group to the Prometheus endpoint of ``elastrun.observe.prometheus``.
    """

    def __init__(self, sink: MetricSink) -> None:
        self.sink = sink

    def emit(self, metric_data: MetricData) -> None:
        self.sink.put(f"{metric_data.group_name}.{metric_data.name}", metric_data.value)

    def __repr__(self) -> str:
        return f"SinkMetricHandler({self.sink!r})"


@dataclass(eq=False)
class MetricStream:
    """Values of one group, sent to one handler."""

    group_name: str
    handler: MetricHandler

    def add_value(self, metric_name: str, metric_value: float) -> None:
        """Emit ``metric_value`` stamped with the current wall-clock time."""
        self.handler.emit(MetricData(time.time(), self.group_name, metric_name, metric_value))


_default_handler: MetricHandler = NullMetricHandler()
_handlers: dict[str, MetricHandler] = {}


def configure(handler: MetricHandler, group: str | None = None) -> None:
    """Send the metrics of ``group`` to ``handler``.

    With ``group=None`` the handler becomes the default, used by every group that has
    no handler of its own (the default starts as :class:`NullMetricHandler`).
    """
    global _default_handler
    if group is None:
        _default_handler = handler
    else:
        _handlers[group] = handler


def getStream(group: str) -> MetricStream:  # torch's camelCase name
    """The stream of ``group``: its own handler, else the default one."""
    return MetricStream(group, _handlers.get(group, _default_handler))


def put_metric(metric_name: str, metric_value: float, metric_group: str = DEFAULT_GROUP) -> None:
    """Emit one value of ``metric_name`` in ``metric_group``."""
    getStream(metric_group).add_value(metric_name, metric_value)


def publish_metric(metric_group: str, metric_name: str, metric_value: float) -> None:
    """Deprecated: use ``put_metric(metric_name, metric_value, metric_group)``."""
    warnings.warn(
        "publish_metric is deprecated; use put_metric(name, value, group)",
        FutureWarning,
        stacklevel=2,
    )
    put_metric(metric_name, metric_value, metric_group)


def get_elapsed_time_ms(start_time_in_seconds: float) -> int:
    """Whole milliseconds since ``start_time_in_seconds`` (a ``time.time()`` value)."""
    return int((time.time() - start_time_in_seconds) * 1000)


def _metric_key(fn: Callable[..., object]) -> str:
    # A method's qualname already says its class; a plain function gets the last part of
    # its module's name, so that keys stay short but distinguishable.
    qualname: str = getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))
    if "." in qualname:
        return qualname
    module: str | None = getattr(fn, "__module__", None)
    return f"{module.rsplit('.', 1)[-1]}.{qualname}" if module else qualname


def _timed(fn: Callable[P, R], key: str, group: str) -> Callable[P, R]:
    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        start = time.monotonic()
        try:
            result = fn(*args, **kwargs)
            put_metric(f"{key}.success", 1, group)
        except Exception:
            put_metric(f"{key}.failure", 1, group)
            raise
        finally:
            put_metric(f"{key}.duration.ms", int((time.monotonic() - start) * 1000), group)
        return result

    return wrapper


@overload
def prof(fn: Callable[P, R], group: str = DEFAULT_GROUP) -> Callable[P, R]: ...


@overload
def prof(
    fn: None = None, group: str = DEFAULT_GROUP
) -> Callable[[Callable[P, R]], Callable[P, R]]: ...


def prof(
    fn: Callable[P, R] | None = None, group: str = DEFAULT_GROUP
) -> Callable[P, R] | Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorator: count successes and failures of a function and time it.

    Each call emits ``<key>.success`` = 1 or ``<key>.failure`` = 1 (an exception, which
    is re-raised), then ``<key>.duration.ms`` (int, measured on the monotonic clock).
    ``key`` is the function's ``__qualname__`` when it contains a dot (a method), else
    ``<last part of its module name>.<name>``. Use as ``@prof`` or
    ``@prof(group="mygroup")``.
    """

    def wrap(f: Callable[P, R]) -> Callable[P, R]:
        return _timed(f, _metric_key(f), group)

    return wrap(fn) if fn is not None else wrap


def profile(group: str | None = None) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Deprecated: use :func:`prof`. Like ``prof`` with the function's bare name as key."""
    warnings.warn("profile is deprecated; use @prof", FutureWarning, stacklevel=2)
    target = group if group is not None else DEFAULT_GROUP

    def wrap(f: Callable[P, R]) -> Callable[P, R]:
        return _timed(f, getattr(f, "__name__", repr(f)), target)

    return wrap


@dataclass(eq=False)
class MetricsApiSink:
    """A :class:`~elastrun.observe.sinks.MetricSink` that calls :func:`put_metric`.

    Give it to the agent so that handlers configured with :func:`configure` (as torch
    users do) receive the agent's metrics, in ``group`` (torch's ``torchelastic``).
    """

    group: str = DEFAULT_GROUP

    def put(self, name: str, value: float) -> None:
        put_metric(name, value, self.group)


class FanoutMetricSink:
    """Sends every value to several metric sinks, in order."""

    def __init__(self, *sinks: MetricSink) -> None:
        self.sinks = sinks

    def put(self, name: str, value: float) -> None:
        for sink in self.sinks:
            sink.put(name, value)

    def __repr__(self) -> str:
        return f"FanoutMetricSink{self.sinks!r}"

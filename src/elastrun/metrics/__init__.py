"""Metrics, compatible with ``torch.distributed.elastic.metrics``.

Code calls :func:`put_metric` (or decorates functions with :func:`prof`); each metric
group goes to the :class:`MetricHandler` configured for it with :func:`configure`, or to
the default handler (a :class:`NullMetricHandler` until configured)::

    from elastrun import metrics

    metrics.configure(metrics.ConsoleMetricHandler(), group="trainer")
    metrics.put_metric("batches", 1, "trainer")  # prints [<time>][trainer]: batches=1

The launcher's own metrics go to the group ``torchelastic`` (through
:class:`MetricsApiSink`) and, with ``--metrics-port``, to a Prometheus endpoint
(``elastrun.observe.prometheus``).
"""

from __future__ import annotations

from elastrun.metrics.api import (
    ConsoleMetricHandler,
    FanoutMetricSink,
    MetricData,
    MetricHandler,
    MetricsApiSink,
    MetricsConfig,
    MetricStream,
    NullMetricHandler,
    SinkMetricHandler,
    configure,
    get_elapsed_time_ms,
    getStream,
    prof,
    profile,
    publish_metric,
    put_metric,
)

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
    "initialize_metrics",
    "prof",
    "profile",
    "publish_metric",
    "put_metric",
]


def initialize_metrics(cfg: MetricsConfig | None = None) -> None:
    """Does nothing; kept because torch exports it (handlers are set with configure)."""

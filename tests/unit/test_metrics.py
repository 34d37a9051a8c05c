"""Unit tests of elastrun.metrics: torch-compatible handlers, streams, put_metric and prof."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from elastrun import metrics
from elastrun.metrics import api


class Recorder(metrics.MetricHandler):
    def __init__(self) -> None:
        self.data: list[metrics.MetricData] = []

    def emit(self, metric_data: metrics.MetricData) -> None:
        self.data.append(metric_data)

    def pairs(self) -> list[tuple[str, str, float]]:
        return [(d.group_name, d.name, d.value) for d in self.data]


class ListSink:
    def __init__(self) -> None:
        self.values: list[tuple[str, float]] = []

    def put(self, name: str, value: float) -> None:
        self.values.append((name, value))


@pytest.fixture(autouse=True)
def fresh_handlers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # The handler table is module-global by torch's design; give each test a clean one.
    monkeypatch.setattr(api, "_handlers", {})
    monkeypatch.setattr(api, "_default_handler", metrics.NullMetricHandler())
    yield


def test_console_handler_prints_time_group_name_and_value(
    capsys: pytest.CaptureFixture[str],
) -> None:
    metrics.ConsoleMetricHandler().emit(metrics.MetricData(12.5, "trainer", "loss", 0.25))
    assert capsys.readouterr().out == "[12.5][trainer]: loss=0.25\n"


def test_metrics_go_nowhere_until_a_handler_is_configured(
    capsys: pytest.CaptureFixture[str],
) -> None:
    metrics.put_metric("x", 1)
    assert isinstance(metrics.getStream("torchelastic").handler, metrics.NullMetricHandler)
    assert capsys.readouterr().out == ""


def test_configure_with_a_group_routes_only_that_group() -> None:
    rec = Recorder()
    metrics.configure(rec, group="trainer")
    metrics.put_metric("steps", 3, "trainer")
    metrics.put_metric("other", 1, "elsewhere")
    assert rec.pairs() == [("trainer", "steps", 3)]


def test_configure_without_group_replaces_the_default_for_every_other_group() -> None:
    default, own = Recorder(), Recorder()
    metrics.configure(default)
    metrics.configure(own, group="mine")
    metrics.put_metric("a", 1)  # default group torchelastic
    metrics.put_metric("b", 2, "anything")
    metrics.put_metric("c", 3, "mine")
    assert default.pairs() == [("torchelastic", "a", 1), ("anything", "b", 2)]
    assert own.pairs() == [("mine", "c", 3)]


def test_stream_stamps_values_with_wall_clock_time() -> None:
    rec = Recorder()
    stream = metrics.MetricStream("g", rec)
    stream.add_value("n", 7)
    (data,) = rec.data
    assert data.group_name == "g" and data.name == "n" and data.value == 7
    assert data.timestamp > 1.6e9  # seconds since the epoch, not a monotonic reading


@metrics.prof
def plain_function(x: int) -> int:
    return x * 2


class Trainer:
    @metrics.prof(group="trainer")
    def step(self) -> str:
        return "ok"

    @metrics.prof
    def explode(self) -> None:
        raise RuntimeError("boom")


def test_prof_on_a_function_emits_success_then_duration_keyed_by_module_and_name() -> None:
    rec = Recorder()
    metrics.configure(rec)
    assert plain_function(21) == 42
    names = [(d.group_name, d.name) for d in rec.data]
    assert names == [
        ("torchelastic", "test_metrics.plain_function.success"),
        ("torchelastic", "test_metrics.plain_function.duration.ms"),
    ]
    assert rec.data[0].value == 1
    assert isinstance(rec.data[1].value, int) and rec.data[1].value >= 0


def test_prof_on_a_method_uses_the_qualified_name_and_the_given_group() -> None:
    rec = Recorder()
    metrics.configure(rec, group="trainer")
    assert Trainer().step() == "ok"
    assert [d.name for d in rec.data] == ["Trainer.step.success", "Trainer.step.duration.ms"]


def test_prof_counts_a_failure_and_reraises_it() -> None:
    rec = Recorder()
    metrics.configure(rec)
    with pytest.raises(RuntimeError, match="boom"):
        Trainer().explode()
    assert [d.name for d in rec.data] == ["Trainer.explode.failure", "Trainer.explode.duration.ms"]


def test_prof_keeps_the_wrapped_function_name_and_docstring() -> None:
    assert plain_function.__name__ == "plain_function"
    # attr-defined: functools.wraps sets it; prof's Callable[P, R] does not declare it
    assert plain_function.__wrapped__(1) == 2  # type: ignore[attr-defined]


def test_publish_metric_is_deprecated_but_still_emits() -> None:
    rec = Recorder()
    metrics.configure(rec)
    with pytest.warns(FutureWarning, match="put_metric"):
        metrics.publish_metric("g", "n", 5)
    assert rec.pairs() == [("g", "n", 5)]


def test_profile_is_deprecated_and_keys_by_bare_function_name() -> None:
    rec = Recorder()
    metrics.configure(rec, group="legacy")
    with pytest.warns(FutureWarning, match="prof"):

        @metrics.profile("legacy")
        def work() -> int:
            return 1

    assert work() == 1
    assert [d.name for d in rec.data] == ["work.success", "work.duration.ms"]


def test_metrics_config_defaults_to_empty_params() -> None:
    assert metrics.MetricsConfig().params == {}
    assert metrics.MetricsConfig({"a": "b"}).params == {"a": "b"}
    metrics.initialize_metrics(metrics.MetricsConfig())  # a no-op, kept for torch's API


def test_get_elapsed_time_ms_is_whole_milliseconds() -> None:
    import time

    elapsed = metrics.get_elapsed_time_ms(time.time() - 2.0)
    assert isinstance(elapsed, int)
    assert 2000 <= elapsed < 60_000


def test_metrics_api_sink_lets_configured_handlers_see_agent_metrics() -> None:
    rec = Recorder()
    metrics.configure(rec)
    sink = metrics.MetricsApiSink()
    sink.put("agent.restarts", 1)
    assert rec.pairs() == [("torchelastic", "agent.restarts", 1)]


def test_sink_metric_handler_forwards_group_and_name_to_a_metric_sink() -> None:
    sink = ListSink()
    metrics.configure(metrics.SinkMetricHandler(sink), group="trainer")
    metrics.put_metric("loss", 0.5, "trainer")
    assert sink.values == [("trainer.loss", 0.5)]


def test_fanout_metric_sink_sends_each_value_to_every_sink_in_order() -> None:
    a, b = ListSink(), ListSink()
    metrics.FanoutMetricSink(a, b).put("n", 2)
    assert a.values == b.values == [("n", 2)]


def test_public_names_match_torch_elastic_metrics() -> None:
    torch_names = {
        "ConsoleMetricHandler",
        "MetricData",
        "MetricHandler",
        "MetricStream",
        "MetricsConfig",
        "NullMetricHandler",
        "configure",
        "getStream",
        "get_elapsed_time_ms",
        "initialize_metrics",
        "prof",
        "profile",
        "publish_metric",
        "put_metric",
    }
    assert torch_names <= set(metrics.__all__)
    assert all(hasattr(metrics, n) for n in metrics.__all__)

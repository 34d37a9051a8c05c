"""The --metrics-port endpoint: a real HTTP server on loopback, scraped with urllib."""

from __future__ import annotations

import re
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from elastrun.core.errors import ConfigError
from elastrun.observe.prometheus import MetricsServer, PrometheusMetricSink
from elastrun.observe.sinks import MetricSink, labelled


def scrape(server: MetricsServer) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        body: bytes = resp.read()
    return body.decode()


def sample(text: str, name: str, labels: str = "") -> float:
    """The value of one sample line ``name{labels} value`` of a text exposition."""
    pattern = "^" + re.escape(name + (f"{{{labels}}}" if labels else "")) + r" (\S+)$"
    match = re.search(pattern, text, re.MULTILINE)
    assert match, f"no sample {name}{{{labels}}} in:\n{text}"
    return float(match.group(1))


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    srv = MetricsServer(port=0)
    srv.start()
    yield srv
    srv.stop()


def test_agent_metrics_are_served_in_prometheus_text_format(server: MetricsServer) -> None:
    sink: MetricSink = server.sink
    sink.put("agent.restarts", 1)
    sink.put("agent.restarts", 1)
    sink.put("agent.worker_failures", 2)
    sink.put("agent.rendezvous.duration_ms", 250)
    sink.put("agent.rendezvous.duration_ms", 750)
    sink.put("agent.workers_start.duration_ms", 40)
    sink.put("agent.group_world_size", 3)
    sink.put("agent.remaining_restarts", 1)
    sink.put("agent.state.HEALTHY", 1)
    sink.put("trainer.custom", 7.5)
    text = scrape(server)
    assert "# TYPE elastrun_restarts_total counter" in text
    assert sample(text, "elastrun_restarts_total") == 2
    assert sample(text, "elastrun_worker_failures_total") == 2
    assert sample(text, "elastrun_membership_changes_total") == 0
    assert "# TYPE elastrun_rendezvous_duration_seconds histogram" in text
    assert sample(text, "elastrun_rendezvous_duration_seconds_count") == 2
    assert sample(text, "elastrun_rendezvous_duration_seconds_sum") == pytest.approx(1.0)
    assert sample(text, "elastrun_rendezvous_duration_seconds_bucket", 'le="0.5"') == 1
    assert sample(text, "elastrun_workers_start_duration_seconds_sum") == pytest.approx(0.04)
    assert sample(text, "elastrun_group_world_size") == 3
    assert sample(text, "elastrun_remaining_restarts") == 1
    assert sample(text, "elastrun_worker_group_state", 'state="HEALTHY"') == 1
    assert sample(text, "elastrun_worker_group_state", 'state="FAILED"') == 0
    assert sample(text, "elastrun_metric", 'name="trainer.custom"') == 7.5


def test_worker_group_state_is_one_hot(server: MetricsServer) -> None:
    server.sink.put("agent.state.HEALTHY", 1)
    server.sink.put("agent.state.STOPPED", 1)
    text = scrape(server)
    assert sample(text, "elastrun_worker_group_state", 'state="STOPPED"') == 1
    assert sample(text, "elastrun_worker_group_state", 'state="HEALTHY"') == 0
    assert sample(text, "elastrun_worker_group_state", 'state="INIT"') == 0


def test_worker_metrics_are_labelled_by_rank_and_local_rank(server: MetricsServer) -> None:
    sink: MetricSink = server.sink
    sink.put(labelled("worker.steps", rank=5, local_rank=1), 3)
    sink.put(labelled("worker.steps", rank=5, local_rank=1), 2)
    sink.put(labelled("worker.step", rank=5, local_rank=1), 42)
    sink.put(labelled("worker.step.duration_ms", rank=5, local_rank=1), 20)
    sink.put(labelled("worker.straggler", rank=5, local_rank=1), 1)
    sink.put(labelled("node.straggler", group_rank=2), 1)
    sink.put("agent.stragglers", 1)
    sink.put(labelled("worker.steps", rank=5), 1)  # a label missing: kept, under its name
    text = scrape(server)
    labels = 'local_rank="1",rank="5"'
    assert sample(text, "elastrun_worker_steps_total", labels) == 5
    assert sample(text, "elastrun_worker_step", labels) == 42
    assert sample(text, "elastrun_worker_step_seconds_count", labels) == 1
    assert sample(text, "elastrun_worker_step_seconds_sum", labels) == pytest.approx(0.02)
    assert sample(text, "elastrun_worker_step_seconds_bucket", 'le="0.025",' + labels) == 1
    assert sample(text, "elastrun_worker_straggler", labels) == 1
    assert sample(text, "elastrun_node_straggler", 'group_rank="2"') == 1
    assert sample(text, "elastrun_straggler_reports_total") == 1
    assert sample(text, "elastrun_metric", 'name="worker.steps{rank=5}"') == 1


def test_stop_frees_the_port_and_is_idempotent() -> None:
    srv = MetricsServer(port=0)
    port = srv.start()
    assert port != 0 and srv.port == port
    scrape(srv)
    srv.stop()
    srv.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))  # nothing listens there any more


def test_each_server_has_its_own_registry() -> None:
    import prometheus_client

    with MetricsServer(port=0) as one, MetricsServer(port=0) as two:
        one.sink.put("agent.restarts", 5)
        assert sample(scrape(one), "elastrun_restarts_total") == 5
        assert sample(scrape(two), "elastrun_restarts_total") == 0
    assert b"elastrun_" not in prometheus_client.generate_latest(prometheus_client.REGISTRY)


def test_a_port_already_in_use_is_a_config_error_naming_the_option() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        srv = MetricsServer(port=port)
        with pytest.raises(ConfigError) as info:
            srv.start()
    assert info.value.field == "--metrics-port"
    assert f"127.0.0.1:{port}" in str(info.value)


@pytest.mark.parametrize("port", [-1, 65536])
def test_a_port_out_of_range_is_rejected_before_binding(port: int) -> None:
    with pytest.raises(ConfigError, match="between 0 and 65535"):
        MetricsServer(port=port)


def test_a_value_prometheus_refuses_is_dropped_without_raising() -> None:
    sink = PrometheusMetricSink()
    sink.put("agent.restarts", -1)  # a counter cannot go down
    sink.put("agent.restarts", 1)
    assert b"elastrun_restarts_total 1.0" in sink.exposition()


def test_metrics_put_before_start_are_served_once_started() -> None:
    srv = MetricsServer(port=0)
    srv.sink.put("agent.group_rank", 2)
    with srv:
        assert sample(scrape(srv), "elastrun_group_rank") == 2


def test_missing_prometheus_client_is_a_config_error_with_the_install_hint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # makes the import fail
    with pytest.raises(ConfigError, match=r"elastrun\[metrics\]") as info:
        MetricsServer(port=0)
    assert info.value.field == "--metrics-port"


def test_importing_the_module_does_not_import_prometheus_client() -> None:
    import subprocess

    code = (
        "import sys, elastrun.observe.prometheus;"
        "sys.exit(1 if 'prometheus_client' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0

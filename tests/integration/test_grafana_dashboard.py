"""etc/grafana-dashboard.json: well formed, and built only on metrics a live gateway exports.

The unit tests read the file: every panel has the Prometheus datasource
variable and a query, every query follows the job and instance variables,
panels do not overlap. The integration test starts a real ``twistd
msggateway`` with the admin endpoint, a listener of each protocol, an
upstream and two durable routes (one to the hub, one to the upstream, which
refuses connections), sends a message through each route and one bad line,
scrapes ``/metrics``, and checks that every metric name any query uses is
there (a counter's ``_total``, a histogram's ``_bucket``, ``_sum`` and
``_count`` included), and that the log's metrics follow the traffic: the
hub route's forwarder catches up (lag 0, one delivered), the upstream's
stays one behind, retrying.
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.codecs import qmqp
from tests.integration.harness import GatewayProcess, LineClient

DASHBOARD: Final = Path(__file__).resolve().parents[2] / "etc" / "grafana-dashboard.json"
DATASOURCE: Final = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
GRID_COLUMNS: Final = 24

# PromQL's functions and aggregation operators (prometheus.io/docs/prometheus/latest/querying).
PROMQL_FUNCTIONS: Final = frozenset((
    "abs", "absent", "absent_over_time", "acos", "acosh", "asin", "asinh", "atan", "atanh", "avg",
    "avg_over_time", "bottomk", "ceil", "changes", "clamp", "clamp_max", "clamp_min", "count",
    "count_over_time", "count_values", "cos", "cosh", "day_of_month", "day_of_week",
    "day_of_year", "days_in_month", "deg", "delta", "deriv", "exp", "floor", "group",
    "histogram_avg", "histogram_count", "histogram_fraction", "histogram_quantile",
    "histogram_stddev", "histogram_stdvar", "histogram_sum", "holt_winters", "hour", "idelta",
    "increase", "irate", "label_join", "label_replace", "last_over_time", "limitk", "limit_ratio",
    "ln", "log10", "log2", "mad_over_time", "max", "max_over_time", "min", "min_over_time",
    "minute", "month", "pi", "predict_linear", "present_over_time", "quantile",
    "quantile_over_time", "rad", "rate", "resets", "round", "scalar", "sgn", "sin", "sinh",
    "sort", "sort_by_label", "sort_by_label_desc", "sort_desc", "sqrt", "stddev",
    "stddev_over_time", "stdvar", "stdvar_over_time", "sum", "sum_over_time", "tan", "tanh",
    "time", "timestamp", "topk", "vector", "year",
))  # fmt: skip
PROMQL_KEYWORDS: Final = frozenset((
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
    "unless", "atan2",
))  # fmt: skip
_STRING: Final = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS: Final = re.compile(r"\{[^}]*\}")
_RANGE: Final = re.compile(r"\[[^\]]*\]")
_GROUPING: Final = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER: Final = re.compile(r"(?<![\w:.$])([A-Za-z_:][\w:]*)\s*(\(?)")
_LABEL_VALUES: Final = re.compile(
    r"^label_values\(\s*([A-Za-z_:][\w:]*)\s*(\{[^}]*\})?\s*,\s*\w+\s*\)$"
)
_FILTER: Final = '{job=~"$job", instance=~"$instance"'


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects.

    Strings, label matchers, ranges and ``by (...)``-style label lists are
    blanked out first; what is left that is a name not followed by ``(``
    and not a keyword is a metric.

    Raises:
        AssertionError: A name is called like a function PromQL does not have.
    """
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub("{}", text)
    text = _RANGE.sub("[]", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for found in _IDENTIFIER.finditer(text):
        name, call = found.groups()
        if call:
            assert name in PROMQL_FUNCTIONS, f"{name}() is not a PromQL function, in {expr}"
        elif name not in PROMQL_KEYWORDS:
            names.add(name)
    return names


def load_dashboard() -> dict[str, Any]:
    """The dashboard file, parsed."""
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel that is not a row (panels inside collapsed rows included)."""
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def expressions(dashboard: dict[str, Any]) -> list[str]:
    """Every target's PromQL expression."""
    return [target["expr"] for panel in panels(dashboard) for target in panel["targets"]]


def variable_metrics(dashboard: dict[str, Any]) -> set[str]:
    """The metrics the template variables' ``label_values(...)`` queries read."""
    names = set()
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]
        text = query["query"] if isinstance(query, dict) else query
        found = _LABEL_VALUES.match(text)
        assert found, f"variable {variable['name']}: expected label_values(metric, label): {text}"
        names.add(found.group(1))
    return names


def dashboard_metrics() -> set[str]:
    """Every metric name the dashboard's queries and variables use."""
    dashboard = load_dashboard()
    names = variable_metrics(dashboard)
    for expr in expressions(dashboard):
        names |= metric_names(expr)
    return names


# --- the file on its own ------------------------------------------------------------------


def test_the_dashboard_loads_with_a_prometheus_datasource_variable() -> None:
    """Valid JSON, a recent schema, and ``DS_PROMETHEUS`` as a datasource variable."""
    dashboard = load_dashboard()
    assert dashboard["schemaVersion"] >= 39
    assert dashboard["uid"] and dashboard["title"]
    [variable] = [v for v in dashboard["templating"]["list"] if v["name"] == "DS_PROMETHEUS"]
    assert variable["type"] == "datasource"
    assert variable["query"] == "prometheus"


def test_every_panel_has_the_datasource_and_a_query() -> None:
    """Each panel (rows aside) and each of its targets uses ``${DS_PROMETHEUS}``."""
    dashboard = load_dashboard()
    seen = list(panels(dashboard))
    assert len(seen) >= 10
    for panel in seen:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], f"{panel['title']}: no query"
        assert panel.get("description"), f"{panel['title']}: say what it shows"
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(set(ref_ids)) == len(ref_ids), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
            assert target["expr"].strip(), panel["title"]


def test_panel_ids_are_unique_and_panels_do_not_overlap() -> None:
    """Ids unique; each panel within the 24 columns; no two panels share a grid cell."""
    dashboard = load_dashboard()
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(set(ids)) == len(ids)
    taken: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= GRID_COLUMNS, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in taken, f"{panel['title']} overlaps {taken[(x, y)]}"
                taken[(x, y)] = panel["title"]


def test_every_query_follows_the_job_and_instance_variables() -> None:
    """Each metric a query selects is filtered by ``$job`` and ``$instance`` (several gateways)."""
    for expr in expressions(load_dashboard()):
        for name in metric_names(expr):
            occurrences = re.findall(
                rf"(?<![\w:]){re.escape(name)}(?![\w:])(.{{0,{len(_FILTER)}}})", expr
            )
            assert occurrences, expr
            for following in occurrences:
                assert following == _FILTER, f"{name} without the job/instance filter: {expr}"


def test_metric_names_are_found_in_promql() -> None:
    """The extraction skips functions, keywords, label lists, strings and ranges."""
    expr = (
        "histogram_quantile(0.99, sum by (route, le)"
        ' (rate(a_bucket{job=~"x|y"}[$__rate_interval])))'
        " / on (route) group_left sum without (kind) (b_total{}) - time() + c offset 5m"
        " > bool 1e-9 and ignoring(le) d:recorded"
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c", "d:recorded"}


# --- against a live gateway ---------------------------------------------------------------

CONFIG = """
[gateway]
data_dir = "data"
routes = "routes"

[admin]
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.hub]
protocol = "ssmp"
endpoint = "tcp:0:interface=127.0.0.1"
schemes = ["open"]

[listeners.mail]
protocol = "qmqp"
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.streams]
protocol = "stream"
endpoint = "tcp:0:interface=127.0.0.1"

[listeners.dmp]
protocol = "dmp"
endpoint = "tcp:0:interface=127.0.0.1"
sinks = ["orders"]
feeds = ["alerts"]

[listeners.mtl]
protocol = "mtl"
endpoint = "tcp:0:interface=127.0.0.1"

[upstreams.central]
protocol = "ssmp"
endpoint = "tcp:host=127.0.0.1:port={refusing_port}"
identity = "gateway-1"
scheme = "open"
"""
ROUTES = {
    "mail": 'from = "mail"\nmatch = "#@example.org"\nto = "hub"\naddress = "mail"\n'
    'body = "subject"\ndurable = true\n',
    "central": 'from = "mail"\nmatch = "#@central.example.org"\nto = "central"\n'
    'address = "mail"\ndurable = true\n',
}


@pytest.fixture
def refusing_port() -> Iterator[int]:
    """A loopback port that refuses connections: bound, never listening, held for the test."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def _exported(text: str) -> tuple[set[str], set[str]]:
    """Metric names a scrape declares (with their suffixes), and those with samples."""
    declared: set[str] = set()
    sampled: set[str] = set()
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count")}
    for family in text_string_to_metric_families(text):
        declared.add(family.name)
        declared.update(family.name + suffix for suffix in suffixes.get(family.type, ()))
        sampled.update(sample.name for sample in family.samples)
    return declared | sampled, sampled


def _send_one_mail(address: tuple[str, int], recipient: bytes = b"ops@example.org") -> None:
    block = qmqp.MessageBlock(
        id=b"m1",
        message=b"Subject: dashboard\n\nhello\n",
        sender=b"app@example.org",
        recipients=(recipient,),
    )
    codec = qmqp.QMQPCodec(qmqp.Role.CLIENT)
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(qmqp.encode(block))
        replies: list[qmqp.Block] = []
        while not replies:
            data = sock.recv(65536)
            assert data, "the gateway closed without answering"
            replies.extend(codec.receive_data(data))
    assert isinstance(replies[0], qmqp.ReplyBlock)
    assert replies[0].status == b"K", replies[0]


def _route_samples(text: str) -> dict[tuple[str, str], float]:
    """The forwarder samples of a scrape, by metric name and route."""
    return {
        (sample.name, sample.labels["route"]): sample.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith("msggateway_forwarder_")
        for sample in family.samples
    }


def _forwarded(gateway: GatewayProcess, timeout: float = 10.0) -> dict[tuple[str, str], float]:
    """The forwarder samples once the hub route's has caught up and the upstream's retried."""
    deadline = time.monotonic() + timeout
    while True:
        found = _route_samples(gateway.metrics())
        if (
            found.get(("msggateway_forwarder_delivered_total", "mail")) == 1
            and found.get(("msggateway_forwarder_retried_total", "central"), 0) >= 1
        ) or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


@pytest.mark.integration
def test_every_metric_the_dashboard_uses_is_exported(tmp_path: Path, refusing_port: int) -> None:
    """A live gateway's /metrics has every metric the dashboard's queries name."""
    gateway = GatewayProcess(
        tmp_path, CONFIG.replace("{refusing_port}", str(refusing_port)), routes=ROUTES
    ).start()
    try:
        _send_one_mail(gateway.address("mail"))
        _send_one_mail(gateway.address("mail"), b"ops@central.example.org")
        with LineClient(gateway.address("hub")) as client:
            client.send("NOT-A-REQUEST")  # one protocol error
            client.expect_code(400)
            client.expect_closed()
        forwarded = _forwarded(gateway)
        exported, sampled = _exported(gateway.metrics())
    finally:
        gateway.stop()
    used = dashboard_metrics()
    missing = sorted(used - exported)
    assert not missing, f"the dashboard queries metrics /metrics does not have: {missing}"
    # The message went through the route, and the rest of the gateway showed up.
    for name in (
        "msggateway_route_latency_seconds_bucket",
        "msggateway_route_outcomes_total",
        "msggateway_qmqp_replies_total",
        "msggateway_protocol_errors_total",
        "msggateway_upstream_connected",
        "process_resident_memory_bytes",
        "msggateway_log_appends_total",
        "msggateway_log_commit_seconds_bucket",
        "msggateway_log_fsync_seconds_bucket",
        "msggateway_log_filesystem_free_bytes",
    ):
        assert name in sampled, f"{name}: no samples after traffic"
    # The hub took its message: its forwarder caught up. The upstream is down:
    # its message waits in the log, delivered again and again.
    assert forwarded[("msggateway_forwarder_lag_messages", "mail")] == 0, forwarded
    assert forwarded[("msggateway_forwarder_delivered_total", "mail")] == 1, forwarded
    assert forwarded[("msggateway_forwarder_lag_messages", "central")] == 1, forwarded
    assert forwarded[("msggateway_forwarder_delivered_total", "central")] == 0, forwarded
    assert forwarded[("msggateway_forwarder_retried_total", "central")] >= 1, forwarded

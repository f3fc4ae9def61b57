"""docker/grafana/dashboards/vllm-manager.json: a dashboard Grafana can load, whose every query names
metrics that really exist.

The names a query may use come from what exports them: the manager's GET /metrics (the app through
TestClient, after its first metrics sample) and a vLLM 0.32.0 engine's /metrics captured in
tests/fixtures/vllm_metrics_cpu.txt (tests/metrics/capture_vllm_metrics.py). A name that neither
exports fails the test, so a renamed metric or a typo shows here and not as an empty panel.

Grafana publishes no JSON schema for its dashboards on PyPI or npm: @grafana/schema 13.2.3 (npm)
ships TypeScript types generated from Grafana's CUE kinds, with schemaVersion 42 in their default
dashboard. The fields that Grafana's file provisioning and the panels rely on are checked by hand
below, after those types.
"""

from __future__ import annotations

import copy
import json
import re
import sys
import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from manager.app import create_app
from manager.settings import Settings
from tests.docker.conftest import DOCKER, REPO

DASHBOARD = DOCKER / "grafana" / "dashboards" / "vllm-manager.json"
VLLM_METRICS = REPO / "tests" / "fixtures" / "vllm_metrics_cpu.txt"
SCHEMA_VERSION = 42  # Grafana 13's, as in @grafana/schema 13.2.3

# Front door counters the dashboard shows before the manager's /metrics has them: tokens counted per
# inference key (labels key, model, kind) and requests refused by a key's limit (labels key, limit).
# Accepted under these names and types only; once /metrics exports them, it is checked as any other.
PENDING = {"vllm_manager_proxy_tokens": "counter", "vllm_manager_proxy_limited": "counter"}

# The series a family of each type puts in Prometheus.
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "unknown": ("",),
}

NAME = re.compile(r"(?<![\w:.$])([A-Za-z_:][\w:]*)(\s*\()?")
STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*[A-Za-z_]\w*\s*\)\s*$", re.S)
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless"}
KEYWORDS |= {"offset", "start", "end", "inf", "nan", "Inf", "NaN"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL query (or a Grafana label_values() variable query) reads."""
    found = LABEL_VALUES.match(expr)
    text = found.group(1) if found else expr
    text = STRING.sub('""', text)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers: label names and Grafana variables
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range windows: $__rate_interval, 10m
    text = GROUPING.sub(" ", text)  # by (le, model), on (instance)
    return {name for name, call in NAME.findall(text) if not call and name not in KEYWORDS}


def series_names(exposition: str) -> dict[str, str]:
    """Every series name an exposition text gives Prometheus -> its family's type."""
    names: dict[str, str] = {}
    for family in text_string_to_metric_families(exposition):
        for suffix in SUFFIXES[family.type]:
            names[family.name + suffix] = family.type
        names.update((sample.name, family.type) for sample in family.samples)
    return names


def panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])  # a collapsed row keeps its panels inside it


def queries(dashboard: dict) -> Iterator[tuple[str, str]]:
    """(where, query) for every panel target and every query variable."""
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} target {target['refId']}", target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            yield f"variable {variable['name']!r}", query["query"] if isinstance(query, dict) else query


def unknown_metrics(dashboard: dict, known: set[str]) -> dict[str, set[str]]:
    unknown = {where: metric_names(query) - known for where, query in queries(dashboard)}
    return {where: names for where, names in unknown.items() if names}


@pytest.fixture(scope="module")
def manager_exposition(tmp_path_factory) -> str:
    settings = Settings(
        data_dir=tmp_path_factory.mktemp("monitoring") / "data",
        engine_python=sys.executable,
        api_token=None,
        stop_workers_on_exit=False,
    )
    with TestClient(create_app(settings)) as client:
        # The GPU, host and worker families appear once the collector has taken its first sample.
        deadline = time.monotonic() + 10
        while client.get("/api/metrics").status_code != 200:
            assert time.monotonic() < deadline, "the metrics collector took no sample in 10 s"
            time.sleep(0.2)
        return client.get("/metrics").text


@pytest.fixture(scope="module")
def manager_names(manager_exposition) -> dict[str, str]:
    return series_names(manager_exposition)


@pytest.fixture(scope="module")
def known_names(manager_names) -> set[str]:
    pending = series_names("".join(f"# TYPE {name} {kind}\n" for name, kind in PENDING.items()))
    vllm = series_names(VLLM_METRICS.read_text())
    return set(manager_names) | set(pending) | set(vllm)


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_every_query_names_only_metrics_the_manager_or_vllm_exports(dashboard, known_names):
    assert unknown_metrics(dashboard, known_names) == {}


def test_a_query_naming_a_metric_nobody_exports_is_caught(dashboard, known_names):
    broken = copy.deepcopy(dashboard)
    targets = [target for panel in panels(broken) for target in panel.get("targets", [])]
    kv = next(t for t in targets if "vllm:kv_cache_usage_perc" in t["expr"])
    # vLLM's name before 0.10; 0.32 exports vllm:kv_cache_usage_perc only.
    kv["expr"] = kv["expr"].replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    requests = next(t for t in targets if "vllm_manager_proxy_requests_total" in t["expr"])
    # The family's name: a counter's series end in _total.
    requests["expr"] = requests["expr"].replace("vllm_manager_proxy_requests_total", "vllm_manager_proxy_requests")
    variable = next(v for v in broken["templating"]["list"] if v["name"] == "model_name")
    variable["query"]["query"] = "label_values(vllm:num_requests_runnin, model_name)"
    found = unknown_metrics(broken, known_names)
    assert sorted(name for names in found.values() for name in names) == [
        "vllm:gpu_cache_usage_perc",
        "vllm:num_requests_runnin",
        "vllm_manager_proxy_requests",
    ]


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        (
            "histogram_quantile(0.99, sum by (le, kind) (rate(vllm_manager_proxy_swap_seconds_bucket[10m])))",
            {"vllm_manager_proxy_swap_seconds_bucket"},
        ),
        (
            'sum(rate(vllm:prompt_tokens_total{model_name=~"$model_name", x="f(y) 1e3"}[$__rate_interval])) by (m)'
            " / on (m) group_left vllm:num_requests_running offset 5m > bool 1e3",
            {"vllm:prompt_tokens_total", "vllm:num_requests_running"},
        ),
        ("label_values(vllm:num_requests_running, model_name)", {"vllm:num_requests_running"}),
        (
            "vllm_manager_host_memory_used_bytes / vllm_manager_host_memory_total_bytes",
            {"vllm_manager_host_memory_used_bytes", "vllm_manager_host_memory_total_bytes"},
        ),
    ],
)
def test_the_metric_names_of_a_query_are_read_without_functions_labels_or_windows(expr, names):
    assert metric_names(expr) == names


def test_the_manager_exports_the_front_door_gpu_host_and_worker_families(manager_names):
    """What the known names rest on: the exposition read is the full one, not an empty first scrape."""
    for name in (
        "vllm_manager_proxy_requests_total",
        "vllm_manager_proxy_queue_wait_seconds_bucket",
        "vllm_manager_gpu_memory_total_bytes",
        "vllm_manager_host_memory_used_bytes",
        "vllm_manager_worker_state",
    ):
        assert name in manager_names


def test_a_pending_front_door_metric_once_exported_has_the_type_the_dashboard_expects(manager_names):
    for family, kind in PENDING.items():
        exported = {manager_names[name] for name in (family, family + "_total") if name in manager_names}
        assert exported <= {kind}, f"{family} is exported as {exported}, the dashboard reads it as a {kind}"


def test_the_dashboard_has_what_grafana_provisioning_needs(dashboard):
    assert dashboard["schemaVersion"] == SCHEMA_VERSION
    assert dashboard["uid"] == "vllm-manager" and dashboard["title"]
    assert dashboard["id"] is None  # Grafana gives provisioned dashboards their own id
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [panel["id"] for panel in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(dashboard):
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        # Every query goes to the data source the viewer picks, none to a fixed uid.
        for source in [panel["datasource"]] + [t["datasource"] for t in panel["targets"]]:
            assert source == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]


def test_the_dashboard_shows_what_an_operator_asks_first(dashboard):
    read = {name for _where, query in queries(dashboard) for name in metric_names(query)}
    assert {
        "vllm_manager_proxy_requests_total",
        "vllm_manager_proxy_queue_wait_seconds_bucket",
        "vllm_manager_proxy_swap_seconds_bucket",
        "vllm_manager_proxy_tokens_total",
        "vllm_manager_proxy_limited_total",
        "vllm_manager_gpu_memory_used_bytes",
        "vllm_manager_gpu_memory_total_bytes",
        "vllm_manager_host_memory_used_bytes",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
    } <= read

"""The Grafana dashboard: the committed JSON is the code's output, well formed, and every query
names series (and labels) that a live ``kvscope serve`` exports."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvscope.analysis.live_metrics import LEDGER_SERIES, metrics_source
from kvscope.collector.proxy.metrics import ProxyMetrics
from kvscope.dashboards import grafana_dashboard
from kvscope.store.schema import TRACES_ARROW
from tests.dashboards.test_alerts import assert_committed_is_generated

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "analysis"))
from test_live_metrics import (  # noqa: E402
    _send_gauges,
    _serving_runs_of,
    _shuffled_batches,
    _wait_for_gauges,
    source,  # noqa: F401  (the fixture)
)

COMMITTED = Path(__file__).resolve().parents[2] / "dashboards" / "grafana" / "kvscope.json"
_SELECTOR = re.compile(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)")
_BY = re.compile(r"\bby \(([^)]*)\)")
_FUNCTIONS = {"sum", "rate", "deriv", "histogram_quantile", "label_values", "by"}


def _queries(model: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in model["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in model["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_committed_json_is_what_the_code_generates(capsys: pytest.CaptureFixture[str]) -> None:
    assert_committed_is_generated(COMMITTED, grafana_dashboard.render, "grafana", capsys)


def test_dashboard_structure() -> None:
    model = json.loads(COMMITTED.read_text(encoding="utf-8"))
    assert model["uid"] and model["title"] and isinstance(model["schemaVersion"], int)
    ids = [p["id"] for p in model["panels"]]
    assert len(ids) == len(set(ids))
    titles = " ".join(p["title"] for p in model["panels"])
    for wanted in ("Reuse rate", "miss causes", "Retained KV beside GPU memory", "TTFT"):
        assert wanted in titles
    variables = {v["name"]: v for v in model["templating"]["list"]}
    # Import wiring: the one declared input is what every panel, target and variable queries.
    [declared] = model["__inputs"]
    assert declared["type"] == "datasource" and declared["pluginId"] == "prometheus"
    wired = {"type": "prometheus", "uid": "${" + declared["name"] + "}"}
    required = {(r["type"], r["id"]) for r in model["__requires"]}
    assert {("grafana", "grafana"), ("datasource", "prometheus")} <= required
    for variable in variables.values():
        assert variable["datasource"] == wired, variable["name"]
    for panel in model["panels"]:
        grid = panel["gridPos"]
        assert set(grid) == {"x", "y", "w", "h"} and grid["x"] + grid["w"] <= 24
        assert panel["datasource"] == wired, panel["title"]
        assert all(t["datasource"] == wired for t in panel["targets"]), panel["title"]
        assert ("panel", panel["type"]) in required, panel["type"]
        # Never measured reads "no data", not a blank or 0.
        assert panel["fieldConfig"]["defaults"]["noValue"] == "no data"
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs))
        for target in panel["targets"]:
            expr = target["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}")
            # Variables used are declared.
            for name in re.findall(r"\$(\w+)", expr):
                assert name in variables or name.startswith("__"), name
    by_title = {p["title"]: p for p in model["panels"]}
    alarm = by_title["Invalid reuse (correctness alarm)"]["fieldConfig"]["defaults"]
    assert [(s["color"], s["value"]) for s in alarm["thresholds"]["steps"]] == [
        ("green", None), ("red", 1)]
    proxy = [p for p in model["panels"] if "kvscope_proxy_" in json.dumps(p["targets"])]
    assert len(proxy) >= 4, "the proxy's series have panels"


@pytest.fixture(scope="module")
def scraped(source: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:  # noqa: F811
    """Sample name → label names, scraped from a live receiver holding simulated runs."""
    db = tmp_path_factory.mktemp("grafana") / "served.duckdb"
    receiver = _serving_runs_of(source, db, metrics=metrics_source)
    try:
        cursor = receiver.writer.connection.cursor()
        runs = dict(cursor.execute("SELECT label, run_id FROM kvscope_runs").fetchall())
        cursor.close()
        for batch in _shuffled_batches(source, 2, 1):
            assert receiver.writer.submit_traces(batch.cast(TRACES_ARROW))
        assert receiver.writer.flush(30)
        _send_gauges(receiver.url, runs["faults"])
        _wait_for_gauges(receiver, 4)
        text = httpx.get(f"{receiver.url}/metrics", timeout=30).text
    finally:
        receiver.stop()
    # The proxy's series, each with a sample (one finished turn, one failed leg).
    proxy = ProxyMetrics()
    proxy.scrape_time.dropped_spans = lambda: 0
    proxy.scrape_time.router_entries = lambda: 0
    proxy.observe(SimpleNamespace(
        route="pd", model="m", prefill_instance="p0", decode_instance="d0", lookup="hit",
        error_kind="timeout", error_leg="decode", client_disconnected=False,
        first_token_ns=2_000_000, arrival_ns=1_000_000, trace_id=1, prefill_start_ns=None,
        prefill_end_ns=None, decode_start_ns=None, decode_end_ns=None, end_ns=3_000_000))
    samples: dict[str, set[str]] = {}
    for exposition in (text, generate_latest(proxy.registry).decode()):
        for family in text_string_to_metric_families(exposition):
            for sample in family.samples:
                samples.setdefault(sample.name, set()).update(sample.labels)
            if not family.samples and family.name in LEDGER_SERIES:
                # Declared, no sample yet (the invalid-token count where none was countable):
                # the ledger series' labels.
                samples.setdefault(family.name, {"run", "run_id", "model", "engine"})
    return samples


def test_every_query_names_an_exported_series(scraped: dict[str, set[str]]) -> None:
    model = grafana_dashboard.dashboard()
    for expr in _queries(model):
        names = {n for n in re.findall(r"\b(kvscope_[a-z0-9_]+)\b", expr)}
        assert names, expr
        labels: set[str] = set()
        for name in names:
            assert name in scraped, f"{name} (in {expr}) is not exported by kvscope serve"
            labels |= scraped[name]
        for name, matchers in _SELECTOR.findall(expr):
            for label, _ in _MATCHER.findall(matchers):
                assert label in scraped[name], f"{name} has no label {label} ({expr})"
        for group in _BY.findall(expr):
            for label in (g.strip() for g in group.split(",")):
                # job and instance: the labels Prometheus adds to every scraped series.
                assert label in labels | {"le", "job", "instance"}, (
                    f"by ({label}) names no label of {names}")


def test_the_check_catches_a_wrong_name(scraped: dict[str, set[str]]) -> None:
    """The series check is not vacuous: a misspelt series or label is refused."""
    assert "kvscope_reusable_token" not in scraped
    assert "outcome" in scraped["kvscope_turns"]
    assert "engine" not in scraped["kvscope_gpu_memory_used_bytes"]

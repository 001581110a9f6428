"""The Grafana dashboard: the committed JSON is the code's output, well formed, and every query
names series (and labels) that a live ``kvscope serve`` exports."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvscope import cli
from kvscope.analysis.live_metrics import metrics_source
from kvscope.collector.receiver import Receiver
from kvscope.dashboards import grafana_dashboard
from kvscope.store.schema import TRACES_ARROW

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "analysis"))
from test_live_metrics import (  # noqa: E402
    _copy_runs,
    _send_gauges,
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
    assert COMMITTED.read_text(encoding="utf-8") == grafana_dashboard.render(), (
        "regenerate: kvscope grafana -o dashboards/grafana/kvscope.json")
    assert cli.main(["grafana"]) == 0
    assert capsys.readouterr().out == grafana_dashboard.render()


def test_dashboard_structure() -> None:
    model = json.loads(COMMITTED.read_text(encoding="utf-8"))
    assert model["uid"] and model["title"] and isinstance(model["schemaVersion"], int)
    ids = [p["id"] for p in model["panels"]]
    assert len(ids) == len(set(ids))
    titles = " ".join(p["title"] for p in model["panels"])
    for wanted in ("Reuse rate", "miss causes", "Retained KV beside GPU memory", "TTFT"):
        assert wanted in titles
    variables = {v["name"]: v for v in model["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    for panel in model["panels"]:
        grid = panel["gridPos"]
        assert set(grid) == {"x", "y", "w", "h"} and grid["x"] + grid["w"] <= 24
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs))
        for target in panel["targets"]:
            expr = target["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}")
            # Variables used are declared.
            for name in re.findall(r"\$(\w+)", expr):
                assert name in variables or name.startswith("__"), name


@pytest.fixture(scope="module")
def scraped(source: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:  # noqa: F811
    """Sample name → label names, scraped from a live receiver holding simulated runs."""
    db = tmp_path_factory.mktemp("grafana") / "served.duckdb"
    receiver = Receiver(db, port=0, metrics=metrics_source).start()
    try:
        cursor = receiver.writer.connection.cursor()
        _copy_runs(source, cursor)
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
    samples: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, set()).update(sample.labels)
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
                assert label in labels | {"le"}, f"by ({label}) names no label of {names}"


def test_the_check_catches_a_wrong_name(scraped: dict[str, set[str]]) -> None:
    """The series check is not vacuous: a misspelt series or label is refused."""
    assert "kvscope_reusable_token" not in scraped
    assert "outcome" in scraped["kvscope_turns"]
    assert "engine" not in scraped["kvscope_gpu_memory_used_bytes"]

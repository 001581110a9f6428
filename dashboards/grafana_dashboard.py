"""The Grafana dashboard for ``kvscope serve``'s ``/metrics``, generated (never hand-edited).

:func:`dashboard` builds the dashboard model from the live ledger's series names
(:mod:`kvscope.analysis.live_metrics`), so a renamed series renames its queries.
``dashboards/grafana/kvscope.json`` is this function's output, committed for import (a test
checks it equals what the code generates, and that every query names a series a live
``kvscope serve`` exports). Regenerate it with
``kvscope grafana -o dashboards/grafana/kvscope.json``.

Panels mirror the pages of kvscope's own dashboard that Prometheus can serve: reuse rate (token-
weighted, local vs remote), outcomes and miss causes, invalid reuse, retained KV memory beside GPU
memory, TTFT quantiles, and KV transfers by direction and status; then ``kvscope proxy``'s own
series (``kvscope_proxy_*``: turns, router lookups, upstream errors, TTFT) and the telemetry
lost on the way (the receiver's and the proxy's drop counters). Variables: the runs and models to
show (multi-select, all by default).

Import wiring, as Grafana's own "export for sharing externally" writes it: ``__inputs`` declares
the Prometheus data source (``DS_PROMETHEUS``) and every panel, target and variable names it as
``${DS_PROMETHEUS}``, so the import dialog's choice is the one every query uses; ``__requires``
lists Grafana, the Prometheus plugin and each panel type. A value never measured shows "no data"
(``noValue``), never 0: the invalid-token count is exported only where the ledger counted it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from itertools import count
from typing import Any

from kvscope import exposition, semconv
from kvscope.analysis import live_metrics as m
from kvscope.exposition import prom_name

UID = "kvscope-live"
TITLE = "kvscope: KV reuse in vLLM P/D"
INPUT = "DS_PROMETHEUS"
DATASOURCE = {"type": "prometheus", "uid": "${" + INPUT + "}"}
# What a value never measured shows (Grafana's default would be a blank or, summed, 0).
NO_VALUE = "no data"
# The invalid-reuse stat: green at 0, red from the first turn.
ALARM_THRESHOLDS = {"mode": "absolute", "steps": [{"color": "green", "value": None},
                                                   {"color": "red", "value": 1}]}
# Every query selects the dashboard's runs and models.
_SEL = 'run=~"$run",model=~"$model"'
_RUN = 'run=~"$run"'
_MODEL_NAME = 'model_name=~"$model"'  # the proxy's label for what the client asked for
WIDTH = 24


def _target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ref,
            "range": True}


def _panel(ids: Iterator[int], title: str, kind: str, targets: list[tuple[str, str]],
           grid: tuple[int, int, int, int], *, unit: str = "short", description: str = "",
           stacked: bool = False, thresholds: dict[str, Any] | None = None,
           decimals: int | None = None, **options: Any) -> dict[str, Any]:
    x, y, w, h = grid
    defaults: dict[str, Any] = {"unit": unit, "noValue": NO_VALUE}
    if thresholds is not None:
        defaults["thresholds"] = thresholds
        defaults["color"] = {"mode": "thresholds"}
    if decimals is not None:
        defaults["decimals"] = decimals
    if kind == "timeseries":
        defaults["custom"] = {"stacking": {"mode": "normal" if stacked else "none"},
                              "fillOpacity": 20 if stacked else 0}
    return {
        "id": next(ids),
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "targets": [_target(expr, legend, chr(ord("A") + i))
                    for i, (expr, legend) in enumerate(targets)],
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options,
    }


def _sum(series: str, by: str = "run", selector: str = _SEL) -> str:
    return f"sum by ({by}) ({series}{{{selector}}})"


def _quantile(q: float, series: str, selector: str = _SEL) -> str:
    return (f"histogram_quantile({q}, sum by (le, run) "
            f"(rate({series}_bucket{{{selector}}}[$__rate_interval])))")


def panels() -> list[dict[str, Any]]:
    """The dashboard's panels, top to bottom."""
    ids = count(1)
    reused = f"({_sum(m.REUSED_LOCAL_TOKENS)} + {_sum(m.REUSED_REMOTE_TOKENS)})"
    reusable = _sum(m.REUSABLE_TOKENS)
    return [
        _panel(ids, "Reuse rate (token-weighted)", "stat",
               [(f"{reused} / {reusable}", "{{run}}")], (0, 0, 8, 6), unit="percentunit",
               description="(reused local + reused remote) / reusable tokens of turns k>=2, "
               "as kvscope analyze reuse_rate computes it",
               reduceOptions={"calcs": ["lastNotNull"]}),
        _panel(ids, "Reuse split: local vs remote", "timeseries",
               [(f"{_sum(m.REUSED_LOCAL_TOKENS)} / {reusable}", "local {{run}}"),
                (f"{_sum(m.REUSED_REMOTE_TOKENS)} / {reusable}", "remote {{run}}")],
               (8, 0, 16, 6), unit="percentunit", stacked=True,
               description="Shares of the reusable tokens prefill found locally or pulled "
               "from decode"),
        _panel(ids, "Outcomes and miss causes", "bargauge",
               [(f'sum by (outcome) ({m.TURNS}{{{_SEL},outcome_class=~"miss|invalid|unknown"}})',
                 "{{outcome}}")],
               (0, 6, 12, 8), description="Turns now in each miss cause (turns whose outcome "
               "is not a reuse); a turn moves when late spans arrive",
               orientation="horizontal", displayMode="basic",
               reduceOptions={"calcs": ["lastNotNull"]}),
        _panel(ids, "Turns by outcome class", "timeseries",
               [(_sum(m.TURNS, "outcome_class"), "{{outcome_class}}")], (12, 6, 12, 8),
               stacked=True),
        _panel(ids, "Invalid reuse (correctness alarm)", "stat",
               [(f"sum({m.INVALID_REUSE_TURNS}{{{_SEL}}})", "turns"),
                (f"sum({m.INVALID_REUSE_TOKENS}{{{_SEL}}})", "tokens")], (0, 14, 6, 6),
               description="Turns whose read from decode loaded KV that does not belong to "
               "their prompt (red from the first; the KvscopeInvalidReuse alert pages on it), "
               "and the tokens they loaded where countable (no data: not countable)",
               thresholds=ALARM_THRESHOLDS, decimals=0, colorMode="background",
               graphMode="none", reduceOptions={"calcs": ["lastNotNull"]}),
        _panel(ids, "Recomputed reusable tokens /s", "timeseries",
               [(f"sum by (run) (deriv({m.RECOMPUTED_TOKENS}{{{_SEL}}}[$__rate_interval]))",
                 "{{run}}")], (6, 14, 18, 6),
               description="Prefill work spent on tokens decode still held (gauge slope)"),
        _panel(ids, "Retained KV beside GPU memory", "timeseries",
               [(_sum(m.RETAINED_BYTES, "engine", _RUN), "retained {{engine}}"),
                (_sum(m.GPU_USED_BYTES, "host, gpu", _RUN), "GPU used {{host}}:{{gpu}}"),
                (_sum(m.GPU_TOTAL_BYTES, "host, gpu", _RUN), "GPU total {{host}}:{{gpu}}")],
               (0, 20, 24, 8), unit="bytes",
               description="KV bytes decode engines hold for later turns, next to the GPUs' "
               "used and total memory"),
        _panel(ids, "TTFT", "timeseries",
               [(_quantile(q, m.TTFT_SECONDS), f"p{round(q * 100)} {{{{run}}}}")
                for q in (0.5, 0.9, 0.99)], (0, 28, 12, 8), unit="s",
               description="From the proxy's kvscope.turn spans, vLLM's TTFT buckets"),
        _panel(ids, "KV transfers: bytes/s by direction and status", "timeseries",
               [(f"sum by (direction, status) (rate({m.TRANSFER_BYTES}_total{{{_RUN}}}"
                 "[$__rate_interval]))", "{{direction}} {{status}}")], (12, 28, 12, 8),
               unit="Bps"),
        _panel(ids, "KV transfer duration p90", "timeseries",
               [(f"histogram_quantile(0.9, sum by (le, direction, status) "
                 f"(rate({m.TRANSFER_SECONDS}_bucket{{{_RUN}}}[$__rate_interval])))",
                 "{{direction}} {{status}}")], (0, 36, 12, 8), unit="s"),
        _panel(ids, "KV transfers/s by status", "timeseries",
               [(f"sum by (status) (rate({m.TRANSFERS}_total{{{_RUN}}}[$__rate_interval]))",
                 "{{status}}")], (12, 36, 12, 8), unit="ops"),
        *_proxy_panels(ids, 44),
    ]


def _proxy_panels(ids: Iterator[int], top: int) -> list[dict[str, Any]]:
    """``kvscope proxy``'s series, and the telemetry lost on the way to the store."""
    turns, lookups, errors, ttft, dropped = (
        prom_name(semconv.METRIC_PROXY_TURNS), prom_name(semconv.METRIC_PROXY_ROUTER_LOOKUPS),
        prom_name(semconv.METRIC_PROXY_UPSTREAM_ERRORS), prom_name(semconv.METRIC_PROXY_TTFT),
        prom_name(semconv.METRIC_PROXY_TELEMETRY_DROPPED))
    lost = '__name__=~"' + "|".join(f"{n}_total" for n in (
        dropped, exposition.RECEIVER_SPANS_REJECTED, exposition.RECEIVER_ROWS_DROPPED,
        exposition.RECEIVER_ROWS_FAILED)) + '"'
    return [
        _panel(ids, "Proxy: turns/s by route and outcome", "timeseries",
               [(f"sum by (route, outcome) (rate({turns}_total{{{_MODEL_NAME}}}"
                 "[$__rate_interval]))", "{{route}} {{outcome}}")], (0, top, 12, 8),
               unit="reqps", stacked=True,
               description="Turns kvscope proxy finished (outcome: ok or the error's kind)"),
        _panel(ids, "Proxy: router lookups/s by result", "timeseries",
               [(f"sum by (result) (rate({lookups}_total{{{_MODEL_NAME}}}[$__rate_interval]))",
                 "{{result}}")], (12, top, 12, 8), unit="reqps", stacked=True,
               description="The proxy router's conversation lookups: a hit sends decode's KV "
               "params to prefill; stale, consumed and miss explain router_* miss causes"),
        _panel(ids, "Proxy: TTFT", "timeseries",
               [(f"histogram_quantile({q}, sum by (le) (rate({ttft}_bucket{{{_MODEL_NAME}}}"
                 "[$__rate_interval])))", f"p{round(q * 100)}") for q in (0.5, 0.9, 0.99)],
               (0, top + 8, 12, 8), unit="s",
               description="Arrival at the proxy to the first token sent (vLLM's buckets)"),
        _panel(ids, "Proxy: upstream errors/s by leg and kind", "timeseries",
               [(f"sum by (leg, kind) (rate({errors}_total{{{_MODEL_NAME}}}"
                 "[$__rate_interval]))", "{{leg}} {{kind}}")], (12, top + 8, 12, 8),
               unit="reqps", description="Failed prefill or decode calls (no data: none "
               "since the proxy started)"),
        _panel(ids, "Telemetry lost (spans and rows)", "stat",
               [(f"sum by (job) ({{{lost}}})", "{{job}}")], (0, top + 16, 24, 5),
               description="Spans or rows the proxy's exporter dropped, the receiver rejected, "
               "or its store writer dropped or failed: the ledger undercounts by this much "
               "(the KvscopeTelemetryLost alert fires on growth)", decimals=0,
               thresholds=ALARM_THRESHOLDS, colorMode="background", graphMode="none",
               reduceOptions={"calcs": ["lastNotNull"]}),
    ]


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {"name": name, "label": label, "type": "query", "datasource": DATASOURCE,
            "query": {"query": query, "refId": name}, "definition": query, "refresh": 2,
            "multi": True, "includeAll": True, "allValue": ".*",
            "current": {"text": "All", "value": "$__all"}, "sort": 1}


def _requires(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Grafana's ``__requires``: the Grafana version, the data source plugin, each panel type."""
    kinds = sorted({p["type"] for p in panels})
    return [{"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.0.0"},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
            *({"type": "panel", "id": kind, "name": _PANEL_NAMES[kind], "version": ""}
              for kind in kinds)]


_PANEL_NAMES = {"bargauge": "Bar gauge", "stat": "Stat", "timeseries": "Time series"}


def dashboard() -> dict[str, Any]:
    """The whole dashboard model (Grafana's JSON model, importable as is)."""
    board = panels()
    return {
        "__inputs": [{"name": INPUT, "label": "Prometheus", "description": "the Prometheus "
                      "that scrapes kvscope serve and kvscope proxy", "type": "datasource",
                      "pluginId": "prometheus", "pluginName": "Prometheus"}],
        "__requires": _requires(board),
        "uid": UID,
        "title": TITLE,
        "description": "kvscope serve /metrics: per-turn KV reuse, miss causes, retained memory",
        "tags": ["kvscope", "vllm"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "utc",
        "templating": {"list": [
            _variable("run", "run", f"label_values({m.TURNS}, run)"),
            _variable("model", "model", f'label_values({m.TURNS}{{{_RUN}}}, model)'),
        ]},
        "panels": board,
    }


def render() -> str:
    """The dashboard as the committed file holds it (sorted keys, 2-space indent, newline)."""
    return json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"


__all__ = ["ALARM_THRESHOLDS", "DATASOURCE", "INPUT", "NO_VALUE", "TITLE", "UID", "WIDTH",
    "dashboard", "panels", "render"]

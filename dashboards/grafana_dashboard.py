"""The Grafana dashboard for ``kvscope serve``'s ``/metrics``, generated (never hand-edited).

:func:`dashboard` builds the dashboard model from the live ledger's series names
(:mod:`kvscope.analysis.live_metrics`), so a renamed series renames its queries.
``dashboards/grafana/kvscope.json`` is this function's output, committed for import (a test
checks it equals what the code generates, and that every query names a series a live
``kvscope serve`` exports). Regenerate it with
``kvscope grafana -o dashboards/grafana/kvscope.json``.

Panels mirror the pages of kvscope's own dashboard that Prometheus can serve: reuse rate (token-
weighted, local vs remote), outcomes and miss causes, invalid reuse, retained KV memory beside GPU
memory, TTFT quantiles, and KV transfers by direction and status. Variables: the Prometheus data
source, and the runs and models to show (multi-select, all by default).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from itertools import count
from typing import Any

from kvscope.analysis import live_metrics as m

UID = "kvscope-live"
TITLE = "kvscope: KV reuse in vLLM P/D"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Every query selects the dashboard's runs and models.
_SEL = 'run=~"$run",model=~"$model"'
_RUN = 'run=~"$run"'
WIDTH = 24


def _target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ref,
            "range": True}


def _panel(ids: Iterator[int], title: str, kind: str, targets: list[tuple[str, str]],
           grid: tuple[int, int, int, int], *, unit: str = "short", description: str = "",
           stacked: bool = False, **options: Any) -> dict[str, Any]:
    x, y, w, h = grid
    defaults: dict[str, Any] = {"unit": unit}
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
               "their prompt", reduceOptions={"calcs": ["lastNotNull"]}),
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
    ]


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {"name": name, "label": label, "type": "query", "datasource": DATASOURCE,
            "query": {"query": query, "refId": name}, "definition": query, "refresh": 2,
            "multi": True, "includeAll": True, "allValue": ".*",
            "current": {"text": "All", "value": "$__all"}, "sort": 1}


def dashboard() -> dict[str, Any]:
    """The whole dashboard model (Grafana's JSON model, importable as is)."""
    return {
        "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource",
                      "pluginId": "prometheus", "pluginName": "Prometheus"}],
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
            {"name": "datasource", "label": "Prometheus", "type": "datasource",
             "query": "prometheus", "current": {}},
            _variable("run", "run", f"label_values({m.TURNS}, run)"),
            _variable("model", "model", f'label_values({m.TURNS}{{{_RUN}}}, model)'),
        ]},
        "panels": panels(),
    }


def render() -> str:
    """The dashboard as the committed file holds it (sorted keys, 2-space indent, newline)."""
    return json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"


__all__ = ["TITLE", "UID", "dashboard", "panels", "render"]

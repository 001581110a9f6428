"""Prometheus alert rules for ``kvscope serve``'s and ``kvscope proxy``'s ``/metrics``, generated.

:func:`groups` builds the rules from the series names (:mod:`kvscope.analysis.live_metrics`,
the receiver's and the proxy's), so a renamed series renames its rules, as the Grafana board
(:mod:`kvscope.dashboards.grafana_dashboard`) does. ``dashboards/prometheus/kvscope-alerts.yml``
is :func:`render`'s output, committed for Prometheus's ``rule_files`` (a test checks it equals
what the code generates); ``dashboards/prometheus/kvscope-alerts.test.yml`` holds
``promtool test rules`` unit tests on synthetic series. Regenerate with
``kvscope alerts -o dashboards/prometheus/kvscope-alerts.yml``.

The ledger series are gauges that appear when their first turn does (a label set Prometheus
has not seen before has no earlier sample), and the transfer counters gain a label set at its
first transfer of that status, so ``increase()`` would miss the first event of a kind. Growth
is therefore the value now less the value a window ago, where a label set absent then counts
as 0 (:func:`_growth`). The thresholds are the constants below; edit them here and regenerate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from kvscope import exposition, semconv
from kvscope.analysis import live_metrics as m
from kvscope.reuse import outcomes

# Reuse rate: fire when the last REUSE_WINDOW's token-weighted rate falls below
# REUSE_DROP_FACTOR × the run's rate since it began, over at least REUSE_MIN_TOKENS reusable
# tokens in the window (a quiet window says nothing).
REUSE_WINDOW = "30m"
REUSE_DROP_FACTOR = 0.8
REUSE_MIN_TOKENS = 10_000
# TTL-expired misses: fire when, over TTL_WINDOW, at least TTL_MIN_TURNS turns k>=2 missed
# because decode's (or the router's) TTL expired, and they are over TTL_SHARE of turns k>=2.
TTL_WINDOW = "15m"
TTL_MIN_TURNS = 3
TTL_SHARE = 0.2
TTL_OUTCOMES = (outcomes.DECODE_TTL_EXPIRED, outcomes.ROUTER_TTL_EXPIRED)
# Retained KV: kvscope does not see decode's KV-cache size, only the GPUs' memory; fire when the
# KV decode engines retain exceeds RETAINED_SHARE_OF_GPU of the run's GPU memory in total. Set
# it to about 0.9 × the share of GPU memory your decode engines give their KV cache.
RETAINED_SHARE_OF_GPU = 0.5
# Transfers and telemetry loss: any within EVENT_WINDOW.
EVENT_WINDOW = "5m"
FAILED_TRANSFER_STATUSES = (semconv.TRANSFER_FAILED, semconv.TRANSFER_HANDSHAKE_FAILED)
# The live ledger (kvscope serve): fire when span rows wait unread at every scrape this long.
LIVE_BEHIND_FOR = "10m"
_FIRST = outcomes.FIRST_TURN
_REFUSED_BY = "job, instance, reason"
_FAILED_BY = "run, engine, status"


@dataclass(frozen=True)
class Rule:
    """One alerting rule (Prometheus's fields)."""

    alert: str
    expr: str
    summary: str
    description: str
    severity: str = "warning"
    for_: str = "0m"
    labels: dict[str, str] = field(default_factory=dict)


def _sum(series: str, by: str = "run", selector: str = "", offset: str = "") -> str:
    at = f" offset {offset}" if offset else ""
    matchers = f"{{{selector}}}" if selector else ""
    return f"sum by ({by}) ({series}{matchers}{at})"


def _growth(series: str, window: str, by: str = "run", selector: str = "") -> str:
    """How much ``series`` grew over ``window``, a label set absent a window ago counting 0."""
    now = _sum(series, by, selector)
    return f"({now} - ({_sum(series, by, selector, window)} or {now} * 0))"


def _reuse_rate(window: str | None) -> str:
    parts = (m.REUSED_LOCAL_TOKENS, m.REUSED_REMOTE_TOKENS, m.REUSABLE_TOKENS)
    local, remote, reusable = ((_sum(s) if window is None else _growth(s, window)) for s in parts)
    return f"({local} + {remote}) / {reusable}"


def rules() -> list[Rule]:
    """Every alerting rule, most urgent first."""
    ttl = 'outcome=~"' + "|".join(TTL_OUTCOMES) + '"'
    failed = ('direction="' + semconv.DIRECTION_D_TO_P + '",status=~"'
              + "|".join(FAILED_TRANSFER_STATUSES) + '"')
    later_turns = f'outcome!="{_FIRST}"'
    # One sum over the loss counters of every job: serve's and the proxy's label sets differ,
    # so adding them with `+` would match nothing.
    lost = '__name__=~"' + "|".join(
        f"{name}_total" for name in (
            exposition.RECEIVER_SPANS_REJECTED, exposition.RECEIVER_ROWS_DROPPED,
            exposition.RECEIVER_ROWS_FAILED,
            exposition.prom_name(semconv.METRIC_PROXY_TELEMETRY_DROPPED))
    ) + '"'
    refused = exposition.RECEIVER_REQUESTS_REFUSED + "_total"
    return [
        Rule("KvscopeInvalidReuse", f"{_sum(m.INVALID_REUSE_TURNS)} > 0",
             "Run {{ $labels.run }}: a turn loaded decode KV that does not match its prompt",
             "{{ $value }} turn(s) of run {{ $labels.run }} read KV from decode that does not "
             "belong to their prompt (outcome reused_invalid): their output may be wrong. "
             "kvscope ledger STORE builds the ledger; its rows with outcome reused_invalid "
             "say why.", severity="critical"),
        Rule("KvscopeKvTransferFailures",
             f"{_growth(m.TRANSFERS + '_total', EVENT_WINDOW, _FAILED_BY, failed)} > 0",
             "Run {{ $labels.run }}: D->P KV transfers failing on {{ $labels.engine }}",
             "{{ $value }} D->P KV transfer(s) ended {{ $labels.status }} on engine "
             "{{ $labels.engine }} in the last " + EVENT_WINDOW + "; those turns recompute "
             "(or stall, with kv_load_failure_policy=recompute)."),
        Rule("KvscopeReuseRateBelowBaseline",
             f"({_reuse_rate(REUSE_WINDOW)}) < {REUSE_DROP_FACTOR} * ({_reuse_rate(None)}) "
             f"and {_growth(m.REUSABLE_TOKENS, REUSE_WINDOW)} >= {REUSE_MIN_TOKENS}",
             "Run {{ $labels.run }}: reuse rate dropped below its baseline",
             f"Token-weighted reuse over the last {REUSE_WINDOW} is "
             "{{ $value | humanizePercentage }}, "
             f"under {REUSE_DROP_FACTOR} x the run's rate since it began. kvscope analyze "
             "STORE miss_causes says why.", for_="10m"),
        Rule("KvscopeTtlExpiredMissesRising",
             f"{_growth(m.TURNS, TTL_WINDOW, selector=ttl)} / "
             f"{_growth(m.TURNS, TTL_WINDOW, selector=later_turns)} > {TTL_SHARE} "
             f"and {_growth(m.TURNS, TTL_WINDOW, selector=ttl)} >= {TTL_MIN_TURNS}",
             "Run {{ $labels.run }}: turns missing reuse because a TTL expired",
             f"{{{{ $value | humanizePercentage }}}} of turns k>=2 in the last {TTL_WINDOW} found "
             "decode's KV (or the router's entry) expired: think times exceed "
             "decoder_kv_blocks_ttl. kvscope whatif STORE shows what a longer TTL buys."),
        Rule("KvscopeRetainedKvNearCapacity",
             f"{_sum(m.RETAINED_BYTES)} / {_sum(m.GPU_TOTAL_BYTES)} > {RETAINED_SHARE_OF_GPU}",
             "Run {{ $labels.run }}: retained KV near decode's capacity",
             "Decode engines retain {{ $value | humanizePercentage }} of the run's GPU memory "
             f"for later turns (threshold {RETAINED_SHARE_OF_GPU}); new requests may preempt.",
             for_="5m"),
        Rule("KvscopeTelemetryLost", f"{_growth('', EVENT_WINDOW, 'job, instance', lost)} > 0",
             "{{ $labels.job }} {{ $labels.instance }}: kvscope telemetry lost",
             f"{{{{ $value }}}} span(s) or row(s) were rejected, dropped or failed to be written "
             f"in the last {EVENT_WINDOW}: the ledger undercounts. GET /health says which."),
        Rule("KvscopeReceiverRefusingRequests",
             f"{_growth(refused, EVENT_WINDOW, _REFUSED_BY)} > 0",
             "kvscope serve {{ $labels.instance }} refused requests ({{ $labels.reason }})",
             f"{{{{ $value }}}} OTLP request(s) refused whole in the last {EVENT_WINDOW} "
             "(busy: the store writer is behind and senders retry; others: malformed, too "
             "large or unsupported bodies, whose spans are lost).", for_="2m"),
        Rule("KvscopeLiveLedgerBehind",
             f"max by (job, instance) ({m.PENDING_ROWS}) > 0",
             "kvscope serve {{ $labels.instance }}: the live ledger is behind the store",
             "{{ $value }} stored span rows were not yet read by the live ledger at the last "
             f"scrape, for {LIVE_BEHIND_FOR}: its refreshes do not keep up "
             f"({m.REFRESH_SECONDS} says how long one takes) and the ledger series lag what "
             "was received. A restart on a large store catches up in steps (about 80 s at 1M "
             "stored turns).", for_=LIVE_BEHIND_FOR),
    ]


def groups() -> dict[str, object]:
    """The rule file's model (Prometheus's ``groups`` format)."""
    return {"groups": [{"name": "kvscope", "rules": [
        {"alert": r.alert, "expr": r.expr, "for": r.for_,
         "labels": {"severity": r.severity, **r.labels},
         "annotations": {"summary": r.summary, "description": r.description}}
        for r in rules()]}]}


def _yaml(value: object, indent: int) -> list[str]:
    """YAML block lines for the rule model (strings as JSON strings, which YAML reads)."""
    pad = " " * indent
    lines: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, dict | list):
                lines.append(f"{pad}{key}:")
                lines += _yaml(item, indent + 2)
            else:
                lines.append(f"{pad}{key}: {json.dumps(item)}")
    elif isinstance(value, list):
        for item in value:
            block = _yaml(item, indent + 2)
            lines.append(f"{pad}- {block[0].lstrip()}")
            lines += block[1:]
    return lines


def render() -> str:
    """The rule file as committed (YAML, two-space indent, newline at the end)."""
    header = ("# Generated by `kvscope alerts` (kvscope.dashboards.prometheus_alerts); "
              "do not edit.\n")
    return header + "\n".join(_yaml(groups(), 0)) + "\n"


__all__ = ["EVENT_WINDOW", "FAILED_TRANSFER_STATUSES", "LIVE_BEHIND_FOR", "RETAINED_SHARE_OF_GPU",
    "REUSE_DROP_FACTOR", "REUSE_MIN_TOKENS", "REUSE_WINDOW", "Rule", "TTL_MIN_TURNS",
    "TTL_OUTCOMES", "TTL_SHARE", "TTL_WINDOW", "groups", "render", "rules"]

"""The Prometheus alert rules: the committed file is the code's output, Prometheus's own
``promtool`` accepts it and passes its unit tests on synthetic series, and every series a rule
names is one kvscope serve or kvscope proxy exports."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvscope import cli
from kvscope.analysis.live_metrics import metrics_source
from kvscope.collector.proxy.metrics import ProxyMetrics
from kvscope.collector.receiver import Receiver
from kvscope.dashboards import prometheus_alerts

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "dashboards" / "prometheus"
COMMITTED = FOLDER / "kvscope-alerts.yml"
UNIT_TESTS = FOLDER / "kvscope-alerts.test.yml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian: apt-get install prometheus; "
    ".ci/run installs it)")


def assert_committed_is_generated(committed: Path, render: Callable[[], str], command: str,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``committed`` (a file under the repository root) holds what ``render`` returns, and
    ``kvscope COMMAND`` prints the same."""
    assert committed.read_text(encoding="utf-8") == render(), (
        f"regenerate: kvscope {command} -o {committed.relative_to(ROOT).as_posix()}")
    assert cli.main([command]) == 0
    assert capsys.readouterr().out == render()


def _promtool(*args: str, timeout: int) -> subprocess.CompletedProcess[str]:
    """``promtool ARGS``, its output captured as text."""
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=timeout)


def test_committed_rules_are_what_the_code_generates(capsys: pytest.CaptureFixture[str]) -> None:
    assert_committed_is_generated(COMMITTED, prometheus_alerts.render, "alerts", capsys)


def test_the_brief_s_alerts_are_all_there() -> None:
    names = {r.alert for r in prometheus_alerts.rules()}
    assert names == {"KvscopeInvalidReuse", "KvscopeKvTransferFailures",
                     "KvscopeReuseRateBelowBaseline", "KvscopeTtlExpiredMissesRising",
                     "KvscopeRetainedKvNearCapacity", "KvscopeTelemetryLost",
                     "KvscopeReceiverRefusingRequests", "KvscopeLiveLedgerBehind"}
    tested = set(re.findall(r"alertname: (\w+)", UNIT_TESTS.read_text(encoding="utf-8")))
    assert tested == names, "every rule has a promtool unit test"


@needs_promtool
def test_promtool_checks_the_rules() -> None:
    done = _promtool("check", "rules", str(COMMITTED), timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(prometheus_alerts.rules())} rules found" in done.stdout


@needs_promtool
def test_promtool_unit_tests_pass() -> None:
    done = _promtool("test", "rules", str(UNIT_TESTS), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_promtool_unit_tests_can_fail(tmp_path: Path) -> None:
    """The unit tests see the thresholds: a rule with its threshold moved fails them."""
    text = COMMITTED.read_text(encoding="utf-8")
    moved = text.replace(f"< {prometheus_alerts.REUSE_DROP_FACTOR} *", "< 0.1 *")
    assert moved != text
    (tmp_path / COMMITTED.name).write_text(moved, encoding="utf-8")
    shutil.copy(UNIT_TESTS, tmp_path / UNIT_TESTS.name)
    done = _promtool("test", "rules", str(tmp_path / UNIT_TESTS.name), timeout=120)
    assert done.returncode != 0
    assert "KvscopeReuseRateBelowBaseline" in done.stdout + done.stderr


def _exported(text: str) -> set[str]:
    """Series names of an exposition, families with no samples yet included (a store with no
    spans declares the ledger's families with no samples)."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name + ("_total" if family.type == "counter" else ""))
        names.update(s.name for s in family.samples)
    return names


def test_every_series_a_rule_names_is_exported(tmp_path: Path) -> None:
    with Receiver(tmp_path / "served.duckdb", port=0, metrics=metrics_source) as receiver:
        # A refused request (unsupported content type) shows in the refusal counter.
        refused = httpx.post(f"{receiver.url}/v1/traces", content=b"x",
                             headers={"Content-Type": "text/plain"}, timeout=10)
        assert refused.status_code == 415
        text = httpx.get(f"{receiver.url}/metrics", timeout=30).text
    proxy = ProxyMetrics()
    proxy.scrape_time.dropped_spans = lambda: 0
    exported = _exported(text) | _exported(generate_latest(proxy.registry).decode())
    refusals = {s.labels["reason"]: s.value for f in text_string_to_metric_families(text)
                for s in f.samples if s.name == "kvscope_receiver_requests_refused_total"}
    assert refusals == {"bad_request": 0, "too_large": 0, "unsupported": 1, "busy": 0}
    for rule in prometheus_alerts.rules():
        named = set(re.findall(r"\b(kvscope_[a-z0-9_]+)\b", rule.expr))
        assert named, rule.alert
        for name in named:
            assert name in exported, f"{rule.alert}: {name} is exported by no kvscope server"
    assert "kvscope_reusable_token" not in exported  # the check is not vacuous

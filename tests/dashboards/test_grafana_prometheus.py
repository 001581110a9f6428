"""The Grafana board against a real Prometheus: Debian's ``prometheus`` scrapes a live receiver
(``kvscope serve``'s /metrics) and the emulator's ``kvscope proxy`` during a small emulated run,
loads the generated alert rules, and every panel's query is evaluated through Prometheus's HTTP
API; the values equal what ``kvscope analyze`` says of the same store afterwards.

Skipped, with the reason shown, where Debian's ``prometheus`` is not installed (``.ci/run``
installs it).
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvscope import cli
from kvscope.analysis.live_metrics import OUTCOME_CLASSES, metrics_source
from kvscope.collector.receiver import Receiver
from kvscope.dashboards import grafana_dashboard, prometheus_alerts
from kvscope.emulator.launcher import EmulatedCluster
from kvscope.emulator.replay import replay
from kvscope.emulator.servers import EmulatorConfig
from kvscope.emulator.workloads.synthetic import generate
from kvscope.reuse import outcomes

PROMETHEUS = shutil.which("prometheus")
TIME_SCALE = 50.0
SCRAPE_S = 1
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="Debian's prometheus not installed (apt-get install prometheus; "
    ".ci/run installs it): the Grafana panels were not evaluated by a real Prometheus")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _target(url: str) -> str:
    return url.removeprefix("http://")


class _Prometheus:
    """One Prometheus process on a free loopback port, its TSDB in a temporary folder."""

    def __init__(self, folder: Path, serve: str, proxy: str) -> None:
        shutil.copy(Path(prometheus_alerts.__file__).parent / "prometheus" /
                    "kvscope-alerts.yml", folder / "rules.yml")
        config = {
            "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
            "rule_files": ["rules.yml"],
            "scrape_configs": [
                {"job_name": "kvscope", "static_configs": [{"targets": [_target(serve)]}]},
                {"job_name": "kvscope-proxy", "static_configs": [{"targets": [_target(proxy)]}]},
            ],
        }
        # JSON is YAML.
        (folder / "prometheus.yml").write_text(json.dumps(config), encoding="utf-8")
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = folder / "prometheus.log"
        assert PROMETHEUS is not None
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [PROMETHEUS, f"--config.file={folder / 'prometheus.yml'}",
                 f"--storage.tsdb.path={folder / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{port}"],
                stdout=log, stderr=subprocess.STDOUT, cwd=folder)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text(errors="replace")[-2000:]
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError("prometheus did not become ready: "
                             + self.log.read_text(errors="replace")[-2000:])

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = at
        body = httpx.get(f"{self.url}/api/v1/query", params=params, timeout=30).json()
        assert body["status"] == "success", (expr, body)
        return list(body["data"]["result"])

    def scraped_since(self, moment: float, job: str) -> bool:
        found = self.query(f'timestamp(up{{job="{job}"}})')
        return bool(found) and float(found[0]["value"][1]) > moment

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(30)


def _workload(seed: int) -> Any:
    # Reusable spans grow by about 160 tokens a turn: with a 500-token threshold, early turns
    # miss (below_threshold) and later turns pull from decode.
    return generate(
        conversations=4, seed=seed, system_prompt_tokens=120, shared_system_prompt=False,
        turns_p50=4, max_turns=5, new_input_tokens_p50=40, output_tokens_p50=120,
        think_time_p50_s=1.0, think_time_p90_s=2.0, arrival_rate_per_s=0, summary_tokens=50,
        max_context_tokens=20_000, reset_probability=0, subagent_probability=0)


def _substitute(expr: str) -> str:
    # All runs and models; a rate window that covers the whole (seconds-long) run.
    return (expr.replace("$run", ".*").replace("$model", ".*")
            .replace("$__rate_interval", "5m"))


def _wait_for_scrapes(prometheus: _Prometheus, settled: float) -> None:
    """Until both jobs were scraped after ``settled`` and every ledger series has three samples
    (a slope, deriv, needs two)."""
    deadline = time.monotonic() + 60
    while not (all(prometheus.scraped_since(settled + 2 * SCRAPE_S, job)
                   for job in ("kvscope", "kvscope-proxy"))
               and prometheus.query("min(count_over_time(kvscope_turns[5m])) >= 3")):
        assert time.monotonic() < deadline, "prometheus scraped nothing new"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Every panel target's result (title → legend → samples), plus the store path."""
    folder = tmp_path_factory.mktemp("prometheus")
    db = folder / "served.duckdb"
    results: dict[str, Any] = {"db": db, "panels": {}}
    with Receiver(db, port=0, record_run=True, metrics=metrics_source) as receiver:
        config = EmulatorConfig(time_scale=TIME_SCALE, prefill_prefix_caching=False, seed=3,
                                kv_recompute_threshold=500)
        with EmulatedCluster(config, otlp_endpoint=receiver.url, proxy=True) as cluster:
            assert cluster.proxy_url is not None
            prometheus = _Prometheus(folder, receiver.url, cluster.proxy_url)
            try:
                # Two halves, the spans of each flushed before Prometheus scrapes again: rates
                # (TTFT quantiles, transfers/s) need series that grow while scraped.
                for seed in (7, 8):
                    done = asyncio.run(replay(_workload(seed), cluster.proxy_url,
                                              time_scale=TIME_SCALE, concurrency=4))
                    assert done.summary()["errors"] == 0
                    assert cluster.flush(30) and receiver.writer.flush(30)
                    settled = time.time()
                    _wait_for_scrapes(prometheus, settled)
                at = time.time()
                for panel in grafana_dashboard.panels():
                    results["panels"][panel["title"]] = {
                        t["legendFormat"]: prometheus.query(_substitute(t["expr"]), at)
                        for t in panel["targets"]}
                results["proxy_turns"] = prometheus.query(
                    "sum(kvscope_proxy_turns_total)", at)
                results["transfers"] = prometheus.query(
                    "sum by (direction, status) (kvscope_kv_transfers_total)", at)
                results["rules"] = httpx.get(f"{prometheus.url}/api/v1/rules",
                                             timeout=30).json()["data"]["groups"]
                results["firing"] = prometheus.query('ALERTS{alertstate="firing"}', at)
            finally:
                prometheus.stop()
    yield results


def _analyze(db: Path, name: str, capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    capsys.readouterr()
    assert cli.main(["analyze", str(db), name, "--format", "json"]) == 0
    return list(json.loads(capsys.readouterr().out))


def _values(samples: list[dict[str, Any]], key: str) -> dict[str, float]:
    return {s["metric"].get(key, ""): float(s["value"][1]) for s in samples}


def test_every_panel_query_returns_data(evaluated: dict[str, Any]) -> None:
    # Allowed empty, as the store is (the other tests check that): nothing failed upstream; no
    # invalid read had a countable size (no data, not 0); an emulated run has no GPU sampler.
    may_be_empty = {("Proxy: upstream errors/s by leg and kind", "{{leg}} {{kind}}"),
                    ("Invalid reuse (correctness alarm)", "tokens"),
                    ("Retained KV beside GPU memory", "GPU used {{host}}:{{gpu}}"),
                    ("Retained KV beside GPU memory", "GPU total {{host}}:{{gpu}}")}
    for title, targets in evaluated["panels"].items():
        for legend, samples in targets.items():
            if (title, legend) in may_be_empty:
                continue
            finite = [s for s in samples if math.isfinite(float(s["value"][1]))]
            assert finite, f"{title} / {legend}: no data from Prometheus {samples}"


def test_reuse_panels_equal_kvscope_analyze(evaluated: dict[str, Any],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    [row] = _analyze(evaluated["db"], "reuse_rate", capsys)
    panels = evaluated["panels"]
    [rate] = panels["Reuse rate (token-weighted)"]["{{run}}"]
    assert float(rate["value"][1]) == pytest.approx(row["token_reuse_rate"], rel=1e-9)
    assert 0 < row["token_reuse_rate"] < 1, "the run mixes reuse and misses"
    split = panels["Reuse split: local vs remote"]
    [local], [remote] = split["local {{run}}"], split["remote {{run}}"]
    assert float(local["value"][1]) == pytest.approx(
        row["local_tokens"] / row["reusable_tokens"], rel=1e-9)
    assert float(remote["value"][1]) == pytest.approx(
        row["remote_tokens"] / row["reusable_tokens"], rel=1e-9)


def test_outcome_panels_equal_kvscope_analyze(evaluated: dict[str, Any],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    ledger = _analyze(evaluated["db"], "ledger", capsys)
    causes = _analyze(evaluated["db"], "miss_causes", capsys)
    panels = evaluated["panels"]
    bars = _values(panels["Outcomes and miss causes"]["{{outcome}}"], "outcome")
    expected: dict[str, float] = {}
    for row in causes:
        if OUTCOME_CLASSES.get(row["outcome"]) in ("miss", "invalid", "unknown"):
            expected[row["outcome"]] = expected.get(row["outcome"], 0) + row["turns"]
    assert bars == expected and bars, (bars, expected)
    classes = _values(panels["Turns by outcome class"]["{{outcome_class}}"], "outcome_class")
    counted: dict[str, float] = {}
    for row in ledger:
        cls = OUTCOME_CLASSES.get(row["outcome"], "unknown")
        counted[cls] = counted.get(cls, 0) + 1
    assert classes == counted
    invalid = [r for r in ledger if r["outcome"] == outcomes.REUSED_INVALID]
    [turns] = panels["Invalid reuse (correctness alarm)"]["turns"]
    assert float(turns["value"][1]) == len(invalid)
    tokens = panels["Invalid reuse (correctness alarm)"]["tokens"]
    counted_tokens = [r["invalid_tokens"] for r in invalid if r["invalid_tokens"] is not None]
    # Not measured shows no data, never 0.
    assert (tokens == []) == (counted_tokens == [])
    assert float(evaluated["proxy_turns"][0]["value"][1]) == len(ledger)


def test_transfer_counts_equal_the_store(evaluated: dict[str, Any],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert cli.main([
        "sql", str(evaluated["db"]),
        "SELECT SpanAttributes['kvscope.transfer.direction'] AS d, "
        "SpanAttributes['kvscope.transfer.status'] AS s, count(*) AS n FROM otel_traces "
        "WHERE SpanName = 'kvscope.kv_transfer' GROUP BY ALL", "--format", "json"]) == 0
    stored = {(r["d"], r["s"]): float(r["n"]) for r in json.loads(capsys.readouterr().out)}
    scraped = {(s["metric"]["direction"], s["metric"]["status"]): float(s["value"][1])
               for s in evaluated["transfers"]}
    assert scraped == stored and stored
    # GPU panels are empty because nothing sampled a GPU, not because a sample was lost.
    assert cli.main(["sql", str(evaluated["db"]), "SELECT count(*) AS n FROM otel_metrics_gauge "
                     "WHERE MetricName LIKE 'kvscope.gpu.%'", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"n": 0}]
    gpu = evaluated["panels"]["Retained KV beside GPU memory"]
    assert gpu["GPU used {{host}}:{{gpu}}"] == gpu["GPU total {{host}}:{{gpu}}"] == []


def test_prometheus_loads_the_alert_rules(evaluated: dict[str, Any]) -> None:
    rules = [r for g in evaluated["rules"] for r in g["rules"]]
    assert {r["name"] for r in rules} == {r.alert for r in prometheus_alerts.rules()}
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError"))
                                                      for r in rules]
    # A clean emulated run: no invalid reuse, no transfer failure, nothing lost.
    assert evaluated["firing"] == []

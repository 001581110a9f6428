"""``kvscope ingest`` of a vLLM server's /metrics snapshot, and the ``reconciliation`` analysis.

The snapshot is written by prometheus_client (the library vLLM's metrics use) with vLLM
0.33.0's metric names, types and labels (``v1/metrics/loggers.py:569-590, 757-797``,
``kv_connector/v1/nixl/stats.py:180-285``): counters expose ``_total``, histograms ``_count``
and ``_sum``, every series carries ``model_name`` and ``engine``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvscope import semconv
from kvscope.analysis import registry
from kvscope.collector.ingest import KINDS, detect, ingest, vllm_metrics
from kvscope.errors import IngestError
from tests.collector.test_ingest_proxy_log import (
    _stats,
    hits_log,
)
from tests.collector.test_ingest_server_log import PLAIN, _pull_log

LABELS = ["model_name", "engine"]


def write_snapshot(path: Path, external: int, local_hit: int, computed: int,
                   transfers: int, failed: int, expired: int) -> Path:
    """A prefill server's /metrics as vLLM's PrometheusStatLogger exposes it."""
    reg = CollectorRegistry()
    by_source = Counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                        [*LABELS, "source"], registry=reg)
    for source, value in (("local_compute", computed), ("local_cache_hit", local_hit),
                          ("external_kv_transfer", external)):
        by_source.labels("m", "0", source).inc(value)
    cached = Counter("vllm:prompt_tokens_cached_by_source", "Prefix-cache hit tokens by tier.",
                     [*LABELS, "source"], registry=reg)
    for source in ("device", "host", "p2p", "disk", "external_unspecified"):
        cached.labels("m", "0", source).inc(
            external if source == "p2p" else local_hit if source == "device" else 0)
    fetch = Gauge("vllm:num_requests_kv_fetch_by_stage", "Waiting requests by KV load stage.",
                  [*LABELS, "stage"], registry=reg)
    for stage in ("waiting_to_start", "in_progress", "completed_waiting"):
        fetch.labels("m", "0", stage).set(0)
    xfer = Histogram("vllm:nixl_xfer_time_seconds", "Histogram of transfer duration.",
                     LABELS, registry=reg)
    size = Histogram("vllm:nixl_bytes_transferred", "Histogram of bytes transferred.",
                     LABELS, registry=reg)
    for _ in range(transfers):
        xfer.labels("m", "0").observe(0.002)
        size.labels("m", "0").observe(4 * 2**20)
    for name, value in (("vllm:nixl_num_failed_transfers", failed),
                        ("vllm:nixl_num_failed_notifications", 0),
                        ("vllm:nixl_num_kv_expired_reqs", expired),
                        ("vllm:nixl_num_notifications_after_expiry", 0)):
        Counter(name, "NIXL counter.", LABELS, registry=reg).labels("m", "0").inc(value)
    path.write_bytes(generate_latest(reg))
    return path


def test_a_snapshot_is_detected_and_its_counters_read(tmp_path: Path) -> None:
    path = write_snapshot(tmp_path / "metrics.txt", 684, 412, 900, 1, 1, 0)
    assert detect(path) is KINDS[vllm_metrics.KIND]
    parsed = vllm_metrics.read_prefill(path)
    counters = parsed.engines["m/0"]
    expected = {
        "prompt_tokens_external_kv_transfer": 684, "prompt_tokens_local_cache_hit": 412,
        "cached_tokens_p2p": 684, "nixl_transfers": 1, "nixl_bytes_transferred": 4 * 2**20,
        "nixl_failed_transfers": 1, "nixl_notifications_after_expiry": 0,
        "kv_fetch_in_progress": 0,
    }
    assert {name: counters.get(name) for name in expected} == expected


def test_a_file_with_no_vllm_sample_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "other.txt"
    other.write_text("# TYPE up gauge\nup 1\n")
    with pytest.raises(IngestError, match=r"other\.txt:1: no vllm: sample"):
        ingest(tmp_path / "run.duckdb", [f"{vllm_metrics.KIND_PREFILL}:{other}"])


def _run(tmp_path: Path, external: int, expired: int = 0) -> list[dict]:
    proxy = hits_log(tmp_path / "proxy.log")
    db = tmp_path / "run.duckdb"
    snapshot = write_snapshot(tmp_path / "prefill-metrics.txt", external, 412, 900, 1, 1, expired)
    ingest(db, [_stats(tmp_path / "stats.json"), proxy.write(),
                f"vllm-prefill-log:{_pull_log(tmp_path / 'prefill.log', PLAIN)}",
                f"{vllm_metrics.KIND_PREFILL}:{snapshot}"])
    with registry.AnalysisContext.open(db) as ctx:
        return registry.run(ctx, "reconciliation").to_dicts()


def test_reconciliation_sets_the_ledger_beside_vllms_counters(tmp_path: Path) -> None:
    rows = {r["quantity"]: r for r in _run(tmp_path, external=384)}
    assert {r["role"] for r in rows.values()} == {semconv.ROLE_PREFILL}
    scheduled = rows["d2p_tokens_scheduled"]
    # The log's pulls are 384 + 300 tokens; the 300 are a read that failed, whose request
    # reported no prefill stats: vLLM counted the 384 (as real servers do: the real tier).
    assert (scheduled["ledger_value"], scheduled["vllm_value"], scheduled["explained"]) == (
        684.0, 384.0, -300.0)
    assert scheduled["flagged"] is False
    assert "300 tokens" in scheduled["explanation"]
    reused = rows["d2p_tokens_reused"]
    assert (reused["ledger_value"], reused["vllm_value"], reused["explained"]) == (
        384.0, 384.0, 0.0)
    assert reused["flagged"] is False
    assert "1 turns not measured" in reused["explanation"]  # CONV_1 turn 2: no evidence
    assert (rows["reads_failed"]["ledger_value"], rows["reads_failed"]["vllm_value"]) == (
        1.0, 1.0)
    assert rows["reads_ok"]["ledger_value"] == 1.0
    assert rows["local_cache_hit_tokens"]["flagged"] is False


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


def test_an_unexplained_difference_is_flagged(tmp_path: Path) -> None:
    rows = {r["quantity"]: r for r in _run(tmp_path, external=900)}
    scheduled = rows["d2p_tokens_scheduled"]
    assert (scheduled["difference"], scheduled["flagged"]) == (216.0, True)
    # vLLM counting the failed read's tokens too is not what vLLM does: flagged.
    rows = {r["quantity"]: r for r in _run(_mkdir(tmp_path / "all"), external=684)}
    assert rows["d2p_tokens_scheduled"]["flagged"] is True


def test_expiries_beyond_the_declined_reads_are_prefills_own_leases(tmp_path: Path) -> None:
    """vLLM's nixl_num_kv_expired_reqs on prefill counts declined expired reads and the
    engine's own send-side leases that expired unread (no turn's read): more than the ledger's
    declined reads is shown, not flagged."""
    rows = {r["quantity"]: r for r in _run(tmp_path, external=384, expired=3)}
    declined = rows["reads_declined_expired"]
    assert (declined["ledger_value"], declined["vllm_value"], declined["difference"]) == (
        0.0, 3.0, 3.0)
    assert declined["flagged"] is False
    assert "send-side leases" in declined["explanation"]


def test_a_live_metrics_url_is_scraped(tmp_path: Path) -> None:
    """``vllm-prefill-metrics:http://127.0.0.1:PORT/metrics`` scrapes the page when ingest runs
    (a real HTTP server on loopback serving the snapshot); an unreachable URL is one line."""
    import http.server
    import threading

    body = write_snapshot(tmp_path / "served.txt", 684, 412, 900, 1, 1, 0).read_bytes()

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        result = ingest(tmp_path / "run.duckdb",
                        [f"{vllm_metrics.KIND_PREFILL}:http://127.0.0.1:{port}/metrics"])
        # Unnamed, the page's kind is detected from what it serves.
        detected = ingest(tmp_path / "detected.duckdb", [f"http://127.0.0.1:{port}/metrics"])
        assert [s.kind for s in detected.sources] == [vllm_metrics.KIND]
    finally:
        server.shutdown()
        server.server_close()
    (source,) = result.sources
    assert (source.kind, source.path.name) == (vllm_metrics.KIND_PREFILL,
                                               f"metrics-127.0.0.1-{port}.prom")
    with registry.AnalysisContext.open(tmp_path / "run.duckdb") as ctx:
        runs = registry.run(ctx, "reconciliation")
    # vLLM's counters, with no turn of the run to set them beside: the ledger's side is not
    # measured (null), and nothing is flagged.
    assert runs["vllm_value"].null_count() == 0
    assert runs["ledger_value"].null_count() == runs.height
    assert not runs["flagged"].any()
    with pytest.raises(IngestError, match=r"^http://127\.0\.0\.1:9/metrics: cannot scrape"):
        ingest(tmp_path / "other.duckdb", ["http://127.0.0.1:9/metrics"])


def test_pulls_whose_token_count_was_not_measured_make_the_sum_a_lower_bound() -> None:
    """Concurrent reads in a server log (real tier): the log tied two pulls to their turns with
    no token count. vLLM's counter is larger by their tokens: a lower bound, not flagged."""
    import json

    import polars as pl

    from kvscope.analysis.reconcile import reconcile_table

    counters = {"engine 0": {"prompt_tokens_external_kv_transfer": 400.0}}
    runs = pl.DataFrame({"run_id": ["r"], "settings": [json.dumps({"files": [
        {"kind": vllm_metrics.KIND_PREFILL, "vllm_counters": counters}]})]})
    ledger = pl.DataFrame({
        "run_id": ["r"] * 3, "turn_index": [2, 2, 2],
        "decision": [semconv.DECISION_PULL] * 3, "to_pull_tokens": [240, None, None],
        "errored": [False] * 3, "d2p_status": [semconv.TRANSFER_OK] * 3,
        "outcome": ["reused_remote", "unknown", "unknown"],
        "remote_reused_tokens": [240, None, None], "local_hit_tokens": [32, None, None]},
        schema_overrides={"to_pull_tokens": pl.Int64, "remote_reused_tokens": pl.Int64,
                          "local_hit_tokens": pl.Int64})
    rows = {r["quantity"]: r for r in reconcile_table(runs, ledger).to_dicts()}
    scheduled = rows["d2p_tokens_scheduled"]
    assert (scheduled["ledger_value"], scheduled["vllm_value"]) == (240.0, 400.0)
    assert scheduled["flagged"] is False
    assert "2 pulls whose token count was not measured" in scheduled["explanation"]
    # Every pull counted: the same difference is flagged.
    counted = reconcile_table(runs, ledger.with_columns(pl.lit(240).alias("to_pull_tokens")))
    assert counted.filter(pl.col("quantity") == "d2p_tokens_scheduled")["flagged"].to_list() == [
        True]

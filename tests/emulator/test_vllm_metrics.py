"""The emulated servers' ``/metrics`` (vLLM's own counters) reconciled with the ledger of the
same run: replay → kvscope proxy → emulated P and D under faults (failed reads and handshakes,
blocks expired before the next turn, a prefill clock that misjudges decode's deadline), the
snapshots added to the run with ``kvscope ingest --run``, then analysis ``reconciliation``."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvscope import semconv
from kvscope.analysis import registry
from kvscope.collector.ingest import ingest
from kvscope.emulator import faults
from kvscope.emulator.faults import FaultMix
from kvscope.emulator.launcher import EmulatedCluster
from kvscope.emulator.replay import replay
from kvscope.emulator.servers import EmulatorConfig
from kvscope.emulator.workloads.synthetic import generate
from kvscope.errors import IngestError
from tests.stores import query

TIME_SCALE = 50.0
FAULTS = {faults.TRANSFER_FAIL: 0.15, faults.HANDSHAKE_FAIL: 0.1,
          faults.EXPIRE_BEFORE_NEXT_TURN: 0.3, faults.CLOCK_SKEW: 0.5}


def _samples(text: str) -> dict[tuple[str, str], float]:
    """(sample name, source label) -> value, every sample labelled model_name and engine."""
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.labels["engine"] == "0" and sample.labels["model_name"]
            if sample.name.endswith("_created"):
                continue
            key = (sample.name, sample.labels.get("source", sample.labels.get("le", "")))
            out[key] = sample.value
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    tmp = tmp_path_factory.mktemp("vllm-metrics")
    db = tmp / "run.duckdb"
    workload = generate(
        conversations=8, seed=4, system_prompt_tokens=120, shared_system_prompt=False,
        turns_p50=4, max_turns=4, new_input_tokens_p50=40, output_tokens_p50=100,
        think_time_p50_s=1.0, think_time_p90_s=2.0, arrival_rate_per_s=0, summary_tokens=50,
        max_context_tokens=20_000, reset_probability=0, subagent_probability=0)
    config = EmulatorConfig(time_scale=TIME_SCALE, prefill_prefix_caching=False, seed=4,
                            faults=FaultMix(FAULTS, seed=11))
    with EmulatedCluster(config, db=db, proxy=True, run_label="faulted") as cluster:
        assert cluster.proxy_url is not None
        asyncio.run(replay(workload, cluster.proxy_url, time_scale=TIME_SCALE, concurrency=4))
        snapshots = []
        for role, url in (("prefill", cluster.prefill_urls[0]),
                          ("decode", cluster.decode_urls[0])):
            with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
                assert answer.headers["Content-Type"].startswith("text/plain")
                path = tmp / f"{role}-metrics.prom"
                path.write_bytes(answer.read())
                snapshots.append(path)
    return db, snapshots[0], snapshots[1]


def test_the_counters_are_vllms_series_counted_where_vllm_counts_them(
        run: tuple[Path, Path, Path]) -> None:
    db, prefill, decode = run
    p, d = _samples(prefill.read_text()), _samples(decode.read_text())
    by_source = {s: p[("vllm:prompt_tokens_by_source_total", s)]
                 for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}
    assert sum(by_source.values()) == p[("vllm:prompt_tokens_total", "")]
    assert (by_source["local_cache_hit"] + by_source["external_kv_transfer"]
            == p[("vllm:prompt_tokens_cached_total", "")])
    assert ("vllm:prompt_tokens_total", "") not in d  # decode's are not modelled
    # Every READ's span and its counter on the engine whose worker read.
    rows = query(db, "SELECT ServiceName, SpanAttributes[?], count(*) FROM otel_traces "
                     "WHERE SpanName = ? GROUP BY ALL",
                 [semconv.TRANSFER_STATUS, semconv.SPAN_KV_TRANSFER])
    spans = {(service, status): n for service, status, n in rows}
    for service, counters in ((semconv.SERVICE_PREFILL, p), (semconv.SERVICE_DECODE, d)):
        assert counters[("vllm:nixl_xfer_time_seconds_count", "")] == spans.get(
            (service, semconv.TRANSFER_OK), 0)
        assert counters[("vllm:nixl_num_failed_transfers_total", "")] == (
            spans.get((service, semconv.TRANSFER_FAILED), 0)
            + spans.get((service, semconv.TRANSFER_HANDSHAKE_FAILED), 0))
    assert p[("vllm:nixl_num_kv_expired_reqs_total", "")] == spans.get(
        (semconv.SERVICE_PREFILL, semconv.TRANSFER_DECLINED_EXPIRED), 0) > 0
    # Decode's expiries are its retentions the TTL reaper released (its send leases).
    [[expired]] = query(db, "SELECT count(*) FROM otel_traces WHERE SpanName = ? AND "
                            "SpanAttributes[?] = ?",
                        [semconv.SPAN_KV_RETENTION, semconv.RETENTION_RELEASE_REASON,
                         semconv.RELEASE_EXPIRED])
    assert d[("vllm:nixl_num_kv_expired_reqs_total", "")] == expired > 0


def test_the_snapshots_added_to_the_run_reconcile_with_its_ledger(
        run: tuple[Path, Path, Path]) -> None:
    db, prefill, decode = run
    result = ingest(db, [f"vllm-prefill-metrics:{prefill}", f"vllm-decode-metrics:{decode}"],
                    run="faulted")
    [(run_id, settings)] = query(db, "SELECT run_id, settings FROM kvscope_runs")
    assert result.run_id == run_id
    assert [f["kind"] for f in json.loads(settings)["ingested"]["files"]] == [
        "vllm-prefill-metrics", "vllm-decode-metrics"]
    with registry.AnalysisContext.open(db) as ctx:
        rows = registry.run(ctx, "reconciliation")
    table = rows.select("role", "quantity", "ledger_value", "vllm_value", "difference").rows()
    got = {(r["role"], r["quantity"]): r for r in rows.to_dicts()}
    assert not rows["flagged"].any(), table
    # Where vLLM and the ledger count the same thing, the same number.
    for quantity in ("reads_ok", "reads_failed", "reads_declined_expired"):
        row = got[(semconv.ROLE_PREFILL, quantity)]
        assert row["ledger_value"] is not None and row["difference"] == 0, table
    # vLLM does not count the tokens of reads that failed or were declined (their requests
    # report no prefill stats): the difference is exactly theirs, and there are some.
    scheduled = got[(semconv.ROLE_PREFILL, "d2p_tokens_scheduled")]
    assert scheduled["difference"] == scheduled["explained"] < 0, table
    assert got[(semconv.ROLE_PREFILL, "reads_failed")]["vllm_value"] > 0, table
    # Through kvscope's proxy an offer is used once (the router consumes it) and prefill
    # declines a read near decode's deadline, so no read comes after release here: both 0.
    after = got[(semconv.ROLE_DECODE, "notifications_after_expiry")]
    assert after["vllm_value"] == after["ledger_value"] == 0, table
    # The report sets the same rows beside the ledger (its tables iterate every analysis).
    from kvscope.dashboards.report import write_report
    page = write_report(db, db.with_suffix(".html")).read_text(encoding="utf-8")
    section = page[page.index("reconciliation"):]
    for quantity in ("d2p_tokens_scheduled", "reads_failed", "notifications_after_expiry"):
        assert quantity in section


def test_decode_counts_reads_after_release_and_leases_its_reaper_expired() -> None:
    """A READ and a notify-only message for a handle decode no longer holds (a second reader of
    one offer) are each a notification after expiry; a handle the TTL reaper released is an
    expired send lease (vLLM: ``_reap_expired_send_leases``)."""
    from kvscope.emulator.servers import Emulation
    from kvscope.emulator.tokens import BlockSeq

    emulation = Emulation(EmulatorConfig(decoder_kv_blocks_ttl=10.0))
    decode = emulation.add_decode()
    node, sequence = decode.node, BlockSeq.from_tokens(list(range(300)), 16)
    for request_id in ("read-twice", "expires"):
        retention, _ = node.finish_request(request_id, sequence, "finished_stopped", 0.0)
        assert retention is not None
    assert node.receive("read-twice", 1.0, read=True).known
    assert not node.receive("read-twice", 2.0, read=True).known
    assert not node.receive("read-twice", 2.0, read=False).known
    node.reap(20.0)
    decode.refresh_metrics()
    counted = _samples(decode.metrics.exposition().decode())
    assert counted[("vllm:nixl_num_notifications_after_expiry_total", "")] == 2
    assert counted[("vllm:nixl_num_kv_expired_reqs_total", "")] == 1
    decode.refresh_metrics()  # read again: nothing counted twice
    assert _samples(decode.metrics.exposition().decode()) == counted


def test_a_run_to_join_that_is_not_there_is_named_and_nothing_written(
        run: tuple[Path, Path, Path], tmp_path: Path) -> None:
    db, stored, _ = run
    prefill = tmp_path / "prefill-later.prom"  # not the stored file (that one is refused first)
    prefill.write_text(stored.read_text() + "# scraped again\n")
    before = query(db, "SELECT run_id, settings FROM kvscope_runs")
    with pytest.raises(IngestError, match=r"--run nope: no run has that id or label \(runs: "):
        ingest(db, [f"vllm-prefill-metrics:{prefill}"], run="nope")
    assert query(db, "SELECT run_id, settings FROM kvscope_runs") == before
    done = subprocess.run([sys.executable, "-m", "kvscope.cli", "ingest", "--db", str(db),
                           "--run", "nope", f"vllm-prefill-metrics:{prefill}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--run nope: no run has that id or label" in done.stderr

"""The ledger names the evidence a hook kvscope could not install would have given.

On a vLLM whose NIXL classes changed, the plugin leaves a changed method unhooked and says so on
its engine spans' resource (``kvscope.vllm.hooks_missing``; the contract tier checks that on the
real classes). Its spans are then absent: here an emulated run through the proxy loses the span
kind that hook gives, its engine spans carry the attribute, and the ledger's ``unknown`` turns
say which hooks were missing instead of a generic reason.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import polars as pl
import pytest

from kvscope import semconv
from kvscope.analysis.ledger import ledger
from kvscope.emulator.launcher import EmulatedCluster
from kvscope.emulator.servers import EmulatorConfig
from kvscope.reuse import outcomes
from kvscope.store.database import open_store
from kvscope.store.source import open_reader

MODEL = "kvscope-emulated"
DECISION_HOOK = "NixlPullConnectorScheduler.update_state_after_alloc"
READ_HOOK = "NixlPullConnectorWorker.get_transfer_results"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three append-only turns of one conversation; each later turn pulls D→P."""
    db = tmp_path_factory.mktemp("hooks") / "run.duckdb"
    config = EmulatorConfig(time_scale=50.0, prefill_prefix_caching=False)
    with EmulatedCluster(config, db=db, proxy=True) as cluster:
        assert cluster.proxy_url is not None
        messages = [{"role": "system", "content": "agent " + "rules " * 120},
                    {"role": "user", "content": "task " + "context " * 30}]
        for step in range(3):
            body = {"model": MODEL, "messages": messages, "max_tokens": 30, "ignore_eos": True,
                    "stream": False, "conversation_id": "c"}
            resp = httpx.post(cluster.proxy_url + "/v1/chat/completions", json=body, timeout=30)
            assert resp.status_code == 200, resp.text
            messages += [resp.json()["choices"][0]["message"],
                         {"role": "user", "content": f"tool {step} " + "line " * 20}]
    return db


def _without(run: Path, tmp_path: Path, span: str, hooks_missing: str | None) -> pl.DataFrame:
    """The run's ledger after dropping ``span``'s spans, the engines naming ``hooks_missing``."""
    db = tmp_path / "copy.duckdb"
    db.write_bytes(run.read_bytes())
    con = open_store(db)
    try:
        con.execute("DELETE FROM otel_traces WHERE SpanName = ?", [span])
        if hooks_missing is not None:
            con.execute(
                "UPDATE otel_traces SET ResourceAttributes = map_concat(ResourceAttributes, "
                "MAP([?], [?])) WHERE ServiceName IN (?, ?)",
                [semconv.HOOKS_MISSING, hooks_missing, semconv.SERVICE_PREFILL,
                 semconv.SERVICE_DECODE])
    finally:
        con.close()
    reader = open_reader(db)
    try:
        return ledger(reader).sort("turn_index")
    finally:
        reader.close()


def test_the_full_run_reuses(run: Path) -> None:
    reader = open_reader(run)
    try:
        rows = ledger(reader).sort("turn_index")
    finally:
        reader.close()
    assert rows["outcome"].to_list() == [outcomes.FIRST_TURN, outcomes.REUSED_REMOTE,
                                         outcomes.REUSED_REMOTE]


def test_missing_decision_hooks_are_named(run: Path, tmp_path: Path) -> None:
    rows = _without(run, tmp_path, semconv.SPAN_REUSE_DECISION, DECISION_HOOK)
    assert rows["outcome"].to_list()[1:] == [outcomes.UNKNOWN] * 2
    for evidence in rows["evidence"].to_list()[1:]:
        assert evidence == (f"prefill's reuse decision not observed: kvscope's hooks "
                            f"{DECISION_HOOK} not installed in this vLLM")


def test_without_the_attribute_the_reason_stays_generic(run: Path, tmp_path: Path) -> None:
    rows = _without(run, tmp_path, semconv.SPAN_REUSE_DECISION, None)
    assert rows["evidence"].to_list()[1:] == [
        "no engine hooks: prefill's reuse decision not observed"] * 2


def test_missing_read_hooks_are_named(run: Path, tmp_path: Path) -> None:
    rows = _without(run, tmp_path, semconv.SPAN_KV_TRANSFER,
                    f"{READ_HOOK},NixlPullConnectorWorker._is_turn2_read_expired")
    assert rows["outcome"].to_list()[1:] == [outcomes.UNKNOWN] * 2
    for evidence in rows["evidence"].to_list()[1:]:
        assert evidence == (
            "prefill decided to pull, the D→P read not observed: kvscope's hooks "
            f"{READ_HOOK}, NixlPullConnectorWorker._is_turn2_read_expired not installed in "
            "this vLLM")



def test_without_the_attribute_a_lost_read_is_not_blamed_on_hooks(run: Path,
                                                                    tmp_path: Path) -> None:
    rows = _without(run, tmp_path, semconv.SPAN_KV_TRANSFER, None)
    assert "hooks" not in " ".join(rows["evidence"].to_list()[1:])


def test_retention_snapshots_yield_to_their_release(run: Path, tmp_path: Path) -> None:
    """The hooks record a long-held retention open (no end) before its release: the ledger
    takes the release's span, whichever span id sorts first."""
    db = tmp_path / "snap.duckdb"
    db.write_bytes(run.read_bytes())
    con = open_store(db)
    try:
        for span_id in ("0000000000000000", "ffffffffffffffff"):
            con.execute(
                "INSERT INTO otel_traces SELECT * REPLACE (? AS SpanId, 0::BIGINT AS Duration, "
                "map_concat(SpanAttributes, MAP([?], [?])) AS SpanAttributes) "
                "FROM otel_traces WHERE SpanName = ?",
                [span_id, semconv.RETENTION_RELEASE_REASON, semconv.RELEASE_OPEN,
                 semconv.SPAN_KV_RETENTION])
    finally:
        con.close()
    reader = open_reader(db)
    try:
        rows = ledger(reader).sort("turn_index")
    finally:
        reader.close()
    assert rows["retention_release"].to_list() == [None, semconv.RELEASE_READ,
                                                   semconv.RELEASE_READ]
    assert all(s > 0 for s in rows["retention_held_s"].to_list()[1:])

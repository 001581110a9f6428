"""Two clients under one conversation id, their turns overlapping: the router keeps the entry of
the decode that finished last, which need not be turn k-1's. The KV turn k loads is the KV that
entry names, so the ledger judges the read against that turn's history, not turn k-1's.

Found by the adversarial conversations (CI, stop 38): a turn whose k-1 it continued, but which
pulled the KV of another client's turn that finished later, was called ``valid``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import polars as pl
from polars.testing import assert_frame_equal

from kvscope.analysis.ledger import VALIDITY_INVALID, VALIDITY_VALID, ledger
from kvscope.emulator.launcher import EmulatedCluster
from kvscope.emulator.servers import EmulatorConfig
from kvscope.reuse import outcomes
from kvscope.store.clickhouse import ClickHouseReader, ClickHouseSource, load_store
from kvscope.store.source import open_reader
from tests.store import otelcol
from tests.store.test_clickhouse import create_exporter_tables

MODEL = "kvscope-emulated"
CID = "shared-id"
# Slow virtual time: a decode of LONG tokens outlasts a whole short turn (20 ms a token).
TIME_SCALE = 0.01
LONG = 300
DATABASE = "kvscope_overlap"


def _words(seed: int, n: int) -> str:
    return " ".join(f"w{(seed * 31 + i * 7) % 97}" for i in range(n))


def _post(url: str, messages: list[dict[str, str]], max_tokens: int,
          client: httpx.Client | None = None) -> str:
    if client is None:
        with httpx.Client() as own:
            return _post(url, messages, max_tokens, own)
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                            "conversation_id": CID, "ignore_eos": True}
    resp = client.post(url + "/v1/chat/completions", json=body, timeout=60)
    resp.raise_for_status()
    return str(resp.json()["choices"][0]["message"]["content"])


def test_a_read_of_another_turns_kv_is_judged_against_that_turn(
        tmp_path: Path, chdb_folder: Path) -> None:
    db = tmp_path / "overlap.duckdb"
    config = EmulatorConfig(time_scale=TIME_SCALE, decoder_kv_blocks_ttl=1e6,
                            prefill_prefix_caching=False)
    mine = [{"role": "system", "content": _words(1, 150)},
            {"role": "user", "content": _words(2, 20)}]
    theirs = [{"role": "system", "content": _words(3, 150)},
              {"role": "user", "content": _words(4, 20)}]
    with EmulatedCluster(config, db=db, proxy=True, router_ttl_s=1e6) as cluster:
        url = cluster.proxy_url
        assert url is not None and cluster.emulation is not None
        with httpx.Client() as client:
            replies: list[str] = []
            # Turn 1, ours; turn 2, another client's, arrives while turn 1 decodes (the router
            # has no entry for it) and decodes long; turn 3, ours, continues turn 1, reads its
            # KV and ends while turn 2 still decodes.
            opening = threading.Thread(target=lambda: replies.append(_post(url, mine, 50)))
            other = threading.Thread(target=lambda: _post(url, theirs, LONG))
            opening.start()
            time.sleep(0.3)  # turn 1 arrived; it decodes until about 1.4 s
            other.start()
            opening.join()
            mine = [*mine, {"role": "assistant", "content": replies[0]},
                    {"role": "user", "content": _words(5, 20)}]
            reply = _post(url, mine, 4, client)  # turn 3
            other.join()
            # Turn 4 continues turn 3, but the router's entry is turn 2's (it finished last);
            # its prompt is longer than turn 2's sequence, so the read is aligned.
            mine = [*mine, {"role": "assistant", "content": reply},
                    {"role": "user", "content": _words(6, 400)}]
            _post(url, mine, 4, client)
        truth = {row.x_request_id: row for row in cluster.emulation.truth.rows}
    reader = open_reader(db)
    try:
        rows = ledger(reader).sort("turn_index")
    finally:
        reader.close()
    # ClickHouse's rendering of the per-turn query finds the same source turns.
    assert_frame_equal(rows, _clickhouse_ledger(db, chdb_folder).sort("turn_index"))
    assert rows["turn_index"].to_list() == [1, 2, 3, 4]
    first, second, third, fourth = rows.iter_rows(named=True)
    # The setting is what it says: turn 3 read turn 1's KV, turn 4 turn 2's.
    assert third["retention_id"] == first["decode_request_id"]
    assert fourth["retention_id"] == second["decode_request_id"]
    assert truth[third["x_request_id"]].outcome == outcomes.REUSED_REMOTE
    assert truth[fourth["x_request_id"]].outcome == outcomes.REUSED_INVALID
    # Turn 3 continues turn 1, whose KV it loaded: valid, though turn 2 (another history)
    # came between (judged against turn 2 it was a false alarm: "edited").
    assert (third["history"], third["reuse_validity"]) == ("continues", VALIDITY_VALID)
    assert third["outcome"] == outcomes.REUSED_REMOTE
    # Turn 4 continues turn 3, not turn 2, whose KV it loaded: invalid (judged against turn 3
    # it was called valid: "pulled 474").
    assert (fourth["history"], fourth["reuse_validity"]) == ("edited", VALIDITY_INVALID)
    assert fourth["outcome"] == outcomes.REUSED_INVALID



def _clickhouse_ledger(db: Path, chdb_folder: Path) -> pl.DataFrame:
    """The ledger of ``db``'s spans copied into ClickHouse (chdb) tables as the exporter's."""
    otelcol.create_database(chdb_folder, DATABASE)
    source = ClickHouseSource(f"chdb:{chdb_folder}", database=DATABASE)
    reader = ClickHouseReader.connect(source)
    try:
        create_exporter_tables(reader, DATABASE)
        load_store(db, reader.engine)
    finally:
        reader.close()
    clickhouse = open_reader(source)
    try:
        return ledger(clickhouse)
    finally:
        clickhouse.close()

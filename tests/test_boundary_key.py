"""Keyed message-boundary hashes: the key's file, its id on spans, and the ledger's comparison."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from kvscope import semconv
from kvscope.analysis.ledger import HISTORY_CONTINUES, HISTORY_EDITED, HISTORY_UNKNOWN, ledger
from kvscope.boundary_key import (
    DEFAULT_KEY_FILE,
    BoundaryKey,
    key_id_of,
    logger,
    resolve_boundary_key,
)
from kvscope.collector.otel import setup_telemetry
from kvscope.collector.proxy.conversation import ConversationId
from kvscope.collector.proxy.telemetry import ProxyTelemetry
from kvscope.errors import SettingError
from kvscope.reuse import outcomes
from kvscope.reuse.boundaries import boundary_hashes
from kvscope.reuse.router import history_continues
from kvscope.store.source import open_reader
from tests.stores import query

LOGGER = logger.name
BODY = {"messages": [{"role": "system", "content": "You are a coding agent."},
                     {"role": "user", "content": "fix the failing test in parser.py"}]}


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"XDG_STATE_HOME": str(tmp_path / "state"), "HOME": str(tmp_path / "home"), **extra}


def test_the_same_text_hashes_differently_under_different_keys() -> None:
    one, two = BoundaryKey(b"a" * 32), BoundaryKey(b"b" * 32)
    hashes_one, hashes_two = boundary_hashes(BODY, one)[1], boundary_hashes(BODY, two)[1]
    assert hashes_one == boundary_hashes(BODY, BoundaryKey(b"a" * 32))[1]  # deterministic
    assert set(hashes_one.split(",")).isdisjoint(hashes_two.split(","))
    assert one.key_id != two.key_id
    # The id is neither the key nor a plain hash of it, and the repr never shows the key.
    assert one.key_id not in (b"a" * 32).hex() and "aaaa" not in repr(one)
    assert key_id_of(b"a" * 32) == one.key_id


def test_the_default_key_is_created_once_and_kept_across_restarts(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    env = _env(tmp_path)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        first = resolve_boundary_key(environ=env)
    path = tmp_path / "state" / "kvscope" / DEFAULT_KEY_FILE
    assert first.source == str(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [r.getMessage() for r in caplog.records if "created" in r.getMessage()] == [
        f"kvscope: created the boundary hash key {path} (id {first.key_id}); proxies that "
        "write one store need the same key: set KVSCOPE_BOUNDARY_HASH_KEY_FILE on each"]
    caplog.clear()
    # A restarted proxy reads the same key, says nothing, and continues the chain it left.
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        restarted = resolve_boundary_key(environ=env)
    assert not caplog.records
    assert (restarted.secret, restarted.key_id) == (first.secret, first.key_id)
    turn_1 = boundary_hashes(BODY, first)[1].split(",")
    turn_2_body = {"messages": [*BODY["messages"], {"role": "assistant", "content": "done"},
                                {"role": "user", "content": "now run it"}]}
    _, turn_2, _ = _boundaries(turn_2_body, restarted)
    assert history_continues(turn_1[-1], turn_2, "suau")


def _boundaries(body: dict[str, Any], key: BoundaryKey) -> tuple[int, list[str], str]:
    from kvscope.reuse.boundaries import message_boundaries

    count, hashes, roles = message_boundaries(body, key)
    return count, hashes.split(","), roles


def test_a_configured_key_file_must_exist_and_hold_a_key(tmp_path: Path) -> None:
    missing = tmp_path / "fleet.key"
    with pytest.raises(SettingError, match=f"boundary hash key file {missing} does not exist"):
        resolve_boundary_key(str(missing), environ=_env(tmp_path))
    missing.write_text("not hex\n")
    with pytest.raises(SettingError, match="not a key of 16 to 64 bytes in hex"):
        resolve_boundary_key(str(missing), environ=_env(tmp_path))
    missing.write_text("ab" * 8)  # 8 bytes: too short to be a key
    with pytest.raises(SettingError, match="not a key of 16 to 64 bytes"):
        resolve_boundary_key(str(missing), environ=_env(tmp_path))
    shared = tmp_path / "shared.key"
    shared.write_text(os.urandom(32).hex() + "\n")
    shared.chmod(0o600)
    # The environment names it for every proxy of a fleet: each gets the same key.
    env = _env(tmp_path, KVSCOPE_BOUNDARY_HASH_KEY_FILE=str(shared))
    assert resolve_boundary_key(environ=env).key_id == resolve_boundary_key(
        str(shared), environ=_env(tmp_path)).key_id
    assert not (tmp_path / "state").exists()  # no default key made beside a configured one


def test_an_unwritable_state_dir_falls_back_to_a_key_of_this_process(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocked = tmp_path / "state"
    blocked.write_text("a file where the state directory should be")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        one = resolve_boundary_key(environ=_env(tmp_path))
        two = resolve_boundary_key(environ=_env(tmp_path))
    assert one.source == two.source == "ephemeral" and one.key_id != two.key_id
    assert "hashing with a key for this process only" in caplog.text


# --- the ledger: hashes compare only under one key id --------------------------------------
def _two_turns(db: Path, first: BoundaryKey, second: BoundaryKey, turn_2_body: dict[str, Any]
               ) -> dict[str, Any]:
    """Turn 1 from a proxy hashing with ``first``, turn 2 from one (restarted) hashing with
    ``second``, stored as real spans in one run; the ledger's row for turn 2."""
    telemetry = setup_telemetry(semconv.SERVICE_PROXY, db=str(db), run_id="run-1")
    try:
        for index, (key, body) in enumerate(((first, BODY), (second, turn_2_body)), start=1):
            proxy = ProxyTelemetry(telemetry, router_ttl_s=450.0, boundary_key=key)
            record = proxy.begin_turn("/v1/chat/completions", f"x-{index}", None, None)
            proxy.conversation_started(record, ConversationId("conv-1", "body"))
            record.turn_index = index  # the conversation's turn, whichever proxy served it
            record.arrival_ns += index * 1_000_000_000
            record.prompt_tokens, record.output_tokens = 40 * index, 12
            proxy.message_boundaries(record, body)
            record.end_ns = record.arrival_ns + 500_000_000
            proxy.finish_turn(record)
        assert telemetry.flush(30)
    finally:
        telemetry.shutdown()
    reader = open_reader(db)
    try:
        rows = ledger(reader).sort("turn_index").to_dicts()
    finally:
        reader.close()
    assert [r["turn_index"] for r in rows] == [1, 2]
    return rows[1]


CONTINUED = {"messages": [*BODY["messages"], {"role": "assistant", "content": "patched it"},
                          {"role": "tool", "content": "3 passed"}]}
EDITED = {"messages": [BODY["messages"][0], {"role": "user", "content": "something else"},
                       {"role": "assistant", "content": "patched it"},
                       {"role": "tool", "content": "3 passed"}]}


def test_the_ledger_continues_a_conversation_across_a_restart_with_the_persisted_key(
        tmp_path: Path) -> None:
    env = _env(tmp_path)
    before, after = resolve_boundary_key(environ=env), resolve_boundary_key(environ=env)
    row = _two_turns(tmp_path / "a.duckdb", before, after, CONTINUED)
    assert row["history"] == HISTORY_CONTINUES
    # The control: the same key shows a real edit, so the rule below has something to hide.
    row = _two_turns(tmp_path / "b.duckdb", before, after, EDITED)
    assert row["history"] == HISTORY_EDITED
    # No decode answered turn 1 here, so the decision table ranks that cause first and the
    # evidence names the edit as the second one.
    assert row["outcome"] == outcomes.NO_DECODE_METADATA
    assert "the history was also edited" in row["evidence"]


@pytest.mark.parametrize("body", [CONTINUED, EDITED], ids=["continued", "edited"])
def test_turns_hashed_with_different_keys_are_never_an_edited_history(
        tmp_path: Path, body: dict[str, Any]) -> None:
    row = _two_turns(tmp_path / "k.duckdb", BoundaryKey.ephemeral(), BoundaryKey.ephemeral(),
                     body)
    assert row["history"] == HISTORY_UNKNOWN
    assert row["outcome"] not in (outcomes.PREFIX_DIVERGED, outcomes.REUSED_INVALID)


def test_kvscope_proxy_hashes_with_the_persisted_key_in_its_export_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvscope proxy --db``'s telemetry: the export child hashes with the key the state
    directory keeps, and each turn span names its id."""
    import argparse

    from kvscope.cli.proxy import configure as add_proxy_arguments
    from kvscope.cli.proxy import telemetry_from_args

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    key = resolve_boundary_key()
    parser = argparse.ArgumentParser()
    add_proxy_arguments(parser)
    db = tmp_path / "proxy.duckdb"
    telemetry = telemetry_from_args(parser.parse_args(["--db", str(db)]), 450.0)
    try:
        assert telemetry.boundary_key.key_id == key.key_id
        record = telemetry.begin_turn("/v1/chat/completions", "x-1", None, None)
        telemetry.conversation_started(record, ConversationId("conv-1", "body"))
        telemetry.message_boundaries(record, BODY)
        telemetry.finish_turn(record)
        assert telemetry.flush(30)
    finally:
        telemetry.shutdown()
    [(attrs,)] = query(db, "SELECT SpanAttributes FROM otel_traces WHERE SpanName = ?",
                       [semconv.SPAN_TURN])
    assert attrs[semconv.MESSAGE_BOUNDARY_HASH_KEY_ID] == key.key_id
    assert attrs[semconv.MESSAGE_BOUNDARY_HASHES] == boundary_hashes(BODY, key)[1]

"""Reuse of KV that does not match the prompt, through kvscope proxy to the emulated P and D.

vLLM's D→P pull is decided by token counts, and its proxy finds decode's params by conversation
id alone (both confirmed on the real classes: tests/vllm_contract/test_real_*_claims.py). A
client that edits or truncates its history under the same id, or a second client that sends the
same id, gets decode's KV loaded for positions where its prompt has other tokens. The ground
truth marks those turns ``reused_invalid``; the ledger, from spans alone, says the same; and
``kvscope proxy --reuse-guard`` sends MISS params instead.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from pathlib import Path
from typing import Any

import httpx
import polars as pl
import pytest

from kvscope.analysis.ledger import ledger
from kvscope.emulator.launcher import EmulatedCluster
from kvscope.emulator.servers import EmulatorConfig
from kvscope.reuse import outcomes
from kvscope.reuse.router import GUARD_EDITED, GUARD_PASSED
from kvscope.store.source import open_reader

MODEL = "kvscope-emulated"
_ids = itertools.count()


def _config() -> EmulatorConfig:
    return EmulatorConfig(time_scale=50.0, prefill_prefix_caching=False, stall_timeout_s=0.2)


def _ask(url: str, cid: str, messages: list[dict[str, str]]) -> str:
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 60,
                            "stream": False, "conversation_id": cid}
    resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["message"]["content"])


def _edited_conversation(url: str) -> str:
    """Two append-only turns, turn 3 with turn 1's answer rewritten, turn 4 cut to turn 1."""
    cid = f"edit-{next(_ids)}"
    system = {"role": "system", "content": "you are a coding agent " + "rules " * 150}
    task = {"role": "user", "content": "fix the failing test " + "context " * 60}
    messages = [system, task]
    reply1 = _ask(url, cid, messages)
    messages += [{"role": "assistant", "content": reply1},
                 {"role": "user", "content": "tool result " + "line " * 80}]
    reply2 = _ask(url, cid, messages)
    edited = [system, task, {"role": "assistant", "content": "[compacted]"},
              {"role": "user", "content": "tool result " + "line " * 80},
              {"role": "assistant", "content": reply2},
              {"role": "user", "content": "next step " + "more " * 40}]
    _ask(url, cid, edited)
    _ask(url, cid, [system, task, {"role": "assistant", "content": reply1},
                    {"role": "user", "content": "start over"}])
    return cid


def _rows(db: Path) -> pl.DataFrame:
    reader = open_reader(db)
    try:
        return ledger(reader).sort("conversation_id", "turn_index")
    finally:
        reader.close()


def test_edited_and_truncated_histories_are_invalid_reuse(tmp_path: Path) -> None:
    db = tmp_path / "edit.duckdb"
    with EmulatedCluster(_config(), db=db, proxy=True) as cluster:
        assert cluster.proxy_url is not None and cluster.emulation is not None
        _edited_conversation(cluster.proxy_url)
        truth = list(cluster.emulation.truth.rows)
    assert [r.outcome for r in truth] == [
        outcomes.FIRST_TURN, outcomes.REUSED_REMOTE, outcomes.REUSED_INVALID,
        outcomes.REUSED_INVALID]
    # Linked by the router's entry, not by content: turns 3 and 4 are turns 3 and 4.
    assert [r.turn_index for r in truth] == [1, 2, 3, 4]
    assert "past the prompt's common prefix" in truth[2].evidence
    assert "misaligned" in truth[3].evidence
    rows = _rows(db)
    assert rows["outcome"].to_list() == [r.outcome for r in truth]
    assert rows["reuse_validity"].to_list() == [None, "valid", "invalid", "invalid"]
    assert rows["history"].to_list()[2:] == ["edited", "edited"]


def test_the_reuse_guard_sends_miss_params_for_an_edited_history(tmp_path: Path) -> None:
    db = tmp_path / "guard.duckdb"
    with EmulatedCluster(_config(), db=db, proxy=True, reuse_guard=True) as cluster:
        assert cluster.proxy_url is not None and cluster.emulation is not None
        _edited_conversation(cluster.proxy_url)
        truth = list(cluster.emulation.truth.rows)
    # Turn 2 continues: reused. Turns 3 and 4 got no offer: nothing loaded, nothing invalid.
    assert truth[1].outcome == outcomes.REUSED_REMOTE
    assert [r.transfer_status for r in truth[2:]] == [None, None]
    assert outcomes.REUSED_INVALID not in {r.outcome for r in truth}
    rows = _rows(db)
    assert rows["reuse_guard"].to_list() == [None, GUARD_PASSED, GUARD_EDITED, GUARD_EDITED]
    assert rows["outcome"].to_list()[2] == outcomes.PREFIX_DIVERGED
    assert "reuse guard sent MISS params" in rows["evidence"].to_list()[2]
    # The truth has the guard's verdict from the proxy: the same cause, not router_no_entry.
    assert [r.facts.get("reuse_guard") for r in truth] == rows["reuse_guard"].to_list()
    assert [r.outcome for r in truth] == rows["outcome"].to_list()


def test_the_truth_has_the_router_s_facts_when_the_proxy_runs_in_the_emulation(
        tmp_path: Path) -> None:
    """No conversation id, a stale router entry, a consumed one: causes only the proxy sees.
    With kvscope's proxy in the emulation's process the truth records its router's facts and
    labels them as the ledger does (before, every one read ``router_no_entry``, "prefill got no
    offer")."""
    db = tmp_path / "router.duckdb"
    system = {"role": "system", "content": "you are a coding agent " + "rules " * 150}
    task = {"role": "user", "content": "fix the failing test " + "context " * 60}

    def two_turns(url: str, cid: str | None, wait_s: float = 0.0) -> None:
        body: dict[str, Any] = {"model": MODEL, "messages": [system, task], "max_tokens": 60,
                                "stream": False}
        if cid is not None:
            body["conversation_id"] = cid
        first = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert first.status_code == 200, first.text
        reply = first.json()["choices"][0]["message"]["content"]
        time.sleep(wait_s)
        body["messages"] = [system, task, {"role": "assistant", "content": reply},
                            {"role": "user", "content": "the test still fails"}]
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=30).status_code == 200

    # The router's TTL in wall seconds: 1 s, decode's (480 s / 50) far longer.
    with EmulatedCluster(_config(), db=db, proxy=True, router_ttl_s=1.0) as cluster:
        assert cluster.proxy_url is not None and cluster.emulation is not None
        two_turns(cluster.proxy_url, "router-hit")
        two_turns(cluster.proxy_url, None)
        two_turns(cluster.proxy_url, "router-stale", wait_s=1.5)
        truth = list(cluster.emulation.truth.rows)
    assert [r.router_lookup for r in truth] == [
        "miss", "hit", "no_conversation_id", "no_conversation_id", "miss", "stale"]
    assert [r.outcome for r in truth] == [
        outcomes.FIRST_TURN, outcomes.REUSED_REMOTE, outcomes.NO_CONVERSATION_ID,
        outcomes.NO_CONVERSATION_ID, outcomes.FIRST_TURN, outcomes.ROUTER_TTL_EXPIRED]
    assert truth[5].evidence.startswith("router entry 1.")
    by_request = {r["x_request_id"]: r for r in _rows(db).to_dicts()}
    assert [by_request[r.x_request_id]["outcome"] for r in truth] == [r.outcome for r in truth]


def _two_clients(url: str) -> None:
    """Client A runs a turn; client B, another task, sends A's conversation id."""
    cid = f"shared-{next(_ids)}"
    a = [{"role": "system", "content": "agent A " + "alpha " * 150},
         {"role": "user", "content": "task A"}]
    _ask(url, cid, a)
    b = [{"role": "system", "content": "agent B " + "beta " * 200},
         {"role": "user", "content": "task B " + "bravo " * 40}]
    _ask(url, cid, b)


def test_another_client_with_the_same_id_loads_foreign_kv_unless_guarded(tmp_path: Path) -> None:
    for guarded in (False, True):
        db = tmp_path / f"shared-{guarded}.duckdb"
        with EmulatedCluster(_config(), db=db, proxy=True, reuse_guard=guarded) as cluster:
            assert cluster.proxy_url is not None and cluster.emulation is not None
            _two_clients(cluster.proxy_url)
            truth = list(cluster.emulation.truth.rows)
        rows = _rows(db)
        second = rows.row(1, named=True)
        if guarded:
            assert truth[1].transfer_status is None and second["reuse_guard"] == GUARD_EDITED
            assert second["outcome"] == outcomes.PREFIX_DIVERGED
        else:
            # B's prompt shares nothing with A's sequence, yet A's KV was pulled into it.
            assert truth[1].outcome == second["outcome"] == outcomes.REUSED_INVALID
            assert truth[1].remote_reused_tokens == 0 and truth[1].transfer_bytes > 0


def test_the_proxy_logs_each_turn_in_vllms_words_and_lists_models(
        caplog: pytest.LogCaptureFixture) -> None:
    """The lines vLLM's multi-turn proxy logs (and its troubleshooting greps), and
    ``GET /v1/models`` relayed from decode."""
    caplog.set_level(logging.INFO, logger="kvscope.collector.proxy.turns")
    with EmulatedCluster(_config(), proxy=True) as cluster:
        assert cluster.proxy_url is not None
        cid = f"log-{next(_ids)}"
        messages = [{"role": "system", "content": "rules " * 100},
                    {"role": "user", "content": "task"}]
        reply = _ask(cluster.proxy_url, cid, messages)
        _ask(cluster.proxy_url, cid, messages + [{"role": "assistant", "content": reply},
                                                  {"role": "user", "content": "go on"}])
        models = httpx.get(cluster.proxy_url + "/v1/models", timeout=10)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvscope.collector.proxy.turns"]
    assert any(line.endswith(f"conv={cid}: cache MISS") for line in lines), lines
    assert any(line.startswith(f"conv={cid}: cache HIT (age=") for line in lines), lines
    assert sum("Prefill done in" in line for line in lines) == 2
    assert sum(line.startswith(f"conv={cid}: cached D blocks (remote_request_id=")
               for line in lines) == 2
    assert models.status_code == 200 and models.json()["object"] == "list"
    assert models.json()["data"][0]["id"] == MODEL


def test_a_turn_with_prompt_logprobs_is_scheduler_skipped_in_truth_and_ledger(
        tmp_path: Path) -> None:
    db = tmp_path / "logprobs.duckdb"
    with EmulatedCluster(_config(), db=db, proxy=True) as cluster:
        assert cluster.proxy_url is not None and cluster.emulation is not None
        cid = f"lp-{next(_ids)}"
        messages = [{"role": "system", "content": "rules " * 100},
                    {"role": "user", "content": "task"}]
        reply = _ask(cluster.proxy_url, cid, messages)
        body: dict[str, Any] = {
            "model": MODEL, "stream": False, "conversation_id": cid, "max_tokens": 20,
            "prompt_logprobs": 1,
            "messages": messages + [{"role": "assistant", "content": reply},
                                    {"role": "user", "content": "go on"}]}
        assert httpx.post(cluster.proxy_url + "/v1/chat/completions", json=body,
                          timeout=30).status_code == 200
        truth = list(cluster.emulation.truth.rows)
    assert truth[1].outcome == outcomes.SCHEDULER_SKIPPED
    assert _rows(db)["outcome"].to_list()[1] == outcomes.SCHEDULER_SKIPPED


def test_completions_turns_are_not_judged_by_one_hash(tmp_path: Path) -> None:
    """/v1/completions sends one growing prompt: its single boundary hash changes every turn,
    which says nothing about edits. The guard lets it through unjudged, and the ledger raises
    no alarm for a read that continues the text."""
    db = tmp_path / "completions.duckdb"
    with EmulatedCluster(_config(), db=db, proxy=True, reuse_guard=True) as cluster:
        assert cluster.proxy_url is not None and cluster.emulation is not None
        cid = f"cmpl-{next(_ids)}"
        prompt = "system rules " * 120 + "task one"
        for extra in ("", " next step please"):
            body = {"model": MODEL, "prompt": prompt + extra, "max_tokens": 30,
                    "conversation_id": cid}
            resp = httpx.post(cluster.proxy_url + "/v1/completions", json=body, timeout=30)
            assert resp.status_code == 200, resp.text
            prompt = prompt + extra + resp.json()["choices"][0]["text"]
        truth = list(cluster.emulation.truth.rows)
    rows = _rows(db)
    assert rows["reuse_guard"].to_list() == [None, "no_history"]
    assert truth[1].transfer_status is not None  # the guard did not block the pull
    assert rows["history"].to_list()[1] == "unknown"
    assert rows["outcome"].to_list()[1] != outcomes.REUSED_INVALID


def test_a_single_message_chat_replaced_under_its_id_is_invalid_reuse(tmp_path: Path) -> None:
    """A chat of one message, then another single message under the same conversation id: the
    boundary hash of a chat's one message is as good as any, so the ledger sees the edit the
    truth sees (before, a lone hash was taken for a completions prompt: "not verified")."""
    db = tmp_path / "single.duckdb"
    with EmulatedCluster(_config(), db=db, proxy=True) as cluster:
        assert cluster.proxy_url is not None and cluster.emulation is not None
        cid = f"single-{next(_ids)}"
        _ask(cluster.proxy_url, cid, [{"role": "user", "content": "alpha " * 300}])
        _ask(cluster.proxy_url, cid, [{"role": "user", "content": "bravo " * 320}])
        truth = list(cluster.emulation.truth.rows)
    rows = _rows(db)
    assert truth[1].outcome == outcomes.REUSED_INVALID
    assert rows["history"].to_list()[1] == "edited"
    assert rows["outcome"].to_list() == [r.outcome for r in truth]
    assert rows["reuse_validity"].to_list()[1] == "invalid"


def test_truth_reusable_follows_the_ledger_after_a_length_capped_turn(tmp_path: Path) -> None:
    """A turn that hit max_tokens: decode holds KV for prompt + output - 1 tokens (it never
    ran the last one), and both truth and ledger count that many as reusable."""
    db = tmp_path / "capped.duckdb"
    with EmulatedCluster(_config(), db=db, proxy=True) as cluster:
        assert cluster.proxy_url is not None and cluster.emulation is not None
        cid = f"capped-{next(_ids)}"
        messages = [{"role": "system", "content": "rules " * 200},
                    {"role": "user", "content": "task " * 40}]
        body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 7,
                                "stream": False, "conversation_id": cid}
        resp = httpx.post(cluster.proxy_url + "/v1/chat/completions", json=body, timeout=30)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["finish_reason"] == "length"
        reply = str(resp.json()["choices"][0]["message"]["content"])
        _ask(cluster.proxy_url, cid, [*messages, {"role": "assistant", "content": reply},
                                      {"role": "user", "content": "go on " * 30}])
        truth = list(cluster.emulation.truth.rows)
    rows = _rows(db)
    assert truth[0].finish_status == "finished_length_capped"
    assert rows["reusable_tokens"].to_list()[1] == truth[1].reusable_tokens
    assert rows["outcome"].to_list() == [r.outcome for r in truth]


def _cached(db: Path) -> dict[str, int | None]:
    """The cached prompt tokens each turn's span recorded (prefill's usage), by X-Request-Id."""
    from kvscope import semconv
    from kvscope.store.query import span_attr, spans

    sql = spans(semconv.SPAN_TURN, {
        "x": span_attr(semconv.X_REQUEST_ID),
        "cached": span_attr(semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS)})
    reader = open_reader(db)
    try:
        frame = reader.frame(sql)
    finally:
        reader.close()
    return {x: None if c is None else int(c) for x, c in frame.iter_rows()}


def test_cached_tokens_are_reported_as_vllm_counts_them(tmp_path: Path) -> None:
    """vLLM's cached prompt tokens: local hit + external tokens at prefill's first schedule
    (PrefillStats.set); decode reports P's count. The HTTP emulator and the simulator both
    report that: a turn that pulled N tokens reports local + N, not its local hit alone."""
    from kvscope.emulator.simulator import SimulationSettings, simulate
    from kvscope.emulator.workloads import synthetic

    db = tmp_path / "cached.duckdb"
    config = EmulatorConfig(time_scale=50.0, prefill_prefix_caching=False, stall_timeout_s=0.2,
                            enable_prompt_tokens_details=True)
    with EmulatedCluster(config, db=db, proxy=True) as cluster:
        assert cluster.proxy_url is not None and cluster.emulation is not None
        _edited_conversation(cluster.proxy_url)
        truth = list(cluster.emulation.truth.rows)
    cached = _cached(db)
    assert truth[1].outcome == outcomes.REUSED_REMOTE
    assert cached[truth[1].x_request_id] == (truth[1].local_hit_tokens
                                            + truth[1].remote_reused_tokens) > 0
    sim_db = tmp_path / "sim.duckdb"
    workload = synthetic.generate(seed=2, conversations=3, turns_p50=4, max_turns=5)
    result = simulate(workload, sim_db, SimulationSettings(profile="tiny", seed=2))
    cached = _cached(sim_db)
    pulled = [row for row in result.truth if row.outcome == outcomes.REUSED_REMOTE]
    assert pulled
    for row in pulled:
        assert cached[row.x_request_id] == row.local_hit_tokens + row.remote_reused_tokens


def _ask_streaming(url: str, cid: str, messages: list[dict[str, str]]) -> str:
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 60,
                            "stream": True, "conversation_id": cid}
    parts: list[str] = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices") or ():
                    parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


def _reply_edited(url: str, streaming: bool) -> None:
    """Turn 2 keeps turn 1's messages and sends its reply back; turn 3 sends turn 2's reply
    back rewritten (compacted), every other message and role as before."""
    ask = _ask_streaming if streaming else _ask
    cid = f"reply-{next(_ids)}"
    messages = [{"role": "system", "content": "you are a coding agent " + "rules " * 150},
                {"role": "user", "content": "fix the failing test " + "context " * 60}]
    reply = ask(url, cid, messages)
    messages += [{"role": "assistant", "content": reply},
                 {"role": "user", "content": "tool result " + "line " * 80}]
    reply = ask(url, cid, messages)
    messages += [{"role": "assistant", "content": reply[: len(reply) // 2] + " [compacted]"},
                 {"role": "user", "content": "next step " + "more " * 40}]
    ask(url, cid, messages)


@pytest.mark.parametrize("streaming", [False, True])
def test_an_edited_assistant_reply_is_an_edited_history(tmp_path: Path, streaming: bool) -> None:
    # Every message hash the client sends continues turn 2's, and the next role is the
    # assistant's: only the hash of the reply decode produced (the proxy's, chained into the
    # turn span and the router entry) shows that decode holds KV of another reply.
    for guarded in (False, True):
        db = tmp_path / f"reply-{streaming}-{guarded}.duckdb"
        with EmulatedCluster(_config(), db=db, proxy=True, reuse_guard=guarded) as cluster:
            assert cluster.proxy_url is not None and cluster.emulation is not None
            _reply_edited(cluster.proxy_url, streaming)
            truth = list(cluster.emulation.truth.rows)
        rows = _rows(db)
        assert rows["history"].to_list() == ["first", "continues", "edited"]
        assert rows["outcome"].to_list()[1] == truth[1].outcome == outcomes.REUSED_REMOTE
        if guarded:
            assert rows["reuse_guard"].to_list()[1:] == [GUARD_PASSED, GUARD_EDITED]
            assert truth[2].transfer_status is None
            assert rows["outcome"].to_list()[2] == outcomes.PREFIX_DIVERGED
        else:
            assert truth[2].outcome == rows["outcome"].to_list()[2] == outcomes.REUSED_INVALID
            assert rows["reuse_validity"].to_list()[2] == "invalid"


def test_a_reply_sent_back_as_text_parts_continues_the_history(tmp_path: Path) -> None:
    """OpenAI-style clients may send a message back as ``[{"type": "text", "text": ...}]``;
    vLLM renders text-only parts as their texts joined by newlines, so the prompt (and decode's
    KV) is the one the plain string gives: a continuation, reused and valid, not an edit.
    Hashed as JSON, the parts read as an edited reply and the guard withheld valid KV."""
    for guarded in (False, True):
        db = tmp_path / f"parts-{guarded}.duckdb"
        with EmulatedCluster(_config(), db=db, proxy=True, reuse_guard=guarded) as cluster:
            assert cluster.proxy_url is not None and cluster.emulation is not None
            url, cid = cluster.proxy_url, f"parts-{next(_ids)}"
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": "you are a coding agent " + "rules " * 150},
                {"role": "user", "content": [{"type": "text", "text": "fix the failing test"},
                                             {"type": "text", "text": "context " * 60}]}]
            reply = _ask(url, cid, messages)
            messages += [{"role": "assistant", "content": [{"type": "text", "text": reply}]},
                         {"role": "user", "content": "tool result " + "line " * 80}]
            _ask(url, cid, messages)
            truth = list(cluster.emulation.truth.rows)
        rows = _rows(db)
        assert rows["history"].to_list() == ["first", "continues"]
        assert truth[1].outcome == rows["outcome"].to_list()[1] == outcomes.REUSED_REMOTE
        assert rows["reuse_validity"].to_list()[1] == "valid"
        if guarded:
            assert rows["reuse_guard"].to_list()[1] == GUARD_PASSED

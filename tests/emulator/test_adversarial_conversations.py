"""Adversarial conversations (hypothesis) through the emulated P/D servers, kvscope's proxy and
``kvscope serve``.

Each drawn conversation is a sequence of client moves a real agent or user makes: continue,
edit any earlier message (the assistant's reply included), truncate, retry a turn, branch (two
continuations of one turn), change the system prompt, replace a single-message chat, add tool
messages, multi-byte text, length-capped turns, turns a stop string ends, streamed and whole
answers, reuse another conversation's id, and completions prompts that grow. A batch of them
runs against one :class:`EmulatedCluster` (HTTP engines and the proxy exporting OTLP to a real
``kvscope serve`` process that owns the DuckDB file), with and without ``--reuse-guard``, under
the asynchronous and the synchronous scheduler. Invariants on every turn, truth (the emulator
knows every token) against the ledger (spans only):

* every fact both sides measured agrees (a disagreement names the fact);
* the ledger never calls a read ``valid`` when the KV it loaded does not match the prompt
  (without boundary hashes, as for a completions prompt, it says ``not_verified``);
* with the guard on, no chat turn loads KV of another history.
"""

from __future__ import annotations

import itertools
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import polars as pl
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvscope.analysis.ledger import VALIDITY_VALID, ledger
from kvscope.emulator.ground_truth import TruthRow
from kvscope.emulator.launcher import EmulatedCluster
from kvscope.emulator.servers import EmulatorConfig
from kvscope.reuse import decisions, outcomes
from kvscope.reuse import params as reuse_params
from kvscope.store.source import open_reader
from tests.collector.served import Served

MODEL = "kvscope-emulated"
WORDS = ("alpha", "beta", "gamma", "delta", "käse", "naïve", "東京", "🙂", "tool", "result")
# Words the emulated decode generates: a stop string among them ends some replies early.
STOPS = ("patch", "test", "fix", "done")
MOVES = ("continue", "continue", "edit", "edit_reply", "truncate", "retry", "branch", "system",
         "tool", "capped", "stop", "foreign", "single")
_examples = itertools.count()

# One conversation: its kind, its first message size, whether answers stream, and its moves.
conversation = st.tuples(
    st.sampled_from(("chat", "chat", "chat", "completions", "single")),
    st.integers(min_value=20, max_value=160),
    st.booleans(),
    st.lists(st.tuples(st.sampled_from(MOVES), st.integers(0, 10_000)), min_size=1,
             max_size=3),
)


def _text(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(words))


def _chat(client: httpx.Client, url: str, cid: str, messages: list[dict[str, str]],
          stream: bool, max_tokens: int = 24, stop: str | None = None) -> str:
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                            "stream": stream, "conversation_id": cid,
                            "ignore_eos": max_tokens < 10}
    if stop is not None:
        body["stop"] = [stop]
    # A failed read ends the turn in error (kv_load_failure_policy fail, vLLM's default): the
    # client goes on with the history it has, as an agent retrying would.
    if not stream:
        resp = client.post(url + "/v1/chat/completions", json=body, timeout=30)
        if resp.status_code != 200:
            assert resp.status_code in (500, 502, 504), resp.text
            return ""
        return str(resp.json()["choices"][0]["message"]["content"])
    parts: list[str] = []
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as resp:
        if resp.status_code != 200:
            assert resp.status_code in (500, 502, 504)
            return ""
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    return ""
                for choice in event.get("choices") or ():
                    parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


def _run(url: str, cid: str, foreign: str,
         spec: tuple[str, int, bool, list[tuple[str, int]]]) -> None:
    kind, size, stream, moves = spec
    with httpx.Client() as client:
        if kind == "completions":
            prompt = _text(size, size)
            for move, seed in [("start", 0), *moves]:
                if move in ("edit", "system", "truncate"):  # one growing prompt, rewritten
                    prompt = _text(seed, 5) + prompt[len(prompt) // 2:]
                body = {"model": MODEL, "prompt": prompt + " " + _text(seed, 12),
                        "max_tokens": 16, "conversation_id": cid}
                resp = client.post(url + "/v1/completions", json=body, timeout=30)
                assert resp.status_code in (200, 500, 502, 504), resp.text
                text = resp.json()["choices"][0]["text"] if resp.status_code == 200 else ""
                prompt = body["prompt"] + " " + text
            return
        if kind == "single":
            for seed in [size, *(seed for _, seed in moves)]:
                _chat(client, url, cid, [{"role": "user", "content": _text(seed, size)}], stream)
            return
        messages = [{"role": "system", "content": _text(size, size)},
                    {"role": "user", "content": _text(size + 1, 20)}]
        before = list(messages)
        reply = _chat(client, url, cid, messages, stream)
        for move, seed in moves:
            turn_id, max_tokens, stop = cid, 24, None
            if move == "retry":
                messages = list(before)
            elif move == "branch":
                messages = [*before, {"role": "assistant", "content": reply},
                            {"role": "user", "content": _text(seed, 15)}]
            else:
                messages = [*messages, {"role": "assistant", "content": reply},
                            {"role": "user", "content": _text(seed, 15)}]
                if move == "edit":
                    index = seed % (len(messages) - 2)  # any message before the last reply
                    messages[index] = {**messages[index],
                                       "content": _text(seed + 1, 10 + seed % 40)}
                elif move == "edit_reply":  # compaction, stripped reasoning: another reply
                    messages[-2] = {"role": "assistant", "content": reply[: seed % 40]}
                elif move == "truncate":
                    messages = messages[: 2 + seed % max(len(messages) - 2, 1)]
                elif move == "system":
                    messages[0] = {"role": "system", "content": _text(seed, size)}
                elif move == "tool":
                    messages.insert(-1, {"role": "tool", "content": _text(seed, 30)})
                elif move == "single":
                    messages = [{"role": "user", "content": _text(seed, size)}]
                elif move == "foreign":
                    turn_id = foreign
                elif move == "capped":
                    max_tokens = 6
                elif move == "stop":
                    stop = STOPS[seed % len(STOPS)]
            before = list(messages)
            reply = _chat(client, url, turn_id, messages, stream, max_tokens, stop)


# The decision table's facts the ledger shows in its columns: fact -> ledger column.
LEDGER_FACTS = {"decision": "decision", "offered": "offered_tokens", "read_status": "d2p_status",
                "reusable": "reusable_tokens", "local": "local_hit_tokens",
                "remote": "remote_reused_tokens", "invalid_tokens": "invalid_tokens",
                "history": "history", "router_lookup": "router_lookup",
                "reuse_guard": "reuse_guard"}


# Facts relative to the previous turn: the ledger's is turn k-1 under the conversation id, the
# truth's the turn whose params prefill was offered (else one found by content, which need not
# be the ledger's: another client's turn under the id, a consumed entry).
RELATIVE = {"history", "reusable", "local", "remote"}


def disagreeing_facts(truth: TruthRow, row: dict[str, Any]) -> list[str]:
    """The facts truth and ledger both measured for a turn and do not agree on, by name.

    Facts relative to the previous turn are compared where both sides link the same previous
    turn (prefill was offered its params and the ledger's turn k-1 is the one that left them),
    and the token split where the ledger verified the history (a completions prompt is not:
    its split assumes a continuation, and its validity says ``not_verified``).
    """
    facts = truth.facts
    linked = facts.get("offered") is not None and row["linked"]
    verified = row["history"] == decisions.HISTORY_CONTINUES
    return [f"{fact}: truth {facts.get(fact)!r}, ledger {row[column]!r}"
            for fact, column in LEDGER_FACTS.items()
            if facts.get(fact) is not None and row[column] is not None
            and row[column] != decisions.HISTORY_UNKNOWN and facts[fact] != row[column]
            and (fact not in RELATIVE or linked)
            and (fact == "history" or fact not in RELATIVE or verified)]


def _check(truth: list[TruthRow], rows: pl.DataFrame, guarded: bool,
           batch: list[Any] = ()) -> int:
    by_id = {r.x_request_id: r for r in truth}
    checked = linked = 0
    off = []
    previous: dict[Any, Any] = {}
    outcomes_compared = 0
    for row in rows.sort("conversation_id", "turn_index").iter_rows(named=True):
        # The ledger's turn k-1 left the params prefill was offered.
        before, before_x = previous.get(row["conversation_id"], (None, None))
        if row["conversation_id"] is not None:
            previous[row["conversation_id"]] = (row["decode_request_id"], row["x_request_id"])
        row["linked"] = row["retention_id"] is not None and row["retention_id"] == before
        t = by_id.get(row["x_request_id"])
        if t is None or t.error is not None:
            continue
        checked += 1
        linked += row["linked"] and row["history"] == decisions.HISTORY_CONTINUES
        where = (row["conversation_id"], row["turn_index"], t.outcome, row["outcome"],
                 row["evidence"])
        wrong = disagreeing_facts(t, row)
        # Where both sides place the turn after the same turn (or both as a first turn), the
        # table must read their facts the same way: router causes included (the truth has the
        # proxy's router facts when the proxy runs in the emulation). A completions prompt has
        # no boundary hashes: the ledger cannot tell an edited one (history unknown).
        # One difference is the ledger's rule, not an error: an edited history's read is invalid
        # to the ledger (message hashes cannot say where the edit lies), while the truth, by
        # tokens, may find every loaded token matches (a reply a one-token stop string ended,
        # sent back without it: decode holds no KV for its last token). Only that direction.
        cautious = (row["invalid_kind"] == "edited" and not t.facts.get("invalid_kind")
                    and t.facts.get("history") == decisions.HISTORY_EDITED)
        if (t.previous_x_request_id == before_x and row["history"] != decisions.HISTORY_UNKNOWN
                or t.router_lookup == "no_conversation_id"):
            outcomes_compared += 1
            if t.outcome != row["outcome"] and not cautious:
                wrong.append(f"outcome: truth {t.outcome!r}, ledger {row['outcome']!r}")
        if wrong:
            off.append((*where, wrong))
        if t.outcome == outcomes.REUSED_INVALID:
            # Without boundary hashes (completions) the ledger says "not_verified", never valid.
            assert row["reuse_validity"] != VALIDITY_VALID, where
        if row["reuse_validity"] == VALIDITY_VALID:
            assert t.outcome in (outcomes.REUSED_REMOTE, outcomes.PARTIAL), where
        if guarded and row["reuse_guard"] is not None and row["reuse_guard"] != "no_history":
            assert t.outcome != outcomes.REUSED_INVALID, where
    for wrong in off[:12]:  # the conversation's moves, to replay it by hand
        print("disagrees:", wrong, batch[int(wrong[0].rsplit("-", 1)[1])] if batch else "")
    assert not off, off[:5]
    assert checked >= len(truth) * 0.9
    # Turns whose facts relative to the previous turn were compared, not only their own.
    assert linked > 0
    assert outcomes_compared >= checked * 0.5, (outcomes_compared, checked)
    return checked


def _converse(tmp: Path, batch: list[Any], guarded: bool, scheduling: str) -> None:
    example = next(_examples)
    db = tmp / f"adversarial-{example}.duckdb"
    # Fast virtual time; decode keeps KV long enough that turns are judged on content, not TTL.
    config = EmulatorConfig(time_scale=2000.0, decoder_kv_blocks_ttl=1e6, scheduling=scheduling,
                            prefill_prefix_caching=False, stall_timeout_s=0.1)
    served = Served(db)
    try:
        # The router's TTL in wall seconds: long, as decode's.
        with EmulatedCluster(config, otlp_endpoint=served.url, proxy=True, router_ttl_s=1e6,
                             reuse_guard=guarded, truth_path=tmp / f"{example}.truth") as cluster:
            assert cluster.proxy_url is not None and cluster.emulation is not None
            url = cluster.proxy_url
            ids = [f"adv-{example}-{i}" for i in range(len(batch))]
            with ThreadPoolExecutor(max_workers=8) as pool:
                list(pool.map(lambda i: _run(url, ids[i], ids[i - 1], batch[i]),
                              range(len(batch))))
            truth = list(cluster.emulation.truth.rows)
    finally:
        served.stop()
    reader = open_reader(db)
    try:
        rows = ledger(reader)
    finally:
        reader.close()
    _check(truth, rows, guarded, batch)


# 4 settings x 5 examples x 25 conversations: 500 conversations a run, one kvscope serve and
# one emulated cluster per example (about 3 minutes on 2 shared cores).
@pytest.mark.slow
@pytest.mark.parametrize("scheduling", reuse_params.SCHEDULING_MODES)
@pytest.mark.parametrize("guarded", [False, True], ids=["unguarded", "guarded"])
def test_adversarial_conversations_keep_the_ledger_honest(
        tmp_path: Path, guarded: bool, scheduling: str) -> None:
    conversations: list[int] = []

    @settings(max_examples=5, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate],  # no shrinking: an example takes seconds
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(batch=st.lists(conversation, min_size=25, max_size=25))
    def converse(batch: list[Any]) -> None:
        _converse(tmp_path, batch, guarded, scheduling)
        conversations.append(len(batch))

    converse()
    assert sum(conversations) == 125

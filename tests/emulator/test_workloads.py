"""Workloads: seeded generation, trace loading, block view and chat rendering."""

from __future__ import annotations

import csv
import itertools
import json
import statistics
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.emulator import tokens
from kvscope.emulator.workloads import (
    BlockChain,
    ChatHistory,
    Conversation,
    Turn,
    Workload,
    WorkloadError,
    block_view,
    common_prefix_blocks,
    messages,
    mooncake,
    mooncake_synthetic,
    synthetic,
    weka,
)

# Small sizes keep rendering and token hashing fast while keeping every structural feature.
SMALL = dict(
    system_prompt_tokens=70, task_tokens_p50=20, new_input_tokens_p50=30,
    max_new_input_tokens=200, output_tokens_p50=12, max_output_tokens=40, max_context_tokens=900,
    summary_tokens=40, turns_p50=8, max_turns=14, subagent_probability=0.15,
    reset_probability=0.1,
)


def _reply(conv: Conversation, turn: Turn) -> str:
    return " ".join(tokens.generate_output_words(hash((conv.id, turn.index)) & 0xFFFF,
                                                 turn.output_tokens))


# --- synthetic ----------------------------------------------------------------------------------


def test_same_seed_same_workload_and_blocks() -> None:
    a = synthetic.generate(conversations=6, seed=11, **SMALL)
    b = synthetic.generate(conversations=6, seed=11, **SMALL)
    c = synthetic.generate(conversations=6, seed=12, **SMALL)
    assert a == b
    assert a != c
    va, vb = block_view(a), block_view(b)
    assert va.prompts.keys() == vb.prompts.keys()
    for key in va.prompts:
        assert va.prompts[key].ids() == vb.prompts[key].ids()
    conv = a.conversations[0]
    assert messages(conv, conv.turns[2], [_reply(conv, t) for t in conv.turns[:2]]) == messages(
        b.conversations[0], b.conversations[0].turns[2], [_reply(conv, t) for t in conv.turns[:2]]
    )


def test_synthetic_shape_resets_subagents_and_think_times() -> None:
    work = synthetic.generate(conversations=120, seed=5)
    summary = work.summary()
    assert summary["subagents"] > 0 and summary["resets"] > 0
    waits = sorted(t.think_time_s for c in work.conversations for t in c.turns if t.index > 1)
    assert len(waits) > 1500
    assert 7 <= statistics.median(waits) <= 14
    assert 110 <= waits[int(0.9 * len(waits))] <= 250
    by_id = {c.id: c for c in work.conversations}
    for conv in work.conversations:
        assert [t.index for t in conv.turns] == list(range(1, len(conv.turns) + 1))
        if conv.parent_id is not None:
            parent = by_id[conv.parent_id]
            assert conv.system_seed == parent.system_seed and conv.start_s > parent.start_s
        for prev, turn in zip(conv.turns, conv.turns[1:], strict=False):
            assert turn.prompt_tokens <= work.settings["max_context_tokens"]
            if not turn.reset:
                assert turn.shared_prefix_tokens == prev.prompt_tokens + prev.output_tokens
            assert turn.new_input_tokens == turn.prompt_tokens - turn.shared_prefix_tokens
    starts = [c.start_s for c in work.conversations if c.parent_id is None]
    assert starts == sorted(starts) and starts[-1] > 0


def test_block_prefixes_match_shared_prefix_tokens() -> None:
    work = synthetic.generate(conversations=40, seed=2)
    view = block_view(work)
    bs = work.block_size
    by_id = {c.id: c for c in work.conversations}
    for conv in work.conversations:
        first = view.prompt(conv.id, 1)
        assert first.num_blocks == conv.turns[0].prompt_tokens // bs
        if conv.parent_id is not None:
            parent_first = view.prompt(conv.parent_id, 1)
            assert common_prefix_blocks(first, parent_first) == conv.system_prompt_tokens // bs
            assert by_id[conv.parent_id].system_prompt_tokens == conv.system_prompt_tokens
        for prev, turn in zip(conv.turns, conv.turns[1:], strict=False):
            held = view.sequence(conv.id, prev.index)
            prompt = view.prompt(conv.id, turn.index)
            assert held.num_blocks == (prev.prompt_tokens + prev.output_tokens) // bs
            assert prompt.num_blocks == turn.prompt_tokens // bs
            assert common_prefix_blocks(held, prompt) == turn.shared_prefix_tokens // bs
    # One product, one system prompt: unrelated sessions share its blocks too.
    a, b = [c for c in work.conversations if c.parent_id is None][:2]
    assert common_prefix_blocks(view.prompt(a.id, 1), view.prompt(b.id, 1)) == 2048 // bs


def test_rendered_prompts_have_planned_sizes_and_preserve_prefixes() -> None:
    work = synthetic.generate(conversations=5, seed=9, **SMALL)
    view = block_view(work)
    resets = 0
    for conv in work.conversations:
        history = ChatHistory(conv, work.block_size)
        previous_ids: list[int] | None = None
        for turn in conv.turns:
            ids = tokens.apply_chat_template(history.messages(turn))
            assert len(ids) == turn.prompt_tokens
            if previous_ids is not None:
                common = tokens.common_prefix_len(previous_ids, ids)
                assert common == turn.shared_prefix_tokens
                if not turn.reset:
                    assert ids[: len(previous_ids)] == previous_ids
                else:
                    resets += 1
                # The emulator's own block hashing agrees with the block view.
                held = view.sequence(conv.id, turn.index - 1)
                hashed = tokens.block_hashes(previous_ids, work.block_size)
                now = tokens.block_hashes(ids, work.block_size)
                assert tokens.common_prefix_len(hashed, now) == common_prefix_blocks(
                    held, view.prompt(conv.id, turn.index)
                )
            reply = _reply(conv, turn)
            history.add_reply(reply)
            # What decode holds: prompt + generated words (its <|end|> comes with the next turn).
            previous_ids = ids + tokens.encode(reply)
    assert resets > 0
    text = json.dumps([history.messages(conv.turns[0])])
    assert "<|" not in text  # filler never contains template markers


def test_unknown_or_invalid_synthetic_options_are_refused() -> None:
    with pytest.raises(WorkloadError, match="unknown option"):
        synthetic.generate(conversation=3)
    with pytest.raises(WorkloadError, match="reset_probability"):
        synthetic.generate(reset_probability=2.0)


# --- block chains -------------------------------------------------------------------------------


@st.composite
def _id_lists(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    shared = draw(st.lists(st.integers(0, 50), max_size=30))
    a = shared + draw(st.lists(st.integers(100, 150), max_size=20))
    b = shared + draw(st.lists(st.integers(200, 250), max_size=20))
    return a, b


@given(_id_lists())
@settings(max_examples=150, deadline=None)
def test_block_chain_round_trip_and_common_prefix(pair: tuple[list[int], list[int]]) -> None:
    a_ids, b_ids = pair
    a = BlockChain.from_ids(a_ids)
    b = BlockChain.from_ids(b_ids, base=a)
    assert a.ids() == a_ids and b.ids() == b_ids
    assert [b.block_id(i) for i in range(b.num_blocks)] == b_ids
    naive = tokens.common_prefix_len(a_ids, b_ids)
    assert common_prefix_blocks(a, b) == naive
    assert b.kept == naive


@given(st.lists(st.integers(0, 10_000), max_size=40), st.sampled_from([16, 32, 64]))
def test_weka_hash_expansion_keeps_equality(hash_ids: list[int], block_size: int) -> None:
    ratio = 64 // block_size
    expanded = weka.expand_hash_ids(hash_ids, block_size)
    assert len(expanded) == ratio * len(hash_ids)
    for i, h in enumerate(hash_ids):
        for j, g in enumerate(hash_ids):
            same = expanded[i * ratio : (i + 1) * ratio] == expanded[j * ratio : (j + 1) * ratio]
            assert same == (h == g)


# --- WEKA traces --------------------------------------------------------------------------------


def _csv_rows() -> list[dict[str, str]]:
    with weka.CSV_PATH.open(newline="") as handle:
        return list(csv.DictReader(handle))


def test_weka_csv_matches_the_readme_facts() -> None:
    work = weka.load_csv()
    summary = work.summary()
    assert summary["requests"] == 49_334
    assert summary["resets"] == 845
    assert len({c.id for c in work.conversations if c.parent_id is None}) == 710
    follow_ups = sorted(
        t.think_time_s for c in work.conversations for t in c.turns if t.index > 1
    )
    assert statistics.median(follow_ups) == 10.0
    assert 160 <= follow_ups[int(0.9 * len(follow_ups))] <= 175
    covered = sum(1 for t in follow_ups if t <= 480) / len(follow_ups)
    assert abs(covered - 0.948) < 0.005


def test_weka_selection_caps_and_scaling() -> None:
    rows = _csv_rows()
    first_three = list(dict.fromkeys(r["conversation_id"] for r in rows))[:3]
    work = weka.load_csv(conversations=3)
    assert {c.id.split(".")[0] for c in work.conversations} == set(first_three)
    assert work.num_requests == sum(1 for r in rows if r["conversation_id"] in first_three)

    sub = weka.load_csv(conversation_ids=["trace_0277"])
    children = [c for c in sub.conversations if c.parent_id == "trace_0277"]
    assert [c.id for c in children] == [f"trace_0277.sa{k}" for k in (1, 2, 3, 4)]
    assert children[0].start_s == pytest.approx(79.224)
    assert len(sub.conversation("trace_0277.sa3").turns) == 17

    small = weka.load_csv(conversation_ids=["trace_0277"], max_turns=3, token_scale=0.1,
                          time_compression=10, arrival_rate_per_s=1.0)
    assert all(len(c.turns) <= 3 for c in small.conversations)
    assert small.settings["token_scale"] == 0.1 and small.settings["time_compression"] == 10
    full_main, small_main = sub.conversation("trace_0277"), small.conversation("trace_0277")
    assert small_main.turns[1].prompt_tokens == round(full_main.turns[1].prompt_tokens * 0.1)
    assert small_main.turns[1].think_time_s == pytest.approx(full_main.turns[1].think_time_s / 10)
    assert small.conversation("trace_0277.sa1").start_s == pytest.approx(7.9224)
    with pytest.raises(WorkloadError, match="trace_9999"):
        weka.load_csv(conversation_ids=["trace_9999"])


def test_weka_resets_are_half_prompt_drops_and_render_as_summaries() -> None:
    work = weka.load_csv(conversation_ids=["trace_0003"], token_scale=0.02)
    conv = work.conversation("trace_0003")
    resets = [t for t in conv.turns if t.reset]
    assert len(resets) >= 3
    history = ChatHistory(conv, work.block_size)
    before: list[dict[str, str]] = []
    for turn in conv.turns[: resets[0].index]:
        sent = history.messages(turn)
        if turn.reset:
            assert len(sent) == 3 and sent[:2] == before[:2]
            kept = tokens.apply_chat_template(sent[:2], add_generation_prompt=False)
            assert len(kept) == conv.system_prompt_tokens + conv.task_tokens
            assert len(kept) == min(t.shared_prefix_tokens for t in resets)
        elif before:
            assert sent[: len(before)] == before
        history.add_reply("ok done")
        before = sent + [{"role": "assistant", "content": "ok done"}]


def test_weka_raw_traces_agree_with_the_csv() -> None:
    raw = weka.load_raw()
    assert {c.id for c in raw.conversations if c.parent_id is None} == {
        "trace_0201", "trace_0277", "trace_0504"
    }
    shipped = ("trace_0201", "trace_0277", "trace_0504")
    rows = [r for r in _csv_rows() if r["conversation_id"] in shipped]
    view = block_view(raw)
    for conv in raw.conversations:
        trace, _, agent = conv.id.partition(".")
        key = (trace, agent or "main")
        mine = [r for r in rows if (r["conversation_id"], r["agent_id"]) == key]
        csv_rows = sorted(mine, key=lambda r: int(r["turn_index"]))
        assert len(csv_rows) == len(conv.turns)
        for row, turn in zip(csv_rows, conv.turns, strict=True):
            assert turn.prompt_tokens == int(row["prompt_tokens"])
            assert turn.shared_prefix_tokens == int(row["shared_prefix_tokens"])
            if turn.index > 1:
                prev = view.prompt(conv.id, turn.index - 1)
                shared_blocks = common_prefix_blocks(prev, view.prompt(conv.id, turn.index))
                assert shared_blocks * 16 == turn.shared_prefix_tokens
    # Blocks render block by block: equal block ids give equal text prefixes over HTTP.
    conv = raw.conversation("trace_0277.sa1")
    first = ChatHistory(conv).messages(conv.turns[0])[0]["content"].split()
    second = ChatHistory(conv).messages(conv.turns[1])[0]["content"].split()
    shared_words = tokens.common_prefix_len(first, second)
    assert shared_words >= conv.turns[1].shared_prefix_tokens
    assert shared_words < conv.turns[1].shared_prefix_tokens + 64


def test_weka_bad_files_name_the_place(tmp_path: Path) -> None:
    bad = tmp_path / "flat.csv"
    bad.write_text("conversation_id,agent_id\nx,main\n")
    with pytest.raises(WorkloadError, match="missing column"):
        weka.load_csv(bad)
    header = (weka.CSV_PATH.open().readline())
    bad.write_text(header + "t1,main,0,0.0,notanumber,5,0,,,0.0,1.0,end_turn\n")
    with pytest.raises(WorkloadError, match=r"flat\.csv:2"):
        weka.load_csv(bad)
    broken = tmp_path / "trace_0001.json"
    broken.write_text('{"block_size": 64, "requests": [{"t": 0}]}')
    with pytest.raises(WorkloadError, match=r"requests\[0\]"):
        weka.load_raw([broken])


# --- Mooncake -----------------------------------------------------------------------------------


def _mooncake_file(tmp_path: Path, rows: list[dict[str, object]]) -> Path:
    path = tmp_path / "mooncake.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _found_links(sessions: mooncake.Sessions) -> set[tuple[int, int]]:
    """(earlier row, follow-up row) pairs the importer linked, as 0-based row indices."""
    return {(a - 1, b - 1) for lines in sessions.lines for a, b in itertools.pairwise(lines)}


def test_mooncake_finds_the_sessions_of_a_trace_shaped_like_the_real_one(tmp_path: Path) -> None:
    trace = mooncake_synthetic.generate(sessions=300, seed=3)
    path = trace.write(tmp_path / "conversation_trace.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    # The real trace's shape: a follow-up never carries its previous prompt's last id, every
    # prompt starts with the shared system-prompt block 0, timestamps fall on a 3 s grid (some
    # ticks 1 ms early). test_mooncake_generator_matches_the_real_trace compares more.
    for a, b in trace.links():
        full = rows[a]["input_length"] // 512
        assert rows[b]["hash_ids"][:full] == rows[a]["hash_ids"][:full]
        if rows[a]["input_length"] % 512:  # a partial last block changes
            assert rows[a]["hash_ids"][-1] not in rows[b]["hash_ids"]
    assert {r["hash_ids"][0] for r in rows} == {0}
    assert {r["timestamp"] % 3000 for r in rows} == {0, 2999}

    found = mooncake.read_sessions(path)
    links = _found_links(found)
    # Every link found is one the generator made, and every link the ids can tell is found; the
    # rest (an earlier prompt whose full blocks are all system prompt) cannot be told apart.
    assert links <= trace.links()
    assert links == trace.identifiable_links()
    # A short first question (under 1024 tokens: its only full block is the shared one) cannot
    # be followed, as in the real trace; they are a small part.
    assert len(links) >= 0.9 * len(trace.links())
    unlinkable = len(trace.links()) - len(links)
    summary = found.summary
    assert summary.requests == len(rows) == 695
    assert summary.sessions == len(trace.sessions) + unlinkable == 319
    assert summary.follow_ups == len(links) == 376
    assert summary.multi_turn_sessions == sum(1 for lines in found.lines if len(lines) > 1)
    assert (summary.turns_per_session_p50, summary.turns_per_session_max) == (2, 8)
    # No retries in the generated trace; first turns after the shared block 0 are not counted.
    assert summary.unlinked_on_prefix == 0

    work = mooncake.load(path)
    assert mooncake.import_summary(work) == summary
    assert work.settings["sessions"] == 319 and work.num_requests == 695
    view = block_view(work)
    for conv in work.conversations:
        for prev, turn in itertools.pairwise(conv.turns):
            # A follow-up re-sends the previous prompt and answer: the blocks decode holds.
            sent = prev.prompt_tokens + prev.output_tokens
            assert turn.shared_prefix_tokens == sent
            held = view.sequence(conv.id, prev.index)
            assert common_prefix_blocks(held, view.prompt(conv.id, turn.index)) == sent // 16
            assert turn.sent_at_s is not None and prev.sent_at_s is not None
            assert turn.think_time_s == pytest.approx(turn.sent_at_s - prev.sent_at_s)


def test_mooncake_links_on_full_blocks_only(tmp_path: Path) -> None:
    system = {"timestamp": 0, "input_length": 900, "output_length": 50, "hash_ids": [0, 1]}
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [0, 2, 3]},
        system,  # its only full block is the shared system prompt: no follow-up can be told
        {"timestamp": 3000, "input_length": 1200, "output_length": 20, "hash_ids": [0, 4, 5]},
        # Follows row 1: its full blocks [0, 2], not its partial id 3.
        {"timestamp": 6000, "input_length": 1600, "output_length": 20, "hash_ids": [0, 2, 6, 7]},
        # Row 3 again (a retry): the same ids, no longer: it joins row 3's session.
        {"timestamp": 9000, "input_length": 1200, "output_length": 5, "hash_ids": [0, 4, 5]},
        {"timestamp": 12000, "input_length": 2600, "output_length": 5,
         "hash_ids": [0, 2, 6, 9, 10, 11]},
    ]
    path = _mooncake_file(tmp_path, rows)
    found = mooncake.read_sessions(path)
    assert found.lines == ((1, 4, 6), (2,), (3, 5))
    assert found.parents == {4: (1, mooncake.FOLLOW_UP), 6: (4, mooncake.FOLLOW_UP),
                             5: (3, mooncake.RETRY)}
    assert (found.summary.unlinked_on_prefix, found.summary.retries) == (0, 1)
    work = mooncake.load(path)
    first = work.conversations[0]
    assert [t.sent_at_s for t in first.turns] == [0.0, 6.0, 12.0]
    assert [t.think_time_s for t in first.turns] == [0.0, 6.0, 6.0]
    assert first.turns[1].shared_prefix_tokens == 1110
    retried = work.conversations[2].turns
    assert retried[1].shared_prefix_tokens == retried[1].prompt_tokens == 1200
    single = mooncake.load(path, group=False)
    assert [len(c.turns) for c in single.conversations] == [1] * 6
    # Equal hash ids are equal blocks, across conversations too (the shared leading id 0), and
    # render as equal text.
    view = block_view(work)
    a, b = work.conversations[0], work.conversations[2]
    assert common_prefix_blocks(view.prompt(a.id, 1), view.prompt(b.id, 1)) == 512 // 16
    text_a = ChatHistory(a).messages(a.turns[0])[0]["content"].split()
    text_b = ChatHistory(b).messages(b.turns[0])[0]["content"].split()
    assert tokens.common_prefix_len(text_a, text_b) == 512


def test_mooncake_generator_is_seeded() -> None:
    one = mooncake_synthetic.generate(sessions=20, seed=5)
    assert one == mooncake_synthetic.generate(sessions=20, seed=5)
    assert one != mooncake_synthetic.generate(sessions=20, seed=6)
    with pytest.raises(WorkloadError, match="continue_probability"):
        mooncake_synthetic.generate(continue_probability=1.0)


def test_mooncake_bad_rows_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
                    '{"timestamp": 1, "input_length": 10}\n')
    with pytest.raises(WorkloadError, match=r"bad\.jsonl:2"):
        mooncake.load(path)
    path.write_text('{"timestamp": 0, "input_length": 100, "output_length": 1, '
                    '"hash_ids": [1, 2, 3]}\n')
    with pytest.raises(WorkloadError, match="do not fit"):
        mooncake.load(path)


def test_workload_holds_no_text() -> None:
    work = synthetic.generate(conversations=2, seed=1, **SMALL)
    assert isinstance(work, Workload)
    for conv in work.conversations:
        for value in vars(conv).values():
            assert not (isinstance(value, str) and " " in value)


def test_weka_csv_continuations_share_the_previous_prompt_and_reply() -> None:
    # trace_0001 turn 1: 71,175 prompt + 169 output; turn 2 shares all 1,112 full 64-blocks.
    workload = weka.load_csv(conversations=1)
    first, second = workload.conversations[0].turns[:2]
    assert (first.prompt_tokens, first.output_tokens) == (71_175, 169)
    assert second.shared_prefix_tokens == 71_175 + 169
    # A reset keeps the measured (block-granular) prefix.
    resets = [t for c in workload.conversations for t in c.turns if t.reset]
    assert all(t.shared_prefix_tokens % 64 == 0 for t in resets)


def test_weka_csv_a_prompt_too_short_for_the_reply_edited_it(tmp_path: Path) -> None:
    """Rows of the real CSV's shapes: trace_0003's follow-ups share every full block of the
    previous prompt but are 2-14 tokens shorter than prompt + output (the reply did not come back
    verbatim; taken as a continuation, the ledger and truth disagreed on 453 turns), and
    trace_0105's requests with 0 output tokens (the workload floors output at 1; the shared
    prefix was one token short of the sequence, 10 reusable-token differences)."""
    header = ("conversation_id,agent_id,turn_index,arrival_s,prompt_tokens,output_tokens,"
              "shared_prefix_tokens,gap_s,idle_s,think_time_s,api_time_s,stop\n")
    rows = ["t,main,0,0.0,84500,380,0,,,0.0,7.0,tool_use",
            "t,main,1,19.0,84878,12,84480,19.0,11.0,12.0,9.0,tool_use",   # 2 short of 84,880
            "t,main,2,40.0,90000,0,84864,21.0,10.0,10.0,3.0,",             # continues, output 0
            "t,main,3,60.0,95000,300,89984,20.0,10.0,10.0,3.0,tool_use"]   # after an output of 0
    csv = tmp_path / "flat.csv"
    csv.write_text(header + "\n".join(rows) + "\n")
    turns = weka.load_csv(csv).conversations[0].turns
    assert turns[1].shared_prefix_tokens == 84_500  # the history edited where the reply starts
    assert turns[2].shared_prefix_tokens == 84_878 + 12
    assert turns[2].output_tokens == 1
    assert turns[3].shared_prefix_tokens == 90_000 + 1


def test_a_workload_option_its_kind_does_not_read_is_refused() -> None:
    """``--token-scale`` on a Mooncake trace (or a trace file for the synthetic generator) was
    silently dropped: the run went ahead full size. Now it is a one-line error naming it."""
    from pathlib import Path

    from kvscope.emulator.workloads import sources
    from kvscope.errors import SettingError

    trace = Path(__file__).parent / "data" / "mooncake_conversation_trace_head.jsonl"
    with pytest.raises(SettingError, match="mooncake does not use --token-scale"):
        sources.load("mooncake", trace=trace, token_scale=0.1)
    with pytest.raises(SettingError, match="does not use --arrival-rate, a workload seed"):
        sources.load("mooncake", trace=trace, arrival_rate_per_s=2.0, seed=3)
    with pytest.raises(SettingError, match="synthetic does not use --trace"):
        sources.load("synthetic", trace=trace)
    # The synthetic generator draws its own waits: a time scale was silently ignored.
    with pytest.raises(SettingError, match="synthetic does not use --time-scale"):
        sources.load("synthetic", time_compression=10.0)
    assert sources.load("mooncake", trace=trace).num_requests == 328

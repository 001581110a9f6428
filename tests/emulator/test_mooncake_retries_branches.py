"""The Mooncake importer on generated traces with retries, branches and short answer copies:
every link the ids can tell is found with its kind, a retry joins its session without breaking
the chain, and a fault-free run shows invalid reuse only where the trace implies it."""

from __future__ import annotations

import collections
from pathlib import Path

from kvscope.emulator.simulator import SimulationSettings, simulate
from kvscope.emulator.workloads import mooncake, mooncake_synthetic
from kvscope.reuse import outcomes
from kvscope.reuse.validity import INVALID_TAINTED

TRACE_BLOCK = 512


def _generated() -> mooncake_synthetic.GeneratedTrace:
    return mooncake_synthetic.generate(sessions=200, seed=3, retry_probability=0.15,
                                       branch_probability=0.15, short_answer_probability=0.3)


def _full(row: dict[str, object]) -> tuple[int, ...]:
    ids = row["hash_ids"]
    assert isinstance(ids, list)
    return tuple(ids[: int(row["input_length"]) // TRACE_BLOCK])  # type: ignore[call-overload]


def _identifiable(trace: mooncake_synthetic.GeneratedTrace) -> set[tuple[int, int, str]]:
    """The (parent, row, kind) links the ids can tell: every retry (its ids are its original's),
    and a follow-up whose parent's full blocks hold some of its session's own text when no
    other earlier request (not a retry) shorter than the row starts it with as many full blocks
    or more (a sibling whose new text fits in its last, partial block looks like the parent to
    the ids: the row starts with its full blocks and is longer)."""
    rows, out = trace.rows, set()
    follow_ups = trace.links()
    for row, link in enumerate(trace.parents):
        if link is None:
            continue
        parent, kind = link
        if kind == "retry":
            out.add((parent, row, kind))
            continue
        assert (parent, row) in follow_ups
        if len(_full(rows[parent])) * TRACE_BLOCK <= trace.system_tokens[parent]:
            continue
        ids = tuple(rows[row]["hash_ids"])
        rivals = [other for other in range(row) if other != parent
                  and (trace.parents[other] or (0, ""))[1] != "retry"
                  and len(_full(rows[other])) >= len(_full(rows[parent]))
                  and ids[:len(_full(rows[other]))] == _full(rows[other])
                  and rows[other]["input_length"] < rows[row]["input_length"]]
        if not rivals:
            out.add((parent, row, kind))
    return out


def test_retries_and_every_child_of_a_branching_turn_are_linked(tmp_path: Path) -> None:
    trace = _generated()
    path = trace.write(tmp_path / "trace.jsonl")
    found = mooncake.read_sessions(path)
    links = {(parent - 1, line - 1, kind) for line, (parent, kind) in found.parents.items()}
    truth = {(link[0], row, link[1]) for row, link in enumerate(trace.parents) if link}
    identifiable = _identifiable(trace)
    assert len(identifiable) >= 0.8 * len(truth)
    assert identifiable <= links
    # What was found and is not the generator's link is one the ids cannot tell: a follow-up
    # of a request whose full blocks the row starts with and which it is longer than.
    for parent, row, kind in links - truth:
        assert kind == mooncake.FOLLOW_UP and (parent, row, kind) not in identifiable
        full = _full(trace.rows[parent])
        assert tuple(trace.rows[row]["hash_ids"][:len(full)]) == full
        assert trace.rows[row]["input_length"] > trace.rows[parent]["input_length"]
    retries = trace.retries()
    branching = collections.Counter(a for a, _ in trace.links())
    assert len(retries) >= 20 and sum(1 for n in branching.values() if n > 1) >= 10
    summary = found.summary
    assert summary.retries == len(retries) and summary.unlinked_on_prefix == 0
    assert summary.branches >= 10
    # A retry joins the session of the request it repeats, and the follow-ups of that request
    # stay in that session: the chain is not broken.
    session_of = {line - 1: number for number, lines in enumerate(found.lines)
                  for line in lines}
    for original, retry in retries:
        assert session_of[retry] == session_of[original]
        for parent, child in trace.links():
            if parent == original and (parent, child, "follow_up") in identifiable:
                assert session_of[child] == session_of[original]


def test_a_fault_free_run_shows_invalid_reuse_only_where_the_trace_implies_it(
        tmp_path: Path) -> None:
    """A turn that re-sends its previous turn's prompt and answer and adds to them never loads
    invalid KV itself (it may read KV an earlier invalid load of its session computed: that is
    what the trace implies, kvscope.reuse.taint). Invalid reuse the trace implies: a prompt
    shorter than what decode holds for the previous turn (a misaligned read of decode's
    end-trimmed blocks), or a turn that does not continue the previous turn of its session (a
    branch from an earlier turn, a retry): the proxy offers the previous turn's KV, which the
    prompt leaves."""
    trace = _generated()
    path = trace.write(tmp_path / "trace.jsonl")
    work = mooncake.load(path)
    found = mooncake.read_sessions(path)
    result = simulate(work, tmp_path / "run.duckdb", SimulationSettings())
    turns = {(c.id, t.index): t for c in work.conversations for t in c.turns}
    lines = {(c.id, t.index): line for c, session in zip(work.conversations, found.lines,
                                                         strict=True)
             for t, line in zip(c.turns, session, strict=True)}
    counted: collections.Counter[str] = collections.Counter()
    invalid: set[str] = set()  # X-Request-Ids of turns that loaded or read invalid KV
    for row in sorted(result.truth, key=lambda r: r.arrival_s):
        if row.outcome == outcomes.REUSED_INVALID:
            invalid.add(row.x_request_id)
        if row.turn_index == 1:
            continue
        key = (row.conversation_id, row.turn_index)
        previous_key = (row.conversation_id, row.turn_index - 1)
        turn, previous = turns[key], turns[previous_key]
        held = previous.prompt_tokens + previous.output_tokens
        continues = found.parents[lines[key]] == (lines[previous_key], mooncake.FOLLOW_UP)
        if continues and turn.prompt_tokens >= held:
            counted["continues"] += 1
            if row.outcome == outcomes.REUSED_INVALID:
                # Only by reading KV an earlier invalid load computed (kvscope.reuse.taint).
                assert row.facts["invalid_kind"] == INVALID_TAINTED, row
                assert row.facts["taint_source"] in invalid, row
                counted["read an earlier invalid load's KV"] += 1
        elif row.outcome == outcomes.REUSED_INVALID:
            counted["implied invalid"] += 1
            assert turn.prompt_tokens < held or not continues
    assert counted["continues"] >= 150 and counted["implied invalid"] >= 1

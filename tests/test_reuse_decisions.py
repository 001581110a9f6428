"""The decision table (kvscope.reuse.decisions): its two evaluators agree, and nothing else in
kvscope decides a turn's outcome.

* the scalar evaluator (:func:`decisions.decide`) and the polars rendering
  (:func:`decisions.polars_exprs`) give the same outcome and evidence on random facts;
* no module outside ``kvscope/reuse`` produces an outcome label itself (an ``outcomes.X``
  returned, passed as ``outcome=``, put in ``pl.lit``/``.then``, or chosen by ``if``/``else``).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope import semconv
from kvscope.reuse import decisions, outcomes, taint, validity
from kvscope.reuse import router as router_rules

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvscope", "collector", "emulator", "analysis", "dashboards")

_STRINGS: dict[str, list[str]] = {
    "router_lookup": [semconv.ROUTER_HIT, semconv.ROUTER_MISS, semconv.ROUTER_STALE,
                      semconv.ROUTER_CONSUMED, semconv.ROUTER_NO_CONVERSATION_ID],
    "reuse_guard": [router_rules.GUARD_PASSED, router_rules.GUARD_EDITED,
                    router_rules.GUARD_UNCHECKED],
    "history": [decisions.HISTORY_FIRST, decisions.HISTORY_CONTINUES, decisions.HISTORY_EDITED,
                decisions.HISTORY_UNKNOWN],
    "prev_params": [decisions.PREV_RETURNED, decisions.PREV_NONE, decisions.PREV_NO_DECODE],
    "decision": list(semconv.DECISIONS),
    "read_status": [semconv.TRANSFER_OK, semconv.TRANSFER_FAILED,
                    semconv.TRANSFER_DECLINED_EXPIRED, semconv.TRANSFER_HANDSHAKE_FAILED],
    "invalid_kind": [validity.INVALID_AFTER_RELEASE, validity.INVALID_BEYOND_PREFIX,
                     validity.INVALID_MISALIGNED, validity.INVALID_EDITED,
                     validity.INVALID_TAINTED, validity.INVALID_TOKENS],
    "taint_via": [taint.VIA_PREFIX_CACHE, taint.VIA_DECODE],
    "taint_source": ["req-1", "cmpl-2"],
    **{name: ["get_num_new_matched_tokens, start_load_kv", "_read_blocks_for_req"]
       for name in ("decision_hooks_missing", "read_hooks_missing", "cause_hooks_missing")},
}
_DTYPES = {int: pl.Int64(), float: pl.Float64(), bool: pl.Boolean(), str: pl.String()}


def _fact(name: str, kind: type) -> st.SearchStrategy[Any]:
    if kind is str:
        values: st.SearchStrategy[Any] = st.sampled_from(_STRINGS[name])
    elif kind is bool:
        values = st.booleans()
    elif kind is float:
        values = st.floats(min_value=0, max_value=1e5, allow_nan=False).map(
            lambda x: round(x, 3))
    else:
        values = st.integers(min_value=-3, max_value=3) | st.integers(0, 100_000)
    return st.none() | values


FACTS = st.fixed_dictionaries(
    {name: _fact(name, kind) for name, (kind, _) in decisions.FACTS.items()})


@settings(max_examples=300, deadline=None)
@given(st.lists(FACTS, min_size=1, max_size=25))
def test_scalar_and_polars_evaluators_agree(rows: list[dict[str, Any]]) -> None:
    schema = {name: _DTYPES[kind] for name, (kind, _) in decisions.FACTS.items()}
    frame = pl.DataFrame(rows, schema=schema)
    label, evidence = decisions.polars_exprs()
    got = frame.select(label.alias("outcome"), evidence.alias("evidence")).rows()
    assert got == [decisions.decide(row) for row in rows]


def test_every_rule_can_decide_a_turn() -> None:
    # A rule shadowed by the rules above it (all its conditions implied) would never fire.
    for rule in decisions.TABLE:
        assert rule.outcome in outcomes.OUTCOMES
        assert rule.when, rule
        for cond in rule.when:
            assert cond.fact in decisions.FACTS, cond
        for arg in rule.args:
            assert arg.fact in decisions.FACTS, arg
        assert rule.evidence.count("{}") == len(rule.args), rule


def test_unknown_facts_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown facts"):
        decisions.decide({"turn_idx": 2})


def test_several_causes_rank_by_the_table_and_evidence_names_both() -> None:
    # Decode returned no params for turn k-1 and the history was edited: nothing could be
    # pulled either way; the upstream cause stopped the reuse and the evidence says both.
    outcome, evidence = decisions.decide({
        "turn_index": 2, "router_lookup": semconv.ROUTER_MISS, "history":
        decisions.HISTORY_EDITED, "prev_params": decisions.PREV_NONE, "engine_seen": True,
        "decision": semconv.DECISION_NO_OFFER})
    assert outcome == outcomes.NO_DECODE_METADATA
    assert evidence.startswith(outcomes.EVIDENCE_NO_DECODE_METADATA)
    assert "history was also edited" in evidence


def test_a_read_of_valid_kv_is_never_a_miss() -> None:
    facts = {"turn_index": 3, "router_lookup": semconv.ROUTER_HIT,
             "history": decisions.HISTORY_EDITED, "prev_params": decisions.PREV_RETURNED,
             "engine_seen": True, "decision": semconv.DECISION_PULL, "reusable": 28_000,
             "local": 0, "remote": 28_000, "reused": 28_000, "coverable": 28_000}
    assert decisions.decide(facts)[0] == outcomes.REUSED_REMOTE
    assert decisions.decide(facts | {"coverable": 30_000})[0] == outcomes.PARTIAL


def test_a_guard_blocked_turn_is_never_router_no_entry() -> None:
    # The guard sent MISS params: prefill saw no offer, but the turn's own fields say why.
    facts = {"turn_index": 2, "router_lookup": semconv.ROUTER_HIT,
             "reuse_guard": router_rules.GUARD_EDITED, "history": decisions.HISTORY_UNKNOWN,
             "prev_params": decisions.PREV_RETURNED, "engine_seen": True,
             "decision": semconv.DECISION_NO_OFFER, "reusable": None}
    assert decisions.decide(facts)[0] == outcomes.PREFIX_DIVERGED


# --- no other coding of the outcome order -------------------------------------------------------

_LABELS = {name for name in dir(outcomes) if getattr(outcomes, name) in outcomes.OUTCOMES}
_LABELS.add("ROUTER_OUTCOMES")  # a lookup -> outcome map is a rule too


def _labels_in(node: ast.AST | None) -> list[str]:
    if node is None:
        return []
    return [n.attr for n in ast.walk(node)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "outcomes" and n.attr in _LABELS]


def producers(tree: ast.AST) -> list[tuple[int, str]]:
    """Where code *produces* an outcome label (rather than testing or grouping labels)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        produced: list[str] = []
        if isinstance(node, ast.Return):
            produced = _labels_in(node.value)
        elif isinstance(node, ast.IfExp):
            produced = _labels_in(node.body) + _labels_in(node.orelse)
        elif isinstance(node, ast.keyword) and node.arg in ("outcome", "label"):
            produced = _labels_in(node.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                node.func.attr in ("then", "lit", "otherwise")):
            produced = [label for arg in node.args for label in _labels_in(arg)]
        elif isinstance(node, ast.Tuple | ast.List):
            # A row pairing a condition with the label it yields: (condition, outcomes.X, ...).
            labels = [e for e in node.elts if _labels_in(e) and isinstance(e, ast.Attribute)]
            if labels and len(labels) < len(node.elts):
                produced = [label for e in labels for label in _labels_in(e)]
        found += [(getattr(node, "lineno", 0), label) for label in produced]
    return found


def test_a_producer_is_detected() -> None:
    tree = ast.parse("def f(x):\n    return outcomes.PREFIX_DIVERGED if x else outcomes.UNKNOWN\n"
                     "y = pl.when(a).then(pl.lit(outcomes.BELOW_THRESHOLD))\n"
                     "z = replace(t, outcome=outcomes.NO_CONVERSATION_ID)\n"
                     "rules = [(c('x') == 1, outcomes.PREEMPTED, pl.lit('why'))]\n"
                     "ok = pl.col('outcome').is_in([outcomes.PARTIAL, outcomes.REUSED_LOCAL])\n")
    assert {label for _, label in producers(tree)} == {
        "PREFIX_DIVERGED", "UNKNOWN", "BELOW_THRESHOLD", "NO_CONVERSATION_ID", "PREEMPTED"}


def test_no_module_outside_the_table_decides_an_outcome() -> None:
    offenders = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel.parts[:2] == ("kvscope", "reuse"):
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            offenders += [f"{rel}:{line}: {label}" for line, label in producers(tree)]
    assert not offenders, (
        "outcome labels produced outside kvscope.reuse.decisions.TABLE (add a rule to the "
        "table and give it facts instead):\n" + "\n".join(offenders))

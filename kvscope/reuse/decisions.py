"""Every per-turn reuse outcome as one ordered table of rules, written as data (STYLE §11).

A turn is described by named *facts* (:data:`FACTS`): what the router's lookup found, what
prefill was offered and decided, how the D→P read ended, the history's relation to the previous
turn, whether what was loaded matches the prompt, the token split. Each :class:`Rule` is a
conjunction of conditions over those facts and the outcome, evidence template and evidence
arguments it yields; the first rule that holds wins (:data:`TABLE`). Two evaluators read the
same table:

* :func:`decide` — scalar facts (the emulator's ground truth, the proxy's guard, what-if);
* :func:`polars_exprs` — the same rules as polars expressions over fact columns (the ledger's
  :func:`kvscope.analysis.ledger.shape`).

A property test (``tests/test_reuse_decisions.py``) gives both random facts and checks they
agree; a second one fails if any other module of kvscope codes the outcome order itself.

Null semantics are SQL's with ``fill_null(False)``: a condition on a fact that is null (not
measured) does not hold, except :data:`IS_NULL`.

The order, and why (DESIGN §5; docs/architecture.md "One vocabulary"):

1. ``reused_invalid`` — the correctness alarm, ahead of everything else: a request with no
   conversation id, or a first turn, can hit KV an invalid load left in prefill's prefix cache
   (:mod:`kvscope.reuse.taint`).
2. ``no_conversation_id`` — a request without a conversation id can be linked to nothing, its
   first turn included.
3. ``first_turn``.
4. ``unknown`` for a client's own record no proxy or engine span explains.
5. A read of valid KV is reuse, never a miss: ``reused_remote`` / ``partial`` when tokens
   pulled from decode were reused.
6. Causes upstream of the history check that left nothing to pull either way (decode returned
   no params for the previous turn; the router's lookup found no usable entry) rank ahead of an
   edited history; when both hold the evidence names both, the stopping cause first.
7. ``prefix_diverged`` — the history was edited (hashes, the proxy's reuse guard, or no common
   prefix while decode offered).
8. Full reuse: ``reused_remote`` / ``reused_local`` (local + remote covers the coverable span).
9. The miss causes in the order a request meets them: decode's params → the router → prefill's
   decision (offer check, bidir, threshold, the scheduler) → preemption → the read's outcome.
10. ``unknown`` when the reusable span is not measured; ``partial``; ``unknown``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvscope import semconv
from kvscope.reuse import outcomes, validity
from kvscope.reuse.router import GUARD_EDITED

if TYPE_CHECKING:  # polars is imported by the rendering only: the scalar evaluator stays light
    import polars as pl

# History relation of turn k to turn k-1 (the ledger's HISTORY_* values, the truth's too).
HISTORY_FIRST = "first"
HISTORY_CONTINUES = "continues"
HISTORY_EDITED = "edited"
HISTORY_UNKNOWN = "unknown"

# What the previous turn left the router (fact ``prev_params``).
PREV_RETURNED = "returned"  # decode returned params
PREV_NONE = "none"  # decode finished and returned no params
PREV_NO_DECODE = "no_decode"  # the previous turn never reached decode

# The facts a rule may read: name -> (python type, meaning). Null: not measured / not seen.
FACTS: dict[str, tuple[type, str]] = {
    "turn_index": (int, "1-based turn number in its conversation"),
    "router_lookup": (str, "the proxy's router lookup result (semconv.ROUTER_*)"),
    "router_entry_age_s": (float, "age of the router entry looked up"),
    "reuse_guard": (str, "the proxy's --reuse-guard verdict (router.GUARD_*)"),
    "client_only": (bool, "a client's own record, no proxy or engine span joined"),
    "engine_only": (bool, "engine spans alone: no proxy span names the request"),
    "history": (str, "turn k's messages against turn k-1's (HISTORY_*)"),
    "common_prefix": (int, "tokens the prompt shares with decode's sequence (truth only)"),
    "prev_params": (str, "what the previous turn left the router (PREV_*)"),
    "engine_seen": (bool, "prefill's reuse decision was observed"),
    "decision": (str, "prefill's first reuse decision (semconv.DECISION_*)"),
    "bidir": (bool, "bidirectional_kv_xfer at prefill"),
    "offered": (int, "decode's remote_num_tokens offered to prefill"),
    "below_count": (int, "the connector's count min(offered, prompt) - local hit"),
    "threshold": (int, "kv_recompute_threshold"),
    "rescheduled": (bool, "the request was rescheduled after its read"),
    "read_status": (str, "the D->P read's status (semconv.TRANSFER_*)"),
    "load_errored": (bool, "a failed read ended the request in error (policy fail)"),
    "load_reissued": (bool, "a failed read was re-issued (policy recompute)"),
    "loaded": (int, "tokens the D->P read loaded"),
    "invalid_kind": (str, "why loaded KV does not match the prompt (validity.INVALID_*)"),
    "invalid_tokens": (int, "loaded tokens that do not match the prompt"),
    "taint_read": (int, "tokens read through taint_via (the local hit, or it plus the read)"),
    "taint_via": (str, "where KV computed from an invalid load was read (taint.VIA_*)"),
    "taint_source": (str, "the request whose invalid load computed that KV"),
    "prompt_tokens": (int, "the prompt's tokens"),
    "reusable": (int, "reusable tokens (DESIGN §5)"),
    "local": (int, "local prefix-cache hit inside the reusable span"),
    "remote": (int, "tokens pulled from decode and reused inside the reusable span"),
    "reused": (int, "local + remote"),
    "coverable": (int, "what full reuse must cover: min(reusable, max(offered, local))"),
    # The hooks kvscope could not install in this vLLM (named), when they include those that
    # observe the fact in question; null when those hooks installed (or nothing is known).
    "decision_hooks_missing": (str, "missing hooks, when they observe prefill's decision"),
    "read_hooks_missing": (str, "missing hooks, when they observe the D->P read"),
    "cause_hooks_missing": (str, "missing hooks, when they observe a failed read's cause"),
}

# Condition operators.
EQ, NE, IN, GT, GE, LE, IS_NULL, NOT_NULL = "==", "!=", "in", ">", ">=", "<=", "null", "not_null"


@dataclass(frozen=True, slots=True)
class Ref:
    """A condition's value that is another fact (``reused >= Ref("coverable")``)."""

    fact: str


@dataclass(frozen=True, slots=True)
class Cond:
    """``fact op value``; false when the fact (or a referenced one) is null."""

    fact: str
    op: str
    value: Any = None


@dataclass(frozen=True, slots=True)
class Arg:
    """An evidence argument: a fact's value, rounded to ``digits`` when given."""

    fact: str
    digits: int | None = None


@dataclass(frozen=True, slots=True)
class Rule:
    """One row: when every condition holds, the turn gets ``outcome`` and ``evidence``."""

    outcome: str
    when: tuple[Cond, ...]
    evidence: str
    args: tuple[Arg, ...] = ()


def _c(fact: str, op: str, value: Any = None) -> Cond:
    return Cond(fact, op, value)


_EDITED = _c("history", EQ, HISTORY_EDITED)
_ALSO_EDITED = "; the history was also edited since the previous turn"
_FULL = (_c("engine_seen", EQ, True), _c("reused", GE, Ref("coverable")), _c("reused", GT, 0))
_READ_FAILED = (_c("read_status", NOT_NULL), _c("read_status", NE, semconv.TRANSFER_OK))
_NO_METADATA = outcomes.EVIDENCE_NO_DECODE_METADATA
_NEVER_DECODED = "previous turn never reached decode"
_ROUTER_CAUSES: tuple[tuple[str, str, str, tuple[Arg, ...]], ...] = (
    (semconv.ROUTER_MISS, outcomes.ROUTER_NO_ENTRY, "router lookup miss", ()),
    (semconv.ROUTER_STALE, outcomes.ROUTER_TTL_EXPIRED, "router entry {} s old",
     (Arg("router_entry_age_s", 1),)),
    (semconv.ROUTER_CONSUMED, outcomes.HANDLE_CONSUMED,
     "router entry already taken by an overlapping turn", ()),
)


def _upstream(extra: tuple[Cond, ...], suffix: str) -> list[Rule]:
    """Decode's params and the router's lookup: nothing reached prefill to pull."""
    rules = [
        Rule(outcomes.NO_DECODE_METADATA, (_c("prev_params", EQ, PREV_NONE), *extra),
             _NO_METADATA + suffix),
        Rule(outcomes.NO_DECODE_METADATA, (_c("prev_params", EQ, PREV_NO_DECODE), *extra),
             _NEVER_DECODED + suffix),
    ]
    rules += [Rule(outcome, (_c("router_lookup", EQ, lookup), *extra), text + suffix, args)
              for lookup, outcome, text, args in _ROUTER_CAUSES]
    return rules


_INVALID_ARGS: dict[str, tuple[Arg, ...]] = {
    validity.INVALID_AFTER_RELEASE: (Arg("loaded"),),
    validity.INVALID_EDITED: (Arg("loaded"),),
    validity.INVALID_BEYOND_PREFIX: (Arg("loaded"), Arg("invalid_tokens"), Arg("reusable")),
    validity.INVALID_MISALIGNED: (Arg("loaded"), Arg("offered"), Arg("prompt_tokens")),
    validity.INVALID_TOKENS: (Arg("loaded"),),
    validity.INVALID_TAINTED: (Arg("taint_read"), Arg("taint_via"), Arg("taint_source")),
}

# The table: the first rule whose conditions all hold decides the turn.
TABLE: tuple[Rule, ...] = (
    # Loaded KV that does not match the prompt, first: a request with no conversation id, or a
    # first turn, can still hit prefill's prefix cache on KV an invalid load left there.
    *(Rule(outcomes.REUSED_INVALID, (_c("invalid_kind", EQ, kind),),
           outcomes.EVIDENCE_INVALID[kind], args) for kind, args in _INVALID_ARGS.items()),
    Rule(outcomes.NO_CONVERSATION_ID,
         (_c("router_lookup", EQ, semconv.ROUTER_NO_CONVERSATION_ID),),
         outcomes.EVIDENCE_NO_CONVERSATION_ID),
    Rule(outcomes.FIRST_TURN, (_c("turn_index", LE, 1),), outcomes.EVIDENCE_FIRST_TURN),
    Rule(outcomes.UNKNOWN, (_c("client_only", EQ, True),), outcomes.EVIDENCE_CLIENT_ONLY),
    # Engine spans alone (no proxy span): what needs the conversation (was there an earlier
    # turn, did the router keep decode's params) is not known; engine facts still decide.
    Rule(outcomes.UNKNOWN, (_c("engine_only", EQ, True), _c("engine_seen", NE, True)),
         outcomes.EVIDENCE_ENGINE_ONLY_NO_DECISION),
    Rule(outcomes.UNKNOWN,
         (_c("engine_only", EQ, True), _c("decision", EQ, semconv.DECISION_NO_OFFER)),
         outcomes.EVIDENCE_ENGINE_ONLY_NO_OFFER),
    # KV pulled from decode and reused (valid: the rules above did not fire) is never a miss.
    Rule(outcomes.REUSED_REMOTE, (*_FULL, _c("remote", GT, 0)), outcomes.EVIDENCE_REUSED_REMOTE,
         (Arg("remote"), Arg("local"))),
    Rule(outcomes.PARTIAL, (_c("remote", GT, 0),), outcomes.EVIDENCE_PARTIAL,
         (Arg("reused"), Arg("reusable"))),
    *_upstream((_EDITED,), _ALSO_EDITED),
    Rule(outcomes.PREFIX_DIVERGED, (_EDITED, _c("reuse_guard", EQ, GUARD_EDITED)),
         outcomes.EVIDENCE_EDITED + "; the proxy's reuse guard sent MISS params"),
    Rule(outcomes.PREFIX_DIVERGED, (_EDITED,),
         outcomes.EVIDENCE_EDITED + " (message-boundary hashes)"),
    # The guard hashed every message (the spans keep only the last few): its verdict stands.
    Rule(outcomes.PREFIX_DIVERGED, (_c("reuse_guard", EQ, GUARD_EDITED),),
         outcomes.EVIDENCE_EDITED + "; the proxy's reuse guard sent MISS params"),
    Rule(outcomes.PREFIX_DIVERGED, (_c("common_prefix", EQ, 0), _c("offered", GT, 0)),
         outcomes.EVIDENCE_NO_COMMON_PREFIX),
    Rule(outcomes.UNKNOWN, (_c("common_prefix", EQ, 0),), outcomes.EVIDENCE_NO_COMMON_PREFIX),
    Rule(outcomes.REUSED_LOCAL, _FULL, outcomes.EVIDENCE_REUSED_LOCAL, (Arg("local"),)),
    *_upstream((), ""),
    Rule(outcomes.UNKNOWN,
         (_c("engine_seen", NE, True), _c("decision_hooks_missing", NOT_NULL)),
         "prefill's reuse decision not observed: " + outcomes.EVIDENCE_HOOKS_MISSING,
         (Arg("decision_hooks_missing"),)),
    Rule(outcomes.UNKNOWN, (_c("engine_seen", NE, True),),
         "no engine hooks: prefill's reuse decision not observed"),
    # A pull whose read no span reports, in a run whose engines could not hook reads.
    Rule(outcomes.UNKNOWN,
         (_c("decision", EQ, semconv.DECISION_PULL), _c("read_status", IS_NULL),
          _c("read_hooks_missing", NOT_NULL)),
         "prefill decided to pull, the D→P read not observed: " + outcomes.EVIDENCE_HOOKS_MISSING,
         (Arg("read_hooks_missing"),)),
    Rule(outcomes.INVALID_PARAMS, (_c("decision", EQ, semconv.DECISION_INVALID_PARAMS),),
         outcomes.EVIDENCE_INVALID_PARAMS),
    Rule(outcomes.ROUTER_NO_ENTRY, (_c("decision", EQ, semconv.DECISION_NO_OFFER),),
         outcomes.EVIDENCE_NO_OFFER),
    Rule(outcomes.PREFILL_BIDIR_DISABLED,
         (_c("bidir", EQ, False), _c("decision", NE, semconv.DECISION_LOCAL_COVERS)),
         outcomes.EVIDENCE_BIDIR_OFF),
    Rule(outcomes.BELOW_THRESHOLD, (_c("decision", EQ, semconv.DECISION_BELOW_THRESHOLD),),
         outcomes.EVIDENCE_BELOW_THRESHOLD, (Arg("below_count"), Arg("threshold"))),
    Rule(outcomes.SCHEDULER_SKIPPED, (_c("decision", EQ, semconv.DECISION_SCHEDULER_SKIPPED),),
         outcomes.EVIDENCE_SCHEDULER_SKIPPED),
    Rule(outcomes.PREEMPTED, (_c("rescheduled", EQ, True),), outcomes.EVIDENCE_PREEMPTED),
    Rule(outcomes.LOAD_FAILED_ERRORED, (*_READ_FAILED, _c("load_errored", EQ, True)),
         outcomes.EVIDENCE_LOAD_FAILED, (Arg("read_status"),)),
    Rule(outcomes.LOAD_STALLED, (*_READ_FAILED, _c("load_reissued", EQ, True)),
         outcomes.EVIDENCE_LOAD_STALLED, (Arg("read_status"),)),
    Rule(outcomes.DECODE_TTL_EXPIRED, (_c("read_status", EQ, semconv.TRANSFER_DECLINED_EXPIRED),),
         outcomes.EVIDENCE_DECLINED),
    Rule(outcomes.HANDSHAKE_FAILED, (_c("read_status", EQ, semconv.TRANSFER_HANDSHAKE_FAILED),),
         outcomes.EVIDENCE_HANDSHAKE),
    Rule(outcomes.TRANSFER_FAILED,
         (_c("read_status", EQ, semconv.TRANSFER_FAILED), _c("cause_hooks_missing", NOT_NULL)),
         outcomes.EVIDENCE_TRANSFER + "; why (declined as expired or not) not observed: "
         + outcomes.EVIDENCE_HOOKS_MISSING, (Arg("cause_hooks_missing"),)),
    Rule(outcomes.TRANSFER_FAILED, (_c("read_status", EQ, semconv.TRANSFER_FAILED),),
         outcomes.EVIDENCE_TRANSFER),
    Rule(outcomes.UNKNOWN, (_c("reusable", IS_NULL),),
         "reusable tokens not measured (no boundary hashes and no offer)"),
    Rule(outcomes.PARTIAL, (_c("reused", GT, 0),), outcomes.EVIDENCE_PARTIAL,
         (Arg("reused"), Arg("reusable"))),
)
# When no rule holds.
FALLBACK = Rule(outcomes.UNKNOWN, (), outcomes.EVIDENCE_UNEXPLAINED)


def coverable(reusable: int | None, offered: int | None, local: int | None) -> int | None:
    """What full reuse must cover: ``min(reusable, max(offered, local))`` when decode offered
    (a read takes at most what decode holds), else the reusable span."""
    if reusable is None:
        return None
    if offered:
        return min(reusable, max(offered, local or 0))
    return reusable


def coverable_expr(reusable: pl.Expr, offered: pl.Expr, local: pl.Expr) -> pl.Expr:
    """:func:`coverable` over columns (null offers read as none)."""
    import polars as pl

    return pl.when(offered.fill_null(0) > 0).then(
        pl.min_horizontal(reusable, pl.max_horizontal(offered, local.fill_null(0)))
    ).otherwise(reusable).cast(pl.Int64)


# --- scalar evaluator ---------------------------------------------------------------------------

_COMPARE: dict[str, Callable[[Any, Any], Any]] = {
    EQ: operator.eq, NE: operator.ne, IN: lambda value, other: value in other,
    GT: operator.gt, GE: operator.ge, LE: operator.le,
}


def _predicate(cond: Cond) -> Callable[[Mapping[str, Any]], bool]:
    """``cond`` as a test of a turn's facts, built once per condition (the simulator decides
    every turn: reading the operator per turn was most of the table's cost)."""
    fact = cond.fact
    if cond.op == IS_NULL:
        return lambda facts: facts.get(fact) is None
    if cond.op == NOT_NULL:
        return lambda facts: facts.get(fact) is not None
    compare = _COMPARE.get(cond.op)
    if compare is None:
        raise ValueError(f"decision table: unknown operator {cond.op!r} on fact {fact!r}")
    if isinstance(cond.value, Ref):
        ref = cond.value.fact

        def holds_ref(facts: Mapping[str, Any]) -> bool:
            value, other = facts.get(fact), facts.get(ref)
            return value is not None and other is not None and bool(compare(value, other))
        return holds_ref
    other = cond.value
    if other is None:
        return lambda facts: False

    def holds(facts: Mapping[str, Any]) -> bool:
        value = facts.get(fact)
        return value is not None and bool(compare(value, other))
    return holds


def _text(value: Any) -> str:
    # As polars' format renders a value: null as "null", booleans lower case.
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _arg(arg: Arg, facts: Mapping[str, Any]) -> str:
    value = facts.get(arg.fact)
    if arg.digits is not None and value is not None:
        value = round(float(value), arg.digits)
    return _text(value)


# The table with each condition built into its test once (what the scalar evaluator runs).
_COMPILED = tuple((rule, tuple(_predicate(cond) for cond in rule.when)) for rule in TABLE)


def first_rule(facts: Mapping[str, Any]) -> Rule:
    """The rule that decides a turn with these facts (missing facts read as null)."""
    unknown = facts.keys() - FACTS.keys()
    if unknown:
        raise ValueError(f"decision table: unknown facts {sorted(unknown)}")
    for rule, tests in _COMPILED:
        for test in tests:
            if not test(facts):
                break
        else:
            return rule
    return FALLBACK


def decide(facts: Mapping[str, Any]) -> tuple[str, str]:
    """``(outcome, evidence)`` for one turn's scalar facts."""
    rule = first_rule(facts)
    return rule.outcome, rule.evidence.format(*(_arg(a, facts) for a in rule.args))


# --- polars rendering ---------------------------------------------------------------------------

def _expr(cond: Cond, col: Mapping[str, pl.Expr]) -> pl.Expr:
    import polars as pl

    value = col[cond.fact]
    if cond.op == IS_NULL:
        return value.is_null()
    if cond.op == NOT_NULL:
        return value.is_not_null()
    other: Any = col[cond.value.fact] if isinstance(cond.value, Ref) else pl.lit(cond.value)
    if cond.op == EQ:
        out = value == other
    elif cond.op == NE:
        out = value != other
    elif cond.op == IN:
        out = value.is_in(list(cond.value))
    elif cond.op == GT:
        out = value > other
    elif cond.op == GE:
        out = value >= other
    elif cond.op == LE:
        out = value <= other
    else:
        raise ValueError(f"decision table: unknown operator {cond.op!r} on fact {cond.fact!r}")
    return out.fill_null(False)


def _evidence(rule: Rule, col: Mapping[str, pl.Expr]) -> pl.Expr:
    import polars as pl

    if not rule.args:
        return pl.lit(rule.evidence)
    args = []
    for arg in rule.args:
        value = col[arg.fact]
        if arg.digits is not None:
            value = value.cast(pl.Float64).round(arg.digits)
        args.append(value.cast(pl.String).fill_null("null"))
    return pl.format(rule.evidence, *args)


def polars_exprs(columns: Mapping[str, pl.Expr] | None = None) -> tuple[pl.Expr, pl.Expr]:
    """``(outcome, evidence)`` expressions: the table over fact columns.

    ``columns`` maps a fact to the expression that holds it; a fact not named is read from the
    column of its own name.
    """
    import polars as pl

    col = {name: pl.col(name) for name in FACTS} | dict(columns or {})
    label: pl.Expr = pl.lit(FALLBACK.outcome)
    evidence: pl.Expr = pl.lit(FALLBACK.evidence)
    for rule in reversed(TABLE):
        holds = pl.lit(True)
        for cond in rule.when:
            holds = holds & _expr(cond, col)
        label = pl.when(holds).then(pl.lit(rule.outcome)).otherwise(label)
        evidence = pl.when(holds).then(_evidence(rule, col)).otherwise(evidence)
    return label, evidence


__all__ = ["Arg", "Cond", "EQ", "FACTS", "FALLBACK", "GE", "GT", "HISTORY_CONTINUES",
    "HISTORY_EDITED", "HISTORY_FIRST", "HISTORY_UNKNOWN", "IN", "IS_NULL", "LE", "NE", "NOT_NULL",
    "PREV_NONE", "PREV_NO_DECODE", "PREV_RETURNED", "Ref", "Rule", "TABLE", "coverable",
    "coverable_expr", "decide", "first_rule", "polars_exprs"]

"""The ground truth of an HTTP emulation: the true outcome and token split of every turn.

The emulated servers never see a conversation id (the proxy strips it), so turns are keyed by the
``X-Request-Id`` the proxy sends to both legs, and the previous turn is found the way the
conversation id finds it (docs/architecture.md, "One vocabulary"): when prefill got decode's
params, the turn those params came from (``remote_request_id``), whatever the prompt holds — an
edited, truncated or foreign history included; ``reusable_tokens`` is then the prompt's common
prefix with that turn's prompt + output. Without an offer it is found by content: a process-wide
:class:`SequenceOracle` indexes every sequence decode finished by its chained block hashes, and
the match is the longest finished sequence the prompt *contains* entirely. A prompt with neither
is turn 1 — also when it only shares a prefix (a system prompt shared across conversations, a
context reset whose router entry was gone); the virtual-time simulator
(``kvscope.emulator.simulator``), which also plays the proxy, has exact truth for those.

Labels come from :func:`account_turn` (here, for the simulator too): the facts of what the
emulated nodes did (:func:`turn_facts`), read by the one decision table
(:data:`kvscope.reuse.decisions.TABLE`). The router's facts (its
lookup, the entry's age, the reuse guard's verdict) are recorded when kvscope's proxy runs in the
emulation's process (:class:`~kvscope.emulator.launcher.EmulatedCluster` with ``proxy=True``
passes :meth:`TruthRecorder.routed` to it), so ``no_conversation_id`` and a router miss, stale
or consumed entry are labelled as the table labels them. With a proxy elsewhere the servers never
see the lookup: such a turn is recorded as what prefill saw — no offer, ``router_no_entry`` with
evidence "prefill got no offer" — and only the ledger can tell the causes apart.
``no_decode_metadata`` is exact: the oracle remembers whether decode's params for turn k-1
reached the wire.

Rows are JSON lines (``<db>.truth.jsonl`` or ``--truth PATH``), written when a turn completes
(decode finished, or prefill failed so no decode leg follows). No text, only counts and ids.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, TypedDict, Unpack

from kvscope import semconv
from kvscope.emulator import reuse_model
from kvscope.emulator.tokens import BlockSeq, common_prefix_len
from kvscope.reuse import decisions
from kvscope.reuse.taint import Taint, TaintTracker, TaintTurn
from kvscope.reuse.validity import INVALID_BEYOND_PREFIX, INVALID_TAINTED, invalid_tokens


# Per turn: not frozen (see docs/architecture.md, "Value classes on hot paths").
@dataclass(slots=True)
class TurnAccounting:
    """Ground truth for one turn: the token split (DESIGN §5) and its outcome label."""

    reusable_tokens: int
    local_hit_tokens: int
    remote_reused_tokens: int
    recomputed_reusable_tokens: int
    outcome: str
    evidence: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # What happened, as the decision table's facts (kvscope.reuse.decisions.FACTS).
    facts: dict[str, Any] = field(default_factory=dict)

    def split(self) -> TurnSplit:
        """The token split and the outcome, as a truth row's keywords."""
        return TurnSplit(reusable_tokens=self.reusable_tokens,
                         local_hit_tokens=self.local_hit_tokens,
                         remote_reused_tokens=self.remote_reused_tokens,
                         recomputed_reusable_tokens=self.recomputed_reusable_tokens,
                         outcome=self.outcome)


class TurnSplit(TypedDict):
    """A turn's token split and outcome (:meth:`TurnAccounting.split`)."""

    reusable_tokens: int
    local_hit_tokens: int
    remote_reused_tokens: int
    recomputed_reusable_tokens: int
    outcome: str


class TurnContext(TypedDict, total=False):
    """What the proxy and the client did around a turn (:func:`turn_facts`' keywords)."""

    router_lookup: str | None
    decode_returned_params: bool
    router_entry_age_s: float | None
    history_edited: bool
    reuse_guard: str | None


def account_turn(
    turn_index: int,
    reusable_tokens: int,
    result: reuse_model.PrefillResult | None,
    **context: Unpack[TurnContext],
) -> TurnAccounting:
    """Split turn ``turn_index``'s reusable tokens and label it: the facts of what happened,
    read by the one decision table (:data:`kvscope.reuse.decisions.TABLE`).

    ``reusable_tokens`` is the common prefix of the prompt with decode's sequence, capped at the
    tokens decode holds KV for. ``history_edited``: the messages do not extend the previous
    turn's (edited, reset). ``facts`` are the table's facts; ``extra`` carries, when a read
    loaded KV that does not match the prompt, ``invalid_tokens`` and ``invalid_kind``
    (:mod:`kvscope.reuse.validity`).
    """
    facts = turn_facts(turn_index, reusable_tokens, result, **context)
    outcome, evidence = decisions.decide(facts)
    if turn_index <= 1:
        accounting = TurnAccounting(0, 0, 0, 0, outcome, evidence)
    else:
        accounting = TurnAccounting(
            facts["reusable"], facts["local"], facts["remote"],
            facts["reusable"] - facts["local"] - facts["remote"], outcome, evidence)
    accounting.facts = facts
    if facts.get("invalid_tokens"):
        accounting.extra = {"invalid_tokens": facts["invalid_tokens"],
                            "invalid_kind": facts["invalid_kind"]}
    return accounting


def turn_facts(
    turn_index: int,
    reusable_tokens: int,
    result: reuse_model.PrefillResult | None,
    *,
    router_lookup: str | None = semconv.ROUTER_HIT,
    decode_returned_params: bool = True,
    router_entry_age_s: float | None = None,
    history_edited: bool = False,
    reuse_guard: str | None = None,
) -> dict[str, Any]:
    """What happened to one turn, as the decision table's facts (the emulator knows them all)."""
    facts: dict[str, Any] = {
        "turn_index": turn_index, "router_lookup": router_lookup,
        "router_entry_age_s": router_entry_age_s, "reuse_guard": reuse_guard,
        "client_only": False,
        "prev_params": decisions.PREV_RETURNED if decode_returned_params else decisions.PREV_NONE,
        "engine_seen": result is not None,
    }
    if turn_index <= 1:
        return facts | {"history": decisions.HISTORY_FIRST}
    reusable = max(reusable_tokens, 0)
    facts["history"] = decisions.HISTORY_EDITED if history_edited else (
        decisions.HISTORY_CONTINUES)
    facts["common_prefix"] = reusable
    ran = result is not None and not (result.errored or result.stalled)
    invalid, kind, loaded = 0, None, 0
    if ran and result is not None and result.transfer is not None and result.transfer.tokens:
        decision = result.decision
        loaded = result.transfer.tokens
        invalid, kind = invalid_tokens(
            decision.local_hit_tokens, loaded, decision.remote_offered_tokens, reusable,
            decision.block_size, after_release=result.transfer.stale_handle,
        )
    local = remote = 0
    if ran and result is not None:
        local = min(result.local_hit_tokens, reusable)
        if result.remote_reused_tokens and kind in (None, INVALID_BEYOND_PREFIX):
            reach = result.local_hit_tokens + result.remote_reused_tokens
            remote = max(min(reach, reusable) - local, 0)
    facts |= {"reusable": reusable, "local": local, "remote": remote,
              "reused": local + remote, "loaded": loaded,
              "invalid_kind": kind if invalid > 0 else None, "invalid_tokens": invalid}
    if result is None:
        facts["coverable"] = reusable
        return facts
    decision = result.decision
    transfer = result.transfer
    offered = decision.remote_offered_tokens
    facts |= {
        "decision": decision.decision, "bidir": decision.bidirectional_kv_xfer,
        "offered": offered, "below_count": decision.count, "threshold": decision.threshold,
        "prompt_tokens": decision.prompt_tokens, "rescheduled": result.preempted,
        "read_status": (transfer.status if transfer is not None and result.load_failed
                        else semconv.TRANSFER_OK if transfer is not None else None),
        "load_errored": result.load_failed and result.errored,
        "load_reissued": result.load_failed and result.stalled,
        "coverable": decisions.coverable(reusable, offered, local),
    }
    return facts


def taint_turn(
    key: int,
    facts: dict[str, Any],
    result: reuse_model.PrefillResult | None,
    *,
    x_request_id: str,
    previous: str | None,
    engine: str | None,
    prompt_key: str | None,
    retention_id: str | None,
    decode_request_id: str | None = None,
    arrival_ns: int = 0,
    prefilled_ns: int = 0,
) -> TaintTurn:
    """What :mod:`kvscope.reuse.taint` reads of a labelled turn: the nodes' own counts (the
    hit, the tokens a finished read loaded) and its facts (its own invalid load)."""
    ran = result is not None and not (result.errored or result.stalled)
    local = decided = pulled = 0
    if ran and result is not None:
        local = result.local_hit_tokens
        decided = result.decision.local_hit_tokens if result.decision is not None else local
        if facts.get("read_status") == semconv.TRANSFER_OK:
            pulled = facts.get("loaded") or 0
    kind = facts.get("invalid_kind")
    clean = max(facts.get("reusable") or 0, decided) if kind == INVALID_BEYOND_PREFIX else decided
    return TaintTurn(
        key=key, x_request_id=x_request_id, previous=previous, arrival_ns=arrival_ns,
        prefilled_ns=prefilled_ns, prefill_engine=engine, prompt_hash=prompt_key,
        decode_request_id=decode_request_id, retention_id=retention_id, local_hit=local,
        pulled=pulled, continues=facts.get("history") == decisions.HISTORY_CONTINUES,
        own_invalid=kind is not None, clean_tokens=clean)


def label_tainted(facts: dict[str, Any], taint: Taint) -> tuple[str, str]:
    """A turn that read KV an invalid load computed: its facts say so, the table labels it."""
    facts |= {"invalid_kind": INVALID_TAINTED, "invalid_tokens": taint.tokens,
              "taint_read": taint.read, "taint_via": taint.via, "taint_source": taint.source}
    return decisions.decide(facts)


@dataclass
class FinishedSequence:
    """A sequence decode finished: what the next turn of its conversation may reuse."""

    seq: BlockSeq
    turn_index: int
    x_request_id: str
    decode_request_id: str
    params_on_wire: bool
    # Tokens decode holds KV for (remote_num_tokens at request_finished: one less than the
    # sequence after a length-capped turn or under the synchronous scheduler); None: all.
    held_tokens: int | None = None

    def reusable(self, common_prefix: int) -> int:
        """The reusable tokens of a prompt sharing ``common_prefix`` tokens with this sequence:
        the ledger's definition, capped at what decode holds KV for."""
        return common_prefix if self.held_tokens is None else min(common_prefix,
                                                                  self.held_tokens)


@dataclass(frozen=True)
class Match:
    """The previous turn a prompt continues, if any, and the tokens it shares with it."""

    previous: FinishedSequence | None
    reusable_tokens: int
    shared_prefix_tokens: int


class SequenceOracle:
    """Finds the finished sequence a prompt continues, by chained block hash."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._hashes: set[int] = set()
        self.by_decode_request: dict[str, FinishedSequence] = {}
        # Last full-block hash of a finished sequence → the latest such sequence.
        self._ends: dict[int, FinishedSequence] = {}

    def add(self, finished: FinishedSequence) -> None:
        """Index a sequence decode finished."""
        self.by_decode_request[finished.decode_request_id] = finished
        if not finished.seq.block_hashes:
            return
        self._hashes.update(finished.seq.block_hashes)
        self._ends[finished.seq.block_hashes[-1]] = finished

    def match(self, prompt: BlockSeq, prompt_ids: Sequence[int]) -> Match:
        """The longest finished sequence ``prompt`` contains entirely (prompt + output)."""
        hashes = self._hashes
        blocks = prompt.block_hashes
        # Chained hashes: "block i is known" implies "every block before i is known".
        lo, hi = 0, len(blocks)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if blocks[mid - 1] in hashes:
                lo = mid
            else:
                hi = mid - 1
        shared = lo * self.block_size
        bs = self.block_size
        for m in range(lo, 0, -1):
            candidate = self._ends.get(blocks[m - 1])
            if candidate is None or candidate.seq.num_blocks != m:
                continue
            tail = candidate.seq.tail
            if common_prefix_len(tail, prompt_ids[m * bs : m * bs + len(tail)]) == len(tail):
                return Match(candidate, candidate.reusable(candidate.seq.num_tokens), shared)
        return Match(None, 0, shared)


def common_prefix_tokens(finished: FinishedSequence, prompt: BlockSeq,
                         prompt_ids: Sequence[int]) -> int:
    """Tokens ``prompt`` shares with a finished sequence from its start.

    Exact through the shared full blocks, and through the finished sequence's partial last block
    (its tokens are kept); inside a full block that differs, counted to the block's start (the
    oracle keeps hashes, not tokens).
    """
    seq = finished.seq
    bs = seq.block_size
    blocks = seq.common_prefix_blocks(prompt)
    if blocks < seq.num_blocks:
        return blocks * bs
    tail = seq.tail
    start = blocks * bs
    return start + common_prefix_len(tail, prompt_ids[start : start + len(tail)])


@dataclass(frozen=True)
class Route:
    """What kvscope's proxy router did for one turn (None: not seen, the proxy ran elsewhere)."""

    lookup: str | None = None
    entry_age_s: float | None = None
    reuse_guard: str | None = None
    # The decode request whose params the router's entry held (before the guard judged them).
    entry_request_id: str | None = None


_NOT_ROUTED = Route()
# Routes kept for turns whose prefill has not been seen yet (a turn that never reaches prefill
# leaves its route behind; the oldest goes first).
_MAX_ROUTES = 65_536


@dataclass
class TruthRow:
    """One turn's ground truth (DESIGN §5 fields, plus what the emulator did)."""

    run_id: str
    x_request_id: str
    vllm_request_id: str | None = None
    decode_request_id: str | None = None
    prefill_engine: str | None = None
    decode_engine: str | None = None
    turn_index: int = 1
    previous_x_request_id: str | None = None
    reusable_tokens: int = 0
    local_hit_tokens: int = 0
    remote_reused_tokens: int = 0
    recomputed_reusable_tokens: int = 0
    outcome: str = ""
    evidence: str = ""
    decision: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    transfer_status: str | None = None
    transfer_bytes: int = 0
    transfer_blocks: int = 0
    p_to_d_bytes: int = 0
    retention_request_id: str | None = None
    retention_bytes: int = 0
    params_returned: bool = False
    finish_status: str | None = None
    error: str | None = None
    faults: list[str] = field(default_factory=list)
    # Wall ms the prefill server spent on the request before answering (admission, D->P read,
    # compute): the part of a proxy's "Prefill done in N ms" that is the engine's.
    prefill_server_ms: float | None = None
    # The proxy's router lookup (semconv.ROUTER_*), when the proxy ran in the emulation.
    router_lookup: str | None = None
    # What happened, as the decision table's facts (the outcome is the table's reading of
    # them); the router's are among them only when the proxy ran in the emulation.
    facts: dict[str, Any] = field(default_factory=dict)


class TruthRecorder:
    """Collects :class:`TruthRow` per turn and appends each to a JSONL file when it completes."""

    def __init__(self, path: str | Path | None, run_id: str, block_size: int) -> None:
        self.run_id = run_id
        self.oracle = SequenceOracle(block_size)
        self.rows: list[TruthRow] = []
        self._pending: dict[str, TruthRow] = {}
        # KV computed from invalid loads, followed turn by turn (prefill serialises per engine:
        # the order prefill_done is called in is the order each engine computed).
        self._taint = TaintTracker()
        # X-Request-Id -> the router's facts for it, from routed() until its prefill is seen.
        self._routes: dict[str, Route] = {}
        self.path = Path(path) if path is not None else None
        self._sink: IO[str] | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._sink = self.path.open("a", encoding="utf-8")

    def routed(self, x_request_id: str, route: Route) -> None:
        """Record what kvscope's proxy router did for a turn, before its prefill is called."""
        if len(self._routes) >= _MAX_ROUTES:  # turns that never reached prefill
            self._routes.pop(next(iter(self._routes)))
        self._routes[x_request_id] = route

    def prefill_done(
        self,
        x_request_id: str,
        vllm_request_id: str,
        engine: str,
        prompt: BlockSeq,
        prompt_ids: Sequence[int],
        result: reuse_model.PrefillResult,
        faults: Sequence[str],
        error: str | None,
        offered_request_id: str | None = None,
    ) -> TruthRow:
        """Label the turn at prefill: previous turn, reusable tokens and outcome."""
        match = self.oracle.match(prompt, prompt_ids)
        route = self._routes.pop(x_request_id, _NOT_ROUTED)
        # The router's entry names the previous turn, also when the guard kept it from prefill.
        offered = self.oracle.by_decode_request.get(offered_request_id or route.entry_request_id
                                                    or "")
        if offered is not None and offered is not match.previous:
            # The router's entry names the previous turn, whatever the prompt holds.
            match = Match(offered, offered.reusable(common_prefix_tokens(offered, prompt,
                                                                         prompt_ids)),
                          match.shared_prefix_tokens)
        previous = match.previous
        turn_index = previous.turn_index + 1 if previous is not None else 1
        # The prompt continues the previous turn when it holds decode's whole sequence (the
        # reply as decode generated it); an edited history or reply, a truncation or a foreign
        # prompt under the offer's id does not.
        edited = previous is not None and previous is offered and common_prefix_tokens(
            previous, prompt, prompt_ids) < previous.seq.num_tokens
        accounting = account_turn(
            turn_index,
            match.reusable_tokens,
            result,
            router_lookup=route.lookup,
            router_entry_age_s=route.entry_age_s,
            reuse_guard=route.reuse_guard,
            decode_returned_params=previous.params_on_wire if previous is not None else True,
            history_edited=edited,
        )
        transfer = result.transfer
        taint_in = taint_turn(
            0, accounting.facts, result, x_request_id=x_request_id,
            previous=previous.x_request_id if previous is not None else None, engine=engine,
            prompt_key=_prompt_key(prompt),
            retention_id=offered_request_id or route.entry_request_id)
        taint = self._taint.read(taint_in)
        self._taint.record(taint_in, taint)
        if taint is not None and not taint_in.own_invalid:
            accounting.outcome, accounting.evidence = label_tainted(accounting.facts, taint)
            accounting.extra = {"invalid_tokens": taint.tokens, "invalid_kind": INVALID_TAINTED}
        evidence = accounting.evidence
        if previous is None and match.shared_prefix_tokens:
            evidence += f"; shares {match.shared_prefix_tokens} tokens with no whole earlier turn"
        row = TruthRow(
            run_id=self.run_id,
            x_request_id=x_request_id,
            vllm_request_id=vllm_request_id,
            prefill_engine=engine,
            turn_index=turn_index,
            previous_x_request_id=previous.x_request_id if previous is not None else None,
            **accounting.split(),
            evidence=evidence,
            decision=result.decision.decision,
            prompt_tokens=prompt.num_tokens,
            transfer_status=transfer.status if transfer is not None else None,
            transfer_bytes=transfer.bytes if transfer is not None else 0,
            transfer_blocks=transfer.blocks if transfer is not None else 0,
            error=error,
            faults=sorted(faults),
            router_lookup=route.lookup,
            facts=accounting.facts,
        )
        if error is not None:
            self._write(row)
        else:
            self._pending[x_request_id] = row
        return row

    def decode_done(
        self,
        x_request_id: str,
        decode_request_id: str,
        engine: str,
        sequence: BlockSeq,
        prompt_tokens: int,
        output_tokens: int,
        finish_status: str,
        retention: reuse_model.Retention | None,
        params_on_wire: bool,
        p_to_d_bytes: int,
        faults: Sequence[str],
        prompt: BlockSeq | None = None,
        prompt_ids: Sequence[int] = (),
        held_tokens: int | None = None,
    ) -> TruthRow:
        """Complete the turn at decode's finish and index its sequence for the next turn."""
        row = self._pending.pop(x_request_id, None)
        if row is None:
            # No prefill leg seen (decode called directly): place the turn by content here.
            match = (
                self.oracle.match(prompt, prompt_ids) if prompt is not None else Match(None, 0, 0)
            )
            previous = match.previous
            turn_index = previous.turn_index + 1 if previous is not None else 1
            # The table's label for a turn whose prefill was never seen; the evidence says so.
            outcome, _ = decisions.decide({"turn_index": turn_index, "engine_seen": False})
            row = TruthRow(
                run_id=self.run_id,
                x_request_id=x_request_id,
                turn_index=turn_index,
                previous_x_request_id=previous.x_request_id if previous is not None else None,
                reusable_tokens=match.reusable_tokens,
                recomputed_reusable_tokens=match.reusable_tokens,
                outcome=outcome,
                evidence="no prefill leg seen for this request",
                prompt_tokens=prompt_tokens,
            )
        row.decode_request_id = decode_request_id
        self._taint.decoded(x_request_id, decode_request_id)
        row.decode_engine = engine
        row.output_tokens = output_tokens
        row.finish_status = finish_status
        row.p_to_d_bytes = p_to_d_bytes
        row.params_returned = params_on_wire
        row.faults = sorted(set(row.faults) | set(faults))
        if retention is not None:
            row.retention_request_id = retention.request_id
            row.retention_bytes = retention.bytes
        self.oracle.add(
            FinishedSequence(sequence, row.turn_index, x_request_id, decode_request_id,
                             params_on_wire, held_tokens)
        )
        self._write(row)
        return row

    def close(self) -> None:
        """Write turns whose decode leg never came, then close the file."""
        for row in list(self._pending.values()):
            row.error = row.error or "no decode leg"
            self._write(row)
        self._pending.clear()
        self._routes.clear()
        if self._sink is not None:
            self._sink.close()
            self._sink = None

    def _write(self, row: TruthRow) -> None:
        self.rows.append(row)
        if self._sink is not None:
            self._sink.write(json.dumps(asdict(row), sort_keys=True) + "\n")
            self._sink.flush()


def _prompt_key(prompt: BlockSeq) -> str:
    """A prompt's identity: its chained hashes end in one that names every full block, then
    the partial block's tokens."""
    last = prompt.block_hashes[-1] if prompt.block_hashes else 0
    return f"{last}:{prompt.num_tokens}:{hash(prompt.tail)}"


def read_truth(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a truth file, as dicts."""
    with Path(path).open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


__all__ = ["FinishedSequence", "Match", "Route", "SequenceOracle", "TruthRecorder", "TruthRow",
    "TurnAccounting", "TurnContext", "TurnSplit", "account_turn", "common_prefix_tokens",
    "label_tainted", "read_truth", "taint_turn", "turn_facts"]

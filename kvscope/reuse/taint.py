"""KV computed from an invalid load: where it goes next, and which later turns read it.

A turn that loads KV that does not match its prompt (:mod:`kvscope.reuse.validity`) does not
only answer wrongly itself. Prefill computes the rest of the prompt attending to that KV and
caches every full block of it under the *prompt's* block hashes; decode receives those blocks
(P→D) and retains them with its reply. From the first position that does not match (the turn's
*dirty start*) on, that KV is what the prompt's tokens would never produce. vLLM keys both
caches by tokens (and decode's by conversation), never by content, so two later reads take it:

* **prefill's prefix cache**: a later request on the same prefill whose prompt starts with the
  turn's tokens hits those blocks locally (the next turn of the same conversation does; so
  does any request with the same prompt, with or without a conversation id);
* **decode's retained KV**: the next turn, offered the turn's decode request, pulls them.

Both make the reader *tainted* from the same dirty start: its local hit or its read reaching
past that start loaded KV that does not match its prompt, however valid the read was by
itself. Observed on real vLLM (tests/vllm_real/test_history.py): the output then differs from a
plain server's.

What spans cannot show, so a tainted turn may be a false alarm: prefill evicting the dirty
blocks before the later hit (a later correct computation of the same tokens is cached anew),
and a restart of the engine under the same name. Only identical prompts and continuations of
the same conversation are linked through prefill's cache: a prompt that extends another
conversation's prompt is not (message-boundary hashes of other conversations are not joined).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# How the tainted KV reached the turn (the evidence names it).
VIA_PREFIX_CACHE = "prefill's prefix cache"
VIA_DECODE = "decode's retained KV"


@dataclass(frozen=True, slots=True)
class TaintTurn:
    """What the rule reads of one turn. ``key`` is the caller's (a row number)."""

    key: int
    x_request_id: str | None
    # The turn it follows: the one whose decode KV it was offered, else its conversation's
    # turn k-1 (an X-Request-Id; None for a first turn or no conversation).
    previous: str | None
    arrival_ns: int
    # When prefill had computed (and cached) the prompt: its leg's end, else the arrival.
    prefilled_ns: int
    prefill_engine: str | None
    # The prompt's identity: the chained hash of all its messages (with the hash key's id).
    prompt_hash: str | None
    decode_request_id: str | None
    # The decode request whose retained KV prefill was offered (the router's entry).
    retention_id: str | None
    # Prefill's own prefix-cache hit, and the tokens a finished read loaded from decode.
    local_hit: int
    pulled: int
    # The history continues ``previous``'s (its messages, then the reply decode produced).
    continues: bool
    # The turn itself loaded KV that does not match (validity.INVALID_*), and up to where what
    # it holds is the prompt's own.
    own_invalid: bool
    clean_tokens: int
    # Whether ``clean_tokens`` is exact: after an edit the spans give only a lower bound (the
    # local hit), so what follows counts no tainted tokens (null), only the taint.
    clean_exact: bool = True


@dataclass(frozen=True, slots=True)
class Taint:
    """A turn that read tainted KV: the tokens it read that way, how many past the dirty start
    (None: the start is a lower bound), from which request, through what."""

    read: int
    tokens: int | None
    source: str | None
    via: str
    dirty_start: int
    exact: bool


@dataclass(frozen=True, slots=True)
class _Dirty:
    start: int
    exact: bool
    source: str | None
    engine: str | None
    ready_ns: int

    def taint(self, read: int, via: str) -> Taint:
        return Taint(read, read - self.start if self.exact else None, self.source, via,
                     self.start, self.exact)


class TaintTracker:
    """Which turns hold KV computed from an invalid load, as turns come in arrival order."""

    def __init__(self) -> None:
        self._by_decode: dict[str, _Dirty] = {}
        self._by_prompt: dict[tuple[str, str], _Dirty] = {}
        self._by_turn: dict[str, _Dirty] = {}

    def read(self, turn: TaintTurn) -> Taint | None:
        """Whether ``turn``'s read or local hit took KV an earlier dirty turn left."""
        source = self._by_decode.get(turn.retention_id) if turn.retention_id else None
        reach = turn.local_hit + turn.pulled
        if source is not None and turn.pulled > 0 and reach > source.start:
            return source.taint(reach, VIA_DECODE)
        if turn.local_hit <= 0 or not turn.prefill_engine:
            return None
        candidates: list[_Dirty | None] = []
        if turn.continues and turn.previous:
            candidates.append(self._by_turn.get(turn.previous))
        if turn.prompt_hash:
            candidates.append(self._by_prompt.get((turn.prefill_engine, turn.prompt_hash)))
        for dirty in candidates:
            if (dirty is not None and dirty.engine == turn.prefill_engine
                    and dirty.ready_ns <= turn.arrival_ns and turn.local_hit > dirty.start):
                return dirty.taint(turn.local_hit, VIA_PREFIX_CACHE)
        return None

    def record(self, turn: TaintTurn, taint: Taint | None) -> bool:
        """Keep ``turn`` as a source when it holds dirty KV (its own invalid load or ``taint``);
        whether it does."""
        if taint is None and not turn.own_invalid:
            return False
        start, exact = turn.clean_tokens, turn.clean_exact
        if taint is not None and (not turn.own_invalid or taint.dirty_start < start):
            start, exact = taint.dirty_start, taint.exact
        dirty = _Dirty(start, exact, turn.x_request_id, turn.prefill_engine, turn.prefilled_ns)
        if turn.x_request_id:
            self._by_turn[turn.x_request_id] = dirty
        if turn.prefill_engine and turn.prompt_hash:
            self._by_prompt[(turn.prefill_engine, turn.prompt_hash)] = dirty
        if turn.decode_request_id:
            self._by_decode[turn.decode_request_id] = dirty
        return True

    def decoded(self, x_request_id: str, decode_request_id: str) -> None:
        """Decode retained a dirty turn's KV under ``decode_request_id`` (known only once decode
        finished, after :meth:`record`)."""
        dirty = self._by_turn.get(x_request_id)
        if dirty is not None:
            self._by_decode[decode_request_id] = dirty


def propagate(turns: Iterable[TaintTurn]) -> dict[int, Taint]:
    """The turns (by ``key``) that read KV computed from an invalid load, directly or through a
    chain of them. ``turns`` in arrival order; a turn's own invalid load is not a taint (its
    kind says why), but it makes the turn a source."""
    tracker = TaintTracker()
    found: dict[int, Taint] = {}
    for turn in turns:
        taint = tracker.read(turn)
        tracker.record(turn, taint)
        if taint is not None and not turn.own_invalid:
            found[turn.key] = taint
    return found


__all__ = ["Taint", "TaintTracker", "TaintTurn", "VIA_DECODE", "VIA_PREFIX_CACHE", "propagate"]

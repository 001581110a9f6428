"""Seeded generator of Mooncake-format traces shaped like the FAST'25 conversation trace.

It writes what the real trace holds and keeps what the real trace does not say: which session
each request belongs to. Shape, as in the real trace:

- **chained ids** numbered in order of first appearance: a block's id stands for its content and
  everything before it, so equal ids at one position mean an equal prefix;
- one id per 512-token block of the prompt **including the last, partial one**, whose id changes
  when the next turn fills it (the previous answer and new text follow);
- **one shared system prompt** of 512-1023 tokens: every prompt starts with block id 0, and the
  block holding the system prompt's end and the first message is the session's own (in the
  real trace, every row starts with id 0 and no first turn shares its second id);
- a follow-up re-sends the previous prompt and answer and adds one message: mostly a short
  reply (real median: 21 new tokens), sometimes a pasted document (thousands);
- output lengths mostly a few hundred tokens, capped at 2,000, with a tail of very short ones;
- ``timestamp`` in ms, **quantised** to 3 s, rows in send order; some 3 s ticks are written
  1 ms early (``5999``, ``41999``: float truncation in the real trace).

The defaults come from the first 328 rows of the real trace
(``tests/emulator/data/mooncake_conversation_trace_head.jsonl``; the test there compares the
two): first-turn prompts p50 8.8k tokens (a fifth of them under 2k), outputs p50 387, 7 of 39
ticks 1 ms early.

Same config (seed included) ⇒ identical trace.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvscope.emulator.workloads.model import WorkloadError

TRACE_BLOCK_SIZE = 512


@dataclass(frozen=True)
class TraceConfig:
    """Knobs of the generated trace; sizes in tokens, times in seconds."""

    sessions: int = 300
    seed: int = 0
    arrival_rate_per_s: float = 0.5
    # One of these system prompts starts each session (picked uniformly). The real trace has
    # one, between 512 and ~890 tokens (its shortest prompt is 892 tokens, two blocks).
    system_prompt_tokens: tuple[int, ...] = (880,)
    first_message_p50: int = 9_000
    first_message_sigma: float = 0.85
    # A first turn is a short question (not a document) with this probability.
    first_question_probability: float = 0.2
    first_question_p50: int = 150
    first_question_sigma: float = 1.2
    # A follow-up adds a short reply, or with this probability a document.
    follow_up_message_p50: int = 10
    follow_up_message_sigma: float = 0.6
    follow_up_document_probability: float = 0.4
    follow_up_document_p50: int = 2_000
    follow_up_document_sigma: float = 1.3
    max_message_tokens: int = 120_000
    output_p50: int = 400
    output_sigma: float = 0.4
    # With this probability an output is very short (uniform 1..short_output_max_tokens).
    short_output_probability: float = 0.12
    short_output_max_tokens: int = 40
    max_output_tokens: int = 2_000
    # Chat template tokens around one message.
    message_overhead_tokens: int = 4
    continue_probability: float = 0.6
    max_turns: int = 12
    think_time_p50_s: float = 30.0
    think_time_sigma: float = 1.3
    max_think_time_s: float = 1_800.0
    timestamp_quantum_ms: int = 3_000
    # Share of quantum ticks written 1 ms early (seeded per tick, as the real trace's are).
    early_tick_probability: float = 0.18
    # Off by default (the defaults draw the same trace as before these knobs existed). A request
    # is re-sent, identical, 3-30 s later with retry_probability (the session goes on from the
    # original); a follow-up gets a sibling (a second continuation of the same turn, one turn
    # long, sent 3-30 s after it) with branch_probability; and the history's copy of an answer
    # is 1..short_answer_max_tokens shorter than the output with short_answer_probability (the
    # real trace: 2 of 27 follow-ups shorter than the previous prompt and output).
    retry_probability: float = 0.0
    branch_probability: float = 0.0
    short_answer_probability: float = 0.0
    short_answer_max_tokens: int = 20

    def validate(self) -> None:
        """Raise :class:`WorkloadError` naming the first invalid field."""
        checks = {
            "sessions": self.sessions >= 0,
            "arrival_rate_per_s": self.arrival_rate_per_s > 0,
            "system_prompt_tokens": bool(self.system_prompt_tokens)
            and min(self.system_prompt_tokens) > 0,
            "continue_probability": 0.0 <= self.continue_probability < 1.0,
            "max_turns": self.max_turns >= 1,
            "timestamp_quantum_ms": self.timestamp_quantum_ms >= 1,
            "first_question_probability": 0.0 <= self.first_question_probability <= 1.0,
            "follow_up_document_probability": 0.0 <= self.follow_up_document_probability <= 1.0,
            "short_output_probability": 0.0 <= self.short_output_probability <= 1.0,
            "early_tick_probability": 0.0 <= self.early_tick_probability <= 1.0,
            "retry_probability": 0.0 <= self.retry_probability <= 1.0,
            "branch_probability": 0.0 <= self.branch_probability <= 1.0,
            "short_answer_probability": 0.0 <= self.short_answer_probability <= 1.0,
            "short_answer_max_tokens": self.short_answer_max_tokens >= 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise WorkloadError(f"mooncake trace generator: invalid {name}="
                                    f"{getattr(self, name)!r}")


@dataclass(frozen=True)
class GeneratedTrace:
    """A generated trace: its rows in file order and the sessions that made them.

    ``sessions`` holds each session's row indices (0-based, file order) in send order;
    ``system_tokens`` the system prompt size of each row's session; ``parents`` each row's
    parent: ``(row index, "follow_up" or "retry")``, None for a session's first request.
    """

    rows: tuple[dict[str, Any], ...]
    sessions: tuple[tuple[int, ...], ...]
    system_tokens: tuple[int, ...]
    parents: tuple[tuple[int, str] | None, ...] = ()

    def write(self, path: str | Path) -> Path:
        """Write the rows as JSON lines (the Mooncake format) and return the path."""
        out = Path(path)
        out.write_text("".join(json.dumps(row) + "\n" for row in self.rows))
        return out

    def links(self) -> set[tuple[int, int]]:
        """Every (earlier row, follow-up row) pair: a follow-up and the request it continues."""
        if not self.parents:
            return {(a, b) for turns in self.sessions for a, b in itertools.pairwise(turns)}
        return {(p[0], row) for row, p in enumerate(self.parents)
                if p is not None and p[1] == "follow_up"}

    def retries(self) -> set[tuple[int, int]]:
        """Every (earlier row, the same request re-sent) pair."""
        return {(p[0], row) for row, p in enumerate(self.parents)
                if p is not None and p[1] == "retry"}

    def identifiable_links(self) -> set[tuple[int, int]]:
        """The links the ids can tell: the earlier prompt's full blocks hold some of the
        session's own text (full blocks that are all system prompt start other users' prompts
        too, so they cannot say whose next request follows)."""
        out = set()
        for a, b in self.links():
            full_tokens = self.rows[a]["input_length"] // TRACE_BLOCK_SIZE * TRACE_BLOCK_SIZE
            if full_tokens > self.system_tokens[a]:
                out.add((a, b))
        return out


def _lognormal(rng: random.Random, p50: float, sigma: float, high: float) -> int:
    return max(1, min(int(high), round(p50 * math.exp(sigma * rng.gauss(0.0, 1.0)))))


def _early_tick(seed: int, tick: int, probability: float) -> bool:
    """Whether a tick is written 1 ms early: the same answer for every row of that tick."""
    return random.Random(seed * 1_000_003 + tick).random() < probability


# A segment of a prompt: (what it is, its tokens). Blocks are named by the slices they cover.
_Segment = tuple[tuple[Any, ...], int]


def _block_contents(segments: list[_Segment]) -> list[tuple[tuple[Any, ...], ...]]:
    """Each 512-token block's content (the segment slices it covers), the last maybe partial."""
    blocks: list[tuple[tuple[Any, ...], ...]] = []
    current: list[tuple[Any, ...]] = []
    room = TRACE_BLOCK_SIZE
    for key, tokens in segments:
        offset = 0
        while offset < tokens:
            take = min(room, tokens - offset)
            current.append((key, offset, take))
            offset += take
            room -= take
            if room == 0:
                blocks.append(tuple(current))
                current, room = [], TRACE_BLOCK_SIZE
    if current:
        blocks.append(tuple(current))
    return blocks


def generate(config: TraceConfig | None = None, **overrides: Any) -> GeneratedTrace:
    """Generate a trace (see the module docstring); ``overrides`` replace config fields."""
    base = config or TraceConfig()
    cfg = TraceConfig(**{**base.__dict__, **overrides}) if overrides else base
    cfg.validate()
    rng = random.Random(cfg.seed)
    # (send time s, session, turn, segments, output tokens, own key, parent key, kind)
    requests: list[tuple[float, int, int, list[_Segment], int, int, int | None, str]] = []
    systems: list[int] = []
    start = 0.0

    def quantum_gap() -> float:
        return cfg.timestamp_quantum_ms / 1000.0 * rng.randint(1, 10)

    for session in range(cfg.sessions):
        start += rng.expovariate(cfg.arrival_rate_per_s)
        system = rng.choice(cfg.system_prompt_tokens)
        systems.append(system)
        segments: list[_Segment] = [(("system", system), system)]
        sent = start
        parent: int | None = None
        for turn in range(1, cfg.max_turns + 1):
            if turn == 1 and rng.random() < cfg.first_question_probability:
                p50, sigma = cfg.first_question_p50, cfg.first_question_sigma
            elif turn == 1:
                p50, sigma = cfg.first_message_p50, cfg.first_message_sigma
            elif rng.random() < cfg.follow_up_document_probability:
                p50, sigma = cfg.follow_up_document_p50, cfg.follow_up_document_sigma
            else:
                p50, sigma = cfg.follow_up_message_p50, cfg.follow_up_message_sigma
            words = _lognormal(rng, p50, sigma, cfg.max_message_tokens)
            history = segments
            segments = [*segments, (("user", session, turn), words + cfg.message_overhead_tokens)]
            if rng.random() < cfg.short_output_probability:
                output = rng.randint(1, cfg.short_output_max_tokens)
            else:
                output = _lognormal(rng, cfg.output_p50, cfg.output_sigma, cfg.max_output_tokens)
            key = len(requests)
            requests.append((sent, session, turn, segments, output, key, parent, "follow_up"))
            if cfg.retry_probability and rng.random() < cfg.retry_probability:
                requests.append((sent + quantum_gap(), session, turn, segments,
                                 _lognormal(rng, cfg.output_p50, cfg.output_sigma,
                                            cfg.max_output_tokens),
                                 len(requests), key, "retry"))
            if turn > 1 and cfg.branch_probability and rng.random() < cfg.branch_probability:
                sibling = [*history, (("branch", session, turn),
                                      _lognormal(rng, cfg.follow_up_message_p50,
                                                 cfg.follow_up_message_sigma,
                                                 cfg.max_message_tokens)
                                      + cfg.message_overhead_tokens)]
                requests.append((sent + quantum_gap(), session, turn, sibling,
                                 _lognormal(rng, cfg.output_p50, cfg.output_sigma,
                                            cfg.max_output_tokens),
                                 len(requests), parent, "follow_up"))
            parent = key
            if rng.random() >= cfg.continue_probability:
                break
            prompt = sum(tokens for _, tokens in segments)
            # The answer takes its time (the trace never says how long), then the user thinks.
            service = 0.3 + prompt / 20_000 + output * 0.02
            think = min(cfg.max_think_time_s,
                        cfg.think_time_p50_s * math.exp(cfg.think_time_sigma * rng.gauss(0, 1)))
            sent += service + think
            answer = output + cfg.message_overhead_tokens
            if cfg.short_answer_probability and rng.random() < cfg.short_answer_probability:
                answer = max(1, output - rng.randint(1, cfg.short_answer_max_tokens))
            segments = [*segments, (("answer", session, turn), answer)]
    requests.sort(key=lambda r: (r[0], r[1], r[2], r[5]))
    ids: dict[tuple[int, tuple[tuple[Any, ...], ...]], int] = {}
    rows: list[dict[str, Any]] = []
    by_session: dict[int, list[int]] = {}
    row_systems: list[int] = []
    row_of: dict[int, int] = {}
    parents: list[tuple[int, str] | None] = []
    for sent, session, _turn, segments, output, key, parent, kind in requests:
        hash_ids: list[int] = []
        previous = -1
        for content in _block_contents(segments):
            # Chained: a block's id names its content and every block before it.
            previous = ids.setdefault((previous, content), len(ids))
            hash_ids.append(previous)
        quantum = cfg.timestamp_quantum_ms
        tick = int(sent * 1000) // quantum
        early = tick > 0 and _early_tick(cfg.seed, tick, cfg.early_tick_probability)
        rows.append({
            "timestamp": tick * quantum - early,
            "input_length": sum(tokens for _, tokens in segments),
            "output_length": output,
            "hash_ids": hash_ids,
        })
        row_of[key] = len(rows) - 1
        parents.append(None if parent is None else (row_of[parent], kind))
        by_session.setdefault(session, []).append(len(rows) - 1)
        row_systems.append(systems[session])
    sessions = tuple(tuple(by_session[s]) for s in sorted(by_session))
    return GeneratedTrace(tuple(rows), sessions, tuple(row_systems), tuple(parents))


__all__ = ["GeneratedTrace", "TRACE_BLOCK_SIZE", "TraceConfig", "generate"]

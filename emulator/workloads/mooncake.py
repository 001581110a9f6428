"""Import Mooncake-format traces: JSON lines of ``timestamp`` (ms), lengths and block hash ids.

Each row is one request: ``timestamp`` (ms since the trace start), ``input_length``,
``output_length`` and ``hash_ids``: one chained id per ``trace_block_size``-token block of the
prompt (Mooncake uses 512) *including the last, partial one*. Equal hash ids are equal token
blocks: each id ``h`` becomes ``trace_block_size / B`` sub-block ids ``h·ratio + j`` at our block
size ``B`` (a partial block keeps its full sub-blocks), and prompts render block by block, so
equal ids also give equal text over HTTP.

Grouping (``group=True``; :func:`read_sessions`). A chat's next turn re-sends the previous prompt
and answer and adds new text, so the previous prompt's partial last block changes: a follow-up
starts with the previous prompt's *full* blocks (``input_length // 512`` ids), never with all of
its ids. Rows are read in timestamp order (equal timestamps keep file order); a row continues
the session whose latest request is the deepest, then most recent, whose full-block prefix this
row starts with, provided that

- the row is longer than that request's prompt (a chat re-sends the prompt and adds the answer
  and new text; this also keeps a repeated identical prompt, a retry, from being read as a
  follow-up). Not "at least prompt plus answer": in the FAST'25 trace a few follow-ups are a
  little shorter than that (the history's copy of the answer is shorter than the
  ``output_length`` that was generated: by 1 and by 13 tokens in the first 328 rows), and
  ``tests/emulator/data/`` pins this on those rows; and
- that full-block prefix is not *shared*: seen in more than one session. A prompt whose full
  blocks are all a system prompt that other users' prompts start with too (in the FAST'25
  conversation trace, every prompt's first block) tells nothing about who sent the next one.
  The first pass can only know a prefix is shared once two sessions have used it, so grouping
  runs twice, the second pass knowing the prefixes the first found shared.

Sessions are linear: a request, once continued, is no longer a candidate. Every other row opens a
new session. What the grouping found is in :class:`ImportSummary` (also in the workload's
``settings``): sessions, follow-ups, turns per session, and the new sessions that start with an
earlier session's own full blocks but were not linked to it (retries, mostly). A row that
starts with *part* of an earlier prompt's full blocks (an edited or truncated history: four of
the first 328 real rows) opens a new session and is not counted there.
``group=False`` makes each row a one-turn session.

A follow-up's ``shared_prefix_tokens`` is the previous prompt plus its answer (what the chat
re-sent; the whole prompt when it is shorter than that), so its first blocks are the previous
turn's prompt and output in the block view, and its trace ids follow. Time: the trace records when
each request was *sent* and nothing about when its answer ended, so the gap between two sends also
holds the previous request's service time (and timestamps are quantised, ~3 s in the FAST'25
traces). A follow-up keeps its send time (``Turn.sent_at_s``): the simulator and the replay driver
send it then, or as soon as the previous turn ends when that is later, rather than adding the whole
gap after the answer. ``think_time_s`` is the gap itself, an upper bound of the user's think time.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvscope.emulator.workloads.model import (
    DEFAULT_BLOCK_SIZE,
    MAX_TRACE_BYTES,
    BlockChain,
    Conversation,
    Turn,
    Workload,
    WorkloadError,
    mix_seed,
)
from kvscope.files import read_limited

MOONCAKE_BLOCK_SIZE = 512


@dataclass(frozen=True)
class _Row:
    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _read(path: Path) -> list[_Row]:
    rows: list[_Row] = []
    try:
        text = read_limited(path, MAX_TRACE_BYTES, "mooncake trace", WorkloadError).decode()
    except UnicodeDecodeError:
        raise WorkloadError(f"mooncake trace {path}: not UTF-8 text") from None
    for line, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        where = f"{path}:{line}"
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{where}: not JSON ({exc.msg})") from None
        try:
            rows.append(
                _Row(
                    line,
                    float(obj["timestamp"]),
                    int(obj["input_length"]),
                    int(obj["output_length"]),
                    tuple(int(h) for h in obj.get("hash_ids", [])),
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise WorkloadError(f"{where}: malformed row ({exc!r})") from None
    # Stable sort: rows with equal timestamps keep file order.
    rows.sort(key=lambda r: r.timestamp_ms)
    return rows


@dataclass(frozen=True)
class ImportSummary:
    """What grouping found in a whole trace (before ``conversations`` / ``max_turns`` cuts)."""

    requests: int
    sessions: int
    follow_ups: int
    multi_turn_sessions: int
    turns_per_session_p50: float
    turns_per_session_p90: float
    turns_per_session_max: int
    # New sessions that start with an earlier session's own full blocks (a prefix no other
    # session used) and were not linked to it: the row is no longer than that prompt (a retry
    # of the same prompt, mostly). Rows that start with a shared prefix only (every first turn
    # after the shared system-prompt block) are not counted: they say nothing.
    unlinked_on_prefix: int

    def as_settings(self) -> dict[str, int | float]:
        """The summary as flat workload settings (recorded with each run)."""
        return {
            "requests": self.requests,
            "sessions": self.sessions,
            "follow_ups": self.follow_ups,
            "multi_turn_sessions": self.multi_turn_sessions,
            "turns_per_session_p50": self.turns_per_session_p50,
            "turns_per_session_p90": self.turns_per_session_p90,
            "turns_per_session_max": self.turns_per_session_max,
            "unlinked_on_prefix": self.unlinked_on_prefix,
        }

    def line(self) -> str:
        """One line for a person: sessions, follow-ups, turns per session, what was not linked."""
        return (f"{self.requests} requests -> {self.sessions} sessions ({self.multi_turn_sessions} "
                f"with follow-ups), {self.follow_ups} follow-ups; turns per session p50 "
                f"{self.turns_per_session_p50:g}, p90 {self.turns_per_session_p90:g}, max "
                f"{self.turns_per_session_max}; {self.unlinked_on_prefix} new sessions start with "
                f"an earlier session's own blocks but were not linked to it")


@dataclass(frozen=True)
class Sessions:
    """A trace's rows grouped into sessions: each session's file line numbers, in turn order."""

    lines: tuple[tuple[int, ...], ...]
    summary: ImportSummary


_SHARED = -1  # owner of a prefix seen in more than one session


def _prefix_keys(ids: Sequence[int]) -> list[int]:
    """Chained keys of every prefix of ``ids`` (key i names ``ids[:i + 1]``)."""
    keys, key = [], 0
    for block in ids:
        key = hash((key, block))
        keys.append(key)
    return keys


def _group(rows: Sequence[_Row], trace_block_size: int, known_shared: frozenset[int]
           ) -> tuple[list[list[_Row]], set[int], int]:
    """One grouping pass (see the module docstring).

    Returns the groups, the prefix keys found shared, and how many new sessions start with an
    earlier session's own full blocks.
    """
    groups: list[list[_Row]] = []
    # Full-prefix key of each session's latest request -> those sessions (mostly one).
    tails: dict[int, list[int]] = {}
    tail_key: dict[int, int] = {}  # session -> the key it is listed under in tails
    owner: dict[int, int] = {}
    unlinked = 0
    for row in rows:
        keys = _prefix_keys(row.hash_ids)
        target = None
        # Depth of the deepest own prefix whose session was passed over for length (a retry
        # shares it with that session: the same user's, not a prefix shared across sessions).
        retried = 0
        for depth in range(len(keys), 0, -1):  # deepest first
            key = keys[depth - 1]
            found = tails.get(key)
            if not found:
                continue
            if key in known_shared or owner.get(key) == _SHARED:
                continue
            for g in reversed(found):  # most recent first
                previous = groups[g][-1]
                if row.input_length <= previous.input_length:
                    retried = max(retried, depth)
                    continue
                target = g
                break
            if target is not None:
                break
        if target is None:
            unlinked += retried > 0
            target = len(groups)
            groups.append([])
        elif (old := tail_key.pop(target, None)) is not None:
            tails[old].remove(target)  # sessions are linear: continued once
        groups[target].append(row)
        full = min(row.input_length // trace_block_size, len(keys))
        if full:
            tails.setdefault(keys[full - 1], []).append(target)
            tail_key[target] = keys[full - 1]
        for key in keys[retried:full]:
            seen = owner.setdefault(key, target)
            if seen != target:
                owner[key] = _SHARED
    shared = {key for key, g in owner.items() if g == _SHARED}
    return groups, shared, unlinked


def _percentile(values: Sequence[int], q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))]) if ordered else 0.0


def _sessions(rows: Sequence[_Row], trace_block_size: int
              ) -> tuple[list[list[_Row]], ImportSummary]:
    """Group rows into sessions (two passes; see the module docstring) and summarise."""
    _, shared, _ = _group(rows, trace_block_size, frozenset())
    groups, _, unlinked = _group(rows, trace_block_size, frozenset(shared))
    sizes = [len(g) for g in groups]
    summary = ImportSummary(
        requests=len(rows),
        sessions=len(groups),
        follow_ups=len(rows) - len(groups),
        multi_turn_sessions=sum(1 for n in sizes if n > 1),
        turns_per_session_p50=statistics.median(sizes) if sizes else 0.0,
        turns_per_session_p90=_percentile(sizes, 0.9),
        turns_per_session_max=max(sizes, default=0),
        unlinked_on_prefix=unlinked,
    )
    return groups, summary


def read_sessions(path: str | Path, *, trace_block_size: int = MOONCAKE_BLOCK_SIZE) -> Sessions:
    """Group a trace's rows into sessions: each session's file line numbers, and the summary."""
    rows = _read(Path(path))
    groups, summary = _sessions(rows, trace_block_size)
    return Sessions(tuple(tuple(r.line for r in g) for g in groups), summary)


def _sub_blocks(row: _Row, trace_block_size: int, block_size: int, source: Path) -> list[int]:
    """Expand a row's hash ids into full sub-blocks (a partial last block keeps its full part)."""
    if len(row.hash_ids) * trace_block_size >= row.input_length + trace_block_size:
        raise WorkloadError(
            f"{source}:{row.line}: {len(row.hash_ids)} hash_ids of {trace_block_size} tokens "
            f"do not fit input_length {row.input_length}"
        )
    ratio = trace_block_size // block_size
    ids: list[int] = []
    for position, block in enumerate(row.hash_ids):
        full = min(ratio, (row.input_length - position * trace_block_size) // block_size)
        ids.extend(block * ratio + j for j in range(full))
    return ids


def load(
    path: str | Path,
    *,
    trace_block_size: int = MOONCAKE_BLOCK_SIZE,
    block_size: int = DEFAULT_BLOCK_SIZE,
    group: bool = True,
    conversations: int | None = None,
    max_turns: int | None = None,
    time_compression: float = 1.0,
) -> Workload:
    """Load a Mooncake JSONL trace as a workload of block-rendered conversations."""
    if block_size <= 0 or trace_block_size % block_size:
        raise WorkloadError(
            f"mooncake workload: block_size {block_size} must divide {trace_block_size}"
        )
    if time_compression <= 0:
        raise WorkloadError(f"mooncake workload: time_compression must be > 0: {time_compression}")
    if max_turns is not None and max_turns < 1:
        raise WorkloadError(f"mooncake workload: max_turns must be >= 1, got {max_turns}")
    if conversations is not None and conversations < 0:
        raise WorkloadError(f"mooncake workload: conversations must be >= 0, got {conversations}")
    source = Path(path)
    rows = _read(source)
    if group:
        groups, summary = _sessions(rows, trace_block_size)
    else:
        groups = [[row] for row in rows]
        summary = ImportSummary(len(rows), len(rows), 0, 0, 1.0, 1.0, 1 if rows else 0, 0)
    if conversations is not None:
        groups = groups[:conversations]
    out: list[Conversation] = []
    for number, members in enumerate(groups):
        members = members[:max_turns] if max_turns is not None else members
        turns: list[Turn] = []
        previous: BlockChain | None = None
        previous_row: _Row | None = None
        for index, row in enumerate(members, start=1):
            ids = _sub_blocks(row, trace_block_size, block_size, source)
            chain = BlockChain.from_ids(ids, previous)
            prompt = max(1, row.input_length)
            sent_at = round(row.timestamp_ms / 1000.0 / time_compression, 6)
            if previous_row is None:
                shared, think = 0, 0.0
            else:
                # Grouping guarantees the row re-sends the previous prompt and (most of) its
                # answer; a row shorter than both re-sent its whole self.
                shared = min(previous_row.input_length + previous_row.output_length, prompt)
                think = round((row.timestamp_ms - previous_row.timestamp_ms) / 1000.0
                              / time_compression, 6)
            turns.append(
                Turn(index, think, prompt, max(1, row.output_length), shared, prompt - shared,
                     False, chain, sent_at)
            )
            previous, previous_row = chain, row
        conv_id = f"mooncake-{number:06d}"
        out.append(
            Conversation(
                id=conv_id,
                start_s=round(members[0].timestamp_ms / 1000.0 / time_compression, 6),
                turns=tuple(turns),
                seed=mix_seed("mooncake", conv_id),
                system_seed=mix_seed("mooncake-system", conv_id),
                render="blocks",
            )
        )
    return Workload(
        name=f"mooncake-{source.stem}",
        block_size=block_size,
        conversations=tuple(out),
        source=str(source),
        settings={
            "format": "mooncake",
            "trace_block_size": trace_block_size,
            "group": group,
            "conversations": len(out),
            "max_turns": max_turns or 0,
            "time_compression": time_compression,
            **summary.as_settings(),
        },
    )


def import_summary(workload: Workload) -> ImportSummary | None:
    """The grouping summary a Mooncake workload was loaded with (None for other workloads)."""
    settings = workload.settings
    if settings.get("format") != "mooncake":
        return None
    return ImportSummary(**{name: settings[name] for name in ImportSummary.__dataclass_fields__})

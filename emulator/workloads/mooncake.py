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
its ids. Rows are read in timestamp order (equal timestamps keep file order). Each row is, in
this order:

- a **retry** when an earlier row has exactly its ids (the partial last block's too) and it is
  no longer: the same request re-sent. It joins that request's session as a turn, and it is
  transparent: a later follow-up of the request links to the original, never to the retry, so
  a retry does not break the chain (it used to open a session of its own, and the next
  follow-up continued whichever of the two was more recent);
- a **follow-up** of the request whose full-block prefix the row starts with, the deepest such
  prefix, then the most recent request with it that the row is longer than (a chat re-sends
  the prompt and adds the answer and new text; not "at least prompt plus answer": in the FAST'25
  trace a few follow-ups are a little shorter than that, by 1 and by 13 tokens in the first 328
  rows, which ``tests/emulator/data/`` pins). Every request stays a candidate after it was
  continued, so **each child of a branching turn is linked to that turn** (its parent: the
  request it continues, which the ids name) and joins the parent's session. Two children whose
  new text fits in their partial last block have equal full blocks; a grandchild then links to
  the more recent of them (the ids cannot tell which). A prefix is never linked on when it is
  *shared*: seen in more than one session. A prompt whose full blocks are all a system prompt
  that other users' prompts start with too (in the FAST'25 conversation trace, every prompt's
  first block) tells nothing about who sent the next one. The first pass can only know a prefix
  is shared once two sessions have used it, so grouping runs twice, the second pass knowing the
  prefixes the first found shared;
- else the first turn of a new session.

A session is the tree of its requests, in send order: a turn's previous turn is the session's
request sent just before it, which is its parent for a plain chain and a sibling or cousin after
a branch or retry. What the grouping found is in :class:`ImportSummary` (also in the workload's
``settings``): sessions, follow-ups, branches, retries, turns per session, and the new sessions
that start with an earlier session's own full blocks but were not linked to it (a shorter edit).
A row that starts with *part* of an earlier prompt's full blocks (an edited or truncated history:
four of the first 328 real rows) links only when that part is some request's full blocks.
``group=False`` makes each row a one-turn session. ``Sessions.parents`` names each linked row's
parent and kind.

Rendering. ``shared_prefix_tokens`` (the leading tokens a turn's prompt shares with the previous
turn's prompt and output) is the most the trace allows: the parent's prompt and answer when the
parent is the previous turn or an ancestor of it (a follow-up re-sends them), else the blocks
whose ids are equal and full in both, or the whole prompt for a retry of the previous turn;
capped at the previous prompt and output and at the prompt. So a follow-up shorter than the
previous prompt and answer is the part of them it has room for, and the trace's own ids follow:
it shows only the invalid reuse its lengths force (a prompt shorter than what decode holds is
read misaligned, vLLM taking decode's end-trimmed blocks, whatever its text), none that a
rendering of unknown text as new would add. A branch or retry does not continue the previous
turn: the proxy offers that turn's KV, which the prompt leaves (the trace implies it: same
session, another history).

A follow-up's first blocks are the previous turn's prompt and output in the block view, and its
trace ids follow. Time: the trace records when each request was *sent* and nothing about when its
answer ended, so the gap between two sends also holds the previous request's service time (and
timestamps are quantised, ~3 s in the FAST'25 traces). A follow-up keeps its send time
(``Turn.sent_at_s``): the simulator and the replay driver send it then, or as soon as the
previous turn ends when that is later, rather than adding the whole gap after the answer.
``think_time_s`` is the gap itself, an upper bound of the user's think time.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
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
    trace_seconds,
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


def _read(path: Path, trace_block_size: int = MOONCAKE_BLOCK_SIZE) -> list[_Row]:
    """The trace's rows in timestamp order; :class:`WorkloadError` naming the file and line of
    the first bad one (not JSON, a missing field, a timestamp that is not finite or outside
    [0, MAX_TRACE_S], a negative length, ``hash_ids`` that do not cover ``input_length``) or
    of a trace with no rows."""
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
            row = _Row(
                line,
                trace_seconds(obj["timestamp"], where, "timestamp", per_second=1000.0) * 1000.0,
                int(obj["input_length"]),
                int(obj["output_length"]),
                tuple(int(h) for h in obj.get("hash_ids", [])),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, WorkloadError):
                raise
            raise WorkloadError(f"{where}: malformed row ({exc!r})") from None
        if row.input_length < 0 or row.output_length < 0:
            raise WorkloadError(f"{where}: input_length {row.input_length} and output_length "
                                f"{row.output_length} must be >= 0")
        # One id per trace block of the prompt, the partial last one included.
        needed = -(-row.input_length // trace_block_size)
        if len(row.hash_ids) < needed:
            raise WorkloadError(
                f"{where}: {len(row.hash_ids)} hash_ids of {trace_block_size} tokens do not "
                f"cover input_length {row.input_length} ({needed} needed)")
        rows.append(row)
    if not rows:
        raise WorkloadError(f"mooncake trace {path}: empty (no requests)")
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
    # session used) and were not linked to it: the row is neither longer than that prompt nor
    # the same ids (a shorter edit of it). Rows that start with a shared prefix only (every
    # first turn after the shared system-prompt block) are not counted: they say nothing.
    unlinked_on_prefix: int
    # Rows with the ids of an earlier request, no longer: re-sent, linked to its session.
    retries: int = 0
    # Follow-ups of a request that already had one (a second continuation of one turn).
    branches: int = 0

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
            "retries": self.retries,
            "branches": self.branches,
        }

    def line(self) -> str:
        """One line for a person: sessions, follow-ups, turns per session, what was not linked."""
        return (f"{self.requests} requests -> {self.sessions} sessions ({self.multi_turn_sessions} "
                f"with follow-ups), {self.follow_ups} follow-ups ({self.branches} of them "
                f"branches), {self.retries} retries; turns per session p50 "
                f"{self.turns_per_session_p50:g}, p90 {self.turns_per_session_p90:g}, max "
                f"{self.turns_per_session_max}; {self.unlinked_on_prefix} new sessions start with "
                f"an earlier session's own blocks but were not linked to it")


FOLLOW_UP = "follow_up"
RETRY = "retry"


@dataclass(frozen=True)
class Sessions:
    """A trace's rows grouped into sessions: each session's file line numbers, in turn (send)
    order, and each linked row's parent: ``parents[line] = (parent line, FOLLOW_UP or RETRY)``."""

    lines: tuple[tuple[int, ...], ...]
    summary: ImportSummary
    parents: Mapping[int, tuple[int, str]] = field(default_factory=dict)


_SHARED = -1  # owner of a prefix seen in more than one session


def _prefix_keys(ids: Sequence[int]) -> list[int]:
    """Chained keys of every prefix of ``ids`` (key i names ``ids[:i + 1]``)."""
    keys, key = [], 0
    for block in ids:
        key = hash((key, block))
        keys.append(key)
    return keys


@dataclass
class _Grouping:
    groups: list[list[_Row]]
    parents: dict[int, tuple[_Row, str]]  # row line -> (parent row, kind)
    shared: set[int]
    unlinked: int


def _group(rows: Sequence[_Row], trace_block_size: int, known_shared: frozenset[int]
           ) -> _Grouping:
    """One grouping pass (see the module docstring)."""
    groups: list[list[_Row]] = []
    # Full-prefix key of every request so far -> (row position, its session), oldest first.
    # Every request stays a candidate: a turn may be continued twice (a branch).
    by_key: dict[int, list[tuple[int, int]]] = {}
    # Every request's whole ids (its partial last block's too) -> (row position, session) of
    # the first request sent with them: an identical row re-sends it (a retry), even where its
    # full blocks are all shared system prompt.
    sent: dict[tuple[int, ...], tuple[int, int]] = {}
    parents: dict[int, tuple[_Row, str]] = {}
    owner: dict[int, int] = {}
    unlinked = 0
    for position, row in enumerate(rows):
        keys = _prefix_keys(row.hash_ids)
        target = parent = None
        kind = FOLLOW_UP
        original = sent.get(row.hash_ids)
        if original is not None and row.input_length <= rows[original[0]].input_length:
            target, parent, kind = original[1], rows[original[0]], RETRY
        # Depth of the deepest own prefix whose request was passed over (neither longer nor
        # the same ids): that session's own prefix, not one shared across sessions.
        passed = 0
        for depth in range(len(keys) if target is None else 0, 0, -1):  # deepest first
            key = keys[depth - 1]
            found = by_key.get(key)
            if not found or key in known_shared or owner.get(key) == _SHARED:
                continue
            # The most recent request this row is longer than: a follow-up of it.
            for earlier, session in reversed(found):
                previous = rows[earlier]
                if row.input_length > previous.input_length:
                    target, parent = session, previous
                    break
            if target is not None:
                break
            passed = max(passed, depth)
        if target is None or parent is None:
            unlinked += passed > 0
            target = len(groups)
            groups.append([])
        else:
            parents[row.line] = (parent, kind)
        groups[target].append(row)
        sent.setdefault(row.hash_ids, (position, target))
        full = min(row.input_length // trace_block_size, len(keys))
        if full and kind != RETRY:
            # A retry is its original re-sent: a follow-up of either continues the original.
            by_key.setdefault(keys[full - 1], []).append((position, target))
        for key in keys[passed:full]:
            seen = owner.setdefault(key, target)
            if seen != target:
                owner[key] = _SHARED
    shared = {key for key, g in owner.items() if g == _SHARED}
    return _Grouping(groups, parents, shared, unlinked)


def _percentile(values: Sequence[int], q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))]) if ordered else 0.0


def _sessions(rows: Sequence[_Row], trace_block_size: int) -> tuple[_Grouping, ImportSummary]:
    """Group rows into sessions (two passes; see the module docstring) and summarise."""
    first = _group(rows, trace_block_size, frozenset())
    grouping = _group(rows, trace_block_size, frozenset(first.shared))
    groups = grouping.groups
    sizes = [len(g) for g in groups]
    kinds = [kind for _, kind in grouping.parents.values()]
    children: dict[int, int] = {}
    for parent, kind in grouping.parents.values():
        if kind == FOLLOW_UP:
            children[parent.line] = children.get(parent.line, 0) + 1
    summary = ImportSummary(
        requests=len(rows),
        sessions=len(groups),
        follow_ups=kinds.count(FOLLOW_UP),
        multi_turn_sessions=sum(1 for n in sizes if n > 1),
        turns_per_session_p50=statistics.median(sizes) if sizes else 0.0,
        turns_per_session_p90=_percentile(sizes, 0.9),
        turns_per_session_max=max(sizes, default=0),
        unlinked_on_prefix=grouping.unlinked,
        retries=kinds.count(RETRY),
        branches=sum(n - 1 for n in children.values()),
    )
    return grouping, summary


def read_sessions(path: str | Path, *, trace_block_size: int = MOONCAKE_BLOCK_SIZE) -> Sessions:
    """Group a trace's rows into sessions: each session's file line numbers, each linked row's
    parent, and the summary."""
    rows = _read(Path(path), trace_block_size)
    grouping, summary = _sessions(rows, trace_block_size)
    return Sessions(tuple(tuple(r.line for r in g) for g in grouping.groups), summary,
                    {line: (parent.line, kind) for line, (parent, kind)
                     in grouping.parents.items()})


def _common_tokens(row: _Row, previous: _Row, trace_block_size: int) -> int:
    """The leading tokens ``row``'s prompt shares with ``previous``'s prompt, as the ids prove:
    the blocks whose ids are equal and full in both, or all of ``row`` when its ids are
    ``previous``'s and it is no longer (a re-sent prompt)."""
    if row.hash_ids == previous.hash_ids and row.input_length <= previous.input_length:
        return row.input_length
    limit = min(row.input_length, previous.input_length) // trace_block_size
    equal = 0
    for a, b in zip(row.hash_ids[:limit], previous.hash_ids[:limit], strict=True):
        if a != b:
            break
        equal += 1
    return equal * trace_block_size


def _shared_with_previous(row: _Row, previous: _Row, links: Mapping[int, tuple[_Row, str]],
                          trace_block_size: int) -> int:
    """``Turn.shared_prefix_tokens`` of ``row`` after the session's previous turn: the most the
    trace allows (module docstring, "Rendering"), capped at the previous prompt and answer and
    at ``row``'s prompt."""
    sent = previous.input_length + previous.output_length
    shared = _common_tokens(row, previous, trace_block_size)
    link = links.get(row.line)
    if link is not None and link[1] == FOLLOW_UP:
        # The parent's prompt and answer open this row; they open the previous turn too when
        # the parent is the previous turn or one of its ancestors.
        parent = link[0]
        node: _Row | None = previous
        while node is not None and node is not parent:
            up = links.get(node.line)
            node = up[0] if up is not None else None
        if node is parent:
            shared = max(shared, parent.input_length + parent.output_length)
    return min(shared, sent, max(1, row.input_length))


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
    if conversations is not None and conversations < 1:
        raise WorkloadError(f"mooncake workload: conversations must be >= 1, got {conversations}")
    source = Path(path)
    rows = _read(source, trace_block_size)
    links: dict[int, tuple[_Row, str]] = {}
    if group:
        grouping, summary = _sessions(rows, trace_block_size)
        groups, links = grouping.groups, grouping.parents
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
                shared = _shared_with_previous(row, previous_row, links, trace_block_size)
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


__all__ = ["FOLLOW_UP", "ImportSummary", "MOONCAKE_BLOCK_SIZE", "RETRY", "Sessions",
    "import_summary", "load", "read_sessions"]

"""Import Mooncake-format traces: JSON lines of ``timestamp`` (ms), lengths and block hash ids.

Each row is one request: ``timestamp`` (ms since the trace start), ``input_length``,
``output_length`` and ``hash_ids`` (one id per full ``trace_block_size``-token block of the
prompt; Mooncake uses 512). Equal hash ids are equal token blocks: each id ``h`` becomes
``trace_block_size / B`` sub-block ids ``h·ratio + j`` at our block size ``B``, and prompts render
block by block, so equal ids also give equal text over HTTP.

Grouping heuristic (``group=True``): rows are read in timestamp order; a row continues the open
conversation whose latest prompt's hash ids are *all* a prefix of this row's hash ids (the longest
such prompt wins; an append-only chat re-sends its whole history). Any other row opens a new
conversation. A shared system prompt alone therefore never merges two users' sessions, and
context resets are not detected (they start a new conversation). ``group=False`` makes each row a
one-turn session. The think time of a follow-up is the gap between the two timestamps (the trace
has no response end, so it includes the previous request's service time).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvscope.emulator.workloads.model import (
    DEFAULT_BLOCK_SIZE,
    BlockChain,
    Conversation,
    Turn,
    Workload,
    WorkloadError,
    mix_seed,
)

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
        text = path.read_text()
    except OSError as exc:
        raise WorkloadError(f"mooncake trace {path}: cannot read ({exc.strerror})") from None
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


def _group(rows: Sequence[_Row]) -> list[list[_Row]]:
    """Group rows into conversations by full-prefix continuation (see the module docstring)."""
    groups: list[list[_Row]] = []
    # Key: the chained hash of an open conversation's latest prompt ids → group index.
    open_by_chain: dict[int, int] = {}
    for row in rows:
        chain, prefixes = 0, []
        for block in row.hash_ids:
            chain = hash((chain, block))
            prefixes.append(chain)
        target = None
        # Strict extension only (the last prefix is the whole prompt: a repeat, not a follow-up).
        for key in reversed(prefixes[:-1] if prefixes else []):
            if key in open_by_chain:
                target = open_by_chain.pop(key)
                break
        if target is None:
            target = len(groups)
            groups.append([])
        groups[target].append(row)
        if prefixes:
            open_by_chain[prefixes[-1]] = target
    return groups


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
    source = Path(path)
    rows = _read(source)
    groups = _group(rows) if group else [[row] for row in rows]
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
            if previous_row is None:
                shared, think = 0, 0.0
            else:
                shared = min(chain.kept * block_size, row.input_length)
                gap_s = (row.timestamp_ms - previous_row.timestamp_ms) / 1000.0
                think = round(gap_s / time_compression, 6)
            prompt = max(1, row.input_length)
            turns.append(
                Turn(index, think, prompt, max(1, row.output_length), shared, prompt - shared,
                     False, chain)
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
        },
    )

"""Load the real agentic-coding traces (WEKA / Claude Code) shipped in ``emulator/data/weka_cc``.

Two formats, both described in that folder's README:

- ``traces_flat.csv`` (:func:`load_csv`): one row per request of 710 conversations. Per row we
  take ``prompt_tokens``, ``output_tokens``, ``shared_prefix_tokens`` (64 × common hash prefix
  with the previous request of the same agent) and ``think_time_s`` as the tool wait (when blank:
  ``gap_s`` minus the previous ``api_time_s``, floored at 0).
- raw ``trace_NNNN.json`` files (:func:`load_raw`): the same requests with their ``hash_ids``
  (one chained id per full 64-token block). Each 64-token block id ``h`` becomes ``64 / B``
  sub-block ids ``ns + h·(64/B) + j`` at our block size ``B``, so equal 64-blocks give equal
  sub-blocks and chaining is preserved; ``ns`` separates files (ids are file-local). These
  conversations render block by block (``render="blocks"``), so HTTP replay sends prompts whose
  text prefixes match exactly where the trace's blocks match.

How structure maps onto the workload model:

- **Continuation**: the trace's shared prefix is counted in whole 64-token blocks, so it always
  stops short of the previous prompt's last partial block and of the reply. When *every* full
  block of the previous prompt is shared and the prompt is at least the previous prompt + output,
  the follow-up is taken as a continuation and ``shared_prefix_tokens`` = previous prompt + output
  (the agent resends the reply verbatim). When every full block is shared but the prompt is
  shorter than that, the reply did not come back as it was sent (a client stripping thinking or
  re-rendering it): ``shared_prefix_tokens`` = the previous prompt, the history edited where the
  reply starts. Otherwise the measured value stands (history was edited or compacted there). CSV
  rows only: raw traces keep their explicit blocks.

- **Reset**: a follow-up whose ``shared_prefix_tokens`` is less than half the previous prompt
  (the README's definition, 845 in the CSV) has ``reset=True``; its ``shared_prefix_tokens`` stays
  the measured value (typically the system prompt and tools, ~15k tokens) and in chat rendering
  the history is replaced by a summary after the system prompt and task.
- **Sub-agent**: rows with ``agent_id`` ``saK`` (raw: a ``subagent`` entry with nested
  ``requests``) become a child :class:`Conversation` ``"<trace id>.saK"`` with ``parent_id`` set
  to the trace id, starting at its spawn time. The parent's next request waits for it through its
  own ``think_time_s``, as recorded.

Options shrink the traces for demos: ``conversations`` (first N trace ids, in file order),
``max_turns`` per agent, ``token_scale`` (multiplies token counts; CSV only), and
``time_compression`` (divides waits and start times). The traces have no global clock, so the
main conversations start at 0 unless ``arrival_rate_per_s`` overlays seeded Poisson arrivals.
Every option is recorded in the workload's ``settings``.
"""

from __future__ import annotations

import csv
import io
import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvscope.emulator.workloads.model import (
    DEFAULT_BLOCK_SIZE,
    MAX_TRACE_BYTES,
    MESSAGE_OVERHEAD_TOKENS,
    BlockChain,
    Conversation,
    Turn,
    Workload,
    WorkloadError,
    mix_seed,
    trace_seconds,
)
from kvscope.files import read_limited

DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "weka_cc"
CSV_PATH = DATA_DIR / "traces_flat.csv"
RAW_DIR = DATA_DIR / "raw"
TRACE_BLOCK_SIZE = 64
# Claude Code's system prompt plus tool definitions (system_tokens + tool_tokens in the raw files).
_DEFAULT_SYSTEM_TOKENS = 15_000
_TASK_TOKENS = 64

_CSV_COLUMNS = (
    "conversation_id", "agent_id", "turn_index", "arrival_s", "prompt_tokens", "output_tokens",
    "shared_prefix_tokens", "gap_s", "think_time_s", "api_time_s",
)


@dataclass(frozen=True)
class _Request:
    """One trace request, before scaling: the numbers every format provides."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    shared_prefix_tokens: int
    think_time_s: float
    hash_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class _Options:
    max_turns: int | None
    token_scale: float
    time_compression: float
    block_size: int

    def tokens(self, value: int, minimum: int = 1) -> int:
        return max(minimum, round(value * self.token_scale))

    def seconds(self, value: float) -> float:
        return round(value / self.time_compression, 6)


def _check_options(
    max_turns: int | None, token_scale: float, time_compression: float, block_size: int,
    arrival_rate_per_s: float,
) -> _Options:
    if max_turns is not None and max_turns < 1:
        raise WorkloadError(f"weka workload: max_turns must be >= 1, got {max_turns}")
    if token_scale <= 0:
        raise WorkloadError(f"weka workload: token_scale must be > 0, got {token_scale}")
    if time_compression <= 0:
        raise WorkloadError(f"weka workload: time_compression must be > 0, got {time_compression}")
    if block_size <= 0 or TRACE_BLOCK_SIZE % block_size:
        raise WorkloadError(
            f"weka workload: block_size must divide {TRACE_BLOCK_SIZE}, got {block_size}"
        )
    if arrival_rate_per_s < 0:
        raise WorkloadError(
            f"weka workload: arrival_rate_per_s must be >= 0, got {arrival_rate_per_s}"
        )
    return _Options(max_turns, token_scale, time_compression, block_size)


def _turns(
    requests: Sequence[_Request], opts: _Options, continuation: bool = True
) -> tuple[Turn, ...]:
    """Map one agent's requests to turns; resets are < half the previous prompt reused.

    ``continuation`` applies the continuation rule of the module docstring (CSV rows); raw
    traces keep their explicit blocks, which already say where prompts stop matching.
    """
    turns: list[Turn] = []
    previous: _Request | None = None
    limit = len(requests) if opts.max_turns is None else min(len(requests), opts.max_turns)
    for number, req in enumerate(requests[:limit], start=1):
        prompt = opts.tokens(req.prompt_tokens)
        output = opts.tokens(req.output_tokens)
        if previous is None:
            shared, reset, think = 0, False, 0.0
        else:
            measured = opts.tokens(req.shared_prefix_tokens, 0)
            full_blocks = TRACE_BLOCK_SIZE * (previous.prompt_tokens // TRACE_BLOCK_SIZE)
            # The previous turn as the workload has it (scaled, its output at least 1 token).
            sequence = turns[-1].prompt_tokens + turns[-1].output_tokens
            if continuation and req.shared_prefix_tokens >= full_blocks:
                # Every full 64-token block of the previous prompt is shared. The trace cannot
                # see past its last full block: a prompt that can hold the previous reply
                # carries it verbatim (a continuation, prompt + output shared); a shorter one
                # did not send the reply back as it was (thinking stripped, re-rendered), so
                # the history was edited where the reply starts.
                measured = sequence if prompt >= sequence else turns[-1].prompt_tokens
            shared = min(measured, prompt, sequence)
            reset = 2 * req.shared_prefix_tokens < previous.prompt_tokens
            think = opts.seconds(req.think_time_s)
        turns.append(Turn(number, think, prompt, output, shared, prompt - shared, reset))
        previous = req
    return tuple(turns)


def _system_sizes(turns: Sequence[Turn], opts: _Options) -> tuple[int, int]:
    """Choose (system, task) message sizes so a rendered reset keeps what the trace kept."""
    first = turns[0].prompt_tokens
    kept = [t.shared_prefix_tokens for t in turns if t.reset and t.shared_prefix_tokens > 0]
    base = min(kept) if kept else min(opts.tokens(_DEFAULT_SYSTEM_TOKENS), first // 2)
    task = min(_TASK_TOKENS, base // 2)
    task = max(task, MESSAGE_OVERHEAD_TOKENS + 1)
    system = max(base - task, MESSAGE_OVERHEAD_TOKENS + 1)
    return system, task


def _arrivals(count: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(mix_seed(seed, "weka-arrivals"))
    out, clock = [], 0.0
    for number in range(count):
        if number and rate > 0:
            clock += rng.expovariate(rate)
        out.append(clock)
    return out


def _agent_key(agent_id: str) -> tuple[int, int]:
    # "main" first, then sa1, sa2, ... in numeric order.
    return (0, 0) if agent_id == "main" else (1, int(agent_id[2:]))


def _float(row: dict[str, str], name: str, where: str) -> float | None:
    """A time column in seconds (None when empty): finite and within [0, MAX_TRACE_S]."""
    raw = row.get(name, "")
    if raw == "" or raw is None:
        return None
    return trace_seconds(raw, where, f"column {name!r}")


def _read_csv(
    path: Path, wanted: set[str] | None, count: int | None
) -> dict[str, dict[str, list[_Request]]]:
    traces: dict[str, dict[str, list[tuple[int, _Request]]]] = {}
    last_api: dict[tuple[str, str], float | None] = {}
    data = read_limited(path, MAX_TRACE_BYTES, "weka trace", WorkloadError)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise WorkloadError(f"weka trace {path}: not UTF-8 text") from None
    with io.StringIO(text, newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in _CSV_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise WorkloadError(f"{path}: missing column(s) {', '.join(missing)}")
        for line, row in enumerate(reader, start=2):
            trace = row["conversation_id"]
            if wanted is not None and trace not in wanted:
                continue
            if trace not in traces and count is not None and len(traces) >= count:
                continue
            where = f"{path}:{line}"
            agent = row["agent_id"]
            if agent != "main" and not (agent.startswith("sa") and agent[2:].isdigit()):
                raise WorkloadError(f"{where}: agent_id {agent!r} is neither main nor saK")
            try:
                index = int(row["turn_index"])
                prompt = int(row["prompt_tokens"])
                output = int(row["output_tokens"])
                shared = int(row["shared_prefix_tokens"])
            except ValueError as exc:
                raise WorkloadError(f"{where}: bad integer ({exc})") from None
            arrival = _float(row, "arrival_s", where) or 0.0
            think = _float(row, "think_time_s", where)
            if think is None:
                gap = _float(row, "gap_s", where) or 0.0
                think = max(0.0, gap - (last_api.get((trace, agent)) or 0.0))
            last_api[(trace, agent)] = _float(row, "api_time_s", where)
            req = _Request(arrival, prompt, output, shared, max(0.0, think))
            traces.setdefault(trace, {}).setdefault(agent, []).append((index, req))
    # Rows of one agent are ordered by turn_index, whatever order the file lists them in.
    ordered: dict[str, dict[str, list[_Request]]] = {}
    for trace, agents in traces.items():
        ordered[trace] = {
            agent: [req for _, req in sorted(rows, key=lambda pair: pair[0])]
            for agent, rows in agents.items()
        }
    return ordered


def _conversations(
    trace: str, agents: dict[str, list[_Request]], start_s: float, opts: _Options,
    render_blocks: bool, ns: int,
) -> list[Conversation]:
    out: list[Conversation] = []
    # With max_turns, the main agent stops early; sub-agents it spawned later never happen.
    main = agents.get("main") or []
    truncated = opts.max_turns is not None and len(main) > opts.max_turns
    cutoff = main[: opts.max_turns][-1].arrival_s if truncated and main else None
    for agent in sorted(agents, key=_agent_key):
        requests = agents[agent]
        if not requests:
            continue
        if agent != "main" and cutoff is not None and requests[0].arrival_s > cutoff:
            continue
        turns = _turns(requests, opts, continuation=not render_blocks)
        if render_blocks:
            turns = _with_blocks(turns, requests, opts.block_size, ns)
        system, task = _system_sizes(turns, opts)
        conv_id = trace if agent == "main" else f"{trace}.{agent}"
        out.append(
            Conversation(
                id=conv_id,
                start_s=round(start_s + opts.seconds(requests[0].arrival_s), 6),
                turns=turns,
                parent_id=None if agent == "main" else trace,
                seed=mix_seed("weka", conv_id),
                system_seed=mix_seed("weka-system", conv_id),
                system_prompt_tokens=system,
                task_tokens=task,
                render="blocks" if render_blocks else "chat",
            )
        )
    return out


def load_csv(
    path: str | Path | None = None,
    *,
    conversations: int | None = None,
    conversation_ids: Iterable[str] | None = None,
    max_turns: int | None = None,
    token_scale: float = 1.0,
    time_compression: float = 1.0,
    arrival_rate_per_s: float = 0.0,
    seed: int = 0,
    block_size: int = DEFAULT_BLOCK_SIZE,
    include_subagents: bool = True,
) -> Workload:
    """Load ``traces_flat.csv`` (the shipped copy by default) as a chat-rendered workload."""
    opts = _check_options(max_turns, token_scale, time_compression, block_size, arrival_rate_per_s)
    source = Path(path) if path is not None else CSV_PATH
    wanted = set(conversation_ids) if conversation_ids is not None else None
    traces = _read_csv(source, wanted, conversations)
    if wanted is not None and (absent := sorted(wanted - set(traces))):
        raise WorkloadError(f"{source}: no rows for conversation(s) {', '.join(absent)}")
    starts = _arrivals(len(traces), arrival_rate_per_s, seed)
    out: list[Conversation] = []
    for start, (trace, agents) in zip(starts, traces.items(), strict=True):
        if not include_subagents:
            agents = {a: r for a, r in agents.items() if a == "main"}
        out.extend(_conversations(trace, agents, opts.seconds(start), opts, False, 0))
    return Workload(
        name=f"weka-{len(traces)}",
        block_size=block_size,
        conversations=tuple(out),
        source=str(source),
        settings={
            "format": "weka_csv",
            "conversations": len(traces),
            "max_turns": max_turns or 0,
            "token_scale": token_scale,
            "time_compression": time_compression,
            "arrival_rate_per_s": arrival_rate_per_s,
            "seed": seed,
            "include_subagents": include_subagents,
        },
    )


# --- raw JSON -----------------------------------------------------------------------------------


def expand_hash_ids(hash_ids: Sequence[int], block_size: int, ns: int = 0) -> list[int]:
    """Expand 64-token block ids into ids of ``block_size``-token sub-blocks (same chaining)."""
    ratio = TRACE_BLOCK_SIZE // block_size
    return [ns + h * ratio + j for h in hash_ids for j in range(ratio)]


def _with_blocks(
    turns: Sequence[Turn], requests: Sequence[_Request], block_size: int, ns: int
) -> tuple[Turn, ...]:
    out: list[Turn] = []
    previous: BlockChain | None = None
    for turn, req in zip(turns, requests, strict=False):
        ids = expand_hash_ids(req.hash_ids or (), block_size, ns)
        chain = BlockChain.from_ids(ids, previous)
        out.append(
            Turn(turn.index, turn.think_time_s, turn.prompt_tokens, turn.output_tokens,
                 turn.shared_prefix_tokens, turn.new_input_tokens, turn.reset, chain)
        )
        previous = chain
    return tuple(out)


def _raw_requests(entries: Any, where: str) -> tuple[list[_Request], list[tuple[float, Any]]]:
    """Split a request list into normal requests and (spawn time, nested requests) sub-agents."""
    if not isinstance(entries, list):
        raise WorkloadError(f"{where}: 'requests' is not a list")
    requests: list[_Request] = []
    subagents: list[tuple[float, Any]] = []
    previous_ids: Sequence[int] = ()
    for number, entry in enumerate(entries):
        here = f"{where}: requests[{number}]"
        try:
            if entry.get("type") == "subagent":
                subagents.append((trace_seconds(entry["t"], here, "t"),
                                  entry.get("requests", [])))
                continue
            ids = [int(h) for h in entry["hash_ids"]]
            common = 0
            for a, b in zip(ids, previous_ids, strict=False):
                if a != b:
                    break
                common += 1
            requests.append(
                _Request(
                    arrival_s=trace_seconds(entry["t"], here, "t"),
                    prompt_tokens=int(entry["in"]),
                    output_tokens=int(entry["out"]),
                    shared_prefix_tokens=TRACE_BLOCK_SIZE * common if requests else 0,
                    think_time_s=trace_seconds(entry.get("think_time") or 0.0, here,
                                               "think_time"),
                    hash_ids=tuple(ids),
                )
            )
            previous_ids = ids
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, WorkloadError):
                raise
            raise WorkloadError(f"{here}: malformed request ({exc!r})") from None
    return requests, subagents


def load_raw(
    paths: Iterable[str | Path] | None = None,
    *,
    max_turns: int | None = None,
    time_compression: float = 1.0,
    arrival_rate_per_s: float = 0.0,
    seed: int = 0,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> Workload:
    """Load raw ``trace_NNNN.json`` files (the shipped copies by default), with block ids."""
    opts = _check_options(max_turns, 1.0, time_compression, block_size, arrival_rate_per_s)
    files = [Path(p) for p in paths] if paths is not None else sorted(RAW_DIR.glob("trace_*.json"))
    starts = _arrivals(len(files), arrival_rate_per_s, seed)
    out: list[Conversation] = []
    for number, (file, start) in enumerate(zip(files, starts, strict=True)):
        try:
            doc = json.loads(read_limited(file, MAX_TRACE_BYTES, "weka trace", WorkloadError))
        except UnicodeDecodeError:
            raise WorkloadError(f"weka trace {file}: not UTF-8 text") from None
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{file}:{exc.lineno}: not JSON ({exc.msg})") from None
        if not isinstance(doc, dict) or doc.get("block_size") != TRACE_BLOCK_SIZE:
            raise WorkloadError(f"{file}: expected a trace object with block_size 64")
        trace = str(doc.get("id") or file.stem)
        main, spawned = _raw_requests(doc.get("requests"), str(file))
        agents: dict[str, list[_Request]] = {"main": main}
        for k, (spawn, nested) in enumerate(spawned, start=1):
            child, _ = _raw_requests(nested, f"{file}: subagent {k}")
            # Nested times restart at 0 at spawn; shift them onto the parent's clock.
            agents[f"sa{k}"] = [
                _Request(spawn + r.arrival_s, r.prompt_tokens, r.output_tokens,
                         r.shared_prefix_tokens, r.think_time_s, r.hash_ids)
                for r in child
            ]
        # File-local hash ids: give each file its own id range.
        ns = (number + 1) << 40
        out.extend(_conversations(trace, agents, opts.seconds(start), opts, True, ns))
    return Workload(
        name=f"weka-raw-{len(files)}",
        block_size=block_size,
        conversations=tuple(out),
        source=",".join(str(f) for f in files),
        settings={
            "format": "weka_raw",
            "conversations": len(files),
            "max_turns": max_turns or 0,
            "token_scale": 1.0,
            "time_compression": time_compression,
            "arrival_rate_per_s": arrival_rate_per_s,
            "seed": seed,
        },
    )


__all__ = ["CSV_PATH", "DATA_DIR", "RAW_DIR", "TRACE_BLOCK_SIZE", "expand_hash_ids", "load_csv",
    "load_raw"]

"""Join one run's sources: a client's record of a turn takes the proxy log's evidence for it.

The benchmark's stats file and the proxy's log describe the same requests from two sides and
share no id (the benchmark never sees the X-Request-Id the proxy makes). They are joined by
conversation and time: a conversation's requests reach the proxy in the order the client sent
them, so, per conversation id, each client turn (by start) takes the next proxy request of
that conversation logged within its span of time, give or take :data:`TOLERANCE_NS` (vLLM's
proxy logs whole seconds, and the stats file's clock is placed by the file's modification time,
:mod:`.bench_stats`). Requests the proxy saw without a conversation id (the benchmark without
``--send-conversation-id``) are joined the same way by time alone, oldest first.

A proxy request no client turn took stays a turn of its own (the client lost or never recorded
it); a client turn no proxy request matched keeps only the client's evidence.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from kvscope.collector.ingest.bench_stats import BenchStats, BenchTurn, turn_ids
from kvscope.collector.ingest.proxy_log import ProxyLog, ProxyRequest

# Whole-second log times plus the stats file's clock anchor (its mtime, written right after the
# last response).
TOLERANCE_NS = 2_000_000_000


def _fits(turn: BenchTurn, offset_ns: int, request: ProxyRequest) -> bool:
    start = turn.start_ns + offset_ns
    end = turn.end_ns + offset_ns
    return start - TOLERANCE_NS <= request.time_ns <= end + TOLERANCE_NS


def _take(turns: list[tuple[BenchTurn, int, str]], requests: list[ProxyRequest]) -> int:
    """Greedy in time order: each turn takes the oldest request left that fits it."""
    joined = 0
    left = deque(sorted(requests, key=lambda r: (r.time_ns, r.line)))
    for turn, offset, sha256 in sorted(turns, key=lambda item: item[0].start_ns + item[1]):
        # Requests logged before this turn could start belong to nothing later either.
        while left and left[0].time_ns < turn.start_ns + offset - TOLERANCE_NS:
            left.popleft()
        if left and _fits(turn, offset, left[0]):
            request = left.popleft()
            request.joined_to = turn_ids(sha256, turn)
            turn.proxy = request
            joined += 1
    return joined


def join(stats: Sequence[BenchStats], logs: Sequence[ProxyLog]) -> int:
    """Attach proxy requests to the client turns they served; return how many were joined."""
    if not stats or not logs:
        return 0
    turns: dict[str | None, list[tuple[BenchTurn, int, str]]] = {}
    for part in stats:
        for turn in part.turns:
            turns.setdefault(turn.conversation_id, []).append(
                (turn, part.clock_offset_ns, part.sha256))
    requests: dict[str | None, list[ProxyRequest]] = {}
    for log in logs:
        for request in log.requests:
            if request.retried_by is None:  # a retried attempt served no client turn
                requests.setdefault(request.conversation_id, []).append(request)
    joined = sum(_take(turns.get(conv, []), found)
                 for conv, found in requests.items() if conv is not None)
    left = [item for items in turns.values() for item in items if item[0].proxy is None]
    return joined + _take(left, requests.get(None, []))


__all__ = ["TOLERANCE_NS", "join"]

"""Derived metrics, live: the reuse ledger kept current as spans arrive, for Prometheus.

``kvscope serve --db FILE`` answers ``GET /metrics`` on its OTLP/HTTP port with what the ledger
says about the turns received so far (turns by outcome and miss cause; reusable, reused-local,
reused-remote and recomputed tokens; invalid-reuse turns), what the engines report (retained KV
bytes per decode engine, GPU memory used and total), KV transfers by direction and status, and
TTFT, labelled by run (its label, and its id), model and engine.

Incremental, not a rebuild per scrape. :meth:`LiveLedger.refresh` (started by each scrape, in
a thread of its own that the scrape waits for at most :attr:`LiveMetrics.wait_s`) reads only
the span rows appended since the last refresh (``rowid`` above a watermark: one writer
appends, so row ids grow in commit order), and maps each to the *conversation* it belongs to:
a ``kvscope.turn`` span names it (run id + conversation id; a turn without a conversation id
is a unit of its own), a leg or tool-wait span by its trace id, an engine span (reuse
decision, KV transfer, retention) by its vLLM request id reduced to the X-Request-Id
(:func:`kvscope.analysis.ledger.request_key`). The new rows also go through the ledger's own
extraction (:data:`kvscope.analysis.ledger.QUERIES`, restricted to those row ids) and are kept in
memory, so the store is read once per row. Only the conversations that received a span are
recomputed: :func:`kvscope.analysis.ledger.build` runs on their spans alone (the kept frames
filtered by trace id and X-Request-Id), and their old contribution to each series is replaced by
the new one. A conversation is the unit because turn k's row reads turn k-1's (its prompt, output
and decode retention).

Bounded memory: a conversation no span touched for ``idle_s`` leaves memory (its kept span rows,
routing keys and contribution; the totals keep what it contributed), and the 64-bit hash of its
id and keys remembers it was let go (8 bytes each). A later turn or late span of it reads it
back from the store (:func:`kvscope.analysis.ledger_units.unit_frames`): what the totals hold
of it is recomputed from its spans up to the previous refresh that were not waiting unclaimed,
then replaced by its new contribution as for any conversation. A kept span no conversation
claims for ``idle_s`` is looked up in the store once (its conversation may have been let go) and
dropped.

Late spans: an engine or leg span that arrives *after* its turn was counted makes that
conversation dirty again, and its turns (outcome included) are recomputed at the next refresh; one
that arrives *before* its turn span waits in the kept frames and is found when the turn's
arrival recomputes the conversation. So a turn's outcome may change as evidence arrives
(``unknown`` → ``reused_remote``): the ledger series are gauges (turns *now* in each outcome),
not counters. Append-only facts — transfers and TTFT, one observation per span — are counters
and histograms.

The result equals a full rebuild (:func:`kvscope.analysis.ledger.ledger`) on the same store
(tests/analysis/test_live_metrics.py checks both, and the scrape against ``kvscope analyze``).
"""

from __future__ import annotations

import bisect
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import duckdb
import polars as pl
import pyarrow as pa
from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvscope import exposition, semconv
from kvscope.analysis import ledger as ledger_module
from kvscope.analysis import ledger_units
from kvscope.reuse import outcomes
from kvscope.store import query
from kvscope.store.duckdb_reader import DuckDBReader
from kvscope.store.reader import Reader

_LEG_SPANS = (semconv.SPAN_INPUT_PROCESSING, semconv.SPAN_GENERATION, semconv.SPAN_TOOL_WAIT)
_ENGINE_SPANS = (semconv.SPAN_REUSE_DECISION, semconv.SPAN_KV_TRANSFER, semconv.SPAN_KV_RETENTION)
_GAUGE_METRICS = (semconv.METRIC_KV_RETAINED, semconv.METRIC_GPU_MEMORY_USED,
                  semconv.METRIC_GPU_MEMORY_TOTAL)

# Series (Prometheus names; units in the name).
TURNS = "kvscope_turns"
REUSABLE_TOKENS = "kvscope_reusable_tokens"
REUSED_LOCAL_TOKENS = "kvscope_reused_local_tokens"
REUSED_REMOTE_TOKENS = "kvscope_reused_remote_tokens"
RECOMPUTED_TOKENS = "kvscope_recomputed_reusable_tokens"
INVALID_REUSE_TURNS = "kvscope_invalid_reuse_turns"
INVALID_REUSE_TOKENS = "kvscope_invalid_reuse_tokens"
RETAINED_BYTES = "kvscope_kv_retained_bytes"
GPU_USED_BYTES = "kvscope_gpu_memory_used_bytes"
GPU_TOTAL_BYTES = "kvscope_gpu_memory_total_bytes"
TRANSFER_BYTES = "kvscope_kv_transfer_bytes"  # counter: exposed with _total
TRANSFERS = "kvscope_kv_transfers"  # counter: exposed with _total
TRANSFER_SECONDS = "kvscope_kv_transfer_duration_seconds"
TTFT_SECONDS = "kvscope_ttft_seconds"
REFRESHES = "kvscope_live_refreshes"  # counter
RECOMPUTED_CONVERSATIONS = "kvscope_live_recomputed_conversations"  # counter
REFRESH_SECONDS = "kvscope_live_last_refresh_seconds"
PENDING_ROWS = "kvscope_live_pending_span_rows"

_LEDGER_LABELS = ("run", "run_id", "model", "engine")
# Series built from the ledger: name → (help, extra label names).
LEDGER_SERIES: dict[str, tuple[str, tuple[str, ...]]] = {
    TURNS: ("Turns in the ledger now, by outcome and its class (miss, reuse, invalid, first, "
            "unknown); a turn's outcome may change as late spans arrive",
            ("outcome", "outcome_class")),
    REUSABLE_TOKENS: ("Tokens of turns k>=2 whose KV earlier turns computed", ()),
    REUSED_LOCAL_TOKENS: ("Reusable tokens prefill found in its own prefix cache (turns k>=2 "
                          "with a measured reusable count)", ()),
    REUSED_REMOTE_TOKENS: ("Reusable tokens pulled from decode by a finished, valid read "
                           "(turns k>=2 with a measured reusable count)", ()),
    RECOMPUTED_TOKENS: ("Reusable tokens prefill computed again (turns k>=2)", ()),
    INVALID_REUSE_TURNS: ("Turns whose read from decode loaded KV that does not belong to their "
                          "prompt (outcome reused_invalid): a correctness alarm", ()),
    INVALID_REUSE_TOKENS: ("Tokens such reads loaded that do not belong to the prompt, where "
                           "countable (absent where no such read was countable: not 0)", ()),
}
OUTCOME_CLASSES = {
    **dict.fromkeys(outcomes.MISS_CAUSES, "miss"),
    **dict.fromkeys(outcomes.REUSE_OUTCOMES, "reuse"),
    outcomes.FIRST_TURN: "first",
    outcomes.REUSED_INVALID: "invalid",
    outcomes.UNKNOWN: "unknown",
}
GAUGE_SERIES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    semconv.METRIC_KV_RETAINED: (RETAINED_BYTES, "KV bytes a decode engine holds for later turns "
                                 "(its latest sample)", ("run", "run_id", "engine")),
    semconv.METRIC_GPU_MEMORY_USED: (GPU_USED_BYTES, "GPU memory in use (latest sample)",
                                     ("run", "run_id", "host", "gpu")),
    semconv.METRIC_GPU_MEMORY_TOTAL: (GPU_TOTAL_BYTES, "GPU memory in total (latest sample)",
                                      ("run", "run_id", "host", "gpu")),
}
_TRANSFER_LABELS = ("run", "run_id", "engine", "direction", "status")

Labels = tuple[str, ...]
SeriesKey = tuple[str, Labels]


def _a(key: str) -> str:
    return f"SpanAttributes['{key}']"


# Only the columns the refresh needs to route a new span and count what is append-only.
_NEW_SPANS_SQL = (
    f"SELECT rowid AS row, SpanName AS name, TraceId AS trace_id, "
    f"ResourceAttributes['{semconv.RUN_ID}'] AS run_id, "
    f"{_a(semconv.GEN_AI_CONVERSATION_ID)} AS conversation_id, "
    f"{_a(semconv.X_REQUEST_ID)} AS x_request_id, {_a(semconv.VLLM_REQUEST_ID)} AS request_id, "
    f"{_a(semconv.GEN_AI_REQUEST_MODEL)} AS model, {_a(semconv.TTFT_MS)} AS ttft_ms, "
    f"{_a(semconv.ENGINE_ID)} AS engine, {_a(semconv.TRANSFER_DIRECTION)} AS direction, "
    f"{_a(semconv.TRANSFER_STATUS)} AS status, {_a(semconv.TRANSFER_BYTES)} AS size_bytes, "
    f"Duration AS duration_ns, epoch_ns(Timestamp) + Duration AS end_ns "
    f"FROM otel_traces WHERE rowid > $low AND rowid <= $high"
)

# Per conversation, the row of its last stored turn (a first refresh's catch-up, below).
_LAST_TURNS_SQL = (
    f"SELECT ResourceAttributes['{semconv.RUN_ID}'] AS run_id, "
    f"{_a(semconv.GEN_AI_CONVERSATION_ID)} AS conversation_id, max(rowid) AS last_row "
    f"FROM otel_traces WHERE rowid <= $high AND SpanName = $turn "
    f"AND {_a(semconv.GEN_AI_CONVERSATION_ID)} IS NOT NULL GROUP BY 1, 2"
)
_NEW_GAUGES_SQL = (
    f"SELECT ResourceAttributes['{semconv.RUN_ID}'] AS run_id, MetricName AS metric, "
    f"Attributes['{semconv.ENGINE_ID}'] AS engine, Attributes['{semconv.GPU_HOST}'] AS host, "
    f"Attributes['{semconv.GPU_INDEX}'] AS gpu, TimeUnix AS time, Value AS value "
    f"FROM otel_metrics_gauge WHERE rowid > $low AND rowid <= $high "
    f"AND list_contains($metrics, MetricName)"
)


unit_key = ledger_units.unit_key
_unit_expr = ledger_units.unit_expr
# Kept frames keyed by trace id, and by request key (vLLM's request id reduced to the
# X-Request-Id: a precomputed ``_key`` column, so a refresh does not apply the regexes again to
# every kept row); turn rows carry their unit (``_unit``).
_BY_TRACE = ("prefill", "decode", "waits")
_BY_REQUEST = ("decisions", "transfers", "retentions", "vllm_requests")


def _keyed(name: str, frame: pl.DataFrame) -> pl.DataFrame:
    """``frame`` (rows entering the kept frames) with its look-up column."""
    if name == "turns":
        return frame.with_columns(_unit_expr().alias("_unit"))
    if name in _BY_REQUEST:
        return frame.with_columns(ledger_module.request_key("request_id").alias("_key"))
    return frame


class _Seen:
    """The strings let go, each with a row at or before the first store row of its spans,
    kept as 64-bit hashes and rows (16 bytes a string): "was this conversation, or this
    span's key, ever let go?", and "from which row on is it in the store?". Exact but for a
    hash collision (among 10M strings, one with probability ~3e-6: it costs a read of the
    store, as any "yes" does; strings whose hashes collide share the lower row, so a row is
    never after its string's first one).

    It was a fixed 1 MiB Bloom filter: at 1M stored turns it held ~2M strings and said "yes"
    for ~16 % of those never added, so each refresh read ~300 conversations back from the store
    for nothing (5 s a refresh instead of under 1 s, ``bench_live_metrics.py --base``). Memory
    now grows with what was let go, 16 bytes a string (~40 MB at 1M turns), where the kept
    conversations' spans it replaces cost hundreds of bytes each. The rows bound what a read
    back scans (a store scan restricted to ``rowid > row`` skips the row groups before it:
    13-20 ms instead of 704 ms for an attribute filter over 6.9M spans). The hash is Python's
    own (SipHash, keyed per process: nothing here outlives the process). Hashes are sorted in
    an ``array('Q')`` (looked up by bisection), their rows beside them in an ``array('q')``;
    new ones wait in a dict until they are a sixteenth of it (at least 64Ki), then are merged
    in by one sort.
    """

    _MASK = (1 << 64) - 1

    def __init__(self) -> None:
        self._sorted = array("Q")
        self._rows = array("q")
        self._pending: dict[int, int] = {}

    def __len__(self) -> int:
        self._merge()
        return len(self._sorted)

    def add(self, text: str, row: int) -> None:
        self.update({text: row})

    def update(self, rows: Mapping[str, int]) -> None:
        """Add each string with its row (a string added again keeps the lower row)."""
        mask, pending = self._MASK, self._pending
        for text, row in rows.items():
            value = hash(text) & mask
            known = pending.get(value)
            pending[value] = row if known is None else min(known, row)
        if len(pending) >= max(1 << 16, len(self._sorted) >> 4):
            self._merge()

    def __contains__(self, text: str) -> bool:
        return self.first_row(text) is not None

    def first_row(self, text: str) -> int | None:
        """The row ``text`` was added with (the lowest, if more than once); None if never."""
        if not self._sorted and not self._pending:
            return None
        value = hash(text) & self._MASK
        pending = self._pending.get(value)
        at = bisect.bisect_left(self._sorted, value)
        stored = (self._rows[at] if at < len(self._sorted) and self._sorted[at] == value
                  else None)
        if pending is None or stored is None:
            return pending if stored is None else stored
        return min(pending, stored)

    def lowest_row(self, texts: Iterable[str]) -> int | None:
        """The lowest row of those of ``texts`` added; None when none was."""
        rows = [row for row in map(self.first_row, texts) if row is not None]
        return min(rows, default=None)

    def _merge(self) -> None:
        if not self._pending:
            return
        hashes = array("Q", self._sorted)
        hashes.extend(self._pending.keys())
        rows = array("q", self._rows)
        rows.extend(self._pending.values())
        merged = (pl.DataFrame({"h": _uint64s(hashes), "r": _int64s(rows)})
                  .group_by("h").agg(pl.col("r").min()).sort("h"))
        self._sorted = array("Q", merged["h"].to_arrow().buffers()[1].to_pybytes()[
            :8 * merged.height])
        self._rows = array("q", merged["r"].to_arrow().buffers()[1].to_pybytes()[
            :8 * merged.height])
        self._pending = {}


def _first_row_by(frame: pl.DataFrame, column: str) -> pl.DataFrame:
    """``column``'s values (not null) with the first row of each in ``frame``."""
    return (frame.filter(pl.col(column).is_not_null())
            .group_by(column).agg(pl.col("_row").min()))


def _uint64s(values: array) -> pl.Series:
    return pl.Series(pa.Array.from_buffers(pa.uint64(), len(values),
                                           [None, pa.py_buffer(values)]))


def _int64s(values: array) -> pl.Series:
    return pl.Series(pa.Array.from_buffers(pa.int64(), len(values),
                                           [None, pa.py_buffer(values)]))


def contributions(rows: pl.DataFrame, models: pl.DataFrame, labels_of_run: dict[str, str]
                  ) -> dict[str, dict[SeriesKey, float]]:
    """Each unit's contribution to every ledger series, from its ledger rows (pure).

    The token sums follow :func:`kvscope.analysis.reuse.reuse_table` (turns k >= 2; local and
    remote over turns whose reusable count was measured), the turn counts
    :func:`kvscope.analysis.causes.cause_table` (which leaves first turns out; here they are
    ``outcome="first_turn"``).
    """
    if rows.is_empty():
        return {}
    c = pl.col
    frame = rows.join(models.unique("x_request_id", keep="first"), on="x_request_id", how="left")
    frame = frame.with_columns(
        unit=_unit_expr(),
        run_id_label=c("run_id").fill_null(""),
        model_label=c("model").fill_null(""),
        engine_label=c("prefill_engine").fill_null(""),
    )
    later = c("turn_index") >= 2
    measured = later & c("reusable_tokens").is_not_null()
    keys = ["unit", "run_id_label", "model_label", "engine_label"]
    measured_sums = {REUSABLE_TOKENS: c("reusable_tokens").filter(later),
                     REUSED_LOCAL_TOKENS: c("local_hit_tokens").filter(measured),
                     REUSED_REMOTE_TOKENS: c("remote_reused_tokens").filter(measured),
                     RECOMPUTED_TOKENS: c("recomputed_reusable_tokens").filter(later)}
    tokens = frame.group_by(keys).agg(
        *(values.sum().alias(name) for name, values in measured_sums.items()),
        # Values measured per sum: a unit with none adds no series (absent, not 0).
        *(values.count().alias(f"_measured {name}") for name, values in measured_sums.items()),
        (c("outcome") == outcomes.REUSED_INVALID).sum().alias(INVALID_REUSE_TURNS),
        c("invalid_tokens").filter(c("outcome") == outcomes.REUSED_INVALID).sum()
        .alias(INVALID_REUSE_TOKENS),
        # Invalid turns whose loaded-token count was measured: none, and the series is absent.
        c("invalid_tokens").filter(c("outcome") == outcomes.REUSED_INVALID).is_not_null().sum()
        .alias("invalid_tokens_counted"),
    )
    turns = frame.group_by([*keys, "outcome"]).agg(pl.len().alias("turns"))
    result: dict[str, dict[SeriesKey, float]] = {}
    for row in tokens.iter_rows(named=True):
        labels = _ledger_labels(row, labels_of_run)
        into = result.setdefault(row["unit"], {})
        for name in (REUSABLE_TOKENS, REUSED_LOCAL_TOKENS, REUSED_REMOTE_TOKENS,
                     RECOMPUTED_TOKENS, INVALID_REUSE_TURNS):
            if row.get(f"_measured {name}", 1):
                into[(name, labels)] = float(row[name] or 0)
        # Not measured is not 0: no invalid turn with a counted size, no invalid-token series.
        if row["invalid_tokens_counted"]:
            into[(INVALID_REUSE_TOKENS, labels)] = float(row[INVALID_REUSE_TOKENS])
    for row in turns.iter_rows(named=True):
        outcome = row["outcome"]
        labels = (*_ledger_labels(row, labels_of_run), outcome,
                  OUTCOME_CLASSES.get(outcome, "unknown"))
        result.setdefault(row["unit"], {})[(TURNS, labels)] = float(row["turns"])
    return result


def _ledger_labels(row: dict, labels_of_run: dict[str, str]) -> Labels:
    run_id = row["run_id_label"]
    return (labels_of_run.get(run_id, run_id), run_id, row["model_label"], row["engine_label"])


@dataclass
class _Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
        return out


@dataclass(frozen=True)
class _View:
    """What a scrape shows: the series as of the end of the last refresh step (copies)."""

    totals: dict[SeriesKey, float] = field(default_factory=dict)
    gauges: dict[SeriesKey, tuple[object, float]] = field(default_factory=dict)
    transfers: dict[Labels, float] = field(default_factory=dict)
    transfer_bytes: dict[Labels, float] = field(default_factory=dict)
    transfer_s: dict[Labels, _Histogram] = field(default_factory=dict)
    ttft: dict[Labels, _Histogram] = field(default_factory=dict)
    refreshes: int = 0
    recomputed_conversations: int = 0
    last_refresh_s: float | None = None
    # Span rows stored but not read yet (a refresh in steps, as of its last step).
    pending_rows: int = 0


def _copies(histograms: dict[Labels, _Histogram]) -> dict[Labels, _Histogram]:
    return {labels: _Histogram(h.buckets, list(h.counts), h.total)
            for labels, h in histograms.items()}


class LiveLedger:
    """The ledger's series over one store, kept current by :meth:`refresh` (thread-safe).

    ``con`` is a connection to the store (the receiver's own: ``writer.connection``); the live
    ledger reads through cursors of its own and never writes. A conversation no span has
    touched for ``idle_s`` seconds leaves memory (None: none ever does); see the module's
    docstring for what brings it back.
    """

    # The most span rows one step of a refresh reads (see :meth:`refresh`).
    step_rows = 250_000
    # Up to this many new span rows, a refresh reads them as DuckDBReader's small_results.
    small_rows = 25_000

    def __init__(self, con: duckdb.DuckDBPyConnection, *, idle_s: float | None = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._con = con
        # The in-memory engine each recomputation's per-turn SQL runs on (kept: a connect per
        # refresh cost ~15 ms of a ~300 ms refresh).
        self._engine = duckdb.connect()
        self._lock = threading.Lock()
        self._idle_s = idle_s
        self._clock = clock
        self._span_mark = -1
        self._gauge_mark = -1
        # (refresh time, span mark then): when each row arrived, for as long as idle_s.
        self._marks: deque[tuple[float, int]] = deque()
        self._unit_of_key: dict[str, str] = {}  # X-Request-Id or trace id → unit
        # ... and back: a refresh's work on a few conversations must not walk every key kept.
        self._keys_of_unit: dict[str, set[str]] = {}
        self._contribution: dict[str, dict[SeriesKey, float]] = {}
        self._last_seen: dict[str, float] = {}  # resident unit → when a span last touched it
        # Conversations let go, and keys of spans dropped unmatched: a unit or turn that may
        # be among them is read back from the store, not from the kept frames.
        self._let_go = _Seen()
        self._unapplied: set[int] = set()  # rows dropped unclaimed by this refresh
        # The ledger's span frames (ledger.QUERIES, with each span's rowid as ``_row``) of the
        # resident conversations and of spans whose turn has not arrived; turn → model.
        self._frames: dict[str, pl.DataFrame] = {}
        self._models: pl.DataFrame | None = None
        self._totals: dict[SeriesKey, float] = {}
        # How many units contribute to each series: a series none measures is absent, not 0.
        self._contributors: dict[SeriesKey, int] = {}
        self._gauges: dict[SeriesKey, tuple[object, float]] = {}  # → (sample time, value)
        self._transfer_bytes: dict[Labels, float] = {}
        self._transfers: dict[Labels, float] = {}
        self._transfer_s: dict[Labels, _Histogram] = {}
        self._ttft: dict[Labels, _Histogram] = {}
        self._labels_of_run: dict[str, str] = {}
        # The newest span end read (ns); a first refresh's conversations → their newest turn's
        # end, while it runs (kept for those let go: a later step may bring one back).
        self._newest_end: int | None = None
        self._turn_end: dict[str, int] | None = None
        self.refreshes = 0
        self.recomputed_conversations = 0
        # What collect() and totals() read: replaced whole after each step of a refresh, so a
        # scrape never waits for a refresh in progress (a restart's reads the whole store).
        self._view = _View()
        self._view_lock = threading.Lock()
        # Set by stop(): a refresh in progress ends after its current step.
        self._stopping = threading.Event()
        self.store_reads = 0  # conversations read back from the store
        self.last_refresh_s: float | None = None

    # -- refresh ---------------------------------------------------------------------------------
    def refresh(self) -> int:
        """Read the rows appended since the last refresh; recompute the conversations they touch.

        More than :attr:`step_rows` new rows (a first refresh over a large store: ``kvscope
        serve`` restarted on it) are read in steps of that many, each as a refresh of its own,
        so what one step holds is bounded. In a first refresh, a conversation whose newest turn
        ended ``idle_s`` or more before the newest span read so far, and none of whose turns is
        stored further on, leaves memory after the step (its contribution stays in the totals):
        history is idle by its own spans' clock, not held for ``idle_s`` of this process's, and
        what stays is the conversations open at that point of the store.

        Returns how many conversations were recomputed.
        """
        with self._lock:
            started = time.perf_counter()
            now = self._clock()
            cursor = self._con.cursor()
            touched: set[str] = set()
            try:
                reader = DuckDBReader(cursor, time_limit_s=None)
                _, top = reader.rows(query.Query("SELECT max(rowid) FROM otel_traces",
                                                 name="last span row"))
                high = top[0][0]
                # A scrape's few new rows: each statement bound once (DuckDBReader).
                reader.small_results = (high is not None
                                        and high - self._span_mark <= self.small_rows)
                self._publish(pending=0 if high is None else max(high - self._span_mark, 0))
                ends: dict[str, int] = {}
                idle_ns = None if self._idle_s is None else int(self._idle_s * 1e9)
                catching_up = self._span_mark < 0 and idle_ns is not None and high is not None
                last_turn: dict[str, int] = {}
                if catching_up:
                    self._turn_end = ends
                    _, rows = reader.rows(query.Query(
                        _LAST_TURNS_SQL, {"high": high, "turn": semconv.SPAN_TURN},
                        name="last turn rows"))
                    last_turn = {unit_key(run, conversation, None): row
                                 for run, conversation, row in rows}
                self._read_gauges(reader)
                while True:
                    step = (None if high is None
                            else min(high, max(self._span_mark, -1) + self.step_rows))
                    touched |= self._step(reader, step, now)
                    if catching_up and idle_ns is not None and self._newest_end is not None:
                        # Idle by the spans' own clock, as of the newest span read so far, and
                        # no turn of it stored further on (else a later step reads it back).
                        old_before = self._newest_end - idle_ns
                        self._let_units_go({u for u in self._last_seen
                                            if ends.get(u, old_before) < old_before
                                            and last_turn.get(u, -1) <= (step or -1)})
                    if step is None or step >= high or self._stopping.is_set():
                        break
                    self._publish(pending=high - step)
            finally:
                self._turn_end = None
                cursor.close()
            self.refreshes += 1
            self.recomputed_conversations += len(touched)
            self.last_refresh_s = time.perf_counter() - started
            self._publish(pending=0 if high is None else max(high - self._span_mark, 0))
            return len(touched)

    def stop(self) -> None:
        """End a refresh in progress after its current step (the store is about to close)."""
        self._stopping.set()

    def _publish(self, *, pending: int) -> None:
        view = _View(dict(self._totals), dict(self._gauges), dict(self._transfers),
                     dict(self._transfer_bytes), _copies(self._transfer_s), _copies(self._ttft),
                     self.refreshes, self.recomputed_conversations, self.last_refresh_s,
                     pending)
        with self._view_lock:
            self._view = view

    def _step(self, reader: Reader, high: int | None, now: float) -> set[str]:
        """One step of a refresh: the rows up to ``high``; the conversations recomputed."""
        previous = self._span_mark
        dirty = self._read_spans(reader, high)
        self._unapplied = set()
        dirty |= self._drop_unmatched(reader, now)
        if dirty:
            self._recompute(reader, dirty, previous, now)
        self._let_idle_go(now)
        self._marks.append((now, self._span_mark))
        return dirty

    def _run_label(self, reader: Reader, run_id: str) -> str:
        label = self._labels_of_run.get(run_id)
        if label is None:
            _, rows = reader.rows(query.Query(
                "SELECT label FROM kvscope_runs WHERE run_id = $run", {"run": run_id},
                name="run label"))
            # Spans of a run the store has no row for keep the id as their label.
            label = self._labels_of_run[run_id] = rows[0][0] if rows else run_id
        return label

    def _read_spans(self, reader: Reader, high: int | None) -> set[str]:
        if high is None or high <= self._span_mark:
            return set()
        new = reader.frame(query.Query(_NEW_SPANS_SQL, {"low": self._span_mark, "high": high},
                                       name="new spans")).with_columns(
            ledger_module.request_key("request_id").alias("request_key"))
        ends = new["end_ns"].drop_nulls()
        if ends.len():
            newest = int(ends.cast(pl.Int64).max())  # type: ignore[arg-type]
            self._newest_end = max(newest, self._newest_end or newest)
        # The ledger's own extraction, of the new rows only, kept: a recomputation filters
        # these frames by key instead of reading the store again.
        for name, extraction in ledger_module.QUERIES.items():
            # The live ledger reads its own DuckDB store: the DuckDB text, rows past the mark;
            # each span with its row (a span sent twice is read twice: kept once, below).
            fresh = _keyed(name, reader.frame(query.Query(
                extraction.sql.replace("SELECT DISTINCT ", "SELECT rowid AS _row, ", 1)
                + " AND rowid > $row_low AND rowid <= $row_high",
                {**extraction.params, "row_low": self._span_mark, "row_high": high})))
            kept = self._frames.get(name)
            # Without a rechunk: appending must not copy what is kept.
            self._frames[name] = fresh if kept is None else pl.concat(
                [kept, fresh], how="vertical_relaxed", rechunk=False)
        models = new.filter(pl.col("name") == semconv.SPAN_TURN).select("x_request_id", "model")
        self._models = models if self._models is None else pl.concat(
            [self._models, models], rechunk=False)
        self._span_mark = high
        dirty: set[str] = set()
        traces: set[str] = set()
        requests: set[str] = set()
        for span in new.iter_rows(named=True):
            name = span["name"]
            run_id = span["run_id"] or ""
            if run_id and run_id not in self._labels_of_run:
                self._run_label(reader, run_id)
            if name == semconv.SPAN_TURN:
                unit = unit_key(span["run_id"], span["conversation_id"], span["x_request_id"])
                for turn_key in (span["x_request_id"], span["trace_id"]):
                    if turn_key is not None:
                        self._claim(turn_key, unit)
                dirty.add(unit)
                if self._turn_end is not None and span["end_ns"] is not None:
                    self._turn_end[unit] = max(self._turn_end.get(unit, span["end_ns"]),
                                               span["end_ns"])
                ttft = _number(span["ttft_ms"])
                if ttft is not None:
                    labels = (self._labels_of_run.get(run_id, run_id), run_id,
                              span["model"] or "")
                    self._ttft.setdefault(
                        labels, _Histogram(exposition.VLLM_TTFT_BUCKETS_S)).observe(ttft / 1e3)
                continue
            key: str | None
            if name in _LEG_SPANS:
                key = span["trace_id"]
            elif name in _ENGINE_SPANS:
                key = span["request_key"]
                if name == semconv.SPAN_KV_TRANSFER:
                    self._count_transfer(span, run_id)
            else:
                continue
            # A span whose turn has not arrived waits in the frames: the turn's arrival
            # recomputes its conversation, which finds it there.
            known = None if key is None else self._unit_of_key.get(key)
            if known is not None:
                dirty.add(known)
            elif key is not None and key in self._let_go:
                # Maybe a late span of a conversation let go: the store says whose it is.
                (traces if name in _LEG_SPANS else requests).add(key)
        if traces or requests:
            # Their turns are at or after the rows the keys were let go with.
            low = self._let_go.lowest_row(traces | requests)
            dirty.update(ledger_units.units_of(
                reader, traces, requests, low=None if low is None else low - 1)["unit"].to_list())
        return dirty

    def _count_transfer(self, span: dict, run_id: str) -> None:
        labels = (self._labels_of_run.get(run_id, run_id), run_id, span["engine"] or "",
                  span["direction"] or "", span["status"] or "")
        self._transfers[labels] = self._transfers.get(labels, 0.0) + 1
        size = _number(span["size_bytes"])
        if size is not None:
            self._transfer_bytes[labels] = self._transfer_bytes.get(labels, 0.0) + size
        if span["duration_ns"] is not None:
            self._transfer_s.setdefault(labels, _Histogram(exposition.LATENCY_BUCKETS_S)).observe(
                span["duration_ns"] / 1e9)

    def _read_gauges(self, reader: Reader) -> None:
        _, top = reader.rows(query.Query("SELECT max(rowid) FROM otel_metrics_gauge",
                                         name="last gauge row"))
        high = top[0][0]
        if high is None or high <= self._gauge_mark:
            return
        new = reader.frame(query.Query(
            _NEW_GAUGES_SQL, {"low": self._gauge_mark, "high": high,
                              "metrics": list(_GAUGE_METRICS)}, name="new gauge samples"))
        self._gauge_mark = high
        for sample in new.iter_rows(named=True):
            run_id = sample["run_id"] or ""
            label = self._run_label(reader, run_id) if run_id else ""
            if sample["metric"] == semconv.METRIC_KV_RETAINED:
                labels: Labels = (label, run_id, sample["engine"] or "")
            else:
                labels = (label, run_id, sample["host"] or "", sample["gpu"] or "")
            key = (sample["metric"], labels)
            previous = self._gauges.get(key)
            # The latest sample by its own time: batches from several processes interleave.
            if previous is None or sample["time"] >= previous[0]:
                self._gauges[key] = (sample["time"], float(sample["value"]))

    # -- which rows belong to which conversation ---------------------------------------------------
    def _claim(self, key: str, unit: str) -> None:
        """``key`` (an X-Request-Id or trace id) names a turn of ``unit`` from now on."""
        before = self._unit_of_key.get(key)
        if before == unit:
            return
        if before is not None:
            others = self._keys_of_unit[before]
            others.discard(key)
            if not others:
                del self._keys_of_unit[before]
        self._unit_of_key[key] = unit
        self._keys_of_unit.setdefault(unit, set()).add(key)

    def _keys(self, units: Iterable[str]) -> list[str]:
        """The keys naming turns of ``units``."""
        return [key for unit in units for key in self._keys_of_unit.get(unit, ())]

    def _membership(self, units: Iterable[str] | None) -> dict[str, pl.Expr]:
        """Per frame, the rows of ``units`` (None: of every unit whose turn is known)."""
        chosen = (set(self._last_seen) | set(self._keys_of_unit) if units is None
                  else set(units))
        # One Series for every frame's test (a list is converted again at each use).
        keys = pl.Series(list(self._unit_of_key) if units is None else self._keys(chosen),
                         dtype=pl.String).implode()
        return {
            "turns": pl.col("_unit").is_in(pl.Series(list(chosen), dtype=pl.String).implode()),
            **{name: pl.col("trace_id").is_in(keys) for name in _BY_TRACE},
            **{name: pl.col("_key").is_in(keys) for name in _BY_REQUEST},
        }

    def _drop_unmatched(self, reader: Reader, now: float) -> set[str]:
        """Drop kept spans no resident conversation claimed for ``idle_s``; the conversations
        the store says they belong to (ones let go) are returned, to be read back."""
        if self._idle_s is None or not self._frames:
            return set()
        cut = max((mark for at, mark in self._marks if at <= now - self._idle_s), default=None)
        while self._marks and self._marks[0][0] <= now - self._idle_s:
            self._marks.popleft()
        if cut is None:
            return set()
        claimed = self._membership(None)
        traces: dict[str, int] = {}
        keys: dict[str, int] = {}
        for name, frame in self._frames.items():
            aged = (pl.col("_row") <= cut) & ~claimed[name].fill_null(False)
            dropped = frame.filter(aged)
            if not dropped.height:
                continue
            self._frames[name] = frame.filter(~aged)
            self._unapplied.update(dropped["_row"].to_list())
            if name == "turns":
                continue  # a turn span always has its unit, resident (claimed) or let go
            column, found = ("trace_id", traces) if name in _BY_TRACE else ("_key", keys)
            for key, row in _first_row_by(dropped, column).iter_rows():
                found[key] = min(row, found.get(key, row))
        self._let_go.update(traces)
        self._let_go.update(keys)
        if not traces and not keys:
            return set()
        # A turn span of these keys is after their dropped spans (all rows up to them were
        # read, and a turn read before would have claimed them), or its conversation was let
        # go, with a row lower still.
        low = self._let_go.lowest_row([*traces, *keys])
        return set(ledger_units.units_of(reader, traces, keys,
                                         low=None if low is None else low - 1)["unit"].to_list())

    def _let_idle_go(self, now: float) -> None:
        """Conversations idle for ``idle_s`` leave memory: their spans, keys and contribution
        (which stays in the totals)."""
        if self._idle_s is None:
            return
        self._let_units_go({u for u, seen in self._last_seen.items()
                            if now - seen >= self._idle_s})

    def _let_units_go(self, idle: set[str]) -> None:
        """``idle`` (resident conversations) leave memory: their spans, keys and contribution
        (which stays in the totals)."""
        if not idle:
            return
        mine = self._membership(idle)
        keys = self._keys(idle)
        first = self._first_rows(idle, keys)
        for name, frame in self._frames.items():
            self._frames[name] = frame.filter(~mine[name].fill_null(False))
        if self._models is not None:
            self._models = self._models.filter(
                ~pl.col("x_request_id").is_in(pl.Series(keys, dtype=pl.String).implode()))
        # Each key with its conversation's first row: a read back starts there.
        self._let_go.update({key: first.get(self._unit_of_key[key], 0) for key in keys})
        self._let_go.update({unit: first.get(unit, 0) for unit in idle})
        for key in keys:
            del self._unit_of_key[key]
        for unit in idle:
            self._keys_of_unit.pop(unit, None)
            del self._last_seen[unit]
            self._contribution.pop(unit, None)

    def _first_rows(self, units: set[str], keys: list[str]) -> dict[str, int]:
        """Each of ``units``' first row among the kept spans (``keys``: theirs). Every span
        of a resident conversation up to the mark is kept (a read back brought back what was
        let go or dropped), so it is the conversation's first row in the store."""
        owner = pl.DataFrame({"key": keys, "unit": [self._unit_of_key[k] for k in keys]},
                             schema={"key": pl.String, "unit": pl.String})
        parts = []
        for name, frame in self._frames.items():
            if name == "turns":
                part = frame.filter(pl.col("_unit").is_in(
                    pl.Series(list(units), dtype=pl.String).implode())).select(
                        unit=pl.col("_unit"), row=pl.col("_row"))
            else:
                column = "trace_id" if name in _BY_TRACE else "_key"
                part = frame.select(key=pl.col(column), row=pl.col("_row")).join(
                    owner, on="key").select("unit", "row")
            parts.append(part)
        if not parts:
            return {}
        firsts = pl.concat(parts).group_by("unit").agg(pl.col("row").min())
        return dict(firsts.iter_rows())

    def _first_row_of(self, units: list[str]) -> int | None:
        """A row before every stored span of ``units`` (read back: let go, or owning dropped
        spans; their kept spans stay kept); None when one's rows are not known."""
        lows = []
        for unit in units:
            low = self._let_go.lowest_row([unit, *self._keys_of_unit.get(unit, ())])
            if low is None:
                return None
            lows.append(low)
        return min(lows) - 1 if lows else None

    def _maybe_let_go(self, units: set[str]) -> list[str]:
        """Those of ``units`` (not resident) that may have been let go, or own dropped spans."""
        if not len(self._let_go):
            return []
        return sorted(u for u in units if u in self._let_go
                      or any(k in self._let_go for k in self._keys_of_unit.get(u, ())))

    def _read_back(self, reader: Reader, units: list[str], previous: int) -> None:
        """Make ``units`` resident again from the store: their spans into the frames, and as
        their contribution what the totals hold of them (their spans up to ``previous`` that
        were not waiting in the frames unclaimed)."""
        self.store_reads += len(units)
        stored = {name: _keyed(name, frame) for name, frame in ledger_units.unit_frames(
            reader, units, high=self._span_mark, rows=True,
            low=self._first_row_of(units)).items()}
        # The rows waiting (kept, or dropped this step), as one Series for every frame's test
        # (not Python objects: a few hundred thousand rows are kept).
        waiting = pl.concat([pl.Series(sorted(self._unapplied), dtype=pl.Int64),
                             *(frame["_row"].cast(pl.Int64) for frame in self._frames.values())]
                            ).implode()
        counted = {name: frame.filter((pl.col("_row") <= previous)
                                      & ~pl.col("_row").cast(pl.Int64).is_in(waiting))
                   for name, frame in stored.items()}
        turns = stored["turns"]
        for row in turns.select("x_request_id", "trace_id", "_unit").iter_rows():
            for key in row[:2]:
                if key is not None:
                    self._claim(key, row[2])
        models = _models_of(reader, turns["x_request_id"].drop_nulls().unique().to_list())
        before = contributions(ledger_module.build(_bare(counted), across_conversations=False,
                                                   con=self._engine),
                               models, self._labels_of_run)
        for unit in units:
            self._contribution[unit] = before.get(unit, {})
        for name, frame in stored.items():
            kept = self._frames.get(name)
            if kept is None:
                self._frames[name] = frame
                continue
            kept = kept.filter(~pl.col("_row").is_in(frame["_row"].to_list()))
            self._frames[name] = pl.concat([kept, frame.select(kept.columns)],
                                           how="vertical_relaxed", rechunk=False)
        self._models = models if self._models is None else pl.concat(
            [self._models.filter(~pl.col("x_request_id").is_in(models["x_request_id"].to_list())),
             models], how="vertical_relaxed", rechunk=False)

    def _recompute(self, reader: Reader, dirty: set[str], previous: int,
                   now: float) -> None:
        back = self._maybe_let_go({u for u in dirty if u not in self._last_seen})
        if back:
            self._read_back(reader, back, previous)
        for unit in dirty:
            self._last_seen[unit] = now
        frames = dict(self._frames)
        turns = frames["turns"].filter(
            pl.col("_unit").is_in(pl.Series(list(dirty), dtype=pl.String).implode()))
        traces = turns["trace_id"].unique().implode()
        requests = turns["x_request_id"].unique().drop_nulls().implode()
        frames["turns"] = turns
        for name in _BY_TRACE:
            frames[name] = frames[name].filter(pl.col("trace_id").is_in(traces))
        for name in _BY_REQUEST:
            frames[name] = frames[name].filter(pl.col("_key").is_in(requests))
        assert self._models is not None
        models = self._models.filter(pl.col("x_request_id").is_in(requests))
        rows = ledger_module.build(_bare(frames), across_conversations=False, con=self._engine)
        fresh = contributions(rows, models, self._labels_of_run)
        for unit in dirty:
            for key, value in self._contribution.pop(unit, {}).items():
                self._totals[key] -= value
                self._contributors[key] -= 1
                if not self._contributors[key]:
                    # No unit measures it any more: absent, not 0.
                    del self._totals[key], self._contributors[key]
            new = fresh.get(unit)
            if new:
                self._contribution[unit] = new
                for key, value in new.items():
                    self._totals[key] = self._totals.get(key, 0.0) + value
                    self._contributors[key] = self._contributors.get(key, 0) + 1

    def resident(self) -> dict[str, int]:
        """What the live ledger holds now: conversations, kept span rows, routing keys."""
        with self._lock:
            return {"conversations": len(self._last_seen),
                    "span_rows": sum(f.height for f in self._frames.values()),
                    "keys": len(self._unit_of_key)}

    # -- reading -----------------------------------------------------------------------------------
    def totals(self) -> dict[SeriesKey, float]:
        """The ledger series as of the last refresh step: (series, labels) → value."""
        with self._view_lock:
            return dict(self._view.totals)

    def collect(self) -> Iterator[Metric]:
        """Every series as Prometheus metric families (a ``prometheus_client`` collector), as
        of the last refresh step: never waits for a refresh in progress."""
        with self._view_lock:
            view = self._view
        yield from _ledger_families(view)
        yield from _gauge_families(view)
        yield from _transfer_families(view)
        ttft = HistogramMetricFamily(
            TTFT_SECONDS, "Request arrival at the proxy to the first token sent, from its "
            "kvscope.turn spans (vLLM's TTFT buckets)", labels=["run", "run_id", "model"])
        for labels, hist in sorted(view.ttft.items()):
            ttft.add_metric(list(labels), hist.cumulative(), hist.total)
        yield ttft
        yield from _self_families(view)


def _ledger_families(view: _View) -> Iterator[Metric]:
    for name, (help_text, extra) in LEDGER_SERIES.items():
        family = GaugeMetricFamily(name, help_text, labels=[*_LEDGER_LABELS, *extra])
        for (series, labels), value in sorted(view.totals.items()):
            if series == name:
                family.add_metric(list(labels), value)
        yield family


def _gauge_families(view: _View) -> Iterator[Metric]:
    for metric, (name, help_text, label_names) in GAUGE_SERIES.items():
        family = GaugeMetricFamily(name, help_text, labels=list(label_names))
        for (series, labels), (_, value) in sorted(view.gauges.items(), key=str):
            if series == metric:
                family.add_metric(list(labels), value)
        yield family


def _transfer_families(view: _View) -> Iterator[Metric]:
    count = CounterMetricFamily(TRANSFERS, "KV transfers (kvscope.kv_transfer spans) by "
                                "direction and status", labels=list(_TRANSFER_LABELS))
    size = CounterMetricFamily(TRANSFER_BYTES, "Bytes KV transfers moved, by direction and "
                               "status", labels=list(_TRANSFER_LABELS))
    seconds = HistogramMetricFamily(TRANSFER_SECONDS, "Duration of KV transfers, by "
                                    "direction and status", labels=list(_TRANSFER_LABELS))
    for labels, value in sorted(view.transfers.items()):
        count.add_metric(list(labels), value)
    for labels, value in sorted(view.transfer_bytes.items()):
        size.add_metric(list(labels), value)
    for labels, hist in sorted(view.transfer_s.items()):
        seconds.add_metric(list(labels), hist.cumulative(), hist.total)
    yield count
    yield size
    yield seconds


def _self_families(view: _View) -> Iterator[Metric]:
    yield CounterMetricFamily(REFRESHES, "Refreshes of the live ledger", value=view.refreshes)
    yield CounterMetricFamily(RECOMPUTED_CONVERSATIONS, "Conversations recomputed by those "
                              "refreshes", value=view.recomputed_conversations)
    if view.last_refresh_s is not None:
        yield GaugeMetricFamily(REFRESH_SECONDS, "How long the last refresh took",
                                value=view.last_refresh_s)
    yield GaugeMetricFamily(PENDING_ROWS, "Span rows stored that the live ledger has not read "
                            "yet (a refresh in progress, as of its last step)",
                            value=view.pending_rows)


def _bare(frames: dict[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    """Frames without the kept row ids (the ledger's extraction columns only), each in one
    chunk: a kept frame gains a chunk every refresh, and the per-turn SQL's scans of many-chunk
    Arrow tables made refreshes grow with the live ledger's age (bench_live_metrics.py without
    --base, 100 refreshes, last 20: median 266-341 ms, 221-254 ms with this)."""
    return {name: frame.drop("_row", "_unit", "_key", strict=False).rechunk()
            for name, frame in frames.items()}


def _models_of(reader: Reader, requests: list[str]) -> pl.DataFrame:
    """X-Request-Id → model of the turn spans naming ``requests``."""
    return reader.frame(query.Query(
        f"SELECT {_a(semconv.X_REQUEST_ID)} AS x_request_id, "
        f"{_a(semconv.GEN_AI_REQUEST_MODEL)} AS model FROM otel_traces WHERE SpanName = $span "
        f"AND {_a(semconv.X_REQUEST_ID)} IN (SELECT unnest($requests))",
        {"span": semconv.SPAN_TURN, "requests": requests}, name="models of requests"))


def _number(text: object) -> float | None:
    if text is None:
        return None
    try:
        return float(str(text))
    except ValueError:
        return None


class _Adapter(Collector):
    def __init__(self, live: LiveLedger) -> None:
        self.live = live

    def collect(self) -> Iterator[Metric]:
        return self.live.collect()


class LiveMetrics:
    """``GET /metrics`` for ``kvscope serve``: refresh the live ledger, then expose it.

    The refresh runs in a thread of its own; a scrape starts one (unless one is running) and
    waits for it at most ``wait_s`` seconds, then answers with the series as of the last
    refresh step: a restart's first refresh over a large store (minutes at 1M turns) does not
    hold scrapes past Prometheus' timeout, and ``kvscope_live_pending_span_rows`` says how far
    behind it still is.
    """

    wait_s = 8.0  # below Prometheus' default scrape timeout (10 s)

    def __init__(self, con: duckdb.DuckDBPyConnection, *beside: Collector) -> None:
        self.ledger = LiveLedger(con)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Adapter(self.ledger))
        for collector in beside:
            self.registry.register(collector)
        self._starting = threading.Lock()
        self._thread: threading.Thread | None = None
        self._failed: BaseException | None = None

    def __call__(self, accept: str | None) -> tuple[bytes, str]:
        """Refresh (waiting at most :attr:`wait_s`), then render in the format ``accept`` asks
        for: (body, Content-Type). A refresh that failed fails the scrape that sees it end."""
        thread = self._start()
        thread.join(self.wait_s)
        failed = None
        with self._starting:
            if not thread.is_alive():
                failed, self._failed = self._failed, None
        if failed is not None:
            raise failed
        return exposition.render(self.registry, accept)

    def close(self) -> None:
        """Before the store closes: end a refresh in progress after its current step."""
        self.ledger.stop()
        with self._starting:
            thread = self._thread
        if thread is not None:
            thread.join()

    def _start(self) -> threading.Thread:
        with self._starting:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._refresh, daemon=True,
                                                name="kvscope-live-refresh")
                self._thread.start()
            return self._thread

    def _refresh(self) -> None:
        try:
            self.ledger.refresh()
        except BaseException as exc:  # handed to the scrape that sees the refresh end
            with self._starting:
                self._failed = exc


def metrics_source(con: duckdb.DuckDBPyConnection, *beside: Collector) -> LiveMetrics:
    """The ``/metrics`` renderer over a store connection (what ``kvscope serve`` passes on),
    exposing ``beside`` (the receiver's own counters) too."""
    return LiveMetrics(con, *beside)


__all__ = ["GAUGE_SERIES", "GPU_TOTAL_BYTES", "GPU_USED_BYTES", "INVALID_REUSE_TOKENS",
    "INVALID_REUSE_TURNS", "LEDGER_SERIES", "Labels", "LiveLedger", "LiveMetrics",
    "OUTCOME_CLASSES", "PENDING_ROWS", "RECOMPUTED_CONVERSATIONS", "RECOMPUTED_TOKENS", "REFRESHES",
    "REFRESH_SECONDS", "RETAINED_BYTES", "REUSABLE_TOKENS", "REUSED_LOCAL_TOKENS",
    "REUSED_REMOTE_TOKENS", "SeriesKey", "TRANSFERS", "TRANSFER_BYTES", "TRANSFER_SECONDS",
    "TTFT_SECONDS", "TURNS", "contributions", "metrics_source", "unit_key"]

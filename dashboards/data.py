"""The dashboard's data side: analysis results per (analysis, parameters, filters, data version).

Pages never query the store: they ask :class:`DashboardData` for registry results
(:meth:`DashboardData.result`) and format them. One long-lived base
:class:`~kvscope.analysis.registry.AnalysisContext` per data version holds the expensive,
filter-independent data (the ledger built from raw spans, the retention spans, the what-if
inputs); each filter selection gets a :class:`ScopedContext` that shares those and caches its own
analysis results, so a filter change re-runs only the cheap polars shaping.

Sources:

* a store file, opened read-only: its data version never changes while it is open (DuckDB lets
  no other process write a file that is open);
* a live :class:`~kvscope.store.writer.StoreWriter` (``kvscope serve --dashboard``): reads go
  through a cursor of the writer's own connection (a second connection to the file is refused),
  and the data version is the writer's count of written rows, looked at no more often than
  every ``refresh_s`` seconds, so a busy receiver does not rebuild the ledger on every tick.

Filters (:class:`Filters`): runs select through the context's run selection; engine, time window
and conversation select ledger rows (time is seconds since each run's first arrival, so runs
recorded at different times share one axis); the engine filter also selects retention spans of
that engine. What a filter cannot select is said on the page, never hidden.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import polars as pl

from kvscope.analysis import registry, runs
from kvscope.analysis.registry import AnalysisContext
from kvscope.errors import KvscopeError, StoreError
from kvscope.store.duckdb_reader import DuckDBReader
from kvscope.store.query import Query
from kvscope.store.reader import Reader
from kvscope.store.source import Source, open_reader
from kvscope.store.writer import StoreWriter

logger = logging.getLogger(__name__)

DEFAULT_REFRESH_S = 5.0
# Scoped contexts kept per data version: each holds its filter selection's analysis results.
MAX_SCOPES = 32
# Most conversations offered in a picker: a 1M-turn store has ~100k; the list says when cut.
MAX_CONVERSATION_OPTIONS = 2000

# Analyses whose rows for one run are computed from that run's data alone (grouped by run_id):
# a run filter can select rows of their unfiltered result.
RUN_SEPARABLE = frozenset({
    "reuse_rate", "miss_causes", "retention_cost", "retained_memory", "task_time",
    "task_time_summary", "ladder", "ledger", "cost_fit", "whatif", "ttft_windows",
})


@dataclass(frozen=True)
class Filters:
    """One selection of the dashboard's filters (hashable: it keys the caches)."""

    runs: tuple[str, ...] = ()
    engine: str | None = None
    conversation: str | None = None
    start_s: float | None = None
    end_s: float | None = None

    @classmethod
    def from_store(cls, raw: Mapping[str, Any] | None) -> Filters:
        """Filters from the page's ``dcc.Store`` value (JSON: lists and plain values)."""
        raw = raw or {}
        return cls(
            runs=tuple(sorted(raw.get("runs") or ())),
            engine=raw.get("engine") or None,
            conversation=raw.get("conversation") or None,
            start_s=_float_or_none(raw.get("start_s")),
            end_s=_float_or_none(raw.get("end_s")),
        )

    def to_store(self) -> dict[str, Any]:
        """The JSON form :meth:`from_store` reads."""
        return {"runs": list(self.runs), "engine": self.engine,
                "conversation": self.conversation, "start_s": self.start_s,
                "end_s": self.end_s}

    @property
    def narrows_turns(self) -> bool:
        """Whether a filter beyond runs and engine is set (those only select ledger rows)."""
        return self.conversation is not None or self.start_s is not None or \
            self.end_s is not None

    # The ledger columns select_ledger reads.
    LEDGER_COLUMNS = ("run_id", "arrival", "prefill_engine", "decode_engine", "conversation_id")

    def select_ledger(self, ledger: pl.DataFrame) -> pl.DataFrame:
        """Ledger rows inside the time window, engine and conversation selection (pure).

        Time is seconds since each run's first arrival in ``ledger``: pass whole runs.
        """
        out = ledger
        if (self.start_s is not None or self.end_s is not None) and not out.is_empty():
            since = (pl.col("arrival") - pl.col("arrival").min().over("run_id")) \
                .dt.total_nanoseconds() / 1e9
            out = out.with_columns(since.alias("_since_s"))
            if self.start_s is not None:
                out = out.filter(pl.col("_since_s") >= self.start_s)
            if self.end_s is not None:
                out = out.filter(pl.col("_since_s") <= self.end_s)
            out = out.drop("_since_s")
        if self.engine is not None:
            out = out.filter((pl.col("prefill_engine") == self.engine)
                             | (pl.col("decode_engine") == self.engine))
        if self.conversation is not None:
            out = out.filter(pl.col("conversation_id") == self.conversation)
        return out


def _float_or_none(value: Any) -> float | None:
    try:
        return None if value is None or value == "" else float(value)
    except (TypeError, ValueError):
        return None


class ScopedContext(AnalysisContext):
    """An analysis context for one filter selection, sharing the base context's heavy data."""

    def __init__(self, base: AnalysisContext, filters: Filters) -> None:
        super().__init__(base.reader, runs=list(filters.runs) or None)
        self.base = base
        self.filters = filters
        self._ledger: pl.DataFrame | None = None

    def get(self, item: registry.Intermediate, *args: Hashable) -> Any:
        """Shared intermediates from the base context; those of this selection here."""
        if item.shared:
            return self.base.get(item, *args)
        return super().get(item, *args)

    def frame(self, sql: Query) -> pl.DataFrame:
        """A query's rows, through the base (which knows whether a stored query's table is
        current)."""
        return self.base.frame(sql)

    def ledger(self, columns: Sequence[str] | None = None) -> pl.DataFrame:
        """The ledger rows of this selection (the ledger is built once, in the base): every
        column, kept for the selection; or ``columns`` only, with what the filters read, from
        the base (a stored ledger's columns are read there once; here only the rows selected
        of the columns asked for are copied)."""
        if columns is None:
            if self._ledger is None:
                self._ledger = self.filters.select_ledger(self.select_runs(self.base.ledger()))
            return self._ledger
        if self._ledger is not None:
            return self._ledger.select(list(dict.fromkeys(columns)))
        asked = list(dict.fromkeys(columns))
        read = list(dict.fromkeys([*asked, *Filters.LEDGER_COLUMNS]))
        return self.filters.select_ledger(self.select_runs(self.base.ledger(read))).select(asked)

    def ledger_head(self, rows: int) -> tuple[pl.DataFrame, int]:
        """The first ``rows`` of this selection's ledger (every column) and its height."""
        frame = self.ledger()
        return frame.head(rows), frame.height

    def select_runs(self, frame: pl.DataFrame) -> pl.DataFrame:
        """Rows of the selected runs, and of the selected engine where a frame names engines."""
        out = super().select_runs(frame)
        if self.filters.engine is not None and "engine_id" in out.columns:
            out = out.filter(pl.col("engine_id") == self.filters.engine)
        return out


@dataclass
class Result:
    """One analysis result for a page: the frame, or why there is none."""

    frame: pl.DataFrame | None
    why: str | None = None

    @property
    def ok(self) -> bool:
        return self.frame is not None


@dataclass
class _Version:
    number: int
    base: AnalysisContext
    checked_at: float
    built_at: datetime
    scopes: OrderedDict[Filters, ScopedContext] = field(default_factory=OrderedDict)


class DashboardData:
    """Analysis results for the dashboard, cached per (analysis, parameters, filters, version).

    ``source`` is a store path (opened read-only) or a live :class:`StoreWriter`. Every method
    is safe to call from Dash's request threads: one lock serialises work on the store's
    connection and the caches (two requests for the same result build it once).
    """

    def __init__(self, source: Source | StoreWriter, *,
                 refresh_s: float = DEFAULT_REFRESH_S) -> None:
        self.source = source
        self.live = isinstance(source, StoreWriter)
        self.refresh_s = refresh_s
        self.name = ("live store" if self.live else Path(source).name
                     if isinstance(source, str | Path) else str(source))
        self._lock = threading.RLock()
        self._version: _Version | None = None
        # Set by close(): no new reader is opened, and warming stops between pages.
        self.closing = threading.Event()

    # --- versions ---------------------------------------------------------------------------

    def _open_reader(self) -> Reader:
        if isinstance(self.source, StoreWriter):
            # A cursor of the writer's connection: DuckDB refuses a second connection to it.
            return DuckDBReader(self.source.connection.cursor())
        return open_reader(self.source)

    def _current_number(self) -> int:
        if isinstance(self.source, StoreWriter):
            stats = self.source.stats
            return stats.written_rows
        return 0

    def version(self) -> int:
        """The data version, re-checked at most every ``refresh_s`` seconds in live mode."""
        return self._state().number

    def _state(self) -> _Version:
        with self._lock:
            if self.closing.is_set():
                raise StoreError("the dashboard is stopping")
            now = time.monotonic()
            state = self._version
            if state is not None and (not self.live or now - state.checked_at < self.refresh_s):
                return state
            number = self._current_number()
            if state is not None and number == state.number:
                state.checked_at = now
                return state
            if state is not None:
                state.base.close()
            self._version = _Version(number, AnalysisContext(self._open_reader()), now,
                                     datetime.now().astimezone())
            return self._version

    def built_at(self) -> datetime:
        """When the current data version was opened (the freshness of what pages show)."""
        return self._state().built_at

    def close(self, wait_s: float = 60.0) -> None:
        """Stop the queries in progress, then close the reader (the live writer itself stays
        open: its owner closes it).

        A query runs under the lock (warming, a page's callback): it is interrupted until the
        lock is free, so the reader is never closed under it, and no thread is left inside
        DuckDB when the process exits (a SIGTERM while pages warmed once aborted the process:
        "FATAL: exception not rethrown").
        """
        self.closing.set()
        deadline = time.monotonic() + wait_s
        while not self._lock.acquire(timeout=0.1):
            version = self._version
            if version is not None:
                version.base.reader.interrupt()
            if time.monotonic() > deadline:
                logger.warning("a dashboard query did not stop within %g s", wait_s)
                return
        try:
            if self._version is not None:
                self._version.base.close()
                self._version = None
        finally:
            self._lock.release()

    # --- contexts and results ---------------------------------------------------------------

    def context(self, filters: Filters | None = None) -> AnalysisContext:
        """The context of one filter selection (the base context when nothing is selected)."""
        filters = filters or Filters()
        with self._lock:
            state = self._state()
            if filters == Filters():
                return state.base
            scope = state.scopes.get(filters)
            if scope is None:
                scope = ScopedContext(state.base, filters)
                state.scopes[filters] = scope
                while len(state.scopes) > MAX_SCOPES:
                    state.scopes.popitem(last=False)
            else:
                state.scopes.move_to_end(filters)
            return scope

    def result(self, name: str, params: Mapping[str, Any] | None = None,
               filters: Filters | None = None) -> Result:
        """A registry result, or why there is none (never raises for a page to show)."""
        if name not in registry.analyses():
            return Result(None, f"the {name} analysis is not available in this kvscope")
        with self._lock:
            try:
                if (filters is not None and filters.runs and filters.engine is None
                        and not filters.narrows_turns and name in RUN_SEPARABLE):
                    # Rows of these analyses depend on their own run only: select the rows of
                    # the unfiltered result instead of recomputing it for the selection.
                    whole = registry.run(self.context(), name, params)
                    key = ("run rows", name, repr(sorted((params or {}).items())))
                    return Result(self.context(filters).cached(
                        key, lambda: whole.filter(pl.col("run_id").is_in(list(filters.runs)))))
                return Result(registry.run(self.context(filters), name, params))
            except KvscopeError as exc:
                return Result(None, str(exc))
            except Exception as exc:  # one failing analysis must not break the page
                logger.warning("analysis %s failed", name, exc_info=True)
                return Result(None, f"failed: {type(exc).__name__}: {exc}")

    def derived(self, key: str, build: Callable[[AnalysisContext], Any],
                filters: Filters | None = None) -> Any:
        """A value shaped from analysis results, cached on the selection's context."""
        with self._lock:
            ctx = self.context(filters)
            return ctx.cached(("dashboard", key), lambda: build(ctx))

    def ledger(self, filters: Filters | None = None,
               columns: Sequence[str] | None = None) -> pl.DataFrame:
        """The ledger of a selection (the registry's ``ledger`` analysis), empty when absent;
        only its ``columns`` when given: a page that reads a few columns holds those, where the
        ``ledger`` analysis reads every column (a stored ledger is read a column at a time:
        ~7.5 GiB for all of 10M turns)."""
        if columns is None:
            result = self.result("ledger", None, filters)
            return result.frame if result.frame is not None else pl.DataFrame()
        with self._lock:
            try:
                return self.context(filters).ledger(list(columns))
            except KvscopeError:
                return pl.DataFrame()
            except Exception:  # as result(): a page must not break
                logger.warning("the ledger's %s could not be read", ", ".join(columns),
                               exc_info=True)
                return pl.DataFrame()

    def ledger_columns(self, columns: Sequence[str]) -> pl.DataFrame:
        """The ledger's ``columns`` of every run (the filters' options), empty when there is
        none."""
        return self.ledger(None, columns)

    def retentions(self, filters: Filters | None = None) -> Result:
        """Retention spans of a selection with ``held_s`` (the analysis layer loads them)."""
        from kvscope.analysis import retention

        def build(ctx: AnalysisContext) -> Result:
            try:
                spans = retention.load_retentions(ctx)
            except KvscopeError as exc:
                return Result(None, str(exc))
            return Result(spans.with_columns(
                (pl.col("duration_ns") / 1e9).alias("held_s")))
        with self._lock:
            result: Result = self.derived("retentions", build, filters)
            return result

    # --- filter options ---------------------------------------------------------------------

    def runs(self) -> pl.DataFrame:
        """Runs in the store: run_id, label (the label is the run id where none was given)."""
        def build(ctx: AnalysisContext) -> pl.DataFrame:
            try:
                table = runs.run_table(ctx)
            except KvscopeError:
                table = pl.DataFrame(schema={"run_id": pl.String, "label": pl.String})
            ledger_runs = self.ledger_columns(["run_id"])
            ids = list(dict.fromkeys(
                table["run_id"].to_list()
                + (ledger_runs["run_id"].unique().sort().to_list()
                   if "run_id" in ledger_runs.columns else [])))
            labels = dict(zip(table["run_id"].to_list(), table["label"].to_list(), strict=True))
            return pl.DataFrame({"run_id": ids, "label": [labels.get(i) or i for i in ids]},
                                schema={"run_id": pl.String, "label": pl.String})
        frame: pl.DataFrame = self.derived("runs", build)
        return frame

    def labels(self) -> dict[str, str]:
        """run_id → label."""
        return dict(self.runs().select("run_id", "label").rows())

    def engines(self) -> list[str]:
        """Prefill and decode engine ids seen in the ledger."""
        def build(ctx: AnalysisContext) -> list[str]:
            ledger = self.ledger_columns(["prefill_engine", "decode_engine"])
            names: set[str] = set()
            for column in ("prefill_engine", "decode_engine"):
                if column in ledger.columns:
                    names.update(v for v in ledger[column].unique().to_list() if v)
            return sorted(names)
        engines: list[str] = self.derived("engines", build)
        return engines

    def conversations(self, filters: Filters | None = None) -> pl.DataFrame:
        """(run_id, conversation_id, turns) of a selection, sorted, at most the picker's limit."""
        def build(ctx: AnalysisContext) -> pl.DataFrame:
            ledger = ctx.ledger(["run_id", "conversation_id"])
            if ledger.is_empty():
                return pl.DataFrame(schema={"run_id": pl.String, "conversation_id": pl.String,
                                            "turns": pl.UInt32})
            return (ledger.group_by("run_id", "conversation_id").agg(pl.len().alias("turns"))
                    .sort("run_id", "conversation_id"))
        frame: pl.DataFrame = self.derived("conversations", build, filters)
        return frame

    def time_span_s(self) -> float | None:
        """The longest run's span in seconds (first arrival → last end); None without turns."""
        def build(ctx: AnalysisContext) -> float | None:
            ledger = self.ledger_columns(["run_id", "arrival", "end"])
            if ledger.is_empty() or "arrival" not in ledger.columns:
                return None
            spans = ledger.group_by("run_id").agg(
                ((pl.col("end").max() - pl.col("arrival").min()).dt.total_nanoseconds() / 1e9)
                .alias("s"))
            value = spans["s"].max()
            return float(value) if isinstance(value, int | float) else None
        span: float | None = self.derived("time_span", build)
        return span


def open_data(source: str | Path | StoreWriter, *,
              refresh_s: float = DEFAULT_REFRESH_S) -> DashboardData:
    """The data side of a dashboard over ``source`` (nothing is read until a page asks)."""
    return DashboardData(source, refresh_s=refresh_s)


__all__ = ["DEFAULT_REFRESH_S", "DashboardData", "Filters", "MAX_CONVERSATION_OPTIONS",
    "MAX_SCOPES", "RUN_SEPARABLE", "Result", "ScopedContext", "open_data"]

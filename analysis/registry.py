"""The registry of analyses: each is one small unit the CLI, the report and the dashboards iterate.

An analysis declares its name, a one-line title, its parameters (typed, with defaults and help)
and the columns of the frame it returns, and runs against an :class:`AnalysisContext`. The
context owns the store connection and caches what analyses build on the way: each such
intermediate (the ledger, the retention spans, the what-if inputs, …) is registered here too
(:func:`intermediate`), so its cache key is the registry's, never a string spelled at each use,
and several analyses over one file build the ledger once. An intermediate is ``shared`` when it
does not depend on which turns are selected: a dashboard's filtered context takes it from the
unfiltered one. Modules listed in :data:`MODULES` register their analyses on import;
:func:`analyses` imports them on first use (nothing loads at import time).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from kvscope import settings
from kvscope.errors import KvscopeError
from kvscope.store.query import Query
from kvscope.store.reader import Reader
from kvscope.store.source import Source, open_reader

logger = logging.getLogger(__name__)


class AnalysisError(KvscopeError, ValueError):
    """An analysis was asked for with an unknown name, a bad parameter or missing data."""


@dataclass(frozen=True)
class Param:
    """One parameter of an analysis."""

    name: str
    type: type
    default: Any
    help: str
    choices: tuple[Any, ...] | None = None

    def parse(self, raw: Any) -> Any:
        """Convert and check one value; raise AnalysisError naming the parameter."""
        if raw is None:
            return self.default
        try:
            if self.type is list:
                value: Any = (
                    [v.strip() for v in raw.split(",") if v.strip()] if isinstance(raw, str)
                    else list(raw)
                )
            elif self.type is bool and isinstance(raw, str):
                value = raw.lower() in ("1", "true", "yes", "on")
            else:
                value = self.type(raw)
        except (TypeError, ValueError) as exc:
            raise AnalysisError(f"parameter {self.name}={raw!r}: {exc}") from None
        if self.choices is not None and value not in self.choices:
            raise AnalysisError(
                f"parameter {self.name}={raw!r}: choose one of {', '.join(map(str, self.choices))}"
            )
        return value


Runner = Callable[["AnalysisContext", Mapping[str, Any]], pl.DataFrame]


# (context, parsed parameters, rows) -> (the result's first rows, its height).
HeadRunner = Callable[["AnalysisContext", Mapping[str, Any], int], tuple[pl.DataFrame, int]]


@dataclass(frozen=True, eq=False)
class Analysis:
    """One registered analysis: what it is called, takes and returns, and how it runs.

    ``head``: how to get the result's first rows and height without the whole result, for an
    analysis whose result is large (the ledger listing); :func:`head` uses it.
    """

    name: str
    title: str
    run: Runner
    params: tuple[Param, ...] = ()
    columns: Mapping[str, pl.DataType] = field(default_factory=dict)
    head: HeadRunner | None = None

    def parse_params(self, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Resolve parameters: given values parsed, the rest defaulted, unknown names refused."""
        given = dict(given or {})
        known = {p.name: p for p in self.params}
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise AnalysisError(
                f"{self.name}: unknown parameter(s) {', '.join(unknown)}; "
                f"known: {', '.join(known) or 'none'}"
            )
        return {name: p.parse(given.get(name)) for name, p in known.items()}


@dataclass(frozen=True, eq=False)
class Intermediate:
    """Data analyses build on the way and share, cached per context and arguments.

    ``shared``: built from the whole store, whatever turns a context selects (a scoped context
    asks its base context for it); otherwise built per context from its selection.
    """

    name: str
    build: Callable[..., Any]
    shared: bool


REGISTRY: dict[str, Analysis] = {}
INTERMEDIATES: dict[str, Intermediate] = {}

# Modules whose import registers analyses, in the order the report shows them.
MODULES = (
    "kvscope.analysis.reuse",
    "kvscope.analysis.causes",
    "kvscope.analysis.retention",
    "kvscope.analysis.task_time",
    "kvscope.analysis.windows",
    "kvscope.analysis.compare",
    "kvscope.analysis.cost_fit",
    "kvscope.analysis.whatif",
    "kvscope.analysis.published",
    "kvscope.analysis.ladder",
    "kvscope.analysis.verdict",
    "kvscope.analysis.sources",
    "kvscope.analysis.reconcile",
)
_loaded = False


def register(
    name: str, title: str, *, params: Sequence[Param] = (),
    columns: Mapping[str, pl.DataType] | None = None, head: HeadRunner | None = None,
) -> Callable[[Runner], Runner]:
    """Decorator: register ``fn`` as the analysis ``name`` (``head``: see :class:`Analysis`)."""

    def decorate(fn: Runner) -> Runner:
        if name in REGISTRY:
            raise ValueError(f"analysis {name!r} registered twice")
        REGISTRY[name] = Analysis(name, title, fn, tuple(params), dict(columns or {}), head)
        return fn

    return decorate


def intermediate(name: str, *, shared: bool) -> Callable[[Callable[..., Any]], Intermediate]:
    """Decorator: register ``fn(ctx, *args)`` as the intermediate ``name``; get it with
    :meth:`AnalysisContext.get`."""

    def decorate(fn: Callable[..., Any]) -> Intermediate:
        if name in INTERMEDIATES:
            raise ValueError(f"intermediate {name!r} registered twice")
        INTERMEDIATES[name] = item = Intermediate(name, fn, shared)
        return item

    return decorate


def analyses() -> dict[str, Analysis]:
    """Every registered analysis, importing the analysis modules on first use."""
    global _loaded
    if not _loaded:
        for module in MODULES:
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as exc:
                if exc.name != module:
                    raise
        _loaded = True
    return REGISTRY


def get(name: str) -> Analysis:
    """The analysis called ``name``; a clear error naming the known ones otherwise."""
    known = analyses()
    if name not in known:
        raise AnalysisError(f"no analysis called {name!r}; known: {', '.join(sorted(known))}")
    return known[name]


def size_of(value: Any) -> int:
    """Bytes ``value`` holds by polars' estimate: frames and series, and mappings, sequences and
    dataclasses of them; an object with a ``cached_bytes()`` method says its own; anything
    else counts 0. Buffers two values share count in both."""
    if isinstance(value, pl.DataFrame | pl.Series):
        return int(value.estimated_size())
    if isinstance(value, Mapping):
        return sum(size_of(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(size_of(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(size_of(getattr(value, f.name)) for f in dataclasses.fields(value))
    held = getattr(value, "cached_bytes", None)
    return int(held()) if callable(held) else 0


class AnalysisContext:
    """A store opened for analysis, with derived data cached for the context's lifetime.

    What the cache keeps is bounded by ``cache_mib`` (the ``analysis_cache_mib`` setting):
    past it entries go, those cheapest to build again per byte first (an entry with a
    ``release(bytes)`` method, the stored ledger, lets go of its least recently used columns
    instead), and are built again when asked. Every intermediate is a function of the store,
    so a rebuilt one is the same. At 10M turns the report's analyses otherwise kept ~10 GiB:
    every ledger column read, the what-if's timeline, the retention spans, ...
    """

    def __init__(self, reader: Reader, *, runs: Sequence[str] | None = None,
                 cache_mib: float | None = None) -> None:
        self.reader = reader
        self.runs = list(runs) if runs else None
        # Least recently used first.
        self._cache: dict[Hashable, Any] = {}
        mib = settings.resolve("analysis_cache_mib") if cache_mib is None else cache_mib
        self.cache_bytes = int(float(mib) * 2**20)
        # Entries built again after they were let go (a figure for benchmarks and tests).
        self.rebuilt = 0
        self._released: set[Hashable] = set()
        # What each entry's last build took, in seconds.
        self._seconds: dict[Hashable, float] = {}

    @classmethod
    def open(cls, path: Source, *, runs: Sequence[str] | None = None) -> AnalysisContext:
        """Open the store at ``path`` read-only (or connect to a ClickHouse source)."""
        return cls(open_reader(path), runs=runs)

    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> AnalysisContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def cached(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """Build once per context (and per key, while the cache keeps it), then reuse."""
        if key in self._cache:
            value = self._cache[key] = self._cache.pop(key)  # now the most recently used
            return value
        start = time.perf_counter()
        value = build()
        self._seconds[key] = time.perf_counter() - start
        if key in self._released:
            self.rebuilt += 1
        self._cache[key] = value
        self.trim(keep=key)
        return value

    def cached_bytes(self) -> int:
        """What the cache holds, by :func:`size_of`."""
        return sum(size_of(value) for value in self._cache.values())

    def _rebuild_cost(self, key: Hashable, size: int) -> float:
        """Seconds per byte to build the entry ``key`` again: what its build took (an entry
        with a ``seconds_per_byte()`` method, the stored ledger, says its own)."""
        value = self._cache[key]
        own = getattr(value, "seconds_per_byte", None)
        if callable(own):
            return float(own())
        return self._seconds.get(key, 0.0) / max(size, 1)

    def trim(self, keep: Hashable | None = None) -> None:
        """Let entries go until the cache holds at most :attr:`cache_bytes` (``keep``, the
        entry just built, stays): those cheapest to build again per byte first, the least
        recently used first among equals."""
        sizes = {key: size_of(value) for key, value in self._cache.items()}
        excess = sum(sizes.values()) - self.cache_bytes
        if excess <= 0:
            return
        # Large entries only (a sixteenth of the bound or more: the ledger's columns, the
        # what-if's timeline, retention spans), and the small ones too only when they hold a
        # quarter of the bound together: a small result (most analyses' are kilobytes) costs as
        # much to build again as a large one and frees little. Cheapest per byte first: the
        # stored ledger's columns are read again at ~1 ns a byte, the retention spans are built
        # again from their query at ~10 (10M turns).
        large = self.cache_bytes // 16
        small = sum(size for size in sizes.values() if size < large)
        used = {key: index for index, key in enumerate(self._cache)}
        order = sorted(self._cache, key=lambda key: (
            self._rebuild_cost(key, sizes[key]), used[key]))
        for floor in (large, 1) if small > self.cache_bytes // 4 else (large,):
            for key in order:
                if excess <= 0:
                    return
                if key == keep or sizes[key] < floor or key not in self._cache:
                    continue
                release = getattr(self._cache[key], "release", None)
                if callable(release):
                    freed = int(release(excess))
                    sizes[key] -= freed
                    excess -= freed
                else:
                    del self._cache[key]
                    self._released.add(key)
                    excess -= sizes[key]

    def get(self, item: Intermediate, *args: Hashable) -> Any:
        """The intermediate ``item`` for ``args``, built once per context."""
        return self.cached((item, args), lambda: item.build(self, *args))

    def ledger(self, columns: Sequence[str] | None = None) -> pl.DataFrame:
        """The per-turn ledger of the selected runs: its ``columns`` (all when None). An
        analysis that names the columns it reads holds only those of a stored ledger."""
        if columns is None or self.runs is None or "run_id" in columns:
            return self.select_runs(whole_ledger(self, columns))
        return self.select_runs(whole_ledger(self, ["run_id", *columns])).drop("run_id")

    def ledger_head(self, rows: int) -> tuple[pl.DataFrame, int]:
        """The first ``rows`` of :meth:`ledger` (every column) and how many rows it has: of a
        stored ledger only those rows of each column are kept, where the whole listing holds
        every column (~5 GiB at 10M turns)."""
        whole = self.get(LEDGER)
        if isinstance(whole, pl.DataFrame):
            frame = self.select_runs(whole)
            return frame.head(rows), frame.height
        head: tuple[pl.DataFrame, int] = whole.head(rows, self.runs)
        return head

    def select_runs(self, frame: pl.DataFrame) -> pl.DataFrame:
        """Rows of the selected runs (all when no selection)."""
        if self.runs is None or "run_id" not in frame.columns:
            return frame
        return frame.filter(pl.col("run_id").is_in(self.runs))

    def frame(self, sql: Query) -> pl.DataFrame:
        """Run a query through the store's reader (a stored query's table instead, when
        ``kvscope ledger`` keeps it current: :mod:`kvscope.analysis.stored_queries`)."""
        from kvscope.analysis import ledger_units, stored_queries

        name = stored_queries.name_of(sql)
        if name is not None and name in self.cached(
                _STORED_TABLES, lambda: ledger_units.stored_tables(self.reader)):
            return ledger_units.scan(self.reader, ledger_units.stored_table_query(name, sql))
        return self.reader.frame(sql)


def run(ctx: AnalysisContext, name: str, params: Mapping[str, Any] | None = None) -> pl.DataFrame:
    """Run one analysis by name with parsed parameters, cached per (name, parameters)."""
    analysis = get(name)
    parsed = analysis.parse_params(params)
    key = (analysis, repr(sorted(parsed.items())))
    return ctx.cached(key, lambda: analysis.run(ctx, parsed))


def head(ctx: AnalysisContext, name: str, rows: int,
         params: Mapping[str, Any] | None = None) -> tuple[pl.DataFrame, int]:
    """The first ``rows`` rows of an analysis's result and its height: from the result when
    the context has it, else through the analysis's ``head`` when it has one (cached per
    parameters and rows), else from the whole result."""
    analysis = get(name)
    parsed = analysis.parse_params(params)
    key = (analysis, repr(sorted(parsed.items())))
    if key in ctx._cache or analysis.head is None:
        whole = run(ctx, name, params)
        return whole.head(rows), whole.height
    runner = analysis.head
    out: tuple[pl.DataFrame, int] = ctx.cached(
        ("head", *key, rows), lambda: runner(ctx, parsed, rows))
    return out


@intermediate("ledger", shared=True)
def _whole_ledger(ctx: AnalysisContext) -> Any:
    """The ledger of every run in the store (contexts select their runs from it): the stored
    ``kvscope_ledger`` table when ``kvscope ledger`` has kept it current (a
    :class:`~kvscope.analysis.ledger_units.StoredLedger`, read by columns), else computed (a
    frame). Read it through :func:`whole_ledger`."""
    from kvscope.analysis import ledger as ledger_module
    from kvscope.analysis import ledger_units

    stored = ledger_units.stored_columns(ctx.reader)
    if stored is not None:
        return stored
    partitions = ledger_module.partitions_for(ctx.reader)
    if partitions > 1:
        # Computed here, the whole ledger of so large a store is held in memory (10M turns:
        # past 15 GiB on chdb), where its table is read a few columns at a time.
        logger.warning(
            "kvscope_ledger is missing or not current for this store (no table, spans stored "
            "after it was built, or rules that changed since): computing the ledger of its "
            "%d partitions in this process holds all of it in memory; `kvscope ledger` first "
            "writes it to the store", partitions)
    return ledger_units.categorical(ledger_module.ledger(ctx.reader))


def whole_ledger(ctx: AnalysisContext, columns: Sequence[str] | None = None) -> pl.DataFrame:
    """The ledger of every run in the store, whatever ``ctx`` selects: its ``columns`` (all
    when None)."""
    whole = ctx.get(LEDGER)
    if isinstance(whole, pl.DataFrame):
        return whole if columns is None else whole.select(list(dict.fromkeys(columns)))
    frame: pl.DataFrame = whole.frame(columns)
    ctx.trim()  # the stored ledger keeps the columns just asked for
    return frame


LEDGER = _whole_ledger
# A context's cache key for the stored queries whose tables are current.
_STORED_TABLES = "stored query tables"


def iter_analyses() -> Iterator[Analysis]:
    """Analyses in report order."""
    yield from analyses().values()


__all__ = ["Analysis", "AnalysisContext", "AnalysisError", "HeadRunner", "INTERMEDIATES",
    "Intermediate", "LEDGER", "MODULES", "Param", "REGISTRY", "Runner", "analyses", "get", "head",
    "intermediate", "iter_analyses", "register", "run", "size_of", "whole_ledger"]

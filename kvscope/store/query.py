"""Queries over the store's OpenTelemetry tables, written one way: named parameters, one accessor.

Analyses name what they read (:func:`spans`, :func:`select`): a column of the table, or an
attribute of the span, its resource or a metric point (:func:`span_attr`,
:func:`resource_attr`, :func:`point_attr`). Every attribute key and every compared value becomes
a named parameter (``$p0``, ``$p1``, …) of the :class:`Query`; nothing is spliced into SQL text
but quoted column names. A :class:`~kvscope.store.reader.Reader` runs a :class:`Query`
through its one seam (time limit, errors that name the query).

The same query runs on DuckDB and on ClickHouse (the OpenTelemetry Collector's tables): a
:class:`Dialect` renders what differs, and only that. A parameter is ``$p0`` in DuckDB and
``{p0:String}`` in ClickHouse; an attribute is ``map[key]`` in both, but a key the map lacks
reads as NULL in DuckDB and as ``''`` in ClickHouse, so ClickHouse's look-up is
``if(mapContains(map, key), map[key], NULL)`` (a missing attribute is never an empty string).
``Query.sql`` is the DuckDB text; :meth:`Query.text` renders for either dialect.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvscope.store.schema import quote

__all__ = ["Attr", "Binder", "CLICKHOUSE", "Column", "DUCKDB", "Dialect", "GAUGES", "Part", "Query",
    "TRACES", "compose", "point_attr", "resource_attr", "select", "span_attr", "spans"]

TRACES = "otel_traces"
GAUGES = "otel_metrics_gauge"


@dataclass(frozen=True)
class Attr:
    """One attribute: ``key`` in the map column ``map`` (a span's, its resource's, a point's)."""

    map: str
    key: str


def span_attr(key: str) -> Attr:
    """An attribute of the span (``SpanAttributes``)."""
    return Attr("SpanAttributes", key)


def resource_attr(key: str) -> Attr:
    """An attribute of the span's or metric's resource (``ResourceAttributes``)."""
    return Attr("ResourceAttributes", key)


def point_attr(key: str) -> Attr:
    """An attribute of a metric point (``Attributes``)."""
    return Attr("Attributes", key)


Column = str | Attr


@dataclass(frozen=True)
class Dialect:
    """What differs between the engines a :class:`Query` runs on.

    Parameters and map look-ups, and the few functions the ledger's per-turn query needs whose
    names or null rules differ: each renders SQL text from SQL text.
    """

    name: str
    # (parameter name, its value) -> the placeholder in SQL text
    param: Callable[[str, Any], str]
    # (quoted map column, placeholder of the key) -> the attribute's value, NULL when absent
    attr: Callable[[str, str], str]
    # a string -> its number, NULL when it is not one (``'12'``, ``'1e3'``; ``'x'`` -> NULL)
    to_float: Callable[[str], str]
    # a string -> its number truncated to a 64-bit integer, NULL when it is not one
    to_int: Callable[[str], str]
    # a number -> a 64-bit integer, NULL stays NULL (sums of unsigned durations, counts)
    int64: Callable[[str], str]
    # (a string, placeholder of a pattern) -> the string with the pattern's first match removed
    strip: Callable[[str, str], str]
    # (a value, PARTITION BY list, ORDER BY list) -> the value on the row before, NULL on the first
    lag: Callable[[str, str, str], str]
    # (a string, a needle) -> the needle's 1-based position in it, 0 when absent
    find: Callable[[str, str], str]
    # (a string, placeholder of a separator) -> its last item (all of it without a separator)
    last_item: Callable[[str, str], str]
    # (a dividend, a divisor) -> their integer quotient
    int_div: Callable[[str, str], str]
    # the keyword that leaves columns out of ``SELECT *`` (``SELECT * EXCLUDE (a)``)
    exclude: str
    # (a table's name, whether it has the ledger's partition column ``_p``) -> ``CREATE ...
    # AS`` of a scratch table (DuckDB: temporary unless qualified; ClickHouse: on disk)
    create_as: Callable[[str, bool], str]
    # appended to a composed query (:func:`compose`): settings the query's meaning relies on
    suffix: str = ""


def _clickhouse_type(value: Any) -> str:
    """The ClickHouse type a bound value is declared with (``{name:Type}``)."""
    if isinstance(value, bool):
        return "Bool"
    if isinstance(value, int):
        return "Int64"
    if isinstance(value, float):
        return "Float64"
    if isinstance(value, str):
        return "String"
    raise TypeError(f"cannot bind a {type(value).__name__} as a ClickHouse query parameter")


DUCKDB = Dialect(
    "duckdb",
    param=lambda name, value: f"${name}",
    attr=lambda m, key: f"{m}[{key}]",
    to_float=lambda x: f"TRY_CAST({x} AS DOUBLE)",
    # DuckDB rounds a double cast to an integer; trunc first, as a float-to-int cast does.
    to_int=lambda x: f"TRY_CAST(trunc(TRY_CAST({x} AS DOUBLE)) AS BIGINT)",
    int64=lambda x: f"CAST({x} AS BIGINT)",
    strip=lambda x, pattern: f"regexp_replace({x}, {pattern}, '')",
    lag=lambda x, partition, order: f"lag({x}) OVER (PARTITION BY {partition} ORDER BY {order})",
    find=lambda x, needle: f"strpos({x}, {needle})",
    last_item=lambda x, sep: f"string_split({x}, {sep})[-1]",
    int_div=lambda x, y: f"({x}) // ({y})",
    exclude="EXCLUDE",
    create_as=lambda table, _: (f"CREATE TABLE {table} AS" if "." in table
                                else f"CREATE TEMP TABLE {table} AS"),
)
CLICKHOUSE = Dialect(
    "clickhouse",
    param=lambda name, value: f"{{{name}:{_clickhouse_type(value)}}}",
    attr=lambda m, key: f"if(mapContains({m}, {key}), {m}[{key}], NULL)",
    to_float=lambda x: f"toFloat64OrNull({x})",
    to_int=lambda x: f"accurateCastOrNull(trunc(toFloat64OrNull({x})), 'Int64')",
    # CAST to a non-Nullable type fails on NULL; this one keeps it.
    int64=lambda x: f"accurateCastOrNull({x}, 'Int64')",
    strip=lambda x, pattern: f"replaceRegexpOne({x}, {pattern}, '')",
    # ClickHouse has no lag(); lagInFrame reads the frame, which must reach the row before, and
    # gives the type's default (not NULL) before the first row unless the value is Nullable.
    lag=lambda x, partition, order: (
        f"lagInFrame(toNullable({x}), 1) OVER (PARTITION BY {partition} ORDER BY {order} "
        "ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)"),
    find=lambda x, needle: f"position({x}, {needle})",
    # splitByChar takes a constant separator: a bound parameter is one once substituted.
    last_item=lambda x, sep: f"arrayElement(splitByChar({sep}, {x}), -1)",
    int_div=lambda x, y: f"intDiv({x}, {y})",
    exclude="EXCEPT",
    # A partition's rows are read by ``_p``: the table's sort key, so its scan skips the rest.
    create_as=lambda table, partitioned: (
        f"CREATE TABLE {table} ENGINE = MergeTree ORDER BY "
        + ("_p SETTINGS allow_nullable_key = 1 AS" if partitioned else "tuple() AS")),
    # A LEFT JOIN's unmatched columns are the type's default ('' and 0) unless this is set:
    # the ledger's joins mean NULL (no span joined).
    suffix=" SETTINGS join_use_nulls = 1",
)
_PLACEHOLDER = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)")


class Binder:
    """Binds values as the named parameters of one query, numbered as met (``p0``, ``p1``, …),
    so a query composed of several parts numbers them once, the same in every dialect."""

    def __init__(self, dialect: Dialect) -> None:
        self.dialect = dialect
        self.params: dict[str, Any] = {}

    def __call__(self, value: Any) -> str:
        """The placeholder of ``value``, bound as the next parameter."""
        name = f"p{len(self.params)}"
        self.params[name] = value
        return self.dialect.param(name, value)

    def column(self, column: Column) -> str:
        """A table column (quoted) or an attribute (its key bound)."""
        if isinstance(column, Attr):
            return self.dialect.attr(quote(column.map), self(column.key))
        return quote(column)


@dataclass(frozen=True)
class Query:
    """SQL text with named parameters (``$name``) and their values.

    ``sql`` is the DuckDB text. A query built by :func:`select` or :func:`compose` renders
    itself for each dialect (``build``); one written by hand has its ``$name`` placeholders
    rewritten.
    """

    sql: str
    params: Mapping[str, Any] = field(default_factory=dict)
    build: Callable[[Binder], str] | None = field(default=None, compare=False, repr=False)
    # What a reader's errors call the query (an analysis's name for it); "" for none.
    name: str = field(default="", compare=False)
    # Values for ``?`` placeholders, in order, instead of ``params``: DuckDB only (kvscope sql's
    # deprecated ``--param VALUE``); a ClickHouse reader refuses them.
    positional: tuple[Any, ...] = ()

    def named(self, name: str) -> Query:
        """This query, called ``name`` in a reader's errors."""
        return replace(self, name=name)

    def text(self, dialect: Dialect) -> str:
        """The SQL text in ``dialect``."""
        if self.build is not None:
            return self.build(Binder(dialect))
        if dialect is DUCKDB:
            return self.sql

        def placeholder(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in self.params:
                raise KeyError(f"query parameter ${name} has no value")
            return dialect.param(name, self.params[name])
        return _PLACEHOLDER.sub(placeholder, self.sql)


def _built(build: Callable[[Binder], str]) -> Query:
    binder = Binder(DUCKDB)
    sql = build(binder)
    return Query(sql, binder.params, build)


def select(table: str, columns: Mapping[str, Column], *,
           where: Mapping[Column, Any] | None = None, distinct: bool = False) -> Query:
    """``SELECT [DISTINCT] <columns> FROM table WHERE <each where entry>``.

    ``columns`` maps output names to table columns or attributes. Each ``where`` entry compares
    a column or attribute with a value (``=``), or with each of a tuple's values (``IN``).
    """
    def build(bind: Binder) -> str:
        chosen = ", ".join(f"{bind.column(c)} AS {quote(alias)}" for alias, c in columns.items())
        conditions = []
        for column, value in (where or {}).items():
            if isinstance(value, tuple):
                conditions.append(
                    f"{bind.column(column)} IN ({', '.join(bind(v) for v in value)})")
            else:
                conditions.append(f"{bind.column(column)} = {bind(value)}")
        return (f"SELECT {'DISTINCT ' if distinct else ''}{chosen} FROM {quote(table)}"
                + (f" WHERE {' AND '.join(conditions)}" if conditions else ""))

    return _built(build)


def spans(name: str, columns: Mapping[str, Column], *,
          where: Mapping[Column, Any] | None = None, distinct: bool = False) -> Query:
    """The spans called ``name`` (``otel_traces``), with more conditions in ``where``."""
    return select(TRACES, columns, where={"SpanName": name, **(where or {})}, distinct=distinct)


# A part of a composed query: a query, or SQL text built with the composed query's binder.
Part = Query | Callable[[Binder], str]


def compose(parts: Sequence[tuple[str, Part]], final: Callable[[Binder], str]) -> Query:
    """``WITH name AS (part), … final``: named parts as common table expressions, their
    parameters numbered once; the dialect's ``suffix`` (settings) closes the statement."""
    builders: list[tuple[str, Callable[[Binder], str]]] = []
    for name, part in parts:
        if isinstance(part, Query):
            if part.build is None:
                raise ValueError(f"part {name!r} is hand-written SQL: compose() needs a built "
                                 "query")
            builders.append((name, part.build))
        else:
            builders.append((name, part))

    def build(bind: Binder) -> str:
        ctes = ", ".join(f"{quote(name)} AS ({part(bind)})" for name, part in builders)
        return (f"WITH {ctes} " if ctes else "") + final(bind) + bind.dialect.suffix

    return _built(build)

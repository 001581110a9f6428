"""Queries over the store's OpenTelemetry tables, written one way: named parameters, one accessor.

Analyses name what they read (:func:`spans`, :func:`select`): a column of the table, or an
attribute of the span, its resource or a metric point (:func:`span_attr`,
:func:`resource_attr`, :func:`point_attr`). Every attribute key and every compared value becomes
a named parameter (``$p0``, ``$p1``, …) of the :class:`Query`; nothing is spliced into SQL text
but quoted column names. A :class:`~kvscope.store.reader.StoreReader` runs a :class:`Query`
through its one seam (time limit, error translation).

The same query runs on DuckDB and on ClickHouse (the OpenTelemetry Collector's tables): a
:class:`Dialect` renders what differs, and only that. A parameter is ``$p0`` in DuckDB and
``{p0:String}`` in ClickHouse; an attribute is ``map[key]`` in both, but a key the map lacks
reads as NULL in DuckDB and as ``''`` in ClickHouse, so ClickHouse's look-up is
``if(mapContains(map, key), map[key], NULL)`` (a missing attribute is never an empty string).
``Query.sql`` is the DuckDB text; :meth:`Query.text` renders for either dialect.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvscope.store.schema import quote

__all__ = [
    "CLICKHOUSE",
    "DUCKDB",
    "Attr",
    "Dialect",
    "Query",
    "point_attr",
    "resource_attr",
    "select",
    "span_attr",
    "spans",
]

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
    """What differs between the engines a :class:`Query` runs on: parameters and map look-ups."""

    name: str
    # (parameter name, its value) -> the placeholder in SQL text
    param: Callable[[str, Any], str]
    # (quoted map column, placeholder of the key) -> the attribute's value, NULL when absent
    attr: Callable[[str, str], str]


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


DUCKDB = Dialect("duckdb", lambda name, value: f"${name}", lambda m, key: f"{m}[{key}]")
CLICKHOUSE = Dialect(
    "clickhouse",
    lambda name, value: f"{{{name}:{_clickhouse_type(value)}}}",
    lambda m, key: f"if(mapContains({m}, {key}), {m}[{key}], NULL)",
)
_PLACEHOLDER = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)")


@dataclass(frozen=True)
class Query:
    """SQL text with named parameters (``$name``) and their values.

    ``sql`` is the DuckDB text. A query built by :func:`select` renders itself for each
    dialect (``render``); one written by hand has its ``$name`` placeholders rewritten.
    """

    sql: str
    params: Mapping[str, Any] = field(default_factory=dict)
    render: Callable[[Dialect], str] | None = field(default=None, compare=False, repr=False)

    def text(self, dialect: Dialect) -> str:
        """The SQL text in ``dialect``."""
        if self.render is not None:
            return self.render(dialect)
        if dialect is DUCKDB:
            return self.sql

        def placeholder(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in self.params:
                raise KeyError(f"query parameter ${name} has no value")
            return dialect.param(name, self.params[name])
        return _PLACEHOLDER.sub(placeholder, self.sql)


def select(table: str, columns: Mapping[str, Column], *,
           where: Mapping[Column, Any] | None = None, distinct: bool = False) -> Query:
    """``SELECT [DISTINCT] <columns> FROM table WHERE <each where entry>``.

    ``columns`` maps output names to table columns or attributes. Each ``where`` entry compares
    a column or attribute with a value (``=``), or with each of a tuple's values (``IN``).
    """
    def build(dialect: Dialect) -> tuple[str, dict[str, Any]]:
        # Parameters are numbered in the order they are met, the same in every dialect.
        params: dict[str, Any] = {}

        def bind(value: Any) -> str:
            name = f"p{len(params)}"
            params[name] = value
            return dialect.param(name, value)

        def expr(column: Column) -> str:
            if isinstance(column, Attr):
                return dialect.attr(quote(column.map), bind(column.key))
            return quote(column)

        chosen = ", ".join(f"{expr(c)} AS {quote(alias)}" for alias, c in columns.items())
        conditions = []
        for column, value in (where or {}).items():
            if isinstance(value, tuple):
                conditions.append(f"{expr(column)} IN ({', '.join(bind(v) for v in value)})")
            else:
                conditions.append(f"{expr(column)} = {bind(value)}")
        sql = (f"SELECT {'DISTINCT ' if distinct else ''}{chosen} FROM {quote(table)}"
               + (f" WHERE {' AND '.join(conditions)}" if conditions else ""))
        return sql, params

    sql, params = build(DUCKDB)
    return Query(sql, params, lambda dialect: build(dialect)[0])


def spans(name: str, columns: Mapping[str, Column], *,
          where: Mapping[Column, Any] | None = None, distinct: bool = False) -> Query:
    """The spans called ``name`` (``otel_traces``), with more conditions in ``where``."""
    return select(TRACES, columns, where={"SpanName": name, **(where or {})}, distinct=distinct)

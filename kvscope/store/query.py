"""Queries over the store's OpenTelemetry tables, written one way: named parameters, one accessor.

Analyses name what they read (:func:`spans`, :func:`select`): a column of the table, or an
attribute of the span, its resource or a metric point (:func:`span_attr`,
:func:`resource_attr`, :func:`point_attr`). Every attribute key and every compared value becomes
a named parameter (``$p0``, ``$p1``, …) of the :class:`Query`; nothing is spliced into SQL text
but quoted column names. A :class:`~kvscope.store.reader.StoreReader` runs a :class:`Query`
through its one seam (time limit, error translation).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvscope.store.schema import quote

__all__ = [
    "Attr",
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
class Query:
    """SQL text with named parameters (``$name``) and their values."""

    sql: str
    params: Mapping[str, Any] = field(default_factory=dict)


def select(table: str, columns: Mapping[str, Column], *,
           where: Mapping[Column, Any] | None = None, distinct: bool = False) -> Query:
    """``SELECT [DISTINCT] <columns> FROM table WHERE <each where entry>``.

    ``columns`` maps output names to table columns or attributes. Each ``where`` entry compares
    a column or attribute with a value (``=``), or with each of a tuple's values (``IN``).
    """
    params: dict[str, Any] = {}

    def bind(value: Any) -> str:
        name = f"p{len(params)}"
        params[name] = value
        return f"${name}"

    def expr(column: Column) -> str:
        if isinstance(column, Attr):
            return f"{quote(column.map)}[{bind(column.key)}]"
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
    return Query(sql, params)


def spans(name: str, columns: Mapping[str, Column], *,
          where: Mapping[Column, Any] | None = None, distinct: bool = False) -> Query:
    """The spans called ``name`` (``otel_traces``), with more conditions in ``where``."""
    return select(TRACES, columns, where={"SpanName": name, **(where or {})}, distinct=distinct)

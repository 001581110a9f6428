"""Query results as text: an aligned table, CSV or JSON (every command that prints rows)."""

from __future__ import annotations

import csv
import io
import json
import shutil
import sys
from collections.abc import Sequence
from datetime import date, datetime
from decimal import Decimal
from typing import Any

# What a figure, table or sentence says instead of a number nobody measured (never 0).
NOT_MEASURED = "not measured"


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, dict | list):
        return json.dumps(value, default=str, separators=(",", ":"))
    return str(value)


def round_float(value: float) -> str:
    """A float as people read it: 4 significant digits, thousands separated, and float noise
    (|x| < 1e-9, e.g. 3.553e-15 left by a subtraction) as 0."""
    if value != value:  # NaN
        return "nan"
    if abs(value) < 1e-9:
        return "0"
    if abs(value) >= 1e6:
        return f"{value:,.0f}"
    return f"{value:.4g}"


def _text_cell(value: Any) -> str:
    return round_float(value) if isinstance(value, float) else _cell(value)


def jsonable(value: Any) -> Any:
    """A cell as JSON holds it (dates as ISO text, decimals as floats, bytes as hex)."""
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, bytes):
        return value.hex()
    return value


# Narrowest a column is cut to when a table must fit the terminal.
MIN_COLUMN_WIDTH = 8


def terminal_width() -> int | None:
    """The terminal's width when stdout is one, else None (pipes and files get whole cells)."""
    if not sys.stdout.isatty():
        return None
    return shutil.get_terminal_size().columns


def fit(widths: list[int], total: int, gap: int = 2) -> list[int]:
    """Column widths that fit ``total`` characters: the widest column is narrowed first, none
    below :data:`MIN_COLUMN_WIDTH` (so a very narrow terminal still wraps)."""
    widths = list(widths)
    while sum(widths) + gap * (len(widths) - 1) > total:
        widest = max(range(len(widths)), key=widths.__getitem__)
        if widths[widest] <= MIN_COLUMN_WIDTH:
            break
        widths[widest] -= 1
    return widths


def format_rows(columns: Sequence[str], rows: Sequence[Sequence[Any]], fmt: str,
                width: int | None = None) -> str:
    """Render a result as an aligned text table (drawn by rich), CSV or JSON (a list of objects).

    A table is fitted to ``width`` characters (default: the terminal's, when stdout is one) by
    narrowing its widest columns and cutting their cells with a visible "…"; a pipe or file
    (no width) gets every cell whole.
    """
    if fmt == "json":
        records = [
            {c: jsonable(v) for c, v in zip(columns, row, strict=True)} for row in rows
        ]
        return json.dumps(records, indent=2, default=str) + "\n"
    if fmt == "csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(columns)
        for row in rows:
            writer.writerow([_cell(v) for v in row])
        return buffer.getvalue()
    cells = [[_text_cell(v) for v in row] for row in rows]
    widths = [len(c) for c in columns]
    for row in cells:
        widths = [max(w, len(v)) for w, v in zip(widths, row, strict=True)]
    limit = terminal_width() if width is None else width
    if limit is not None:
        widths = fit(widths, limit, gap=_GAP)
    numeric = [bool(rows) and all(isinstance(row[i], int | float | Decimal) or row[i] is None
                                  for row in rows) for i in range(len(columns))]
    footer = f"({len(rows)} row{'s' if len(rows) != 1 else ''})"
    return _rich_table(columns, cells, widths, numeric) + footer + "\n"


# Spaces between columns: the box's divider and one of padding.
_GAP = 2


def _rich_table(columns: Sequence[str], cells: list[list[str]], widths: list[int],
                numeric: list[bool]) -> str:
    """The table drawn by rich: a header rule, cells cut to their width with a visible "…",
    numbers right-aligned; plain text (no colour), trailing spaces stripped."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="",
                  padding=(0, 0, 0, 1))
    for name, w, right in zip(columns, widths, numeric, strict=True):
        table.add_column(name, width=w, no_wrap=True, overflow="ellipsis",
                         justify="right" if right else "left")
    for row in cells:
        table.add_row(*row)
    out = io.StringIO()
    total = sum(widths) + _GAP * (len(widths) - 1)
    Console(file=out, width=total, color_system=None, force_terminal=False, highlight=False,
            markup=False, emoji=False, legacy_windows=False).print(table)
    lines = [line.rstrip() for line in out.getvalue().splitlines()]
    return "\n".join(line for line in lines if line) + "\n"


__all__ = ["MIN_COLUMN_WIDTH", "NOT_MEASURED", "fit", "format_rows", "jsonable", "round_float",
    "terminal_width"]

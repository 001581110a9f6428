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


def _jsonable(value: Any) -> Any:
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


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def format_rows(columns: Sequence[str], rows: Sequence[Sequence[Any]], fmt: str,
                width: int | None = None) -> str:
    """Render a result as an aligned text table, CSV or JSON (a list of objects).

    A table is fitted to ``width`` characters (default: the terminal's, when stdout is one) by
    narrowing its widest columns and cutting their cells with an ellipsis.
    """
    if fmt == "json":
        records = [
            {c: _jsonable(v) for c, v in zip(columns, row, strict=True)} for row in rows
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
        widths = fit(widths, limit)
        columns = [_clip(c, w) for c, w in zip(columns, widths, strict=True)]
        cells = [[_clip(v, w) for v, w in zip(row, widths, strict=True)] for row in cells]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip(),
        "  ".join("-" * w for w in widths),
    ]
    lines += [
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    lines.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(lines) + "\n"

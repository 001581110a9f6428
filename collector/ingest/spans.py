"""What every ingested source shares: reading its file, deterministic ids, one span row builder."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvscope import __version__, semconv
from kvscope.errors import IngestError
from kvscope.files import read_limited
from kvscope.store.rows import Attrs, TraceRows, stringify
from kvscope.store.schema import SPAN_KIND_NAMES, STATUS_CODE_NAMES

# As the OTLP decoder names them (opentelemetry.proto SpanKind / Status.StatusCode numbers).
KIND_INTERNAL = SPAN_KIND_NAMES[1]
KIND_SERVER = SPAN_KIND_NAMES[2]
KIND_CLIENT = SPAN_KIND_NAMES[3]
STATUS_UNSET = STATUS_CODE_NAMES[0]
STATUS_ERROR = STATUS_CODE_NAMES[2]


@dataclass(frozen=True)
class SourceFile:
    """One source file read whole: its bytes, text, modification time and SHA-256."""

    data: bytes
    text: str
    mtime_ns: int
    sha256: str


# Largest source file ingest reads. A file is read whole and decoded (about twice its size in
# memory, more while parsed); a larger log can be split (``split -C 256M``) and ingested as
# several sources of one run.
MAX_SOURCE_BYTES = 512 << 20


def read_source(path: Path) -> SourceFile:
    """Read ``path`` as UTF-8 text; IngestError names the file (and the line of a bad byte)."""
    data = read_limited(path, MAX_SOURCE_BYTES, "ingest source", IngestError)
    try:
        mtime_ns = path.stat().st_mtime_ns
    except OSError as exc:
        raise IngestError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise IngestError(f"{path}:{line}: not UTF-8 text") from None
    return SourceFile(data, text, mtime_ns, hashlib.sha256(data).hexdigest())


@dataclass
class LineCounts:
    """Lines a log parser read, and those it could not place (counted, never errors)."""

    lines: int = 0
    unknown: int = 0


# Largest count a log line may carry: the store's analyses cast counts to BIGINT.
MAX_COUNT = 2**63 - 1
# Largest magnitude of a measured value (ms, s, MB) a log line may carry.
MAX_MEASURE = 1e15


def count_value(path: Path, line: int, text: str) -> int:
    """A count a log line's pattern matched as digits; IngestError past :data:`MAX_COUNT`
    (Python refuses to convert more than 4300 digits, and a larger count breaks every query)."""
    if len(text) > len(str(MAX_COUNT)) or int(text) > MAX_COUNT:
        raise IngestError(f"{path}:{line}: the count {text[:24]}{'...' if len(text) > 24 else ''}"
                          f" is larger than {MAX_COUNT}")
    return int(text)


def measure_value(path: Path, line: int, text: str) -> float:
    """A measured value (ms, s, MB) a log line's pattern matched; IngestError when it is not
    finite or past :data:`MAX_MEASURE` in magnitude."""
    value = float(text)
    if not abs(value) <= MAX_MEASURE:
        raise IngestError(f"{path}:{line}: the value {text[:24]}{'...' if len(text) > 24 else ''}"
                          f" is out of range (at most {MAX_MEASURE:g} in magnitude)")
    return value


def ingest_id(sha256: str, *parts: object, size: int) -> str:
    """A deterministic non-zero id (hex) for one span of one file: re-reading gives the same."""
    digest = hashlib.sha256("\x1f".join((sha256, *map(str, parts))).encode()).hexdigest()
    value = digest[: size * 2]
    return value if int(value, 16) else "0" * (size * 2 - 1) + "1"


def attrs(values: dict[str, Any]) -> Attrs:
    """Attribute pairs of the set values (None means not measured: left out)."""
    return [(key, stringify(value)) for key, value in values.items() if value is not None]


def resource(service: str, run_id: str, kind: str, file_name: str) -> Attrs:
    """The resource of every span one file adds."""
    return attrs({"service.name": service, semconv.RUN_ID: run_id, semconv.INGEST_KIND: kind,
                  semconv.INGEST_FILE: file_name})


def add_span(rows: TraceRows, *, resource_attrs: Attrs, service: str, name: str, trace_id: str,
             span_id: str, parent: str, kind: str, start_ns: int, end_ns: int,
             values: dict[str, Any], events: Sequence[tuple[int, str, Attrs]] = (),
             status: str = STATUS_UNSET, status_message: str = "") -> None:
    """Append one span row (times in Unix ns)."""
    rows.add(
        timestamp_ns=start_ns, trace_id=trace_id, span_id=span_id, parent_span_id=parent,
        trace_state="", span_name=name, span_kind=kind, service_name=service,
        resource_attributes=resource_attrs, scope_name=semconv.SCOPE_NAME,
        scope_version=__version__, span_attributes=attrs(values),
        duration_ns=max(end_ns - start_ns, 0), status_code=status,
        status_message=status_message, events=list(events), links=[],
    )


__all__ = ["KIND_CLIENT", "KIND_INTERNAL", "KIND_SERVER", "LineCounts", "MAX_COUNT", "MAX_MEASURE",
    "MAX_SOURCE_BYTES", "STATUS_ERROR", "STATUS_UNSET", "SourceFile", "add_span", "attrs",
    "count_value", "ingest_id", "measure_value", "read_source", "resource"]

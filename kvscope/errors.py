"""kvscope's exception hierarchy.

    KvscopeError                 base of everything kvscope raises on purpose
    ├── SettingError             a bad explicit setting value (option or argument)
    ├── StoreError               a DuckDB store cannot be used
    │   ├── NotAKvscopeStore     the file is not DuckDB, or a DuckDB file of something else
    │   ├── NewerSchemaError     written by a newer kvscope; refused, never rewritten
    │   └── StoreLockedError     another process holds the file for writing
    ├── PayloadError             an OTLP payload that cannot be decoded (receiver → HTTP 400)
    ├── IngestError              a source file that cannot be ingested (names file and line),
    │                            or one already in the store
    ├── ChildStartError          a helper process did not start (kvscope.child)
    ├── AnalysisError            an analysis cannot run on these runs or parameters
    │                            (kvscope.analysis.registry)
    └── WorkloadError            a workload or trace file that cannot be read
                                 (kvscope.emulator.workloads.model)

Third-party errors (duckdb, protobuf) are translated into these at one boundary each; the CLI
turns them into one-line messages.
"""

from __future__ import annotations


class KvscopeError(Exception):
    """Base class of every error kvscope raises on purpose."""


class SettingError(KvscopeError, ValueError):
    """An explicit setting value is invalid."""


class StoreError(KvscopeError):
    """A DuckDB store cannot be opened or used."""


class QueryError(StoreError):
    """A query a reader ran failed or ran past its time limit; names the query and its SQL."""

    def __init__(self, message: str, *, query_name: str = "", sql: str = "") -> None:
        super().__init__(message)
        self.query_name = query_name
        self.sql = sql


class QueryOutOfMemory(QueryError):
    """A query ran out of the engine's memory (DuckDB's ``memory_limit``, its spill included)."""


class NotAKvscopeStore(StoreError):
    """The file is not a DuckDB database, or is one that kvscope did not create."""


class NewerSchemaError(StoreError):
    """The store was written by a newer kvscope schema version."""


class StoreLockedError(StoreError):
    """Another process holds the store open for writing."""


class PayloadError(KvscopeError, ValueError):
    """An OTLP request body is malformed."""


class IngestError(KvscopeError, ValueError):
    """A source file for ``kvscope ingest`` is malformed, of no known kind, or already stored."""


__all__ = ["IngestError", "KvscopeError", "NewerSchemaError", "NotAKvscopeStore", "PayloadError",
    "QueryError", "QueryOutOfMemory", "SettingError", "StoreError", "StoreLockedError"]

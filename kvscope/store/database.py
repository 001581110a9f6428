"""Opening a kvscope DuckDB store: create, check, migrate, or refuse — never rewrite a foreign file.

``open_store(path)`` is the one place a writable connection is made and
``open_readonly(path)`` the one place a read-only one is; both translate DuckDB's errors into
:mod:`kvscope.errors`.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Any

import duckdb

from kvscope import settings
from kvscope.errors import NewerSchemaError, NotAKvscopeStore, StoreError, StoreLockedError
from kvscope.store import migrations
from kvscope.store.schema import (
    KVSCOPE_TABLES,
    META_TABLE,
    RUNS_TABLE,
    SCHEMA_VERSION,
    ddl,
    quote,
)

_LOCK_MARKERS = ("Could not set lock", "Conflicting lock", "lock on file")
_NOT_DUCKDB_MARKERS = ("not a valid DuckDB database", "database file", "Invalid Input Error")
# How much write-ahead log a writer collects before DuckDB checkpoints it into the file. At
# DuckDB's default (16 MiB) a bulk span load checkpoints every ~40k spans and each checkpoint
# grows dearer as the table does: 800k spans took 17.7 s to insert in 20k-row batches, against
# 8.7-9.1 s at 64 MiB (checkpoints every ~100k spans at a steady ~0.3 s). The log stays bounded.
WAL_CHECKPOINT_THRESHOLD = "64MiB"
# Temporary Parquet batch files (store/writer.py) live in a folder beside their store, named
# with their process id, so that the next writer to open the store finds and removes what an
# abrupt end (SIGKILL, power loss) left behind; the system temp dir would keep them forever.
BATCH_FOLDER_SUFFIX = ".kvscope-tmp"
BATCH_FILE_PREFIX = "kvscope-batch-"


def batch_folder(path: str | Path) -> Path:
    """The folder beside the store at ``path`` that holds its temporary batch files."""
    return Path(f"{path}{BATCH_FOLDER_SUFFIX}")


def batch_file_prefix() -> str:
    """The name prefix of this process's batch files (the pid tells whose a file is)."""
    return f"{BATCH_FILE_PREFIX}{os.getpid()}-"


def _remove_stale_batch_files(path: str) -> None:
    """Remove batch files that other (ended) processes left beside the store at ``path``.

    Called once the store is open for writing: DuckDB's lock means no other process writes this
    store now. This process's own files are kept (another connection of it may be inserting).
    """
    folder = batch_folder(path)
    if not folder.is_dir():
        return
    mine = batch_file_prefix()
    for stale in folder.glob(f"{BATCH_FILE_PREFIX}*.parquet"):
        if not stale.name.startswith(mine):
            try:
                stale.unlink()
            except OSError:
                pass
    try:
        folder.rmdir()  # only when empty
    except OSError:
        pass


def _connect(path: str, read_only: bool) -> duckdb.DuckDBPyConnection:
    if path != ":memory:" and read_only and not Path(path).exists():
        raise StoreError(f"{path}: no such store file")
    if path != ":memory:" and Path(path).is_dir():
        raise StoreError(f"{path}: is a directory, expected a DuckDB file")
    try:
        return duckdb.connect(path, read_only=read_only)
    except duckdb.IOException as exc:
        message = str(exc)
        if any(marker in message for marker in _LOCK_MARKERS):
            raise StoreLockedError(
                f"{path}: another process holds this store for writing "
                "(send telemetry to that process over OTLP, or stop it first)"
            ) from None
        if any(marker in message for marker in _NOT_DUCKDB_MARKERS):
            raise NotAKvscopeStore(f"{path}: not a DuckDB database; refusing to touch it") from None
        raise StoreError(f"{path}: cannot open: {message.splitlines()[0]}") from None
    except duckdb.Error as exc:
        first = str(exc).splitlines()[0]
        if "not a valid DuckDB" in first or "Invalid Input" in first or "Serialization" in first:
            raise NotAKvscopeStore(f"{path}: not a DuckDB database; refusing to touch it") from None
        raise StoreError(f"{path}: cannot open: {first}") from None


def _tables(con: duckdb.DuckDBPyConnection) -> set[str]:
    rows = con.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = 'main'"
    ).fetchall()
    return {row[0] for row in rows}


def schema_version(con: duckdb.DuckDBPyConnection, path: str) -> int | None:
    """The store's schema version; None for an empty database; refuse anything foreign."""
    tables = _tables(con)
    if not tables:
        return None
    if META_TABLE not in tables:
        raise NotAKvscopeStore(
            f"{path}: a DuckDB file with tables {sorted(tables)[:5]} but no {META_TABLE}; "
            "not a kvscope store, refusing to touch it"
        )
    rows = con.execute(
        f"SELECT value FROM {quote(META_TABLE)} WHERE key = 'schema_version'"
    ).fetchall()
    row = rows[0] if rows else None
    if row is None or not str(row[0]).isdigit():
        raise NotAKvscopeStore(f"{path}: {META_TABLE} has no valid schema_version; refusing")
    version = int(row[0])
    if version < 1:
        raise NotAKvscopeStore(
            f"{path}: schema version {version} in {META_TABLE} is not one kvscope ever wrote "
            "(versions start at 1); refusing to touch it"
        )
    if version > SCHEMA_VERSION:
        raise NewerSchemaError(
            f"{path}: schema version {version} is newer than this kvscope understands "
            f"({SCHEMA_VERSION}); upgrade kvscope to read it"
        )
    return version


@cache
def _expected_columns() -> dict[str, tuple[tuple[str, str], ...]]:
    """Table → (column, DuckDB type) of schema version :data:`SCHEMA_VERSION`, as DuckDB itself
    spells the types (read back from the DDL run in an in-memory database)."""
    con = duckdb.connect(":memory:")
    try:
        for statement in ddl():
            con.execute(statement)
        return {table: _columns(con, table) for table in KVSCOPE_TABLES}
    finally:
        con.close()


def _columns(con: duckdb.DuckDBPyConnection, table: str) -> tuple[tuple[str, str], ...]:
    rows = con.execute(
        "SELECT column_name, data_type FROM information_schema.columns "
        "WHERE table_schema = 'main' AND table_name = ? ORDER BY ordinal_position",
        [table],
    ).fetchall()
    return tuple((str(name), str(kind)) for name, kind in rows)


def check_schema(con: duckdb.DuckDBPyConnection, path: str) -> None:
    """Refuse a store whose kvscope tables are not those of the current schema version.

    A damaged store (a table or column dropped or retyped by hand, a half-copied file) would
    otherwise be accepted and fail at every insert, so that exporters retry forever against a
    receiver answering 503. The error names the first thing that is wrong.
    """
    tables = _tables(con)
    for table, expected in _expected_columns().items():
        if table not in tables:
            raise NotAKvscopeStore(
                f"{path}: table {table} is missing (schema version {SCHEMA_VERSION} has it); "
                "a damaged store, refusing to use it"
            )
        present = _columns(con, table)
        if present == expected:
            continue
        found = dict(present)
        for column, kind in expected:
            if column not in found:
                raise NotAKvscopeStore(
                    f"{path}: column {table}.{column} is missing; a damaged store, "
                    "refusing to use it"
                )
            if found[column] != kind:
                raise NotAKvscopeStore(
                    f"{path}: column {table}.{column} is {found[column]}, expected {kind}; "
                    "a damaged store, refusing to use it"
                )
        extra = [column for column in found if column not in dict(expected)]
        # The writer inserts by position (INSERT ... SELECT *): an added or reordered column
        # would fail every insert too.
        raise NotAKvscopeStore(
            f"{path}: table {table} has "
            + (f"an extra column {extra[0]}" if extra else "its columns in another order")
            + f" than schema version {SCHEMA_VERSION}; a damaged store, refusing to use it"
        )


def _initialise(con: duckdb.DuckDBPyConnection) -> None:
    con.execute("BEGIN TRANSACTION")
    try:
        for statement in ddl():
            con.execute(statement)
        con.execute(
            f"INSERT INTO {quote(META_TABLE)} VALUES ('schema_version', ?), ('created_by', ?)",
            [str(SCHEMA_VERSION), "kvscope"],
        )
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise


def open_store(path: str | Path, *, threads: int | None = None,
               memory_limit: str | None = None) -> duckdb.DuckDBPyConnection:
    """Open (creating if new) a store for writing; refuse foreign, newer or locked files.

    ``threads``: DuckDB's worker threads for this database (default: one per core). A process
    that only inserts span batches beside other busy processes does best with 1: the same
    800k spans took 7.0 s of CPU instead of 8.0 s. ``memory_limit``: DuckDB's memory limit
    (an amount such as 4GB, checked by the ``store_memory_limit`` setting); the ledger's
    rebuild passes that setting's value, as readers use it.
    """
    path = str(path)
    if path != ":memory:":
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    con = _connect(path, read_only=False)
    try:
        con.execute(f"SET checkpoint_threshold = '{WAL_CHECKPOINT_THRESHOLD}'")
        if threads is not None:
            con.execute(f"SET threads = {int(threads)}")
        if memory_limit:
            checked = settings.resolve("store_memory_limit", memory_limit)
            con.execute(f"SET memory_limit = '{checked}'")
        version = schema_version(con, path)
        if version is None:
            _initialise(con)
        elif version < SCHEMA_VERSION:
            migrations.upgrade(con, version)
        check_schema(con, path)
    except BaseException:
        con.close()
        raise
    if path != ":memory:":
        _remove_stale_batch_files(path)
    return con


def open_readonly(path: str | Path) -> duckdb.DuckDBPyConnection:
    """Open an existing store read-only; refuse anything that is not a kvscope store."""
    path = str(path)
    con = _connect(path, read_only=True)
    try:
        # DuckDB shares one database instance among a process's connections to a file: a
        # second reader of the same store finds it configured and locked already.
        locked = con.execute("SELECT current_setting('lock_configuration')").fetchone()
        if not (locked and locked[0]):
            limit = settings.resolve("store_memory_limit")
            if limit:  # validated by the setting: an amount such as 4GB
                con.execute(f"SET memory_limit = '{limit}'")
            # A library's queries draw nothing on the user's terminal.
            con.execute("SET enable_progress_bar = false")
            # Readers only read this file: no COPY TO, ATTACH or extension loads from user SQL.
            con.execute("SET enable_external_access = false")
            con.execute("SET lock_configuration = true")
        version = schema_version(con, path)
        if version is None:
            raise NotAKvscopeStore(f"{path}: empty DuckDB file, not a kvscope store")
        if version < SCHEMA_VERSION:
            raise StoreError(
                f"{path}: schema version {version} is older than {SCHEMA_VERSION}; "
                "open it once for writing (e.g. `kvscope serve --db`) to upgrade it"
            )
        check_schema(con, path)
    except BaseException:
        con.close()
        raise
    return con


# DuckDB's memory for a store's plain scans (:func:`open_scanner`).
SCAN_MEMORY_LIMIT = "256MB"


def open_scanner(path: str | Path) -> duckdb.DuckDBPyConnection:
    """The store at ``path`` read-only in a DuckDB instance of its own, held to
    :data:`SCAN_MEMORY_LIMIT` with nowhere to spill, for scans that need no working memory (a
    stored table read a column at a time).

    DuckDB keeps the blocks a scan reads cached up to its memory limit, and a reader's limit is
    ``store_memory_limit`` (4GB by default: what a ledger computed in the engine needs). All 55
    columns of a 10M-turn ledger table read that way held 1.6 GiB of them beside the columns
    themselves. One file has one instance a process, with one configuration (a second
    ``connect`` with another limit is refused), so this one attaches the file instead.
    """
    path = str(path)
    con = _connect(":memory:", read_only=False)
    try:
        con.execute(f"SET memory_limit = '{SCAN_MEMORY_LIMIT}'")
        con.execute("SET temp_directory = ''")  # a scan past the limit fails; it writes nothing
        con.execute("SET enable_progress_bar = false")
        con.execute("ATTACH ? AS store (READ_ONLY)", [path])
        con.execute("USE store")
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
    except duckdb.Error as exc:
        con.close()
        raise StoreError(f"{path}: cannot open: {str(exc).splitlines()[0]}") from None
    return con


def begin_run(
    con: duckdb.DuckDBPyConnection,
    label: str,
    settings: Mapping[str, Any],
    run_id: str | None = None,
) -> str:
    """Record a new run and return its id."""
    run_id = run_id or uuid.uuid4().hex[:16]
    con.execute(
        f"INSERT INTO {quote(RUNS_TABLE)} (run_id, label, settings, started_at) "
        "VALUES (?, ?, ?, ?)",
        [run_id, label, json.dumps(dict(settings), sort_keys=True, default=str),
         datetime.now(UTC)],
    )
    return run_id


def end_run(con: duckdb.DuckDBPyConnection, run_id: str) -> None:
    """Mark a run finished."""
    con.execute(
        f"UPDATE {quote(RUNS_TABLE)} SET ended_at = ? WHERE run_id = ?",
        [datetime.now(UTC), run_id],
    )


def table_counts(con: duckdb.DuckDBPyConnection) -> dict[str, int]:
    """Row count of every kvscope table."""
    counts: dict[str, int] = {}
    for table in KVSCOPE_TABLES:
        rows = con.execute(f"SELECT count(*) FROM {quote(table)}").fetchall()
        counts[table] = int(rows[0][0])
    return counts


__all__ = ["BATCH_FILE_PREFIX", "BATCH_FOLDER_SUFFIX", "SCAN_MEMORY_LIMIT",
    "WAL_CHECKPOINT_THRESHOLD", "batch_file_prefix", "batch_folder", "begin_run", "check_schema",
    "end_run", "open_readonly", "open_scanner", "open_store", "schema_version", "table_counts"]

"""The store writer: one thread owns the writable connection and appends Arrow batches.

Producers (exporters) call :meth:`StoreWriter.submit`, which never blocks and never raises: it
enqueues the batch when the bounded queue has room and otherwise drops it and counts the rows.
The receiver calls :meth:`StoreWriter.commit` instead, which returns a future that resolves once
the rows are committed (so it can acknowledge only what a SIGKILL cannot take back); its caller
bounds what it queues (the receiver by bytes). The writer thread concatenates everything queued
(group commit: one insert serves every request waiting) and inserts it with one
``INSERT ... SELECT`` per target table (through a temporary Parquet file beside the store, or
DuckDB's Arrow scan for small batches; never row by row: see :func:`insert_arrow`); a group
larger than :data:`ROW_GROUP_ROWS` is inserted in parts of that size inside one transaction.
When a group's insert fails, each batch in it is inserted on its own, so one batch the store
refuses fails only its own future. :meth:`flush` waits until everything submitted so far is
written.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from kvscope.store.database import batch_file_prefix, batch_folder, open_store
from kvscope.store.schema import GAUGE_TABLE, RAW_TABLES, TRACES_TABLE, quote

logger = logging.getLogger(__name__)


@dataclass
class WriterStats:
    """Counters a writer keeps; read them for drop and failure reporting."""

    submitted_rows: int = 0
    written_rows: int = 0
    dropped_rows: int = 0
    failed_rows: int = 0
    batches_written: int = 0


# Batches at least this large reach DuckDB through a Parquet file (see insert_arrow).
PARQUET_MIN_ROWS = 256

# DuckDB's row group (rows). An insert of a whole multiple of it is written straight to the
# file; a smaller one goes through the write-ahead log and is written again at a checkpoint, and
# one that ends in a part of a group leaves that part to be rewritten at the checkpoint. 491,520
# turn-like spans inserted by 122,880 rows: 6.3 µs a span; by 20,000: 9.5 µs; by 4,000: 18.0 µs
# (one thread, closing included: ``bench_store_throughput.py``, insert sizes).
ROW_GROUP_ROWS = 122_880


def batch_folder_of(con: duckdb.DuckDBPyConnection) -> Path | None:
    """The folder for ``con``'s temporary batch files, beside its store; None in memory.

    A catalog query (~0.5 ms): look it up once per connection, not per batch.
    """
    rows = con.execute(
        "SELECT path FROM duckdb_databases() WHERE database_name = current_database()"
    ).fetchall()
    path = rows[0][0] if rows else None
    return batch_folder(path) if path else None


def insert_arrow(con: duckdb.DuckDBPyConnection, table: str, rows: pa.Table, *,
                 spill_folder: Path | None = None) -> None:
    """Insert an Arrow table into one raw table in a single statement.

    DuckDB builds MAP values (every span's attribute maps) about 2× faster from its Parquet
    reader than from an Arrow scan, which checks each map entry by entry: 14.5 µs a span
    through Arrow, 7.6 µs written to an uncompressed Parquet file and read back (1.9 + 5.7 µs),
    with identical rows (``tests/benchmarks/bench_store_throughput.py`` prints both). So a batch
    of at least :data:`PARQUET_MIN_ROWS` goes through a temporary Parquet file, removed right
    after; if that file cannot be written, the Arrow scan is used. The file goes in
    ``spill_folder`` (:func:`batch_folder_of`, looked up from ``con`` when not given), where the
    next :func:`~kvscope.store.database.open_store` removes it if this process ends before it
    does; an in-memory store takes the Arrow scan.
    """
    if table not in RAW_TABLES:
        raise ValueError(f"not a raw table: {table}")
    if rows.num_rows >= PARQUET_MIN_ROWS:
        folder = spill_folder or batch_folder_of(con)
        path = _spill(rows, folder) if folder is not None else None
        if path is not None:
            try:
                con.execute(f"INSERT INTO {quote(table)} SELECT * FROM read_parquet(?)", [path])
            finally:
                _remove(path)
            return
    insert_arrow_scan(con, table, rows)


def insert_arrow_scan(con: duckdb.DuckDBPyConnection, table: str, rows: pa.Table) -> None:
    """Insert an Arrow table through DuckDB's Arrow scan (no file)."""
    if table not in RAW_TABLES:
        raise ValueError(f"not a raw table: {table}")
    con.register("_kvscope_batch", rows)
    try:
        con.execute(f"INSERT INTO {quote(table)} SELECT * FROM _kvscope_batch")
    finally:
        con.unregister("_kvscope_batch")


def _spill(rows: pa.Table, folder: Path) -> str | None:
    """Write ``rows`` to a new uncompressed Parquet file in ``folder``; None on failure."""
    try:
        folder.mkdir(exist_ok=True)
        fd, path = tempfile.mkstemp(prefix=batch_file_prefix(), suffix=".parquet",
                                    dir=folder)
        os.close(fd)
    except OSError:
        logger.warning("kvscope: no temporary file for a batch in %s; inserting through Arrow",
                       folder, exc_info=True)
        return None
    try:
        # A path, not a Python file object: Arrow's own file writes never take the GIL.
        # Uncompressed and without column statistics (a full scan reads it once): writing
        # takes 1.3 instead of 1.8 µs a span.
        pq.write_table(rows, path, compression="none", write_statistics=False)
        return path
    except Exception:
        logger.warning("kvscope: could not write a batch to %s; inserting through Arrow",
                       path, exc_info=True)
        _remove(path)
        return None


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class StoreWriter:
    """Batches Arrow rows into a store from any thread, through one bounded queue."""

    def __init__(
        self,
        con: duckdb.DuckDBPyConnection,
        *,
        max_queue_rows: int = 65536,
        name: str = "kvscope-store-writer",
        insert: Callable[[duckdb.DuckDBPyConnection, str, pa.Table], None] | None = None,
    ) -> None:
        self._con = con
        # Inserts run on their own cursor so readers sharing ``con`` never collide with them.
        self._insert_con = con.cursor()
        # The batch folder is looked up once here, not per batch (insert_arrow's default).
        self._batch_folder = batch_folder_of(con)
        if insert is None:
            insert = (insert_arrow_scan if self._batch_folder is None
                      else functools.partial(insert_arrow, spill_folder=self._batch_folder))
        self._insert = insert
        self._max_queue_rows = max_queue_rows
        self._queue: deque[_Entry] = deque()
        self._queued_rows = 0
        self._cond = threading.Condition()
        self._closed = False
        self._seq_submitted = 0
        self._seq_done = 0
        self.stats = WriterStats()
        self._warned_drop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, path: str | Path, *, max_queue_rows: int = 65536) -> StoreWriter:
        """Open (or create) the store at ``path`` and start a writer on it."""
        return cls(open_store(path), max_queue_rows=max_queue_rows)

    @property
    def connection(self) -> duckdb.DuckDBPyConnection:
        """The writable connection (use ``.cursor()`` for reads from other threads)."""
        return self._con

    def submit(self, table: str, rows: pa.Table) -> bool:
        """Queue rows for ``table``; False (and counted as dropped) when the queue is full."""
        n = rows.num_rows
        if n == 0:
            return True
        with self._cond:
            if self._closed or self._queued_rows + n > self._max_queue_rows:
                self.stats.dropped_rows += n
                if not self._warned_drop:
                    self._warned_drop = True
                    logger.warning(
                        "kvscope store writer queue full or closed; dropping rows "
                        "(further drops are counted, not logged)"
                    )
                return False
            self._enqueue(table, rows, None)
            return True

    def commit(self, table: str, rows: pa.Table) -> Future[None] | None:
        """Queue rows for ``table`` and return a future that resolves once they are committed.

        The future's result is None once the rows are in the store (committed: a SIGKILL
        afterwards cannot lose them); it holds the exception when the store refused them (none
        of them is stored then). None instead of a future when the writer is closed. Unlike
        :meth:`submit` the queue's row bound does not refuse these rows: the caller bounds what
        it has in flight (the receiver admits requests by bytes) and waits for each future.
        """
        done: Future[None] = Future()
        if rows.num_rows == 0:
            done.set_result(None)
            return done
        with self._cond:
            if self._closed:
                return None
            self._enqueue(table, rows, done)
        return done

    def _enqueue(self, table: str, rows: pa.Table, done: Future[None] | None) -> None:
        # Called with self._cond held.
        self._queue.append(_Entry(table, rows, done))
        self._queued_rows += rows.num_rows
        self._seq_submitted += 1
        self.stats.submitted_rows += rows.num_rows
        self._cond.notify_all()

    def submit_traces(self, rows: pa.Table) -> bool:
        """Queue rows for ``otel_traces``."""
        return self.submit(TRACES_TABLE, rows)

    def submit_gauge(self, rows: pa.Table) -> bool:
        """Queue rows for ``otel_metrics_gauge``."""
        return self.submit(GAUGE_TABLE, rows)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every batch submitted before this call is written (or failed)."""
        with self._cond:
            target = self._seq_submitted
            return self._cond.wait_for(lambda: self._seq_done >= target, timeout=timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        """Write what is queued, stop the thread and close the connection."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        try:
            self._insert_con.close()
            self._con.close()
        except duckdb.Error:
            logger.exception("closing the store connection failed")
        if self._batch_folder is not None:
            try:
                self._batch_folder.rmdir()  # only when empty: leave no clutter beside the store
            except OSError:
                pass

    def _take(self) -> list[_Entry] | None:
        with self._cond:
            self._cond.wait_for(lambda: self._queue or self._closed)
            if not self._queue:
                return None
            batch = list(self._queue)
            self._queue.clear()
            self._queued_rows = 0
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            by_table: dict[str, list[_Entry]] = {}
            for entry in batch:
                by_table.setdefault(entry.table, []).append(entry)
            for table, entries in by_table.items():
                self._write_group(table, entries)
            with self._cond:
                self._seq_done += len(batch)
                self._cond.notify_all()

    def _write_group(self, table: str, entries: list[_Entry]) -> None:
        """Insert every entry of one table at once; on failure, each entry on its own."""
        parts = [entry.rows for entry in entries]
        rows = parts[0] if len(parts) == 1 else pa.concat_tables(parts)
        try:
            self._insert_committed(table, rows)
        except Exception as exc:
            if len(entries) == 1:
                self._failed(entries[0], exc)
                return
            # One refused batch must not fail the others it was grouped with.
            for entry in entries:
                try:
                    self._insert_committed(table, entry.rows)
                except Exception as own:
                    self._failed(entry, own)
                else:
                    self._written(entry)
            return
        self.stats.batches_written += 1
        for entry in entries:
            self._written(entry)

    def _insert_committed(self, table: str, rows: pa.Table) -> None:
        """Insert ``rows`` and commit: one statement, or parts of whole row groups in one
        transaction (all or nothing), so a huge group never goes through one file at once."""
        if rows.num_rows <= ROW_GROUP_ROWS:
            self._insert(self._insert_con, table, rows)
            return
        con = self._insert_con
        con.execute("BEGIN TRANSACTION")
        try:
            for offset in range(0, rows.num_rows, ROW_GROUP_ROWS):
                self._insert(con, table, rows.slice(offset, ROW_GROUP_ROWS))
        except BaseException:
            con.execute("ROLLBACK")
            raise
        con.execute("COMMIT")

    def _written(self, entry: _Entry) -> None:
        self.stats.written_rows += entry.rows.num_rows
        if entry.done is not None and entry.done.set_running_or_notify_cancel():
            entry.done.set_result(None)

    def _failed(self, entry: _Entry, exc: Exception) -> None:
        self.stats.failed_rows += entry.rows.num_rows
        logger.error("kvscope store writer failed to write %d rows: %s", entry.rows.num_rows,
                     str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        if entry.done is not None and entry.done.set_running_or_notify_cancel():
            entry.done.set_exception(exc)


@dataclass(frozen=True)
class _Entry:
    """One queued batch: the table it goes to, its rows, and the future of a commit()."""

    table: str
    rows: pa.Table
    done: Future[None] | None


__all__ = ["PARQUET_MIN_ROWS", "ROW_GROUP_ROWS", "StoreWriter", "WriterStats", "batch_folder_of",
    "insert_arrow", "insert_arrow_scan"]

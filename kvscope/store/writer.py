"""The store writer: one thread owns the writable connection and appends Arrow batches.

Producers (exporters, the receiver) call :meth:`StoreWriter.submit`, which never blocks and never
raises: it enqueues the batch when the bounded queue has room and otherwise drops it and counts
the rows. The writer thread concatenates what is queued and inserts it with one
``INSERT ... SELECT`` per target table (through a temporary Parquet file beside the store, or
DuckDB's Arrow scan for small batches; never row by row: see :func:`insert_arrow`).
:meth:`flush` waits until everything submitted so far is written.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
import threading
from collections import deque
from collections.abc import Callable
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
        self._queue: deque[tuple[str, pa.Table]] = deque()
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
            self._queue.append((table, rows))
            self._queued_rows += n
            self._seq_submitted += 1
            self.stats.submitted_rows += n
            self._cond.notify_all()
            return True

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

    def _take(self) -> list[tuple[str, pa.Table]] | None:
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
            by_table: dict[str, list[pa.Table]] = {}
            for table, rows in batch:
                by_table.setdefault(table, []).append(rows)
            for table, parts in by_table.items():
                rows = parts[0] if len(parts) == 1 else pa.concat_tables(parts)
                try:
                    self._insert(self._insert_con, table, rows)
                    self.stats.written_rows += rows.num_rows
                    self.stats.batches_written += 1
                except Exception:
                    self.stats.failed_rows += rows.num_rows
                    logger.exception("kvscope store writer failed to write %d rows", rows.num_rows)
            with self._cond:
                self._seq_done += len(batch)
                self._cond.notify_all()

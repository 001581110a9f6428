"""Temporary Parquet batch files never outlive their store's writer (issue 22, defect 6).

Batches of :data:`~kvscope.store.writer.PARQUET_MIN_ROWS` rows or more reach DuckDB through a
temporary Parquet file. A process that ends abruptly mid-insert leaves its file behind; the next
writer to open the store must find and remove it, wherever the system's temp dir is.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvscope.store import open_store

ROOT = Path(__file__).resolve().parents[2]

# Inserts 20,000-row batches forever: its Parquet batch file exists most of the time.
_INSERTER = """
import sys
from kvscope.store import insert_arrow, open_store
from kvscope.store.rows import TraceRows

rows = TraceRows()
for i in range(20_000):
    rows.add(timestamp_ns=i, trace_id="0" * 32, span_id=f"{i:016x}", parent_span_id="",
             trace_state="", span_name="s", span_kind="SPAN_KIND_INTERNAL", service_name="t",
             resource_attributes=[("k", "v")], scope_name="", scope_version="",
             span_attributes=[("a", str(i))], duration_ns=1, status_code="STATUS_CODE_UNSET",
             status_message="", events=[], links=[])
table = rows.to_arrow()
con = open_store(sys.argv[1])
print("inserting", flush=True)
while True:
    insert_arrow(con, "otel_traces", table)
"""


def _batch_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("kvscope-batch-*.parquet"))


def test_a_batch_file_left_by_a_killed_writer_is_removed_when_the_store_is_next_opened(
    tmp_path: Path,
) -> None:
    system_tmp = tmp_path / "system-tmp"
    system_tmp.mkdir()
    store = tmp_path / "store" / "killed.duckdb"
    env = {**os.environ, "TMPDIR": str(system_tmp)}
    process = subprocess.Popen([sys.executable, "-c", _INSERTER, str(store)], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stdout.readline() == "inserting\n"
        deadline = time.monotonic() + 60
        while not _batch_files(tmp_path):
            assert time.monotonic() < deadline, "no batch file ever appeared"
            time.sleep(0.002)
        process.send_signal(signal.SIGKILL)  # mid-insert: its batch file is left behind
        process.wait(30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert _batch_files(tmp_path)

    open_store(store).close()
    assert _batch_files(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store", "system-tmp"]

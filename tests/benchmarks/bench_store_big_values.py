"""What DuckDB holds for big stored values: peak and idle RSS after N one-row inserts of M MiB.

Run: ``.venv/bin/python tests/benchmarks/bench_store_big_values.py [--mib 12] [--rows 4,16,32]``

Why ``kvscope serve``'s peak is far above its in-flight budget when a request's bytes are
stored (``bench_receiver_memory.py``, shape ``stored``): this takes the receiver out and
inserts, one committed statement at a time as the store writer does, rows whose one MAP value
(as ``SpanAttributes``) holds M MiB, into a file store with kvscope's checkpoint threshold.
Each setting runs in a fresh process; the table prints peak (VmHWM) and idle RSS after the
inserts, side by side for each row count, and says when DuckDB refused an insert. If the peak
grows with the rows stored, no admission bound on requests in flight can bound it. Linux only.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile

CHILD = r"""
import os, sys, pyarrow as pa, duckdb
from kvscope.store.database import WAL_CHECKPOINT_THRESHOLD
def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])
path, rows, mib, settings = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
con = duckdb.connect(path)
con.execute(f"SET checkpoint_threshold = '{WAL_CHECKPOINT_THRESHOLD}'")
for statement in filter(None, settings.split(";")):
    con.execute(statement)
con.execute("CREATE TABLE t (k VARCHAR, attributes MAP(VARCHAR, VARCHAR))")
base = kib("VmRSS")
try:
    for i in range(rows):
        value = "x" * (mib << 20)
        batch = pa.table({"k": [str(i)], "attributes": pa.array(
            [[("big", value)]], type=pa.map_(pa.string(), pa.string()))})
        del value
        con.register("batch", batch)
        con.execute("INSERT INTO t SELECT * FROM batch")
        con.unregister("batch")
        del batch
    failed = ""
except duckdb.Error as exc:
    failed = str(exc).splitlines()[0][:80]
print(base // 1024, kib("VmHWM") // 1024, kib("VmRSS") // 1024, failed, sep="\t")
"""

SETTINGS = {
    "defaults": "",
    "allocator flush 16MiB": ("SET allocator_flush_threshold = '16MiB';"
                              "SET allocator_bulk_deallocation_flush_threshold = '16MiB'"),
    "memory_limit 256MB": "SET memory_limit = '256MB'",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=12, help="MiB per stored value")
    parser.add_argument("--rows", default="4,16,32", help="comma-separated row counts")
    args = parser.parse_args(argv)
    print(f"one-row inserts of a {args.mib} MiB MAP value, each committed\n")
    print(f"{'settings':<24} {'rows':>5} {'stored MiB':>10} {'base MiB':>9} {'peak MiB':>9} "
          f"{'idle MiB':>9}  refused")
    for label, settings in SETTINGS.items():
        for rows in (int(r) for r in args.rows.split(",")):
            with tempfile.TemporaryDirectory(prefix="kvscope-bigvalues-") as tmp:
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, f"{tmp}/store.duckdb", str(rows),
                     str(args.mib), settings], capture_output=True, text=True, check=True)
            base, peak, idle, failed = out.stdout.rstrip("\n").split("\t")
            print(f"{label:<24} {rows:>5} {rows * args.mib:>10} {base:>9} {peak:>9} "
                  f"{idle:>9}  {failed or '-'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

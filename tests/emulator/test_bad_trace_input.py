"""Bad trace input: one-line errors naming the file and line, exit code 2, and no run recorded.

Each case is a trace a person could hand ``kvscope simulate`` by mistake (an empty file, a NaN or
absurd timestamp, too few ``hash_ids``) or an option that asks for nothing (``--conversations 0``).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from kvscope import cli
from kvscope.emulator.simulator import simulate
from kvscope.emulator.workloads import mooncake, weka
from kvscope.emulator.workloads.model import Conversation, Turn, Workload, WorkloadError

GOOD = {"timestamp": 0, "input_length": 1200, "output_length": 40, "hash_ids": [0, 1, 2]}


def _kvscope(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvscope.cli", *argv], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def _trace(path: Path, *rows: dict[str, object] | str) -> Path:
    lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _runs(db: Path) -> int:
    if not db.exists():
        return 0
    con = duckdb.connect(str(db), read_only=True)
    try:
        tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables")
                  .fetchall()}
        if "kvscope_runs" not in tables:
            return 0
        return int(con.execute("SELECT count(*) FROM kvscope_runs").fetchone()[0])  # type: ignore[index]
    finally:
        con.close()


BAD_MOONCAKE = [
    # (rows, what the message says, the line it names; None: the file only)
    ((), "empty (no requests)", None),
    (("",), "empty (no requests)", None),
    ((GOOD, {**GOOD, "timestamp": "NaN"}), "timestamp 'NaN' is not a finite number", 2),
    ((GOOD, {**GOOD, "timestamp": 1e18}), "timestamp 1e+18 ms is out of range", 2),
    (({**GOOD, "timestamp": -3000}, GOOD), "timestamp -3000 ms is out of range", 1),
    ((GOOD, {**GOOD, "hash_ids": [0, 1]}), "2 hash_ids of 512 tokens do not cover "
                                           "input_length 1200 (3 needed)", 2),
    ((GOOD, {**GOOD, "output_length": -4}), "must be >= 0", 2),
]


@pytest.mark.parametrize(("rows", "message", "line"), BAD_MOONCAKE)
def test_a_bad_mooncake_trace_is_named_by_file_and_line(
        rows: tuple[dict[str, object] | str, ...], message: str, line: int | None,
        tmp_path: Path) -> None:
    trace = _trace(tmp_path / "bad.jsonl", *rows)
    with pytest.raises(WorkloadError) as caught:
        mooncake.load(trace)
    text = str(caught.value)
    assert message in text and "\n" not in text
    assert (f"{trace}:{line}:" in text) if line is not None else str(trace) in text


@pytest.mark.parametrize(("rows", "message", "line"), [
    *BAD_MOONCAKE,
    # A trace that is fine, asked for none of its sessions.
    ((GOOD,), "--conversations=0: must be >= 1", "conversations"),
])
def test_simulate_refuses_a_bad_trace_with_exit_2_and_records_no_run(
        rows: tuple[dict[str, object] | str, ...], message: str, line: int | str | None,
        tmp_path: Path) -> None:
    trace = _trace(tmp_path / "bad.jsonl", *rows)
    extra = ["--conversations", "0"] if line == "conversations" else []
    db = tmp_path / "out.duckdb"
    done = _kvscope("simulate", "--workload", "mooncake", "--trace", str(trace), "--db", str(db),
                    "--quiet", *extra, cwd=tmp_path)
    assert done.returncode == cli.EXIT_USER_ERROR == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("kvscope simulate: error: ") and message in done.stderr
    if isinstance(line, int):
        assert f"{trace}:{line}:" in done.stderr
    assert _runs(db) == 0


def test_the_synthetic_workload_with_no_conversations_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "out.duckdb"
    done = _kvscope("simulate", "--conversations", "0", "--db", str(db), "--quiet", cwd=tmp_path)
    assert done.returncode == 2 and "--conversations=0: must be >= 1" in done.stderr
    assert _runs(db) == 0


def test_weka_traces_with_bad_times_are_named_by_file_and_line(tmp_path: Path) -> None:
    header = ",".join(weka._CSV_COLUMNS)
    good = dict.fromkeys(weka._CSV_COLUMNS, "")
    good.update(conversation_id="c1", agent_id="main", turn_index="1", prompt_tokens="100",
                output_tokens="10", shared_prefix_tokens="0", arrival_s="0")

    def row(**values: str) -> str:
        return ",".join({**good, **values}[c] for c in weka._CSV_COLUMNS)

    for values, message in (({"arrival_s": "nan"}, "column 'arrival_s' 'nan' is not a finite"),
                            ({"arrival_s": "-5"}, "column 'arrival_s' -5 s is out of range"),
                            ({"think_time_s": "inf"}, "'inf' is not a finite number")):
        csv = tmp_path / "flat.csv"
        csv.write_text("\n".join([header, row(), row(turn_index="2", **values)]) + "\n")
        with pytest.raises(WorkloadError, match="flat.csv:3: ") as caught:
            weka.load_csv(csv)
        assert message in str(caught.value)
    empty = tmp_path / "empty.csv"
    empty.write_text(header + "\n")
    done = _kvscope("simulate", "--workload", "weka", "--trace", str(empty), "--db",
                    str(tmp_path / "w.duckdb"), "--quiet", cwd=tmp_path)
    assert done.returncode == 2 and "no turns to run" in done.stderr and str(empty) in done.stderr
    assert _runs(tmp_path / "w.duckdb") == 0
    raw = tmp_path / "trace_0001.json"
    raw.write_text(json.dumps({"block_size": 64, "requests": [
        {"t": 0, "in": 64, "out": 8, "hash_ids": [1]},
        {"t": float("nan"), "in": 128, "out": 8, "hash_ids": [1, 2]}]}))
    with pytest.raises(WorkloadError, match=r"trace_0001.json: requests\[1\]: t nan is not a "
                                            "finite number"):
        weka.load_raw([raw])


def test_a_workload_built_in_code_with_a_nan_time_records_no_run(tmp_path: Path) -> None:
    turns = (Turn(1, 0.0, 100, 10, 0, 100), Turn(2, math.nan, 200, 10, 110, 90))
    workload = Workload("made", 16, (Conversation("c", 0.0, turns),), "code")
    db = tmp_path / "out.duckdb"
    with pytest.raises(WorkloadError, match="conversation c turn 2: think_time_s nan is not"):
        simulate(workload, db)
    assert _runs(db) == 0

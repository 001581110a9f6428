"""Reading a store while ``kvscope serve`` writes it: ``kvscope analyze --live URL NAME`` asks the
receiver (``GET /v1/analyze/NAME``), which answers from a snapshot of its own store; the answer
equals ``kvscope analyze FILE NAME`` once the receiver has stopped."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from kvscope import cli
from kvscope.analysis.live_queries import answer_source
from kvscope.store.schema import TRACES_ARROW
from tests.analysis.test_live_metrics import (
    _serving_runs_of,
    _shuffled_batches,
    source,  # noqa: F401  (the fixture)
)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_analyze_live_reads_what_serve_is_writing(
        source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    db = tmp_path / "served.duckdb"
    receiver = _serving_runs_of(source, db, queries=answer_source)
    try:
        batches = _shuffled_batches(source, 2, 1)
        assert receiver.writer.submit_traces(batches[0].cast(TRACES_ARROW))
        assert receiver.writer.flush(30)
        # The file is held for writing: a local read is refused, a live one answers.
        code, _, err = _run(["analyze", str(db), "reuse_rate"], capsys)
        assert code == cli.EXIT_USER_ERROR and err.count("\n") == 1
        code, half, _ = _run(["analyze", "--live", receiver.url, "miss_causes",
                              "--format", "json"], capsys)
        assert code == 0
        for batch in batches[1:]:
            assert receiver.writer.submit_traces(batch.cast(TRACES_ARROW))
        assert receiver.writer.flush(30)
        code, live, _ = _run(["analyze", "--live", receiver.url, "reuse_rate", "--format",
                              "json", "--runs", "faults"], capsys)
        assert code == 0
        code, table, _ = _run(["analyze", "--live", receiver.url, "reuse_rate"], capsys)
        assert code == 0
        code, _, err = _run(["analyze", "--live", receiver.url, "no_such_analysis"], capsys)
        assert code == cli.EXIT_USER_ERROR and "no_such_analysis" in err
        bad = httpx.get(f"{receiver.url}/v1/analyze/reuse_rate", params={"param": "oops"},
                        timeout=30)
        assert bad.status_code == 400 and "NAME=VALUE" in bad.json()["error"]
    finally:
        receiver.stop()
    code, stored, _ = _run(["analyze", str(db), "reuse_rate", "--format", "json", "--runs",
                            "faults"], capsys)
    assert code == 0
    assert json.loads(live) == json.loads(stored) and json.loads(stored)
    # Half the spans, half the turns: the snapshot was of what had arrived then.
    code, whole, _ = _run(["analyze", str(db), "miss_causes", "--format", "json"], capsys)
    assert sum(r["turns"] for r in json.loads(half)) < sum(r["turns"] for r in json.loads(whole))
    # Tables show runs by label, as a local table does.
    assert "faults" in table and "plain" in table and "run_id" not in table.splitlines()[0]


def test_analyze_live_without_serve_is_a_one_line_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code, _, err = _run(["analyze", "--live", f"http://127.0.0.1:{port}", "reuse_rate"], capsys)
    assert code == cli.EXIT_USER_ERROR and err.count("\n") == 1
    assert "cannot reach kvscope serve" in err
    code, _, err = _run(["analyze", "--live", "http://127.0.0.1:1", str(tmp_path / "x.duckdb"),
                         "reuse_rate"], capsys)
    assert code == cli.EXIT_USER_ERROR and "give no store file" in err

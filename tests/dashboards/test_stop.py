"""``kvscope dashboard`` stops cleanly on SIGTERM while its pages warm.

Warming runs the heavy analyses on a thread; a SIGTERM then once ended the process with
"FATAL: exception not rethrown" (exit -6) in 3 of 5 runs: the interpreter exited while that
thread was inside DuckDB. Closing the data now interrupts the query in progress and waits for it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.stores import on_off_store


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    db = tmp_path_factory.mktemp("stop") / "store.duckdb"
    return on_off_store(db, seed=3, conversations=12, turns_p50=4, max_turns=8)


@pytest.mark.parametrize("after_step", [1, 3, 5])
def test_sigterm_while_pages_warm_exits_cleanly(store: Path, after_step: int) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "kvscope.cli", "dashboard", str(store), "--port", "0"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert process.stderr is not None
    seen: list[str] = []
    try:
        for line in process.stderr:
            seen.append(line)
            if f"({after_step}/6)" in line or "warming pages: done" in line:
                break
        process.send_signal(signal.SIGTERM)
        code = process.wait(60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    rest = process.stderr.read()
    assert code == 0, (code, "".join(seen) + rest)
    assert "FATAL" not in rest and "Traceback" not in rest, rest

"""Progress on stderr (rich on a terminal, plain lines elsewhere) and tables fitted to a width."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.cli.simulate import ProgressLine
from kvscope.emulator.simulator import SimulationResult, SimulationSettings, simulate
from kvscope.emulator.workloads import synthetic
from kvscope.progress import spinner, steps
from kvscope.tables import MIN_COLUMN_WIDTH, format_rows


class Terminal(io.StringIO):
    """A stream that says it is a terminal, as rich asks."""

    def isatty(self) -> bool:
        return True


def test_steps_elsewhere_are_one_line_each() -> None:
    out = io.StringIO()
    with steps("kvscope report", 3, stream=out) as step:
        for name in ("ledger", "figures", "tables"):
            step(name)
    lines = out.getvalue().splitlines()
    assert lines[:3] == ["kvscope report: ledger (1/3)", "kvscope report: figures (2/3)",
                         "kvscope report: tables (3/3)"]
    assert lines[3].startswith("kvscope report: done in ")


def test_steps_on_a_terminal_are_drawn_by_rich() -> None:
    out = Terminal()
    with steps("kvscope demo", 2, stream=out) as step:
        step("feature OFF")
        step("feature ON")
    text = out.getvalue()
    assert "\x1b[" in text  # rich's cursor control: redrawn in place, then cleared
    assert "kvscope demo: feature ON" in text
    assert "kvscope demo: done in " in text.rstrip().splitlines()[-1]


def test_spinner_without_a_terminal() -> None:
    out = io.StringIO()
    with spinner("rebuilding", stream=out):
        pass
    assert out.getvalue().splitlines()[0] == "rebuilding: working (1/1)"


def test_simulate_progress_on_a_terminal_uses_rich() -> None:
    out = Terminal()
    line = ProgressLine("[1/1 ON]", 100, out)
    line(50, 30.0)
    line(100, 60.0)
    line.done(SimulationResult("r", 100, 400, [], 60.0))
    text = out.getvalue()
    assert "\x1b[" in text and "[1/1 ON]" in text
    assert "[1/1 ON] 100 turns, 400 spans in " in text.splitlines()[-1]


def test_replay_progress_is_drawn_by_the_same_line() -> None:
    from kvscope.cli.emulator import ReplayProgress

    out = Terminal()
    line = ReplayProgress(out)
    line(40, 80, 2.0)
    line(80, 80, 4.0)
    line.close()
    assert "\x1b[" in out.getvalue()  # rich, as simulate's progress on a terminal


def test_tables_fit_the_width_and_cut_long_cells() -> None:
    columns = ["run", "outcome", "evidence"]
    rows = [("feature ON", "below_threshold", "x" * 300), ("feature OFF", "first_turn", "turn 1")]
    text = format_rows(columns, rows, "table", width=60)
    assert max(len(line) for line in text.splitlines()) <= 60
    assert "…" in text and "feature OFF" in text and "below_threshold" in text
    # Without a width (a pipe) every cell is whole.
    assert "x" * 300 in format_rows(columns, rows, "table")
    # A terminal too narrow for the columns' minimum still shows every column.
    narrow = format_rows(columns, rows, "table", width=10)
    assert narrow.splitlines()[0].split() == ["run", "outcome", "evidence"]
    assert all(len(cell) >= MIN_COLUMN_WIDTH - 1 for cell in narrow.splitlines()[2].split())
    # Drawn by rich: a header rule, numbers right-aligned.
    numbers = format_rows(["run", "turns"], [("ON", 3), ("OFF", 120)], "table")
    assert numbers.splitlines() == ["run  turns", "─" * 10, "ON       3", "OFF    120",
                                    "(2 rows)"]


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    db = tmp_path_factory.mktemp("progress") / "sim.duckdb"
    workload = synthetic.generate(seed=1, conversations=3, turns_p50=4, max_turns=5)
    simulate(workload, db, SimulationSettings(profile="tiny", label="feature ON", seed=2))
    return db


def _kvscope(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvscope.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_ledger_and_report_say_their_progress_on_stderr(simulated: Path, tmp_path: Path
                                                        ) -> None:
    done = _kvscope("ledger", str(simulated))
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith("kvscope ledger: bringing kvscope_ledger up to the raw spans")
    assert done.stdout.startswith("kvscope_ledger: ")
    done = _kvscope("report", str(simulated), "-o", str(tmp_path / "r.html"))
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[:3] == ["kvscope report: ledger and verdict (1/3)",
                                            "kvscope report: figures (2/3)",
                                            "kvscope report: tables (3/3)"]


def test_analyze_tables_name_runs_by_label(simulated: Path) -> None:
    done = _kvscope("analyze", str(simulated), "reuse_rate")
    assert done.returncode == 0, done.stderr
    header, _, first = done.stdout.splitlines()[:3]
    assert header.split()[0] == "run" and first.startswith("feature ON ")
    as_json = _kvscope("analyze", str(simulated), "reuse_rate", "--format", "json")
    assert '"run_id"' in as_json.stdout  # programs keep the id

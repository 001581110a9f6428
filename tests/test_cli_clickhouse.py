"""``--clickhouse URL`` on the reading commands: the same output as from the DuckDB store.

Each command runs as its own process (as a user runs it) against chdb, ClickHouse's engine
in-process, on a data folder that a separate process filled with the exporter's exact tables
and a simulator store's spans (every fault on, plus a feature-OFF run).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from kvscope.emulator.simulator import SIM_FAULTS, SimulationSettings, simulate
from kvscope.emulator.workloads import synthetic

ROOT = Path(__file__).resolve().parent.parent
DATABASE = "otel"


def run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvscope.cli", *argv], capture_output=True,
                          text=True, timeout=180, cwd=ROOT, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    folder = tmp_path_factory.mktemp("cli-chdb")
    duck = folder / "sim.duckdb"
    workload = synthetic.generate(seed=3, conversations=5, turns_p50=6, max_turns=8,
                                  think_time_p50_s=4, think_time_p90_s=30)
    simulate(workload, duck, SimulationSettings(
        profile="tiny", label="faults ON", seed=2, faults=dict.fromkeys(SIM_FAULTS, 0.1)))
    simulate(workload, duck, SimulationSettings(
        profile="tiny", label="OFF", seed=2, prefill_bidirectional_kv_xfer=False,
        decode_bidirectional_kv_xfer=False))
    data = folder / "chdb"
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys; from tests.store.otelcol import load_into_chdb; "
         "print(load_into_chdb(*sys.argv[1:]))", str(duck), str(data), DATABASE],
        capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert loaded.returncode == 0, loaded.stderr
    return duck, f"chdb:{data}"


_NUMBER = re.compile(r"-?\d+\.\d+(?:[eE][-+]?\d+)?")


def assert_same_output(got: str, expected: str) -> None:
    """Text equal, but for decimals printed from float sums: their last digit follows the order
    rows came in, which neither engine promises (relative difference at most 1e-10)."""
    assert _NUMBER.split(got) == _NUMBER.split(expected)
    for a, b in zip(_NUMBER.findall(got), _NUMBER.findall(expected), strict=True):
        assert float(a) == pytest.approx(float(b), rel=1e-10, abs=0), (a, b)


def _click(url: str, *argv: str) -> list[str]:
    return [*argv, "--clickhouse", url, "--clickhouse-database", DATABASE]


@pytest.mark.parametrize("argv", [
    ["analyze", "{src}", "reuse_rate", "--format", "json"],
    ["analyze", "{src}", "miss_causes", "--format", "csv"],
    ["whatif", "{src}", "--ttl", "5,60", "--threshold", "0,256"],
    ["compare", "{src}", "--format", "json"],
    ["analyze", "{src}"],
], ids=["analyze-reuse", "analyze-causes", "whatif", "compare", "analyze-list"])
def test_a_command_prints_the_same_from_clickhouse(stores: tuple[Path, str], argv: list) -> None:
    duck, url = stores
    from_duck = run(*[str(duck) if a == "{src}" else a for a in argv])
    assert from_duck.returncode == 0, from_duck.stderr
    from_click = run(*_click(url, *[a for a in argv if a != "{src}"]))
    assert from_click.returncode == 0, from_click.stderr
    assert_same_output(from_click.stdout, from_duck.stdout)
    assert from_duck.stdout.strip()


@pytest.mark.parametrize("more", [[], ["--partitions", "3"]], ids=["one", "partitions"])
def test_ledger_is_written_back_as_a_clickhouse_table(stores: tuple[Path, str],
                                                      more: list[str]) -> None:
    duck, url = stores
    result = run(*_click(url, "ledger", *more))
    assert result.returncode == 0, result.stderr
    turns = int(re.search(r"kvscope_ledger: (\d+) turns", result.stdout).group(1))
    expected = run("sql", str(duck), "SELECT count(*) FROM otel_traces "
                   "WHERE SpanName = 'kvscope.turn'", "--format", "csv")
    assert turns == int(expected.stdout.split()[-1]) > 0


def test_report_from_clickhouse(stores: tuple[Path, str], tmp_path: Path) -> None:
    _, url = stores
    out = tmp_path / "r.html"
    result = run(*_click(url, "report", "-o", str(out)))
    assert result.returncode == 0, result.stderr
    html = out.read_text()
    assert f"store {url} (database {DATABASE})" in html and "faults ON" in html


_HEAD = """
import sys
from kvscope.analysis import ledger_units, registry
from kvscope.store.clickhouse import ClickHouseSource

with registry.AnalysisContext.open(ClickHouseSource(sys.argv[1], sys.argv[2])) as ctx:
    assert isinstance(ctx.get(registry.LEDGER), ledger_units.StoredLedger)
    head, height = registry.head(ctx, "ledger", 7)
    whole = registry.run(ctx, "ledger")
    assert head.equals(whole.head(7)) and height == whole.height > 7, (height, whole.height)
print("ok")
"""


def test_the_reports_ledger_table_is_the_listings_head_on_clickhouse(
        stores: tuple[Path, str]) -> None:
    """The report's ledger table reads its rows alone from ClickHouse's stored ledger (read
    ``ORDER BY _row``): the listing's first rows and height."""
    _, url = stores
    assert run(*_click(url, "ledger")).returncode == 0
    result = subprocess.run([sys.executable, "-c", _HEAD, url, DATABASE], capture_output=True,
                            text=True, timeout=180, cwd=ROOT)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_user_and_password_come_from_the_environment(stores: tuple[Path, str]) -> None:
    """The password is an environment variable only, and never printed."""
    _, url = stores
    env = {"KVSCOPE_CLICKHOUSE": url, "KVSCOPE_CLICKHOUSE_DATABASE": DATABASE,
           "KVSCOPE_CLICKHOUSE_PASSWORD": "s3cret"}
    result = run("analyze", "reuse_rate", "--format", "csv", env=env)
    assert result.returncode == 0, result.stderr
    shown = run("settings", env=env)
    assert "s3cret" not in shown.stdout and "(set)" in shown.stdout


@pytest.mark.parametrize(("argv", "message"), [
    (["compare"], "name a kvscope DuckDB store, or the Collector's ClickHouse"),
    (["compare", "x.duckdb", "--clickhouse", "chdb:/tmp/x"], "not both"),
    (["compare", "--clickhouse", "ftp://h"], "expected http(s)://host:port"),
    (["compare", "--clickhouse", "http://127.0.0.1:9", "--clickhouse-database", "d"],
     "cannot connect to http://127.0.0.1:9"),
])
def test_bad_sources_are_one_line_errors(argv: list[str], message: str) -> None:
    result = run(*argv, env={"KVSCOPE_CLICKHOUSE": ""})
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and message in result.stderr


def test_dashboard_serves_from_clickhouse(stores: tuple[Path, str]) -> None:
    _, url = stores
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvscope.cli", *_click(url, "dashboard", "--port", "0")],
        stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        found = None
        seen = []
        while found is None and proc.stderr is not None:  # warm-up progress lines come first
            line = proc.stderr.readline()
            if not line:
                break
            seen.append(line)
            found = re.search(r"(http://\S+) \(read-only: (.*)\)", line)
        assert found, seen
        assert f"{url} (database {DATABASE})" in found.group(2)
        with urllib.request.urlopen(found.group(1), timeout=60) as page:
            assert page.status == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)

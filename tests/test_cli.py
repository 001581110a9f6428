"""The command line: exact output, one-line errors, every command documented."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope import __version__, cli
from kvscope.store import open_store

ROOT = Path(__file__).resolve().parents[1]


def run(*argv: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvscope.cli", *argv],
                          capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    path = tmp_path / "cli.duckdb"
    con = open_store(path)
    con.execute("INSERT INTO kvscope_runs VALUES ('r1', 'ON', '{}', now(), NULL), "
                "('r2', 'OFF, \"quoted\"', '{}', now(), NULL)")
    con.close()
    return path


def test_every_command_has_help() -> None:
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subparsers.choices) == {c.name for c in cli.COMMANDS}
    for name, sub in subparsers.choices.items():
        assert sub.description, name
        for action in sub._actions:
            if action.dest != "help":
                assert action.help, f"{name} {action.dest} lacks help"


def test_every_command_is_in_the_readme_table() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    table = [line for line in readme.splitlines() if line.startswith("| `kvscope ")]
    listed = {line.split("`")[1].split()[1] for line in table}
    assert listed == {c.name for c in cli.COMMANDS}


def test_version() -> None:
    result = run("version")
    assert result.returncode == 0
    assert result.stdout == f"kvscope {__version__} (store schema 1)\n"


# setuptools warns that reading [tool.setuptools] is "beta": the table builds the package.
@pytest.mark.filterwarnings("ignore:Support for `\\[tool.setuptools\\]`")
def test_the_package_s_version_is_the_one_kvscope_reports() -> None:
    # pyproject.toml takes the version from kvscope.__version__: what setuptools builds into
    # the package's metadata equals what the commands print, and the installed metadata too.
    from setuptools.config.pyprojecttoml import read_configuration

    built = read_configuration(ROOT / "pyproject.toml", expand=True)["project"]["version"]
    assert built == __version__ == importlib.metadata.version("kvscope")


def test_sql_table_output_is_exact(store: Path) -> None:
    result = run("sql", str(store), "SELECT run_id, label FROM kvscope_runs ORDER BY run_id")
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        "run_id  label\n"
        "─────────────────────\n"
        "r1      ON\n"
        "r2      OFF, \"quoted\"\n"
        "(2 rows)\n"
    )


def test_sql_csv_and_json_output(store: Path) -> None:
    query = "SELECT run_id, label FROM kvscope_runs WHERE run_id = $run"
    csv_out = run("sql", str(store), query, "--param", "run=r2", "--format", "csv")
    assert csv_out.stdout == 'run_id,label\nr2,"OFF, ""quoted"""\n'
    json_out = run("sql", str(store), query, "--param", "run=r1", "--format", "json")
    assert json.loads(json_out.stdout) == [{"run_id": "r1", "label": "ON"}]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["sql", "{missing}", "SELECT 1"], "no such store file"),
        (["sql", "{store}", "SELECT * FROM nope"], "query failed: Catalog Error"),
        (["sql", "{store}", "DELETE FROM kvscope_runs"], "query failed"),
        (["sql", "{store}", "SELECT count(*) FROM kvscope_ledger"],
         "no kvscope_ledger table yet: build it with `kvscope ledger "),
        (["sql", "{text}", "SELECT 1"], "not a DuckDB database"),
        (["serve"], "--db is required"),
        (["serve", "--db", "{store}", "--port", "99999"], "--port=99999"),
    ],
)
def test_user_mistakes_are_one_line_errors(argv: list[str], message: str, store: Path,
                                           tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("not a database\n")
    paths = {"store": str(store), "missing": str(tmp_path / "absent.duckdb"), "text": str(text)}
    result = run(*[a.format(**paths) for a in argv])
    assert result.returncode == cli.EXIT_USER_ERROR
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"kvscope {argv[0]}: error: ")
    assert message in result.stderr


def test_settings_markdown_is_the_docs_file() -> None:
    result = run("settings", "--markdown")
    doc = Path(__file__).resolve().parent.parent / "docs" / "settings.md"
    assert result.stdout == doc.read_text()


def test_demo_writes_a_store(tmp_path: Path) -> None:
    # A hang guard, not a timing: the demo takes about a minute on an idle 2-core machine.
    result = run("demo", "--out", str(tmp_path / "out"), timeout_s=600)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "kvscope.duckdb").exists()
    assert "otel_traces" in result.stdout
    count = run("sql", str(tmp_path / "out" / "kvscope.duckdb"),
                "SELECT count(*) > 0 AS ok FROM otel_traces", "--format", "csv")
    assert count.stdout == "ok\nTrue\n"


def test_ledger_refuses_a_missing_store_and_creates_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.duckdb"
    assert cli.main(["ledger", str(missing)]) == 2
    assert "no such kvscope store" in capsys.readouterr().err
    assert not missing.exists()


def test_report_and_analyze_exit_2_on_a_store_without_spans(tmp_path: Path) -> None:
    db = tmp_path / "empty.duckdb"
    open_store(db).close()
    for argv in (["report", str(db), "-o", str(tmp_path / "r.html")],
                 ["analyze", str(db), "reuse_rate"]):
        done = run(*argv)
        assert done.returncode == 2, (argv, done.stdout, done.stderr)
        assert "holds no spans" in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "r.html").exists()


def test_sql_runs_under_a_memory_limit_and_refuses_a_result_past_its_rows(
    tmp_path: Path,
) -> None:
    db = tmp_path / "s.duckdb"
    open_store(db).close()
    limit = run("sql", str(db), "SELECT current_setting('memory_limit') AS m", "--format", "csv")
    assert limit.stdout.splitlines()[1] == "3.7 GiB"  # the store_memory_limit default, 4GB
    done = run("sql", str(db), "SELECT * FROM range(3000000)")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("kvscope sql: error: the result has more than 1000000 rows; add a "
                           "LIMIT or aggregate in the query (query kvscope sql: SELECT * FROM "
                           "range(3000000))\n")

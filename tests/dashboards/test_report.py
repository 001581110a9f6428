"""The HTML report: one offline file with the verdict, a div per figure, the registry tables."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import polars as pl
import pytest

from kvscope import cli
from kvscope.analysis import registry
from kvscope.analysis.registry import AnalysisError
from kvscope.dashboards import report
from tests.stores import on_off_store

HOSTILE_LABEL = '<script>alert("x")</script> & ON'


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Feature ON and OFF over one small workload (the ON run's label needs escaping)."""
    return on_off_store(tmp_path_factory.mktemp("report") / "ab.duckdb", seed=7,
                        conversations=5, turns_p50=6, max_turns=8, on_label=HOSTILE_LABEL)


@pytest.fixture(scope="module")
def page(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("out") / "nested" / "report.html"
    assert report.write_report(store, out) == out
    return out


def test_one_file_and_nothing_fetched(page: Path) -> None:
    assert [p.name for p in page.parent.iterdir()] == ["report.html"]  # no temp file left
    text = page.read_text(encoding="utf-8")
    tags = re.findall(r"<(?:script|link|img|iframe|source)\b[^>]*>", text, flags=re.I)
    assert tags, "the page has scripts"
    for tag in tags:
        assert not re.search(r"\b(src|href)\s*=", tag, flags=re.I), tag
    # plotly.js is embedded once, inline.
    assert text.count("<script type=\"text/javascript\">") == 1
    assert text.count("Plotly.newPlot(") == len(report.FIGURES)


def test_verdict_first_then_figures_then_tables(page: Path, store: Path) -> None:
    text = page.read_text(encoding="utf-8")
    verdict, figs, tables = (text.index(f"<h2>{h}</h2>") for h in ("Verdict", "Figures", "Tables"))
    assert verdict < figs < tables
    assert text.count('<div class="verdict"') == 2
    assert "Reuse happened" in text and "Reuse did not happen" in text
    assert "Against the feature-OFF run OFF" in text
    for spec in report.FIGURES:
        assert f'id="fig-{spec.id}"' in text, spec.id
    for analysis in registry.iter_analyses():
        assert f'id="table-{analysis.name}"' in text, analysis.name
    # Every analysis ran: no section reports a failure.
    assert "failed:" not in text
    # Settings per run come from kvscope_runs.
    assert "<code>decoder_kv_blocks_ttl</code>=480.0" in text


def test_everything_is_escaped(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    assert HOSTILE_LABEL not in text
    assert html_escaped(HOSTILE_LABEL) in text


def html_escaped(value: str) -> str:
    import html

    return html.escape(value, quote=True)


def test_selected_runs_only(store: Path, tmp_path: Path) -> None:
    out = report.write_report(store, tmp_path / "off.html", runs=["OFF"])
    text = out.read_text(encoding="utf-8")
    assert text.count('<div class="verdict"') == 1
    assert html_escaped(HOSTILE_LABEL) not in text
    # One run (a production store's usual case): its own TTFT vs prompt length and prefill
    # split, not two empty A/B figures.
    figures = text[text.index("<h2>Figures</h2>"):]
    figures = figures[:figures.index("<h2>", 5)]
    for div in ("fig-ttft-vs-prompt", "fig-prefill-split"):
        start = figures.index(f'id="{div}"')
        end = figures.find('<div class="figure">', start)
        assert "compare needs two runs" not in figures[start:end if end > 0 else None], div
    with pytest.raises(AnalysisError, match="no run with id or label 'nope'"):
        report.write_report(store, tmp_path / "x.html", runs=["nope"])
    assert not (tmp_path / "x.html").exists()


def test_table_html_is_bounded_and_says_so() -> None:
    frame = pl.DataFrame({"n": list(range(500)), "v": [None] * 500})
    text = report.table_html(frame, max_rows=200)
    assert "first 200 of 500 rows" in text
    assert text.count("<tr>") == 201  # header + 200 rows
    assert text.count(">not measured<") == 200
    assert report.format_cell(None) == ("not measured", "null")
    assert report.format_cell(float("nan"))[0] == "not measured"
    assert report.format_cell(0.0) == ("0", "num")  # a measured zero stays zero


def test_main_report_and_analyze(store: Path, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.html"
    assert cli.main(["report", str(store), "--out", str(out)]) == 0
    assert out.exists() and f"wrote {out}" in capsys.readouterr().out
    assert cli.main(["analyze", str(store)]) == 0
    listing = capsys.readouterr().out
    for name in ("reuse_rate", "compare", "compare_by_prompt", "verdict"):
        assert re.search(rf"^{name}\s", listing, flags=re.M), name
    assert cli.main(["analyze", str(store), "compare_by_prompt", "--format", "json",
                     "--param", "bins=3"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["bin"] for r in rows} == {0, 1, 2}
    assert cli.main(["analyze", str(store), "verdict", "--runs", "OFF", "--format", "csv"]) == 0
    csv_lines = capsys.readouterr().out.splitlines()
    assert csv_lines[0].startswith("run_id,label,feature") and len(csv_lines) == 2
    assert cli.main(["analyze", str(store), "verdict", "--param", "nope=1"]) == 2
    assert "unknown parameter" in capsys.readouterr().err
    assert cli.main(["analyze", str(store), "nope"]) == 2
    assert "no analysis called" in capsys.readouterr().err


CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser"),
                             shutil.which("google-chrome")) if p), None)


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not installed "
                    "(Debian: apt-get install chromium); the report was not opened in a browser")
def test_opens_in_headless_chromium(page: Path, tmp_path: Path) -> None:
    assert CHROMIUM is not None
    result = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
         "--v=0", f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000",
         "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    console = [line for line in result.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, console
    # plotly.js ran: every figure div holds its rendered SVG.
    assert result.stdout.count('class="plotly-graph-div') == len(report.FIGURES)
    assert result.stdout.count('class="main-svg"') >= len(report.FIGURES)


def test_tables_read_in_units_with_runs_by_label() -> None:
    from kvscope.dashboards.report import format_cell, table_html

    assert format_cell(0.1234, "token_reuse_rate") == ("12.3 %", "num")
    assert format_cell(0.5, "share") == ("50.0 %", "num")
    assert format_cell(1234.567, "ttft_p50_ms") == ("1,235 ms", "num")
    assert format_cell(12.345, "ttft_p50_ms") == ("12.3 ms", "num")
    assert format_cell(3 * (1 << 30), "retained_bytes") == ("3.00 GiB", "num")
    assert format_cell(None, "ttft_p50_ms")[0] == "not measured"
    assert format_cell(0.25, "gib_s_total") == ("0.25", "num")  # GiB·s is not seconds
    html = table_html(pl.DataFrame({"run_id": ["9f3a1c0d5e7b2a41"], "label": ["feature ON"],
                                    "local_share": [0.25]}))
    assert "9f3a1c0d5e7b2a41" not in html and "<th>run</th>" in html
    assert html.index("<th>run</th>") < html.index("<th>local_share</th>")
    assert "25.0 %" in html


@pytest.mark.parametrize("external", [384, 900])
def test_the_verdict_says_what_vllms_own_counters_say(tmp_path: Path, external: int) -> None:
    """A run ingested with prefill's /metrics snapshot: its verdict sets vLLM's counters beside
    the ledger (684 tokens pulled by the log's turns, 300 of them a failed read vLLM does not
    count; 900 is vLLM counting more than the ledger has turns for), and the reconciliation
    table is in the report."""
    from tests.collector.test_ingest_vllm_metrics import _run

    rows = _run(tmp_path, external=external)
    html = report.write_report(tmp_path / "run.duckdb", tmp_path / "r.html").read_text()
    verdict = html[html.index("<h2>Verdict</h2>"):html.index("<h2>Figures</h2>")]
    if external == 384:
        assert f"agree with the ledger: {len(rows)} quantities" in verdict
    else:
        assert (f"DISAGREE with the ledger on 1 of {len(rows)} quantities, unexplained: "
                "d2p_tokens_scheduled (prefill: ledger 684, vLLM 900)") in verdict
    table = html[html.index('id="table-reconciliation"'):]
    assert all(row["quantity"] in table for row in rows)


def test_the_verdict_says_vllms_counters_were_not_compared(page: Path) -> None:
    text = page.read_text()
    verdict = text[text.index("<h2>Verdict</h2>"):text.index("<h2>Figures</h2>")]
    assert verdict.count("vLLM&#x27;s own reuse counters: not measured (no /metrics") == 2

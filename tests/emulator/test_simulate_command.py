"""``kvscope simulate``: options for every setting, sweeps into one store, truth, progress,
summary, and the report on the result."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope import cli
from kvscope.analysis import registry
from kvscope.cli.simulate import (
    OPTIONS,
    ProgressLine,
    base_settings,
    expand,
    parse_sweep,
    run_simulate,
)
from kvscope.emulator.simulator import SimulationResult, SimulationSettings
from kvscope.emulator.workloads import mooncake_synthetic
from kvscope.errors import SettingError
from kvscope.reuse import outcomes
from kvscope.store.query import Query
from kvscope.store.source import open_reader


def _parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["simulate", "--db", "x.duckdb", *argv])


def kvscope(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvscope.cli", *argv], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_every_setting_is_an_option_named_as_vllm_names_it() -> None:
    fields = {f.name for f in dataclasses.fields(SimulationSettings)}
    assert {o.field for o in OPTIONS} == fields - {"faults"}
    flags = {flag for action in cli.build_parser()._subparsers._group_actions[0]  # type: ignore[union-attr]
             .choices["simulate"]._actions for flag in action.option_strings}
    for flag in ("--decoder-kv-blocks-ttl", "--kv-recompute-threshold", "--kv-load-failure-policy",
                 "--no-enable-prefix-caching", "--router-ttl", "--prefill-nodes",
                 "--decode-nodes", "--profile", "--fault", "--scheduling", "--seed", "--label",
                 "--served-model-name", "--truth", "--sweep", "--workload", "--trace"):
        assert flag in flags, flag


def test_options_give_the_settings() -> None:
    args = _parse("--decoder-kv-blocks-ttl", "60", "--kv-recompute-threshold", "0",
                  "--kv-load-failure-policy", "recompute", "--no-enable-prefix-caching",
                  "--scheduling", "sync", "--prefill-nodes", "2", "--router-ttl", "30",
                  "--fault", "transfer_fail=0.25", "--fault", "clock_skew", "--seed", "9",
                  "--label", "plan", "--no-bidirectional-kv-xfer", "--profile", "tiny")
    assert base_settings(args) == SimulationSettings(
        label="plan", profile="tiny", prefill_nodes=2, decoder_kv_blocks_ttl=60.0,
        kv_recompute_threshold=0, kv_load_failure_policy="recompute", scheduling="sync",
        prefill_prefix_caching=False, router_ttl=30.0, seed=9,
        prefill_bidirectional_kv_xfer=False, decode_bidirectional_kv_xfer=False,
        faults={"transfer_fail": 0.25, "clock_skew": 1.0},
    )
    # vLLM's defaults where nothing is given: async scheduling, failure policy fail.
    defaults = base_settings(_parse())
    assert defaults == SimulationSettings()
    assert (defaults.scheduling, defaults.kv_load_failure_policy) == ("async", "fail")


def test_a_sweep_runs_every_combination_each_labelled() -> None:
    base = SimulationSettings(label="plan")
    plans = expand(base, [parse_sweep("decoder-kv-blocks-ttl=60,480"),
                          parse_sweep("bidirectional-kv-xfer=on,off")])
    assert [p.label for p in plans] == [
        "plan decoder-kv-blocks-ttl=60 bidirectional-kv-xfer=on",
        "plan decoder-kv-blocks-ttl=60 bidirectional-kv-xfer=off",
        "plan decoder-kv-blocks-ttl=480 bidirectional-kv-xfer=on",
        "plan decoder-kv-blocks-ttl=480 bidirectional-kv-xfer=off",
    ]
    assert [(p.decoder_kv_blocks_ttl, p.prefill_bidirectional_kv_xfer,
             p.decode_bidirectional_kv_xfer) for p in plans] == [
        (60.0, True, True), (60.0, False, False), (480.0, True, True), (480.0, False, False)]
    # Field names work as keys too.
    assert parse_sweep("kv_recompute_threshold=0,64").values == (0, 64)
    for bad, message in (("nope=1", "unknown key"), ("scheduling=fast", "choose one of"),
                         ("decoder-kv-blocks-ttl", "expected KEY=V1"),
                         ("prefill-nodes=x", "invalid literal")):
        with pytest.raises(SettingError, match=message):
            parse_sweep(bad)
    with pytest.raises(SettingError, match="prefill-nodes must be >= 1"):
        expand(base, [parse_sweep("prefill-nodes=0")])


def test_progress_line_says_turns_virtual_time_and_rate() -> None:
    out = io.StringIO()
    line = ProgressLine("[1/2 ON]", 4096, out, every_s=0.0)
    line(1024, 30.0)
    line(4096, 7200.0)
    line.done(SimulationResult("r", 4096, 30_000, [], 7200.0))
    first, last, closing = out.getvalue().splitlines()
    assert first.startswith("[1/2 ON] 1,024/4,096 turns (25%), virtual 30 s, ")
    assert first.endswith(" turns/s")
    assert last.startswith("[1/2 ON] 4,096/4,096 turns (100%), virtual 2.0 h, ")
    assert closing.startswith("[1/2 ON] 4,096 turns, 30,000 spans in ")


def test_simulate_a_mooncake_trace_sweep_into_one_store(tmp_path: Path) -> None:
    trace = mooncake_synthetic.generate(sessions=60, seed=2)
    trace.write(tmp_path / "trace.jsonl")
    done = kvscope("simulate", "--workload", "mooncake", "--trace", "trace.jsonl",
                   "--db", "out.duckdb", "--truth", "truth.jsonl", "--label", "plan",
                   "--no-enable-prefix-caching", "--sweep", "decoder-kv-blocks-ttl=30,480",
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    requests = len(trace.rows)
    sessions = len(trace.sessions) + len(trace.links() - trace.identifiable_links())
    # Progress and the import summary on stderr, the summary table on stdout.
    assert f"mooncake grouping: {requests} requests -> {sessions} sessions" in done.stderr
    assert (f"[1/2 plan decoder-kv-blocks-ttl=30] {requests}/{requests} turns (100%), virtual "
            in done.stderr)
    assert f"[2/2 plan decoder-kv-blocks-ttl=480] {requests} turns, " in done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("2 run(s) into out.duckdb in ")
    assert lines[1].split() == ["label", "turns", "reuse", "top", "miss", "causes",
                                "retained", "GiB·s", "TTFT", "p50", "ms", "TTFT", "p90", "ms"]
    assert lines[3].startswith("plan decoder-kv-blocks-ttl=30 ")
    assert lines[4].startswith("plan decoder-kv-blocks-ttl=480 ")
    assert lines[-1] == "report: kvscope report out.duckdb -o report.html"

    reader = open_reader(tmp_path / "out.duckdb")
    _, runs = reader.rows(Query("SELECT run_id, label, settings FROM kvscope_runs ORDER BY "
                                "started_at"))
    reader.close()
    assert [label for _, label, _ in runs] == ["plan decoder-kv-blocks-ttl=30",
                                               "plan decoder-kv-blocks-ttl=480"]
    recorded = json.loads(runs[0][2])
    assert recorded["decoder_kv_blocks_ttl"] == 30.0 and not recorded["prefill_prefix_caching"]
    assert recorded["workload_settings"]["sessions"] == sessions

    truth = [json.loads(line) for line in (tmp_path / "truth.jsonl").read_text().splitlines()]
    assert len(truth) == 2 * requests
    assert {row["run_id"] for row in truth} == {run_id for run_id, _, _ in runs}
    # The summary's reuse is the ledger's, which equals the simulator's truth (where no turn
    # errored: the ledger cannot count what follows an errored turn, so it says "not measured").
    later = [r for r in truth if r["run_id"] == runs[1][0] and r["turn_index"] > 1]
    assert not any(r["errored"] for r in later)
    reused = sum(r["local_hit_tokens"] + r["remote_reused_tokens"] for r in later)
    rate = reused / sum(r["reusable_tokens"] for r in later)
    assert f" {100 * rate:.1f}% " in lines[4]
    # A 30 s TTL loses what the trace's think times outlast (failed loads under vLLM's policy).
    short = [r for r in truth if r["run_id"] == runs[0][0] and r["turn_index"] > 1]
    assert sum(r["outcome"] == outcomes.LOAD_FAILED_ERRORED for r in short) > 0.2 * len(short)
    assert "load_failed_errored" in lines[3]

    # The report works on the result unchanged.
    assert cli.main(["report", str(tmp_path / "out.duckdb"), "--out",
                     str(tmp_path / "report.html")]) == 0
    assert "plan decoder-kv-blocks-ttl=480" in (tmp_path / "report.html").read_text()


def test_simulate_the_raw_weka_traces(tmp_path: Path) -> None:
    from kvscope.emulator.workloads import weka

    args = _parse("--workload", "weka", "--trace", str(weka.RAW_DIR), "--max-turns", "4",
                  "--profile", "tiny", "--quiet")
    assert run_simulate(
        argparse.Namespace(**{**vars(args), "db": str(tmp_path / "weka.duckdb")})) == 0
    with registry.AnalysisContext.open(tmp_path / "weka.duckdb") as ctx:
        ledger = ctx.ledger()
    assert ledger.height == weka.load_raw(max_turns=4).num_requests


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workload", "mooncake"], "--trace is required with --workload mooncake"),
        (["--sweep", "nope=1"], "unknown key 'nope'"),
        (["--fault", "meteor=0.1"], "unknown fault"),
        (["--fault", "transfer_fail=2"], "within [0, 1]"),
        (["--decoder-kv-blocks-ttl", "soon"], "--decoder-kv-blocks-ttl=soon"),
        # A setting's range is checked as every other command checks it (was accepted).
        (["--decoder-kv-blocks-ttl", "-5"], "--decoder-kv-blocks-ttl=-5: must be > 0"),
        (["--sweep", "kv-recompute-threshold=64,-3"], "must be >= 0"),
        (["--workload", "mooncake", "--trace", "absent.jsonl"], "cannot read"),
    ],
)
def test_mistakes_are_one_line_errors(argv: list[str], message: str, tmp_path: Path) -> None:
    done = kvscope("simulate", "--db", "out.duckdb", "--quiet", *argv, cwd=tmp_path)
    assert done.returncode == cli.EXIT_USER_ERROR
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("kvscope simulate: error: ") and message in done.stderr

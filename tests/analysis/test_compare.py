"""A/B comparison and per-run verdict: pure shaping on small frames, then ON vs OFF runs."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope import cli
from kvscope.analysis import compare, registry, runs
from kvscope.analysis.causes import cause_table
from kvscope.analysis.ledger import LEDGER_SCHEMA
from kvscope.analysis.registry import AnalysisContext, AnalysisError
from kvscope.analysis.reuse import reuse_table
from kvscope.analysis.verdict import verdict_sentences, verdict_table
from kvscope.reuse import outcomes
from tests.stores import on_off_store

T0 = datetime(2026, 1, 1)


def _ledger(rows: list[dict]) -> pl.DataFrame:
    """A ledger frame with every column, filled from ``rows`` (missing columns null)."""
    full = [{name: row.get(name) for name in LEDGER_SCHEMA} for row in rows]
    return pl.DataFrame(full, schema=LEDGER_SCHEMA)


def _turn(run: str, conv: str, index: int, start_s: float, dur_s: float, **values) -> dict:
    return {"run_id": run, "conversation_id": conv, "turn_index": index,
            "arrival": T0 + timedelta(seconds=start_s),
            "end": T0 + timedelta(seconds=start_s + dur_s), **values}


# --- feature state, runs ----------------------------------------------------------------------


@pytest.mark.parametrize(("settings_", "label", "bidir", "expected"), [
    ({"prefill_bidirectional_kv_xfer": True, "decode_bidirectional_kv_xfer": True}, "x", None,
     ("on", "settings")),
    ({"prefill_bidirectional_kv_xfer": True, "decode_bidirectional_kv_xfer": False}, "ON",
     True, ("off", "settings")),
    ({"bidirectional_kv_xfer": "false"}, "on", None, ("off", "settings")),
    ({}, "bidir-OFF run 3", True, ("off", "label")),
    ({}, "warm-on", None, ("on", "label")),
    ({}, "online", False, ("off", "reuse decisions")),  # "on" inside a word is not a flag
    ({}, "on vs off", None, (None, "not recorded")),
])
def test_feature_state(settings_: dict, label: str, bidir: bool | None,
                       expected: tuple) -> None:
    assert runs.feature_state(settings_, label, bidir) == expected


def _runs(*rows: tuple[str, str, dict]) -> pl.DataFrame:
    return pl.DataFrame(
        [{"run_id": r, "label": lbl, "settings": json.dumps(s),
          "started_at": T0 + timedelta(minutes=i), "ended_at": None}
         for i, (r, lbl, s) in enumerate(rows)],
        schema={"run_id": pl.String, "label": pl.String, "settings": pl.String,
                "started_at": pl.Datetime("us", "UTC"), "ended_at": pl.Datetime("us", "UTC")},
    )


def test_pairing_by_workload_and_feature() -> None:
    wl = {"workload": "synthetic", "workload_settings": {"seed": 1}}
    other = {"workload": "synthetic", "workload_settings": {"seed": 2}}
    table = _runs(
        ("a", "first", {**wl, "bidirectional_kv_xfer": False}),
        ("b", "other", {**other, "bidirectional_kv_xfer": False}),
        ("c", "second", {**wl, "bidirectional_kv_xfer": True}),
        ("d", "later off", {**wl, "bidirectional_kv_xfer": False}),
    )
    info = runs.run_info(table, _ledger([]))
    assert runs.baseline_for(info, "c") == "d"  # the most recent OFF run of that workload
    assert runs.baseline_for(info, "a") is None  # OFF runs have no baseline
    assert runs.choose_pair(info) == ("c", "d")
    with pytest.raises(AnalysisError, match="two runs"):
        runs.choose_pair(info.filter(pl.col("run_id") != "c"))
    assert runs.resolve_runs(table, ["second", "a"]) == ["c", "a"]
    with pytest.raises(AnalysisError, match="no run with id or label 'nope'"):
        runs.resolve_runs(table, ["nope"])


def test_workload_fingerprint_without_settings() -> None:
    turns = [_turn(r, "c1", 1, 0, 1, prompt_tokens=100) for r in ("x", "y", "z")]
    turns.append(_turn("z", "c1", 2, 5, 1, prompt_tokens=300))
    info = runs.run_info(_runs(("x", "x on", {}), ("y", "y off", {}), ("z", "z off", {})),
                            _ledger(turns))
    keys = dict(info.select("run_id", "workload_key").rows())
    assert keys["x"] == keys["y"] != keys["z"]
    assert runs.baseline_for(info, "x") == "y"


def test_a_faults_run_finds_the_off_run_of_its_workload() -> None:
    """``make demo``'s ON + faults run: its faults and failed turns are not its workload."""
    wl = {"workload": "weka", "workload_settings": {"conversations": 12}}
    table = _runs(("off", "feature OFF", {**wl, "bidirectional_kv_xfer": False, "faults": {}}),
                 ("on", "feature ON", {**wl, "bidirectional_kv_xfer": True, "faults": {}}),
                 ("f", "feature ON + faults", {**wl, "bidirectional_kv_xfer": True,
                                               "faults": {"transfer_fail": 0.08}}))
    info = runs.run_info(table, _ledger([]))
    assert runs.baseline_for(info, "f") == runs.baseline_for(info, "on") == "off"
    # Without recorded settings, a failed turn (no prompt tokens reported) does not change
    # the fingerprint either.
    turns = [_turn("x", "c1", 1, 0, 1, prompt_tokens=100),
             _turn("y", "c1", 1, 0, 1, prompt_tokens=0)]
    info = runs.run_info(_runs(("x", "x on", {}), ("y", "y off", {})), _ledger(turns))
    assert runs.baseline_for(info, "x") == "y"


# --- shaping ----------------------------------------------------------------------------------


def test_prompt_bins_are_rounded_and_increasing() -> None:
    edges = compare.prompt_bins(pl.Series(list(range(1000, 21000, 10))), 4)
    assert edges == [6000, 11000, 16000]
    assert compare.prompt_bins(pl.Series([5, 5, 5, 5]), 4) == [5]
    assert compare.prompt_bins(pl.Series([], dtype=pl.Int64), 4) == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=200_000), min_size=1, max_size=80),
       st.integers(min_value=1, max_value=12))
def test_bins_cover_every_turn_once(prompts: list[int], bins: int) -> None:
    edges = compare.prompt_bins(pl.Series(prompts), bins)
    assert edges == sorted(set(edges))
    ledger = _ledger([_turn("r", f"c{i}", 1, i, 1, prompt_tokens=p, ttft_ms=1.0)
                      for i, p in enumerate(prompts)])
    table = compare.by_prompt_table(ledger, {"r": "R"}, edges)
    assert table["turns"].sum() == len(prompts)
    assert table.height <= len(edges) + 1
    # A bin's observed range never crosses an edge.
    for lo, hi in table.select("bin_lo_tokens", "bin_hi_tokens").rows():
        assert not any(lo < e <= hi for e in edges)


def test_prefill_split_null_without_hooks_zero_without_read() -> None:
    ledger = _ledger([
        # A run with engine hooks: one turn read (20 ms of 100), one did not read.
        _turn("hooks", "c", 1, 0, 1, prompt_tokens=1000, prefill_ms=100.0, d2p_ms=20.0,
              decision="pull", ttft_ms=110.0),
        _turn("hooks", "c", 2, 5, 1, prompt_tokens=1000, prefill_ms=60.0, decision="no_offer",
              ttft_ms=70.0),
        # A run without engine hooks: no decision, no transfer measured.
        _turn("bare", "c", 1, 0, 1, prompt_tokens=1000, prefill_ms=90.0, ttft_ms=95.0),
    ])
    table = compare.by_prompt_table(ledger, {"hooks": "H", "bare": "B"}, [])
    rows = {r["run_id"]: r for r in table.iter_rows(named=True)}
    assert rows["hooks"]["transfer_ms_mean"] == pytest.approx(10.0)
    assert rows["hooks"]["prefill_compute_ms_mean"] == pytest.approx(70.0)
    assert rows["bare"]["transfer_ms_mean"] is None
    assert rows["bare"]["prefill_compute_ms_mean"] is None
    assert rows["bare"]["prefill_ms_mean"] == pytest.approx(90.0)
    assert table["label"].to_list() == ["H", "B"]  # the pair's order, not alphabetical


def test_run_stats_task_time_and_ttft_share() -> None:
    ledger = _ledger([
        _turn("r", "c1", 1, 0, 2, ttft_ms=500.0, outcome=outcomes.FIRST_TURN),
        _turn("r", "c1", 2, 10, 2, ttft_ms=500.0, outcome=outcomes.REUSED_REMOTE),  # task 12 s
        _turn("r", "c2", 1, 0, 8, ttft_ms=None, errored=True, outcome=outcomes.FIRST_TURN),
    ])
    stats = compare.run_stats(ledger).row(0, named=True)
    assert stats["task_time_total_s"] == pytest.approx(20.0)
    assert stats["task_time_p50_s"] == pytest.approx(10.0)
    assert stats["ttft_share_of_task"] == pytest.approx(1.0 / 20.0)
    assert stats["ttft_p50_ms"] == pytest.approx(500.0)
    assert stats["turns_reused_remote"] == 1 and stats["errored_turns"] == 1
    assert stats["transfer_ms_mean"] is None  # no engine hooks in this run


def test_summary_ratios_and_not_measured() -> None:
    stats = pl.DataFrame({"run_id": ["a", "b"], "ttft_p50_ms": [50.0, 100.0],
                          "transfer_ms_mean": [5.0, 0.0]})
    reuse = pl.DataFrame({"run_id": ["a"], "token_reuse_rate": [0.9], "local_share": [0.1],
                          "remote_share": [0.8]})
    table = compare.summary_table(("a", "b"), {"a": "ON", "b": "OFF"}, stats, reuse,
                                  compare.retention_totals(None))
    by = {r["metric"]: r for r in table.iter_rows(named=True)}
    assert by["ttft_p50_ms"]["ratio"] == pytest.approx(0.5)
    assert by["transfer_ms_mean"]["ratio"] is None  # b is 0: no ratio, not infinity
    assert by["token_reuse_rate"]["value_b"] is None  # not measured, not 0
    assert by["retained_gib_s"]["value_a"] is None
    assert [m for m, _ in compare.SUMMARY_METRICS] == table["metric"].to_list()


def test_retention_totals_sum_engines() -> None:
    cost = pl.DataFrame({"run_id": ["a", "a", "b"], "engine_id": ["d0", "d1", "d0"],
                         "gib_s_total": [1.0, 2.0, 4.0], "gib_s_useful": [0.5, 0.5, None],
                         "gib_s_idle": [0.0, 1.0, None], "gib_s_wasted": [0.5, 0.5, 4.0]})
    totals = {r["run_id"]: r for r in compare.retention_totals(cost).iter_rows(named=True)}
    assert totals["a"]["retained_gib_s"] == pytest.approx(3.0)
    assert totals["a"]["idle_gib_s"] == pytest.approx(1.0)
    assert totals["b"]["wasted_gib_s"] == pytest.approx(4.0)
    assert compare.retention_totals(cost.drop("gib_s_total")).is_empty()


def test_retained_peak_sums_engines_and_prefers_the_gauge() -> None:
    gib = float(1 << 30)
    t = [T0, T0 + timedelta(seconds=10)]
    frame = pl.DataFrame({
        "run_id": ["a"] * 4 + ["b"] * 4,
        "source": ["retention_spans"] * 4 + ["retention_spans", "retention_spans",
                                              "retained_bytes_gauge", "gpu_memory_used"],
        "time": [t[0], t[0], t[1], t[1], t[0], t[1], t[1], t[1]],
        "mean_bytes": [1 * gib, 2 * gib, 2 * gib, 2 * gib, 9 * gib, 9 * gib, 5 * gib, 80 * gib],
    })
    peaks = dict(compare.retained_peak(frame).rows())
    assert peaks == {"a": pytest.approx(4.0), "b": pytest.approx(5.0)}
    assert compare.retained_peak(None).is_empty()
    assert compare.retained_peak(frame.filter(pl.col("source") == "gpu_memory_used")).is_empty()


def test_sentences_say_not_measured_never_zero() -> None:
    unmeasured = ("label", "feature", "token_reuse_rate", "ttft_p50_ms", "ttft_p90_ms",
                  "ttft_share_of_task", "retained_gib_s")
    row: dict[str, object] = dict.fromkeys(unmeasured)
    row.update(run_id="r1", turns=3, later_turns=2, feature="on", feature_source="label",
               retention_note="the retention_cost analysis is not available")
    text = " ".join(verdict_sentences(row))
    assert "Reuse was not measured" in text
    assert "TTFT p50 not measured, p90 not measured" in text
    assert "Retention cost: not measured (the retention_cost analysis is not available)" in text
    assert "change in TTFT and task time is not measured" in text
    assert "0%" not in text and "0.0 ms" not in text


# --- simulator: ON vs OFF of one workload -----------------------------------------------------


@pytest.fixture(scope="module")
def ab_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Feature ON and OFF over one workload; prefill's own prefix cache off, so reuse is remote."""
    return on_off_store(tmp_path_factory.mktemp("ab") / "ab.duckdb", seed=5, conversations=8,
                        turns_p50=8, max_turns=10)


def test_compare_on_vs_off(ab_store: Path) -> None:
    with AnalysisContext.open(ab_store) as ctx:
        summary = registry.run(ctx, "compare")
        by_prompt = registry.run(ctx, "compare_by_prompt", {"bins": 4})
        swapped = registry.run(ctx, "compare", {"runs": "OFF,ON"})
    assert summary["label_a"][0] == "ON" and summary["label_b"][0] == "OFF"
    by = {r["metric"]: r for r in summary.iter_rows(named=True)}
    assert by["turns"]["ratio"] == 1.0
    assert by["ttft_p50_ms"]["ratio"] < 1.0
    assert by["token_reuse_rate"]["value_a"] > 0.9 and by["token_reuse_rate"]["value_b"] == 0.0
    assert by["transfer_ms_mean"]["value_a"] > 0 and by["transfer_ms_mean"]["value_b"] == 0.0
    assert by["turns_reused_remote"]["value_a"] > 0
    # ON's TTFT is lower at long prompts: the last bin, where recompute costs most.
    last = by_prompt.filter(pl.col("bin") == by_prompt["bin"].max())
    ttft = dict(last.select("label", "ttft_p50_ms").rows())
    assert ttft["ON"] < 0.8 * ttft["OFF"]
    compute = dict(last.select("label", "prefill_compute_ms_mean").rows())
    assert compute["ON"] < compute["OFF"]
    assert by_prompt["bin"].n_unique() == 4
    assert swapped["label_a"][0] == "OFF"
    assert swapped.filter(pl.col("metric") == "ttft_p50_ms")["ratio"][0] > 1.0


def test_compare_refuses_bad_runs(ab_store: Path) -> None:
    with AnalysisContext.open(ab_store) as ctx:
        with pytest.raises(AnalysisError, match="exactly two runs"):
            registry.run(ctx, "compare", {"runs": "ON"})
        with pytest.raises(AnalysisError, match="no run with id or label 'MAYBE'"):
            registry.run(ctx, "compare", {"runs": "ON,MAYBE"})
    on_id = _run_id(ab_store, "ON")
    with AnalysisContext.open(ab_store, runs=[on_id]) as ctx:
        with pytest.raises(AnalysisError, match="not in the selected runs"):
            registry.run(ctx, "compare", {"runs": "ON,OFF"})


def _run_id(db: Path, label: str) -> str:
    with AnalysisContext.open(db) as ctx:
        table = runs.run_table(ctx)
    return str(table.filter(pl.col("label") == label)["run_id"][0])


def test_verdict_on_vs_off(ab_store: Path) -> None:
    import kvscope.analysis.verdict  # noqa: F401  registers "verdict" until MODULES lists it

    with AnalysisContext.open(ab_store) as ctx:
        table = registry.run(ctx, "verdict")
    rows = {r["label"]: r for r in table.iter_rows(named=True)}
    on, off = rows["ON"], rows["OFF"]
    assert on["feature"] == "on" and off["feature"] == "off"
    assert on["baseline_run_id"] == off["run_id"] and off["baseline_run_id"] is None
    assert on["ttft_p50_change"] < 0
    assert on["turns_reused_remote"] > 0 and off["turns_reused_remote"] == 0
    assert off["cause_1"] == outcomes.NO_DECODE_METADATA and off["cause_1_share"] == 1.0
    text = " ".join(verdict_sentences(on))
    assert "Reuse happened" in text and "Against the feature-OFF run OFF" in text
    off_text = " ".join(verdict_sentences(off))
    assert "Reuse did not happen" in off_text and "no_decode_metadata (100%" in off_text
    if "retention_cost" in registry.analyses():
        assert on["retained_gib_s"] > 0
        assert off["retained_gib_s"] is None and off["retention_note"] is not None


def test_verdict_table_without_retention_analysis() -> None:
    ledger = _ledger([_turn("r", "c", 1, 0, 1, ttft_ms=10.0, outcome=outcomes.FIRST_TURN)])
    info = runs.run_info(_runs(("r", "solo", {})), ledger)
    row = verdict_table(info, ledger, None).row(0, named=True)
    assert row["retained_gib_s"] is None
    assert row["retention_note"] == "the retention_cost analysis is not available"
    assert row["later_turns"] == 0
    assert "nothing to reuse" in " ".join(verdict_sentences(row))


def test_main_compare_prints_both_tables(ab_store: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["compare", str(ab_store), "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["metric"] for r in out["summary"]] == [m for m, _ in compare.SUMMARY_METRICS]
    assert {r["label"] for r in out["by_prompt"]} == {"ON", "OFF"}
    assert cli.main(["compare", str(ab_store), "--runs", "OFF,ON"]) == 0
    text = capsys.readouterr().out
    assert text.count("rows)") == 2 and "ttft_p50_ms" in text


def test_unmeasured_quantities_are_null_not_zero() -> None:
    """A run with no turn end has no task time; turns whose engine left no evidence add no
    local or remote tokens and no reuse rate (issue 30: never a sum of nothing shown as 0)."""
    ledger = _ledger([
        {"run_id": "r", "conversation_id": "c1", "turn_index": 1, "arrival": T0,
         "outcome": outcomes.FIRST_TURN},
        {"run_id": "r", "conversation_id": "c1", "turn_index": 2,
         "arrival": T0 + timedelta(seconds=5), "reusable_tokens": 400,
         "outcome": outcomes.UNKNOWN},
    ])
    stats = compare.run_stats(ledger).row(0, named=True)
    assert stats["task_time_total_s"] is None
    assert stats["ttft_share_of_task"] is None
    (reuse,) = reuse_table(ledger).iter_rows(named=True)
    assert (reuse["measured_turns"], reuse["reusable_tokens"]) == (0, 400)
    assert reuse["local_tokens"] is None and reuse["remote_tokens"] is None
    assert reuse["recomputed_tokens"] is None
    assert reuse["token_reuse_rate"] is None and reuse["turn_reuse_rate"] is None
    (cause,) = cause_table(ledger).iter_rows(named=True)
    assert cause["recomputed_tokens"] is None
    # With a measured turn beside it, the rates are over the measured turn only.
    measured = _ledger([*ledger.to_dicts(), {
        "run_id": "r", "conversation_id": "c2", "turn_index": 2, "arrival": T0,
        "reusable_tokens": 100, "local_hit_tokens": 20, "remote_reused_tokens": 60,
        "recomputed_reusable_tokens": 20, "outcome": outcomes.REUSED_REMOTE}])
    (reuse,) = reuse_table(measured).iter_rows(named=True)
    assert (reuse["measured_turns"], reuse["local_tokens"], reuse["remote_tokens"]) == (1, 20, 60)
    assert reuse["token_reuse_rate"] == pytest.approx(0.8)

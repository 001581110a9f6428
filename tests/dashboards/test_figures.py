"""Shared figure builders: traces and data from small frames; empty or partial input annotated."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta

import plotly.graph_objects as go
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.dashboards import figures

T0 = datetime(2026, 1, 1)


def _annotations(fig: go.Figure) -> list[str]:
    return [a.text for a in fig.layout.annotations or ()]


def _trace(fig: go.Figure, name: str) -> go.BaseTraceType:
    found = [t for t in fig.data if t.name == name]
    assert found, f"no trace {name!r}; traces: {[t.name for t in fig.data]}"
    return found[0]


def _by_prompt(transfer_on: list[float] | None = None) -> pl.DataFrame:
    rows = []
    for label, ttft, compute, transfer in (
        ("ON", [100.0, 150.0], [80.0, 100.0], transfer_on or [10.0, 30.0]),
        ("OFF", [110.0, 300.0], [105.0, 290.0], [0.0, 0.0]),
    ):
        for b, (lo, hi) in enumerate(((1000, 4000), (4000, 9000))):
            rows.append({"run_id": label.lower(), "label": label, "bin": b, "bin_lo_tokens": lo,
                         "bin_hi_tokens": hi, "turns": 5, "ttft_p50_ms": ttft[b],
                         "ttft_p90_ms": ttft[b] * 1.5,
                         "prefill_ms_mean": compute[b] + transfer[b],
                         "prefill_compute_ms_mean": compute[b], "transfer_ms_mean": transfer[b]})
    return pl.DataFrame(rows)


def test_ttft_vs_prompt_two_lines_per_run() -> None:
    fig = figures.ttft_vs_prompt(_by_prompt())
    assert len(fig.data) == 4
    on = _trace(fig, "ON p50")
    assert list(on.x) == [2500.0, 6500.0] and list(on.y) == [100.0, 150.0]
    assert _trace(fig, "OFF p90").line.dash == "dash"
    assert list(_trace(fig, "OFF p90").y) == [165.0, 450.0]
    assert not _annotations(fig)


def test_prefill_split_pairs_compute_and_transfer() -> None:
    fig = figures.prefill_split(_by_prompt())
    assert fig.layout.barmode == "group"
    compute, transfer = _trace(fig, "ON compute"), _trace(fig, "ON transfer")
    assert list(compute.y) == [80.0, 100.0]
    assert list(transfer.y) == [10.0, 30.0] and list(transfer.base) == [80.0, 100.0]
    assert compute.offsetgroup == transfer.offsetgroup == "ON"
    assert _trace(fig, "OFF compute").offsetgroup == "OFF"
    assert list(compute.x) == ["1000–4000", "4000–9000"]
    assert not _annotations(fig)


def test_prefill_split_without_hooks_says_transfer_not_measured() -> None:
    frame = _by_prompt().with_columns(
        pl.when(pl.col("label") == "OFF").then(None).otherwise(pl.col(c)).alias(c)
        for c in ("prefill_compute_ms_mean", "transfer_ms_mean")
    ).with_columns(pl.when(pl.col("label") == "OFF").then(200.0)
                   .otherwise(pl.col("prefill_ms_mean")).alias("prefill_ms_mean"))
    fig = figures.prefill_split(frame)
    whole = _trace(fig, "OFF prefill (split not measured)")
    assert list(whole.y) == [200.0, 200.0]  # the whole leg, not a made-up split
    assert not [t for t in fig.data if t.name == "OFF transfer"]
    assert _annotations(fig) == ["no engine hooks: transfer times not measured for OFF"]


def test_reuse_by_turn_remote_and_local() -> None:
    frame = pl.DataFrame({"run_id": ["a", "a", "b", "b"], "turn_index": [3, 2, 2, 3],
                          "local_share": [0.1, 0.2, 0.5, None],
                          "remote_share": [0.9, 0.7, 0.0, None]})
    fig = figures.reuse_by_turn(frame)
    remote = _trace(fig, "a remote")
    assert list(remote.x) == [2, 3] and list(remote.y) == [0.7, 0.9]
    assert list(_trace(fig, "b local").y) == [0.5, None]  # a gap, never 0
    all_null = frame.with_columns(pl.lit(None, pl.Float64).alias("local_share"),
                                  pl.lit(None, pl.Float64).alias("remote_share"))
    assert "not measured" in _annotations(figures.reuse_by_turn(all_null))[0]


def test_miss_causes_leave_out_full_reuse() -> None:
    frame = pl.DataFrame({
        "run_id": ["a", "a", "a", "b"], "label": ["ON", "ON", "ON", "OFF"],
        "outcome": ["reused_remote", "below_threshold", "decode_ttl_expired",
                    "no_decode_metadata"],
        "turns": [8, 1, 1, 10], "share": [0.8, 0.1, 0.1, 1.0],
    })
    fig = figures.miss_causes(frame)
    on = _trace(fig, "ON")
    assert sorted(on.y) == ["below_threshold", "decode_ttl_expired"]
    assert list(_trace(fig, "OFF").x) == [1.0]
    only_reuse = figures.miss_causes(frame.filter(pl.col("outcome") == "reused_remote"))
    assert _annotations(only_reuse) == [
        "no missed reuse: every later turn reused its earlier KV"]


def _memory(sources: list[str]) -> pl.DataFrame:
    rows = []
    for s in sources:
        for k in range(3):
            rows.append({"run_id": "r", "source": s,
                         "engine_id": "d0" if s.startswith("retention") else None,
                         "gpu_host": None if s.startswith("retention") else "h",
                         "gpu_index": None if s.startswith("retention") else "0",
                         "time": T0 + timedelta(seconds=100 + 10 * k),
                         "mean_bytes": float((k + 1) << 30), "max_bytes": float((k + 2) << 30)})
    return pl.DataFrame(rows)


def test_retained_memory_in_gib_from_run_start() -> None:
    fig = figures.retained_memory(_memory(["retention_spans"]))
    (trace,) = fig.data
    assert list(trace.x) == [0.0, 10.0, 20.0] and list(trace.y) == [1.0, 2.0, 3.0]
    assert _annotations(fig) == ["no GPU memory samples: GPU memory not measured"]
    both = figures.retained_memory(_memory(["retention_spans", "gpu_memory_used"]))
    assert len(both.data) == 2 and not _annotations(both)
    assert [t.line.dash for t in both.data].count("dash") == 1
    gpu_only = figures.retained_memory(_memory(["gpu_memory_used"]))
    assert "retained KV not measured" in _annotations(gpu_only)[0]


def test_task_time_stacks_measured_components() -> None:
    frame = pl.DataFrame({
        "run_id": ["a", "a", "b"], "conversation_id": ["c1", "c2", "c1"],
        "input_processing_s": [1.0, 2.0, 4.0], "transfer_s": [0.5, None, None],
        "generation_s": [3.0, 3.0, 3.0], "tool_wait_s": [10.0, 20.0, 30.0],
        "proxy_overhead_s": [0.1, 0.1, 0.1],
    })
    fig = figures.task_time(frame)
    assert fig.layout.barmode == "stack"
    assert list(_trace(fig, "input processing").y) == [3.0, 4.0]
    assert list(_trace(fig, "transfer").y) == [0.5, None]  # b: not measured, not 0
    assert not _annotations(fig)
    partial = figures.task_time(frame.drop("transfer_s"))
    assert _annotations(partial) == ["not measured: transfer"]


def test_whatif_lines_per_threshold_and_observed_star() -> None:
    rows = [{"run_id": "r", "source": "replay", "decoder_kv_blocks_ttl": ttl,
             "kv_recompute_threshold": th, "router_ttl": 450.0,
             "token_reuse_rate": ttl / 1000 - th / 10000, "retained_gib_s": ttl * 2.0}
            for th in (0, 64) for ttl in (480.0, 60.0, 900.0)]
    rows.append({"run_id": "r", "source": "observed", "decoder_kv_blocks_ttl": 480.0,
                 "kv_recompute_threshold": 64, "router_ttl": 450.0, "token_reuse_rate": 0.47,
                 "retained_gib_s": 950.0})
    fig = figures.whatif_curves(pl.DataFrame(rows))
    line = [t for t in fig.data if t.name == "threshold 64" and t.showlegend is not False][0]
    assert list(line.x) == [60.0, 480.0, 900.0]
    assert list(line.y) == pytest.approx([0.0536, 0.4736, 0.8936])
    stars = [t for t in fig.data if t.name == "observed"]
    assert len(stars) == 2 and list(stars[1].y) == [950.0]
    assert len([t for t in fig.data if t.name.startswith("threshold")]) == 4


def test_ladder_waterfall_ends_at_observed() -> None:
    steps = ["ideal", "ttl_bounded", "threshold_bounded", "capacity_bounded", "observed"]
    frame = pl.DataFrame({"run_id": ["r"] * 5, "step_order": [5, 1, 2, 3, 4],
                          "step": [steps[4], *steps[:4]],
                          "tokens": [400, 1000, 900, 900, None]})
    fig = figures.reuse_ladder(frame)
    (trace,) = fig.data
    assert list(trace.x) == ["ideal", "ttl_bounded", "threshold_bounded",
                             "lost before observed", "observed"]
    assert list(trace.y) == [1000, -100, 0, -500, 400]
    assert list(trace.measure) == ["absolute", "relative", "relative", "relative", "total"]
    assert _annotations(fig) == ["not measured: r: capacity_bounded"]
    one = figures.reuse_ladder(frame.filter(pl.col("step") == "ideal"))
    assert "not measured" in _annotations(one)[0]


BUILDERS: dict[str, Callable[[pl.DataFrame | None], go.Figure]] = {
    "ttft_vs_prompt": figures.ttft_vs_prompt,
    "prefill_split": figures.prefill_split,
    "reuse_by_turn": figures.reuse_by_turn,
    "miss_causes": figures.miss_causes,
    "retained_memory": figures.retained_memory,
    "task_time": figures.task_time,
    "whatif_curves": figures.whatif_curves,
    "reuse_ladder": figures.reuse_ladder,
}
SAMPLES: dict[str, pl.DataFrame] = {
    "ttft_vs_prompt": _by_prompt(),
    "prefill_split": _by_prompt(),
    "retained_memory": _memory(["retention_spans"]),
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_empty_and_missing_input_is_annotated(name: str) -> None:
    build = BUILDERS[name]
    for frame in (None, pl.DataFrame(), pl.DataFrame({"unrelated": [1]})):
        fig = build(frame)
        assert not fig.data, name
        (text,) = _annotations(fig)
        assert "not measured" in text or "not shown" in text, text
    if name in SAMPLES:
        empty = SAMPLES[name].head(0)
        fig = build(empty)
        assert not fig.data and "not measured" in _annotations(fig)[0]


def test_missing_column_is_named() -> None:
    fig = figures.ttft_vs_prompt(_by_prompt().drop("ttft_p50_ms"))
    assert _annotations(fig) == [
        "input lacks column(s) ttft_p50_ms: TTFT by prompt length not shown"]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.one_of(st.none(), st.floats(min_value=0.1, max_value=1e5)),
                min_size=1, max_size=12))
def test_nulls_stay_gaps(values: list[float | None]) -> None:
    frame = pl.DataFrame({
        "run_id": ["r"] * len(values), "bin_lo_tokens": list(range(len(values))),
        "bin_hi_tokens": list(range(len(values))), "ttft_p50_ms": values,
    }, schema_overrides={"ttft_p50_ms": pl.Float64})
    fig = figures.ttft_vs_prompt(frame)
    if all(v is None for v in values):
        assert not fig.data and "not measured" in _annotations(fig)[0]
    else:
        assert list(fig.data[0].y) == values


def test_an_outcome_has_one_colour_on_every_figure() -> None:
    """From the outcome table: each outcome its own colour, the alarm red, reuse green."""
    from kvscope.reuse import outcomes

    assert set(figures.OUTCOME_COLORS) == set(outcomes.OUTCOMES)
    assert len(set(figures.OUTCOME_COLORS.values())) == len(outcomes.OUTCOMES)
    assert figures.outcome_color(outcomes.REUSED_INVALID) == "#d62728"
    shares = pl.DataFrame({"run_id": ["a", "a", "b"], "label": ["ON", "ON", "OFF"],
                           "outcome": ["reused_remote", "transfer_failed", "transfer_failed"],
                           "turns": [8, 2, 10], "share": [0.8, 0.2, 1.0]})
    windows = pl.DataFrame({"run_id": ["a", "b", "b"], "label": ["ON", "OFF", "OFF"],
                            "window_start": [T0, T0, T0 + timedelta(seconds=5)],
                            "outcome": ["transfer_failed", "transfer_failed",
                                        "decode_ttl_expired"], "turns": [2, 4, 6]})
    engines = pl.DataFrame({"prefill_engine": ["p0", "p1"], "outcome": ["transfer_failed"] * 2,
                            "turns": [1, 2]})
    for fig in (figures.outcome_shares(shares), figures.outcomes_over_time(windows),
                figures.outcomes_by_engine(engines)):
        for trace in fig.data:
            assert trace.marker.color == figures.outcome_color(trace.name), trace.name


def test_missed_reuse_over_time_is_split_per_run() -> None:
    windows = pl.DataFrame({"run_id": ["a", "b", "b"], "label": ["ON", "OFF", "OFF"],
                            "window_start": [T0, T0, T0 + timedelta(seconds=5)],
                            "outcome": ["transfer_failed"] * 3, "turns": [2, 4, 6]})
    fig = figures.outcomes_over_time(windows)
    titles = [a.text for a in fig.layout.annotations]
    assert titles == ["OFF", "ON"]  # one panel per run, named by label
    assert {t.yaxis for t in fig.data} == {"y", "y2"}
    assert sum(1 for t in fig.data if t.showlegend) == 1  # one legend entry per cause


def test_prompt_bins_are_in_numeric_order() -> None:
    frame = _by_prompt()
    # A run whose only bin is the larger one comes first in sort order ("B" < "ON").
    extra = frame.filter(pl.col("bin") == 1).with_columns(
        pl.lit("b").alias("run_id"), pl.lit("B").alias("label"), pl.lit(9000).alias(
            "bin_lo_tokens"), pl.lit(20000).alias("bin_hi_tokens"))
    fig = figures.prefill_split(pl.concat([frame, extra], how="vertical_relaxed"))
    assert list(fig.layout.xaxis.categoryarray) == ["1000–4000", "4000–9000", "9000–20000"]


def test_time_windows_are_sized_to_the_run() -> None:
    from kvscope.dashboards.pages import MAX_WINDOW_S, window_s

    def ledger(seconds: float) -> pl.DataFrame:
        return pl.DataFrame({"run_id": ["r", "r"], "arrival": [T0, T0 + timedelta(seconds=seconds)],
                             "end": [T0 + timedelta(seconds=1), None]})

    assert window_s(ledger(20)) == 1.0  # a 20 s run: 1 s windows, not one 60 s point
    assert window_s(ledger(600)) == 20.0
    assert window_s(ledger(36_000)) == MAX_WINDOW_S
    assert window_s(pl.DataFrame()) == MAX_WINDOW_S

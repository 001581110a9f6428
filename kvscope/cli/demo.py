"""``kvscope demo`` (``make demo``): an emulated 1P1D deployment observed end to end, no GPU needed.

Three runs of one agentic workload drawn from the real WEKA / Claude Code traces go through the
kvscope proxy to an emulated prefill and decode server (``qwen3-32b`` cost profile): the feature
OFF, the feature ON, and ON with a realistic mix of faults. Everything is real apart from the
engines: HTTP on 127.0.0.1, the proxy, the OpenTelemetry SDK, the store. Telemetry lands in
``out/kvscope.duckdb``; the report in ``out/report.html``.

Time: prefill, transfer and decode take their cost-model durations in real time; tool waits are
divided by ``--time-scale`` and so are ``decoder_kv_blocks_ttl`` (480 s) and the proxy's router
TTL (450 s), so gaps and TTLs keep their proportions (vLLM's 5 s expiry margin is not scaled).
Token counts of the traces are multiplied by ``--token-scale`` to keep requests small.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvscope import settings
from kvscope.emulator import faults
from kvscope.emulator.launcher import EmulatedCluster
from kvscope.emulator.replay import replay
from kvscope.emulator.servers import EmulatorConfig
from kvscope.emulator.workloads import weka
from kvscope.emulator.workloads.model import Workload
from kvscope.reuse import outcomes


@dataclass(frozen=True)
class DemoOptions:
    """What the demo runs (recorded with each run's settings)."""

    out: Path = Path("out")
    conversations: int = 10
    max_turns: int = 8
    token_scale: float = 0.08
    time_scale: float = 12.0
    concurrency: int = 10
    profile: str = "qwen3-32b"


# A realistic mix: most turns are fine; some clients omit the id, some transfers fail, ...
FAULT_MIX = (
    (faults.TRANSFER_FAIL, 0.08),
    (faults.HANDSHAKE_FAIL, 0.04),
    (faults.STRIP_STREAM_METADATA, 0.05),
    (faults.PREEMPT_AFTER_READ, 0.04),
    (faults.INVALID_PARAMS, 0.03),
)


def _workload(options: DemoOptions) -> Workload:
    return weka.load_csv(
        conversations=options.conversations,
        max_turns=options.max_turns,
        token_scale=options.token_scale,
        time_compression=options.time_scale,
    )


def _config(
    options: DemoOptions, bidir: bool, mix: tuple[tuple[str, float], ...]
) -> EmulatorConfig:
    ttl = settings.resolve("decoder_kv_blocks_ttl") / options.time_scale
    fault_mix = faults.FaultMix(dict(mix), seed=7)
    # As in the vLLM blog's measurement: no prefix caching on prefill (a conversation's next turn
    # lands on a prefill node without its blocks), so only D→P reuse can avoid recompute.
    return EmulatorConfig(
        cost_profile=options.profile,
        prefill_prefix_caching=False,
        bidirectional_kv_xfer=bidir,
        decoder_kv_blocks_ttl=ttl,
        faults=fault_mix,
        seed=7,
    )


def _percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between ranks: the quantile the report's verdict and compare use."""
    if not values:
        return None
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _run_one(label: str, config: EmulatorConfig, workload: Workload, options: DemoOptions,
             db: Path) -> dict[str, Any]:
    router_ttl = settings.resolve("router_ttl") / options.time_scale
    started = time.monotonic()
    print(f"  [{label}] starting emulated 1P1D + kvscope proxy ...", flush=True)
    with EmulatedCluster(config, db=db, proxy=True, run_label=label, router_ttl_s=router_ttl,
                         run_settings={"workload": workload.name,
                                       "workload_settings": dict(workload.settings)}) as cluster:
        assert cluster.proxy_url is not None
        result = asyncio.run(replay(
            workload, cluster.proxy_url, concurrency=options.concurrency,
            time_scale=options.time_scale, request_timeout_s=120.0,
        ))
    ttfts = [r.ttft_ms for r in result.records if r.ttft_ms is not None]
    errors = sum(1 for r in result.records if not r.ok)
    print(f"  [{label}] {len(result.records)} turns in {time.monotonic() - started:.0f} s, "
          f"{errors} errors, client TTFT p50 {_fmt_ms(_percentile(ttfts, 0.5))}", flush=True)
    return {"label": label, "run_id": cluster.run_id, "turns": len(result.records)}


def _fmt_ms(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.0f} ms"


def _fmt_rate(value: float | None) -> str:
    return "not measured" if value is None else f"{100 * value:.1f} %"


def banner(options: DemoOptions, conversations: int, turns: int) -> str:
    """The demo's first line: the traces asked for (``--conversations``) and the conversations
    they make with their subagents, which the runs and the report count."""
    return (f"kvscope demo: {options.conversations} WEKA Claude Code traces ({conversations} "
            f"conversations with their subagents), {turns} turns (tokens x{options.token_scale}, "
            f"tool waits and TTLs /{options.time_scale:g}), profile {options.profile}")


def run_lines(label: str, rate: float | None, ttft_p50: float | None, ttft_p90: float | None,
              top_causes: list[tuple[str, float]], invalid: int) -> list[str]:
    """A run's summary lines: reuse rate, TTFT, the top missed-reuse causes (share of turns
    k>=2), and the correctness alarm, which is not a miss (its turns did reuse, wrongly)."""
    causes = ", ".join(f"{o} {100 * s:.0f} %" for o, s in top_causes)
    missed = f"missed reuse: {causes}" if causes else "missed reuse: no turn"
    lines = [f"  {label:<22} reuse {_fmt_rate(rate):>12}  TTFT p50 {_fmt_ms(ttft_p50):>8} p90 "
             f"{_fmt_ms(ttft_p90):>8}  {missed}"]
    if invalid:
        lines.append(f"  {'':<22} ALARM: {invalid} turn(s) did reuse decode's KV, but KV that "
                     "does not match their prompt (reused_invalid: a correctness fault, counted "
                     "apart from missed reuse; the report gives each one's evidence)")
    return lines


def _summary(db: Path, runs: list[dict[str, Any]]) -> None:
    from kvscope.analysis import registry

    with registry.AnalysisContext.open(db) as ctx:
        ledger = ctx.ledger()
        reuse = registry.run(ctx, "reuse_rate")
        causes = registry.run(ctx, "miss_causes")
        retention = (registry.run(ctx, "retention_cost")
                     if "retention_cost" in registry.analyses() else None)
        shares = (registry.run(ctx, "task_time_summary")
                  if "task_time_summary" in registry.analyses() else None)
        print("\nsummary (turns k>=2; missed reuse: the top causes, as shares of those turns)")
        for run in runs:
            rid = run["run_id"]
            rows = ledger.filter(ledger["run_id"] == rid)
            later = rows.filter(rows["turn_index"] >= 2)
            ttft = [v for v in later["ttft_ms"].to_list() if v is not None]
            rate = reuse.filter(reuse["run_id"] == rid)["token_reuse_rate"].to_list()
            invalid = later.filter(later["outcome"] == outcomes.REUSED_INVALID).height
            shown_apart = [outcomes.REUSED_REMOTE, outcomes.REUSED_LOCAL, outcomes.REUSED_INVALID]
            top = causes.filter((causes["run_id"] == rid)
                                & ~causes["outcome"].is_in(shown_apart))
            top_causes = list(zip(top["outcome"][:3], top["share"][:3], strict=False))
            for line in run_lines(run["label"], rate[0] if rate else None,
                                  _percentile(ttft, 0.5), _percentile(ttft, 0.9), top_causes,
                                  invalid):
                print(line)
            if retention is not None and retention.height:
                held = retention.filter(retention["run_id"] == rid)
                if held.height:
                    print(f"  {'':<22} retained {held['gib_s_total'].sum():.1f} GiB·s "
                          f"(useful {held['gib_s_useful'].sum():.1f}, idle "
                          f"{held['gib_s_idle'].sum():.1f}, wasted "
                          f"{held['gib_s_wasted'].sum():.1f}, still held "
                          f"{held['gib_s_open'].sum():.1f})")
            if shares is not None and shares.height:
                row = shares.filter((shares["run_id"] == rid) & (shares["component"] == "ttft"))
                share = row["share_of_task"][0] if row.height else None
                print(f"  {'':<22} TTFT share of task time {_fmt_rate(share)}")


def run_demo(out: Path, options: DemoOptions | None = None) -> int:
    """Run the three demo runs into ``out/kvscope.duckdb``, write the report, print a summary."""
    options = replace(options or DemoOptions(), out=out)
    out.mkdir(parents=True, exist_ok=True)
    db = out / "kvscope.duckdb"
    for stale in (db, Path(f"{db}.wal"), Path(f"{db}.truth.jsonl")):
        stale.unlink(missing_ok=True)
    workload = _workload(options)
    summary = workload.summary()
    print(banner(options, summary["conversations"], summary["requests"]))
    plans = [
        ("feature OFF", _config(options, False, ())),
        ("feature ON", _config(options, True, ())),
        ("feature ON + faults", _config(options, True, FAULT_MIX)),
    ]
    from kvscope.progress import steps

    with steps("kvscope demo", len(plans) + 1) as step:
        runs = []
        for label, config in plans:
            step(label)
            runs.append(_run_one(label, config, workload, options, db))
        step("summary and report")
        _summary(db, runs)
        report = out / "report.html"
        try:
            from kvscope.dashboards.report import write_report
        except ImportError:
            print("report: not available in this build")
        else:
            write_report(db, report)
            print(f"\nreport:  {report}")
    print(f"store:   {db}  (kvscope sql {db} \"SELECT SpanName, count(*) FROM otel_traces "
          "GROUP BY 1\")")
    # The time taken is the progress line's (kvscope.progress.steps), printed once.
    return 0


__all__ = ["DemoOptions", "FAULT_MIX", "banner", "run_demo", "run_lines"]

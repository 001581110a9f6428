"""The real round trip of a run made without kvscope: vLLM's benchmark client, unchanged, through
vLLM's example proxy, unchanged, against ``kvscope emulate`` with kvscope's spans off; then
``kvscope ingest`` of the benchmark's ``--stats-json-output`` and the proxy's log.

The ledger built from those two files alone is compared with the emulator's ground truth, turn by
turn (joined by the X-Request-Id the proxy logged, which the emulator's truth records):

* outcomes the two files carry the evidence for — a conversation's first turn, decode returning
  no params (no ``cached D blocks`` line), a request without a conversation id — agree; a truth of
  ``router_no_entry`` for a request the proxy saw without a conversation id reads
  ``no_conversation_id`` (the servers never see the router; the proxy's log says why);
* outcomes decided inside the engines (a pull, invalid params) are ``unknown``, naming the
  missing evidence: neither file holds prefill's reuse decision;
* the proxy's cache HIT is exactly where prefill got decode's offer (the truth's decision is
  not ``no_offer``);
* the proxy's "Prefill done in N ms" covers the emulated prefill server's own time for the
  request (admission, D→P read, compute), and the client's TTFT covers the proxy's prefill leg.

The agreement table is printed in the test's output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvscope import semconv
from kvscope.reuse import outcomes
from tests.vllm_contract.test_vllm_clients import (
    CONVERSATIONS,
    LATER_TURNS,
    Workload,
    _check_workload,
    _run,
    workload,  # noqa: F401  (the module fixture)
)

# Outcomes the stats file and the proxy's log carry the evidence for.
EVIDENCED = (outcomes.FIRST_TURN, outcomes.NO_DECODE_METADATA)
# The proxy's "Prefill done" is measured around the HTTP call to P: the server's own time plus
# loopback HTTP and two event loops on a shared CI machine (a bound that cannot hide a wrong
# join: the legs differ by 10x between a pulled and a recomputed turn only in real runs).
PREFILL_OVERHEAD_MS = 1000.0
# "Prefill done in %.0fms" rounds to whole milliseconds.
ROUNDING_MS = 0.5


def _ledger_of(tmp_path: Path) -> tuple[Any, list[dict[str, Any]]]:
    from kvscope.analysis import ledger
    from kvscope.collector.ingest import ingest
    from kvscope.store.source import open_reader

    result = ingest(tmp_path / "ingested.duckdb",
                    [tmp_path / "stats.json", tmp_path / "vllm-proxy.log"])
    reader = open_reader(tmp_path / "ingested.duckdb")
    try:
        return result, ledger.ledger(reader).to_dicts()
    finally:
        reader.close()


def _agreement(truth: dict[str, Any], row: dict[str, Any] | None, conversation_ids: bool) -> str:
    """How the ledger's outcome stands to the truth's: agrees, unknown (not in the sources),
    more specific, or a disagreement (the test fails on it)."""
    if row is None:
        return "not ingested"
    if row["outcome"] == truth["outcome"] and truth["outcome"] in EVIDENCED:
        return "agrees"
    if not conversation_ids and row["outcome"] == outcomes.NO_CONVERSATION_ID and truth[
            "outcome"] in (outcomes.FIRST_TURN, outcomes.ROUTER_NO_ENTRY):
        return "more specific (proxy: no conversation id)"
    if row["outcome"] == outcomes.UNKNOWN and truth["outcome"] not in EVIDENCED:
        return "unknown (engine evidence not in the sources)"
    return "DISAGREES"


def _table(lines: list[tuple[str, ...]]) -> str:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True))
                     for line in lines)


def _fmt(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.1f}"


CASES = {
    "bidir_on": ({}, True),
    "bidir_off": ({"emulator_flags": ["--no-bidirectional-kv-xfer"]}, True),
    "no_conversation_id": ({"send_conversation_id": False}, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ingested_stats_and_proxy_log_agree_with_the_emulators_truth(
        tmp_path: Path, workload: Workload, case: str,  # noqa: F811
        capsys: pytest.CaptureFixture[str]) -> None:
    options, conversation_ids = CASES[case]
    run = _run(tmp_path, workload, spans=False, **options)  # type: ignore[arg-type]
    _check_workload(run)
    assert run.spans == [] and not (tmp_path / "emulator.duckdb").exists()  # kvscope's spans off
    result, rows = _ledger_of(tmp_path)
    by_request = {r["x_request_id"]: r for r in rows}
    assert result.joined == len(run.stats) == len(rows), (result, run.logs)

    lines = [("conversation", "turn", "x_request_id", "truth", "ledger", "agreement",
              "proxy lookup", "truth decision", "truth prefill ms", "proxy prefill ms",
              "client TTFT ms")]
    verdicts = []
    for truth in sorted(run.truth, key=lambda t: (t["turn_index"], t["x_request_id"])):
        row = by_request.get(truth["x_request_id"])
        verdict = _agreement(truth, row, conversation_ids)
        verdicts.append(verdict)
        lines.append((
            row["conversation_id"] if row else "-", str(truth["turn_index"]),
            truth["x_request_id"][:8], truth["outcome"], row["outcome"] if row else "-",
            verdict, row["router_lookup"] if row else "-", str(truth["decision"]),
            _fmt(truth["prefill_server_ms"]), _fmt(row["prefill_ms"] if row else None),
            _fmt(row["ttft_ms"] if row else None)))
        if row is None:
            continue  # the benchmark can lose its last sample (see _check_workload)
        assert row["turn_index"] == truth["turn_index"], (row, truth)
        # The proxy's HIT is the offer prefill got: a HIT exactly where prefill decided on an
        # offer, a MISS (or no id) where it got none.
        assert (row["router_lookup"] == semconv.ROUTER_HIT) == (
            truth["decision"] != semconv.DECISION_NO_OFFER), (row, truth)
        # The proxy's prefill leg holds the server's own time; the client's TTFT holds the leg.
        assert truth["prefill_server_ms"] - ROUNDING_MS <= row["prefill_ms"] <= (
            truth["prefill_server_ms"] + PREFILL_OVERHEAD_MS), (row, truth)
        assert row["ttft_ms"] >= row["prefill_ms"] - ROUNDING_MS, row
        if row["outcome"] == outcomes.UNKNOWN:
            assert "not observed" in row["evidence"], row
    table = _table(lines)
    with capsys.disabled():
        print(f"\n[{case}] ledger from the stats JSON + vLLM proxy log vs the emulator's truth\n"
              + table)
    assert "DISAGREES" not in verdicts, table
    later = [v for v, t in zip(verdicts, sorted(run.truth, key=lambda t: (
        t["turn_index"], t["x_request_id"])), strict=True) if t["turn_index"] >= 2]
    assert len(later) == LATER_TURNS
    if case == "bidir_on":
        # Every later turn was pulled; the sources show only the router's hit.
        assert {r["outcome"] for r in run.later} == {outcomes.REUSED_REMOTE}
        assert later.count("unknown (engine evidence not in the sources)") >= LATER_TURNS - 1
    elif case == "bidir_off":
        assert later.count("agrees") >= LATER_TURNS - 1
    else:
        assert verdicts.count("more specific (proxy: no conversation id)") >= (
            len(run.truth) - 1)
    assert verdicts[:CONVERSATIONS] != ["not ingested"] * CONVERSATIONS

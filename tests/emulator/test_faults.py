"""Each fault, switched on for one turn, produces its miss cause in the ground truth."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvscope import semconv
from kvscope.cli import build_parser
from kvscope.cli.emulator import config_from_args
from kvscope.emulator import faults
from kvscope.emulator.faults import FaultMix, parse_fault, turn_key
from kvscope.emulator.ground_truth import TruthRow
from kvscope.emulator.launcher import EmulatedCluster
from kvscope.emulator.servers import EmulatorConfig
from kvscope.errors import SettingError
from kvscope.reuse import outcomes

MODEL = "kvscope-emulated"
_conversations = itertools.count()


def _config(**overrides: Any) -> EmulatorConfig:
    # Policy recompute (vLLM's default is fail, the emulator's too): each failed read then
    # shows the stall it causes; load_failure_policy_fail switches a turn back to fail.
    base: dict[str, Any] = dict(time_scale=50.0, prefill_prefix_caching=False,
                                stall_timeout_s=0.2, allow_fault_headers=True,
                                kv_load_failure_policy="recompute")
    base.update(overrides)
    return EmulatorConfig(**base)


@pytest.fixture(scope="module")
def cluster() -> Iterator[EmulatedCluster]:
    with EmulatedCluster(_config(), proxy=True) as c:
        yield c


def _turn(url: str, cid: str, messages: list[dict[str, str]], fault: list[str]) -> httpx.Response:
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 80,
                            "ignore_eos": True, "stream": False, "conversation_id": cid}
    if fault:
        body[faults.FAULT_BODY_FIELD] = fault
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=30)


def two_turns(cluster: EmulatedCluster, turn1: list[str] = (),  # type: ignore[assignment]
              turn2: list[str] = ()) -> tuple[TruthRow, httpx.Response]:  # type: ignore[assignment]
    """Run one two-turn conversation through the proxy; return turn 2's truth and response."""
    assert cluster.proxy_url is not None and cluster.emulation is not None
    n = next(_conversations)
    cid = f"conv-{n}"
    messages = [{"role": "system", "content": f"you are agent {n} " + "rules " * 120},
                {"role": "user", "content": f"task {n}"}]
    first = _turn(cluster.proxy_url, cid, messages, list(turn1))
    assert first.status_code == 200
    reply = first.json()["choices"][0]["message"]["content"]
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "go on"}]
    second = _turn(cluster.proxy_url, cid, messages, list(turn2))
    row = cluster.emulation.truth.rows[-1]
    assert row.turn_index == 2
    return row, second


def test_no_fault_reuses_remote(cluster: EmulatedCluster) -> None:
    row, resp = two_turns(cluster)
    assert resp.status_code == 200
    assert row.outcome == outcomes.REUSED_REMOTE and row.decision == semconv.DECISION_PULL
    # Length-capped (ignore_eos, max_tokens): even the async scheduler skips the step that
    # would compute the last token, so D holds and offers one token less than prompt + output,
    # and reusable tokens count what D holds (the ledger's definition): all of them were pulled.
    assert row.remote_reused_tokens == row.reusable_tokens
    assert row.transfer_status == semconv.TRANSFER_OK and row.transfer_bytes > 0


@pytest.mark.parametrize(
    ("turn1", "turn2", "outcome", "status"),
    [
        ([faults.DECODE_NO_BIDIR], [], outcomes.NO_DECODE_METADATA, 200),
        ([faults.STRIP_STREAM_METADATA], [], outcomes.NO_DECODE_METADATA, 200),
        # A failed read under policy recompute re-runs the decision with the read already
        # processed: in 0.33.0 the request parks again and stalls (see reuse_model), which the
        # emulator answers with 500 after stall_timeout_s, and the proxy with 502.
        ([faults.EXPIRE_BEFORE_NEXT_TURN], [], outcomes.LOAD_STALLED, 502),
        ([], [faults.PREFILL_NO_BIDIR], outcomes.PREFILL_BIDIR_DISABLED, 502),
        ([], [faults.INVALID_PARAMS], outcomes.INVALID_PARAMS, 200),
        ([], [faults.HANDSHAKE_FAIL], outcomes.LOAD_STALLED, 502),
        ([], [faults.TRANSFER_FAIL], outcomes.LOAD_STALLED, 502),
        ([], [faults.CLOCK_SKEW], outcomes.LOAD_STALLED, 502),
        ([], [faults.PREEMPT_AFTER_READ], outcomes.PREEMPTED, 502),
        ([], [faults.TRANSFER_FAIL, faults.LOAD_FAILURE_POLICY_FAIL],
         outcomes.LOAD_FAILED_ERRORED, 502),
    ],
)
def test_each_fault_gives_its_outcome(
    cluster: EmulatedCluster, turn1: list[str], turn2: list[str], outcome: str, status: int
) -> None:
    row, resp = two_turns(cluster, turn1, turn2)
    assert (row.outcome, resp.status_code) == (outcome, status), row.evidence
    assert row.remote_reused_tokens == 0
    assert row.recomputed_reusable_tokens == row.reusable_tokens > 0
    assert set(turn2) <= set(row.faults)


def test_stripped_metadata_leaves_blocks_pinned_unread(cluster: EmulatedCluster) -> None:
    assert cluster.emulation is not None
    two_turns(cluster, [faults.STRIP_STREAM_METADATA])
    decode = cluster.emulation.decode_nodes[0].node
    # D kept the blocks (request_finished ran) although nobody could learn their address.
    assert any(r.release_reason == semconv.RELEASE_OPEN for r in decode.handles.values())


def test_evicted_prefix_cache_moves_reuse_from_local_to_remote() -> None:
    with EmulatedCluster(_config(prefill_prefix_caching=True), proxy=True) as c:
        kept, _ = two_turns(c)
        evicted, _ = two_turns(c, [], [faults.EVICT_PREFIX_CACHE])
    assert kept.local_hit_tokens > 0 and evicted.local_hit_tokens == 0
    assert evicted.remote_reused_tokens > kept.remote_reused_tokens
    assert evicted.outcome == kept.outcome == outcomes.REUSED_REMOTE


def test_fault_fields_are_ignored_unless_allowed() -> None:
    with EmulatedCluster(_config(allow_fault_headers=False), proxy=True) as c:
        row, _ = two_turns(c, [], [faults.TRANSFER_FAIL])
    assert row.outcome == outcomes.REUSED_REMOTE and row.faults == []


def test_cli_flag_switches_a_fault_for_every_turn() -> None:
    args = build_parser().parse_args(["emulate", "--fault", "handshake_fail", "--time-scale",
                                      "50", "--no-enable-prefix-caching"])
    config = config_from_args(args)
    assert config.faults.describe() == {faults.HANDSHAKE_FAIL: 1.0}
    # vLLM's default policy, the emulator's too: the failed read ends the request in error.
    assert config.kv_load_failure_policy == "fail"
    with EmulatedCluster(config, proxy=True) as c:
        row, _ = two_turns(c)
    assert row.outcome == outcomes.LOAD_FAILED_ERRORED


def test_mix_is_deterministic_under_seed_and_honours_probability() -> None:
    keys = [turn_key([i, i * 7]) for i in range(400)]
    mix = FaultMix({faults.TRANSFER_FAIL: 0.5, faults.DECODE_NO_BIDIR: 0.25}, seed=3)
    drawn = [mix.draw(k, faults.LEG_PREFILL) for k in keys]
    assert drawn == [FaultMix(dict(mix.probabilities), seed=3).draw(k, faults.LEG_PREFILL)
                     for k in keys]
    hits = sum(faults.TRANSFER_FAIL in d for d in drawn)
    assert 150 < hits < 250
    assert all(faults.DECODE_NO_BIDIR not in d for d in drawn)  # a decode-leg fault
    decode_hits = sum(faults.DECODE_NO_BIDIR in mix.draw(k, faults.LEG_DECODE) for k in keys)
    assert 60 < decode_hits < 140
    other = [FaultMix(dict(mix.probabilities), seed=4).draw(k, faults.LEG_PREFILL) for k in keys]
    assert other != drawn


def test_parse_fault_names_probabilities_and_errors() -> None:
    assert parse_fault("transfer_fail") == ("transfer_fail", 1.0)
    assert parse_fault("clock_skew=0.25") == ("clock_skew", 0.25)
    with pytest.raises(SettingError, match="unknown fault 'nope'"):
        parse_fault("nope")
    with pytest.raises(SettingError, match="between 0 and 1"):
        parse_fault("transfer_fail=2")
    with pytest.raises(SettingError, match="not a number"):
        parse_fault("transfer_fail=x")
    assert faults.names_in("transfer_fail, nope,clock_skew") == {"transfer_fail", "clock_skew"}
    assert faults.names_in(None) == frozenset()


def test_async_scheduling_flag_sets_what_decode_offers() -> None:
    """``--async-scheduling`` (default) / ``--no-async-scheduling`` reach the engines' config
    (what each offers is tested on the model: test_reuse_model)."""
    assert config_from_args(build_parser().parse_args(["emulate"])).scheduling == "async"
    sync = config_from_args(build_parser().parse_args(["emulate", "--no-async-scheduling"]))
    assert sync.scheduling == "sync"
    from kvscope.emulator.servers import Emulation

    decode = Emulation(sync).add_decode().node  # the engine the flag reaches
    assert decode.config.scheduling == "sync"


@pytest.mark.parametrize(("queued_wall_s", "status"), [(0.0, semconv.TRANSFER_OK),
                                                       (1.0, semconv.TRANSFER_DECLINED_EXPIRED)])
def test_time_queued_at_prefill_eats_the_expiry_margin(queued_wall_s: float,
                                                        status: str) -> None:
    """The deadline is checked when prefill takes the request up (vLLM's start_load_kv), not
    when it arrives: an offer good on arrival is declined after queueing behind other work.

    TTL 40 model seconds at time scale 50: read at once (within 0.7 wall seconds of turn 1's
    end, room for a slow machine), 40 > 5 s of margin; queued 1 wall second (50 model seconds)
    behind a busy prefill, 50 + 5 ≥ 40.
    """
    import asyncio
    import threading

    with EmulatedCluster(_config(decoder_kv_blocks_ttl=40.0), proxy=True) as c:
        assert c.proxy_url is not None and c.emulation is not None and c._loop is not None
        lock = c.emulation.prefill_nodes[0].compute_lock
        n = next(_conversations)
        messages = [{"role": "system", "content": f"agent {n} " + "rules " * 120},
                    {"role": "user", "content": f"task {n}"}]
        first = _turn(c.proxy_url, f"q-{n}", messages, [])
        reply = first.json()["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "go"}]
        if queued_wall_s:
            asyncio.run_coroutine_threadsafe(lock.acquire(), c._loop).result(5)
            threading.Timer(queued_wall_s,
                            lambda: c._loop.call_soon_threadsafe(lock.release)).start()
        _turn(c.proxy_url, f"q-{n}", messages, [])
        row = c.emulation.truth.rows[-1]
    assert row.turn_index == 2 and row.transfer_status == status, row

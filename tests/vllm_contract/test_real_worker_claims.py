"""Claims about vLLM 0.33.0's real NIXL pull worker, checked with real READs over UCX on CPU.

Each test drives the real ``NixlConnector`` scheduler and worker roles of a prefill (P) and a
decode (D) engine built by ``tests/vllm_contract/test_worker.py`` (same process, CPU KV caches
registered with NIXL's UCX backend) and asserts what vLLM actually does. Each docstring states
the claim, the verdict, and the vLLM code responsible (paths relative to
``vllm/distributed/kv_transfer/kv_connector/v1/nixl/``, line numbers of vLLM 0.33.0).

D's finished turn is set up the way D's scheduler sees a P→D request: ``update_state_after_alloc``
(it joins ``reqs_in_batch``, so D's worker tracks the lease) then ``request_finished`` (the lease
and the offer with ``remote_blocks_expiry_time``); one D step hands the lease to D's worker.
D's block ``i`` of the turn holds the value ``i + 1`` in every element, so a P block's value
names the D block it came from.

vLLM's logging config may stop its ``vllm`` logger from propagating to the root logger, so
``vllm_log`` then attaches pytest's ``caplog`` handler to the ``vllm`` logger.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from queue import Queue
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.v1.request import Request

from kvscope import semconv
from kvscope.collector.ingest import server_log
from tests.vllm_contract.test_server_log_lines import write_vllm_log
from tests.vllm_contract.test_worker import (  # the module-scoped engines fixture, reused
    BLOCK,
    Engine,
    blocks,
    engines,  # noqa: F401  (fixture)
    finish,
    free_port,
    request,
    schedule,
)

NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"

Engines = tuple[Engine, Engine]


@pytest.fixture
def vllm_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """caplog, also fed by the ``vllm`` logger when vLLM's logging config stops propagation."""
    logger = logging.getLogger("vllm")
    attach = not logger.propagate
    if attach:
        logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        if attach:
            logger.removeHandler(caplog.handler)


def records(caplog: pytest.LogCaptureFixture, needle: str) -> list[logging.LogRecord]:
    unique = {id(r): r for r in caplog.records}  # one record per emission
    return [r for r in unique.values() if needle in r.getMessage()]


def messages(caplog: pytest.LogCaptureFixture, needle: str) -> list[str]:
    return [r.getMessage() for r in records(caplog, needle)]


def step(engine: Engine) -> Any:
    """One model-runner step; returns the worker's KVConnectorTransferResults."""
    return engine.step_with(lambda worker: worker.get_transfer_results(set()))


def step_until(condition: Callable[[], bool], *engines_: Engine, on: Callable[[Engine, Any], None],
               timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        for engine in engines_:
            on(engine, step(engine))
        time.sleep(0.01)


def pin_on_d(d: Engine, req_id: str, d_blocks: list[int], computed: int) -> dict[str, Any]:
    """D finishes a turn in ``d_blocks`` (block i holds i + 1) and offers it; P's params back."""
    for i, block in enumerate(d_blocks):
        d.fill([block], float(i + 1))
    req = request(req_id, 96, {"do_remote_prefill": True})
    d.nixl.update_state_after_alloc(req, blocks(d_blocks), 0)
    offer = finish(d, req, d_blocks, computed)
    step(d)  # D's worker takes the lease (reqs_in_batch + reqs_to_send)
    assert req_id in d.worker.connector_worker._reqs_to_send
    offer.update(do_remote_decode=True, do_remote_prefill=False)  # what the router forwards
    return offer


class Results:
    """Everything the two workers reported, by kind."""

    def __init__(self) -> None:
        self.seen: dict[str, dict[str, set[str]]] = {}

    def __call__(self, engine: Engine, results: Any) -> None:
        kinds = self.seen.setdefault(engine.nixl.engine_id, {"sending": set(), "recving": set(),
                                                              "failed": set()})
        kinds["sending"] |= set(results.finished_sending or ())
        kinds["recving"] |= set(results.finished_recving or ())
        kinds["failed"] |= set(results.failed_recving or ())

    def of(self, engine: Engine, kind: str) -> set[str]:
        return self.seen.get(engine.nixl.engine_id, {}).get(kind, set())


def read_d_to_p(p: Engine, d: Engine, p_req: str, d_req: str) -> Results:
    """Step P alone until its READ completes, then D until it releases on P's notification."""
    seen = Results()
    step_until(lambda: p_req in seen.of(p, "recving"), p, on=seen)
    assert p_req not in seen.of(p, "failed")
    # The READ is complete on P, yet D still holds the blocks: only the notification releases.
    assert d_req in d.worker.connector_worker._reqs_to_send
    step_until(lambda: d_req in seen.of(d, "sending"), d, on=seen)
    assert d_req not in d.worker.connector_worker._reqs_to_send
    return seen


def spy_prefix_caching(p: Engine, monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, Any]]:
    """Record ``_apply_prefix_caching``'s (local, remote) block lists as it returns them."""
    worker = p.worker.connector_worker
    original = worker._apply_prefix_caching
    calls: list[tuple[Any, Any]] = []

    def spy(**kwargs: Any) -> Any:
        local, remote = original(**kwargs)
        calls.append(([list(g) for g in kwargs["decode_block_ids"]],
                      [list(g) for g in kwargs["prefill_block_ids"]]))
        calls.append(([list(g) for g in local], [list(g) for g in remote]))
        return local, remote

    monkeypatch.setattr(worker, "_apply_prefix_caching", spy)
    return calls


def test_claim1_shorter_prompt_reads_the_last_d_blocks_into_p(
    engines: Engines, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """Claim 1, CONFIRMED: a shorter P prompt gets D's LAST blocks, misaligned.

    D holds a finished turn of 99 computed tokens in blocks [1, 2, 3, 4] (values 1-4). P's new
    prompt has 64 tokens: ``pull_scheduler.py:NixlPullConnectorScheduler.
    get_num_new_matched_tokens`` (lines 85-103) returns min(99, 64) - 0 = 64, so P allocates
    2 blocks [1, 2]. The worker (``pull_worker.py:_read_blocks`` line 485) passes P's 2 local
    blocks and D's 4 remote blocks to ``base_worker.py:_apply_prefix_caching``, which end-trims
    the remote list (line 3793: ``prefill_group[-num_decode_blocks:]``) to [3, 4].
    Measured after the real READ: D block 3 (value 3, tokens 64-95) → P block 1 (P's tokens
    0-31), D block 4 (value 4, tokens 96-98, the partial last block) → P block 2 (tokens 32-63);
    D blocks 1 and 2 (the actual prefix) are never read. The READ reports success.
    """
    p, d = engines
    calls = spy_prefix_caching(p, monkeypatch)
    offer = pin_on_d(d, "c1-d", [1, 2, 3, 4], computed=99)
    assert d.values([1, 2, 3, 4]) == [1.0, 2.0, 3.0, 4.0]
    p.fill([1, 2], 0.0)
    assert schedule(p, request("c1-p", 64, offer), [1, 2]) == 64

    read_d_to_p(p, d, "c1-p", "c1-d")

    assert calls == [([[1, 2]], [[1, 2, 3, 4]]), ([[1, 2]], [[3, 4]])]
    assert p.values([1, 2]) == [3.0, 4.0]  # D's 3rd and 4th blocks, not its 1st and 2nd
    d_blocks = [1, 2, 3, 4]
    mapping = {d_blocks[int(value) - 1]: p_block
               for p_block, value in zip([1, 2], p.values([1, 2]), strict=True)}
    assert mapping == {3: 1, 4: 2}
    # kvscope's rule (kvscope.reuse.validity) places the read the same way: P's positions 0-1
    # get D's blocks 2-3 (0-based), a shift of 2 blocks, so every loaded token is invalid.
    from kvscope.reuse.validity import INVALID_MISALIGNED, invalid_tokens, loaded_span

    span = loaded_span(0, 64, 99, BLOCK)
    assert (span.first_p_block, span.first_d_block, span.blocks) == (0, 2, 2)
    assert invalid_tokens(0, 64, 99, 0, BLOCK) == (64, INVALID_MISALIGNED)


def test_claim2_same_length_edited_prompt_reads_d_blocks_regardless_of_content(
    engines: Engines, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """Claim 2, CONFIRMED: the pull is decided by counts only; token contents are never compared.

    D's turn was prompt tokens 1..96 (+3 generated, 99 computed) in blocks [5, 6, 7, 8]. P's
    prompt has the same length (99 tokens) but entirely different tokens (400..498). In
    ``pull_scheduler.py:get_num_new_matched_tokens`` (lines 67-103) only
    ``remote_num_tokens`` and ``request.num_prompt_tokens`` are used, so the edited prompt and
    the original-content prompt both get 99 tokens; ``pull_worker.py:_read_blocks_for_req`` /
    ``_read_blocks`` never see tokens or hashes. After the real READ, P's blocks [3, 4, 5, 6]
    hold D's blocks [5, 6, 7, 8] one to one (values 1, 2, 3, 4).
    """
    p, d = engines
    calls = spy_prefix_caching(p, monkeypatch)
    offer = pin_on_d(d, "c2-d", [5, 6, 7, 8], computed=99)
    edited = Request("c2-p", list(range(400, 499)), SamplingParams(max_tokens=4), None)
    edited.kv_transfer_params = dict(offer)
    original = request("c2-p-original", 99, dict(offer))
    assert original.prompt_token_ids != edited.prompt_token_ids
    assert len(original.prompt_token_ids) == len(edited.prompt_token_ids) == 99
    assert p.nixl.get_num_new_matched_tokens(original, 0) == (99, True)
    p.fill([3, 4, 5, 6], 0.0)
    assert schedule(p, edited, [3, 4, 5, 6]) == 99

    read_d_to_p(p, d, "c2-p", "c2-d")

    assert calls[-1] == ([[3, 4, 5, 6]], [[5, 6, 7, 8]])
    assert p.values([3, 4, 5, 6]) == [1.0, 2.0, 3.0, 4.0]


def containers(worker: Any) -> dict[str, int]:
    """Sizes of every container attribute of the worker (dicts, sets, lists, queues)."""
    sizes = {}
    for name, value in vars(worker).items():
        if isinstance(value, (dict, set, list)):
            sizes[name] = len(value)
        elif isinstance(value, Queue):
            sizes[name] = value.qsize()
    return sizes


def test_claim3_notify_only_with_failed_handshake_is_dropped(
    engines: Engines, vllm_log: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    """Claim 3, CONFIRMED (and no failure-tracking entry is leaked in 0.33.0).

    The offer names an unreachable D ("ghost-decode", nothing listens on its port) and 40
    remote tokens, below ``kv_recompute_threshold`` 64: ``pull_scheduler.py:
    get_num_new_matched_tokens`` returns (0, False) (lines 90-102) and
    ``update_state_after_alloc`` queues a notify-only recv with ``local_block_ids == ()`` and
    ``awaiting_kvs`` False (lines 145-177). ``pull_worker.py:start_load_kv`` (lines 75-76)
    does not put it in ``_recving_metadata``; ``_read_blocks_for_req`` (line 154) starts the
    background handshake, which times out (5 s ZMQ RCVTIMEO, ``base_worker.py:_nixl_handshake``
    lines 1160-1164). ``base_worker.py:_ensure_handshake`` logs ``handshake_setup_failed`` and
    ``_background_nixl_handshake.request_ready`` logs ``handshake_failed`` and queues the
    request on ``_failed_recv_reqs`` (lines 1470-1477); ``get_transfer_results`` moves it into
    ``_recv_failures`` then drops it because it is not in ``_recving_metadata`` (lines
    3209-3223): not in ``finished_recving``/``failed_recving``, no invalid blocks.
    ``_log_failure`` (lines 1335-1383) only logs; there is no ``read_failures`` attribute in
    0.33.0, and no failure-tracking container of the worker grows (the failure set
    ``_recv_failures`` and queue ``_failed_recv_reqs`` end empty; ``_failed_remote_engines``,
    ``_invalid_remote_engines``, ``_remote_agents``, ``_handshake_futures`` hold nothing for the
    ghost). The only container that grows is ``_reqs_to_process`` (+1, "c3-p"): P's producer-side
    tracking of any ``do_remote_decode`` request (``update_state_after_alloc`` line 125 →
    ``start_load_kv`` lines 97-98), released by D's notification or the lease reaper once the
    request finishes, unrelated to the failure. ``xfer_stats.data["num_failed_handshakes"]``
    gains one entry, a stats buffer the engine drains each step via ``get_kv_connector_stats``.
    D, were it alive, would get no notification and hold its blocks until its TTL.
    """
    p, _ = engines
    worker = p.worker.connector_worker
    assert not hasattr(worker, "read_failures")
    offer = dict(do_remote_decode=True, do_remote_prefill=False, remote_block_ids=([20, 21],),
                 remote_engine_id="ghost-decode", remote_request_id="ghost-d",
                 remote_host="127.0.0.1", remote_port=free_port(), tp_size=1, dcp_size=1,
                 pp_size=1, remote_num_tokens=40,
                 remote_blocks_expiry_time=time.perf_counter() + 400.0,
                 remote_registration_generation=0, transfer_mode="pull")
    req = request("c3-p", 140, offer)
    assert p.nixl.get_num_new_matched_tokens(req, 0) == (0, False)
    step(p)  # settle anything a previous test left to report
    before = containers(worker)
    stats_before = len(worker.xfer_stats.data.get("num_failed_handshakes", []))

    assert schedule(p, req, [7, 8, 9, 10, 11]) == 0  # P computes the prompt itself
    seen = Results()
    results = step(p)
    seen(p, results)
    assert "c3-p" not in worker._recving_metadata  # notify-only: nothing is awaited
    step_until(lambda: bool(messages(vllm_log, "handshake_failed")) and
               worker._failed_recv_reqs.empty() and not worker._recv_failures, p, on=seen)
    seen(p, step(p))

    assert "c3-p" not in seen.of(p, "recving") | seen.of(p, "failed")
    assert p.worker.get_block_ids_with_load_errors() == set()
    [setup_failed] = messages(vllm_log, "handshake_setup_failed")
    assert "'remote_engine_id': 'ghost-decode'" in setup_failed
    [failed] = messages(vllm_log, "NIXL transfer failure: handshake_failed |")
    assert "'request_id': 'c3-p'" in failed
    after = containers(worker)
    grown = {k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)}
    # The only growth is P's own producer-side tracking of the new request (it will offer its
    # turn to D when it finishes), not failure bookkeeping.
    assert grown == {"_reqs_to_process": 1}, grown
    assert "c3-p" in worker._reqs_to_process
    assert not worker._recv_failures and worker._failed_recv_reqs.empty()
    assert "ghost-decode" not in worker._remote_agents
    assert "ghost-decode" not in worker._handshake_futures
    assert "ghost-decode" not in worker._failed_remote_engines | worker._invalid_remote_engines
    assert len(worker.xfer_stats.data["num_failed_handshakes"]) == stats_before + 1


def test_claim4_expiry_is_checked_at_read_time_after_the_handshake(
    engines: Engines, vllm_log: pytest.LogCaptureFixture,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """Claim 4, CONFIRMED: the expiry check runs when the READ would be posted, after a handshake.

    ``pull_scheduler.py:get_num_new_matched_tokens`` never reads ``remote_blocks_expiry_time``
    (the offer is accepted with 99 tokens at arrival). The check is
    ``pull_worker.py:_is_turn2_read_expired`` (lines 127-136: ``perf_counter() + 5.0 >=
    expiry - clock_offset``, margin ``_KV_BLOCKS_EXPIRY_SAFETY_MARGIN`` line 33), called from
    ``_read_blocks_for_req`` (line 160) only after the ``engine_id not in _remote_agents``
    branch has handed the request to the background handshake (line 152-155); it re-enters
    from ``_ready_requests`` in ``start_load_kv`` (lines 80-81). Here P forgets D's agent and
    its handshake is slowed by 1.5 s; the offer's deadline is margin + 1.0 s away at arrival
    and at the first ``start_load_kv``, so it is only inside the margin when the handshake has
    finished: P logs "Declining expired remote read for c4-p from engine decode-engine." and
    reports the request in ``failed_recving`` with its blocks as load errors; nothing is read,
    and D (never notified) keeps its blocks until its own TTL.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import pull_worker

    p, d = engines
    worker = p.worker.connector_worker
    offer = pin_on_d(d, "c4-d", [9, 10, 11, 12], computed=99)
    margin = pull_worker._KV_BLOCKS_EXPIRY_SAFETY_MARGIN
    assert margin == 5.0
    offer["remote_blocks_expiry_time"] = time.perf_counter() + margin + 1.0
    # P forgets D (as its stale-engine eviction would) and the new handshake takes 1.5 s.
    worker._cleanup_remote_engine("decode-engine", log_eviction=False)
    handshake = worker._nixl_handshake

    def slow_handshake(*args: Any, **kwargs: Any) -> Any:
        time.sleep(1.5)
        return handshake(*args, **kwargs)

    monkeypatch.setattr(worker, "_nixl_handshake", slow_handshake)
    p.fill([12, 13, 14, 15], 0.0)
    req = request("c4-p", 140, offer)
    assert schedule(p, req, [12, 13, 14, 15]) == 99  # accepted at arrival
    assert time.perf_counter() + margin < offer["remote_blocks_expiry_time"]  # not expired yet
    expired_before = len(worker.xfer_stats.data.get("num_kv_expired_reqs", []))
    seen = Results()
    seen(p, step(p))  # start_load_kv: handshake started, no expiry check yet
    assert not messages(vllm_log, "Declining expired remote read")
    assert time.perf_counter() + margin < offer["remote_blocks_expiry_time"]
    step_until(lambda: "c4-p" in seen.of(p, "recving"), p, on=seen)

    assert "decode-engine" in worker._remote_agents  # the handshake did complete
    assert messages(vllm_log, "Declining expired remote read") == [
        "Declining expired remote read for c4-p from engine decode-engine."]
    assert "c4-p" in seen.of(p, "failed")
    # The decline is counted where the TTL reaper's releases are (pull_worker.py:166,
    # record_kv_expired_req): kvscope's release reason must not read it as a reaped send.
    assert len(worker.xfer_stats.data.get("num_kv_expired_reqs", [])) == expired_before + 1
    assert p.worker.get_block_ids_with_load_errors() == {12, 13, 14, 15}
    assert p.values([12, 13, 14, 15]) == [0.0] * 4
    assert "c4-d" in d.worker.connector_worker._reqs_to_send  # D was not notified
    # kvscope ingest reads the line as vLLM's handler writes it: a declined D->P read.
    log = server_log.read_prefill(write_vllm_log(
        tmp_path / "prefill.log", records(vllm_log, "Declining expired remote read")))
    assert [(e.request_id, e.what, e.remote_engine_id) for e in log.events] == [
        ("c4-p", semconv.TRANSFER_DECLINED_EXPIRED, "decode-engine")]


def test_claim5_ttl_reaper_before_the_notification_p_succeeds_d_logs_invalid(
    engines: Engines, vllm_log: pytest.LogCaptureFixture,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """Claim 5, CONFIRMED for the reaper-before-notification order (the in-flight race is not
    deterministic here; see below).

    D's lease is released by P's notification (``pull_worker.py:_get_new_notifs`` lines
    669-700, checked in claims 1/2: P's READ completes while D still holds the lease) or by the
    reaper ``base_worker.py:_reap_expired_send_leases`` (lines 3352-3378, warning "Releasing
    expired KV blocks for request %s which were retrieved by %d remote worker(s) before lease
    expired."). D's TTL is 1 s here (``decoder_kv_blocks_ttl`` on D's scheduler) and the router
    does not forward the deadline (``remote_blocks_expiry_time`` None: ``_is_turn2_read_expired``
    reads as usual, lines 131-133 — a forwarded deadline would make P decline, claim 4). P
    accepts the offer; D's reaper frees the blocks before P's READ; D's scheduler reuses them
    (value 9 written). P's READ still succeeds (``finished_recving``, not ``failed_recving``, no
    load errors) and P holds the reused content. When the notification arrives D logs at ERROR
    (``pull_worker.py:_get_new_notifs`` lines 674-681): "Potentially invalid KV blocks for
    unrecognized request c5-d were retrieved by a decode worker. They may have expired."
    In-flight order: ``get_transfer_results`` runs ``_get_new_notifs`` (line 3198) before the
    reaper (line 3323), so a notification already delivered when D polls wins; the reaper only
    wins while the notification has not arrived, which UCX timing decides (not driven here).
    """
    p, d = engines
    monkeypatch.setattr(d.nixl, "decoder_kv_blocks_ttl", 1.0)
    offer = pin_on_d(d, "c5-d", [13, 14, 15, 16], computed=99)
    offer["remote_blocks_expiry_time"] = None
    p.fill([16, 17, 18, 19], 0.0)
    assert schedule(p, request("c5-p", 140, offer), [16, 17, 18, 19]) == 99
    time.sleep(1.1)
    seen = Results()
    seen(d, step(d))  # D's reaper runs before P has posted its READ
    assert "c5-d" in seen.of(d, "sending")
    assert "c5-d" not in d.worker.connector_worker._reqs_to_send
    assert messages(vllm_log, "Releasing expired KV blocks") == [
        "Releasing expired KV blocks for request c5-d which were retrieved by 0 remote "
        "worker(s) before lease expired."]
    d.fill([13, 14, 15, 16], 9.0)  # D's scheduler freed the blocks; a new request wrote them

    step_until(lambda: "c5-p" in seen.of(p, "recving"), p, on=seen)
    assert "c5-p" not in seen.of(p, "failed")
    assert p.worker.get_block_ids_with_load_errors() == set()
    assert p.values([16, 17, 18, 19]) == [9.0] * 4  # not the turn's KV (1, 2, 3, 4)

    needle = "Potentially invalid KV blocks"
    step_until(lambda: bool(messages(vllm_log, needle)), d, on=seen)
    [record] = records(vllm_log, needle)
    assert record.levelno == logging.ERROR
    assert record.name == f"{NIXL}.pull_worker"
    assert record.getMessage() == (
        "Potentially invalid KV blocks for unrecognized request c5-d were retrieved by a "
        "decode worker. They may have expired.")
    assert seen.of(d, "sending") == {"c5-d"}  # reported once, by the reaper
    # kvscope ingest reads both lines as vLLM's handler writes them: counted with the run.
    log = server_log.read_decode(write_vllm_log(
        tmp_path / "decode.log",
        records(vllm_log, "Releasing expired KV blocks") + records(vllm_log, needle)))
    assert log.counts == {"released_expired_unread": 1, "potentially_invalid_kv_blocks": 1}
    assert log.invalid_block_reads == ["c5-d"] and log.unknown_lines == 0

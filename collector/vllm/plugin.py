"""vLLM general plugin: instrument the NIXL connector in every process vLLM loads plugins in.

vLLM calls the ``vllm.general_plugins`` entry points (``kvscope =
kvscope.collector.vllm.plugin:register``) once per process — front end, engine core, workers —
and only those named in ``VLLM_PLUGINS`` when it is set. :func:`register` is enabled by the
kvscope setting ``otlp_endpoint`` (``KVSCOPE_OTLP_ENDPOINT``): without it nothing is imported
and nothing changes. Engines are separate processes, so telemetry leaves over OTLP to
``kvscope serve`` (never into the DuckDB file directly); each role gets its own providers with
service name ``vllm-prefill`` or ``vllm-decode``, built when the first record of that role
appears, their resource naming the vLLM version and any hook not installed
(``kvscope.vllm.hooks_missing``). Which hooks installed, and which did not and why, is one line
in vLLM's own log (through vLLM's logger: kvscope's has no handler in a vLLM process).

:func:`register` is idempotent and never raises into vLLM: a failure to instrument is logged
once and vLLM runs unchanged.
"""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Any

from kvscope import semconv, settings

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "kvscope"
ENTRY_POINT = "kvscope.collector.vllm.plugin:register"

_lock = threading.Lock()
_outcome: bool | None = None  # None: not tried yet; True: instrumented; False: off or failed
_telemetries: list[Any] = []


def register(otlp_endpoint: str | None = None) -> None:
    """vLLM plugin entry point: instrument the NIXL connector when a destination is set."""
    try:
        enable(otlp_endpoint)
    except BaseException:  # noqa: B036 - nothing may escape into vLLM's plugin loader
        logger.warning("kvscope: vLLM instrumentation disabled", exc_info=True)


def enable(otlp_endpoint: str | None = None) -> bool:
    """Instrument once per process; return whether the hooks are installed. Never raises."""
    global _outcome
    with _lock:
        if _outcome is not None:
            return _outcome
        _outcome = False
        try:
            endpoint = settings.resolve("otlp_endpoint", otlp_endpoint or None)
        except Exception as exc:
            logger.warning("kvscope: vLLM instrumentation disabled: %s", exc)
            return False
        if not endpoint:
            logger.debug("kvscope: %s not set; vLLM instrumentation off",
                         settings.SETTINGS["otlp_endpoint"].env_var)
            return False
        try:
            from kvscope.collector.vllm.instrumentor import NixlConnectorInstrumentor

            instrumentor = NixlConnectorInstrumentor()
            installed = instrumentor.instrument(provider_factory=_otlp_factory(endpoint))
        except Exception as exc:
            _vllm_log().warning("kvscope: could not instrument vLLM's NIXL connector (%s: %s); "
                                "vLLM runs uninstrumented", type(exc).__name__, exc)
            return False
        if not installed:
            _vllm_log().warning("kvscope: no NIXL connector hook matches this vLLM (%s); vLLM "
                                "runs uninstrumented", "; ".join(
                                    f"{k}: {v}" for k, v in instrumentor.hooks_missing.items()))
            return False
        atexit.register(shutdown)
        _outcome = True
        _vllm_log().log(logging.WARNING if instrumentor.hooks_missing else logging.INFO,
                        "%s; exporting to %s", instrumentor.report(), endpoint)
        return True


def _vllm_log() -> logging.Logger:
    """vLLM's logger for kvscope's lines (configured by vLLM when it is imported)."""
    from kvscope.collector.vllm.instrumentor import vllm_logger

    return vllm_logger


def _otlp_factory(endpoint: str) -> Any:
    def providers(role: str) -> tuple[Any, Any]:
        from kvscope.collector.otel import setup_telemetry

        service = semconv.SERVICE_DECODE if role == semconv.ROLE_DECODE else semconv.SERVICE_PREFILL
        telemetry = setup_telemetry(service, otlp_endpoint=endpoint,
                                    resource_attributes=resource_attributes())
        _telemetries.append(telemetry)
        return telemetry.tracer_provider, telemetry.meter_provider

    return providers


def resource_attributes() -> dict[str, str]:
    """What this process's engine spans say about their instrumentation: the vLLM version and
    the hooks not installed (the evidence the ledger then names as missing)."""
    from kvscope.collector.vllm.instrumentor import NixlConnectorInstrumentor

    instrumentor = NixlConnectorInstrumentor()
    attrs: dict[str, str] = {}
    if instrumentor.vllm_version:
        attrs[semconv.VLLM_VERSION] = instrumentor.vllm_version
    if instrumentor.hooks_missing:
        attrs[semconv.HOOKS_MISSING] = ",".join(instrumentor.hooks_missing)
    return attrs


def shutdown() -> None:
    """Flush what the hooks recorded and close the exporters (at process exit)."""
    try:
        from kvscope.collector.vllm.instrumentor import NixlConnectorInstrumentor

        NixlConnectorInstrumentor().flush(5.0)
        for telemetry in _telemetries:
            telemetry.shutdown()
    except Exception:
        logger.debug("kvscope: shutdown of vLLM telemetry failed", exc_info=True)


def _reset_for_tests() -> None:
    """Forget the per-process outcome (tests load the plugin more than once)."""
    global _outcome
    with _lock:
        _outcome = None


__all__ = ["ENTRY_POINT", "ENTRY_POINT_GROUP", "PLUGIN_NAME", "enable", "register",
    "resource_attributes", "shutdown"]

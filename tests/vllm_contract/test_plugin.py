"""Loading through vLLM's real plugin loader and connector factory; export over OTLP/HTTP."""

from __future__ import annotations

import importlib.metadata
import io
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import vllm.plugins
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request

from kvscope import semconv
from kvscope.collector.vllm import plugin
from kvscope.collector.vllm.instrumentor import NixlConnectorInstrumentor
from tests.vllm_contract.conftest import kv_cache_config, vllm_config


def _wrapped() -> bool:
    method = NixlPullConnectorScheduler.__dict__.get("get_num_new_matched_tokens")
    return bool(getattr(method, "_kvscope_wrapper", False))


class OtlpSink:
    """A loopback OTLP/HTTP endpoint that keeps the decoded trace requests."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.got = threading.Event()
        self._loop_ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._loop_ready.wait(10)

    def _serve(self) -> None:
        import asyncio

        async def traces(request: web.Request) -> web.Response:
            message = ExportTraceServiceRequest()
            message.ParseFromString(await request.read())
            self.requests.append(message)
            self.got.set()
            return web.Response(body=b"", content_type="application/x-protobuf")

        async def metrics(_request: web.Request) -> web.Response:
            return web.Response(body=b"", content_type="application/x-protobuf")

        async def main() -> None:
            app = web.Application()
            app.router.add_post("/v1/traces", traces)
            app.router.add_post("/v1/metrics", metrics)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self._stop = asyncio.Event()
            self._loop_ready.set()
            await self._stop.wait()
            await runner.cleanup()

        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(main())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def spans(self) -> list[tuple[str, str, dict[str, Any]]]:
        out = []
        for message in self.requests:
            for rs in message.resource_spans:
                service = next(a.value.string_value for a in rs.resource.attributes
                               if a.key == "service.name")
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        attrs = {a.key: a.value for a in span.attributes}
                        out.append((service, span.name, attrs))
        return out


@pytest.fixture
def entry_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kvscope's vllm.general_plugins entry point, as the installed package will declare it."""
    installed = [ep for ep in importlib.metadata.entry_points(group=plugin.ENTRY_POINT_GROUP)
                 if ep.name == plugin.PLUGIN_NAME]
    if not installed:  # pyproject does not declare it yet: a dist-info stands in for it
        dist = tmp_path / "kvscope_vllm_plugin-0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: kvscope-vllm-plugin\nVersion: 0\n")
        (dist / "entry_points.txt").write_text(
            f"[{plugin.ENTRY_POINT_GROUP}]\n{plugin.PLUGIN_NAME} = {plugin.ENTRY_POINT}\n")
        monkeypatch.syspath_prepend(str(tmp_path))


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A process in which vLLM has not loaded plugins and kvscope has not instrumented."""
    NixlConnectorInstrumentor().uninstrument()
    plugin._reset_for_tests()
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.delenv("KVSCOPE_OTLP_ENDPOINT", raising=False)
    yield
    NixlConnectorInstrumentor().uninstrument()
    plugin._reset_for_tests()


@pytest.fixture
def vllm_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """caplog, also fed by the ``vllm`` logger (vLLM's logging config stops its propagation)."""
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        vllm_logger.removeHandler(caplog.handler)


@contextmanager
def vllm_configured_logging() -> Iterator[io.StringIO]:
    """vLLM's own logging set-up, as its API server and engine-core processes apply it
    (``vllm.logger.configure_logging``), its handler writing to a buffer; undone afterwards."""
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging

    vllm_logger = logging.getLogger("vllm")
    saved = (list(vllm_logger.handlers), vllm_logger.level, vllm_logger.propagate,
             logging.getLogRecordFactory())
    configure_logging(LoggingConfig(log_level="INFO", configure_logging=True))
    buffer = io.StringIO()
    for handler in vllm_logger.handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(buffer)
    try:
        yield buffer
    finally:
        vllm_logger.handlers[:] = saved[0]
        vllm_logger.setLevel(saved[1])
        vllm_logger.propagate = saved[2]
        logging.setLogRecordFactory(saved[3])


def _records(log: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """Each record once (a record can reach caplog's handler both on ``vllm`` and the root)."""
    return list({id(r): r for r in log.records}.values())


def _resource(sink: OtlpSink) -> dict[str, str]:
    """The resource attributes of the first exported spans."""
    rs = sink.requests[0].resource_spans[0]
    return {a.key: a.value.string_value for a in rs.resource.attributes}


@pytest.fixture
def sink() -> Iterator[OtlpSink]:
    s = OtlpSink()
    yield s
    s.close()


def _one_decision(connector: Any) -> None:
    req = Request("chatcmpl-plug", list(range(170)), SamplingParams(max_tokens=1), None)
    req.kv_transfer_params = {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_block_ids": [[1, 2]],
        "remote_engine_id": "d", "remote_request_id": "r", "remote_host": "127.0.0.1",
        "remote_port": 5600, "remote_num_tokens": 160}
    sched = connector.connector_scheduler
    count, _ = sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, KVCacheBlocks(([KVCacheBlock(1)],)), count)


def test_real_loader_instruments_and_spans_reach_an_otlp_endpoint(
    entry_point: None, fresh: None, sink: OtlpSink, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSCOPE_OTLP_ENDPOINT", f"http://127.0.0.1:{sink.port}")
    vllm.plugins.load_general_plugins()
    assert _wrapped()
    vllm.plugins.load_general_plugins()  # once per process: a second call is a no-op
    plugin.register()  # and the function itself is idempotent
    connector = KVConnectorFactory.create_connector(
        vllm_config("kv_producer"), KVConnectorRole.SCHEDULER, kv_cache_config())
    _one_decision(connector)
    plugin.shutdown()
    assert sink.got.wait(10)
    [(service, name, attrs)] = sink.spans()
    assert (service, name) == (semconv.SERVICE_PREFILL, semconv.SPAN_REUSE_DECISION)
    assert attrs[semconv.VLLM_REQUEST_ID].string_value == "chatcmpl-plug"
    assert attrs[semconv.TOKENS_TO_PULL].int_value == 160


def test_without_a_destination_the_plugin_does_nothing(entry_point: None, fresh: None) -> None:
    vllm.plugins.load_general_plugins()
    assert not _wrapped()


def test_vllm_plugins_allowlist_is_respected(
    entry_point: None, fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSCOPE_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin")
    vllm.plugins.load_general_plugins()
    assert not _wrapped()
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.setenv("VLLM_PLUGINS", f"some_other_plugin,{plugin.PLUGIN_NAME}")
    vllm.plugins.load_general_plugins()
    assert _wrapped()


def test_a_failure_to_instrument_logs_once_and_leaves_vllm_untouched(
    entry_point: None, fresh: None, monkeypatch: pytest.MonkeyPatch,
    vllm_log: pytest.LogCaptureFixture,
) -> None:
    def broken(*_: object, **__: object) -> bool:
        raise ImportError("no NIXL connector in this vLLM")

    monkeypatch.setattr(NixlConnectorInstrumentor, "instrument", broken)
    monkeypatch.setenv("KVSCOPE_OTLP_ENDPOINT", "http://127.0.0.1:9")
    vllm.plugins.load_general_plugins()  # must not raise
    plugin.register()
    assert not _wrapped()
    assert len([r for r in _records(vllm_log) if "could not instrument" in r.message]) == 1


def test_the_instrumented_line_reaches_vllms_log(
    entry_point: None, fresh: None, sink: OtlpSink, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through vLLM's own handler and format (kvscope's logger has none in a vLLM process)."""
    monkeypatch.setenv("KVSCOPE_OTLP_ENDPOINT", f"http://127.0.0.1:{sink.port}")
    with vllm_configured_logging() as out:
        vllm.plugins.load_general_plugins()
    [line] = [line for line in out.getvalue().splitlines() if "instrumented" in line]
    assert " INFO " in line and "[plugin.py:" in line  # vLLM's format
    assert f"on vLLM {vllm.__version__}: 9 hooks installed (" in line
    assert "NixlPullConnectorScheduler.request_finished" in line
    assert "NOT installed" not in line
    assert f"exporting to http://127.0.0.1:{sink.port}" in line
    assert NixlConnectorInstrumentor().hooks_missing == {}


def test_a_changed_signature_is_left_unhooked_and_named(
    entry_point: None, fresh: None, sink: OtlpSink, monkeypatch: pytest.MonkeyPatch,
    vllm_log: pytest.LogCaptureFixture,
) -> None:
    """A vLLM whose request_finished takes other parameters: that hook is not installed, the
    others are; vLLM's log and the spans' resource say which, and what it costs."""
    original = NixlPullConnectorScheduler.request_finished

    def request_finished(self: Any, req: Any, blocks: Any) -> Any:
        return original(self, req, blocks)

    monkeypatch.setattr(NixlPullConnectorScheduler, "request_finished", request_finished)
    monkeypatch.setenv("KVSCOPE_OTLP_ENDPOINT", f"http://127.0.0.1:{sink.port}")
    vllm.plugins.load_general_plugins()
    assert _wrapped()  # the other hooks are in
    assert not getattr(NixlPullConnectorScheduler.request_finished, "_kvscope_wrapper", False)
    missing = "NixlPullConnectorScheduler.request_finished"
    assert NixlConnectorInstrumentor().hooks_missing == {
        missing: "takes (req, blocks), not 0.33.0's (request, block_ids)"}
    warned = [r.getMessage() for r in _records(vllm_log) if r.levelno == logging.WARNING]
    assert any(missing in m and "decode's retentions" in m for m in warned)
    [line] = [m for m in warned if "instrumented on vLLM" in m]
    assert "8 hooks installed" in line and f"NOT installed: {missing} (takes (req, blocks)" in line
    connector = KVConnectorFactory.create_connector(
        vllm_config("kv_producer"), KVConnectorRole.SCHEDULER, kv_cache_config())
    _one_decision(connector)
    plugin.shutdown()
    assert sink.got.wait(10)
    resource = _resource(sink)
    assert resource[semconv.HOOKS_MISSING] == missing
    assert resource[semconv.VLLM_VERSION] == vllm.__version__


def test_explicit_connector_class_through_the_factory(
    fresh: None, sink: OtlpSink
) -> None:
    config = vllm_config("kv_producer")
    config.kv_transfer_config.kv_connector = "KvscopeNixlConnector"
    config.kv_transfer_config.kv_connector_module_path = "kvscope.collector.vllm.connector"
    config.kv_transfer_config.kv_connector_extra_config["kvscope_otlp_endpoint"] = (
        f"http://127.0.0.1:{sink.port}")
    connector = KVConnectorFactory.create_connector(
        config, KVConnectorRole.SCHEDULER, kv_cache_config())
    assert type(connector).__name__ == "KvscopeNixlConnector"
    assert _wrapped()
    _one_decision(connector)
    plugin.shutdown()
    assert sink.got.wait(10)
    assert [name for _, name, _ in sink.spans()] == [semconv.SPAN_REUSE_DECISION]

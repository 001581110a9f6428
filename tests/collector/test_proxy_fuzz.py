"""Fuzzing the proxy's request parsing: whatever a client sends, a 2xx or 4xx answer, no crash.

A real proxy on loopback (telemetry to a real store, the reuse guard on, so that every request's
messages are hashed on the request path too) in front of the upstream stubs, which answer 400 to
a body they cannot read as vLLM's request validation does. Hypothesis sends JSON bodies of odd
shapes (messages that are not lists of objects, roles and contents of every JSON type, lone
surrogates, deep nesting, huge numbers), conversation ids in the body and the ``X-Session-ID``
header, ``stream`` flags of every type, trace headers, and raw bytes that are not JSON at all.
Each answer must be below 500, the proxy must stay healthy, and its telemetry must not have failed.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvscope import semconv
from kvscope.collector.otel import setup_telemetry
from kvscope.collector.proxy.app import SERVER_OPTIONS, ProxyConfig, Upstream, build_app
from kvscope.collector.proxy.export_process import TurnExportProcess
from kvscope.collector.proxy.telemetry import ProxyTelemetry

sys.path.insert(0, str(Path(__file__).parent))
from upstream_stub import ServerThread, StubState, decode_app, prefill_app  # noqa: E402

ROUTES = ("/v1/chat/completions", "/v1/completions")

# JSON values of every type, strings with lone surrogates and control characters included.
text = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=40)
scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | text)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=12,
)
roles = st.sampled_from(["system", "user", "assistant", "tool", "", "\ud800", "Ω"]) | json_values
message = (
    st.fixed_dictionaries({"role": roles, "content": json_values | text})
    | st.fixed_dictionaries({}, optional={"role": roles, "content": json_values,
                                          "tool_calls": json_values, "name": json_values})
    | json_values
)
messages = st.lists(message, max_size=6) | json_values
conversation_ids = (st.none() | text | st.integers() | json_values
                    | st.text(min_size=300, max_size=600))
stream_flags = st.none() | st.booleans() | st.integers(-2, 2) | text | json_values

bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": json_values, "messages": messages, "prompt": json_values | text,
        "conversation_id": conversation_ids, "stream": stream_flags,
        "max_tokens": json_values, "max_completion_tokens": json_values,
        "min_tokens": json_values, "stream_options": json_values,
        "kv_transfer_params": json_values, "n": json_values,
    },
)
# Header values httpx can send (latin-1, no line breaks).
header_text = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF,
                                             exclude_characters="\x7f"), max_size=80
                      ).map(lambda value: value.strip(" \t"))  # h11 sends no edge blanks
headers = st.fixed_dictionaries({}, optional={
    "X-Session-ID": header_text, "traceparent": header_text | st.just(
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
    "tracestate": header_text, "Content-Type": header_text,
})
nested = st.integers(min_value=1, max_value=200_000).map(lambda n: "[" * n + "]" * n)
raw_bodies = (
    st.binary(max_size=200)
    | nested.map(str.encode)
    | nested.map(lambda deep: f'{{"messages": [{{"role": "user", "content": {deep}}}]}}'
                 .encode())
    | st.sampled_from([b"", b"null", b"[]", b'"text"', b"1e999", b"NaN", b'{"a": 1',
                       b'{"messages": "\\ud800"}', b'{"stream": true}' * 3,
                       b'{"messages": [{"role": "\\udfff", "content": "x"}], "stream": true}',
                       b'{"prompt": ' + b"9" * 5000 + b"}"])
)


class Proxy:
    """The proxy under fuzzing, its telemetry and an HTTP client."""

    def __init__(self, client: httpx.Client, telemetry: ProxyTelemetry) -> None:
        self.client, self.telemetry = client, telemetry
        self.dropped = 0

    def check(self, response: httpx.Response, sent: object) -> None:
        assert response.status_code < 500, (response.status_code, response.text[:300], sent)
        # Stored (flushed here, so that a failure names the request that caused it).
        assert self.telemetry.flush(30)
        dropped, self.dropped = self.dropped, self.telemetry.dropped_spans()
        assert self.dropped == dropped, sent


@pytest.fixture(scope="module", params=["export-process", "in-process"])
def proxy(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Proxy]:
    """``kvscope proxy --db``'s telemetry (spans built in the export process), and spans built
    in the proxy's own process (messages hashed on the request path)."""
    prefill, decode = StubState(keep=False), StubState(keep=False)
    db = tmp_path_factory.mktemp("fuzz") / "proxy.duckdb"
    with ServerThread(lambda: prefill_app(prefill)) as p, \
            ServerThread(lambda: decode_app(decode)) as d:
        config = ProxyConfig(prefillers=[Upstream("127.0.0.1", p.port)],
                             decoders=[Upstream("127.0.0.1", d.port)], reuse_guard=True,
                             log_turns=False)
        otel = None
        if request.param == "export-process":
            telemetry = ProxyTelemetry(None, router_ttl_s=config.router_ttl_s,
                                       export_process=TurnExportProcess(
                                           semconv.SERVICE_PROXY, db=str(db),
                                           send_interval_s=0.01))
        else:
            otel = setup_telemetry(semconv.SERVICE_PROXY, db=str(db))
            telemetry = ProxyTelemetry(otel, router_ttl_s=config.router_ttl_s)
        try:
            with ServerThread(lambda: build_app(config, telemetry),
                              runner_options=SERVER_OPTIONS) as server, \
                    httpx.Client(base_url=server.url, timeout=30) as client:
                yield Proxy(client, telemetry)
                assert client.get("/health").status_code == 200
                assert telemetry.flush(30)
        finally:
            telemetry.shutdown()


def _json(body: dict[str, Any]) -> bytes:
    # What a client's JSON library writes: NaN and Infinity as Python's json does.
    return json.dumps(body).encode("utf-8", "surrogatepass")


FUZZ = settings(max_examples=100, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ
@given(route=st.sampled_from(ROUTES), body=bodies, extra_headers=headers)
def test_any_json_body_gets_a_client_or_success_answer(
        proxy: Proxy, route: str, body: dict[str, Any], extra_headers: dict[str, str]) -> None:
    sent = {"Content-Type": b"application/json",
            **{name: value.encode("latin-1") for name, value in extra_headers.items()}}
    response = proxy.client.post(route, content=_json(body), headers=sent)
    proxy.check(response, (route, body, extra_headers))


@FUZZ
@given(route=st.sampled_from(ROUTES), raw=raw_bodies, session=st.none() | header_text)
def test_any_bytes_get_a_client_or_success_answer(
        proxy: Proxy, route: str, raw: bytes, session: str | None) -> None:
    sent = {"Content-Type": b"application/json"}
    if session is not None:
        sent["X-Session-ID"] = session.encode("latin-1")
    response = proxy.client.post(route, content=raw, headers=sent)
    proxy.check(response, (route, raw[:200], session))


@FUZZ
@given(turns=st.lists(st.tuples(messages, stream_flags), min_size=2, max_size=4),
       conversation=st.text(min_size=1, max_size=8))
def test_a_conversation_of_odd_turns_never_breaks_the_guard_or_the_hashes(
        proxy: Proxy, turns: list[tuple[Any, Any]], conversation: str) -> None:
    # Same conversation id each turn: the router's entry and the reuse guard see them all.
    for history, stream in turns:
        body = {"model": "m", "messages": history, "stream": stream, "max_tokens": 4,
                "conversation_id": "fuzz-" + conversation}
        response = proxy.client.post("/v1/chat/completions", content=_json(body),
                                     headers={"Content-Type": "application/json"})
        proxy.check(response, body)

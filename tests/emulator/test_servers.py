"""The emulated servers speak vLLM 0.33.0's HTTP protocol: routes, SSE framing, shapes, ids."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvscope.emulator.launcher import EmulatedCluster
from kvscope.emulator.servers import EmulatorConfig
from kvscope.emulator.tokens import apply_chat_template
from kvscope.reuse.params import P_PARAMS_EXTRA_FIELDS, PARAMS_FIELDS
from kvscope.reuse.router import MISS_PARAMS
from tests.raw_http import partial_body_answer

MODEL = "kvscope-emulated"


@pytest.fixture(scope="module")
def cluster() -> Iterator[EmulatedCluster]:
    with EmulatedCluster(EmulatorConfig(time_scale=50.0, enable_prompt_tokens_details=True,
                                        prefill_prefix_caching=False)) as c:
        yield c


def _messages(tag: str, words: int = 40) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"agent {tag} " + "context " * words},
            {"role": "user", "content": f"task {tag}"}]


def _events(raw: bytes) -> list[str]:
    """SSE payloads; asserts vLLM's framing: every event is ``data: ...`` + blank line."""
    text = raw.decode()
    assert text.endswith("data: [DONE]\n\n")
    frames = text.split("\n\n")
    assert frames[-1] == ""
    payloads = []
    for frame in frames[:-1]:
        assert frame.startswith("data: ") and "\n" not in frame, frame
        payloads.append(frame[len("data: "):])
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1
    return payloads[:-1]


def _chat(url: str, body: dict[str, Any], request_id: str | None = None) -> httpx.Response:
    headers = {"X-Request-Id": request_id} if request_id else {}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def test_health_is_empty_200_and_models_lists_the_served_model(cluster: EmulatedCluster) -> None:
    for url in cluster.prefill_urls + cluster.decode_urls:
        health = httpx.get(url + "/health")
        assert health.status_code == 200 and health.content == b""
    models = httpx.get(cluster.decode_urls[0] + "/v1/models").json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert (card["id"], card["object"], card["owned_by"], card["root"]) == (
        MODEL, "model", "vllm", MODEL)
    assert card["permission"][0]["object"] == "model_permission"


def test_stream_chunks_match_vllm_shapes_and_usage_chunk_is_last(
    cluster: EmulatedCluster,
) -> None:
    body = {"model": MODEL, "messages": _messages("sse"), "max_tokens": 5, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", cluster.decode_urls[0] + "/v1/chat/completions", json=body,
                      headers={"X-Request-Id": "req-sse"}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        chunks = [json.loads(p) for p in _events(resp.read())]
    first, tokens, usage = chunks[0], chunks[1:-1], chunks[-1]
    assert list(first) == ["id", "object", "created", "model", "choices", "prompt_token_ids",
                           "prompt_text"]
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}]
    assert len(tokens) == 5 and all(c["id"] == "chatcmpl-req-sse" for c in chunks)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    for chunk in tokens[:-1]:
        assert list(chunk) == ["id", "object", "created", "model", "choices",
                               "kv_transfer_params"]
        assert chunk["kv_transfer_params"] is None
        assert list(chunk["choices"][0]) == ["index", "delta", "logprobs", "finish_reason",
                                             "token_ids"]
    last_choice = tokens[-1]["choices"][0]
    assert last_choice["finish_reason"] == "length"
    assert list(last_choice) == ["index", "delta", "logprobs", "finish_reason", "stop_reason",
                                 "token_ids", "weight_versions"]
    assert usage["choices"] == [] and "kv_transfer_params" not in usage
    prompt_tokens = len(apply_chat_template(body["messages"]))
    assert usage["usage"] == {"prompt_tokens": prompt_tokens,
                              "total_tokens": prompt_tokens + 5, "completion_tokens": 5}
    text = "".join(c["choices"][0]["delta"]["content"] for c in tokens)
    assert len(text.split()) == 5


def test_no_usage_chunk_without_include_usage(cluster: EmulatedCluster) -> None:
    body = {"model": MODEL, "messages": _messages("nousage"), "max_tokens": 3,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": False}}
    with httpx.stream("POST", cluster.decode_urls[0] + "/v1/chat/completions",
                      json=body) as resp:
        chunks = [json.loads(p) for p in _events(resp.read())]
    assert all(c["choices"] for c in chunks)  # vLLM's benchmark indexes choices[0] everywhere
    assert not any("usage" in c for c in chunks)


def test_non_streaming_body_has_every_vllm_field(cluster: EmulatedCluster) -> None:
    body = {"model": MODEL, "messages": _messages("full"), "max_completion_tokens": 4,
            "max_tokens": 99, "ignore_eos": True}
    answer = _chat(cluster.decode_urls[0], body, "req-full").json()
    assert list(answer) == ["id", "object", "created", "model", "choices", "service_tier",
                            "system_fingerprint", "usage", "prompt_logprobs",
                            "prompt_token_ids", "prompt_text", "kv_transfer_params",
                            "ec_transfer_params", "metrics"]
    assert answer["id"] == "chatcmpl-req-full" and answer["object"] == "chat.completion"
    choice = answer["choices"][0]
    assert choice["message"]["role"] == "assistant" and "tool_calls" not in choice["message"]
    assert len(choice["message"]["content"].split()) == 4  # max_completion_tokens wins
    assert answer["usage"]["completion_tokens"] == 4
    assert answer["kv_transfer_params"] is None  # no P->D params: not a disaggregated leg


def test_completions_route_streams_text_chunks(cluster: EmulatedCluster) -> None:
    body = {"model": MODEL, "prompt": "hello there " * 10, "max_tokens": 3, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", cluster.decode_urls[0] + "/v1/completions", json=body,
                      headers={"X-Request-Id": "c1"}) as resp:
        chunks = [json.loads(p) for p in _events(resp.read())]
    assert [c["object"] for c in chunks] == ["text_completion"] * 3
    assert chunks[0]["id"] == "cmpl-c1"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    whole = httpx.post(cluster.prefill_urls[0] + "/v1/completions",
                       json={**body, "stream": False}).json()
    assert whole["object"] == "text_completion" and whole["usage"]["prompt_tokens"] == 20


def test_request_ids_follow_x_request_id_with_random_suffix(cluster: EmulatedCluster) -> None:
    body = {"model": MODEL, "messages": _messages("ids"), "max_tokens": 1,
            "kv_transfer_params": dict(MISS_PARAMS)}
    answer = _chat(cluster.prefill_urls[0], body, "xrid-42").json()
    assert answer["id"] == "chatcmpl-xrid-42"
    engine_id = answer["kv_transfer_params"]["remote_request_id"]
    assert re.fullmatch(r"chatcmpl-xrid-42-[0-9a-f]{8}", engine_id)
    without_header = _chat(cluster.prefill_urls[0], body).json()
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", without_header["id"])


def test_request_id_randomization_can_be_disabled() -> None:
    config = EmulatorConfig(disable_request_id_randomization=True, time_scale=50.0)
    with EmulatedCluster(config) as c:
        body = {"model": MODEL, "messages": _messages("norand"), "max_tokens": 1,
                "kv_transfer_params": dict(MISS_PARAMS)}
        params = _chat(c.prefill_urls[0], body, "fixed").json()["kv_transfer_params"]
    assert params["remote_request_id"] == "chatcmpl-fixed"


def test_params_field_sets_both_directions(cluster: EmulatedCluster) -> None:
    messages = _messages("params", 60)
    prefill = _chat(cluster.prefill_urls[0], {"model": MODEL, "messages": messages,
                                              "max_tokens": 1, "kv_transfer_params":
                                              dict(MISS_PARAMS)}, "pd-1").json()
    p_params = prefill["kv_transfer_params"]
    assert set(p_params) == set(PARAMS_FIELDS) | set(P_PARAMS_EXTRA_FIELDS)
    assert p_params["do_remote_prefill"] is True and p_params["do_remote_decode"] is False
    assert p_params["remote_blocks_expiry_time"] is None
    assert prefill["usage"]["completion_tokens"] == 1
    body = {"model": MODEL, "messages": messages, "max_tokens": 20, "ignore_eos": True,
            "stream": True, "kv_transfer_params": p_params}
    with httpx.stream("POST", cluster.decode_urls[0] + "/v1/chat/completions", json=body,
                      headers={"X-Request-Id": "pd-1"}) as resp:
        chunks = [json.loads(p) for p in _events(resp.read())]
    carrying = [c for c in chunks if c.get("kv_transfer_params")]
    assert len(carrying) == 1 and carrying[0]["choices"][0]["finish_reason"] == "length"
    d_params = carrying[0]["kv_transfer_params"]
    assert list(d_params) == list(PARAMS_FIELDS)
    assert d_params["do_remote_decode"] is True and d_params["do_remote_prefill"] is False
    prompt = len(apply_chat_template(messages))
    assert d_params["remote_num_tokens"] == prompt + 20 - 1
    assert d_params["remote_request_id"].startswith("chatcmpl-pd-1-")
    assert d_params["remote_engine_id"] == "decode-engine-000"
    assert isinstance(d_params["remote_blocks_expiry_time"], float)
    # Non-streaming decode puts the params at top level.
    whole = _chat(cluster.decode_urls[0], {**body, "stream": False}, "pd-2").json()
    assert whole["kv_transfer_params"]["do_remote_decode"] is True


def test_output_is_deterministic_and_stops_without_ignore_eos(cluster: EmulatedCluster) -> None:
    body = {"model": MODEL, "messages": _messages("det"), "max_tokens": 4000}
    first = _chat(cluster.decode_urls[0], body).json()["choices"][0]
    second = _chat(cluster.decode_urls[0], body).json()["choices"][0]
    assert first["message"]["content"] == second["message"]["content"]
    assert first["finish_reason"] == "stop" and len(first["message"]["content"].split()) < 4000


@pytest.mark.parametrize(
    ("body", "status", "error_type"),
    [
        ({"model": "other", "messages": []}, 404, "NotFoundError"),
        ({"model": MODEL, "messages": "hi"}, 400, "BadRequestError"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
         400, "BadRequestError"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
          "kv_transfer_params": "bad"}, 400, "BadRequestError"),
    ],
)
def test_invalid_requests_get_vllm_error_bodies(
    cluster: EmulatedCluster, body: dict[str, Any], status: int, error_type: str
) -> None:
    resp = _chat(cluster.prefill_urls[0], body)
    assert resp.status_code == status
    error = resp.json()["error"]
    assert (error["type"], error["code"]) == (error_type, status)


def test_malformed_json_is_a_400(cluster: EmulatedCluster) -> None:
    resp = httpx.post(cluster.prefill_urls[0] + "/v1/chat/completions", content=b"{nope",
                      headers={"Content-Type": "application/json"})
    assert resp.status_code == 400 and "not valid JSON" in resp.json()["error"]["message"]


def test_a_lone_surrogate_is_a_400_not_a_500(cluster: EmulatedCluster) -> None:
    # Valid JSON, not text: once a 500 from the emulator (and a 502 from the proxy).
    for content in ('"\\ud800 hello"', '"\\udfff"'):
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "X"}]}
                          ).replace('"X"', content).encode()
        resp = httpx.post(cluster.prefill_urls[0] + "/v1/chat/completions", content=body,
                          headers={"Content-Type": "application/json"})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["type"] == "BadRequestError"


def test_a_client_holding_a_partial_body_gets_408(cluster: EmulatedCluster,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from kvscope.emulator import servers

    monkeypatch.setattr(servers, "BODY_READ_TIMEOUT_S", 0.3)
    for url in (cluster.prefill_urls[0], cluster.decode_urls[0]):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        answer = partial_body_answer(host, int(port), "/v1/chat/completions")
        assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
        assert b"request body not received within 0.3 s" in answer

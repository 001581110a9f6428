"""vLLM's OpenAI-compatible HTTP shapes, as the emulated engines speak them (vLLM 0.33.0).

Request validation and the ids vLLM derives (:func:`parse_request`), the output plan
(:func:`plan_output`), and every body the servers write: SSE chunks (:func:`chunk_json`,
:func:`token_choice`), non-streaming bodies (:func:`full_response`), ``usage`` (:func:`usage`),
``GET /v1/models`` (:func:`models_body`) and ``ErrorResponse`` (:func:`error_response`). Fields
and their order follow vLLM's pydantic models (``entrypoints/openai/chat_completion/serving.py``):
chunks ``exclude_unset``, the trailing usage chunk ``exclude_none``, non-streaming bodies in full.
No I/O beyond building an aiohttp response.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kvscope.emulator import faults as fault_names
from kvscope.emulator import reuse_model, tokens
from kvscope.emulator.faults import FAULT_BODY_FIELD, FAULT_HEADER

if TYPE_CHECKING:
    from kvscope.emulator.servers import EmulatorConfig

__all__ = ["CHAT", "COMPLETION", "EmulatedRequest", "RequestError", "STOP_STRING", "chunk_json",
    "dumps", "error_response", "full_response", "models_body", "parse_request", "plan_output",
    "stop_reason", "token_choice", "usage"]

CHAT = "chat"
COMPLETION = "completion"
_NATURAL_MIN_TOKENS = 16
_NATURAL_SPREAD = 241
_JSON = {"separators": (",", ":"), "ensure_ascii": False}


class RequestError(Exception):
    """A request vLLM would refuse: becomes an OpenAI-style error response."""

    def __init__(self, status: int, message: str, error_type: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.error_type, self.param = status, message, error_type, param


def error_response(status: int, message: str, error_type: str,
                   param: str | None = None) -> web.Response:
    """vLLM's ``ErrorResponse`` body."""
    body = {"error": {"message": message, "type": error_type, "param": param, "code": status}}
    return web.Response(text=json.dumps(body, **_JSON), status=status,  # type: ignore[arg-type]
                        content_type="application/json")


def dumps(obj: Any) -> str:
    return json.dumps(obj, **_JSON)  # type: ignore[arg-type]


@dataclass
class EmulatedRequest:
    """One parsed request, with the ids vLLM would derive for it."""

    kind: str
    model: str
    prompt_ids: list[int]
    prompt: tokens.BlockSeq
    stream: bool
    include_usage: bool
    max_tokens: int
    ignore_eos: bool
    params: dict[str, Any] | None
    response_id: str
    request_id: str
    x_request_id: str
    traceparent: str | None
    fault_names: frozenset[str]
    key: int
    created: int = field(default_factory=lambda: int(time.time()))
    # prompt_logprobs asked: vLLM's scheduler reads no cached prefix (skip_reading_prefix_cache).
    skip_reading_prefix_cache: bool = False
    # The request's stop strings (``stop``); matched within the emulated output's words.
    stop: tuple[str, ...] = ()


def _int_field(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(400, f"{name} must be an integer", param=name)
    return value


def parse_request(
    body: Any, headers: Mapping[str, str], kind: str, config: EmulatorConfig, rng: random.Random
) -> EmulatedRequest:
    """Validate a request body as vLLM would and derive its token ids and request ids."""
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    model = body.get("model") or config.model
    if model != config.model:
        raise RequestError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    if kind == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise RequestError(400, "messages must be a list of message objects", param="messages")
        prompt_ids = tokens.apply_chat_template(messages)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = tokens.encode(prompt)
        elif isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            prompt_ids = list(prompt)
        else:
            raise RequestError(400, "prompt must be a string or a list of token ids",
                               param="prompt")
    if not prompt_ids:
        raise RequestError(400, "The prompt is empty", param="prompt")
    limit = _int_field(body, "max_completion_tokens")
    if limit is None:
        limit = _int_field(body, "max_tokens")
    room = config.max_model_len - len(prompt_ids)
    if room <= 0:
        raise RequestError(400, f"The prompt has {len(prompt_ids)} tokens, more than "
                                f"max_model_len={config.max_model_len}", param="messages")
    if limit is None:
        limit = room
    if limit < 1:
        raise RequestError(400, f"max_tokens must be at least 1, got {limit}.",
                           param="max_tokens")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list)
                                 and all(isinstance(s, str) and s for s in stop)):
        raise RequestError(400, "stop must be a string or a list of non-empty strings",
                           param="stop")
    options = body.get("stream_options")
    stream = bool(body.get("stream", False))
    include_usage = bool(stream and isinstance(options, dict) and options.get("include_usage"))
    params = body.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise RequestError(400, "kv_transfer_params must be an object",
                           param="kv_transfer_params")
    x_request_id = headers.get("X-Request-Id")
    body_id = body.get("request_id")
    base = x_request_id or (body_id if isinstance(body_id, str) and body_id else uuid.uuid4().hex)
    response_id = ("chatcmpl-" if kind == CHAT else "cmpl-") + base
    request_id = reuse_model.vllm_request_id(
        base, rng, chat=kind == CHAT, randomize=not config.disable_request_id_randomization)
    requested: frozenset[str] = frozenset()
    if config.allow_fault_headers:
        requested = fault_names.names_in(headers.get(FAULT_HEADER, "")) | fault_names.names_in(
            body.get(FAULT_BODY_FIELD)
        )
    return EmulatedRequest(
        kind=kind,
        model=model,
        prompt_ids=prompt_ids,
        prompt=tokens.BlockSeq.from_tokens(prompt_ids, config.block_size),
        stream=stream,
        include_usage=include_usage,
        max_tokens=min(limit, room),
        ignore_eos=bool(body.get("ignore_eos", False)),
        params=dict(params) if params else None,
        response_id=response_id,
        request_id=request_id,
        x_request_id=x_request_id or response_id,
        traceparent=headers.get("traceparent"),
        fault_names=requested,
        key=fault_names.turn_key(prompt_ids),
        skip_reading_prefix_cache=body.get("prompt_logprobs") is not None,
        stop=tuple(stop or ()),
    )


# A stop string matched before the engine finished the request: vLLM's frontend cuts the text
# and aborts it (finish_reason "stop" on the wire; decode keeps and returns nothing).
STOP_STRING = "stop_string"


def stop_reason(req: EmulatedRequest, word: str) -> str | None:
    """The stop string ``word`` matched (vLLM's ``stop_reason``), if any."""
    return next((stop for stop in req.stop if stop in word), None)


def plan_output(req: EmulatedRequest, seed: int) -> tuple[list[str], str, int]:
    """The words decode generates, why it ends (``length``, ``stop`` or :data:`STOP_STRING`)
    and how many of them the client sees, by seed.

    A stop string (matched within a word) ends the text before its word. When that word is
    the last the engine generates anyway, the engine has finished the request in that step
    (its reason stands, the text is still cut); earlier, the frontend aborts it.
    """
    mixed = (req.key ^ (seed * 0x9E3779B97F4A7C15)) & 0x7FFFFFFFFFFFFFFF
    n, reason = req.max_tokens, "length"
    if not req.ignore_eos:
        natural = _NATURAL_MIN_TOKENS + mixed % _NATURAL_SPREAD
        if natural < n:
            n, reason = natural, "stop"
    words = tokens.generate_output_words(mixed, n)
    for i, word in enumerate(words if req.stop else ()):
        if any(stop in word for stop in req.stop):
            return words[: i + 1], reason if i == len(words) - 1 else STOP_STRING, i
    return words, reason, len(words)


def usage(prompt: int, completion: int, cached: int | None, details: bool,
           full: bool) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    prompt_details = {"cached_tokens": cached} if details and cached is not None else None
    if full:
        usage["prompt_tokens_details"] = (
            None if prompt_details is None else {"cached_tokens": cached,
                                                 "created_cache_tokens": None,
                                                 "multimodal_tokens": None}
        )
        usage["completion_tokens_details"] = None
    elif prompt_details is not None:
        usage["prompt_tokens_details"] = prompt_details
    return usage


def chunk_json(req: EmulatedRequest, choice: dict[str, Any], **extra: Any) -> str:
    """One SSE chunk's JSON (fields as vLLM's ``exclude_unset`` dump orders them)."""
    chunk: dict[str, Any] = {
        "id": req.response_id,
        "object": "chat.completion.chunk" if req.kind == CHAT else "text_completion",
        "created": req.created,
        "model": req.model,
        "choices": [choice],
    }
    chunk.update(extra)
    return dumps(chunk)


def token_choice(req: EmulatedRequest, text: str, finish_reason: str | None,
                 stop_reason: str | None = None) -> dict[str, Any]:
    """The choice of one streamed token (the last one carries ``finish_reason`` and, for a
    stop string, the string as ``stop_reason``)."""
    if req.kind == CHAT:
        choice: dict[str, Any] = {
            "index": 0, "delta": {"content": text}, "logprobs": None,
            "finish_reason": finish_reason,
        }
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        choice["token_ids"] = None
        if finish_reason is not None:
            choice["weight_versions"] = None
        return choice
    return {
        "index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
        "stop_reason": stop_reason, "prompt_token_ids": None, "token_ids": None,
        "weight_versions": None,
    }


def full_response(req: EmulatedRequest, text: str, finish_reason: str, usage: dict[str, Any],
                  params: dict[str, Any] | None, stop_reason: str | None = None
                  ) -> dict[str, Any]:
    """A non-streaming body, every field as vLLM's ``model_dump()`` writes it."""
    if req.kind == CHAT:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": None,
                        "annotations": None, "audio": None, "function_call": None,
                        "reasoning": None},
            "logprobs": None, "finish_reason": finish_reason, "stop_reason": stop_reason,
            "token_ids": None, "routed_experts": None, "weight_versions": None,
        }
        return {
            "id": req.response_id, "object": "chat.completion", "created": req.created,
            "model": req.model, "choices": [choice], "service_tier": None,
            "system_fingerprint": None, "usage": usage, "prompt_logprobs": None,
            "prompt_token_ids": None, "prompt_text": None, "kv_transfer_params": params,
            "ec_transfer_params": None, "metrics": None,
        }
    choice = {
        "index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
        "stop_reason": stop_reason, "token_ids": None, "prompt_logprobs": None,
        "prompt_token_ids": None, "routed_experts": None, "weight_versions": None,
    }
    return {
        "id": req.response_id, "object": "text_completion", "created": req.created,
        "model": req.model, "choices": [choice], "service_tier": None,
        "system_fingerprint": None, "usage": usage, "kv_transfer_params": params,
        "ec_transfer_params": None, "metrics": None,
    }


def models_body(config: EmulatorConfig) -> dict[str, Any]:
    """``GET /v1/models`` as vLLM answers it (one base model)."""
    created = int(time.time())
    permission = {
        "id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created,
        "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
        "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
        "organization": "*", "group": None, "is_blocking": False,
    }
    card = {
        "id": config.model, "object": "model", "created": created, "owned_by": "vllm",
        "root": config.model, "parent": None, "max_model_len": config.max_model_len,
        "permission": [permission],
    }
    return {"object": "list", "data": [card]}

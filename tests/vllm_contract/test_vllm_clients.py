"""vLLM's own multi-turn proxy and benchmark client, unchanged, against ``kvscope emulate``.

The two scripts come from vLLM 0.33.0's sdist (``bash scripts/vllm-clients.sh`` fetches and
extracts them into ``.venv-vllm/vllm-sdist/``) and run here as subprocesses, unmodified:

    benchmark_serving_multi_turn.py ──► disagg_proxy_multiturn.py (or ``kvscope proxy``)
                                          ├─► kvscope emulate: prefill server
                                          └─► kvscope emulate: decode server

Every process binds 127.0.0.1 on an ephemeral port. The benchmark generates a few small
conversations from a seeded word corpus, tokenized by a local WordLevel tokenizer that counts
words exactly as the emulator does, so its per-request stats can be checked against the
emulator's ground truth (``<db>.truth.jsonl``) token for token. Prefill's prefix cache is off (as
on the blog's P), so a reused turn can only have been pulled D→P.

What each case must show, from the ground truth and the emulator's spans in its store:

- bidir on, ``--send-conversation-id``: every turn ≥ 2 is pulled from decode (decision ``pull``,
  a finished D→P read, outcome ``reused_remote``) and the proxy logs a cache hit for it;
- bidir off (``--no-bidirectional-kv-xfer``): decode returns no params, nothing is pulled;
- no ``--send-conversation-id``: the proxy cannot link turns, prefill never gets an offer;
- fault ``transfer_fail``: every offered read fails, the reusable tokens are recomputed;
- fault ``strip_stream_metadata``: decode pins its blocks but its stream carries no params;
- ``kvscope proxy`` in place of vLLM's: one ``kvscope.turn`` span per benchmark request, joined
  to the emulator's turns by X-Request-Id.
"""

from __future__ import annotations

import ast
import collections
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvscope import semconv
from kvscope.reuse import outcomes

CLIENTS = Path(sys.prefix) / "vllm-sdist" / "vllm-0.33.0"
PROXY_SCRIPT = CLIENTS / "examples" / "disaggregated" / "disaggregated_serving" / (
    "disagg_proxy_multiturn.py")
BENCHMARK_SCRIPT = CLIENTS / "benchmarks" / "multi_turn" / "benchmark_serving_multi_turn.py"
_MISSING_MODULES = [m for m in ("uvicorn", "httpx", "fastapi", "pandas", "tqdm", "tokenizers",
                                "transformers") if importlib.util.find_spec(m) is None]
if not (PROXY_SCRIPT.is_file() and BENCHMARK_SCRIPT.is_file()) or _MISSING_MODULES:
    pytest.skip(
        f"vLLM's multi-turn clients are not set up in {sys.prefix} (scripts: "
        f"{PROXY_SCRIPT.is_file() and BENCHMARK_SCRIPT.is_file()}, missing modules: "
        f"{_MISSING_MODULES or 'none'}): bash scripts/vllm-venv.sh && bash "
        "scripts/vllm-clients.sh && .venv-vllm/bin/python -m pytest tests/vllm_contract",
        allow_module_level=True,
    )

from tests.vllm_contract.word_tokenizer import build_tokenizer, corpus_words  # noqa: E402

CONVERSATIONS = 3
USER_TURNS = 3
REQUESTS = CONVERSATIONS * USER_TURNS
LATER_TURNS = CONVERSATIONS * (USER_TURNS - 1)
MODEL = "kvscope-emulated"
# The emulator's chat template: <|role|> content <|end|> per message, then <|assistant|>.
TEMPLATE_TOKENS_PER_MESSAGE = 2
GENERATION_PROMPT_TOKENS = 1
START_TIMEOUT_S = 60.0
BENCHMARK_TIMEOUT_S = 120.0


# --- the workload ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """The benchmark's inputs: tokenizer folder and generator config (its §7 format)."""

    tokenizer: Path
    config: Path


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory) -> Workload:
    root = tmp_path_factory.mktemp("workload")
    words = corpus_words(6000, seed=7)
    corpus = root / "corpus.txt"
    corpus.write_text(" ".join(words) + "\n")
    config = root / "conversations.json"
    # Turns 2.. re-send a prompt of ≥ 150 tokens with the history: well above the 64-token
    # kv_recompute_threshold, so every offered pull is taken.
    config.write_text(json.dumps({
        "filetype": "generate_conversations",
        "num_conversations": CONVERSATIONS,
        "text_files": [str(corpus)],
        "print_stats": False,
        "prompt_input": {
            "num_turns": {"distribution": "constant", "value": 2 * USER_TURNS},
            "common_prefix_num_tokens": {"distribution": "constant", "value": 0},
            "prefix_num_tokens": {"distribution": "constant", "value": 120},
            "num_tokens": {"distribution": "uniform", "min": 20, "max": 40},
        },
        "prompt_output": {"num_tokens": {"distribution": "uniform", "min": 20, "max": 40}},
    }))
    return Workload(build_tokenizer(root / "tokenizer", words), config)


# --- subprocesses ---------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("OPENAI_API_KEY", None)  # vLLM's proxy would forward it upstream
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_TARGET_DEVICE="cpu",
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _tail(path: Path, lines: int = 40) -> str:
    if not path.exists():
        return f"({path.name}: no output)"
    return f"--- {path.name} ---\n" + "\n".join(path.read_text(errors="replace")
                                                 .splitlines()[-lines:])


class Process:
    """A subprocess writing stdout and stderr to one log file; stopped with SIGINT."""

    def __init__(self, argv: Sequence[str], log: Path, cwd: Path) -> None:
        self.log = log
        with log.open("wb") as sink:
            self.popen = subprocess.Popen(list(argv), stdout=sink, stderr=subprocess.STDOUT,
                                          cwd=cwd, env=_env())

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def check_alive(self) -> None:
        if self.popen.poll() is not None:
            raise AssertionError(f"exited with {self.popen.returncode}\n{_tail(self.log)}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)


def _wait_http(url: str, proc: Process) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        proc.check_alive()
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not ready in {START_TIMEOUT_S} s\n{_tail(proc.log)}")


def _start_emulator(workdir: Path, flags: Sequence[str],
                    spans: bool = True) -> tuple[Process, str, str]:
    """``kvscope emulate`` on ephemeral ports; returns it with its prefill and decode URLs.

    ``spans=False``: kvscope's telemetry off (no store), the ground truth still written.
    """
    store = (["--db", str(workdir / "emulator.duckdb")] if spans
             else ["--truth", str(workdir / "emulator.duckdb.truth.jsonl")])
    proc = Process(
        [sys.executable, "-m", "kvscope.cli", "emulate", "--prefill-port", "0",
         "--decode-port", "0", "--served-model-name", MODEL, "--seed", "3", *store, *flags],
        workdir / "emulator.log", workdir,
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        for line in proc.text().splitlines():
            # "kvscope emulate run RUN: prefill URL... decode URL..."
            if line.startswith("kvscope emulate run ") and " decode " in line:
                prefill = line.split(" prefill ", 1)[1].split(" decode ", 1)[0].split()
                decode = line.split(" decode ", 1)[1].split()
                return proc, prefill[0], decode[0]
        proc.check_alive()
        time.sleep(0.1)
    proc.stop()
    raise AssertionError(f"kvscope emulate did not start\n{_tail(proc.log)}")


def _host_port(url: str) -> tuple[str, str]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, port


def _start_proxy(workdir: Path, kind: str, prefill: str, decode: str) -> tuple[Process, str]:
    """vLLM's ``disagg_proxy_multiturn.py`` (kind "vllm") or ``kvscope proxy`` (kind "kvscope")."""
    p_host, p_port = _host_port(prefill)
    d_host, d_port = _host_port(decode)
    port = _free_port()
    upstreams = ["--prefiller-host", p_host, "--prefiller-port", p_port,
                 "--decoder-host", d_host, "--decoder-port", d_port]
    if kind == "vllm":
        argv = [sys.executable, str(PROXY_SCRIPT)]
    else:
        argv = [sys.executable, "-m", "kvscope.cli", "proxy",
                "--db", str(workdir / "proxy.duckdb")]
    proc = Process([*argv, "--host", "127.0.0.1", "--port", str(port), *upstreams],
                   workdir / f"{kind}-proxy.log", workdir)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(f"{url}/health", proc)
    except BaseException:
        proc.stop()
        raise
    return proc, url


def _run_benchmark(workdir: Path, workload: Workload, url: str,
                   send_conversation_id: bool) -> list[dict[str, Any]]:
    """vLLM's ``benchmark_serving_multi_turn.py`` against ``url``; its per-request stats."""
    stats = workdir / "stats.json"
    argv = [sys.executable, str(BENCHMARK_SCRIPT), "-m", str(workload.tokenizer),
            "--served-model-name", MODEL, "-u", url, "-i", str(workload.config),
            "-p", "1", "--seed", "0", "--request-timeout-sec", "30",
            "--stats-json-output", str(stats)]
    if send_conversation_id:
        argv.append("--send-conversation-id")
    log = workdir / "benchmark.log"
    with log.open("wb") as sink:
        result = subprocess.run(argv, stdout=sink, stderr=subprocess.STDOUT, cwd=workdir,
                                env=_env(), timeout=BENCHMARK_TIMEOUT_S, check=False)
    assert result.returncode == 0, f"benchmark exited with {result.returncode}\n{_tail(log)}"
    assert stats.exists(), f"benchmark wrote no --stats-json-output\n{_tail(log)}"
    data: list[dict[str, Any]] = json.loads(stats.read_text())
    return data


# --- one run of the stack -------------------------------------------------------------------------


@dataclass
class Span:
    """One stored span: name, service and attributes (values as stored, strings)."""

    name: str
    service: str
    attrs: dict[str, str]


@dataclass
class Run:
    """What one benchmark run through one proxy left behind."""

    stats: list[dict[str, Any]]
    truth: list[dict[str, Any]]
    spans: list[Span]
    proxy_spans: list[Span]
    proxy_log: str
    benchmark_log: str
    logs: str = ""
    by_turn: dict[int, list[dict[str, Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for row in self.truth:
            self.by_turn.setdefault(row["turn_index"], []).append(row)

    @property
    def later(self) -> list[dict[str, Any]]:
        """Truth rows of turns ≥ 2."""
        return [row for row in self.truth if row["turn_index"] >= 2]

    def named(self, name: str, **attrs: str) -> list[Span]:
        """Emulator spans called ``name`` whose attributes include ``attrs``."""
        return [s for s in self.spans
                if s.name == name and all(s.attrs.get(k) == v for k, v in attrs.items())]


def _spans(db: Path) -> list[Span]:
    from kvscope.store import open_readonly

    con = open_readonly(db)
    try:
        rows = con.execute(
            "SELECT SpanName, ServiceName, SpanAttributes FROM otel_traces").fetchall()
    finally:
        con.close()
    return [Span(name, service, dict(attrs)) for name, service, attrs in rows]


def _run(tmp_path: Path, workload: Workload, *, proxy: str = "vllm",
         emulator_flags: Sequence[str] = (), send_conversation_id: bool = True,
         prefix_caching: bool = False, spans: bool = True) -> Run:
    procs: list[Process] = []
    flags = [*emulator_flags, *([] if prefix_caching else ["--no-enable-prefix-caching"])]
    try:
        emulator, prefill, decode = _start_emulator(tmp_path, flags, spans)
        procs.append(emulator)
        proxy_proc, url = _start_proxy(tmp_path, proxy, prefill, decode)
        procs.append(proxy_proc)
        stats = _run_benchmark(tmp_path, workload, url, send_conversation_id)
    finally:
        for proc in reversed(procs):  # the proxy first: its telemetry flushes on exit
            proc.stop()
    logs = "\n".join(_tail(p.log) for p in procs) + "\n" + _tail(tmp_path / "benchmark.log")
    from kvscope.emulator.ground_truth import read_truth

    truth_path = tmp_path / "emulator.duckdb.truth.jsonl"
    assert truth_path.exists(), f"the emulator wrote no ground truth\n{logs}"
    proxy_db = tmp_path / "proxy.duckdb"
    return Run(
        stats=stats,
        truth=read_truth(truth_path),
        spans=_spans(tmp_path / "emulator.duckdb") if spans else [],
        proxy_spans=_spans(proxy_db) if proxy_db.exists() else [],
        proxy_log=procs[1].text(),
        benchmark_log=(tmp_path / "benchmark.log").read_text(errors="replace"),
        logs=logs,
    )


def _check_workload(run: Run) -> None:
    """Every request the benchmark made is one emulated turn, with the same token counts.

    The benchmark counts message contents only; the emulator's prompt adds its chat template
    (two marker tokens per message, one generation prompt), so the counts agree exactly when
    the tokenizer, the history the client re-sends and the streamed output all match.
    """
    # vLLM's benchmark can lose its last sample: its collector stops reading once the client
    # says it finished ("Collected N samples ... Waiting for client (is alive: True)"), so the
    # last per-request record may never be read. The emulator's truth is the full count.
    assert len(run.truth) == REQUESTS, run.logs
    assert REQUESTS - 1 <= len(run.stats) <= REQUESTS, run.logs
    assert sorted(run.by_turn) == list(range(1, USER_TURNS + 1)), run.truth
    assert all(len(rows) == CONVERSATIONS for rows in run.by_turn.values()), run.truth
    expected = collections.Counter(
        ((s["input_num_turns"] + 1) // 2,
         s["input_num_tokens"] + TEMPLATE_TOKENS_PER_MESSAGE * s["input_num_turns"]
         + GENERATION_PROMPT_TOKENS,
         s["output_num_tokens"])
        for s in run.stats)
    observed = collections.Counter(
        (r["turn_index"], r["prompt_tokens"], r["output_tokens"]) for r in run.truth)
    assert not expected - observed, (expected, observed)
    assert all(r["error"] is None for r in run.truth), run.truth
    assert [r["outcome"] for r in run.by_turn[1]] == [outcomes.FIRST_TURN] * CONVERSATIONS
    assert {s["conversation_id"] for s in run.stats} == {
        f"CONV_ID_{i}" for i in range(CONVERSATIONS)}


def _check_ingested(tmp_path: Path, run: Run) -> None:
    """The benchmark's own stats file through ``kvscope ingest``: one client-side turn per
    record with its TTFT and latency; turn 1 ``first_turn``, later turns ``unknown`` (the file
    has no router, decode or engine evidence); a second ingest is refused."""
    from kvscope.analysis import ledger
    from kvscope.collector.ingest import ingest
    from kvscope.errors import IngestError
    from kvscope.store.source import open_reader

    db, stats = tmp_path / "ingested.duckdb", tmp_path / "stats.json"
    result = ingest(db, [stats])
    assert result.sources[0].records == len(run.stats)
    reader = open_reader(db)
    try:
        rows = {(r["conversation_id"], r["turn_index"]): r
                for r in ledger.ledger(reader).to_dicts()}
    finally:
        reader.close()
    assert len(rows) == len(run.stats)
    for record in run.stats:
        row = rows[(record["conversation_id"], (record["input_num_turns"] + 1) // 2)]
        assert row["ttft_ms"] == pytest.approx(record["ttft_ms"]), (row, record)
        assert row["turn_ms"] == pytest.approx(record["latency_ms"], abs=1e-6), (row, record)
        assert row["outcome"] == (outcomes.FIRST_TURN if row["turn_index"] == 1
                                  else outcomes.UNKNOWN), row
    with pytest.raises(IngestError, match="already in"):
        ingest(db, [stats])


def test_the_ingested_field_list_is_the_benchmarks_request_stats() -> None:
    from kvscope.collector.ingest import bench_stats

    tree = ast.parse(BENCHMARK_SCRIPT.read_text())
    (request_stats,) = [node for node in tree.body
                        if isinstance(node, ast.ClassDef) and node.name == "RequestStats"]
    fields = {node.target.id: ast.unparse(node.annotation) for node in request_stats.body
              if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    json_types = {"float": "number", "int": "integer", "str": "string"}
    assert list(fields) == list(bench_stats.FIELDS)
    assert {name: json_types[kind] for name, kind in fields.items()} == bench_stats.FIELDS


def _pulls(run: Run) -> list[Span]:
    return run.named(semconv.SPAN_KV_TRANSFER, **{
        semconv.TRANSFER_DIRECTION: semconv.DIRECTION_D_TO_P})


def _check_no_decode_metadata(run: Run, retained: int) -> None:
    """Decode's params never came back: no later turn got an offer, none pulled, every lookup
    missed; ``retained`` is how many finished turns decode pinned all the same."""
    _check_workload(run)
    assert not any(r["params_returned"] for r in run.truth), run.truth
    for row in run.later:
        assert row["outcome"] == outcomes.NO_DECODE_METADATA, row
        assert row["decision"] == semconv.DECISION_NO_OFFER, row
        assert row["remote_reused_tokens"] == 0, row
    assert _pulls(run) == []
    assert len(run.named(semconv.SPAN_KV_RETENTION)) == retained
    assert "cache HIT" not in run.proxy_log
    assert run.proxy_log.count("cache MISS") == REQUESTS, run.proxy_log


# --- the cases ------------------------------------------------------------------------------------


def test_bidir_on_turns_after_the_first_are_pulled_from_decode(
        tmp_path: Path, workload: Workload) -> None:
    run = _run(tmp_path, workload)
    _check_workload(run)
    _check_ingested(tmp_path, run)
    for row in run.later:
        assert row["outcome"] == outcomes.REUSED_REMOTE, row
        assert row["decision"] == semconv.DECISION_PULL, row
        assert row["transfer_status"] == semconv.TRANSFER_OK, row
        # Under the async scheduler (vLLM's default off CPU, the emulator's too) decode offers
        # prompt + output after a stop token, one less after max_tokens (the last sampled
        # token's KV was never computed); what is reusable follows the ledger's definition, so
        # all of it arrives either way.
        assert row["remote_reused_tokens"] == row["reusable_tokens"] > 0, row
        assert row["local_hit_tokens"] == 0, row
    # The spans say the same: one pull decision and one finished D→P read per later turn,
    # on prefill, for exactly the turns the ground truth names.
    pull_ids = {s.attrs[semconv.VLLM_REQUEST_ID] for s in run.named(
        semconv.SPAN_REUSE_DECISION, **{semconv.DECISION: semconv.DECISION_PULL})}
    assert pull_ids == {r["vllm_request_id"] for r in run.later}
    pulls = _pulls(run)
    assert len(pulls) == LATER_TURNS
    assert {s.service for s in pulls} == {semconv.SERVICE_PREFILL}
    assert {s.attrs[semconv.TRANSFER_STATUS] for s in pulls} == {semconv.TRANSFER_OK}
    assert sum(int(s.attrs[semconv.TRANSFER_BYTES]) for s in pulls) == sum(
        r["transfer_bytes"] for r in run.later) > 0
    # vLLM's proxy found decode's params for every later turn (its own log lines).
    assert run.proxy_log.count("cache HIT") == LATER_TURNS, run.proxy_log
    assert run.proxy_log.count("cache MISS") == CONVERSATIONS, run.proxy_log


def test_bidir_off_nothing_is_pulled(tmp_path: Path, workload: Workload) -> None:
    run = _run(tmp_path, workload, emulator_flags=["--no-bidirectional-kv-xfer"])
    _check_no_decode_metadata(run, retained=0)  # D pins nothing for a next turn
    for row in run.later:
        assert row["recomputed_reusable_tokens"] == row["reusable_tokens"] > 0, row


def test_without_conversation_id_the_proxy_cannot_link_turns(
        tmp_path: Path, workload: Workload) -> None:
    run = _run(tmp_path, workload, send_conversation_id=False)
    _check_workload(run)
    # The benchmark records its own conversation ids even when it sends none: the stats file
    # looks the same, and its ingested turns claim no cause either way.
    _check_ingested(tmp_path, run)
    # Decode still returns its params; the proxy has no key to keep them under.
    assert all(r["params_returned"] for r in run.truth), run.truth
    for row in run.later:
        # The servers never see the router; the ground truth says "prefill got no offer".
        assert row["outcome"] == outcomes.ROUTER_NO_ENTRY, row
        assert row["decision"] == semconv.DECISION_NO_OFFER, row
        assert row["remote_reused_tokens"] == 0, row
    assert _pulls(run) == []
    assert run.proxy_log.count("No conversation_id provided") == REQUESTS, run.proxy_log
    assert "cache HIT" not in run.proxy_log


def test_fault_invalid_params_prefill_recomputes(tmp_path: Path, workload: Workload) -> None:
    run = _run(tmp_path, workload, emulator_flags=["--fault", "invalid_params"])
    _check_workload(run)
    for row in run.later:
        # The offer lacks remote_request_id: 0.33.0's D->P branch is not taken, P computes.
        assert row["outcome"] == outcomes.INVALID_PARAMS, row
        assert row["decision"] == semconv.DECISION_INVALID_PARAMS, row
        assert row["remote_reused_tokens"] == 0, row
        assert row["recomputed_reusable_tokens"] == row["reusable_tokens"] > 0, row
    assert _pulls(run) == []
    # The proxy did find and send decode's params: the loss is at prefill, not the router.
    assert run.proxy_log.count("cache HIT") == LATER_TURNS, run.proxy_log


def test_fault_transfer_fail_stalls_the_turn_and_vllms_stack_drops_it(
        tmp_path: Path, workload: Workload) -> None:
    """A failed D->P read under ``recompute`` stalls the request; vLLM's clients see a 500.

    0.33.0 reschedules the request with ``_remote_blocks_processed`` set, answers the same
    async pull again, registers no read, and it waits for remote KV forever (the emulator
    answers 500 after ``--stall-timeout``). vLLM's proxy has no error handling (its exception
    reaches the client as a 500, and uvicorn then closes the connection) and the benchmark drops
    the conversation, or stops at the next request on that closed connection: how many turns 1
    follow is timing, so only what every run shares is asserted.
    """
    run = _run(tmp_path, workload,
               emulator_flags=["--fault", "transfer_fail", "--stall-timeout", "1",
                               "--kv-load-failure-policy", "recompute"])
    failed = run.later
    assert failed, run.logs
    for row in failed:
        assert row["outcome"] == outcomes.LOAD_STALLED, row
        assert row["decision"] == semconv.DECISION_PULL, row
        assert row["transfer_status"] == semconv.TRANSFER_FAILED, row
        assert row["error"] is not None and row["decode_request_id"] is None, row
        assert row["remote_reused_tokens"] == 0, row
    pulls = _pulls(run)
    assert len(pulls) == len(failed)
    assert {s.attrs[semconv.TRANSFER_STATUS] for s in pulls} == {semconv.TRANSFER_FAILED}
    # Only first turns reached the client, one stats row each.
    assert [s["input_num_turns"] for s in run.stats] == [1] * len(run.by_turn[1]), run.logs
    assert all(r["outcome"] == outcomes.FIRST_TURN for r in run.by_turn[1])
    assert "Received HTTP status 500" in run.benchmark_log, run.logs


def test_fault_strip_stream_metadata_leaves_the_proxy_nothing_to_offer(
        tmp_path: Path, workload: Workload) -> None:
    run = _run(tmp_path, workload, emulator_flags=["--fault", "strip_stream_metadata"])
    # Unlike bidir off, decode did pin every finished turn: retained, never read.
    _check_no_decode_metadata(run, retained=REQUESTS)


def test_benchmark_through_kvscope_proxy_one_turn_span_per_request(
        tmp_path: Path, workload: Workload) -> None:
    run = _run(tmp_path, workload, proxy="kvscope")
    _check_workload(run)
    for row in run.later:
        assert row["outcome"] == outcomes.REUSED_REMOTE, row
    turns = [s for s in run.proxy_spans if s.name == semconv.SPAN_TURN]
    assert len(turns) == REQUESTS, run.logs
    assert {s.service for s in turns} == {semconv.SERVICE_PROXY}
    # One span per request: the X-Request-Ids it sent are exactly the emulated turns'.
    sent = [s.attrs[semconv.X_REQUEST_ID] for s in turns]
    assert sorted(sent) == sorted(r["x_request_id"] for r in run.truth)
    by_id = {r["x_request_id"]: r for r in run.truth}
    for span in turns:
        index = int(span.attrs[semconv.TURN_INDEX])
        assert index == by_id[span.attrs[semconv.X_REQUEST_ID]]["turn_index"], span
        expected = semconv.ROUTER_HIT if index >= 2 else semconv.ROUTER_MISS
        assert span.attrs[semconv.ROUTER_LOOKUP] == expected, span
    conversations = collections.Counter(s.attrs[semconv.GEN_AI_CONVERSATION_ID] for s in turns)
    assert conversations == collections.Counter(
        {f"CONV_ID_{i}": USER_TURNS for i in range(CONVERSATIONS)})
    # Its turn lines (vLLM's words, the kvscope CLI's format) read as vLLM's proxy log is.
    from kvscope.collector.ingest import proxy_log

    log = proxy_log.read(tmp_path / "kvscope-proxy.log")
    assert log.writers == [proxy_log.KVSCOPE_LOGGER]
    assert sorted(r.x_request_id for r in log.requests) == sorted(sent)
    for request in log.requests:
        truth = by_id[request.x_request_id]
        assert request.turn_index == truth["turn_index"], (request, truth)
        assert request.lookup == (semconv.ROUTER_HIT if truth["turn_index"] >= 2
                                  else semconv.ROUTER_MISS), request
        assert request.params_returned is True and request.prefill_ms is not None, request

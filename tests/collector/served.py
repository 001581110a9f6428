"""A receiver in a child process, started as the kill, memory and throughput checks start one.

Shared by ``receiver_kill.py``, ``receiver_memory.py`` and
``tests/benchmarks/bench_store_throughput.py``: ``kvscope serve`` itself, or (with ``ack``)
``run_receiver`` with that way of acknowledging, which ``kvscope serve`` has no flag for.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# run_receiver with an ack mode, announcing itself in the words of kvscope serve.
_ACK_LAUNCHER = (
    "import sys\n"
    "from kvscope.collector.receiver import run_receiver\n"
    "def ready(listening):\n"
    "    print(f'kvscope serve: receiving OTLP/HTTP on {listening.http_url}, OTLP/gRPC on '\n"
    "          f'{listening.grpc_url}', file=sys.stderr, flush=True)\n"
    "run_receiver(sys.argv[1], '127.0.0.1', 0, grpc_port=0, on_ready=ready, ack=sys.argv[2])\n"
)


class Served:
    """A receiver on ephemeral ports; ``url`` and ``grpc_target`` from the line it starts with.

    ``env`` is added to this process's environment (``KVSCOPE_*`` limits, for example).
    """

    def __init__(self, db: Path, ack: str | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        argv = ([sys.executable, "-c", _ACK_LAUNCHER, str(db), ack] if ack else
                [sys.executable, "-m", "kvscope.cli", "serve", "--db", str(db), "--port", "0",
                 "--grpc-port", "0"])
        self.process = subprocess.Popen(
            argv, stderr=subprocess.PIPE, text=True, cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        assert self.process.stderr is not None
        line = self.process.stderr.readline()
        if "receiving OTLP/HTTP on " not in line:
            self.process.kill()
            raise RuntimeError(f"receiver did not start: {line!r}")
        self.url = line.split(" on ", 1)[1].split(",", 1)[0]
        self.grpc_target = line.split("OTLP/gRPC on http://", 1)[1].split(",", 1)[0].strip()

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout_s: float = 120) -> None:
        """Send ``sig`` and wait for the process to end."""
        self.process.send_signal(sig)
        self.process.wait(timeout_s)
        assert self.process.stderr is not None
        self.process.stderr.close()

"""Messages to helper processes: pack/unpack, and the send buffer."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from multiprocessing import Pipe
from pathlib import Path

import pytest

from kvscope.child import pack, set_send_buffer, unpack


def test_plain_values_are_marshalled_and_round_trip() -> None:
    value = [(-1, 0, ("id", 1, 2.5, None, True, ("c", "body", None), ["stop"])),
             (0, 1, ("req", 10**30, -3, "", {"messages": [{"role": "user", "content": "é"}]}))]
    data = pack(value)
    assert data[:1] == b"M"
    assert unpack(data) == value


def test_other_values_fall_back_to_pickle() -> None:
    value = [(0, 2, ("x", Path("a/b")))]  # a class instance: marshal refuses it
    data = pack(value)
    assert data[:1] == b"P"
    assert unpack(data) == value


def test_control_messages_are_never_packed_values() -> None:
    # The export process tells b"" (end) and b"F" (flush) from record batches by their bytes.
    assert pack([]) not in (b"", b"F")
    assert not pack([]).startswith(b"F")
    with pytest.raises(ValueError, match="not a packed message"):
        unpack(b"F")


def test_send_buffer_is_widened() -> None:
    parent, child = Pipe(duplex=True)
    left, right = socket.socketpair()
    try:
        default = left.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        set_send_buffer(parent, 8 << 20)
        with socket.socket(fileno=os.dup(parent.fileno())) as sock:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) > default
    finally:
        for end in (parent, child, left, right):
            end.close()


def test_a_script_without_a_main_guard_starts_the_span_process(tmp_path: Path) -> None:
    # Under spawn the child used to re-run such a script, fail to start its own child while
    # importing and print a traceback, and the simulator fell back to building in-process.
    script = tmp_path / "plain_script.py"
    script.write_text(
        "from kvscope.emulator.simulator import SimulationSettings, Simulator\n"
        "from kvscope.emulator.workloads import synthetic\n"
        "sim = Simulator(SimulationSettings(profile='tiny'))\n"
        "sim._process_rows_min_turns = 0  # the span process even for a small run\n"
        "result = sim.run(synthetic.generate(conversations=2, seed=1, max_turns=3), 'out.duckdb')\n"
        "print('spans', result.spans)\n"
    )
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "building and writing spans" not in done.stderr
    assert done.stdout.startswith("spans ") and int(done.stdout.split()[1]) > 0

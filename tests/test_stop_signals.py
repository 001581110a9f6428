"""``kvscope.serving.stop_signals``: every serving process waits on it for SIGINT or SIGTERM.

The kernel hands a process-directed signal to any thread that does not block it. A Python
handler runs only on the main thread once it runs bytecode, so a SIGTERM taken by another thread
(DuckDB's, a server's) once left the main thread blocked in its wait for ever: ``kvscope
dashboard`` under load did not exit (tests/dashboards/test_stop.py timed out, 2 of 8 runs here).
"""

from __future__ import annotations

import signal
import threading
import time

from kvscope.serving import stop_signals


def _from_another_thread(signum: int, delay_s: float = 0.2) -> threading.Thread:
    """A thread that sends ``signum`` to itself: the C handler runs there, not on the main
    thread (what the kernel does when it picks another thread)."""
    def send() -> None:
        time.sleep(delay_s)
        signal.pthread_kill(threading.get_ident(), signum)

    thread = threading.Thread(target=send)
    thread.start()
    return thread


def test_a_signal_taken_by_another_thread_wakes_the_waiting_main_thread() -> None:
    with stop_signals() as wait:
        sender = _from_another_thread(signal.SIGTERM)
        started = time.monotonic()
        got = wait(20)
        sender.join()
    assert got == signal.SIGTERM, "the wait gave up: the signal never woke the main thread"
    assert time.monotonic() - started < 20


def test_a_signal_before_the_wait_returns_at_once_and_handlers_are_restored() -> None:
    before = signal.getsignal(signal.SIGINT)
    with stop_signals() as wait:
        signal.raise_signal(signal.SIGINT)  # on the main thread, before anyone waits
        assert wait(5) == signal.SIGINT
        assert wait(0.05) == 0  # one signal, one wake-up
    assert signal.getsignal(signal.SIGINT) is before


def test_other_handled_signals_do_not_end_the_wait() -> None:
    """The wake-up fd carries every signal with a Python handler, not only the stop signals."""
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    try:
        with stop_signals() as wait:
            signal.raise_signal(signal.SIGUSR1)
            assert wait(0.1) == 0
            sender = _from_another_thread(signal.SIGTERM, 0.0)
            assert wait(20) == signal.SIGTERM
            sender.join()
    finally:
        signal.signal(signal.SIGUSR1, previous)

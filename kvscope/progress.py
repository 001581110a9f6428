"""Progress of long commands on stderr, drawn by ``rich`` (never on stdout, which holds results).

:class:`Line` draws one counted task (turns sent of a run, requests done of a replay): on a
terminal rich draws it in place with a bar, elsewhere it is a plain line at most every
``every_s`` seconds (and always at the end). ``kvscope simulate`` and ``kvscope replay`` say what
the line reads; this module draws it.

On a terminal, :func:`steps` shows a live line (spinner, the current step, steps done / total,
elapsed time) that rich redraws in place from its own thread, and :func:`spinner` a spinner with
elapsed time for work that has no steps to count. Elsewhere (a log file, CI, a pipe) rich draws
nothing live, so each step is one plain line instead, which keeps logs short and greppable.
``rich`` is imported on first use (this module is core; the vLLM plugin's path never loads it).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Line:
    """One counted task on ``stream``: ``prefix`` and a text the caller formats per update.

    On a terminal rich draws a bar and the text in place (redrawn from its own thread); elsewhere
    each update is a plain line, at most every ``every_s`` seconds, the last one always.
    """

    def __init__(self, prefix: str, total: int, stream: TextIO | None = None, *,
                 every_s: float = 5.0) -> None:
        self.prefix = prefix
        self.total = total
        self.stream = sys.stderr if stream is None else stream
        self.every_s = every_s  # plain lines only: on a terminal rich redraws at its pace
        self.tty = _is_terminal(self.stream)
        self._last = -float("inf")
        self._live: Any = None
        if self.tty:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn

            self._live = Progress(TextColumn("{task.fields[prefix]}"), BarColumn(),
                                  TextColumn("{task.description}"),
                                  console=Console(file=self.stream), transient=True)
            self._task = self._live.add_task("", total=total or None, prefix=prefix)
            self._live.start()

    def update(self, done: int, text: Callable[[], str]) -> None:
        """``done`` of the total; ``text()`` (called only when drawn) says the rest."""
        if self._live is not None:
            # rich redraws at its own pace: an update is only a few attribute writes.
            self._live.update(self._task, completed=done, description=text())
            return
        now = time.monotonic()
        if now - self._last < self.every_s and done < self.total:
            return
        self._last = now
        self.stream.write(" ".join(p for p in (self.prefix, text()) if p) + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Stop drawing (idempotent)."""
        if self._live is not None:
            self._live.stop()
            self._live = None

    def finish(self, text: str) -> None:
        """Stop drawing and write the closing line ``text`` (after the prefix)."""
        self.close()
        self.stream.write(" ".join(p for p in (self.prefix, text) if p) + "\n")
        self.stream.flush()


@contextmanager
def steps(title: str, total: int, *, stream: TextIO | None = None,
          enabled: bool = True) -> Iterator[Callable[[str], None]]:
    """Yield ``step(name)``: call it as each of ``total`` steps begins.

    The line says ``title: name (k/total)``; the last step is counted done when the block ends.
    """
    out = sys.stderr if stream is None else stream
    if not enabled:
        yield lambda name: None
        return
    started = time.monotonic()
    if not _is_terminal(out):
        done = [0]

        def line(name: str) -> None:
            done[0] += 1
            out.write(f"{title}: {name} ({done[0]}/{total})\n")
            out.flush()

        yield line
        out.write(f"{title}: done in {time.monotonic() - started:.1f} s\n")
        out.flush()
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    console = Console(file=out)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                  transient=True) as progress:
        task = progress.add_task(title, total=total)
        begun = [0]

        def advance(name: str) -> None:
            if begun[0]:
                progress.advance(task)
            begun[0] += 1
            progress.update(task, description=f"{title}: {name}")

        yield advance
    console.print(f"{title}: done in {time.monotonic() - started:.1f} s", highlight=False)


@contextmanager
def spinner(text: str, *, stream: TextIO | None = None) -> Iterator[None]:
    """A spinner with elapsed time while the block runs (a start and an end line elsewhere)."""
    with steps(text, 1, stream=stream) as step:
        step("working")
        yield


__all__ = ["Line", "spinner", "steps"]

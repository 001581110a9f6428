"""Progress of long commands on stderr, drawn by ``rich`` (never on stdout, which holds results).

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
from typing import TextIO


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


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


__all__ = ["spinner", "steps"]

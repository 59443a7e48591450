"""Progress of ``ait.tune`` on the terminal.

One line per graph: ``module/graph``, a bar over its candidates, the candidate being evaluated and its phase
(build, check, probes, round trip, measure), the elapsed time and an estimate of what is left. Drawn with
rich, whose own thread refreshes the line several times a second, so a build that takes minutes still shows
its clock moving.

On by default when standard error is a terminal (rich's convention: nothing is drawn into logs or pipes);
off with ``ait.tune(..., progress=False)`` or ``AITUNE_PROGRESS=0``; ``AITUNE_PROGRESS=1`` forces it on.
"""

from __future__ import annotations

import os
from typing import Any

PHASES = {
    "supports": "checking support",
    "build": "building",
    "build_wait": "waiting for its background build",
    "check": "comparing with eager",
    "probes": "checking probes",
    "round_trip": "save/load round trip",
    "measure": "measuring",
}


def progress_enabled(requested: bool | None) -> bool:
    """``requested`` when given; else ``AITUNE_PROGRESS`` (0/1); else whether stderr is a terminal."""
    if requested is not None:
        return bool(requested)
    setting = os.environ.get("AITUNE_PROGRESS", "").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return False
    if setting in ("1", "true", "yes", "on"):
        return True
    try:
        from rich.console import Console
    except ImportError:
        return False
    return Console(stderr=True).is_terminal


def _terminal_stream():
    """A text stream on a duplicate of standard error's descriptor (None when stderr has no descriptor)."""
    import sys

    try:
        return os.fdopen(os.dup(sys.stderr.fileno()), "w", buffering=1, encoding="utf-8", errors="replace")
    except (AttributeError, OSError, ValueError):  # captured or replaced stderr without a descriptor
        return None


class TuneProgress:
    """The progress display of one ``tune`` run (a no-op object when disabled).

    Args:
        enabled: see :func:`progress_enabled`.
    """

    def __init__(self, enabled: bool | None = None):
        self.enabled = progress_enabled(enabled)
        self._progress: Any = None
        self._task: Any = None
        self._label = ""
        self._stream = None

    def __enter__(self) -> "TuneProgress":
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            # NOTE [progress during builds]: builds send file descriptors 1 and 2 to their build.log
            # (aitune.utils.logging.control_output); the display keeps its own duplicate of the terminal's
            # descriptor, so it stays on screen while a build runs.
            self._stream = _terminal_stream()
            console = Console(file=self._stream) if self._stream is not None else Console(stderr=True)
            self._progress = Progress(SpinnerColumn(), TextColumn("{task.fields[label]}"), BarColumn(bar_width=20),
                                      MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
                                      TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
                                      console=console, refresh_per_second=4)
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def start_graph(self, label: str, candidates: int) -> None:
        """A new graph: ``label`` (``module/graph``) with ``candidates`` evaluations to go (eager included)."""
        self._label = label
        if self._progress is not None:
            if self._task is not None:
                self._progress.update(self._task, status="done")
            self._task = self._progress.add_task(label, total=max(candidates, 1), label=label, status="starting")

    def phase(self, candidate: str, phase: str) -> None:
        """The candidate being evaluated and what it is doing (a key of :data:`PHASES` or free text)."""
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, status=f"{candidate[:40]}: {PHASES.get(phase, phase)}")

    def candidate_done(self) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task)

    def graph_done(self, chosen: str) -> None:
        if self._progress is not None and self._task is not None:
            task = self._progress.tasks[-1]
            self._progress.update(self._task, completed=task.total, status=f"chose {chosen[:50]}")

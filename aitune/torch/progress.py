"""Progress of ``ait.tune`` on the terminal (issue "What users expect", point 1).

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

            self._progress = Progress(SpinnerColumn(), TextColumn("{task.fields[label]}"), BarColumn(bar_width=20),
                                      MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
                                      TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
                                      console=Console(stderr=True), refresh_per_second=4)
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

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

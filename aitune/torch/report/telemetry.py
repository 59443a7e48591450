"""Tuning data: the current (or last) ``ait.tune`` run's report at ``config.tuning_data_output_path``.

Every run's report is written twice: under ``<cache>/reports/tune-<time>.json`` (one file per run, by
:func:`aitune.torch.tuning.tune_modules`) and, overwritten by each run, at
``config.tuning_data_output_path`` (``$AITUNE_TUNING_DATA_PATH``, else
``<cache>/tuning_data/report.json``) — the fixed place the reference system writes its telemetry to.
:func:`snapshot_tuning_data` writes the run in progress (graphs tuned so far) at any time.

The content is aitune's :class:`~aitune.torch.report.rows.TuneReport` JSON (``schema_version`` 1: one row per
candidate with status, reason, build time, latency/throughput, speed-up, errors vs eager), not the
reference's schema-3 layout (README, "Migrating from NVIDIA AITune").
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from aitune.torch.config import config
from aitune.torch.report.rows import TuneReport

logger = logging.getLogger(__name__)

__all__ = ["begin_run", "current_run", "end_run", "snapshot_tuning_data"]

_lock = threading.Lock()
_current: TuneReport | None = None


def begin_run(report: TuneReport) -> None:
    """Make ``report`` the run :func:`snapshot_tuning_data` writes (``tune_modules`` calls this)."""
    global _current
    with _lock:
        _current = report


def current_run() -> TuneReport | None:
    """The run in progress, else the last finished one, else None."""
    return _current


def end_run(report: TuneReport) -> Path | None:
    """Write the finished run to ``config.tuning_data_output_path``; returns that path (None if unwritable)."""
    begin_run(report)
    return _write(report, config.tuning_data_output_path)


def snapshot_tuning_data(path: str | os.PathLike | None = None) -> Path | None:
    """Write the run in progress (or the last one) now.

    Args:
        path: where to write (default ``config.tuning_data_output_path``).

    Returns:
        The path written, or None when no ``ait.tune`` run happened in this process.
    """
    report = current_run()
    if report is None:
        logger.info("aitune: no tuning run to snapshot yet")
        return None
    return _write(report, Path(path) if path is not None else config.tuning_data_output_path)


def _write(report: TuneReport, path: Path) -> Path | None:
    # TuneReport.write_json sets report.path; keep the per-run path the run was published under.
    previous = report.path
    try:
        written = report.write_json(path)
    except OSError as exc:
        logger.warning("aitune: could not write tuning data to %s: %s", path, exc)
        return None
    finally:
        report.path = previous if previous is not None else report.path
    return written

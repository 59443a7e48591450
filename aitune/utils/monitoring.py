"""NVTX ranges and hardware metrics around named scopes (the reference system's ``aitune.utils.monitoring``).

``@annotate(name="inference", color="green")`` (or ``with annotate(...)``) marks a scope:

* with ``AITUNE_NVTX_EVENTS=1`` (``true``/``yes``) and the ``nvtx`` package installed (``pip install
  'aitune[nvtx]'``), the scope is an NVTX range in the domain ``AITune``, visible in Nsight Systems. Without
  the package, or when the variable is unset, nothing is emitted (one INFO line says why when the variable is
  set but the package is missing).
* while hardware metrics are collected, samples taken inside the scope are attributed to it.

Hardware metrics: :func:`enable_hardware_metrics` (or ``AITUNE_HARDWARE_METRICS=1`` when ``aitune.torch`` is
imported) starts a background thread that samples every 100 ms: host CPU utilisation (%), host memory used
and available (bytes, from ``psutil`` when installed, else ``/proc``), PyTorch's CUDA allocated/reserved bytes
per GPU, and, when NVML is available (``nvidia-ml-py``), each GPU's used memory, utilisation (%) and power
(W). :func:`disable_hardware_metrics` stops it and writes the samples as CSV (``AITUNE_HARDWARE_METRICS_PATH``,
else ``hardware_metrics_<YYYYmmdd_HHMMSS>.csv`` in the working directory) and logs a per-scope summary;
:func:`snapshot` writes them without stopping. Collection started by the environment variable is dumped at
exit.

aitune samples from a thread of the process instead of the reference's child process (no second interpreter
to start; the GIL is released while sampling waits), and :func:`get_hardware_metrics` returns a list of dicts
(one per sample) instead of a pandas DataFrame (pandas is not a dependency).
"""

from __future__ import annotations

import atexit
import contextlib
import csv
import datetime
import logging
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable

logger = logging.getLogger(__name__)

__all__ = ["annotate", "annotate_with_nvtx", "disable_hardware_metrics", "dump_metrics", "enable_hardware_metrics",
           "get_hardware_metrics", "hardware_metrics_enabled", "nvtx_enabled", "snapshot"]

NVTX_DOMAIN = "AITune"
SAMPLING_INTERVAL_S = 0.1

_TRUE = ("1", "true", "yes", "on")


def nvtx_enabled() -> bool:
    """``AITUNE_NVTX_EVENTS`` is set to a true value (read at each scope: it can be changed at run time)."""
    return os.environ.get("AITUNE_NVTX_EVENTS", "").strip().lower() in _TRUE


_nvtx_module: Any = None
_nvtx_checked = False


def _nvtx():
    """The ``nvtx`` package, or None (missing: reported once)."""
    global _nvtx_module, _nvtx_checked
    if not _nvtx_checked:
        _nvtx_checked = True
        try:
            import nvtx  # noqa: PLC0415 - optional dependency, imported on first use only

            _nvtx_module = nvtx
        except ImportError:
            logger.info("aitune: AITUNE_NVTX_EVENTS is set but the 'nvtx' package is not installed — pip install "
                        "'aitune[nvtx]'; no NVTX ranges are emitted")
    return _nvtx_module


# --------------------------------------------------------------------------------------------- scopes

_scopes: list[str] = []  # the scopes currently open (innermost last), across threads
_scopes_lock = threading.Lock()


def current_scope() -> str | None:
    """The innermost open scope's name, or None."""
    with _scopes_lock:
        return _scopes[-1] if _scopes else None


class annotate(contextlib.ContextDecorator):  # noqa: N801 - the reference's name, used as a decorator
    """An NVTX range and a hardware-metrics scope: ``@annotate(name=..., color=...)`` or ``with annotate(...)``.

    Args:
        name: the range's name (default: the decorated function's qualified name, else ``"annotated"``).
        color: an NVTX color name (``"green"``, ``"yellow"``...) or None.

    Costs a few attribute reads when neither NVTX nor hardware metrics are on.
    """

    def __init__(self, name: str | None = None, color: str | None = None):
        self.name = name
        self.color = color
        self._state = threading.local()

    def __call__(self, function: Callable) -> Callable:
        if self.name is None:
            self.name = getattr(function, "__qualname__", None) or "annotated"
        return super().__call__(function)

    def __enter__(self) -> "annotate":
        name = self.name or "annotated"
        stack = getattr(self._state, "stack", None)
        if stack is None:
            stack = self._state.stack = []
        entry = [None, False]
        if nvtx_enabled():
            package = _nvtx()
            if package is not None:
                entry[0] = package.start_range(message=name, color=self.color, domain=NVTX_DOMAIN)
        if _collector is not None:
            with _scopes_lock:
                _scopes.append(name)
            entry[1] = True
        stack.append(entry)
        return self

    def __exit__(self, *exc) -> bool:
        entry = self._state.stack.pop()
        if entry[0] is not None:
            _nvtx().end_range(entry[0])
        if entry[1]:
            with _scopes_lock:
                name = self.name or "annotated"
                for index in range(len(_scopes) - 1, -1, -1):
                    if _scopes[index] == name:
                        del _scopes[index]
                        break
        return False


def annotate_with_nvtx(name: str, color: str | None = None) -> contextlib.AbstractContextManager:
    """An NVTX range only (no hardware-metrics scope); a no-op unless NVTX events are on and ``nvtx`` exists."""
    if not nvtx_enabled() or _nvtx() is None:
        return contextlib.nullcontext()
    return _nvtx().annotate(message=name, color=color, domain=NVTX_DOMAIN)


# --------------------------------------------------------------------------------------------- hardware metrics


class _Collector:
    """Samples hardware metrics every ``interval`` seconds on a daemon thread."""

    def __init__(self, interval: float = SAMPLING_INTERVAL_S):
        self.interval = interval
        self.samples: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self._cpu_previous = _read_cpu_times()
        self._nvml = _nvml_handles()
        self.thread = threading.Thread(target=self._run, name="aitune-hardware-metrics", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop_event.wait(self.interval):
            try:
                row = self.sample()
            except Exception:  # noqa: BLE001 - a failing probe must not kill the sampler
                logger.debug("hardware metrics sample failed", exc_info=True)
                continue
            with self.lock:
                self.samples.append(row)

    def sample(self) -> dict[str, Any]:
        row: dict[str, Any] = {"timestamp": time.time(), "scope": current_scope() or "-"}
        row["host_cpu_percent"] = self._cpu_percent()
        row.update(_host_memory())
        row.update(_torch_memory())
        for index, handle in enumerate(self._nvml):
            row.update(_nvml_sample(index, handle))
        return row

    def _cpu_percent(self) -> float | None:
        try:
            import psutil  # noqa: PLC0415 - optional

            return float(psutil.cpu_percent(interval=None))
        except ImportError:
            pass
        now = _read_cpu_times()
        previous, self._cpu_previous = self._cpu_previous, now
        if now is None or previous is None:
            return None
        busy = (now[0] - previous[0])
        total = (now[1] - previous[1])
        return 100.0 * busy / total if total > 0 else 0.0

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=2)

    def rows(self, reset: bool = False) -> list[dict[str, Any]]:
        with self.lock:
            rows = list(self.samples)
            if reset:
                self.samples.clear()
        return rows


def _read_cpu_times() -> tuple[float, float] | None:
    """(busy, total) jiffies from /proc/stat, or None."""
    try:
        with open("/proc/stat") as stat:
            fields = [float(value) for value in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return sum(fields) - idle, sum(fields)


def _host_memory() -> dict[str, Any]:
    try:
        import psutil  # noqa: PLC0415 - optional

        memory = psutil.virtual_memory()
        return {"host_memory_used_bytes": memory.total - memory.available, "host_memory_free_bytes": memory.available}
    except ImportError:
        pass
    values = {}
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                key, rest = line.split(":", 1)
                values[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        return {}
    total, available = values.get("MemTotal"), values.get("MemAvailable")
    if total is None or available is None:
        return {}
    return {"host_memory_used_bytes": total - available, "host_memory_free_bytes": available}


def _torch_memory() -> dict[str, Any]:
    import torch  # noqa: PLC0415 - torch is imported by every caller already

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    row = {}
    for index in range(torch.cuda.device_count()):
        row[f"cuda:{index}_torch_allocated_bytes"] = torch.cuda.memory_allocated(index)
        row[f"cuda:{index}_torch_reserved_bytes"] = torch.cuda.memory_reserved(index)
    return row


def _nvml_handles() -> list:
    try:
        import pynvml  # noqa: PLC0415 - optional (nvidia-ml-py)

        pynvml.nvmlInit()
        return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:  # noqa: BLE001 - no NVML here: host and torch metrics only
        return []


def _nvml_sample(index: int, handle) -> dict[str, Any]:
    import pynvml  # noqa: PLC0415 - only reached when NVML initialised

    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    utilisation = pynvml.nvmlDeviceGetUtilizationRates(handle)
    return {f"cuda:{index}_memory_used_bytes": memory.used, f"cuda:{index}_memory_total_bytes": memory.total,
            f"cuda:{index}_utilization_percent": utilisation.gpu,
            f"cuda:{index}_power_w": pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0}


_collector: _Collector | None = None
_collector_lock = threading.Lock()


def hardware_metrics_enabled() -> bool:
    """Is a collection running?"""
    return _collector is not None


def enable_hardware_metrics(interval_s: float = SAMPLING_INTERVAL_S) -> None:
    """Start collecting (no-op when already collecting)."""
    global _collector
    with _collector_lock:
        if _collector is None:
            _collector = _Collector(interval_s)
            logger.info("aitune: collecting hardware metrics every %.0f ms", interval_s * 1e3)


def disable_hardware_metrics(path: str | os.PathLike | None = None) -> Path | None:
    """Stop collecting; write the samples as CSV and log a per-scope summary.

    Args:
        path: CSV path (default ``AITUNE_HARDWARE_METRICS_PATH``, else ``hardware_metrics_<time>.csv``).

    Returns:
        The CSV written, or None when nothing was collecting.
    """
    global _collector
    with _collector_lock:
        collector, _collector = _collector, None
    if collector is None:
        return None
    collector.stop()
    rows = collector.rows()
    return dump_metrics(rows, path)


def snapshot(path: str | os.PathLike, reset_metrics: bool = True) -> Path | None:
    """Write the samples collected so far to ``path`` (CSV) without stopping; clear them when
    ``reset_metrics``. A no-op with a warning when nothing is collecting."""
    collector = _collector
    if collector is None:
        logger.warning("aitune: hardware metrics snapshot skipped: collection is not active "
                       "(enable_hardware_metrics() or AITUNE_HARDWARE_METRICS=1)")
        return None
    return dump_metrics(collector.rows(reset=reset_metrics), path)


def get_hardware_metrics() -> list[dict[str, Any]] | None:
    """The samples collected so far (one dict per sample), or None when nothing is collecting."""
    collector = _collector
    return None if collector is None else collector.rows()


def dump_metrics(rows: list[dict[str, Any]], path: str | os.PathLike | None = None) -> Path:
    """Write ``rows`` as CSV (union of their keys as columns) and log a per-scope summary; returns the path."""
    if path is None:
        path = os.environ.get("AITUNE_HARDWARE_METRICS_PATH") or \
            f"hardware_metrics_{datetime.datetime.now().strftime('%Y%m%d_%H%M%S')}.csv"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    columns: list[str] = []
    for row in rows:
        columns.extend(key for key in row if key not in columns)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns or ["timestamp", "scope"])
        writer.writeheader()
        writer.writerows(rows)
    logger.info("aitune: hardware metrics (%d samples) written to %s\n%s", len(rows), path, summarize(rows))
    return path


def summarize(rows: list[dict[str, Any]]) -> str:
    """Per scope: samples, mean/max host CPU %, mean host memory used (GiB), GPU utilisation/power when known."""
    from tabulate import tabulate  # noqa: PLC0415 - a core dependency, imported when a summary is made

    by_scope: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_scope.setdefault(row.get("scope", "-"), []).append(row)
    table = []
    for scope, scoped in by_scope.items():
        cpu = [r["host_cpu_percent"] for r in scoped if r.get("host_cpu_percent") is not None]
        memory = [r["host_memory_used_bytes"] for r in scoped if r.get("host_memory_used_bytes") is not None]
        gpu = [v for r in scoped for k, v in r.items() if k.endswith("_utilization_percent")]
        power = [v for r in scoped for k, v in r.items() if k.endswith("_power_w")]
        table.append([scope, len(scoped), _fmt(statistics.fmean(cpu) if cpu else None),
                      _fmt(max(cpu) if cpu else None), _fmt(statistics.fmean(memory) / 2**30 if memory else None),
                      _fmt(statistics.fmean(gpu) if gpu else None), _fmt(max(power) if power else None)])
    return tabulate(table, headers=["scope", "samples", "cpu % mean", "cpu % max", "host mem GiB", "gpu util %",
                                    "gpu power W max"], tablefmt="github")


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def _enable_from_environment() -> None:
    """``AITUNE_HARDWARE_METRICS=1``: collect from import on, dump at exit."""
    if os.environ.get("AITUNE_HARDWARE_METRICS", "").strip().lower() in _TRUE and _collector is None:
        enable_hardware_metrics()
        atexit.register(disable_hardware_metrics)


_enable_from_environment()

"""Peak memory of a stretch of work (``ait.tune``), on the host and on CUDA devices.

NOTE [measuring peak memory]: the host figure is the process's resident-set high-water mark, ``VmHWM`` in
``/proc/self/status``, which the kernel keeps exactly (no sampling that could miss a short peak). Writing
``5`` to ``/proc/self/clear_refs`` resets it to the current resident size (Linux >= 4.0, proc(5)), so a
measurement starts from "now" rather than from the process's start. Where that file cannot be written (other
systems, a locked-down ``/proc``), the figure is ``ru_maxrss`` of ``getrusage``, the high-water mark since
the process started, and the result says so (``host_method``). Resident memory counts everything the process
maps — Python, PyTorch's libraries, the model's weights — not only what tuning allocates; memory of build
steps that run in child processes (:mod:`aitune.torch.backend.isolation`) is not included. Resetting the mark is
process-wide: another reader of ``VmHWM`` in this process sees it restart.

The device figure is ``torch.cuda.max_memory_allocated`` per CUDA device PyTorch had initialised when the
measurement started, reset at the start; the result is the largest device's. It counts PyTorch's caching
allocator only: memory ONNX Runtime or TensorRT take through their own allocators is not in it.

Pauses (:meth:`PeakMemory.paused`) leave out work whose memory use is the point, such as the max-batch-size
search, which grows batches until memory runs out.

Sections (:class:`DeviceSection`) give one stretch of work inside a measurement its own device high-water mark
(each candidate's row: which one needed the memory). A section resets PyTorch's peak counter at its start, so
it first folds the mark reached so far into ``_FOLDED_PEAKS``, which :class:`PeakMemory` reads as well: the
overall figure stays the true high-water mark.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import sys
from pathlib import Path
from typing import Iterator

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def host_peak_bytes() -> int | None:
    """The process's resident high-water mark in bytes (``VmHWM``), or None where /proc has none."""
    try:
        match = re.search(r"^VmHWM:\s+(\d+)\s+kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def available_memory_bytes() -> int | None:
    """Memory the OS reports available (``MemAvailable`` of /proc/meminfo, else free pages), or None."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def reset_host_peak() -> bool:
    """Reset ``VmHWM`` to the current resident size; False where the kernel does not allow it."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return host_peak_bytes() is not None


_FOLDED_PEAKS: dict[int, int] = {}  # device index -> high-water mark before the last DeviceSection reset it


def _fold_and_reset(index: int) -> None:
    _FOLDED_PEAKS[index] = max(_FOLDED_PEAKS.get(index, 0), torch.cuda.max_memory_allocated(index))
    torch.cuda.reset_peak_memory_stats(index)


class DeviceSection:
    """Device memory of one stretch of work: ``peak_bytes`` (the caching allocator's high-water mark while it ran,
    everything allocated at the time included) and ``retained_bytes`` (allocated at its end minus at its start:
    what the work keeps). Both None for a CPU device or where CUDA is not initialised.

    Usage::

        with DeviceSection(device) as section:
            ...                                  # build, check, measure one candidate
        section.peak_bytes, section.retained_bytes
    """

    def __init__(self, device: torch.device | str):
        device = torch.device(device)
        self._index = (device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" and torch.cuda.is_initialized() else None
        self.peak_bytes: int | None = None
        self.retained_bytes: int | None = None
        self._before = 0

    def __enter__(self) -> "DeviceSection":
        if self._index is not None:
            _fold_and_reset(self._index)
            self._before = torch.cuda.memory_allocated(self._index)
        return self

    def __exit__(self, *exc) -> None:
        if self._index is not None:
            self.peak_bytes = torch.cuda.max_memory_allocated(self._index)
            self.retained_bytes = torch.cuda.memory_allocated(self._index) - self._before


def _max_rss_bytes() -> int:
    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return value if sys.platform == "darwin" else value * 1024  # bytes on macOS, KiB on Linux


class PeakMemory:
    """High-water marks of host and device memory from :meth:`start` to :meth:`result` (see the module note).

    Usage::

        peak = PeakMemory()
        peak.start()
        ...                       # the work measured
        with peak.paused():
            ...                   # work left out
        figures = peak.result()   # {"host_bytes", "device_bytes", "host_method"}
    """

    def __init__(self):
        self.host_bytes: int | None = None
        self.device_bytes: int | None = None
        self.host_method = "VmHWM"
        self._devices: list[int] = []
        self._running = False

    def start(self) -> None:
        """Start (or restart after a pause) measuring from the current usage."""
        if not self._devices and torch.cuda.is_available() and torch.cuda.is_initialized():
            self._devices = list(range(torch.cuda.device_count()))
        if self.host_method == "VmHWM" and not reset_host_peak():
            self.host_method = "ru_maxrss"  # since the process started: an upper bound
        for device in self._devices:
            torch.cuda.reset_peak_memory_stats(device)
            _FOLDED_PEAKS.pop(device, None)
        self._running = True

    def stop(self) -> None:
        """Fold the marks since :meth:`start` into the figures."""
        if not self._running:
            return
        self._running = False
        host = host_peak_bytes() if self.host_method == "VmHWM" else _max_rss_bytes()
        if host is not None:
            self.host_bytes = max(self.host_bytes or 0, host)
        for device in self._devices:  # sections inside may have reset the counter: their folded marks count too
            peak = max(torch.cuda.max_memory_allocated(device), _FOLDED_PEAKS.get(device, 0))
            self.device_bytes = max(self.device_bytes or 0, peak)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Leave the work inside out of the figures."""
        running = self._running
        self.stop()
        try:
            yield
        finally:
            if running:
                self.start()

    def result(self) -> dict:
        """``{"host_bytes", "device_bytes", "host_method"}`` (bytes; ``device_bytes`` None without CUDA)."""
        self.stop()
        return {"host_bytes": self.host_bytes, "device_bytes": self.device_bytes, "host_method": self.host_method}

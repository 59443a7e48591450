"""``strategy.enable_find_max_batch_size()``: the largest batch that fits memory (and a latency limit).

Before a graph is tuned, the module runs eagerly on batches grown from the recorded sample with the largest
batch: the batch size doubles until a call runs out of memory, would exceed the memory budget, exceeds the
latency limit, or reaches ``max_batch_size``; then the sizes between the last one that fit and the first one
that did not are bisected. The largest size that fit becomes a recorded sample of the graph (built, checked
and measured like the others), so every candidate is built for the range up to it. The search restores the
module's parameters, buffers and ``training`` flags, and is reported on the graph's report entry
(``GraphReport.max_batch_size``).

NOTE [max batch size and memory]: on CUDA a call that does not fit raises an out-of-memory error, which ends
the growth; ``torch.cuda.max_memory_allocated`` gives each call's peak. On the CPU an allocation that does not
fit is not an error — the kernel's out-of-memory killer ends the process — so the search never runs a batch
whose *predicted* memory exceeds the budget: the bytes of the tensors a call creates (activations and
outputs, counted exactly while they are alive by a ``TorchDispatchMode``, independent of allocator caching)
grow linearly with the batch, so ``peak(b2) ~ peak(b1) * b2 / b1``. The budget is ``max_memory_bytes`` when
given, else ``memory_fraction`` (default 0.5) of the memory the OS reports available when the search starts.
On CUDA the prediction applies only when ``max_memory_bytes`` is given. A ``MemoryError`` or an allocator
error raised anyway also ends the growth.

The reference system sweeps powers of two and keeps the batch size with the best throughput; aitune keeps
the largest batch that fits (the brief of ``enable_find_max_batch_size``) and, like the reference, leaves the
choice among candidates to the strategy, which measures them on every recorded sample including this one.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import statistics
import time
import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from aitune.errors import ConfigError
from aitune.torch.measure.memory import available_memory_bytes
from aitune.torch.record.pytree import tree_flatten, tree_unflatten
from aitune.torch.record.samples import BATCH, Sample, clone_tree

logger = logging.getLogger(__name__)

__all__ = ["MaxBatchSizeSearch", "find_max_batch_size", "peak_tensor_bytes"]


@dataclasses.dataclass(kw_only=True)
class MaxBatchSizeSearch:
    """Settings of the search (see the module docstring).

    Args:
        max_batch_size: never try a larger batch (default 4096).
        max_memory_bytes: memory budget of one call, bytes (default: ``memory_fraction`` of the available
            RAM on CPU; none on CUDA, where running out of memory raises).
        memory_fraction: share of the available RAM used as the CPU budget when ``max_memory_bytes`` is None.
        latency_limit_ms: a batch whose median latency exceeds this does not fit (default: no limit).
        repeats: timed calls per batch size (median taken), after one untimed call.
    """

    max_batch_size: int = 4096
    max_memory_bytes: int | None = None
    memory_fraction: float = 0.5
    latency_limit_ms: float | None = None
    repeats: int = 3

    def __post_init__(self):
        if not isinstance(self.max_batch_size, int) or isinstance(self.max_batch_size, bool) or self.max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be an int >= 1, got {self.max_batch_size!r}")
        if self.max_memory_bytes is not None and (not isinstance(self.max_memory_bytes, int)
                                                  or self.max_memory_bytes <= 0):
            raise ConfigError(f"max_memory_bytes must be a positive int (bytes) or None, got {self.max_memory_bytes!r}")
        if not isinstance(self.memory_fraction, (int, float)) or not 0 < self.memory_fraction <= 1:
            raise ConfigError(f"memory_fraction must lie in (0, 1], got {self.memory_fraction!r}")
        if self.latency_limit_ms is not None and (not isinstance(self.latency_limit_ms, (int, float))
                                                  or not self.latency_limit_ms > 0):
            raise ConfigError(f"latency_limit_ms must be a number > 0 (ms) or None, got {self.latency_limit_ms!r}")
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise ConfigError(f"repeats must be an int >= 1, got {self.repeats!r}")


class _PeakTensorBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages created inside the mode and still alive (views counted once)."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._owners: dict[int, int] = {}

    def _release(self, key: int, nbytes: int) -> None:
        owners = self._owners.get(key)
        if owners is None:
            return
        if owners <= 1:
            del self._owners[key]
            self.live -= nbytes
        else:
            self._owners[key] = owners - 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        # An output sharing storage with one of the op's inputs (a view such as weight.t(), an in-place op)
        # allocated nothing.
        inputs = {leaf.untyped_storage().data_ptr() for leaf in tree_flatten((args, kwargs or {}))[0]
                  if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta"}
        for leaf in tree_flatten(output)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
                storage = leaf.untyped_storage()
                key = storage.data_ptr()
                if not key or key in inputs:
                    continue
                if key not in self._owners:
                    self._owners[key] = 0
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                self._owners[key] += 1
                weakref.finalize(leaf, self._release, key, storage.nbytes())
        return output


def peak_tensor_bytes(run: Callable[[], Any]) -> int:
    """Peak bytes of the tensors ``run()`` creates (activations, outputs), counted while they are alive."""
    with _PeakTensorBytes() as tracker:
        output = run()
        del output
    return tracker.peak


@dataclasses.dataclass
class _Trial:
    batch_size: int
    status: str  # "fits", "out of memory", "over memory budget", "over latency limit", "error"
    latency_ms: float | None = None
    peak_bytes: int | None = None
    reason: str = ""

    @property
    def fits(self) -> bool:
        return self.status == "fits"


def _is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc).lower()
    return "out of memory" in text or "can't allocate memory" in text or "defaultcpuallocator" in text


def batch_of(graph, sample: Sample, batch_size: int) -> Sample:
    """``sample`` resized to ``batch_size`` along every batch axis: sliced, or its rows repeated in order.

    An axis with multiplier ``m`` (e.g. 2 for classifier-free guidance) gets ``m * batch_size`` rows.
    """
    leaves = list(sample.leaves())
    for spec in graph.tensor_specs:
        tensor = leaves[spec.leaf_index]
        for axis, kind in enumerate(spec.axes):
            if kind != BATCH:
                continue
            multiplier = spec.multipliers[axis]
            target = int(round(multiplier * batch_size)) if not math.isnan(multiplier) else batch_size
            rows = torch.arange(target, device=tensor.device) % tensor.shape[axis]
            tensor = tensor.index_select(axis, rows)
        leaves[spec.leaf_index] = tensor.contiguous()
    args, kwargs = tree_unflatten(tree_flatten((sample.args, sample.kwargs))[1], leaves)
    return Sample(args, kwargs, batch_size)


def _seed(graph) -> tuple[Sample, int] | None:
    """The recorded sample with the largest batch, and that batch size."""
    best = None
    for sample in graph.samples:
        size = sample.batch_size
        if size is None:
            continue
        if best is None or size > best[1]:
            best = (sample, size)
    return best


def _declared_cap(graph) -> int | None:
    """The largest batch the user's BatchDim declarations allow (None: no declaration)."""
    caps = []
    for spec in graph.tensor_specs:
        for axis, dim in enumerate(spec.dims):
            if dim is not None and spec.axes[axis] == BATCH:
                multiplier = spec.multipliers[axis]
                caps.append(int(dim.max // (multiplier if not math.isnan(multiplier) else 1)))
    return min(caps) if caps else None


def find_max_batch_size(module: torch.nn.Module, graph, device: torch.device, settings: MaxBatchSizeSearch,
                        restore_state: Callable[[], None] | None = None, *, extend_graph: bool = True) -> dict:
    """Search the largest batch ``module`` runs on ``graph``'s inputs (see the module docstring).

    Args:
        module: the user's module (run eagerly under ``no_grad``; its state is restored after).
        graph: the :class:`~aitune.torch.record.samples.GraphSpec` with recorded samples and a batch axis.
        device: where the module runs (decides how memory is measured).
        settings: limits of the search.
        restore_state: puts the module's parameters/buffers/flags back (called after the search).
        extend_graph: record the found batch as a sample of ``graph`` when it exceeds the recorded ones.

    Returns:
        A JSON-able report: ``status`` (``found`` / ``skipped`` / ``failed``), ``max_batch_size``,
        ``recorded_max_batch_size``, ``stopped_by`` (why the growth ended), ``memory_budget_bytes``,
        ``trials`` (batch size, status, latency ms, peak bytes), ``duration_s``; ``reason`` when skipped or
        failed.
    """
    started = time.perf_counter()
    report: dict[str, Any] = {"enabled": True, "device": str(device), "max_batch_size_cap": settings.max_batch_size,
                              "latency_limit_ms": settings.latency_limit_ms}
    if not graph.has_batch_axis:
        return {**report, "status": "skipped", "reason": "no batch axis recorded: tune with at least two batch "
                                                         "sizes (e.g. batch_sizes=[1, 2]) so aitune can find it"}
    if graph.stateful:
        return {**report, "status": "skipped", "reason": "the module changes its own state in forward: extra calls "
                                                         "would advance it"}
    seed = _seed(graph)
    if seed is None:
        return {**report, "status": "skipped", "reason": "no recorded sample knows its batch size"}
    sample, recorded = seed
    cap = settings.max_batch_size
    declared = _declared_cap(graph)
    if declared is not None:
        cap = min(cap, declared)
    budget = settings.max_memory_bytes
    if budget is None and torch.device(device).type == "cpu":
        available = available_memory_bytes()
        budget = int(available * settings.memory_fraction) if available else None
    report.update(recorded_max_batch_size=recorded, memory_budget_bytes=budget)
    trials: list[_Trial] = []
    try:
        runner = _Runner(module, graph, sample, torch.device(device), settings, budget)
        first = runner.trial(recorded, None)
        trials.append(first)
        if not first.fits:
            return {**report, "status": "failed", "trials": [dataclasses.asdict(t) for t in trials],
                    "reason": f"the recorded batch of {recorded} does not fit: {first.status} {first.reason}".strip(),
                    "duration_s": time.perf_counter() - started}
        good, bad = first, None
        while good.batch_size < cap:
            size = min(good.batch_size * 2, cap)
            trial = runner.trial(size, good)
            trials.append(trial)
            if not trial.fits:
                bad = trial
                break
            good = trial
        first_failure = bad
        while bad is not None and bad.batch_size - good.batch_size > 1:
            middle = (good.batch_size + bad.batch_size) // 2
            trial = runner.trial(middle, good)
            trials.append(trial)
            if trial.fits:
                good = trial
            else:
                bad = trial
        if first_failure is None:
            stopped_by = f"the max_batch_size cap of {cap}"
        else:
            stopped_by = f"{first_failure.status} at batch {first_failure.batch_size}" + (
                f" ({first_failure.reason})" if first_failure.reason else "")
        result = {**report, "status": "found", "max_batch_size": good.batch_size, "stopped_by": stopped_by,
                  "latency_ms": good.latency_ms, "peak_bytes": good.peak_bytes}
        if extend_graph and good.batch_size > recorded:
            extended = batch_of(graph, sample, good.batch_size)
            graph.add(Sample(*clone_tree((extended.args, extended.kwargs)), good.batch_size), extended.leaves())
            result["added_sample"] = True
        logger.info("  max batch size: %d (recorded %d; stopped by %s)", good.batch_size, recorded, stopped_by)
        return {**result, "trials": [dataclasses.asdict(t) for t in trials],
                "duration_s": time.perf_counter() - started}
    finally:
        if restore_state is not None:
            restore_state()
        gc.collect()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()


class _Runner:
    """Runs the module on resized samples and judges each batch size."""

    def __init__(self, module, graph, sample: Sample, device: torch.device, settings: MaxBatchSizeSearch,
                 budget: int | None):
        self.module, self.graph, self.sample = module, graph, sample
        self.device, self.settings, self.budget = device, settings, budget
        self.cuda = device.type == "cuda"

    def _input_bytes(self, sample: Sample) -> int:
        return sum(leaf.numel() * leaf.element_size() for leaf in sample.leaves() if isinstance(leaf, torch.Tensor))

    def trial(self, batch_size: int, previous: _Trial | None) -> _Trial:
        predicted = None
        if self.budget is not None and previous is not None and previous.peak_bytes is not None:
            predicted = int(previous.peak_bytes * batch_size / previous.batch_size)
            if predicted > self.budget:
                return _Trial(batch_size, "over memory budget", peak_bytes=predicted,
                              reason=f"predicted {predicted / 2**20:.1f} MiB > budget {self.budget / 2**20:.1f} MiB")
        inputs = batch_of(self.graph, self.sample, batch_size)
        try:
            with torch.no_grad():
                peak = self._peak(inputs) + self._input_bytes(inputs)
                if self.budget is not None and peak > self.budget:
                    return _Trial(batch_size, "over memory budget", peak_bytes=peak,
                                  reason=f"{peak / 2**20:.1f} MiB > budget {self.budget / 2**20:.1f} MiB")
                latency = self._latency(inputs)
        except Exception as exc:  # noqa: BLE001 - judged below; anything else is a failed trial too
            if self.cuda:
                torch.cuda.empty_cache()
            if _is_out_of_memory(exc):
                return _Trial(batch_size, "out of memory", reason=str(exc).splitlines()[0][:160] if str(exc) else "")
            return _Trial(batch_size, "error", reason=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                          if str(exc) else type(exc).__name__)
        finally:
            del inputs
        limit = self.settings.latency_limit_ms
        if limit is not None and latency > limit:
            return _Trial(batch_size, "over latency limit", latency_ms=latency, peak_bytes=peak,
                          reason=f"{latency:.3f} ms > {limit} ms")
        return _Trial(batch_size, "fits", latency_ms=latency, peak_bytes=peak)

    def _call(self, inputs: Sample):
        return self.module(*inputs.args, **inputs.kwargs)

    def _peak(self, inputs: Sample) -> int:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            self._call(inputs)  # the output is dropped at once: the peak is what counts
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - before
        return peak_tensor_bytes(lambda: self._call(inputs))

    def _latency(self, inputs: Sample) -> float:
        times = []
        for _ in range(self.settings.repeats):
            if self.cuda:
                torch.cuda.synchronize(self.device)
            began = time.perf_counter()
            output = self._call(inputs)
            if self.cuda:
                torch.cuda.synchronize(self.device)
            times.append((time.perf_counter() - began) * 1e3)
            del output
        return statistics.median(times)


def search_for_graph(strategy, module: torch.nn.Module, graph, device: torch.device,
                     restore_state: Callable[[], None] | None = None) -> dict | None:
    """The search a strategy asks for (:meth:`~aitune.torch.TuneStrategy.enable_find_max_batch_size`), or None.

    A reference-style ``profiling_config`` (:mod:`aitune.torch.task.profiling`) caps the search at its largest
    batch size (``batching=False``: skipped). A search that fails is reported and tuning goes on with the
    recorded samples (the reference aborts the graph's tuning instead).
    """
    settings = getattr(strategy, "max_batch_size_search", None)
    if settings is None:
        return None
    if getattr(graph, "phase", None) is not None:  # NOTE [no probes for caches] in aitune/torch/check/probes.py
        return {"enabled": True, "status": "skipped", "reason": f"a {graph.phase} graph's batch is its key/value "
                                                                "cache's: larger batches would need another cache"}
    cap = getattr(strategy.profiling_config, "max_batch_size", None)
    if cap is not None:
        if cap <= 1:
            return {"enabled": True, "status": "skipped", "reason": "profiling_config has batching=False"}
        settings = dataclasses.replace(settings, max_batch_size=min(settings.max_batch_size, cap))
    try:
        return find_max_batch_size(module, graph, device, settings, restore_state)
    except Exception as exc:  # noqa: BLE001 - the search is an aid; tuning goes on with the recorded samples
        logger.warning("  max batch size search failed: %s: %s", type(exc).__name__, exc)
        return {"enabled": True, "status": "failed", "reason": f"{type(exc).__name__}: {exc}"}

"""Measure latency and throughput of a backend on recorded samples (DESIGN.md §6).

Timing: CUDA events around each call on GPU (synchronised after each call), ``time.perf_counter_ns`` on
CPU. Every candidate, eager included, runs under ``torch.no_grad`` with the same warm-up, which is
excluded from the figures (case C19). Calls go round-robin over the samples; a *round* is one call of
each sample. Measuring stops when the median round time is stable (its relative standard error is
below ``stable_rel_error``), when ``time_budget_s`` is spent, or after ``max_rounds``.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Callable, Sequence

import torch

from aitune.errors import ConfigError
from aitune.torch.arguments import KnownFields


@dataclasses.dataclass(kw_only=True)
class ProfilingConfig(KnownFields):
    """How long and how carefully to measure.

    Args:
        warmup_rounds: untimed rounds before measuring (default 3).
        warmup_s: keep warming up until this many seconds have passed too (default 0.3 s: GPU clocks and
            CPU caches settle; a fixed count alone left eager's first figures 2x off on the H200).
        min_rounds / max_rounds: bounds on timed rounds (defaults 5 / 200).
        time_budget_s: stop after this many seconds of timed calls (default 1.5 s per candidate).
        stable_rel_error: stop once the relative standard error of the median round time is below this
            (default 0.01 = 1 %).
        min_noise: the smallest relative noise assumed when comparing candidates (default 0.02 = 2 %).
    """

    warmup_rounds: int = 3
    warmup_s: float = 0.3
    min_rounds: int = 5
    max_rounds: int = 200
    time_budget_s: float = 1.5
    stable_rel_error: float = 0.01
    min_noise: float = 0.02

    def __post_init__(self):
        for name in ("warmup_rounds", "min_rounds", "max_rounds"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"ProfilingConfig.{name} must be an int >= 0, got {value!r}")
        if self.min_rounds < 1 or self.max_rounds < self.min_rounds:
            raise ConfigError("ProfilingConfig needs 1 <= min_rounds <= max_rounds")
        for name in ("time_budget_s", "stable_rel_error", "min_noise", "warmup_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"ProfilingConfig.{name} must be a number >= 0, got {value!r}")


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 100] (numpy's default method)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    position = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclasses.dataclass
class SampleTiming:
    """Latency of one sample over the timed calls, in ms; ``batch_size`` items per call."""

    batch_size: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    std_ms: float
    calls: int


@dataclasses.dataclass
class Measurement:
    """Figures of one backend on one graph.

    Attributes:
        samples: per-sample timings (in the graph's sample order).
        rounds: number of timed rounds; ``round_ms`` their durations.
        throughput: items per second over a round (sum of batch sizes / median round time), samples/s.
        noise: relative noise of the median round time (half the relative inter-quartile range,
            at least ``min_noise``); used to decide whether one candidate truly beats another.
    """

    samples: list[SampleTiming]
    rounds: int
    round_ms: list[float]
    noise: float

    @property
    def median_round_ms(self) -> float:
        return statistics.median(self.round_ms)

    @property
    def throughput(self) -> float:
        items = sum(timing.batch_size for timing in self.samples)
        return items / (self.median_round_ms / 1000.0) if self.median_round_ms > 0 else math.inf

    @property
    def reference(self) -> SampleTiming:
        """The largest-batch sample: its latency is the one shown in reports."""
        return max(self.samples, key=lambda timing: timing.batch_size)

    @property
    def p50_ms(self) -> float:
        return self.reference.p50_ms

    @property
    def p90_ms(self) -> float:
        return self.reference.p90_ms

    @property
    def p99_ms(self) -> float:
        return self.reference.p99_ms

    @property
    def min_batch_latency_ms(self) -> float:
        """Median latency of the smallest-batch sample (what MinLatencyStrategy minimises)."""
        return min(self.samples, key=lambda timing: timing.batch_size).p50_ms

    def latency_for_batch(self, batch_size: int) -> float | None:
        for timing in self.samples:
            if timing.batch_size == batch_size:
                return timing.p50_ms
        return None

    def to_dict(self) -> dict:
        """JSON figures: throughput (samples/s), p50/p90/p99 (ms, reference sample), the median round, the
        number of rounds, their durations ``round_ms`` (ms, in timing order: the distribution reports draw),
        the noise and the per-sample timings."""
        return {"throughput": self.throughput, "p50_ms": self.p50_ms, "p90_ms": self.p90_ms, "p99_ms": self.p99_ms,
                "median_round_ms": self.median_round_ms, "rounds": self.rounds, "round_ms": list(self.round_ms),
                "noise": self.noise, "samples": [dataclasses.asdict(timing) for timing in self.samples]}


def beats(challenger: Measurement, incumbent: Measurement, *, by_latency: bool = False,
          noise: float | None = None) -> bool:
    """True when ``challenger`` is better than ``incumbent`` by more than ``noise`` (default: the larger
    measured noise of the two)."""
    noise = max(challenger.noise, incumbent.noise) if noise is None else noise
    if by_latency:
        return challenger.min_batch_latency_ms * (1 + noise) < incumbent.min_batch_latency_ms
    return challenger.throughput > incumbent.throughput * (1 + noise)


def reaches_speedup(candidate: Measurement, baseline: Measurement, ratio: float) -> bool:
    """True when ``candidate``'s throughput is at least ``ratio`` times ``baseline``'s beyond the noise.

    The rule: ``candidate.throughput > ratio * baseline.throughput * (1 + noise)`` with ``noise`` the larger
    measured relative noise of the two. ``ratio=1`` is :func:`beats`; ``ratio=3`` means "3x the baseline's
    samples/s"; a ratio below 1 admits candidates slower than the baseline by at most that factor.
    """
    noise = max(candidate.noise, baseline.noise)
    return candidate.throughput > ratio * baseline.throughput * (1 + noise)


class Timer:
    """Times one call: CUDA events on a CUDA device, ``perf_counter_ns`` otherwise. Returns ms."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"

    def __call__(self, function: Callable[[], Any]) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            function()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end))
        begin = time.perf_counter_ns()
        function()
        return (time.perf_counter_ns() - begin) / 1e6


def measure(run: Callable[[Any], Any], samples: Sequence[Any], batch_sizes: Sequence[int], device: torch.device,
            config: ProfilingConfig | None = None) -> Measurement:
    """Measure ``run(sample)`` over ``samples``.

    Args:
        run: calls the backend on one prepared sample.
        samples: prepared inputs (reused across calls; cloned by the caller once).
        batch_sizes: items per call for each sample (1 when the batch size is unknown).
        device: where the calls run (decides the timer).
        config: stopping rules.

    Returns:
        A :class:`Measurement`.
    """
    config = config or ProfilingConfig()
    timer = Timer(device)
    with torch.no_grad():
        warmup_started = time.perf_counter()
        rounds = 0
        while rounds < config.warmup_rounds or (time.perf_counter() - warmup_started < config.warmup_s
                                                 and rounds < 1000):
            for sample in samples:
                run(sample)
            rounds += 1
        if timer.cuda:
            torch.cuda.synchronize()
        per_sample: list[list[float]] = [[] for _ in samples]
        round_ms: list[float] = []
        started = time.perf_counter()
        while len(round_ms) < config.max_rounds:
            total = 0.0
            for index, sample in enumerate(samples):
                elapsed = timer(lambda: run(sample))
                per_sample[index].append(elapsed)
                total += elapsed
            round_ms.append(total)
            if len(round_ms) >= config.min_rounds:
                if time.perf_counter() - started > config.time_budget_s:
                    break
                if _relative_standard_error_of_median(round_ms) < config.stable_rel_error and len(round_ms) >= 10:
                    break
    timings = [
        SampleTiming(batch_size=int(batch_size), p50_ms=statistics.median(values), p90_ms=percentile(values, 90),
                     p99_ms=percentile(values, 99), mean_ms=statistics.fmean(values),
                     std_ms=statistics.pstdev(values), calls=len(values))
        for values, batch_size in zip(per_sample, batch_sizes)
    ]
    median = statistics.median(round_ms)
    iqr = percentile(round_ms, 75) - percentile(round_ms, 25)
    noise = max(config.min_noise, (iqr / 2) / median if median > 0 else 0.0)
    return Measurement(samples=timings, rounds=len(round_ms), round_ms=round_ms, noise=noise)


def _relative_standard_error_of_median(values: Sequence[float]) -> float:
    # Standard error of the median ~ 1.2533 * std / sqrt(n) (asymptotic, normal data).
    if len(values) < 2:
        return math.inf
    median = statistics.median(values)
    return 1.2533 * statistics.pstdev(values) / math.sqrt(len(values)) / median if median > 0 else math.inf

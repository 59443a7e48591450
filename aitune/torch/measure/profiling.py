"""Measure latency and throughput of a backend on recorded samples.

Timing: CUDA events around each call on GPU (synchronised after each call), ``time.perf_counter_ns`` on
CPU (read through :data:`CLOCK`). Every candidate, eager included, runs under ``torch.no_grad`` with the same
warm-up, which is excluded from the figures (compile time would otherwise count as run time). Calls go
round-robin over the samples; a *round* is one call of each sample. Measuring stops when the median round
time is stable (its relative standard error is below ``stable_rel_error``), when ``time_budget_s`` is spent,
or after ``max_rounds``.

NOTE [host allocator steady state]: on CPU, how fast a model runs depends on the process's history through
glibc's ``malloc``. A block above the mmap threshold (128 KiB at process start) is mapped fresh for every
allocation and unmapped when freed, so each of eager PyTorch's large activations costs page faults on every
call; glibc raises that threshold (up to 32 MiB on 64-bit) the first time such a block of a given size is
freed (``mallopt(3)``, M_MMAP_THRESHOLD: "dynamic mmap threshold"). So a model measured early in a process
runs slower than the same model measured later: a transformer encoder's eager call can take thousands of page
faults in a fresh process and almost none after one 30 MiB block has been freed, so the first candidate timed,
usually eager, looks slower than it is and every candidate's "x eager" is inflated
(``benchmarks/cpu_allocator.py`` measures it). :func:`settle_host_allocator` frees one 30 MiB block before the
first CPU measurement, which leaves glibc where any longer-running process ends up anyway; under other
allocators it costs one allocation and changes nothing.

NOTE [paired speed-up]: a candidate's speed-up over eager is measured *paired*: :func:`measure_pair` times
one round of eager and one round of the candidate in alternation, and the figure is the median of the
per-round ratios ``eager round ms / candidate round ms`` (:func:`paired_speedup`), with their quartiles and
extremes as its spread. A ratio of two throughputs measured seconds apart divides by whatever load the
machine had in each window; a round pair meets the same load, and the median ignores a minority of rounds
hit by a burst on one side. A figure whose half inter-quartile range exceeds ``NOISY_SPREAD`` (10 %) of its
median is marked noisy (the same bound as a single measurement's noise note in
:mod:`aitune.torch.search.evaluation`; pyperf's ``check`` command flags a benchmark as unstable at a standard
deviation above 10 % of the mean: https://pyperf.readthedocs.io/en/latest/cli.html, "pyperf check").

Time is read from :data:`CLOCK` (``time.perf_counter_ns`` unless :func:`use_clock` sets another, e.g. a fake
clock in tests): the CPU timer, the warm-up and the time budget all use it; on CUDA the calls themselves are
timed with CUDA events.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import statistics
import time
from typing import Any, Callable, Iterator, Sequence

import torch

from aitune.errors import ConfigError
from aitune.torch.common.arguments import KnownFields

CLOCK: contextvars.ContextVar[Callable[[], int]] = contextvars.ContextVar("aitune_clock", default=time.perf_counter_ns)
NOISY_SPREAD = 0.10  # half relative IQR of the per-round ratios above which a speed-up is noisy (NOTE [paired speed-up])


@contextlib.contextmanager
def use_clock(clock: Callable[[], int]) -> Iterator[None]:
    """Measure with ``clock`` (a monotonic time in ns, like ``time.perf_counter_ns``) inside the block: the CPU
    timer, warm-up and time budget read it (NOTE [paired speed-up]). For tests: a fake clock that each fake call
    advances makes every figure known in advance."""
    token = CLOCK.set(clock)
    try:
        yield
    finally:
        CLOCK.reset(token)


@dataclasses.dataclass(kw_only=True)
class ProfilingConfig(KnownFields):
    """How long and how carefully to measure.

    Args:
        warmup_rounds: untimed rounds before measuring (default 3).
        warmup_s: keep warming up until this many seconds have passed too (default 0.3 s: GPU clocks and
            CPU caches settle; a fixed count alone can leave eager's first figures far off).
        min_rounds / max_rounds: bounds on timed rounds (defaults 5 / 200).
        time_budget_s: stop after this many seconds of timed calls (default 1.5 s per candidate; a candidate
            timed in alternation with eager shares it with eager's rounds, :func:`measure_pair`).
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
        paired: for a candidate timed in alternation with a baseline (:func:`measure_pair`), its
            :class:`PairedSpeedup` over that baseline; None when measured alone.
    """

    samples: list[SampleTiming]
    rounds: int
    round_ms: list[float]
    noise: float
    paired: "PairedSpeedup | None" = None

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


@dataclasses.dataclass
class PairedSpeedup:
    """A speed-up measured in alternating rounds (NOTE [paired speed-up]).

    Attributes:
        median: median over rounds of ``baseline round ms / candidate round ms`` (x; > 1 = candidate faster; the
            same as candidate throughput / baseline throughput within a round).
        q25 / q75: its lower and upper quartiles. min / max: the extreme round ratios. rounds: round pairs.
    """

    median: float
    q25: float
    q75: float
    min: float
    max: float
    rounds: int

    @property
    def spread(self) -> float:
        """Half the inter-quartile range relative to the median (as :attr:`Measurement.noise` is defined)."""
        return (self.q75 - self.q25) / 2 / self.median if self.median > 0 else math.inf

    @property
    def noisy(self) -> bool:
        """True when :attr:`spread` exceeds ``NOISY_SPREAD``: the figure is not to be trusted as it stands."""
        return not self.spread <= NOISY_SPREAD

    def to_dict(self) -> dict:
        """``{"q25", "q75", "min", "max", "rounds", "noisy"}`` (the median is the row's ``speedup``)."""
        return {"q25": self.q25, "q75": self.q75, "min": self.min, "max": self.max, "rounds": self.rounds,
                "noisy": self.noisy}

    def reaches(self, ratio: float, min_noise: float) -> bool:
        """True when the median reaches ``ratio`` beyond the noise: ``median > ratio * (1 + noise)``, ``noise`` the
        larger of :attr:`spread` and ``min_noise`` (the rule of :func:`reaches_speedup`, on paired rounds)."""
        return self.median > ratio * (1 + max(self.spread, min_noise))


def paired_speedup(baseline_round_ms: Sequence[float], candidate_round_ms: Sequence[float]) -> PairedSpeedup | None:
    """The paired speed-up of a candidate over a baseline timed in the same rounds (:func:`measure_pair`).

    Args:
        baseline_round_ms / candidate_round_ms: ms per round, aligned round by round (same items per round).

    Returns:
        A :class:`PairedSpeedup`, or None when no round has positive times on both sides.
    """
    ratios = [base / cand for base, cand in zip(baseline_round_ms, candidate_round_ms) if base > 0 and cand > 0]
    if not ratios:
        return None
    return PairedSpeedup(median=statistics.median(ratios), q25=percentile(ratios, 25), q75=percentile(ratios, 75),
                         min=min(ratios), max=max(ratios), rounds=len(ratios))


def reaches_speedup(candidate: Measurement, baseline: Measurement, ratio: float) -> bool:
    """True when ``candidate``'s throughput is at least ``ratio`` times ``baseline``'s beyond the noise.

    The rule: ``candidate.throughput > ratio * baseline.throughput * (1 + noise)`` with ``noise`` the larger
    measured relative noise of the two. ``ratio=1`` is :func:`beats`; ``ratio=3`` means "3x the baseline's
    samples/s"; a ratio below 1 admits candidates slower than the baseline by at most that factor.
    """
    noise = max(candidate.noise, baseline.noise)
    return candidate.throughput > ratio * baseline.throughput * (1 + noise)


class Timer:
    """Times one call: CUDA events on a CUDA device, :data:`CLOCK` (``perf_counter_ns``) otherwise. Returns ms."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.clock = CLOCK.get()

    def __call__(self, function: Callable[[], Any]) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            function()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end))
        begin = self.clock()
        function()
        return (self.clock() - begin) / 1e6


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
    [(per_sample, round_ms)] = _timed_rounds([(run, samples)], device, config)
    return _summary(per_sample, round_ms, batch_sizes, config)


def measure_pair(run_a: Callable[[Any], Any], samples_a: Sequence[Any], run_b: Callable[[Any], Any],
                 samples_b: Sequence[Any], batch_sizes: Sequence[int], device: torch.device,
                 config: ProfilingConfig | None = None) -> tuple[Measurement, Measurement]:
    """Measure two runs in alternation: each round times one round of ``a`` and one of ``b``, which goes
    first swapping every round, so both meet the same machine conditions (clocks, heat, other load).

    Measured one after the other, two runs differ also by how the machine drifted between them (the same
    callable can move by tens of percent between two-second windows on a shared machine); compared in
    alternation they do not. Same warm-up and stopping rules as :func:`measure` (the time budget covers
    both runs; stable means both medians are).

    Args:
        run_a / run_b: call one prepared sample; samples_a / samples_b: their samples, in the same order
            as ``batch_sizes`` (one entry per sample, items per call).
        device: where the calls run (decides the timer). config: stopping rules.

    Returns:
        ``(measurement of a, measurement of b)``; compare them with :func:`beats`.
    """
    config = config or ProfilingConfig()
    (per_a, rounds_a), (per_b, rounds_b) = _timed_rounds([(run_a, samples_a), (run_b, samples_b)], device, config)
    return _summary(per_a, rounds_a, batch_sizes, config), _summary(per_b, rounds_b, batch_sizes, config)


_ALLOCATOR_SETTLED = False
_SETTLE_BYTES = 30 * 2**20  # under glibc's 32 MiB ceiling for the dynamic threshold, with room for headers


def settle_host_allocator() -> None:
    """Bring the host allocator to its steady state before CPU timing (once per process; see NOTE [host
    allocator steady state]): allocates and frees one 30 MiB block (not touched, so no page is written)."""
    global _ALLOCATOR_SETTLED
    if not _ALLOCATOR_SETTLED:
        torch.empty(_SETTLE_BYTES, dtype=torch.uint8)  # freed as soon as made
        _ALLOCATOR_SETTLED = True


def interleaved_round_ms(calls: Sequence[Callable[[], Any]], device: torch.device,
                         config: ProfilingConfig | None = None) -> list[list[float]]:
    """Time several callables in alternation: each round calls every one once, the order rotating every
    round. Returns, per callable, its ms per round; the lists are aligned round by round, so per-round ratios
    (``statistics.median(a / b for a, b in zip(...))``) compare calls made under the same machine conditions.
    Same warm-up and stopping rules as :func:`measure`."""
    runs = [(lambda _, call=call: call(), [None]) for call in calls]
    return [round_ms for _, round_ms in _timed_rounds(runs, device, config or ProfilingConfig())]


def _timed_rounds(runs: list[tuple[Callable[[Any], Any], Sequence[Any]]], device: torch.device,
                  config: ProfilingConfig) -> list[tuple[list[list[float]], list[float]]]:
    """Warm up every run, then time rounds of each in turn (the order rotating every round) until the
    stopping rules hold for all; per run: ``(ms per call of each sample, ms per round)``."""
    timer = Timer(device)
    clock = CLOCK.get()
    if not timer.cuda:
        settle_host_allocator()
    with torch.no_grad():
        warmup_started = clock()
        rounds = 0
        while rounds < config.warmup_rounds or ((clock() - warmup_started) / 1e9 < config.warmup_s
                                                 and rounds < 1000):
            for run, samples in runs:
                for sample in samples:
                    run(sample)
            rounds += 1
        if timer.cuda:
            torch.cuda.synchronize()
        results = [([[] for _ in samples], []) for _, samples in runs]
        started = clock()
        timed = 0
        while timed < config.max_rounds:
            for offset in range(len(runs)):
                which = (timed + offset) % len(runs)
                (run, samples), (per_sample, round_ms) = runs[which], results[which]
                total = 0.0
                for index, sample in enumerate(samples):
                    elapsed = timer(lambda: run(sample))
                    per_sample[index].append(elapsed)
                    total += elapsed
                round_ms.append(total)
            timed += 1
            if timed >= config.min_rounds:
                if (clock() - started) / 1e9 > config.time_budget_s:
                    break
                if timed >= 10 and all(_relative_standard_error_of_median(round_ms) < config.stable_rel_error
                                       for _, round_ms in results):
                    break
    return results


def _summary(per_sample: list[list[float]], round_ms: list[float], batch_sizes: Sequence[int],
             config: ProfilingConfig) -> Measurement:
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

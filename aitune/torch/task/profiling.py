"""``aitune.torch.task.profiling``: the reference system's profiling configuration, on aitune's measurement.

``ProfilingConfig(batch_sizes=[...], measurement_stop_strategy=..., ...)`` is accepted wherever a strategy
takes a ``profiling_config`` (it is an :class:`aitune.torch.measure.profiling.ProfilingConfig`). How it maps:

* the *measurement stop strategy* decides how long each candidate is measured:
  :class:`NumStepsMeasuringStopStrategy` → ``warmup_samples`` warm-up rounds, then exactly ``num_steps``
  timed rounds; :class:`StableWindowMeasuringStopStrategy` → ``warmup_samples`` warm-up rounds, then at least
  ``window_size`` and at most ``max_samples`` timed rounds, stopping once the window is stable (coefficient of
  variation ``max_cv_ratio``, turned into aitune's relative standard error of the median:
  ``1.2533 * cv / sqrt(window)``);
* ``batch_sizes``: the largest entry caps :meth:`~aitune.torch.TuneStrategy.enable_find_max_batch_size`'s search;
* the *profiling stop strategies* (:class:`ThroughputSaturatedProfilingStopStrategy`,
  :class:`AllSamplesProfilingStopStrategy`) end the reference's batch-size sweep. aitune does not sweep: it
  measures every candidate on the recorded samples (each recorded batch size, plus the one the max-batch-size
  search adds), so these are accepted and kept for reports, and do not change the measurement.
* ``batching=False`` makes the max-batch-size search a no-op (the reference then profiles batch size 1 only).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable

from aitune.errors import ConfigError
from aitune.torch.measure.profiling import ProfilingConfig as _MeasurementConfig

__all__ = ["AllSamplesProfilingStopStrategy", "ModelExecutionTimeMeasuringStrategy", "NumStepsMeasuringStopStrategy",
           "ProfilingConfig", "StableWindowMeasuringStopStrategy", "ThroughputSaturatedProfilingStopStrategy",
           "get_throughput"]


@dataclasses.dataclass
class ModelExecutionTimeMeasuringStrategy:
    """Time each call (CUDA-synchronised wall time): what aitune's timer does (:class:`aitune.torch.measure.profiling.Timer`)."""


@dataclasses.dataclass
class NumStepsMeasuringStopStrategy:
    """``warmup_samples`` untimed calls, then ``num_steps`` timed ones."""

    num_steps: int = 20
    warmup_samples: int = 10

    def __post_init__(self):
        _positive_int(self.num_steps, "num_steps")
        _non_negative_int(self.warmup_samples, "warmup_samples")


@dataclasses.dataclass
class StableWindowMeasuringStopStrategy:
    """Stop once the last ``window_size`` timings vary by at most ``max_cv_ratio`` (std / mean)."""

    window_size: int = 20
    max_cv_ratio: float = 0.10
    warmup_samples: int = 10
    max_samples: int = 100

    def __post_init__(self):
        _positive_int(self.window_size, "window_size")
        _non_negative_int(self.warmup_samples, "warmup_samples")
        _positive_int(self.max_samples, "max_samples")
        if self.max_samples < self.window_size:
            raise ConfigError("max_samples must be >= window_size")
        if not isinstance(self.max_cv_ratio, (int, float)) or not self.max_cv_ratio > 0:
            raise ConfigError(f"max_cv_ratio must be a number > 0, got {self.max_cv_ratio!r}")


@dataclasses.dataclass
class ThroughputSaturatedProfilingStopStrategy:
    """Reference sweep rule (accepted, not used by aitune: see the module docstring)."""

    min_throughput_gain_ratio: float = 0.05
    throughput_backoff_limit: int = 2


@dataclasses.dataclass
class AllSamplesProfilingStopStrategy:
    """Reference sweep rule: never stop early (accepted, not used by aitune: see the module docstring)."""


@dataclasses.dataclass
class ProfilingConfig(_MeasurementConfig):
    """The reference system's profiling configuration (see the module docstring for how it maps).

    Args:
        batch_sizes: non-empty list (or generator) of batch sizes >= 1.
        batching: False: batch size 1 only (the max-batch-size search is skipped).
        measuring_strategy: default :class:`ModelExecutionTimeMeasuringStrategy`.
        measurement_stop_strategy: default :class:`NumStepsMeasuringStopStrategy`.
        profiling_stop_strategy: default :class:`ThroughputSaturatedProfilingStopStrategy`.

    Raises:
        ConfigError: empty or invalid ``batch_sizes``, or a stop strategy of an unknown type.
    """

    batch_sizes: Any = None
    batching: bool = True
    measuring_strategy: Any = None
    measurement_stop_strategy: Any = None
    profiling_stop_strategy: Any = None

    def __post_init__(self):
        if self.batch_sizes is None:
            raise ConfigError("ProfilingConfig needs batch_sizes, e.g. [2**n for n in range(8)]")
        sizes = list(self.batch_sizes) if isinstance(self.batch_sizes, Iterable) else None
        if not sizes or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in sizes):
            raise ConfigError(f"batch_sizes must be a non-empty list of ints >= 1, got {self.batch_sizes!r}")
        self.batch_sizes = sizes
        if not isinstance(self.batching, bool):
            raise ConfigError(f"batching must be a bool, got {self.batching!r}")
        self.measuring_strategy = self.measuring_strategy or ModelExecutionTimeMeasuringStrategy()
        self.measurement_stop_strategy = self.measurement_stop_strategy or NumStepsMeasuringStopStrategy()
        self.profiling_stop_strategy = self.profiling_stop_strategy or ThroughputSaturatedProfilingStopStrategy()
        stop = self.measurement_stop_strategy
        if isinstance(stop, NumStepsMeasuringStopStrategy):
            self.warmup_rounds, self.warmup_s = stop.warmup_samples, 0.0
            self.min_rounds = self.max_rounds = stop.num_steps
            self.time_budget_s, self.stable_rel_error = math.inf, 0.0
        elif isinstance(stop, StableWindowMeasuringStopStrategy):
            self.warmup_rounds, self.warmup_s = stop.warmup_samples, 0.0
            self.min_rounds, self.max_rounds = stop.window_size, stop.max_samples
            self.time_budget_s = math.inf
            self.stable_rel_error = 1.2533 * stop.max_cv_ratio / math.sqrt(stop.window_size)
        else:
            raise ConfigError(f"measurement_stop_strategy must be NumStepsMeasuringStopStrategy or "
                              f"StableWindowMeasuringStopStrategy, got {type(stop).__name__}")
        if not isinstance(self.profiling_stop_strategy, (ThroughputSaturatedProfilingStopStrategy,
                                                         AllSamplesProfilingStopStrategy)):
            raise ConfigError(f"profiling_stop_strategy must be ThroughputSaturatedProfilingStopStrategy or "
                              f"AllSamplesProfilingStopStrategy, got {type(self.profiling_stop_strategy).__name__}")
        super().__post_init__()

    @property
    def max_batch_size(self) -> int:
        """The largest batch size listed (1 when ``batching`` is off)."""
        return max(self.batch_sizes) if self.batching else 1


def get_throughput(batch_size: int, execution_times_ns: list[float]) -> float:
    """Samples per second of calls of ``batch_size`` items taking ``execution_times_ns`` (mean), as the reference
    computes it: ``batch_size * 1e9 / mean(ns)``."""
    if not execution_times_ns:
        raise ConfigError("get_throughput needs at least one execution time")
    mean = sum(execution_times_ns) / len(execution_times_ns)
    return batch_size * 1e9 / mean if mean > 0 else math.inf


def _positive_int(value: Any, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be an int >= 1, got {value!r}")


def _non_negative_int(value: Any, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{name} must be an int >= 0, got {value!r}")

"""OneBackendStrategy: build exactly one backend; its errors are raised, not swallowed."""

from __future__ import annotations

from aitune.errors import ConfigError
from aitune.torch.backend.base import Backend
from aitune.torch.profiling import beats
from aitune.torch.report import REJECTED_PERFORMANCE
from aitune.torch.tune_strategy.base import TuneStrategy


class OneBackendStrategy(TuneStrategy):
    """Use ``backend``; build or correctness errors propagate (the original error, cause chained).

    With performance validation on (the default), a backend that does not beat eager by more than the
    measured noise times ``min_speedup_ratio`` is not used: eager runs instead, and the report says so.

    Raises:
        ConfigError: if ``backend`` is not a single Backend.
    """

    def __init__(self, backend: Backend, **kwargs):
        if not isinstance(backend, Backend):
            raise ConfigError(f"OneBackendStrategy takes one backend instance, got {backend!r}")
        super().__init__([backend], **kwargs)

    def tune(self, context):
        candidate = self.evaluate(self.backends[0], context, raise_errors=True)
        rows = [candidate.row]
        if self.performance_validation:
            eager = self.eager_candidate(context)
            rows.append(eager.row)
            if not _fast_enough(candidate.measurement, eager.measurement, self.min_speedup_ratio):
                candidate.row.status = REJECTED_PERFORMANCE
                candidate.row.reason = f"not faster than eager ({candidate.row.speedup:.2f}x)"
                self.finish(eager, [candidate, eager])
                return eager.backend, rows, "performance validation: the backend did not beat eager"
        self.finish(candidate, [candidate])
        return candidate.backend, rows, "the only backend requested"


def _fast_enough(measurement, eager_measurement, min_speedup_ratio: float) -> bool:
    if measurement is None or eager_measurement is None:
        return True
    scaled = type(eager_measurement)(eager_measurement.samples, eager_measurement.rounds,
                                     [t * min_speedup_ratio for t in eager_measurement.round_ms],
                                     eager_measurement.noise)
    return beats(measurement, scaled) if min_speedup_ratio >= 1.0 else not beats(scaled, measurement)

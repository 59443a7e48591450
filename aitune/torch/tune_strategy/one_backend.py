"""OneBackendStrategy: build exactly one backend; its errors are raised, not swallowed."""

from __future__ import annotations

from aitune.errors import ConfigError
from aitune.torch.backend.base import Backend
from aitune.torch.report.rows import REJECTED_PERFORMANCE
from aitune.torch.tune_strategy.base import TuneStrategy


class OneBackendStrategy(TuneStrategy):
    """Use ``backend``; build or correctness errors propagate (the original error, cause chained).

    With performance validation on (the default), a backend that does not reach ``min_speedup_ratio`` x
    eager's throughput beyond the measured noise is not used: eager runs instead, and the report says so.

    Args:
        backend: the one backend to build.
        **kwargs: as for :class:`~aitune.torch.tune_strategy.TuneStrategy` (``profiling_config``, ``tolerance``).

    Raises:
        ConfigError: if ``backend`` is not a single Backend.
    """

    def __init__(self, backend: Backend, **kwargs):
        if not isinstance(backend, Backend):
            raise ConfigError(f"OneBackendStrategy takes one backend instance, got {backend!r}")
        super().__init__([backend], **kwargs)

    def tune(self, context):
        """Build, check and (with validation) measure the one backend; raises its original error."""
        candidate = self.evaluate(self.backends[0], context, raise_errors=True)
        eager = self.eager_candidate(context) if self.performance_validation else None
        rows = [candidate.row] + ([eager.row] if eager else [])
        if not self.fast_enough(candidate, eager):
            candidate.row.status = REJECTED_PERFORMANCE
            candidate.row.reason = self.speedup_reason(candidate)
            self.finish(eager, [candidate, eager])
            return eager.backend, rows, "performance validation: the backend did not beat eager"
        self.finish(candidate, [candidate] + ([eager] if eager else []))
        return candidate.backend, rows, "the only backend requested"

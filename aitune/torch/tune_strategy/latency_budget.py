"""LatencyBudgetStrategy: best throughput among candidates whose latency fits a budget."""

from __future__ import annotations

import math

from aitune.errors import ConfigError, TuningError
from aitune.torch.report.rows import REJECTED_PERFORMANCE
from aitune.torch.tune_strategy.base import Candidate, TuneStrategy


class LatencyBudgetStrategy(TuneStrategy):
    """For each correct candidate, take the recorded samples whose median latency is within
    ``latency_budget_ms``; its score is the best throughput (batch / latency) among them. Highest score wins,
    with the tie rule every strategy uses (:meth:`TuneStrategy.pick`: within the top candidate's noise, the
    simpler one).

    Args:
        latency_budget_ms: per-call latency budget, ms (> 0).
        backends: as for :class:`TuneStrategy`.

    Raises:
        ConfigError: for a non-positive budget.
        TuningError: (from ``tune``) when no candidate, eager included, meets the budget.
    """

    def __init__(self, latency_budget_ms: float, backends=None, **kwargs):
        if not isinstance(latency_budget_ms, (int, float)) or not math.isfinite(latency_budget_ms) \
                or latency_budget_ms <= 0:
            raise ConfigError(f"latency_budget_ms must be a number > 0 (milliseconds), got {latency_budget_ms!r}")
        super().__init__(backends, **kwargs)
        self.latency_budget_ms = float(latency_budget_ms)

    def describe(self) -> str:
        return super().describe()[:-1] + f", latency_budget_ms={self.latency_budget_ms})"

    def budget_score(self, candidate: Candidate) -> float | None:
        """Best items/ms among the samples whose median latency fits the budget; None when none fits."""
        fits = [t.batch_size / t.p50_ms for t in candidate.measurement.samples if t.p50_ms <= self.latency_budget_ms]
        return max(fits) if fits else None

    def _budget_figure(self, candidate: Candidate) -> tuple[float, str] | None:
        score = self.budget_score(candidate) if candidate.measurement is not None else None
        return None if score is None else (score, f"{score:.3g} samples/ms within {self.latency_budget_ms} ms")

    def choose(self, pool: list[Candidate], where: str = "") -> Candidate:
        """The chosen candidate among evaluated ones (rows of those over budget are marked).

        Raises:
            TuningError: when no passing candidate meets the budget.
        """
        scored = []
        for candidate in pool:
            if not self.selectable(candidate):
                continue
            if self.budget_score(candidate) is None:
                candidate.row.status = REJECTED_PERFORMANCE
                candidate.row.reason = (f"latency {candidate.measurement.min_batch_latency_ms:.3f} ms at the "
                                        f"smallest batch exceeds the budget of {self.latency_budget_ms} ms")
            else:
                scored.append(candidate)
        if not scored:
            raise TuningError(f"no backend meets the latency budget of {self.latency_budget_ms} ms for "
                              f"{where or 'this graph'}; raise the budget or use smaller batches")
        return self.pick(scored, score=self.budget_score)

    def tune(self, context):
        """Evaluate every candidate, then choose by :meth:`choose`."""
        eager = self.eager_candidate(context)
        candidates = list(self.evaluate_in_order(self.candidates_for(context), context))
        pool = candidates + [eager]
        chosen = self.choose(pool, f"{context.module_name}/{context.graph.name}")
        self.finish(chosen, pool, self._budget_figure)
        return chosen.backend, [c.row for c in pool], f"best throughput within {self.latency_budget_ms} ms"

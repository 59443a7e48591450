"""FirstWinsStrategy: the first backend that builds, passes the check and beats eager."""

from __future__ import annotations

from aitune.torch.report.rows import REJECTED_PERFORMANCE, SKIPPED, CandidateResult
from aitune.torch.tune_strategy.base import TuneStrategy


class FirstWinsStrategy(TuneStrategy):
    """Try backends in order; take the first that builds, matches eager and (with performance validation,
    the default) reaches ``min_speedup_ratio`` x eager's throughput beyond the noise. Later backends are
    skipped. None wins: eager."""

    def tune(self, context):
        """Evaluate the backends in order until one wins; see the class docstring."""
        eager = self.eager_candidate(context) if self.performance_validation else None
        rows: list[CandidateResult] = []
        blueprints = self.candidates_for(context)
        for position, candidate in enumerate(self.evaluate_in_order(blueprints, context,
                                                                    measure_it=self.performance_validation)):
            rows.append(candidate.row)
            if not self.selectable(candidate):
                if candidate.backend is not None:
                    candidate.backend.deactivate()
                continue
            if not self.fast_enough(candidate, eager):
                candidate.row.status = REJECTED_PERFORMANCE
                candidate.row.reason = self.speedup_reason(candidate)
                candidate.backend.deactivate()
                continue
            for skipped in blueprints[position + 1:]:
                rows.append(CandidateResult(module=context.module_name, graph=context.graph.name,
                                            backend=skipped.name, description=skipped.describe(), status=SKIPPED,
                                            reason="an earlier backend won"))
            self.finish(candidate, [candidate] + ([eager] if eager else []))
            if eager is not None:
                rows.append(eager.row)
            return candidate.backend, rows, "first backend that passed" + (" and beat eager" if eager else "")
        if eager is None:
            eager = self.eager_candidate(context)
        rows.append(eager.row)
        self.finish(eager, [eager])
        return eager.backend, rows, "no backend passed and beat eager: eager is used"

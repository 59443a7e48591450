"""MaxThroughputStrategy: the correct candidate with the highest throughput (samples/s)."""

from __future__ import annotations

from aitune.torch.tune_strategy.base import TuneStrategy


class MaxThroughputStrategy(TuneStrategy):
    """Evaluate every backend; choose the highest throughput over the recorded samples (all batch sizes).

    Eager is measured in the same run and competes (unless performance validation is off). A candidate
    must beat the best by more than the measured noise; within the noise the simpler one wins (eager,
    then AOT over JIT, then shorter build). This is the default strategy.
    """

    by_latency = False

    def tune(self, context):
        eager = self.eager_candidate(context)
        candidates = [self.evaluate(blueprint, context) for blueprint in self.candidates(context.device)]
        pool = candidates + [eager]
        contenders = pool if self.performance_validation else (
            [c for c in candidates if c.passed] or [eager])
        if self.performance_validation and self.min_speedup_ratio != 1.0:
            from aitune.torch.tune_strategy.one_backend import _fast_enough

            contenders = [eager] + [c for c in candidates if c.passed and _fast_enough(
                c.measurement, eager.measurement, self.min_speedup_ratio)]
        chosen = self.pick(contenders, by_latency=self.by_latency)
        fastest = self.pick_fastest(contenders, by_latency=self.by_latency)
        self.finish(chosen, pool)
        metric = "lowest latency at the smallest batch" if self.by_latency else "highest throughput"
        why = f"{metric} among {sum(c.backend is not None for c in pool)} correct candidates"
        if chosen is not fastest:
            why += f" (within the measured noise of {fastest.row.description}, the simpler one is kept)"
        return chosen.backend, [c.row for c in pool], why

"""MaxThroughputStrategy: the correct candidate with the highest paired speed-up over eager's throughput."""

from __future__ import annotations

from aitune.torch.report.rows import REJECTED_PERFORMANCE
from aitune.torch.tune_strategy.base import TuneStrategy, latency_figure


class MaxThroughputStrategy(TuneStrategy):
    """Evaluate every backend; choose the highest throughput over the recorded samples (all batch sizes), judged
    by each candidate's paired speed-up over eager (timed in alternation with it, NOTE [paired speed-up] in
    :mod:`aitune.torch.measure.profiling`), so load that comes and goes between measurements does not decide.

    Eager is measured in the same run and competes (unless performance validation is off). A candidate
    must beat the best by more than the measured noise; within the noise the simpler one wins (eager,
    then AOT over JIT, then shorter build), unless another tied candidate, timed head to head against it, is
    faster beyond that figure's own noise (:meth:`TuneStrategy.settle_tie`, NOTE [head to head]). With
    ``min_speedup_ratio`` r, only candidates reaching r x eager's throughput compete with eager. With more
    candidates than ``finalists`` (3), every candidate gets a quick measurement and only the finalists the full one (successive halving, see
    :meth:`TuneStrategy.search`). This is the default strategy.
    """

    by_latency = False

    def tune(self, context):
        """Evaluate every candidate, then choose; see the class docstring and :meth:`TuneStrategy.search`."""
        eager = self.eager_candidate(context)
        candidates = self.search(context, by_latency=self.by_latency)
        pool = candidates + [eager]
        if self.performance_validation:
            contenders = [eager]
            for candidate in candidates:
                if not self.selectable(candidate) or not candidate.row.details.get("finalist", True):
                    continue
                if self.min_speedup_ratio != 1.0 and not self.fast_enough(candidate, eager):
                    candidate.row.status = REJECTED_PERFORMANCE
                    candidate.row.reason = self.speedup_reason(candidate)
                    continue
                contenders.append(candidate)
        else:
            contenders = [c for c in candidates if self.selectable(c) and c.row.details.get("finalist", True)] \
                or [eager]
        chosen = self.pick(contenders, by_latency=self.by_latency)
        fastest = self.pick_fastest(contenders, by_latency=self.by_latency)
        settled: list[str] = []
        if not self.by_latency:  # a latency ranking has no paired figure to settle with
            chosen, settled = self.settle_tie(chosen, self.tied(contenders), context)
        any_passed = any(c.passed for c in candidates)  # before finish(): the chosen row becomes "selected"
        self.finish(chosen, pool, latency_figure if self.by_latency else None)
        self.runners_up = self.rank([c for c in contenders if c is not chosen and c is not eager],
                                    by_latency=self.by_latency)[:2]
        metric = "lowest latency at the smallest batch" if self.by_latency else \
            "highest throughput (paired speed-up over eager)"
        correct = sum(c.passed or c is chosen for c in contenders)
        correct_in_all = sum(c.passed or c is chosen for c in pool)
        if not any_passed:
            why = "no candidate passed its checks (see the rows above), so eager runs"
        else:
            why = f"{metric} among {correct} correct candidate{'s' if correct != 1 else ''}"
            if eager in contenders and correct > 1:
                why += " (eager included)"
            if correct_in_all > correct:  # the others passed but were measured only briefly (successive halving)
                why += f" measured in full ({correct_in_all} passed their checks)"
        if settled:
            why += f" (tied within the noise of their speed-ups over eager; {'; '.join(settled)})"
        elif chosen is not fastest:
            why += f" (within the measured noise of {fastest.row.description}, the simpler one is kept)"
        return chosen.backend, [c.row for c in pool], why

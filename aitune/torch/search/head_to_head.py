"""Two passing candidates timed against each other, for the strategy's tie rule (NOTE [head to head]).

NOTE [head to head]: each candidate's speed-up over eager is paired with eager (NOTE [paired speed-up] in
:mod:`aitune.torch.measure.profiling`), so its spread is mostly eager's own jitter when eager is many times
slower: ResNet-50 at batch 1 on an H100 (2026-12-07, ``benchmarks/gpu_search.py``), eager 8.3 ms a call and
launch-bound, gave per-round ratios of 8.4-16.7x for a candidate at 0.51 ms, and a tie with one at 0.83 ms whose
figure was 10.0x; the simpler one was kept. Timed against each other, the two differ clearly. The strategy
measures the two this way before it keeps the simpler of two tied candidates
(:meth:`aitune.torch.tune_strategy.base.TuneStrategy.settle_tie`).
"""

from __future__ import annotations

import logging

from aitune.torch.backend.base import one_line
from aitune.torch.check.context import GraphContext
from aitune.torch.measure.profiling import PairedSpeedup, ProfilingConfig, measure_pair, paired_speedup
from aitune.torch.search.evaluation import Candidate, graph_samples, sample_caller

logger = logging.getLogger(__name__)


def head_to_head(incumbent: Candidate, challenger: Candidate, context: GraphContext,
                 config: ProfilingConfig) -> PairedSpeedup | None:
    """``challenger``'s speed-up over ``incumbent``, the two timed in alternation on the graph's samples
    (:func:`aitune.torch.measure.profiling.measure_pair`, then :func:`paired_speedup`: median of the per-round
    ratios ``incumbent round ms / challenger round ms``, > 1 = challenger faster), both released afterwards.

    Both are called on the recorded samples as in their measurement against eager (a key/value cache reset to its
    recorded state before each call, inputs the module mutates copied).

    Returns:
        The paired figure, or None when a call failed (logged; the tie stands).
    """
    samples, batch_sizes = graph_samples(context)
    try:
        first, second = measure_pair(sample_caller(incumbent.backend, context), samples,
                                     sample_caller(challenger.backend, context), samples, batch_sizes, context.device,
                                     config)
    except Exception as exc:  # noqa: BLE001 - both already passed their checks; the tie rule decides then
        logger.warning("  head-to-head of %s and %s failed: %s", incumbent.row.description,
                       challenger.row.description, one_line(exc))
        return None
    finally:
        incumbent.backend.deactivate()
        challenger.backend.deactivate()
    return paired_speedup(first.round_ms, second.round_ms)

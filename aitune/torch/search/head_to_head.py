"""Passing candidates timed against each other, for the default strategy's tie rule (NOTE [head to head]).

NOTE [head to head]: each candidate's speed-up over eager is paired with eager (NOTE [paired speed-up] in
:mod:`aitune.torch.measure.profiling`), so its spread is mostly eager's own jitter when eager is many times
slower: on a GPU, a launch-bound eager ResNet-50 at batch 1 gave a candidate whose own rounds were 1.6x faster than
another's a speed-up within the other's spread, the simpler (slower) one was kept, and a second tune of the same
build reversed the order of the two figures (``benchmarks/gpu_search.py``; benchmarks/RESULTS.md, the
thirty-second session). Timed against each other,
in alternation, the two candidates meet the same conditions and eager's jitter is out of the figure. The default
strategy (:class:`~aitune.torch.tune_strategy.MaxThroughputStrategy`) settles every tie between compiled
candidates this way (:func:`settle_tie`): at most one extra measurement per tied candidate, the finalists (3).
Two candidates are active on the device during it (the search otherwise holds one at a time). On a GPU, two
CUDA-graph candidates (aitune's own capture and reduce-overhead's graph trees) timed this way in one process stay
right: ``tests/gpu/test_inductor_gpu.py::test_two_cuda_graph_candidates_timed_head_to_head_stay_right``.
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


def settle_tie(chosen: Candidate, tied: list[Candidate], context: GraphContext,
               config: ProfilingConfig) -> tuple[Candidate, list[str]]:
    """Settle a tie by timing the tied candidates head to head (NOTE [head to head]).

    ``chosen`` is the simplest of ``tied`` (``TuneStrategy.pick``). Each other tied candidate, fastest by its own
    median round first (the candidates' own timings, untouched by eager's jitter), is timed against the one kept so
    far (:func:`head_to_head`) and replaces it when its paired speed-up over it reaches 1.0 beyond that figure's
    own spread (:meth:`PairedSpeedup.reaches`, at least ``config.min_noise``). Eager on either side is already
    paired with the other (its speed-up over eager): not timed again. Each figure lands in both rows'
    ``details["head_to_head"]`` (``speedup``: that row's candidate over the other, quartiles from its side); a
    measurement that fails keeps the one kept so far, and the notes say so.

    Returns:
        ``(the candidate kept, one note per head-to-head for the selection reason)``.
    """
    kept, notes = chosen, []
    min_noise = config.min_noise
    if getattr(chosen.backend, "passthrough", False):
        return kept, notes
    others = sorted((c for c in tied if c is not chosen and c.backend is not None
                     and not getattr(c.backend, "passthrough", False)),
                    key=lambda c: c.measurement.median_round_ms)
    for challenger in others:
        paired = head_to_head(kept, challenger, context, config)
        if paired is None:
            challenger.row.details["head_to_head"] = {"against": kept.row.description, "failed": True}
            notes.append(f"the head-to-head measurement of {challenger.row.description} against "
                         f"{kept.row.description} failed (see the log): the latter kept")
            continue
        wins = paired.reaches(1.0, min_noise)
        challenger.row.details["head_to_head"] = {"against": kept.row.description, "speedup": paired.median,
                                                  "q25": paired.q25, "q75": paired.q75,
                                                  "rounds": paired.rounds, "kept": wins}
        kept.row.details["head_to_head"] = {"against": challenger.row.description, "speedup": 1 / paired.median,
                                            "q25": 1 / paired.q75, "q75": 1 / paired.q25,
                                            "rounds": paired.rounds, "kept": not wins}
        slower = paired.median * (1 + max(paired.spread, min_noise)) < 1
        verdict = "it is kept" if wins else \
            f"{kept.row.description} stays ({'faster' if slower else 'a tie'})"
        notes.append(f"{challenger.row.description} timed head to head against {kept.row.description}: "
                     f"{paired.median:.2f}x its speed (quartiles {paired.q25:.2f}-{paired.q75:.2f}), {verdict}")
        logger.info("  head to head: %s", notes[-1])
        if wins:
            kept = challenger
    return kept, notes

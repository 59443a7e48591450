"""The search engine: which candidates are evaluated, in which order, how long each is measured.

Strategies (:mod:`aitune.torch.tune_strategy`) only choose; :func:`search` does the work they share:

- the default candidates: every backend class that declares itself one
  (:attr:`~aitune.torch.backend.base.Backend.default_search_position`), expanded by its search space;
- successive halving: with more candidates than the finalists, every candidate is measured briefly, the best
  ``finalists`` selectable ones again in full;
- background builds: child-process build steps start first and run while the others are built and checked;
- device-memory sections: each candidate's peak and retained device memory in its row;
- ranking reuse: a re-tune of the same graph in the same environment rebuilds only the earlier winners
  (:mod:`aitune.torch.search.rankings`);
- the time budget, through each candidate's search tier (:func:`aitune.torch.search.evaluation.start`).
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from aitune.torch.backend.base import Backend
from aitune.torch.backend.registry import default_candidate_classes
from aitune.torch.check.context import EvaluationSettings, GraphContext
from aitune.torch.measure.memory import DeviceSection
from aitune.torch.measure.profiling import ProfilingConfig
from aitune.torch.report.rows import PASSED, SKIPPED, CandidateResult
from aitune.torch.search.evaluation import (
    Candidate,
    Evaluation,
    complete,
    evaluate,
    measure_candidate,
    start,
    unsupported,
)
from aitune.torch.search.rankings import candidate_key, reused

logger = logging.getLogger(__name__)


def default_backends(device: torch.device | str, module: torch.nn.Module | None = None,
                     graph=None) -> list[Backend]:
    """Candidates tried when a strategy is given none: the blueprints of every backend class in the default
    search (:func:`~aitune.torch.backend.registry.default_candidate_classes`, in their
    ``default_search_position`` order; each class's :meth:`~aitune.torch.backend.base.Backend.default_candidates`),
    each expanded by its :meth:`~aitune.torch.backend.base.Backend.search_space` (e.g. Inductor with and
    without freezing, CUDA graphs on a GPU, channels-last for convnets), cheapest and most promising first.

    Unavailable ones still get a report row saying why.
    """
    device = torch.device(device)
    candidates: list[Backend] = []
    for backend_class in default_candidate_classes():
        for blueprint in backend_class.default_candidates(device):
            try:
                candidates.extend(blueprint.search_space(module, graph, device))
            except Exception:  # noqa: BLE001 - a search space that cannot be derived: the default configuration
                candidates.append(blueprint)
    return candidates


@dataclasses.dataclass(kw_only=True)
class SearchSettings:
    """What :func:`search` needs from the strategy that calls it.

    Attributes:
        evaluation: how each candidate is judged, with the full measurement (:class:`ProfilingConfig`).
        selectable: may a passing candidate be chosen (only selectable ones become finalists or are ranked)?
        finalists: candidates measured in full after the quick round of successive halving.
        halving: successive halving allowed (False: every candidate is measured in full, e.g. when performance
            validation is off).
        reuse_rankings: rebuild only an earlier search's winners when the same search ran before.
        ranking_facts: what else decides the search's outcome (the strategy's settings): part of a ranking's key.
        description: the strategy as recorded with a ranking.
    """

    evaluation: EvaluationSettings
    selectable: Callable[[Candidate], bool]
    finalists: int = 3
    halving: bool = True
    reuse_rankings: bool = True
    ranking_facts: dict = dataclasses.field(default_factory=dict)
    description: str = ""


def search(context: GraphContext, blueprints: list[Backend], settings: SearchSettings, *,
           by_latency: bool = False) -> list[Candidate]:
    """Evaluate every candidate, one at a time, releasing each (device memory) before the next builds.

    With more candidates than ``settings.finalists`` (or one building in the background), successive halving:
    every candidate is measured briefly (:func:`quick_profiling`), then the best ``finalists`` selectable ones
    are measured again with the full :class:`ProfilingConfig`; the others keep their quick figures, are marked
    ``details["finalist"] = False`` and cannot be chosen (their rows say so). An earlier search's ranking of the
    same graph and candidates in this environment is reused when it applies (:mod:`aitune.torch.search.rankings`).

    Args:
        context: the graph being tuned. blueprints: the candidates, in order (copied before each build).
        settings: the calling strategy's :class:`SearchSettings`.
        by_latency: rank by the smallest batch's median latency instead of the paired speed-up over eager.

    Returns:
        The evaluated candidates, in the order of ``blueprints``.
    """
    key = _ranking_key(context, blueprints, settings, by_latency)
    record = context.rankings.lookup(key) if key is not None else None
    done: dict[int, Candidate] = {}
    if record is not None:
        candidates, done = _search_again(context, blueprints, settings, record)
        if candidates is not None:
            return candidates
    candidates = _search_all(context, blueprints, settings, by_latency, done)
    if key is not None:
        _remember(context, key, candidates, settings, by_latency)
    return candidates


def _search_all(context: GraphContext, blueprints: list[Backend], settings: SearchSettings, by_latency: bool,
                done: dict[int, Candidate] | None = None) -> list[Candidate]:
    """Evaluate every blueprint; ``done`` holds candidates already evaluated in this tune, by blueprint index
    (earlier winners that failed their re-check: not built a second time)."""
    done = done or {}
    background = [blueprint.builds_in_background and index not in done
                  for index, blueprint in enumerate(blueprints)]
    halving = (len(blueprints) > settings.finalists or any(background)) and settings.halving
    full_profiling = settings.evaluation.profiling
    evaluation = dataclasses.replace(settings.evaluation)
    if halving:
        evaluation.profiling = quick_profiling(full_profiling)
    results: list = [done.get(index) for index in range(len(blueprints))]
    executor = ThreadPoolExecutor(max_workers=min(4, sum(background))) if any(background) else None
    # NOTE [no CPU timing beside a background build]: on a CPU device a background compile takes the cores
    # the measurement runs on. On a machine with few cores, candidates timed while the AOTInductor
    # child compiles can look many times slower than when timed alone, which misranks them for the finalists
    # and misreports the others. There, candidates are built and
    # checked while the child runs, and measured once it has finished. On CUDA the kernels are timed on the
    # device, the finalists are measured again at the end, and the overlap is kept.
    measure_later = executor is not None and context.device.type == "cpu" and evaluation.measure
    first_round = evaluation.profiling
    if measure_later:
        evaluation = dataclasses.replace(evaluation, measure=False)
    try:
        # NOTE [background builds]: child-process build steps start first and run while the other
        # candidates are built and checked; their first-round figures only rank them, and the finalists
        # are measured again once nothing runs in the background.
        for index, blueprint in enumerate(blueprints):
            if background[index]:
                results[index] = start(blueprint, context, evaluation, background=executor)
        for index, blueprint in enumerate(blueprints):
            if index in done:
                continue
            with DeviceSection(context.device) as section:
                if results[index] is None:
                    results[index] = evaluate(promote_fallback(blueprint, blueprints[:index], results[:index]),
                                              context, evaluation)
                elif isinstance(results[index], Evaluation):
                    results[index] = complete(results[index], context)
                if results[index].backend is not None:
                    results[index].backend.deactivate()
            if section.peak_bytes is not None:  # which candidate needed / keeps the memory
                results[index].row.details["device_peak_bytes"] = section.peak_bytes
                results[index].row.details["device_retained_bytes"] = section.retained_bytes
    finally:
        if executor is not None:
            executor.shutdown(wait=True)
    candidates = results
    if measure_later:
        candidates = [measure_candidate(c, context, first_round) if c.passed and index not in done else c
                      for index, c in enumerate(candidates)]
    if not halving:
        return candidates
    measured = [c for c in candidates if c.measurement is not None and settings.selectable(c)]
    score = score_for(by_latency)
    finalists = sorted(measured, key=score, reverse=True)[:settings.finalists]
    for candidate in measured:
        candidate.row.details["finalist"] = candidate in finalists
        candidate.row.details["quick_speedup"] = candidate.row.speedup
        if candidate not in finalists:
            candidate.row.reason = "; ".join(filter(None, [
                f"quick measurement only: not among the {settings.finalists} finalists", candidate.row.reason]))
            continue
        measure_candidate(candidate, context, full_profiling)
        if candidate.row.speedup is not None and candidate.row.status == PASSED:
            logger.info("  %-28s finalist, measured again: %.2fx eager", candidate.row.description,
                        candidate.row.speedup)
    explain_finalists(finalists, [c for c in measured if c not in finalists])
    return candidates


# ---- earlier rankings (aitune/torch/search/rankings.py)
def _ranking_key(context: GraphContext, blueprints: list[Backend], settings: SearchSettings,
                 by_latency: bool) -> str | None:
    if not settings.reuse_rankings or context.rankings is None or context.deadline is not None:
        return None  # a time budget asks for a search
    facts = {**settings.ranking_facts, "by_latency": by_latency, "finalists": settings.finalists}
    return context.rankings.key(context, blueprints, facts)


def _remember(context: GraphContext, key: str, candidates: list[Candidate], settings: SearchSettings,
              by_latency: bool) -> None:
    """Record the ranking of a full search: the passing, measured, selectable finalists, best first."""
    score = score_for(by_latency)
    min_noise = settings.evaluation.profiling.min_noise
    ranked = sorted((c for c in candidates if c.passed and c.measurement is not None and settings.selectable(c)
                     and c.row.details.get("finalist", True)), key=score, reverse=True)
    if ranked:
        context.rankings.record(key, context, [
            {"candidate": candidate_key(c.backend), "description": c.row.description, "score": score(c),
             "noise": c.measurement.noise if by_latency else relative_noise(c, min_noise),
             "speedup": c.row.speedup} for c in ranked], strategy=settings.description)


def _search_again(context: GraphContext, blueprints: list[Backend], settings: SearchSettings,
                  record: dict) -> tuple[list[Candidate] | None, dict[int, Candidate]]:
    """Evaluate only the earlier winners (:func:`aitune.torch.search.rankings.reused`); the other candidates get
    ``skipped`` rows. Returns ``(candidates, {})``, or ``(None, evaluated)`` when no earlier winner passes now:
    the caller then searches in full, reusing ``evaluated`` (blueprint index -> candidate)."""
    wanted = set(reused(record))
    top = record["ranked"][0]
    earlier = f"in an earlier tune of this module, graph, candidates and environment ({record.get('when')})"
    candidates, evaluated, skipped = [], {}, 0
    for index, blueprint in enumerate(blueprints):
        if candidate_key(blueprint) in wanted:
            # a fallback variant among the winners won promoted (promote_fallback): rebuilt promoted
            candidate = evaluate(promoted(blueprint), context, settings.evaluation)
            evaluated[index] = candidate
            if candidate.backend is not None:
                candidate.backend.deactivate()
            if candidate.row.status == PASSED:
                candidate.row.reason = "; ".join(filter(None, [f"rebuilt: among the winners {earlier}",
                                                               candidate.row.reason]))
        else:
            candidate = unsupported(blueprint, context)  # unavailable / unsupported rows stay what they are
            if candidate is None:
                row = CandidateResult(module=context.module_name, graph=context.graph.name,
                                      backend=blueprint.name, description=blueprint.describe(), status=SKIPPED)
                row.reason = (f"not rebuilt: {top['description']} ranked first {earlier}; "
                              "strategy.enable_ranking_reuse(False) searches all candidates again")
                candidate = Candidate(None, row)
            skipped += 1
        candidates.append(candidate)
    if not any(c.passed and settings.selectable(c) for c in candidates):
        logger.info("  the earlier winners of %s/%s did not pass this time: searching all candidates",
                    context.module_name, context.graph.name)
        return None, evaluated
    if context.progress is not None:  # counted here, once: a full search after a failure counts them itself
        for _ in range(skipped):
            context.progress.candidate_done()
    logger.info("  %s/%s: rebuilt the earlier winner%s only (ranking of %s)", context.module_name,
                context.graph.name, "s" if len(wanted) > 1 else "", record.get("when"))
    return candidates, {}


# ---- figures every strategy ranks by
def quick_profiling(config: ProfilingConfig) -> ProfilingConfig:
    """The short measurement of the first round of successive halving (a tenth of a second or so per
    candidate; its figures only rank candidates)."""
    return ProfilingConfig(warmup_rounds=min(config.warmup_rounds, 2), warmup_s=min(config.warmup_s, 0.1),
                           min_rounds=min(config.min_rounds, 3), max_rounds=min(config.max_rounds, 30),
                           time_budget_s=min(config.time_budget_s, 0.3),
                           stable_rel_error=max(config.stable_rel_error, 0.03), min_noise=config.min_noise)


def score_for(by_latency: bool) -> Callable[[Candidate], float]:
    """Higher is better. By latency: the inverse of the smallest batch's median latency. By throughput: the
    row's speed-up over eager (eager's own row: 1.0), which for a candidate timed in alternation with eager is
    the paired median (NOTE [paired speed-up] in aitune/torch/measure/profiling.py): every candidate is then
    compared with eager under the conditions of its own rounds, so load that comes and goes between one
    candidate's measurement and another's (or eager's) does not decide the choice. Without a speed-up: the raw
    throughput relative to nothing, i.e. 0 (never preferred)."""
    if by_latency:
        return lambda c: 1.0 / max(c.measurement.min_batch_latency_ms, 1e-9)
    return lambda c: c.row.speedup if c.row.speedup is not None else 0.0


def relative_noise(candidate: Candidate, min_noise: float) -> float:
    """The relative uncertainty of a candidate's paired speed-up: the spread of its per-round ratios (half the
    inter-quartile range over the median), at least ``min_noise``; without a paired figure, its own timing
    noise."""
    paired = candidate.measurement.paired if candidate.measurement is not None else None
    if paired is None:
        return candidate.measurement.noise
    return max(paired.spread, min_noise)


def promote_fallback(blueprint: Backend, earlier: list[Backend], results: list) -> Backend:
    """A fallback variant (``Backend.search_fallback``) as a first-tier candidate when no earlier variant of its
    backend class passed its checks in this tune; otherwise (and for any other blueprint) ``blueprint`` itself."""
    if not blueprint.search_fallback or any(
            type(other) is type(blueprint) and result is not None and result.passed
            for other, result in zip(earlier, results)):
        return blueprint
    return promoted(blueprint)


def promoted(blueprint: Backend) -> Backend:
    """A fallback variant as a first-tier candidate (a fresh copy, no longer marked); any other blueprint itself."""
    return blueprint.copy() if blueprint.search_fallback else blueprint


def explain_finalists(finalists: list[Candidate], others: list[Candidate]) -> None:
    """A finalist whose full measurement came out below a non-finalist's quick figure would look misranked in the
    table (the two rows show figures of different rounds): its row says which quick figure made it a finalist."""
    quick = [c.row.speedup for c in others if c.row.speedup is not None]
    if not quick:
        return
    for candidate in finalists:
        full, first = candidate.row.speedup, candidate.row.details.get("quick_speedup")
        if full is not None and first is not None and full < max(quick):
            candidate.row.reason = "; ".join(filter(None, [
                f"finalist on its quick measurement ({first:.2f}x eager); the figures shown are from its full "
                "measurement",
                candidate.row.reason]))

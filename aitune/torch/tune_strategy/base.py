"""The strategy base: configuration shared by every strategy and the rules for choosing among candidates.

Strategies only choose. Evaluating one candidate (availability → supports → build → check against eager →
round trip → measure) is :func:`aitune.torch.search.evaluation.evaluate`, the same path for every strategy; a
failing candidate never stops tuning (except in :class:`OneBackendStrategy`, which by design re-raises the
original error): it becomes a report row with a one-line reason naming the real cause and its log path.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

import torch

from aitune.errors import AITuneError, ConfigError
from aitune.torch.common.arguments import init_keywords, reject_unknown_keywords
from aitune.torch.backend.base import Backend, BuildMode
from aitune.torch.compat import strategy as reference_strategy
from aitune.torch.check.correctness import Tolerance
from aitune.torch.search.evaluation import (
    Candidate,
    Evaluation,
    EvaluationSettings,
    GraphContext,
    complete,
    eager_candidate,
    evaluate,
    measure_candidate,
    start,
    unsupported,
)
from aitune.torch.search.max_batch_size import MaxBatchSizeSearch
from aitune.torch.measure.memory import DeviceSection
from aitune.torch.check.probes import ProbeConfig
from aitune.torch.measure.profiling import ProfilingConfig, reaches_speedup
from aitune.torch.search.rankings import candidate_key, reused
from aitune.torch.report.rows import PASSED, SELECTED, SKIPPED, CandidateResult

logger = logging.getLogger(__name__)

QUANTIZATION_NOTE = "quantization is not used unless allowed: allow_quantization=True on the strategy"
REDUCED_PRECISION_NOTE = ("reduced precision (bf16/fp16 autocast of an fp32 model) is not used unless allowed: "
                          "allow_reduced_precision=True (or allow_quantization=True) on the strategy")

__all__ = ["Candidate", "GraphContext", "TuneStrategy", "default_backends"]


def default_backends(device: torch.device | str, module: torch.nn.Module | None = None,
                     graph=None) -> list[Backend]:
    """Candidates tried when a strategy is given none: every built-in backend's search space
    (:meth:`Backend.search_space`: e.g. Inductor with and without freezing, CUDA graphs on a GPU, channels-last
    for convnets), cheapest and most promising first.

    Unavailable ones still get a report row saying why. On CUDA, eager replayed from CUDA graphs
    is added: eager at batch 1 is launch-bound there (``benchmarks/cuda_graphs_eager.py``).
    """
    from aitune.torch import backend as backends

    blueprints: list[Backend] = [backends.TorchInductorJitBackend()]
    if torch.device(device).type == "cuda":
        blueprints.append(backends.TorchEagerBackend(backends.TorchEagerBackendConfig(use_cuda_graphs=True)))
    for name in ("TorchInductorAotBackend", "ONNXRuntimeBackend", "TorchAOBackend", "TensorRTBackend",
                 "TorchTensorRTJitBackend", "TorchTensorRTAotBackend"):
        backend_class = getattr(backends, name)
        if isinstance(backend_class, type) and issubclass(backend_class, Backend):
            blueprints.append(backend_class())
    candidates: list[Backend] = []
    for blueprint in blueprints:
        try:
            candidates.extend(blueprint.search_space(module, graph, device))
        except Exception:  # noqa: BLE001 - a search space that cannot be derived: the default configuration
            candidates.append(blueprint)
    return candidates


class TuneStrategy:
    """Base of every strategy.

    Args:
        backends: candidate backends (blueprints, copied before each build); None = :func:`default_backends`.
        profiling_config: how to measure (:class:`~aitune.torch.measure.profiling.ProfilingConfig`).
        tolerance: thresholds of the comparison with eager (:class:`~aitune.torch.check.correctness.Tolerance`).
        probe_config: inputs beyond the recorded samples that every candidate is also checked on
            (:class:`~aitune.torch.check.probes.ProbeConfig`; default: up to 12 probes, 10 s per candidate).
        allow_quantization: may a quantizing candidate (TorchAO, TensorRT with int8/fp8) be *selected*? They
            are always measured and shown. None (default) = only when you listed the backends yourself;
            with the default candidates a quantizing one is shown as "would be N x at SQNR ..." but not used.
        allow_reduced_precision: may a candidate that computes an fp32 model in bf16/fp16 (autocast,
            :attr:`Backend.reduces_precision`) be selected? Such variants are in the default search where the
            hardware runs bf16 natively (Inductor with bf16 autocast on CPUs with AMX or AVX-512 BF16). None
            (default) = as ``allow_quantization`` decides: quantization changes outputs more than bf16 does.

    Raises:
        ConfigError: when ``backends`` is empty or holds something that is not a Backend.
    """

    def __new__(cls, *args, **kwargs):
        reject_unknown_keywords(cls.__name__, init_keywords(cls), kwargs)
        return super().__new__(cls)

    def __init__(self, backends: Iterable[Backend] | Backend | None = None, *,
                 profiling_config: ProfilingConfig | None = None, tolerance: Tolerance | None = None,
                 probe_config: ProbeConfig | None = None, allow_quantization: bool | None = None,
                 allow_reduced_precision: bool | None = None):
        if isinstance(backends, Backend):
            backends = [backends]
        if backends is not None:
            backends = list(backends)
            if not backends:
                raise ConfigError(f"{type(self).__name__} got an empty list of backends; pass at least one "
                                  "backend, or None for the default candidates")
            for backend in backends:
                if not isinstance(backend, Backend):
                    raise ConfigError(f"{type(self).__name__}: {backend!r} is not an aitune backend; pass "
                                      "instances such as TorchInductorJitBackend()")
        if profiling_config is not None and not isinstance(profiling_config, ProfilingConfig):
            raise ConfigError("profiling_config must be an aitune.torch.measure.profiling.ProfilingConfig")
        if tolerance is not None and not isinstance(tolerance, Tolerance):
            raise ConfigError("tolerance must be an aitune.torch.check.correctness.Tolerance")
        if probe_config is not None and not isinstance(probe_config, ProbeConfig):
            raise ConfigError("probe_config must be an aitune.torch.ProbeConfig")
        if allow_quantization is not None and not isinstance(allow_quantization, bool):
            raise ConfigError(f"allow_quantization must be True, False or None, got {allow_quantization!r}")
        if allow_reduced_precision is not None and not isinstance(allow_reduced_precision, bool):
            raise ConfigError(f"allow_reduced_precision must be True, False or None, got "
                              f"{allow_reduced_precision!r}")
        self.allow_quantization = allow_quantization
        self.allow_reduced_precision = allow_reduced_precision
        self.backends = backends
        self.probe_config = probe_config or ProbeConfig()
        self.runners_up: list[Backend] = []  # after tune(): next-best passing backends (the guard's fallbacks)
        self.profiling_config = profiling_config or ProfilingConfig()
        self.tolerance = tolerance or Tolerance()
        self.correctness_check = True
        self.performance_validation = True
        self.min_speedup_ratio = 1.0
        self.max_batch_size_search: MaxBatchSizeSearch | None = None  # see enable_find_max_batch_size

    # ---- configuration (chainable, as in the reference)
    def enable_correctness_check(self, enabled: bool = True, tolerance: Tolerance | None = None) -> "TuneStrategy":
        """Turn the comparison with eager on/off; optionally set its tolerance. Returns self.

        Raises:
            ConfigError: when ``tolerance`` is not an :class:`~aitune.torch.check.correctness.Tolerance`.
        """
        self.correctness_check = bool(enabled)
        if tolerance is not None:
            if not isinstance(tolerance, Tolerance):
                raise ConfigError("tolerance must be an aitune.torch.check.correctness.Tolerance")
            self.tolerance = tolerance
        return self

    def enable_performance_validation(self, enabled: bool = True, min_speedup_ratio: float = 1.0) -> "TuneStrategy":
        """Require a candidate to reach ``min_speedup_ratio`` x eager's throughput to be chosen. Returns self.

        Args:
            enabled: with False, measured candidates are chosen even when slower than eager.
            min_speedup_ratio: e.g. 3.0 = at least 3x eager's throughput (samples/s), beyond the measured
                noise: the paired speed-up's median above ``ratio * (1 + noise)`` (:meth:`fast_enough`). 1.0 =
                simply beat eager.

        Raises:
            ConfigError: for a ratio that is not a number > 0.
        """
        if not isinstance(min_speedup_ratio, (int, float)) or min_speedup_ratio <= 0:
            raise ConfigError(f"min_speedup_ratio must be a number > 0, got {min_speedup_ratio!r}")
        self.performance_validation = bool(enabled)
        self.min_speedup_ratio = float(min_speedup_ratio)
        return self

    def enable_find_max_batch_size(self, enable: bool = True, *, max_batch_size: int = 4096,
                                   max_memory_bytes: int | None = None, latency_limit_ms: float | None = None,
                                   memory_fraction: float = 0.5) -> "TuneStrategy":
        """Before tuning each graph, search the largest batch that fits memory (and ``latency_limit_ms``) and
        tune for the range up to it (:mod:`aitune.torch.search.max_batch_size`; reported as the graph's
        ``max_batch_size`` entry). Off by default. Returns self.

        Args:
            enable: turn the search on/off.
            max_batch_size: never try a larger batch.
            max_memory_bytes: memory budget of one call in bytes (default on CPU: ``memory_fraction`` of the
                available RAM; on CUDA: until a call runs out of memory).
            latency_limit_ms: batches slower than this (median, ms) do not fit.
            memory_fraction: CPU budget as a share of the available RAM when ``max_memory_bytes`` is None.

        Raises:
            ConfigError: for a bad limit.
        """
        self.max_batch_size_search = MaxBatchSizeSearch(
            max_batch_size=max_batch_size, max_memory_bytes=max_memory_bytes, latency_limit_ms=latency_limit_ms,
            memory_fraction=memory_fraction) if enable else None
        return self

    def enable_quantization(self, enabled: bool = True) -> "TuneStrategy":
        """Allow (or forbid) selecting quantizing candidates (int8/fp8: outputs differ from eager by design,
        judged by SQNR and cosine instead of atol/rtol). Returns self."""
        self.allow_quantization = bool(enabled)
        return self

    def enable_reduced_precision(self, enabled: bool = True) -> "TuneStrategy":
        """Allow (or forbid) selecting candidates that compute an fp32 model in bf16/fp16 (autocast; outputs
        differ from eager by design, checked with the fp16/bf16 tolerances). Returns self."""
        self.allow_reduced_precision = bool(enabled)
        return self

    @property
    def quantization_allowed(self) -> bool:
        """``allow_quantization``, or — when left at None — whether the user listed the backends."""
        return self.allow_quantization if self.allow_quantization is not None else self.backends is not None

    @property
    def reduced_precision_allowed(self) -> bool:
        """``allow_reduced_precision``, or — when left at None — :attr:`quantization_allowed`."""
        if self.allow_reduced_precision is not None:
            return self.allow_reduced_precision
        return self.quantization_allowed

    def selectable(self, candidate: Candidate) -> bool:
        """May this passing candidate be chosen? A quantizing one only when quantization is allowed, one that
        reduces precision only when that is allowed; otherwise its row says what it would give and how to
        allow it."""
        backend = candidate.backend
        if not candidate.passed or backend is None or not (backend.is_quantizing or backend.reduces_precision):
            return candidate.passed
        if backend.is_quantizing:
            allowed, gate = self.quantization_allowed, QUANTIZATION_NOTE
        else:
            allowed, gate = self.reduced_precision_allowed, REDUCED_PRECISION_NOTE
        if allowed:
            return True
        if gate in candidate.row.reason:
            return False
        comparison = candidate.row.comparison or {}
        figures = []
        if candidate.row.speedup is not None:
            figures.append(f"{candidate.row.speedup:.2f}x eager")
        if comparison.get("min_sqnr_db") is not None:
            figures.append(f"SQNR {comparison['min_sqnr_db']:.0f} dB")
        if comparison.get("min_cosine") is not None:
            figures.append(f"cosine {comparison['min_cosine']:.5f}")
        note = (f"would be {', '.join(figures)}" if figures else "passed") + f" — {gate}"
        candidate.row.reason = "; ".join(filter(None, [note, candidate.row.reason]))
        return False

    def clone(self) -> "TuneStrategy":
        """A deep copy (each graph is tuned by its own copy)."""
        return copy.deepcopy(self)

    def candidates(self, device: torch.device, module: torch.nn.Module | None = None, graph=None) -> list[Backend]:
        """The blueprints to evaluate on ``device``: the given backends as configured, or the default candidates'
        search spaces for ``module``/``graph`` (:func:`default_backends`)."""
        return list(self.backends) if self.backends is not None else default_backends(device, module, graph)

    def candidates_for(self, context: GraphContext) -> list[Backend]:
        """:meth:`candidates` for the graph being tuned."""
        return self.candidates(context.device, context.module, context.graph)

    def describe(self) -> str:
        """``StrategyName(Backend(config), ...)`` for reports."""
        names = [backend.describe() for backend in self.backends] if self.backends is not None else ["<defaults>"]
        if self.backends is None and self.quantization_allowed:  # the defaults measure quantizing candidates only
            names.append("quantization allowed")
        if self.backends is None and self.reduced_precision_allowed:
            names.append("reduced precision allowed")
        return f"{type(self).__name__}({', '.join(names)})"

    # ---- the work
    def tune(self, context: GraphContext) -> tuple[Backend, list[CandidateResult], str]:
        """Tune one graph.

        Args:
            context: the graph, the user's module and eager's reference outputs (built by ``ait.tune``).

        Returns:
            ``(chosen backend (ACTIVE), report rows, why it was chosen)``.

        Raises:
            TuningError: when the strategy's rule leaves no candidate (LatencyBudgetStrategy).
            The original build/correctness error in OneBackendStrategy.
        """
        if type(self)._tune is not TuneStrategy._tune:  # written for the reference system: it overrides _tune
            return reference_strategy.run_reference_tune(self, context)
        raise NotImplementedError(f"{type(self).__name__} must override tune(context) or _tune(module, name, "
                                  "graph_spec, data, device, cache_dir)")

    # ---- the reference system's strategy contract (see aitune.torch.compat.strategy)
    def _tune(self, module, name, graph_spec, data, device, cache_dir) -> Backend:
        """Reference contract: build, check and return the chosen backend (active) for one graph."""
        raise NotImplementedError

    def _pre_tune(self, module, name, graph_spec, data, device, cache_dir) -> None:
        """Reference contract: called before :meth:`_tune`."""

    def _post_tune(self, module, name, graph_spec, data, device, cache_dir) -> None:
        """Reference contract: called after :meth:`_tune`."""

    def check_correctness(self, backend: Backend, name: str | None = None, graph_spec=None, data=None) -> None:
        """Inside :meth:`_tune`: compare ``backend`` with eager on every recorded sample of the graph being tuned.

        Raises:
            CorrectnessError: on the first disagreement. ConfigError: outside ``_tune``.
        """
        reference_strategy.check_correctness(self, backend)

    def settings(self, *, measure: bool = True) -> EvaluationSettings:
        """This strategy's evaluation settings (tolerance, profiling, which checks run)."""
        return EvaluationSettings(tolerance=self.tolerance, profiling=self.profiling_config,
                                  probes=self.probe_config, correctness_check=self.correctness_check,
                                  measure=measure)

    def evaluate(self, blueprint: Backend, context: GraphContext, *, measure_it: bool = True,
                 raise_errors: bool = False) -> Candidate:
        """One candidate through :func:`aitune.torch.search.evaluation.evaluate` with this strategy's settings."""
        return evaluate(blueprint, context, self.settings(measure=measure_it), raise_errors=raise_errors)

    finalists = 3  # candidates measured at full length after the quick round (successive halving)

    def search(self, context: GraphContext, *, by_latency: bool = False) -> list[Candidate]:
        """Evaluate every candidate, one at a time, releasing each (device memory) before the next builds.

        With more candidates than :attr:`finalists`, successive halving: every candidate is measured briefly
        (:func:`quick_profiling`), then the best :attr:`finalists` selectable ones are measured again with the
        strategy's full :class:`ProfilingConfig`; the others keep their quick figures, are marked
        ``details["finalist"] = False`` and cannot be chosen (their rows say so).

        Returns:
            The evaluated candidates, in order.
        """
        blueprints = self.candidates_for(context)
        key = self._ranking_key(context, blueprints, by_latency)
        record = context.rankings.lookup(key) if key is not None else None
        done: dict[int, Candidate] = {}
        if record is not None:
            candidates, done = self._search_again(context, blueprints, record)
            if candidates is not None:
                return candidates
        candidates = self._search_all(context, blueprints, by_latency, done)
        if key is not None:
            self._remember(context, key, candidates, by_latency)
        return candidates

    def _search_all(self, context: GraphContext, blueprints: list[Backend], by_latency: bool,
                    done: dict[int, Candidate] | None = None) -> list[Candidate]:
        """Evaluate every blueprint; ``done`` holds candidates already evaluated in this tune, by blueprint index
        (earlier winners that failed their re-check: not built a second time)."""
        done = done or {}
        background = [blueprint.builds_in_background and index not in done
                      for index, blueprint in enumerate(blueprints)]
        halving = (len(blueprints) > self.finalists or any(background)) and self.performance_validation
        settings = self.settings()
        if halving:
            settings.profiling = quick_profiling(self.profiling_config)
        results: list = [done.get(index) for index in range(len(blueprints))]
        executor = ThreadPoolExecutor(max_workers=min(4, sum(background))) if any(background) else None
        # NOTE [no CPU timing beside a background build]: on a CPU device a background compile takes the cores
        # the measurement runs on. On a machine with few cores, candidates timed while the AOTInductor
        # child compiles can look many times slower than when timed alone, which misranks them for the finalists
        # and misreports the others. There, candidates are built and
        # checked while the child runs, and measured once it has finished. On CUDA the kernels are timed on the
        # device, the finalists are measured again at the end, and the overlap is kept.
        measure_later = executor is not None and context.device.type == "cpu" and settings.measure
        first_round = settings.profiling
        if measure_later:
            settings = dataclasses.replace(settings, measure=False)
        try:
            # NOTE [background builds]: child-process build steps start first and run while the other
            # candidates are built and checked; their first-round figures only rank them, and the finalists
            # are measured again once nothing runs in the background.
            for index, blueprint in enumerate(blueprints):
                if background[index]:
                    results[index] = start(blueprint, context, settings, background=executor)
            for index, blueprint in enumerate(blueprints):
                if index in done:
                    continue
                with DeviceSection(context.device) as section:
                    if results[index] is None:
                        results[index] = evaluate(_promote_fallback(blueprint, blueprints[:index], results[:index]),
                                                  context, settings)
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
        measured = [c for c in candidates if c.measurement is not None and self.selectable(c)]
        score = _score(by_latency)
        finalists = sorted(measured, key=score, reverse=True)[:self.finalists]
        for candidate in measured:
            candidate.row.details["finalist"] = candidate in finalists
            candidate.row.details["quick_speedup"] = candidate.row.speedup
            if candidate not in finalists:
                candidate.row.reason = "; ".join(filter(None, [
                    f"quick measurement only: not among the {self.finalists} finalists", candidate.row.reason]))
                continue
            measure_candidate(candidate, context, self.profiling_config)
            if candidate.row.speedup is not None and candidate.row.status == PASSED:
                logger.info("  %-28s finalist, measured again: %.2fx eager", candidate.row.description,
                            candidate.row.speedup)
        _explain_finalists(finalists, [c for c in measured if c not in finalists])
        return candidates

    # ---- earlier rankings (aitune/torch/search/rankings.py)
    reuse_rankings = True

    def enable_ranking_reuse(self, enabled: bool = True) -> "TuneStrategy":
        """Re-tunes of the same graph in the same environment build only the earlier winners (default on;
        see :mod:`aitune.torch.search.rankings`). ``False``: every tune searches all candidates. Returns self."""
        self.reuse_rankings = bool(enabled)
        return self

    def _ranking_key(self, context: GraphContext, blueprints: list[Backend], by_latency: bool) -> str | None:
        if not self.reuse_rankings or context.rankings is None or context.deadline is not None:
            return None  # a time budget asks for a search
        facts = {"strategy": type(self).__qualname__, "by_latency": by_latency, "tolerance": self.tolerance,
                 "profiling": self.profiling_config, "probes": self.probe_config,
                 "quantization": self.quantization_allowed, "reduced_precision": self.reduced_precision_allowed,
                 "correctness": self.correctness_check,
                 "performance_validation": self.performance_validation, "min_speedup": self.min_speedup_ratio,
                 "finalists": self.finalists}
        return context.rankings.key(context, blueprints, facts)

    def _remember(self, context: GraphContext, key: str, candidates: list[Candidate], by_latency: bool) -> None:
        """Record the ranking of a full search: the passing, measured, selectable finalists, best first."""
        score = _score(by_latency)
        ranked = sorted((c for c in candidates if c.passed and c.measurement is not None and self.selectable(c)
                         and c.row.details.get("finalist", True)), key=score, reverse=True)
        if ranked:
            context.rankings.record(key, context, [
                {"candidate": candidate_key(c.backend), "description": c.row.description, "score": score(c),
                 "noise": c.measurement.noise if by_latency else _noise(c, self.profiling_config.min_noise),
                 "speedup": c.row.speedup} for c in ranked], strategy=self.describe())

    def _search_again(self, context: GraphContext, blueprints: list[Backend],
                      record: dict) -> tuple[list[Candidate] | None, dict[int, Candidate]]:
        """Evaluate only the earlier winners (:func:`aitune.torch.search.rankings.reused`); the other candidates get
        ``skipped`` rows. Returns ``(candidates, {})``, or ``(None, evaluated)`` when no earlier winner passes now:
        the caller then searches in full, reusing ``evaluated`` (blueprint index -> candidate)."""
        wanted = set(reused(record))
        top = record["ranked"][0]
        earlier = f"in an earlier tune of this module, graph, candidates and environment ({record.get('when')})"
        settings = self.settings()
        candidates, evaluated, skipped = [], {}, 0
        for index, blueprint in enumerate(blueprints):
            if candidate_key(blueprint) in wanted:
                candidate = evaluate(blueprint, context, settings)
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
        if not any(c.passed and self.selectable(c) for c in candidates):
            logger.info("  the earlier winners of %s/%s did not pass this time: searching all candidates",
                        context.module_name, context.graph.name)
            return None, evaluated
        if context.progress is not None:  # counted here, once: a full search after a failure counts them itself
            for _ in range(skipped):
                context.progress.candidate_done()
        logger.info("  %s/%s: rebuilt the earlier winner%s only (ranking of %s)", context.module_name,
                    context.graph.name, "s" if len(wanted) > 1 else "", record.get("when"))
        return candidates, {}

    def eager_candidate(self, context: GraphContext) -> Candidate:
        """The eager baseline (measured once per graph, in the same run as the candidates)."""
        return eager_candidate(context, self.profiling_config)

    def fast_enough(self, candidate: Candidate, eager: Candidate | None) -> bool:
        """Performance validation: does ``candidate`` reach ``min_speedup_ratio`` x eager's throughput
        beyond the measured noise? For a candidate timed in alternation with eager, by its paired speed-up:
        ``median > ratio * (1 + max(spread, min_noise))`` (:meth:`PairedSpeedup.reaches`). (Always True with
        validation off or without measurements.)"""
        if not self.performance_validation or eager is None:
            return True
        if candidate.measurement is None or eager.measurement is None:
            return True
        paired = candidate.measurement.paired
        if paired is not None:  # timed beside eager: judged by the speed-up the row shows (NOTE [paired speed-up])
            return paired.reaches(self.min_speedup_ratio, self.profiling_config.min_noise)
        return reaches_speedup(candidate.measurement, eager.measurement, self.min_speedup_ratio)

    def speedup_reason(self, candidate: Candidate) -> str:
        """The report reason of a candidate refused by performance validation."""
        speedup = candidate.row.speedup
        needed = f"{self.min_speedup_ratio:g}x" if self.min_speedup_ratio != 1.0 else "faster than"
        return f"not {needed} eager beyond the measured noise ({speedup:.2f}x)" if speedup is not None else \
            f"not {needed} eager"

    # ---- selection helpers
    def pick(self, candidates: list[Candidate], *, by_latency: bool = False,
             score: Callable[[Candidate], float] | None = None) -> Candidate:
        """Best passing candidate; within the measured noise of the best, the simplest wins.

        Args:
            candidates: evaluated candidates (those not passing or not measured are ignored).
            by_latency: rank by the smallest batch's median latency instead of throughput (by default each
                candidate's throughput is judged by its paired speed-up over eager, see :func:`_score`).
            score: rank by this (higher is better, > 0) instead; e.g. throughput within a latency budget.

        The tie rule is the same for every strategy: a candidate ties with the top one unless the top one
        beats it by more than the *top* candidate's relative noise (for paired speed-ups, the spread of its
        per-round ratios, at least ``min_noise``; a noisy slower candidate cannot widen the tie by its own noise). Among the tied, the simplest wins: plain eager, then AOT over JIT
        (deployable without the original module), then the backend class's rank, then the shorter build.

        Raises:
            AITuneError: when no candidate passed.
        """
        passing = [c for c in candidates if c.passed and c.measurement is not None]
        if not passing:
            raise AITuneError("no candidate passed")
        paired_scores = score is None and not by_latency
        score = score or _score(by_latency)
        top = max(passing, key=score)
        noise = _noise(top, self.profiling_config.min_noise) if paired_scores else top.measurement.noise
        tied = [c for c in passing if not score(top) > score(c) * (1 + noise)]
        return min(tied, key=lambda c: (_simplicity(c.backend), c.row.build_s or 0.0))

    def rank(self, candidates: list[Candidate], *, by_latency: bool = False) -> list[Backend]:
        """The passing, measured candidates' backends, best first (by paired speed-up or latency)."""
        passing = [c for c in candidates if c.passed and c.measurement is not None]
        return [c.backend for c in sorted(passing, key=_score(by_latency), reverse=True)]

    def pick_fastest(self, candidates: list[Candidate], *, by_latency: bool = False) -> Candidate:
        """The passing candidate with the best raw figure (no tie rule)."""
        passing = [c for c in candidates if c.passed and c.measurement is not None]
        return max(passing, key=_score(by_latency))

    @staticmethod
    def finish(chosen: Candidate, candidates: list[Candidate]) -> None:
        """Mark ``chosen`` selected and release every other built candidate."""
        chosen.row.status = SELECTED
        for candidate in candidates:
            if candidate is not chosen and candidate.backend is not None:
                candidate.backend.deactivate()


def quick_profiling(config: ProfilingConfig) -> ProfilingConfig:
    """The short measurement of the first round of successive halving (a tenth of a second or so per
    candidate; its figures only rank candidates)."""
    return ProfilingConfig(warmup_rounds=min(config.warmup_rounds, 2), warmup_s=min(config.warmup_s, 0.1),
                           min_rounds=min(config.min_rounds, 3), max_rounds=min(config.max_rounds, 30),
                           time_budget_s=min(config.time_budget_s, 0.3), stable_rel_error=max(config.stable_rel_error,
                                                                                             0.03),
                           min_noise=config.min_noise)


def _score(by_latency: bool) -> Callable[[Candidate], float]:
    """Higher is better. By latency: the inverse of the smallest batch's median latency. By throughput: the
    row's speed-up over eager (eager's own row: 1.0), which for a candidate timed in alternation with eager is
    the paired median (NOTE [paired speed-up] in aitune/torch/measure/profiling.py): every candidate is then compared
    with eager under the conditions of its own rounds, so load that comes and goes between one candidate's
    measurement and another's (or eager's) does not decide the choice. Without a speed-up: the raw throughput
    relative to nothing, i.e. 0 (never preferred)."""
    if by_latency:
        return lambda c: 1.0 / max(c.measurement.min_batch_latency_ms, 1e-9)
    return lambda c: c.row.speedup if c.row.speedup is not None else 0.0


def _noise(candidate: Candidate, min_noise: float) -> float:
    """The relative uncertainty of a candidate's paired speed-up: the spread of its per-round ratios (half the
    inter-quartile range over the median), at least ``min_noise``; without a paired figure, its own timing
    noise."""
    paired = candidate.measurement.paired if candidate.measurement is not None else None
    if paired is None:
        return candidate.measurement.noise
    return max(paired.spread, min_noise)


def _simplicity(backend: Backend) -> tuple[int, int]:
    # Plain eager first; then AOT over JIT (deployable without the original module); then the class's rank.
    # Eager with CUDA graphs or autocast is a JIT candidate like any other.
    if getattr(backend, "passthrough", False):
        return (0, 0)
    return (1 if backend.build_mode is BuildMode.AOT else 2, backend.rank)


def _promote_fallback(blueprint: Backend, earlier: list[Backend], results: list) -> Backend:
    """A fallback variant (``Backend.search_fallback``) as a first-tier candidate when no earlier variant of its
    backend class passed its checks in this tune; otherwise (and for any other blueprint) ``blueprint`` itself."""
    if not blueprint.search_fallback or any(
            type(other) is type(blueprint) and result is not None and result.passed
            for other, result in zip(earlier, results)):
        return blueprint
    return blueprint.copy()  # a fresh copy: first tier, no longer marked as a fallback


def _explain_finalists(finalists: list[Candidate], others: list[Candidate]) -> None:
    """A finalist whose full measurement came out below a non-finalist's quick figure would look misranked in the
    table (the two rows show figures of different rounds): its row says which quick figure made it a finalist."""
    quick = [c.row.speedup for c in others if c.row.speedup is not None]
    if not quick:
        return
    for candidate in finalists:
        full, first = candidate.row.speedup, candidate.row.details.get("quick_speedup")
        if full is not None and first is not None and full < max(quick):
            candidate.row.reason = "; ".join(filter(None, [
                f"finalist on its quick measurement ({first:.2f}x eager); the figures shown are the full one",
                candidate.row.reason]))

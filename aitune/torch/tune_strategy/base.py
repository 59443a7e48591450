"""The strategy base: configuration shared by every strategy and the rules for choosing among candidates.

Strategies only choose. The search they share (default candidates, successive halving, background builds,
device-memory sections, ranking reuse) is :func:`aitune.torch.search.engine.search`. Evaluating one candidate (availability → supports → build → check against eager →
round trip → measure) is :func:`aitune.torch.search.evaluation.evaluate`, the same path for every strategy; a
failing candidate never stops tuning (except in :class:`OneBackendStrategy`, which by design re-raises the
original error): it becomes a report row with a one-line reason naming the real cause and its log path.
"""

from __future__ import annotations

import copy
import logging
from typing import Callable, Iterable, Iterator

import torch

from aitune.errors import AITuneError, ConfigError
from aitune.torch.backend.base import Backend, BuildMode
from aitune.torch.check.context import EvaluationSettings, GraphContext
from aitune.torch.check.correctness import Tolerance
from aitune.torch.check.probes import ProbeConfig
from aitune.torch.common.arguments import init_keywords, reject_unknown_keywords
from aitune.torch.measure.profiling import ProfilingConfig, reaches_speedup
from aitune.torch.report.rows import PASSED, SELECTED, CandidateResult
from aitune.torch.search import engine
from aitune.torch.search.engine import default_backends, promote_fallback, relative_noise, score_for
from aitune.torch.search.engine import explain_finalists as _explain_finalists  # noqa: F401 - its old import path
from aitune.torch.search.evaluation import Candidate, eager_candidate, evaluate
from aitune.torch.search.head_to_head import settle_tie
from aitune.torch.search.max_batch_size import MaxBatchSizeSearch

logger = logging.getLogger(__name__)

QUANTIZATION_NOTE = "quantization is not used unless allowed: allow_quantization=True on the strategy"
REDUCED_PRECISION_NOTE = ("reduced precision (bf16/fp16 autocast of an fp32 model) is not used unless allowed: "
                          "allow_reduced_precision=True (or allow_quantization=True) on the strategy")

__all__ = ["Candidate", "GraphContext", "TuneStrategy", "default_backends", "install_reference_contract"]

# NOTE [reference strategies]: a strategy written for the reference system overrides ``_tune(module, name,
# graph_spec, data, device, cache_dir)`` instead of ``tune(context)``. The adapter that runs it,
# :mod:`aitune.torch.compat.strategy`, sits in a layer above this one and installs itself here when imported
# (``ait.tune`` imports it): this module never imports it.
_REFERENCE_CONTRACT: dict[str, Callable] = {}


def install_reference_contract(run: Callable, check_correctness: Callable) -> None:
    """Install the adapter of the reference system's strategy contract (NOTE [reference strategies]).

    Args:
        run: ``run(strategy, context) -> (backend, rows, why)``: ``_pre_tune`` → ``_tune`` → ``_post_tune`` and
            the check of the returned backend, for :meth:`TuneStrategy.tune` of a strategy that overrides ``_tune``.
        check_correctness: ``check_correctness(strategy, backend)``: :meth:`TuneStrategy.check_correctness`.
    """
    _REFERENCE_CONTRACT.update(run=run, check_correctness=check_correctness)


def _reference_contract(name: str) -> Callable:
    if name not in _REFERENCE_CONTRACT:
        raise AITuneError("strategies that override _tune run through aitune.torch.compat.strategy: import "
                          "aitune.torch (or aitune.torch.compat.strategy) before tuning with one")
    return _REFERENCE_CONTRACT[name]


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
            return _reference_contract("run")(self, context)
        raise NotImplementedError(f"{type(self).__name__} must override tune(context) or _tune(module, name, "
                                  "graph_spec, data, device, cache_dir)")

    # ---- the reference system's strategy contract (NOTE [reference strategies])
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
        _reference_contract("check_correctness")(self, backend)

    def settings(self, *, measure: bool = True) -> EvaluationSettings:
        """This strategy's evaluation settings (tolerance, profiling, which checks run)."""
        return EvaluationSettings(tolerance=self.tolerance, profiling=self.profiling_config,
                                  probes=self.probe_config, correctness_check=self.correctness_check,
                                  measure=measure)

    def evaluate(self, blueprint: Backend, context: GraphContext, *, measure_it: bool = True,
                 raise_errors: bool = False) -> Candidate:
        """One candidate through :func:`aitune.torch.search.evaluation.evaluate` with this strategy's settings."""
        return evaluate(blueprint, context, self.settings(measure=measure_it), raise_errors=raise_errors)

    def evaluate_in_order(self, blueprints: list[Backend], context: GraphContext, **options) -> Iterator[Candidate]:
        """:meth:`evaluate` each blueprint in turn, a fallback variant promoted where no earlier variant of its
        backend passed (:func:`~aitune.torch.search.engine.promote_fallback`), as the default search does."""
        evaluated: list[Candidate] = []
        for position, blueprint in enumerate(blueprints):
            evaluated.append(self.evaluate(promote_fallback(blueprint, blueprints[:position], evaluated), context,
                                           **options))
            yield evaluated[-1]

    finalists = 3  # candidates measured at full length after the quick round (successive halving)

    def search(self, context: GraphContext, *, by_latency: bool = False) -> list[Candidate]:
        """Evaluate every candidate with :func:`aitune.torch.search.engine.search`: one at a time, each released
        (device memory) before the next builds; an earlier search's ranking reused (:meth:`enable_ranking_reuse`).

        With more candidates than :attr:`finalists`, successive halving: every candidate is measured briefly
        (:func:`~aitune.torch.search.engine.quick_profiling`), then the best :attr:`finalists` selectable ones are
        measured again with the strategy's full :class:`ProfilingConfig`; the others keep their quick figures, are
        marked ``details["finalist"] = False`` and cannot be chosen (their rows say so).

        Returns:
            The evaluated candidates, in order.
        """
        return engine.search(context, self.candidates_for(context), self.search_settings(), by_latency=by_latency)

    def search_settings(self) -> engine.SearchSettings:
        """What the search engine needs from this strategy (:class:`aitune.torch.search.engine.SearchSettings`)."""
        facts = {"strategy": type(self).__qualname__, "tolerance": self.tolerance,
                 "profiling": self.profiling_config, "probes": self.probe_config,
                 "quantization": self.quantization_allowed, "reduced_precision": self.reduced_precision_allowed,
                 "correctness": self.correctness_check,
                 "performance_validation": self.performance_validation, "min_speedup": self.min_speedup_ratio}
        return engine.SearchSettings(evaluation=self.settings(), selectable=self.selectable, finalists=self.finalists,
                                     halving=self.performance_validation, reuse_rankings=self.reuse_rankings,
                                     ranking_facts=facts, description=self.describe())

    reuse_rankings = True  # see enable_ranking_reuse

    def enable_ranking_reuse(self, enabled: bool = True) -> "TuneStrategy":
        """Re-tunes of the same graph in the same environment build only the earlier winners (default on;
        see :mod:`aitune.torch.search.rankings`). ``False``: every tune searches all candidates. Returns self."""
        self.reuse_rankings = bool(enabled)
        return self

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
                candidate's throughput is judged by its paired speed-up over eager, see :func:`~aitune.torch.search.engine.score_for`).
            score: rank by this (higher is better, > 0) instead; e.g. throughput within a latency budget.

        The tie rule of every strategy: a candidate ties with the top one unless the top one beats it by more
        than the *top* candidate's relative noise (for paired speed-ups, the spread of its per-round ratios, at
        least ``min_noise``; a noisy slower candidate cannot widen the tie by its own noise). Among the tied, the
        simplest wins: plain eager, then AOT over JIT (deployable without the original module), then the backend
        class's rank, then the shorter build. (:class:`MaxThroughputStrategy` then settles the tie by timing the tied
        candidates against each other: :meth:`settle_tie`.)

        Raises:
            AITuneError: when no candidate passed.
        """
        tied = self.tied(candidates, by_latency=by_latency, score=score)
        return min(tied, key=lambda c: (_simplicity(c.backend), c.row.build_s or 0.0))

    def tied(self, candidates: list[Candidate], *, by_latency: bool = False,
             score: Callable[[Candidate], float] | None = None) -> list[Candidate]:
        """The passing, measured candidates tied with the top one by :meth:`pick`'s rule (the top one included).

        Raises:
            AITuneError: when no candidate passed.
        """
        passing = [c for c in candidates if c.passed and c.measurement is not None]
        if not passing:
            raise AITuneError("no candidate passed")
        paired_scores = score is None and not by_latency
        score = score or score_for(by_latency)
        top = max(passing, key=score)
        noise = relative_noise(top, self.profiling_config.min_noise) if paired_scores else top.measurement.noise
        return [c for c in passing if not score(top) > score(c) * (1 + noise)]

    def settle_tie(self, chosen: Candidate, tied: list[Candidate],
                   context: GraphContext) -> tuple[Candidate, list[str]]:
        """:func:`aitune.torch.search.head_to_head.settle_tie` with this strategy's profiling settings: the tied
        candidates timed head to head against the simplest (``chosen``). Returns ``(kept, notes)``."""
        return settle_tie(chosen, tied, context, self.profiling_config)

    def rank(self, candidates: list[Candidate], *, by_latency: bool = False) -> list[Backend]:
        """The passing, measured candidates' backends, best first (by paired speed-up or latency)."""
        passing = [c for c in candidates if c.passed and c.measurement is not None]
        return [c.backend for c in sorted(passing, key=score_for(by_latency), reverse=True)]

    def pick_fastest(self, candidates: list[Candidate], *, by_latency: bool = False) -> Candidate:
        """The passing candidate with the best raw figure (no tie rule)."""
        passing = [c for c in candidates if c.passed and c.measurement is not None]
        return max(passing, key=score_for(by_latency))

    @staticmethod
    def finish(chosen: Candidate, candidates: list[Candidate],
               figure: Callable[[Candidate], tuple[float, str] | None] | None = None) -> None:
        """Mark ``chosen`` selected and release every other built candidate. A passing, fully measured
        candidate that lost gets a reason: ``figure(candidate)`` — ``(score, text)``, higher is better, the
        figure the strategy chose by — against the chosen one's (default: the paired speed-up over eager)."""
        chosen.row.status = SELECTED
        for candidate in candidates:
            if candidate is not chosen:
                _say_why_not_chosen(candidate, chosen, figure or _speedup_figure)
                if candidate.backend is not None:
                    candidate.backend.deactivate()


def _speedup_figure(candidate: Candidate) -> tuple[float, str] | None:
    speedup = candidate.row.speedup
    return None if speedup is None else (speedup, f"{speedup:.2f}x eager")


def latency_figure(candidate: Candidate) -> tuple[float, str] | None:
    """The figure a latency strategy chooses by: the smallest batch's median latency (lower is better)."""
    latency = candidate.measurement.min_batch_latency_ms if candidate.measurement is not None else None
    return None if not latency else (1.0 / latency, f"{latency:.3f} ms at the smallest batch")


def _say_why_not_chosen(candidate: Candidate, chosen: Candidate, figure) -> None:
    """The reason of a passing, fully measured candidate that lost: its figure against the chosen one's. Rows that
    already say why (quick measurement only, not allowed to be chosen, rejected, the eager baseline) keep theirs."""
    row = candidate.row
    if (row.status != PASSED or candidate.measurement is None or getattr(candidate.backend, "passthrough", False)
            or not row.details.get("finalist", True)
            or any(note in (row.reason or "") for note in (QUANTIZATION_NOTE, REDUCED_PRECISION_NOTE))):
        return
    mine, theirs = figure(candidate), figure(chosen)
    if mine is None or theirs is None:
        verdict = f"not selected: the strategy chose {chosen.row.description}"
    else:
        verdict = f"not selected: {mine[1]} against {theirs[1]} for the selected {chosen.row.description}"
        settled = row.details.get("head_to_head")
        if settled is not None and settled["against"] == chosen.row.description and "speedup" in settled:
            verdict += f"; timed head to head against it: {settled['speedup']:.2f}x its speed"
            if mine[0] > theirs[0] and settled["speedup"] >= 1:
                verdict += " (within the noise of that figure, the simpler one is kept)"
        elif mine[0] > theirs[0]:
            verdict += (" (within the measured noise of this candidate, the simpler one is kept: eager, then AOT "
                        "over JIT, then the backend's rank)")
    row.reason = "; ".join(filter(None, [verdict, row.reason]))


def _simplicity(backend: Backend) -> tuple[int, int]:
    # Plain eager first; then AOT over JIT (deployable without the original module); then the class's rank.
    # Eager with CUDA graphs or autocast is a JIT candidate like any other.
    if getattr(backend, "passthrough", False):
        return (0, 0)
    return (1 if backend.build_mode is BuildMode.AOT else 2, backend.rank)

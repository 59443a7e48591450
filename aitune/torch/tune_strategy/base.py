"""The strategy base: evaluate candidates (availability → supports → build → check vs eager → measure).

Every strategy shares :meth:`TuneStrategy.evaluate`; strategies differ only in which candidates they
evaluate and how they choose. A failing candidate never stops tuning (except in
:class:`OneBackendStrategy`, which by design re-raises the original error): it becomes a report row with a
one-line reason naming the real cause and the path of its full log.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Iterable

import torch

from aitune.errors import AITuneError, BackendBuildError, ConfigError, CorrectnessError, ToleranceExceededError
from aitune.torch.backend.base import Backend, BuildMode, one_line
from aitune.torch.correctness import OutputComparator, Tolerance
from aitune.torch.profiling import Measurement, ProfilingConfig, beats, measure
from aitune.torch.report import (
    FAILED,
    PASSED,
    REJECTED_CORRECTNESS,
    SELECTED,
    UNAVAILABLE,
    UNSUPPORTED,
    CandidateResult,
)
from aitune.torch.samples import clone_tree

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class GraphContext:
    """What a strategy needs to tune one graph of one module.

    Attributes:
        module: the user's module (never modified). module_name: report name.
        graph: the :class:`~aitune.torch.samples.GraphSpec` with recorded samples.
        device: where to build and run. workdir: ``<cache>/<module>/<graph>``.
        reference_outputs: eager outputs per sample (computed once on cloned inputs under no_grad).
        reference_inputs_after: per sample, the input leaves after the eager call (for in-place ops).
        cache: optional build cache (see :mod:`aitune.torch.cache`).
    """

    module: torch.nn.Module
    module_name: str
    graph: Any
    device: torch.device
    workdir: Path
    reference_outputs: list
    reference_inputs_after: list | None = None
    cache: Any = None
    eager_measurement: Measurement | None = None
    _fp32_outputs: dict = dataclasses.field(default_factory=dict)
    _fp32_unavailable: bool = False

    def fp32_reference(self, index: int) -> Any:
        """Outputs of a float32 copy of the module on sample ``index`` (fp16/bf16 inputs upcast), or None.

        Computed lazily, only when an fp16/bf16 candidate misses the plain tolerance (correctness rule 5);
        the copy is dropped right after. None when the copy or the call fails (e.g. out of memory).
        """
        if self._fp32_unavailable:
            return None
        if index not in self._fp32_outputs:
            try:
                module32 = copy.deepcopy(self.module).float()
                with torch.no_grad():
                    for position, sample in enumerate(self.graph.samples):
                        args, kwargs = _upcast(sample.clone())
                        self._fp32_outputs[position] = clone_tree(module32(*args, **kwargs))
                del module32
            except Exception:  # noqa: BLE001 - rule 5 is a second chance, never a new failure
                logger.debug("no fp32 reference for %s/%s", self.module_name, self.graph.name, exc_info=True)
                self._fp32_unavailable = True
                return None
        return self._fp32_outputs.get(index)


@dataclasses.dataclass
class Candidate:
    """A candidate after evaluation: the built backend (None if it did not pass) and its report row."""

    backend: Backend | None
    row: CandidateResult
    measurement: Measurement | None = None

    @property
    def passed(self) -> bool:
        return self.backend is not None and self.row.status == PASSED


def default_backends(device: torch.device | str) -> list[Backend]:
    """Candidates tried when a strategy is given none: every built-in backend's default configuration.

    Unavailable ones still get a report row saying why (case U6). On CUDA, Inductor with CUDA graphs
    (``mode="reduce-overhead"``) and eager replayed from CUDA graphs are added: eager at batch 1 is
    launch-bound there (H200 figures in benchmarks/RESULTS.md).
    """
    from aitune.torch import backend as backends

    candidates: list[Backend] = [backends.TorchInductorJitBackend()]
    if torch.device(device).type == "cuda":
        candidates.append(backends.TorchInductorJitBackend(backends.TorchInductorJitBackendConfig(
            mode="reduce-overhead")))
        candidates.append(backends.TorchEagerBackend(backends.TorchEagerBackendConfig(use_cuda_graphs=True)))
    for name in ("TorchInductorAotBackend", "ONNXRuntimeBackend", "TorchAOBackend", "TensorRTBackend",
                 "TorchTensorRTJitBackend", "TorchTensorRTAotBackend"):
        backend_class = getattr(backends, name)
        if isinstance(backend_class, type) and issubclass(backend_class, Backend):
            candidates.append(backend_class())
    return candidates


class TuneStrategy:
    """Base of every strategy.

    Args:
        backends: candidate backends (blueprints, copied before each build); None = :func:`default_backends`.
        profiling_config: how to measure (:class:`~aitune.torch.profiling.ProfilingConfig`).
        tolerance: thresholds of the comparison with eager (:class:`~aitune.torch.correctness.Tolerance`).

    Raises:
        ConfigError: when ``backends`` is empty or holds something that is not a Backend.
    """

    def __init__(self, backends: Iterable[Backend] | Backend | None = None, *,
                 profiling_config: ProfilingConfig | None = None, tolerance: Tolerance | None = None):
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
            raise ConfigError("profiling_config must be an aitune.torch.profiling.ProfilingConfig")
        if tolerance is not None and not isinstance(tolerance, Tolerance):
            raise ConfigError("tolerance must be an aitune.torch.correctness.Tolerance")
        self.backends = backends
        self.profiling_config = profiling_config or ProfilingConfig()
        self.tolerance = tolerance or Tolerance()
        self.correctness_check = True
        self.performance_validation = True
        self.min_speedup_ratio = 1.0

    # ---- configuration (chainable, as in the reference)
    def enable_correctness_check(self, enabled: bool = True, tolerance: Tolerance | None = None) -> "TuneStrategy":
        """Turn the comparison with eager on/off; optionally set its tolerance. Returns self."""
        self.correctness_check = bool(enabled)
        if tolerance is not None:
            if not isinstance(tolerance, Tolerance):
                raise ConfigError("tolerance must be an aitune.torch.correctness.Tolerance")
            self.tolerance = tolerance
        return self

    def enable_performance_validation(self, enabled: bool = True, min_speedup_ratio: float = 1.0) -> "TuneStrategy":
        """Require a candidate to beat eager (by ``min_speedup_ratio`` and the noise) to be chosen. Returns self."""
        if not isinstance(min_speedup_ratio, (int, float)) or min_speedup_ratio <= 0:
            raise ConfigError(f"min_speedup_ratio must be a number > 0, got {min_speedup_ratio!r}")
        self.performance_validation = bool(enabled)
        self.min_speedup_ratio = float(min_speedup_ratio)
        return self

    def clone(self) -> "TuneStrategy":
        return copy.deepcopy(self)

    def candidates(self, device: torch.device) -> list[Backend]:
        return list(self.backends) if self.backends is not None else default_backends(device)

    def describe(self) -> str:
        names = [backend.describe() for backend in self.backends] if self.backends is not None else ["<defaults>"]
        return f"{type(self).__name__}({', '.join(names)})"

    # ---- the work
    def tune(self, context: GraphContext) -> tuple[Backend, list[CandidateResult], str]:
        """Tune one graph. Returns (chosen backend, report rows, why it was chosen)."""
        raise NotImplementedError

    def evaluate(self, blueprint: Backend, context: GraphContext, *, measure_it: bool = True,
                 raise_errors: bool = False) -> Candidate:
        """Availability → supports → build → correctness → measure, as one report row."""
        graph = context.graph
        row = CandidateResult(module=context.module_name, graph=graph.name, backend=blueprint.name,
                              description=blueprint.describe())
        try:
            support = blueprint.supports(context.module, graph, context.device)
        except Exception as exc:  # noqa: BLE001 - a crashing eligibility check is a row too
            row.status, row.reason = FAILED, "supports(): " + _reason(exc)
            logger.info("  %-28s failed: %s", blueprint.describe()[:28], row.reason)
            if raise_errors:
                raise
            return Candidate(None, row)
        if not support.ok:
            row.status = UNAVAILABLE if not blueprint.availability().ok else UNSUPPORTED
            row.reason = support.reason
            logger.info("  %-28s %s: %s", blueprint.describe()[:28], row.status, row.reason)
            if raise_errors:
                from aitune.errors import BackendUnavailableError

                raise BackendUnavailableError(f"Backend '{blueprint.name}' cannot run here: {support.reason}")
            return Candidate(None, row)
        workdir = context.workdir / blueprint.key()
        logger.info("  %-28s building…", blueprint.describe()[:28])
        started = time.perf_counter()
        try:
            if context.cache is not None:
                backend, row.cached = context.cache.build(blueprint, context.module, graph, context.device, workdir)
            else:
                backend = blueprint.copy().build(context.module, graph, context.device, workdir)
        except Exception as exc:  # noqa: BLE001 - any candidate failure is a row, never a crash
            row.status, row.reason = FAILED, _reason(exc)
            row.build_s = time.perf_counter() - started
            row.log_path = str(getattr(exc, "log_path", None) or workdir / "build.log")
            logger.info("  %-28s failed: %s", blueprint.describe()[:28], row.reason)
            if raise_errors:
                raise
            return Candidate(None, row)
        row.build_s = backend.build_info.get("build_s", time.perf_counter() - started)
        row.log_path = str(workdir / "build.log")
        row.details = {k: v for k, v in backend.build_info.items() if k != "build_s"}
        if self.correctness_check:
            try:
                row.comparison = check_against_eager(backend, context, self.tolerance).to_dict()
            except Exception as exc:  # noqa: BLE001
                row.status = REJECTED_CORRECTNESS if isinstance(exc, CorrectnessError) else FAILED
                row.reason = _reason(exc)
                logger.info("  %-28s %s: %s", blueprint.describe()[:28], row.status, row.reason)
                backend.deactivate()
                if raise_errors:
                    raise
                return Candidate(None, row)
        if backend.build_mode is BuildMode.AOT and not row.cached:
            try:
                verify_round_trip(backend, context)
            except Exception as exc:  # noqa: BLE001 - case C23: not saveable means not selectable
                row.status, row.reason = FAILED, "not saveable: " + _reason(exc)
                logger.info("  %-28s failed: %s", blueprint.describe()[:28], row.reason)
                backend.deactivate()
                if raise_errors:
                    raise
                return Candidate(None, row)
        result = Candidate(backend, row)
        if measure_it:
            try:
                result.measurement = measure_backend(backend, context, self.profiling_config)
            except Exception as exc:  # noqa: BLE001
                row.status, row.reason = FAILED, "measuring: " + _reason(exc)
                if raise_errors:
                    raise
                return Candidate(None, row)
            row.measurement = result.measurement.to_dict()
            eager = self.eager_baseline(context)
            if eager is not None and eager.throughput > 0:
                row.speedup = result.measurement.throughput / eager.throughput
        row.reason = "; ".join(filter(None, [build_notes(row.details), noise_note(result.measurement)]))
        logger.info("  %-28s passed%s", blueprint.describe()[:28],
                    f" ({row.speedup:.2f}x eager)" if row.speedup is not None else "")
        return result

    def eager_baseline(self, context: GraphContext) -> Measurement | None:
        """Eager measured once per graph, in the same run and under the same conditions as candidates."""
        if context.eager_measurement is None:
            self.eager_candidate(context)
        return context.eager_measurement

    def eager_candidate(self, context: GraphContext) -> Candidate:
        """The eager baseline as a passing candidate (always correct by definition), measured once per graph."""
        from aitune.torch.backend.eager import TorchEagerBackend

        blueprint = TorchEagerBackend()
        backend = blueprint.copy().build(context.module, context.graph, context.device,
                                         context.workdir / blueprint.key())
        if context.eager_measurement is None:
            context.eager_measurement = measure_backend(backend, context, self.profiling_config)
        measurement = context.eager_measurement
        row = CandidateResult(module=context.module_name, graph=context.graph.name, backend=blueprint.name,
                              description=blueprint.describe(), build_s=backend.build_info.get("build_s"),
                              measurement=measurement.to_dict(), speedup=1.0,
                              reason="; ".join(filter(None, ["baseline", noise_note(measurement)])))
        return Candidate(backend, row, measurement)

    # ---- selection helpers
    def pick_fastest(self, candidates: list[Candidate], *, by_latency: bool = False) -> Candidate:
        passing = [c for c in candidates if c.passed and c.measurement is not None]
        if by_latency:
            return min(passing, key=lambda c: c.measurement.min_batch_latency_ms)
        return max(passing, key=lambda c: c.measurement.throughput)

    def pick(self, candidates: list[Candidate], *, by_latency: bool = False) -> Candidate:
        """Best passing candidate; within the measured noise of the best, the simplest wins (eager, then AOT
        over JIT, then shorter build)."""
        passing = [c for c in candidates if c.passed and c.measurement is not None]
        if not passing:
            raise AITuneError("no candidate passed")

        def score(candidate: Candidate) -> float:
            m = candidate.measurement
            return -m.min_batch_latency_ms if by_latency else m.throughput

        top = max(passing, key=score)
        # Within the *top* candidate's noise: a noisy slower candidate cannot widen the tie by its own noise.
        tied = [c for c in passing
                if not beats(top.measurement, c.measurement, by_latency=by_latency, noise=top.measurement.noise)]
        return min(tied, key=lambda c: (_simplicity(c.backend), c.row.build_s or 0.0))

    @staticmethod
    def finish(chosen: Candidate, candidates: list[Candidate]) -> None:
        chosen.row.status = SELECTED
        for candidate in candidates:
            if candidate is not chosen and candidate.backend is not None:
                candidate.backend.deactivate()


NOISY = 0.10  # relative noise above which a row says its figures are unreliable


def noise_note(measurement: Measurement | None) -> str:
    """A warning for figures too noisy to trust (another process busy on the machine, frequency changes)."""
    if measurement is None or measurement.noise <= NOISY:
        return ""
    return f"noisy measurement (±{measurement.noise:.0%}): other load on the machine? re-run to confirm"


def build_notes(details: dict) -> str:
    """One line of what a passing build did that users should know (preset, graph breaks, EP, specialisation)."""
    notes = []
    if details.get("preset"):
        notes.append(f"preset {details['preset']}")
    if details.get("graph_breaks"):
        notes.append(f"{details['graph_breaks']} graph break(s)")
    if details.get("providers"):
        notes.append("EP " + ",".join(p.removesuffix("ExecutionProvider") for p in details["providers"]))
    if details.get("shape_specialized") or details.get("specialized_axes"):
        notes.append("shape-specialized: calls outside its shapes run eager")
    if details.get("export_batch_repeated"):
        notes.append("exported at batch >= 2 (sample repeated)")
    return "; ".join(notes)


def _simplicity(backend: Backend) -> tuple[int, int]:
    # Plain eager first; then AOT over JIT (deployable without the original module); then the class's rank.
    # Eager with CUDA graphs or autocast is a JIT candidate like any other.
    if getattr(backend, "passthrough", False):
        return (0, 0)
    return (1 if backend.build_mode is BuildMode.AOT else 2, backend.rank)


def _reason(exc: BaseException) -> str:
    """One line naming the real cause: for wrapped errors, the innermost chained cause."""
    if isinstance(exc, BackendBuildError) and exc.__cause__ is not None:
        root = exc.__cause__
        while root.__cause__ is not None:
            root = root.__cause__
        return one_line(root)
    return one_line(exc)


def _upcast(sample) -> tuple[tuple, dict]:
    from aitune.torch.pytree import tree_flatten, tree_unflatten

    leaves, spec = tree_flatten((sample.args, sample.kwargs))
    leaves = [leaf.float() if isinstance(leaf, torch.Tensor) and leaf.dtype in (torch.float16, torch.bfloat16)
              else leaf for leaf in leaves]
    return tree_unflatten(spec, leaves)


def check_against_eager(backend: Backend, context: GraphContext, tolerance: Tolerance):
    """Run ``backend`` on a fresh clone of every sample and compare with eager (outputs and in-place effects).

    Outputs are cloned right after each call, before the next one (case C20, U4).

    Raises:
        CorrectnessError (ShapeMismatchError / ToleranceExceededError): on the first violation.
    """
    comparator = OutputComparator(tolerance, quantized=backend.is_quantizing,
                                  low_precision=bool(getattr(backend, "low_precision", False)))
    graph = context.graph
    for index, sample in enumerate(graph.samples):
        inputs = sample.clone()
        with torch.no_grad():
            output = clone_tree(backend.infer(*inputs.args, **inputs.kwargs))
        try:
            comparator.compare(context.reference_outputs[index], output)
        except ToleranceExceededError as exc:
            # Correctness rule 5 (aitune/torch/correctness.py): fp16/bf16 leaves may pass against an fp32 run.
            if not (tolerance.fp32_parity and exc.tolerance.startswith("atol=") and not backend.is_quantizing):
                raise
            reference_fp32 = context.fp32_reference(index)
            if reference_fp32 is None:
                raise
            comparator.compare(context.reference_outputs[index], output, reference_fp32=reference_fp32)
        if graph.mutated_inputs and context.reference_inputs_after is not None:
            try:
                comparator.compare(context.reference_inputs_after[index], inputs.leaves())
            except CorrectnessError as exc:
                raise type(exc)(f"input mutation not preserved: {exc}") from exc
    return comparator.result()


def verify_round_trip(backend: Backend, context: GraphContext) -> None:
    """Save an AOT backend's artifact, load it back without the module and compare one output (case C23).

    The loaded copy must reproduce the built backend's output on the first sample within 1e-6 (abs and
    rel); the copy is then dropped. Raises whatever save/load raise, or ToleranceExceededError.
    """
    import tempfile

    sample = context.graph.samples[0]
    with tempfile.TemporaryDirectory(prefix="aitune-roundtrip-") as directory:
        metadata = backend.save(Path(directory))
        restored = type(backend).from_checkpoint(Path(directory), backend.config, metadata, None, context.graph,
                                                 context.device)
        with torch.no_grad():
            inputs = sample.clone()
            expected = clone_tree(backend.infer(*inputs.args, **inputs.kwargs))
            inputs = sample.clone()
            actual = restored.infer(*inputs.args, **inputs.kwargs)
        restored.deactivate()
    OutputComparator(Tolerance(atol=1e-6, rtol=1e-6, low_precision_atol=1e-6, low_precision_rtol=1e-6)).compare(
        expected, actual)


def measure_backend(backend: Backend, context: GraphContext, config: ProfilingConfig) -> Measurement:
    samples = [sample.clone() for sample in context.graph.samples]
    batch_sizes = [sample.batch_size or 1 for sample in samples]
    if context.graph.mutated_inputs:
        # The module changes its inputs in place: each call gets a fresh copy (for every candidate alike),
        # or thousands of warm-up calls would drift the inputs towards inf/denormals.
        def run(sample):
            fresh = sample.clone()
            return backend.infer(*fresh.args, **fresh.kwargs)
    else:
        def run(sample):
            return backend.infer(*sample.args, **sample.kwargs)
    return measure(run, samples, batch_sizes, context.device, config)

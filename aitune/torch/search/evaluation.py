"""One candidate, one path: availability → supports → build → check against eager → round trip → measure.

Every strategy evaluates candidates through :func:`evaluate`; strategies only decide *which* candidates to
evaluate and *which* to choose. A step that fails ends the path through the one exit in :func:`evaluate`:
the candidate becomes a report row with a one-line reason naming the real cause and the path of its full
log (and its backend, if built, is released). Only :class:`~aitune.torch.tune_strategy.OneBackendStrategy`
asks for the original error instead (``raise_errors=True``).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from aitune.errors import (
    BackendBuildError,
    BackendUnavailableError,
    CorrectnessError,
    TuningError,
)
from aitune.torch.backend.base import Backend, BackendState, BuildMode, one_line
from aitune.torch.backend.eager import TorchEagerBackend
from aitune.torch.backend.isolation import BACKGROUND_BUILDS, BUILD_DEADLINE
from aitune.torch.check.checks import check_against_eager, check_probes, verify_round_trip
from aitune.torch.check.context import EvaluationSettings, GraphContext
from aitune.torch.check.correctness import comparator_for
from aitune.torch.measure.profiling import (
    Measurement,
    ProfilingConfig,
    measure,
    measure_pair,
    paired_speedup,
)
from aitune.torch.search.crashes import crash_signal
from aitune.torch.record.object_state import reset_state
from aitune.torch.report.rows import (
    FAILED,
    NO_OP,
    PASSED,
    REJECTED_CORRECTNESS,
    SKIPPED,
    UNAVAILABLE,
    UNSUPPORTED,
    CandidateResult,
)

logger = logging.getLogger(__name__)

NOISY = 0.10  # relative noise above which a row says its figures are unreliable


@dataclasses.dataclass
class Candidate:
    """A candidate after evaluation: the built backend (None if it did not pass) and its report row."""

    backend: Backend | None
    row: CandidateResult
    measurement: Measurement | None = None

    @property
    def passed(self) -> bool:
        return self.backend is not None and self.row.status == PASSED


class _Stop(Exception):
    """Ends a candidate's path: its status, the reason's prefix and the error that caused it."""

    def __init__(self, status: str, cause: BaseException | None, reason: str = "", prefix: str = ""):
        super().__init__(reason)
        self.status, self.cause, self.reason, self.prefix = status, cause, reason, prefix


def evaluate(blueprint: Backend, context: GraphContext, settings: EvaluationSettings, *,
             raise_errors: bool = False) -> Candidate:
    """Take one candidate through availability → supports → build → check → round trip → measure.

    Args:
        blueprint: the backend to try (copied before building; never built itself).
        context: the graph, the user's module, eager's reference outputs.
        settings: tolerance, profiling and which checks run.
        raise_errors: re-raise the original error of a failing step (OneBackendStrategy) after recording it.

    Returns:
        A :class:`Candidate`: ``passed`` with an ACTIVE backend and (with ``settings.measure``) its
        measurement, or a row with status failed / rejected (correctness) / unavailable / unsupported /
        skipped / no-op.

    Raises:
        Only with ``raise_errors``: the original error (BackendBuildError, CorrectnessError, ...), or
        BackendUnavailableError when the backend cannot run here, TuningError when it was skipped.
    """
    started = start(blueprint, context, settings, raise_errors=raise_errors)
    return started if isinstance(started, Candidate) else complete(started, context)


@dataclasses.dataclass
class Evaluation:
    """A candidate whose build started (possibly still running in the background): what :func:`complete`
    needs to finish its evaluation."""

    blueprint: Backend
    backend: Backend
    row: CandidateResult
    settings: EvaluationSettings
    raise_errors: bool = False


def start(blueprint: Backend, context: GraphContext, settings: EvaluationSettings, *, raise_errors: bool = False,
          background=None) -> Evaluation | Candidate:
    """The first half of :func:`evaluate`: support, budget and crash checks, then the build. With
    ``background`` (an executor), a backend whose heavy step runs in a child process starts it there and
    returns at once (NOTE [background builds] in :mod:`aitune.torch.backend.isolation`).

    Returns:
        An :class:`Evaluation` for :func:`complete`, or the finished :class:`Candidate` when the path ended.
    """
    row = CandidateResult(module=context.module_name, graph=context.graph.name, backend=blueprint.name,
                          description=blueprint.describe())
    try:
        context.show(blueprint.describe(), "supports")
        _check_support(blueprint, context, row)
        _check_budget_and_crashes(blueprint, context)
        context.show(blueprint.describe(), "build")
        token = BACKGROUND_BUILDS.set(background)
        try:
            backend = _build(blueprint, context, row)
        finally:
            BACKGROUND_BUILDS.reset(token)
    except _Stop as stop:
        return _failed(stop, blueprint, context, row, None, raise_errors)
    return Evaluation(blueprint, backend, row, settings, raise_errors)


def complete(evaluation: Evaluation, context: GraphContext) -> Candidate:
    """The second half of :func:`evaluate`: wait for a background build, then check against eager, probes,
    round trip, measure — ending in the one failure exit when a step fails."""
    blueprint, row = evaluation.blueprint, evaluation.row
    phases = row.details.setdefault("phase_s", {})  # seconds per phase after the build: where a tune's time went
    current = [None, time.perf_counter()]

    def show(phase: str | None) -> None:
        now = time.perf_counter()
        if current[0] is not None:
            phases[current[0]] = round(phases.get(current[0], 0.0) + now - current[1], 4)
        current[0], current[1] = phase, now
        if phase is not None:
            context.show(blueprint.describe(), phase)

    try:
        return _complete(evaluation, context, show)
    finally:
        show(None)


def _complete(evaluation: Evaluation, context: GraphContext, show) -> Candidate:
    blueprint, backend, row, settings = evaluation.blueprint, evaluation.backend, evaluation.row, evaluation.settings
    try:
        if backend.state is BackendState.BUILDING:
            show("build_wait")
            try:
                backend.finish_build()
            except Exception as exc:  # noqa: BLE001 - a failed background build is a failed build
                _build_failed(exc, blueprint, context, row)
            row.build_s = backend.build_info.get("build_s", row.build_s)
            if context.cache is not None:
                context.cache.store(blueprint, context.module, context.graph, context.device, backend)
        if backend.is_quantizing and backend.build_info.get("quantized_modules") == 0:
            raise _Stop(NO_OP, None, reason="quantized nothing: no layer matched its quantization config, so it would "
                                            "only run the original model under another name; never selected")
        if settings.correctness_check:
            comparator = comparator_for(backend, settings.tolerance)
            show("check")
            try:
                check_against_eager(backend, context, settings.tolerance, comparator)
            except Exception as exc:  # noqa: BLE001 - any failure of the check is a row
                raise _Stop(REJECTED_CORRECTNESS if isinstance(exc, CorrectnessError) else FAILED, exc) from exc
            show("probes")
            try:
                row.probes = check_probes(backend, context, settings, comparator)
            except Exception as exc:  # noqa: BLE001
                probe = getattr(exc, "probe", None)
                row.probes = getattr(exc, "probe_counts", None)
                prefix = f"probe {probe.kind} ({probe.description}): " if probe is not None else "probes: "
                raise _Stop(REJECTED_CORRECTNESS if isinstance(exc, CorrectnessError) else FAILED, exc,
                            prefix=prefix) from exc
            row.comparison = comparator.result().to_dict()
        if backend.build_mode is BuildMode.AOT and not row.cached:
            show("round_trip")
            try:
                verify_round_trip(backend, context, settings.tolerance)
            except Exception as exc:  # noqa: BLE001 - not saveable means not selectable
                raise _Stop(FAILED, exc, prefix="not saveable: ") from exc
        measurement = None
        if settings.measure:
            show("measure")
            try:
                measurement = measure_backend(backend, context, settings.profiling)
            except Exception as exc:  # noqa: BLE001
                raise _Stop(FAILED, exc, prefix="measuring: ") from exc
            _set_figures(row, measurement, context, settings.profiling)
    except _Stop as stop:
        return _failed(stop, blueprint, context, row, backend, evaluation.raise_errors)
    if context.progress is not None:
        context.progress.candidate_done()
    row.reason = "; ".join(filter(None, [build_notes(row.details), noise_note(measurement),
                                         speedup_noise_note(measurement)]))
    logger.info("  %-28s passed%s", blueprint.describe(),
                f" ({row.speedup:.2f}x eager)" if row.speedup is not None else "")
    return Candidate(backend, row, measurement)


def _failed(stop: "_Stop", blueprint: Backend, context: GraphContext, row: CandidateResult, backend: Backend | None,
            raise_errors: bool) -> Candidate:
    """The one failure exit: the row gets the status and a one-line reason, the backend is released, and with
    ``raise_errors`` the original error is raised (the row attached to it)."""
    if context.progress is not None:
        context.progress.candidate_done()
    row.status = stop.status
    row.reason = stop.reason or stop.prefix + failure_reason(stop.cause)
    logger.info("  %-28s %s: %s", blueprint.describe(), row.status, row.reason)
    if backend is not None:
        backend.deactivate()
    if raise_errors:
        if stop.cause is not None:
            stop.cause.candidate_row = row  # tune() still reports the row of the error it re-raises
            raise stop.cause
        if stop.status in (NO_OP, SKIPPED):
            raise TuningError(f"Backend '{blueprint.name}' {row.reason}") from None
        raise BackendUnavailableError(f"Backend '{blueprint.name}' cannot run here: {row.reason}") from None
    return Candidate(None, row)


def unsupported(blueprint: Backend, context: GraphContext) -> Candidate | None:
    """The row of a candidate that cannot run here at all (unavailable, unsupported, a failing ``supports()``),
    found without building it; None when it could be built."""
    row = CandidateResult(module=context.module_name, graph=context.graph.name, backend=blueprint.name,
                          description=blueprint.describe())
    try:
        _check_support(blueprint, context, row)
    except _Stop as stop:
        row.status = stop.status
        row.reason = stop.reason or stop.prefix + failure_reason(stop.cause)
        return Candidate(None, row)
    return None


def _check_support(blueprint: Backend, context: GraphContext, row: CandidateResult) -> None:
    try:
        support = blueprint.supports(context.module, context.graph, context.device)
    except Exception as exc:  # noqa: BLE001 - a crashing eligibility check is a row too
        raise _Stop(FAILED, exc, prefix="supports(): ") from exc
    if not support.ok:
        status = UNAVAILABLE if not blueprint.availability().ok else (NO_OP if support.no_op else UNSUPPORTED)
        raise _Stop(status, None, reason=support.reason)


# Time left of an explicit budget below which a candidate of each search tier is not started (tier 0: always).
TIER_MIN_S = {1: 60.0, 2: 300.0}


def _check_budget_and_crashes(blueprint: Backend, context: GraphContext) -> None:
    """Skip a candidate that crashed this environment before, an expensive one the budget does not allow,
    and any once the budget is spent."""
    if context.crashes is not None:
        crash = context.crashes.lookup(blueprint, context.device)
        if crash is not None:
            raise _Stop(SKIPPED, None, reason=f"crashed this environment before ({crash['signal']}, {crash['when']}: "
                                              f"{crash['reason']}; log {crash['log']}) — `aitune env --clear-crashes` "
                                              "retries it")
    remaining = context.remaining_s()
    if remaining is not None and remaining <= 0:
        raise _Stop(SKIPPED, None, reason="time budget spent before this candidate could be built")
    tier = blueprint.search_tier
    needed = TIER_MIN_S[min(tier, 2)] if tier else 0.0
    if tier and (remaining is None or remaining < needed):
        left = "no time budget was given" if remaining is None else f"only {remaining:.0f} s of the budget left"
        what = "expensive build (minutes)" if tier >= 2 else "extra search variant"
        when = f"tried only with >= {needed:.0f} s of time budget left"
        if blueprint.search_fallback:
            what, when = ("fallback variant", "tried without a budget only when no other variant of its backend "
                          f"passes its checks (one did), otherwise only with >= {needed:.0f} s of it left")
        raise _Stop(SKIPPED, None, reason=f"{what}, {when}; {left} (ait.tune(..., time_budget_s=...))")


def _build(blueprint: Backend, context: GraphContext, row: CandidateResult) -> Backend:
    workdir = context.workdir / blueprint.key()
    logger.info("  %-28s building…", blueprint.describe())
    started = time.perf_counter()
    row.log_path = str(workdir / "build.log")
    deadline = BUILD_DEADLINE.set(context.deadline)
    try:
        if context.cache is not None:
            backend, row.cached = context.cache.build(blueprint, context.module, context.graph, context.device,
                                                      workdir)
        else:
            backend = blueprint.copy().build(context.module, context.graph, context.device, workdir)
    except Exception as exc:  # noqa: BLE001 - any candidate failure is a row, never a crash
        row.build_s = time.perf_counter() - started
        _build_failed(exc, blueprint, context, row)
    finally:
        BUILD_DEADLINE.reset(deadline)
    row.build_s = backend.build_info.get("build_s", time.perf_counter() - started)
    row.details = {k: v for k, v in backend.build_info.items() if k != "build_s"}
    return backend


def _build_failed(exc: BaseException, blueprint: Backend, context: GraphContext, row: CandidateResult) -> None:
    """A failed build: its log, a crash remembered for this environment; raises the failure exit."""
    row.log_path = str(getattr(exc, "log_path", None) or row.log_path)
    signal_name = crash_signal(exc)
    if signal_name is not None and context.crashes is not None:
        context.crashes.record(blueprint, context.device, signal_name, failure_reason(exc), row.log_path)
    raise _Stop(FAILED, exc) from exc


def build_eager(context: GraphContext) -> Backend:
    """Plain eager (:class:`~aitune.torch.backend.eager.TorchEagerBackend`) built for the graph."""
    blueprint = TorchEagerBackend()
    return blueprint.copy().build(context.module, context.graph, context.device, context.workdir / blueprint.key())


def eager_runner(context: GraphContext) -> Backend:
    """Plain eager as a built backend, made once per graph (kept in ``context.eager_runner``, released by
    ``context.release()``): what every candidate is timed against in alternation (NOTE [paired speed-up] in
    :mod:`aitune.torch.measure.profiling`)."""
    if context.eager_runner is None:
        context.eager_runner = build_eager(context)
    return context.eager_runner


def eager_candidate(context: GraphContext, profiling: ProfilingConfig) -> Candidate:
    """The eager baseline as a passing candidate (correct by definition), measured once per graph.

    Eager is measured in the same run and under the same conditions as the candidates; the measurement is
    kept in ``context.eager_measurement`` and reused by later calls (and by :func:`evaluate` for the
    speed-up column).
    """
    backend = build_eager(context)
    if context.eager_measurement is None:
        context.show("eager (baseline)", "measure")
        context.eager_measurement = measure(sample_caller(backend, context), *graph_samples(context), context.device,
                                            profiling)
        if context.progress is not None:
            context.progress.candidate_done()
    measurement = context.eager_measurement
    row = CandidateResult(module=context.module_name, graph=context.graph.name, backend=backend.name,
                          description=backend.describe(), build_s=backend.build_info.get("build_s"),
                          measurement=measurement.to_dict(), speedup=1.0,
                          reason="; ".join(filter(None, ["baseline", noise_note(measurement)])))
    return Candidate(backend, row, measurement)


def noise_note(measurement: Measurement | None) -> str:
    """A warning for figures too noisy to trust (another process busy on the machine, frequency changes)."""
    if measurement is None or measurement.noise <= NOISY:
        return ""
    return f"noisy measurement (±{measurement.noise:.0%}): other load on the machine? re-run to confirm"


def speedup_noise_note(measurement: Measurement | None) -> str:
    """A warning for a paired speed-up whose per-round ratios spread too widely to trust its median
    (:attr:`~aitune.torch.measure.profiling.PairedSpeedup.noisy`)."""
    paired = None if measurement is None else measurement.paired
    if paired is None or not paired.noisy:
        return ""
    return (f"noisy speed-up: per-round ratios {paired.min:.2f}-{paired.max:.2f}x (quartiles {paired.q25:.2f}-"
            f"{paired.q75:.2f}x): other load on the machine? re-run to confirm")


def build_notes(details: dict) -> str:
    """One line of what a passing build did that users should know (preset, graph breaks, EP, specialisation)."""
    notes = []
    if details.get("preset"):
        notes.append(f"preset {details['preset']}")
    if details.get("graph_breaks"):
        notes.append(f"{details['graph_breaks']} graph break(s)")
    if details.get("providers"):
        providers = ",".join(p.removesuffix("ExecutionProvider") for p in details["providers"])
        notes.append(f"execution provider {providers}")
    if details.get("shape_specialized") or details.get("specialized_axes"):
        notes.append("shape-specialized: calls outside its shapes run eager")
    if details.get("export_batch_repeated"):
        notes.append("exported at batch >= 2 (sample repeated)")
    if details.get("fusion_note"):
        notes.append(details["fusion_note"])
    if details.get("placement_note"):  # nodes off the requested execution provider (ONNX Runtime)
        notes.append(details["placement_note"])
    return "; ".join(notes)


def failure_reason(exc: BaseException | None) -> str:
    """One line naming the real cause: for wrapped build errors, the innermost chained cause."""
    if exc is None:
        return ""
    if isinstance(exc, BackendBuildError) and exc.__cause__ is not None:
        root = exc.__cause__
        while root.__cause__ is not None:
            root = root.__cause__
        return one_line(root)
    return one_line(exc)


def measure_candidate(candidate: Candidate, context: GraphContext, config: ProfilingConfig) -> Candidate:
    """Measure a passing candidate (again): its measurement, the row's figures, its speed-up against eager
    (measured first if it was not yet) and its noise note, which replaces an earlier measurement's. A call that
    fails while being measured fails the candidate, as in :func:`evaluate` (a new, failed Candidate)."""
    old_notes = {noise_note(candidate.measurement), speedup_noise_note(candidate.measurement)}
    context.show(candidate.row.description, "measure")
    try:
        measurement = measure_backend(candidate.backend, context, config)
    except Exception as exc:  # noqa: BLE001 - as in _complete: a row, not a crash
        return _failed(_Stop(FAILED, exc, prefix="measuring: "), candidate.backend, context, candidate.row,
                       candidate.backend, raise_errors=False)
    finally:
        candidate.backend.deactivate()
    candidate.measurement = measurement
    row = candidate.row
    _set_figures(row, measurement, context, config)
    notes = [note for note in row.reason.split("; ") if note and note not in old_notes]
    row.reason = "; ".join(filter(None, notes + [noise_note(measurement), speedup_noise_note(measurement)]))
    return candidate


def _set_figures(row: CandidateResult, measurement: Measurement, context: GraphContext,
                 config: ProfilingConfig) -> None:
    """The row's measurement and speed-up: the paired figure (median of per-round ratios against eager, with
    its spread) when the candidate was timed beside eager, else the ratio of throughputs (eager measured
    first if it was not yet)."""
    row.measurement = measurement.to_dict()
    if measurement.paired is not None:
        row.speedup, row.speedup_spread = measurement.paired.median, measurement.paired.to_dict()
        return
    eager = eager_candidate(context, config).measurement
    row.speedup_spread = None
    if eager.throughput > 0:
        row.speedup = measurement.throughput / eager.throughput


def measure_backend(backend: Backend, context: GraphContext, config: ProfilingConfig) -> Measurement:
    """Latency and throughput of ``backend`` over the graph's samples, timed in alternation with eager
    (:func:`aitune.torch.measure.profiling.measure_pair`; the time budget covers both): the measurement's ``paired``
    is its speed-up over eager (NOTE [paired speed-up] in :mod:`aitune.torch.measure.profiling`).

    Calls take the recorded samples themselves: a candidate that writes into inputs eager leaves alone was
    rejected by :func:`check_against_eager` before it is measured, so no copy of every sample is held.
    """
    samples, batch_sizes = graph_samples(context)
    eager, measurement = measure_pair(sample_caller(eager_runner(context), context), samples,
                                      sample_caller(backend, context), samples, batch_sizes, context.device, config)
    return dataclasses.replace(measurement, paired=paired_speedup(eager.round_ms, measurement.round_ms))


def graph_samples(context: GraphContext) -> tuple[list, list[int]]:
    """The graph's samples and their batch sizes (1 when unknown)."""
    samples = list(context.graph.samples)
    return samples, [sample.batch_size or 1 for sample in samples]


def sample_caller(backend: Backend, context: GraphContext):
    """``run(sample)`` calling ``backend`` on one recorded sample."""
    if getattr(context.graph, "cache_input", None) is not None:
        # A key/value cache: one working copy per sample, its recorded state put back in place before each call
        # (object_state.reset_state: no allocation, the same addresses for CUDA graphs), for every candidate alike.
        working: dict = {}

        def run(sample):
            copy = working.get(id(sample))
            if copy is None or not reset_state((copy.args, copy.kwargs), (sample.args, sample.kwargs)):
                copy = working[id(sample)] = sample.clone()
            return backend.infer(*copy.args, **copy.kwargs)
    elif context.graph.mutated_inputs:
        # The module changes its inputs in place: each call gets a fresh copy (for every candidate alike),
        # or thousands of warm-up calls would drift the inputs towards inf/denormals.
        def run(sample):
            fresh = sample.clone()
            return backend.infer(*fresh.args, **fresh.kwargs)
    else:
        def run(sample):
            return backend.infer(*sample.args, **sample.kwargs)
    return run

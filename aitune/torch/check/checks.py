"""The checks a built candidate must pass: values against eager on every recorded sample (and the probes),
inputs left alone where eager leaves them, and an AOT artifact's save → load round trip.

Each check raises :class:`aitune.errors.CorrectnessError` (``ShapeMismatchError`` / ``ToleranceExceededError``)
on the first violation; :mod:`aitune.torch.search.evaluation` turns that into the candidate's report row.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from aitune.errors import CorrectnessError, ShapeMismatchError, ToleranceExceededError
from aitune.torch.check.context import EvaluationSettings, GraphContext
from aitune.torch.check.correctness import ComparisonResult, OutputComparator, Tolerance, comparator_for
from aitune.torch.check.probes import SCALED_KINDS, Probe, run_probes
from aitune.torch.record.pytree import tree_flatten, tree_unflatten
from aitune.torch.record.samples import same_values
from aitune.torch.check.references import leaf_magnitudes

if TYPE_CHECKING:
    from aitune.torch.backend.base import Backend


def check_against_eager(backend: Backend, context: GraphContext, tolerance: Tolerance,
                        comparator: OutputComparator | None = None) -> ComparisonResult:
    """Run ``backend`` on a fresh clone of every sample, in order, and compare with eager: outputs, in-place
    effects on inputs, and — where eager leaves its inputs alone — that the candidate does too.

    Outputs on CUDA are cloned right after each call, before anything else runs (NOTE [output
    clones in checks]); one sample's inputs and outputs are dropped before the next sample runs. For a stateful
    graph the module's state is first put back to where eager's reference run started, so both see the same
    sequence.

    Returns:
        The worst errors per output leaf and the thresholds used.

    Raises:
        CorrectnessError (ShapeMismatchError / ToleranceExceededError): on the first violation.
    """
    comparator = comparator or comparator_for(backend, tolerance)
    graph = context.graph
    context.require_comparable()
    if context.restore_state is not None:
        context.restore_state()
    for index, sample in enumerate(graph.samples):
        inputs = sample.clone()
        with torch.no_grad(), context.rng():
            output = owned_outputs(backend.infer(*inputs.args, **inputs.kwargs))
        with _nondeterminism_named(context):
            _compare(comparator, context.reference_outputs[index], output,
                     lambda: context.fp32_reference(index))
        if graph.mutated_inputs and context.reference_inputs_after is not None:
            try:
                _compare(comparator, context.reference_inputs_after[index], inputs.leaves(),
                         lambda: context.fp32_inputs_after(index))
            except CorrectnessError as exc:
                raise type(exc)(f"input mutation not preserved: {exc}") from exc
        elif not graph.mutated_inputs:
            _check_inputs_untouched(graph, sample, inputs)
        del inputs, output  # one sample's tensors at a time: the next call allocates its own
    return comparator.result()


# NOTE [output clones in checks]: backends that replay CUDA graphs return tensors that the next replay
# overwrites (pytorch/pytorch#144386), so a check clones a candidate's CUDA outputs at once. Only CUDA ones: no backend
# reuses output buffers on the CPU (Inductor's CUDA-graph trees, eager's CUDA-graph runner and TensorRT's
# runtime are CUDA-only), and cloning a CPU output would double the memory a check needs for large outputs.
# The device decides rather than the backend because user-written backends can capture CUDA graphs too.
def owned_outputs(value: Any) -> Any:
    """``value`` with its CUDA tensors cloned (see NOTE [output clones in checks]); other leaves as they are."""
    leaves, spec = tree_flatten(value)
    if not any(isinstance(leaf, torch.Tensor) and leaf.is_cuda for leaf in leaves):
        return value
    return tree_unflatten(spec, [leaf.detach().clone() if isinstance(leaf, torch.Tensor) and leaf.is_cuda else leaf
                                 for leaf in leaves])


@contextlib.contextmanager
def _nondeterminism_named(context: GraphContext) -> Iterator[None]:
    """A failed comparison on a nondeterministic graph says so: the candidate ran under eager's seed and did not
    reproduce eager's draws (NOTE [nondeterministic forward] in :mod:`aitune.torch.check.context`)."""
    try:
        yield
    except CorrectnessError as exc:
        if getattr(context.graph, "nondeterministic", None) is not None and exc.args and \
                not str(exc.args[0]).startswith("forward is nondeterministic"):
            exc.args = ("forward is nondeterministic (random numbers drawn in forward) and, run under the seed of "
                        f"eager's reference, the candidate does not reproduce eager: {exc.args[0]}",) + exc.args[1:]
        raise


def _compare(comparator: OutputComparator, reference, output, fp32_reference) -> None:
    try:
        comparator.compare(reference, output)
    except ToleranceExceededError as exc:
        # Correctness rule 5 (aitune/torch/check/correctness.py): fp16/bf16 leaves, and fp32 leaves of a TF32 eager,
        # may pass against an exact fp32 run; the comparator says whether the failing leaf is one of them (an
        # fp32 leaf on the CPU is not: no fp32 run is made for it).
        if not getattr(exc, "fp32_parity_possible", False):
            raise
        reference_fp32 = fp32_reference()
        if reference_fp32 is None:
            raise
        comparator.compare(reference, output, reference_fp32=reference_fp32)


def _check_inputs_untouched(graph, sample, inputs) -> None:
    """Eager leaves this graph's inputs alone: a candidate that writes into the caller's tensors is wrong."""
    for path, before, after in zip(graph.input_paths, sample.leaves(), inputs.leaves()):
        if isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and not same_values(before, after):
            raise ShapeMismatchError(f"the candidate writes into its input {path!r} (eager leaves it unchanged): "
                                     "the caller's tensor would be corrupted")


def check_probes(backend: Backend, context: GraphContext, settings: EvaluationSettings,
                 comparator: OutputComparator) -> dict | None:
    """Check ``backend`` on the graph's probes (:mod:`aitune.torch.check.probes`) with the same rules as the samples.

    Returns:
        ``{"checked", "passed", "not_accepted", "not_run", "kinds"}``, plus ``"dropped_memory"`` when probes
        were dropped for ``ProbeConfig.max_reference_bytes`` (None with probes off).

    Raises:
        CorrectnessError: on the first probe the candidate gets wrong; the exception carries ``probe``.
    """
    if not settings.probes.enabled:
        return None
    probe_set = context.probes(settings.probes)
    probes = probe_set.probes
    at_scale = []

    def check(probe: Probe) -> None:
        if context.restore_state is not None:
            context.restore_state()
        inputs = probe.sample.clone()
        with torch.no_grad(), context.rng():
            output = owned_outputs(backend.infer(*inputs.args, **inputs.kwargs))
        before = comparator.snapshot()
        fp32_outputs: list = []

        def fp32_reference():  # computed once per probe, for rule 5 and rule 6 alike
            if not fp32_outputs:
                fp32_outputs.append(context.fp32_reference_for(probe.sample))
            return fp32_outputs[0]

        try:
            _compare(comparator, probe.reference_outputs, output, fp32_reference)
        except ToleranceExceededError as exc:
            # Correctness rule 6 (NOTE [judging probes at other magnitudes] in aitune/torch/check/correctness.py)
            factor = SCALED_KINDS.get(probe.kind)
            if factor is None or comparator.quantized or not exc.tolerance.startswith("atol=") or not (
                    getattr(exc, "fp32_parity_possible", False) or comparator.low_precision):
                raise
            atol_scales = [None if grown is None else min(max(grown, 1.0), max(factor, 1.0))
                           for grown in _magnitude_growth(probe.reference_outputs, context)]
            try:
                _compare(comparator.for_scaled_probe(atol_scales), probe.reference_outputs, output, fp32_reference)
            except ToleranceExceededError as scaled:
                raise type(scaled)(f"{exc}; at the probe's scale (rule 6): {scaled}", leaf=scaled.leaf,
                                   max_abs_error=scaled.max_abs_error, max_rel_error=scaled.max_rel_error,
                                   tolerance=scaled.tolerance) from None
            comparator.restore(before)  # the row's errors stay those judged by rules 3 and 5
            at_scale.append(probe.kind)

    try:
        with _nondeterminism_named(context):
            counts = run_probes(probes, backend.accepts, check, settings.probes.max_seconds)
    except Exception as exc:
        failed_counts = getattr(exc, "probe_counts", None)
        if failed_counts is not None and probe_set.dropped_memory:
            failed_counts["dropped_memory"] = probe_set.dropped_memory
        raise
    if context.restore_state is not None:
        context.restore_state()
    if probe_set.dropped_memory:
        counts["dropped_memory"] = probe_set.dropped_memory
    counts["kinds"] = sorted({probe.kind for probe in probes})
    if at_scale:
        counts["judged_at_scale"] = len(at_scale)
    return counts


def _magnitude_growth(probe_outputs, context: GraphContext) -> list[float | None]:
    """Per output leaf, its largest ``|eager|`` on the probe over the largest on the recorded samples (None for
    leaves that are not float tensors, or that were all zeros on the samples)."""
    on_samples = context.output_magnitudes()
    growth = []
    for position, magnitude in enumerate(leaf_magnitudes(probe_outputs)):
        before = on_samples[position] if position < len(on_samples) else None
        growth.append(magnitude / before if magnitude is not None and before else None)
    return growth


def verify_round_trip(backend: Backend, context: GraphContext, tolerance: Tolerance) -> None:
    """Save an AOT backend's artifact, load it back without the module and compare one output
    (some artifacts cannot be loaded back: pytorch/ao#2690).

    The loaded copy must match eager on the first sample by the same rule and ``tolerance`` the built
    candidate was judged by (a reloaded artifact may pick other kernels; what matters is that it is still
    correct); the copy is then dropped. The built candidate is deactivated first (its next call reactivates
    it), so one copy of the artifact's weights is held at a time.

    Raises:
        Whatever save/load raise, or CorrectnessError.
    """
    sample = context.graph.samples[0]
    with tempfile.TemporaryDirectory(prefix="aitune-roundtrip-") as directory:
        metadata = backend.save(Path(directory))
        backend.deactivate()
        restored = type(backend).from_checkpoint(Path(directory), backend.config, metadata, None, context.graph,
                                                 context.device)
        try:
            with torch.no_grad(), context.rng():
                inputs = sample.clone()
                actual = owned_outputs(restored.infer(*inputs.args, **inputs.kwargs))
        finally:
            restored.deactivate()
            del restored
    with _nondeterminism_named(context):
        _compare(comparator_for(backend, tolerance), context.reference_outputs[0], actual,
                 lambda: context.fp32_reference(0))

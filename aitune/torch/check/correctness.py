"""Compare a candidate's outputs with eager PyTorch, leaf by leaf, by value.

Rules, per output leaf:
  1. Same structure (container types, keys, number of leaves), shape, dtype, device and memory format
     (a channels-last output where eager returns a contiguous one, or the reverse, is a mismatch).
     Library objects registered with PyTorch's pytree (transformers' key/value caches) are opened and their
     tensors compared leaf by leaf (pytorch/pytorch#148748).
  2. Finite where eager is finite; NaN/Inf only where eager has the same NaN/Inf (pytorch/pytorch PR#159973:
     an exported SDPA gave NaN for fully masked rows where eager does not).
  3. Float leaves: ``|candidate - eager| <= atol + rtol * |eager|`` (the rule of ``torch.isclose``) with
     per-dtype defaults: fp32/fp64 ``atol=1e-4, rtol=1e-3``; fp16/bf16 ``atol=rtol=1e-2``.
     Quantizing backends instead need SQNR >= ``min_sqnr_db`` (torchao's tests use 20 dB) and cosine
     similarity >= ``min_cosine`` (Torch-TensorRT's tests use 0.99).
  4. Integer/bool leaves and constants must be equal.
  5. fp16/bf16 leaves that miss rule 3 get a second chance against an fp32 run of the same module: the
     candidate passes if its RMSE from the fp32 result is at most ``fp32_parity_multiplier`` (2) times eager
     fp16's own RMSE from it, plus the leaf dtype's ``atol / 10`` — "no less accurate than eager at this
     precision". The rule and numbers follow PyTorch's own accuracy check for compiled models
     (``torch._dynamo.utils.same`` with an fp64 reference: ``res_error <= multiplier * ref_error + tol / 10``,
     multiplier 2). The report says when a leaf passed this way. The fp32 run has TF32 off
     (:func:`exact_fp32`). On CUDA with TF32 allowed (:func:`tf32_allowed`; PyTorch's default lets cuDNN
     convolutions use TF32) fp32 leaves get the same second chance: eager itself is then only TF32-accurate
     (on a convnet, correct compiled candidates can sit around 1e-3 off eager's logits), so a candidate is
     judged against eager's own distance from the exact fp32 result.
  6. On probes that scale float inputs (x10, x0.1, :mod:`aitune.torch.check.probes`), a leaf that misses rules 3 and
     5 gets a third chance. A leaf that rule 5 applies to (fp16/bf16 leaves, fp32 leaves of a TF32 eager):
     rule 5 with a multiplier of 4 instead of 2, and then its worst element too must stay within 4x eager's
     worst element (both against the exact fp32 run). An fp32 leaf of an exact eager, for a reduced-precision
     candidate (autocast, TF32): rule 3 with ``atol`` times the growth of that output's magnitude from the
     samples to the probe (clamped to [1, the probe's factor]); so is an fp32 leaf counted as TF32 whose eager
     value equals the exact fp32 run's (NOTE [an eager that TF32 never reached]). See NOTE [judging probes at
     other magnitudes].

NOTE [judging probes at other magnitudes]: rules 3 and 5 fix their thresholds for the magnitudes the user's
samples produce. A probe that multiplies the float inputs by 10 sends magnitudes the user never sent; in
fp16/bf16 (or TF32) rounding errors grow with the values, and a transformation that reorders floating-point
work (BatchNorm folded into a convolution, fused or re-tiled reductions) grows them differently from eager:
fp16 ResNet-50 with folded BatchNorm, the folding TensorRT and ONNX Runtime apply by default, was rejected on
such a probe at 2.3x eager's own RMSE from an exact fp32 run. Those probes exist to find faults that depend on
values (a branch or a clamp baked in at trace time, a value range another kernel handles, a saturating
accumulator). So on a scaled probe "no less accurate than eager" allows 4x instead of 2x; a leaf that needs
that allowance must also keep its worst element within 4x eager's worst, so a fault in a few elements is not
averaged away by the RMSE. Where eager itself is the exact result (fp32 on the CPU) and the candidate computes
in reduced precision, its rounding is judged by rule 3, whose ``atol`` is an error allowed at the magnitudes
the samples' outputs had: it grows with the output's own magnitude on the probe (an output that saturates,
such as a softmax, keeps ``atol`` as it is). The limits, stated plainly: a fault smaller than 4x eager's own
worst rounding error on that output, at that magnitude, or within the grown ``atol``, cannot be told from
rounding and passes the probe (the run-time guard still compares real calls by rules 3 and 5). Exact-fp32
candidates on exact-fp32 leaves (rounding near 1e-7 of the values, well inside ``rtol``) and quantized
candidates get no third chance; samples, size probes and probes at the user's magnitudes keep rules 3 and 5
as they are.

NOTE [chunked comparison]: leaves are compared a chunk at a time (:data:`~aitune.torch.check.references.CHUNK_ELEMENTS`,
2^20 elements) on the candidate output's device, in float32 for fp32/fp16/bf16 values and float64 for float64
ones; maxima, counts and the SQNR/cosine sums run across chunks (sums of squares scaled by each chunk's largest
magnitude, accumulated in float64 scalars). An fp16 output of 2^31 elements used to need ~10 full copies
(CPU, then float64, differences, masks); now the check holds one chunk's temporaries. Results equal the
float64 ones within float32 rounding.

Modules: :mod:`~aitune.torch.check.tolerance` (thresholds, results, exact-fp32 settings),
:mod:`~aitune.torch.check.error_metrics` (per-leaf error measures over chunks); this module applies the rules.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from aitune.errors import ShapeMismatchError, ToleranceExceededError
from aitune.torch.check.error_metrics import (  # noqa: F401 - cosine_similarity, sqnr_db: re-exported
    LeafErrors,
    chunk_pieces,
    compute_dtype,
    cosine_similarity,
    sqnr_db,
    sum_of_squares,
)
from aitune.torch.check.references import (
    CHUNK_ELEMENTS,
    StoredTensor,
    chunk_plan,
    flat_piece,
    flatten_outputs,
    memory_format,
    piece_of,
)
from aitune.torch.check.tolerance import (  # noqa: F401 - exact_fp32: re-exported
    LOW_PRECISION,
    SCALED_PROBE_PARITY_MULTIPLIER,
    ComparisonResult,
    LeafError,
    Tolerance,
    exact_fp32,
    tf32_allowed,
)
from aitune.torch.record.pytree import leaf_paths, path_to_str, tree_flatten


def _leaf_facts(leaf: torch.Tensor | StoredTensor) -> tuple[torch.Size, torch.dtype, torch.device, str]:
    layout = leaf.memory_format if isinstance(leaf, StoredTensor) else memory_format(leaf)
    return leaf.shape, leaf.dtype, leaf.device, layout


def _dense(leaf: Any) -> Any:
    """Sparse/other layouts are compared as dense tensors (the chunked path needs strided ones)."""
    return leaf.to_dense() if isinstance(leaf, torch.Tensor) and leaf.layout != torch.strided else leaf


class OutputComparator:
    """Accumulates per-leaf errors over samples; raises on the first violation.

    Leaves are compared in chunks of ``chunk_elements`` on the candidate output's device, fp16/bf16 upcast to
    float32 (never fp32 to float64): the check holds one chunk of temporaries, whatever the output's size.
    The reference side may be a :class:`~aitune.torch.check.references.StoredOutputs` (host memory or a spilled
    file, read chunk by chunk).

    Args:
        tolerance: thresholds. quantized: use SQNR/cosine floors for float leaves instead of atol/rtol.
        low_precision: the candidate computes fp32 outputs in reduced precision (TF32, autocast): fp32 leaves
            get the fp16/bf16 tolerances (``atol=rtol=1e-2``, rule 3 of this module).
        tf32_eager: did eager's fp32 leaves come from TF32 math (rule 5 then applies to them)? None (default):
            when the candidate's output is on CUDA and :func:`tf32_allowed`.
        chunk_elements: elements compared at a time (default :data:`~aitune.torch.check.references.CHUNK_ELEMENTS`).
        parity_worst_element: rule 6: a leaf that needs more than ``base_parity_multiplier`` (default: the
            tolerance's own rule-5 multiplier) must also keep its worst element within the multiplier.
        atol_scales: rule 6: per output leaf, a factor on ``atol`` for a reduced-precision candidate's fp32 leaves
            of an exact eager (see :meth:`for_scaled_probe`).
    """

    def __init__(self, tolerance: Tolerance | None = None, quantized: bool = False, low_precision: bool = False,
                 *, tf32_eager: bool | None = None, chunk_elements: int = CHUNK_ELEMENTS,
                 parity_worst_element: bool = False, base_parity_multiplier: float | None = None,
                 atol_scales: list[float | None] | None = None):
        self.tolerance = tolerance or Tolerance()
        self.quantized = quantized
        self.low_precision = low_precision  # computes fp32 in reduced precision (TF32, autocast): fp16 tolerances
        self.tf32_eager = tf32_eager
        self.chunk_elements = chunk_elements
        self.parity_worst_element = parity_worst_element
        self._base_multiplier = base_parity_multiplier or self.tolerance.fp32_parity_multiplier
        self._atol_scales = list(atol_scales or [])
        self._errors: dict[str, LeafError] = {}

    def for_scaled_probe(self, atol_scales: list[float | None] | None = None) -> "OutputComparator":
        """The comparator of correctness rule 6, for a probe that scaled the float inputs: rule 5's multiplier
        at least :data:`SCALED_PROBE_PARITY_MULTIPLIER` (a leaf that needs more than this comparator's own
        multiplier must also keep its worst element within it) and, for a reduced-precision candidate's fp32
        leaves of an exact eager, ``atol`` times ``atol_scales[i]`` for leaf ``i`` (the growth of its magnitude).
        Its errors are its own: what it measures does not enter this comparator's :meth:`result`."""
        tolerance = dataclasses.replace(
            self.tolerance,
            fp32_parity_multiplier=max(self.tolerance.fp32_parity_multiplier, SCALED_PROBE_PARITY_MULTIPLIER))
        return OutputComparator(tolerance, self.quantized, self.low_precision, tf32_eager=self.tf32_eager,
                                chunk_elements=self.chunk_elements, parity_worst_element=True,
                                base_parity_multiplier=self.tolerance.fp32_parity_multiplier, atol_scales=atol_scales)

    def compare(self, reference: Any, candidate: Any, reference_fp32: Any = None) -> None:
        """Compare one sample's outputs. Raises ShapeMismatchError or ToleranceExceededError.

        ``reference`` (and ``reference_fp32``) may be kept outputs
        (:class:`~aitune.torch.check.references.StoredOutputs`).
        ``reference_fp32``: the same call run in exact float32 (same structure); enables rule 5 for fp16/bf16
        leaves, and for fp32 leaves that eager computed in TF32.
        """
        reference_leaves, reference_spec = flatten_outputs(reference)
        candidate_leaves, candidate_spec = tree_flatten(candidate)
        if _structure(reference_spec) != _structure(candidate_spec):
            raise ShapeMismatchError(f"output structure differs from eager: expected {_describe(reference_spec)}, "
                                     f"got {_describe(candidate_spec)}")
        fp32_leaves = flatten_outputs(reference_fp32)[0] if reference_fp32 is not None else \
            [None] * len(reference_leaves)
        if len(fp32_leaves) != len(reference_leaves):
            fp32_leaves = [None] * len(reference_leaves)
        for position, (path, expected, actual, expected32) in enumerate(zip(
                leaf_paths(reference_spec), reference_leaves, candidate_leaves, fp32_leaves)):
            expected, actual = _dense(expected), _dense(actual)
            scale = self._atol_scales[position] if position < len(self._atol_scales) else None
            try:
                self._compare_leaf(path_to_str(path), expected, actual, atol_scale=scale or 1.0)
            except ToleranceExceededError as exc:
                # whether an exact fp32 run could still rescue this leaf: callers compute one only then
                exc.fp32_parity_possible = self._parity_applies(exc, expected, actual)
                expected32 = _dense(expected32)
                if self._parity_rescues(path_to_str(path), exc, expected, actual, expected32):
                    continue
                if not (scale and scale > 1.0 and self._eager_exact_after_all(expected, actual, expected32)):
                    raise
                # NOTE [an eager that TF32 never reached]
                self._compare_leaf(path_to_str(path), expected, actual, atol_scale=scale, exact_eager=True)

    def snapshot(self) -> dict[str, LeafError]:
        """The errors recorded so far (a copy), for :meth:`restore`."""
        return {path: dataclasses.replace(leaf) for path, leaf in self._errors.items()}

    def restore(self, errors: dict[str, LeafError]) -> None:
        """Forget what was recorded since :meth:`snapshot` returned ``errors``."""
        self._errors = errors

    def eager_in_tf32(self, actual) -> bool:
        """Were eager's fp32 results computed in TF32 (see ``tf32_eager``)?"""
        if self.tf32_eager is not None:
            return self.tf32_eager
        return isinstance(actual, torch.Tensor) and actual.is_cuda and tf32_allowed()

    def _eager_exact_after_all(self, expected, actual, expected32) -> bool:
        """NOTE [an eager that TF32 never reached]: on CUDA with TF32 allowed (PyTorch's default for cuDNN
        convolutions) eager's fp32 leaves count as TF32 results (rule 5), but a module without convolutions (an
        MLP: cuBLAS matmuls stay exact fp32 by default) computes them exactly, and rule 5 then asks a
        reduced-precision candidate for no more than twice eager's error of zero. A leaf whose eager value equals
        the exact fp32 run's element for element is judged as an exact eager's leaf instead: on a scaled probe, by
        rule 6's grown ``atol`` (a bf16-autocast MLP on CUDA failed its x10 probe with 345 of 16384 values beyond
        the ungrown ``atol``: tests/gpu/test_inductor_gpu.py)."""
        if not (self.low_precision and not self.quantized and _is_tensor(expected) and expected.dtype == torch.float32
                and _is_tensor(expected32) and expected32.shape == expected.shape and self.eager_in_tf32(actual)):
            return False
        for reference, eager in chunk_pieces([expected32, expected], actual.device, self.chunk_elements):
            if not torch.equal(reference.to(eager.dtype), eager):
                return False
        return True

    def _parity_applies(self, exc: ToleranceExceededError, expected, actual) -> bool:
        """Could rule 5 rescue this leaf: an fp16/bf16 leaf, or an fp32 leaf of a TF32 eager, that missed
        atol/rtol (not a quantized check, not a NaN or shape failure), with rule 5 turned on?"""
        if self.quantized or not self.tolerance.fp32_parity or not _is_tensor(expected) \
                or not exc.tolerance.startswith("atol="):
            return False
        return expected.dtype in LOW_PRECISION or (expected.dtype == torch.float32 and self.eager_in_tf32(actual))

    def _parity_rescues(self, path: str, exc: ToleranceExceededError, expected, actual, expected32) -> bool:
        """Rule 5: a fp16/bf16 leaf, or an fp32 leaf of a TF32 eager, as close to the exact fp32 result as
        eager's own (see the module docstring)."""
        if not exc.fp32_parity_possible or not _is_tensor(expected32) or expected32.shape != expected.shape:
            return False
        candidate_sum = eager_sum = torch.zeros((), dtype=torch.float64, device=actual.device)
        candidate_worst = eager_worst = torch.zeros((), dtype=torch.float32, device=actual.device)
        count = 0
        for reference, eager, candidate in chunk_pieces([expected32, expected, actual], actual.device,
                                                   self.chunk_elements):
            finite = torch.isfinite(reference) & torch.isfinite(eager)
            if not bool(finite.all()):
                reference, eager, candidate = reference[finite], eager[finite], candidate[finite]
            candidate_sum = candidate_sum + sum_of_squares(candidate - reference)
            eager_sum = eager_sum + sum_of_squares(eager - reference)
            if self.parity_worst_element and reference.numel():
                candidate_worst = torch.maximum(candidate_worst, (candidate - reference).abs().max().float())
                eager_worst = torch.maximum(eager_worst, (eager - reference).abs().max().float())
            count += reference.numel()
        candidate_rmse = math.sqrt(float(candidate_sum) / count) if count else 0.0
        eager_rmse = math.sqrt(float(eager_sum) / count) if count else 0.0
        multiplier = self.tolerance.fp32_parity_multiplier
        slack = self.tolerance.for_dtype(expected.dtype)[0] / 10
        if candidate_rmse > multiplier * eager_rmse + slack:
            exc.args = (f"{exc.args[0]}; and vs an exact fp32 run its RMSE {candidate_rmse:.3g} exceeds "
                        f"{multiplier:g} x eager's {eager_rmse:.3g} + {slack:g}",)
            return False
        needs_allowance = candidate_rmse > self._base_multiplier * eager_rmse + slack
        if self.parity_worst_element and needs_allowance and \
                float(candidate_worst) > multiplier * float(eager_worst) + slack:
            exc.args = (f"{exc.args[0]}; and vs an exact fp32 run its worst element is off by "
                        f"{float(candidate_worst):.3g}, over {multiplier:g} x eager's worst {float(eager_worst):.3g} "
                        f"+ {slack:g}",)
            return False
        record = self._errors.setdefault(path, LeafError(path))
        record.fp32_parity = {"candidate_rmse": candidate_rmse, "eager_rmse": eager_rmse}
        return True

    def result(self) -> ComparisonResult:
        metric = "sqnr+cosine" if self.quantized else "allclose"
        if any(leaf.fp32_parity for leaf in self._errors.values()):
            metric = "allclose+fp32-parity"
        return ComparisonResult(list(self._errors.values()), metric, self.tolerance.to_dict())

    def _compare_leaf(self, path: str, expected: Any, actual: Any, atol_scale: float = 1.0,
                      exact_eager: bool = False) -> None:
        if not _is_tensor(expected):
            if isinstance(actual, torch.Tensor):
                raise ShapeMismatchError(f"output {path}: expected a {type(expected).__name__}, got a tensor")
            if type(expected) is not type(actual):
                raise ShapeMismatchError(f"output {path}: expected a {type(expected).__name__}, got a "
                                         f"{type(actual).__name__}")
            if not _constants_equal(expected, actual):
                raise ShapeMismatchError(f"output {path}: {type(expected).__name__} value differs from eager's: "
                                         f"{_short(actual)} != {_short(expected)}")
            return
        if not isinstance(actual, torch.Tensor):
            raise ShapeMismatchError(f"output {path}: expected a tensor, got {type(actual).__name__}")
        shape, dtype, device, expected_layout = _leaf_facts(expected)
        if shape != actual.shape:
            raise ShapeMismatchError(f"output {path}: shape {tuple(actual.shape)} != eager {tuple(shape)}")
        if dtype != actual.dtype:
            raise ShapeMismatchError(f"output {path}: dtype {actual.dtype} != eager {dtype}")
        if device.type != actual.device.type:
            raise ShapeMismatchError(f"output {path}: device {actual.device} != eager {device}")
        actual_layout = memory_format(actual)
        if expected_layout != actual_layout and "channels_last" in expected_layout + actual_layout:
            raise ShapeMismatchError(f"output {path}: memory format {actual_layout} != eager {expected_layout}")
        record = self._errors.setdefault(path, LeafError(path))
        numel = actual.numel()
        if not (dtype.is_floating_point or dtype.is_complex):
            mismatches = torch.zeros((), dtype=torch.int64, device=actual.device)
            for index, start, stop in chunk_plan(shape, self.chunk_elements):
                piece = piece_of(expected, index, start, stop)
                mismatches += (piece.to(actual.device) != flat_piece(actual, index)).sum()
            if int(mismatches):
                raise ToleranceExceededError(f"output {path}: {int(mismatches)} of {numel} integer/bool "
                                             "elements differ from eager", leaf=path, tolerance="exact")
            return
        atol, rtol = self.tolerance.for_dtype(torch.float16 if self.low_precision else dtype)
        if self.low_precision and dtype not in LOW_PRECISION and (exact_eager or not self.eager_in_tf32(actual)):
            atol *= atol_scale  # rule 6: a reduced-precision candidate's fp32 leaf of an exact eager
        # Every float leaf is judged by value: atol/rtol (the fp16/bf16 ones for a reduced-precision candidate),
        # or SQNR/cosine for a quantized one. SQNR and cosine are also recorded for reduced-precision candidates:
        # the report quotes them beside the atol/rtol verdict.
        errors = LeafErrors(actual.device, compute_dtype(dtype), record_norms=self.quantized or self.low_precision,
                             count_excess=not self.quantized)
        for expected_piece, actual_piece in chunk_pieces([expected, actual], actual.device, self.chunk_elements):
            errors.add(expected_piece, actual_piece, atol, rtol)
        bad, extra = int(errors.non_finite), int(errors.extra_finite)
        if bad or extra:
            raise ToleranceExceededError(
                f"output {path}: {bad} non-finite values where eager is finite"
                + (f", {extra} finite where eager is NaN/Inf" if extra else ""), leaf=path, tolerance="finite")
        if int(errors.sign):
            raise ToleranceExceededError(f"output {path}: infinities of a different sign than eager", leaf=path,
                                         tolerance="finite")
        finite = int(errors.finite)
        if finite == 0:
            return
        max_abs = float(errors.max_abs)
        # Relative to the leaf's scale, not element-wise: |a-b|/|b| explodes where eager is near zero.
        max_rel = max_abs / max(float(errors.max_expected), 1e-12)
        record.max_abs_error = max(record.max_abs_error, max_abs)
        record.max_rel_error = max(record.max_rel_error, max_rel)
        if errors.norms is not None:
            sqnr, cosine = errors.norms.sqnr_db(), errors.norms.cosine()
            record.sqnr_db = sqnr if record.sqnr_db is None else min(record.sqnr_db, sqnr)
            record.cosine = cosine if record.cosine is None else min(record.cosine, cosine)
        if not self.quantized:
            record.atol, record.rtol = atol, rtol
        if self.quantized:
            if sqnr < self.tolerance.min_sqnr_db or cosine < self.tolerance.min_cosine:
                raise ToleranceExceededError(
                    f"output {path}: SQNR {sqnr:.1f} dB (floor {self.tolerance.min_sqnr_db} dB), cosine "
                    f"{cosine:.4f} (floor {self.tolerance.min_cosine})", leaf=path, max_abs_error=max_abs,
                    max_rel_error=max_rel, tolerance=f"sqnr>={self.tolerance.min_sqnr_db}dB,"
                                                     f"cosine>={self.tolerance.min_cosine}")
            return
        count = int(errors.excess)
        if count:
            raise ToleranceExceededError(
                f"output {path}: {count} of {finite} values off by more than atol={atol:g} + "
                f"rtol={rtol:g}*|eager| (max abs error {max_abs:.3g}, max rel error {max_rel:.3g})",
                leaf=path, max_abs_error=max_abs, max_rel_error=max_rel, tolerance=f"atol={atol:g},rtol={rtol:g}")


def _is_tensor(leaf: Any) -> bool:
    return isinstance(leaf, (torch.Tensor, StoredTensor))


def _constants_equal(expected: Any, actual: Any) -> bool:
    """Equal by ``==`` (NaN equals NaN); objects that only compare by identity (no ``__eq__`` of their own,
    not opened as a pytree node) or cannot compare are equal when their reprs are."""
    if type(expected).__eq__ is object.__eq__:
        return expected is actual or repr(expected) == repr(actual)
    try:
        return bool(expected == actual) or (expected != expected and actual != actual)
    except Exception:  # noqa: BLE001 - uncomparable constants
        return repr(expected) == repr(actual)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _structure(spec) -> tuple:
    return (spec.kind, spec.node_type, spec.context, tuple(_structure(child) for child in spec.children))


def _describe(spec) -> str:
    if spec.kind == "leaf":
        return "leaf"
    name = spec.node_type.__name__ if spec.node_type is not None else spec.kind
    inner = ", ".join(
        f"{key}: {_describe(child)}" if spec.context else _describe(child)
        for key, child in zip(spec.context or range(len(spec.children)), spec.children))
    return f"{name}({inner})"


def comparator_for(backend, tolerance: Tolerance) -> OutputComparator:
    """The comparator a backend (:class:`aitune.torch.backend.Backend`) is judged with: SQNR/cosine when it
    quantizes (``backend.is_quantizing``), fp16 tolerances for TF32/autocast (``backend.low_precision``)."""
    return OutputComparator(tolerance, quantized=backend.is_quantizing,
                            low_precision=bool(getattr(backend, "low_precision", False)))

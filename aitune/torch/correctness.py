"""Compare a candidate's outputs with eager PyTorch, leaf by leaf, by value (DESIGN.md §5).

Rules, per output leaf:
  1. Same structure (container types, keys, number of leaves), shape, dtype, device and memory format
     (a channels-last output where eager returns a contiguous one, or the reverse, is a mismatch).
     Library objects registered with PyTorch's pytree (transformers' key/value caches) are opened and their
     tensors compared leaf by leaf (case C34).
  2. Finite where eager is finite; NaN/Inf only where eager has the same NaN/Inf (case C09).
  3. Float leaves: ``|candidate - eager| <= atol + rtol * |eager|`` (the rule of ``torch.isclose``) with
     per-dtype defaults: fp32/fp64 ``atol=1e-4, rtol=1e-3``; fp16/bf16 ``atol=rtol=1e-2``.
     Quantizing backends instead need SQNR >= ``min_sqnr_db`` (torchao's tests use 20 dB) and cosine
     similarity >= ``min_cosine`` (Torch-TensorRT's tests use 0.99).
  4. Integer/bool leaves and constants must be equal.
  5. fp16/bf16 leaves that miss rule 3 get a second chance against an fp32 run of the same module: the
     candidate passes if its RMSE from the fp32 result is at most ``fp32_parity_multiplier`` (2) times eager
     fp16's own RMSE from it, plus ``low_precision_atol / 10`` — "no less accurate than eager at this
     precision". The rule and numbers follow PyTorch's own accuracy check for compiled models
     (``torch._dynamo.utils.same`` with an fp64 reference: ``res_error <= multiplier * ref_error + tol / 10``,
     multiplier 2). The report says when a leaf passed this way.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from aitune.errors import ConfigError, ShapeMismatchError, ToleranceExceededError
from aitune.torch.arguments import KnownFields
from aitune.torch.pytree import leaf_paths, path_to_str, tree_flatten

LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(kw_only=True)
class Tolerance(KnownFields):
    """Thresholds used to compare with eager.

    Args:
        atol / rtol: for fp32/fp64 leaves (defaults 1e-4 / 1e-3).
        low_precision_atol / low_precision_rtol: for fp16/bf16 leaves (and TF32 paths) (defaults 1e-2 / 1e-2).
        min_sqnr_db: quantized candidates' floor of signal-to-quantization-noise ratio, dB (default 20).
        min_cosine: quantized candidates' floor of cosine similarity of each leaf (default 0.99).

    Raises:
        ConfigError: on a negative or non-finite tolerance, or a cosine floor outside [-1, 1].
    """

    atol: float = 1e-4
    rtol: float = 1e-3
    low_precision_atol: float = 1e-2
    low_precision_rtol: float = 1e-2
    min_sqnr_db: float = 20.0
    min_cosine: float = 0.99
    fp32_parity: bool = True
    fp32_parity_multiplier: float = 2.0

    def __post_init__(self):
        for name in ("atol", "rtol", "low_precision_atol", "low_precision_rtol"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"Tolerance.{name} must be a finite number >= 0, got {value!r}")
        if not isinstance(self.min_sqnr_db, (int, float)) or math.isnan(self.min_sqnr_db):
            raise ConfigError(f"Tolerance.min_sqnr_db must be a number (dB), got {self.min_sqnr_db!r}")
        if not isinstance(self.min_cosine, (int, float)) or not -1.0 <= self.min_cosine <= 1.0:
            raise ConfigError(f"Tolerance.min_cosine must lie in [-1, 1], got {self.min_cosine!r}")
        if not isinstance(self.fp32_parity, bool):
            raise ConfigError(f"Tolerance.fp32_parity must be a bool, got {self.fp32_parity!r}")
        if not isinstance(self.fp32_parity_multiplier, (int, float)) or not self.fp32_parity_multiplier >= 1.0:
            raise ConfigError(f"Tolerance.fp32_parity_multiplier must be a number >= 1, got "
                              f"{self.fp32_parity_multiplier!r}")

    def for_dtype(self, dtype: torch.dtype) -> tuple[float, float]:
        if dtype in LOW_PRECISION:
            return self.low_precision_atol, self.low_precision_rtol
        return self.atol, self.rtol

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> "Tolerance":
        """The inverse of :meth:`to_dict`; missing fields take their defaults, unknown ones are ignored.

        Args:
            data: a :meth:`to_dict` result (e.g. from a checkpoint manifest), or None for the defaults.

        Raises:
            ConfigError: when ``data`` is not a dict or a value is invalid (see the class).
        """
        if data is not None and not isinstance(data, dict):
            raise ConfigError(f"a Tolerance is read from a dict, got {type(data).__name__}")
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in (data or {}).items() if key in names})


@dataclasses.dataclass
class LeafError:
    """Measured error of one output leaf: max abs/rel error, and for quantized checks SQNR and cosine."""

    path: str
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0  # max |candidate - eager| / max |eager| over the leaf: meaningful near zero too
    sqnr_db: float | None = None
    cosine: float | None = None
    fp32_parity: dict | None = None  # {"candidate_rmse", "eager_rmse"} when rule 5 decided the leaf


@dataclasses.dataclass
class ComparisonResult:
    """Outcome of comparing all samples: the worst error per leaf and the thresholds used."""

    leaves: list[LeafError]
    metric: str  # "allclose" or "sqnr+cosine"
    tolerance: dict

    @property
    def max_abs_error(self) -> float:
        return max((leaf.max_abs_error for leaf in self.leaves), default=0.0)

    @property
    def max_rel_error(self) -> float:
        return max((leaf.max_rel_error for leaf in self.leaves), default=0.0)

    @property
    def min_sqnr_db(self) -> float | None:
        values = [leaf.sqnr_db for leaf in self.leaves if leaf.sqnr_db is not None]
        return min(values) if values else None

    @property
    def min_cosine(self) -> float | None:
        values = [leaf.cosine for leaf in self.leaves if leaf.cosine is not None]
        return min(values) if values else None

    def to_dict(self) -> dict:
        return {"metric": self.metric, "tolerance": self.tolerance, "max_abs_error": self.max_abs_error,
                "max_rel_error": self.max_rel_error, "min_sqnr_db": self.min_sqnr_db, "min_cosine": self.min_cosine,
                "leaves": [dataclasses.asdict(leaf) for leaf in self.leaves]}


def _rmse(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    return float(torch.sqrt(torch.mean((candidate - reference) ** 2))) if reference.numel() else 0.0


def sqnr_db(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: ``20 * log10(||ref|| / ||ref - cand||)`` (torchao's definition)."""
    reference = reference.double()
    noise = torch.linalg.vector_norm(reference - candidate.double())
    signal = torch.linalg.vector_norm(reference)
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return float(20 * torch.log10(signal / noise))


def cosine_similarity(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """Cosine similarity of the flattened tensors (1.0 when both are all-zero)."""
    reference, candidate = reference.double().flatten(), candidate.double().flatten()
    norms = torch.linalg.vector_norm(reference) * torch.linalg.vector_norm(candidate)
    if norms == 0:
        return 1.0 if torch.equal(reference, candidate) else 0.0
    return float(torch.dot(reference, candidate) / norms)


class OutputComparator:
    """Accumulates per-leaf errors over samples; raises on the first violation.

    Args:
        tolerance: thresholds. quantized: use SQNR/cosine floors for float leaves instead of atol/rtol.
        low_precision: the candidate computes fp32 outputs in reduced precision (TF32, autocast): fp32 leaves
            get the fp16/bf16 tolerances (DESIGN.md §5: "tf32 and bf16/fp16 1e-2/1e-2").
    """

    def __init__(self, tolerance: Tolerance | None = None, quantized: bool = False, low_precision: bool = False):
        self.tolerance = tolerance or Tolerance()
        self.quantized = quantized
        self.low_precision = low_precision  # computes fp32 in reduced precision (TF32, autocast): fp16 tolerances
        self._errors: dict[str, LeafError] = {}

    def compare(self, reference: Any, candidate: Any, reference_fp32: Any = None) -> None:
        """Compare one sample's outputs. Raises ShapeMismatchError or ToleranceExceededError.

        ``reference_fp32``: the same call run in float32 (same structure); enables rule 5 for fp16/bf16 leaves.
        """
        reference_leaves, reference_spec = tree_flatten(reference)
        candidate_leaves, candidate_spec = tree_flatten(candidate)
        if _structure(reference_spec) != _structure(candidate_spec):
            raise ShapeMismatchError(f"output structure differs from eager: expected {_describe(reference_spec)}, "
                                     f"got {_describe(candidate_spec)}")
        fp32_leaves = tree_flatten(reference_fp32)[0] if reference_fp32 is not None else [None] * len(reference_leaves)
        if len(fp32_leaves) != len(reference_leaves):
            fp32_leaves = [None] * len(reference_leaves)
        for path, expected, actual, expected32 in zip(leaf_paths(reference_spec), reference_leaves, candidate_leaves,
                                                      fp32_leaves):
            try:
                self._compare_leaf(path_to_str(path), expected, actual)
            except ToleranceExceededError as exc:
                if not self._parity_rescues(path_to_str(path), exc, expected, actual, expected32):
                    raise

    def _parity_rescues(self, path: str, exc: ToleranceExceededError, expected, actual, expected32) -> bool:
        """Rule 5: a fp16/bf16 leaf as close to the fp32 result as eager's own (see the module docstring)."""
        if (self.quantized or not self.tolerance.fp32_parity or not isinstance(expected32, torch.Tensor)
                or not isinstance(expected, torch.Tensor) or expected.dtype not in LOW_PRECISION
                or not exc.tolerance.startswith("atol=") or expected32.shape != expected.shape):
            return False
        reference = expected32.detach().cpu().double()
        finite = torch.isfinite(reference) & torch.isfinite(expected.detach().cpu())
        reference = reference[finite]
        candidate_rmse = _rmse(actual.detach().cpu().double()[finite], reference)
        eager_rmse = _rmse(expected.detach().cpu().double()[finite], reference)
        bound = self.tolerance.fp32_parity_multiplier * eager_rmse + self.tolerance.low_precision_atol / 10
        if candidate_rmse > bound:
            exc.args = (f"{exc.args[0]}; and vs an fp32 run its RMSE {candidate_rmse:.3g} exceeds "
                        f"{self.tolerance.fp32_parity_multiplier:g} x eager's {eager_rmse:.3g} + "
                        f"{self.tolerance.low_precision_atol / 10:g}",)
            return False
        record = self._errors.setdefault(path, LeafError(path))
        record.fp32_parity = {"candidate_rmse": candidate_rmse, "eager_rmse": eager_rmse}
        return True

    def result(self) -> ComparisonResult:
        metric = "sqnr+cosine" if self.quantized else "allclose"
        if any(leaf.fp32_parity for leaf in self._errors.values()):
            metric = "allclose+fp32-parity"
        return ComparisonResult(list(self._errors.values()), metric, self.tolerance.to_dict())

    def _compare_leaf(self, path: str, expected: Any, actual: Any) -> None:
        if not isinstance(expected, torch.Tensor):
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
        if expected.shape != actual.shape:
            raise ShapeMismatchError(f"output {path}: shape {tuple(actual.shape)} != eager {tuple(expected.shape)}")
        if expected.dtype != actual.dtype:
            raise ShapeMismatchError(f"output {path}: dtype {actual.dtype} != eager {expected.dtype}")
        if expected.device.type != actual.device.type:
            raise ShapeMismatchError(f"output {path}: device {actual.device} != eager {expected.device}")
        expected_layout, actual_layout = memory_format(expected), memory_format(actual)
        if expected_layout != actual_layout and "channels_last" in expected_layout + actual_layout:
            raise ShapeMismatchError(f"output {path}: memory format {actual_layout} != eager {expected_layout}")
        record = self._errors.setdefault(path, LeafError(path))
        if not (expected.is_floating_point() or expected.is_complex()):
            if not torch.equal(expected.cpu(), actual.cpu()):
                mismatches = int((expected.cpu() != actual.cpu()).sum())
                raise ToleranceExceededError(f"output {path}: {mismatches} of {expected.numel()} integer/bool "
                                             "elements differ from eager", leaf=path, tolerance="exact")
            return
        leaf_dtype = expected.dtype
        expected, actual = expected.detach().cpu(), actual.detach().cpu()
        if expected.is_complex():  # compare real and imaginary parts (.double() would drop the imaginary)
            expected, actual = torch.view_as_real(expected.resolve_conj()), torch.view_as_real(actual.resolve_conj())
        expected_finite, actual_finite = torch.isfinite(expected), torch.isfinite(actual)
        if not torch.equal(expected_finite, actual_finite):
            bad = int((expected_finite & ~actual_finite).sum())
            extra = int((~expected_finite & actual_finite).sum())
            raise ToleranceExceededError(
                f"output {path}: {bad} non-finite values where eager is finite"
                + (f", {extra} finite where eager is NaN/Inf" if extra else ""), leaf=path, tolerance="finite")
        if not torch.equal(expected[~expected_finite].nan_to_num(), actual[~actual_finite].nan_to_num()):
            raise ToleranceExceededError(f"output {path}: infinities of a different sign than eager", leaf=path,
                                         tolerance="finite")
        expected, actual = expected[expected_finite].double(), actual[actual_finite].double()
        if expected.numel() == 0:
            return
        difference = (actual - expected).abs()
        max_abs = float(difference.max())
        # Relative to the leaf's scale, not element-wise: |a-b|/|b| explodes where eager is near zero.
        max_rel = max_abs / max(float(expected.abs().max()), 1e-12)
        record.max_abs_error = max(record.max_abs_error, max_abs)
        record.max_rel_error = max(record.max_rel_error, max_rel)
        if self.quantized:
            sqnr, cosine = sqnr_db(expected, actual), cosine_similarity(expected, actual)
            record.sqnr_db = sqnr if record.sqnr_db is None else min(record.sqnr_db, sqnr)
            record.cosine = cosine if record.cosine is None else min(record.cosine, cosine)
            if sqnr < self.tolerance.min_sqnr_db or cosine < self.tolerance.min_cosine:
                raise ToleranceExceededError(
                    f"output {path}: SQNR {sqnr:.1f} dB (floor {self.tolerance.min_sqnr_db} dB), cosine "
                    f"{cosine:.4f} (floor {self.tolerance.min_cosine})", leaf=path, max_abs_error=max_abs,
                    max_rel_error=max_rel, tolerance=f"sqnr>={self.tolerance.min_sqnr_db}dB,"
                                                     f"cosine>={self.tolerance.min_cosine}")
            return
        atol, rtol = self.tolerance.for_dtype(torch.float16 if self.low_precision else leaf_dtype)
        excess = difference - (atol + rtol * expected.abs())
        if bool((excess > 0).any()):
            count = int((excess > 0).sum())
            raise ToleranceExceededError(
                f"output {path}: {count} of {expected.numel()} values off by more than atol={atol:g} + "
                f"rtol={rtol:g}*|eager| (max abs error {max_abs:.3g}, max rel error {max_rel:.3g})",
                leaf=path, max_abs_error=max_abs, max_rel_error=max_rel, tolerance=f"atol={atol:g},rtol={rtol:g}")


def memory_format(tensor: torch.Tensor) -> str:
    """``"channels_last"`` / ``"channels_last_3d"`` (4-D / 5-D tensors in that layout and not plain
    contiguous), ``"contiguous"``, or ``"strided"`` (any other strides)."""
    if tensor.dim() == 4 and not tensor.is_contiguous() and tensor.is_contiguous(memory_format=torch.channels_last):
        return "channels_last"
    if tensor.dim() == 5 and not tensor.is_contiguous() and \
            tensor.is_contiguous(memory_format=torch.channels_last_3d):
        return "channels_last_3d"
    return "contiguous" if tensor.is_contiguous() else "strided"


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

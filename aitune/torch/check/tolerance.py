"""The thresholds of the comparison with eager (:class:`Tolerance`), what it measured per leaf
(:class:`LeafError`, :class:`ComparisonResult`), and the fp32 settings an exact reference run needs.

The rules these thresholds serve: :mod:`aitune.torch.check.correctness`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Iterator

import torch

from aitune.errors import ConfigError
from aitune.torch.common.arguments import KnownFields


LOW_PRECISION = (torch.float16, torch.bfloat16)

# rule 5's multiplier on scaled probes, for the RMSE and the worst element (NOTE [judging probes at other magnitudes])
SCALED_PROBE_PARITY_MULTIPLIER = 4.0


def tf32_allowed() -> bool:
    """May CUDA fp32 work run in TF32 (or lower) under the current settings: cuDNN convolutions
    (``torch.backends.cudnn.allow_tf32``, True by default) or matmuls (``torch.get_float32_matmul_precision()``
    other than ``"highest"``)? Settings that mix PyTorch's legacy and new TF32 APIs cannot be read: True."""
    try:
        return bool(torch.backends.cudnn.allow_tf32) or torch.get_float32_matmul_precision() != "highest"
    except RuntimeError:
        return True


@contextlib.contextmanager
def exact_fp32() -> Iterator[None]:
    """CUDA fp32 convolutions and matmuls in full fp32 (TF32 off) for a reference run; the user's settings are
    restored after. The settings are process-wide: another thread's CUDA work during the reference run runs
    without TF32 too (slower, never less accurate)."""
    try:
        matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    except RuntimeError:  # mixed legacy/new TF32 settings: leave them alone
        yield
        return
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = cudnn


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
    def from_dict(cls, data: dict | None, strict: bool = False) -> "Tolerance":
        """The inverse of :meth:`to_dict`; missing fields take their defaults, unknown ones are ignored
        (refused with ``strict``).

        Args:
            data: a :meth:`to_dict` result (e.g. from a checkpoint manifest), or None for the defaults.
            strict: refuse unknown fields (checkpoints read them so: a threshold this aitune does not know
                would silently not be applied).

        Raises:
            ConfigError: when ``data`` is not a dict, a value is invalid (see the class), or with ``strict`` a
                field is unknown.
        """
        if data is not None and not isinstance(data, dict):
            raise ConfigError(f"a Tolerance is read from a dict, got {type(data).__name__}")
        names = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(key for key in (data or {}) if key not in names)
        if strict and unknown:
            raise ConfigError(f"Tolerance has no field {', '.join(repr(key) for key in unknown)} (fields: "
                              f"{sorted(names)})")
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
    atol: float | None = None  # the atol / rtol of rule 3 this leaf was held to (its dtype's, or fp16's for
    rtol: float | None = None  # a reduced-precision candidate); None for integer leaves and SQNR/cosine checks


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

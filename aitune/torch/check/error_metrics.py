"""Error measures of one output leaf, computed a chunk at a time (NOTE [chunked comparison] in
:mod:`aitune.torch.check.correctness`): the compute dtype, max errors and counts (:class:`LeafErrors`), and the
SQNR and cosine similarity of quantized checks (:class:`Norms`, :func:`sqnr_db`, :func:`cosine_similarity`)."""

from __future__ import annotations

import math
from typing import Iterator

import torch

from aitune.torch.check.references import CHUNK_ELEMENTS, chunk_plan, piece_of


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype values of ``dtype`` are compared in: float64 stays float64, other floating types (fp16, bf16,
    fp8) become float32, complex types their real counterpart at the same rule (compared as real and
    imaginary parts); integers and bools float64 (only the public SQNR/cosine helpers compare those)."""
    if dtype in (torch.float64, torch.complex128) or not (dtype.is_floating_point or dtype.is_complex):
        return torch.float64
    return torch.float32


def chunk_pieces(leaves: list, device: torch.device, chunk_elements: int) -> Iterator[list[torch.Tensor]]:
    """For leaves of one shape (tensors or :class:`~aitune.torch.check.references.StoredTensor`), the same
    flattened piece of each, on ``device``, as real values of their :func:`compute_dtype` (a complex piece as its
    real and imaginary parts)."""
    for index, start, stop in chunk_plan(leaves[0].shape, chunk_elements):
        pieces = []
        for leaf in leaves:
            piece = piece_of(leaf, index, start, stop)
            piece = piece.detach().to(device)
            if piece.is_complex():
                piece = torch.view_as_real(piece.resolve_conj()).reshape(-1)
            pieces.append(piece.to(compute_dtype(leaf.dtype)))
        yield pieces


def sum_of_squares(values: torch.Tensor) -> torch.Tensor:
    """``sum(values ** 2)`` as a float64 scalar on ``values``' device, computed in ``values``' dtype scaled by
    its largest magnitude (no overflow of float32 squares above 1.8e19, no underflow of tiny ones)."""
    if values.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=values.device)
    scale = values.abs().max()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (values / scale).square().sum().double() * scale.double().square()


def _dot(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """``sum(first * second)`` as a float64 scalar, scaled like :func:`sum_of_squares`."""
    if first.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=first.device)
    scales = [values.abs().max() for values in (first, second)]
    scales = [torch.where(scale > 0, scale, torch.ones_like(scale)) for scale in scales]
    return ((first / scales[0]) * (second / scales[1])).sum().double() * scales[0].double() * scales[1].double()


class Norms:
    """Running sums for SQNR and cosine over chunks: ||ref||², ||ref - cand||², ||cand||², <ref, cand>, and
    whether ref == cand everywhere (float64 scalars on the device)."""

    def __init__(self, device: torch.device):
        zero = torch.zeros((), dtype=torch.float64, device=device)
        self.signal, self.noise, self.candidate, self.dot = zero, zero.clone(), zero.clone(), zero.clone()
        self.unequal = torch.zeros((), dtype=torch.int64, device=device)

    def add(self, reference: torch.Tensor, candidate: torch.Tensor) -> None:
        self.signal = self.signal + sum_of_squares(reference)
        self.noise = self.noise + sum_of_squares(reference - candidate)
        self.candidate = self.candidate + sum_of_squares(candidate)
        self.dot = self.dot + _dot(reference, candidate)
        self.unequal = self.unequal + (reference != candidate).sum()

    def sqnr_db(self) -> float:
        """``20 * log10(||ref|| / ||ref - cand||)``: inf without noise, -inf without signal."""
        noise, signal = float(self.noise), float(self.signal)
        if noise == 0:
            return math.inf
        if signal == 0:
            return -math.inf
        return 10 * math.log10(signal / noise)

    def cosine(self) -> float:
        """``<ref, cand> / (||ref|| ||cand||)``; with a zero norm, 1.0 when both are equal, else 0.0."""
        norms = math.sqrt(float(self.signal)) * math.sqrt(float(self.candidate))
        if norms == 0:
            return 1.0 if int(self.unequal) == 0 else 0.0
        return float(self.dot) / norms


def norms_of(reference: torch.Tensor, candidate: torch.Tensor, chunk_elements: int = CHUNK_ELEMENTS) -> Norms:
    reference, candidate = reference.detach().flatten(), candidate.detach().flatten()
    norms = Norms(reference.device)
    for pieces in chunk_pieces([reference, candidate], reference.device, chunk_elements):
        norms.add(*pieces)
    return norms


def sqnr_db(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: ``20 * log10(||ref|| / ||ref - cand||)`` (torchao's definition).

    Computed in chunks, in float32 for fp32/fp16/bf16 values (float64 sums of scaled squares)."""
    return norms_of(reference, candidate).sqnr_db()


def cosine_similarity(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """Cosine similarity of the flattened tensors (1.0 when both are all-zero)."""
    return norms_of(reference, candidate).cosine()


class LeafErrors:
    """What one float leaf's comparison accumulates over its chunks (scalars on the device until the end)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, *, record_norms: bool, count_excess: bool):
        count = lambda: torch.zeros((), dtype=torch.int64, device=device)  # noqa: E731
        self.non_finite, self.extra_finite, self.sign, self.excess, self.finite = (count() for _ in range(5))
        self.max_abs = torch.zeros((), dtype=dtype, device=device)
        self.max_expected = torch.zeros((), dtype=dtype, device=device)
        self.norms = Norms(device) if record_norms else None
        self.count_excess = count_excess

    def add(self, expected: torch.Tensor, actual: torch.Tensor, atol: float, rtol: float) -> None:
        # Few chunk-sized temporaries, reused in place: they are what a check holds beyond the two outputs.
        expected_finite, actual_finite = torch.isfinite(expected), torch.isfinite(actual)
        both = expected_finite & actual_finite
        finite = both.sum()
        self.non_finite += expected_finite.sum() - finite
        self.extra_finite += actual_finite.sum() - finite
        del expected_finite, actual_finite
        if not bool(finite == both.numel()):
            neither = ~(torch.isfinite(expected) | torch.isfinite(actual))
            self.sign += (expected[neither].nan_to_num() != actual[neither].nan_to_num()).sum()
            expected, actual = expected[both], actual[both]
        del both
        if expected.numel() == 0:
            return
        self.finite += expected.numel()
        difference = actual - expected
        difference.abs_()
        magnitude = expected.abs()
        self.max_abs = torch.maximum(self.max_abs, difference.max())
        self.max_expected = torch.maximum(self.max_expected, magnitude.max())
        if self.count_excess:
            self.excess += (difference > magnitude.mul_(rtol).add_(atol)).sum()  # |a - e| > atol + rtol * |e|
        del difference, magnitude
        if self.norms is not None:
            self.norms.add(expected, actual)

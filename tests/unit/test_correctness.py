import math

import pytest
import torch

from aitune.errors import ConfigError, ShapeMismatchError, ToleranceExceededError
from aitune.torch.check.correctness import OutputComparator, Tolerance, cosine_similarity, sqnr_db


def test_defaults_follow_design():
    tolerance = Tolerance()
    assert tolerance.for_dtype(torch.float32) == (1e-4, 1e-3)
    assert tolerance.for_dtype(torch.float16) == (1e-2, 1e-2)
    assert tolerance.for_dtype(torch.bfloat16) == (1e-2, 1e-2)


@pytest.mark.parametrize("field", ["atol", "rtol", "low_precision_atol"])
def test_negative_tolerance_is_a_config_error(field):
    with pytest.raises(ConfigError, match=field):
        Tolerance(**{field: -1.0})


def test_allclose_rule_and_measured_errors():
    reference = torch.tensor([1.0, 100.0])
    comparator = OutputComparator()
    comparator.compare(reference, reference + torch.tensor([1e-4, 0.1]))  # 1e-4 <= 1e-4+1e-3; 0.1 <= 0.1001
    result = comparator.result()
    assert result.max_abs_error == pytest.approx(0.1, rel=1e-4)
    with pytest.raises(ToleranceExceededError) as info:
        OutputComparator().compare(reference, reference + torch.tensor([0.0, 0.2]))
    assert info.value.max_abs_error == pytest.approx(0.2, rel=1e-4) and "rtol=0.001" in info.value.tolerance


def test_structure_shape_dtype_mismatches():
    with pytest.raises(ShapeMismatchError, match="structure"):
        OutputComparator().compare((torch.ones(1), torch.ones(1)), [torch.ones(1), torch.ones(1)])
    with pytest.raises(ShapeMismatchError, match="shape"):
        OutputComparator().compare(torch.ones(2), torch.ones(3))
    with pytest.raises(ShapeMismatchError, match="dtype"):
        OutputComparator().compare(torch.ones(2), torch.ones(2, dtype=torch.float64))
    with pytest.raises(ToleranceExceededError, match="integer"):
        OutputComparator().compare(torch.tensor([1, 2]), torch.tensor([1, 3]))
    with pytest.raises(ShapeMismatchError):
        OutputComparator().compare({"n": 3}, {"n": 4})


def test_nan_must_match_positions_case_c09():
    reference = torch.tensor([1.0, float("nan"), 2.0])
    OutputComparator().compare(reference, torch.tensor([1.0, float("nan"), 2.0]))
    with pytest.raises(ToleranceExceededError, match="non-finite"):
        OutputComparator().compare(torch.tensor([1.0, 2.0]), torch.tensor([1.0, float("nan")]))
    with pytest.raises(ToleranceExceededError):
        OutputComparator().compare(reference, torch.tensor([1.0, 0.0, 2.0]))


def test_quantized_metric():
    torch.manual_seed(0)
    reference = torch.randn(1000)
    assert sqnr_db(reference, reference) == math.inf
    noisy = reference + 0.01 * torch.randn(1000)
    assert sqnr_db(reference, noisy) == pytest.approx(40, abs=1.5)  # noise 1 % of signal -> ~40 dB
    assert cosine_similarity(reference, -reference) == pytest.approx(-1.0)
    comparator = OutputComparator(quantized=True)
    comparator.compare(reference, noisy)
    assert comparator.result().min_sqnr_db > 30
    with pytest.raises(ToleranceExceededError, match="SQNR"):
        OutputComparator(quantized=True).compare(reference, reference + 0.5 * torch.randn(1000))


def test_complex_outputs_compare_imaginary_parts():
    with pytest.raises(ToleranceExceededError):
        OutputComparator().compare(torch.tensor([1 + 1j, 2 + 2j]), torch.tensor([1 + 5j, 2 - 7j]))
    OutputComparator().compare(torch.tensor([1 + 1j]), torch.tensor([1 + 1j]))


def test_fp16_leaf_passes_when_as_accurate_as_eager_against_fp32():
    torch.manual_seed(0)
    exact = torch.randn(4096) * 20  # large values: fp16 rounding alone exceeds atol=rtol=1e-2 somewhere
    eager = (exact + 0.05 * torch.randn(4096)).half()
    candidate = (exact + 0.05 * torch.randn(4096)).half()  # different rounding, same accuracy
    with pytest.raises(ToleranceExceededError):
        OutputComparator().compare(eager, candidate)  # the plain rule alone rejects it
    comparator = OutputComparator()
    comparator.compare(eager, candidate, reference_fp32=exact)
    result = comparator.result()
    assert result.metric == "allclose+fp32-parity"
    parity = result.leaves[0].fp32_parity
    assert parity["candidate_rmse"] <= 2 * parity["eager_rmse"] + 1e-3

    worse = (exact + 0.5 * torch.randn(4096)).half()  # ten times less accurate than eager
    with pytest.raises(ToleranceExceededError, match="RMSE"):
        OutputComparator().compare(eager, worse, reference_fp32=exact)
    with pytest.raises(ToleranceExceededError):  # turned off: the plain rule only
        OutputComparator(Tolerance(fp32_parity=False)).compare(eager, candidate, reference_fp32=exact)


def test_fp32_parity_never_rescues_nan_or_fp32_leaves():
    exact = torch.tensor([1.0, 2.0])
    with pytest.raises(ToleranceExceededError, match="non-finite"):
        OutputComparator().compare(exact.half(), torch.tensor([1.0, float("nan")]).half(), reference_fp32=exact)
    with pytest.raises(ToleranceExceededError):
        OutputComparator().compare(exact, exact + 0.5, reference_fp32=exact)


def test_fp32_leaves_of_a_tf32_eager_are_judged_against_eager_s_own_distance_from_exact_fp32():
    # fp32 ResNet-50 on a GPU with TF32 on: eager's cuDNN convolutions ran in TF32 and compiled
    # candidates differed from its logits by 4e-4 to 1e-3, beyond fp32's atol=1e-4 + rtol=1e-3.
    generator = torch.Generator().manual_seed(7)
    exact = torch.randn(4096, generator=generator) * 3
    eager = exact + 2e-3 * torch.randn(4096, generator=generator)  # TF32-sized errors
    candidate = exact + 2e-3 * torch.randn(4096, generator=generator)
    with pytest.raises(ToleranceExceededError, match="atol=0.0001") as plain:  # eager exact: plain rule only
        OutputComparator(tf32_eager=False).compare(eager, candidate, reference_fp32=exact)
    assert plain.value.fp32_parity_possible is False  # so the checks compute no exact fp32 run for it
    with pytest.raises(ToleranceExceededError) as first:  # before the exact run exists: it is worth making
        OutputComparator(tf32_eager=True).compare(eager, candidate)
    assert first.value.fp32_parity_possible is True
    with pytest.raises(ToleranceExceededError) as half:
        OutputComparator().compare(eager.half(), (eager + 0.5).half())
    assert half.value.fp32_parity_possible is True
    comparator = OutputComparator(tf32_eager=True)
    comparator.compare(eager, candidate, reference_fp32=exact)
    assert comparator.result().metric == "allclose+fp32-parity"
    parity = comparator.result().leaves[0].fp32_parity
    assert parity["eager_rmse"] == pytest.approx(float((eager - exact).pow(2).mean().sqrt()), rel=1e-4)
    worse = exact + 1e-2 * torch.randn(4096, generator=generator)  # five times eager's error
    with pytest.raises(ToleranceExceededError, match="exact fp32 run its RMSE .* \\+ 1e-05"):
        OutputComparator(tf32_eager=True).compare(eager, worse, reference_fp32=exact)
    # by default only CUDA outputs are taken for TF32 results: a CPU fp32 leaf keeps the plain rule
    assert not OutputComparator().eager_in_tf32(candidate)


def test_exact_fp32_turns_tf32_off_and_restores_the_user_settings():
    from aitune.torch.check.correctness import exact_fp32, tf32_allowed

    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("medium")
    try:
        assert tf32_allowed()
        with exact_fp32():
            assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cudnn.allow_tf32
            assert not tf32_allowed()
        assert torch.get_float32_matmul_precision() == "medium" and torch.backends.cudnn.allow_tf32 == before[1]
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]


# ---- chunked comparison (NOTE [chunked comparison]) against the float64 one it replaced


def _float64_verdict(expected, actual, quantized=False, atol=1e-4, rtol=1e-3):
    """The comparison before chunking: both leaves on the CPU in float64, whole (kept here as the oracle)."""
    expected, actual = expected.detach().cpu(), actual.detach().cpu()
    if not (expected.is_floating_point() or expected.is_complex()):
        mismatches = int((expected != actual).sum())
        return ("exact", mismatches) if mismatches else ("ok",)
    if expected.is_complex():
        expected, actual = torch.view_as_real(expected.resolve_conj()), torch.view_as_real(actual.resolve_conj())
    expected_finite, actual_finite = torch.isfinite(expected), torch.isfinite(actual)
    if not torch.equal(expected_finite, actual_finite):
        return ("finite", int((expected_finite & ~actual_finite).sum()), int((~expected_finite & actual_finite).sum()))
    if not torch.equal(expected[~expected_finite].nan_to_num(), actual[~actual_finite].nan_to_num()):
        return ("sign",)
    expected, actual = expected[expected_finite].double(), actual[actual_finite].double()
    if expected.numel() == 0:
        return ("ok",)
    difference = (actual - expected).abs()
    max_abs = float(difference.max())
    max_rel = max_abs / max(float(expected.abs().max()), 1e-12)
    if quantized:
        noise, signal = torch.linalg.vector_norm(expected - actual), torch.linalg.vector_norm(expected)
        sqnr = math.inf if noise == 0 else (-math.inf if signal == 0 else float(20 * torch.log10(signal / noise)))
        norms = signal * torch.linalg.vector_norm(actual)
        cosine = (1.0 if torch.equal(expected, actual) else 0.0) if norms == 0 else float(
            torch.dot(expected, actual) / norms)
        return ("quantized", max_abs, max_rel, sqnr, cosine)
    count = int(((difference - (atol + rtol * expected.abs())) > 0).sum())
    return ("allclose", max_abs, max_rel, count, expected.numel())


def _chunked_verdict(expected, actual, quantized=False, chunk_elements=1000):
    comparator = OutputComparator(quantized=quantized, chunk_elements=chunk_elements)
    try:
        comparator.compare(expected, actual)
    except ToleranceExceededError as exc:
        return exc, comparator.result()
    return None, comparator.result()


def _with_non_finite(values: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    values = values.clone()
    flat = values.view(-1)
    positions = torch.randperm(flat.numel(), generator=generator)[:30]
    flat[positions[:10]] = float("nan")
    flat[positions[10:20]] = float("inf")
    flat[positions[20:]] = -float("inf")
    return values


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("chunk_elements", [7, 1000, 2**22])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "channels_last"])
def test_chunked_comparison_equals_float64_on_random_data(dtype, chunk_elements, layout):
    generator = torch.Generator().manual_seed(1)
    shape = (3, 4, 25, 30)  # 9000 elements: several chunks of 1000, one of 2^22
    exact = torch.randn(shape, generator=generator) * 10
    noise = torch.randn(shape, generator=generator) * (1e-3 if dtype in (torch.float32, torch.float64) else 3e-2)
    expected = _with_non_finite(exact, generator).to(dtype)
    actual = (expected.float() + noise).to(dtype)  # same NaN/inf positions (inf + noise stays inf)
    within = (expected.float() + noise / 1000).to(dtype)  # passes
    if layout == "transposed":  # strided eager vs contiguous candidate: compared in logical order
        expected, actual, within = expected.transpose(1, 3), actual.transpose(1, 3).contiguous(), \
            within.transpose(1, 3).contiguous()
    elif layout == "channels_last":
        expected, actual, within = (t.contiguous(memory_format=torch.channels_last) for t in (expected, actual, within))
    atol, rtol = Tolerance().for_dtype(dtype)
    oracle = _float64_verdict(expected, actual, atol=atol, rtol=rtol)
    assert oracle[0] == "allclose" and oracle[3] > 0  # some values off: the message carries the count
    error, result = _chunked_verdict(expected, actual, chunk_elements=chunk_elements)
    assert error is not None and f"{oracle[3]} of {oracle[4]} values off" in str(error)
    assert error.max_abs_error == pytest.approx(oracle[1], rel=1e-6)
    assert error.max_rel_error == pytest.approx(oracle[2], rel=1e-6)
    assert result.leaves[0].max_abs_error == pytest.approx(oracle[1], rel=1e-6)

    error, result = _chunked_verdict(expected, within, chunk_elements=chunk_elements)
    oracle = _float64_verdict(expected, within, atol=atol, rtol=rtol)
    assert error is None and oracle[3] == 0
    assert result.max_abs_error == pytest.approx(oracle[1], rel=1e-6)
    assert result.max_rel_error == pytest.approx(oracle[2], rel=1e-6)


@pytest.mark.parametrize("chunk_elements", [5, 64, 2**22])
def test_chunked_non_finite_positions_and_signs_as_before(chunk_elements):
    generator = torch.Generator().manual_seed(2)
    expected = _with_non_finite(torch.randn(40, 50, generator=generator), generator)
    moved = expected.clone()
    nan_at = torch.isnan(expected).view(-1).nonzero()[0]
    moved.view(-1)[nan_at] = 0.0  # finite where eager is NaN
    moved.view(-1)[(torch.isfinite(expected).view(-1)).nonzero()[:3]] = float("nan")  # NaN where eager is finite
    oracle = _float64_verdict(expected, moved)
    assert oracle == ("finite", 3, 1)
    error, _ = _chunked_verdict(expected, moved, chunk_elements=chunk_elements)
    assert str(error).endswith("3 non-finite values where eager is finite, 1 finite where eager is NaN/Inf")
    flipped = expected.clone()
    flipped[torch.isposinf(expected)] = -float("inf")
    assert _float64_verdict(expected, flipped) == ("sign",)
    error, _ = _chunked_verdict(expected, flipped, chunk_elements=chunk_elements)
    assert "infinities of a different sign" in str(error)
    error, result = _chunked_verdict(expected, expected.clone(), chunk_elements=chunk_elements)
    assert error is None and result.max_abs_error == 0.0


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.bool])
def test_chunked_integer_leaves_count_every_mismatch(dtype):
    generator = torch.Generator().manual_seed(3)
    expected = torch.randint(0, 2 if dtype is torch.bool else 100, (3000,), generator=generator).to(dtype)
    actual = expected.clone()
    actual[::97] = ~actual[::97] if dtype is torch.bool else actual[::97] + 1
    oracle = _float64_verdict(expected, actual)
    error, _ = _chunked_verdict(expected, actual, chunk_elements=100)  # 30 chunks
    assert f"{oracle[1]} of 3000 integer/bool elements differ" in str(error)
    assert _chunked_verdict(expected, expected.clone(), chunk_elements=100)[0] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.complex64])
def test_chunked_sqnr_and_cosine_equal_float64(dtype):
    generator = torch.Generator().manual_seed(4)
    expected = torch.randn(5000, generator=generator, dtype=torch.complex64 if dtype.is_complex else torch.float32)
    actual = expected + 0.05 * torch.randn(5000, generator=generator, dtype=expected.dtype)
    expected, actual = expected.to(dtype), actual.to(dtype)
    oracle = _float64_verdict(expected, actual, quantized=True)
    error, result = _chunked_verdict(expected, actual, quantized=True, chunk_elements=333)
    assert error is None
    assert result.min_sqnr_db == pytest.approx(oracle[3], rel=1e-5)
    assert result.min_cosine == pytest.approx(oracle[4], rel=1e-6)
    assert result.max_abs_error == pytest.approx(oracle[1], rel=1e-6)
    assert sqnr_db(expected, actual) == pytest.approx(oracle[3], rel=1e-5)
    assert cosine_similarity(expected, actual) == pytest.approx(oracle[4], rel=1e-6)


def test_sums_of_squares_do_not_overflow_float32():
    reference = torch.full((1000,), 1e30)  # squares overflow float32; scaled sums do not
    assert cosine_similarity(reference, reference) == pytest.approx(1.0)
    assert sqnr_db(reference, reference * (1 + 1e-3)) == pytest.approx(60.0, abs=0.01)
    assert cosine_similarity(torch.zeros(4), torch.zeros(4)) == 1.0
    assert cosine_similarity(torch.zeros(4), torch.ones(4)) == 0.0
    assert sqnr_db(torch.zeros(4), torch.ones(4)) == -math.inf and sqnr_db(torch.ones(4), torch.ones(4)) == math.inf


def test_chunked_fp32_parity_rmse_equals_float64():
    generator = torch.Generator().manual_seed(5)
    exact = torch.randn(4096, generator=generator) * 20
    eager = (exact + 0.05 * torch.randn(4096, generator=generator)).half()
    candidate = (exact + 0.05 * torch.randn(4096, generator=generator)).half()
    comparator = OutputComparator(chunk_elements=100)
    comparator.compare(eager, candidate, reference_fp32=exact)
    parity = comparator.result().leaves[0].fp32_parity
    for key, values in (("candidate_rmse", candidate), ("eager_rmse", eager)):
        float64 = float(torch.sqrt(torch.mean((values.double() - exact.double()) ** 2)))
        assert parity[key] == pytest.approx(float64, rel=1e-6)


def test_rule_6_allows_4x_eagers_rounding_but_not_one_element_beyond_4x_eagers_worst():
    """Correctness rule 6 (scaled probes): an fp16 leaf 3x as far from the exact fp32 result as eager passes;
    the same leaf with one element 20 sigma off keeps its RMSE within 4x but not its worst element."""
    generator = torch.Generator().manual_seed(0)
    exact = torch.rand(1000, generator=generator) + 1.0
    sigma = 0.01
    eager = (exact + sigma * torch.randn(1000, generator=generator)).half()
    candidate = (exact + 3 * sigma * torch.randn(1000, generator=generator)).half()
    with pytest.raises(ToleranceExceededError, match="exceeds 2 x eager"):
        OutputComparator().compare(eager, candidate, reference_fp32=exact)  # rules 3 and 5 alone reject it
    OutputComparator().for_scaled_probe().compare(eager, candidate, reference_fp32=exact)  # rule 6 passes it
    faulty = candidate.clone()
    faulty[7] += 20 * sigma
    with pytest.raises(ToleranceExceededError, match="worst element"):
        OutputComparator().for_scaled_probe().compare(eager, faulty, reference_fp32=exact)


def test_rule_6_judges_an_fp32_leaf_that_tf32_never_reached_as_an_exact_eagers():
    """NOTE [an eager that TF32 never reached]: eager's fp32 leaf counts as a TF32 result (as on CUDA with cuDNN's
    TF32 allowed) but equals the exact fp32 run (no convolution reached it): a bf16-autocast candidate on a x10
    probe is judged by rule 3 with the grown ``atol`` (rule 5 would ask for twice eager's error of zero), and a
    fault beyond that ``atol`` still fails; where eager really differs from the exact run, rule 5 decides as
    before."""
    generator = torch.Generator().manual_seed(0)
    exact = torch.randn(4096, generator=generator) * 10  # outputs of a x10 probe
    candidate = exact + 0.03 * torch.randn(4096, generator=generator).clamp(-3, 3)  # bf16-sized rounding
    scaled = OutputComparator(low_precision=True, tf32_eager=True).for_scaled_probe([10.0])
    with pytest.raises(ToleranceExceededError):
        OutputComparator(low_precision=True, tf32_eager=True).compare(exact, candidate, reference_fp32=exact)
    scaled.compare(exact, candidate, reference_fp32=exact)  # eager == the exact run: the grown atol applies
    faulty = candidate.clone()
    faulty[11] += 1.0  # beyond atol 0.1 + rtol 0.01 * |eager| wherever |eager| < 90
    with pytest.raises(ToleranceExceededError):
        OutputComparator(low_precision=True, tf32_eager=True).for_scaled_probe([10.0]).compare(
            exact, faulty, reference_fp32=exact)
    tf32_eager = exact + 1e-4 * torch.randn(4096, generator=generator)  # eager really off the exact run
    with pytest.raises(ToleranceExceededError, match="exceeds"):
        OutputComparator(low_precision=True, tf32_eager=True).for_scaled_probe([10.0]).compare(
            tf32_eager, candidate, reference_fp32=exact)

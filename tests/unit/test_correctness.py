import math

import pytest
import torch

from aitune.errors import ConfigError, ShapeMismatchError, ToleranceExceededError
from aitune.torch.correctness import OutputComparator, Tolerance, cosine_similarity, sqnr_db


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

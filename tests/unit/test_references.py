"""Reference outputs kept compactly (aitune/torch/check/references.py): chunk plans, host copies, spilled files."""

import math

import pytest
import torch
from safetensors.torch import load_file

from aitune.errors import ShapeMismatchError, ToleranceExceededError
from aitune.torch.check.correctness import OutputComparator
from aitune.torch.check.references import ReferenceStore, StoredTensor, all_finite, chunk_plan, spill_bytes_from_env


@pytest.mark.parametrize("shape", [(), (0,), (5, 0, 3), (13,), (3, 4, 5), (2, 3, 41), (1, 1, 100), (7, 2)])
@pytest.mark.parametrize("chunk_elements", [1, 6, 40, 2**22])
def test_chunk_plan_covers_every_element_once_in_logical_order(shape, chunk_elements):
    tensor = torch.arange(math.prod(shape)).reshape(shape)
    strided = tensor.clone().transpose(0, -1).contiguous().transpose(0, -1) if len(shape) > 1 else tensor
    expected_start = 0
    for index, start, stop in chunk_plan(shape, chunk_elements):
        assert start == expected_start and stop > start
        assert stop - start <= max(chunk_elements, 1) or len(shape) == 0
        for source in (tensor, strided):
            assert torch.equal(source[index].reshape(-1), torch.arange(start, stop))
        expected_start = stop
    assert expected_start == math.prod(shape)


def outputs(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 6, 50, generator=generator)
    return {"logits": logits.transpose(1, 2), "half": torch.randn(30, 7, generator=generator).half(),
            "bf16": torch.randn(9, generator=generator).bfloat16(), "ids": torch.arange(12).reshape(3, 4),
            "mask": torch.rand(10, generator=generator) > 0.5, "steps": 3,
            "image": torch.randn(2, 3, 4, 5, generator=generator).contiguous(memory_format=torch.channels_last)}


def verdict(reference, candidate) -> str:
    comparator = OutputComparator(chunk_elements=17)
    try:
        comparator.compare(reference, candidate)
    except (ToleranceExceededError, ShapeMismatchError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return repr([(leaf.path, leaf.max_abs_error, leaf.max_rel_error) for leaf in comparator.result().leaves])


def candidates(eager: dict) -> list:
    off = {**eager, "logits": eager["logits"] + 0.01}
    wrong_ids = {**eager, "ids": eager["ids"] + (torch.arange(12).reshape(3, 4) % 5 == 0)}
    wrong_layout = {**eager, "image": eager["image"].contiguous()}
    slightly = {key: value + 1e-5 if isinstance(value, torch.Tensor) and value.dtype == torch.float32 else value
                for key, value in eager.items()}
    return [eager, off, wrong_ids, wrong_layout, slightly, {**eager, "steps": 4}]


def test_spilled_references_compare_the_same_as_in_memory_ones(tmp_path):
    in_memory = ReferenceStore(None)
    spilled = ReferenceStore(tmp_path, spill_bytes=0, chunk_elements=16)
    eager = outputs(0)
    kept_in_memory, kept_on_disk = in_memory.keep(eager), spilled.keep(outputs(0))
    on_disk = [leaf for leaf in kept_on_disk.leaves if isinstance(leaf, StoredTensor)]
    assert on_disk and all(leaf.spilled for leaf in on_disk)
    assert not any(leaf.spilled for leaf in kept_in_memory.leaves if isinstance(leaf, StoredTensor))
    for candidate in candidates(eager):
        assert verdict(kept_on_disk, candidate) == verdict(kept_in_memory, candidate) == verdict(eager, candidate)
    # The file is plain safetensors: each tensor flattened in logical order.
    files = list(tmp_path.glob("references-*/*.safetensors"))
    assert len(files) == 1
    assert torch.equal(load_file(files[0])["0"], eager["logits"].reshape(-1))
    assert torch.equal(on_disk[0].tensor(), eager["logits"])
    spilled.close()
    assert not list(tmp_path.glob("references-*"))


def test_spilling_starts_when_the_total_passes_the_threshold_and_takes_earlier_references_along(tmp_path):
    first, second = torch.randn(1000), torch.randn(1000)  # 4000 bytes each
    store = ReferenceStore(tmp_path, spill_bytes=6000)
    kept_first = store.keep((first,))
    assert not kept_first.leaves[0].spilled and kept_first.leaves[0].piece((slice(0, 1000),), 0, 1000) is not None
    kept_second = store.keep((second,))
    assert kept_first.leaves[0].spilled and kept_second.leaves[0].spilled and store.spilling
    OutputComparator(chunk_elements=64).compare(kept_first, (first,))
    with pytest.raises(ToleranceExceededError, match="of 1000 values off"):
        OutputComparator(chunk_elements=64).compare(kept_second, (first,))
    store.close()


def test_kept_outputs_never_share_memory_with_the_module_or_a_larger_tensor():
    model = torch.nn.Linear(4, 4)
    store = ReferenceStore(None, module=model)
    fresh = torch.randn(8, 4)
    big = torch.randn(100, 4)
    kept = store.keep((fresh, model.weight.detach(), big[:2]))
    assert kept.leaves[0].piece((slice(0, 8),), 0, 32).data_ptr() == fresh.data_ptr()  # kept without a copy
    weight = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)  # a state restore after eager's run would do this
    assert torch.equal(kept.leaves[1].tensor(), weight)
    assert kept.leaves[2].tensor().untyped_storage().nbytes() == 2 * 4 * 4  # not the 100-row storage


def test_complex_references_stay_in_memory_when_spilling(tmp_path):
    store = ReferenceStore(tmp_path, spill_bytes=0)
    value = torch.randn(10, dtype=torch.complex64)
    kept = store.keep([value])
    assert not kept.leaves[0].spilled
    OutputComparator().compare(kept, [value.clone()])
    store.close()


def test_finiteness_of_kept_outputs_is_read_in_chunks(tmp_path):
    store = ReferenceStore(tmp_path, spill_bytes=0, chunk_elements=8)
    values = torch.randn(100)
    assert all_finite(store.keep([values]))
    values[77] = float("inf")
    assert not all_finite(store.keep([values])) and not all_finite([values])
    store.close()


def test_spill_threshold_from_the_environment(monkeypatch):
    monkeypatch.setenv("AITUNE_REFERENCE_SPILL_BYTES", "1024")
    assert spill_bytes_from_env() == 1024
    monkeypatch.setenv("AITUNE_REFERENCE_SPILL_BYTES", "lots")
    assert spill_bytes_from_env() == 256 * 2**20

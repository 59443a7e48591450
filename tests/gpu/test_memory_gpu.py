"""Memory while tuning on CUDA (marked gpu): references kept on the host (in memory and spilled) judge CUDA
candidates like device references, the check holds no second copy of a large output, the report carries the
device peak."""

import pytest
import torch

import aitune.torch as ait
from aitune.errors import ShapeMismatchError, ToleranceExceededError
from aitune.torch.backend import TorchEagerBackend
from aitune.torch.check.correctness import OutputComparator
from aitune.torch.check.references import ReferenceStore

pytestmark = pytest.mark.gpu


def outputs() -> dict:
    generator = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(4, 50, 6, device="cuda", generator=generator)
    return {"logits": logits.transpose(1, 2), "half": torch.randn(300, device="cuda", generator=generator).half(),
            "ids": torch.arange(12, device="cuda"), "image": torch.randn(
                2, 3, 4, 5, device="cuda", generator=generator).contiguous(memory_format=torch.channels_last)}


def verdict(reference, candidate) -> str:
    try:
        OutputComparator(chunk_elements=37).compare(reference, candidate)
    except (ToleranceExceededError, ShapeMismatchError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


@pytest.mark.parametrize("spill", [False, True])
def test_host_references_judge_cuda_candidates_like_device_ones(spill, tmp_path):
    eager = outputs()
    store = ReferenceStore(tmp_path, spill_bytes=0 if spill else None)
    kept = store.keep(outputs())
    assert all(leaf.device.type == "cuda" for leaf in kept.leaves)  # where eager returned them...
    assert all(leaf.tensor().device.type == "cpu" for leaf in kept.leaves)  # ...kept on the host
    for candidate in (eager, {**eager, "logits": eager["logits"] + 0.01}, {**eager, "ids": eager["ids"] + 1},
                      {**eager, "image": eager["image"].contiguous()}, {**eager, "half": eager["half"].cpu()}):
        assert verdict(kept, candidate) == verdict(eager, candidate)
    store.close()


def test_a_check_holds_no_second_copy_of_a_large_output():
    reference = torch.randn(64 * 2**20 // 4, device="cuda")  # 64 MiB
    candidate = reference + 1e-6
    kept = ReferenceStore(None).keep([reference])
    del reference
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    OutputComparator().compare(kept, [candidate])
    assert torch.cuda.max_memory_allocated() - before < 32 * 2**20  # chunk temporaries only


def test_the_report_carries_the_device_peak(fast_profiling):
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)).cuda().eval()
    wrapped = ait.Module(model, "mlp", strategy=ait.MaxThroughputStrategy(
        [TorchEagerBackend()], profiling_config=fast_profiling))
    report = ait.tune(wrapped, [torch.randn(b, 64, device="cuda") for b in (2, 8)], ready_batches=True)
    assert report.peak_memory["device_bytes"] > 0
    assert "device" in report.describe()


def test_each_candidate_row_says_what_it_keeps_on_the_device(fast_profiling):
    from aitune.torch.backend.eager import TorchEagerBackendConfig

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)).cuda().eval()
    graphs = TorchEagerBackend(TorchEagerBackendConfig(use_cuda_graphs=True))
    wrapped = ait.Module(model, "mlp-kept", strategy=ait.MaxThroughputStrategy([graphs], profiling_config=fast_profiling))
    report = ait.tune(wrapped, [torch.randn(b, 64, device="cuda") for b in (2, 8)], ready_batches=True)
    row = next(r for r in report.rows if r.description == graphs.describe())
    # the captured graphs keep their static outputs (at least 8 x 64 fp32) in their memory pool
    assert row.details["device_retained_bytes"] >= 8 * 64 * 4
    # its high-water mark covers the weights and what it keeps
    assert row.details["device_peak_bytes"] >= row.details["device_retained_bytes"] + sum(
        p.numel() * 4 for p in model.parameters())


def test_sections_give_their_own_peaks_and_the_overall_peak_stays_true():
    from aitune.torch.measure.memory import DeviceSection, PeakMemory

    torch.cuda.init()
    peak = PeakMemory()
    peak.start()
    mib = 2**20
    with DeviceSection("cuda") as big:
        transient = torch.empty(64 * mib, dtype=torch.uint8, device="cuda")
        del transient
    with DeviceSection("cuda") as small:  # resets the counter: the big section's mark must survive in the total
        kept = torch.empty(1 * mib, dtype=torch.uint8, device="cuda")
    assert big.peak_bytes >= 64 * mib and big.retained_bytes == 0
    assert small.peak_bytes < big.peak_bytes and small.retained_bytes == mib
    assert peak.result()["device_bytes"] >= 64 * mib
    del kept


def test_the_state_snapshot_of_a_cuda_module_lives_on_the_host_and_restores_bit_for_bit():
    from aitune.torch.tuning import _Snapshot

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64)).cuda().half().eval()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    allocated = torch.cuda.memory_allocated()
    snapshot = _Snapshot(model)
    assert snapshot.on_host and all(t.device.type == "cpu" for t in snapshot.tensors.values())
    assert torch.cuda.memory_allocated() == allocated  # NOTE [snapshot on the host]: no device copy
    with torch.no_grad():
        model[0].weight.data.mul_(2)  # through .data: the version counter does not see it
        model[1].running_mean.add_(1)
    model.train()
    snapshot.restore()
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    assert all(value.device.type == "cuda" for value in model.state_dict().values())
    assert model.training is False

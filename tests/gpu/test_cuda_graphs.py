"""CUDA-graph runner on a real GPU: capture, replay, recapture, LRU eviction, fallback, fresh
outputs per call (marked gpu)."""

import logging

import pytest
import torch

from aitune.torch.backend import TorchEagerBackend, TorchEagerBackendConfig
from aitune.torch.backend.cuda_graphs import CUDAGraphRunner
from aitune.torch.record.samples import record_graphs

pytestmark = pytest.mark.gpu


class Gram(torch.nn.Module):
    """A module whose outputs a later replay would overwrite if they were not copied."""

    def forward(self, x):
        return x @ x.transpose(-1, -2)


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 256)
        self.down = torch.nn.Linear(256, 64)

    def forward(self, x, scale: float = 1.0):
        hidden = torch.relu(self.up(x))
        return {"out": self.down(hidden) * scale, "norm": hidden.norm(dim=-1)}


def test_c20_outputs_are_never_overwritten_by_later_replays():
    module = Gram().cuda().eval()
    replayed_shapes = []
    runner = CUDAGraphRunner(module, name="gram", before_replay=lambda x: replayed_shapes.append(tuple(x.shape)))
    a = torch.randn(64, 64, device="cuda")
    b = torch.randn(64, 64, device="cuda")
    with torch.no_grad():
        first = runner(a)  # warm-up + capture
        y_a = runner(a)  # replay
        y_b = runner(b)  # replay with new values in the static input
        expected_a, expected_b = module(a), module(b)
    assert runner.stats["captures"] == 1 and runner.stats["replays"] == 2
    torch.testing.assert_close(first, expected_a)
    torch.testing.assert_close(y_a, expected_a)
    torch.testing.assert_close(y_b, expected_b)
    assert y_a.data_ptr() != y_b.data_ptr()
    assert replayed_shapes == [(64, 64), (64, 64)]  # the hook ran before each replay, not before the capture


def test_recapture_on_shape_change_and_lru_bound():
    module = Mlp().cuda().eval()
    runner = CUDAGraphRunner(module, max_graphs=2, name="mlp")
    inputs = {batch: torch.randn(batch, 64, device="cuda") for batch in (1, 4, 8)}
    with torch.no_grad():
        for batch in (1, 4, 1, 8, 1):  # 1, 4 captured; 1 replays; 8 evicts 4 (least recently used); 1 replays
            output = runner(inputs[batch])
            expected = module(inputs[batch])
            torch.testing.assert_close(output["out"], expected["out"])
            torch.testing.assert_close(output["norm"], expected["norm"])
    assert runner.stats == {"captures": 3, "replays": 2, "evictions": 1, "plain_calls": 0}
    assert runner.num_graphs == 2
    with torch.no_grad():
        torch.testing.assert_close(runner(inputs[4])["out"], module(inputs[4])["out"])  # evicted: captured again
    assert runner.stats["captures"] == 4 and runner.stats["evictions"] == 2


def test_constants_are_part_of_the_key():
    module = Mlp().cuda().eval()
    runner = CUDAGraphRunner(module, name="mlp")
    x = torch.randn(4, 64, device="cuda")
    with torch.no_grad():
        for scale in (1.0, 0.5, 1.0, 0.5):
            torch.testing.assert_close(runner(x, scale=scale)["out"], module(x, scale=scale)["out"])
    assert runner.stats["captures"] == 2 and runner.stats["replays"] == 2


def test_capture_failure_falls_back_with_one_warning(caplog):
    def host_sync(x):
        if float(x.sum().item()) > 1e30:  # .item() synchronises: not allowed while capturing
            return x
        return x * 2

    runner = CUDAGraphRunner(host_sync, name="sync")
    x = torch.randn(16, device="cuda")
    with caplog.at_level(logging.WARNING, logger="aitune.torch.backend.cuda_graphs"):
        outputs = [runner(x) for _ in range(3)]
    for output in outputs:
        torch.testing.assert_close(output, x * 2)
    assert not runner.enabled and runner.disabled_reason
    warnings = [record for record in caplog.records if "CUDA graph capture failed" in record.getMessage()]
    assert len(warnings) == 1
    assert runner.stats["plain_calls"] == 2 and runner.stats["captures"] == 0
    torch.cuda.synchronize()  # the device is still healthy after the failed capture
    torch.testing.assert_close(torch.ones(3, device="cuda") * 3, torch.full((3,), 3.0, device="cuda"))
    torch.randn(4, device="cuda")  # and so is the CUDA RNG (NOTE [failed capture and the RNG])
    healthy = CUDAGraphRunner(lambda t: t + 1, name="after")
    for _ in range(2):
        torch.testing.assert_close(healthy(x), x + 1)
    assert healthy.stats["captures"] == 1 and healthy.stats["replays"] == 1


def test_random_ops_replay_with_fresh_numbers():
    runner = CUDAGraphRunner(lambda t: t + torch.rand_like(t), name="random")
    x = torch.zeros(1000, device="cuda")
    first, second, third = (runner(x) for _ in range(3))
    assert runner.stats["replays"] == 2
    assert not torch.equal(second, third)  # the graph draws new numbers on every replay
    assert 0.4 < float(third.mean()) < 0.6


def test_eager_backend_with_cuda_graphs_matches_eager(tmp_path):
    module = Mlp().cuda().eval()
    graph = record_graphs(module, [((torch.randn(b, 64, device="cuda"),), {}) for b in (2, 8)])[0]
    backend = TorchEagerBackend(TorchEagerBackendConfig(use_cuda_graphs=True)).build(module, graph, "cuda", tmp_path)
    outputs, expected = [], []
    for batch in (2, 8, 2, 2, 5):
        x = torch.randn(batch, 64, device="cuda")
        outputs.append(backend(x))
        with torch.no_grad():
            expected.append(module(x))
    for output, reference in zip(outputs, expected):  # checked after all calls: nothing was overwritten
        torch.testing.assert_close(output["out"], reference["out"])
        torch.testing.assert_close(output["norm"], reference["norm"])
    assert backend._graphs.stats["captures"] == 3 and backend._graphs.stats["replays"] == 2
    backend.deactivate()
    assert backend._graphs.num_graphs == 0
    backend.activate()
    torch.testing.assert_close(backend(torch.ones(2, 64, device="cuda"))["out"],
                               module(torch.ones(2, 64, device="cuda"))["out"])


def test_eager_backend_with_cuda_graphs_and_autocast_restores_dtypes(tmp_path):
    module = Mlp().cuda().eval()
    graph = record_graphs(module, [((torch.randn(4, 64, device="cuda"),), {})])[0]
    config = TorchEagerBackendConfig(use_cuda_graphs=True, autocast_enabled=True, autocast_dtype=torch.float16)
    backend = TorchEagerBackend(config).build(module, graph, "cuda", tmp_path)
    x = torch.randn(4, 64, device="cuda")
    for _ in range(3):
        output = backend(x)
    assert output["out"].dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(output["out"], module(x)["out"], atol=1e-2, rtol=1e-2)


def test_concurrent_calls_from_threads_each_get_their_own_answer(tmp_path):
    """Eight threads call one CUDA-graph backend at once, each with its own inputs of the captured shape: the
    lock keeps them from copying inputs over each other's static buffers, so every answer is eager's for the
    thread's own input."""
    import threading

    module = Mlp().cuda().eval()
    graph = record_graphs(module, [((torch.randn(b, 64, device="cuda"),), {}) for b in (8, 16)])[0]
    backend = TorchEagerBackend(TorchEagerBackendConfig(use_cuda_graphs=True)).build(module, graph, "cuda", tmp_path)
    inputs = [torch.randn(8, 64, device="cuda") for _ in range(8)]
    with torch.no_grad():
        expected = [module(x)["out"] for x in inputs]
    backend(inputs[0])  # captured before the threads start
    wrong = []
    start = threading.Barrier(len(inputs))

    def worker(index):
        start.wait()
        for _ in range(50):
            output = backend(inputs[index])["out"]
            if not torch.allclose(output, expected[index], atol=1e-5, rtol=1e-4):
                wrong.append(index)

    threads = [threading.Thread(target=worker, args=(index,)) for index in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == [] and backend._graphs.stats["captures"] == 1

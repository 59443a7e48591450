"""CPU-side logic of the CUDA-graph runner: call keys, the LRU bound, pass-through and config checks.

Capture and replay themselves need a GPU: tests/gpu/test_cuda_graphs.py.
"""

import pytest
import torch

from aitune.errors import ConfigError
from aitune.torch.backend import TorchEagerBackend, TorchEagerBackendConfig
from aitune.torch.backend.cuda_graphs import CUDAGraphRunner, LRUCache, clone_tensors, flat_graph_key, graph_key


def test_lru_cache_evicts_least_recently_used_first():
    evicted = []
    cache = LRUCache(2, on_evict=lambda key, value: evicted.append((key, value)))
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # "a" is now the most recent
    assert cache.put("c", 3) == ["b"]
    assert evicted == [("b", 2)] and cache.keys() == ["a", "c"] and len(cache) == 2
    assert cache.get("b") is None and "b" not in cache
    cache.put("a", 10)  # replacing refreshes, evicts nothing
    assert cache.keys() == ["c", "a"] and cache.get("a") == 10
    cache.clear()
    assert len(cache) == 0
    with pytest.raises(ConfigError, match="max_size must be an int >= 1"):
        LRUCache(0)


def test_graph_key_depends_on_shapes_dtypes_structure_and_constants():
    def key_of(*shapes, dtype=torch.float32, scale=1.0, nested=False):
        tensors = [torch.empty(shape, dtype=dtype) for shape in shapes]
        args = ({"a": tensors[0], "b": tensors[1:]},) if nested else tuple(tensors)
        return graph_key(args, {"scale": scale}, require_cuda=False)

    assert key_of((2, 3)) == key_of((2, 3))
    assert key_of((2, 3)) != key_of((4, 3))
    assert key_of((2, 3)) != key_of((2, 3), dtype=torch.float16)
    assert key_of((2, 3)) != key_of((2, 3), scale=2.0)
    assert key_of((2, 3), (1,)) != key_of((2, 3), (1,), nested=True)
    assert graph_key((torch.empty(2, 3).t(),), {}, require_cuda=False) == graph_key((torch.empty(3, 2),), {},
                                                                                     require_cuda=False)


def test_graph_key_refuses_uncapturable_calls():
    assert graph_key((torch.empty(2, 3),), {}) is None  # CPU tensor
    assert graph_key((1.0, "x"), {}, require_cuda=False) is None  # no tensor at all
    weight = torch.empty(2, requires_grad=True)
    with torch.enable_grad():
        assert graph_key((weight,), {}, require_cuda=False) is None
    with torch.no_grad():
        assert graph_key((weight,), {}, require_cuda=False) is not None


def test_a_flat_calls_key_without_flattening_tells_the_same_calls_apart_as_graph_key():
    """``flat_graph_key`` (a replay's key, without the pytree): for calls of tensors and plain constants it refuses
    what ``graph_key`` refuses and tells apart what it tells apart (a bool from an int too), giving the tensors in
    the order flattening gives them; a nested call is left to ``graph_key`` (None)."""
    def both(args, kwargs, **flags):
        key, tensors = flat_graph_key(args, kwargs, **flags)
        assert (key is None) == (graph_key(args, kwargs, **flags) is None)
        return key, tensors

    x, y = torch.empty(2, 3), torch.empty(4, dtype=torch.float16)
    key, tensors = both((x,), {"mask": y, "scale": 1.0}, require_cuda=False)
    assert key is not None and tensors[0] is x and tensors[1] is y
    same = both((torch.empty(2, 3),), {"mask": torch.empty(4, dtype=torch.float16), "scale": 1.0},
                require_cuda=False)[0]
    assert same == key
    others = [((torch.empty(3, 3),), {"mask": y, "scale": 1.0}), ((x,), {"mask": y.float(), "scale": 1.0}),
              ((x,), {"mask": y, "scale": 2.0}), ((x,), {"mask": y, "scale": True}), ((x, y), {"scale": 1.0}),
              ((x,), {"scale": 1.0, "mask": y})]
    keys = [both(args, kwargs, require_cuda=False)[0] for args, kwargs in others]
    assert len({key, *keys}) == len(others) + 1
    assert flat_graph_key((1, 1), {}, require_cuda=False) == (None, [])  # no tensor: plain call
    assert both((x,), {}) == (None, [])  # a CPU tensor
    weight = torch.empty(2, requires_grad=True)
    with torch.enable_grad():
        assert both((weight,), {}, require_cuda=False) == (None, [])
    with torch.no_grad():
        assert both((weight,), {}, require_cuda=False)[0] is not None
    assert flat_graph_key(([x],), {}, require_cuda=False) is None  # nested: graph_key's business
    assert flat_graph_key((x,), {"cache": object()}, require_cuda=False) is None


def test_a_replay_copies_each_input_into_its_buffer_and_hands_out_copies_or_its_own_outputs_in_new_containers(
        monkeypatch):
    """The replay path of ``CUDAGraphRunner.call`` up to the device (capture needs CUDA: a stand-in graph entered
    under the key of a CPU call, keyed as on CUDA): a flat call's tensors, positional and keyword, go to the buffers
    captured for them; a nested call's (keyed by ``graph_key``) too; ``copy=True`` hands out clones, ``copy=False``
    the graph's own buffers, in a new container each call (what a caller sets in one output is not in the next)."""
    import functools

    from aitune.torch.backend import cuda_graphs
    from aitune.torch.backend.cuda_graphs import _CapturedGraph
    from aitune.torch.record.pytree import tree_flatten

    monkeypatch.setattr(cuda_graphs, "flat_graph_key", functools.partial(flat_graph_key, require_cuda=False))
    monkeypatch.setattr(cuda_graphs, "graph_key", functools.partial(graph_key, require_cuda=False))
    runner = CUDAGraphRunner(lambda *args, **kwargs: pytest.fail("a replayed call never runs the function"))
    x_buffer, mask_buffer = torch.zeros(2, 3), torch.zeros(2)
    output = {"sum": torch.zeros(2, 3)}

    class StandInGraph:  # what the captured kernels would do: read the input buffers, write the output's
        def replay(self):
            output["sum"].copy_(x_buffer + mask_buffer[:, None])

    x, mask = torch.randn(2, 3), torch.randn(2)
    key, _ = flat_graph_key((x,), {"mask": mask, "scale": 2}, require_cuda=False)
    entry = _CapturedGraph(StandInGraph(), [x_buffer, mask_buffer], output)
    entry.output_leaves, entry.output_spec = tree_flatten(output)
    runner._graphs.put(key, entry)
    first = runner.call((x,), {"mask": mask, "scale": 2})
    assert torch.equal(x_buffer, x) and torch.equal(mask_buffer, mask)
    torch.testing.assert_close(first["sum"], x + mask[:, None])
    assert first["sum"].data_ptr() != output["sum"].data_ptr()  # a copy
    own = runner.call((x,), {"mask": mask, "scale": 2}, copy=False)
    assert own["sum"] is output["sum"] and own is not output
    own["sum"] = None  # the caller's container: the next output is whole
    again = runner.call((-x,), {"mask": mask, "scale": 2}, copy=False)
    assert again["sum"] is output["sum"]
    torch.testing.assert_close(again["sum"], -x + mask[:, None])
    torch.testing.assert_close(first["sum"], x + mask[:, None])  # the copy kept its values
    nested_key = graph_key(([x],), {"mask": mask}, require_cuda=False)
    runner._graphs.put(nested_key, entry)
    runner.call(([x * 3],), {"mask": -mask})
    assert torch.equal(x_buffer, x * 3) and torch.equal(mask_buffer, -mask)
    assert runner.stats["replays"] == 4 and runner.stats["captures"] == 0


def test_runner_passes_cpu_calls_through():
    calls = []

    def function(x, scale=1.0):
        calls.append(x.shape)
        return x * scale

    runner = CUDAGraphRunner(function, max_graphs=3, name="test")
    x = torch.randn(4)
    torch.testing.assert_close(runner(x, scale=2.0), x * 2.0)
    assert runner.stats == {"captures": 0, "replays": 0, "evictions": 0, "plain_calls": 1}
    assert runner.num_graphs == 0 and runner.enabled
    with pytest.raises(ConfigError, match="max_cuda_graphs must be an int >= 1"):
        CUDAGraphRunner(function, max_graphs=0)


def test_clone_tensors_copies_every_tensor_leaf():
    a = torch.ones(2)
    value = {"a": a, "rest": (a, "tag", 3)}
    copied = clone_tensors(value)
    assert copied["rest"][1:] == ("tag", 3)
    a.add_(1)
    assert torch.equal(copied["a"], torch.ones(2)) and torch.equal(copied["rest"][0], torch.ones(2))
    alone = clone_tensors(a)  # a bare tensor (the usual output): a copy with its own storage
    a.add_(1)
    assert torch.equal(alone, torch.full((2,), 2.0)) and alone.data_ptr() != a.data_ptr()


def test_eager_backend_cuda_graphs_config():
    assert TorchEagerBackendConfig().use_cuda_graphs is False
    config = TorchEagerBackendConfig(use_cuda_graphs=True)
    assert TorchEagerBackendConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ConfigError, match="use_cuda_graphs must be a bool"):
        TorchEagerBackendConfig(use_cuda_graphs="yes")
    check = TorchEagerBackend(config).supports(torch.nn.Linear(2, 2), None, torch.device("cpu"))
    assert not check.ok and check.reason == "use_cuda_graphs needs a CUDA device"


def test_runner_serialises_concurrent_calls():
    """A call from a second thread does not enter the function while a first call is inside it (the lock that
    keeps threads off each other's static buffers). The first call waits up to 1 s for the second to enter:
    with the lock it never does (the wait times out); without it, it would."""
    import threading

    entered_first, entered_second = threading.Event(), threading.Event()
    overlapped = []

    def function(x):
        if x.item() == 0:
            entered_first.set()
            overlapped.append(entered_second.wait(1.0))
        else:
            entered_second.set()
        return x + 1

    runner = CUDAGraphRunner(function, name="test")
    results = {}

    def second():
        entered_first.wait(10.0)
        results["second"] = runner(torch.tensor(1.0))

    thread = threading.Thread(target=second)
    thread.start()
    results["first"] = runner(torch.tensor(0.0))
    thread.join(10.0)
    assert overlapped == [False] and entered_second.is_set()
    assert (float(results["first"]), float(results["second"])) == (1.0, 2.0)


def test_served_calls_of_a_reduce_overhead_variant_skip_the_output_copy_only_when_told(monkeypatch):
    """NOTE [output copies] in aitune/torch/config.py: a served call of an Inductor CUDA-graph variant copies its
    outputs unless ``config.copy_cuda_graph_outputs`` is False; other runs copy either way. (CUDA graphs need a
    GPU: here a default-mode build is switched onto the copying path a CUDA-graph build takes, and a spy on the
    copy counts its calls; tests/gpu/test_llm_generation_gpu.py runs the real thing.) Values equal eager's both
    ways; a non-bool setting is refused."""
    import aitune.torch as ait
    import aitune.torch.backend.inductor_jit as inductor_jit
    from aitune.torch.backend import TorchInductorJitBackend, TorchInductorJitBackendConfig
    from aitune.torch.config import config

    copies = []
    real_copy = inductor_jit.clone_output
    monkeypatch.setattr(inductor_jit, "clone_output", lambda output: copies.append(1) or real_copy(output))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    blueprint = TorchInductorJitBackend(TorchInductorJitBackendConfig())
    tuned = ait.Module(model, "copies", guard=ait.GuardConfig(enabled=False),
                       strategy=ait.OneBackendStrategy(blueprint).enable_performance_validation(False))
    x = torch.randn(2, 8)
    ait.tune(tuned, [x], ignore_failing_modules=False, ready_batches=True)
    backend = tuned.backends["graph0"]
    backend._clone_outputs, backend._bare = True, False  # what a reduce-overhead build sets (NOTE [a bare served call])
    with torch.no_grad():
        expected = model(x)
        copies.clear()
        torch.testing.assert_close(tuned(x), expected)
        assert len(copies) == 1
        try:
            config.copy_cuda_graph_outputs = False
            copies.clear()
            torch.testing.assert_close(tuned(x), expected)
            assert copies == [] and tuned.backend_calls >= 2
            torch.testing.assert_close(backend.run((x,), {}), expected)  # not a served call: copied
            assert len(copies) == 1
        finally:
            config.copy_cuda_graph_outputs = True
    with pytest.raises(ConfigError, match="copy_cuda_graph_outputs must be a bool"):
        config.copy_cuda_graph_outputs = "no"

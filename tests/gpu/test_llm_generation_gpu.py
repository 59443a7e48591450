"""Text generation on CUDA: the decode graph under CUDA graphs (Inductor reduce-overhead) with a static cache
(skipped without CUDA). Tokens are compared with eager ``generate`` on a copy of the model."""

import copy
import gc
import weakref

import pytest
import torch

import aitune.torch as ait
from aitune.torch.backend import TorchInductorJitBackend, TorchInductorJitBackendConfig
from aitune.torch.measure.profiling import ProfilingConfig
from llm_calls import first_decode_call, raising_after_the_run

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

STATIC = dict(cache_implementation="static", disable_compile=True)


def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(config).cuda().eval()
    model.generation_config.pad_token_id = 0
    return model


def prompt(length, batch=1):
    return torch.randint(1, 256, (batch, length), generator=torch.Generator().manual_seed(length)).cuda()


def generate(model, ids, new_tokens=32, **kwargs):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs)


def call_without_device_waits(module, kwargs):
    """``module(**kwargs)`` with CUDA's sync debug mode raising on any wait for the device."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return module(**kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.fixture(scope="module")
def tuned():
    model = tiny_llama()
    eager = copy.deepcopy(model)
    backend = TorchInductorJitBackend(TorchInductorJitBackendConfig(mode="reduce-overhead"))
    strategy = ait.MaxThroughputStrategy(backends=[backend], profiling_config=ProfilingConfig(time_budget_s=0.2))
    model.model = ait.Module(model.model, "decoder", strategy=strategy)
    ait.tune(lambda ids: generate(model, ids, **STATIC), [prompt(5), prompt(7)], ready_batches=True,
             ignore_failing_modules=False)
    return model, eager


@pytest.mark.parametrize("length,batch", [(9, 1), (12, 2)])
def test_decode_under_cuda_graphs_gives_eagers_tokens(tuned, length, batch):
    model, eager = tuned
    assert [graph.name for graph in model.model.graphs] == ["prefill", "decode"]
    assert model.model.backends["decode"].config.mode == "reduce-overhead"
    before = model.model.stats["backend_calls"]
    ids = prompt(length, batch)
    expected = generate(eager, ids, **STATIC)
    for _ in range(2):  # a second generate: a new cache object (other addresses) replays correctly too
        assert torch.equal(generate(model, ids, **STATIC), expected)
    stats = model.model.stats
    assert stats["backend_calls"] - before >= 2 * 31  # every decode step (prefill: whichever won)
    assert stats["eager_fallbacks"] == {}


def test_transformers_auto_compile_with_a_wrapped_decoder_gives_eagers_tokens(tuned):
    """transformers' own compile of the decode step (static cache, auto-compile on) traces the original decoder
    through the wrapper."""
    model, eager = tuned
    ids = prompt(9)
    expected = generate(eager, ids, cache_implementation="static", disable_compile=True)
    assert torch.equal(generate(model, ids, cache_implementation="static"), expected)


def test_a_one_token_prompt_gives_eagers_tokens(tuned):
    """NOTE [decode without a device read]: a one-token prompt's prefill looks like a decode call to the dispatch
    (one position, not read). Into a new cache (lazily initialised: another structure) its phase is read; into a
    cache transformers reuses (reset, initialised) the decode graph computes it. Tokens equal eager's both ways."""
    model, eager = tuned
    ids = prompt(1)
    expected = generate(eager, ids, **STATIC)
    for _ in range(2):  # the second generate reuses the first one's static cache
        assert torch.equal(generate(model, ids, **STATIC), expected)


def test_without_output_copies_generate_gives_eagers_tokens(tuned):
    """NOTE [output copies]: generate uses each decoder output before the next call, so the decode graph's own
    outputs serve it unchanged."""
    from aitune.torch.config import config

    model, eager = tuned
    ids = prompt(9)
    expected = generate(eager, ids, **STATIC)
    config.copy_cuda_graph_outputs = False
    try:
        assert torch.equal(generate(model, ids, **STATIC), expected)
    finally:
        config.copy_cuda_graph_outputs = True


def test_a_served_decode_call_never_waits_for_the_device(tuned):
    """NOTE [decode without a device read]: the dispatch takes a decode call's phase and the cache's fill without
    copying anything back to the host (CUDA's sync debug mode raises on any such wait), and the call writes the
    cache as eager does."""
    model, eager = tuned
    ids = prompt(9)
    call = first_decode_call(eager, lambda: generate(eager, ids, 3, **STATIC))
    with torch.no_grad():
        for _ in range(3):  # warm: CUDA-graph trees record on their first calls
            model.model(**copy.deepcopy(call))
        mine, theirs = copy.deepcopy(call), copy.deepcopy(call)
        served = model.model.stats["backend_calls"]
        output = call_without_device_waits(model.model, mine)
        expected = eager.model(**theirs)
    assert model.model.stats["backend_calls"] == served + 1
    # every tensor of these calls is on the GPU: their routes skip the value gate, which reads CPU tensors only
    routes = list(model.model._self_dispatch._phase_routes.values())  # (graph, offsets, leaf count, host tensors)
    assert routes and not any(host for *_, host in routes)
    torch.testing.assert_close(output.last_hidden_state, expected.last_hidden_state)
    cache = next(value for value in mine.values() if isinstance(value, transformers.Cache))
    reference = next(value for value in theirs.values() if isinstance(value, transformers.Cache))
    for layer, eager_layer in zip(cache.layers, reference.layers):
        torch.testing.assert_close(layer.keys, eager_layer.keys)
        assert torch.equal(layer.cumulative_length, eager_layer.cumulative_length)


def test_a_decode_backend_that_raises_after_writing_the_cache_is_rewound_on_the_device(tuned):
    """The fill was not read (previous test): a backend that advanced the cache and then raised is undone from a
    device copy of the counter taken before the call; eager's rerun then gives eager's tokens."""
    model, eager = tuned
    with raising_after_the_run(model.model.backends["decode"], times=3) as failures:
        ids = prompt(9)
        assert torch.equal(generate(model, ids, **STATIC), generate(eager, ids, **STATIC))
    assert failures == [1, 1, 1]


def test_a_whole_model_wrapped_and_driven_by_its_own_generate_gives_eagers_tokens_with_and_without_auto_compile():
    """The whole model wrapped, ``generate`` read through the wrapper (NOTE [own calls]): the decode graph under
    CUDA graphs serves every step; with transformers' auto-compile on, its compile of the step (made through the
    view) traces the original model; tokens equal eager's both ways."""
    model = tiny_llama()
    eager = copy.deepcopy(model)
    backend = TorchInductorJitBackend(TorchInductorJitBackendConfig(mode="reduce-overhead"))
    strategy = ait.MaxThroughputStrategy(backends=[backend], profiling_config=ProfilingConfig(time_budget_s=0.2))
    lm = ait.Module(model, "lm", strategy=strategy)
    ait.tune(lambda ids: generate(lm, ids, **STATIC), [prompt(5), prompt(7)], ready_batches=True,
             ignore_failing_modules=False)
    ids = prompt(9)
    expected = generate(eager, ids, **STATIC)
    calls = lm.backend_calls
    assert torch.equal(generate(lm, ids, **STATIC), expected)
    # the 31 decode steps (this strategy's one candidate, CUDA graphs, is not offered to prefill: eager serves it)
    assert lm.backend_calls - calls == 31 and lm.stats["eager_fallbacks"] == {}
    assert torch.equal(generate(lm, ids, cache_implementation="static"), expected)
    assert torch.equal(generate(model, ids, **STATIC), expected)  # the model itself: eager


@pytest.fixture(scope="module")
def captured():
    """The decode graph served by aitune's own capture (NOTE [captured CUDA graphs] in
    aitune/torch/backend/decode_graphs.py); a strategy's backends are used as given (not expanded by their search
    space), so the variant is named; the prefill graph, which it does not serve, stays eager."""
    model = tiny_llama()
    eager = copy.deepcopy(model)
    captured = TorchInductorJitBackend(TorchInductorJitBackendConfig(capture_cuda_graphs=True, fullgraph=True))
    strategy = ait.MaxThroughputStrategy(backends=[captured], profiling_config=ProfilingConfig(time_budget_s=0.2))
    model.model = ait.Module(model.model, "decoder", strategy=strategy)
    ait.tune(lambda ids: generate(model, ids, **STATIC), [prompt(5), prompt(7)], ready_batches=True,
             ignore_failing_modules=False)
    return model, eager


def test_captured_decode_graphs_give_eagers_tokens_greedy_and_sampled(captured):
    model, eager = captured
    backend = model.model.backends["decode"]
    assert backend.config.capture_cuda_graphs
    stats = backend._graphs.stats
    replays = stats["replays"]
    for length, batch in ((9, 1), (12, 2)):  # prompt lengths never recorded; a second batch size
        ids = prompt(length, batch)
        expected = generate(eager, ids, **STATIC)
        for _ in range(2):  # transformers makes a new cache per generate: its first decode call captures, or
            # rebinds a graph captured at the same addresses (NOTE [a new cache at the same addresses]); then replays
            began = stats["captures"] + stats["rebinds"]
            assert torch.equal(generate(model, ids, **STATIC), expected)
            assert stats["captures"] + stats["rebinds"] == began + 1
    assert stats["replays"] - replays == 4 * 31
    assert stats["plain_calls"] == 0 and model.model.stats["eager_fallbacks"] == {}
    cache = transformers.StaticCache(config=model.config, max_cache_len=64)  # the caller's own cache, reused
    ids = prompt(9)
    expected = generate(eager, ids, **STATIC)
    for _ in range(2):
        captures = stats["captures"]
        cache.reset()
        assert torch.equal(generate(model, ids, past_key_values=cache, disable_compile=True), expected)
    assert stats["captures"] == captures  # the second generate replayed the first one's graph
    ids = prompt(10)
    sampled = []
    for chosen in (eager, model):
        torch.manual_seed(3)
        with torch.no_grad():
            sampled.append(chosen.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=True, top_k=20,
                                           **STATIC))
    assert torch.equal(*sampled)


def test_a_captured_decode_call_writes_eagers_cache_and_never_waits_for_the_device(captured):
    model, eager = captured
    ids = prompt(9)
    call = first_decode_call(eager, lambda: generate(eager, ids, 3, **STATIC))
    with torch.no_grad():
        mine, theirs = copy.deepcopy(call), copy.deepcopy(call)
        cache = next(value for value in mine.values() if isinstance(value, transformers.Cache))
        start = [layer.cumulative_length.clone() for layer in cache.layers]
        model.model(**mine)  # this cache's capture, which synchronises the device (or a rebind to a graph at its
        # addresses: NOTE [a new cache at the same addresses])
        for layer, count in zip(cache.layers, start):  # the same call again: it writes the same positions
            layer.cumulative_length.copy_(count)
        replays = model.model.backends["decode"]._graphs.stats["replays"]
        output = call_without_device_waits(model.model, mine)
        expected = eager.model(**theirs)
    assert model.model.backends["decode"]._graphs.stats["replays"] == replays + 1
    torch.testing.assert_close(output.last_hidden_state, expected.last_hidden_state)
    reference = next(value for value in theirs.values() if isinstance(value, transformers.Cache))
    for layer, eager_layer in zip(cache.layers, reference.layers):
        torch.testing.assert_close(layer.keys, eager_layer.keys)
        torch.testing.assert_close(layer.values, eager_layer.values)
        assert torch.equal(layer.cumulative_length, eager_layer.cumulative_length)


def test_a_new_cache_object_at_the_same_addresses_is_served_by_the_graph_captured_for_the_old_one(captured):
    """NOTE [a new cache at the same addresses], as ``generate`` meets it: the cache a graph was captured for is gone,
    and a new cache object's new tensors sit where its tensors were (here: built over the same storage). The new
    cache is served without a new capture, and the call writes eager's values into it."""
    model, eager = captured
    ids = prompt(11)
    call = first_decode_call(eager, lambda: generate(eager, ids, 3, **STATIC))
    graphs = model.model.backends["decode"]._graphs
    with torch.no_grad():
        mine, theirs = copy.deepcopy(call), copy.deepcopy(call)
        name = next(key for key, value in mine.items() if isinstance(value, transformers.Cache))
        cache = mine.pop(name)
        start = [layer.cumulative_length.clone() for layer in cache.layers]
        model.model(**mine, **{name: cache})  # captured for this cache (or rebound to it)
        other = copy.copy(cache)
        other.layers = [copy.copy(layer) for layer in cache.layers]
        for layer in other.layers:  # new tensor objects over the old storage
            for field in ("keys", "values", "cumulative_length"):
                old = getattr(layer, field)
                setattr(layer, field, torch.empty(0, dtype=old.dtype, device=old.device).set_(
                    old.untyped_storage(), old.storage_offset(), old.shape, old.stride()))
        for layer, count in zip(other.layers, start):
            layer.cumulative_length.copy_(count)
        gone = weakref.ref(cache)
        del cache
        gc.collect()
        assert gone() is None  # (nothing of aitune's keeps a caller's cache alive)
        captures, rebinds = graphs.stats["captures"], graphs.stats["rebinds"]
        output = call_without_device_waits(model.model, {**mine, name: other})  # (a rebind reads no device value)
        expected = eager.model(**theirs)
    assert (graphs.stats["captures"], graphs.stats["rebinds"]) == (captures, rebinds + 1)
    assert output.past_key_values is other
    torch.testing.assert_close(output.last_hidden_state, expected.last_hidden_state)
    reference = next(value for value in theirs.values() if isinstance(value, transformers.Cache))
    for layer, eager_layer in zip(other.layers, reference.layers):
        torch.testing.assert_close(layer.keys, eager_layer.keys)
        torch.testing.assert_close(layer.values, eager_layer.values)
        assert torch.equal(layer.cumulative_length, eager_layer.cumulative_length)


def test_a_weight_replaced_after_tuning_sends_captured_decode_calls_to_eager(captured):
    """The captured graphs read the weights where they were at capture: weights given new storage
    (``load_state_dict(assign=True)``) are noticed (the weight watch) and eager serves, with the new weights. Last
    in this file: it changes the model."""
    model, eager = captured
    torch.manual_seed(5)
    state = {name: torch.randn_like(tensor) for name, tensor in eager.model.state_dict().items()}
    for chosen in (eager.model, model.model.__wrapped__):
        chosen.load_state_dict({name: tensor.clone() for name, tensor in state.items()}, assign=True)
    ids = prompt(9)
    assert torch.equal(generate(model, ids, **STATIC), generate(eager, ids, **STATIC))
    assert "stale" in model.model.stats["eager_fallbacks"]

"""CPU-side logic of aitune's captured decode graphs (NOTE [captured CUDA graphs] in
aitune/torch/backend/decode_graphs.py): which caches are captured, the cache's fingerprint, how a call's output is
made from a captured graph's, and what is never captured. Capture and replay need a GPU:
tests/gpu/test_llm_generation_gpu.py."""

import copy

import pytest
import torch

from aitune.errors import ConfigError
from aitune.torch.backend import decode_graphs
from aitune.torch.backend.decode_graphs import (DecodeGraphs, _Captured, cache_facts, cache_fingerprint,
                                                captures_cache)

transformers = pytest.importorskip("transformers")

SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def filled(cache):
    for layer in cache.layers:  # (what the prefill does: the layers allocate on their first update)
        layer.lazy_initialization(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))
    return cache


def test_only_allocated_full_attention_static_caches_are_captured():
    static = transformers.StaticCache(config=transformers.LlamaConfig(**SIZES), max_cache_len=16)
    assert not captures_cache(static)  # (before the prefill: no tensors to capture)
    assert captures_cache(filled(static))
    sliding = transformers.StaticCache(config=transformers.MistralConfig(**SIZES, sliding_window=4), max_cache_len=16)
    assert not captures_cache(filled(sliding))  # its token count is an int a graph would freeze
    assert not captures_cache(transformers.DynamicCache()) and not captures_cache(None)
    offloaded = transformers.StaticCache(config=transformers.LlamaConfig(**SIZES), max_cache_len=16, offloading=True)
    assert not captures_cache(filled(offloaded))  # its layers' tensors move between devices between calls


def test_a_cache_fingerprint_changes_with_its_tensors_addresses_and_shapes():
    cache = filled(transformers.StaticCache(config=transformers.LlamaConfig(**SIZES), max_cache_len=16))
    before = cache_fingerprint(cache)
    cache.reset()  # zeroed in place: the same graph serves it
    assert cache_fingerprint(cache) == before
    cache.layers[1].values = cache.layers[1].values.clone()  # reallocated: another graph
    assert cache_fingerprint(cache) != before
    other = filled(transformers.StaticCache(config=transformers.LlamaConfig(**SIZES), max_cache_len=16))
    assert cache_fingerprint(other) != before


def test_a_new_cache_of_the_same_kind_has_the_same_facts_and_one_of_another_kind_does_not():
    """NOTE [a new cache at the same addresses]: a graph serves a new cache object at its addresses only when the
    cache's classes and plain attributes equal those it was captured with."""
    def cache(**kwargs):
        return filled(transformers.StaticCache(config=transformers.LlamaConfig(**SIZES), **{"max_cache_len": 16,
                                                                                          **kwargs}))
    first = cache()
    assert cache_facts(cache()) == cache_facts(first)
    assert cache_facts(cache(offloading=True)) != cache_facts(first)  # (its layers' tensors move between devices)
    assert cache_facts(cache(max_cache_len=32)) != cache_facts(first)
    halved = cache()
    halved.layers[1].values = halved.layers[1].values.half()  # another dtype (or strides) of a layer's tensors
    assert cache_facts(halved) != cache_facts(first)
    first.layers[0].max_batch_size = 2  # any plain attribute of a layer
    assert cache_facts(first) != cache_facts(cache())


def test_a_call_gets_its_own_output_tensors_and_its_own_cache():
    mine = filled(transformers.StaticCache(config=transformers.LlamaConfig(**SIZES), max_cache_len=16))
    theirs = filled(transformers.StaticCache(config=transformers.LlamaConfig(**SIZES), max_cache_len=16))
    static = transformers.modeling_outputs.BaseModelOutputWithPast(last_hidden_state=torch.randn(1, 1, 32),
                                                                   past_key_values=theirs)
    captured = _Captured(None, [], static, theirs, None)
    output = captured.output(mine, copy=True)
    assert type(output) is type(static) and output.past_key_values is mine
    assert torch.equal(output.last_hidden_state, static.last_hidden_state)
    assert output.last_hidden_state.data_ptr() != static.last_hidden_state.data_ptr()  # a copy: the next replay
    assert captured.output(mine, copy=False).last_hidden_state is static.last_hidden_state  # (copies off)
    nested = _Captured(None, [], (static.last_hidden_state, [theirs]), theirs, None)  # any other structure
    tensor, [cache] = nested.output(mine, copy=True)
    assert cache is mine and torch.equal(tensor, static.last_hidden_state)
    assert tensor.data_ptr() != static.last_hidden_state.data_ptr()


def test_calls_that_cannot_be_captured_run_the_compiled_call_as_they_are():
    calls = []

    def function(*args, **kwargs):
        calls.append((args, kwargs))
        return "ran"

    runner = DecodeGraphs(function, "cache")
    cache = filled(transformers.StaticCache(config=transformers.LlamaConfig(**SIZES), max_cache_len=16))
    ids = torch.ones(1, 1, dtype=torch.long)
    for kwargs in (dict(input_ids=ids, cache=cache),  # a CPU tensor: read once at capture, it would be frozen
                   dict(input_ids=ids),  # no cache
                   dict(input_ids=ids, cache=cache, extra=[ids])):  # a nested input
        assert runner((), kwargs) == "ran"
    assert runner.stats == {"captures": 0, "rebinds": 0, "replays": 0, "evictions": 0, "plain_calls": 3}
    assert len(calls) == 3
    with pytest.raises(ConfigError, match="max_graphs must be an int >= 1"):
        DecodeGraphs(function, "cache", max_graphs=0)


def test_a_graph_serves_a_new_cache_object_at_its_addresses_when_the_cache_facts_agree():
    """NOTE [a new cache at the same addresses], the lookup alone (capture and replay need a GPU: here a stand-in
    capture whose graph's replay does nothing; the call passes the cache alone, so its key is the real one): the
    same cache replays; a new cache object holding the same tensors is served by the same graph (``rebinds``); one
    whose facts differ is captured anew, and one holding a tensor the fingerprint does not cover never rebinds."""
    class StandInGraph:
        def replay(self):
            pass

    runner = DecodeGraphs(lambda *args, **kwargs: None, "cache")

    def capture(key, args, kwargs, cache):
        entry = _Captured(StandInGraph(), [], torch.zeros(2), cache, cache_facts(cache))
        runner._graphs[key] = entry
        runner.stats["captures"] += 1
        return entry

    runner._capture = capture
    first = filled(transformers.StaticCache(config=transformers.LlamaConfig(**SIZES), max_cache_len=16))

    def twin(cache):
        other = copy.copy(cache)
        other.layers = [copy.copy(layer) for layer in cache.layers]  # new objects, the same tensors
        return other

    counts = []
    for cache in (first, first, twin(first), first):
        runner((), {"cache": cache})
        counts.append((runner.stats["captures"], runner.stats["rebinds"], runner.stats["replays"]))
    assert counts == [(1, 0, 1), (1, 0, 2), (1, 1, 3), (1, 2, 4)]
    offloaded = twin(first)
    offloaded.offloading = True  # the same tensors, facts that differ: not served by that graph (the stand-in
    # captures anything; the real capture refuses an offloaded cache: test_only_allocated_full_attention...)
    runner((), {"cache": offloaded})
    assert (runner.stats["captures"], runner.stats["rebinds"]) == (2, 2)
    extra = twin(first)
    extra.layers[0].scale = torch.ones(1)  # a tensor of its own: what the graph would read of it is not keyed
    assert cache_facts(extra) is None
    runner((), {"cache": extra})
    assert (runner.stats["captures"], runner.stats["rebinds"]) == (3, 2)


def test_a_cache_that_cannot_be_captured_runs_plain_and_leaves_the_graph_at_its_addresses_to_its_cache(monkeypatch):
    """The real lookup and capture, up to the device (a stand-in graph entered for the first cache; the calls pass
    the cache alone, CPU tensors): a new cache object at those addresses whose facts differ (offloaded) is not
    served by that graph, its capture is refused (``captures_cache``) and the call runs the compiled call; the graph
    stays for its own cache, which replays. A CPU cache with no graph is never captured either. A refused cache's
    later calls skip the checks while it keeps its tensors."""
    class StandInGraph:
        def replay(self):
            pass

    calls = []
    runner = DecodeGraphs(lambda *args, **kwargs: calls.append(kwargs) or "plain", "cache")
    first = filled(transformers.StaticCache(config=transformers.LlamaConfig(**SIZES), max_cache_len=16))
    key, _ = runner._key((), {"cache": first}, first)
    runner._graphs[key] = _Captured(StandInGraph(), [], torch.zeros(2), first, cache_facts(first))
    offloaded = copy.copy(first)
    offloaded.offloading = True
    assert runner((), {"cache": offloaded}) == "plain" and calls == [{"cache": offloaded}]
    assert runner._graphs[key].cache() is first and runner.enabled
    assert torch.equal(runner((), {"cache": first}), torch.zeros(2))  # (the stand-in's output, copied)
    other = filled(transformers.StaticCache(config=transformers.LlamaConfig(**SIZES), max_cache_len=16))
    assert runner((), {"cache": other}) == "plain"  # another address, on the CPU: never captured
    assert runner.stats == {"captures": 0, "rebinds": 0, "replays": 1, "evictions": 0, "plain_calls": 2}
    # a refused cache's later calls, with the same tensors, are not checked again; new tensors in it are
    checked = []
    monkeypatch.setattr(decode_graphs, "captures_cache", lambda cache: checked.append(cache) or False)
    monkeypatch.setattr(decode_graphs, "cache_facts", lambda cache: checked.append(cache) or None)
    assert runner((), {"cache": other}) == "plain" and runner((), {"cache": offloaded}) == "plain"
    assert checked == [offloaded, offloaded]  # (other: the last refused, skipped; offloaded: facts, then refused)
    assert runner((), {"cache": offloaded}) == "plain" and len(checked) == 2
    offloaded.layers[0].keys = offloaded.layers[0].keys.clone()
    assert runner((), {"cache": offloaded}) == "plain" and checked[2:] == [offloaded]
    assert runner.stats["plain_calls"] == 6 and runner._graphs[key].cache() is first

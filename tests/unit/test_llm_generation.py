"""Text generation with a key/value cache: a decoder's prefill and decode phases as graphs
(``aitune/torch/record/llm.py``, NOTE [caches as inputs]).

A tiny Llama-architecture model built from a config (random weights, seeded; nothing downloaded) has its decoder
stack wrapped and tuned by running ``model.generate``; every test compares tokens, outputs or caches with eager
``generate`` on an untouched copy of the model.
"""

from __future__ import annotations

import copy

import pytest
import torch

import aitune.torch as ait
from aitune.torch.backend import TorchEagerBackend, TorchInductorJitBackend, TorchInductorJitBackendConfig
from aitune.torch.backend.compile_settings import resolved_dynamic
from aitune.torch.backend.inductor_jit import CPP_WRAPPER

from llm_calls import first_decode_call, raising_after_the_run

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 32
STATIC = dict(cache_implementation="static", disable_compile=True)


def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    return model


def prompt(length: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, 256, (batch, length), generator=torch.Generator().manual_seed(seed + length))


def generate(model, ids, new_tokens=NEW_TOKENS, **kwargs):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)


CPP = "TorchInductorJitBackend(options={'cpp_wrapper': True})"


def inductor_only():
    """Inductor JIT alone, always used when it passes its checks (tests check values, never speed), with the C++
    wrapper: the first variant a phase graph gets on CPU (NOTE [a C++ wrapper for phase graphs on CPU])."""
    backend = TorchInductorJitBackend(TorchInductorJitBackendConfig(options=dict(CPP_WRAPPER)))
    strategy = ait.OneBackendStrategy(backend,
                                      profiling_config=ait.ProfilingConfig(warmup_rounds=1, warmup_s=0.0, min_rounds=3,
                                                                           max_rounds=10, time_budget_s=0.2))
    return strategy.enable_performance_validation(False)


@pytest.fixture(scope="module")
def tuned():
    """(model with its decoder tuned on prompts of lengths 5 and 7, eager twin, report)."""
    model = tiny_llama()
    eager = copy.deepcopy(model)
    model.model = ait.Module(model.model, "decoder", strategy=inductor_only())
    report = ait.tune(lambda ids: generate(model, ids, **STATIC), [prompt(5), prompt(7)], ready_batches=True)
    return model, eager, report


def decode_call(model, ids):
    """The keyword arguments of the first decode call of an eager static-cache ``generate``, with a copy of the
    cache as it was before that call."""
    return first_decode_call(model, lambda: generate(model, ids, 3, **STATIC))


def cache_tensors(call) -> list[torch.Tensor]:
    cache = next(value for value in call.values() if isinstance(value, transformers.Cache))
    return [tensor for layer in cache.layers for tensor in (layer.keys, layer.values)]


def test_prefill_and_decode_are_graphs_named_by_their_phase(tuned):
    model, _, report = tuned
    wrapped = model.model
    assert [graph.name for graph in wrapped.graphs] == ["prefill", "decode"]
    assert [graph.phase for graph in wrapped.graphs] == ["prefill", "decode"]
    assert {entry.graph: entry.selected for entry in report.graphs} == {
        "prefill": CPP, "decode": CPP}
    # the recorded caches were 37 and 39 positions long: one decode graph with a dynamic cache axis
    decode = wrapped.graphs[1]
    assert decode.num_calls == 2 * (NEW_TOKENS - 1) and decode.is_dynamic
    # ... compiled once per cache length (NOTE [decode per cache length]); the prefill with a symbolic length
    backends = wrapped.backends
    assert backends["decode"].build_info["dynamic"] is False and backends["prefill"].build_info["dynamic"] is True


@pytest.mark.parametrize("length,batch", [(3, 1), (11, 1), (6, 2)])
def test_greedy_tokens_equal_eager_from_prompt_lengths_never_recorded(tuned, length, batch):
    model, eager, _ = tuned
    ids = prompt(length, batch)
    calls_before = model.model.stats["backend_calls"]
    expected = generate(eager, ids, **STATIC)
    assert torch.equal(generate(model, ids, **STATIC), expected)
    stats = model.model.stats
    assert stats["backend_calls"] - calls_before == NEW_TOKENS  # prefill + every decode step by the backend
    assert stats["eager_fallbacks"] == {}


def test_sampling_with_a_fixed_seed_equals_eager(tuned):
    model, eager, _ = tuned
    ids = prompt(9)
    torch.manual_seed(123)
    expected = generate(eager, ids, do_sample=True, top_k=20, temperature=0.9, **STATIC)
    torch.manual_seed(123)
    assert torch.equal(generate(model, ids, do_sample=True, top_k=20, temperature=0.9, **STATIC), expected)


def test_a_tuned_decode_call_writes_the_cache_as_eager_does(tuned):
    model, eager, _ = tuned
    call = decode_call(eager, prompt(8))
    mine, theirs = copy.deepcopy(call), copy.deepcopy(call)
    calls_before = model.model.stats["backend_calls"]
    with torch.no_grad():
        output = model.model(**mine)
        expected = eager.model(**theirs)
    assert model.model.stats["backend_calls"] == calls_before + 1
    torch.testing.assert_close(output.last_hidden_state, expected.last_hidden_state, rtol=1e-4, atol=1e-5)
    before = cache_tensors(call)
    for tensor, reference, old in zip(cache_tensors(mine), cache_tensors(theirs), before):
        torch.testing.assert_close(tensor, reference, rtol=1e-4, atol=1e-5)
        assert not torch.equal(tensor, old)  # the call did write its position


def test_a_call_past_the_caches_capacity_runs_eager_and_raises_eagers_error(tuned):
    """A decode call into a full cache is not given to the compiled graph (whose bounds check would abort the
    process on an out-of-range index): eager runs it and raises eager's error."""
    model, eager, _ = tuned
    call = decode_call(eager, prompt(8))
    cache = next(value for value in call.values() if isinstance(value, transformers.Cache))
    for layer in cache.layers:
        if hasattr(layer, "cumulative_length"):  # transformers >= 5.20: the cache counts its own tokens
            layer.cumulative_length.fill_(layer.max_cache_len)
    if "cache_position" in call:
        call["cache_position"] = torch.full_like(call["cache_position"], cache.layers[0].max_cache_len)
    with pytest.raises(IndexError), torch.no_grad():
        eager.model(**copy.deepcopy(call))
    fallbacks = model.model.stats["eager_fallbacks"].get("values", 0)
    with pytest.raises(IndexError), torch.no_grad():
        model.model(**call)
    assert model.model.stats["eager_fallbacks"]["values"] == fallbacks + 1


def test_tuning_changes_neither_the_users_cache_nor_the_model():
    """A recorded call runs eagerly on the user's own cache (as without aitune); tuning after it changes neither
    that cache nor the model: every candidate ran on its own copy of the state before the recorded call. A
    dataset item given to ``ait.tune`` is never touched at all."""
    model = tiny_llama()
    eager = copy.deepcopy(model)
    call = decode_call(eager, prompt(6))
    weights = {name: value.clone() for name, value in model.state_dict().items()}
    user_call, eager_call, item = copy.deepcopy(call), copy.deepcopy(call), copy.deepcopy(call)
    wrapped = ait.Module(model.model, "decoder", strategy=inductor_only())
    with torch.no_grad():
        wrapped(**user_call)
        eager.model(**eager_call)
    after_call = [tensor.clone() for tensor in cache_tensors(user_call)]
    wrapped.tune()
    for tensor, reference, kept in zip(cache_tensors(user_call), cache_tensors(eager_call), after_call):
        assert torch.equal(tensor, reference) and torch.equal(tensor, kept)
    assert all(torch.equal(weights[name], value) for name, value in model.state_dict().items())
    assert not model.training and wrapped.graphs[0].phase == "decode" and wrapped.stats["state"] == "tuned"

    fresh = ait.Module(tiny_llama().model, "decoder", strategy=inductor_only())
    ait.tune(fresh, [item], ready_batches=True)
    for tensor, original in zip(cache_tensors(item), cache_tensors(call)):
        assert torch.equal(tensor, original)


def test_a_dynamic_cache_runs_eager_and_the_report_says_how_to_switch():
    model = tiny_llama()
    eager = copy.deepcopy(model)
    model.model = ait.Module(model.model, "decoder")  # the default strategy: every candidate is asked
    report = ait.tune(lambda ids: generate(model, ids, 4), [prompt(5), prompt(7)], ready_batches=True)
    assert [entry.graph for entry in report.graphs] == ["prefill", "decode"]
    for entry in report.graphs:
        assert entry.selected == "TorchEagerBackend()"
        rows = [row for row in entry.candidates if row.backend != "eager"]
        assert rows and all(row.status in ("unsupported", "unavailable") for row in rows)
        jit_row = next(row for row in rows if row.backend == "inductor_jit")
        assert "DynamicCache" in jit_row.reason and 'cache_implementation="static"' in jit_row.reason
    ids = prompt(9)
    assert torch.equal(generate(model, ids, 8), generate(eager, ids, 8))


def test_a_checkpoint_keeps_both_phases(tuned, tmp_path):
    model, eager, _ = tuned
    ait.save(model.model, tmp_path / "decoder.ait")
    fresh = tiny_llama()
    fresh.model = ait.load(ait.Module(fresh.model, "decoder"), tmp_path / "decoder.ait")
    assert [graph.name for graph in fresh.model.graphs] == ["prefill", "decode"]
    ids = prompt(10)
    assert torch.equal(generate(fresh, ids, **STATIC), generate(eager, ids, **STATIC))
    assert fresh.model.stats["backend_calls"] == NEW_TOKENS and fresh.model.stats["eager_fallbacks"] == {}


def test_a_wrapped_decoder_inside_the_callers_torch_compile_is_traced_as_the_original(tuned):
    """transformers compiles the decode step itself (its auto-compile on CUDA, or a user's
    ``torch.compile(model.forward)``): the wrapper steps aside inside that trace and the caller's compiler takes the
    original decoder. ``fullgraph=True``: any of aitune's dispatch code in the trace would break the graph."""
    model, eager, _ = tuned
    call = decode_call(eager, prompt(8))
    mine, theirs = copy.deepcopy(call), copy.deepcopy(call)
    calls_before = model.model.stats["backend_calls"]
    compiled = torch.compile(lambda kwargs: model.model(**kwargs), fullgraph=True)
    with torch.no_grad():
        output = compiled(mine)
        expected = eager.model(**theirs)
    assert model.model.stats["backend_calls"] == calls_before  # nothing went through the tuned backends
    torch.testing.assert_close(output.last_hidden_state, expected.last_hidden_state, rtol=1e-4, atol=1e-5)
    for tensor, reference in zip(cache_tensors(mine), cache_tensors(theirs)):
        torch.testing.assert_close(tensor, reference, rtol=1e-4, atol=1e-5)


def test_a_decode_backend_that_raises_after_writing_the_cache_leaves_generation_right(tuned):
    """The backend advanced the cache and then raised: eager reruns the call from the cache's counters as they
    were before it, so the tokens stay eager's."""
    model, eager, _ = tuned
    decode = next(entry for entry in model.model._self_dispatch.graphs if entry.graph.phase == "decode")
    with raising_after_the_run(decode.backend, times=1) as failures:
        ids = prompt(9)
        assert torch.equal(generate(model, ids, **STATIC), generate(eager, ids, **STATIC))
    assert failures == [1]


def test_a_checkpoint_context_naming_a_class_outside_transformers_caches_is_refused():
    from aitune.errors import CheckpointError
    from aitune.torch.record.serialization import tree_spec_from_json

    hostile = {"kind": "kv_cache", "type": "transformers.cache_utils:StaticCache", "children": [],
               "context": {"_t": "obj", "p": "tempfile:_TemporaryFileCloser", "s": {"name": "/tmp/x", "delete": True}}}
    with pytest.raises(CheckpointError, match="outside transformers' caches"):
        tree_spec_from_json(hostile)


def test_measuring_restores_the_recorded_cache_in_place_before_every_call(tuned):
    """A measured decode call starts from the recorded state each time, in the same tensors (no new addresses)."""
    from aitune.torch.record.object_state import reset_state

    model, eager, _ = tuned
    call = decode_call(eager, prompt(8))
    working = copy.deepcopy(call)
    addresses = [tensor.data_ptr() for tensor in cache_tensors(working)]
    with torch.no_grad():
        first = eager.model(**working).last_hidden_state.clone()
        assert reset_state(working, call)
        second = eager.model(**working).last_hidden_state
    assert torch.equal(first, second)  # the same position written again, not the next one
    assert [tensor.data_ptr() for tensor in cache_tensors(working)] == addresses
    for tensor, reference in zip(cache_tensors(working), cache_tensors(call)):
        assert not torch.equal(tensor, reference)  # the call wrote its position after the reset


def test_a_sliding_window_layer_does_not_bound_the_positions_a_call_may_write():
    """Sliding-window layers keep only the window; the full layers bound the positions (a model mixing both, as
    Gemma-2 does); a cache of sliding layers only never fills."""
    from aitune.torch.record.llm import cache_capacity

    sizes = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, sliding_window=4)
    mixed = transformers.StaticCache(config=transformers.Gemma2Config(head_dim=16, **sizes), max_cache_len=16)
    assert [layer.max_cache_len for layer in mixed.layers] == [4, 16] and cache_capacity({"cache": mixed}) == 16
    rolling = transformers.StaticCache(config=transformers.MistralConfig(**sizes), max_cache_len=16)
    assert cache_capacity({"cache": rolling}) is None


class ServedEager(TorchEagerBackend):
    """Eager through a backend's own path (not a passthrough): the dispatch's checks apply to its calls as to a
    compiled artifact's, without a compile."""

    name = "test_served_eager"
    passthrough = False


def test_positions_of_a_cache_of_sliding_window_layers_only_are_not_held_to_the_recorded_range():
    # a rolling cache never fills (cache_capacity None): prompts and generations of lengths never recorded were
    # sent to eager by the value gate ("position_ids holds values in [3, 3], outside the accepted [5, 21]")
    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, sliding_window=4)
    model = transformers.MistralForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    eager = copy.deepcopy(model)
    strategy = ait.OneBackendStrategy(ServedEager(), profiling_config=ait.ProfilingConfig(
        warmup_rounds=1, warmup_s=0.0, min_rounds=3, max_rounds=10, time_budget_s=0.2))
    model.model = ait.Module(model.model, "decoder", strategy=strategy.enable_performance_validation(False))
    ait.tune(lambda ids: generate(model, ids, 8, **STATIC), [prompt(5), prompt(7)], ready_batches=True)
    assert {graph.name for graph in model.model.graphs} == {"prefill", "decode"}
    for length in (3, 12):
        served = model.model.stats["backend_calls"]
        assert torch.equal(generate(model, prompt(length), 8, **STATIC), generate(eager, prompt(length), 8, **STATIC))
        assert model.model.stats["backend_calls"] - served == 8, model.model.stats  # the prefill and 7 decode calls
    assert "values" not in model.model.stats["eager_fallbacks"]
    # its layers count tokens in a plain int: a decode graph compiled for one length would compile per position
    decode = next(graph for graph in model.model.graphs if graph.name == "decode")
    assert resolved_dynamic(None, decode) is None  # torch's automatic dynamic shapes


def test_a_decode_graph_of_full_attention_layers_compiles_for_one_cache_length(tuned):
    model, _, _ = tuned
    decode = next(graph for graph in model.model.graphs if graph.name == "decode")
    assert resolved_dynamic(None, decode) is False  # NOTE [decode per cache length]


def test_cache_graphs_are_offered_no_freezing_no_replayed_copies_and_on_cuda_no_cuda_graphs_for_prefill(tuned,
                                                                                                         monkeypatch):
    """Freezing would fold the cache's static-address tensors like weights; eager's CUDA-graph runner replays on
    copies of the inputs; a prefill may create the cache's tensors, which must not live in a CUDA graph's pool."""
    from aitune.torch.backend import TorchEagerBackend, TorchEagerBackendConfig
    from aitune.torch.backend import inductor_jit

    model, _, _ = tuned
    prefill, decode = model.model.graphs
    module = model.model.__wrapped__
    for graph in (prefill, decode):
        assert all(not variant.config.freezing
                   for variant in TorchInductorJitBackend().search_space(module, graph, torch.device("cpu")))
        frozen = TorchInductorJitBackend(TorchInductorJitBackendConfig(freezing=True))
        assert "freezing folds" in frozen.supports(module, graph, torch.device("cpu")).reason
        # NOTE [a C++ wrapper for phase graphs on CPU]: the C++ wrapper first, the plain compile as its fallback
        variants = TorchInductorJitBackend().search_space(module, graph, torch.device("cpu"))
        assert [(v.config.options, v.search_fallback, v.search_tier) for v in variants] == [
            ({"cpp_wrapper": True}, False, 0), (None, True, 1)]  # the plain compile: built only if needed
    replayed = TorchEagerBackend(TorchEagerBackendConfig(use_cuda_graphs=True))
    assert "replays on its own copies" in replayed.supports(module, decode, torch.device("cuda")).reason
    monkeypatch.setattr(inductor_jit, "native_bf16", lambda device: False)  # no CUDA device needed to list variants
    cuda = torch.device("cuda")
    assert [v.config.mode for v in TorchInductorJitBackend().search_space(module, prefill, cuda)] == [None]
    # NOTE [captured CUDA graphs]: a static cache of full-attention layers: aitune's own capture first, Inductor's
    # CUDA-graph trees (reduce-overhead) the fallback built only when it fails its build or checks
    variants = TorchInductorJitBackend().search_space(module, decode, cuda)
    assert [(v.config.capture_cuda_graphs, v.config.fullgraph, v.config.mode, v.search_tier, v.search_fallback)
            for v in variants[:2]] == [(True, True, None, 0, False), (False, False, "reduce-overhead", 1, True)]
    assert variants[0].bakes_weights  # the graphs read the weights where they were: watched (StateWatch)


def test_captured_decode_graphs_are_refused_where_they_cannot_apply(tuned):
    """capture_cuda_graphs needs CUDA, and of phase graphs a decode graph with a static cache of full-attention
    layers, and a compile without CUDA graphs of its own; what it refuses is named."""
    from aitune.errors import ConfigError

    model, _, _ = tuned
    prefill, decode = model.model.graphs
    module = model.model.__wrapped__
    captured = TorchInductorJitBackend(TorchInductorJitBackendConfig(capture_cuda_graphs=True))
    assert "needs a CUDA device" in captured.supports(module, decode, torch.device("cpu")).reason
    assert "not this phase" in captured.supports(module, prefill, torch.device("cuda")).reason
    assert captured.supports(module, decode, torch.device("cuda")).ok
    other = copy.copy(decode)  # a decode graph that also writes an input other than its cache: refused
    other.mutated_inputs = [*decode.mutated_inputs, "input_ids"]
    assert "other inputs in place" in captured.supports(module, other, torch.device("cuda")).reason
    for clash in (dict(mode="reduce-overhead"), dict(options={"triton.cudagraphs": True})):
        with pytest.raises(ConfigError, match="captures the compiled call into CUDA graphs itself"):
            TorchInductorJitBackendConfig(capture_cuda_graphs=True, **clash)
    stored = TorchInductorJitBackendConfig.from_dict(captured.config.to_dict())  # a checkpoint's config keeps it
    assert stored.capture_cuda_graphs is True


def test_a_cache_structure_loaded_on_another_device_names_that_device(tuned):
    """A checkpoint's samples are loaded where the module runs: a cache recorded elsewhere must index and allocate
    there too, so the devices its structure names are moved with its tensors."""
    from aitune.torch.record.pytree import tree_flatten, tree_unflatten
    from aitune.torch.record.serialization import moved_structure, tree_spec_from_json, tree_spec_to_json

    model, eager, _ = tuned
    call = decode_call(eager, prompt(8))
    leaves, spec = tree_flatten(call)
    loaded = tree_spec_from_json(tree_spec_to_json(spec))  # through the checkpoint's JSON form
    moved = tree_unflatten(moved_structure(loaded, "cpu", torch.device("meta")), [
        leaf.to("meta") if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves])
    cache = next(value for value in moved.values() if isinstance(value, transformers.Cache))
    assert {str(layer.device) for layer in cache.layers} == {"meta"}
    kept = tree_unflatten(loaded, leaves)
    assert {str(layer.device) for layer in next(v for v in kept.values() if isinstance(v, transformers.Cache)).layers} \
        == {"cpu"}


def test_positions_outside_the_calls_cache_run_eager(tuned):
    """``position_ids`` at or past the cache's capacity never reach the compiled graph (value gate): eager answers."""
    model, eager, _ = tuned
    call = decode_call(eager, prompt(8))
    cache = next(value for value in call.values() if isinstance(value, transformers.Cache))
    call["position_ids"] = torch.full_like(call["position_ids"], cache.layers[0].max_cache_len)
    mine, theirs = copy.deepcopy(call), copy.deepcopy(call)
    fallbacks = model.model.stats["eager_fallbacks"].get("values", 0)
    with torch.no_grad():
        output = model.model(**mine)
        expected = eager.model(**theirs)
    assert model.model.stats["eager_fallbacks"]["values"] == fallbacks + 1
    assert torch.equal(output.last_hidden_state, expected.last_hidden_state)


def test_the_decode_graph_compiles_per_cache_length_and_a_fixed_length_compiles_once():
    """NOTE [decode per cache length]: the decode graph is specialized to the cache's length; with
    ``max_cache_len`` fixed, generate calls of prompt lengths never recorded compile nothing new, and a call
    with a longer cache compiles for it and still gives eager's tokens."""
    from torch._dynamo.utils import counters

    model = tiny_llama()
    eager = copy.deepcopy(model)
    fixed = dict(STATIC, max_cache_len=64)
    model.model = ait.Module(model.model, "decoder", strategy=inductor_only())
    ait.tune(lambda ids: generate(model, ids, 8, **fixed), [prompt(5), prompt(7)], ready_batches=True)
    assert model.model.backends["decode"].build_info["dynamic"] is False
    compiled = counters["stats"]["unique_graphs"]
    for length in (9, 20, 3):
        assert torch.equal(generate(model, prompt(length), 8, **fixed), generate(eager, prompt(length), 8, **fixed))
    assert counters["stats"]["unique_graphs"] == compiled  # one cache length: nothing compiled after tuning
    longer = dict(STATIC, max_cache_len=80)
    assert torch.equal(generate(model, prompt(9), 8, **longer), generate(eager, prompt(9), 8, **longer))
    assert counters["stats"]["unique_graphs"] > compiled  # a new length: compiled on its first decode step
    assert model.model.stats["eager_fallbacks"] == {}


def test_just_in_time_tuning_of_a_generate_loop_gives_eagers_tokens():
    """``aitune.torch.jit`` with no code change: the model's forward is discovered, its prefill and decode calls
    recorded and tuned while ``generate`` runs; tokens stay eager's before, during and after."""
    import aitune.torch.jit as jit
    from jit_user_settings import cheap_strategy

    model = tiny_llama()
    lengths = (5, 7, 9, 6)
    expected = [generate(model, prompt(n), 8, **STATIC) for n in lengths]
    jit.reset()
    jit.enable(strategy=cheap_strategy(), min_samples=2)
    try:
        outputs = [generate(model, prompt(n), 8, **STATIC) for n in lengths]
        nodes = jit.patched_modules()
        assert [node.name for node in nodes] == ["LlamaForCausalLM"]
        assert nodes[0].backends == {"prefill": "TorchInductorJitBackend()", "decode": "TorchInductorJitBackend()"}
    finally:
        jit.disable()
        jit.reset()
    for output, reference in zip(outputs, expected):
        assert torch.equal(output, reference)


def test_a_candidate_that_does_not_write_the_cache_is_rejected(tuned, tmp_path):
    """Outputs alone are not enough: a candidate whose outputs equal eager's but whose cache stays as it was (it
    ran on a copy) fails the check of what the call writes into its inputs."""
    from aitune.errors import CorrectnessError
    from aitune.torch.backend import TorchEagerBackend
    from aitune.torch.check.checks import check_against_eager
    from aitune.torch.check.context import GraphContext
    from aitune.torch.check.tolerance import Tolerance

    model, _, _ = tuned
    module, decode = model.model.__wrapped__, model.model.graphs[1]
    context = GraphContext.from_eager(module, "decoder", decode, torch.device("cpu"), tmp_path)
    try:
        honest = TorchEagerBackend().build(module, decode, "cpu", tmp_path / "honest")
        check_against_eager(honest, context, Tolerance())  # eager itself passes

        class OnACopy(TorchEagerBackend):
            def _infer(self, args, kwargs):
                return super()._infer(*copy.deepcopy((args, kwargs)))

        lazy = OnACopy().build(module, decode, "cpu", tmp_path / "lazy")
        with pytest.raises(CorrectnessError, match="input mutation not preserved"):
            check_against_eager(lazy, context, Tolerance())
    finally:
        context.release()


def test_a_candidate_that_keeps_serving_the_cache_its_warm_up_saw_is_rejected(tuned, tmp_path):
    """A CUDA graph replays on the tensors it recorded: a decode backend that keeps serving the cache object of its
    first call (its build's warm-up) must fail its checks. So each check runs on a fresh clone of the sample, never
    on tensors a warm-up already handed to the candidate (a change that shared one working copy of the cache between
    warm-up and checks let such a backend pass, and generate then failed)."""
    from aitune.errors import CorrectnessError
    from aitune.torch.check.checks import check_against_eager
    from aitune.torch.check.context import GraphContext
    from aitune.torch.check.tolerance import Tolerance

    class Pinned(TorchInductorJitBackend):
        def _run(self, args, kwargs, copy=True):
            name = next(key for key, value in kwargs.items() if isinstance(value, transformers.Cache))
            length = kwargs[name].layers[0].keys.shape  # one pinned cache per length, as one graph per shape
            pinned = self.__dict__.setdefault("pinned_caches", {}).setdefault(length, kwargs[name])
            return super()._run(args, {**kwargs, name: pinned}, copy)

    model, _, _ = tuned
    module, decode = model.model.__wrapped__, model.model.graphs[1]
    context = GraphContext.from_eager(module, "decoder", decode, torch.device("cpu"), tmp_path)
    try:
        config = TorchInductorJitBackendConfig(options=dict(CPP_WRAPPER))
        honest = TorchInductorJitBackend(config).build(module, decode, "cpu", tmp_path / "honest")
        check_against_eager(honest, context, Tolerance())  # the same build, serving the caller's cache, passes
        pinned = Pinned(config).build(module, decode, "cpu", tmp_path / "pinned")
        assert len(pinned.pinned_caches) == 2  # its warm-up ran, on both cache lengths
        with pytest.raises(CorrectnessError, match="output cache|input mutation not preserved"):
            check_against_eager(pinned, context, Tolerance())
    finally:
        context.release()


def test_each_cache_object_is_checked_against_its_own_capacity(tuned):
    """The description of a cache's layers is kept for the last cache seen (NOTE [cache facts memo] in
    aitune/torch/record/llm.py): a call that brings another, smaller cache is checked against that cache's
    capacity, and the first cache is served again afterwards."""
    model, eager, _ = tuned
    call = decode_call(eager, prompt(8))
    name = next(key for key, value in call.items() if isinstance(value, transformers.Cache))
    with torch.no_grad():
        model.model(**copy.deepcopy(call))  # the memo now holds this call's cache
        small = transformers.StaticCache(config=eager.config, max_cache_len=9)
        eager.model(input_ids=prompt(9), **{name: small}, use_cache=True)  # a prefill fills all 9 positions
    assert small.get_seq_length() == 9
    overflowing = dict(call, **{name: small})
    if "cache_position" in overflowing:
        overflowing["cache_position"] = torch.full_like(call["cache_position"], 9)
    fallbacks = model.model.stats["eager_fallbacks"].get("values", 0)
    with pytest.raises(IndexError), torch.no_grad():
        model.model(**overflowing)
    assert model.model.stats["eager_fallbacks"]["values"] == fallbacks + 1
    served = model.model.stats["backend_calls"]
    mine, theirs = copy.deepcopy(call), copy.deepcopy(call)
    with torch.no_grad():
        output, expected = model.model(**mine), eager.model(**theirs)
    assert model.model.stats["backend_calls"] == served + 1
    torch.testing.assert_close(output.last_hidden_state, expected.last_hidden_state, rtol=1e-4, atol=1e-5)


def test_a_call_with_a_decode_calls_keywords_but_no_cache_runs_eager(tuned):
    """A decode call's keyword names lead to its normalising plan (NOTE [phase fast path] in aitune/torch/dispatch.py);
    a call with the same names but no cache is not a phase call and takes the general route: never recorded, so
    eager answers, with eager's output."""
    model, eager, _ = tuned
    call = decode_call(eager, prompt(8))
    with torch.no_grad():
        model.model(**copy.deepcopy(call))  # the plan for these keyword names exists now
    name = next(key for key, value in call.items() if isinstance(value, transformers.Cache))
    uncached = dict(call, **{name: None}, use_cache=False, attention_mask=None)
    uncached.pop("cache_position", None)
    fallbacks = model.model.stats["eager_fallbacks"].get("graph", 0)
    with torch.no_grad():
        output, expected = model.model(**uncached), eager.model(**uncached)
    assert model.model.stats["eager_fallbacks"]["graph"] == fallbacks + 1
    assert torch.equal(output.last_hidden_state, expected.last_hidden_state)


def test_a_served_call_keeps_no_reference_to_its_cache(tuned):
    """Once the caller drops a cache, nothing of aitune's keeps it (or its tensors) alive."""
    import gc
    import weakref

    model, eager, _ = tuned
    call = decode_call(eager, prompt(8))
    cache = next(value for value in call.values() if isinstance(value, transformers.Cache))
    served = model.model.stats["backend_calls"]
    with torch.no_grad():
        model.model(**call)
    assert model.model.stats["backend_calls"] == served + 1
    references = [weakref.ref(cache)] + [weakref.ref(layer.keys) for layer in cache.layers]
    del call, cache
    gc.collect()
    assert all(reference() is None for reference in references)


def test_cuda_graph_output_copies_clone_a_model_outputs_tensors_and_keep_its_cache():
    """What a CUDA-graph backend returns (``clone_output``): every tensor a copy (the next replay overwrites its
    buffers), the key/value cache the caller's own object; a transformers output's tensors are replaced in place
    (NOTE [fresh model outputs]), other structures are rebuilt and left as they were."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    from aitune.torch.backend.inductor_jit import clone_output

    cache = transformers.StaticCache(config=tiny_llama().config, max_cache_len=8)
    hidden = torch.randn(1, 1, 64)
    output = BaseModelOutputWithPast(last_hidden_state=hidden, past_key_values=cache)
    copied = clone_output(output)
    for value in (copied.last_hidden_state, copied["last_hidden_state"], copied.to_tuple()[0]):
        assert torch.equal(value, hidden) and value.data_ptr() != hidden.data_ptr()
    assert copied.past_key_values is cache
    plain = {"hidden": hidden, "cache": cache}
    rebuilt = clone_output(plain)
    assert rebuilt is not plain and plain["hidden"] is hidden and rebuilt["cache"] is cache
    assert torch.equal(rebuilt["hidden"], hidden) and rebuilt["hidden"].data_ptr() != hidden.data_ptr()


def test_cache_position_decides_the_phase_as_in_the_reference():
    """An input named ``cache_position`` decides the phase: prefill when its first position is 0, else decode
    (1-D, as transformers passes it, or any other shape); a floating one is no position."""
    from aitune.torch.record.llm import llm_phase

    assert llm_phase((), {"cache_position": torch.arange(5)}) == "prefill"
    assert llm_phase((), {"cache_position": torch.tensor([7])}) == "decode"
    assert llm_phase((), {"cache_position": torch.tensor([[0, 1]])}) == "prefill"
    assert llm_phase((), {"cache_position": torch.tensor([[3]])}) == "decode"
    assert llm_phase((), {"cache_position": torch.tensor([0.0])}) is None


def test_the_dispatch_takes_a_one_position_device_cache_position_for_decode_without_reading_it():
    """NOTE [decode without a device read]: off the CPU, one position means decode for the dispatch, unread (a
    'meta' tensor has no values: reading one raises); recording reads it; on the CPU it is read; several
    positions are read."""
    from aitune.torch.record.llm import llm_phase, phase_call

    unreadable = torch.zeros(1, dtype=torch.long, device="meta")
    call = phase_call((), {"input_ids": torch.zeros(1, 1, dtype=torch.long), "cache_position": unreadable},
                      read_device=False)
    assert call.phase == "decode" and call.assumed and call.cached is None
    with pytest.raises(Exception):
        llm_phase((), {"cache_position": unreadable})  # the recorder's rule reads the value
    assert phase_call((), {"cache_position": torch.tensor([0])}, read_device=False).phase == "prefill"
    assert not phase_call((), {"cache_position": torch.tensor([4])}, read_device=False).assumed
    with pytest.raises(Exception):
        phase_call((), {"cache_position": torch.zeros(3, dtype=torch.long, device="meta")}, read_device=False)


def test_the_dispatch_takes_a_one_token_call_on_a_device_cache_counter_for_decode_without_reading_it():
    """NOTE [decode without a device read], transformers 5.x's form (no ``cache_position``; the cache's static
    layers count their tokens in a 0-dim tensor): a one-token call whose counter is off the CPU is decode for the
    dispatch, unread (a 'meta' counter has no value: reading it fails, and the call is then no phase call);
    recording reads it; a call of several tokens is read."""
    from aitune.torch.record.llm import phase_call

    model = tiny_llama()
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model.model(input_ids=prompt(4), past_key_values=cache, use_cache=True)
    read = phase_call((), {"input_ids": prompt(1), "past_key_values": cache}, read_device=False)
    assert read.phase == "decode" and read.cached == 4 and not read.assumed  # a CPU counter is read
    for layer in cache.layers:
        layer.cumulative_length = torch.zeros((), dtype=torch.long, device="meta")
    call = phase_call((), {"input_ids": prompt(1), "past_key_values": cache}, read_device=False)
    assert call.phase == "decode" and call.assumed and call.cached is None
    assert phase_call((), {"input_ids": prompt(1), "past_key_values": cache}) is None  # recording reads
    assert phase_call((), {"input_ids": prompt(2), "past_key_values": cache}, read_device=False) is None


def test_a_backend_that_raises_after_writing_an_unread_cache_rewinds_it_to_a_device_copy(tuned, monkeypatch):
    """NOTE [decode without a device read]: where the dispatch did not read the cache's fill, a backend that
    advanced the cache and then raised is undone from a copy of the counter taken before the call
    (``counter_snapshot``), so eager's rerun writes where the call started and the tokens stay eager's."""
    import aitune.torch.dispatch as dispatch
    from aitune.torch.record import llm

    model, eager, _ = tuned
    real = llm.phase_call

    def unread(args, kwargs, read_device=True):  # as on a GPU: decode assumed, fill unknown
        call = real(args, kwargs, read_device)
        if call is not None and not read_device and call.phase == llm.DECODE:
            return call._replace(cached=None, assumed=True)
        return call

    monkeypatch.setattr(dispatch, "phase_call", unread)
    with raising_after_the_run(model.model.backends["decode"], times=3) as failures:
        ids = prompt(9)
        assert torch.equal(generate(model, ids, **STATIC), generate(eager, ids, **STATIC))
    assert failures == [1, 1, 1]


def test_a_failed_backend_on_a_cache_whose_state_cannot_be_put_back_raises_instead_of_a_double_step(tuned,
                                                                                                   monkeypatch):
    """A backend that advanced a cache holding state ``rewind_cache`` cannot restore (here: every cache taken for
    such, through ``rewindable``) is not rerun eagerly, which would apply the step twice: the call raises a clear
    error naming the layers and the way out. One that failed before the step reached the cache is rerun eagerly,
    as any failed call."""
    import aitune.torch.dispatch as dispatch
    from aitune.errors import BackendRuntimeError

    model, eager, _ = tuned
    monkeypatch.setattr(dispatch, "rewindable", lambda cache: False)
    with raising_after_the_run(model.model.backends["decode"], times=1) as failures:
        with pytest.raises(BackendRuntimeError, match="StaticLayer.*apply this step twice.*OneBackendStrategy"):
            generate(model, prompt(9), **STATIC)
    assert failures == [1]
    # a backend that fails before the step reaches the cache (its first layer's count unmoved): eager reruns it
    backend, refusals = model.model.backends["decode"], []

    def refuse(args, kwargs, **options):
        refusals.append(1)
        raise RuntimeError("simulated failure before the cache was written")

    monkeypatch.setattr(backend, "run", refuse)
    ids = prompt(9)
    assert torch.equal(generate(model, ids, **STATIC), generate(eager, ids, **STATIC))
    assert len(refusals) == NEW_TOKENS - 1


def test_only_static_full_attention_and_unrolled_sliding_window_caches_are_rewindable_and_their_counter_is_kept():
    """``rewindable``: a StaticCache's layers (positions and counters only) can be put back, and a sliding window
    until it rolls; a layer with its own indexer counter, or a cache without layers (an encoder-decoder pair),
    cannot. ``cache_advanced`` tells a count that moved from one that did not. ``counter_snapshot`` copies a
    tensor counter into one kept tensor (the same one call after call, following the counter's value) and returns
    an int counter as it is."""
    from transformers.cache_utils import EncoderDecoderCache, StaticIndexedLayer, StaticSlidingWindowLayer

    from aitune.torch.record.llm import cache_advanced, counter_snapshot, rewindable

    model = tiny_llama()
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model.model(input_ids=prompt(4), past_key_values=cache, use_cache=True)
    assert rewindable(cache)
    first = counter_snapshot(cache)
    assert int(first) == 4
    assert cache_advanced(cache, first) is False and cache_advanced(cache, 4) is False
    assert cache_advanced(cache, torch.tensor(3)) is True and cache_advanced(cache, 3) is True
    assert cache_advanced(cache, None) is None
    for layer in cache.layers:
        layer.cumulative_length.fill_(6)
    second = counter_snapshot(cache)
    assert second is first and int(second) == 6
    cache.layers[0].cumulative_length = 3
    assert counter_snapshot(cache) == 3
    window = StaticSlidingWindowLayer(max_cache_len=16, sliding_window=4)
    cache.layers[1] = window
    window.cumulative_length_int = 4  # the window just filled, nothing rolled yet
    assert rewindable(cache)
    window.cumulative_length_int = 5  # rolled: no counter undoes that
    assert not rewindable(cache)
    cache.layers[1] = StaticIndexedLayer(max_cache_len=16)
    assert not rewindable(cache)
    assert not rewindable(EncoderDecoderCache(transformers.DynamicCache(), transformers.DynamicCache()))


def test_the_cache_facts_memo_follows_the_cache_object_and_its_layers():
    """The layer facts kept for the last cache (NOTE [cache facts memo]) apply only to that same object (a new
    cache at a dead one's ids is described anew) holding the same layers (a layer swapped in counts)."""
    import weakref

    from aitune.torch.record import llm

    model = tiny_llama()

    def filled(capacity):
        cache = transformers.StaticCache(config=model.config, max_cache_len=capacity)
        with torch.no_grad():
            model.model(input_ids=prompt(4), past_key_values=cache, use_cache=True)
        return cache

    big, small = filled(32), filled(8)
    assert llm._layer_facts(big)[1] == 32 and llm._layer_facts(small)[1] == 8
    layers_key, _ = llm._layer_facts(small)
    # a memo left by another cache object that happened to hold layers at small's ids: not small's
    llm._FACTS_MEMO[0] = (weakref.ref(big), tuple(map(id, small.layers)), torch.float32, layers_key, 32)
    assert llm._layer_facts(small)[1] == 8
    # the memo now holds big; a layer of small swapped into big bounds big's capacity
    assert llm._layer_facts(big)[1] == 32
    big.layers[0] = small.layers[0]
    assert llm._layer_facts(big)[1] == 8


def test_decode_calls_after_the_first_skip_binding_their_arguments(tuned, monkeypatch):
    """NOTE [phase fast path]: once a decode call's keyword names are known, later calls with them are normalised
    by the plan made from the first (no signature binding) and still served by the decode graph's backend."""
    model, eager, _ = tuned
    call = decode_call(eager, prompt(8))
    with torch.no_grad():
        model.model(**copy.deepcopy(call))
    signature = model.model._self_dispatch.signature
    bound = []
    original = signature.normalize
    monkeypatch.setattr(signature, "normalize", lambda *args: bound.append(1) or original(*args))
    served = model.model.stats["backend_calls"]
    mine, theirs = copy.deepcopy(call), copy.deepcopy(call)
    with torch.no_grad():
        output, expected = model.model(**mine), eager.model(**theirs)
    assert bound == [] and model.model.stats["backend_calls"] == served + 1
    torch.testing.assert_close(output.last_hidden_state, expected.last_hidden_state, rtol=1e-4, atol=1e-5)


def test_an_assumed_decode_phase_is_read_where_no_graph_takes_it_and_served_where_one_does(tuned, monkeypatch):
    """NOTE [decode without a device read], the dispatch's half, on the CPU (where every position can be read): a
    stand-in for phase_call assumes decode for every one-token call, as the dispatch does for a one-position
    ``cache_position`` on a GPU (phase decode, fill unknown, ``assumed``). A one-token prompt into a new, lazily
    initialised cache finds no decode graph under that assumption and its phase is read again; into an
    initialised cache (reset, as ``generate`` reuses one) the decode graph serves it. Tokens equal eager's both ways."""
    import aitune.torch.dispatch as dispatch
    from aitune.torch.record import llm

    model, eager, _ = tuned
    real = llm.phase_call
    assumed = []

    reads = []

    def stand_in(args, kwargs, read_device=True):
        call = real(args, kwargs, read_device)
        if read_device:
            reads.append(call.phase)  # the dispatch reading an assumed phase again
        if call is not None and not read_device and call.query == 1:
            assumed.append(call.phase)
            return call._replace(route=(call.route[0], llm.DECODE), phase=llm.DECODE, cached=None, assumed=True)
        return call

    monkeypatch.setattr(dispatch, "phase_call", stand_in)
    decode = model.model.backends["decode"]
    served = []
    real_run = decode.run
    monkeypatch.setattr(decode, "run", lambda *args, **kwargs: served.append(1) or real_run(*args, **kwargs))
    ids = prompt(1)
    expected = generate(eager, ids, **STATIC)
    assert torch.equal(generate(model, ids, **STATIC), expected)  # a new cache: the prefill's phase read again
    assert assumed.count(llm.PREFILL) == 1 and reads == [llm.PREFILL]
    assert len(served) == NEW_TOKENS - 1  # the prefill not by the decode graph (a one-token prompt was never
    # recorded: eager serves it, as before this rule)
    cache = transformers.StaticCache(config=model.config, max_cache_len=48)
    generate(model, prompt(3), 4, past_key_values=cache, disable_compile=True)  # initialises its layers
    cache.reset()
    served.clear()
    fallbacks = dict(model.model.stats["eager_fallbacks"])
    fresh = transformers.StaticCache(config=eager.config, max_cache_len=48)
    expected = generate(eager, ids, past_key_values=fresh, disable_compile=True)
    assert torch.equal(generate(model, ids, past_key_values=cache, disable_compile=True), expected)
    assert len(served) == NEW_TOKENS  # the one-token prefill too, by the decode graph
    assert model.model.stats["eager_fallbacks"] == fallbacks


def test_the_recorder_neither_compares_nor_reads_the_cache_tensors_one_by_one(tuned):
    """A decode call carries every layer's key and value tensors. Off the CPU each comparison or value read waits for
    the device, and a generate loop records hundreds of calls (``benchmarks/recording_cost.py``), so the recorder
    takes the cache as a whole for the input the call changes and records no value range for its tensors (the value
    gate never reads them: aitune/torch/backend/accepted.py); the other inputs are recorded as before."""
    from aitune.torch.record.llm import in_cache

    model, _, _ = tuned
    for graph in model.model.graphs:
        assert graph.mutated_inputs == [graph.cache_input]
        specs = {spec.path: spec for spec in graph.tensor_specs}
        cached = [spec for path, spec in specs.items() if in_cache(path, graph.cache_input)]
        assert cached and all(spec.value_range is None for spec in cached)
        low, high = specs["input_ids"].value_range
        assert 1 <= low <= high < 256  # the recorded token ids


def test_the_readme_example_runs_as_written_and_gives_eagers_tokens(tmp_path, monkeypatch):
    """The code block of README.md's "Text generation (LLMs)", run as written (a new user found the earlier one
    needed a model, a tokenizer and texts it never defined)."""
    from readme_blocks import run_readme_block

    scope = run_readme_block("## Text generation (LLMs)", tmp_path, monkeypatch)
    with torch.no_grad():
        assert torch.equal(scope["out"], scope["eager"].generate(scope["ids"], **scope["options"]))
    assert {graph.name for graph in scope["lm"].graphs} == {"prefill", "decode"}
    assert scope["out"].shape[1] == scope["ids"].shape[1] + 32  # every new token generated: no early stop
    served = scope["lm"].stats["backend_calls"]
    chosen = {graph.graph: graph.selected for graph in scope["report"].graphs}
    assert served == ("eager" not in chosen["prefill"].lower()) + 31 * ("eager" not in chosen["decode"].lower())


def test_a_whole_causal_lm_wrapped_and_driven_by_its_own_generate_is_tuned_saved_and_loaded(tmp_path):
    """The whole model wrapped (head included) and ``generate`` called through the wrapper (NOTE [own calls]):
    both phases are recorded and served, tokens equal eager's (greedy and sampling), the model itself still runs
    eagerly, and a checkpoint loads into a fresh wrapper."""
    model = tiny_llama()
    eager = copy.deepcopy(model)
    wrapped = ait.Module(model, "lm", strategy=inductor_only())
    report = ait.tune(lambda ids: generate(wrapped, ids, **STATIC), [prompt(5), prompt(7)], ready_batches=True)
    assert {entry.graph: entry.selected for entry in report.graphs} == {"prefill": CPP, "decode": CPP}
    ids = prompt(9)
    calls = wrapped.backend_calls
    assert torch.equal(generate(wrapped, ids, **STATIC), generate(eager, ids, **STATIC))
    assert wrapped.backend_calls - calls == NEW_TOKENS and wrapped.stats["eager_fallbacks"] == {}
    torch.manual_seed(7)
    expected = generate(eager, ids, do_sample=True, top_k=20, **STATIC)
    torch.manual_seed(7)
    assert torch.equal(generate(wrapped, ids, do_sample=True, top_k=20, **STATIC), expected)
    calls = wrapped.backend_calls
    generate(model, ids, 4, **STATIC)  # the model itself: eager, as before it was wrapped
    assert wrapped.backend_calls == calls

    ait.save(wrapped, tmp_path / "lm.ait")
    fresh = ait.load(ait.Module(tiny_llama(), "lm"), tmp_path / "lm.ait")
    assert [graph.name for graph in fresh.graphs] == ["prefill", "decode"]
    assert torch.equal(generate(fresh, prompt(10), **STATIC), generate(eager, prompt(10), **STATIC))
    assert fresh.backend_calls == NEW_TOKENS

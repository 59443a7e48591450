"""A tuned backend serves a call only while what it baked in still holds (aitune/torch/check/baked_state.py).

Each backend that runs here is tuned once (module-scoped) on a small net whose forward reads a submodule's
training flag (dropout), a float attribute and a plain tensor attribute. Every test changes one kind of state,
compares the tuned module with eager under the same state, and puts the state back.
"""

import threading

import pytest
import torch
import torch.nn as nn

import aitune.torch as ait
from aitune.errors import BackendRuntimeError
from aitune.torch.backend import (TorchAOBackend, TorchEagerBackend, TorchInductorAotBackend, TorchInductorJitBackend,
                                  TorchInductorJitBackendConfig)
from aitune.torch.check import native_watch
from aitune.torch.check.baked_state import VALUES_CHECK_EVERY
from aitune.torch.measure.profiling import ProfilingConfig

PROFILING = ProfilingConfig(warmup_rounds=1, warmup_s=0.0, min_rounds=3, max_rounds=20, time_budget_s=0.2)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.drop, self.fc2 = nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 4)
        self.scale = 1.0
        self.offset = torch.zeros(16)

    def forward(self, x):
        return self.fc2(self.drop(self.act(self.fc1(x * self.scale + self.offset))))


def _backends():
    backends = {"eager": TorchEagerBackend, "inductor_jit": TorchInductorJitBackend,
                "inductor_jit_frozen": lambda: TorchInductorJitBackend(TorchInductorJitBackendConfig(freezing=True)),
                "inductor_aot": TorchInductorAotBackend, "torchao": TorchAOBackend}
    try:
        import onnxruntime  # noqa: F401
        from aitune.torch.backend import ONNXRuntimeBackend

        backends["onnxruntime"] = ONNXRuntimeBackend
    except ImportError:
        pass
    return backends


BACKENDS = _backends()
BAKED = {"inductor_jit_frozen", "inductor_aot", "torchao", "onnxruntime"}  # artifacts that copy the module


def tune(model, name, backend, guard=ait.GuardConfig(enabled=False)):
    """``model`` tuned with ``backend`` alone; by default without the guard (the watch alone: no eager re-runs to
    hide behind)."""
    strategy = ait.OneBackendStrategy(backend, profiling_config=PROFILING,
                                      probe_config=ait.ProbeConfig(enabled=False))
    tuned = ait.Module(model, name, strategy=strategy.enable_performance_validation(False), guard=guard)
    report = ait.tune(tuned, [torch.randn(b, 16) for b in (2, 4)], ready_batches=True)
    assert not report.module_errors and tuned.backends["graph0"].name == backend.name
    return tuned


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def net(request):
    torch.manual_seed(0)
    model = Net().eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)  # a frozen encoder
    return request.param, model, tune(model, request.param, BACKENDS[request.param]())


def fallbacks(tuned, kind):
    return tuned.stats["eager_fallbacks"].get(kind, 0)


def test_calls_without_autograd_or_changes_use_the_backend(net):
    name, model, tuned = net
    before = tuned.backend_calls
    x = torch.randn(4, 16)
    tuned(x)  # grad mode on, nothing requires grad: no autograd graph either way
    with torch.no_grad():
        tuned(x)
    assert tuned.backend_calls == before + (0 if name == "eager" else 2)  # plain eager counts no backend call


def test_the_backend_itself_answers_without_autograd_in_either_grad_mode(net):
    """A backend's ``run`` enters ``no_grad`` only when the caller has grad mode on (the wrapper's calls mostly
    come under ``no_grad`` already): either way its output carries no autograd graph and the same values."""
    name, model, tuned = net
    backend = tuned.backends["graph0"]
    x = torch.randn(4, 16, requires_grad=True)
    with torch.no_grad():
        expected = model(x)
        quiet = backend.run((), {"x": x})
    loud = backend.run((), {"x": x})  # grad mode on, an input that requires grad
    assert torch.is_grad_enabled()
    for output in (quiet, loud):
        assert output.grad_fn is None and not output.requires_grad
    torch.testing.assert_close(loud, quiet, rtol=0, atol=0)
    if name != "torchao":  # (a quantized copy differs from eager by design)
        torch.testing.assert_close(quiet, expected, rtol=1e-4, atol=1e-5)


def test_an_input_that_requires_grad_gets_eagers_gradients(net):
    name, model, tuned = net
    x = torch.randn(4, 16)
    prompt = torch.zeros(4, 16, requires_grad=True)
    output = tuned(prompt + x)
    assert output.grad_fn is not None
    (output.pow(2).sum() + 1e-3 * prompt.pow(2).sum()).backward()
    expected_prompt = torch.zeros(4, 16, requires_grad=True)
    (model(expected_prompt + x).pow(2).sum() + 1e-3 * expected_prompt.pow(2).sum()).backward()
    torch.testing.assert_close(prompt.grad, expected_prompt.grad, rtol=0, atol=0)
    assert fallbacks(tuned, "grad") >= 1


def test_parameters_that_require_grad_get_their_gradients(net):
    name, model, tuned = net
    x = torch.randn(4, 16)
    model.fc2.weight.requires_grad_(True)
    try:
        tuned(x).sum().backward()
        expected = model.fc2.weight.grad.clone()
        model.fc2.weight.grad = None
        model(x).sum().backward()
        torch.testing.assert_close(expected, model.fc2.weight.grad, rtol=0, atol=0)
    finally:
        model.fc2.weight.grad = None
        model.fc2.weight.requires_grad_(False)


def test_the_callers_autocast_gives_eagers_dtype(net):
    name, model, tuned = net
    x = torch.randn(4, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        output, expected = tuned(x), model(x)
    assert output.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(output, expected, rtol=2e-2, atol=2e-2)
    if name in BAKED:
        assert fallbacks(tuned, "autocast") >= 1


def test_hooks_added_after_tuning_run_and_shape_the_output(net):
    name, model, tuned = net
    x = torch.randn(4, 16)
    features = []
    handles = [model.act.register_forward_hook(lambda module, args, output: features.append(output)),
               model.fc1.register_forward_hook(lambda module, args, output: output * (output.abs() > 0.1))]
    try:
        with torch.no_grad():
            output = tuned(x)
            assert len(features) == 1
            torch.testing.assert_close(output, model(x), rtol=0, atol=0)
    finally:
        for handle in handles:
            handle.remove()
    before = tuned.backend_calls
    with torch.no_grad():
        tuned(x)
    assert tuned.backend_calls == before + (0 if name == "eager" else 1)  # hooks gone: the backend serves again


def test_a_global_forward_hook_runs(net):
    name, model, tuned = net
    x = torch.randn(4, 16)
    seen = []

    def hook(module, args, output):  # records the call and shapes the output, as a feature hook might
        seen.append(module)
        return output * 2 if module is model.fc2 else None

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        with torch.no_grad():
            output = tuned(x)
            seen.clear()
            expected = model(x)  # eager with the hook: fc2's output doubled
    finally:
        handle.remove()
    assert model.fc2 in seen
    torch.testing.assert_close(output, expected, rtol=0, atol=0)


def test_a_submodule_put_in_training_mode_is_obeyed(net):
    name, model, tuned = net
    x = torch.randn(4, 16)
    model.drop.train()
    try:
        with torch.no_grad():
            torch.manual_seed(1)
            output = tuned(x)
            torch.manual_seed(1)
            expected = model(x)
        with torch.no_grad():
            inference = model.eval()(x)
    finally:
        model.drop.eval()
    if name == "inductor_jit":  # compiled dropout draws from Inductor's own random stream: it applies, other bits
        assert not torch.allclose(output, inference)
    else:
        torch.testing.assert_close(output, expected, rtol=0, atol=0)


def test_attributes_read_by_forward_are_obeyed(net):
    name, model, tuned = net
    x = torch.randn(4, 16)
    before = fallbacks(tuned, "module")
    with torch.no_grad():
        model.scale = 3.0
        try:
            torch.testing.assert_close(tuned(x), model(x), rtol=0, atol=0)
        finally:
            model.scale = 1.0
        original = model.offset
        model.offset = torch.full((16,), 5.0)  # a new tensor
        try:
            torch.testing.assert_close(tuned(x), model(x), rtol=0, atol=0)
        finally:
            model.offset = original
        model.offset.add_(7.0)  # in place
        try:
            torch.testing.assert_close(tuned(x), model(x), rtol=0, atol=0)
        finally:
            model.offset.sub_(7.0)
            tuned.watch_state()  # the version counter moved on: watch from the restored state
    if name in BAKED:
        assert fallbacks(tuned, "module") == before + 3


def test_an_attribute_set_again_to_an_equal_object_keeps_the_backend_serving(net):
    """NOTE [native attribute check]: the attributes are compared by identity in C first; an equal value in a new
    object sends one call to the comparison by value, which finds the module as tuned, and the next calls compare
    with the new object."""
    name, model, tuned = net
    x = torch.randn(4, 16)
    before, served = fallbacks(tuned, "module"), tuned.backend_calls
    original = model.scale
    with torch.no_grad():
        expected = tuned(x)  # the backend's answer while nothing changed
    model.scale = float("1.0")  # == 1.0, another float object
    try:
        with torch.no_grad():
            for _ in range(3):
                torch.testing.assert_close(tuned(x), expected, rtol=0, atol=0)
        baked = tuned._self_dispatch.baked
        if name in BAKED and native_watch.native_module() is not None:
            assert baked.attribute_reader() is True  # made again from the objects there now
    finally:
        model.scale = original
    assert fallbacks(tuned, "module") == before
    assert tuned.backend_calls == served + (0 if name == "eager" else 4)


def test_a_changed_module_costs_one_wasted_backend_run_then_is_checked_before_the_launch(net):
    """NOTE [module check after launch] in aitune/torch/dispatch.py: a baked backend's module check follows its
    launch; the first call that finds the module changed discards the backend's output, later calls check first
    (no backend run) until the module is put back, and then the backend serves again."""
    name, model, tuned = net
    if name not in BAKED:
        pytest.skip("this backend reads the module at every call: no module check")
    backend = tuned.backends["graph0"]
    runs = []
    serve = backend.run
    backend.run = lambda *args, **kwargs: runs.append(1) or serve(*args, **kwargs)  # a spy: counts, then serves
    x = torch.randn(4, 16)
    before = fallbacks(tuned, "module")
    try:
        with torch.no_grad():
            first = tuned(x)
            assert len(runs) == 1
            model.scale = 3.0
            for _ in range(3):
                torch.testing.assert_close(tuned(x), model(x), rtol=0, atol=0)
            assert len(runs) == 2 and fallbacks(tuned, "module") == before + 3
            model.scale = 1.0
            served = tuned.backend_calls
            for _ in range(2):  # the backend's own answer again (a quantized one is not eager's)
                torch.testing.assert_close(tuned(x), first, rtol=0, atol=0)
            assert len(runs) == 4 and tuned.backend_calls == served + 2
            model.scale = 2.0  # a second change: again one wasted run, then none
            for _ in range(2):
                torch.testing.assert_close(tuned(x), model(x), rtol=0, atol=0)
            assert len(runs) == 5 and fallbacks(tuned, "module") == before + 5
    finally:
        del backend.run
        model.scale = 1.0


class Locked(Net):
    """A module ``copy.deepcopy`` refuses (it holds a lock): a frozen Inductor build compiles it as it is."""

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()


def test_a_backend_that_may_run_the_live_module_is_never_run_on_a_changed_one():
    """A frozen build whose copy of the module failed compiles the user's module itself (a call could recompile
    it as it is now): its module check stays before the launch (``Backend.runs_own_copy``). So do eager's
    CUDA-graph runner (it captures the live module) and Torch-TensorRT JIT (it compiles the live module)."""
    from aitune.torch.backend import TorchEagerBackendConfig, TorchTensorRTJitBackend

    assert not TorchEagerBackend(TorchEagerBackendConfig(use_cuda_graphs=True)).runs_own_copy
    assert not TorchTensorRTJitBackend().runs_own_copy
    torch.manual_seed(0)
    model = Locked().eval()
    tuned = tune(model, "inductor_jit_frozen", BACKENDS["inductor_jit_frozen"]())
    backend, entry = tuned.backends["graph0"], tuned._self_dispatch.graphs[0]
    assert "frozen_copy_failed" in backend.build_info and not backend.runs_own_copy and not entry.late_state
    runs = []
    serve = backend.run
    backend.run = lambda *args, **kwargs: runs.append(1) or serve(*args, **kwargs)  # a spy: counts, then serves
    x = torch.randn(4, 16)
    with torch.no_grad():
        model.scale = 3.0
        torch.testing.assert_close(tuned(x), model(x), rtol=0, atol=0)
        assert runs == []
        model.scale = 1.0
        torch.testing.assert_close(tuned(x), model(x), rtol=1e-5, atol=1e-5)
        assert len(runs) == 1


def test_where_eager_may_not_run_a_changed_module_is_refused_before_the_launch(net):
    """Where eager may not run (``ait.load`` found other weights than the artifacts'), a call on a changed module
    raises without running the backend first (NOTE [module check after launch])."""
    name, model, tuned = net
    if name not in BAKED:
        pytest.skip("this backend reads the module at every call: no module check")
    dispatch, backend = tuned._self_dispatch, tuned.backends["graph0"]
    runs = []
    serve = backend.run
    backend.run = lambda *args, **kwargs: runs.append(1) or serve(*args, **kwargs)  # a spy: counts, then serves
    dispatch.eager_fallback_error = "the module's weights are not the artifacts'"  # as ait.load sets it
    model.scale = 3.0
    try:
        with torch.no_grad(), pytest.raises(BackendRuntimeError, match="scale"):
            tuned(torch.randn(4, 16))
        assert runs == []
    finally:
        del backend.run
        dispatch.eager_fallback_error = None
        model.scale = 1.0
    with torch.no_grad():
        tuned(torch.randn(4, 16))  # (the module as tuned: its check clean again)


def test_a_new_shape_is_checked_by_the_guard_once_the_module_is_put_back():
    """A call of a shape new to the guard that runs eager because the module differs was not checked: the first
    call of that shape the backend serves later is (``RuntimeGuard.undo_due``)."""
    torch.manual_seed(0)
    model = Net().eval()
    tuned = tune(model, "inductor_jit_frozen", BACKENDS["inductor_jit_frozen"](), guard=None)  # the default guard
    guard = tuned._self_dispatch.graphs[0].guard
    x = torch.randn(3, 16)
    with torch.no_grad():
        model.scale = 3.0
        eager = model(x)
        torch.testing.assert_close(tuned(x), eager, rtol=0, atol=0)
        model.scale = 1.0
        checks = guard.checks
        torch.testing.assert_close(tuned(x), model(x), rtol=1e-5, atol=1e-5)
    assert guard.checks == checks + 1


def test_weights_edited_through_data_are_noticed(net):
    name, model, tuned = net
    x = torch.randn(4, 16)
    model.fc1.weight.data.mul_(2)  # no version bump, same data pointer
    try:
        with torch.no_grad():
            for _ in range(VALUES_CHECK_EVERY):
                tuned(x)
            for _ in range(3):  # from then on every call matches the edited module
                torch.testing.assert_close(tuned(x), model(x), rtol=0, atol=0)
        if name in BAKED:
            assert "fc1.weight" in tuned.needs_retune and ".data" in tuned.needs_retune
    finally:
        model.fc1.weight.data.div_(2)
        tuned.watch_state()


@pytest.mark.parametrize("backend", ["onnxruntime", "torchao"])
def test_hooks_registered_before_tuning_run_on_every_call(backend):
    if backend not in BACKENDS:
        pytest.skip("onnxruntime is not installed")
    model = Net().eval()
    features = []
    model.act.register_forward_hook(lambda module, args, output: features.append(output))
    model.fc1.register_forward_hook(lambda module, args, output: output * (output.abs() > 0.1))
    tuned = tune(model, "hooked", BACKENDS[backend]())
    features.clear()
    x = torch.randn(4, 16)
    with torch.no_grad():
        output = tuned(x)
        assert len(features) == 1
        torch.testing.assert_close(output, model(x), rtol=0, atol=0)
    assert fallbacks(tuned, "hooks") == 1


@pytest.mark.parametrize("backend", ["onnxruntime", "inductor_aot"])
def test_a_built_in_layers_hyper_parameter_is_obeyed_from_the_next_full_check_on(backend):
    """torch.nn's own layers (LeakyReLU's negative_slope here) are compared with the sampled weights every
    VALUES_CHECK_EVERY calls; from then on every call runs eager until the value is put back."""
    if backend not in BACKENDS:
        pytest.skip("onnxruntime is not installed")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.LeakyReLU(0.1)).eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    tuned = tune(model, "leaky", BACKENDS[backend]())
    x = torch.randn(4, 16)
    with torch.no_grad():
        model[1].negative_slope = 0.5
        for _ in range(VALUES_CHECK_EVERY):
            tuned(x)
        assert fallbacks(tuned, "module") == 1
        for _ in range(3):
            torch.testing.assert_close(tuned(x), model(x), rtol=0, atol=0)
        assert fallbacks(tuned, "module") == 4
        model[1].negative_slope = 0.1
        served = tuned.backend_calls
        torch.testing.assert_close(tuned(x), model(x))  # the backend's own rounding again
        assert tuned.backend_calls == served + 1  # put back: the backend serves again


class Scaled(nn.Module):
    scale = 1.0  # a class-level default that an instance attribute may later shadow

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x):
        return self.body(x * self.scale)


@pytest.fixture(scope="module")
def scaled():
    if "onnxruntime" not in BACKENDS:
        pytest.skip("onnxruntime is not installed")
    torch.manual_seed(0)
    model = Scaled().eval().requires_grad_(False)
    return model, tune(model, "scaled", BACKENDS["onnxruntime"]())


def test_an_instance_attribute_shadowing_a_class_default_is_obeyed(scaled):
    model, tuned = scaled
    x = torch.randn(4, 16)
    with torch.no_grad():
        model.scale = 3.0
        try:
            torch.testing.assert_close(tuned(x), model(x), rtol=0, atol=0)
        finally:
            del model.scale
        served = tuned.backend_calls
        torch.testing.assert_close(tuned(x), model(x), atol=1e-5, rtol=1e-4)
    assert tuned.backend_calls == served + 1


def test_only_class_level_values_count_as_defaults_an_instance_may_shadow():
    """What makes a module's attribute count watched per call: names its forward reads that the class holds as
    plain values (``scale = 1.0``), not names the class lacks (globals such as ``F``, parameters such as
    ``weight``): counting those watched every module's attribute count on every call (~11 of ~30 µs per call
    for a ResNet-50, benchmarks/baked_state_cost.py)."""
    from aitune.torch.check.baked_state import _class_defaults
    from aitune.torch.check.read_names import read_names as _read_names

    assert _class_defaults(nn.Linear, _read_names(nn.Linear)) == set()
    assert _class_defaults(nn.Conv2d, _read_names(nn.Conv2d)) == set()
    assert "scale" in _class_defaults(Scaled, _read_names(Scaled))


def test_a_swapped_submodule_is_obeyed():
    if "onnxruntime" not in BACKENDS:
        pytest.skip("onnxruntime is not installed")
    model = Scaled().eval().requires_grad_(False)
    tuned = tune(model, "swapped", BACKENDS["onnxruntime"]())  # its own: needing a re-tune is sticky
    x = torch.randn(4, 16)
    original = model.body[1]
    model.body[1] = nn.Tanh()  # no new parameters: only the module changed
    try:
        with torch.no_grad():
            torch.testing.assert_close(tuned(x), model(x), rtol=0, atol=0)
        assert "submodule" in tuned.needs_retune
    finally:
        model.body[1] = original


def test_jit_discovery_hooks_do_not_count_as_the_users(scaled):
    """JIT tuning registers global forward hooks of its own: a tuned module's watch ignores them."""
    from aitune.torch.jit import discovery

    model, tuned = scaled
    x = torch.randn(4, 16)
    installed = not discovery._hooks
    discovery.install(False)
    try:
        served = tuned.backend_calls
        with torch.no_grad():
            tuned(x)
        assert tuned.backend_calls == served + 1
    finally:
        if installed:
            discovery.uninstall()


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.fc(x)


def test_a_stateful_forward_is_not_served_by_a_copy_of_the_module():
    """An exported copy would answer without counting: the calls run eager and the counter moves as eager's."""
    if "onnxruntime" not in BACKENDS:
        pytest.skip("onnxruntime is not installed")
    model = Counting().eval().requires_grad_(False)
    tuned = tune(model, "counting", BACKENDS["onnxruntime"]())
    assert "calls" in tuned.graphs[0].stateful_reason
    before = model.calls
    x = torch.randn(4, 16)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(tuned(x), model.fc(x), rtol=0, atol=0)
    assert model.calls == before + 3
    assert tuned.backend_calls == 0 and fallbacks(tuned, "stateful") >= 1  # then the changed counter says so too


def _scaled_by(module, y):
    return y * getattr(module, "extra_scale", 1.0)  # read by a free function, not by the module's own code


class ScaledLM(Scaled):
    """A module with transformers' generate on it (its own bookkeeping between calls) and a free function that
    reads one of its attributes."""

    def forward(self, x):
        return _scaled_by(self, super().forward(x))


def test_generates_bookkeeping_may_come_and_go_any_other_attribute_may_not():
    """transformers' ``generate`` sets ``_previous_max_cache_length`` on the model after its first call: that
    attribute (assigned by GenerationMixin, read by no forward) leaves the backend serving; any other attribute
    added, here one a free function reads, still sends the call to eager, and the message names it."""
    transformers = pytest.importorskip("transformers")
    from aitune.torch.check.generation_names import generation_bookkeeping

    names = generation_bookkeeping(transformers.LlamaForCausalLM)  # what generate (and its auto-compile) keep
    assert {"_previous_max_cache_length", "_compiled_call", "_last_compile_config"} <= names
    assert "max_length" not in names  # (assigned on generation_config, not on the model)
    if "onnxruntime" not in BACKENDS:
        pytest.skip("onnxruntime is not installed")
    lm_class = type("ScaledCausalLM", (ScaledLM, transformers.GenerationMixin), {})
    torch.manual_seed(0)
    model = lm_class().eval().requires_grad_(False)
    tuned = tune(model, "scaled-lm", BACKENDS["onnxruntime"]())
    x = torch.randn(4, 16)
    with torch.no_grad():
        model._previous_max_cache_length = 64
        served = tuned.backend_calls
        torch.testing.assert_close(tuned(x), model(x), atol=1e-5, rtol=1e-4)
        assert tuned.backend_calls == served + 1 and fallbacks(tuned, "module") == 0
        model.extra_scale = 3.0
        torch.testing.assert_close(tuned(x), model(x), rtol=0, atol=0)  # eager's result, with the new scale
        assert fallbacks(tuned, "module") == 1
        assert "(extra_scale)" in tuned._self_dispatch.baked._what_attribute_changed()
        del model.extra_scale
        served = tuned.backend_calls
        torch.testing.assert_close(tuned(x), model(x), atol=1e-5, rtol=1e-4)
        assert tuned.backend_calls == served + 1


class Listed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.weights = [1.0, 2.0]
        self.scale = 1.0

    def forward(self, x):
        return self.fc(x) * self.weights[0] * self.scale + self.weights[1]


class _Baking:
    name = "test_baking"


def test_an_equal_mutable_attribute_is_compared_by_value_on_every_call_from_then_on():
    """NOTE [native attribute check]: a list set to an equal new list is found equal by value; a reader of the new
    list's identity would miss an append to it, so the comparison by value runs on every call from then on and the
    append is found at the next call."""
    from aitune.torch.check.baked_state import BakedState

    if native_watch.native_module() is None:
        pytest.skip("the extension is not built here")
    model = Listed()
    baked = BakedState(model)
    assert baked.attribute_reader is not None and baked.module_differs(_Baking()) is None
    model.weights = [1.0, 2.0]
    assert baked.module_differs(_Baking()) is None and baked.attribute_reader is None
    model.weights.append(3.0)
    assert baked.module_differs(_Baking())[0] == "module"


def test_an_attribute_set_to_an_equal_new_object_on_every_call_stops_renewing_the_reader():
    """An equal immutable value in a new object on every call renews the reader at most RENEWALS times; then the
    comparison by value runs on every call, and still sees a real change."""
    from aitune.torch.check.baked_state import RENEWALS, BakedState

    model = Listed()
    baked = BakedState(model)
    if native_watch.native_module() is None:
        pytest.skip("the extension is not built here")
    for _ in range(RENEWALS):
        model.scale = float("1.0")  # == 1.0, a new object each time
        assert baked.module_differs(_Baking()) is None and baked.attribute_reader is not None
    model.scale = float("1.0")
    assert baked.module_differs(_Baking()) is None and baked.attribute_reader is None
    model.scale = 2.0
    assert baked.module_differs(_Baking())[0] == "module"

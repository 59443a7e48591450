"""Just-in-time tuning on small models: settings, routing, discovery, top-down descent, deferred mode, the
decorator, and that nothing the user owns changes."""

import copy
import importlib
import json
import os
import pickle
import sys
import tomllib
from pathlib import Path

import pytest
import torch

import aitune.torch as ait
import aitune.torch.jit as jit
from aitune.errors import ConfigError
from aitune.torch.jit import JitState, patching
from jit_user_settings import cheap_strategy


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.linear(x))


class Top(torch.nn.Module):
    """Two blocks in a ModuleList and a head: children are ``blocks.0``, ``blocks.1``, ``head``."""

    def __init__(self, branch: bool = False):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(16, 4)
        self.branch = branch

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        if self.branch and x.sum() > 0:  # data-dependent: fullgraph compilation cannot take it
            x = x * 2
        return self.head(x)


@pytest.fixture(autouse=True)
def _jit_off():
    jit.reset()
    yield
    jit.reset()


def _batches(sizes=(2, 3, 4, 5)):
    return [torch.randn(size, 16) for size in sizes]


def _eager(model, batches):
    """Eager outputs, computed before tuning is enabled."""
    with torch.no_grad():
        return [model(x) for x in batches]


# ---- settings
def test_config_validates_on_assignment():
    config = jit.JitConfig()
    with pytest.raises(ConfigError, match="min_samples"):
        config.min_samples = 0
    with pytest.raises(ConfigError, match="mode"):
        config.mode = "sometimes"
    with pytest.raises(ConfigError, match="no setting 'min_sample'"):
        config.min_sample = 3
    with pytest.raises(ConfigError, match="skip_modules"):
        config.skip_modules = "BertPooler"
    with pytest.raises(ConfigError, match="strategy"):
        config.strategy = "inductor"
    config.mode = "tune_deferred"
    assert config.mode is jit.JITMode.TUNE_DEFERRED
    json.dumps(config.to_dict())
    config.reset_to_defaults()
    assert config == jit.JitConfig()


def test_environment_settings(monkeypatch, tmp_path):
    (tmp_path / "my_jit_settings.py").write_text("def configure(config):\n    config.min_samples = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("AITUNE_JIT_SETUP", "my_jit_settings:configure")
    monkeypatch.setenv("AITUNE_JIT_MODE", "tune_deferred")
    jit.enable()
    assert jit.jit_config.min_samples == 7 and jit.jit_config.mode is jit.JITMode.TUNE_DEFERRED
    monkeypatch.setenv("AITUNE_JIT_SETUP", "no_such_module:configure")
    with pytest.raises(ConfigError, match="AITUNE_JIT_SETUP"):
        jit.enable()


def test_jit_cache_dir_comes_from_the_environment(monkeypatch, tmp_path):
    """``$AITUNE_JIT_CACHE_DIR`` is where just-in-time tuning writes its builds and reports (not
    ``<aitune cache>/jit``); ``cache_dir`` set in the config wins over it."""
    monkeypatch.setenv("AITUNE_JIT_CACHE_DIR", str(tmp_path / "jit-here"))
    default = Path(os.environ["AITUNE_CACHE_DIR"]) / "jit"
    jit.enable(strategy=cheap_strategy(), min_samples=2)
    assert jit.jit_config.resolved_cache_dir() == tmp_path / "jit-here"
    model = Top().eval()
    with torch.no_grad():
        for x in _batches():
            model(x)
    assert jit.patched_modules()[0].state is JitState.TUNED
    assert list((tmp_path / "jit-here").rglob("*.json")) and not default.exists()
    jit.jit_config.cache_dir = str(tmp_path / "configured")
    assert jit.jit_config.resolved_cache_dir() == tmp_path / "configured"


def test_public_surface():
    assert set(jit.__all__) == {"JITMode", "JitConfig", "JitState", "PatchedModule", "describe", "disable",
                                "enable", "hierarchy", "is_enabled", "jit_config", "patch_for_jit_tuning",
                                "patched_modules", "prepare_for_jit_tuning", "reset", "tune", "tune_now"}
    assert ait.jit_config is jit.jit_config and ait.patch_for_jit_tuning is jit.patch_for_jit_tuning
    assert ait.jit_reset is jit.reset
    jit.enable()  # eager mode: the reference's deferred() refuses, naming the setting
    with pytest.raises(ConfigError, match="tune_deferred"):
        jit.tune.deferred()


def test_pyproject_declares_extra_and_entry_point():
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["aitune_enable_jit_tuning"] == {"torch": "aitune._jit_bootstrap:wrapt_auto_enable"}
    assert any(requirement.startswith("autowrapt") for requirement in project["optional-dependencies"]["jit"])
    assert "jit" in project["optional-dependencies"]["all"][0]


# ---- routing without replacing the module
def test_routing_class_keeps_identity_and_copies_are_plain():
    model = Top().eval()
    calls = []
    patching.patch(model, lambda module, args, kwargs: calls.append(args) or "routed")
    try:
        assert isinstance(model, Top) and type(model).__name__ == "Top" and type(model) is not Top
        assert model(torch.zeros(1, 16)) == "routed" and len(calls) == 1
        assert type(copy.deepcopy(model)) is Top
        assert type(pickle.loads(pickle.dumps(model))) is Top
        twin = patching.make_twin(model)
        assert type(twin) is Top and twin.head.weight is model.head.weight
        model.train()
        assert twin.training  # one __dict__: the user's mode switch reaches the twin
        assert list(twin.state_dict()) == list(model.state_dict())
    finally:
        patching.unpatch(model)
    assert type(model) is Top


# ---- discovery and eager-mode tuning
def test_top_level_module_is_tuned_and_outputs_stay_eager_until_then():
    model = Top().eval()
    batches = _batches()
    expected = _eager(model, batches)
    weights = {name: value.clone() for name, value in model.state_dict().items()}
    jit.enable(strategy=cheap_strategy(), min_samples=2)
    with torch.no_grad():
        outputs = [model(x) for x in batches]
    node = jit.patched_modules()[0]
    assert [node.name for node in jit.patched_modules()] == ["Top"]
    assert node.state is JitState.TUNED and node.calls == 4
    assert node.backends == {"graph0": "TorchInductorJitBackend()"}
    for index, (tuned, eager) in enumerate(zip(outputs, expected)):
        if index < 3:  # discovering call, two recorded calls: eager's outputs, bit for bit
            assert torch.equal(tuned, eager)
        else:
            torch.testing.assert_close(tuned, eager)
    assert node.stats()["guard"]["graph0"]["calls"] == 1
    assert "tuned" in jit.describe() and jit.hierarchy()[0]["backends"]
    jit.disable()
    assert type(model) is Top and not model.training
    assert all(torch.equal(weights[name], value) for name, value in model.state_dict().items())
    assert not jit.patched_modules() and not jit.is_enabled()
    assert not any(getattr(hook, "__module__", "").startswith("aitune")
                   for hook in torch.nn.modules.module._global_forward_pre_hooks.values())


def test_calls_that_need_autograd_or_train_mode_run_eager_unrecorded():
    jit.enable(strategy=cheap_strategy(), min_samples=2)
    model = Top().eval()
    with torch.no_grad():
        model(torch.randn(2, 16))  # discovered
    output = model(torch.randn(3, 16))  # grad enabled, parameters require grad
    assert output.requires_grad
    model.train()
    with torch.no_grad():
        model(torch.randn(4, 16))
    node = jit.patched_modules()[0]
    assert node.state is JitState.RECORDING and node.recorded_calls == 0
    assert set(node.eager_calls) == {"autograd needed (grad enabled and parameters require grad: use "
                                     "torch.no_grad())", "training mode"}


def test_skipped_and_left_alone_modules():
    jit.enable(strategy=cheap_strategy(), min_samples=2, skip_modules=["Block"])
    loss = torch.nn.MSELoss()
    wrapped = ait.Module(Top().eval())
    compiled = torch.compile(Block().eval())
    block = Block().eval()
    with torch.no_grad():
        loss(torch.zeros(2), torch.ones(2))
        wrapped(torch.zeros(2, 16))
        compiled(torch.zeros(2, 16))
        block(torch.zeros(2, 16))
    reasons = {node.name: node.reason for node in jit.patched_modules()}
    assert all(node.state is JitState.SKIPPED for node in jit.patched_modules())
    assert "min_parameters" in reasons["MSELoss"]
    assert "ait.tune tunes it" in reasons["Top"]
    assert "built-in exclusion" in reasons["OptimizedModule"]
    assert "skip_modules" in reasons["Block"]
    assert type(block) is Block and type(wrapped.module) is Top


@pytest.mark.parametrize("entry", ["Top", "Block"])
def test_patch_exclude_never_tunes_the_module_and_tries_its_children(entry):
    """A top-level module (``Top``) or children (``Block``: both blocks, tried once Top cannot be tuned whole)
    in ``patch_exclude`` are never tuned themselves; their children are tried and tuned; outputs stay eager's."""
    model = Top(branch=entry == "Block").eval()
    batches = _batches()
    expected = _eager(model, batches)
    jit.enable(strategy=cheap_strategy(fullgraph=entry == "Block"), min_samples=2, patch_exclude=[entry])
    with torch.no_grad():
        outputs = [model(x) for x in batches]
    nodes = {node.name: node for node in jit.patched_modules()}
    excluded = [nodes["Top"]] if entry == "Top" else [nodes["Top.blocks.0"], nodes["Top.blocks.1"]]
    for node in excluded:
        assert node.state is JitState.SKIPPED and "patch_exclude" in node.reason and not node.backends
    if entry == "Top":
        assert [child.name for child in nodes["Top"].children] == ["Top.blocks.0", "Top.blocks.1", "Top.head"]
        assert all(child.state is JitState.TUNED for child in nodes["Top"].children)
    else:
        assert nodes["Top"].state is JitState.EAGER and nodes["Top.head"].state is JitState.TUNED
        for node in excluded:
            assert [child.name for child in node.children] == [f"{node.name}.linear"]
            assert node.children[0].state is JitState.TUNED
    for tuned, eager in zip(outputs, expected):
        torch.testing.assert_close(tuned, eager)


def test_module_inside_a_tracked_one_is_not_tracked_twice():
    jit.enable(strategy=cheap_strategy(), min_samples=5)
    model = Top().eval()
    with torch.no_grad():
        model(torch.randn(2, 16))
        model.head(torch.randn(2, 16))  # a top-level call of a submodule
    nodes = {node.name: node for node in jit.patched_modules()}
    assert nodes["Linear"].state is JitState.SKIPPED and "part of Top" in nodes["Linear"].reason
    assert type(model.head) is torch.nn.Linear
    nodes["Top"].descend()  # as when Top cannot be tuned: the head is now tried as Top's child
    assert [node.name for node in jit.patched_modules()] == ["Top", "Top.blocks.0", "Top.blocks.1", "Top.head"]
    assert jit.patched_modules()[-1].state is JitState.RECORDING and type(model.head) is not torch.nn.Linear


def test_fixed_shapes_wait_for_a_varying_axis_unless_told_otherwise():
    jit.enable(strategy=cheap_strategy(), min_samples=2)
    model = Top().eval()
    with torch.no_grad():
        for _ in range(4):
            model(torch.randn(3, 16))
    node = jit.patched_modules()[0]
    assert node.state is JitState.RECORDING and "input axis that varies" in node.waiting_for()
    jit.jit_config.batch_axis_required = False
    with torch.no_grad():
        model(torch.randn(3, 16))
    assert node.state is JitState.TUNED


def test_recording_stops_cloning_calls_that_teach_nothing_new():
    jit.enable(strategy=cheap_strategy(), min_samples=2)
    model = Top().eval()
    with torch.no_grad():
        for _ in range(jit.patched_module.RECORDED_ENOUGH + 5):
            model(torch.randn(3, 16))
        node = jit.patched_modules()[0]
        assert node.state is JitState.RECORDING and node.recorded_calls == jit.patched_module.RECORDED_ENOUGH
        model(torch.randn(5, 16))  # a new size: recorded, the batch axis shows, the module is tuned
    assert node.state is JitState.TUNED and node.recorded_calls == jit.patched_module.RECORDED_ENOUGH + 1


# ---- top down
def test_a_module_that_cannot_be_tuned_has_its_children_tuned():
    model = Top(branch=True).eval()
    batches = _batches()
    expected = _eager(model, batches)
    jit.enable(strategy=cheap_strategy(fullgraph=True), min_samples=2)
    with torch.no_grad():
        outputs = [model(x) for x in batches]
    nodes = {node.name: node for node in jit.patched_modules()}
    top = nodes["Top"]
    assert top.state is JitState.EAGER and "Data-dependent" in top.reason
    assert [child.name for child in top.children] == ["Top.blocks.0", "Top.blocks.1", "Top.head"]
    # The children recorded the parent's replayed samples and were tuned at the same call boundary.
    assert all(child.state is JitState.TUNED for child in top.children)
    assert all(child.calls == 3 for child in top.children)  # 2 replayed + 1 live call
    for tuned, eager in zip(outputs, expected):
        torch.testing.assert_close(tuned, eager)
    jit.disable()
    assert type(model) is Top and type(model.blocks[0]) is Block and type(model.head) is torch.nn.Linear


def test_max_depth_level_one_tries_no_children():
    jit.enable(strategy=cheap_strategy(fullgraph=True), min_samples=2, max_depth_level=1)
    model = Top(branch=True).eval()
    with torch.no_grad():
        for x in _batches((2, 3, 4)):
            model(x)
    node = jit.patched_modules()[0]
    assert node.state is JitState.EAGER and not node.children and "max_depth_level=1" in node.note


def test_no_backend_beating_eager_counts_as_not_tuned():
    strategy = cheap_strategy().enable_performance_validation(True, min_speedup_ratio=1000.0)
    jit.enable(strategy=strategy, min_samples=2, max_depth_level=2)
    model = Top().eval()
    with torch.no_grad():
        for x in _batches((2, 3, 4)):
            model(x)
    top = jit.patched_modules()[0]
    assert top.state is JitState.EAGER and "no backend passed the checks and beat eager" in top.reason
    assert "rejected (performance)" in top.reason
    assert [child.state for child in top.children] == [JitState.EAGER] * 3
    assert all("children not tried" in child.note for child in top.children)
    json.dumps(jit.hierarchy())


# ---- deferred mode
def test_deferred_mode_tunes_only_when_asked():
    jit.enable(strategy=cheap_strategy(), mode="tune_deferred")
    model = Top().eval()
    with torch.no_grad():
        for x in _batches():
            model(x)
        node = jit.patched_modules()[0]
        assert node.state is JitState.RECORDING and node.recorded_calls == 3
        assert jit.tune_now() == [node] and node.state is JitState.TUNED
        assert jit.tune_now() == []
        x = torch.randn(6, 16)
        torch.testing.assert_close(model(x), node.twin(x))


def test_deferred_mode_tunes_what_is_pending_at_exit():
    jit.enable(strategy=cheap_strategy(), mode="tune_deferred")
    model = Top().eval()
    with torch.no_grad():
        for x in _batches((2, 3)):
            model(x)
    jit.runtime._at_exit()  # what the interpreter runs at exit
    assert jit.patched_modules()[0].state is JitState.TUNED


# ---- the decorator and the imports
def test_decorator_makes_only_what_the_builder_builds_a_candidate():
    outside = Top().eval()

    @jit.patch_for_jit_tuning
    def build():
        return Top().eval()

    jit.jit_config.update(strategy=cheap_strategy(), mode="tune_deferred")
    original_init = torch.nn.Module.__init__
    built = build()
    assert torch.nn.Module.__init__ is original_init  # wrapped only while building
    with torch.no_grad():
        for x in _batches((2, 3)):
            built(x)
            outside(x)
    assert [node.name for node in jit.patched_modules()] == ["Top"]
    assert jit.patched_modules()[0].module is built and type(outside) is Top


def test_context_manager_restores_module_init():
    original = torch.nn.Module.__init__
    with jit.prepare_for_jit_tuning():
        assert torch.nn.Module.__init__ is not original
        inside = Block()
    assert torch.nn.Module.__init__ is original
    assert inside in jit.state.candidates


def test_enable_and_disable_imports_act_and_stay_callable():
    for name in ("aitune.torch.jit.enable", "aitune.torch.jit.disable"):
        sys.modules.pop(name, None)
    importlib.import_module("aitune.torch.jit.enable")
    assert jit.is_enabled()
    importlib.import_module("aitune.torch.jit.disable")
    assert not jit.is_enabled()
    jit.enable()
    assert jit.is_enabled()
    jit.disable()
    assert not jit.is_enabled()

import json
import logging

import pytest
import torch

import aitune.torch as ait
from aitune.errors import ConfigError
from aitune.torch.backend import TorchEagerBackend, TorchInductorJitBackend


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.scale = 2.0

    def forward(self, x, *, bias=None):
        y = self.fc(x) * self.scale
        return y if bias is None else y + bias


class Pipeline(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.block(x))


def eager_only(fast_profiling):
    return ait.OneBackendStrategy(TorchEagerBackend(), profiling_config=fast_profiling)


def test_wrapper_is_transparent():
    pipe = Pipeline().eval()
    keys = set(pipe.state_dict())
    pipe.block = ait.Module(pipe.block, "block")
    assert isinstance(pipe.block, Block) and pipe.block.scale == 2.0 and pipe.block.fc is pipe.block.module.fc
    assert set(pipe.state_dict()) == keys  # no extra prefix
    assert pipe.block.state is ait.ModuleState.INIT and "block" in repr(pipe.block)


def test_states_record_tune_passthrough(fast_profiling):
    pipe = Pipeline().eval()
    pipe.block = ait.Module(pipe.block, "block", strategy=eager_only(fast_profiling))
    x = torch.randn(4, 8)
    expected = pipe(x)
    assert pipe.block.state is ait.ModuleState.RECORDING
    ait.tune(pipe, [torch.randn(2, 8), torch.randn(5, 8)], ready_batches=True)
    assert pipe.block.state is ait.ModuleState.TUNED
    torch.testing.assert_close(pipe(x), expected)
    with pytest.raises(ConfigError):
        pipe.block.enable_recording()
    pipe.block.enable_passthrough()
    torch.testing.assert_close(pipe(x), expected)


def test_untuned_graph_runs_eager_with_one_warning(fast_profiling, caplog):
    block = Block().eval()
    wrapped = ait.Module(block, "block", strategy=eager_only(fast_profiling))
    ait.tune(wrapped, [torch.randn(2, 8)], ready_batches=True)
    bias = torch.randn(8)
    with caplog.at_level(logging.WARNING):
        out1 = wrapped(torch.randn(2, 8), bias=bias)
        wrapped(torch.randn(2, 8), bias=bias)
    assert sum("never recorded" in record.message for record in caplog.records) == 1
    assert out1.shape == (2, 8)


def test_tune_bad_inputs_are_clear(fast_profiling):
    with pytest.raises(ConfigError, match="torch.nn.Module"):
        ait.Module(lambda x: x)
    with pytest.raises(ConfigError, match="already wrapped"):
        ait.Module(ait.Module(Block()))
    with pytest.raises(ConfigError, match="TuneStrategy"):
        ait.Module(Block(), strategy="fast")
    wrapped = ait.Module(Block(), "b", strategy=eager_only(fast_profiling))
    with pytest.raises(ConfigError, match="empty"):
        ait.tune(wrapped, [], ready_batches=True)
    with pytest.raises(ConfigError, match="callable"):
        ait.tune(None, [torch.randn(1, 8)], ready_batches=True)
    with pytest.raises(ConfigError, match="item #0"):
        ait.tune(lambda item: wrapped(item["missing"]), [{"x": torch.randn(1, 8)}], ready_batches=True)
    with pytest.raises(ConfigError, match="batch_sizes"):
        ait.tune(wrapped, [torch.randn(8)], batch_sizes=[0])
    with pytest.raises(ConfigError, match="no aitune.torch.Module was called"):
        ait.tune(lambda x: x, [torch.randn(1)], ready_batches=True)
    assert wrapped.state is not ait.ModuleState.TUNED


def test_dataset_forms_and_batch_sizes(fast_profiling):
    block = Block().eval()
    wrapped = ait.Module(block, "b", strategy=eager_only(fast_profiling))
    examples = [torch.randn(8) for _ in range(3)]
    report = ait.tune(wrapped, examples, batch_sizes=[1, 4])
    graph = wrapped.graphs[0]
    # Three examples: three batches of 1, one batch of 4 (the three repeated), as the reference's DataLoader.
    assert graph.num_calls == 4
    assert sorted({s.batch_size for s in graph.samples}) == [1, 4]
    assert graph.tensor_specs[0].axes[0] == "batch"
    data = json.loads(open(report.path).read())
    assert data["graphs"][0]["selected"].startswith("TorchEagerBackend")
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(6, 8)), batch_size=3)
    wrapped2 = ait.Module(Block().eval(), "b2", strategy=eager_only(fast_profiling))
    ait.tune(lambda batch: wrapped2(batch[0]), loader, ready_batches=True)
    assert wrapped2.state is ait.ModuleState.TUNED


def test_tuning_leaves_user_objects_untouched(fast_profiling):
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    net.train()
    state = {k: v.clone() for k, v in net.state_dict().items()}
    samples = [torch.randn(3, 4), torch.randn(5, 4)]
    copies = [s.clone() for s in samples]
    wrapped = ait.Module(net, "bn", strategy=ait.MaxThroughputStrategy([TorchInductorJitBackend()],
                                                                      profiling_config=fast_profiling))
    ait.tune(wrapped, samples, ready_batches=True)
    assert net.training and all(m.training for m in net.modules())
    for key, value in net.state_dict().items():
        assert torch.equal(value, state[key]), key
    for sample, copy in zip(samples, copies):
        assert torch.equal(sample, copy)


class Masked(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x, mask=None, scale: float = 1.0):
        return self.fc(x) * mask * scale


class Doubling(TorchEagerBackend):
    """Eager, doubled: a backend whose answers tell that the call reached it (no passthrough, no eager)."""

    name = "test_doubling"
    passthrough = False

    def _infer(self, args, kwargs):
        return 2 * super()._infer(args, kwargs)


def test_every_call_form_reaches_the_backend_with_the_right_arguments(fast_profiling):
    # NOTE [dispatch fast path]: each call shape gets a route whose plan normalises the later calls of that shape
    torch.manual_seed(0)
    model = Masked().eval()
    x, mask = torch.randn(2, 8), (torch.rand(2, 8) > 0.5).float()
    strategy = ait.OneBackendStrategy(Doubling(), profiling_config=fast_profiling).enable_correctness_check(False)
    tuned = ait.Module(model, "forms", strategy=strategy.enable_performance_validation(False))
    ait.tune(lambda item: tuned(**item), [{"x": x, "mask": mask}], ready_batches=True)
    with torch.no_grad():
        expected = 2 * model(x, mask)
        for _ in range(2):  # the second round runs through the stored routes and their plans
            for output in (tuned(x, mask), tuned(x, mask=mask), tuned(mask=mask, x=x), tuned(x=x, mask=mask)):
                torch.testing.assert_close(output, expected, rtol=0, atol=0)
            other_x = torch.randn(2, 8)  # same shape, other values: the plan must take the new tensors
            torch.testing.assert_close(tuned(mask=mask, x=other_x), 2 * model(other_x, mask), rtol=0, atol=0)
    assert tuned.stats["eager_fallbacks"] == {}


def test_the_state_snapshot_restores_values_dtypes_and_flags_bit_for_bit():
    # whatever a build does to the user's module, tuning hands it back as it was
    from aitune.torch.tuning import _Snapshot

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)).eval()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    snapshot = _Snapshot(model)
    assert not snapshot.on_host  # a CPU module's copy is on the host anyway
    with torch.no_grad():
        model[0].weight.data.mul_(2)  # through .data: no version-counter bump
        model[1].running_mean.add_(1)
    model[0].half()  # a dtype change: torch.equal would call the values equal
    model.train()
    snapshot.restore()
    state = model.state_dict()
    assert all(state[name].dtype == value.dtype and torch.equal(state[name], value) for name, value in before.items())
    assert not model.training and not model[0].training


def test_calls_from_another_thread_during_the_recording_pass_are_recorded(fast_profiling):
    """A call another thread makes while ``ait.tune`` records is recorded too (its shape becomes a sample and
    widens the tuned range), and the tuned module answers it like eager."""
    import threading

    model = torch.nn.Linear(4, 2).eval()
    module = ait.Module(model, "threads", strategy=eager_only(fast_profiling))
    other = torch.randn(7, 4)

    def func(batch):
        if batch.shape[0] == 2:  # once, during the recording pass
            thread = threading.Thread(target=module, args=(other,))
            thread.start()
            thread.join()
        return module(batch)

    ait.tune(func, [torch.randn(4) for _ in range(3)], batch_sizes=[1, 2], ignore_failing_modules=False)
    graph = module.graphs[0]
    assert graph.num_calls == 5  # 3 batches of 1, 1 batch of 2, and the other thread's call
    recorded = [sample.shapes() for sample in graph.samples]
    assert ((7, 4),) in recorded and [s for s in recorded if s != ((7, 4),)] == [((1, 4),), ((1, 4),), ((2, 4),)]
    assert any(torch.equal(sample.leaves()[0], other) for sample in graph.samples)
    assert module.state is ait.ModuleState.TUNED
    with torch.no_grad():
        torch.testing.assert_close(module(other), model(other))


class FailsAfterTuning(TorchEagerBackend):
    """Right while tuned; once ``failing`` is set, every call raises (as a backend does when its device runs
    out of memory or its runtime breaks after tuning)."""

    name = "test_fails_after_tuning"
    passthrough = False
    failing = False

    def _infer(self, args, kwargs):
        if FailsAfterTuning.failing:
            raise RuntimeError("kernel launch failed")
        return super()._infer(args, kwargs)


def test_a_backend_that_raises_at_run_time_runs_eager_with_one_warning(fast_profiling, caplog, monkeypatch):
    """README "A failing backend never takes the run down": a call whose backend raises runs eager, with one
    warning over every such call (recorded shapes and new ones alike)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    model.requires_grad_(False)  # inference: no autograd that would send calls to eager
    strategy = ait.OneBackendStrategy(FailsAfterTuning(), profiling_config=fast_profiling)
    tuned = ait.Module(model, "raising", strategy=strategy.enable_performance_validation(False))
    ait.tune(tuned, [torch.randn(2, 8), torch.randn(4, 8)], ready_batches=True)
    assert tuned.backends["graph0"].name == "test_fails_after_tuning"
    monkeypatch.setattr(FailsAfterTuning, "failing", True)
    inputs = [torch.randn(batch, 8) for batch in (2, 4, 2, 7, 3)]
    with caplog.at_level(logging.WARNING, logger="aitune"):
        outputs = [tuned(x) for x in inputs]
    with torch.no_grad():
        for x, out in zip(inputs, outputs):
            torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
                and r.getMessage().startswith("raising:")]  # not the cache-disk-space note a full disk adds
    assert len(warnings) == 1, warnings
    assert "test_fails_after_tuning raised RuntimeError: kernel launch failed; running eager instead" in warnings[0]
    assert tuned.stats["eager_fallbacks"] == {"error": 5} and tuned.stats["backend_calls"] == 0

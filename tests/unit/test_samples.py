import itertools
import math

import pytest
import torch

from aitune.errors import ConfigError
from aitune.torch.backend import TorchEagerBackend
from aitune.torch.record.samples import BATCH, DYNAMIC, STATIC, BatchDim, CallSignature, DynamicDim, clone_tree, \
    Sample, record_graphs, same_values


class Toggle(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x, residual: bool = True, *, keep=None, **extra):
        return self.fc(x) + (x if residual else 0)


def test_positional_and_keyword_calls_are_one_graph():
    module = Toggle()
    x = torch.randn(2, 4)
    graphs = record_graphs(module, [((x,), {}), ((), {"x": x}), ((x, True), {})])
    # x positional == x keyword; an explicit default is a different (but equivalent) call form.
    assert [g.num_calls for g in graphs] == [2, 1]


def test_constants_none_rank_and_dtype_split_graphs():
    class Identity(torch.nn.Module):
        def forward(self, x, flag: bool = True, keep=None):
            return x

    x = torch.randn(2, 4)
    calls = [((x,), {}), ((x, False), {}), ((x,), {"keep": x > 0}), ((x.double(),), {}), ((x[None],), {}),
             ((torch.randn(3, 4),), {})]
    graphs = record_graphs(Identity(), calls)
    assert [g.num_calls for g in graphs] == [2, 1, 1, 1, 1]
    assert graphs[1].constants == {"flag": False}
    assert len(graphs[2].tensor_specs) == 2


def test_dynamic_and_batch_axes():
    module = torch.nn.Linear(8, 2)
    calls = [((torch.randn(b, t, 8),), {}) for b, t in ((1, 5), (4, 5), (2, 9))]
    graph = record_graphs(module, calls)[0]
    spec = graph.tensor_specs[0]
    assert spec.axes == [BATCH, DYNAMIC, STATIC]
    assert spec.min_shape == [1, 5, 8] and spec.max_shape == [4, 9, 8]
    assert graph.covers([torch.randn(3, 7, 8)]) and not graph.covers([torch.randn(5, 7, 8)])


def test_declared_dims_validate_and_set_range():
    with pytest.raises(ConfigError):
        DynamicDim("t", 4, 2)
    with pytest.raises(ConfigError):
        BatchDim("b", 1, 8, opt=9)
    module = torch.nn.Linear(8, 2)
    graph = record_graphs(module, [((torch.randn(2, 8),), {})],
                          dynamic_shapes={"input": (BatchDim("batch", 1, 32), 8)})[0]
    assert graph.tensor_specs[0].axes[0] == BATCH
    assert graph.shape_range(graph.tensor_specs[0]) == ([1, 8], [32, 8], [32, 8])
    with pytest.raises(ConfigError, match="outside the declared"):
        record_graphs(module, [((torch.randn(40, 8),), {})], dynamic_shapes={"input": (BatchDim("batch", 1, 32), 8)})


def test_sample_cap_keeps_range_extremes():
    module = torch.nn.Linear(3, 3)
    sizes = [5, 6, 7, 1, 8, 20]
    graph = record_graphs(module, [((torch.randn(b, 3),), {}) for b in sizes], max_samples=3)[0]
    kept = sorted(s.batch_size for s in graph.samples)
    assert 1 in kept and 20 in kept and len(kept) == 3


def test_recording_clones_and_detects_input_mutation():
    class Center(torch.nn.Module):
        def forward(self, x):
            x.sub_(x.mean(-1, keepdim=True))
            return x

    x = torch.randn(2, 5) + 3
    graph = record_graphs(Center(), [((x,), {})])[0]
    assert graph.mutated_inputs == ["x"]
    assert not torch.allclose(graph.samples[0].args[0] if graph.samples[0].args else graph.samples[0].kwargs["x"], x)


def test_clone_tree_leaves_inference_mode():
    with torch.inference_mode():
        x = torch.randn(2)
    copy = clone_tree({"x": x})
    assert not copy["x"].is_inference() and torch.equal(copy["x"], x)


def test_call_signature_matches_python_errors():
    signature = CallSignature(Toggle().forward)
    with pytest.raises(TypeError):
        signature.normalize((), {})
    assert signature.normalize((1,), {"z": 2, "a": 1}) == ((), {"x": 1, "a": 1, "z": 2})
    assert math.isnan(float("nan"))


def test_extremes_of_every_axis_are_kept():
    class Identity(torch.nn.Module):
        def forward(self, x):
            return x

    shapes = [(1, 512), (32, 8), (4, 4), (64, 600)]
    graph = record_graphs(Identity(), [((torch.randn(*s),), {}) for s in shapes], max_samples=3)[0]
    kept = sorted(tuple(s.leaves()[0].shape) for s in graph.samples)
    # smallest batch (1), smallest length (4), largest of both (64, 600): (32, 8) holds no extreme.
    assert kept == [(1, 512), (4, 4), (64, 600)]


def test_graph_spec_json_round_trip():
    from aitune.torch.record.samples import GraphSpec, TensorSpec

    class Model(torch.nn.Module):
        def forward(self, tokens, scale=1.0):
            return tokens * scale

    model = Model()
    dynamic = {"tokens": (BatchDim("batch", 1, 8), DynamicDim("length", 2, 16))}
    calls = [((torch.randn(2, 5),), {"scale": 0.5}), ((torch.randn(4, 7),), {"scale": 0.5})]
    graph = record_graphs(model, calls, dynamic_shapes=dynamic)[0]
    data = graph.to_json("model")
    assert data["tensor_specs"][0]["device"] == "cpu" and data["tensor_specs"][0]["multipliers"] == [None, None]
    assert data["constants"] == [{"leaf_index": 1, "path": "scale", "value": 0.5}]
    spec = graph.tensor_specs[0]
    assert TensorSpec.from_json(spec.to_json()).to_json() == spec.to_json()  # NaN != NaN: compare JSON forms
    assert TensorSpec.from_json(spec.to_json()).dims == spec.dims
    restored = GraphSpec.from_json({**data, "name": graph.name}, graph.samples, graph.signature,
                                   output_spec=graph.output_spec)
    assert restored.to_json("model") == data and restored.key == graph.key
    assert restored.constants == {"scale": 0.5} and restored.input_names == graph.input_names
    assert restored.shape_range(restored.tensor_specs[0]) == graph.shape_range(spec)


class PositionalOnly(torch.nn.Module):
    def forward(self, x, /, y=None):
        return x


class StarArgs(torch.nn.Module):
    def forward(self, x, *rest):
        return x


@pytest.mark.parametrize("call", [((1,), {}), ((1, False), {}), ((), {"x": 1}), ((1,), {"keep": 3}),
                                  ((), {"keep": 3, "x": 1, "residual": False}), ((1,), {"z": 2, "a": 1}),
                                  ((1, True), {"b": 5})])
def test_a_call_plan_normalises_later_calls_of_the_same_shape_like_normalize(call):
    # NOTE [dispatch fast path]: ait.Module keeps the plan of a call shape and skips binding on later calls
    signature = CallSignature(Toggle().forward)
    args, kwargs = call
    plan = signature.plan(args, kwargs)
    assert plan is not None
    later_args = tuple(object() for _ in args)  # other values, same positional count and keyword names/order
    later_kwargs = {name: object() for name in kwargs}
    planned, expected = plan(later_args, later_kwargs), signature.normalize(later_args, later_kwargs)
    assert planned[0] == expected[0] == ()
    assert list(planned[1]) == list(expected[1])  # same names in the same order
    assert all(planned[1][name] is expected[1][name] for name in expected[1])


def test_no_plan_where_binding_is_needed():
    assert CallSignature(Toggle().forward).plan((), {}) is None  # Python rejects it: normalize raises TypeError
    assert CallSignature(Toggle().forward).plan((1,), {"x": 2}) is None  # x given twice
    assert CallSignature(PositionalOnly().forward).plan((1,), {}) is None
    assert CallSignature(StarArgs().forward).plan((1, 2, 3), {}) is None


class RunningMean(torch.nn.Module):
    """Stateful: every call updates a running mean of its inputs (as BatchNorm's statistics do) and uses it."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)
        self.register_buffer("mean", torch.zeros(8))

    def forward(self, x):
        self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return self.fc(x - self.mean)


def test_calls_of_one_shape_with_different_values_are_kept_two_per_shape():
    """README "Stateful modules": calls of one shape with different values are kept (two per shape); a repeat of
    a kept call is not."""
    first, second, third = (torch.randn(4, 8) for _ in range(3))
    calls = [((first,), {}), ((first.clone(),), {}), ((second,), {}), ((third,), {}), ((torch.randn(2, 8),), {})]
    graph = record_graphs(RunningMean(), calls)[0]
    assert graph.stateful
    same_shape = [sample.leaves()[0] for sample in graph.samples if sample.leaves()[0].shape == (4, 8)]
    assert len(same_shape) == 2
    assert torch.equal(same_shape[0], first) and torch.equal(same_shape[1], second)
    assert len(graph.samples) == 3 and graph.num_calls == 5


class FirstCallOfEachShape(TorchEagerBackend):
    """Answers every call of a shape with what it computed for the first call of that shape: right on one call
    per shape, wrong on any other values (an artifact with a baked-in result)."""

    name = "test_first_call_of_each_shape"
    passthrough = False

    def _infer(self, args, kwargs):
        x = (list(args) + list(kwargs.values()))[0]
        memo = self.__dict__.setdefault("_memo", {})
        if x.shape not in memo:
            memo[x.shape] = super()._infer(args, kwargs)
        return memo[x.shape].clone()


def test_a_second_call_of_a_shape_catches_a_candidate_right_on_the_first_only(fast_profiling):
    """The kept second call is checked: with probes off, only it can show the fault of a stateful module's
    candidate that is right on the first call of each shape."""
    import aitune.torch as ait

    model = RunningMean().eval()
    strategy = ait.OneBackendStrategy(FirstCallOfEachShape(), profiling_config=fast_profiling,
                                      probe_config=ait.ProbeConfig(enabled=False))
    tuned = ait.Module(model, "running", strategy=strategy.enable_performance_validation(False))
    report = ait.tune(tuned, [torch.randn(4, 8), torch.randn(4, 8)], ready_batches=True)
    assert report.graphs[0].spec["stateful"] and report.graphs[0].spec["num_samples"] == 2
    assert report.rows[0].status == "rejected (correctness)", report.rows[0].reason
    assert tuned.state is ait.ModuleState.PASSTHROUGH


def test_same_values_counts_nan_where_both_have_it_for_floating_and_complex_tensors():
    """One helper serves the recorder (did a call change its inputs?) and the checks (did a candidate write into
    its inputs?)."""
    nan = float("nan")
    floats = torch.tensor([1.0, nan, 3.0])
    assert same_values(floats, floats.clone())
    assert not same_values(floats, torch.tensor([1.0, 2.0, nan]))
    assert not same_values(floats, floats.double())  # dtype differs
    assert not same_values(floats, floats[:2])  # shape differs
    complex_values = torch.tensor([complex(nan, 0.0), 1 + 2j])
    assert same_values(complex_values, complex_values.clone())
    assert not same_values(complex_values, torch.tensor([complex(nan, 0.0), 1 + 3j]))
    integers = torch.arange(4)
    assert same_values(integers, integers.clone()) and not same_values(integers, integers.flip(0))


class LateCounter(torch.nn.Module):
    """From its ``start``-th call on, counts its calls in a plain attribute (a state change that begins late; the
    calls before are ticked on an iterator, which state marks hold by identity)."""

    def __init__(self, start: int):
        super().__init__()
        self.start, self.ticks, self.count = start, itertools.count(), 0

    def forward(self, x):
        if next(self.ticks) >= self.start:
            self.count += 1
        return x * 2


class GrowingTable(torch.nn.Module):
    """Keeps a table as long as the longest input seen, grown once when a longer one comes (as older rotary
    embeddings grow their cos/sin cache)."""

    def __init__(self):
        super().__init__()
        self.table = torch.zeros(4)  # a plain tensor attribute (older rotary embeddings keep theirs so)

    def forward(self, x):
        if x.shape[-1] > self.table.numel():
            self.table = torch.zeros(x.shape[-1])
        return x + self.table[: x.shape[-1]]


def test_state_is_marked_on_a_graphs_first_calls_new_shapes_and_every_16th_call_until_found(monkeypatch):
    """NOTE [state checks while recording] in aitune/torch/record/samples.py: the module's state is marked before
    and after a graph's first 8 recorded calls, every call of shapes new to the graph and every 16th call; a
    forward that starts changing state later is found at the next marked call, one that grows state for a longer
    input at that call; once found, no more marking."""
    import aitune.torch.record.samples as samples

    marks = []
    real = samples.state_marks
    monkeypatch.setattr(samples, "state_marks", lambda module: marks.append(1) or real(module))
    calls = [((torch.randn(2, 3),), {}) for _ in range(40)]
    graph = record_graphs(LateCounter(start=10**6), calls)[0]
    assert len(marks) == 2 * (8 + 2) and not graph.stateful  # calls 0-7, 16 and 32, each before and after
    marks.clear()
    late = record_graphs(LateCounter(start=20), calls)[0]  # `count` moves from call 20 on, at every call
    assert late.stateful and late.stateful_reason == "forward changes attribute `count`"
    assert len(marks) == 2 * (8 + 2)  # found at call 32: none marked after it
    lengths = [3] * 20 + [6] + [3] * 19  # the one longer input is call 21, not one of the periodic checks
    grown = record_graphs(GrowingTable(), [((torch.randn(1, n),), {}) for n in lengths])[0]
    assert grown.stateful and grown.stateful_reason == "forward changes attribute `table`"


def test_a_samples_shapes_follow_its_arguments():
    sample = Sample((torch.zeros(2, 3),), {"y": torch.zeros(4)}, 2)
    assert sample.shapes() == ((2, 3), (4,))
    sample.kwargs["z"] = torch.zeros(5, 1)  # a key added in place
    assert sample.shapes() == ((2, 3), (4,), (5, 1))
    sample.args = (torch.zeros(7),)
    assert sample.shapes() == ((7,), (4,), (5, 1))
    sample.kwargs["y"] = torch.zeros(9)  # a value replaced in place
    assert sample.shapes() == ((7,), (9,), (5, 1))

"""The TensorRT runtime's I/O binding logic (:class:`TensorRTRunner`) against a TEST DOUBLE of TensorRT.

TensorRT cannot be installed on any machine of this project, so these tests drive our runner against
``FakeTensorRTEngine`` / ``FakeExecutionContext`` / ``fake_trt``: a stand-in for the TensorRT >= 10 Python
API subset the runner uses (name-based I/O, optimization profiles, ``set_input_shape``/``set_tensor_address``,
``get_tensor_shape`` with -1 for data-dependent outputs, ``IOutputAllocator``, ``execute_async_v3``).
The double is deliberately strict where TensorRT is: it reads inputs from the raw addresses it was given
(so a non-contiguous or wrongly typed buffer gives wrong values), rejects shapes outside the active
profile, and writes outputs to the given addresses or to memory from the output allocator.

The double lives in ``fake_tensorrt.py`` beside this file. What this proves: our binding logic (names,
profile choice and switching, dtype conversion, contiguity, output sizing, data-dependent outputs, fresh
output buffers, error messages). What it cannot prove: that
real TensorRT behaves like the double; that is exercised only where TensorRT is installed.
"""

import pytest
import torch

from aitune.errors import BackendRuntimeError
from aitune.torch.backend.flat import FlatIO
from aitune.torch.backend.tensorrt.runtime import TensorRTRunner
from aitune.torch.record.samples import record_graphs
from fake_tensorrt import FakeDataType, FakeTensorRTEngine, fake_trt


# --------------------------------------------------------------------------------------------- tests


def linear_engine(profiles, weight, input_dtype=FakeDataType.FLOAT, output_dtype=FakeDataType.FLOAT):
    return FakeTensorRTEngine({"input_x": (input_dtype, profiles)}, {"output": output_dtype},
                              lambda inputs: {"output": inputs["input_x"].float() @ weight})


def test_runs_and_matches_reference_with_nested_io_through_flatio():
    class Nested(torch.nn.Module):
        def forward(self, batch):
            hidden = batch["tokens"].float() * batch["scale"]
            return {"hidden": hidden, "stats": (hidden.sum(-1), "tag")}

    module = Nested()
    calls = [(({"tokens": torch.randint(0, 9, (b, 5)), "scale": torch.rand(b, 5)},), {}) for b in (2, 4)]
    graph = record_graphs(module, calls)[0]
    sample = graph.samples[0].clone()
    io = FlatIO(graph, module(*sample.args, **sample.kwargs))
    assert io.input_names == ["input_batch_tokens", "input_batch_scale"]
    assert io.output_names == ["output_hidden", "output_stats_0"]
    profile = [((1, 5), (4, 5), (8, 5))]

    def compute(inputs):
        hidden = inputs["input_batch_tokens"].float() * inputs["input_batch_scale"]
        return {"output_hidden": hidden, "output_stats_0": hidden.sum(-1)}

    engine = FakeTensorRTEngine({"input_batch_tokens": (FakeDataType.INT64, profile),
                                 "input_batch_scale": (FakeDataType.FLOAT, profile)},
                                {"output_hidden": FakeDataType.FLOAT, "output_stats_0": FakeDataType.FLOAT}, compute)
    runner = TensorRTRunner(engine, fake_trt, "cpu", io.input_names, io.output_names, io.output_dtypes)
    args = ({"tokens": torch.randint(0, 9, (3, 5)), "scale": torch.rand(3, 5)},)
    output = io.outputs(runner.run(io.inputs(args, {})))
    expected = module(*args)
    torch.testing.assert_close(output["hidden"], expected["hidden"])
    torch.testing.assert_close(output["stats"][0], expected["stats"][0])
    assert output["stats"][1] == "tag"


def test_profile_selection_switches_profiles_and_out_of_profile_is_a_clear_error():
    weight = torch.randn(4, 2)
    engine = linear_engine([((1, 4), (2, 4), (2, 4)), ((3, 4), (8, 4), (8, 4))], weight)
    runner = TensorRTRunner(engine, fake_trt, "cpu", ["input_x"], ["output"], input_paths={"input_x": "x"})
    assert runner.profiles == [{"input_x": ((1, 4), (2, 4), (2, 4))}, {"input_x": ((3, 4), (8, 4), (8, 4))}]
    context = engine.contexts[0]
    for batch, profile in ((2, 0), (6, 1), (8, 1), (1, 0)):
        x = torch.randn(batch, 4)
        torch.testing.assert_close(runner.run([x])[0], x @ weight)
        assert runner.active_profile == profile
    assert context.profile_switches == [1, 0]  # switched only when needed
    with pytest.raises(BackendRuntimeError) as error:
        runner.run([torch.randn(9, 4)])
    assert str(error.value).startswith("input shape outside every TensorRT optimization profile: x [9, 4]; "
                                       "profile 0: x min [1, 4] max [2, 4]; profile 1: x min [3, 4] max [8, 4]")
    assert context.executions == 4  # the refused call never reached the engine


def test_restore_shapes_puts_back_profile_and_shapes_for_a_graph_replay():
    weight = torch.randn(4, 2)
    engine = linear_engine([((1, 4), (2, 4), (2, 4)), ((3, 4), (8, 4), (8, 4))], weight)
    runner = TensorRTRunner(engine, fake_trt, "cpu", ["input_x"], ["output"], input_paths={"input_x": "x"})
    context = engine.contexts[0]
    small = torch.randn(2, 4)
    runner.run([small])
    runner.run([torch.randn(6, 4)])  # another shape in between: profile 1, shape (6, 4)
    executions = context.executions
    runner.restore_shapes([small])
    assert runner.active_profile == 0 and context.profile == 0 and context.shapes["input_x"] == (2, 4)
    assert context.executions == executions  # host-side state only, nothing ran
    with pytest.raises(BackendRuntimeError, match="outside every TensorRT optimization profile"):
        runner.restore_shapes([torch.randn(9, 4)])


def test_c27_batches_inside_and_outside_the_profile():
    weight = torch.randn(12, 4)
    engine = linear_engine([((1, 12), (8, 12), (16, 12))], weight)
    runner = TensorRTRunner(engine, fake_trt, "cpu", ["input_x"], ["output"], input_paths={"input_x": "x"})
    for batch in (1, 5, 16):
        x = torch.randn(batch, 12)
        output = runner.run([x])[0]
        assert output.shape == (batch, 4)  # never padded to the profile's max (NVIDIA/TensorRT#4035)
        torch.testing.assert_close(output, x @ weight)
    for batch in (17, 64):
        assert runner.profile_for([torch.randn(batch, 12)]) is None
        with pytest.raises(BackendRuntimeError, match=rf"x \[{batch}, 12\]; profile 0: x min \[1, 12\] max \[16, 12\]"):
            runner.run([torch.randn(batch, 12)])


def test_non_contiguous_inputs_are_made_contiguous():
    weight = torch.randn(4, 3)
    runner = TensorRTRunner(linear_engine([((1, 4), (4, 4), (8, 4))], weight), fake_trt, "cpu", ["input_x"], ["output"])
    x = torch.randn(4, 3).t()  # a transposed view: shape (3, 4), strides (1, 3)
    assert not x.is_contiguous()
    torch.testing.assert_close(runner.run([x])[0], x @ weight)


def test_int64_inputs_convert_to_int32_engines_and_refuse_overflow():
    weight = torch.randn(3, 2)
    engine = linear_engine([((1, 3), (2, 3), (4, 3))], weight, input_dtype=FakeDataType.INT32)
    runner = TensorRTRunner(engine, fake_trt, "cpu", ["input_x"], ["output"],
                            input_paths={"input_x": "input_ids"})
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int64)
    torch.testing.assert_close(runner.run([ids])[0], ids.float() @ weight)
    with pytest.raises(BackendRuntimeError, match=r"int64 input input_ids holds values in \[1, 4294967296\], "
                                                  r"outside the int32 range"):
        runner.run([torch.tensor([[1, 2, 2 ** 32]], dtype=torch.int64)])
    # An int64 engine input (TensorRT >= 10) takes int64 as is, beyond the int32 range too.
    engine64 = FakeTensorRTEngine({"input_x": (FakeDataType.INT64, [((1,), (2,), (4,))])}, {"output": FakeDataType.INT64},
                                  lambda inputs: {"output": inputs["input_x"] + 1})
    runner64 = TensorRTRunner(engine64, fake_trt, "cpu", ["input_x"], ["output"])
    big = torch.tensor([2 ** 40, -(2 ** 40)], dtype=torch.int64)
    assert torch.equal(runner64.run([big])[0], big + 1)


def test_float_input_to_int_engine_is_refused():
    engine = linear_engine([((1, 3), (2, 3), (4, 3))], torch.randn(3, 2), input_dtype=FakeDataType.INT32)
    runner = TensorRTRunner(engine, fake_trt, "cpu", ["input_x"], ["output"], input_paths={"input_x": "x"})
    with pytest.raises(BackendRuntimeError, match="input x is torch.float32 but the engine expects torch.int32"):
        runner.run([torch.randn(2, 3)])


def test_outputs_are_cast_to_eager_dtypes():
    """An fp16 engine output (autocast without keep_io_types) comes back as eager's fp32."""
    weight = torch.randn(4, 2)
    engine = linear_engine([((1, 4), (2, 4), (4, 4))], weight, input_dtype=FakeDataType.HALF,
                           output_dtype=FakeDataType.HALF)
    runner = TensorRTRunner(engine, fake_trt, "cpu", ["input_x"], ["output"], output_dtypes=[torch.float32])
    x = torch.randn(3, 4)
    output = runner.run([x])[0]
    assert output.dtype == torch.float32
    torch.testing.assert_close(output, x.half().float() @ weight, atol=1e-2, rtol=1e-2)


def test_data_dependent_outputs_use_the_output_allocator():
    engine = FakeTensorRTEngine({"input_x": (FakeDataType.FLOAT, [((1,), (8,), (16,))])},
                                {"output_idx": FakeDataType.INT64, "output_y": FakeDataType.FLOAT},
                                lambda inputs: {"output_idx": torch.nonzero(inputs["input_x"] > 0).flatten(),
                                                "output_y": inputs["input_x"] * 2},
                                data_dependent={"output_idx"})
    runner = TensorRTRunner(engine, fake_trt, "cpu", ["input_x"], ["output_idx", "output_y"])
    x = torch.tensor([1.0, -1.0, 2.0, 0.0, 3.0])
    idx, y = runner.run([x])
    assert torch.equal(idx, torch.tensor([0, 2, 4])) and torch.equal(y, x * 2)
    assert runner.data_dependent_outputs == {"output_idx"}
    x2 = torch.tensor([-1.0, 5.0])
    idx2, _ = runner.run([x2])
    assert torch.equal(idx2, torch.tensor([1]))
    assert torch.equal(idx, torch.tensor([0, 2, 4]))  # the first call's output is intact (fresh buffers)


def test_outputs_of_earlier_calls_are_never_overwritten():
    """Every call returns fresh output tensors."""
    weight = torch.randn(4, 4)
    runner = TensorRTRunner(linear_engine([((1, 4), (2, 4), (4, 4))], weight), fake_trt, "cpu", ["input_x"], ["output"])
    a, b = torch.randn(2, 4), torch.randn(2, 4)
    y_a = runner.run([a])[0]
    y_b = runner.run([b])[0]
    torch.testing.assert_close(y_a, a @ weight)
    torch.testing.assert_close(y_b, b @ weight)


def test_engine_and_graph_names_must_match():
    engine = linear_engine([((1, 4), (2, 4), (4, 4))], torch.randn(4, 4))
    with pytest.raises(BackendRuntimeError, match=r"engine inputs \['input_x'\] are not among the module's tensor "
                                                  r"inputs \['input_y'\]"):
        TensorRTRunner(engine, fake_trt, "cpu", ["input_y"], ["output"])
    with pytest.raises(BackendRuntimeError, match=r"engine has no outputs named \['output_0'\]"):
        TensorRTRunner(engine, fake_trt, "cpu", ["input_x"], ["output_0"])
    # A graph input the exporter dropped (unused) is simply not bound.
    weight = torch.randn(4, 4)
    runner = TensorRTRunner(linear_engine([((1, 4), (2, 4), (4, 4))], weight), fake_trt, "cpu",
                            ["input_unused", "input_x"], ["output"])
    x = torch.randn(2, 4)
    torch.testing.assert_close(runner.run([torch.randn(7), x])[0], x @ weight)

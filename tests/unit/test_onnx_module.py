"""OnnxModule: an existing .onnx file (made here by torch.onnx.export) run by ONNX Runtime on the CPU, tuned by the
backends that take the file as it is, saved and loaded; bad files and calls that do not fit get clear errors."""

import hashlib
import inspect
import json
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

import aitune.torch as ait  # noqa: E402
from aitune.errors import OnnxFileError, OnnxInputError  # noqa: E402
from aitune.torch.backend import ONNXRuntimeBackend, TorchInductorJitBackend  # noqa: E402
from aitune.torch.backend.base import Check  # noqa: E402
from aitune.torch.record.samples import record_graphs  # noqa: E402
from readme_blocks import run_readme_block  # noqa: E402


class Net(torch.nn.Module):
    """Two inputs (a dynamic batch axis, fixed feature sizes), two outputs."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 4)

    def forward(self, x, mask):
        return torch.tanh(self.proj(x)) * mask, x.sum(-1)


def _export(path: Path, dynamic: bool = True, seed: int = 0) -> Net:
    torch.manual_seed(seed)
    net = Net().eval()
    axes = {"x": {0: "batch"}, "mask": {0: "batch"}, "y": {0: "batch"}, "total": {0: "batch"}} if dynamic else None
    torch.onnx.export(net, (torch.randn(2, 8), torch.ones(2, 4)), str(path), input_names=["x", "mask"],
                      output_names=["y", "total"], dynamic_axes=axes, dynamo=False)
    return net


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One ONNX file with a dynamic batch axis, shared by the tests (never written to by them)."""
    path = tmp_path_factory.mktemp("onnx") / "net.onnx"
    return _export(path), path


def _with_external_data(source: Path, folder: Path, location: str = "weights/net.data") -> Path:
    """``source`` saved again in ``folder`` with every initializer in one external data file at ``location``."""
    (folder / location).parent.mkdir(parents=True, exist_ok=True)
    model = onnx.load(str(source))
    target = folder / "net_ext.onnx"
    onnx.save_model(model, str(target), save_as_external_data=True, all_tensors_to_one_file=True, location=location,
                    size_threshold=0)
    return target


def _relocate(model_path: Path, location: str) -> None:
    """Point every external data entry of ``model_path`` at ``location`` (the data itself is not touched)."""
    model = onnx.load(str(model_path), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    model_path.write_bytes(model.SerializeToString())


def _digest(*paths: Path) -> list[str]:
    return [hashlib.sha256(path.read_bytes()).hexdigest() for path in paths]


def _calls(*batches: int):
    return [(torch.randn(b, 8), torch.rand(b, 4)) for b in batches]


# ---- the untuned module


def test_untuned_outputs_equal_the_source_module_and_the_file_is_described(exported):
    net, path = exported
    module = ait.OnnxModule(path)
    assert module.input_names == ["x", "mask"] and module.output_names == ["y", "total"]
    assert [value.dtype for value in module.inputs] == [torch.float32, torch.float32]
    assert module.inputs[0].shape == ("batch", 8) and module.outputs[1].shape == ("batch",)
    assert module.dynamic_axes == {"x": {0: "batch"}, "mask": {0: "batch"}, "y": {0: "batch"}, "total": {0: "batch"}}
    assert list(inspect.signature(module.forward).parameters) == ["x", "mask"]
    assert module.external_data == [] and not module.training
    for x, mask in _calls(1, 3, 7):  # two (three) batch sizes through the dynamic axis
        y, total = module(x, mask=mask)
        expected = net(x, mask)
        torch.testing.assert_close(y, expected[0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(total, expected[1], atol=1e-5, rtol=1e-5)
        assert y.device.type == "cpu" and y.dtype == torch.float32


def test_io_binding_path_gives_the_same_outputs(exported):
    """The IOBinding code (what runs on CUDA) executed on the CPU."""
    _, path = exported
    module = ait.OnnxModule(path)
    x, mask = _calls(3)[0]
    plain = module(x, mask)
    module._runtime.use_io_binding = True
    module._runtime.session = None
    bound = module(x, mask)
    for a, b in zip(plain, bound):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_single_output_is_a_tensor_and_a_fixed_axis_is_not_dynamic(tmp_path):
    class One(torch.nn.Module):
        def forward(self, x):
            return x * 2

    path = tmp_path / "one.onnx"
    torch.onnx.export(One(), (torch.randn(2, 3),), str(path), input_names=["x"], output_names=["y"], dynamo=False)
    module = ait.OnnxModule(path)
    assert module.dynamic_axes == {} and module.inputs[0].shape == (2, 3)
    out = module(torch.ones(2, 3))
    assert isinstance(out, torch.Tensor) and torch.equal(out, torch.full((2, 3), 2.0))


def test_moves_drop_the_session_and_meta_is_refused(exported):
    _, path = exported
    module = ait.OnnxModule(path)
    x, mask = _calls(2)[0]
    expected = module(x, mask)
    assert module._runtime.session is not None
    module.to("meta")
    assert module.device.type == "meta" and module._runtime.session is None
    with pytest.raises(OnnxInputError, match="on cpu, the module on meta"):
        module(x, mask)
    module.to_empty(device="cpu")  # torch's way back from 'meta' (the anchor holds no data)
    torch.testing.assert_close(module(x, mask)[0], expected[0], atol=0, rtol=0)


def test_calls_that_do_not_fit_the_file_are_refused(exported):
    _, path = exported
    module = ait.OnnxModule(path)
    x, mask = _calls(2)[0]
    cases = [
        (lambda: module(x, mask, x), r"takes 2 input\(s\) \(x, mask\), got 3 positional"),
        (lambda: module(x), r"missing input\(s\) 'mask'"),
        (lambda: module(x, mask=mask, bias=mask), r"no input named 'bias'; its inputs are 'x', 'mask'"),
        (lambda: module(x, x=x, mask=mask), r"got input 'x' twice"),
        (lambda: module(x.double(), mask), r"input 'x' is float64 but the file declares float32\[batch, 8\]"),
        (lambda: module(x[0], mask), r"input 'x' has rank 1 .* declares rank 2"),
        (lambda: module(torch.randn(2, 7), mask), r"input 'x' has size 7 on axis 1 .* fixes it to 8"),
        (lambda: module(x, 1.0), r"input 'mask' must be a torch.Tensor"),
    ]
    for call, message in cases:
        with pytest.raises(OnnxInputError, match=message):
            call()


# ---- files


def test_external_data_runs_and_is_listed(exported, tmp_path):
    net, path = exported
    ext = _with_external_data(path, tmp_path / "model")
    assert (tmp_path / "model" / "weights" / "net.data").is_file()
    module = ait.OnnxModule(ext)
    assert module.external_data == ["weights/net.data"]
    x, mask = _calls(3)[0]
    torch.testing.assert_close(module(x, mask)[0], net(x, mask)[0], atol=1e-6, rtol=1e-5)


def test_bad_files_are_refused_with_the_file_and_the_fix(exported, tmp_path):
    _, path = exported
    with pytest.raises(OnnxFileError, match="does not exist"):
        ait.OnnxModule(tmp_path / "nowhere.onnx")
    text = tmp_path / "text.onnx"
    text.write_text("this is not an ONNX model\n")
    with pytest.raises(OnnxFileError, match=r"text\.onnx is not a valid ONNX model"):
        ait.OnnxModule(text)
    truncated = tmp_path / "truncated.onnx"
    data = path.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(OnnxFileError, match=r"truncated\.onnx is not a valid ONNX model"):
        ait.OnnxModule(truncated)


def test_external_data_outside_the_folder_or_missing_is_refused(exported, tmp_path):
    _, path = exported
    ext = _with_external_data(path, tmp_path / "model", location="net.data")
    data = tmp_path / "model" / "net.data"
    outside = tmp_path / "outside.data"
    outside.write_bytes(data.read_bytes())

    _relocate(ext, str(outside))  # absolute
    with pytest.raises(OnnxFileError, match=r"external data location '.*outside\.data' is an absolute path"):
        ait.OnnxModule(ext)
    _relocate(ext, "../outside.data")
    with pytest.raises(OnnxFileError, match=r"'\.\./outside\.data' leaves the model's folder .* through '\.\.'"):
        ait.OnnxModule(ext)
    (tmp_path / "model" / "link.data").symlink_to(outside)
    _relocate(ext, "link.data")
    with pytest.raises(OnnxFileError, match=r"'link\.data' resolves to .*outside\.data, outside the model's folder"):
        ait.OnnxModule(ext)
    _relocate(ext, "net.data")
    ait.OnnxModule(ext)  # back inside: accepted
    data.unlink()
    with pytest.raises(OnnxFileError, match=r"external data file 'net\.data' is missing"):
        ait.OnnxModule(ext)


def _if_with_external_branch(folder: Path, location: str) -> Path:
    """A graph ``y = x + (If cond: then c else ones)`` whose ``then`` branch holds its constant ``c`` (= [0, 10,
    20, 30]) as external data at ``location`` (written next to the model): tensors inside subgraphs."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper
    from onnx.external_data_helper import set_external_data

    folder.mkdir(parents=True, exist_ok=True)
    constant = numpy_helper.from_array(np.arange(4, dtype=np.float32).reshape(1, 4) * 10, "c")
    (folder / location).resolve().write_bytes(constant.raw_data)
    set_external_data(constant, location=location, offset=0, length=len(constant.raw_data))
    constant.ClearField("raw_data")
    constant.data_location = TensorProto.EXTERNAL
    row = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 4]) for name in ("t", "e", "x", "y")]
    then_branch = helper.make_graph([helper.make_node("Identity", ["c"], ["t"])], "then", [], [row[0]],
                                    initializer=[constant])
    else_branch = helper.make_graph([helper.make_node("Constant", [], ["e"], value=numpy_helper.from_array(
        np.ones((1, 4), np.float32)))], "else", [], [row[1]])
    graph = helper.make_graph(
        [helper.make_node("If", ["cond"], ["picked"], then_branch=then_branch, else_branch=else_branch),
         helper.make_node("Add", ["x", "picked"], ["y"])], "g",
        [helper.make_tensor_value_info("cond", TensorProto.BOOL, []), row[2]], [row[3]])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = folder / "if.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def test_external_data_inside_control_flow_subgraphs_is_listed_checked_and_saved(tmp_path, fast_profiling):
    path = _if_with_external_branch(tmp_path / "model", "then.data")
    module = ait.OnnxModule(path)
    assert module.external_data == ["then.data"]
    torch.testing.assert_close(module(torch.tensor(True), torch.zeros(1, 4)), torch.tensor([[0.0, 10, 20, 30]]))
    tuned = ait.Module(module, "onnx-if", strategy=ait.OneBackendStrategy(
        ONNXRuntimeBackend(), profiling_config=fast_profiling).enable_performance_validation(False))
    ait.tune(tuned, [(torch.tensor(True), torch.randn(1, 4)) for _ in range(2)], ready_batches=True,
             ignore_failing_modules=False)
    assert [f.name for f in tuned.deployment_artifacts()["graph0"].files] == ["if.onnx", "then.data"]
    stored = ait.save(tuned, str(tmp_path / "ckpt" / "if.ait"))
    loaded = ait.Module(ait.OnnxModule(path), "onnx-if")
    ait.load(loaded, stored)
    (tmp_path / "model" / "then.data").unlink()  # the loaded module runs the checkpoint's copy of the data
    torch.testing.assert_close(loaded(torch.tensor(True), torch.ones(1, 4)), torch.tensor([[1.0, 11, 21, 31]]))

    outside = _if_with_external_branch(tmp_path / "other" / "inner", "../outside.data")
    with pytest.raises(OnnxFileError, match=r"'\.\./outside\.data' leaves the model's folder .* through '\.\.'"):
        ait.OnnxModule(outside)


def test_external_data_inside_a_local_function_is_listed_and_checked(tmp_path):
    """A model-local function whose Constant holds external data: listed with the model's, '..' refused (the
    file is only read here; ONNX Runtime is not asked to run it)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper
    from onnx.external_data_helper import set_external_data

    def model_with(location: str) -> Path:
        value = numpy_helper.from_array(np.ones((1, 4), np.float32), "value")
        (tmp_path / "m" / location).resolve().parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "m" / location).resolve().write_bytes(value.raw_data)
        set_external_data(value, location=location, offset=0, length=len(value.raw_data))
        value.ClearField("raw_data")
        value.data_location = TensorProto.EXTERNAL
        function = helper.make_function("local", "AddOnes", ["x"], ["y"], [
            helper.make_node("Constant", [], ["c"], value=value), helper.make_node("Add", ["x", "c"], ["y"])],
            [helper.make_opsetid("", 17)])
        row = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 4]) for name in ("x", "y")]
        graph = helper.make_graph([helper.make_node("AddOnes", ["x"], ["y"], domain="local")], "g", [row[0]], [row[1]])
        model = helper.make_model(graph, functions=[function], opset_imports=[
            helper.make_opsetid("", 17), helper.make_opsetid("local", 1)])
        path = tmp_path / "m" / "f.onnx"
        path.write_bytes(model.SerializeToString())
        return path

    assert ait.OnnxModule(model_with("ones.data")).external_data == ["ones.data"]
    with pytest.raises(OnnxFileError, match=r"'\.\./ones\.data' leaves the model's folder"):
        ait.OnnxModule(model_with("../ones.data"))


@pytest.mark.parametrize("kind", ["sparse initializer", "sparse Constant"])
def test_external_data_of_sparse_tensors_is_listed(tmp_path, kind):
    """``y = x + c`` with ``c`` a sparse tensor ([1, 0, 0, 1]) whose values are external data: as a sparse
    initializer or a Constant's ``sparse_value``, the data file is the model's, and ONNX Runtime runs it."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper
    from onnx.external_data_helper import set_external_data

    (tmp_path / "m").mkdir()
    values = numpy_helper.from_array(np.ones(2, np.float32), "c")
    (tmp_path / "m" / "values.data").write_bytes(values.raw_data)
    set_external_data(values, location="values.data", offset=0, length=len(values.raw_data))
    values.ClearField("raw_data")
    values.data_location = TensorProto.EXTERNAL
    constant = helper.make_sparse_tensor(values, numpy_helper.from_array(np.array([0, 3], np.int64), "i"), [4])
    x, y = (helper.make_tensor_value_info(name, TensorProto.FLOAT, [4]) for name in ("x", "y"))
    if kind == "sparse Constant":
        graph = helper.make_graph([helper.make_node("Constant", [], ["c"], sparse_value=constant),
                                   helper.make_node("Add", ["x", "c"], ["y"])], "g", [x], [y])
    else:
        graph = helper.make_graph([helper.make_node("Add", ["x", "c"], ["y"])], "g", [x], [y],
                                  sparse_initializer=[constant])
    path = tmp_path / "m" / "sparse.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    module = ait.OnnxModule(path)
    assert module.external_data == ["values.data"]
    torch.testing.assert_close(module(torch.zeros(4)), torch.tensor([1.0, 0, 0, 1]))


# ---- tuning, checkpoints


def test_tune_builds_the_file_as_it_is_and_other_backends_say_why_not(exported, fast_profiling):
    _, path = exported
    before = _digest(path)
    module = ait.OnnxModule(path)
    tuned = ait.Module(module, "onnx-file", strategy=ait.MaxThroughputStrategy(
        [ONNXRuntimeBackend(), TorchInductorJitBackend()], profiling_config=fast_profiling))
    report = ait.tune(tuned, _calls(2, 5), ready_batches=True, ignore_failing_modules=False)
    rows = {row.backend: row for row in report.rows}
    assert rows["onnxruntime"].status in ("selected", "passed"), rows["onnxruntime"].reason
    probes = rows["onnxruntime"].probes  # probe inputs checked against the untuned file, as for any module
    assert probes is not None and probes["checked"] > 0 and probes["passed"] == probes["checked"]
    assert rows["inductor_jit"].status == "unsupported"
    assert rows["inductor_jit"].reason.startswith("an ONNX file (OnnxModule): only ONNX Runtime, TensorRT and plain "
                                                  "eager take it as it is")
    from aitune.torch.backend import KernelSelectorBackend

    graph = record_graphs(module, [(call, {}) for call in _calls(2)])[0]
    refusal = KernelSelectorBackend(delegate_backend=ONNXRuntimeBackend()).supports(module, graph, "cpu")
    assert not refusal.ok and refusal.reason.startswith("an ONNX file (OnnxModule)")  # whatever its delegate takes
    for x, mask in _calls(3, 5):
        for got, want in zip(tuned(x, mask), module(x, mask)):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert _digest(path) == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["net.onnx"]  # nothing written beside it


def test_onnxruntime_takes_the_file_with_external_data_and_the_checkpoint_round_trip(exported, tmp_path,
                                                                                    fast_profiling):
    net, path = exported
    ext = _with_external_data(path, tmp_path / "model")
    files = [ext, tmp_path / "model" / "weights" / "net.data"]
    before = _digest(*files)
    tuned = ait.Module(ait.OnnxModule(ext), "onnx-ext", strategy=ait.OneBackendStrategy(
        ONNXRuntimeBackend(), profiling_config=fast_profiling).enable_performance_validation(False))
    ait.tune(tuned, _calls(2, 5), ready_batches=True, ignore_failing_modules=False)
    backend = tuned.backends["graph0"]
    assert isinstance(backend, ONNXRuntimeBackend) and backend.build_info["exporter"] == "file"
    assert backend.build_info["onnx_path"] == str(ext)  # the session ran the user's file, not an export
    x, mask = _calls(4)[0]
    expected = tuned(x, mask)
    torch.testing.assert_close(expected[0], net(x, mask)[0], atol=1e-6, rtol=1e-5)

    ait.save(tuned, str(tmp_path / "ckpt" / "onnx.ait"))
    loaded = ait.Module(ait.OnnxModule(ext), "onnx-ext")
    ait.load(loaded, str(tmp_path / "ckpt" / "onnx.ait"))
    assert isinstance(loaded.backends["graph0"], ONNXRuntimeBackend)  # restored, not tuned again
    for got, want in zip(loaded(x, mask=mask), expected):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    stored = next((tmp_path / "ckpt").rglob("artifacts"))
    assert (stored / "model.onnx").is_file() and (stored / "weights" / "net.data").is_file()
    # the deployment artifact: the user's file while live, the checkpoint's copy once loaded; both run in a bare
    # ONNX Runtime session under the names the artifact lists and give the tuned module's outputs
    import onnxruntime

    for module, model_file in ((tuned, ext), (loaded, None)):
        artifact = module.deployment_artifacts()["graph0"]
        assert artifact.format == "onnx" and [t.name for t in artifact.inputs] == ["x", "mask"]
        if model_file is not None:
            assert artifact.model_file == model_file
        assert [f.name for f in artifact.files] == [artifact.model_file.name, "net.data"]
        session = onnxruntime.InferenceSession(str(artifact.model_file), providers=["CPUExecutionProvider"])
        values = session.run([t.name for t in artifact.outputs], {"x": x.numpy(), "mask": mask.numpy()})
        for value, want in zip(values, expected):
            torch.testing.assert_close(torch.from_numpy(value), want, atol=1e-6, rtol=1e-5)
    assert _digest(*files) == before and sorted(p.name for p in (tmp_path / "model").iterdir()) == [
        "net_ext.onnx", "weights"]


def test_a_checkpoint_of_one_file_loaded_into_another_file_says_so_and_runs_what_was_chosen(exported, tmp_path,
                                                                                            fast_profiling, caplog):
    """An ONNX file's weights live in the file, not in a state_dict: the checkpoint's weights digest covers the
    file, so loading into an OnnxModule of another file is a weights difference like any other (default: the
    checkpoint's model with a warning; weights='module': the module's own file, eagerly)."""
    net_a, path_a = exported
    net_b = _export(tmp_path / "b.onnx", seed=1)
    tuned = ait.Module(ait.OnnxModule(path_a), "onnx-ab", strategy=ait.OneBackendStrategy(
        ONNXRuntimeBackend(), profiling_config=fast_profiling).enable_performance_validation(False))
    ait.tune(tuned, _calls(2, 5), ready_batches=True, ignore_failing_modules=False)
    ait.save(tuned, str(tmp_path / "ckpt" / "a.ait"))
    x, mask = _calls(5)[0]
    for weights, net in ((None, net_a), ("checkpoint", net_a), ("module", net_b)):
        caplog.clear()
        loaded = ait.Module(ait.OnnxModule(tmp_path / "b.onnx"), "onnx-ab")
        ait.load(loaded, str(tmp_path / "ckpt" / "a.ait"), weights=weights)
        torch.testing.assert_close(loaded(x, mask)[0], net(x, mask)[0], atol=1e-5, rtol=1e-5)
        if weights is None:
            assert "weights differ" in caplog.text
    assert not torch.allclose(net_a(x, mask)[0], net_b(x, mask)[0], atol=1e-3)  # the files do differ


def test_saving_after_the_file_changed_is_refused_and_writes_nothing(tmp_path, fast_profiling):
    """The session runs the file as it was at tuning; a checkpoint of the file as it is now would hold other
    weights than those tuned and checked, so ait.save refuses it (naming the file) and leaves no checkpoint."""
    path = tmp_path / "net.onnx"
    _export(path)
    tuned = ait.Module(ait.OnnxModule(path), "onnx-edit", strategy=ait.OneBackendStrategy(
        ONNXRuntimeBackend(), profiling_config=fast_profiling).enable_performance_validation(False))
    ait.tune(tuned, _calls(2, 5), ready_batches=True, ignore_failing_modules=False)
    assert set(tuned.deployment_artifacts()) == {"graph0"}
    _export(path, seed=1)  # the user's file is replaced after tuning
    message = r"net\.onnx \(or its external data\) changed since its OnnxModule was created"
    with pytest.raises(OnnxFileError, match=message):
        ait.save(tuned, str(tmp_path / "ckpt" / "net.ait"))
    assert not (tmp_path / "ckpt" / "net.ait").exists()
    reasons: dict = {}  # the live artifact is the user's file, which the module no longer serves: left out
    assert tuned.deployment_artifacts(reasons) == {}
    assert re.search(message, reasons["graph0"]) and "not what the tuned module serves" in reasons["graph0"]
    path.unlink()  # gone: the same, said as such
    with pytest.raises(OnnxFileError, match=r"net\.onnx \(or its external data\) can no longer be read as it was "
                                            r"\(FileNotFoundError"):
        ait.save(tuned, str(tmp_path / "ckpt" / "net.ait"))
    assert tuned.deployment_artifacts(reasons) == {} and "can no longer be read" in reasons["graph0"]


def test_a_derived_file_is_what_the_artifact_and_checkpoint_hold_after_the_users_file_changed(tmp_path,
                                                                                              fast_profiling):
    """With transformer fusions the session runs a file derived at build time (in the build folder): the
    user's file changing later changes nothing the module serves, so the artifact stays and ait.save works."""
    from aitune.torch.backend.ort import ONNXRuntimeBackendConfig

    path = tmp_path / "net.onnx"
    net = _export(path)
    backend = ONNXRuntimeBackend(ONNXRuntimeBackendConfig(transformer_fusions="bert"))
    tuned = ait.Module(ait.OnnxModule(path), "onnx-fused", strategy=ait.OneBackendStrategy(
        backend, profiling_config=fast_profiling).enable_performance_validation(False))
    ait.tune(tuned, _calls(2, 5), ready_batches=True, ignore_failing_modules=False)
    assert tuned.backends["graph0"].build_info["onnx_path"] != str(path)  # a derived file
    _export(path, seed=1)
    artifact = tuned.deployment_artifacts()["graph0"]
    assert artifact.model_file != path
    loaded = ait.Module(ait.OnnxModule(path), "onnx-fused")
    ait.load(loaded, ait.save(tuned, str(tmp_path / "ckpt" / "fused.ait")), weights="checkpoint")
    x, mask = _calls(3)[0]
    torch.testing.assert_close(loaded(x, mask)[0], net(x, mask)[0], atol=1e-5, rtol=1e-5)  # the file as tuned


def test_one_external_data_file_per_tensor_tunes_saves_and_loads(exported, tmp_path, fast_profiling):
    """External data files listed in graph order, not sorted (``all_tensors_to_one_file=False``): the file's
    digest does not depend on that order, so the checkpoint stores the file as tuned."""
    net, path = exported
    folder = tmp_path / "model"
    folder.mkdir()
    onnx.save_model(onnx.load(str(path)), str(folder / "net.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=False, size_threshold=0)
    module = ait.OnnxModule(folder / "net.onnx")
    assert module.external_data != sorted(module.external_data)  # graph order: proj.weight before proj.bias
    tuned = ait.Module(module, "onnx-per-tensor", strategy=ait.OneBackendStrategy(
        ONNXRuntimeBackend(), profiling_config=fast_profiling).enable_performance_validation(False))
    ait.tune(tuned, _calls(2, 5), ready_batches=True, ignore_failing_modules=False)
    assert isinstance(tuned.backends["graph0"], ONNXRuntimeBackend)
    loaded = ait.Module(ait.OnnxModule(folder / "net.onnx"), "onnx-per-tensor")
    ait.load(loaded, ait.save(tuned, str(tmp_path / "ckpt" / "net.ait")))
    x, mask = _calls(4)[0]
    for got, want in zip(loaded(x, mask), net(x, mask)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_tensorrt_backend_takes_the_file_as_it_is_through_the_stand_in(exported, tmp_path, monkeypatch):
    """TensorRT cannot be installed here: its engine build and runtime are the repository's stand-in (an ONNX
    Runtime engine double, tests/unit/fake_tensorrt.py); what runs for real is our path from the file to the
    build step, the profiles and the runtime's bindings."""
    pytest.importorskip("polygraphy", exc_type=ImportError)
    from test_tensorrt_backend_standin import standin_load_engine

    from aitune.torch.backend import TensorRTBackend

    net, path = exported
    monkeypatch.setattr(TensorRTBackend, "availability",
                        classmethod(lambda cls: Check(True, "", {"tensorrt": "stand-in"})))
    monkeypatch.setattr("aitune.torch.backend.tensorrt.engine_build.load_engine", standin_load_engine)
    module = ait.OnnxModule(path)
    graph = record_graphs(module, [(call, {}) for call in _calls(2, 4)])[0]
    backend = TensorRTBackend()
    backend.build_step = "test_tensorrt_backend_standin:standin_build_engine"
    backend.device_types = frozenset({"cpu", "cuda"})
    assert backend.supports(module, graph, torch.device("cpu")).ok
    backend.build(module, graph, "cpu", tmp_path / "trt")
    plan = json.loads((tmp_path / "trt" / "tensorrt" / "model.plan").read_text())
    assert plan["onnx_path"] == str(path)  # built from the user's file, nothing exported
    assert not (tmp_path / "trt" / "onnx").exists()
    x, mask = _calls(3)[0]
    for got, want in zip(backend(x, mask), net(x, mask)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_the_readme_recipe_runs_as_written(tmp_path, monkeypatch):
    """The code block of README.md's "Tuning an existing ONNX file", run in a fresh folder."""
    scope = run_readme_block("### Tuning an existing ONNX file", tmp_path, monkeypatch)
    x = torch.randn(2, 16)
    with torch.no_grad():
        torch.testing.assert_close(scope["restored"](x), scope["net"](x), atol=1e-5, rtol=1e-4)
    assert scope["model"].dynamic_axes == {"x": {0: "batch"}, "y": {0: "batch"}}
    assert scope["restored"].backends["graph0"].name in ("onnxruntime", "eager")  # restored, whichever won
    assert (tmp_path / "checkpoints" / "net.ait").is_file()

"""The one accepted-range check of AOT artifacts (aitune/torch/backend/accepted.py), and Torch-TensorRT's use
of it: before, Torch-TensorRT checked ranks and sizes only, so a float64 or CPU tensor reached the engine."""

import torch

from aitune.torch.backend import TorchTensorRTAotBackend
from aitune.torch.backend.accepted import AcceptedInput, AcceptedInputs
from aitune.torch.backend.torch_tensorrt import export_dynamic_shapes
from aitune.torch.record.samples import record_graphs


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)

    def forward(self, ids, mask):
        return self.embed(ids) * mask.unsqueeze(-1)


def _graph():
    module = Encoder().eval()
    calls = [((torch.randint(0, 50, (b, s)), torch.ones(b, s)), {}) for b, s in ((1, 5), (4, 12))]
    return record_graphs(module, calls)[0]


def test_reasons_name_the_input_and_the_range():
    graph = _graph()
    accepted = AcceptedInputs.from_graph(graph, "cpu", batch_axes=[(0, 0, 1), (1, 0, 1)])
    ids, mask = torch.zeros(2, 7, dtype=torch.long), torch.ones(2, 7)
    assert accepted.rejects([ids, mask]) is None
    assert accepted.rejects([torch.zeros(5, 7, dtype=torch.long), torch.ones(5, 7)]) == \
        "input 'ids' has shape [5, 7], outside [1..4, 5..12]"
    assert "dtype float64, the artifact takes float32" in accepted.rejects([ids, mask.double()])
    assert "rank 3" in accepted.rejects([ids, mask[..., None]])
    assert "not a tensor" in accepted.rejects([ids, 1.0])
    assert "disagree" in accepted.rejects([ids, torch.ones(3, 7)])
    meta = AcceptedInputs.from_graph(graph, "cuda")
    assert "is on cpu, the artifact runs on cuda" in meta.rejects([ids, mask])
    restored = AcceptedInputs.from_json(accepted.to_json())
    assert restored == accepted


def test_shape_specialized_artifacts_take_only_their_shapes():
    accepted = AcceptedInputs([AcceptedInput(0, "float32", [2, 3], [4, 3], "x")], "cpu", shapes={((2, 3),)})
    assert accepted.rejects([torch.zeros(2, 3)]) is None
    assert "shape-specialized" in accepted.rejects([torch.zeros(3, 3)])


def test_torch_tensorrt_refuses_other_dtypes_and_devices():
    graph = _graph()
    _, inputs = export_dynamic_shapes(graph)  # what a build stores for the compile step and for checkpoints
    backend = TorchTensorRTAotBackend()
    backend._inputs, backend._leaf_indices = inputs, [spec.leaf_index for spec in graph.tensor_specs]
    ids, mask = torch.zeros(2, 7, dtype=torch.long), torch.ones(2, 7)
    assert "the artifact runs on cuda" in backend.rejects([ids, mask])  # CPU tensors never reach the engine
    if torch.cuda.is_available():
        ids, mask = ids.cuda(), mask.cuda()
        assert backend.rejects([ids, mask]) is None
        assert "dtype float64" in backend.rejects([ids, mask.double()])


class TwoInputs(torch.nn.Module):
    def forward(self, x, y):
        return x * 2 + y.mean(0)


def test_onnxruntime_refuses_batch_axes_that_disagree(tmp_path):
    """Before, ONNX Runtime's check took each input's range alone; now the batch axes must agree too."""
    import pytest

    pytest.importorskip("onnxruntime")
    from aitune.torch.backend import ONNXRuntimeBackend

    module = TwoInputs().eval()
    graph = record_graphs(module, [((torch.randn(b, 4), torch.randn(b, 4)), {}) for b in (2, 6)])[0]
    backend = ONNXRuntimeBackend().build(module, graph, "cpu", tmp_path)
    assert backend.rejects([torch.randn(3, 4), torch.randn(3, 4)]) is None
    assert "disagree" in backend.rejects([torch.randn(3, 4), torch.randn(5, 4)])


def test_the_value_gate_reads_only_cpu_tensors():
    """Reading a CUDA tensor's values would synchronize the device on every call: tensors off the CPU (meta here,
    CUDA on a GPU machine) are not read, CPU ones are."""
    from aitune.torch.backend.accepted import ValueGate
    from aitune.torch.record.samples import Recorder

    class Lookup(torch.nn.Module):
        def forward(self, ids, scale):
            return ids.float() * scale

    recorder = Recorder(Lookup())
    recorder.record(Lookup(), (torch.tensor([0, 3, 5]), torch.ones(3)), {}, None)
    graph = next(iter(recorder.graphs.values()))
    gate = ValueGate.for_graph(graph, quantizing=False)
    assert "outside the accepted [0, 5]" in gate.rejects([torch.tensor([0, 9, 5]), torch.ones(3)])
    assert "nan/inf" in gate.rejects([torch.tensor([0, 3, 5]), torch.tensor([1.0, float("nan"), 1.0])])
    assert gate.rejects([torch.tensor([0, 9, 5], device="meta"), torch.ones(3, device="meta")]) is None
    assert "nan/inf" in gate.rejects([torch.tensor([0, 3, 5], device="meta"), torch.tensor([1.0, float("inf"), 1.0])])
    assert not gate.finite_only  # (an integer input: the general loops)
    floats = Recorder(torch.nn.Linear(3, 2))
    floats.record(torch.nn.Linear(3, 2), (torch.ones(2, 3),), {}, None)
    float_gate = ValueGate.for_graph(next(iter(floats.graphs.values())), quantizing=False)
    assert float_gate.finite_only and float_gate.rejects([torch.ones(2, 3)]) is None
    assert "nan/inf" in float_gate.rejects([torch.tensor([[1.0, float("nan"), 0.0]] * 2)])


def test_the_value_gate_lets_through_every_valid_id_of_an_embedding_table():
    """Ids the samples did not hold but the table they index has are served (the next request's tokens); ids past
    that table, negative ids, and an integer input that indexes something else (a plain tensor) keep the
    recorded range."""
    from aitune.torch.backend.accepted import ValueGate
    from aitune.torch.record.samples import Recorder

    class Tokens(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(50, 4)
            self.bias = torch.zeros(8)  # 8 rows, indexed by `relative` (not an embedding table)
            self.wide = torch.nn.Embedding(1000, 4)  # never given `relative` directly

        def forward(self, ids, relative):
            return self.embed(ids).sum(-1) + self.bias[relative] + self.wide(relative % 3).sum(-1)

    model = Tokens()
    recorder = Recorder(model)
    recorder.record(model, (torch.tensor([3, 17, 40]), torch.tensor([0, 1, 2])), {}, None)
    graph = next(iter(recorder.graphs.values()))
    assert [spec.table_rows for spec in graph.tensor_specs] == [50, None]
    gate = ValueGate.for_graph(graph, quantizing=False)
    assert gate.rejects([torch.tensor([0, 49, 1]), torch.tensor([0, 1, 2])]) is None
    assert "outside the accepted [0, 49]" in gate.rejects([torch.tensor([0, 50, 1]), torch.tensor([0, 1, 2])])
    assert "outside" in gate.rejects([torch.tensor([-1, 5, 1]), torch.tensor([0, 1, 2])])
    assert "outside the accepted [0, 2]" in gate.rejects([torch.tensor([0, 5, 1]), torch.tensor([0, 1, 7])])


def test_the_value_gate_tells_nan_and_inf_from_a_sum_that_overflows():
    """The finite check sums each floating input once: a sum that is not finite while every value is (an
    overflow) is served, nan and inf anywhere (also +inf and -inf together, whose sum is nan) run eager, in
    every floating dtype, for strided views and for tensors that require grad; a tensor off the CPU is not read.
    Both ways through ``rejects``: a float model's fast path (``finite_only``: the finite check is the only one),
    and the general loops (a gate that also checks an integer input, here one the calls never hold); each with
    torch's reduction and with the native check (NOTE [native watch]) where it is built here."""
    from aitune.torch.backend.accepted import ValueGate
    from aitune.torch.check.native_watch import all_finite_check

    gates = []
    for native in {None, all_finite_check()}:
        general = ValueGate(finite=[(0, "x")], integers=[(5, "ids", 0, 9)])
        fast = ValueGate(finite=[(0, "x")])
        assert fast.finite_only and not general.finite_only and general.leaf_indices == [0, 5]
        general.native_finite = fast.native_finite = native
        gates += [fast, general]
    for gate in gates:
        def check(tensor, gate=gate):
            return gate.rejects([tensor, *[None] * 5])  # (the general gate's integer input: absent)

        for dtype, huge in ((torch.float32, 3e38), (torch.float64, 1e308), (torch.float16, 6e4),
                            (torch.bfloat16, 3e38)):
            assert check(torch.full((16,), huge, dtype=dtype)) is None, dtype
            assert check(torch.tensor([1.0, -2.0], dtype=dtype)) is None, dtype
            for bad in ([1.0, float("nan")], [float("inf"), 1.0], [float("inf"), float("-inf")], [float("-inf"), 0.0]):
                assert "nan/inf" in check(torch.tensor(bad, dtype=dtype)), (dtype, bad)
        strided = torch.ones(4, 6)[:, ::2]
        assert check(strided) is None
        strided[1, 1] = float("nan")
        assert "nan/inf" in check(strided)
        with torch.no_grad():
            assert check(torch.ones(3, requires_grad=True)) is None
        assert "nan/inf" in check(torch.tensor([float("nan")], requires_grad=True))
        assert check(torch.tensor([float("nan")], device="meta")) is None
        assert gate.rejects([None] * 6) is None  # (leaves a phase route leaves out)

"""GPU checks of the core (skipped without CUDA)."""

import pytest
import torch

import aitune.torch as ait
from aitune.torch.backend import TorchInductorJitBackend, TorchInductorJitBackendConfig
from aitune.torch.measure.profiling import ProfilingConfig

pytestmark = pytest.mark.gpu


class Gram(torch.nn.Module):
    def forward(self, x):
        return x @ x.transpose(-1, -2)


def test_c20_cuda_graph_outputs_stay_valid():
    model = Gram().cuda().eval()
    backend = TorchInductorJitBackend(TorchInductorJitBackendConfig(mode="reduce-overhead"))
    tuned = ait.Module(model, "gram", strategy=ait.OneBackendStrategy(backend, profiling_config=ProfilingConfig(
        time_budget_s=0.2)).enable_performance_validation(False))
    a, b = torch.randn(64, 64, device="cuda"), torch.randn(64, 64, device="cuda")
    ait.tune(tuned, [a], ignore_failing_modules=False, ready_batches=True)
    assert tuned.backends["graph0"].config.mode == "reduce-overhead"
    y_a = tuned(a)
    y_b = tuned(b)
    torch.testing.assert_close(y_a, model(a))
    torch.testing.assert_close(y_b, model(b))


def test_without_output_copies_a_served_call_returns_the_graphs_own_output():
    """NOTE [output copies]: with config.copy_cuda_graph_outputs False a served call returns the graph's own
    output buffer (the same memory at every replay), right when used before the next call; with copies (the
    default) every call's output is its own memory and stays right."""
    from aitune.torch.config import config

    model = Gram().cuda().eval()
    backend = TorchInductorJitBackend(TorchInductorJitBackendConfig(mode="reduce-overhead"))
    tuned = ait.Module(model, "gram-uncopied", strategy=ait.OneBackendStrategy(backend, profiling_config=ProfilingConfig(
        time_budget_s=0.2)).enable_performance_validation(False), guard=ait.GuardConfig(enabled=False))
    a, b = torch.randn(64, 64, device="cuda"), torch.randn(64, 64, device="cuda")
    ait.tune(tuned, [a], ignore_failing_modules=False, ready_batches=True)
    config.copy_cuda_graph_outputs = False
    try:
        with torch.no_grad():
            y_a = tuned(a)
            torch.testing.assert_close(y_a, model(a))  # used before the next call: right
            first = y_a.data_ptr()
            y_b = tuned(b)
            torch.testing.assert_close(y_b, model(b))
            assert y_b.data_ptr() == first  # the graph's own output buffer, not a copy
    finally:
        config.copy_cuda_graph_outputs = True
    with torch.no_grad():
        y_a, y_b = tuned(a), tuned(b)
    assert y_a.data_ptr() != y_b.data_ptr()
    torch.testing.assert_close(y_a, model(a))
    torch.testing.assert_close(y_b, model(b))


def test_the_bf16_variant_of_an_fp32_model_runs_reduce_overhead_in_bf16_when_allowed(monkeypatch):
    """Issue "Search": on a GPU with bf16 tensor cores an fp32 model gets reduce-overhead + freezing + bf16
    autocast; it is selected when reduced precision is allowed, returns fp32, and stays within bf16 accuracy."""
    from aitune.torch.tune_strategy import base

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda().eval()
    monkeypatch.setattr(base, "default_backends", lambda device, module=None, graph=None: [
        v for v in TorchInductorJitBackend().search_space(module, graph, device) if v.reduces_precision])
    # Selection by speed is not what is tested: this MLP is launch-bound (well under a millisecond either way).
    strategy = ait.FirstWinsStrategy(profiling_config=ProfilingConfig(time_budget_s=0.5),
                                     allow_reduced_precision=True).enable_performance_validation(False)
    tuned = ait.Module(model, "mlp", strategy=strategy)
    report = ait.tune(tuned, [torch.randn(b, 256, device="cuda") for b in (64, 128)], ready_batches=True)
    backend = tuned.backends["graph0"]
    assert backend.name == "inductor_jit", report.describe()
    assert backend.config.mode == "reduce-overhead" and backend.config.autocast_dtype == torch.bfloat16
    x = torch.randn(96, 256, device="cuda")
    with torch.no_grad():
        expected, actual = model(x), tuned(x)
    assert actual.dtype == torch.float32 and not torch.equal(actual, expected)
    torch.testing.assert_close(actual, expected, atol=2e-2, rtol=2e-2)


def test_fp32_convnet_candidates_are_judged_against_a_tf32_eager_by_its_own_accuracy():
    """Correctness rule 5 for fp32 leaves (aitune/torch/check/correctness.py): with PyTorch's default
    ``cudnn.allow_tf32 = True`` eager's convolutions run in TF32; Inductor + freezing (BatchNorm folded into the
    convolutions) differed from fp32 ResNet-50's logits by up to about 1e-3 and was rejected by the plain
    fp32 rule. Judged against eager's own distance from an exact fp32 run, it passes."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet50().cuda()
    model.train()
    with torch.no_grad():  # BatchNorm statistics from random data (RESULTS.md: random init explodes otherwise)
        for _ in range(4):
            model(torch.randn(16, 3, 224, 224, device="cuda"))
    model.eval()
    assert torch.backends.cudnn.allow_tf32  # PyTorch's default: the condition this test is about
    backend = TorchInductorJitBackend(TorchInductorJitBackendConfig(mode="reduce-overhead", freezing=True))
    tuned = ait.Module(model, "resnet", strategy=ait.OneBackendStrategy(backend, profiling_config=ProfilingConfig(
        time_budget_s=0.3)).enable_performance_validation(False))
    x = torch.randn(8, 3, 224, 224, device="cuda")
    report = ait.tune(tuned, [x], ignore_failing_modules=False, ready_batches=True)
    row = next(r for r in report.rows if r.backend == "inductor_jit")
    assert row.status == "selected", report.describe()
    assert row.comparison["metric"] == "allclose+fp32-parity"  # the plain rule alone would have rejected it
    parity = row.comparison["leaves"][0]["fp32_parity"]
    assert parity["candidate_rmse"] <= 2 * parity["eager_rmse"] + 1e-5
    assert torch.backends.cudnn.allow_tf32 and torch.get_float32_matmul_precision() == "highest"  # restored


def test_1x1_convolutions_as_matrix_multiplies_under_cuda_graphs_match_eager():
    """Issue "Search": the first-tier CUDA variant for convnets with 1x1 convolutions (reduce-overhead +
    freezing + ``conv_1x1_as_mm``) builds, matches eager in fp16, and its outputs survive the next replay."""
    from aitune.torch.backend.inductor_jit import REDUCE_OVERHEAD_1X1_AS_MM

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
                                torch.nn.Conv2d(32, 64, 1), torch.nn.ReLU(), torch.nn.Conv2d(64, 16, 1)
                                ).cuda().half().eval()
    backend = TorchInductorJitBackend(TorchInductorJitBackendConfig(options=dict(REDUCE_OVERHEAD_1X1_AS_MM),
                                                                    freezing=True))
    tuned = ait.Module(model, "mm1x1", strategy=ait.OneBackendStrategy(backend, profiling_config=ProfilingConfig(
        time_budget_s=0.2)).enable_performance_validation(False))
    x, y = (torch.randn(1, 3, 28, 28, device="cuda", dtype=torch.half) for _ in range(2))
    ait.tune(tuned, [x], ignore_failing_modules=False, ready_batches=True)
    assert tuned.backends["graph0"].config.options["conv_1x1_as_mm"] is True
    out_x = tuned(x)
    out_y = tuned(y)
    with torch.no_grad():
        torch.testing.assert_close(out_x, model(x), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(out_y, model(y), atol=1e-2, rtol=1e-2)


def test_a_call_with_every_tensor_on_the_gpu_skips_the_value_gate(monkeypatch):
    """The value gate reads CPU tensors only (NOTE [value gate]): a flat route whose tensors are all on the GPU does
    not call it (NOTE [dispatch fast path]); the calls stay right."""
    from aitune.torch.backend.accepted import ValueGate

    model = Gram().cuda().eval()
    backend = TorchInductorJitBackend(TorchInductorJitBackendConfig(mode="reduce-overhead"))
    tuned = ait.Module(model, "gram-gate", strategy=ait.OneBackendStrategy(backend, profiling_config=ProfilingConfig(
        time_budget_s=0.2)).enable_performance_validation(False), guard=ait.GuardConfig(enabled=False))
    a = torch.randn(64, 64, device="cuda")
    ait.tune(tuned, [a], ignore_failing_modules=False, ready_batches=True)
    assert tuned._self_dispatch.graphs[0].values is not None  # a gate exists (finite inputs recorded)
    asked = []
    rejects = ValueGate.rejects
    monkeypatch.setattr(ValueGate, "rejects", lambda self, *args, **kwargs: asked.append(1) or rejects(
        self, *args, **kwargs))  # a spy: counts, then checks
    with torch.no_grad():
        for _ in range(4):
            b = torch.randn(64, 64, device="cuda")
            torch.testing.assert_close(tuned(b), model(b))
    assert len(asked) <= 1 and tuned.backend_calls >= 3  # (the first call may take the general path once)


def test_aitunes_own_cuda_graphs_give_eagers_outputs_per_shape_kept_apart_and_follow_new_weights():
    """NOTE [captured CUDA graphs] (aitune/torch/backend/decode_graphs.py): the frozen compile captured by aitune
    per input shape; outputs of earlier calls stay as they were (copies); weights given new storage after tuning
    (``load_state_dict(assign=True)``) are noticed at the next call and eager serves with them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 8 * 8, 10)).cuda().eval()
    backend = TorchInductorJitBackend(TorchInductorJitBackendConfig(capture_cuda_graphs=True, freezing=True))
    tuned = ait.Module(model, "captured", strategy=ait.OneBackendStrategy(backend, profiling_config=ProfilingConfig(
        time_budget_s=0.2)).enable_performance_validation(False))
    ait.tune(tuned, [torch.randn(1, 3, 8, 8, device="cuda"), torch.randn(4, 3, 8, 8, device="cuda")],
             ignore_failing_modules=False, ready_batches=True)
    chosen = tuned.backends["graph0"]
    assert chosen.config.capture_cuda_graphs
    with torch.no_grad():
        inputs = [torch.randn(batch, 3, 8, 8, device="cuda") for batch in (1, 4, 1)]
        outputs = [tuned(x) for x in inputs]
        for x, y in zip(inputs, outputs):  # (each output its own memory: the replays did not overwrite them)
            torch.testing.assert_close(y, model(x), atol=1e-4, rtol=1e-4)
        assert chosen._graphs.stats["replays"] >= 3 and chosen._graphs.enabled
        assert tuned.stats["eager_fallbacks"] == {}
        ait.config.copy_cuda_graph_outputs = False  # NOTE [output copies]: the graph's own buffer, the same each call
        try:
            first, second = tuned(inputs[0]), tuned(inputs[2])
            assert first.data_ptr() == second.data_ptr()
            torch.testing.assert_close(second, model(inputs[2]), atol=1e-4, rtol=1e-4)
        finally:
            ait.config.copy_cuda_graph_outputs = True
        state = {name: torch.randn_like(tensor) for name, tensor in model.state_dict().items()}
        model.load_state_dict(state, assign=True)  # new storage: the graphs read the old weights
        x = torch.randn(1, 3, 8, 8, device="cuda")
        torch.testing.assert_close(tuned(x), model(x))
    assert "stale" in tuned.stats["eager_fallbacks"]


class SmallConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16),
                                        torch.nn.ReLU(), torch.nn.Conv2d(16, 8, 1), torch.nn.AdaptiveAvgPool2d(1),
                                        torch.nn.Flatten())

    def forward(self, x):
        return self.body(x)


def test_two_cuda_graph_candidates_timed_head_to_head_stay_right():
    """NOTE [head to head] on a GPU: aitune's own captured CUDA graph and reduce-overhead's (CUDA-graph trees),
    timed against each other in alternation in one process. A min_noise of 10 ties every candidate with the top
    one and keeps every tie (no head-to-head figure reaches 11x), so the head-to-head runs whatever the speeds
    (performance validation off: eager, the simplest, is no contender);
    the figures are recorded, and the tuned module's outputs stay eager's."""
    torch.manual_seed(0)
    model = SmallConvNet().cuda().eval()
    variants = [TorchInductorJitBackend(TorchInductorJitBackendConfig(mode="reduce-overhead")),
                TorchInductorJitBackend(TorchInductorJitBackendConfig(fullgraph=True, capture_cuda_graphs=True))]
    strategy = ait.MaxThroughputStrategy(variants, profiling_config=ProfilingConfig(
        time_budget_s=0.2, min_noise=10.0)).enable_performance_validation(False)  # eager not a contender
    tuned = ait.Module(model, "convnet-h2h", strategy=strategy)
    x = torch.randn(1, 3, 32, 32, device="cuda")
    report = ait.tune(tuned, [x], ignore_failing_modules=False, ready_batches=True)
    rows = {row.description: row for row in report.rows if row.details.get("head_to_head")}
    assert len(rows) == 2, report.graphs[0].selection_reason
    assert all(row.details["head_to_head"]["speedup"] > 0 for row in rows.values())
    assert "timed head to head" in report.graphs[0].selection_reason
    with torch.no_grad():
        for _ in range(3):
            probe = torch.randn(1, 3, 32, 32, device="cuda")
            torch.testing.assert_close(tuned(probe), model(probe), atol=1e-3, rtol=1e-3)

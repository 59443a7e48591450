"""Scripts written for the reference system (NVIDIA AITune) run unchanged: one test per documented usage.

The 80 usages come from the reference's README, guides, examples and notebooks (grouped as in
``shared/reference/api_compat.md``). Each test is a small script making the calls exactly as the reference
documents them — tiny models with random weights on the CPU — and asserts the documented behaviour (values,
types, files written). Rows where aitune deliberately differs assert aitune's behaviour and name the README
migration table; GPU-only rows check import and construction here. ``ROWS`` is the list with each row's
status; ``test_row_statuses`` checks the count the README states.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import logging
import math
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import aitune.torch as ait
from aitune.errors import BackendRuntimeError, ConfigError
from aitune.torch.backend import (
    ONNXRuntimeBackend,
    ONNXRuntimeBackendConfig,
    TorchEagerBackend,
    TorchEagerBackendConfig,
)

REPO = Path(__file__).resolve().parents[2]

# ------------------------------------------------------------------------------------------ the rows

WORKS, DIFFERS, NOT_SUPPORTED = "works", "differs (deliberate)", "not supported"
GPU_ONLY = "works (GPU-only: import and construction checked)"

ROWS = {
    # Calling and data rules
    "tune_dict_items_pipeline_object": WORKS,
    "tune_dict_items_plain_function": WORKS,
    "tune_default_batch_sizes": WORKS,
    "tune_tensor_dataset_batch_sizes": WORKS,
    "tune_string_items": WORKS,
    "tune_tuple_items_positional": WORKS,
    "tune_call_wrapper_args_kwargs": WORKS,
    "inspect_dict_items_as_kwargs": WORKS,
    "inspect_adds_batch_dimension": WORKS,
    "inspect_describe_prints": WORKS,
    "inspect_warmup_default": WORKS,
    "inspect_get_modules_min_execution_percentage": WORKS,
    "torch_dataset_indexed_by_len": WORKS,
    "enable_find_max_batch_size_off": WORKS,
    "enable_find_max_batch_size_search": WORKS,
    # Configuration and arguments
    "config_module_device_after_tuning": WORKS,
    "config_strict_mode": DIFFERS,
    "config_max_num_samples_stored": WORKS,
    "config_tuning_data_output_path": WORKS,
    "config_cache_dir_and_other_fields": WORKS,
    "tune_dry_run": WORKS,
    "tune_max_num_batches_per_batch_size": WORKS,
    "tune_clear_cache": WORKS,
    "tune_disable_external_logging": WORKS,
    "tune_device_and_ignore_failing_modules": WORKS,
    "module_strategies_per_graph": WORKS,
    "dataloader_factory": WORKS,
    "dynamic_shape_dataset": WORKS,
    "min_max_random_dataset": WORKS,
    "samples_generator": WORKS,
    "task_profiling_config": WORKS,
    "torchao_mxfp8dq_preset": WORKS,
    "torchao_nvfp4dq_preset": WORKS,
    "tensorrt_config_device": GPU_ONLY,
    "torch_quantization_config_device": GPU_ONLY,
    "torch_tensorrt_enabled_precisions": GPU_ONLY,
    "torchao_mode_default": DIFFERS,
    "env_tuning_data_path": WORKS,
    "env_cache_dir": WORKS,
    "env_console_output": WORKS,
    "env_nvtx_events": WORKS,
    "env_hardware_metrics": WORKS,
    "env_integrations": WORKS,
    "env_xdg_cache_home": WORKS,
    # Extension points
    "custom_backend_reference_contract": WORKS,
    "artifact_path": WORKS,
    "custom_strategy_tune": WORKS,
    "module_graph_specs": WORKS,
    "module_tune_method": WORKS,
    # Checkpoints, profiling, monitoring
    "save_load_checkpoints_layout": WORKS,
    "save_load_local_torch_storage": WORKS,
    "storage_remove_checkpoint_after_tune": WORKS,
    "storage_options": WORKS,
    "ait_profile_report": WORKS,
    "module_function_kernel_profiler": GPU_ONLY,
    "snapshot_tuning_data": WORKS,
    "monitoring_annotate": WORKS,
    "hardware_metrics_runtime_control": WORKS,
    "utils_setup_logging": WORKS,
    "dynamo_serving_worker": NOT_SUPPORTED,
    # Just-in-time tuning (aitune/torch/jit, another engineer's branch)
    "jit_enable_import": WORKS,
    "jit_autowrapt_bootstrap": WORKS,
    "jit_config": WORKS,
    "jit_patch_for_jit_tuning": WORKS,
    "jit_inspection_report": WORKS,
    # Documented usages that already worked
    "module_name_and_strategy": WORKS,
    "module_dynamic_shapes": WORKS,
    "quick_start_inspect_wrap_tune_save": WORKS,
    "wrap_with_strategy": WORKS,
    "one_backend_strategy_raises": WORKS,
    "first_wins_strategy_fallback": WORKS,
    "max_throughput_strategy": WORKS,
    "min_latency_and_latency_budget": WORKS,
    "validation_toggles": WORKS,
    "backend_configs_cpu": WORKS,
    "tensorrt_backend_construction": GPU_ONLY,
    "torch_tensorrt_backends_construction": GPU_ONLY,
    "module_state_controls": WORKS,
    "legacy_names_from_examples": WORKS,
    "aitune_cache_dir": WORKS,
}


def test_row_statuses():
    assert len(ROWS) == 80
    working = [name for name, status in ROWS.items() if status in (WORKS, GPU_ONLY)]
    assert len(working) == 77
    assert sum(status == GPU_ONLY for status in ROWS.values()) == 6
    readme = (REPO / "README.md").read_text()
    for name, status in ROWS.items():
        if status in (DIFFERS, NOT_SUPPORTED):
            assert f"`{name}`" in readme, f"{name} must be explained in the README's migration table"
    tested = {name.removeprefix("test_") for name in globals() if name.startswith("test_")}
    assert set(ROWS) <= tested, sorted(set(ROWS) - tested)


# ------------------------------------------------------------------------------------------ helpers


@pytest.fixture(autouse=True)
def _fresh_state(tmp_path, monkeypatch):
    """Each script runs in its own working directory with default settings."""
    monkeypatch.chdir(tmp_path)
    ait.config.reset()
    yield
    ait.config.reset()


def quick(*backends):
    """A strategy that builds and checks without measuring (tests check values, never speed)."""
    return ait.FirstWinsStrategy(backends=list(backends) or [TorchEagerBackend()]).enable_performance_validation(False)


def fast_measuring():
    """The reference's profiling configuration with few steps (it is documented; it keeps tests short)."""
    from aitune.torch.task.profiling import NumStepsMeasuringStopStrategy, ProfilingConfig

    return ProfilingConfig(batch_sizes=[1, 2], measurement_stop_strategy=NumStepsMeasuringStopStrategy(
        num_steps=3, warmup_samples=1))


class Classifier(nn.Module):
    """A tiny image classifier: (N, 3, 8, 8) -> (N, 10). Refuses unbatched input like real CNN code paths."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 10)

    def forward(self, x):
        assert x.dim() == 4, f"expected a batch (N, C, H, W), got shape {tuple(x.shape)}"
        return self.head(self.conv(x).mean(dim=(2, 3)))


class Encoder(nn.Module):
    """A tiny text encoder with keyword inputs (input_ids, attention_mask) -> (N, 16)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 16)

    def forward(self, input_ids, attention_mask):
        hidden = self.proj(self.embed(input_ids))
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)


class Denoiser(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, latents, timestep):
        return self.net(latents) * timestep.unsqueeze(-1)


class TextEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(128, 8)

    def forward(self, tokens):
        return self.embed(tokens).mean(1)


class DiffusionPipeline:
    """A pipeline object as in diffusers: modules as attributes, prompts in, 'images' out."""

    def __init__(self):
        torch.manual_seed(0)
        self.text_encoder = TextEncoder().eval()
        self.unet = Denoiser().eval()
        self.calls: list[dict] = []

    def __call__(self, prompt, height=8, width=8, num_inference_steps=2, guidance_scale=1.0):
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        self.calls.append({"prompts": prompts, "height": height, "width": width})
        tokens = torch.tensor([[ord(c) % 128 for c in (p + " " * 8)[:8]] for p in prompts])
        latents = self.text_encoder(tokens)
        for step in range(num_inference_steps):
            latents = latents - 0.1 * self.unet(latents, torch.full((len(prompts),), float(step + 1)))
        return latents * guidance_scale


def state_of(module: nn.Module) -> dict:
    return {key: value.clone() for key, value in module.state_dict().items()}


# ============================================================================ calling and data rules


def test_tune_dict_items_pipeline_object():
    pipe = DiffusionPipeline()
    input_data = [{"prompt": "A beautiful landscape with mountains and a lake"}]
    pipe.unet = ait.Module(pipe.unet, strategy=quick())
    ait.tune(pipe, input_data)
    # The dict became keyword arguments; default batch sizes [1, 2] stack the one prompt into 1 and 2 prompts.
    assert [len(call["prompts"]) for call in pipe.calls] == [1, 2]
    graph = pipe.unet.graph_specs[0]
    assert graph.tensor_specs[0].axes[0] == "batch" and graph.tensor_specs[0].max_shape[0] == 2
    assert pipe.unet.state is ait.ModuleState.TUNED
    assert pipe(["a", "b", "c"]).shape == (3, 8)


def test_tune_dict_items_plain_function():
    pipe = DiffusionPipeline()
    pipe.unet = ait.Module(pipe.unet, strategy=quick())
    seen = []

    def infer(prompt):
        seen.append(prompt)
        return pipe(prompt, width=8, height=8, num_inference_steps=1)

    ait.tune(infer, [{"prompt": "a cat"}], batch_sizes=[1])
    assert seen == [["a cat"]]  # one keyword argument: a batch (list) of one prompt
    assert pipe.unet.state is ait.ModuleState.TUNED


def test_tune_default_batch_sizes():
    model = Classifier().eval()
    module = ait.Module(model, "classifier", strategy=quick())
    images = [torch.randn(3, 8, 8) for _ in range(2)]  # single, unbatched images
    ait.tune(module, images)
    assert sorted({sample.batch_size for sample in module.graph_specs[0].samples}) == [1, 2]
    spec = module.graph_specs[0].tensor_specs[0]
    assert spec.axes == ["batch", "static", "static", "static"] and spec.max_shape == [2, 3, 8, 8]
    batch = torch.randn(5, 3, 8, 8)
    torch.testing.assert_close(module(batch), model(batch))


def test_tune_tensor_dataset_batch_sizes():
    # examples/ResNet: one preprocessed image (a tensor) is the dataset; batch sizes are powers of two.
    model = Classifier().eval()
    module = ait.Module(model, "example-resnet", strategy=quick())
    dataset = torch.randn(3, 8, 8)
    max_batch_size = 4
    ait.tune(module, dataset, batch_sizes=[2**n for n in range(max_batch_size.bit_length())])
    assert sorted(s.batch_size for s in module.graph_specs[0].samples) == [1, 2, 4]
    out = module(dataset.unsqueeze(0))  # "during tuning model sees batches, we have to unsqueeze"
    torch.testing.assert_close(out, model(dataset.unsqueeze(0)))


def test_tune_string_items():
    # examples/LLM: strings batched into lists of prompts for a pipe(messages) function.
    encoder = ait.Module(Encoder().eval(), "Phi3", strategy=quick())
    batches = []

    def pipe(messages):
        batches.append(list(messages))
        ids = torch.tensor([[ord(c) % 50 for c in (m + "_" * 6)[:6]] for m in messages])
        return encoder(input_ids=ids, attention_mask=torch.ones_like(ids))

    ait.tune(pipe, ["2+2?", "How big is the universe?"], batch_sizes=[1, 2], device="cpu")
    assert batches == [["2+2?"], ["How big is the universe?"], ["2+2?", "How big is the universe?"]]
    assert encoder.state is ait.ModuleState.TUNED


def test_tune_tuple_items_positional():
    class Masked(nn.Module):
        def forward(self, x, mask):
            return x * mask

    module = ait.Module(Masked(), "masked", strategy=quick())
    dataset = [(torch.randn(4), torch.ones(4)), (torch.randn(4), torch.zeros(4))]
    ait.tune(module, dataset, batch_sizes=[2])
    sample = module.graph_specs[0].samples[0]
    assert [tuple(leaf.shape) for leaf in sample.leaves()] == [(2, 4), (2, 4)]


def test_tune_call_wrapper_args_kwargs():
    # examples/FLUX and ParakeetCTC: a workload wrapper passing the batch on plus fixed options.
    pipe = DiffusionPipeline()
    pipe.unet = ait.Module(pipe.unet, "transformer", strategy=quick())
    sizes = [(8, 8), (16, 16)]

    def call_wrapper(*args, **kwargs):
        for height, width in sizes:
            pipe(*args, height=height, width=width, num_inference_steps=2, guidance_scale=1.0, **kwargs)

    ait.tune(call_wrapper, [{"prompt": "a photo"}], batch_sizes=[1])
    assert [(c["prompts"], c["height"]) for c in pipe.calls] == [(["a photo"], 8), (["a photo"], 16)]
    assert pipe.unet.state is ait.ModuleState.TUNED


def test_inspect_dict_items_as_kwargs():
    pipe = DiffusionPipeline()
    info = ait.inspect(pipe, [{"prompt": "A beautiful landscape"}], number_of_iterations=2, warmup_iterations=1)
    assert {m.name for m in info.get_modules()} == {"text_encoder", "unet"}
    assert all(call["prompts"] == ["A beautiful landscape"] for call in pipe.calls)


def test_inspect_adds_batch_dimension():
    model = Classifier().eval()
    info = ait.inspect(model, [torch.randn(3, 8, 8)], number_of_iterations=2, warmup_iterations=1)
    (root,) = info.get_modules()
    assert root.module is model and root.execution_count == 2  # Classifier asserts a 4-D batch


def test_inspect_describe_prints(capsys):
    info = ait.inspect(DiffusionPipeline(), [{"prompt": "x"}], number_of_iterations=2, warmup_iterations=0)
    text = info.describe()
    printed = capsys.readouterr().out
    assert "unet" in printed and "text_encoder" in printed and "% of total" in printed and text.strip() in printed


def test_inspect_warmup_default():
    import inspect as python_inspect

    assert python_inspect.signature(ait.inspect).parameters["warmup_iterations"].default == 5
    counter = nn.Linear(4, 4)
    calls = []
    counter.register_forward_hook(lambda *_: calls.append(1))
    ait.inspect(counter, [torch.randn(4)])
    assert len(calls) == 5 + 10  # 5 warm-up + 10 timed calls by default


def test_inspect_get_modules_min_execution_percentage():
    info = ait.inspect(DiffusionPipeline(), [{"prompt": "x"}], number_of_iterations=2, warmup_iterations=1)
    assert info.get_modules(min_execution_percentage=0.0) == info.get_modules()
    assert info.get_modules(min_execution_percentage=1.0) == []  # no module takes all the time of the call


def test_torch_dataset_indexed_by_len():
    class Images(torch.utils.data.Dataset):
        """Never raises IndexError: only __len__ bounds it."""

        def __len__(self):
            return 3

        def __getitem__(self, index):
            return torch.full((3, 8, 8), float(index))

    module = ait.Module(Classifier().eval(), "classifier", strategy=quick())
    ait.tune(module, Images(), batch_sizes=[1])
    assert module.graph_specs[0].num_calls == 3


def test_enable_find_max_batch_size_off():
    strategy = ait.FirstWinsStrategy(backends=[TorchEagerBackend()])
    assert strategy.enable_find_max_batch_size(enable=False) is strategy
    module = ait.Module(Classifier().eval(), strategy=strategy.enable_performance_validation(False))
    report = ait.tune(module, [torch.randn(3, 8, 8)])
    assert report.graphs[0].max_batch_size is None
    assert module.graph_specs[0].tensor_specs[0].max_shape[0] == 2


def test_enable_find_max_batch_size_search():
    model = Classifier().eval()
    strategy = quick().enable_find_max_batch_size(True, max_memory_bytes=2_000_000)
    module = ait.Module(model, "resnet", strategy=strategy)
    report = ait.tune(module, [torch.randn(3, 8, 8)])
    search = report.graphs[0].max_batch_size
    assert search["status"] == "found" and search["recorded_max_batch_size"] == 2
    found = search["max_batch_size"]
    # The budget, not a cap, ended the growth; the sizes between the last fit and the first miss were bisected.
    assert "over memory budget" in search["stopped_by"]
    fits = {t["batch_size"] for t in search["trials"] if t["status"] == "fits"}
    misses = {t["batch_size"] for t in search["trials"] if t["status"] != "fits"}
    assert found == max(fits) and found + 1 in misses and 4 < found < 2 ** 13
    assert all(t["peak_bytes"] <= 2_000_000 for t in search["trials"] if t["status"] == "fits")
    # The graph is tuned up to that batch: a sample of that size was recorded and checked against eager.
    assert module.graph_specs[0].tensor_specs[0].max_shape[0] == found
    assert found in {s.batch_size for s in module.graph_specs[0].samples}
    batch = torch.randn(found, 3, 8, 8)
    torch.testing.assert_close(module(batch), model(batch))
    assert "max batch size" in report.describe()


# ============================================================================ configuration


def test_config_module_device_after_tuning():
    from aitune.torch.config import config as global_config

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    reference = model(torch.ones(2, 8))
    global_config.device_after_tuning = "meta"
    module = ait.Module(model, "encoder", strategy=quick(ONNXRuntimeBackend(ONNXRuntimeBackendConfig(use_dynamo=False))))
    ait.tune(module, [torch.randn(8) for _ in range(2)])
    assert next(model.parameters()).device.type == "meta"  # offloaded: the ONNX artifact needs no weights
    torch.testing.assert_close(module(torch.ones(2, 8)), reference)  # in the tuned range: the artifact
    with pytest.raises(BackendRuntimeError, match="device_after_tuning"):
        module(torch.ones(2, 8, dtype=torch.float64))  # never tuned: would need the (offloaded) module
    global_config.device_after_tuning = "cpu"
    eager_model = Classifier().eval()
    eager = ait.Module(eager_model, "eager", strategy=quick())
    ait.tune(eager, [torch.randn(3, 8, 8)])
    assert next(eager_model.parameters()).device.type == "cpu"


def test_config_strict_mode(caplog):
    # Differs deliberately (README migration table): accepted, but constants always take part in graph identity.
    with caplog.at_level(logging.WARNING):
        ait.config.strict_mode = False
    assert ait.config.strict_mode is False and "ignored" in caplog.text

    class Scaled(nn.Module):
        def forward(self, x, scale=1.0):
            return x * scale

    module = ait.Module(Scaled(), "scaled", strategy=quick())
    ait.tune(lambda x: (module(x, scale=2.0), module(x, scale=3.0)), [torch.randn(4)], batch_sizes=[1])
    assert len(module.graph_specs) == 2  # the reference (strict_mode=False) would record one graph
    torch.testing.assert_close(module(torch.ones(1, 4), scale=3.0), torch.full((1, 4), 3.0))


def test_config_max_num_samples_stored():
    ait.config.max_num_samples_stored = 10
    assert ait.Module(nn.Linear(4, 4)).max_samples == 10
    ait.config.max_num_samples_stored = 1
    module = ait.Module(nn.Linear(4, 4), "one", strategy=quick())
    ait.tune(module, [torch.randn(4) for _ in range(4)], batch_sizes=[1, 2, 4])
    assert len(module.graph_specs[0].samples) == 1 and module.graph_specs[0].num_calls == 4 + 2 + 1
    with pytest.raises(ConfigError):
        ait.config.max_num_samples_stored = 0


def test_config_tuning_data_output_path(tmp_path):
    ait.config.tuning_data_output_path = tmp_path / "aitune-report.json"
    module = ait.Module(nn.Linear(4, 4), "linear", strategy=quick())
    ait.tune(module, [torch.randn(4)])
    data = json.loads((tmp_path / "aitune-report.json").read_text())
    assert data["graphs"][0]["module"] == "linear" and data["graphs"][0]["selected"].startswith("TorchEager")


def test_config_cache_dir_and_other_fields(tmp_path):
    from aitune.torch import config

    config.cache_dir = str(tmp_path / "cache")
    config.min_num_samples = 5
    config.enable_transformers_integration = True
    config.enable_diffusers_integration = True
    module = ait.Module(nn.Linear(4, 4), "linear", strategy=quick())
    ait.tune(module, [torch.randn(4)])
    assert (tmp_path / "cache" / "linear" / "graph0").is_dir()
    assert (tmp_path / "cache" / "tuning_data" / "report.json").is_file()
    assert config.to_dict()["min_num_samples"] == 5 and config.to_dict()["cache_dir"] == str(tmp_path / "cache")
    with pytest.raises(ConfigError, match="no setting"):
        config.cache_directory = "x"


def test_tune_dry_run(tmp_path):
    pipe = DiffusionPipeline()
    pipe.unet = ait.Module(pipe.unet, "unet", strategy=ait.FirstWinsStrategy(
        backends=[TorchEagerBackend(), ait.backend.TensorRTBackend()]))
    report = ait.tune(pipe, [{"prompt": "x"}], dry_run=True)
    rows = {row.backend: row for row in report.rows}
    assert report.dry_run and rows["eager"].status == "planned"
    assert rows["tensorrt"].status in ("unavailable", "unsupported") and rows["tensorrt"].reason
    assert pipe.unet.state is ait.ModuleState.RECORDING and not pipe.unet.backends
    assert not (Path(ait.config.cache_dir) / "unet" / "graph0").exists()  # nothing built
    ait.tune(pipe, [{"prompt": "x"}], dry_run=False)
    assert pipe.unet.state is ait.ModuleState.TUNED


def test_tune_max_num_batches_per_batch_size():
    module = ait.Module(nn.Linear(4, 4), "linear", strategy=quick())
    ait.tune(module, [torch.randn(4) for _ in range(10)], batch_sizes=[1, 2], max_num_batches_per_batch_size=3)
    assert module.graph_specs[0].num_calls == 6


def test_tune_clear_cache():
    def run(clear):
        torch.manual_seed(0)  # the same weights each time: the cache keys builds by the module's weights
        module = ait.Module(nn.Sequential(nn.Linear(4, 4)).eval(), "cached",
                            strategy=quick(ONNXRuntimeBackend(ONNXRuntimeBackendConfig(use_dynamo=False))))
        report = ait.tune(module, [torch.ones(4)], clear_cache=clear)
        return next(row for row in report.rows if row.backend == "onnxruntime")

    assert not run(False).cached
    assert run(False).cached  # the same build is reused from the cache
    assert not run(True).cached  # cleared first: built again
    assert run(False).cached


def test_tune_disable_external_logging(caplog):
    chatty = logging.getLogger("some_library")

    class Chatty(nn.Module):
        def forward(self, x):
            chatty.warning("library noise")
            return x + 1

    with caplog.at_level(logging.INFO):
        ait.tune(ait.Module(Chatty(), "a", strategy=quick()), [torch.randn(4)], disable_external_logging=True)
    assert "library noise" not in caplog.text and "aitune" in caplog.text  # aitune's own records still show
    caplog.clear()
    with caplog.at_level(logging.INFO):
        ait.tune(ait.Module(Chatty(), "b", strategy=quick()), [torch.randn(4)], disable_external_logging=False)
    assert "library noise" in caplog.text
    assert chatty.level == logging.NOTSET  # restored


def test_tune_device_and_ignore_failing_modules():
    class Failing(TorchEagerBackend):
        name = "compat_failing"

        def _build(self, module, graph, device, workdir):
            raise RuntimeError("engine build failed")

    model = nn.Linear(4, 4)
    module = ait.Module(model, "m", strategy=ait.OneBackendStrategy(backend=Failing()))
    ait.tune(module, [torch.randn(4)], device="cpu", ignore_failing_modules=True)
    assert module.state is ait.ModuleState.PASSTHROUGH and "engine build failed" in module.tuning_error
    x = torch.randn(2, 4)
    torch.testing.assert_close(module(x), model(x))
    with pytest.raises(Exception, match="engine build failed"):
        ait.tune(ait.Module(nn.Linear(4, 4), "n", strategy=ait.OneBackendStrategy(backend=Failing())),
                 [torch.randn(4)], device="cpu", ignore_failing_modules=False)


def test_module_strategies_per_graph():
    # examples/LLM: prefill and decode are tuned differently.
    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(32, 8)
            self.out = nn.Linear(8, 32)

        def forward(self, input_ids, past_key_values=None):
            hidden = self.embed(input_ids)
            if past_key_values is not None:
                hidden = hidden + past_key_values.mean(1, keepdim=True)
            return self.out(hidden)

    model = TinyLM().eval()
    module = ait.Module(model, model.__class__.__name__, strategies=[
        ait.OneBackendStrategy(TorchEagerBackend()).enable_find_max_batch_size(False),  # for prefill
        ait.OneBackendStrategy(ONNXRuntimeBackend(ONNXRuntimeBackendConfig(use_dynamo=False)))
        .enable_find_max_batch_size(False).enable_performance_validation(False),  # for decode
    ])

    def generate(prompt):
        ids = torch.tensor([[ord(c) % 32 for c in p[:4].ljust(4)] for p in prompt])
        logits = module(ids)
        return module(logits.argmax(-1)[:, -1:], past_key_values=module.module.embed(ids))

    ait.tune(generate, ["2+2?", "How big is the universe?"], batch_sizes=[1, 2])
    assert [graph.name for graph in module.graph_specs] == ["graph0", "graph1"]
    assert module.backends["graph0"].name == "eager" and module.backends["graph1"].name == "onnxruntime"
    ids = torch.randint(0, 32, (2, 4))
    torch.testing.assert_close(module(ids), model(ids))
    with pytest.raises(ConfigError, match="not both"):
        ait.Module(nn.Linear(2, 2), strategy=quick(), strategies=[quick()])
    short = ait.Module(TinyLM().eval(), "short", strategies=[quick()])  # fewer strategies than graphs
    ids = torch.ones(1, 4, dtype=torch.long)
    ait.tune(lambda p: (short(ids), short(ids[:, :1], past_key_values=torch.ones(1, 4, 8))), ["x"], batch_sizes=[1])
    assert short.state is ait.ModuleState.PASSTHROUGH and "strategies has 1 entry" in short.tuning_error
    keyed = ait.Module(TinyLM().eval(), "keyed", strategies={"graph0": quick()})
    ait.tune(lambda p: keyed(torch.ones(len(p), 4).long()), ["x"])
    assert keyed.state is ait.ModuleState.TUNED


def test_dataloader_factory():
    def collate(items):
        return {"x": torch.stack([item["image"] for item in items]) * 2}

    factory = ait.DataLoaderFactory([{"image": torch.ones(3, 8, 8)} for _ in range(4)], collate_fn=collate)
    loader = factory.create_dataloader(2)
    assert isinstance(loader, torch.utils.data.DataLoader) and len(loader) == 2
    assert next(iter(loader))["x"].shape == (2, 3, 8, 8)
    module = ait.Module(Classifier().eval(), "classifier", strategy=quick())
    ait.tune(module, factory, batch_sizes=[1, 4])
    assert sorted({s.batch_size for s in module.graph_specs[0].samples}) == [1, 4]
    assert float(module.graph_specs[0].samples[0].leaves()[0].mean()) == 2.0  # the collate_fn ran


def test_dynamic_shape_dataset():
    from aitune.torch.dataloader import DynamicShapeDataset

    dataset = DynamicShapeDataset([{"x": torch.randn(3, 8, 8)}, {"x": torch.randn(3, 16, 16)}])
    module = ait.Module(Classifier().eval(), "classifier", strategy=quick())
    ait.tune(module, dataset, batch_sizes=[1, 2])
    spec = module.graph_specs[0].tensor_specs[0]
    assert spec.min_shape == [1, 3, 8, 8] and spec.max_shape == [2, 3, 16, 16]
    assert spec.axes == ["batch", "static", "dynamic", "dynamic"]


def test_min_max_random_dataset():
    from aitune.torch.dataloader import InputConfig, MinMaxRandomDataset

    dataset = MinMaxRandomDataset(4, [InputConfig((3, 8, 8), (3, 16, 16), kwarg_name="x")])
    assert len(dataset) == 4
    assert dataset[0]["x"].shape == (3, 8, 8) and dataset[1]["x"].shape == (3, 16, 16)
    assert all(0 <= float(item["x"].min()) and float(item["x"].max()) <= 1 for item in dataset)
    module = ait.Module(Classifier().eval(), "classifier", strategy=quick())
    ait.tune(module, ait.DataLoaderFactory(dataset), batch_sizes=[2])
    assert module.graph_specs[0].tensor_specs[0].max_shape == [2, 3, 16, 16]
    with pytest.raises(ConfigError):
        MinMaxRandomDataset(1, [InputConfig((3, 8, 8))])


def test_samples_generator():
    from aitune.torch.dataloader import DynamicShapeDataset, samples_generator

    dataset = [torch.randn(3, 224, 224) for _ in range(4)]
    assert [args[0].shape for _, args, _ in samples_generator(dataset, [4])] == [torch.Size([4, 3, 224, 224])]
    dataset = [{"prompt": "Hello, world!"} for _ in range(10)]
    assert [(bs, len(kwargs["prompt"])) for bs, _, kwargs in samples_generator(dataset, [4, 8], 1)] == [(4, 4), (8, 8)]
    assert [(bs, args[0].shape) for bs, args, _ in samples_generator(torch.randn(10, 10), [1, 2])] == [
        (1, torch.Size([1, 10, 10])), (2, torch.Size([2, 10, 10]))]
    shapes = [(bs, args[0].shape[1]) for bs, args, _ in samples_generator(
        DynamicShapeDataset([torch.randn(10, 10), torch.randn(20, 20)]), [4, 8])]
    assert shapes == [(4, 10), (4, 20), (8, 10), (8, 20)]


def test_task_profiling_config():
    from aitune.torch.task.profiling import (
        NumStepsMeasuringStopStrategy,
        ProfilingConfig,
        StableWindowMeasuringStopStrategy,
        ThroughputSaturatedProfilingStopStrategy,
    )

    config = ProfilingConfig(batch_sizes=[2**n for n in range(3)], measurement_stop_strategy=NumStepsMeasuringStopStrategy(
        num_steps=4, warmup_samples=1), profiling_stop_strategy=ThroughputSaturatedProfilingStopStrategy())
    strategy = ait.MaxThroughputStrategy(backends=[TorchEagerBackend()], profiling_config=config)
    report = ait.tune(ait.Module(nn.Linear(4, 4), "linear", strategy=strategy), [torch.randn(4)])
    assert all(row.measurement["rounds"] == 4 for row in report.rows)  # exactly num_steps timed rounds
    window = ProfilingConfig(batch_sizes=[1], measurement_stop_strategy=StableWindowMeasuringStopStrategy(
        window_size=5, max_samples=10))
    assert window.min_rounds == 5 and window.max_rounds == 10
    with pytest.raises(ConfigError):
        ProfilingConfig(batch_sizes=[])


def _refused_block_preset(preset):
    pytest.importorskip("torchao")
    from aitune.torch.backend import TorchAOBackend, TorchAOBackendConfig

    backend = TorchAOBackend(config=TorchAOBackendConfig(quantization=preset))
    graph = _recorded_graph(nn.Linear(32, 32).to(torch.bfloat16), torch.randn(2, 32, dtype=torch.bfloat16))
    verdict = backend.supports(nn.Linear(32, 32).to(torch.bfloat16), graph, torch.device("cpu"))
    assert not verdict.ok and "Blackwell" in verdict.reason


def test_torchao_mxfp8dq_preset():
    _refused_block_preset("mxfp8dq")


def test_torchao_nvfp4dq_preset():
    _refused_block_preset("nvfp4dq")


def _recorded_graph(module, x):
    from aitune.torch.record.samples import record_graphs

    return record_graphs(module, [((x,), {})])[0]


def test_tensorrt_config_device():
    from aitune.torch.backend import TensorRTBackend, TensorRTBackendConfig

    config = TensorRTBackendConfig(device="cuda:1", use_cuda_graphs=True)
    assert config.device == "cuda:1" and "device=cuda:1" in TensorRTBackend(config).describe()
    with pytest.raises(ConfigError, match="CUDA device"):
        TensorRTBackendConfig(device="cpu")


def test_torch_quantization_config_device():
    from aitune.torch.backend import TensorRTBackend, TensorRTBackendConfig
    from aitune.torch.backend.tensorrt.torch_quantization import TorchQuantizationConfig

    quantization = TorchQuantizationConfig(quantization_config="FP8_DEFAULT_CFG", device="cuda")
    backend = TensorRTBackend(TensorRTBackendConfig(quantization_config=quantization, use_dynamo=False))
    assert backend.config.quantization_config.device == "cuda"


def test_torch_tensorrt_enabled_precisions():
    from aitune.torch.backend import TorchTensorRTConfig, TorchTensorRTJitBackend, TorchTensorRTJitBackendConfig

    compile_config = TorchTensorRTConfig(enabled_precisions={torch.float16})
    assert compile_config.enabled_precisions == {torch.float16} and compile_config.use_explicit_typing is False
    backend = TorchTensorRTJitBackend(TorchTensorRTJitBackendConfig(compile_config=compile_config))
    assert "float16" in backend.describe()
    explicit = TorchTensorRTConfig(enabled_precisions={torch.float16}, use_explicit_typing=False)
    assert explicit.key() == compile_config.key()


def test_torchao_mode_default():
    # Differs deliberately (README migration table): the reference defaults to mode="max-autotune".
    from aitune.torch.backend import TorchAOBackendConfig

    assert TorchAOBackendConfig().mode is None
    assert TorchAOBackendConfig(quantization="int8dq", mode="max-autotune").mode == "max-autotune"


def test_env_tuning_data_path(tmp_path, monkeypatch):
    monkeypatch.setenv("AITUNE_TUNING_DATA_PATH", str(tmp_path / "aitune-report.json"))
    ait.tune(ait.Module(nn.Linear(4, 4), "linear", strategy=quick()), [torch.randn(4)])
    assert json.loads((tmp_path / "aitune-report.json").read_text())["graphs"][0]["module"] == "linear"


def test_env_cache_dir(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("AITUNE_CACHE_DIR", str(tmp_path / "mycache"))
    monkeypatch.setenv("AITUNE_CACHE_MIN_FREE_BYTES", str(2**62))  # more than any disk: the low-space warning
    assert ait.aitune_cache_dir() == tmp_path / "mycache"
    with caplog.at_level(logging.WARNING):
        ait.tune(ait.Module(nn.Linear(4, 4), "linear", strategy=quick()), [torch.randn(4)])
    assert (tmp_path / "mycache" / "linear" / "graph0").is_dir()
    assert "AITUNE_CACHE_MIN_FREE_BYTES" in caplog.text


class PrintingBackend(TorchEagerBackend):
    """Eager, printing while it builds the way compilers do (Python prints and C-level writes)."""

    name = "compat_printing"

    def _build(self, module, graph, device, workdir):
        print("python print during build")
        os.write(2, b"native write during build\n")
        super()._build(module, graph, device, workdir)


@pytest.mark.parametrize("console", [None, "1"])
def test_env_console_output(console, monkeypatch, capfd):
    if console:
        monkeypatch.setenv("AITUNE_CONSOLE_OUTPUT", console)
    else:
        monkeypatch.delenv("AITUNE_CONSOLE_OUTPUT", raising=False)
    report = ait.tune(ait.Module(nn.Linear(4, 4), "p", strategy=quick(PrintingBackend())), [torch.randn(4)])
    log = Path(next(row.log_path for row in report.rows if row.backend == "compat_printing")).read_text()
    assert "python print during build" in log and "native write during build" in log
    console_text = "".join(capfd.readouterr())
    assert ("native write during build" in console_text) is bool(console)


def test_env_nvtx_events(monkeypatch):
    pytest.importorskip("nvtx")
    import nvtx

    from aitune.utils import monitoring

    ranges = []
    monkeypatch.setattr(nvtx, "start_range", lambda message=None, color=None, domain=None: ranges.append(
        (message, color, domain)) or len(ranges))
    monkeypatch.setattr(nvtx, "end_range", lambda handle: ranges.append(("end", handle, None)))
    monkeypatch.setattr(monitoring, "_nvtx_module", nvtx)
    monkeypatch.setattr(monitoring, "_nvtx_checked", True)
    monkeypatch.delenv("AITUNE_NVTX_EVENTS", raising=False)
    ait.tune(ait.Module(nn.Linear(4, 4), "off", strategy=quick()), [torch.randn(4)])
    assert ranges == []
    monkeypatch.setenv("AITUNE_NVTX_EVENTS", "1")
    ait.tune(ait.Module(nn.Linear(4, 4), "on", strategy=quick()), [torch.randn(4)])
    assert ("build: eager", "orange", "AITune") in ranges and ("end", 1, None) in ranges


def test_env_hardware_metrics(tmp_path):
    script = ("import torch, aitune.torch as ait\n"
              "from aitune.utils.monitoring import annotate, get_hardware_metrics\n"
              "import time\n"
              "deadline = time.monotonic() + 60\n"  # waits for two samples, however slowly the sampler runs
              "with annotate(name='inference', color='green'):\n"
              "    while sum(row['scope'] == 'inference' for row in get_hardware_metrics()) < 2 \\\n"
              "            and time.monotonic() < deadline:\n"
              "        time.sleep(0.05)\n")
    env = {**os.environ, "AITUNE_HARDWARE_METRICS": "1", "AITUNE_HARDWARE_METRICS_PATH": str(tmp_path / "hw.csv"),
           "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300, cwd=tmp_path)
    lines = (tmp_path / "hw.csv").read_text().splitlines()
    assert lines[0].startswith("timestamp,scope") and "host_cpu_percent" in lines[0]
    assert sum(",inference," in line for line in lines[1:]) >= 2


def test_env_integrations(monkeypatch):
    monkeypatch.setenv("AITUNE_TRANSFORMERS_INTEGRATION", "0")
    monkeypatch.setenv("AITUNE_DIFFUSERS_INTEGRATION", "true")
    assert ait.config.enable_transformers_integration is False and ait.config.enable_diffusers_integration is True
    monkeypatch.delenv("AITUNE_TRANSFORMERS_INTEGRATION")
    monkeypatch.delenv("AITUNE_DIFFUSERS_INTEGRATION")
    assert ait.config.enable_transformers_integration is True and ait.config.enable_diffusers_integration is False


def test_env_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.delenv("AITUNE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ait.aitune_cache_dir() == tmp_path / "xdg" / "aitune"
    assert ait.config.tuning_data_output_path == tmp_path / "xdg" / "aitune" / "tuning_data" / "report.json"


# ============================================================================ extension points


@dataclasses.dataclass
class ExportedConfig(ait.backend.BackendConfig):
    strict: bool = False


class ExportedProgramBackend(ait.backend.Backend):
    """A custom AOT backend written against the reference's contract: torch.export artifact, ArtifactPath."""

    _devices = ["cpu", "cuda"]
    deploys = 0

    def __init__(self, config: ExportedConfig | None = None):
        super().__init__()
        self._config = config or ExportedConfig()
        self._artifact = None
        self._program = None

    @property
    def is_jit(self) -> bool:
        return False

    def key(self) -> str:
        return f"{self.__class__.__name__}_{self._config.key()[:8]}"

    def describe(self) -> str:
        return f"{self.__class__.__name__}({self._config.describe()})"

    def _build(self, module, graph_spec, data, cache_dir):
        sample = data[0]
        with self._track_build_step("Torch export") as step:
            program = torch.export.export(module, tuple(sample.args), dict(sample.kwargs), strict=self._config.strict)
            cache_dir.mkdir(parents=True, exist_ok=True)
            torch.export.save(program, cache_dir / "program.pt2")
            step["size"] = (cache_dir / "program.pt2").stat().st_size
        self._artifact = ait.backend.ArtifactPath(cache_dir, "program.pt2")
        self._program = program.module()
        return self

    def _activate(self):
        pass

    def _deactivate(self):
        pass

    def _deploy(self):
        type(self).deploys += 1
        self._program = torch.export.load(self._artifact.path).module()

    def _infer(self, *args, **kwargs):
        return self._program(*args, **kwargs)

    def to_dict(self):
        return {"config": self._config.to_dict(), "program": self._artifact, "note": ("exported", 1)}

    @classmethod
    def from_dict(cls, module, state_dict):
        backend = cls(ExportedConfig.from_dict(state_dict["config"]))
        backend._artifact = state_dict["program"]
        assert state_dict["note"] == ("exported", 1)
        return backend


def test_custom_backend_reference_contract(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh()).eval()
    module = ait.Module(model, "custom", strategy=ait.OneBackendStrategy(backend=ExportedProgramBackend())
                        .enable_performance_validation(False))
    report = ait.tune(module, [torch.randn(8) for _ in range(2)], batch_sizes=[2])
    row = report.rows[0]
    assert row.status == "selected" and row.description == "ExportedProgramBackend()"
    assert module.backends["graph0"].build_mode.value == "aot" and not module.backends["graph0"].is_jit
    assert report.rows[0].details["build_results"][0]["step"] == "Torch export"
    deploys = ExportedProgramBackend.deploys  # tuning's save/load round trip deployed once
    x = torch.randn(2, 8)
    ait.save(module, tmp_path / "custom.ait")
    loaded = ait.load(ait.Module(nn.Sequential(nn.Linear(8, 8), nn.Tanh()).eval(), "custom"), tmp_path / "custom.ait")
    assert ExportedProgramBackend.deploys == deploys + 1
    restored = loaded.backends["graph0"]
    assert isinstance(restored, ExportedProgramBackend) and restored._artifact.path.exists()
    assert restored._artifact.path != module.backends["graph0"]._artifact.path  # rebased into the checkpoint
    torch.testing.assert_close(loaded(x), model(x))


def test_artifact_path(tmp_path):
    from aitune.torch.backend import ArtifactPath

    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "model.plan").write_bytes(b"x")
    artifact = ArtifactPath.from_existing(tmp_path / "engine" / "model.plan", root=tmp_path)
    assert artifact.relative_path == Path("engine/model.plan") and artifact.path.read_bytes() == b"x"
    for bad in ("/abs/model.plan", "../model.plan"):
        with pytest.raises(ConfigError):
            ArtifactPath(tmp_path, bad)
    with pytest.raises(ConfigError):
        ArtifactPath.from_existing(tmp_path / "missing", root=tmp_path)


def test_custom_strategy_tune():
    class EagerOnly(ait.TuneStrategy):
        def __init__(self, backend):
            super().__init__()
            self.backend = backend
            self.seen = []

        def _tune(self, module, name, graph_spec, data, device, cache_dir):
            backend = copy.deepcopy(self.backend)
            backend.build(module, graph_spec, data, device, cache_dir / backend.key())
            self.check_correctness(backend, name, graph_spec, data)
            self.seen.append((name, graph_spec.name, len(data), str(device)))
            return backend

    strategy = EagerOnly(TorchEagerBackend())
    model = Classifier().eval()
    module = ait.Module(model, "custom-strategy", strategy=strategy)
    report = ait.tune(module, [torch.randn(3, 8, 8)])
    assert report.graphs[0].selected == "TorchEagerBackend()" and report.rows[0].comparison is not None
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(module(x), model(x))


def test_module_graph_specs():
    module = ait.Module(nn.Linear(4, 4), "m")
    module(torch.randn(1, 4))
    module(torch.randn(1, 4).double().float())
    module(torch.randn(2, 1, 4))
    assert [spec.name for spec in module.graph_specs] == ["graph0", "graph1"] and module.graph_specs == module.graphs


def test_module_tune_method():
    model = Classifier().eval()
    module = ait.Module(model, "direct")
    with pytest.raises(ConfigError, match="recorded nothing"):
        module.tune()
    with torch.no_grad():
        module(torch.randn(1, 3, 8, 8))
        module(torch.randn(2, 3, 8, 8))
    plan = module.tune(strategy=quick(), dry_run=True)
    assert plan.dry_run and plan.rows[0].status == "planned" and module.state is ait.ModuleState.RECORDING
    module.tune(device="cpu", strategy=quick())
    assert module.state is ait.ModuleState.TUNED
    with pytest.raises(ConfigError, match="already tuned"):
        module.tune()


# ============================================================================ checkpoints, profiling, monitoring


def _tuned_classifier(name="model"):
    model = Classifier().eval()
    module = ait.Module(model, name, strategy=quick(ONNXRuntimeBackend(ONNXRuntimeBackendConfig(use_dynamo=False))))
    ait.tune(module, [torch.randn(3, 8, 8)])
    return model, module


def test_save_load_checkpoints_layout(tmp_path):
    model, module = _tuned_classifier()
    ait.save(module, "model.ait")
    assert (tmp_path / "checkpoints" / "model.ait").is_file()
    assert (tmp_path / "checkpoints" / "model_sha256_sums.txt").is_file()
    assert (tmp_path / "checkpoints" / "model" / "manifest.json").is_file()  # the unpacked copy
    fresh = Classifier().eval()
    fresh.load_state_dict(model.state_dict())
    loaded = ait.load(fresh, "model.ait")
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(loaded(x), model(x))


def test_save_load_local_torch_storage(tmp_path):
    from aitune.torch import LocalTorchStorage

    model, module = _tuned_classifier()
    storage = LocalTorchStorage(base_folder="production/models")
    ait.save(module, "model.ait", storage=storage)
    assert (tmp_path / "production" / "models" / "model.ait").is_file()
    fresh = Classifier().eval()
    fresh.load_state_dict(model.state_dict())
    loaded = ait.load(fresh, "model.ait", storage=storage)
    x = torch.randn(3, 3, 8, 8)
    torch.testing.assert_close(loaded(x), model(x))
    with pytest.raises(FileNotFoundError):
        ait.load(Classifier().eval(), "other.ait", storage=storage)


def test_storage_remove_checkpoint_after_tune(tmp_path):
    # examples/ResNet: save(module, tuned_model_path, storage=LocalTorchStorage(remove_checkpoint_after_tune=True))
    model, module = _tuned_classifier()
    ait.save(module, "resnet.ait", storage=ait.LocalTorchStorage(remove_checkpoint_after_tune=True))
    assert (tmp_path / "checkpoints" / "resnet.ait").is_file() and not (tmp_path / "checkpoints" / "resnet").exists()
    loaded = ait.load(Classifier().eval(), "resnet.ait")
    x = torch.randn(1, 3, 8, 8)
    torch.testing.assert_close(loaded(x), model(x))


def test_storage_options(tmp_path):
    from aitune.errors import CheckpointIntegrityError

    model, module = _tuned_classifier()
    folder_only = ait.LocalTorchStorage(base_folder="unpacked", compress_checkpoint=False)
    ait.save(module, "m.ait", storage=folder_only)
    assert (tmp_path / "unpacked" / "m" / "manifest.json").is_file() and not (tmp_path / "unpacked" / "m.ait").exists()
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(ait.load(Classifier().eval(), "m.ait", storage=folder_only)(x), model(x))
    strong = ait.LocalTorchStorage(sha_type="512", overwrite_checkpoint_on_tune=False)
    ait.save(module, "s.ait", storage=strong)
    sums = (tmp_path / "checkpoints" / "s_sha512_sums.txt").read_text().splitlines()
    assert sums and all(len(line.split("  ")[0]) == 128 for line in sums)
    with pytest.raises(FileExistsError):
        ait.save(module, "s.ait", storage=strong)
    (tmp_path / "checkpoints" / "s_sha512_sums.txt").write_text(sums[0].replace(sums[0][0], "0" if sums[0][0] != "0"
                                                                                   else "1", 1) + "\n")
    with pytest.raises(CheckpointIntegrityError, match="SHA-512"):
        ait.load(Classifier().eval(), "s.ait", storage=strong)


def test_ait_profile_report(tmp_path):
    pipe = DiffusionPipeline()
    inputs = [{"prompt": "A beautiful landscape with mountains and a lake"}]

    def infer(prompt):
        return pipe(prompt, width=8, height=8, num_inference_steps=3)

    baseline = ait.profile(obj=pipe, input_data=inputs[0], inference_function=infer, warmup_runs=1, measured_runs=2)
    assert {r["id"] for r in baseline.data["regions"]} == {"untuned_module:text_encoder", "untuned_module:unet"}
    modules_info = ait.inspect(pipe, inputs, inference_function=infer, number_of_iterations=2, warmup_iterations=1)
    modules = [m for m in modules_info.get_modules(min_execution_percentage=0.0) if m.name == "unet"]
    strategy = ait.OneBackendStrategy(TorchEagerBackend()).enable_find_max_batch_size(False)
    pipe = ait.wrap(pipe, modules, strategy=strategy.enable_performance_validation(False))
    ait.tune(infer, inputs, batch_sizes=[1])
    tuned = ait.profile(obj=pipe, input_data=inputs[0], inference_function=infer, warmup_runs=1, measured_runs=2,
                        trace_file="tuned_trace.json")
    data = tuned.data
    assert data["schema_version"] == 1 and data["input"] == {"args_count": 0, "kwargs": ["prompt"]}
    regions = {r["id"]: r for r in data["regions"]}
    assert regions["aot_module:unet"]["wrapper_state"] == "tuned" and "untuned_module:text_encoder" in regions
    assert len(data["runs"]) == 2
    for run in data["runs"]:
        by_id = {r["region_id"]: r for r in run["regions"]}
        assert by_id["aot_module:unet"]["calls"] == 3 and by_id["untuned_module:text_encoder"]["calls"] == 1
        total = sum(r["cpu_time_fraction"] for r in run["regions"]) + run["residual"]["cpu_time_fraction"]
        assert total == pytest.approx(1.0, abs=0.02)
        assert run["timing"]["wall_time_us"] > 0
    assert data["profiler"]["key_averages"]["cpu_time_total"]
    assert tuned.trace_file == (tmp_path / "tuned_trace.json").resolve() and tuned.trace_file.stat().st_size > 0
    markdown = tuned.markdown()
    for section in ("## Overview", "## Runs", "## Regions", "## Per-Run Attribution", "## Profiler Key Averages",
                    "## Warnings", "_(residual)_"):
        assert section in markdown
    Path("tuned_profile.json").write_text(json.dumps(tuned.data, indent=2) + "\n")  # JSON-ready, as documented


def test_module_function_kernel_profiler():
    profiler = ait.ModuleFunctionKernelProfiler(function_names={"scaled_dot_product_attention"})
    assert profiler.function_names == {"scaled_dot_product_attention"}
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            profiler.profile(nn.Linear(4, 4), [((torch.randn(1, 4),), {})])
        return
    model = nn.MultiheadAttention(16, 2, batch_first=True).cuda().eval()
    x = torch.randn(2, 8, 16, device="cuda")
    rows, function_data = profiler.profile(lambda q: model(q, q, q, need_weights=False)[0], [((x,), {})], module=model,
                                           warmup_iterations=1)
    assert any(row["function_name"] == "scaled_dot_product_attention" and row["kernel_us"] > 0 for row in rows)
    assert function_data["scaled_dot_product_attention"][0][0] == 1
    summary = profiler.describe_results(rows, function_data, top_k=3)
    assert summary and summary[0]["time_spent_pct"] > 0


def test_snapshot_tuning_data(tmp_path):
    from aitune.torch import snapshot_tuning_data

    ait.tune(ait.Module(nn.Linear(4, 4), "snap", strategy=quick()), [torch.randn(4)])
    written = snapshot_tuning_data()
    assert written == ait.config.tuning_data_output_path and written.is_file()
    explicit = snapshot_tuning_data(tmp_path / "now.json")
    assert json.loads(explicit.read_text())["graphs"][0]["module"] == "snap"


def test_monitoring_annotate():
    from aitune.utils import monitoring
    from aitune.utils.monitoring import annotate

    scopes = []

    @annotate(name="inference", color="green")
    def do_inference(model, inputs):
        scopes.append(monitoring.current_scope())
        return model(inputs)

    model = nn.Linear(4, 2)
    x = torch.randn(1, 4)
    torch.testing.assert_close(do_inference(model, x), model(x))
    monitoring.enable_hardware_metrics(interval_s=0.02)
    try:
        do_inference(model, x)
        assert scopes == [None, "inference"]  # a scope only while hardware metrics are collected
        with annotate(name="decode"):
            assert monitoring.current_scope() == "decode"
            _wait_for(lambda: any(row["scope"] == "decode" for row in monitoring.get_hardware_metrics()))
        assert monitoring.current_scope() is None
        rows = monitoring.get_hardware_metrics()
    finally:
        monitoring.disable_hardware_metrics(path="hw.csv")
    assert any(row["scope"] == "decode" for row in rows)


def _wait_for(condition, timeout_s: float = 60.0) -> None:
    """Polls ``condition`` until it holds (the hardware-metrics sampler is a thread: how soon it samples depends
    on the machine's load, so tests wait for the samples they need instead of sleeping a fixed time)."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_hardware_metrics_runtime_control(tmp_path, caplog):
    from aitune.utils.monitoring import (
        disable_hardware_metrics,
        enable_hardware_metrics,
        get_hardware_metrics,
        snapshot,
    )

    with caplog.at_level(logging.WARNING):
        assert snapshot(Path("nothing.csv")) is None  # not collecting: a no-op with a warning
    assert "not active" in caplog.text and get_hardware_metrics() is None
    enable_hardware_metrics(interval_s=0.02)
    _wait_for(lambda: len(get_hardware_metrics()) >= 2)
    first = snapshot(Path("phase1_metrics.csv"))
    assert first.is_file() and len(first.read_text().splitlines()) > 2
    _wait_for(lambda: len(get_hardware_metrics()) >= 1)
    kept = snapshot(Path("phase2_metrics.csv"), reset_metrics=False)
    # not reset: every kept row is still collected (the sampler may have added one since)
    assert 0 < len(kept.read_text().splitlines()) - 1 <= len(get_hardware_metrics())
    path = disable_hardware_metrics()
    assert path.name.startswith("hardware_metrics_") and path.suffix == ".csv" and path.is_file()
    assert get_hardware_metrics() is None


def test_utils_setup_logging(tmp_path):
    from aitune.utils import setup_logging

    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        setup_logging(log_file=tmp_path / "run.log")
        assert root.level == logging.INFO and any(isinstance(h, logging.FileHandler) for h in root.handlers)
        logging.getLogger("aitune.test").info("hello from a script")
        for handler in root.handlers:
            handler.flush()
        assert "INFO - hello from a script" in (tmp_path / "run.log").read_text()
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
            handler.close()
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])
        logging.captureWarnings(False)


def test_dynamo_serving_worker():
    # Not supported (README migration table): serving goes through Ray Serve; no Dynamo worker.
    assert importlib.util.find_spec("aitune.dynamo") is None


# ============================================================================ just-in-time tuning

# A user's script for the JIT rows, run in a fresh interpreter as the reference documents it: a two-block
# model called with growing batches; the child prints what JIT tuning made of it and how far the outputs are
# from eager's (computed before any tuning). HOW selects the switch: "import" (`import aitune.torch.jit.enable`
# at the top) or "env" (nothing in the script; AUTOWRAPT_BOOTSTRAP does it).
_JIT_SCRIPT = """
import json, os, sys
if os.environ["HOW"] == "import":
    import aitune.torch.jit.enable  # reference usage: the first import of the script
import torch

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.linear(x))

torch.manual_seed(0)
model = torch.nn.Sequential(Block(), Block()).eval()
batches = [torch.randn(size, 16) for size in (2, 3, 4, 5, 6)]
expected = torch.load(sys.argv[1])
with torch.no_grad():
    outputs = [model(x) for x in batches]
from aitune.torch import jit
node = jit.patched_modules()[0]
print(json.dumps({"enabled": jit.is_enabled(), "state": node.state.value, "name": node.name,
                  "backends": node.backends, "max_error": max(float((a - b).abs().max())
                                                           for a, b in zip(outputs, expected))}))
"""


def _jit_child(tmp_path, how: str, **env) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[_JitBlock() for _ in range(2)]).eval()
    batches = [torch.randn(size, 16) for size in (2, 3, 4, 5, 6)]
    with torch.no_grad():
        torch.save([model(x) for x in batches], tmp_path / "expected.pt")
    script = tmp_path / "user_script.py"
    script.write_text(_JIT_SCRIPT)
    completed = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "expected.pt")], cwd=tmp_path, capture_output=True,
        text=True, timeout=600,
        env={**os.environ, "HOW": how, "AITUNE_JIT_SETUP": "jit_user_settings:configure",
             "AITUNE_CACHE_DIR": str(tmp_path / "cache"),
             "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]), **env})
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


class _JitBlock(nn.Module):  # the script's Block: same seed, same weights
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.linear(x))


def _jit_available() -> bool:
    return importlib.util.find_spec("aitune.torch.jit") is not None


_JIT = "aitune.torch.jit is missing"


@pytest.mark.skipif(not _jit_available(), reason=_JIT)
def test_jit_enable_import(tmp_path):
    # Reference usage: `import aitune.torch.jit.enable` first, the script unchanged: the model is discovered at
    # its first call, tuned once enough calls with a varying batch axis were seen, and answers from then on.
    result = _jit_child(tmp_path, "import")
    assert result["enabled"] and result["state"] == "tuned" and result["name"] == "Sequential"
    assert result["backends"] == {"graph0": "TorchInductorJitBackend()"}
    assert result["max_error"] < 1e-5


@pytest.mark.skipif(not _jit_available(), reason=_JIT)
def test_jit_autowrapt_bootstrap(tmp_path):
    # Reference usage: `AUTOWRAPT_BOOTSTRAP=aitune_enable_jit_tuning python script.py` — no code change at all.
    pytest.importorskip("autowrapt", reason="pip install 'aitune[jit]' (autowrapt)")
    from importlib.metadata import entry_points

    if not entry_points(group="aitune_enable_jit_tuning"):
        pytest.skip("aitune is not installed (pip install -e .): its autowrapt entry point is unregistered")
    result = _jit_child(tmp_path, "env", AUTOWRAPT_BOOTSTRAP="aitune_enable_jit_tuning")
    assert result["enabled"] and result["state"] == "tuned" and result["max_error"] < 1e-5


@pytest.mark.skipif(not _jit_available(), reason=_JIT)
def test_jit_config():
    # Reference usage: `aitune.torch.jit_config`, thresholds set by attribute (`jit_config.min_samples = 3`,
    # `jit_config.batch_axis_required = False`); bad values refused at once; `ait.jit_reset()` forgets it all.
    import aitune.torch.jit as jit
    from jit_user_settings import cheap_strategy

    jit_config = ait.jit_config
    ait.jit_reset()
    try:
        with pytest.raises(ConfigError, match="min_samples"):
            jit_config.min_samples = 0
        jit_config.strategy = cheap_strategy()
        jit_config.min_samples = 3
        jit_config.batch_axis_required = False  # same shape every call: tuned anyway after 3 calls
        jit.enable()
        model = _JitBlock().eval()
        x = torch.randn(4, 16)
        with torch.no_grad():
            # the first call discovers the module (not recorded); the next three are recorded, eager's outputs
            first = [model(x) for _ in range(3)]
            (node,) = jit.patched_modules()
            assert node.state.value == "recording" and node.recorded_calls == 2  # 2 recorded < min_samples
            third = model(x)  # the third recorded call makes it ready: tuned inside this call
            assert node.state.value == "tuned"
            fourth = model(x)
        jit.disable()
        with torch.no_grad():
            expected = model(x)
        assert all(torch.equal(out, expected) for out in first + [third])  # eager's until tuned
        torch.testing.assert_close(fourth, expected)
    finally:
        ait.jit_reset()
    assert jit_config.min_samples == jit.JitConfig().min_samples and not jit.patched_modules()


@pytest.mark.skipif(not _jit_available(), reason=_JIT)
def test_jit_patch_for_jit_tuning():
    # Reference usage: `@patch_for_jit_tuning` on the function that builds the model: only modules created
    # inside it are candidates; in deferred mode they tune when `aitune.torch.jit.tune.deferred()` is called.
    import aitune.torch.jit
    import aitune.torch.jit as jit
    from aitune.torch.jit import patch_for_jit_tuning
    from jit_user_settings import cheap_strategy

    jit.reset()
    try:
        @patch_for_jit_tuning
        def build():
            return _JitBlock().eval()

        jit.jit_config.update(strategy=cheap_strategy(), mode="tune_deferred")
        built, outside = build(), _JitBlock().eval()
        batches = [torch.randn(size, 16) for size in (2, 3, 4)]
        with torch.no_grad():
            for x in batches:
                built(x), outside(x)
        (node,) = jit.patched_modules()
        assert node.module is built and node.state.value == "recording" and type(outside) is _JitBlock
        aitune.torch.jit.tune.deferred()
        assert node.state.value == "tuned"
        with torch.no_grad():
            tuned = built(batches[0])
        jit.disable()
        with torch.no_grad():
            torch.testing.assert_close(tuned, built(batches[0]))
    finally:
        jit.reset()


@pytest.mark.skipif(not _jit_available(), reason=_JIT)
def test_jit_inspection_report(tmp_path):
    # Reference usage: `import aitune.torch.jit.enable_inspection as inspection`, run the pipeline,
    # `inspection.save_report(path, model_name)`; a self-contained "Model Inspector" page, nothing tuned.
    import aitune.torch.jit as jit
    from chromium_pages import check_inspection_page, launch

    started = time.perf_counter()
    pipe = DiffusionPipeline()
    prompts = ["a cat", ["a dog", "two birds"]]
    with torch.no_grad():
        expected = [pipe(prompt, num_inference_steps=2) for prompt in prompts]
    sys.modules.pop("aitune.torch.jit.enable_inspection", None)  # so that the import acts, as in a fresh script
    try:
        import aitune.torch.jit.enable_inspection as inspection

        with torch.no_grad():
            outputs = [pipe(prompt, num_inference_steps=2) for prompt in prompts]
        assert all(torch.equal(a, b) for a, b in zip(outputs, expected))  # eager's, bit for bit
        nodes = {node.name: node for node in inspection.modules()}
        assert list(nodes) == ["TextEncoder", "TextEncoder.embed", "Denoiser", "Denoiser.net", "Denoiser.net.0",
                               "Denoiser.net.1", "Denoiser.net.2"]
        assert nodes["TextEncoder"].calls == 2 and nodes["Denoiser"].calls == 4 and nodes["Denoiser.net.1"].calls == 4
        assert jit.patched_modules() == []  # nothing tracked for tuning, nothing tuned

        path = inspection.save_report(tmp_path / "inspect.html", "my-pipeline")
        page = path.read_text(encoding="utf-8")
        assert "aitune Model Inspector — my-pipeline" in page and "<script" not in page
        assert page.count('<details class="node"') == 7
        assert "latents: float32[1..2b, 8], timestep: float32[1..2b]" in page and "tokens: axis 0" in page
        denoiser = re.search(r'<tr class=""><td><a href="#module-2"><code>Denoiser</code></a>.*?</tr>', page).group(0)
        assert re.findall(r'<td class="num">([^<]*)</td>', denoiser)[0] == "4"  # calls
        figure = re.search(r'<figure class="chart" data-figure="time-share"[^>]*>(.*?)</figure>', page, re.S)
        assert figure and "Denoiser.net.0 (Linear)" in figure.group(1)
        with launch() as browser:
            check_inspection_page(browser, path, list(nodes), ["Denoiser.net.0 (Linear)"])
    finally:
        jit.reset()
    assert type(pipe.unet) is Denoiser and type(pipe.unet.net[0]) is nn.Linear  # classes put back
    print(f"JIT inspection, report and browser check: {time.perf_counter() - started:.1f} s")


# ============================================================================ documented usages that already worked


def test_module_name_and_strategy():
    model = Encoder().eval()
    strategy = ait.OneBackendStrategy(backend=TorchEagerBackend())
    module = ait.Module(model, "my-model", strategy=strategy.enable_performance_validation(False))
    input_data = [{"input_ids": torch.randint(0, 50, (6,)), "attention_mask": torch.ones(6, dtype=torch.long)}]
    ait.tune(module, input_data)
    assert module.name == "my-model" and module.state is ait.ModuleState.TUNED
    ids = torch.randint(0, 50, (3, 6))
    torch.testing.assert_close(module(input_ids=ids, attention_mask=torch.ones_like(ids)),
                               model(input_ids=ids, attention_mask=torch.ones_like(ids)))


def test_module_dynamic_shapes():
    batch = ait.BatchDim("batch", min=1, opt=2, max=8)
    height = ait.DynamicDim("spatial", min=8, opt=8, max=16)
    width = ait.DynamicDim("spatial", min=8, opt=8, max=16)
    model = Classifier().eval()
    module = ait.Module(model, dynamic_shapes={"x": (batch, 3, height, width)},
                        strategy=quick(ONNXRuntimeBackend(ONNXRuntimeBackendConfig(use_dynamo=False))))
    ait.tune(module, [torch.randn(3, 8, 8)], batch_sizes=[1])
    spec = module.graph_specs[0].tensor_specs[0]
    assert spec.dims[0] == batch and spec.dims[2].max == 16
    x = torch.randn(2, 3, 12, 12)  # never recorded, inside the declared ranges: the artifact serves it
    with torch.no_grad():  # an inference call (with autograd on, eager would run it for its grad_fn)
        torch.testing.assert_close(module(x), model(x), atol=1e-5, rtol=1e-4)
    assert module.stats["eager_fallbacks"] == {}
    with pytest.raises(ConfigError):
        ait.DynamicDim("bad", min=4, max=2)


def test_quick_start_inspect_wrap_tune_save(tmp_path):
    pipe = DiffusionPipeline()
    input_data = [{"prompt": "A beautiful landscape with mountains and a lake"}]
    modules_info = ait.inspect(pipe, input_data, number_of_iterations=2, warmup_iterations=1)
    modules_info.describe()
    modules = modules_info.get_modules()
    pipe = ait.wrap(pipe, modules, strategy=quick())
    ait.tune(pipe, input_data)
    ait.save(pipe, "tuned_pipe.ait")
    images = pipe(["A beautiful landscape with mountains and a lake"])
    assert images.shape == (1, 8) and (tmp_path / "checkpoints" / "tuned_pipe.ait").is_file()
    fresh = DiffusionPipeline()
    fresh = ait.load(fresh, "tuned_pipe.ait")
    torch.testing.assert_close(fresh(["A beautiful landscape with mountains and a lake"]), images)


def test_wrap_with_strategy():
    pipe = DiffusionPipeline()
    strategy = ait.OneBackendStrategy(backend=TorchEagerBackend())
    modules = ait.inspect(pipe, [{"prompt": "x"}], number_of_iterations=1, warmup_iterations=0).get_modules()
    pipe = ait.wrap(pipe, modules, strategy=strategy)
    assert isinstance(pipe.unet, ait.Module) and pipe.unet.strategy is strategy
    assert isinstance(pipe.text_encoder, ait.Module) and pipe.text_encoder.name == "text_encoder"


class BrokenBackend(TorchEagerBackend):
    name = "compat_broken"

    def _build(self, module, graph, device, workdir):
        raise RuntimeError("ONNX export failed: unsupported operator")


def test_one_backend_strategy_raises():
    strategy = ait.OneBackendStrategy(BrokenBackend())
    module = ait.Module(nn.Linear(4, 4), "my-model", strategy=strategy)
    with pytest.raises(Exception, match="unsupported operator") as raised:
        ait.tune(module, [torch.randn(4)], ignore_failing_modules=False)
    assert "BackendBuildError" in type(raised.value).__name__


def test_first_wins_strategy_fallback():
    backends = [BrokenBackend(), TorchEagerBackend()]
    strategy = ait.FirstWinsStrategy(backends=backends).enable_performance_validation(False)
    module = ait.Module(nn.Linear(4, 4), "my-model", strategy=strategy)
    report = ait.tune(module, [torch.randn(4)])
    statuses = [(row.backend, row.status) for row in report.rows]
    assert statuses == [("compat_broken", "failed"), ("eager", "selected")]


def test_max_throughput_strategy():
    backends = [TorchEagerBackend(), TorchEagerBackend(TorchEagerBackendConfig(autocast_enabled=False))]
    strategy = ait.MaxThroughputStrategy(backends=backends, profiling_config=fast_measuring())
    module = ait.Module(nn.Linear(4, 4), "my-model", strategy=strategy)
    report = ait.tune(module, [torch.randn(4)])
    measured = [row for row in report.rows if row.measurement]
    assert len(measured) == 3 and all(row.throughput > 0 for row in measured)  # two candidates + eager baseline
    assert sum(row.status == "selected" for row in report.rows) == 1


def test_min_latency_and_latency_budget():
    for strategy in (ait.MinLatencyStrategy(backends=[TorchEagerBackend()], profiling_config=fast_measuring()),
                     ait.LatencyBudgetStrategy(latency_budget_ms=1000.0, backends=[TorchEagerBackend()],
                                               profiling_config=fast_measuring())):
        module = ait.Module(nn.Linear(4, 4), strategy=strategy)
        ait.tune(module, [torch.randn(4)])
        assert module.state is ait.ModuleState.TUNED
    with pytest.raises(ConfigError):
        ait.LatencyBudgetStrategy(latency_budget_ms=0)


def test_validation_toggles():
    strategy = ait.FirstWinsStrategy([TorchEagerBackend()])
    assert strategy.enable_correctness_check(False) is strategy and strategy.correctness_check is False
    assert strategy.enable_performance_validation(False) is strategy and strategy.performance_validation is False
    report = ait.tune(ait.Module(nn.Linear(4, 4), strategy=strategy), [torch.randn(4)])
    assert report.rows[0].comparison is None and report.rows[0].measurement is None


def test_backend_configs_cpu():
    from aitune.torch.backend import (
        ONNXExecutionProvider,
        TorchInductorJitBackend,
        TorchInductorJitBackendConfig,
    )

    inductor = TorchInductorJitBackend(config=TorchInductorJitBackendConfig(mode="max-autotune"))
    assert inductor.describe() == "TorchInductorJitBackend(mode=max-autotune)"
    eager = TorchEagerBackend(TorchEagerBackendConfig(autocast_enabled=True, autocast_dtype=torch.float16))
    assert "autocast_enabled=True" in eager.describe()
    ort = ONNXRuntimeBackendConfig(execution_provider="cuda")
    assert ort.execution_provider is ONNXExecutionProvider.CUDA
    assert TorchInductorJitBackendConfig(mode="max-autotune").key() == TorchInductorJitBackendConfig(
        mode="max-autotune").key() != TorchInductorJitBackendConfig().key()


def test_tensorrt_backend_construction():
    from aitune.torch.backend import (
        ONNXAutoCastConfig,
        ONNXQuantizationConfig,
        ProfileMode,
        TensorRTBackend,
        TensorRTBackendConfig,
        TensorRTProfile,
    )

    backend = TensorRTBackend(TensorRTBackendConfig(use_cuda_graphs=True, workspace_size=1 << 30,
                                                    quantization_config=ONNXAutoCastConfig()))
    assert backend.config.use_cuda_graphs and backend.config.quantization_config.precision == "fp16"
    int8 = TensorRTBackendConfig(quantization_config=ONNXQuantizationConfig(precision="int8", calibration_method="max"),
                                 use_dynamo=False)
    assert int8.quantization_config.precision == "int8"
    profile = TensorRTProfile().add_input_shape("x", (1, 3, 8, 8), (4, 3, 8, 8), (8, 3, 8, 8))
    assert TensorRTBackendConfig(profiles=[profile]).user_profiles == [profile]
    assert TensorRTBackendConfig().profiles is ProfileMode.SINGLE
    graph = _recorded_graph(nn.Linear(4, 4), torch.randn(2, 4))
    verdict = backend.supports(nn.Linear(4, 4), graph, torch.device("cpu"))
    assert not verdict.ok and verdict.reason


def test_torch_tensorrt_backends_construction():
    from aitune.torch.backend import (
        TorchTensorRTAotBackend,
        TorchTensorRTConfig,
        TorchTensorRTJitBackend,
        TorchTensorRTJitBackendConfig,
    )

    jit = TorchTensorRTJitBackend(TorchTensorRTJitBackendConfig(compile_config=TorchTensorRTConfig()))
    aot = TorchTensorRTAotBackend()
    assert jit.build_mode.value == "jit" and aot.build_mode.value == "aot"
    if not jit.availability().ok:
        assert "torch-tensorrt" in jit.availability().reason


def test_module_state_controls():
    model = nn.Linear(4, 4)
    module = ait.Module(model, "m", strategy=quick())
    ait.tune(module, [torch.randn(4)])
    module.deactivate()
    module.activate()
    assert module.state is ait.ModuleState.TUNED
    module.enable_passthrough()
    assert module.state is ait.ModuleState.PASSTHROUGH
    module.enable_recording(force=True)
    assert module.state is ait.ModuleState.RECORDING


def test_legacy_names_from_examples():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from aitune.torch import HighestThroughputStrategy
        from aitune.torch.backend import TorchInductorBackend, TorchInductorBackendConfig
    assert HighestThroughputStrategy is ait.MaxThroughputStrategy
    assert TorchInductorBackend(TorchInductorBackendConfig(autocast_enabled=True, autocast_dtype=torch.float16)
                                ).describe().startswith("TorchInductorJitBackend(")
    deprecated = " ".join(str(w.message) for w in caught if issubclass(w.category, DeprecationWarning))
    assert all(name in deprecated for name in ("HighestThroughputStrategy", "TorchInductorBackend ",
                                               "TorchInductorBackendConfig"))
    assert "HighestThroughputStrategy" not in ait.__all__
    with pytest.raises(AttributeError):
        ait.NoSuchStrategy  # noqa: B018


def test_aitune_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("AITUNE_CACHE_DIR", str(tmp_path / "c"))
    assert ait.aitune_cache_dir() == tmp_path / "c" == ait.config.cache_dir


def test_config_is_one_instance():
    from aitune.torch.config import config

    assert config is ait.config and math.isfinite(config.max_num_samples_stored)

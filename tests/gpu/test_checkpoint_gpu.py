"""Checkpoints on CUDA (marked gpu; skipped without a CUDA device): a CUDA JIT checkpoint round trip in a
fresh process, the same checkpoint rebuilt on the CPU with a warning, and an AOT artifact for another
GPU architecture refused with a clear error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import aitune.torch as ait
from aitune.errors import CheckpointError
from aitune.torch.backend import ONNXRuntimeBackend, TorchInductorJitBackend
from checkpoint_edits import rewrite_archive
from aitune.torch.measure.profiling import ProfilingConfig

pytestmark = pytest.mark.gpu

REPO_ROOT = Path(__file__).resolve().parents[2]
FAST = ProfilingConfig(warmup_rounds=1, min_rounds=3, max_rounds=10, time_budget_s=0.1)

MODEL_SOURCE = textwrap.dedent('''
    import torch
    from torch import nn

    class MLP(nn.Module):
        """x [B, 64] -> [B, 16]."""

        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 16))

        def forward(self, x):
            return self.layers(x)
''')
exec(MODEL_SOURCE)  # defines MLP here exactly as in the child  # noqa: S102

CHILD = MODEL_SOURCE + textwrap.dedent('''
    import json, sys
    from pathlib import Path
    from safetensors.torch import load_file, save_file
    import aitune.torch as ait

    checkpoint, device, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    torch.manual_seed(5)  # other weights: the checkpoint's must be restored
    model = ait.load(MLP().to(device).eval(), checkpoint)
    x = load_file(str(out / "input.safetensors"))["x"].to(device)
    with torch.no_grad():
        save_file({"y": model(x).cpu().contiguous()}, str(out / f"loaded_{device}.safetensors"))
    (out / f"info_{device}.json").write_text(json.dumps({"state": model.state.value,
        "backends": {g: [b.name, str(b.device)] for g, b in model.backends.items()}}))
''')


def only(backend):
    return ait.OneBackendStrategy(backend, profiling_config=FAST).enable_performance_validation(False)


def run_child(checkpoint: Path, device: str, out: Path) -> tuple[dict, str]:
    script = out / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    result = subprocess.run([sys.executable, str(script), str(checkpoint), device, str(out)], env=env,
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((out / f"info_{device}.json").read_text()), result.stderr


def test_cuda_jit_checkpoint_loads_in_a_fresh_process_and_rebuilds_on_cpu(tmp_path):
    torch.manual_seed(0)
    model = ait.Module(MLP().cuda().eval(), "mlp", strategy=only(TorchInductorJitBackend()))
    ait.tune(model, [torch.randn(2, 64, device="cuda"), torch.randn(8, 64, device="cuda")],
             cache_dir_path=tmp_path / "cache", ready_batches=True)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    save_file({"x": x}, str(tmp_path / "input.safetensors"))
    with torch.no_grad():
        expected = model(x.cuda()).cpu()
        eager = model.__wrapped__(x.cuda()).cpu()
    torch.testing.assert_close(expected, eager, rtol=1e-3, atol=1e-4)
    path = ait.save(model, tmp_path / "mlp.ait")
    with zipfile.ZipFile(path) as zf:
        manifest = json.loads(zf.read("manifest.json"))
    facts = manifest["device"]
    assert facts["type"] == "cuda" and facts["capability"] == list(torch.cuda.get_device_capability())
    assert facts["name"] == torch.cuda.get_device_name() and manifest["versions"]["cuda"] == torch.version.cuda

    info, _ = run_child(path, "cuda", tmp_path)
    assert info == {"state": "tuned", "backends": {"graph0": ["inductor_jit", "cuda:0"]}}
    torch.testing.assert_close(load_file(str(tmp_path / "loaded_cuda.safetensors"))["y"], expected, rtol=0, atol=1e-6)

    info, stderr = run_child(path, "cpu", tmp_path)  # the module is on the CPU: rebuilt there, with a warning
    assert info == {"state": "tuned", "backends": {"graph0": ["inductor_jit", "cpu"]}}
    assert "mlp/graph0 was tuned on cuda and is rebuilt on cpu" in stderr
    torch.testing.assert_close(load_file(str(tmp_path / "loaded_cpu.safetensors"))["y"], eager, rtol=1e-3, atol=1e-4)


@pytest.mark.skipif(not ONNXRuntimeBackend.availability().ok, reason=ONNXRuntimeBackend.availability().reason)
def test_an_aot_artifact_for_another_gpu_architecture_is_refused(tmp_path):
    torch.manual_seed(0)
    model = ait.Module(MLP().eval(), "mlp", strategy=only(ONNXRuntimeBackend()))
    ait.tune(model, [torch.randn(2, 64), torch.randn(8, 64)], cache_dir_path=tmp_path / "cache", ready_batches=True)
    path = ait.save(model, tmp_path / "mlp.ait")
    # Pretend it was built on an sm_80 GPU (re-signed consistently, as a real checkpoint would be).
    def on_an_a100(manifest):
        graph = manifest["modules"][0]["graphs"][0]
        graph["device"] = "cuda:0"
        graph["device_facts"] = {"type": "cuda", "index": 0, "name": "NVIDIA A100", "capability": [8, 0]}

    rewrite_archive(path, path, edit_manifest=on_an_a100)
    here = "".join(map(str, torch.cuda.get_device_capability()))
    with pytest.raises(CheckpointError, match=rf"built for GPU architecture sm_80 \(NVIDIA A100\); this GPU .* is "
                                              rf"sm_{here}.*re-tune on this GPU"):
        ait.load(MLP().eval(), path)  # device=None: the checkpoint's device (cuda) exists here


class _Pipe(nn.Module):
    """Two tuned modules: ``a`` (the MLP, [B, 64] -> [B, 16]) then ``b`` ([B, 16] -> [B, 8])."""

    def __init__(self):
        super().__init__()
        self.a, self.b = MLP().eval(), nn.Linear(16, 8).eval()

    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize("how", ["device", "device_map"])
def test_load_puts_every_module_on_the_one_device_given(tmp_path, how):
    """A pipeline tuned on the CPU, built on cuda:0 and loaded with ``device="cuda:0"`` or a ``device_map`` whose
    entries agree: every module's backends run on that device and match the CPU's outputs. aitune never moves
    the module: one left on the CPU is refused with a clear error."""
    from aitune.errors import CheckpointError
    from aitune.torch.backend import TorchEagerBackend

    torch.manual_seed(0)
    pipe = _Pipe()
    pipe.a = ait.Module(pipe.a, "a", strategy=only(TorchEagerBackend()))
    pipe.b = ait.Module(pipe.b, "b", strategy=only(TorchEagerBackend()))
    ait.tune(pipe, [torch.randn(2, 64), torch.randn(4, 64)], cache_dir_path=tmp_path / "cache", ready_batches=True)
    x = torch.randn(3, 64)
    with torch.no_grad():
        expected = pipe(x)
    path = ait.save(pipe, tmp_path / "pipe.ait")
    options = {"device": "cuda:0"} if how == "device" else {"device_map": {"a": "cuda:0", "b": "cuda:0"}}
    torch.manual_seed(1)
    loaded = ait.load(_Pipe().to("cuda:0"), path, **options)  # other weights: the checkpoint's are restored
    assert {str(backend.device) for module in (loaded.a, loaded.b) for backend in module.backends.values()} == {
        "cuda:0"}
    with torch.no_grad():
        output = loaded(x.to("cuda:0"))
    assert output.device == torch.device("cuda:0")
    torch.testing.assert_close(output.cpu(), expected, atol=1e-5, rtol=1e-4)
    half = _Pipe()
    half.b.to("cuda:0")
    with pytest.raises(CheckpointError, match="module 'a': its parameters are on cpu but it is loaded for cuda:0"):
        ait.load(half, path, **options)

"""TorchEagerBackend: the original module, run as is (the baseline every candidate is compared with)."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import torch

from aitune.errors import ConfigError
from aitune.torch.backend.base import Backend, BackendConfig, BuildMode, Check, parse_dtype
from aitune.torch.record.pytree import tree_flatten, tree_unflatten
from aitune.torch.backend.cuda_graphs import CUDAGraphRunner


@dataclasses.dataclass(kw_only=True)
class TorchEagerBackendConfig(BackendConfig):
    """Config of :class:`TorchEagerBackend`.

    Args:
        autocast_enabled: run under ``torch.autocast`` on the module's device type.
        autocast_dtype: autocast dtype (``torch.float16``/``torch.bfloat16``); None = autocast's default.
        use_cuda_graphs: capture each input shape into a CUDA graph and replay it
            (:class:`aitune.torch.backend.cuda_graphs.CUDAGraphRunner`, up to 8 graphs, LRU); CUDA only.
    """

    autocast_enabled: bool = False
    autocast_dtype: torch.dtype | str | None = None
    use_cuda_graphs: bool = False

    def validate(self) -> None:
        for name in ("autocast_enabled", "use_cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self.autocast_dtype = parse_dtype(self.autocast_dtype, "autocast_dtype")


_NO_CONTEXT = contextlib.nullcontext()  # reusable and re-entrant


class AutocastMixin:
    """Autocast around a call; outputs whose dtype autocast changed are cast back (probed at build)."""

    _restore_dtypes: list | None = None

    @property
    def low_precision(self) -> bool:
        """Autocast computes fp32 outputs in reduced precision: the checker uses fp16/bf16 tolerances."""
        return bool(getattr(self.config, "autocast_enabled", False))

    @property
    def reduces_precision(self) -> bool:
        """Autocast runs matmuls and convolutions in bf16/fp16: outputs differ from fp32 eager by design."""
        return self.low_precision

    def _autocast(self):
        config = self.config
        if not getattr(config, "autocast_enabled", False):
            return _NO_CONTEXT
        return torch.autocast(device_type=self.device.type, dtype=config.autocast_dtype)

    def _probe_output_dtypes(self, module, graph) -> None:
        """Record eager's output dtypes (without autocast) so autocast outputs can be cast back."""
        if not getattr(self.config, "autocast_enabled", False) or not graph.samples:
            return
        sample = graph.samples[0].clone()
        with torch.no_grad():
            leaves, _ = tree_flatten(module(*sample.args, **sample.kwargs))
        self._restore_dtypes = [leaf.dtype if isinstance(leaf, torch.Tensor) else None for leaf in leaves]

    def _restore_output_dtypes(self, output):
        if self._restore_dtypes is None:
            return output
        leaves, spec = tree_flatten(output)
        if len(leaves) != len(self._restore_dtypes):
            return output
        restored = [leaf.to(dtype) if isinstance(leaf, torch.Tensor) and dtype is not None and leaf.dtype != dtype
                    else leaf for leaf, dtype in zip(leaves, self._restore_dtypes)]
        return tree_unflatten(spec, restored)


class TorchEagerBackend(AutocastMixin, Backend):
    """Runs the original module under ``torch.no_grad`` (never ``inference_mode``), optionally with autocast.

    Wraps: plain PyTorch. Extra: none. Devices: CPU and CUDA. The module keeps its ``training`` flag.
    With ``use_cuda_graphs`` (CUDA only) calls are captured and replayed as CUDA graphs; outputs are
    clones, so later calls never overwrite them (pytorch/pytorch#144386).
    Checkpoints keep the original weights (JIT build mode).
    """

    name = "eager"
    config_class = TorchEagerBackendConfig
    build_mode = BuildMode.JIT
    rank = 0
    default_search_position = 20  # in the default search (Backend.default_search_position), on CUDA only
    _graphs = None  # CUDAGraphRunner when use_cuda_graphs

    @classmethod
    def default_candidates(cls, device: torch.device) -> list[Backend]:
        """On CUDA, eager replayed from CUDA graphs (plain eager is the baseline every search measures anyway):
        eager at batch 1 is launch-bound there (``benchmarks/cuda_graphs_eager.py``). None on other devices."""
        return [cls(TorchEagerBackendConfig(use_cuda_graphs=True))] if torch.device(device).type == "cuda" else []

    @property
    def passthrough(self) -> bool:
        """True when this backend is exactly the original module (no autocast, no CUDA graphs): the wrapper
        may call it without its routing checks, and it is the simplest candidate of all."""
        return not (self.config.use_cuda_graphs or self.config.autocast_enabled)

    @property
    def takes_onnx_file(self) -> bool:
        """Runs an :class:`~aitune.torch.OnnxModule` as it is when passthrough (no CUDA graphs, no autocast)."""
        return self.passthrough

    @property
    def bakes_module_state(self) -> bool:
        """A captured CUDA graph replays the kernels of the capture: the module's Python state is not read."""
        return bool(self.config.use_cuda_graphs)

    def _supports(self, module, graph, device) -> Check:
        if self.config.use_cuda_graphs and device.type != "cuda":
            return Check(False, "use_cuda_graphs needs a CUDA device")
        return Check(True)

    def _build(self, module, graph, device, workdir: Path) -> None:
        self._callable = module
        self._probe_output_dtypes(module, graph)
        self._graphs = None
        if self.config.use_cuda_graphs:
            self._graphs = CUDAGraphRunner(self._run, name=self.name)

    def _run(self, *args, **kwargs):
        with torch.no_grad(), self._autocast():
            output = self._callable(*args, **kwargs)
        return self._restore_output_dtypes(output)

    def _infer(self, args, kwargs):
        if self._graphs is not None:
            with torch.no_grad():
                return self._graphs(*args, **kwargs)
        return self._run(*args, **kwargs)

    def _deactivate(self) -> None:
        if getattr(self, "_graphs", None) is not None:
            self._graphs.reset()

    def _load(self, directory, metadata, module, graph, device) -> None:
        if module is None:
            raise ConfigError("the eager backend needs the original module (with weights) to load")
        self._build(module, graph, device, directory)

"""TorchEagerBackend: the original module, run as is (the baseline every candidate is compared with)."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import torch

from aitune.errors import ConfigError
from aitune.torch.backend.base import Backend, BackendConfig, BuildMode, parse_dtype
from aitune.torch.pytree import tree_flatten, tree_unflatten


@dataclasses.dataclass(kw_only=True)
class TorchEagerBackendConfig(BackendConfig):
    """Config of :class:`TorchEagerBackend`.

    Args:
        autocast_enabled: run under ``torch.autocast`` on the module's device type.
        autocast_dtype: autocast dtype (``torch.float16``/``torch.bfloat16``); None = autocast's default.
    """

    autocast_enabled: bool = False
    autocast_dtype: torch.dtype | str | None = None

    def validate(self) -> None:
        if not isinstance(self.autocast_enabled, bool):
            raise ConfigError(f"autocast_enabled must be a bool, got {self.autocast_enabled!r}")
        self.autocast_dtype = parse_dtype(self.autocast_dtype, "autocast_dtype")


class AutocastMixin:
    """Autocast around a call; outputs whose dtype autocast changed are cast back (probed at build)."""

    _restore_dtypes: list | None = None

    def _autocast(self):
        config = self.config
        if not getattr(config, "autocast_enabled", False):
            return contextlib.nullcontext()
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
    Checkpoints keep the original weights (JIT build mode).
    """

    name = "eager"
    config_class = TorchEagerBackendConfig
    build_mode = BuildMode.JIT
    rank = 0

    def _build(self, module, graph, device, workdir: Path) -> None:
        self._callable = module
        self._probe_output_dtypes(module, graph)

    def _infer(self, args, kwargs):
        with torch.no_grad(), self._autocast():
            output = self._callable(*args, **kwargs)
        return self._restore_output_dtypes(output)

    def _load(self, directory, metadata, module, graph, device) -> None:
        if module is None:
            raise ConfigError("the eager backend needs the original module (with weights) to load")
        self._build(module, graph, device, directory)

"""TorchInductorJitBackend: ``torch.compile`` with the Inductor compiler."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from aitune.errors import ConfigError
from aitune.torch.backend.base import Backend, BackendConfig, BuildMode, Check, parse_dtype, validate_flags
from aitune.torch.backend.eager import AutocastMixin
from aitune.torch.pytree import tree_flatten, tree_unflatten

logger = logging.getLogger(__name__)

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def graph_break_count() -> int:
    """Total graph breaks dynamo has counted in this process so far."""
    from torch._dynamo.utils import counters

    return int(sum(counters["graph_break"].values()))


def clone_output(output: Any) -> Any:
    """Clone every tensor of an output so later calls cannot overwrite it (CUDA-graph buffers, case C20)."""
    leaves, spec = tree_flatten(output)
    return tree_unflatten(spec, [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves])


def uses_cuda_graphs(mode: str | None, options: dict | None) -> bool:
    return mode == "reduce-overhead" or bool((options or {}).get("triton.cudagraphs"))


@dataclasses.dataclass(kw_only=True)
class TorchInductorJitBackendConfig(BackendConfig):
    """Config of :class:`TorchInductorJitBackend` (arguments of ``torch.compile``).

    Args:
        mode: ``default``, ``reduce-overhead`` (CUDA graphs), ``max-autotune``,
            ``max-autotune-no-cudagraphs`` or None. Mutually exclusive with ``options``.
        options: Inductor options dict (``torch.compile(options=...)``).
        fullgraph: fail on any graph break instead of falling back to Python.
        dynamic: True/False as in ``torch.compile``; None = True when the graph has dynamic axes.
        autocast_enabled / autocast_dtype: as in :class:`TorchEagerBackendConfig`.
    """

    mode: str | None = None
    options: dict | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    autocast_enabled: bool = False
    autocast_dtype: torch.dtype | str | None = None

    def validate(self) -> None:
        if self.mode is not None and self.mode not in COMPILE_MODES:
            raise ConfigError(f"mode must be one of {COMPILE_MODES} or None, got {self.mode!r}")
        if self.mode is not None and self.options:
            raise ConfigError("torch.compile takes either mode or options, not both: drop one of them")
        if self.options is not None and not isinstance(self.options, dict):
            raise ConfigError(f"options must be a dict of Inductor options, got {type(self.options).__name__}")
        validate_flags(self, ("fullgraph", "autocast_enabled"))
        self.autocast_dtype = parse_dtype(self.autocast_dtype, "autocast_dtype")


class TorchInductorJitBackend(AutocastMixin, Backend):
    """``torch.compile(module, backend="inductor")``, warmed up on every recorded sample at build.

    Wraps: TorchInductor (CPU: C++/OpenMP; CUDA: Triton). Extra: none (torch only).
    ``mode="reduce-overhead"`` captures CUDA graphs; outputs are then cloned so they stay valid (case C20).
    Known limitations: graph breaks fall back to Python (counted in ``build_info["graph_breaks"]``);
    shapes outside the recorded range may recompile. Checkpoints keep weights + samples and recompile on load.
    """

    name = "inductor_jit"
    config_class = TorchInductorJitBackendConfig
    build_mode = BuildMode.JIT
    rank = 20

    @property
    def bakes_weights(self) -> bool:
        """Inductor reads the parameters at every call, except with ``freezing`` (weights folded in)."""
        return bool((self.config.options or {}).get("freezing"))

    def _supports(self, module, graph, device) -> Check:
        if uses_cuda_graphs(self.config.mode, self.config.options) and device.type != "cuda":
            return Check(False, "mode 'reduce-overhead' captures CUDA graphs and needs a CUDA device")
        return Check(True)

    def _resolved_dynamic(self, graph) -> bool | None:
        if self.config.dynamic is not None:
            return self.config.dynamic
        return True if graph is not None and graph.is_dynamic else None

    def _build(self, module, graph, device, workdir: Path) -> None:
        self._probe_output_dtypes(module, graph)
        self._clone_outputs = uses_cuda_graphs(self.config.mode, self.config.options)
        dynamic = self._resolved_dynamic(graph)
        self.build_info["dynamic"] = dynamic
        self._compiled = torch.compile(module, backend="inductor", mode=self.config.mode, options=self.config.options,
                                       fullgraph=self.config.fullgraph, dynamic=dynamic)
        breaks_before = graph_break_count()
        for sample in graph.samples:  # warm-up: compile every recorded shape now, not at first use
            sample = sample.clone()
            self._run(sample.args, sample.kwargs)
        self.build_info["graph_breaks"] = graph_break_count() - breaks_before
        logger.debug("inductor_jit: %d graph breaks during warm-up", self.build_info["graph_breaks"])

    def _run(self, args, kwargs):
        if self._clone_outputs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad(), self._autocast():
            output = self._compiled(*args, **kwargs)
        if self._clone_outputs:
            output = clone_output(output)
        return self._restore_output_dtypes(output)

    def _infer(self, args, kwargs):
        return self._run(args, kwargs)

    def _load(self, directory, metadata, module, graph, device) -> None:
        if module is None:
            raise ConfigError("the inductor_jit backend recompiles on load and needs the original module")
        self._build(module, graph, device, directory)

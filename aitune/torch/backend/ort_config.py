"""The configuration of :class:`~aitune.torch.backend.ort.ONNXRuntimeBackend`: the execution provider, the
graph optimization level and the transformer fusions it may ask for."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch

from aitune.errors import ConfigError
from aitune.torch.backend.base import BackendConfig


class ONNXExecutionProvider(str, enum.Enum):
    """ONNX Runtime execution provider (EP) a session runs on.

    ``CPU`` is aitune's addition (the reference system offers CUDA and TensorRT only).
    ``TENSORRT`` asks for ``[TensorrtExecutionProvider, CUDAExecutionProvider]``: ONNX Runtime runs on CUDA
    the parts TensorRT does not take.
    """

    CPU = "cpu"
    CUDA = "cuda"
    TENSORRT = "tensorrt"

    @property
    def ort_name(self) -> str:
        """ONNX Runtime's name of the provider (``CUDAExecutionProvider``)."""
        return _ORT_NAMES[self]

    @property
    def label(self) -> str:
        return {"cpu": "CPU", "cuda": "CUDA", "tensorrt": "TensorRT"}[self.value]


_ORT_NAMES = {
    ONNXExecutionProvider.CPU: "CPUExecutionProvider",
    ONNXExecutionProvider.CUDA: "CUDAExecutionProvider",
    ONNXExecutionProvider.TENSORRT: "TensorrtExecutionProvider",
}

# ONNX Runtime's SessionOptions.graph_optimization_level values, by config name.
GRAPH_OPTIMIZATION_LEVELS = {
    "disable": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "all": "ORT_ENABLE_ALL",
}


def coerce_execution_provider(value: Any) -> ONNXExecutionProvider | None:
    """``None``, an :class:`ONNXExecutionProvider`, its value (``"cuda"``) or ORT name -> the enum member.

    Raises:
        ConfigError: for anything else; the message lists the valid values.
    """
    if value is None or isinstance(value, ONNXExecutionProvider):
        return value
    if isinstance(value, str):
        text = value.strip()
        for member in ONNXExecutionProvider:
            if text.lower() in (member.value, member.ort_name.lower()):
                return member
    raise ConfigError(f"execution_provider must be one of {[m.value for m in ONNXExecutionProvider]} or None, "
                      f"got {value!r}")


TRANSFORMER_MODEL_TYPES = ("bert", "gpt2", "t5", "vit", "clip", "bart")


@dataclasses.dataclass(kw_only=True)
class ONNXRuntimeBackendConfig(BackendConfig):
    """Config of :class:`ONNXRuntimeBackend`.

    Args:
        use_dynamo: export with ``torch.onnx.export(dynamo=True)`` first (falls back to the TorchScript
            exporter if it fails); False uses the TorchScript exporter only.
        execution_provider: :class:`ONNXExecutionProvider` or its value; None = CUDA on a CUDA device, CPU on
            a CPU device.
        opset_version: ONNX opset of the export; None lets the exporter choose.
        intra_op_num_threads / inter_op_num_threads: ONNX Runtime thread pools (None: ONNX Runtime's default,
            one thread per physical core for intra-op).
        graph_optimization_level: ``"disable"``, ``"basic"``, ``"extended"`` or ``"all"`` (ONNX Runtime's
            ``GraphOptimizationLevel``).
        transformer_fusions: run ONNX Runtime's transformer optimizer (``onnxruntime.transformers.optimizer``:
            attention, LayerNorm, GELU and bias fusions) on the exported graph before the session is built,
            for this ``model_type`` (``"bert"`` covers BERT-like encoders); None = off. A module holding a Hugging
            Face model is then exported as a copy with eager attention by the TorchScript exporter, which attention
            fusion needs (:func:`~aitune.torch.backend.ort_fusions.export_for_fusions`; the copy costs as much
            memory again while it is exported).
        cuda_graph: capture ONNX Runtime CUDA graphs (the CUDA EP's ``enable_cuda_graph``), one per recorded
            input shape, replayed with inputs and outputs in persistent device buffers; other shapes are refused
            (:meth:`~aitune.torch.backend.ort.ONNXRuntimeBackend.rejects`) and run eager. CUDA EP only; where ONNX Runtime
            refuses the capture (nodes off the CUDA EP, in some versions), the build fails with its message (see
            :mod:`~aitune.torch.backend.ort_cuda_graph`).
        prefer_nhwc: the CUDA EP's ``prefer_nhwc``: convolutions and the ops around them in channels-last layout
            (NHWC), which cuDNN's fp16 tensor-core kernels take without transposes; ONNX Runtime inserts the layout
            transposes at the graph's edges (its CUDA EP documentation: "depends on the model"). CUDA EP only; an
            ONNX Runtime built without NHWC kernels keeps NCHW.

    Raises:
        ConfigError: on an invalid field.
    """

    use_dynamo: bool = True
    execution_provider: ONNXExecutionProvider | str | None = None
    opset_version: int | None = None
    intra_op_num_threads: int | None = None
    inter_op_num_threads: int | None = None
    graph_optimization_level: str = "all"
    transformer_fusions: str | None = None
    cuda_graph: bool = False
    prefer_nhwc: bool = False

    def validate(self) -> None:
        if not isinstance(self.use_dynamo, bool):
            raise ConfigError(f"use_dynamo must be a bool, got {self.use_dynamo!r}")
        self.execution_provider = coerce_execution_provider(self.execution_provider)
        if self.opset_version is not None and (not isinstance(self.opset_version, int)
                                               or isinstance(self.opset_version, bool) or self.opset_version < 7):
            raise ConfigError(f"opset_version must be an int >= 7 or None, got {self.opset_version!r}")
        for name in ("intra_op_num_threads", "inter_op_num_threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"{name} must be an int >= 1 or None (ONNX Runtime's default), got {value!r}")
        if self.transformer_fusions is not None and self.transformer_fusions not in TRANSFORMER_MODEL_TYPES:
            raise ConfigError(f"transformer_fusions must be one of {TRANSFORMER_MODEL_TYPES} or None, got "
                              f"{self.transformer_fusions!r}")
        if not isinstance(self.cuda_graph, bool):
            raise ConfigError(f"cuda_graph must be a bool, got {self.cuda_graph!r}")
        if self.cuda_graph and self.execution_provider not in (None, ONNXExecutionProvider.CUDA):
            raise ConfigError(f"cuda_graph=True needs the CUDA execution provider (execution_provider='cuda' or None "
                              f"on a CUDA device), got execution_provider={self.execution_provider.value!r}")
        if not isinstance(self.prefer_nhwc, bool):
            raise ConfigError(f"prefer_nhwc must be a bool, got {self.prefer_nhwc!r}")
        if self.prefer_nhwc and self.execution_provider not in (None, ONNXExecutionProvider.CUDA):
            raise ConfigError(f"prefer_nhwc=True is an option of the CUDA execution provider (execution_provider="
                              f"'cuda' or None on a CUDA device), got execution_provider="
                              f"{self.execution_provider.value!r}")
        if self.graph_optimization_level not in GRAPH_OPTIMIZATION_LEVELS:
            raise ConfigError(f"graph_optimization_level must be one of {list(GRAPH_OPTIMIZATION_LEVELS)}, "
                              f"got {self.graph_optimization_level!r}")

    def resolved_provider(self, device: torch.device | str) -> ONNXExecutionProvider:
        """The provider used on ``device``: the configured one, else CUDA on CUDA devices and CPU otherwise."""
        if self.execution_provider is not None:
            return self.execution_provider
        return ONNXExecutionProvider.CUDA if torch.device(device).type == "cuda" else ONNXExecutionProvider.CPU

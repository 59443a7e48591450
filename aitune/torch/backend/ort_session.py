"""How :class:`~aitune.torch.backend.ort.ONNXRuntimeBackend` asks ONNX Runtime for a session: the session
options and the execution providers with their options (ONNX Runtime's documented Python API)."""

from __future__ import annotations

from pathlib import Path

from aitune.torch.backend.ort_config import GRAPH_OPTIMIZATION_LEVELS, ONNXExecutionProvider, ONNXRuntimeBackendConfig


def session_options(config: ONNXRuntimeBackendConfig, profile_prefix: Path | None = None):
    """``onnxruntime.SessionOptions`` for ``config``; with ``profile_prefix``, profiling on (the JSON goes to
    ``<profile_prefix>_<date>.json``: NOTE [node placement from the profile] in
    :mod:`~aitune.torch.backend.ort_placement`)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = getattr(onnxruntime.GraphOptimizationLevel,
                                               GRAPH_OPTIMIZATION_LEVELS[config.graph_optimization_level])
    if config.intra_op_num_threads is not None:
        options.intra_op_num_threads = config.intra_op_num_threads
    if config.inter_op_num_threads is not None:
        options.inter_op_num_threads = config.inter_op_num_threads
    options.log_severity_level = 3  # errors only; failures reach us as exceptions
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = str(profile_prefix)
    return options


def provider_list(provider: ONNXExecutionProvider, device_index: int, cuda_graph: bool = False,
                  config: ONNXRuntimeBackendConfig | None = None) -> list:
    """The ``providers`` argument of ``InferenceSession``: the requested EP with its options
    (:func:`cuda_provider_options`). The TensorRT EP is followed by the CUDA EP, which runs what TensorRT does not
    take."""
    cuda_options = cuda_provider_options(device_index, cuda_graph, config)
    cuda = ("CUDAExecutionProvider", cuda_options)
    if provider is ONNXExecutionProvider.CUDA:
        return [cuda]
    if provider is ONNXExecutionProvider.TENSORRT:
        return [("TensorrtExecutionProvider", {"device_id": device_index}), cuda]
    return ["CPUExecutionProvider"]


def cuda_provider_options(device_index: int, cuda_graph: bool = False,
                          config: ONNXRuntimeBackendConfig | dict | None = None) -> dict:
    """The CUDA EP's options (ONNX Runtime's CUDA EP documentation; values as strings): ``{"device_id": index}``,
    ``"enable_cuda_graph": "1"`` for CUDA graphs (NOTE [ONNX Runtime CUDA graphs] in
    :mod:`~aitune.torch.backend.ort_cuda_graph`), and ``"prefer_nhwc": "1"`` where ``config`` (a config, or its stored
    settings as a dict) sets it. Checkpoints' deployment artifacts list the same."""
    options: dict = {"device_id": device_index}
    if cuda_graph:
        options["enable_cuda_graph"] = "1"
    if (config.get("prefer_nhwc") if isinstance(config, dict) else getattr(config, "prefer_nhwc", False)):
        options["prefer_nhwc"] = "1"
    return options


def inactive_provider_message(provider: ONNXExecutionProvider, active: list[str]) -> str:
    """Why a session that does not run on the requested EP is refused (ONNX Runtime may fall back to CPU
    silently: microsoft/onnxruntime#23372)."""
    on = "CPU" if active and active[0] == "CPUExecutionProvider" else (active[0] if active else "nothing")
    on = "CUDA" if on == "CUDAExecutionProvider" else on
    return (f"onnxruntime: requested {provider.label} EP not active; session on {on} (active providers: "
            f"{', '.join(active)}; install an onnxruntime-gpu that matches this CUDA — pip install "
            "'aitune[onnx-gpu]')")

"""The deployment artifact of an :class:`~aitune.torch.backend.ort.ONNXRuntimeBackend` graph, built from the
metadata the backend writes into checkpoints (:mod:`aitune.torch.backend.artifact`)."""

from __future__ import annotations

from pathlib import Path

from aitune.torch.backend.artifact import (
    DeploymentArtifact,
    GraphFacts,
    config_data,
    input_info,
    output_infos,
    stored_files,
)
from aitune.torch.backend.ort_config import GRAPH_OPTIMIZATION_LEVELS, ONNXExecutionProvider


def onnx_artifact(metadata: dict, directory: Path, config: dict, graph: GraphFacts,
                  backend: str = "onnxruntime") -> DeploymentArtifact:
    """The ONNX model (``metadata["onnx_file"]``, the transformer-fused one when fusions ran) and its external
    data in ``directory``; inputs in the ONNX graph's order with the bounds the backend accepts; the session
    options the backend set.

    Args:
        metadata: what ``ONNXRuntimeBackend._save`` returns (``onnx_file``, ``external_data_files``,
            ``execution_provider``, ``io``: an ``OnnxCallIO.to_json``).
        directory: the folder the files lie in. config: the backend config's ``to_dict``.
        graph: the graph's :class:`GraphFacts`.
    """
    io = metadata["io"]
    settings = config_data(config)
    accepted = io.get("accepted_shapes")
    inputs = []
    for name, position in zip(io["input_names"], io["input_positions"]):
        shapes = [shape[position] for shape in accepted] if accepted else None
        inputs.append(input_info(name, io["input_dtypes"][position], io["tensor_indices"][position],
                                 io["input_low"][position], io["input_high"][position], graph, shapes=shapes))
    provider = ONNXExecutionProvider(metadata.get("execution_provider") or "cpu")
    device_id = int(graph.device.partition(":")[2] or 0)
    providers: list = {
        ONNXExecutionProvider.CPU: [["CPUExecutionProvider", {}]],
        ONNXExecutionProvider.CUDA: [["CUDAExecutionProvider", {"device_id": device_id}]],
        ONNXExecutionProvider.TENSORRT: [["TensorrtExecutionProvider", {"device_id": device_id}],
                                         ["CUDAExecutionProvider", {"device_id": device_id}]],
    }[provider]
    level = GRAPH_OPTIMIZATION_LEVELS[settings.get("graph_optimization_level") or "all"]
    session_options = {"graph_optimization_level": level}
    for key in ("intra_op_num_threads", "inter_op_num_threads"):
        if settings.get(key) is not None:
            session_options[key] = settings[key]
    runtime = {
        "loader": "onnxruntime.InferenceSession(files[0], sess_options, providers)",
        "execution_providers": providers,
        "graph_optimization_level": level,
        "session_options": session_options,
        "io_binding": provider is not ONNXExecutionProvider.CPU,
        "cuda_graphs": False,
        "transformer_fusions": settings.get("transformer_fusions"),
        "exporter": metadata.get("exporter"),
        "feeds": "one array per input name; outputs in the listed order",
    }
    files = stored_files(directory, [metadata["onnx_file"], *metadata.get("external_data_files", [])])
    return DeploymentArtifact(graph=graph.name, backend=backend, format="onnx", files=files, inputs=tuple(inputs),
                              outputs=output_infos(io["outputs"], io["output_names"]),
                              constants=dict(graph.constants), runtime=runtime)

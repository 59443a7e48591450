"""The deployment artifact of an :class:`~aitune.torch.backend.ort.ONNXRuntimeBackend` graph, built from the
metadata the backend writes into checkpoints (:mod:`aitune.torch.backend.artifact`)."""

from __future__ import annotations

import shutil
from pathlib import Path

from aitune.torch.backend.artifact import (
    DeploymentArtifact,
    GraphFacts,
    config_data,
    input_info,
    output_infos,
    stored_files,
)
from aitune.torch.backend.onnx_graph import external_data_files
from aitune.torch.backend.ort_config import GRAPH_OPTIMIZATION_LEVELS, ONNXExecutionProvider
from aitune.torch.backend.ort_session import cuda_provider_options
from aitune.torch.record.onnx_module import onnx_files_digest


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
        ONNXExecutionProvider.CUDA: [["CUDAExecutionProvider", cuda_provider_options(
            device_id, bool(settings.get("cuda_graph")), settings)]],
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
        "cuda_graphs": bool(settings.get("cuda_graph")),  # one per accepted shape, run config "gpu_graph_id" 1, 2...
        "transformer_fusions": settings.get("transformer_fusions"),
        "exporter": metadata.get("exporter"),
        "feeds": "one array per input name; outputs in the listed order",
    }
    files = stored_files(directory, [metadata["onnx_file"], *metadata.get("external_data_files", [])])
    return DeploymentArtifact(graph=graph.name, backend=backend, format="onnx", files=files, inputs=tuple(inputs),
                              outputs=output_infos(io["outputs"], io["output_names"]),
                              constants=dict(graph.constants), runtime=runtime)


def copy_onnx_model(onnx_path: Path, external_files: list[str], workdir: Path | None, directory: Path,
                    default_name: str) -> tuple[str, bool]:
    """Copy the model a session runs (``onnx_path``) and its external data (names relative to its folder) into
    ``directory``; returns (the stored model's name, whether the model is in the build folder ``workdir``).

    A model outside the workdir is an OnnxModule's file: stored as ``default_name`` (its external data locations
    are relative to its folder, whatever its name)."""
    source_dir = onnx_path.parent
    inside = workdir is not None and source_dir.resolve() == Path(workdir).resolve()
    stored = onnx_path.name if inside else default_name
    for source, name in [(onnx_path, stored)] + [(source_dir / name, name) for name in external_files]:
        target = directory / name
        if source.resolve() != target.resolve():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return stored, inside


def onnx_file_changed(onnx_path: Path, model_path: Path, sha256: str | None, consequence: str) -> str | None:
    """Why an OnnxModule's file (``model_path``: the file at ``onnx_path`` or a copy, with its external data) is
    not the one the session runs: its sha256 differs from ``sha256``, the OnnxModule's, taken when it was created.
    None when equal, and for exported models (``sha256`` None)."""
    if sha256 is None:
        return None
    try:
        if onnx_files_digest(model_path, external_data_files(model_path)) == sha256:
            return None
        what = "changed since its OnnxModule was created (sha256 differs)"
    except Exception as exc:  # noqa: BLE001 - a deleted or damaged file is a changed one, said as such
        what = f"can no longer be read as it was ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
    return (f"onnxruntime: {onnx_path} (or its external data) {what}, so {consequence}; restore the "
            "file, or build a new OnnxModule of it and tune again")

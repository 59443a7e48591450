"""The deployment artifact of a :class:`~aitune.torch.backend.tensorrt.TensorRTBackend` graph, built from the
metadata the backend writes into checkpoints (:mod:`aitune.torch.backend.artifact`).

Written against that metadata only: it has not been run with a real TensorRT engine (TensorRT does not
install where aitune's tests run); ``tests/unit/test_deployment_artifacts.py`` checks it on stored metadata.
"""

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

PROFILES_FILE = "model_optimization_profiles.json"


def engine_artifact(metadata: dict, directory: Path, config: dict, graph: GraphFacts, backend: str = "tensorrt",
                    profiles_file: str | None = PROFILES_FILE) -> DeploymentArtifact:
    """The serialized engine (``metadata["engine"]``) and its optimization profiles file in ``directory``.

    An input's bounds span every optimization profile that lists it: a summary, since a call must fit one
    profile whole, so shapes inside the bounds of each input can still fit no profile; ``runtime["profiles"]``
    (``[{name: [min, opt, max]}, ...]``) is what the engine accepts. Inputs that the ONNX export dropped
    (unused by the model) are not engine inputs and are left out.

    Args:
        metadata: what ``TensorRTBackend._save`` returns (``engine``, ``profiles``, ``inputs``, ``output_names``,
            ``outputs``, ``build_info``).
        directory: the folder the files lie in. config: the backend config's ``to_dict``.
        graph: the graph's :class:`GraphFacts`. profiles_file: the profiles file beside the engine, or None.
    """
    settings = config_data(config)
    profiles = metadata.get("profiles") or []
    inputs = []
    for entry in metadata["inputs"]:
        ranges = [profile[entry["name"]] for profile in profiles if entry["name"] in profile]
        if not ranges:
            continue
        low = [min(r[0][axis] for r in ranges) for axis in range(len(ranges[0][0]))]
        high = [max(r[2][axis] for r in ranges) for axis in range(len(ranges[0][2]))]
        inputs.append(input_info(entry["name"], entry.get("dtype") or "", int(entry["leaf_index"]), low, high, graph,
                                 path=entry.get("path") or None))
    build_info = metadata.get("build_info") or {}
    runtime = {
        "loader": "tensorrt.Runtime(logger).deserialize_cuda_engine(open(files[0], 'rb').read())",
        "device": graph.device,
        "profiles": profiles,
        "tensorrt_version": build_info.get("tensorrt_version"),
        "compatibility_level": settings.get("compatibility_level"),
        "cuda_graphs": bool(settings.get("use_cuda_graphs", False)),
        "io": "name-based I/O (set_tensor_address by name); pick the profile the call's shapes fit",
    }
    names = [metadata["engine"]] + ([profiles_file] if profiles_file else [])
    return DeploymentArtifact(graph=graph.name, backend=backend, format="tensorrt_engine",
                              files=stored_files(directory, names), inputs=tuple(inputs),
                              outputs=output_infos(metadata["outputs"], metadata.get("output_names")),
                              constants=dict(graph.constants), runtime=runtime)

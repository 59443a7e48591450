"""The deployment artifact of a :class:`~aitune.torch.backend.inductor_aot.TorchInductorAotBackend` graph, built
from the metadata the backend writes into checkpoints (:mod:`aitune.torch.backend.artifact`)."""

from __future__ import annotations

from pathlib import Path

from aitune.torch.backend.artifact import DeploymentArtifact, GraphFacts, input_info, output_infos, stored_files


def pt2_artifact(metadata: dict, directory: Path, graph: GraphFacts,
                 backend: str = "inductor_aot") -> DeploymentArtifact:
    """The AOTInductor package (``metadata["package"]``) in ``directory``; its inputs are the graph's tensor
    inputs, flat and positional, in the listed order, with the ranges ``torch.export`` kept.

    Args:
        metadata: what ``TorchInductorAotBackend._save`` returns (``package``, ``device``, ``inputs``: accepted
            ranges per tensor input, ``input_names``, ``outputs``).
        directory: the folder the package lies in. graph: the graph's :class:`GraphFacts`.
    """
    entries = metadata["inputs"]
    names = metadata.get("input_names") or [f"input_{index}" for index in range(len(entries))]
    inputs = tuple(input_info(name, entry["dtype"], int(entry["leaf_index"]), entry["low"], entry["high"], graph,
                              path=entry.get("path") or None) for name, entry in zip(names, entries))
    device = str(metadata.get("device") or graph.device)
    runtime = {
        "loader": "torch._inductor.aoti_load_package(files[0], device_index=...)",
        "device": device,
        "device_index": -1 if device.startswith("cpu") else int(device.partition(":")[2] or 0),
        "call": "runner(*inputs): the inputs as contiguous tensors on the device, positional, in the listed "
                "order; returns the outputs as a list in the listed order",
        "requires": "the torch version that compiled it (AOTInductor packages do not move across versions)",
    }
    build_info = metadata.get("build_info") or {}
    if build_info.get("specialized_axes"):
        runtime["specialized_axes"] = build_info["specialized_axes"]
    return DeploymentArtifact(graph=graph.name, backend=backend, format="pt2",
                              files=stored_files(directory, [metadata["package"]]), inputs=inputs,
                              outputs=output_infos(metadata["outputs"]), constants=dict(graph.constants),
                              runtime=runtime)

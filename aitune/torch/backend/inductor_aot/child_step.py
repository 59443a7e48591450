"""The isolated build step of the AOTInductor backend: compile the saved ExportedProgram, load, run once, check.

Runs in a child process (:func:`aitune.torch.backend.isolation.run_isolated`); it exchanges only files with
the parent.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from aitune.torch.backend.inductor_aot.canary import loads_here
from aitune.torch.backend.inductor_aot.runtime import check_outputs, load_package

logger = logging.getLogger(__name__)


def compile_and_check_package(exported_path: str, package_path: str, sample_path: str,
                              expected_outputs: list[dict], inductor_configs: dict | None, device: str) -> dict:
    """Compile an ExportedProgram with AOTInductor, load the package and run it once (the isolated step).

    Runs in a child process started by :func:`aitune.torch.backend.isolation.run_isolated`, and exchanges only files.

    Args:
        exported_path: file written by ``torch.export.save``.
        package_path: where ``aoti_compile_and_package`` writes the ``.pt2`` package.
        sample_path: safetensors file with the flat inputs ``input_0 ... input_<n-1>`` (CPU tensors).
        expected_outputs: eager's flat outputs on that sample, ``[{"shape": [...], "dtype": "float32"}, ...]``.
        inductor_configs: ``torch._inductor.config`` options, or None.
        device: ``"cpu"`` or ``"cuda:<index>"``.

    Returns:
        ``{"compile_s": float, "load_s": float, "run_s": float, "package_bytes": int, "output_shapes": [...]}``.

    Raises:
        RuntimeError: if the package's outputs differ in number, shape or dtype from eager's.
    """
    from safetensors.torch import load_file

    started = time.perf_counter()
    loads_here(device, Path(package_path).parent)
    exported = torch.export.load(exported_path)
    torch._inductor.aoti_compile_and_package(exported, package_path=package_path,
                                             inductor_configs=inductor_configs or None)
    compiled = time.perf_counter()
    logger.info("AOTInductor package written to %s in %.1f s", package_path, compiled - started)
    runner = load_package(package_path, torch.device(device))
    loaded = time.perf_counter()
    tensors = load_file(sample_path)
    inputs = [tensors[f"input_{index}"].to(device) for index in range(len(tensors))]
    with torch.no_grad():
        outputs = list(runner(*inputs))
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    ran = time.perf_counter()
    check_outputs(outputs, expected_outputs)
    logger.info("package loaded in %.2f s and ran once in %.3f s; output shapes match eager",
                loaded - compiled, ran - loaded)
    return {"compile_s": compiled - started, "load_s": loaded - compiled, "run_s": ran - loaded,
            "package_bytes": Path(package_path).stat().st_size,
            "output_shapes": [list(output.shape) for output in outputs]}

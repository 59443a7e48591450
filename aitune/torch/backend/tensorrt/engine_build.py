"""ONNX -> TensorRT engine build, run in a child process by :func:`aitune.torch.backend.isolation.run_isolated`.

An engine build can crash or hang the interpreter, so :func:`build_engine` is a
file-to-file step: it reads the ONNX file, writes the serialized engine (``.plan``), then deserializes the
engine and runs it once on the recorded check inputs before the parent accepts it. Arguments and result
are JSON-able.

The build uses Polygraphy's TensorRT loaders (``NetworkFromOnnxPath``, ``CreateConfig``,
``EngineBytesFromNetwork``), which wrap ``trt.OnnxParser.parse_from_file`` (external weights),
``builder.create_network`` with the STRONGLY_TYPED flag (layer precisions follow the ONNX types: what
autocast/quantization decided, never silently lowered), the builder config (profiles, memory pool limits,
optimization level, hardware compatibility level, TF32 flag, timing cache) and
``builder.build_serialized_network``.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from aitune.torch.backend.tensorrt.config import COMPATIBILITY_LEVELS
from aitune.torch.backend.tensorrt.runtime import TensorRTRunner

logger = logging.getLogger(__name__)


def polygraphy_profiles(profiles: list[dict[str, list[list[int]]]]) -> list:
    """Polygraphy ``Profile`` objects from ``[{name: [min, opt, max]}, ...]`` (needs polygraphy, not TensorRT)."""
    from polygraphy.backend.trt import Profile

    result = []
    for profile in profiles:
        trt_profile = Profile()
        for name, (low, opt, high) in profile.items():
            trt_profile.add(name, min=tuple(low), opt=tuple(opt), max=tuple(high))
        result.append(trt_profile)
    return result


def builder_config_options(trt: Any, *, workspace_size: int | None, optimization_level: int | None,
                           compatibility_level: int | None, timing_cache: str | None) -> dict:
    """Keyword arguments of Polygraphy's ``CreateConfig`` for the backend's settings (None = TensorRT default)."""
    options: dict[str, Any] = {}
    if workspace_size is not None:
        options["memory_pool_limits"] = {trt.MemoryPoolType.WORKSPACE: int(workspace_size)}
    if optimization_level is not None:
        options["builder_optimization_level"] = int(optimization_level)
    if compatibility_level is not None:
        options["hardware_compatibility_level"] = getattr(trt.HardwareCompatibilityLevel,
                                                          COMPATIBILITY_LEVELS[int(compatibility_level)])
    if timing_cache is not None:
        options["load_timing_cache"] = timing_cache
    return options


def build_engine(*, onnx_path: str, engine_path: str, profiles: list[dict], input_names: list[str],
                 output_names: list[str], workspace_size: int | None = None, optimization_level: int | None = None,
                 compatibility_level: int | None = None, timing_cache: str | None = None, enable_tf32: bool = True,
                 check_inputs_path: str | None = None, device_index: int = 0) -> dict:
    """Build a strongly typed TensorRT engine from ``onnx_path`` and write it to ``engine_path``.

    Args:
        onnx_path: the ONNX model (external weights beside it are found by the parser).
        engine_path: where the serialized engine goes; a partial file is removed on failure.
        profiles: ``[{input name: [min, opt, max]}, ...]``, one entry per optimization profile.
        input_names / output_names: engine I/O names in flat order (for the check run).
        workspace_size: workspace memory pool limit, bytes; None = TensorRT default.
        optimization_level: builder optimization level 0-5; None = TensorRT default (3).
        compatibility_level: ``trt.HardwareCompatibilityLevel`` value (0, 1, 2); None = default.
        timing_cache: tactic timing cache file, read if present and merged/written after the build.
        enable_tf32: set (True) or clear (False) the TF32 builder flag.
        check_inputs_path: a ``torch.save``d list of flat input tensors; the built engine is run once on
            them (loaded with ``weights_only=True``).
        device_index: CUDA device to build and check on.

    Returns:
        ``{"engine_path", "engine_bytes", "build_s", "tensorrt_version", "num_profiles", "check_output_shapes"}``.

    Raises:
        Whatever TensorRT/Polygraphy raise (parse errors, build failures); the parent reports them.
    """
    import tensorrt as trt
    import torch
    from polygraphy.backend.trt import CreateConfig, EngineBytesFromNetwork, NetworkFromOnnxPath

    torch.cuda.set_device(device_index)
    engine_file = Path(engine_path)
    engine_file.parent.mkdir(parents=True, exist_ok=True)
    if timing_cache is not None:
        Path(timing_cache).parent.mkdir(parents=True, exist_ok=True)
    existing_cache = timing_cache if timing_cache and os.path.exists(timing_cache) else None
    options = builder_config_options(trt, workspace_size=workspace_size, optimization_level=optimization_level,
                                     compatibility_level=compatibility_level, timing_cache=existing_cache)
    config = CreateConfig(profiles=polygraphy_profiles(profiles), tf32=enable_tf32, **options)
    network = NetworkFromOnnxPath(onnx_path, strongly_typed=True)
    started = time.perf_counter()
    partial = engine_file.with_name(engine_file.name + ".partial")
    try:
        engine_bytes = EngineBytesFromNetwork(network, config=config, save_timing_cache=timing_cache)()
        with open(partial, "wb") as handle:
            handle.write(engine_bytes)
        os.replace(partial, engine_file)
    finally:
        partial.unlink(missing_ok=True)
    build_s = time.perf_counter() - started
    logger.info("built %s (%d bytes) in %.1f s", engine_file, engine_file.stat().st_size, build_s)

    check_shapes: list[list[int]] = []
    if check_inputs_path is not None:
        check_shapes = check_engine(engine_path=str(engine_file), input_names=input_names, output_names=output_names,
                                    inputs_path=check_inputs_path, device_index=device_index)
    return {"engine_path": str(engine_file), "engine_bytes": engine_file.stat().st_size, "build_s": build_s,
            "tensorrt_version": trt.__version__, "num_profiles": len(profiles),
            "check_output_shapes": check_shapes}


def load_engine(engine_path: str | Path):
    """Deserialize an engine file; returns ``(trt module, runtime, engine)`` (keep the runtime alive).

    Raises:
        RuntimeError: if TensorRT cannot deserialize the file (other TensorRT version or GPU model).
    """
    import tensorrt as trt

    trt_logger = trt.Logger(trt.Logger.WARNING)
    runtime = trt.Runtime(trt_logger)
    engine = runtime.deserialize_cuda_engine(Path(engine_path).read_bytes())
    if engine is None:
        raise RuntimeError(f"TensorRT {trt.__version__} could not deserialize {engine_path}; engines only load with "
                           "the TensorRT version and GPU model (or compatibility level) they were built for")
    return trt, runtime, engine


def check_engine(*, engine_path: str, input_names: list[str], output_names: list[str], inputs_path: str,
                 device_index: int = 0) -> list[list[int]]:
    """Load the engine and run it once on the saved inputs; returns the output shapes."""
    import torch

    device = torch.device("cuda", device_index)
    inputs = [tensor.to(device) for tensor in torch.load(inputs_path, weights_only=True)]
    trt, runtime, engine = load_engine(engine_path)
    runner = TensorRTRunner(engine, trt, device, input_names, output_names)
    outputs = runner.run(inputs)
    torch.cuda.synchronize(device)
    del runner, engine, runtime
    return [list(output.shape) for output in outputs]

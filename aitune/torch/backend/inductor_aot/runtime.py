"""Loading an AOTInductor ``.pt2`` package on a device and checking its outputs against eager's."""

from __future__ import annotations

from pathlib import Path

import torch

from aitune.torch.common.dtypes import dtype_name


def check_outputs(outputs: list, expected_outputs: list[dict]) -> None:
    """Raise RuntimeError naming the first output whose count, shape or dtype differs from ``expected``."""
    if len(outputs) != len(expected_outputs):
        raise RuntimeError(f"the AOTInductor package returned {len(outputs)} outputs, eager returns "
                           f"{len(expected_outputs)}")
    for index, (output, expected) in enumerate(zip(outputs, expected_outputs)):
        if not isinstance(output, torch.Tensor):
            raise RuntimeError(f"output {index} of the AOTInductor package is {type(output).__name__}, not a tensor")
        if list(output.shape) != expected["shape"] or dtype_name(output.dtype) != expected["dtype"]:
            raise RuntimeError(f"output {index} of the AOTInductor package is {dtype_name(output.dtype)}"
                               f"{list(output.shape)}, eager gives {expected['dtype']}{expected['shape']}")


def load_package(package_path: str | Path, device: torch.device):
    """``torch._inductor.aoti_load_package`` on ``device`` (the CUDA device index, or -1 for CPU)."""
    device_index = -1
    if device.type == "cuda":
        device_index = device.index if device.index is not None else torch.cuda.current_device()
    return torch._inductor.aoti_load_package(str(package_path), device_index=device_index)

"""dtype names: the one place that turns ``torch.float16`` into ``"float16"`` and back; and whether a module
is float32 throughout.

Checkpoints, configs, artifacts' JSON and reports all write dtypes by these names.
"""

from __future__ import annotations

from typing import Any

import torch

from aitune.errors import ConfigError

# Short spellings users type in configs; canonical names are torch's own attribute names.
_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32",
            "fp64": "float64", "double": "float64"}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"`` (torch's attribute name, no ``torch.`` prefix)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: Any, error: type[Exception] = ConfigError, where: str = "") -> torch.dtype:
    """``"float16"`` / ``"torch.float16"`` / ``"fp16"`` / ``torch.float16`` -> ``torch.float16``.

    Args:
        name: a dtype, its name, or a short alias (fp16, bf16, fp32, half, float, fp64, double).
        error: exception class raised for an unknown name (e.g. CheckpointError when reading a file).
        where: what is being read, for the message (``"TorchAOBackendConfig.dtype"``).

    Raises:
        ``error`` (ConfigError by default): when ``name`` is not a torch dtype.
    """
    if isinstance(name, torch.dtype):
        return name
    text = str(name).removeprefix("torch.")
    dtype = getattr(torch, _ALIASES.get(text, text), None)
    if not isinstance(dtype, torch.dtype):
        prefix = f"{where}: " if where else ""
        raise error(f"{prefix}{name!r} is not a torch dtype (use e.g. torch.float16 or 'bfloat16')")
    return dtype


def is_fp32_model(module: torch.nn.Module | None) -> bool:
    """Every floating parameter and buffer of ``module`` is float32 (and there is at least one)."""
    if module is None:
        return False
    dtypes = {tensor.dtype for tensor in (*module.parameters(), *module.buffers()) if tensor.is_floating_point()}
    return dtypes == {torch.float32}

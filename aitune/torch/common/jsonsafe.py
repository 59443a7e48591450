"""Strict JSON from report rows, build facts and metadata: the one sanitizer every writer uses."""

from __future__ import annotations

import enum
import math
from pathlib import Path
from typing import Any

import torch

from aitune.torch.common.dtypes import dtype_name


def json_safe(value: Any) -> Any:
    """A copy of ``value`` that ``json.dumps(..., allow_nan=False)`` accepts.

    dict keys become strings; tuples and sets become lists (sets sorted); NaN and +-inf become None (JSON has
    no such numbers); enums give their value, dtypes their name (``float16``), devices and paths their text;
    anything else its ``str``.
    """
    if isinstance(value, dict):
        return {str(key): json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    if isinstance(value, (set, frozenset)):
        return sorted((json_safe(item) for item in value), key=repr)
    if isinstance(value, bool) or value is None or isinstance(value, (str, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, enum.Enum):
        return json_safe(value.value)
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if isinstance(value, (torch.device, Path)):
        return str(value)
    return str(value)

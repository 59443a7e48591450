"""The JSON form of tensors in requests and responses.

A tensor is either a plain nested list (its dtype is the tuned input's) or an object::

    {"data": [[101, 2023, 102]], "dtype": "int64"}            # nested list, dtype checked against the tuned one
    {"data": [101, 2023, 102, 0], "dtype": "int64", "shape": [2, 2]}   # flat data and its shape

Responses use the object form with ``shape`` always present; containers the model returns become JSON
objects (dicts, dataclasses, ``ModelOutput``, namedtuples) or arrays (lists, tuples). JSON has no NaN or
infinity: such values are written as the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch

from aitune.errors import RequestError, one_line
from aitune.torch.common.dtypes import dtype_from_name, dtype_name

_TENSOR_KEYS = {"data", "dtype", "shape"}


def tensor_from_json(value: Any, dtype: torch.dtype, field: str) -> torch.Tensor:
    """Decode one request tensor and cast it to ``dtype`` (the tuned input's).

    Args:
        value: a nested list of numbers, ``{"data": ..., "dtype": ..., "shape": ...}``, or a ``torch.Tensor``
            (Python handle calls) / an object with ``__array__``.
        dtype: the dtype the tuned graph was recorded with.
        field: the request field, for messages (``inputs.input_ids``).

    Returns:
        A CPU tensor of ``dtype``.

    Raises:
        RequestError: 422 naming ``field`` for another dtype, float data for an integer input, ragged or
            non-numeric data, or data that does not fill ``shape``; 400 for an object with unknown keys.
    """
    declared = None
    shape = None
    if isinstance(value, Mapping):
        unknown = set(value) - _TENSOR_KEYS
        if "data" not in value or unknown:
            raise RequestError(f"{field}: a tensor is a nested list or an object with 'data' (and optional 'dtype', "
                               f"'shape'); got keys {sorted(value)}", status=400, field=field)
        if value.get("dtype") is not None:
            declared = dtype_from_name(value["dtype"], RequestError, field)
        shape = value.get("shape")
        value = value["data"]
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu()
    else:
        try:
            tensor = torch.as_tensor(value) if hasattr(value, "__array__") else torch.tensor(value)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            reason = one_line(exc, 200, type_name=False)
            raise RequestError(f"{field}: not a rectangular array of numbers ({reason})", field=field) from exc
    if declared is None and isinstance(value, torch.Tensor):
        declared = tensor.dtype
    if declared is not None and declared != dtype:
        raise RequestError(f"{field}: dtype {dtype_name(declared)} given, the tuned input is {dtype_name(dtype)}",
                           field=field)
    if tensor.numel() and _kind(tensor.dtype) > _kind(dtype):
        raise RequestError(f"{field}: holds {_kind_name(tensor.dtype)} values, the tuned input is "
                           f"{dtype_name(dtype)}", field=field)
    if shape is not None:
        if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                  for s in shape):
            raise RequestError(f"{field}.shape: must be a list of sizes >= 0, got {shape!r}", field=field)
        if math.prod(shape) != tensor.numel():
            raise RequestError(f"{field}: {tensor.numel()} values do not fill shape {shape}", field=field)
        tensor = tensor.reshape(shape)
    return tensor.to(dtype)


def _kind(dtype: torch.dtype) -> int:
    """0 bool, 1 integer, 2 floating, 3 complex: a request may only go up this order to the tuned dtype."""
    if dtype == torch.bool:
        return 0
    if dtype.is_complex:
        return 3
    if dtype.is_floating_point:
        return 2
    return 1


def _kind_name(dtype: torch.dtype) -> str:
    return ("boolean", "integer", "floating-point", "complex")[_kind(dtype)]


def to_json(value: Any) -> Any:
    """A model output as JSON (see the module docstring); tensors are moved to the CPU."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu()
        data = tensor.tolist()
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            data = _finite_json(data)
        return {"data": data, "dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape)}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return {name: to_json(item) for name, item in zip(value._fields, value)}
    if isinstance(value, Mapping):
        return {str(key): to_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(item) for item in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: to_json(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if isinstance(value, float) and not math.isfinite(value):
        return _finite_json(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _finite_json(data: Any) -> Any:
    if isinstance(data, list):
        return [_finite_json(item) for item in data]
    if isinstance(data, float) and not math.isfinite(data):
        return "NaN" if math.isnan(data) else ("Infinity" if data > 0 else "-Infinity")
    return data

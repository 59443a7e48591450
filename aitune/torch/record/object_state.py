"""An object's state as tensors plus a JSON-native context, and back: how transformers' key/value caches are
opened (:mod:`aitune.torch.record.pytree`, kind ``"kv_cache"``).

Every transformers version has caches (``StaticCache`` and its ``StaticLayer``/``StaticSlidingWindowLayer``
layers, ``DynamicCache``...), but only some register them with torch's pytree (through a helper meant for
``torch.export``), and registering is a global change of how torch treats the type. aitune opens them itself,
the same way on every version: the object's ``__dict__`` walked recursively, every tensor taken out as a leaf
(recorded, cloned and compared like any input) and everything else kept as plain JSON values, with classes
named ``"module:qualname"`` (the layout transformers' own exporter uses, ``_flatten_to_context`` in
``transformers/exporters/exporter_dynamo.py``). Rebuilding creates the objects with ``cls.__new__`` and sets
their ``__dict__`` — no constructor runs — and finds classes only among modules already imported.
"""

from __future__ import annotations

import sys
from typing import Any

import torch


class NotOpenable(TypeError):
    """The object holds something this layout cannot describe (a function, a bound method, a lock...)."""


def class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def find_class(path: str) -> type:
    """The class named ``"module:qualname"`` among imported modules (never imports).

    Raises:
        NotOpenable: the module is not imported or the name is not a class there.
    """
    module_name, _, qualname = path.partition(":")
    value: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        value = getattr(value, part, None)
    if not isinstance(value, type):
        raise NotOpenable(f"class {path!r} is not defined in an imported module")
    return value


def to_context(obj: Any, tensors: list) -> Any:
    """The JSON-native context of ``obj``; its tensors are appended to ``tensors`` in order.

    Raises:
        NotOpenable: for a value it cannot describe.
    """
    if obj is None or type(obj) in (bool, int, float, str):
        return obj
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {"_t": "tensor", "i": len(tensors) - 1}
    if type(obj) is list:
        return [to_context(item, tensors) for item in obj]
    if type(obj) is tuple:
        return {"_t": "tuple", "v": [to_context(item, tensors) for item in obj]}
    if type(obj) is dict:
        return {"_t": "items", "v": [[to_context(key, []), to_context(value, tensors)] for key, value in obj.items()]}
    if isinstance(obj, torch.device):
        return {"_t": "device", "s": str(obj)}
    if isinstance(obj, torch.dtype):
        return {"_t": "dtype", "n": str(obj).removeprefix("torch.")}
    if isinstance(obj, type):
        return {"_t": "type", "p": class_path(obj)}
    if hasattr(obj, "__dict__") and not callable(obj) and "<locals>" not in type(obj).__qualname__:
        return {"_t": "obj", "p": class_path(type(obj)), "s": {name: to_context(value, tensors)
                                                                for name, value in vars(obj).items()}}
    raise NotOpenable(f"cannot describe a {type(obj).__name__}")


def from_context(context: Any, tensors: list) -> Any:
    """Rebuild what :func:`to_context` described, with ``tensors`` in the tensor slots.

    Raises:
        NotOpenable: a malformed context or a class that is not imported.
    """
    if context is None or type(context) in (bool, int, float, str):
        return context
    if type(context) is list:
        return [from_context(item, tensors) for item in context]
    if type(context) is not dict:
        raise NotOpenable(f"malformed context entry {context!r:.80}")
    tag = context.get("_t")
    if tag == "tensor":
        return tensors[int(context["i"])]
    if tag == "tuple":
        return tuple(from_context(item, tensors) for item in context["v"])
    if tag == "items":
        return {from_context(key, tensors): from_context(value, tensors) for key, value in context["v"]}
    if tag == "device":
        return torch.device(context["s"])
    if tag == "dtype":
        value = getattr(torch, str(context["n"]), None)
        if not isinstance(value, torch.dtype):
            raise NotOpenable(f"unknown dtype {context['n']!r}")
        return value
    if tag == "type":
        return find_class(context["p"])
    if tag == "obj":
        cls = find_class(context["p"])
        instance = cls.__new__(cls)
        instance.__dict__.update({name: from_context(value, tensors) for name, value in context["s"].items()})
        return instance
    raise NotOpenable(f"unknown context tag {tag!r}")


def classes_named(context: Any):
    """Every ``"module:qualname"`` a context names (to check before rebuilding from a file)."""
    if isinstance(context, list):
        for item in context:
            yield from classes_named(item)
    elif isinstance(context, dict):
        if context.get("_t") in ("type", "obj") and isinstance(context.get("p"), str):
            yield context["p"]
        for value in context.values():
            yield from classes_named(value)


def reset_state(target: Any, source: Any) -> bool:
    """Put ``source``'s values back into ``target`` in place — tensors by ``copy_`` (their storage, hence their
    addresses, stay), plain values by assignment — where both have one structure; returns False (``target``
    partly reset: make a fresh copy) where they differ, e.g. a lazily created cache that has since allocated its
    tensors. A measurement restores a cache this way before every timed call, instead of cloning it: no
    allocation, and a CUDA graph captured on the cache's tensors stays valid."""
    if isinstance(source, torch.Tensor):
        if not isinstance(target, torch.Tensor) or target.shape != source.shape or target.dtype != source.dtype \
                or target.device != source.device:
            return False
        with torch.no_grad():
            target.copy_(source)
        return True
    if type(source) is not type(target):
        return False
    if isinstance(source, (list, tuple)):
        if len(source) != len(target):
            return False
        if isinstance(source, list):
            return all(_reset_slot(target, index, value) for index, value in enumerate(source))
        return all(reset_state(mine, theirs) for mine, theirs in zip(target, source))
    if isinstance(source, dict):
        return source.keys() == target.keys() and all(_reset_slot(target, key, value) for key, value in source.items())
    if hasattr(source, "__dict__") and not isinstance(source, type):
        state = vars(target)
        if state.keys() != vars(source).keys():
            return False
        return all(_reset_slot(state, name, value) for name, value in vars(source).items())
    return source == target


def _reset_slot(container, key, value) -> bool:
    """Reset ``container[key]`` from ``value``: plain values are assigned, everything else reset in place."""
    if value is None or type(value) in (bool, int, float, str) or isinstance(value, (torch.device, torch.dtype, type)):
        container[key] = value
        return True
    return reset_state(container[key], value)


def moved_context(context: Any, from_type: str, to_device: str) -> Any:
    """``context`` with every device of type ``from_type`` replaced by ``to_device`` (a cache recorded on one device
    and rebuilt on another: its layers must allocate and index where its tensors now are)."""
    if isinstance(context, list):
        return [moved_context(item, from_type, to_device) for item in context]
    if isinstance(context, dict):
        if context.get("_t") == "device" and torch.device(context["s"]).type == from_type:
            return {"_t": "device", "s": to_device}
        return {key: moved_context(value, from_type, to_device) for key, value in context.items()}
    return context

"""JSON forms of input/output structures and constants, shared by checkpoints and AOT backends.

Nothing here unpickles or imports: structure types are stored as ``"module:qualname"`` and resolved at load
only among modules this process has already imported (:func:`resolve_type`), and checked to be the kind
of class recorded (dataclass, namedtuple, dict subclass, transformers ``ModelOutput``).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

import torch

from aitune.errors import CheckpointError
from aitune.torch.common.dtypes import dtype_from_name, dtype_name
from aitune.torch.record.object_state import classes_named, moved_context
from aitune.torch.record.pytree import LEAF, Context, TreeSpec, is_transformers_cache, tree_unflatten


def type_name(node_type: type) -> str:
    """``"module:qualname"`` of a structure type (resolved at load among imported modules only)."""
    return f"{node_type.__module__}:{node_type.__qualname__}"


# NOTE [importable structure modules]: library modules that only define output containers (no side effects
# a checkpoint could trigger beyond what importing the library does anyway); a checkpoint naming one of them
# may have it imported. Any other module must already be imported by the user.
IMPORTABLE_MODULES = frozenset({"transformers.modeling_outputs", "transformers.cache_utils",
                                "transformers.utils.generic", "collections", "torch.return_types"})


def _import_allowed(module_name: str):
    import importlib

    try:
        return importlib.import_module(module_name)
    except ImportError:
        return None


def resolve_type(name: str, kind: str) -> type:
    """The class named ``"module:qualname"``, looked up in ``sys.modules`` (a module of the allow-list
    :data:`IMPORTABLE_MODULES`, e.g. ``transformers.modeling_outputs``, is imported when needed; nothing else is).

    Raises:
        CheckpointError: the module is not imported, the name is not found, or it is not a class of ``kind``.
    """
    module_name, sep, qualname = name.partition(":")
    if not sep or not module_name or not qualname:
        raise CheckpointError(f"malformed type name {name!r} in the checkpoint (expected 'module:qualname')")
    module = sys.modules.get(module_name)
    if module is None and module_name in IMPORTABLE_MODULES:
        module = _import_allowed(module_name)
    if module is None:
        raise CheckpointError(
            f"the checkpoint's input/output structure uses the type {qualname!r} from module {module_name!r}, which "
            f"is not imported in this process; import it first (import {module_name}) and load again — aitune "
            "never imports modules named by a checkpoint")
    value: Any = module
    for part in qualname.split("."):
        value = getattr(value, part, None)
        if value is None:
            raise CheckpointError(f"the checkpoint's structure type {name!r} is not defined in the imported module "
                                  f"{module_name!r} (no attribute {part!r}); the code differs from when it was saved")
    if not isinstance(value, type) or not _type_fits(value, kind):
        raise CheckpointError(f"{name!r} resolves to {value!r}, which is not a {kind.replace('_', ' ')} type; the code "
                              "differs from when the checkpoint was saved")
    return value


def _type_fits(value: type, kind: str) -> bool:
    if kind == "namedtuple":
        return issubclass(value, tuple) and hasattr(value, "_fields")
    if kind == "dict":
        return issubclass(value, dict)
    if kind == "dataclass":
        return dataclasses.is_dataclass(value)
    if kind == "model_output":
        return any(k.__name__ == "ModelOutput" and k.__module__.startswith("transformers") for k in value.__mro__)
    return False


def tree_spec_to_json(spec: TreeSpec, where: str = "structure") -> dict:
    """JSON form of a :class:`~aitune.torch.record.pytree.TreeSpec` (types as ``"module:qualname"``).

    Raises:
        CheckpointError: a container type that could not be found again by name (defined inside a
            function, or created dynamically), or a dict key that is not a str/int.
    """
    if spec.kind == LEAF:
        return {"kind": LEAF}
    data: dict[str, Any] = {"kind": spec.kind}
    if spec.kind in ("torch_pytree", "kv_cache"):
        return _node_to_json(spec, where)
    if spec.node_type is not None:
        name = type_name(spec.node_type)
        if "<locals>" in spec.node_type.__qualname__ or _lookup(name) is not spec.node_type:
            raise CheckpointError(
                f"{where} uses the type {spec.node_type.__qualname__!r} (module {spec.node_type.__module__!r}), "
                "which cannot be found by name at load (defined inside a function or created dynamically); "
                "define it at module level")
        data["type"] = name
    if spec.context:
        for key in spec.context:
            if type(key) not in (str, int):
                raise CheckpointError(f"{where} has a dict key {key!r} of type {type(key).__name__}; checkpoints "
                                      "store str and int keys only")
        data["context"] = list(spec.context)
    data["children"] = [tree_spec_to_json(child, where) for child in spec.children]
    return data


def _lookup(name: str) -> Any:
    """What ``"module:qualname"`` names in this process right now (None when absent); no import."""
    module_name, _, qualname = name.partition(":")
    value: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        value = getattr(value, part, None)
    return value


def tree_spec_from_json(data: dict) -> TreeSpec:
    """Inverse of :func:`tree_spec_to_json`. Raises CheckpointError for an unknown kind or unresolvable type."""
    if not isinstance(data, dict):
        raise CheckpointError(f"malformed structure entry {data!r} in the checkpoint")
    kind = data.get("kind")
    if kind == LEAF:
        return TreeSpec(LEAF, None, (), ())
    if kind in ("torch_pytree", "kv_cache"):
        return _node_from_json(data)
    if kind not in ("tuple", "list", "namedtuple", "dict", "dataclass", "model_output"):
        raise CheckpointError(f"unknown structure kind {kind!r} in the checkpoint")
    node_type = resolve_type(data["type"], kind) if data.get("type") else None
    if kind in ("namedtuple", "dataclass", "model_output") and node_type is None:
        raise CheckpointError(f"structure kind {kind!r} without a type in the checkpoint")
    context = tuple(data.get("context", ()))
    children = tuple(tree_spec_from_json(child) for child in data.get("children", []))
    return TreeSpec(kind, node_type, context, children)


# NOTE [pytree nodes in checkpoints]: a transformers key/value cache (kind "kv_cache",
# aitune/torch/record/object_state.py) or another type registered with torch's pytree is stored as its type and
# its flatten context, which must be JSON-native (a cache's is, by construction). Before anything is rebuilt,
# every class the context names must resolve without an import (a module already imported, or one of
# IMPORTABLE_MODULES): a checkpoint never makes this process import a module.
def _node_to_json(spec: TreeSpec, where: str) -> dict:
    import json

    node_type, context = spec.node_type
    name = type_name(node_type)
    if "<locals>" in node_type.__qualname__ or _lookup(name) is not node_type:
        raise CheckpointError(f"{where} uses the type {node_type.__qualname__!r}, which cannot be found by name at "
                              "load; define it at module level")
    value = getattr(context, "value", context)
    try:
        value = json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: the flatten context of {node_type.__qualname__!r} (a torch pytree node) has "
                              f"no JSON form ({exc}); checkpoints never pickle") from exc
    return {"kind": spec.kind, "type": name, "context": value,
            "children": [tree_spec_to_json(child, where) for child in spec.children]}


def _node_from_json(data: dict) -> TreeSpec:
    import torch.utils._pytree as torch_pytree

    kind, name, context = data["kind"], data.get("type"), data.get("context")
    if not isinstance(name, str):
        raise CheckpointError(f"a {kind} node without a type in the checkpoint")
    named = list(classes_named(context))
    if kind == "torch_pytree" and named or kind == "kv_cache" and (
            not named or named[0] != name or any(not path.startswith("transformers.") for path in named)):
        # a context may only rebuild transformers' own cache classes, the top one being the node's type: a file
        # naming another class could create any imported object (and run its finalizer)
        raise CheckpointError(f"the checkpoint's {kind} structure names classes outside transformers' caches "
                              f"({', '.join(named[:3]) or 'none'}); refusing to rebuild it")
    for path in (name, *named):
        module_name = path.partition(":")[0]
        if _lookup(path) is None and module_name in IMPORTABLE_MODULES:
            _import_allowed(module_name)
        if _lookup(path) is None:
            raise CheckpointError(f"the checkpoint's input structure names the class {path!r}, whose module is not "
                                  "imported in this process; import it first — aitune never imports modules named "
                                  "by a checkpoint")
    node_type = _lookup(name)
    if not isinstance(node_type, type) or (kind == "kv_cache" and not is_transformers_cache(node_type)) or \
            (kind == "torch_pytree" and node_type not in torch_pytree.SUPPORTED_NODES):
        raise CheckpointError(f"{name!r} is not a {'transformers cache' if kind == 'kv_cache' else 'torch pytree'} "
                              "type in this process; the code differs from when the checkpoint was saved")
    children = tuple(tree_spec_from_json(child) for child in data.get("children", []))
    return TreeSpec(kind, (node_type, Context(context)), (), children)


def moved_structure(spec: TreeSpec, from_type: str, to_device: torch.device) -> TreeSpec:
    """``spec`` with the devices its key/value cache contexts name moved from ``from_type`` to ``to_device`` (a
    checkpoint's samples loaded on another device than they were recorded on)."""
    if spec.kind == LEAF:
        return spec
    node_type = spec.node_type
    if spec.kind == "kv_cache":
        node_type = (node_type[0], Context(moved_context(node_type[1].value, from_type, str(to_device))))
    return TreeSpec(spec.kind, node_type, spec.context,
                    tuple(moved_structure(child, from_type, to_device) for child in spec.children))


def constant_to_json(value: Any, where: str) -> Any:
    """A graph constant as JSON: None, bool, int, str as is; floats (non-finite ones tagged).

    Raises:
        CheckpointError: for any other type (it could only be stored by pickling).
    """
    if value is None or type(value) in (bool, int, str):
        return value
    if type(value) is float:
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, torch.dtype):
        return {"dtype": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    raise CheckpointError(
        f"{where} is a constant of type {type(value).__module__}.{type(value).__qualname__} ({value!r:.60}); "
        "checkpoints store only JSON constants (None, bool, int, float, str, and lists/dicts of them) and never "
        "pickle; pass it as a tensor or one of those types")


def constant_from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"float"} and value["float"] in ("nan", "inf", "-inf"):
            return float(value["float"])
        if set(value) == {"dtype"} and isinstance(getattr(torch, str(value["dtype"]), None), torch.dtype):
            return dtype_from_name(value["dtype"], CheckpointError, "a constant in the checkpoint")
        if set(value) == {"device"}:
            return torch.device(value["device"])
        raise CheckpointError(f"malformed constant {value!r} in the checkpoint")
    if value is None or type(value) in (bool, int, str, float):
        return value
    raise CheckpointError(f"malformed constant {value!r} in the checkpoint")


def outputs_to_json(spec: TreeSpec, constants: list, is_tensor: list[bool], dtypes: list[torch.dtype]) -> dict:
    """An output structure with its constant leaves and tensor dtypes, as JSON (what AOT backends store to
    rebuild eager's outputs without the original module)."""
    dtype_iter = iter(dtypes)
    slots = [{"tensor": dtype_name(next(dtype_iter))} if tensor else
             {"constant": constant_to_json(constant, "an output leaf")}
             for constant, tensor in zip(constants, is_tensor)]
    return {"spec": tree_spec_to_json(spec, "the output structure"), "slots": slots}


def output_template_from_json(data: dict, recorded_spec: TreeSpec | None = None) -> Any:
    """An output of the stored structure with empty tensors of the stored dtypes in the tensor slots
    (a template for :class:`~aitune.torch.backend.flat.FlatIO`). The recorded graph's structure is used
    when it is the same one (then no type lookup happens at all)."""
    spec = None
    if recorded_spec is not None:
        try:
            if tree_spec_to_json(recorded_spec) == data["spec"]:
                spec = recorded_spec
        except CheckpointError:
            spec = None
    if spec is None:
        spec = tree_spec_from_json(data["spec"])
    leaves = []
    for slot in data["slots"]:
        if "tensor" in slot:
            leaves.append(torch.empty(0, dtype=dtype_from_name(slot["tensor"], CheckpointError,
                                                               "an output dtype in the checkpoint")))
        else:
            leaves.append(constant_from_json(slot["constant"]))
    return tree_unflatten(spec, leaves)

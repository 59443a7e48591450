"""Flatten and rebuild nested inputs/outputs (tuple, list, dict, namedtuple, dataclass, ``ModelOutput``).

We keep our own small pytree instead of ``torch.utils._pytree`` because the structure must also be a
hashable part of a graph's identity, must reproduce user dataclasses without global registration, and
must name every leaf (ONNX/TensorRT tensor names come from leaf paths).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any, Hashable, NamedTuple

from aitune.torch.record.object_state import NotOpenable, from_context, to_context

LEAF = "leaf"


class TreeSpec(NamedTuple):
    """Structure of a nested value; leaves are the places holding tensors or constants.

    kind: ``"leaf"``, ``"tuple"``, ``"list"``, ``"namedtuple"``, ``"dict"``, ``"dataclass"``, ``"model_output"``,
        ``"kv_cache"`` (a transformers key/value cache) or ``"torch_pytree"`` (a type registered with PyTorch's
        pytree).
    node_type: the Python type to rebuild (None for leaves and plain containers; ``(type, context)`` for
        ``kv_cache`` and ``torch_pytree`` nodes).
    context: dict keys / field names, in order.
    children: child specs.
    """

    kind: str
    node_type: Any
    context: tuple
    children: tuple

    @property
    def num_leaves(self) -> int:
        if self.kind == LEAF:
            return 1
        return sum(child.num_leaves for child in self.children)


_LEAF_SPEC = TreeSpec(LEAF, None, (), ())


def _is_model_output(value: Any) -> bool:
    # transformers.utils.ModelOutput without importing transformers.
    return any(klass.__name__ == "ModelOutput" and klass.__module__.startswith("transformers")
               for klass in type(value).__mro__)


def _children(value: Any) -> tuple[str, Any, tuple, list] | None:
    """Return (kind, node_type, context, children) for a container, None for a leaf."""
    value_type = type(value)
    # Fast paths first: this runs on every call of a tuned module.
    if value_type is tuple:
        return "tuple", None, (), list(value)
    if value_type is dict:
        keys = tuple(value)
        return "dict", None, keys, [value[k] for k in keys]
    if value_type is list:
        return "list", None, (), list(value)
    if value_type in _LEAF_TYPES:
        return None
    if _is_model_output(value):
        keys = tuple(value.keys())
        return "model_output", value_type, keys, [value[k] for k in keys]
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return "namedtuple", value_type, tuple(value._fields), list(value)
    if isinstance(value, dict):
        node_type = None if value_type is OrderedDict else value_type
        keys = tuple(value.keys())
        return "dict", node_type, keys, [value[k] for k in keys]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = tuple(field.name for field in dataclasses.fields(value) if field.init)
        return "dataclass", value_type, names, [getattr(value, n) for n in names]
    return _registered_node(value, value_type)


class Context:
    """A torch pytree node's context (any object), hashed by its repr so a TreeSpec stays hashable."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, Context):
            return NotImplemented
        try:
            return bool(self.value == other.value)
        except Exception:  # noqa: BLE001 - contexts that cannot compare compare by text
            return repr(self.value) == repr(other.value)

    def __hash__(self) -> int:
        return hash(repr(self.value))

    def __repr__(self) -> str:
        return f"Context({self.value!r})"


def _registered_node(value: Any, value_type: type):
    """A transformers key/value cache is opened by :mod:`aitune.torch.record.object_state` (kind ``"kv_cache"``:
    its tensors are the leaves, the rest a JSON-native context), whatever the transformers version; other types
    registered with PyTorch's pytree (``torch.utils._pytree.register_pytree_node``) are flattened with their own
    registered functions, so their tensors are compared leaf by leaf."""
    if is_transformers_cache(value_type):
        tensors: list = []
        try:
            context = to_context(value, tensors)
        except NotOpenable:
            return None  # one opaque leaf
        return "kv_cache", (value_type, Context(context)), (), tensors
    import torch.utils._pytree as torch_pytree

    node = torch_pytree.SUPPORTED_NODES.get(value_type)
    if node is None:
        return None
    children, context = node.flatten_fn(value)
    return "torch_pytree", (value_type, Context(context)), (), list(children)


def is_transformers_cache(value_type: type) -> bool:
    """Is ``value_type`` a transformers key/value cache class (a subclass of ``transformers...Cache``)?"""
    return any(klass.__name__ == "Cache" and klass.__module__.startswith("transformers") for klass in value_type.__mro__)


def _leaf_types() -> set:
    import torch

    return {torch.Tensor, torch.nn.Parameter, int, float, bool, str, type(None), bytes, complex}


_LEAF_TYPES = _leaf_types()


def tree_flatten(value: Any, is_leaf=None) -> tuple[list[Any], TreeSpec]:
    """Flatten ``value`` into its leaves (depth-first, container order) and its :class:`TreeSpec`.

    Args:
        value: the nested value.
        is_leaf: ``is_leaf(node) -> bool``: containers for which it is true stay whole, as one leaf.
    """
    leaves: list[Any] = []
    spec = _flatten_into(value, leaves, is_leaf)
    return leaves, spec


def _flatten_into(value: Any, leaves: list[Any], is_leaf=None) -> TreeSpec:
    node = None if is_leaf is not None and is_leaf(value) else _children(value)
    if node is None:
        leaves.append(value)
        return _LEAF_SPEC
    kind, node_type, context, children = node
    return TreeSpec(kind, node_type, context, tuple(_flatten_into(child, leaves, is_leaf) for child in children))


def tree_unflatten(spec: TreeSpec, leaves: list[Any]) -> Any:
    """Rebuild the structure described by ``spec`` from ``leaves`` (inverse of :func:`tree_flatten`)."""
    iterator = iter(leaves)
    value = _unflatten_from(spec, iterator)
    if next(iterator, _SENTINEL) is not _SENTINEL:
        raise ValueError("tree_unflatten: more leaves than the structure holds")
    return value


_SENTINEL = object()


def _unflatten_from(spec: TreeSpec, iterator) -> Any:
    if spec.kind == LEAF:
        value = next(iterator, _SENTINEL)
        if value is _SENTINEL:
            raise ValueError("tree_unflatten: fewer leaves than the structure holds")
        return value
    children = [_unflatten_from(child, iterator) for child in spec.children]
    if spec.kind == "tuple":
        return tuple(children)
    if spec.kind == "list":
        return children
    if spec.kind == "namedtuple":
        return spec.node_type(*children)
    if spec.kind == "dict":
        items = zip(spec.context, children)
        return dict(items) if spec.node_type is None else spec.node_type(items)
    if spec.kind == "kv_cache":
        return from_context(spec.node_type[1].value, children)
    if spec.kind == "torch_pytree":
        import torch.utils._pytree as torch_pytree

        node_type, context = spec.node_type
        return torch_pytree.SUPPORTED_NODES[node_type].unflatten_fn(children, context.value)
    # dataclass and ModelOutput are both rebuilt from keyword arguments.
    return spec.node_type(**dict(zip(spec.context, children)))


def leaf_paths(spec: TreeSpec, prefix: tuple = ()) -> list[tuple]:
    """Paths (tuples of keys/indices) of every leaf of ``spec``, in leaf order."""
    if spec.kind == LEAF:
        return [prefix]
    keys = spec.context if spec.context else range(len(spec.children))
    paths: list[tuple] = []
    for key, child in zip(keys, spec.children):
        paths.extend(leaf_paths(child, prefix + (key,)))
    return paths


def path_to_str(path: tuple) -> str:
    """Human-readable leaf path, e.g. ``('extra', 'stats', 0)`` -> ``extra.stats[0]``."""
    text = ""
    for key in path:
        text += f"[{key}]" if isinstance(key, int) else (f".{key}" if text else str(key))
    return text or "<root>"


def path_to_name(path: tuple, prefix: str) -> str:
    """Tensor name for ONNX/TensorRT, e.g. ``input_x``, ``output_0``, ``input_options_mask``."""
    parts = ["".join(ch if ch.isalnum() else "_" for ch in str(key)) for key in path]
    return "_".join([prefix] + parts) if parts else prefix


def hashable_constant(value: Any) -> Hashable:
    """A hashable stand-in for a non-tensor leaf, used in graph identity (equal values -> equal keys)."""
    try:
        hash(value)
        return (type(value).__qualname__, value)
    except TypeError:
        return (type(value).__qualname__, repr(value))

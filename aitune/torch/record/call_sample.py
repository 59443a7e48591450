"""One recorded call (:class:`Sample`): its arguments cloned, its batch size, and how calls are told apart."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Hashable, Iterable

import torch

from aitune.torch.record.pytree import hashable_constant, tree_flatten, tree_unflatten


def clone_tree(value: Any) -> Any:
    """Deep copy of a nested value with every tensor cloned (detached, outside inference mode).

    Tensors created under ``torch.inference_mode`` become normal tensors so every backend can take them.
    """
    leaves, spec = tree_flatten(value)
    copies = []
    with torch.inference_mode(False):
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                copy_ = leaf.detach().clone()
                if getattr(leaf, "_dynamo_static_input_type", None) is not None:
                    # a tensor marked as a static address (transformers marks its static caches' tensors for
                    # CUDA graphs): the copy is marked too, so candidates see the state as the model does
                    torch._dynamo.mark_static_address(copy_)
                copies.append(copy_)
            else:
                copies.append(copy.deepcopy(leaf))
    return tree_unflatten(spec, copies)


def describe_leaf(leaf: Any) -> Hashable:
    """Graph-identity descriptor of one leaf: tensors by dtype/rank/device, constants by value."""
    if isinstance(leaf, torch.Tensor):
        return ("tensor", leaf.dtype, leaf.dim(), leaf.device.type)
    return ("const", hashable_constant(leaf))


@dataclasses.dataclass
class Sample:
    """One recorded call: canonical ``args``/``kwargs`` (cloned) and its ``batch_size`` (None if unknown)."""

    args: tuple
    kwargs: dict
    batch_size: int | None = None
    # (args, the kwargs values, shapes) of the last shapes() call: a graph compares a new call's shapes
    # with every kept sample's on each recorded call, and flattening a kept call that holds a key/value cache is
    # not free
    _shapes: tuple | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def leaves(self) -> list[Any]:
        return tree_flatten((self.args, self.kwargs))[0]

    def clone(self) -> "Sample":
        args, kwargs = clone_tree((self.args, self.kwargs))
        return Sample(args, kwargs, self.batch_size)

    def shapes(self) -> tuple:
        """The shape of every tensor leaf, in leaf order (remembered while ``args`` and the ``kwargs`` values are
        the same objects; tensors are not resized in place)."""
        memo, values = self._shapes, tuple(self.kwargs.values())
        if memo is not None and memo[0] is self.args and len(memo[1]) == len(values) and all(
                old is new for old, new in zip(memo[1], values)):
            return memo[2]
        shapes = tuple(tuple(leaf.shape) for leaf in self.leaves() if isinstance(leaf, torch.Tensor))
        self._shapes = (self.args, values, shapes)
        return shapes


def infer_batch_size(leaves: Iterable[Any]) -> int | None:
    """Batch size guess for a call: dim 0 of its first tensor of rank >= 1 (None when there is none)."""
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            return int(leaf.shape[0])
    return None


def same_call(first: Sample, second: Sample) -> bool:
    """Do two samples of one graph hold equal values in every leaf (tensors by value, NaN equal to NaN)?"""
    for a, b in zip(first.leaves(), second.leaves()):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if not same_values(a, b):
                return False
        elif a is not b and a != b:
            return False
    return True


def same_values(before: torch.Tensor, after: torch.Tensor) -> bool:
    """Do two tensors hold the same values? Same shape and dtype, equal elements, NaN equal to NaN where both
    have one (floating and complex dtypes); ``before`` is compared on ``after``'s device."""
    if before.shape != after.shape or before.dtype != after.dtype:
        return False
    before, after = before.detach(), after.detach()
    with torch.no_grad():
        before = before.to(after.device)
        if torch.equal(before, after):
            return True
        return bool((before.is_floating_point() or before.is_complex()) and torch.equal(before.isnan(), after.isnan())
                    and torch.equal(before.nan_to_num(), after.nan_to_num()))
"""Flat tensor I/O for exporting backends (torch.export, ONNX, TensorRT).

Exporters handle nested inputs/outputs, dataclasses and keyword-only parameters unevenly
(pytorch/pytorch#96981, #110439, #147400).
So export-based backends never export the user's module directly: they export a :class:`FlatModule`
that takes the graph's tensor leaves as positional tensors (constants of the graph are baked in: the
graph identity already fixes them) and returns the output tensors as a flat tuple.
:class:`FlatIO` turns a call into that flat list and the flat outputs back into eager's structure.
"""

from __future__ import annotations

from typing import Any

import torch

from aitune.torch.record.pytree import TreeSpec, leaf_paths, path_to_name, tree_flatten, tree_unflatten


class FlatModule(torch.nn.Module):
    """``forward(*tensors) -> tuple[Tensor, ...]`` around ``module`` for one graph.

    Args:
        module: the user's module (not copied; shares its parameters).
        graph: the :class:`~aitune.torch.record.samples.GraphSpec` whose structure and constants are fixed.
        output_spec: eager's output structure (non-tensor output leaves are kept as constants).
    """

    def __init__(self, module: torch.nn.Module, graph, output_spec: TreeSpec, output_constants: list[Any],
                 output_is_tensor: list[bool] | None = None):
        super().__init__()
        self.inner = module
        self._input_spec = graph.input_spec
        self._tensor_indices = [spec.leaf_index for spec in graph.tensor_specs]
        leaves = list(graph.samples[0].leaves())
        self._template = [None if i in set(self._tensor_indices) else leaf for i, leaf in enumerate(leaves)]
        self._output_is_tensor = (list(output_is_tensor) if output_is_tensor is not None
                                  else [constant is None for constant in output_constants])

    def forward(self, *tensors: torch.Tensor):
        leaves = list(self._template)
        for index, tensor in zip(self._tensor_indices, tensors):
            leaves[index] = tensor
        args, kwargs = tree_unflatten(self._input_spec, leaves)
        output = self.inner(*args, **kwargs)
        output_leaves, _ = tree_flatten(output)
        return tuple(leaf for leaf, is_tensor in zip(output_leaves, self._output_is_tensor) if is_tensor)


class FlatIO:
    """Maps calls to flat tensor inputs and flat tensor outputs back to eager's output structure.

    Built once from the graph and one eager output; ``input_names``/``output_names`` follow the
    reference naming (``input_<path>``, ``output_<path>``, ``output`` for a lone tensor).
    """

    def __init__(self, graph, eager_output: Any):
        self.graph = graph
        self.tensor_indices = [spec.leaf_index for spec in graph.tensor_specs]
        self.input_names = [spec.name for spec in graph.tensor_specs]
        output_leaves, self.output_spec = tree_flatten(eager_output)
        # None marks a tensor slot; anything else is a constant output leaf reproduced as is.
        self.output_constants = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in output_leaves]
        # A None output leaf is a constant too: this mask, not output_constants, says which slots are tensors.
        self.output_is_tensor = [isinstance(leaf, torch.Tensor) for leaf in output_leaves]
        paths = leaf_paths(self.output_spec)
        tensor_paths = [path for path, leaf in zip(paths, output_leaves) if isinstance(leaf, torch.Tensor)]
        self.output_names = [path_to_name(path, "output") for path in tensor_paths]
        self.output_dtypes = [leaf.dtype for leaf in output_leaves if isinstance(leaf, torch.Tensor)]

    def flat_module(self, module: torch.nn.Module) -> FlatModule:
        return FlatModule(module, self.graph, self.output_spec, self.output_constants, self.output_is_tensor)

    def inputs(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """Tensor leaves of a canonical call, in graph order."""
        leaves, _ = tree_flatten((args, kwargs))
        return [leaves[index] for index in self.tensor_indices]

    def sample_inputs(self, sample) -> list[torch.Tensor]:
        return self.inputs(sample.args, sample.kwargs)

    def outputs(self, tensors) -> Any:
        """Rebuild eager's output structure from the flat output tensors."""
        iterator = iter(tensors)
        leaves = [next(iterator) if is_tensor else constant
                  for constant, is_tensor in zip(self.output_constants, self.output_is_tensor)]
        return tree_unflatten(self.output_spec, leaves)

    def to_dict(self) -> dict:
        return {"input_names": self.input_names, "output_names": self.output_names}


def eager_output(module: torch.nn.Module, graph) -> Any:
    """One eager output of the graph's first sample (on a clone, under no_grad)."""
    sample = graph.samples[0].clone()
    with torch.no_grad():
        return module(*sample.args, **sample.kwargs)

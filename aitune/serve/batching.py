"""From a batch of checked requests (what Ray Serve's ``@serve.batch`` hands over) to model calls, and back.

Ray Serve collects requests; this module decides how they run. Requests on the same graph whose sizes agree
outside the batch axis are concatenated along it — also when they differ only on axes of inputs with a pad
value, which are then padded to the largest size among them. A call never carries more rows than the graph
was tuned for (its batch range from the checkpoint), so every call stays inside the tuned shapes. Requests
outside the tuned range (``out_of_range="eager"``) and graphs without a batch axis run alone.

NOTE [outputs split along axis 0]: the outputs of a call are handed back by slicing every tensor output on
axis 0 (the rows); an output that is not a tensor, or whose axis 0 is not the rows, cannot be split, so the
replica checks this at warm-up and turns batching off (one request per call) when it does not hold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from aitune.serve.inputs import GraphInputs, PreparedRequest, pad_axis
from aitune.torch.record.pytree import tree_flatten, tree_unflatten


class OutputNotSplittable(Exception):
    """A call's outputs cannot be handed back per request (NOTE [outputs split along axis 0])."""


@dataclasses.dataclass
class ModelCall:
    """One call of the model.

    Attributes:
        graph: the tuned graph it runs. members: ``(index of the request in the batch, rows)`` in row order.
        tensors: the call's tensors by input path. rows: total rows. in_range: inside the tuned range.
    """

    graph: GraphInputs
    members: list[tuple[int, int]]
    tensors: dict[str, torch.Tensor]
    rows: int
    in_range: bool = True


def plan_calls(requests: list[PreparedRequest], pad_values: Mapping[str, float], max_rows: int | None = None
               ) -> list[ModelCall]:
    """Group ``requests`` into as few calls as the tuned shapes allow (in arrival order within a group).

    Args:
        requests: checked requests (:meth:`~aitune.serve.inputs.TunedInputs.prepare`).
        pad_values: ``{input path: pad value}``: those inputs' dynamic axes are padded to agree.
        max_rows: rows per call at most (default and upper bound: each graph's largest tuned batch).

    Returns:
        The calls; together their members name every request once.
    """
    calls: list[ModelCall] = []
    groups: dict[tuple, list[int]] = {}
    for index, request in enumerate(requests):
        if request.graph.batch_range is None or not request.in_range:
            calls.append(ModelCall(request.graph, [(index, request.rows)], request.tensors, request.rows,
                                   request.in_range))
            continue
        groups.setdefault(_group_key(request, pad_values), []).append(index)
    for indices in groups.values():
        graph = requests[indices[0]].graph
        limit = graph.max_rows if max_rows is None else max(1, min(max_rows, graph.max_rows))
        chunk: list[int] = []
        rows = 0
        for index in indices:
            if chunk and rows + requests[index].rows > limit:
                calls.append(_concatenate(requests, chunk, pad_values))
                chunk, rows = [], 0
            chunk.append(index)
            rows += requests[index].rows
        if chunk:
            calls.append(_concatenate(requests, chunk, pad_values))
    return calls


def _group_key(request: PreparedRequest, pad_values: Mapping[str, float]) -> tuple:
    parts = [request.graph.name]
    for path, spec in request.graph.tensors.items():
        shape = request.tensors[path].shape
        parts.append(tuple(
            -1 if (axis == spec.batch_axis or (path in pad_values and spec.axes[axis] == "dynamic")) else size
            for axis, size in enumerate(shape)))
    return tuple(parts)


def _concatenate(requests: list[PreparedRequest], chunk: list[int], pad_values: Mapping[str, float]) -> ModelCall:
    first = requests[chunk[0]]
    members = [(index, requests[index].rows) for index in chunk]
    if len(chunk) == 1:
        return ModelCall(first.graph, members, first.tensors, first.rows)
    tensors = {}
    for path, spec in first.graph.tensors.items():
        parts = [requests[index].tensors[path] for index in chunk]
        if path in pad_values:
            for axis, kind in enumerate(spec.axes):
                if kind == "dynamic":
                    size = max(part.shape[axis] for part in parts)
                    parts = [pad_axis(part, axis, size, pad_values[path]) for part in parts]
        tensors[path] = torch.cat(parts, dim=spec.batch_axis)
    return ModelCall(first.graph, members, tensors, sum(rows for _, rows in members))


def split_outputs(output: Any, call: ModelCall) -> list[Any]:
    """The outputs of ``call``, one per member, in member order (NOTE [outputs split along axis 0]).

    Raises:
        OutputNotSplittable: a leaf is not a tensor with ``call.rows`` rows on axis 0 (only with several members).
    """
    if len(call.members) == 1:
        return [output]
    leaves, spec = tree_flatten(output)
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0 or leaf.shape[0] != call.rows:
            shape = list(leaf.shape) if isinstance(leaf, torch.Tensor) else type(leaf).__name__
            raise OutputNotSplittable(f"an output leaf ({shape}) does not have the call's {call.rows} rows on axis 0")
    results = []
    start = 0
    for _, rows in call.members:
        # clone: a slice would carry (and pickle, for handle calls) the whole batch's storage
        results.append(tree_unflatten(spec, [leaf[start:start + rows].clone() for leaf in leaves]))
        start += rows
    return results

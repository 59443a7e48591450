"""Calls to an exported ONNX graph: a module call mapped to the graph's named inputs, its outputs mapped back
to eager's structure, and the JSON form of that mapping kept in checkpoints (shared by the ONNX Runtime and
TensorRT backends).

A loaded graph needs neither the module nor the graph spec: :class:`OnnxCallIO` keeps the input structure,
the accepted shapes and dtypes, the baked constants and the signature of the recorded ``forward``.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING, Any

import torch

from aitune.errors import CheckpointError, ConfigError
from aitune.torch.backend.accepted import AcceptedInput, AcceptedInputs, batch_axes
from aitune.torch.common.dtypes import dtype_from_name, dtype_name
from aitune.torch.record.pytree import LEAF, TreeSpec, hashable_constant, tree_flatten, tree_unflatten
from aitune.torch.record.samples import CallSignature
from aitune.torch.record.serialization import output_template_from_json, outputs_to_json
from aitune.torch.record.serialization import tree_spec_from_json as spec_from_json
from aitune.torch.record.serialization import tree_spec_to_json as spec_to_json

if TYPE_CHECKING:
    from aitune.torch.backend.onnx_export import OnnxExport


def constant_key(value: Any) -> str:
    """A string that is equal for equal constants (used to check that a call's constants are the baked ones)."""
    return repr(hashable_constant(value))


_PLAIN_LEAF_TYPES = (torch.Tensor, int, float, bool, str, type(None))


@dataclasses.dataclass
class OnnxCallIO:
    """Maps a module call to the ONNX graph's named inputs and its outputs back to eager's structure.

    Built from an :class:`OnnxExport` at build time, stored as JSON in checkpoints, and rebuilt without the
    module or the graph (types of structured outputs are then imported by name, see
    :func:`spec_from_json`).

    Attributes:
        input_spec: structure of the canonical ``(args, kwargs)`` of the graph.
        num_leaves: number of input leaves; tensor_indices: leaf index of each flat tensor input.
        input_dtypes / input_low / input_high: dtype and accepted size range per flat tensor input.
        constant_keys: ``{leaf index: key}`` of the non-tensor inputs baked into the graph.
        input_names / input_positions: ONNX input names and the flat tensor position each takes.
        output_names / output_dtypes: ONNX output names and eager's dtype of each.
        output_spec / output_constants: eager's output structure and its non-tensor leaves (None in tensor
            slots). output_is_tensor: which output leaves are tensors (a None output leaf is a constant).
        accepted_shapes: when not None, the only flat input shapes the graph may run (shape-specialized).
        parameters: ``[name, kind, has_default]`` per parameter of the module's ``forward``, so a loaded
            graph normalises calls like :class:`~aitune.torch.record.samples.CallSignature` without the module.
    """

    input_spec: TreeSpec
    num_leaves: int
    tensor_indices: list[int]
    input_dtypes: list[torch.dtype]
    input_low: list[list[int]]
    input_high: list[list[int]]
    constant_keys: dict[int, str]
    input_names: list[str]
    input_positions: list[int]
    output_names: list[str]
    output_dtypes: list[torch.dtype]
    output_spec: TreeSpec
    output_constants: list[Any]
    accepted_shapes: set[tuple] | None = None
    parameters: list[list] | None = None
    output_is_tensor: list[bool] | None = None
    batch_axes: list | None = None  # (tensor position, axis, multiplier): sizes must agree (one batch per call)

    def __post_init__(self):
        if self.output_is_tensor is None:
            self.output_is_tensor = [constant is None for constant in self.output_constants]
        self._signature = _signature_from_parameters(self.parameters) if self.parameters is not None else None
        # Canonical calls are usually keyword-only and flat: ((), {name: leaf, ...}); such a call's leaves
        # are its values (checked without flattening).
        spec = self.input_spec
        flat = (spec.kind == "tuple" and len(spec.children) == 2 and not spec.children[0].children
                and spec.children[1].kind == "dict" and spec.children[1].node_type is None
                and all(child.kind == LEAF for child in spec.children[1].children))
        self._flat_keys = tuple(spec.children[1].context) if flat else None
        self._accepted = AcceptedInputs(
            [AcceptedInput(index, dtype_name(dtype), list(low), list(high)) for index, dtype, low, high in
             zip(self.tensor_indices, self.input_dtypes, self.input_low, self.input_high)],
            device_type=None, batch_axes=[tuple(axis) for axis in self.batch_axes or []],
            shapes=self.accepted_shapes)

    @classmethod
    def from_export(cls, export: OnnxExport, graph, module: torch.nn.Module | None = None) -> "OnnxCallIO":
        leaves = graph.samples[0].leaves()
        low, high = [], []
        for spec in graph.tensor_specs:
            spec_low, _, spec_high = graph.shape_range(spec)
            low.append(list(spec_low))
            high.append(list(spec_high))
        tensor_indices = [spec.leaf_index for spec in graph.tensor_specs]
        constant_keys = {index: constant_key(leaf) for index, leaf in enumerate(leaves) if index not in tensor_indices}
        flat_io = export.flat_io
        return cls(input_spec=graph.input_spec, num_leaves=len(leaves), tensor_indices=tensor_indices,
                   input_dtypes=[spec.dtype for spec in graph.tensor_specs], input_low=low, input_high=high,
                   constant_keys=constant_keys, input_names=list(export.input_names),
                   input_positions=list(export.input_indices), output_names=list(export.output_names),
                   output_dtypes=list(flat_io.output_dtypes), output_spec=flat_io.output_spec,
                   output_constants=list(flat_io.output_constants),
                   accepted_shapes={tuple(map(tuple, export.example_shapes))} if export.shape_specialized else None,
                   parameters=recorded_parameters(graph, module),
                   output_is_tensor=list(flat_io.output_is_tensor), batch_axes=batch_axes(graph))

    # ---- calls
    def leaves_of(self, args: tuple, kwargs: dict, signature=None) -> list[Any]:
        """Input leaves of a call, in the graph's order.

        Args:
            args / kwargs: the call. signature: a :class:`~aitune.torch.record.samples.CallSignature` of the
                module's ``forward`` to normalise the call first; default: the one stored at build.

        Raises:
            ValueError: the call does not fit ``forward``'s signature, or its structure is not the graph's
                (other arguments, other nesting).
        """
        if not args and self._flat_keys is not None and tuple(kwargs) == self._flat_keys:
            leaves = list(kwargs.values())
            if all(type(leaf) in _PLAIN_LEAF_TYPES for leaf in leaves):
                return leaves
        signature = signature or self._signature
        if signature is not None:
            try:
                args, kwargs = signature.normalize(tuple(args), dict(kwargs))
            except TypeError as exc:
                raise ValueError(f"the call does not fit the module's forward signature: {exc}") from exc
        leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
        if self._same_structure(spec):
            return leaves
        expected_keys = self.input_spec.children[1].context if len(self.input_spec.children) == 2 else ()
        if set(kwargs) == set(expected_keys):  # same keyword arguments in another order
            leaves, spec = tree_flatten((tuple(args), {key: kwargs[key] for key in expected_keys}))
            if self._same_structure(spec):
                return leaves
        raise ValueError("the call's arguments do not have the structure this ONNX graph was exported for; "
                         "call it like the recorded samples (or through aitune.Module, which routes other calls)")

    def _same_structure(self, spec: TreeSpec) -> bool:
        try:
            return spec == self.input_spec or spec_to_json(spec) == spec_to_json(self.input_spec)
        except ConfigError:
            return False

    def check(self, leaves: list[Any]) -> str | None:
        """Why this graph cannot run the call with these input leaves, or None when it can."""
        if len(leaves) != self.num_leaves:
            return f"the call has {len(leaves)} input leaves, the graph {self.num_leaves}"
        for index, key in self.constant_keys.items():
            if isinstance(leaves[index], torch.Tensor) or constant_key(leaves[index]) != key:
                return f"non-tensor input #{index} differs from the value the graph was exported with ({key})"
        self._accepted.shapes = self.accepted_shapes  # a build may restrict it after validating the samples
        return self._accepted.rejects(leaves)  # dtype, rank, range, batch agreement: the shared AOT check

    def flat_inputs(self, leaves: list[Any]) -> list[torch.Tensor]:
        """Tensors for the ONNX graph inputs, in ``input_names`` order."""
        tensors = [leaves[index] for index in self.tensor_indices]
        return [tensors[position] for position in self.input_positions]

    def outputs(self, tensors: list[torch.Tensor]) -> Any:
        """Eager's output structure rebuilt around the output tensors (flat order)."""
        iterator = iter(tensors)
        leaves = [next(iterator) if is_tensor else constant
                  for constant, is_tensor in zip(self.output_constants, self.output_is_tensor)]
        return tree_unflatten(self.output_spec, leaves)

    # ---- JSON
    def to_json(self) -> dict:
        """JSON-able form. Raises ConfigError for output constants or keys JSON cannot hold."""
        return {
            "input_spec": spec_to_json(self.input_spec),
            "num_leaves": self.num_leaves,
            "tensor_indices": self.tensor_indices,
            "input_dtypes": [dtype_name(d) for d in self.input_dtypes],
            "input_low": self.input_low,
            "input_high": self.input_high,
            "constant_keys": {str(k): v for k, v in self.constant_keys.items()},
            "input_names": self.input_names,
            "input_positions": self.input_positions,
            "output_names": self.output_names,
            "output_dtypes": [dtype_name(d) for d in self.output_dtypes],
            "outputs": outputs_to_json(self.output_spec, self.output_constants, self.output_is_tensor,
                                       self.output_dtypes),
            "accepted_shapes": None if self.accepted_shapes is None else sorted(
                [list(map(list, shapes)) for shapes in self.accepted_shapes]),
            "parameters": self.parameters,
            "batch_axes": [list(axis) for axis in self.batch_axes or []],
        }

    @classmethod
    def from_json(cls, data: dict, graph=None) -> "OnnxCallIO":
        """Inverse of :meth:`to_json`; the graph's structures are used when they match (no imports then)."""
        input_spec = _spec_or_graph(data["input_spec"], getattr(graph, "input_spec", None))
        template = output_template_from_json(data["outputs"], getattr(graph, "output_spec", None))
        output_leaves, output_spec = tree_flatten(template)
        output_is_tensor = ["tensor" in slot for slot in data["outputs"]["slots"]]
        accepted = data.get("accepted_shapes")
        return cls(
            input_spec=input_spec, num_leaves=int(data["num_leaves"]), tensor_indices=list(data["tensor_indices"]),
            input_dtypes=[dtype_from_name(name, CheckpointError) for name in data["input_dtypes"]],
            input_low=[list(x) for x in data["input_low"]], input_high=[list(x) for x in data["input_high"]],
            constant_keys={int(k): v for k, v in data["constant_keys"].items()},
            input_names=list(data["input_names"]), input_positions=list(data["input_positions"]),
            output_names=list(data["output_names"]),
            output_dtypes=[dtype_from_name(name, CheckpointError) for name in data["output_dtypes"]],
            output_spec=output_spec,
            output_constants=[None if tensor else leaf for leaf, tensor in zip(output_leaves, output_is_tensor)],
            output_is_tensor=output_is_tensor,
            accepted_shapes=None if accepted is None else {tuple(tuple(s) for s in shapes) for shapes in accepted},
            parameters=data.get("parameters"), batch_axes=data.get("batch_axes"))


def _spec_or_graph(data: dict, graph_spec: TreeSpec | None) -> TreeSpec:
    if graph_spec is not None:
        try:
            if spec_to_json(graph_spec) == data:
                return graph_spec
        except CheckpointError:
            pass
    return spec_from_json(data)


def forward_parameters(module: torch.nn.Module) -> list[list] | None:
    """``[name, kind name, has_default]`` for each parameter of ``module.forward`` (None without a signature)."""
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None
    return _parameters_of(signature)


def recorded_parameters(graph, module: torch.nn.Module | None) -> list[list] | None:
    """The parameters of the ``forward`` that ``graph``'s samples were recorded (so normalised) against.

    The exported module may be a wrapper with ``forward(*args, **kwargs)`` (the kernel selector's
    PlannedModule); its own signature would not normalise calls into the graph's input structure. Falls
    back to ``module.forward`` when the graph has no signature.
    """
    call_signature = getattr(graph, "signature", None)
    if call_signature is not None and call_signature.signature is not None:
        return _parameters_of(call_signature.signature)
    return forward_parameters(module) if module is not None else None


def _parameters_of(signature: inspect.Signature) -> list[list]:
    return [[p.name, p.kind.name, p.default is not inspect.Parameter.empty] for p in signature.parameters.values()]


_HAS_DEFAULT = object()  # stands in for a default value: canonical calls never fill defaults in


def _signature_from_parameters(parameters: list[list]) -> CallSignature:
    def forward(*args, **kwargs):  # pragma: no cover - only its __signature__ is used
        raise NotImplementedError

    forward.__signature__ = inspect.Signature([
        inspect.Parameter(name, getattr(inspect.Parameter, kind), default=_HAS_DEFAULT if has_default
                          else inspect.Parameter.empty) for name, kind, has_default in parameters])
    return CallSignature(forward)

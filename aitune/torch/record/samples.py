"""Recorded samples, graphs, tensor specs and dynamic/batch axis detection.

A *sample* is one normalised call of a module: its arguments bound to the ``forward`` signature
(positional and keyword forms of the same parameter are equivalent, defaults are applied).
A *graph* is one input structure: same leaves, same tensor ranks/dtypes/devices, equal constants.
Across the samples of a graph an axis whose size changes is *dynamic*; if it changes in step with the
batch size it is a *batch axis*.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from typing import Any, Hashable, Iterable

import torch

from aitune.errors import CheckpointError, ConfigError
from aitune.torch.record.pytree import (
    TreeSpec,
    hashable_constant,
    leaf_paths,
    path_to_name,
    path_to_str,
    tree_flatten,
    tree_unflatten,
)
from aitune.torch.common.dtypes import dtype_from_name, dtype_name
from aitune.torch.record.serialization import constant_to_json, tree_spec_from_json, tree_spec_to_json
from aitune.torch.record.signature import CallSignature, positional_parameter_names  # noqa: F401 - re-exported

logger = logging.getLogger(__name__)

STATIC, DYNAMIC, BATCH = "static", "dynamic", "batch"
SAME_SHAPE_SAMPLES = 2  # calls of one shape kept per graph when their values differ


@dataclasses.dataclass(frozen=True)
class DynamicDim:
    """An explicitly dynamic axis with its range (sizes in elements).

    Args:
        name: dims with the same name share one symbol (must have equal bounds).
        min: smallest size (>= 0). max: largest size (> min). opt: size to optimise for (default: max).

    Raises:
        ConfigError: on a non-positive or inconsistent range.
    """

    name: str
    min: int
    max: int
    opt: int | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"{type(self).__name__}: name must be a non-empty string, got {self.name!r}")
        for field in ("min", "max"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{type(self).__name__}({self.name}): {field} must be an int >= 0, got {value!r}")
        if self.min >= self.max:
            raise ConfigError(f"{type(self).__name__}({self.name}): min ({self.min}) must be < max ({self.max})")
        if self.opt is not None and not (self.min <= self.opt <= self.max):
            raise ConfigError(f"{type(self).__name__}({self.name}): opt ({self.opt}) must lie in [min, max]")

    @property
    def opt_or_max(self) -> int:
        return self.max if self.opt is None else self.opt


@dataclasses.dataclass(frozen=True)
class BatchDim(DynamicDim):
    """An explicitly dynamic batch axis (see :class:`DynamicDim`)."""


# --------------------------------------------------------------------------------------------- samples


def clone_tree(value: Any) -> Any:
    """Deep copy of a nested value with every tensor cloned (detached, outside inference mode).

    Tensors created under ``torch.inference_mode`` become normal tensors so every backend can take them.
    """
    leaves, spec = tree_flatten(value)
    copies = []
    with torch.inference_mode(False):
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                copies.append(leaf.detach().clone())
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

    def leaves(self) -> list[Any]:
        return tree_flatten((self.args, self.kwargs))[0]

    def clone(self) -> "Sample":
        args, kwargs = clone_tree((self.args, self.kwargs))
        return Sample(args, kwargs, self.batch_size)

    def shapes(self) -> tuple:
        return tuple(tuple(leaf.shape) for leaf in self.leaves() if isinstance(leaf, torch.Tensor))


def infer_batch_size(leaves: Iterable[Any]) -> int | None:
    """Batch size guess for a call: dim 0 of its first tensor of rank >= 1 (None when there is none)."""
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            return int(leaf.shape[0])
    return None


@dataclasses.dataclass
class TensorSpec:
    """A tensor input of a graph.

    Attributes:
        name: tensor name (``input_<path>``), used by ONNX/TensorRT.
        path: readable leaf path (``attention_mask``, ``inputs.tokens``).
        leaf_index: position among the graph's flattened input leaves.
        dtype: torch dtype. min_shape / max_shape: recorded (or user-declared) bounds per axis.
        axes: per axis ``"static"``, ``"dynamic"`` or ``"batch"``.
        multipliers: per axis ``size / batch_size`` when constant across samples, else NaN.
        dims: user-declared :class:`DynamicDim` per axis, or None.
    """

    name: str
    path: str
    leaf_index: int
    dtype: torch.dtype
    min_shape: list[int]
    max_shape: list[int]
    axes: list[str]
    multipliers: list[float]
    dims: list[DynamicDim | None]

    @property
    def rank(self) -> int:
        return len(self.min_shape)

    @property
    def dynamic_axes(self) -> list[int]:
        return [i for i, kind in enumerate(self.axes) if kind != STATIC]

    def to_dict(self) -> dict:
        """Summary for reports: name, path, leaf index, dtype, min/max shape, axes."""
        return {"name": self.name, "path": self.path, "leaf_index": self.leaf_index,
                "dtype": dtype_name(self.dtype), "min_shape": self.min_shape,
                "max_shape": self.max_shape, "axes": self.axes}

    def to_json(self) -> dict:
        """Every field as JSON (checkpoint manifests): NaN multipliers as None, declared dims as
        ``{"kind": "batch" | "dynamic", "name", "min", "max", "opt"}``; :meth:`from_json` reads it back."""
        dims = [None if dim is None else {"kind": BATCH if isinstance(dim, BatchDim) else DYNAMIC, "name": dim.name,
                                          "min": dim.min, "max": dim.max, "opt": dim.opt} for dim in self.dims]
        return {"name": self.name, "path": self.path, "leaf_index": self.leaf_index, "dtype": dtype_name(self.dtype),
                "min_shape": list(self.min_shape), "max_shape": list(self.max_shape), "axes": list(self.axes),
                "multipliers": [None if math.isnan(m) else m for m in self.multipliers], "dims": dims}

    @classmethod
    def from_json(cls, data: dict) -> "TensorSpec":
        """The spec :meth:`to_json` wrote (extra keys such as ``"device"`` are ignored).

        Raises:
            CheckpointError: an unknown dtype. ConfigError: a declared dim with an invalid range.
        """
        dims = [None if dim is None else (BatchDim if dim["kind"] == BATCH else DynamicDim)(
            dim["name"], dim["min"], dim["max"], dim.get("opt")) for dim in data["dims"]]
        return cls(name=data["name"], path=data["path"], leaf_index=int(data["leaf_index"]),
                   dtype=dtype_from_name(data["dtype"], CheckpointError, f"input {data['path']!r} in the checkpoint"),
                   min_shape=[int(v) for v in data["min_shape"]],
                   max_shape=[int(v) for v in data["max_shape"]], axes=list(data["axes"]),
                   multipliers=[math.nan if m is None else float(m) for m in data["multipliers"]], dims=dims)


class GraphSpec:
    """One input structure of a module, its recorded samples and its tensor specs.

    Attributes:
        index: graph number within the module; ``name`` is ``graph<index>``.
        key: hashable graph identity (structure + leaf descriptors).
        input_spec: :class:`TreeSpec` of ``(args, kwargs)``.
        input_paths: readable path of every input leaf.
        tensor_specs: one :class:`TensorSpec` per tensor leaf.
        constants: non-tensor leaves by readable path (the values artifacts are specialised for).
        samples: recorded samples, at most ``max_samples``: distinct shapes first (extremes always kept), and
            up to ``SAME_SHAPE_SAMPLES`` calls of one shape with different values, so candidates are checked
            on more than one of them.
        output_spec: :class:`TreeSpec` of eager's output (set by the recorder).
        mutated_inputs: readable paths of inputs that ``forward`` changed in place.
        stateful: ``forward`` changed the module's own parameters or buffers (running statistics, step
            counters): candidates are judged from the same starting state as eager, over the same sequence.
    """

    def __init__(self, index: int, key: Hashable, input_spec: TreeSpec, leaves: list[Any], max_samples: int = 8,
                 dynamic_shapes: dict | None = None, positional_names: list[str] | None = None):
        self.index = index
        self.name = f"graph{index}"
        self.key = key
        self.input_spec = input_spec
        self.max_samples = max_samples
        raw_paths = leaf_paths(input_spec)
        # Paths start with 0 (args) or 1 (kwargs); drop that level for names.
        readable = [_readable_path(p, positional_names or []) for p in raw_paths]
        self.input_paths = [path_to_str(p) for p in readable]
        self._input_names = [path_to_name(p, "input") for p in readable]
        self.tensor_specs: list[TensorSpec] = []
        self.constants: dict[str, Any] = {}
        for index_, (leaf, path) in enumerate(zip(leaves, self.input_paths)):
            if isinstance(leaf, torch.Tensor):
                shape = list(leaf.shape)
                self.tensor_specs.append(TensorSpec(
                    name=self._input_names[index_], path=path, leaf_index=index_, dtype=leaf.dtype,
                    min_shape=list(shape), max_shape=list(shape), axes=[STATIC] * len(shape),
                    multipliers=[math.nan] * len(shape), dims=[None] * len(shape)))
            else:
                self.constants[path] = leaf
        self.samples: list[Sample] = []
        self.num_calls = 0
        # Distinct (batch size, tensor shapes) seen: bounded by the distinct shapes, not by the call count.
        self._size_history: set[tuple[int | None, tuple[tuple[int, ...], ...]]] = set()
        self.output_spec: TreeSpec | None = None
        self.mutated_inputs: list[str] = []
        self.stateful = False
        self.training: bool | None = None
        self.signature: CallSignature | None = None  # set by the Recorder: normalises direct backend calls
        self._apply_dynamic_shapes(dynamic_shapes or {})

    # ---- user-declared dims
    def _apply_dynamic_shapes(self, dynamic_shapes: dict) -> None:
        by_path = {spec.path: spec for spec in self.tensor_specs}
        for path, dims in dynamic_shapes.items():
            spec = by_path.get(path)
            if spec is None:
                continue  # validated against all graphs by the Module after recording
            if len(dims) != spec.rank:
                raise ConfigError(f"dynamic_shapes[{path!r}] has {len(dims)} entries but the input has rank "
                                  f"{spec.rank}; give one entry (int, DynamicDim or BatchDim) per axis")
            for axis, dim in enumerate(dims):
                if isinstance(dim, DynamicDim):
                    spec.dims[axis] = dim
                    spec.axes[axis] = BATCH if isinstance(dim, BatchDim) else DYNAMIC

    # ---- recording
    def add(self, sample: Sample, leaves: list[Any]) -> None:
        """Merge one call's shapes into the specs and keep the sample if its shapes are new/extreme."""
        self.num_calls += 1
        shapes = [list(leaves[spec.leaf_index].shape) for spec in self.tensor_specs]
        entry = (sample.batch_size, tuple(tuple(shape) for shape in shapes))
        if entry in self._size_history:
            # These shapes were merged before; keep another call of them if its values differ (bounded).
            same = [kept for kept in self.samples if kept.shapes() == sample.shapes()]
            if len(same) < SAME_SHAPE_SAMPLES and len(self.samples) < self.max_samples and not any(
                    _same_call(kept, sample) for kept in same):
                self.samples.append(sample)
            return
        self._size_history.add(entry)
        extends_range = False
        for spec, shape in zip(self.tensor_specs, shapes):
            for axis, size in enumerate(shape):
                dim = spec.dims[axis]
                if dim is None and spec.axes[axis] == STATIC and size != spec.min_shape[axis]:
                    spec.axes[axis] = DYNAMIC
                if dim is not None and not (dim.min <= size <= dim.max):
                    raise ConfigError(f"input {spec.path!r} axis {axis} has size {size}, outside the declared "
                                      f"{type(dim).__name__}({dim.name!r}, min={dim.min}, max={dim.max})")
                if size < spec.min_shape[axis]:
                    spec.min_shape[axis] = size
                    extends_range = True
                if size > spec.max_shape[axis]:
                    spec.max_shape[axis] = size
                    extends_range = True
        self._classify_batch_axes()
        known = {s.shapes() for s in self.samples}
        if sample.shapes() in known:
            return
        if len(self.samples) < self.max_samples:
            self.samples.append(sample)
        elif extends_range:
            # Keep the extremes: replace a sample none of whose extreme sizes is held by it alone.
            kept = self.samples + [sample]
            held = [self._extremes(candidate) for candidate in kept]
            for i in range(len(self.samples)):
                others = set().union(*(held[j] for j in range(len(kept)) if j != i))
                if held[i] <= others:
                    self.samples[i] = sample
                    break

    def _extremes(self, sample: Sample) -> set[tuple[int, int, str]]:
        """(tensor, axis, "min"/"max") of every recorded extreme size this sample has, per axis."""
        leaves = sample.leaves()
        found = set()
        for index, spec in enumerate(self.tensor_specs):
            shape = leaves[spec.leaf_index].shape
            for axis, size in enumerate(shape):
                if spec.min_shape[axis] != spec.max_shape[axis]:
                    if size == spec.min_shape[axis]:
                        found.add((index, axis, "min"))
                    if size == spec.max_shape[axis]:
                        found.add((index, axis, "max"))
        return found

    def _classify_batch_axes(self) -> None:
        for index, spec in enumerate(self.tensor_specs):
            for axis in range(spec.rank):
                if spec.dims[axis] is not None:
                    continue
                ratios = set()
                for batch_size, shapes in self._size_history:
                    if not batch_size:
                        ratios.add(math.nan)
                        break
                    ratios.add(shapes[index][axis] / batch_size)
                ratio = next(iter(ratios)) if len(ratios) == 1 else math.nan
                if spec.axes[axis] != STATIC and not math.isnan(ratio) and float(ratio).is_integer() and ratio >= 1:
                    spec.axes[axis] = BATCH
                    spec.multipliers[axis] = ratio
                elif spec.axes[axis] == BATCH:
                    spec.axes[axis] = DYNAMIC
                    spec.multipliers[axis] = math.nan

    # ---- queries
    @property
    def input_names(self) -> list[str]:
        return list(self._input_names)

    @property
    def is_dynamic(self) -> bool:
        return any(spec.dynamic_axes for spec in self.tensor_specs)

    @property
    def has_batch_axis(self) -> bool:
        return any(BATCH in spec.axes for spec in self.tensor_specs)

    def shape_range(self, spec: TensorSpec) -> tuple[list[int], list[int], list[int]]:
        """(min, opt, max) shape of a tensor input; declared dims win, opt defaults to max."""
        low, opt, high = list(spec.min_shape), list(spec.max_shape), list(spec.max_shape)
        for axis, dim in enumerate(spec.dims):
            if dim is not None:
                low[axis], opt[axis], high[axis] = dim.min, dim.opt_or_max, dim.max
        return low, opt, high

    def covers(self, leaves: list[Any]) -> bool:
        """True when every tensor leaf fits the graph's static axes and recorded/declared ranges."""
        for spec in self.tensor_specs:
            leaf = leaves[spec.leaf_index]
            low, _, high = self.shape_range(spec)
            for axis, size in enumerate(leaf.shape):
                if not (low[axis] <= size <= high[axis]):
                    return False
        return True

    def describe(self) -> dict:
        """JSON-able summary for reports and checkpoint manifests."""
        return {
            "name": self.name,
            "inputs": [spec.to_dict() for spec in self.tensor_specs],
            "constants": {path: repr(value) for path, value in self.constants.items()},
            "num_samples": len(self.samples),
            "num_calls": self.num_calls,
            "mutated_inputs": list(self.mutated_inputs),
            "stateful": self.stateful,
            "training": self.training,
        }


    # ---- JSON (checkpoint manifests)
    def to_json(self, module_name: str | None = None) -> dict:
        """Everything needed to rebuild this graph except the sample tensors and the output structure.

        Args:
            module_name: the owning module's name, for error messages.

        Returns:
            ``{"index", "input_structure", "input_paths", "input_names", "tensor_specs" (each with the
            ``"device"`` type its tensor was recorded on), "constants" ([{"leaf_index", "path", "value"}]),
            "max_samples", "num_calls", "mutated_inputs", "stateful", "training"}``.

        Raises:
            CheckpointError: an input constant or structure type that has no JSON form.
        """
        where = f"module {module_name!r} {self.name}" if module_name is not None else self.name
        leaves = self.samples[0].leaves() if self.samples else []
        constants = [{"leaf_index": index, "path": path, "value": constant_to_json(leaf, f"{where}: input {path!r}")}
                     for index, (leaf, path) in enumerate(zip(leaves, self.input_paths))
                     if not isinstance(leaf, torch.Tensor)]
        return {
            "index": self.index,
            "input_structure": tree_spec_to_json(self.input_spec, f"{where}: the input structure"),
            "input_paths": list(self.input_paths),
            "input_names": list(self.input_names),
            "tensor_specs": [{**spec.to_json(), "device": leaves[spec.leaf_index].device.type}
                             for spec in self.tensor_specs],
            "constants": constants,
            "max_samples": self.max_samples,
            "num_calls": self.num_calls,
            "mutated_inputs": list(self.mutated_inputs),
            "stateful": self.stateful,
            "training": self.training,
        }

    @classmethod
    def from_json(cls, data: dict, samples: list[Sample], signature: CallSignature | None, *,
                  output_spec: TreeSpec | None = None) -> "GraphSpec":
        """The graph :meth:`to_json` wrote, with its samples restored.

        Args:
            data: a :meth:`to_json` result plus ``"name"``.
            samples: the recorded samples, rebuilt in ``data``'s input structure (constants included).
            signature: the module's call signature (normalises direct backend calls, as the Recorder sets it).
            output_spec: eager's output structure, when known.

        Raises:
            CheckpointError: no samples, a structure that does not fit the samples, or an unknown dtype.
        """
        if not samples:
            raise CheckpointError(f"{data.get('name')}: the checkpoint holds no samples for this graph")
        input_spec = tree_spec_from_json(data["input_structure"])
        first = samples[0].leaves()
        if len(first) != input_spec.num_leaves or len(data["input_paths"]) != len(first):
            raise CheckpointError(f"{data.get('name')}: the samples do not fit the graph's input structure")
        graph = cls(int(data["index"]), make_graph_key(first, input_spec), input_spec, first,
                    max_samples=int(data.get("max_samples", len(samples))))
        graph.name = data["name"]
        graph.input_paths = list(data["input_paths"])
        graph._input_names = list(data["input_names"])
        graph.tensor_specs = [TensorSpec.from_json(spec) for spec in data["tensor_specs"]]
        graph.constants = {path: leaf for path, leaf in zip(graph.input_paths, first)
                           if not isinstance(leaf, torch.Tensor)}
        graph.samples = list(samples)
        graph.num_calls = int(data.get("num_calls", len(samples)))
        graph.mutated_inputs = list(data.get("mutated_inputs", []))
        graph.stateful = bool(data.get("stateful", False))
        graph.training = data.get("training")
        graph.signature = signature
        graph.output_spec = output_spec
        return graph


def _readable_path(path: tuple, positional_names: list[str]) -> tuple:
    """Turn a canonical ``(args, kwargs)`` leaf path into one that starts with the parameter name."""
    if not path:
        return path
    if path[0] == 0:
        index = path[1]
        name = positional_names[index] if index < len(positional_names) else f"args{index}"
        return (name,) + tuple(path[2:])
    return tuple(path[1:])


def make_graph_key(leaves: list[Any], spec: TreeSpec) -> Hashable:
    """Graph identity of a call: its structure plus every leaf's descriptor."""
    return (spec, tuple(describe_leaf(leaf) for leaf in leaves))


class Recorder:
    """Records calls of one module into graphs (used by :class:`aitune.torch.Module` and by tests).

    Args:
        module: the module whose ``forward`` signature normalises calls.
        max_samples: distinct input shapes kept per graph (the range extremes are always kept).
        dynamic_shapes: user-declared axes ``{input path: (int | DynamicDim | BatchDim, ...)}``.
    """

    def __init__(self, module: torch.nn.Module, max_samples: int = 8, dynamic_shapes: dict | None = None):
        self.signature = CallSignature(module.forward)
        self.positional_names = positional_parameter_names(self.signature)
        self.max_samples = max_samples
        self.dynamic_shapes = dynamic_shapes or {}
        self.graphs: dict[Hashable, GraphSpec] = {}

    def record(self, module: torch.nn.Module, args: tuple, kwargs: dict, batch_size: int | None = None) -> Any:
        """Run ``module`` on the call (the caller's tensors, as eager would) and record a cloned sample."""
        args, kwargs = self.signature.normalize(args, kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        key = make_graph_key(leaves, spec)
        graph = self.graphs.get(key)
        if graph is None:
            graph = GraphSpec(len(self.graphs), key, spec, leaves, self.max_samples, self.dynamic_shapes,
                              self.positional_names)
            graph.signature = self.signature
            self.graphs[key] = graph
        cloned_args, cloned_kwargs = clone_tree((args, kwargs))
        if batch_size is None:
            batch_size = infer_batch_size(leaves)
        sample = Sample(cloned_args, cloned_kwargs, batch_size)
        state_before = _state_versions(module)
        output = module(*args, **kwargs)
        if _state_versions(module) != state_before:
            graph.stateful = True
        graph.training = module.training
        mutated = [path for path, before, after in zip(graph.input_paths, sample.leaves(), leaves)
                   if isinstance(after, torch.Tensor) and not same_values(before, after)]
        for path in mutated:
            if path not in graph.mutated_inputs:
                graph.mutated_inputs.append(path)
        graph.output_spec = tree_flatten(output)[1]
        graph.add(sample, leaves)
        return output


def _state_versions(module: torch.nn.Module) -> list[tuple[int, int]]:
    """Identity and version counter of every parameter and buffer: changes when ``forward`` updates them in
    place (running statistics) or assigns new tensors (step counters)."""
    return [(id(t), t._version) for t in module.parameters()] + [(id(t), t._version) for t in module.buffers()]


def _same_call(first: Sample, second: Sample) -> bool:
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
    before, after = before.detach(), after.detach()
    if before.shape != after.shape or before.dtype != after.dtype:
        return False
    with torch.no_grad():
        before = before.to(after.device)
        if torch.equal(before, after):
            return True
        return bool((before.is_floating_point() or before.is_complex()) and torch.equal(before.isnan(), after.isnan())
                    and torch.equal(before.nan_to_num(), after.nan_to_num()))


def record_graphs(module: torch.nn.Module, calls: Iterable[tuple[tuple, dict]], **recorder_options) -> list[GraphSpec]:
    """Record ``calls`` (each ``(args, kwargs)``) of ``module`` under ``no_grad``; returns the graphs in order.

    Restores the module's parameters and buffers afterwards (recording must not change the module).
    """
    recorder = Recorder(module, **recorder_options)
    state = {name: value.detach().clone() for name, value in module.state_dict(keep_vars=True).items()}
    with torch.no_grad():
        for args, kwargs in calls:
            recorder.record(module, tuple(args), dict(kwargs))
        for name, value in module.state_dict(keep_vars=True).items():
            if name in state and isinstance(value, torch.Tensor):
                value.detach().copy_(state[name])
    return list(recorder.graphs.values())

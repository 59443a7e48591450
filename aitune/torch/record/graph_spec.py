"""A graph (:class:`GraphSpec`): one input structure of a module, the samples recorded for it, the shape ranges
of its tensor inputs (:class:`TensorSpec`) and which axes are dynamic or batch axes; saved and read as JSON."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Hashable

import torch

from aitune.errors import CheckpointError, ConfigError
from aitune.torch.common.dtypes import dtype_from_name, dtype_name
from aitune.torch.record.pytree import TreeSpec, leaf_paths, path_to_name, path_to_str
from aitune.torch.record.serialization import constant_to_json, tree_spec_from_json, tree_spec_to_json
from aitune.torch.record.signature import CallSignature
from aitune.torch.record.call_sample import Sample, describe_leaf, same_call
from aitune.torch.record.dims import BatchDim, DynamicDim
from aitune.torch.record.llm import in_cache, phase_structure


STATIC, DYNAMIC, BATCH = "static", "dynamic", "batch"
SAME_SHAPE_SAMPLES = 2  # calls of one shape kept per graph when their values differ


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
        value_range: ``[lowest, highest]`` value over every recorded call (finite values only; None for bool
            tensors or before any call); aitune's value gate (:mod:`aitune.torch.backend.accepted`) routes
            integer inputs outside it, and quantized candidates' inputs far outside it, to eager.
        finite: every recorded call's values were finite (no nan/inf) — non-finite inputs then run eager.
        table_rows: for an integer input that a recorded call passed straight to an ``nn.Embedding`` (or
            ``EmbeddingBag``), the rows of that table (the smallest, if several): every id in ``[0, rows)`` is
            valid, so the value gate accepts them all, not only the ids the samples held. None otherwise.
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
    value_range: list[float] | None = None
    finite: bool = True
    table_rows: int | None = None

    def record_values(self, tensor: torch.Tensor) -> None:
        """Widen :attr:`value_range` (and clear :attr:`finite`) by one call's tensor."""
        if tensor.dtype == torch.bool or tensor.is_complex() or tensor.numel() == 0:
            return
        with torch.no_grad():
            values = tensor.detach()
            if values.is_floating_point():
                finite = torch.isfinite(values)
                if not bool(finite.all()):
                    self.finite = False
                    values = values[finite]
                    if values.numel() == 0:
                        return
            low, high = torch.aminmax(values)
            cast = float if values.is_floating_point() else int
            low, high = cast(low.item()), cast(high.item())
        if self.value_range is None:
            self.value_range = [low, high]
        else:
            self.value_range = [min(self.value_range[0], low), max(self.value_range[1], high)]

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
                "max_shape": self.max_shape, "axes": self.axes, "value_range": self.value_range,
                "finite": self.finite, "table_rows": self.table_rows}

    def to_json(self) -> dict:
        """Every field as JSON (checkpoint manifests): NaN multipliers as None, declared dims as
        ``{"kind": "batch" | "dynamic", "name", "min", "max", "opt"}``; :meth:`from_json` reads it back."""
        dims = [None if dim is None else {"kind": BATCH if isinstance(dim, BatchDim) else DYNAMIC, "name": dim.name,
                                          "min": dim.min, "max": dim.max, "opt": dim.opt} for dim in self.dims]
        return {"name": self.name, "path": self.path, "leaf_index": self.leaf_index, "dtype": dtype_name(self.dtype),
                "min_shape": list(self.min_shape), "max_shape": list(self.max_shape), "axes": list(self.axes),
                "multipliers": [None if math.isnan(m) else m for m in self.multipliers], "dims": dims,
                "value_range": self.value_range, "finite": self.finite, "table_rows": self.table_rows}

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
                   multipliers=[math.nan if m is None else float(m) for m in data["multipliers"]], dims=dims,
                   value_range=None if data.get("value_range") is None else list(data["value_range"]),
                   finite=bool(data.get("finite", True)),
                   table_rows=None if data.get("table_rows") is None else int(data["table_rows"]))


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
        stateful: ``forward`` changed the module's own parameters, buffers or plain attributes (running
            statistics, step counters, caches): candidates are judged from the same starting state as eager, over
            the same sequence, and tuning puts that state back after its own runs.
        stateful_reason: what ``forward`` changed, e.g. ``forward changes attribute `count```; None when stateless.
        nondeterministic: why two eager runs of ``forward`` on one input differ (random numbers drawn in
            ``forward``), and how candidates are judged then; None when they agree or before tuning looked
            (set by :meth:`aitune.torch.check.context.GraphContext.from_eager`).
        rounding_spread: how far two eager runs on one input differ when they differ by rounding only (kernels
            whose order of summation varies between runs), e.g.
            ``"max abs 0.0703, SQNR >= 45.1 dB"``; the graph is then judged as deterministic, without the run-time
            guard (NOTE [eager that repeats itself up to rounding] in :mod:`aitune.torch.check.context`); None
            otherwise.
        phase: ``"prefill"``/``"decode"`` for a decoder called with a key/value cache (the graph's name too),
            else None (:mod:`aitune.torch.record.llm`).
        untunable: why no compiled backend may serve this graph (a dynamic key/value cache), or None; its
            candidates are then reported unsupported with this reason and eager serves it.
    """

    def __init__(self, index: int, key: Hashable, input_spec: TreeSpec, leaves: list[Any], max_samples: int = 8,
                 dynamic_shapes: dict | None = None, positional_names: list[str] | None = None,
                 keeps_value_ranges: bool = True):
        self.index = index
        self.name = f"graph{index}"
        self.key = key
        self.input_spec = input_spec
        self.max_samples = max_samples
        # False: shapes only, no tensor value read (an inspection's records: a read waits for the device)
        self.keeps_value_ranges = keeps_value_ranges
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
        self.stateful_reason: str | None = None
        self.nondeterministic: str | None = None
        self.rounding_spread: str | None = None
        self.training: bool | None = None
        self.phase: str | None = None
        self.untunable: str | None = None
        self.cache_input: str | None = None  # the keyword argument holding a key/value cache (phase graphs)
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
    def shape_entry(self, leaves: list[Any], batch_size: int | None) -> tuple:
        """``(batch size, every tensor input's shape)`` of a call of this graph (``leaves``: its flat inputs)."""
        return batch_size, tuple(tuple(leaves[spec.leaf_index].shape) for spec in self.tensor_specs)

    def new_shapes(self, leaves: list[Any], batch_size: int | None) -> bool:
        """Has no recorded call of this graph had these shapes (and batch size)?"""
        return self.shape_entry(leaves, batch_size) not in self._size_history

    def add(self, sample: Sample, leaves: list[Any]) -> None:
        """Merge one call's shapes into the specs and keep the sample if its shapes are new/extreme."""
        self.num_calls += 1
        if self.keeps_value_ranges:
            recorded = sample.leaves()  # the call's values before forward ran (it may change its inputs in place)
            for spec in self.tensor_specs:
                if not in_cache(spec.path, self.cache_input):  # a cache's values are never gated (accepted.py)
                    spec.record_values(recorded[spec.leaf_index])
        entry = self.shape_entry(leaves, sample.batch_size)
        shapes = entry[1]
        if entry in self._size_history:
            # These shapes were merged before; keep another call of them if its values differ (bounded).
            shapes_now = sample.shapes()
            same = [kept for kept in self.samples if kept.shapes() == shapes_now]
            if len(same) < SAME_SHAPE_SAMPLES and len(self.samples) < self.max_samples and not any(
                    same_call(kept, sample) for kept in same):
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
            **self._behaviour(),
        }

    def _behaviour(self) -> dict:
        """What the recorded calls showed of ``forward`` (shared by :meth:`describe` and :meth:`to_json`)."""
        return {"num_calls": self.num_calls, "mutated_inputs": list(self.mutated_inputs), "stateful": self.stateful,
                "stateful_reason": self.stateful_reason, "nondeterministic": self.nondeterministic,
                "rounding_spread": self.rounding_spread, "training": self.training, "phase": self.phase,
                "untunable": self.untunable, "cache_input": self.cache_input}

    # ---- JSON (checkpoint manifests)
    def to_json(self, module_name: str | None = None) -> dict:
        """Everything needed to rebuild this graph except the sample tensors and the output structure.

        Args:
            module_name: the owning module's name, for error messages.

        Returns:
            ``{"index", "input_structure", "input_paths", "input_names", "tensor_specs" (each with the
            ``"device"`` type its tensor was recorded on), "constants" ([{"leaf_index", "path", "value"}]),
            "max_samples", "num_calls", "mutated_inputs", "stateful", "stateful_reason", "nondeterministic",
            "rounding_spread", "training", "phase", "untunable", "cache_input"}``.

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
            **self._behaviour(),
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
        graph = cls(int(data["index"]), make_graph_key(first, input_spec, data.get("phase")), input_spec, first,
                    max_samples=int(data.get("max_samples", len(samples))))
        graph.name = data["name"]
        graph.input_paths = list(data["input_paths"])
        graph._input_names = list(data["input_names"])
        graph.tensor_specs = [TensorSpec.from_json(spec) for spec in data["tensor_specs"]]
        for spec in graph.tensor_specs:
            if "value_range" not in data["tensor_specs"][0]:  # written before value ranges were kept
                for sample in samples:
                    spec.record_values(sample.leaves()[spec.leaf_index])
        graph.constants = {path: leaf for path, leaf in zip(graph.input_paths, first)
                           if not isinstance(leaf, torch.Tensor)}
        graph.samples = list(samples)
        graph.num_calls = int(data.get("num_calls", len(samples)))
        graph.mutated_inputs = list(data.get("mutated_inputs", []))
        graph.stateful = bool(data.get("stateful", False))
        graph.stateful_reason = data.get("stateful_reason")
        graph.nondeterministic = data.get("nondeterministic")
        graph.rounding_spread = data.get("rounding_spread")
        graph.training = data.get("training")
        graph.phase = data.get("phase")
        graph.untunable = data.get("untunable")
        graph.cache_input = data.get("cache_input")
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


def make_graph_key(leaves: list[Any], spec: TreeSpec, phase: str | None = None) -> Hashable:
    """Graph identity of a call: its structure plus every leaf's descriptor; for a decoder call with a key/value
    cache, its phase too, and the cache's sizes left out (:mod:`aitune.torch.record.llm`)."""
    if phase is not None:
        return (phase_structure(spec), tuple(describe_leaf(leaf) for leaf in leaves), phase)
    return (spec, tuple(describe_leaf(leaf) for leaf in leaves))

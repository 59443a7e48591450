"""Recorded samples, graphs, tensor specs and dynamic/batch axis detection.

A *sample* is one normalised call of a module: its arguments bound to the ``forward`` signature
(positional and keyword forms of the same parameter are equivalent, defaults are applied).
A *graph* is one input structure: same leaves, same tensor ranks/dtypes/devices, equal constants.
Across the samples of a graph an axis whose size changes is *dynamic*; if it changes in step with the
batch size it is a *batch axis*.

Modules: :mod:`~aitune.torch.record.dims` (declared dynamic axes), :mod:`~aitune.torch.record.call_sample` (one
call), :mod:`~aitune.torch.record.graph_spec` (graphs and tensor specs); this module records calls into graphs
and keeps every name importable.
"""

from __future__ import annotations

import contextlib

from typing import Any, Hashable, Iterable, Iterator

import torch

from aitune.torch.record.call_sample import (  # noqa: F401 - re-exported
    Sample,
    clone_tree,
    describe_leaf,
    infer_batch_size,
    same_call,
    same_values,
)
from aitune.torch.record.dims import BatchDim, DynamicDim  # noqa: F401 - re-exported
from aitune.torch.record.graph_spec import (  # noqa: F401 - re-exported
    BATCH,
    DYNAMIC,
    SAME_SHAPE_SAMPLES,
    STATIC,
    GraphSpec,
    TensorSpec,
    make_graph_key,
)
from aitune.torch.record.llm import (
    POSITION_INPUTS,
    cache_argument,
    cache_capacity,
    dynamic_cache_reason,
    in_cache,
    llm_phase,
)
from aitune.torch.record.pytree import tree_flatten
from aitune.torch.record.state import AttributeSnapshot, changed_state, state_marks
from aitune.torch.record.signature import CallSignature, positional_parameter_names  # noqa: F401 - re-exported


STATE_CHECKS_FIRST = 8  # NOTE [state checks while recording]
STATE_CHECKS_EVERY = 16


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
        """Run ``module`` on the call (the caller's tensors, as eager would) and record a cloned sample.

        NOTE [calls as given]: the module runs on the call as the caller made it; the canonical form (every
        argument that can be a keyword is one) is what is recorded and keyed. A forward(-pre) hook of the wrapped
        module reads its positional arguments, which the canonical form has moved into keywords. The two forms
        share their tensors, so what the call changes in place is seen through either."""
        given_args, given_kwargs = args, kwargs
        args, kwargs = self.signature.normalize(args, kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        phase = llm_phase(args, kwargs)
        key = make_graph_key(leaves, spec, phase)
        graph = self.graphs.get(key)
        if graph is None:
            graph = GraphSpec(len(self.graphs), key, spec, leaves, self.max_samples, self.dynamic_shapes,
                              self.positional_names)
            graph.signature = self.signature
            if phase is not None:  # NOTE [caches as inputs] in aitune/torch/record/llm.py
                taken = {other.name for other in self.graphs.values()}
                graph.name = phase if phase not in taken else f"{phase}{len(self.graphs)}"
                graph.phase = phase
                graph.untunable = dynamic_cache_reason(args, kwargs)
                graph.cache_input = cache_argument(kwargs)
            self.graphs[key] = graph
        if phase is not None:
            _bound_positions(graph, cache_capacity(kwargs, args))
        cloned_args, cloned_kwargs = clone_tree((args, kwargs))
        if batch_size is None:
            batch_size = infer_batch_size(leaves)
        sample = Sample(cloned_args, cloned_kwargs, batch_size)
        # NOTE [state checks while recording]: marking the module's state before and after a call walks every
        # submodule's parameters, buffers and attributes: ~5 ms per recorded call of a 24-layer decoder on this
        # project's CPU (two walks of ~2.5 ms), more than the call itself (benchmarks/recording_cost.py), and a
        # generate loop records hundreds of decode calls. So the state is compared around a graph's first
        # STATE_CHECKS_FIRST calls, every call with shapes the graph has not recorded before (state grown for a
        # longer input: a rotary embedding's table, a lazily sized buffer) and every STATE_CHECKS_EVERY-th call,
        # until a change is found. A forward that changes state does so from its first calls (running statistics,
        # counters, a cache it fills) or for a new size; one that starts later is found at the next compared call.
        # A change made only by calls of known shapes that are never compared is missed (docs/promises.md).
        # (Comparing across the calls in between was tried: it blamed the forward, and every graph of the module,
        # for what the caller's own code changed between calls, such as a load_state_dict.)
        count = graph.num_calls
        checked = not graph.stateful and (count < STATE_CHECKS_FIRST or count % STATE_CHECKS_EVERY == 0
                                          or graph.new_shapes(leaves, batch_size))
        state_before, kept = state_marks(module) if checked else (None, None)
        with _embedding_inputs(module, leaves) as tables:
            output = module(*given_args, **given_kwargs)
        for spec in graph.tensor_specs:
            rows = tables.get(spec.leaf_index)
            if rows is not None:
                spec.table_rows = rows if spec.table_rows is None else min(spec.table_rows, rows)
        changed = changed_state(state_before, state_marks(module)[0]) if checked else []
        del kept
        if changed:
            graph.stateful = True
            if graph.stateful_reason is None:
                more = f" (and {len(changed) - 3} more)" if len(changed) > 3 else ""
                graph.stateful_reason = "forward changes " + ", ".join(changed[:3]) + more
        graph.training = module.training
        # a cache is written by every call, also where no recorded tensor changed in place (a lazily created cache
        # replaces its tensors on the first call): the cache as a whole is an input the call changes, and every run
        # starts from a copy of the recorded state; its own tensors are not compared one by one (off the CPU each
        # comparison waits for the device)
        mutated = [path for path, before, after in zip(graph.input_paths, sample.leaves(), leaves)
                   if isinstance(after, torch.Tensor) and not in_cache(path, graph.cache_input)
                   and not same_values(before, after)]
        if graph.cache_input is not None:
            mutated.append(graph.cache_input)
        for path in mutated:
            if path not in graph.mutated_inputs:
                graph.mutated_inputs.append(path)
        graph.output_spec = tree_flatten(output)[1]
        graph.add(sample, leaves)
        return output


def _bound_positions(graph: GraphSpec, capacity: int | None) -> None:
    """The positions a phase graph's call may hold: ``[0, capacity)`` of its static cache (the value gate's
    ``table_rows``, kept at the smallest capacity recorded; a call's own cache bounds it at run time)."""
    if capacity is None:
        return
    for spec in graph.tensor_specs:
        if spec.path in POSITION_INPUTS and not spec.dtype.is_floating_point and spec.dtype != torch.bool:
            spec.table_rows = capacity if spec.table_rows is None else min(spec.table_rows, capacity)


@contextlib.contextmanager
def _embedding_inputs(module: torch.nn.Module, leaves: list) -> Iterator[dict[int, int]]:
    """While the call runs: which integer input leaves reach an embedding table as they are (by identity), as
    ``{leaf index: rows of the smallest such table}`` (filled in as the call runs)."""
    found: dict[int, int] = {}
    integer_leaves = {id(leaf): index for index, leaf in enumerate(leaves)
                      if isinstance(leaf, torch.Tensor) and not leaf.is_floating_point() and not leaf.is_complex()
                      and leaf.dtype != torch.bool}
    handles = []
    if integer_leaves:
        def seen(layer, inputs):
            index = integer_leaves.get(id(inputs[0])) if inputs else None
            if index is not None:
                found[index] = min(found.get(index, layer.num_embeddings), layer.num_embeddings)

        handles = [layer.register_forward_pre_hook(seen) for layer in module.modules()
                   if isinstance(layer, (torch.nn.Embedding, torch.nn.EmbeddingBag))]
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


def graph_device(graph) -> torch.device:
    """The device of a graph's first recorded tensor input (CPU when it has none, or no samples)."""
    for sample in graph.samples[:1]:
        for leaf in sample.leaves():
            if isinstance(leaf, torch.Tensor):
                return leaf.device
    return torch.device("cpu")


def record_graphs(module: torch.nn.Module, calls: Iterable[tuple[tuple, dict]], **recorder_options) -> list[GraphSpec]:
    """Record ``calls`` (each ``(args, kwargs)``) of ``module`` under ``no_grad``; returns the graphs in order.

    Restores the module's parameters, buffers and plain attributes afterwards (recording must not change the
    module).
    """
    recorder = Recorder(module, **recorder_options)
    attributes = AttributeSnapshot(module)
    state = {name: value.detach().clone() for name, value in module.state_dict(keep_vars=True).items()}
    with torch.no_grad():
        for args, kwargs in calls:
            recorder.record(module, tuple(args), dict(kwargs))
        for name, value in module.state_dict(keep_vars=True).items():
            if name in state and isinstance(value, torch.Tensor):
                value.detach().copy_(state[name])
    attributes.restore()
    return list(recorder.graphs.values())


def hook_hint(module: torch.nn.Module, exc: BaseException) -> str:
    """A hint for a tune that failed inside a forward(-pre) hook of the wrapped module registered without
    ``with_kwargs``: the checks replay the recorded calls in their canonical (keyword) form (NOTE [calls as given]),
    so such a hook sees no positional arguments there. Empty when the failure did not pass through such a hook."""
    registered = ((module._forward_pre_hooks, module._forward_pre_hooks_with_kwargs),
                  (module._forward_hooks, module._forward_hooks_with_kwargs))
    codes = {_code(hook) for hooks, kwargs in registered for key, hook in hooks.items() if key not in kwargs}
    seen, error = set(), exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        trace = error.__traceback__
        while trace is not None:
            if trace.tb_frame.f_code in codes:
                return (" (it failed in a forward hook of the module: while aitune checks candidates, hooks "
                        "receive the recorded calls' arguments by keyword; read them from kwargs, with_kwargs=True, or "
                        "register the hook after tuning)")
            trace = trace.tb_next
        error = error.__cause__ or error.__context__
    return ""


def _code(hook) -> Any:
    """The code object a hook runs: a function's, a ``functools.partial``'s function's, or a callable's ``__call__``."""
    hook = getattr(hook, "func", hook)
    return getattr(hook, "__code__", None) or getattr(getattr(type(hook), "__call__", None), "__code__", None)


_CONSTANT_TYPES = (int, float, bool, str, type(None))


def flat_call_key(args: tuple, kwargs: dict):
    """Graph key of a call with only tensor / plain-constant arguments; None when anything is nested. The
    dispatch's route key where the C extension's does not answer (NOTE [native call key] in aitune/torch/dispatch.py).

    A tensor's device enters as ``(get_device(), is_cuda)`` (index, -1 on the CPU): ~90 ns against ~290 ns for
    ``tensor.device.type``, which builds a ``torch.device`` per access (torch 2.13)."""
    parts = []
    for value in args:
        if isinstance(value, torch.Tensor):
            parts.append((value.dtype, value.dim(), value.get_device(), value.is_cuda))
        elif type(value) in _CONSTANT_TYPES:
            parts.append((type(value), value))
        else:
            return None
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            parts.append((name, value.dtype, value.dim(), value.get_device(), value.is_cuda))
        elif type(value) in _CONSTANT_TYPES:
            parts.append((name, type(value), value))
        else:
            return None
    return len(args), tuple(parts)


def on_host(values) -> bool:
    """Is any of ``values`` a CPU tensor (the value gate reads only those: a route with none skips it)? By
    ``get_device()``, as the route keys: -1 for the CPU, and for meta tensors too, which then count."""
    return any(isinstance(value, torch.Tensor) and value.get_device() < 0 for value in values)

"""One CUDA-graph runner that any backend can put around its call (eager, TensorRT, AOTInductor, ...).

A CUDA graph records the kernels one call launches and replays them with a single launch, which removes
the CPU launch overhead that dominates small-batch inference. The runner:

* keys calls by their input structure, each tensor's shape/dtype/device and the non-tensor constants;
* runs the first call of a key normally (the warm-up, on a side stream as the PyTorch docs ask), then
  captures the function into a ``torch.cuda.CUDAGraph`` whose inputs are *static* buffers;
* replays later calls of that key after copying the inputs into the static buffers;
* keeps at most ``max_graphs`` graphs, least recently used evicted first (each holds its own memory pool);
* on a capture failure (a host sync, a CPU tensor, an op that is not capturable) logs one warning and
  runs every later call normally: the runner is then a pass-through;
* hands the caller *clones* of the graph's static outputs, so the next replay never overwrites an output
  the caller still holds (pytorch/pytorch#144386); ``call(..., copy=False)`` (Inductor's captured variant with
  ``copy_cuda_graph_outputs`` off) hands out the static outputs themselves in a new container, valid until the
  next replay of that graph, by this thread or another.

NOTE [cuda graphs and dynamic shapes]: a graph is only valid for the exact shapes it was captured with,
so every distinct input shape gets its own graph; the LRU bound keeps memory in check when shapes vary
a lot (each graph keeps its own static inputs, outputs and private memory pool alive).

NOTE [cuda graphs and in-place inputs]: a replay writes into the static input buffers, not the caller's
tensors. A function that mutates its inputs in place therefore does not mutate the caller's
tensors under graphs; backends that must preserve such mutations should not enable graphs.

Reference for the capture protocol (warm-up on a side stream, static inputs, ``copy_`` then ``replay``):
PyTorch docs, "CUDA Graphs" section of the CUDA semantics notes.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict
from typing import Any, Callable, Hashable, Iterator

import torch

from aitune.errors import ConfigError
from aitune.torch.record.pytree import hashable_constant, tree_flatten, tree_unflatten

logger = logging.getLogger(__name__)

DEFAULT_MAX_GRAPHS = 8


def graph_key(args: tuple, kwargs: dict, *, require_cuda: bool = True) -> Hashable | None:
    """Identity of a call for graph reuse, or None when the call cannot be captured.

    The key holds the input structure, every tensor leaf's ``(shape, dtype, device)`` and every
    non-tensor leaf's value. Strides are not part of the key: inputs are copied into the static buffers.

    Args:
        args / kwargs: the call.
        require_cuda: return None when a tensor is not on a CUDA device (False: key any device's tensors).

    Returns:
        A hashable key; None when the call has no tensor, a tensor that is not on a CUDA device, or a
        tensor that requires grad while grad mode is on (graphs are for inference).
    """
    leaves, spec = tree_flatten((args, kwargs))
    parts = []
    has_tensor = False
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if require_cuda and leaf.device.type != "cuda":
                return None
            if leaf.requires_grad and torch.is_grad_enabled():
                return None
            has_tensor = True
            parts.append(("tensor", tuple(leaf.shape), leaf.dtype, leaf.device.index))
        else:
            parts.append(("const", hashable_constant(leaf)))
    if not has_tensor:
        return None
    return (spec, tuple(parts))


CONSTANT_TYPES = (int, float, bool, str, type(None))  # the plain constants a flat call's key holds by value


def flat_graph_key(args: tuple, kwargs: dict, *, require_cuda: bool = True) -> tuple[Hashable | None, list] | None:
    """:func:`graph_key` of a flat call (every argument a tensor or a plain constant, nothing nested), without
    flattening it, and its tensors in the call's order (as flattening gives them); None for any other call, which
    :func:`graph_key` keys. The key is None where :func:`graph_key`'s would be: no tensor, a tensor off CUDA (with
    ``require_cuda``), or one that requires grad while grad mode is on. A replay used to flatten its call twice
    (its key, then its tensors): 0.60 of the 2.67 s cProfile gave the backend's ``run`` over 20,000 ResNet-50 b1
    calls on the GPU machine (``benchmarks/wrapper_cost.py --profile``, benchmarks/RESULTS.md, 2026-12-07)."""
    parts: list = [len(args)]
    tensors = []
    grad = None
    for name, value in (*enumerate(args), *kwargs.items()):
        if isinstance(value, torch.Tensor):
            if require_cuda and not value.is_cuda:
                return None, []
            if value.requires_grad and (grad if grad is not None else (grad := torch.is_grad_enabled())):
                return None, []
            parts.append((name, value.shape, value.dtype, value.get_device()))
            tensors.append(value)
        elif type(value) in CONSTANT_TYPES:
            parts.append((name, type(value), value))
        else:
            return None
    return (("flat", tuple(parts)) if tensors else None), tensors


class LRUCache:
    """A bounded mapping that evicts the least recently used entry first.

    Args:
        max_size: most entries kept (>= 1).
        on_evict: called with ``(key, value)`` for every evicted entry.

    Raises:
        ConfigError: if ``max_size`` is not an int >= 1.
    """

    def __init__(self, max_size: int, on_evict: Callable[[Hashable, Any], None] | None = None):
        if not isinstance(max_size, int) or isinstance(max_size, bool) or max_size < 1:
            raise ConfigError(f"LRUCache max_size must be an int >= 1, got {max_size!r}")
        self.max_size = max_size
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()
        self._on_evict = on_evict

    def get(self, key: Hashable) -> Any:
        """The value for ``key`` (marked most recently used), or None."""
        if key not in self._entries:
            return None
        self._entries.move_to_end(key)
        return self._entries[key]

    def put(self, key: Hashable, value: Any) -> list[Hashable]:
        """Insert or replace ``key``; returns the keys evicted to stay within ``max_size``."""
        self._entries[key] = value
        self._entries.move_to_end(key)
        evicted = []
        while len(self._entries) > self.max_size:
            old_key, old_value = self._entries.popitem(last=False)
            evicted.append(old_key)
            if self._on_evict is not None:
                self._on_evict(old_key, old_value)
        return evicted

    def clear(self) -> None:
        self._entries.clear()

    def keys(self) -> list[Hashable]:
        """Keys from least to most recently used."""
        return list(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._entries))


def clone_tensors(value: Any) -> Any:
    """Copy of a nested value with every tensor leaf cloned (other leaves shared)."""
    if isinstance(value, torch.Tensor):  # the common case, without flattening
        return value.clone()
    leaves, spec = tree_flatten(value)
    return tree_unflatten(spec, [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves])


@dataclasses.dataclass
class _CapturedGraph:
    graph: Any  # torch.cuda.CUDAGraph
    static_inputs: list  # tensor leaves the graph reads (same order as the call's tensor leaves)
    static_output: Any
    replays: int = 0
    output_leaves: list = dataclasses.field(default_factory=list)  # static_output flattened, for copy=False
    output_spec: Any = None  # (None: static_output is a tensor, handed out as it is)


class GraphSet:
    """What a capture-and-replay runner holds: its graphs (``_graphs``, sized and clearable), the lock its calls
    take (``_lock``), its ``name``, and whether it still captures (``enabled``, ``disabled_reason``)."""

    _graphs: Any
    _lock: Any
    name: str
    enabled: bool
    disabled_reason: str

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def reset(self) -> None:
        """Drop every captured graph (and its memory); they are captured again on later calls."""
        with self._lock:
            self._graphs.clear()

    def _capture_failed(self, exc: Exception, generator: Any, saved_state: Any) -> None:
        """After a capture raised (called under the lock): every later call runs without graphs, with one warning.

        NOTE [failed capture and the RNG]: when the capture is invalidated, CUDAGraph.capture_end raises before it
        takes the CUDA generator out of capture mode, and every later random op in the process then fails ("Offset
        increment outside graph capture"). The generator state saved just before the capture is restored."""
        if saved_state is not None:
            generator.graphsafe_set_state(saved_state)
        self.enabled = False
        lines = str(exc).strip().splitlines()
        self.disabled_reason = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
        self._graphs.clear()
        logger.warning("%s: CUDA graph capture failed (%s); running without CUDA graphs from now on",
                       self.name, self.disabled_reason)


class CUDAGraphRunner(GraphSet):
    """Capture-and-replay wrapper around ``function(*args, **kwargs)`` for CUDA inputs.

    Args:
        function: the call to capture. It must be capturable: no host synchronisation (``.item()``,
            ``.cpu()``, data-dependent shapes), no CPU tensors, no allocation outside PyTorch's allocator.
        max_graphs: most graphs kept at once (one per input key), least recently used evicted (>= 1).
        name: label for log messages (e.g. the backend name).
        before_replay: called with the call's ``(*args, **kwargs)`` right before each replay, to put host-side
            state back as it was at capture (e.g. a TensorRT context's input shapes and profile).

    Attributes:
        enabled: False once a capture failed; every call then runs ``function`` directly.
        disabled_reason: the capture error, one line, when disabled.
        stats: counters: ``captures``, ``replays``, ``evictions``, ``plain_calls`` (calls run without a graph).

    Raises:
        ConfigError: if ``max_graphs`` is not an int >= 1.
    """

    def __init__(self, function: Callable[..., Any], *, max_graphs: int = DEFAULT_MAX_GRAPHS, name: str = "",
                 before_replay: Callable[..., Any] | None = None):
        if not isinstance(max_graphs, int) or isinstance(max_graphs, bool) or max_graphs < 1:
            raise ConfigError(f"max_cuda_graphs must be an int >= 1, got {max_graphs!r}")
        self.function = function
        self.name = name or getattr(function, "__name__", "function")
        self.max_graphs = max_graphs
        self.before_replay = before_replay
        self.enabled = True
        self.disabled_reason = ""
        self.stats = {"captures": 0, "replays": 0, "evictions": 0, "plain_calls": 0}
        self._graphs = LRUCache(max_graphs, on_evict=self._evicted)
        self._lock = threading.Lock()

    # ---- public
    def __call__(self, *args, **kwargs) -> Any:
        # NOTE [cuda graphs and threads]: captured graphs share static input/output buffers; a lock keeps two
        # threads from copying inputs over each other between copy-in and the cloned output (with copy=False the
        # caller reads the buffers after the lock is released: another thread's replay may overwrite them).
        return self.call(args, kwargs)

    def call(self, args: tuple, kwargs: dict, copy: bool = True) -> Any:
        """``function(*args, **kwargs)`` through the graph of the call's key (captured on its first call), under
        the lock; ``copy``: return copies of the output tensors (else the graph's own buffers, valid until the next
        replay of this graph; NOTE [output copies] in aitune/torch/config.py). A call that cannot be captured, and
        every call once a capture failed, runs ``function`` itself."""
        with self._lock:
            found = flat_graph_key(args, kwargs) if self.enabled else (None, [])
            key, tensors = found if found is not None else (graph_key(args, kwargs), None)
            if key is None:
                self.stats["plain_calls"] += 1
                return self.function(*args, **kwargs)
            entry = self._graphs.get(key)
            if entry is None:
                return self._warm_up_and_capture(key, args, kwargs)
            if tensors is None:
                tensors = [leaf for leaf in tree_flatten((args, kwargs))[0] if isinstance(leaf, torch.Tensor)]
            return self._replay(entry, tensors, args, kwargs, copy)

    def _replay(self, entry, tensors: list, args: tuple, kwargs: dict, copy: bool) -> Any:
        for static, tensor in zip(entry.static_inputs, tensors):
            static.copy_(tensor)
        if self.before_replay is not None:
            self.before_replay(*args, **kwargs)
        entry.graph.replay()
        entry.replays += 1
        self.stats["replays"] += 1
        if copy:
            return clone_tensors(entry.static_output)
        if entry.output_spec is None:  # the graph's own buffer
            return entry.static_output
        # a new container each call around the graph's own buffers: what a caller sets in one output (a dict's or a
        # ModelOutput's field) is not in the next
        return tree_unflatten(entry.output_spec, entry.output_leaves)

    # ---- internals
    def _evicted(self, key: Hashable, entry: _CapturedGraph) -> None:
        self.stats["evictions"] += 1
        logger.debug("%s: evicted a CUDA graph after %d replays (cache of %d)", self.name, entry.replays,
                     self.max_graphs)

    def _warm_up_and_capture(self, key: Hashable, args: tuple, kwargs: dict) -> Any:
        leaves, spec = tree_flatten((args, kwargs))
        device = next(leaf.device for leaf in leaves if isinstance(leaf, torch.Tensor))
        static_leaves = []
        static_inputs = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                with torch.inference_mode(False), torch.no_grad():  # (a later call outside inference mode copies
                    # into it; no autograd history)
                    buffer = torch.empty_like(leaf)
                    buffer.copy_(leaf)
                static_leaves.append(buffer)
                static_inputs.append(buffer)
            else:
                static_leaves.append(leaf)
        static_args, static_kwargs = tree_unflatten(spec, static_leaves)
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                warm_output = self.function(*static_args, **static_kwargs)
        finally:  # (a warm-up that raised: what the caller runs next follows what it launched)
            current.wait_stream(side)
        # The warm-up output may alias a static input (identity-like functions): hand out a copy.
        warm_output = clone_tensors(warm_output)
        generator, saved_state = _generator_snapshot(device)
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.device(device), torch.cuda.graph(graph):
                static_output = self.function(*static_args, **static_kwargs)
        except Exception as exc:  # noqa: BLE001 - any capture failure means: run without graphs
            self._capture_failed(exc, generator, saved_state)
            return warm_output
        self.stats["captures"] += 1
        entry = _CapturedGraph(graph, static_inputs, static_output)
        if not isinstance(static_output, torch.Tensor):
            entry.output_leaves, entry.output_spec = tree_flatten(static_output)
        self._graphs.put(key, entry)
        logger.debug("%s: captured a CUDA graph (%d cached, max %d)", self.name, len(self._graphs), self.max_graphs)
        return warm_output


def _generator_snapshot(device: torch.device) -> tuple[Any, Any]:
    """The device's default CUDA generator and a clone of its state (None where torch lacks the API)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    generator = torch.cuda.default_generators[index]
    if not hasattr(generator, "clone_state") or not hasattr(generator, "graphsafe_set_state"):
        return generator, None
    return generator, generator.clone_state()

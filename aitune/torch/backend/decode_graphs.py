"""aitune's own CUDA graphs around a compiled call, and a decode step's graph that reads and writes the caller's
key/value cache in place.

NOTE [captured CUDA graphs]: ``torch.compile(mode="reduce-overhead")`` replays a compiled call's kernels with one
launch (CUDA-graph trees), but still runs Dynamo's guards, AOTAutograd's wrappers and the trees' bookkeeping
(invariant checks of every graph recorded for the function, output liveness) on every call: ~430 µs of host time per
decode call of a Qwen2-0.5B-sized model on an H100, whether transformers or aitune makes the call, and ~120 µs for
ResNet-50 at batch 1. Where the host is the bottleneck (a generate loop: ~1.35 ms of kernels per step at batch 1
against ~2 ms of transformers' Python around each call; a batch-1 convnet whose launch the device waits for), that
is the latency. Inductor's ``capture_cuda_graphs`` variant compiles the same kernels without CUDA graphs and aitune
captures the compiled call into one ``torch.cuda.CUDAGraph`` per input shape, then replays it: the host work per call
is copying the inputs into the graph's buffers, one launch and a copy of the outputs. For a graph without a cache
that is :class:`~aitune.torch.backend.cuda_graphs.CUDAGraphRunner`; for an LLM's decode graph, :class:`DecodeGraphs`
below. Measured side by side in one process (H100, bf16, prompt 128, 256 new tokens; a scratch run before this
module existed, with the capture by hand): 1.36x transformers' auto-compile's tokens/s at batch 1, 1.31x at batch 8
(benchmarks/RESULTS.md).

What makes a captured decode graph correct (the last three points hold for every captured graph):

* the cache's tensors are not copied: the graph reads and writes them where they are (their addresses are part of
  a captured graph's key, so a cache whose tensors are elsewhere gets its own capture). Only transformers'
  full-attention ``StaticLayer`` caches, not offloaded, are captured (:func:`captures_cache`): a sliding window's
  token count is a Python int the graph would freeze, and offloading moves the layers' tensors between calls;
* NOTE [a new cache at the same addresses]: transformers' ``generate`` makes a new cache object per call, and its
  tensors may land in the blocks the last one freed. A graph reads and writes addresses, not objects: a new cache
  whose fingerprint (:func:`cache_fingerprint`: addresses, key shapes) and facts (:func:`cache_facts`: classes,
  plain attributes, the dtypes, shapes and strides of every tensor) equal those the graph was captured with is
  served by that graph without a new capture (each capture warms up, synchronises the device and empties the
  allocator's cache: ``torch.cuda.graph``). A cache or layer holding tensors other than keys, values and the counter
  has no facts (what the graph reads of them is not fingerprinted) and is never served that way; facts that differ
  capture anew (the old graph stays until that capture replaces it);
* a capture runs the call once first (warm-up: compiles a new shape, sets up lazy state), which advances the
  cache's token counters: they are set back (:func:`~aitune.torch.record.llm.rewind_cache`) before the capture,
  and the writes it made into the cache are the ones the replay then makes again (the same positions, the same
  values);
* the graph bakes in the addresses of the module's weights: the backend keeps the weights' storage alive and
  declares them baked (``Backend.bakes_weights``), so ``ait.Module`` watches for weights changed or replaced and runs
  eager once they are;
* a replay runs no Python of the model: the compiled call is built with ``fullgraph=True`` (no Python between
  graph pieces), and of what Dynamo's guards would check per call, ``ait.Module`` checks grad mode, autocast, the
  module's flags, the attributes ``forward`` reads and hooks for every backend that bakes the module in (NOTE [what
  a backend follows]); not the fields of objects held in attributes (a transformers ``config``'s
  ``output_attentions``) nor other global state: a graph captured before such a change replays as captured, so
  re-tune after one (a module with forward hooks at tuning is refused: its calls could never use the graph);
* outputs are copied (``copy_cuda_graph_outputs``, NOTE [output copies]): a replay writes into the same buffers.

Each graph has its own memory pool (at most ``max_graphs`` are kept). Reference for the capture protocol (warm-up on
a side stream, ``capture_error_mode="thread_local"``): PyTorch's "CUDA Graphs" notes and
``torch/_inductor/cudagraph_trees.py``.
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Hashable

import torch

from aitune.errors import ConfigError
from aitune.torch.backend.cuda_graphs import CONSTANT_TYPES, DEFAULT_MAX_GRAPHS, GraphSet, _generator_snapshot
from aitune.torch.record.llm import is_kv_cache, rewind_cache
from aitune.torch.record.pytree import tree_flatten, tree_unflatten

CAPTURED_LAYERS = ("StaticLayer",)  # full attention: positions come from a device counter or cache_position


def captures_cache(cache: Any) -> bool:
    """Can a decode call with ``cache`` be captured: a transformers cache, not offloaded, whose layers are all
    full-attention ``StaticLayer`` with their tensors allocated (after the prefill) and a token counter that is a
    tensor or none (an int counter would be frozen into the graph)? Checked by class name. (That the tensors are on a
    CUDA device is checked at capture.)"""
    layers = getattr(cache, "layers", None)
    return bool(layers) and not getattr(cache, "offloading", False) and all(type(layer).__name__ in CAPTURED_LAYERS
                                and isinstance(getattr(layer, "keys", None), torch.Tensor)
                                and isinstance(getattr(layer, "cumulative_length", None), (torch.Tensor, type(None)))
                                for layer in layers)


_WITH_COUNTER = operator.attrgetter("keys", "values", "cumulative_length")
_WITHOUT_COUNTER = operator.attrgetter("keys", "values")


def cache_facts(cache: Any) -> tuple | None:
    """What a captured graph assumed of a cache beyond its tensors' addresses (:func:`cache_fingerprint`): the
    cache's and each layer's class, their attributes of plain values (``offloading``, ``max_cache_len``,
    ``batch_size``, the head sizes, ``is_initialized``, the device), and the dtype, shape and strides of each layer's
    keys, values and counter. Two caches with equal facts and fingerprints are served by one graph. None (never
    served by another cache's graph) when the cache or a layer holds anything else: an attribute that is neither a
    plain value nor one of those tensors (nor the cache's list of layers), whose contents the fingerprint does not
    cover."""
    if not _only(cache, (), ("layers",)) or not all(_only(layer, _LAYER_TENSORS, ()) for layer in cache.layers):
        return None
    return (type(cache), _plain(cache), *[(type(layer), _plain(layer), *[
        _layout(getattr(layer, name, None)) for name in _LAYER_TENSORS]) for layer in cache.layers])


_LAYER_TENSORS = ("cumulative_length", "keys", "values")
_FACT_TYPES = (*CONSTANT_TYPES, torch.device, torch.dtype)


def _layout(value: Any) -> tuple:
    if isinstance(value, torch.Tensor):
        return value.dtype, value.shape, value.stride()
    return (type(value),)  # (no tensor: None, or an int counter, which captures_cache refuses)


def _plain(value: Any) -> tuple:
    return tuple(sorted((name, item) for name, item in vars(value).items() if type(item) in _FACT_TYPES))


def _slots(klass: type) -> tuple:
    slots = getattr(klass, "__slots__", ()) if "__slots__" in vars(klass) else ()
    return tuple(name for name in ((slots,) if isinstance(slots, str) else slots)
                 if name not in ("__dict__", "__weakref__"))


def _only(value: Any, tensors: tuple, others: tuple) -> bool:
    """Does ``value`` hold nothing but plain values, the named tensors and the named other attributes?"""
    if not hasattr(value, "__dict__") or any(_slots(klass) for klass in type(value).__mro__):
        return False  # (slots hold attributes vars() does not show)
    return all(type(item) in _FACT_TYPES or name in others or (name in tensors and isinstance(item, torch.Tensor))
               for name, item in vars(value).items())


def cache_fingerprint(cache: Any) -> tuple:
    """Where a decode step reads and writes a cache: each layer's keys (address, shape and dtype: a cache initialised
    again in place with another dtype), values and tensor counter (addresses). Raises AttributeError for a layer
    without keys or values. ~5 µs for 24 layers (this project's CPU)."""
    try:
        return tuple([(keys.data_ptr(), keys.shape, keys.dtype, values.data_ptr(), counter.data_ptr())
                      for keys, values, counter in map(_WITH_COUNTER, cache.layers)])
    except AttributeError:  # layers without a tensor counter (positions passed in: cache_position)
        return tuple([(keys.data_ptr(), keys.shape, keys.dtype, values.data_ptr())
                      for keys, values in map(_WITHOUT_COUNTER, cache.layers)])


class _Captured:
    """One captured graph: its input buffers, its outputs, and how a call's output is made from them."""

    __slots__ = ("graph", "inputs", "cache", "facts", "type", "fields", "leaves", "spec", "cache_at", "replays")

    def __init__(self, graph, inputs, output, cache, facts: tuple | None) -> None:
        self.graph = graph
        self.inputs = inputs  # the graph's own buffers for the call's tensors, in the call's order
        self.cache = weakref.ref(cache)  # the cache it serves (NOTE [a new cache at the same addresses])
        self.facts = facts  # cache_facts of that cache at capture (None: never serves another cache object)
        self.type = type(output)
        self.fields = self.leaves = self.spec = None
        # a transformers ModelOutput of tensors and the cache: built anew per call by its constructor (~3x faster
        # than unflattening it); the caller's cache goes in where the captured call's was (not kept alive here: a
        # tuning copy of a cache can be large)
        if (isinstance(output, dict) and type(output).__module__.startswith("transformers.")
                and all(isinstance(value, torch.Tensor) or value is cache for value in output.values())):
            self.fields = [(key, None if value is cache else value) for key, value in output.items()]
        else:
            self.leaves, self.spec = tree_flatten(output, is_leaf=is_kv_cache)
        self.cache_at = [index for index, leaf in enumerate(self.leaves or ()) if leaf is cache]
        for index in self.cache_at:
            self.leaves[index] = None
        self.replays = 0

    def output(self, cache, copy: bool):
        if self.fields is not None:
            return self.type(**{key: cache if value is None else value.clone() if copy else value
                                  for key, value in self.fields})
        leaves = [leaf.clone() if copy and isinstance(leaf, torch.Tensor) else leaf for leaf in self.leaves]
        for index in self.cache_at:
            leaves[index] = cache
        return tree_unflatten(self.spec, leaves)


class DecodeGraphs(GraphSet):
    """Capture-and-replay of a decode call ``function(*args, **kwargs)`` whose key/value cache is used in place
    (NOTE [captured CUDA graphs]).

    Args:
        function: the compiled call (Inductor without CUDA graphs, ``fullgraph=True``); called under the caller's
            grad mode and contexts.
        cache_name: the keyword the call passes the cache as (``GraphSpec.cache_input``).
        max_graphs: most graphs kept (one per input shapes and cache), least recently used released first.
        name: label for log messages.

    Attributes:
        enabled: False once a capture failed; every call then runs ``function``.
        disabled_reason: that failure, one line.
        stats: ``captures``, ``rebinds`` (a graph that went on serving a new cache object at the same addresses),
            ``replays``, ``evictions`` (graphs dropped: over ``max_graphs``, replaced by a capture at their key, or
            their cache gone without facts at a later capture),
            ``plain_calls`` (calls run without a graph: no capturable cache, or a nested input).
    """

    def __init__(self, function: Callable[..., Any], cache_name: str, *, max_graphs: int = DEFAULT_MAX_GRAPHS,
                 name: str = "") -> None:
        if not isinstance(max_graphs, int) or isinstance(max_graphs, bool) or max_graphs < 1:
            raise ConfigError(f"max_graphs must be an int >= 1, got {max_graphs!r}")
        self.function = function
        self.cache_name = cache_name
        self.name = name or "decode graphs"
        self.enabled = True
        self.disabled_reason = ""
        self.stats = {"captures": 0, "rebinds": 0, "replays": 0, "evictions": 0, "plain_calls": 0}
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[Hashable, _Captured] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()  # the graphs' input and output buffers are shared between calls
        self._refused: tuple[Any, Hashable] | None = None  # (weak reference, key) of the last cache _capture refused

    def __call__(self, args: tuple, kwargs: dict, copy: bool = True) -> Any:
        """Answer a canonical call (``args``/``kwargs`` as the backend gets them); ``copy``: return copies of the
        output tensors (else the graph's own buffers, valid until the next replay).

        The first call of a key captures: it runs the call once (compiling a new shape), sets the cache's counters
        back, synchronises the device (``torch.cuda.graph``) and captures, then replays. A new cache object at the
        addresses of a graph's, with the facts it was captured with, is served by that graph (NOTE [a new cache at
        the same addresses]). An exception from the call propagates with the cache as that run left it (the caller
        puts the counters back: ``ait.Module`` does). A failed capture turns the graphs off for good (``enabled``),
        with one warning."""
        with self._lock:
            cache = kwargs.get(self.cache_name)
            found = self._key(args, kwargs, cache) if self.enabled else None
            if found is None:
                self.stats["plain_calls"] += 1
                return self.function(*args, **kwargs)
            key, tensors = found
            if self._refused is not None and self._refused[0]() is cache and self._refused[1] == key:  # (refused
                # once, with the same tensors: not checked again per call)
                self.stats["plain_calls"] += 1
                return self.function(*args, **kwargs)
            entry = self._graphs.get(key)
            if entry is not None and entry.cache() is not cache:  # NOTE [a new cache at the same addresses]
                if entry.facts is not None and cache_facts(cache) == entry.facts:
                    entry.cache = weakref.ref(cache)
                    self.stats["rebinds"] += 1
                else:  # (a capture for this cache replaces the entry; one refused leaves it to its own cache)
                    entry = None
            if entry is None:
                entry = self._capture(key, args, kwargs, cache)  # (its buffers hold this call's inputs)
                if entry is None:
                    self.stats["plain_calls"] += 1
                    return self.function(*args, **kwargs)
            else:
                self._graphs.move_to_end(key)
                for buffer, tensor in zip(entry.inputs, tensors):
                    buffer.copy_(tensor)
            entry.graph.replay()
            entry.replays += 1
            self.stats["replays"] += 1
            return entry.output(cache, copy)

    def _key(self, args: tuple, kwargs: dict, cache: Any) -> tuple[Hashable, list] | None:
        """The call's key (keyword names, each tensor's shape and dtype, each constant, the addresses of the cache's
        tensors) and its tensors in the call's order; None when it cannot be captured (no cache, a nested or
        unknown input)."""
        if cache is None:
            return None
        parts, tensors = [len(args)], []
        for name, value in (*enumerate(args), *kwargs.items()):
            parts.append(name)
            if isinstance(value, torch.Tensor):
                if not value.is_cuda:  # (a CPU tensor would be read once, at capture, and frozen into the graph)
                    return None
                parts.append((value.shape, value.dtype))
                tensors.append(value)
            elif value is cache:
                try:
                    parts.append(cache_fingerprint(cache))
                except AttributeError:  # a layer without keys/values (not allocated, another layer type)
                    return None
            elif type(value) in CONSTANT_TYPES:
                parts.append(value)
            else:
                return None
        return tuple(parts), tensors  # (a key never captured is checked by _capture: captures_cache)

    def _capture(self, key: Hashable, args: tuple, kwargs: dict, cache: Any) -> _Captured | None:
        """Warm up, set the cache's counters back, capture. None for a cache that cannot be captured (the call then
        runs plain; a graph another cache had at this key stays), and when the capture fails (every later call plain,
        ``enabled``)."""
        device = cache.layers[0].keys.device if captures_cache(cache) else None
        if device is None or device.type != "cuda" or any(layer.keys.device != device for layer in cache.layers):
            # (not capturable, a CPU cache, or one spread over devices: one graph runs on one device). What makes
            # a cache refused (its classes, offloading, counters' types, devices) does not change while it keeps
            # its tensors (the key holds their addresses), so its later calls skip the checks; a new cache object,
            # or new tensors in this one, are checked anew.
            try:
                self._refused = (weakref.ref(cache), key)
            except TypeError:  # (a class without weak references: checked at every call)
                pass
            return None
        facts = cache_facts(cache)  # (before the warm-up: as a new cache is when its first decode call comes)
        counter = getattr(cache.layers[0], "cumulative_length", None)
        before = counter.clone() if isinstance(counter, torch.Tensor) else counter
        inputs = []

        def own(value):
            if isinstance(value, torch.Tensor):
                inputs.append(value.clone())
                return inputs[-1]
            return value

        with torch.inference_mode(False), torch.no_grad():  # (buffers a later call outside inference mode can
            # copy into, without autograd history)
            static_args = tuple(own(value) for value in args)
            static_kwargs = {name: own(value) for name, value in kwargs.items()}
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                self.function(*static_args, **static_kwargs)  # warm-up (its output is not used)
                if before is not None:
                    rewind_cache(cache, before)
        finally:  # (a warm-up that raised: the caller's rewind then follows what it launched)
            current.wait_stream(side)
        generator, saved_state = _generator_snapshot(device)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.device(device), torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                output = self.function(*static_args, **static_kwargs)
        except Exception as exc:  # noqa: BLE001 - a capture that fails: run without graphs from now on
            self._capture_failed(exc, generator, saved_state)
            return None
        entry = _Captured(graph, inputs, output, cache, facts)
        # dropped: the graph this capture replaces (another cache's at these addresses), graphs whose cache is gone
        # and that no other cache may use (no facts), the least recently used over max_graphs. A graph whose cache
        # is gone stays for a later cache at its addresses (NOTE [a new cache at the same addresses])
        for old in [old for old, kept in self._graphs.items() if old == key or (kept.facts is None
                                                                                 and kept.cache() is None)]:
            del self._graphs[old]
            self.stats["evictions"] += 1
        self._graphs[key] = entry
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
            self.stats["evictions"] += 1
        self.stats["captures"] += 1
        return entry

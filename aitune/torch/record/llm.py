"""Text generation: the prefill and decode phases of a decoder called with a key/value cache.

A decoder inside ``model.generate(...)`` is called once per prompt (*prefill*: the whole prompt, the cache
empty) and then once per new token (*decode*: one position, the cache holding everything before it). The two
calls differ in their work (a prompt-long matrix product against one row), so each is its own graph, named
after its phase; a call's phase is read from its inputs:

* an input named ``cache_position`` (older transformers versions and many custom decoders pass one): prefill
  when its first position is 0, else decode;
* otherwise a transformers cache among the inputs (``cache`` in transformers 5.24, ``past_key_values`` in 5.17):
  prefill when it holds no token yet (``get_seq_length() == 0``), else decode.

NOTE [caches as inputs]: a static cache (``StaticCache``: preallocated key/value tensors, written in place at
the call's positions) is an input like any other — opened into its tensors
(:mod:`aitune.torch.record.object_state`), recorded as a clone of its state before the call, and compared after
every candidate's run with eager's cache from the same state (checks of mutated inputs). Its size
(``max_cache_len``, set by ``generate`` from the prompt and ``max_new_tokens``) is left out of the graph's
identity: a longer generation is the same graph with a longer cache axis. A dynamic cache (``DynamicCache``:
its tensors replaced by longer ones at every step, ``is_compileable`` False) cannot be served by a compiled
artifact — its graph is marked :attr:`GraphSpec.untunable` and runs eager, with the hint to ask ``generate`` for a
static cache.

Inputs that index into the cache (``cache_position``, ``position_ids``) are accepted in ``[0, capacity)`` of
the cache the call brings (the value gate, ``aitune/torch/backend/accepted.py``); no probe is derived for
such graphs (NOTE [no probes for caches] in :mod:`aitune.torch.check.probes`).
"""

from __future__ import annotations

import weakref
from typing import Any, Hashable, NamedTuple

import torch

from aitune.torch.record.pytree import TreeSpec, is_transformers_cache

PREFILL = "prefill"
DECODE = "decode"
POSITION_INPUTS = ("cache_position", "position_ids")  # integer inputs that index the cache's sequence axis
STATIC_CACHE_HINT = ("a dynamic key/value cache (its tensors grow at every step) cannot be served by a compiled "
                     "graph: pass cache_implementation=\"static\" to generate (or a transformers StaticCache) "
                     "to tune this phase")

EXPORTED_CACHE_REASON = ("an exported graph is functional: it cannot fill or update the key/value cache object the "
                         "call passes (in place, as the model does); compiled-in-process backends (Inductor JIT, "
                         "TorchAO) or eager serve this phase")

FROZEN_CACHE_REASON = ("freezing folds static-address tensors like weights, and a key/value cache's are static "
                       "addresses (transformers marks them for CUDA graphs): a cache of another length would fail the "
                       "compiled graph's size checks")


REPLAYED_CACHE_REASON = ("eager's CUDA-graph runner replays on its own copies of the inputs: the writes into the "
                         "key/value cache would not reach the caller's cache")

# NOTE [no CUDA graphs for prefill]: a prefill call may create the cache's tensors (transformers allocates them
# lazily, on the first call); under CUDA graphs they would live in the graph's private memory pool, which later
# replays overwrite, and the decode graph would read them from there. A prefill is also compute-bound (a whole
# prompt per call), where replaying launches saves little. On CUDA it is offered Inductor without CUDA graphs.


def cache_refusal(exported: bool, config) -> str | None:
    """Why a backend configuration cannot serve a graph that takes a key/value cache object, or None."""
    if exported:
        return EXPORTED_CACHE_REASON
    if folds_state(config):
        return FROZEN_CACHE_REASON
    if getattr(config, "use_cuda_graphs", False):
        return REPLAYED_CACHE_REASON
    return None


def folds_state(config) -> bool:
    """Does a backend configuration freeze (fold the module's tensors into the compiled graph)?"""
    return bool(getattr(config, "freezing", False) or (getattr(config, "options", None) or {}).get("freezing"))


def cache_object_input(graph) -> bool:
    """Does a phase graph take a transformers cache object (not only ``cache_position``)?"""
    return getattr(graph, "cache_input", None) is not None  # set for phase graphs only


def is_kv_cache(value: Any) -> bool:
    """Is ``value`` a transformers key/value cache (a subclass of ``transformers.cache_utils.Cache``)?
    Checked by class name so transformers is never imported here (the answer is kept per type)."""
    value_type = type(value)
    known = _CACHE_TYPES.get(value_type)
    if known is None:
        known = _CACHE_TYPES[value_type] = is_transformers_cache(value_type)
    return known


_CACHE_TYPES: dict[type, bool] = {}


def find_cache(kwargs: dict, args: tuple = ()) -> Any:
    """The first transformers cache among a call's top-level arguments, or None."""
    name = cache_argument(kwargs)
    if name is not None:
        return kwargs[name]
    return next((value for value in args if is_kv_cache(value)), None)


def llm_phase(args: tuple, kwargs: dict) -> str | None:
    """The phase of a canonical call (``"prefill"``/``"decode"``), or None when it is not a cached decoder call.

    Reading a CUDA ``cache_position`` waits for the device (one small copy); ``generate`` synchronizes at every
    step anyway (its stopping check).
    """
    found = _phase_and_fill(kwargs, find_cache(kwargs, args))
    return found[0] if found is not None else None


def _phase_and_fill(kwargs: dict, cache: Any, read_device: bool = True) -> tuple[str, int | None, bool] | None:
    """``(phase, tokens the cache holds before the call, assumed)`` by the rules of this module's docstring; the
    token count is None when ``cache_position`` decides. None when neither applies (or the cache cannot say).
    ``read_device=False``: a one-position ``cache_position`` off the CPU is taken for decode without reading it,
    and ``assumed`` says so (NOTE [decode without a device read])."""
    position = kwargs.get("cache_position")
    if isinstance(position, torch.Tensor) and position.numel() and not position.is_floating_point():
        if not read_device and not position.is_cpu and position.numel() == 1:
            return DECODE, None, True
        first = position[0] if position.dim() == 1 else position.reshape(-1)[0]  # one view op fewer, per call
        return (PREFILL if int(first) == 0 else DECODE), None, False
    if cache is None:
        return None
    try:
        counter = cache.get_seq_length()  # transformers 5.x's static layers: their token counter, a 0-dim tensor
        if not read_device and isinstance(counter, torch.Tensor) and not counter.is_cpu and _query(kwargs) == 1:
            return DECODE, None, True  # NOTE [decode without a device read]
        cached = int(counter)
    except Exception:  # noqa: BLE001 - a cache that cannot say: not a phase call
        return None
    return (PREFILL if cached == 0 else DECODE), cached, False


def dynamic_cache_reason(args: tuple, kwargs: dict) -> str | None:
    """Why a call's cache rules out compiled backends (a cache whose ``is_compileable`` is False), or None."""
    cache = find_cache(kwargs, args)
    if cache is None or bool(getattr(cache, "is_compileable", False)):
        return None
    return f"{type(cache).__name__}: {STATIC_CACHE_HINT}"


def cache_capacity(kwargs: dict, args: tuple = ()) -> int | None:
    """Positions the call's static cache holds (its ``max_cache_len``), or None without one or when every layer is
    a sliding window (a rolling cache never fills). Sliding-window layers keep only the window; the full layers
    hold every position, so they bound the positions a call may write."""
    return _capacity_of(find_cache(kwargs, args))


def _capacity_of(cache: Any) -> int | None:
    if cache is None:
        return None
    layers = list(getattr(cache, "layers", ()))
    if not layers:
        length = getattr(cache, "max_cache_len", None)
        return int(length) if isinstance(length, int) else None
    lengths = [getattr(layer, "max_cache_len", None) for layer in layers if "Sliding" not in type(layer).__name__]
    lengths = [int(length) for length in lengths if isinstance(length, int)]
    return min(lengths) if lengths else None


def phase_structure(spec: TreeSpec) -> TreeSpec:
    """``spec`` with every transformers cache node's context dropped (its sizes, e.g. ``max_cache_len``): the
    structure that identifies a phase graph (its leaves, their ranks and dtypes stay in the key)."""
    if spec.kind == "leaf" or not spec.children:
        return spec
    node_type = spec.node_type
    if spec.kind == "kv_cache":
        node_type = (node_type[0], None)
    return TreeSpec(spec.kind, node_type, spec.context, tuple(phase_structure(child) for child in spec.children))


def in_cache(path: str, cache: str | None) -> bool:
    """Is the input leaf at ``path`` the key/value cache ``cache`` (a graph's ``cache_input``) or one of its tensors
    and counters (``cache[3]``)?"""
    return cache is not None and (path == cache or path.startswith(cache + "["))


def cache_argument(kwargs: dict) -> str | None:
    """The name of the keyword argument holding a transformers cache, or None."""
    for name, value in kwargs.items():
        if is_kv_cache(value):
            return name
    return None


class PhaseCall(NamedTuple):
    """What the per-call path needs of a decoder call with a key/value cache (:func:`phase_call`).

    Attributes:
        route: hashable identity of the call's structure without flattening the cache: each keyword's tensor
            dtype/rank/device or constant value, the cache's type and which of its layers hold tensors, and the
            phase.
        phase: ``"prefill"`` or ``"decode"``.
        cached: tokens the cache held before the call (None when the call passes ``cache_position`` instead).
        capacity: positions the cache holds (``max_cache_len``), None when unknown.
        query: positions the call adds (the sequence length of ``input_ids``/``inputs_embeds``), None when unknown.
        assumed: the phase was taken from the shape, not read (NOTE [decode without a device read]).
    """

    route: Hashable
    phase: str
    cached: int | None
    capacity: int | None
    query: int | None
    assumed: bool = False

    @property
    def overflows(self) -> bool:
        """Would the call write past its cache's end (False when any of the three counts is unknown)?"""
        return None not in (self.cached, self.capacity, self.query) and self.cached + self.query > self.capacity


def phase_call(args: tuple, kwargs: dict, read_device: bool = True) -> PhaseCall | None:
    """The facts of a canonical call with a transformers cache or a ``cache_position`` (NOTE [caches as inputs]),
    read without flattening the cache; None for any other call (or one nested in ways this does not key).

    NOTE [decode without a device read]: with ``read_device=False`` (the dispatch of a tuned module), a call that
    adds one position and whose ``cache_position`` — or, without one, its cache's token counter (transformers 5.x
    passes no ``cache_position``; a static layer counts its tokens in a 0-dim tensor on the cache's device) — is off
    the CPU is taken for a decode call without reading the position: the read waits for the device (a copy back to
    the host); with it the phase check took 73.5 µs of a decode call on the GPU machine
    (``benchmarks/llm_decode_host.py --stages``), more than the rest of the dispatch. Only a prompt of one token
    into an empty cache is such a call and not a decode call; the decode graph computes the same forward for it (the
    graph takes the positions and the counter as values, not as constants), and a lazily initialised cache
    (transformers' first call) has another structure, which no decode graph takes: that call's phase is read
    (:attr:`PhaseCall.assumed`). The fill is then unknown on the host (``cached`` None), so a call past the cache's
    end is not turned away before it runs: it meets the same index check as in eager (a device-side assert on
    CUDA; Inductor keeps its indirect-indexing asserts), and a backend's output discarded after the call rewinds the
    counters to a device-side copy taken before it (:func:`counter_snapshot`). Recording always reads the position
    (the graph's identity, as in the reference)."""
    if args:
        return None
    parts = []
    cache = None
    capacity = None
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            parts.append((name, value.dtype, value.dim(), value.get_device()))
        elif value is None or type(value) in (int, float, bool, str):
            parts.append((name, type(value), value))
        elif cache is None and is_kv_cache(value):
            cache = value
            facts = _layer_facts(value)
            if facts is None:
                return None
            layers_key, capacity = facts
            parts.append((name, type(value), layers_key))
        else:
            return None
    found = _phase_and_fill(kwargs, cache, read_device)
    if found is None:
        return None
    phase, cached, assumed = found
    return PhaseCall((tuple(parts), phase), phase, cached, capacity, _query(kwargs), assumed)


# NOTE [cache facts memo]: a decode step's call brings the same cache object every step, and a model has one layer
# object per decoder layer (24 for a 0.5B model): describing its layers took ~0.5 µs each per call, ~13 µs per
# decode call on a 24-layer cache (this project's CPU), which a CUDA-graph replay does not hide. The description is
# kept for the last cache seen, once every layer is initialised (a lazily initialised layer changes), and reused
# while that cache (a weak reference: the memo never keeps a cache or its tensors alive) holds the same layer
# objects (their ids, in order: a layer swapped in, or a new list, is described again) and its first layer's keys
# keep their dtype (``early_initialization`` re-initialises every layer in place, in any dtype). A layer's
# ``max_cache_len`` is set when it is made. transformers itself never swaps a cache's layers.
_FACTS_MEMO: list = [None]  # (weakref to the cache, ids of its layers, first keys' dtype, layers key, capacity)


def _layer_facts(cache: Any) -> tuple[tuple, int | None] | None:
    """``(layers key, capacity)`` of a transformers cache: per layer its type, whether it holds tensors and their
    dtype; capacity as :func:`cache_capacity`. None for a cache without ``layers`` (not keyed)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return None
    memo = _FACTS_MEMO[0]
    if memo is not None and memo[0]() is cache:
        ids = tuple(map(id, layers))
        if ids == memo[1] and getattr(getattr(layers[0], "keys", None), "dtype", None) == memo[2]:
            return memo[3], memo[4]
    initialized = [bool(getattr(layer, "is_initialized", True)) for layer in layers]
    key = tuple((type(layer), ready, getattr(getattr(layer, "keys", None), "dtype", None))
                for layer, ready in zip(layers, initialized))
    capacity = _capacity_of(cache)
    if layers and all(initialized):
        try:
            _FACTS_MEMO[0] = (weakref.ref(cache), tuple(map(id, layers)), key[0][2], key, capacity)
        except TypeError:  # a cache class without weak references: described on every call
            pass
    return key, capacity


def _query(kwargs: dict) -> int | None:
    tokens = kwargs.get("input_ids")
    if not isinstance(tokens, torch.Tensor):
        tokens = kwargs.get("inputs_embeds")
    return int(tokens.shape[1]) if isinstance(tokens, torch.Tensor) and tokens.dim() >= 2 else None


def slow_route_facts(args: tuple, kwargs: dict, phase: str) -> PhaseCall:
    """The :class:`PhaseCall` of a phase call :func:`phase_call` could not key (other nested arguments)."""
    cache = find_cache(kwargs, args)
    found = _phase_and_fill(kwargs, cache)
    return PhaseCall(None, phase, found[1] if found is not None else None, _capacity_of(cache), _query(kwargs))


# the layer classes whose whole state is key/value tensors written at positions and position counters: the only
# ones rewind_cache can put back where a call started (linear-attention states, an indexer's own counter, an
# encoder-decoder pair's second cache, or a sliding window's rolled contents are not)
REWINDABLE_LAYERS = ("StaticLayer", "StaticSlidingWindowLayer")


def rewindable(cache: Any) -> bool:
    """Can :func:`rewind_cache` put ``cache`` back where a call started, read after the call? Every layer must be
    a ``StaticLayer`` (full attention: a rerun writes the same positions), or a ``StaticSlidingWindowLayer`` whose
    window has not filled (``cumulative_length_int <= max_cache_len``: a full window rolls its contents, which no
    counter undoes; a layer the call did not reach may have been full before it, and counts as full). Checked by
    class name."""
    layers = getattr(cache, "layers", None)
    if not layers:
        return False
    for layer in layers:
        name = type(layer).__name__
        if name == "StaticSlidingWindowLayer":
            filled, window = getattr(layer, "cumulative_length_int", None), getattr(layer, "max_cache_len", None)
            if not (isinstance(filled, int) and isinstance(window, int) and filled <= window):
                return False
        elif name != "StaticLayer":
            return False
    return True


_SNAPSHOT: list = [None]  # (weak reference to the last counter copied, the tensor it was copied into)


def _first_counter(cache: Any) -> Any:
    """The first layer's ``cumulative_length`` (a tensor or an int), or None."""
    layers = getattr(cache, "layers", None)
    return getattr(layers[0], "cumulative_length", None) if layers else None


def counter_snapshot(cache: Any) -> torch.Tensor | int | None:
    """The token counter of ``cache``'s first layer as it is now, for :func:`rewind_cache` where the fill was not
    read (NOTE [decode without a device read]): a tensor counter (transformers' static layers) is copied on its
    device without reading it back (an asynchronous copy into a tensor kept for that counter, no allocation per
    call); an int counter is returned as it is; None without one. Full-attention layers count alike; a sliding
    layer's tensor counter stops at its window while its int counter goes on, and :func:`rewind_cache` sets both
    from the one value (the tensor is not read once the window is full)."""
    counter = _first_counter(cache)
    if not isinstance(counter, torch.Tensor):
        return counter if isinstance(counter, int) else None
    kept = _SNAPSHOT[0]
    if kept is None or kept[0]() is not counter:
        copy = counter.clone()
        _SNAPSHOT[0] = (weakref.ref(counter), copy)
        return copy
    return kept[1].copy_(counter)


def cache_advanced(cache: Any, before: int | torch.Tensor | None) -> bool | None:
    """Has ``cache``'s first layer counted tokens since ``before`` (its count before a call: the int
    :func:`phase_call` read, or a :func:`counter_snapshot` tensor)? None when it cannot be told. The first layer
    runs first in a decoder's forward, so an unmoved count means the call applied nothing to the cache. Reads the
    device for a tensor count (used after a backend raised only)."""
    try:
        if isinstance(before, torch.Tensor):
            now = _first_counter(cache)
            if not isinstance(now, torch.Tensor):
                return None
            return not torch.equal(now, before.to(now.device))
        if isinstance(before, int):
            return int(cache.get_seq_length()) != before
    except Exception:  # noqa: BLE001 - a cache that cannot say
        return None
    return None


def rewind_cache(cache: Any, cached: int | torch.Tensor) -> None:
    """Set the counters of ``cache`` and its layers back to ``cached`` tokens (what :func:`phase_call` read before
    the call, or a :func:`counter_snapshot` taken then), so an eager rerun of a call a backend already ran writes
    where that call started. The counters are transformers' ``cumulative_length`` (a tensor, or an int) and
    ``cumulative_length_int`` (sliding-window layers). A snapshot is copied on the device; it is read back for an
    int counter (a sliding layer's ``cumulative_length_int`` included: a device read, on this rare path only)."""
    for layer in getattr(cache, "layers", ()):
        counter = getattr(layer, "cumulative_length", None)
        if isinstance(counter, torch.Tensor):
            counter.copy_(cached) if isinstance(cached, torch.Tensor) else counter.fill_(cached)
        elif isinstance(counter, int):
            layer.cumulative_length = int(cached)
        if isinstance(getattr(layer, "cumulative_length_int", None), int):
            layer.cumulative_length_int = int(cached)

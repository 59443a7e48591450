"""The settings Dynamo and Inductor compile an aitune-compiled callable with: Inductor ``freezing`` for every
compile that starts inside a call of a frozen callable (NOTE [freezing per compile]); every other setting is
torch's (NOTE [floats as torch traces them]).

Also which shapes a compile treats as symbolic (:func:`resolved_dynamic`, NOTE [decode per cache length]).

Used by the Inductor JIT and TorchAO backends (:mod:`aitune.torch.backend.inductor_jit`,
:mod:`aitune.torch.backend.ao`); :func:`resolved_dynamic` by Inductor JIT only, :func:`dynamic_for_axes`
(``dynamic=True`` for any graph with a dynamic axis, a decode phase's too) by TorchAO and Torch-TensorRT.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

from aitune.torch.record.llm import DECODE, find_cache


# NOTE [floats as torch traces them]: with ``specialize_float`` off (torch's default) Dynamo makes a module's float
# attributes (an RMSNorm's ``variance_epsilon``, attention's ``scaling``) graph inputs, and under ``dynamic=True`` a
# decoder's prefill trace can restart once ("Restarting analysis due to ... _tensorify_python_scalars" with
# ``TORCH_LOGS=dynamo``), which costs tune time. Specialising floats for the build's compiles only (and leaving a
# later recompile to torch's default) removed that restart, but on CUDA (torch 2.11) the decode graph's first
# recompile at serve time (a cache of another length) then crashed the process inside Triton's launcher (a
# segmentation fault; with the static launcher off: "Pointer argument must be either uint64 or have data_ptr method"):
# tests/gpu/test_llm_generation_gpu.py. Specialising every compile of the prefill graph's callable only (build and
# serve time alike; the decode graph's with torch's setting) crashed that test file too, in the same place: the
# decode graph's CUDA-graph recording, a kernel of its first graph partition launched by Triton's static launcher. It
# crashed there with Inductor's and Triton's caches off as well (not a cache entry shared between the two settings),
# and with floats specialised in every compile of every graph (benchmarks/RESULTS.md). aitune's compiles use torch's
# setting, the same in every compile.


class _FreezingWhileTracing:
    """Inductor ``freezing`` on for every compile that starts inside a call of a frozen callable (re-entrant).

    NOTE [freezing per compile]: the flag is read only while Dynamo traces and Inductor compiles. A call marks
    its thread (a thread-local depth: under 1 µs per call), and Dynamo's compile-start callback
    (``torch._dynamo.callback_handler``, run in the compiling thread before it traces) sets
    ``torch._inductor.config.freezing`` for a Dynamo compile that starts in a thread inside such a call; the end
    callback restores it, and so does the call's exit if the end callback ran in another thread (Dynamo runs the
    callbacks when a process-wide count of compiles in progress, CUDA-graph recordings and lazy backward compiles
    included, leaves and returns to zero). Setting and restoring the flag around every call instead cost ~9 µs
    of host time per call (the config module's attribute lookups; this project's CPU). A frozen callable's
    recompile that starts while another thread compiles a backward or records a CUDA graph gets no start
    callback and compiles without freezing: slower, not wrong. Where the config is shared by all threads (older
    torch; torch 2.13 keeps it per thread), a compile by another thread between such a compile's end and the
    call's end sees the flag. The callbacks are registered again by the first call after
    ``torch._dynamo.reset()``, which clears them. Where they are missing (another torch), the flag is set and
    restored around the call."""

    def __init__(self) -> None:
        self._local = _Depth()
        self._handler = getattr(torch._dynamo, "callback_handler", None)
        self._per_compile = isinstance(getattr(self._handler, "start_callbacks", None), list)
        self._started, self._ended = self._compile_started, self._compile_ended  # (bound once: found by identity)

    def __enter__(self) -> None:
        local = self._local
        local.depth += 1
        if self._per_compile:
            if self._started not in self._handler.start_callbacks:  # first call, or torch._dynamo.reset() cleared it
                self._handler.register_start_callback(self._started)
                self._handler.register_end_callback(self._ended)
        else:
            config = torch._inductor.config
            local.saved.append(config.freezing)
            config.freezing = True

    def __exit__(self, *exc_info) -> None:
        local = self._local
        local.depth -= 1
        if not self._per_compile:
            torch._inductor.config.freezing = local.saved.pop()
        elif local.set and not local.depth:  # the compile's end callback ran elsewhere (or never)
            self._restore(local)

    def _compile_started(self, args=None) -> None:
        local = self._local
        trigger = getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO")
        if local.depth and not local.set and trigger == "DYNAMO":  # not a CUDA-graph recording
            config = torch._inductor.config
            local.previous = config.freezing
            config.freezing = True
            local.set = True

    def _compile_ended(self, args=None) -> None:
        local = self._local
        if local.set:  # only the thread that set it
            self._restore(local)

    @staticmethod
    def _restore(local) -> None:
        torch._inductor.config.freezing = local.previous
        local.set = False


class _Depth(threading.local):
    """Per thread: how many frozen calls are running; whether a compile-start callback set the flag, and what
    it was before; the values to restore where the flag is set around each call."""

    depth = 0
    set = False
    previous = False

    def __init__(self) -> None:
        self.saved: list = []


_FREEZING_WHILE_TRACING: _FreezingWhileTracing | None = None


def parameter_freezing(enabled: bool):
    """A context in which Dynamo traces with Inductor ``freezing`` on (a no-op context when not ``enabled``).

    NOTE [freezing is decided while Dynamo traces]: ``torch.compile(options={"freezing": True})`` patches
    Inductor's config only while Inductor compiles, but whether parameters become graph constants (what
    freezing folds) or stay graph inputs is decided earlier, while Dynamo traces, from the config's own
    ``torch._inductor.config.freezing`` (process-wide, or per thread in newer torch;
    ``torch._dynamo.utils.is_parameter_freezing``). With the options
    alone, a frozen reduce-overhead ResNet-50 on CUDA ran slower than with freezing on while tracing, even
    slower than without freezing (``benchmarks/gpu_freezing.py`` measures it), and on CPU the weights were
    not folded at all (``tests/unit/test_search.py``). Every call of a frozen compiled
    callable runs inside this context, not only the build's warm-up: a call that recompiles (a probe of
    another size during tuning, a new shape later) adds a cache entry that Dynamo tries first, so an
    unfrozen recompile would shadow the frozen one. The flag is set and restored around the call's compiles
    (NOTE [freezing per compile]).
    """
    global _FREEZING_WHILE_TRACING
    if not enabled:
        return contextlib.nullcontext()
    if _FREEZING_WHILE_TRACING is None:
        import torch._dynamo  # noqa: F401 - makes torch._dynamo.callback_handler an attribute
        import torch._inductor.config  # noqa: F401 - makes torch._inductor.config an attribute

        _FREEZING_WHILE_TRACING = _FreezingWhileTracing()
    return _FREEZING_WHILE_TRACING


def resolved_dynamic(configured: bool | None, graph) -> bool | None:
    """The ``dynamic`` argument of ``torch.compile`` for ``graph``: ``configured`` when set (True/False), else
    False for a decode phase (NOTE [decode per cache length]; None for a cache with sliding-window layers), True
    for any other graph with a dynamic axis (a prefill phase's prompt length included: torch's automatic dynamic
    shapes compiled a decoder's prefill no faster, ``benchmarks/prefill_compile.py``), None otherwise."""
    if configured is not None:
        return configured
    if graph is not None and graph.phase == DECODE:
        # NOTE [decode per cache length]: a decode call's shapes are fixed but for the batch size and the
        # static cache's length (and the mask sized to it), which differs between generate calls. Symbolic,
        # that length slowed the decode step (benchmarks/RESULTS.md: 0.72-0.78x of transformers' own
        # compile, against 0.93-0.96x compiled for one length). So the graph compiles once per batch size
        # and cache length, as transformers' own compile does; in transformers 5.x a model's static cache
        # never shrinks between calls (``_prepare_static_cache`` takes the longest so far, ``max_cache_len``
        # sets the least), so a generate loop meets few lengths, each compiled on its first call, within
        # dynamo's recompile limit (NOTE [recompile limit]).
        # A sliding-window layer keeps its token count in a plain int (transformers' StaticSlidingWindowLayer),
        # which a graph compiled with dynamic=False specialises on: one compile per position, up to the
        # recompile limit. Such a cache's decode graph compiles with torch's automatic dynamic shapes instead
        # (static first; what changes between calls, that count, symbolic from the second compile on).
        if graph.samples and _has_sliding_layers(find_cache(graph.samples[0].kwargs, graph.samples[0].args)):
            return None
        return False
    return dynamic_for_axes(configured, graph)


def dynamic_for_axes(configured: bool | None, graph) -> bool | None:
    """The ``dynamic`` argument of ``torch.compile`` by the graph's axes alone: ``configured`` when set, else True
    for a graph with a dynamic axis, None (torch's automatic dynamic shapes) otherwise. TorchAO's and
    Torch-TensorRT's rule for every graph, Inductor JIT's outside a decode phase (:func:`resolved_dynamic`)."""
    if configured is not None:
        return configured
    return True if graph is not None and graph.is_dynamic else None


def _has_sliding_layers(cache: Any) -> bool:
    return any("Sliding" in type(layer).__name__ for layer in getattr(cache, "layers", None) or ())

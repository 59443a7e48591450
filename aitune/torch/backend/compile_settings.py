"""The settings Dynamo and Inductor compile an aitune-compiled callable with, set only while a compile that
starts inside one of its calls traces and compiles (NOTE [freezing per compile]).

Used by the Inductor JIT and TorchAO backends (:mod:`aitune.torch.backend.inductor_jit`,
:mod:`aitune.torch.backend.ao`): every call of their compiled callable runs in :func:`compile_settings`.
"""

from __future__ import annotations

import contextlib
import threading

import torch


class _WhileTracing:
    """Compile settings for every compile that starts inside a call of an aitune-compiled callable (re-entrant):
    Dynamo's ``specialize_float`` for all of them, and Inductor's ``freezing`` inside a call of a frozen one.

    NOTE [freezing per compile]: the flags are read only while Dynamo traces and Inductor compiles. A call marks
    its thread (thread-local depths: under 1 µs per call), and Dynamo's compile-start callback
    (``torch._dynamo.callback_handler``, run in the compiling thread before it traces) sets the flags for a
    Dynamo compile that starts in a thread inside such a call; the end callback restores them, and so does the
    call's exit if the end callback ran in another thread (Dynamo runs the callbacks when a process-wide count of
    compiles in progress, CUDA-graph recordings and lazy backward compiles included, leaves and returns to zero).
    Setting and restoring ``freezing`` around every call instead cost ~9 µs of host time per call (the config
    module's attribute lookups; this project's CPU). A recompile that starts while another thread compiles a
    backward or records a CUDA graph gets no start callback and compiles without the settings: slower, not wrong.
    Where the config is shared by all threads (older torch; torch 2.13 keeps it per thread), a compile by another
    thread between such a compile's end and the call's end sees the flags. The callbacks are registered again by
    the first call after ``torch._dynamo.reset()``, which clears them. Where they are missing (another torch), the
    flags are set and restored around the call.

    NOTE [floats specialised while tracing]: with ``specialize_float`` off (torch's default) Dynamo makes a
    module's float attributes (an RMSNorm's ``variance_epsilon``, attention's ``scaling``) graph inputs; under
    ``dynamic=True`` Inductor then fails to turn some of them into tensors and Dynamo restarts the whole trace
    ("Restarting analysis due to ... _tensorify_python_scalars"). On the H200 that restart was ~36 s of a
    Qwen2-0.5B-sized decoder's 88 s prefill build (``benchmarks/llm_generate.py --compile-times``,
    benchmarks/RESULTS.md). aitune's graphs take their float arguments as constants already (a call with another
    float value is another graph: :func:`aitune.torch.record.pytree.hashable_constant`), so specialising floats
    loses nothing they could use."""

    def __init__(self) -> None:
        import torch._dynamo.config  # noqa: F401 - makes torch._dynamo.config an attribute

        self._local = _Depth()
        self._handler = getattr(torch._dynamo, "callback_handler", None)
        self._per_compile = isinstance(getattr(self._handler, "start_callbacks", None), list)
        self._started, self._ended = self._compile_started, self._compile_ended  # (bound once: found by identity)

    def enter(self, frozen: bool) -> None:
        local = self._local
        local.depth += 1
        local.frozen += frozen
        if self._per_compile:
            if self._started not in self._handler.start_callbacks:  # first call, or torch._dynamo.reset() cleared it
                self._handler.register_start_callback(self._started)
                self._handler.register_end_callback(self._ended)
        else:
            local.saved.append(_flags())
            _set_flags(True, bool(local.frozen) or torch._inductor.config.freezing)

    def exit(self, frozen: bool) -> None:
        local = self._local
        local.depth -= 1
        local.frozen -= frozen
        if not self._per_compile:
            _set_flags(*local.saved.pop())
        elif local.set and not local.depth:  # the compile's end callback ran elsewhere (or never)
            self._restore(local)

    def _compile_started(self, args=None) -> None:
        local = self._local
        trigger = getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO")
        if local.depth and not local.set and trigger == "DYNAMO":  # not a CUDA-graph recording
            local.previous = _flags()
            _set_flags(True, bool(local.frozen) or local.previous[1])
            local.set = True

    def _compile_ended(self, args=None) -> None:
        local = self._local
        if local.set:  # only the thread that set it
            self._restore(local)

    @staticmethod
    def _restore(local) -> None:
        _set_flags(*local.previous)
        local.set = False


def _flags() -> tuple[bool, bool]:
    return torch._dynamo.config.specialize_float, torch._inductor.config.freezing


def _set_flags(specialize_float: bool, freezing: bool) -> None:
    torch._dynamo.config.specialize_float = specialize_float
    torch._inductor.config.freezing = freezing


class _Depth(threading.local):
    """Per thread: how many calls of aitune-compiled callables are running, how many of them frozen; whether a
    compile-start callback set the flags, and what they were before; the values to restore where the flags are
    set around each call."""

    depth = 0
    frozen = 0
    set = False
    previous = (False, False)

    def __init__(self) -> None:
        self.saved: list = []


class _CompileSettings:
    """The context one compiled callable's calls run in (:func:`compile_settings`)."""

    __slots__ = ("_shared", "_frozen")

    def __init__(self, shared: _WhileTracing, frozen: bool) -> None:
        self._shared, self._frozen = shared, frozen

    def __enter__(self) -> None:
        self._shared.enter(self._frozen)

    def __exit__(self, *exc_info) -> None:
        self._shared.exit(self._frozen)


_WHILE_TRACING: _WhileTracing | None = None
_SETTINGS: dict[bool, _CompileSettings] = {}


def compile_settings(frozen: bool) -> _CompileSettings:
    """The context every call of an aitune-compiled callable runs in: the compiles that start inside it trace
    with floats specialised (NOTE [floats specialised while tracing]) and, for a ``frozen`` callable, with
    Inductor ``freezing`` on (NOTE [freezing is decided while Dynamo traces]); set per compile (NOTE [freezing
    per compile])."""
    global _WHILE_TRACING
    if frozen not in _SETTINGS:
        if _WHILE_TRACING is None:
            import torch._dynamo  # noqa: F401 - makes torch._dynamo.callback_handler an attribute
            import torch._inductor.config  # noqa: F401 - makes torch._inductor.config an attribute

            _WHILE_TRACING = _WhileTracing()
        _SETTINGS[frozen] = _CompileSettings(_WHILE_TRACING, frozen)
    return _SETTINGS[frozen]


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
    (NOTE [freezing per compile]); floats are specialised there too (:func:`compile_settings`).
    """
    return compile_settings(True) if enabled else contextlib.nullcontext()

"""The settings Dynamo and Inductor compile an aitune-compiled callable with: Inductor ``freezing`` for every
compile that starts inside a call of a frozen callable (NOTE [freezing per compile]), floats specialised for every
compile that starts inside a call of a prefill graph's callable (NOTE [floats as torch traces them]); every other
setting is torch's.

Used by the Inductor JIT and TorchAO backends (:mod:`aitune.torch.backend.inductor_jit`,
:mod:`aitune.torch.backend.ao`).
"""

from __future__ import annotations

import contextlib
import threading


# NOTE [floats as torch traces them]: with ``specialize_float`` off (torch's default) Dynamo makes a module's float
# attributes (an RMSNorm's ``variance_epsilon``, attention's ``scaling``) graph inputs, and under ``dynamic=True`` a
# decoder's prefill trace restarts once ("Restarting analysis due to ... _tensorify_python_scalars" with
# ``TORCH_LOGS=dynamo``): Inductor cannot turn those floats into tensors, and the second trace takes them as constants
# after all. On the H200 a Qwen2-0.5B-sized decoder's prefill builds took 58.0 s specialised against 118.3 s with the
# restart (a first tune at batch 8, benchmarks/RESULTS.md); on this project's CPU the tiny test decoder compiled
# directly (``model.model`` on a ``StaticCache``) restarts the same way: 9.1 s against 6.5 s specialised (one scratch
# run each; called with generate's arguments it does not restart there). So every compile of a *prefill* graph's
# callable (its build and any recompile at serve time alike: the setting is the same in every compile of it)
# specialises floats: the trace is taken once, with those attributes as the constants the restart would have made
# them. Every other graph compiles with torch's setting. Specialising only a build's warm-up compiles and leaving a
# later recompile to torch's setting made the decode graph's first serve-time recompile (a cache of another length)
# crash the process on CUDA (torch 2.11) inside Triton's launcher (a segmentation fault; with the static launcher off:
# "Pointer argument must be either uint64 or have data_ptr method"): tests/gpu/test_llm_generation_gpu.py. A prefill
# graph's float attribute that changes between calls is a new constant each time: one recompile per value, up to
# Dynamo's recompile limit (NOTE [recompile limit] in aitune/torch/backend/inductor_jit.py), after which torch runs
# that forward uncompiled (values right, slower).


class _WhileTracing:
    """One compile setting on for every compile that starts inside a call of a callable built with it
    (re-entrant): Inductor ``freezing`` for a frozen one, Dynamo ``specialize_float`` for a prefill graph's.

    Args:
        config: ``"inductor"`` (``torch._inductor.config``) or ``"dynamo"`` (``torch._dynamo.config``).
        setting: the config attribute set to True (``"freezing"``, ``"specialize_float"``).

    NOTE [freezing per compile]: the settings are read only while Dynamo traces and Inductor compiles. A call marks
    its thread (a thread-local depth: under 1 µs per call), and Dynamo's compile-start callback
    (``torch._dynamo.callback_handler``, run in the compiling thread before it traces) sets the setting for a
    Dynamo compile that starts in a thread inside such a call; the end callback restores it, and so does the
    call's exit if the end callback ran in another thread (Dynamo runs the callbacks when a process-wide count of
    compiles in progress, CUDA-graph recordings and lazy backward compiles included, leaves and returns to zero).
    Setting and restoring ``freezing`` around every call instead cost ~9 µs of host time per call (the config
    module's attribute lookups; this project's CPU). A recompile that starts while another thread compiles a
    backward or records a CUDA graph gets no start callback and compiles without the setting: for freezing
    slower, not wrong; for floats a restarted trace. Where the config is shared by all threads (older torch; torch
    2.13 keeps it per thread), a compile by another thread between such a compile's end and the call's end sees
    the setting. The callbacks are registered again by the first call after ``torch._dynamo.reset()``, which
    clears them. Where they are missing (another torch), the setting is made and restored around the call."""

    def __init__(self, config: str, setting: str) -> None:
        import torch._dynamo.config  # noqa: F401 - makes torch._dynamo.config an attribute
        import torch._inductor.config  # noqa: F401 - makes torch._inductor.config an attribute

        self._config = torch._inductor.config if config == "inductor" else torch._dynamo.config
        self._setting = setting
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
            local.saved.append(getattr(self._config, self._setting))
            setattr(self._config, self._setting, True)

    def __exit__(self, *exc_info) -> None:
        local = self._local
        local.depth -= 1
        if not self._per_compile:
            setattr(self._config, self._setting, local.saved.pop())
        elif local.set and not local.depth:  # the compile's end callback ran elsewhere (or never)
            self._restore(local)

    def _compile_started(self, args=None) -> None:
        local = self._local
        trigger = getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO")
        if local.depth and not local.set and trigger == "DYNAMO":  # not a CUDA-graph recording
            local.previous = getattr(self._config, self._setting)
            setattr(self._config, self._setting, True)
            local.set = True

    def _compile_ended(self, args=None) -> None:
        local = self._local
        if local.set:  # only the thread that set it
            self._restore(local)

    def _restore(self, local) -> None:
        setattr(self._config, self._setting, local.previous)
        local.set = False


class _Depth(threading.local):
    """Per thread: how many frozen calls are running; whether a compile-start callback set the flag, and what
    it was before; the values to restore where the flag is set around each call."""

    depth = 0
    set = False
    previous = False

    def __init__(self) -> None:
        self.saved: list = []


_WHILE_TRACING: dict[str, _WhileTracing] = {}


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
    return _while_tracing("inductor", "freezing") if enabled else contextlib.nullcontext()


def floats_specialised(enabled: bool):
    """A context in which every compile that starts takes float attributes as constants (Dynamo's
    ``specialize_float``; a no-op context when not ``enabled``): every call of a prefill graph's compiled callable
    runs in it (NOTE [floats as torch traces them])."""
    return _while_tracing("dynamo", "specialize_float") if enabled else contextlib.nullcontext()


def compile_settings(freezing: bool, specialise_floats: bool):
    """The context every call of a compiled callable runs in: :func:`parameter_freezing` and/or
    :func:`floats_specialised`, one context object either way (no per-call cost for a setting not asked for)."""
    if freezing and specialise_floats:
        return _Both(parameter_freezing(True), floats_specialised(True))
    return parameter_freezing(True) if freezing else floats_specialised(specialise_floats)


class _Both:
    __slots__ = ("first", "second")

    def __init__(self, first, second) -> None:
        self.first, self.second = first, second

    def __enter__(self) -> None:
        self.first.__enter__()
        try:
            self.second.__enter__()
        except BaseException:
            self.first.__exit__(None, None, None)
            raise

    def __exit__(self, *exc_info) -> None:
        try:
            self.second.__exit__(*exc_info)
        finally:
            self.first.__exit__(*exc_info)


def _while_tracing(config: str, setting: str) -> _WhileTracing:
    found = _WHILE_TRACING.get(setting)
    if found is None:
        found = _WHILE_TRACING[setting] = _WhileTracing(config, setting)
    return found

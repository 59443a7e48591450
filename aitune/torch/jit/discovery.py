"""Finding the modules a run calls: global module hooks spot top-level calls; a failed module's children are
tracked by :meth:`PatchedModule.descend`.

NOTE [discovery by global hooks]: a forward pre-hook and an always-called forward hook registered with
``torch.nn.modules.module.register_module_forward_pre_hook`` / ``register_module_forward_hook`` count the
module calls in progress on each thread. A call made while none is in progress (and outside aitune's own
work) is a *top-level* call: its module is looked at once (:func:`track`), patched when it may be tuned,
and its later calls are routed to its :class:`PatchedModule`; the discovering call itself runs eager,
unrecorded. Both hooks return at once under ``torch.compiler.is_compiling()``, so compiled graphs trace
nothing of them. Cost while enabled: two Python calls per module call (about a microsecond each); the
hooks are removed by :func:`aitune.torch.jit.disable`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import warnings
from typing import Any, Callable, Iterator

import torch
import wrapt

from aitune.torch.jit import inspection, patching, state
from aitune.torch.jit.config import JITMode, jit_config
from aitune.torch.jit.patched_module import JitState, PatchedModule, track
from aitune.torch.record.locate import MODULE, walk
from aitune.torch.check.baked_state import OWN_HOOK_IDS

logger = logging.getLogger(__name__)

_hooks: list = []
_global = {"enabled": False}  # tuning enabled for every module of the process (import / env / enable())
_construction = {"depth": 0, "init": None}
_construction_lock = threading.Lock()
_discovery_lock = threading.Lock()
# torch.compile warns that global hooks fire for OptimizedModule; ours ignore it (built-in exclusion).
_COMPILE_HOOK_WARNING = r"Using `torch.compile\(module\)` when there are global hooks"


def hooks_installed() -> bool:
    return bool(_hooks)


def globally_enabled() -> bool:
    return _global["enabled"]


def install(global_enable: bool) -> None:
    """Register the discovery hooks (once); ``global_enable``: every top-level module is a candidate."""
    if global_enable:
        _global["enabled"] = True
    if _hooks:
        return
    _hooks.append(torch.nn.modules.module.register_module_forward_pre_hook(_pre_hook))
    _hooks.append(torch.nn.modules.module.register_module_forward_hook(_post_hook, always_call=True))
    OWN_HOOK_IDS.update(handle.id for handle in _hooks)  # a tuned module's watch ignores these
    warnings.filterwarnings("ignore", message=_COMPILE_HOOK_WARNING, category=UserWarning)


def uninstall() -> None:
    """Remove the hooks and every patch; forget every module."""
    for handle in _hooks:
        handle.remove()
        OWN_HOOK_IDS.discard(handle.id)
    _hooks.clear()
    _global["enabled"] = False
    warnings.filters[:] = [entry for entry in warnings.filters
                           if not (entry[0] == "ignore" and entry[1] is not None
                                   and entry[1].pattern == _COMPILE_HOOK_WARNING)]
    getattr(warnings, "_filters_mutated", lambda: None)()  # what filterwarnings() does after a change
    for node in list(state.seen.values()):
        node.release()
    state.clear()
    state.thread.depth = 0


def _pre_hook(module: torch.nn.Module, args: Any) -> None:
    if torch.compiler.is_compiling():
        return None
    thread = state.thread
    depth = thread.depth
    thread.depth = depth + 1
    if (depth == 0 and not thread.active and not thread.suspended and module not in state.seen
            and module not in state.ignored):
        try:
            node = _discover(module)
            if isinstance(node, inspection.InspectModule):
                inspection.begin_discovering_call(module, node, args)
        except Exception:  # noqa: BLE001 - discovery never breaks the user's call
            logger.warning("aitune jit: looking at %s failed; it is left alone", type(module).__qualname__,
                           exc_info=True)
    return None


def _post_hook(module: torch.nn.Module, args: Any, output: Any) -> None:
    if torch.compiler.is_compiling():
        return None
    thread = state.thread
    if thread.depth:
        thread.depth -= 1
        if thread.depth == 0:  # a top-level call ends: the discovering call of an inspected module?
            try:
                inspection.end_discovering_call(module, output)
            except Exception:  # noqa: BLE001 - inspection never breaks the user's call
                logger.warning("aitune jit: timing %s failed", type(module).__qualname__, exc_info=True)
    return None


def _discover(module: torch.nn.Module) -> "PatchedModule | inspection.InspectModule | None":
    if not _global["enabled"] and module not in state.candidates:
        state.ignored.add(module)
        return None
    with _discovery_lock:  # two threads making the same first call track it once
        if module in state.seen:
            return None
        name = state.unique_name(patching.original_class(module).__qualname__)
        if jit_config.mode is JITMode.INSPECT:
            node = inspection.track(module, name)
        else:
            node = track(module, name, level=0)
    if isinstance(node, inspection.InspectModule):
        logger.info("aitune jit: inspecting top-level module %s (%s) and %d module(s) below it", node.name,
                    node.state.value + (f": {node.reason}" if node.reason else ""), _count_below(node))
        return node
    if node.state is JitState.RECORDING:
        node.calls += 1  # this discovering call, which runs eager and unrecorded
    logger.info("aitune jit: discovered top-level module %s (%s)", node.name,
                node.state.value + (f": {node.reason}" if node.reason else ""))
    return node


def _count_below(node) -> int:
    return sum(1 + _count_below(child) for child in node.children)


# ---- candidates (decorator / context manager)
@contextlib.contextmanager
def prepare_for_jit_tuning() -> Iterator[None]:
    """Modules constructed inside this block become candidates for just-in-time tuning.

    Discovery starts (the hooks are installed) and stays on until :func:`aitune.torch.jit.disable`; when
    tuning was not enabled for the whole process, only candidates are tuned. ``torch.nn.Module.__init__`` is
    wrapped while the block runs (any thread constructing modules then adds candidates) and restored after.
    Modules that are not constructed (``torch.load`` of a whole model) are not seen: decorate the function
    that returns them with :func:`patch_for_jit_tuning` instead, which also walks its return value.
    """
    install(global_enable=False)
    with _construction_lock:
        if _construction["depth"] == 0:
            original = torch.nn.Module.__init__
            _construction["init"] = original

            @functools.wraps(original)
            def __init__(self, *args, **kwargs):
                original(self, *args, **kwargs)
                state.candidates.add(self)

            torch.nn.Module.__init__ = __init__
        _construction["depth"] += 1
    try:
        yield
    finally:
        with _construction_lock:
            _construction["depth"] -= 1
            if _construction["depth"] == 0:
                torch.nn.Module.__init__ = _construction["init"]
                _construction["init"] = None


def add_candidates(obj: Any) -> None:
    """The modules ``obj`` holds (a model, a pipeline object, a tuple or dict of them; see
    :mod:`aitune.torch.record.locate`) become candidates. Modules are not walked into: their top-level calls are
    what discovery sees."""
    for node in walk(obj, 4, follow=lambda step: step.kind != MODULE):
        value = node.value.__wrapped__ if isinstance(node.value, wrapt.ObjectProxy) else node.value
        if isinstance(value, torch.nn.Module):
            state.candidates.add(value)
            state.ignored.discard(value)


def patch_for_jit_tuning(function: Callable | None = None):
    """Decorate the function that builds the model: what it constructs or returns is tuned just in time.

    Usage: ``@patch_for_jit_tuning`` (or ``@patch_for_jit_tuning()``) on ``def build(): ... return model``.
    The function's code and result are unchanged; see :func:`prepare_for_jit_tuning`.
    """
    if function is None:
        return patch_for_jit_tuning

    @functools.wraps(function)
    def build(*args, **kwargs):
        with prepare_for_jit_tuning():
            result = function(*args, **kwargs)
        add_candidates(result)
        return result

    return build

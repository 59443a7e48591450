"""Switching just-in-time tuning on and off, tuning on request, and what happens at interpreter exit."""

from __future__ import annotations

import atexit
import importlib
import logging
import os

from aitune.errors import ConfigError
from aitune.torch.jit import discovery, inspection, state
from aitune.torch.jit.config import JITMode, jit_config
from aitune.torch.jit.hierarchy import patched_modules, render
from aitune.torch.jit.patched_module import JitState, PatchedModule

logger = logging.getLogger(__name__)

SETUP_VARIABLE = "AITUNE_JIT_SETUP"
MODE_VARIABLE = "AITUNE_JIT_MODE"
_exit_registered = {"done": False}
# What enable_inspection() sets (the reference's inspect mode: deeper than tuning, weightless modules too).
INSPECTION_SETTINGS = {"mode": JITMode.INSPECT, "max_depth_level": 7, "min_parameters": 0}


def enable(**settings) -> None:
    """Tune, just in time, the top-level modules this process calls (idempotent).

    Settings come, in this order, from ``$AITUNE_JIT_MODE`` (``tune_eager`` / ``tune_deferred`` / ``inspect``:
    see :func:`enable_inspection`, which also sets the depth),
    ``$AITUNE_JIT_SETUP`` (``"package.module:function"``, called with :data:`jit_config` — the way to
    configure a run whose code you do not change) and ``settings`` (names of :class:`JitConfig` fields).

    Raises:
        ConfigError: an unknown setting or a bad value (also from the environment variables).
    """
    before = {name: getattr(jit_config, name) for name in INSPECTION_SETTINGS}
    apply_environment()
    jit_config.update(**settings)
    if jit_config.mode is JITMode.INSPECT:
        inspection.begin(before)  # also when inspect mode comes from $AITUNE_JIT_MODE or a setting
    was_enabled = discovery.globally_enabled()
    discovery.install(global_enable=True)
    _register_exit()
    if not was_enabled and jit_config.mode is JITMode.INSPECT:
        logger.info("aitune jit: inspection enabled (max_depth_level=%d, min_parameters=%d)",
                    jit_config.max_depth_level, jit_config.min_parameters)
    elif not was_enabled:
        logger.info("aitune jit: enabled (mode %s, min_samples=%d%s)", jit_config.mode.value,
                    jit_config.min_samples, ", an input axis must vary" if jit_config.batch_axis_required else "")


def enable_inspection(**settings) -> None:
    """Inspect, instead of tune: every top-level module this process calls and its children are timed and
    described (:mod:`aitune.torch.jit.inspection`); nothing is tuned (idempotent).

    Sets ``mode="inspect"``, ``max_depth_level=7`` and ``min_parameters=0`` (the reference's inspect mode
    looks deeper than tuning does, at weightless modules too); ``settings`` (names of :class:`JitConfig`
    fields) override them. :func:`disable` puts those three settings back as they were.

    Raises:
        ConfigError: an unknown setting or a bad value.
    """
    if any(isinstance(node, PatchedModule) for node in list(state.seen.values())):
        logger.warning("aitune jit: inspection starts while modules are tracked for tuning: those stay as they "
                       "are (call aitune.torch.jit.disable() first to inspect them)")
    before = {name: getattr(jit_config, name) for name in INSPECTION_SETTINGS}
    running = inspection.is_running()
    try:
        enable(**{**INSPECTION_SETTINGS, **settings})
    except Exception:
        if not running:
            inspection.end()
            jit_config.update(**before)
        raise


def disable() -> None:
    """Stop just-in-time tuning (or inspection): remove the hooks, give every patched module its own class
    back, release the tuned backends and forget every module. Weights and ``training`` flags were never
    changed. Inspection records stay for ``save_report`` (see :mod:`aitune.torch.jit.inspection`), and the
    settings :func:`enable_inspection` changed are put back."""
    discovery.uninstall()
    previous = inspection.end()
    if previous is not None and jit_config.mode is JITMode.INSPECT:
        jit_config.update(**previous)


def is_enabled() -> bool:
    """True while discovery runs (after :func:`enable`, or after a decorated builder ran)."""
    return discovery.hooks_installed()


def reset() -> None:
    """:func:`disable`, then every :data:`jit_config` setting back to its default and inspection records
    forgotten (the reference's ``jit_reset``)."""
    disable()
    inspection.clear()
    jit_config.reset_to_defaults()


def tune_now() -> list:
    """Tune, now and in this thread, every discovered module that has recorded calls, top down: a module that
    cannot be tuned has its children tried (they record its replayed samples), down to
    ``jit_config.max_depth_level``. The thresholds (``min_samples``, a varying axis) do not apply: you chose
    the moment. This is how deferred mode tunes; in eager mode it tunes what is still waiting.

    Returns:
        The :class:`~aitune.torch.jit.patched_module.PatchedModule` objects tuned by this call.
    """
    before = {id(node) for node in patched_modules() if node.state is JitState.TUNED}
    with state.lock:
        for node in patched_modules():
            if node.level == 0:
                node.tune_pending(force=True)
    return [node for node in patched_modules() if node.state is JitState.TUNED and id(node) not in before]


def apply_environment() -> None:
    """Read ``$AITUNE_JIT_MODE`` and run ``$AITUNE_JIT_SETUP`` (see :func:`enable`)."""
    mode = os.environ.get(MODE_VARIABLE)
    if mode:
        jit_config.mode = mode
    setup = os.environ.get(SETUP_VARIABLE)
    if setup:
        module_name, _, function_name = setup.partition(":")
        try:
            function = getattr(importlib.import_module(module_name), function_name or "configure")
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"${SETUP_VARIABLE}={setup!r}: cannot import it ({exc}); give "
                              "'package.module:function', a function taking aitune.torch.jit.jit_config") from exc
        function(jit_config)


def _register_exit() -> None:
    if not _exit_registered["done"]:
        _exit_registered["done"] = True
        atexit.register(_at_exit)


def _at_exit() -> None:
    """Deferred mode: tune what is pending (``tune_at_exit``); then log the hierarchy and what never got tuned."""
    if not discovery.hooks_installed() or jit_config.mode is JITMode.INSPECT:
        return  # inspection writes its report at exit itself
    nodes = patched_modules()
    if jit_config.mode is JITMode.TUNE_DEFERRED and jit_config.tune_at_exit and any(
            node.state is JitState.RECORDING and node.recorded_calls for node in nodes):
        logger.info("aitune jit: tuning the modules still pending at exit (deferred mode, jit_config.tune_at_exit)")
        try:
            tune_now()
        except Exception:  # noqa: BLE001 - exit must go on
            logger.warning("aitune jit: tuning at exit failed", exc_info=True)
    if not nodes:
        logger.info("aitune jit: enabled, but no top-level module was called in this process")
        return
    for node in nodes:
        if node.state is JitState.RECORDING and node.level == 0:
            logger.warning("aitune jit: %s was never tuned: waiting for %s", node.name, node.waiting_for())
    logger.info("aitune jit: modules at exit\n%s", render())

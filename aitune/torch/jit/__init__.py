"""Just-in-time tuning: tune the modules a run calls, with no change to its code.

Switch it on in one of three ways:

* ``AUTOWRAPT_BOOTSTRAP=aitune_enable_jit_tuning python your_script.py`` (needs ``pip install 'aitune[jit]'``:
  the ``autowrapt`` package enables it as soon as ``torch`` is imported);
* ``import aitune.torch.jit.enable`` at the top of the script (or :func:`enable`);
* ``@patch_for_jit_tuning`` on the function that builds the model (only what it builds is tuned).

Discovered modules record their calls (outputs stay eager's) and are tuned once they have seen
``jit_config.min_samples`` calls with a varying input axis — inside the call that made them ready (the
run pauses) or, in deferred mode, when :func:`tune_now` is called. A module that cannot be tuned runs
eager and its children are tried, top down. :func:`describe` shows what happened; :func:`disable` puts
everything back. See the README section "Tuning without code changes".
"""

from aitune.torch.jit.config import JitConfig, JITMode, jit_config
from aitune.torch.jit.discovery import patch_for_jit_tuning, prepare_for_jit_tuning
from aitune.torch.jit.hierarchy import describe, hierarchy, patched_modules
from aitune.torch.jit.patched_module import JitState, PatchedModule
from aitune.torch.jit.runtime import disable, enable, is_enabled, reset, tune_now
from aitune.torch.jit import tune  # noqa: E402 - tune.deferred(), the reference's deferred-mode call

__all__ = [
    "JITMode",
    "JitConfig",
    "JitState",
    "PatchedModule",
    "describe",
    "disable",
    "enable",
    "hierarchy",
    "is_enabled",
    "jit_config",
    "patch_for_jit_tuning",
    "patched_modules",
    "prepare_for_jit_tuning",
    "reset",
    "tune",
    "tune_now",
]

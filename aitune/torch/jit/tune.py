"""``aitune.torch.jit.tune.deferred()``: the reference system's call that tunes in deferred mode.

The reference sets a flag and tunes inside the next forward call; aitune tunes at once, in the calling
thread (:func:`aitune.torch.jit.tune_now`), so the next call already runs the tuned module.
"""

from __future__ import annotations

from aitune.errors import ConfigError
from aitune.torch.jit.config import JITMode, jit_config
from aitune.torch.jit.runtime import tune_now


def deferred() -> list:
    """Tune every discovered module that has recorded calls (deferred mode).

    Returns:
        The patched modules tuned by this call.

    Raises:
        ConfigError: when ``jit_config.mode`` is not ``tune_deferred`` (as the reference requires).
    """
    if jit_config.mode is not JITMode.TUNE_DEFERRED:
        raise ConfigError(f"jit.tune.deferred() needs jit_config.mode = 'tune_deferred' (it is "
                          f"{jit_config.mode.value!r}); in eager mode modules tune by themselves, or call "
                          "aitune.torch.jit.tune_now()")
    return tune_now()

"""The ``autowrapt`` entry point of just-in-time tuning: ``AUTOWRAPT_BOOTSTRAP=aitune_enable_jit_tuning``.

NOTE [lazy bootstrap]: wrapt loads every entry point of the group while the interpreter starts (before the
script runs), so the module named by the entry point must be cheap to import: this one imports nothing.
wrapt registers :func:`wrapt_auto_enable` as a post-import hook of ``torch`` (the entry point's name), so
aitune is imported, and tuning enabled, only once the script imports torch. It lives outside
``aitune.torch`` because importing anything below that package imports torch and all of aitune.
Child processes inherit the variable: those that import torch enable tuning too.
"""


def wrapt_auto_enable(module=None) -> None:
    """Called by wrapt right after ``torch`` is imported (``module`` is torch)."""
    from aitune.torch.jit.runtime import enable  # deferred on purpose: NOTE [lazy bootstrap]

    enable()

"""What just-in-time tuning found and did: the patched-module hierarchy, as data and as a table."""

from __future__ import annotations

import logging

from aitune.torch.jit import inspection, state
from aitune.torch.jit.config import JITMode, jit_config
from aitune.torch.jit.patched_module import JitState, PatchedModule

logger = logging.getLogger(__name__)


def patched_modules() -> list[PatchedModule]:
    """Every module discovery looked at for tuning, top-level ones in discovery order, each followed by the
    children tried below it (depth first). Modules the user dropped are gone; inspected modules are
    :func:`aitune.torch.jit.inspection.modules`."""
    ordered: list[PatchedModule] = []

    def visit(node: PatchedModule) -> None:
        ordered.append(node)
        for child in node.children:
            visit(child)

    for node in list(state.seen.values()):
        if isinstance(node, PatchedModule) and node.level == 0:
            visit(node)
    return ordered


def hierarchy() -> list[dict]:
    """JSON-able tree: one dict per top-level module (``PatchedModule.to_dict()``, children nested)."""
    return [node.to_dict() for node in patched_modules() if node.level == 0]


def describe() -> str:
    """A table of the hierarchy: per module its level (indentation), class, parameters, state, calls, and
    the chosen backends or the reason it runs eager or was skipped (in inspect mode: the inspected modules'
    states, calls and times). Also logged at INFO."""
    text = render()
    logger.info("%s", text)
    return text


def render() -> str:
    """:func:`describe`'s text, not logged."""
    from tabulate import tabulate

    if jit_config.mode is JITMode.INSPECT:
        return inspection.render()

    rows = []
    for node in patched_modules():
        calls = "" if node.state is JitState.SKIPPED else node.calls  # skipped modules are not routed
        recorded = node.recorded_calls if node.wrapper is not None else ""
        rows.append(["  " * node.level + node.name, node.class_name.rsplit(".", 1)[-1], _count(node.num_parameters),
                     node.state.value, calls, recorded, sum(node.eager_calls.values()) or "", _detail(node)])
    settings = (f"mode {jit_config.mode.value}, min_samples={jit_config.min_samples}, "
                f"batch_axis_required={jit_config.batch_axis_required}, "
                f"max_depth_level={jit_config.max_depth_level}")
    if not rows:
        text = f"aitune just-in-time tuning ({settings}): no module discovered yet"
    else:
        table = tabulate(rows, headers=["module", "class", "params", "state", "calls", "recorded",
                                        "eager (not recordable)", "backend / reason"], tablefmt="github")
        text = f"aitune just-in-time tuning ({settings})\n{table}"
    return text


def _detail(node: PatchedModule) -> str:
    if node.state is JitState.TUNED:
        text = ", ".join(f"{graph}: {backend}" for graph, backend in node.backends.items())
        if node.tuning_s is not None:
            text += f" (tuned in {node.tuning_s:.1f} s)"
    elif node.state is JitState.RECORDING:
        waiting = node.waiting_for()
        text = f"waiting for {waiting}" if waiting else "ready"
    else:
        text = node.reason
    if node.eager_calls:
        text += " [eager: " + ", ".join(f"{count} x {why}" for why, count in node.eager_calls.items()) + "]"
    if node.note:
        text += f" [{node.note}]"
    return text


def _count(value: int) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.1f}{suffix}"
    return str(value)

"""Inspect mode's session and tracking: the one inspection of this process (its top-level modules), and
tracking a discovered module with its children, each routed to its :class:`InspectModule`."""

from __future__ import annotations

from typing import Any

import torch

from aitune.torch.jit import patching, state
from aitune.torch.jit.config import jit_config
from aitune.torch.jit.inspection_records import TIMED, InspectModule
from aitune.torch.jit.patched_module import child_modules, exclusion


class _Session:
    """The one inspection of this process: its top-level records, when and where it started, whether saved."""

    def __init__(self):
        self.roots: list[InspectModule] = []
        self.started_at: str | None = None
        self.report_dir: str | None = None
        self.saved_path: str | None = None
        self.previous_settings: dict | None = None
        self.exit_registered = False


session = _Session()


def is_running() -> bool:
    return session.previous_settings is not None


def modules() -> list[InspectModule]:
    """Every tracked module: top-level ones in discovery order, each followed by its subtree (depth first)."""
    ordered: list[InspectModule] = []

    def visit(node: InspectModule) -> None:
        ordered.append(node)
        for child in node.children:
            visit(child)

    for root in list(session.roots):
        visit(root)
    return ordered


def _route(module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    node = state.seen.get(module)
    if isinstance(node, InspectModule) and node.state in TIMED:
        return node.call(module, args, kwargs)
    return patching.original_class(module).__call__(module, *args, **kwargs)


def track(module: torch.nn.Module, name: str) -> InspectModule:
    """Track a discovered top-level module and, top down, its children (caller holds discovery's lock)."""
    return _track(module, name, "", 0, None)


def _track(module: torch.nn.Module, name: str, path: str, level: int, parent: InspectModule | None) -> InspectModule:
    node = InspectModule(module, name, path, level, parent)
    state.seen[module] = node
    (parent.children if parent is not None else session.roots).append(node)
    excluded = exclusion(module, name, node.num_parameters)
    if excluded is not None:
        reason, children_tried = excluded
        node.skip(reason.replace("children are tried", "children are inspected"))
        if children_tried:
            _track_children(node, module)
        return node
    try:
        patching.patch(module, _route)
    except TypeError as exc:  # a class Python will not let us swap
        node.skip(f"its calls cannot be routed ({exc}): its children are inspected")
    _track_children(node, module)
    return node


def _track_children(node: InspectModule, module: torch.nn.Module) -> None:
    children = list(child_modules(module))
    if children and node.level + 1 >= jit_config.max_depth_level:
        node.note = (f"{len(children)} child module(s) not inspected "
                     f"(jit_config.max_depth_level={jit_config.max_depth_level})")
        return
    elsewhere = []
    for path, child in children:
        existing = state.seen.get(child)
        if existing is None:
            _track(child, f"{node.name}.{path}", path, node.level + 1, node)
        elif isinstance(existing, InspectModule) and existing.parent is None and existing in session.roots:
            _adopt(existing, node, path)  # called on its own first, now found as the child it is
        else:
            elsewhere.append(f"{path} (tracked already as {existing.name})")
    if elsewhere:
        node.note = "not repeated here: " + ", ".join(elsewhere)


def _adopt(node: InspectModule, parent: InspectModule, path: str) -> None:
    session.roots.remove(node)
    node.parent, node.path = parent, path
    parent.children.append(node)

    def place(item: InspectModule, name: str, level: int) -> None:
        item.name, item.level = name, level
        for child in item.children:
            place(child, f"{name}.{child.path}", level + 1)

    place(node, f"{parent.name}.{path}", parent.level + 1)


# ============================================================================================ session

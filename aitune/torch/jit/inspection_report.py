"""Inspect mode's report: the records as JSON-able data, a text table, and the "Model Inspector" HTML page."""

from __future__ import annotations

import datetime
import logging
import os
import time
from pathlib import Path

from aitune.torch.jit.config import jit_config
from aitune.torch.jit.inspection_records import InspectModule, record_lock
from aitune.torch.jit.inspection_tracking import is_running, modules, session
from aitune.torch.common.environment import environment
from aitune.torch.report.html import render_jit_inspection

logger = logging.getLogger(__name__)


REPORT_PREFIX = "jit_inspect_"


def _timed_total_s() -> float:
    """Time in the top-most timed calls: the roots', or their timed children's where a root was skipped, s."""
    total = 0.0

    def visit(node: InspectModule) -> None:
        nonlocal total
        if node.calls:
            total += node.total_s
        else:
            for child in node.children:
                visit(child)

    for root in session.roots:
        visit(root)
    return total


def to_dict(model_name: str | None = None) -> dict:
    """The inspection as JSON-able data (what the report page shows).

    Returns:
        ``{"model_name", "started_at", "created_at", "running", "total_s" (s in the top-most timed calls),
        "overhead_s" (bookkeeping of inspected calls made inside others, s), "settings", "modules" (one
        :meth:`InspectModule.to_dict` tree per top-level module), "environment"}``.
    """
    nodes = modules()
    with record_lock:
        trees = [root.to_dict() for root in session.roots]
    return {"model_name": model_name or ", ".join(root.name for root in session.roots) or "model",
            "started_at": session.started_at, "created_at": now(), "running": is_running(),
            "total_s": _timed_total_s(), "overhead_s": sum(node.inner_overhead_s for node in nodes),
            "settings": {name: jit_config.to_dict()[name] for name in
                         ("mode", "max_depth_level", "min_parameters", "skip_modules", "patch_exclude")},
            "modules": trees, "environment": environment()}


def render() -> str:
    """A text table of the tracked modules (what ``aitune.torch.jit.describe()`` shows in inspect mode)."""
    from tabulate import tabulate

    total = _timed_total_s()
    rows = [["  " * node.level + node.name, node.class_name.rsplit(".", 1)[-1], node.state.value, node.calls,
             f"{node.self_s * 1e3:.3f}", f"{node.total_s * 1e3:.3f}",
             f"{100 * node.self_s / total:.1f}" if total else "", node.num_parameters, node.reason or node.note]
            for node in modules()]
    if not rows:
        return "aitune jit inspection: no module discovered yet"
    table = tabulate(rows, headers=["module", "class", "state", "calls", "self ms", "total ms", "% self", "params",
                                    "reason / note"], tablefmt="github")
    return f"aitune jit inspection ({total * 1e3:.3f} ms in the top-level calls)\n{table}"


def describe() -> str:
    """:func:`render`'s table, also logged at INFO."""
    text = render()
    logger.info("%s", text)
    return text


def save_report(path: str | os.PathLike | None = None, model_name: str | None = None) -> Path:
    """Write the "Model Inspector" page: one self-contained HTML file (NOTE [self-contained pages] in
    :mod:`aitune.torch.report.html`): summary, a figure of the modules' time shares (with matplotlib), the
    collapsible module tree, and every module's times, calls, parameters, input/output types and batch axes.

    Args:
        path: the file to write (folders are created); an existing folder (or None) gets
            ``jit_inspect_<YYYYmmdd-HHMMSS>.html`` inside (None: ``jit_config.inspection_dir``, else the working
            directory of the moment inspection was enabled).
        model_name: the page's title (default: the top-level modules' names).

    Returns:
        The path written. Saving once means nothing is written at exit.

    Raises:
        OSError: the file cannot be written.
    """
    target = _report_path(path)
    page = render_jit_inspection(to_dict(model_name))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(page, encoding="utf-8")
    session.saved_path = str(target)
    logger.info("aitune jit: inspection report written to %s", target)
    return target


def _report_path(path: str | os.PathLike | None) -> Path:
    if path is not None and not Path(path).is_dir():
        return Path(path)
    folder = Path(path if path is not None else jit_config.inspection_dir or session.report_dir or os.getcwd())
    target = folder / f"{REPORT_PREFIX}{time.strftime('%Y%m%d-%H%M%S')}.html"
    if target.exists():
        target = target.with_name(f"{target.stem}-{os.getpid()}.html")
    return target


def now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")

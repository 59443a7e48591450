"""Inspect mode of just-in-time tuning: time and describe every module a run calls; tune nothing.

Switched on by ``import aitune.torch.jit.enable_inspection as inspection`` (or calling it with settings);
``inspection.save_report(path, model_name)`` writes the "Model Inspector" page
(:func:`aitune.torch.report.html.render_jit_inspection`), and a run that never saved one writes
``jit_inspect_<timestamp>.html`` at exit. ``aitune.torch.jit.disable()`` puts every class back.

Discovery is the tuning mode's (NOTE [discovery by global hooks]): a top-level call makes aitune look at its
module once. Inspection then tracks that module *and its children at once*, top down through
``ModuleList``/``ModuleDict`` entries, to ``jit_config.max_depth_level`` (7 here: levels 0..6), with the same
exclusion rules (``skip_modules``, ``patch_exclude``, ``min_parameters`` — 0 unless you set it —, the
built-in exclusions). Each tracked module gets the routing class of NOTE [routing by class swap and a twin],
routed to its :class:`InspectModule`, which calls the original ``__call__`` on the same object: outputs,
hooks and autograd are eager's, bit for bit, in training mode too. No twin is needed (nothing is compiled),
so the records keep no reference to your weights and outlive the model.

Per module: calls, total time, self time (total minus the inspected calls made inside it), the largest
call, the distinct input and output type signatures (tensor dtype, shape range, device; other values by
type), the axes that varied in step with the batch size (batch axes; visible once two batch sizes were
seen), parameters and their dtypes, and where it sits in the hierarchy.

NOTE [inspection timing]: ``time.perf_counter`` around the call; when the module's parameters or any input
tensor are on CUDA, ``torch.cuda.synchronize`` first (so the caller's queued kernels stay the caller's time)
and again after (so the module's own kernels are its time). Recording a call's types happens outside that
window and reads no tensor value (shapes, dtypes and devices only: a value read would wait for the device
there, and the caller's queued kernels would count as bookkeeping); self times leave this bookkeeping out,
total times include that of the modules inside (the report states how much it was). The discovering call (a
top-level module's first) is timed by the discovery hooks themselves: it counts, but the hook sees only its
positional arguments — a signature seen only on that call is marked so. Module calls that do not go through
``module(...)`` (``child.forward(x)``, modules held outside the registered children) count as their caller's
self time.

States (the reference's ``InspectModule`` states): ``INIT`` tracked, no call yet; ``INSPECT`` its calls are
timed (the tuning mode's RECORDING, without recording samples); ``SKIPPED`` excluded by a rule, the reason
kept (the tuning mode's SKIPPED); ``DETACHED`` its own class is back after ``disable()``: the records stay
for ``save_report`` until :func:`aitune.torch.jit.reset` or the next ``enable_inspection``.

Modules: :mod:`~aitune.torch.jit.inspection_records` (per-module records and the timing of calls),
:mod:`~aitune.torch.jit.inspection_tracking` (the session and tracking), :mod:`~aitune.torch.jit.inspection_report`
(data, table and page); this module starts and ends an inspection and keeps the public names.
"""

from __future__ import annotations

import atexit
import logging
import os

from aitune.torch.jit.inspection_records import (  # noqa: F401 - re-exported
    MAX_SIGNATURES,
    TIMED,
    InspectModule,
    InspectState,
    TypeSignatures,
    begin_discovering_call,
    end_discovering_call,
    frames,
)
from aitune.torch.jit.inspection_report import (  # noqa: F401 - re-exported
    REPORT_PREFIX,
    describe,
    now,
    render,
    save_report,
    to_dict,
)
from aitune.torch.jit.inspection_tracking import is_running, modules, session, track  # noqa: F401 - re-exported

logger = logging.getLogger(__name__)

__all__ = ["InspectModule", "InspectState", "TypeSignatures", "describe", "modules", "save_report", "to_dict"]


def begin(previous_settings: dict) -> None:
    """Start an inspection (``enable_inspection``): a new one when none is running."""
    if session.previous_settings is not None:
        return  # running already
    if session.roots and session.saved_path is None:
        logger.warning("aitune jit: a new inspection starts: the records of the previous one (%d module(s), never "
                       "saved) are dropped", len(modules()))
    session.roots.clear()
    session.saved_path = None
    session.started_at = now()
    session.report_dir = os.getcwd()
    session.previous_settings = dict(previous_settings)
    if not session.exit_registered:
        session.exit_registered = True
        atexit.register(_at_exit)


def end() -> dict | None:
    """Inspection stops (``disable()``): returns the settings it had replaced (to restore), None if none."""
    previous, session.previous_settings = session.previous_settings, None
    for node in modules():
        if node.state in TIMED:
            node.release()
    frames.stack.clear()
    frames.discovering.clear()
    return previous


def clear() -> None:
    """Forget every record (``reset()``)."""
    end()
    session.roots.clear()
    session.saved_path = None


def _at_exit() -> None:
    """Write the report of an inspection that was never saved."""
    if session.saved_path is not None or not session.roots:
        if is_running() and not session.roots:
            logger.info("aitune jit: inspection was enabled, but no module was called in this process")
        return
    try:
        path = save_report()
    except Exception:  # noqa: BLE001 - exit must go on
        logger.warning("aitune jit: writing the inspection report at exit failed", exc_info=True)
        return
    logger.warning("aitune jit: inspection report (save_report() was never called) written to %s", path)

"""``ait.profile(obj, input_data)``: where inference time goes — tuned modules, other modules, the rest.

Runs ``inference_function(input)`` (or ``obj(input)``) ``warmup_runs`` times, then once more and
``measured_runs`` times under the PyTorch profiler, each measured run inside a ``record_function`` range. Two
kinds of *regions* are timed, as in the reference system:

* ``aot_module:<name>`` — every :class:`~aitune.torch.Module` wrapper called (tuned, recording or passthrough;
  ``wrapper_state`` says which), timed around the wrapper's call;
* ``untuned_module:<path>`` — the ``nn.Module`` children of ``obj`` (its attributes when ``obj`` is a pipeline
  object; ``nn.ModuleList``/``nn.ModuleDict`` are looked through) that hold no wrapper; a child that holds one is
  descended into so its other children get their own regions. Plain ``list``/``dict`` attributes are not
  entered (their modules' time is residual).

Per measured run: wall time (``perf_counter_ns``, CUDA-synchronised), the profiler's CPU and device time of the
run, every region's calls/CPU/device time and fractions, and the *residual* (time outside any region, clamped
at zero). ``profiler.key_averages`` keeps the top 20 operators by CPU and by device total. Nothing is written
unless you write ``profile.data`` or ``profile.markdown()``, or pass ``trace_file`` (Chrome trace).

Difference from the reference: user-defined methods of untuned modules (``vae.decode``) are not instrumented
(calls through ``forward`` are); their time lands in the region of the module whose ``forward`` runs them, or in
the residual.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, record_function

from aitune import __version__
from aitune.errors import ConfigError
from aitune.torch.module import Module, registered_modules

logger = logging.getLogger(__name__)

__all__ = ["PerformanceProfile", "profile"]

SCHEMA_VERSION = 1
TOP_OPERATORS = 20
_RUN = "aitune_run:"


@dataclasses.dataclass
class PerformanceProfile:
    """The result of :func:`profile`: ``data`` (JSON-able dict, schema in the module docstring) and the
    Chrome trace path (None unless ``trace_file`` was given)."""

    data: dict
    trace_file: Path | None = None

    def markdown(self) -> str:
        """Overview, Runs, Regions, Per-Run Attribution, Profiler Key Averages, Warnings (a pure view of ``data``)."""
        from tabulate import tabulate

        data = self.data
        lines = ["# AITune performance profile", "", "## Overview", ""]
        overview = [["created", data["created_at"]], ["aitune version", data["aitune_version"]],
                    ["target", data["target"]["type"]], ["warmup runs", data["config"]["warmup_runs"]],
                    ["measured runs", data["config"]["measured_runs"]],
                    ["inference function", data["config"]["uses_inference_function"]],
                    ["positional args", data["input"]["args_count"]],
                    ["keyword args", ", ".join(data["input"]["kwargs"]) or "-"]]
        lines += [tabulate(overview, headers=["", ""], tablefmt="github"), "", "## Runs", ""]
        lines.append(tabulate([[run["run_index"], _us(run["timing"]["wall_time_us"]), _us(run["timing"]["cpu_time_us"]),
                                _us(run["timing"]["device_time_us"])] for run in data["runs"]],
                              headers=["run", "wall µs", "cpu µs", "device µs"], tablefmt="github"))
        lines += ["", "## Regions", ""]
        lines.append(tabulate([[region["name"], region["kind"], region.get("wrapper_state", "-"), region["module_type"]]
                               for region in data["regions"]], headers=["name", "kind", "state", "module type"],
                              tablefmt="github") if data["regions"] else "_(no regions observed)_")
        lines += ["", "## Per-Run Attribution", ""]
        rows = []
        for run in data["runs"]:
            for region in run["regions"]:
                rows.append([run["run_index"], region["region_id"], region["calls"], _us(region["cpu_time_us"]),
                             _pct(region["cpu_time_fraction"]), _us(region["device_time_us"]),
                             _pct(region["device_time_fraction"])])
            residual = run["residual"]
            rows.append([run["run_index"], "_(residual)_", "", _us(residual["cpu_time_us"]),
                         _pct(residual["cpu_time_fraction"]), _us(residual["device_time_us"]),
                         _pct(residual["device_time_fraction"])])
        lines.append(tabulate(rows, headers=["run", "region", "calls", "cpu µs", "cpu %", "device µs", "device %"],
                              tablefmt="github"))
        lines += ["", "## Profiler Key Averages", ""]
        for sort_key, title in (("cpu_time_total", "by CPU total"), ("device_time_total", "by device total")):
            lines += [f"### {title}", ""]
            lines.append(tabulate([[row["key"], row["device_type"], row["count"], _us(row["cpu_time_total_us"]),
                                    _us(row["self_cpu_time_total_us"]), _us(row["device_time_total_us"])]
                                   for row in data["profiler"]["key_averages"][sort_key]],
                                  headers=["operator", "device", "count", "cpu total µs", "self cpu µs",
                                           "device total µs"], tablefmt="github"))
            lines.append("")
        lines += ["## Warnings", ""]
        lines += [f"- `{w['code']}`: {w['message']}" for w in data["warnings"]] or ["_(none)_"]
        return "\n".join(lines) + "\n"


def _us(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def _pct(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.1f}"


def profile(obj: Any, input_data: Any, *, inference_function: Callable | None = None, warmup_runs: int = 3,
            measured_runs: int = 10, trace_file: str | Path | None = None) -> PerformanceProfile:
    """Profile one representative input through ``obj`` (see the module docstring).

    Args:
        obj: the model or pipeline (its wrappers and modules are the regions); called when no
            ``inference_function`` is given.
        input_data: one input: a mapping → keyword arguments, a tuple → positional arguments, None → no
            arguments, anything else → one positional argument.
        inference_function: what to call instead of ``obj``.
        warmup_runs: unprofiled runs first (>= 0); one more runs inside the profiler, unrecorded.
        measured_runs: recorded runs (>= 1).
        trace_file: write the profiler's Chrome trace there.

    Returns:
        A :class:`PerformanceProfile`.

    Raises:
        ConfigError: bad counts, or nothing callable.
    """
    if not isinstance(warmup_runs, int) or isinstance(warmup_runs, bool) or warmup_runs < 0:
        raise ConfigError(f"warmup_runs must be an int >= 0, got {warmup_runs!r}")
    if not isinstance(measured_runs, int) or isinstance(measured_runs, bool) or measured_runs < 1:
        raise ConfigError(f"measured_runs must be an int >= 1, got {measured_runs!r}")
    function = inference_function or obj
    if not callable(function):
        raise ConfigError("obj is not callable: pass inference_function=...")
    args, kwargs = _split_input(input_data)
    regions = _discover_regions(obj)
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def run_once():
        with torch.no_grad():
            return function(*args, **kwargs)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    walls: list[float] = []
    with _instrumented(regions):
        for _ in range(warmup_runs):
            run_once()
        sync()
        with torch.profiler.profile(activities=activities) as prof:
            with record_function("aitune_warmup"):
                run_once()
            sync()
            for index in range(measured_runs):
                began = time.perf_counter_ns()
                with record_function(f"{_RUN}{index}"):
                    run_once()
                    sync()
                walls.append((time.perf_counter_ns() - began) / 1e3)
    data = _assemble(prof, regions, walls, args, kwargs, obj, inference_function, warmup_runs, measured_runs,
                     activities)
    written = None
    if trace_file is not None:
        written = Path(trace_file).expanduser().resolve()
        written.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(written))
    return PerformanceProfile(data=data, trace_file=written)


def _split_input(input_data: Any) -> tuple[tuple, dict]:
    if input_data is None:
        return (), {}
    if isinstance(input_data, dict):
        return (), dict(input_data)
    if isinstance(input_data, tuple):
        return input_data, {}
    return (input_data,), {}


@dataclasses.dataclass
class _Region:
    id: str
    name: str
    kind: str
    module: Any


def _discover_regions(obj: Any) -> list[_Region]:
    regions: list[_Region] = []
    seen: set[int] = set()

    def holds_wrapper(module: torch.nn.Module) -> bool:
        return any(isinstance(sub, Module) for sub in _submodules(module))

    def visit(name: str, module: Any) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        if isinstance(module, Module):
            regions.append(_Region(f"aot_module:{module.name}", module.name, "aot_managed_module", module))
        elif isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)) or (
                isinstance(module, torch.nn.Module) and holds_wrapper(module)):
            for child_name, child in module.named_children():
                visit(f"{name}.{child_name}" if name else child_name, child)
        elif isinstance(module, torch.nn.Module):
            regions.append(_Region(f"untuned_module:{name}", name, "untuned_module", module))

    if isinstance(obj, torch.nn.Module):
        if isinstance(obj, Module):
            visit("", obj)
        else:
            seen.add(id(obj))
            for child_name, child in obj.named_children():
                visit(child_name, child)
    else:
        for attribute, value in vars(obj).items() if hasattr(obj, "__dict__") else ():
            if isinstance(value, torch.nn.Module) and not attribute.startswith("__"):
                visit(attribute, value)
    return regions


def _submodules(module: torch.nn.Module):
    stack = list(module.children())
    while stack:
        current = stack.pop()
        yield current
        if not isinstance(current, Module):
            stack.extend(current.children())


class _instrumented:
    """Forward hooks on untuned regions and a patched ``Module.__call__`` for wrappers, removed on exit.

    NOTE [profiling wrappers]: a tuned wrapper's call never reaches its module's ``forward`` (a backend runs),
    so hooks cannot time it; ``Module.__call__`` is wrapped for the duration of the profile instead (every
    wrapper of the process gets its region then; calls from other threads meanwhile are annotated too).
    """

    def __init__(self, regions: list[_Region]):
        self.regions = regions
        self.handles: list = []
        self.original_call = None

    def __enter__(self):
        for region in self.regions:
            if region.kind != "untuned_module":
                continue
            ranges: list = []

            def pre(module, args, region_id=region.id, ranges=ranges):
                ranges.append(record_function(region_id))
                ranges[-1].__enter__()

            def post(module, args, output, ranges=ranges):
                if ranges:
                    ranges.pop().__exit__(None, None, None)

            self.handles.append(region.module.register_forward_pre_hook(pre))
            self.handles.append(region.module.register_forward_hook(post))
        original = Module.__call__
        self.original_call = original

        def call(wrapper, *args, **kwargs):
            with record_function(f"aot_module:{wrapper.name}"):
                return original(wrapper, *args, **kwargs)

        Module.__call__ = call
        return self

    def __exit__(self, *exc):
        Module.__call__ = self.original_call
        for handle in self.handles:
            handle.remove()
        return False


def _assemble(prof, regions: list[_Region], walls: list[float], args: tuple, kwargs: dict, obj: Any,
              inference_function, warmup_runs: int, measured_runs: int, activities) -> dict:
    events = list(prof.events())
    runs_events = sorted((e for e in events if e.name.startswith(_RUN)), key=lambda e: int(e.name[len(_RUN):]))
    region_events = [e for e in events if e.name.startswith(("aot_module:", "untuned_module:"))]
    runs = []
    observed: set[str] = set()
    for index, run in enumerate(runs_events):
        start, end = run.time_range.start, run.time_range.end
        cpu_total = float(run.cpu_time_total)
        device_total = float(_device_time(run))
        by_region: dict[str, dict] = {}
        for event in region_events:
            if start <= event.time_range.start and event.time_range.end <= end:
                entry = by_region.setdefault(event.name, {"region_id": event.name, "calls": 0, "cpu_time_us": 0.0,
                                                          "device_time_us": 0.0})
                entry["calls"] += 1
                entry["cpu_time_us"] += float(event.cpu_time_total)
                entry["device_time_us"] += float(_device_time(event))
        for entry in by_region.values():
            entry["cpu_time_fraction"] = entry["cpu_time_us"] / cpu_total if cpu_total > 0 else 0.0
            entry["device_time_fraction"] = entry["device_time_us"] / device_total if device_total > 0 else 0.0
            observed.add(entry["region_id"])
        cpu_residual = max(0.0, cpu_total - sum(e["cpu_time_us"] for e in by_region.values()))
        device_residual = max(0.0, device_total - sum(e["device_time_us"] for e in by_region.values()))
        runs.append({
            "run_index": index,
            "timing": {"wall_time_us": walls[index] if index < len(walls) else None, "cpu_time_us": cpu_total,
                       "device_time_us": device_total},
            "regions": sorted(by_region.values(), key=lambda e: -e["cpu_time_us"]),
            "residual": {"cpu_time_us": cpu_residual,
                         "cpu_time_fraction": cpu_residual / cpu_total if cpu_total > 0 else 0.0,
                         "device_time_us": device_residual,
                         "device_time_fraction": device_residual / device_total if device_total > 0 else 0.0},
        })
    registered = {id(module) for module in registered_modules()}
    region_rows, warnings = [], []
    by_id = {region.id: region for region in regions}
    for region_id in sorted(observed | {r.id for r in regions if r.kind == "aot_managed_module"}):
        region = by_id.get(region_id)
        if region is None:  # a wrapper called from inside another region or from elsewhere in the process
            name = region_id.split(":", 1)[1]
            wrapper = next((m for m in registered_modules() if m.name == name), None)
            if wrapper is None:
                warnings.append({"code": "UNREGISTERED_AOT_REGION",
                                 "message": f"{region_id} was observed but no live wrapper has that name"})
                region_rows.append({"id": region_id, "name": name, "kind": "aot_managed_module",
                                    "module_type": "unknown", "wrapper_state": "unknown"})
                continue
            region = _Region(region_id, name, "aot_managed_module", wrapper)
        row = {"id": region.id, "name": region.name, "kind": region.kind,
               "module_type": _type_name(region.module.module if isinstance(region.module, Module) else region.module)}
        if region.kind == "aot_managed_module":
            row["wrapper_state"] = region.module.state.value if id(region.module) in registered else "unknown"
        if region.id in observed or region.kind == "aot_managed_module":
            region_rows.append(row)
    averages = prof.key_averages()
    return {
        "schema_version": SCHEMA_VERSION,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "aitune_version": __version__,
        "config": {"warmup_runs": warmup_runs, "measured_runs": measured_runs,
                   "uses_inference_function": inference_function is not None},
        "target": {"type": _type_name(obj.module if isinstance(obj, Module) else obj)},
        "input": {"args_count": len(args), "kwargs": sorted(kwargs)},
        "runs": runs,
        "profiler": {"activities": [str(a).split(".")[-1] for a in activities],
                     "key_averages": {"cpu_time_total": _top(averages, "cpu_time_total"),
                                      "device_time_total": _top(averages, "device_time_total")}},
        "regions": region_rows,
        "warnings": warnings,
    }


def _device_time(event) -> float:
    return float(getattr(event, "device_time_total", 0.0) or 0.0)


def _top(averages, key: str) -> list[dict]:
    def value(row, name):
        return float(getattr(row, name, 0.0) or 0.0)

    rows = sorted(averages, key=lambda row: value(row, key), reverse=True)[:TOP_OPERATORS]
    return [{"key": row.key, "device_type": str(row.device_type).split(".")[-1], "count": int(row.count),
             "self_cpu_time_total_us": value(row, "self_cpu_time_total"), "cpu_time_total_us": value(row, "cpu_time_total"),
             "self_device_time_total_us": value(row, "self_device_time_total"),
             "device_time_total_us": value(row, "device_time_total")} for row in rows]


def _type_name(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"

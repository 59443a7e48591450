"""``aitune report FILE.ait``: what a checkpoint holds, as text, read from its manifest only."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from aitune.torch.checkpoint.archive import member_sizes, sums_path
from aitune.torch.checkpoint.manifest import read_manifest
from aitune.torch.report.html.page import speedup_text


def describe_checkpoint(path: str | os.PathLike, verify: bool = True) -> str:
    """What a checkpoint holds, as text: modules, graphs, backends, inputs, versions, device, figures.

    Reads ``manifest.json`` (JSON) and, with ``verify``, hashes every member against ``SHA256SUMS``; it
    never imports code, unpickles or loads tensors from the checkpoint. Matching digests show the archive is
    intact (no corruption or accidental change), not that it comes from a trusted source. Used by
    ``aitune report FILE.ait``.

    Args:
        path: the ``.ait`` file.
        verify: check every digest first (reads the whole archive once).

    Returns:
        Multi-line text (markdown tables).

    Raises:
        CheckpointIntegrityError / CheckpointVersionError / CheckpointError: as :func:`aitune.torch.load`.
    """
    from tabulate import tabulate

    path = Path(path)
    manifest, sums = read_manifest(path, verify=verify)
    versions = manifest.get("versions", {})
    device = manifest.get("device", {})
    lines = [f"aitune checkpoint {path} ({_size_text(path.stat().st_size)}), format {manifest.get('format_version')}, "
             f"saved {manifest.get('created_at', '?')}",
             "versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v is not None),
             f"device: {_device_text(device)}"]
    if verify:
        lines.append(f"integrity: {len(sums)} file(s), every SHA-256 digest matches SHA256SUMS"
                     + (f" and {sums_path(path).name}" if sums_path(path).exists() else ""))
    else:
        lines.append("integrity: not verified (verify=False)")
    sizes = member_sizes(path)
    for module in manifest.get("modules", []):
        weights = module.get("weights")
        weights_text = (f"stored ({module.get('num_weight_tensors', '?')} tensors, "
                        f"{_size_text(sizes.get(weights, 0))})" if weights
                        else "not stored (every graph uses an AOT backend)")
        lines += ["", f"module {module['name']!r} at {module.get('path_text', '?')} (class {module.get('class', '?')}); "
                      f"weights: {weights_text}"]
        rows = []
        for graph in module.get("graphs", []):
            row = graph.get("tune_row") or {}
            measurement = row.get("measurement") or {}
            comparison = row.get("comparison") or {}
            artifact_bytes = sum(sizes.get(f"{graph['artifacts_dir']}/{name}", 0) for name in graph.get("artifacts", []))
            rows.append([
                graph["name"], graph.get("description") or graph["backend"], graph.get("build_mode", "?"),
                graph.get("device", "?"), _inputs_text(graph), _num(measurement.get("p50_ms"), ".3f"),
                _num(measurement.get("throughput"), ".1f"),
                speedup_text(row.get("speedup"), row.get("speedup_spread")),
                _num(comparison.get("max_abs_error"), ".2g"),
                f"{len(graph.get('artifacts', []))} ({_size_text(artifact_bytes)})" if graph.get("artifacts") else "-"])
        lines.append(tabulate(rows, headers=["graph", "backend", "mode", "device", "inputs (min..max)", "p50 ms",
                                             "samples/s", "speed-up", "max abs err", "artifacts"],
                              tablefmt="github"))
        lines += _runtime_lines(module.get("runtime") or {})
    return "\n".join(lines)


def _runtime_lines(runtime: dict) -> list[str]:
    """What the module went through at run time before it was saved: guard events, stale weights, fallbacks."""
    lines = []
    for graph, guard in (runtime.get("guard") or {}).items():
        for event in guard.get("events", []):
            lines.append(f"run time: {graph}: {event['backend']} disagreed with eager on inputs {event['input_shapes']} "
                         f"({event['reason']}); {event['replaced_by']} served it afterwards")
    if runtime.get("needs_retune"):
        lines.append(f"run time: needs re-tune — {runtime['needs_retune']}")
    fallbacks = runtime.get("eager_fallbacks") or {}
    if fallbacks:
        lines.append("run time: calls that ran eager: " + ", ".join(f"{kind} {count}" for kind, count in fallbacks.items()))
    return lines


def _size_text(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size} B"


def _device_text(device: dict) -> str:
    if not device:
        return "?"
    text = device.get("type", "?") + (f":{device['index']}" if device.get("index") is not None else "")
    if device.get("name"):
        text += f" ({device['name']}"
        if device.get("capability"):
            text += f", sm_{''.join(map(str, device['capability']))}"
        text += ")"
    return text


def _inputs_text(graph: dict) -> str:
    parts = []
    for spec in graph.get("tensor_specs", []):
        dims = []
        for low, high, axis in zip(spec["min_shape"], spec["max_shape"], spec["axes"]):
            text = str(low) if low == high else f"{low}..{high}"
            dims.append(text + ("(b)" if axis == "batch" else ""))
        parts.append(f"{spec['path']}: {spec['dtype']}[{','.join(dims)}]")
    for constant in graph.get("constants", []):
        parts.append(f"{constant['path']}={constant['value']!r}")
    return "; ".join(parts)


def _num(value: Any, spec: str) -> str:
    if value is None or not isinstance(value, (int, float)) or (isinstance(value, float) and not math.isfinite(value)):
        return ""
    return format(value, spec)

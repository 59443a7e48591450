"""Checkpoints (``.ait``): save a tuned model or pipeline, load it later without re-tuning (DESIGN.md §8).

A checkpoint is one zip archive (stored, not compressed) holding:

``manifest.json``
    format version, aitune/torch/CUDA/package versions, device, and per tuned module (addressed by its
    attribute path in the saved object) and per graph: backend name, build mode, config
    (``BackendConfig.to_dict``), backend metadata (what ``Backend.save`` returned), the graph spec (input
    structure, tensor specs with ranges and axes, constants, output structure) and the tune-report row of
    the chosen backend (measured figures).
``modules/<m>/graphs/<graph>/artifacts/...``
    what ``Backend.save`` wrote (e.g. a ``.pt2`` package or an ``.onnx`` model).
``modules/<m>/graphs/<graph>/samples.safetensors``
    the recorded samples' tensors (JIT backends recompile from them; they also fix each graph's identity).
``modules/<m>/weights.safetensors``
    the module's ``state_dict`` — only for modules with at least one JIT graph (eager, Inductor JIT,
    TorchAO): AOT artifacts are self-contained, so the weights of AOT-only modules are neither stored nor
    needed at load.
``SHA256SUMS``
    ``<sha256 hex>  <path>`` for every other file (the layout of ``sha256sum``); a copy is written beside
    the archive as ``<stem>_sha256_sums.txt``.

NOTE [checkpoint safety]: :func:`load` hashes every member while copying it out of the archive and compares
all digests before anything is deserialised; member names that are absolute, contain ``..`` or a
backslash, and members not listed in ``SHA256SUMS`` are refused. Nothing is unpickled: tensors come from
safetensors, everything else from JSON. Python types named by a checkpoint (user dataclasses, namedtuples,
``transformers`` ``ModelOutput`` classes in input/output structures) are looked up only among modules
already imported in this process (``sys.modules``); a checkpoint never makes aitune import anything.

NOTE [checkpoint devices]: ``load(..., device=None)`` picks, per module, the device of the module's
parameters when the module needs its weights (a JIT graph), else the device the checkpoint was saved on
when that device exists here, else the CPU. A JIT graph whose saved device type differs from the target
is rebuilt there with a warning (its backend choice was measured elsewhere); an AOT artifact built for
another device type (e.g. a CUDA artifact loaded on a CPU-only machine) or another GPU architecture is
refused with a :class:`~aitune.errors.CheckpointError` — it would either not run or, with AOTInductor,
crash the process (case C23) — and the message says to load it where it was built or to re-tune. Other
differences (torch/aitune/CUDA versions, another GPU or CPU model) load with one warning that lists them.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import math
import os
import platform
import shutil
import stat
import tempfile
import weakref
import zipfile
from pathlib import Path
from typing import Any

import torch

from aitune import __version__
from aitune.errors import AITuneError, CheckpointError, CheckpointIntegrityError, CheckpointVersionError
from aitune.torch.pytree import tree_unflatten
from aitune.torch.serialization import (
    constant_from_json,
    constant_to_json,
    tree_spec_from_json,
    tree_spec_to_json,
)

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
FORMAT_NAME = "aitune-checkpoint"
MANIFEST = "manifest.json"
SUMS = "SHA256SUMS"
_CHUNK = 1 << 20
_MAX_SMALL_MEMBER = 64 << 20  # manifest.json and SHA256SUMS are read into memory; refuse absurd sizes
_FIXED_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # identical content -> identical members (reproducible archives)

__all__ = ["FORMAT_VERSION", "describe_checkpoint", "load", "save", "tree_spec_from_json", "tree_spec_to_json"]


# ============================================================================================ public API


def save(model_or_pipeline: Any, path: str | os.PathLike) -> Path:
    """Write every tuned :class:`~aitune.torch.Module` found in ``model_or_pipeline`` to one ``.ait`` file.

    Args:
        model_or_pipeline: an :class:`~aitune.torch.Module`, an ``nn.Module`` holding wrappers as
            submodules, or any object holding wrappers as attributes / dict or list entries (a pipeline).
            Wrappers are addressed by their attribute path, so :func:`load` must get an object of the same
            shape.
        path: the archive to write (conventionally ``name.ait``); its parent directory is created.
            ``<stem>_sha256_sums.txt`` is written beside it. Both are replaced atomically.

    Returns:
        The path of the archive.

    Raises:
        CheckpointError: no tuned wrapper found; an input constant that is not a JSON type (None, bool,
            int, float, str); a structure type defined inside a function (it cannot be found at load); a
            backend whose ``save`` fails or returns non-JSON metadata; weights that cannot be stored.
    """
    path = Path(path)
    found = find_wrappers(model_or_pipeline)
    tuned = []
    for entry in found:
        wrapper = entry.wrapper
        if wrapper.state.value != "tuned" or not wrapper._self_dispatch:
            logger.warning("aitune.save: %s (at %s) is not tuned (state: %s%s); it is not saved",
                           wrapper.name, _path_text(entry.path), wrapper.state.value,
                           f", tuning failed: {wrapper.tuning_error}" if wrapper.tuning_error else "")
            continue
        tuned.append(entry)
    if not tuned:
        raise CheckpointError(
            f"nothing to save: no tuned aitune.torch.Module found in {type(model_or_pipeline).__name__}"
            f"{' (found untuned ones: ' + ', '.join(e.wrapper.name for e in found) + ')' if found else ''}; "
            "wrap the modules with ait.Module(...) or ait.wrap(...) and run ait.tune(...) first")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="aitune-save-") as staging_name:
        staging = Path(staging_name)
        manifest = _base_manifest(model_or_pipeline)
        for index, entry in enumerate(tuned):
            manifest["modules"].append(_save_module(index, entry, staging))
        _finish_manifest(manifest)
        side = sums_path(path)
        partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
        side_partial = side.with_name(f".{side.name}.partial-{os.getpid()}")
        try:
            side_partial.write_text(_sums_text(_write_archive(partial, staging, manifest)))
            os.replace(partial, path)
            os.replace(side_partial, side)
        finally:
            partial.unlink(missing_ok=True)
            side_partial.unlink(missing_ok=True)
    logger.info("aitune.save: wrote %s (%d module(s), %d graph(s), %.1f MiB)", path, len(manifest["modules"]),
                sum(len(m["graphs"]) for m in manifest["modules"]), path.stat().st_size / 2**20)
    return path


def load(model_or_pipeline: Any, path: str | os.PathLike, device: str | torch.device | None = None) -> Any:
    """Restore the tuned modules of a checkpoint into ``model_or_pipeline``; returns it TUNED.

    Every digest is verified before anything is deserialised (see NOTE [checkpoint safety]). Where the
    checkpoint has a wrapper and ``model_or_pipeline`` holds a plain ``nn.Module``, the module is wrapped
    in place (as :func:`aitune.torch.wrap` does); when that place is the root, the new wrapper is returned.
    Weights stored for JIT graphs are loaded into the module (``load_state_dict(strict=True)``); AOT graphs
    run their artifact and never touch the module's weights (calls outside an artifact's recorded shape
    range still run the module eagerly, with the weights it has).

    Args:
        model_or_pipeline: the same model/pipeline structure that was saved (freshly constructed: its
            classes must be importable and imported; for JIT graphs its parameters receive the stored
            weights).
        path: the ``.ait`` file.
        device: where to run; None chooses per module (see NOTE [checkpoint devices]).

    Returns:
        ``model_or_pipeline``, or the new wrapper when its root was wrapped.

    Raises:
        CheckpointIntegrityError: not a zip / truncated, a digest mismatch, an unsafe or unlisted member,
            a missing file or artifact, or a side sums file that disagrees with the archive.
        CheckpointVersionError: the checkpoint was written by a newer format version.
        CheckpointError: a structure type that is not imported here, a module path missing from
            ``model_or_pipeline``, weights that do not fit, an AOT artifact for another device type or
            GPU architecture, an unavailable backend, or a backend that fails to restore (cause chained).
    """
    path = Path(path)
    scratch = Path(tempfile.mkdtemp(prefix="aitune-checkpoint-"))
    keep_scratch = False
    try:
        manifest, sums = _read_verified(path, extract_to=scratch)
        _check_format(manifest, path)
        plans = [_plan_module(model_or_pipeline, entry, set(sums), device) for entry in manifest["modules"]]
        _warn_differences(manifest, plans, path)
        files = _ExtractedFiles(scratch)
        for plan in plans:
            _restore_module(plan, files)
        keep_scratch = True
        result = model_or_pipeline
        for plan in plans:
            result = _install(result, plan)
        _drop_loaded_tensor_files(scratch)
        logger.info("aitune.load: restored %s from %s", ", ".join(
            f"{plan.name} ({', '.join(f'{g.name}: {b.name}' for g, b in plan.dispatch.values())})" for plan in plans),
            path)
        return result
    finally:
        if not keep_scratch:
            shutil.rmtree(scratch, ignore_errors=True)


def describe_checkpoint(path: str | os.PathLike, verify: bool = True) -> str:
    """What a checkpoint holds, as text: modules, graphs, backends, inputs, versions, device, figures.

    Reads ``manifest.json`` (JSON) and, with ``verify``, hashes every member against ``SHA256SUMS``; it
    never imports code, unpickles or loads tensors from the checkpoint. Used by ``aitune report FILE.ait``.

    Args:
        path: the ``.ait`` file.
        verify: check every digest first (reads the whole archive once).

    Returns:
        Multi-line text (markdown tables).

    Raises:
        CheckpointIntegrityError / CheckpointVersionError / CheckpointError: as :func:`load`.
    """
    from tabulate import tabulate

    path = Path(path)
    if verify:
        manifest, sums = _read_verified(path, extract_to=None)
    else:
        manifest, sums = _read_manifest_only(path), None
    _check_format(manifest, path)
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
    sizes = _member_sizes(path)
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
                "" if row.get("speedup") is None else f"{row['speedup']:.2f}x",
                _num(comparison.get("max_abs_error"), ".2g"),
                f"{len(graph.get('artifacts', []))} ({_size_text(artifact_bytes)})" if graph.get("artifacts") else "-"])
        lines.append(tabulate(rows, headers=["graph", "backend", "mode", "device", "inputs (min..max)", "p50 ms",
                                             "samples/s", "speed-up", "max abs err", "artifacts"],
                              tablefmt="github"))
    return "\n".join(lines)


def sums_path(path: str | os.PathLike) -> Path:
    """``<dir>/<stem>_sha256_sums.txt`` beside the archive ``<dir>/<stem>.ait``."""
    path = Path(path)
    return path.with_name(f"{path.stem}_sha256_sums.txt")


# ============================================================================================ finding wrappers


@dataclasses.dataclass
class WrapperEntry:
    """A wrapper found in a saved object: its first path and any further paths (aliases) to it."""

    path: list
    wrapper: Any
    aliases: list = dataclasses.field(default_factory=list)


def find_wrappers(obj: Any, max_depth: int = 12) -> list[WrapperEntry]:
    """Every :class:`~aitune.torch.Module` reachable from ``obj`` with its attribute path.

    A path is a list of ``[kind, key]`` steps: ``["module", name]`` (an ``nn.Module`` child),
    ``["attr", name]`` (an object attribute), ``["key", key]`` (a dict entry), ``["index", i]``
    (a list/tuple entry). The root itself has the path ``[]``. Walks like :func:`aitune.torch.inspect`.
    """
    from aitune.torch.module import Module

    found: dict[int, WrapperEntry] = {}
    seen: set[int] = set()

    def visit(value, path, depth):
        if isinstance(value, Module):
            if id(value) in found:
                found[id(value)].aliases.append(path)
                return
            found[id(value)] = WrapperEntry(path, value)
        if id(value) in seen or depth > max_depth:
            return
        seen.add(id(value))
        for step, child in _children(value):
            visit(child, path + [step], depth + 1)

    visit(obj, [], 0)
    return list(found.values())


def _children(value: Any) -> list[tuple[list, Any]]:
    from aitune.torch.module import Module

    if isinstance(value, Module):
        value = value.__wrapped__
    if isinstance(value, torch.nn.Module):
        return [(["module", name], child) for name, child in value._modules.items() if child is not None]
    if isinstance(value, dict):
        return [(["key", key], child) for key, child in value.items() if _json_key(key)]
    if isinstance(value, (list, tuple)):
        return [(["index", i], child) for i, child in enumerate(value)]
    if (hasattr(value, "__dict__") and not isinstance(value, type)
            and type(value).__module__.split(".")[0] not in ("builtins", "torch")):
        return [(["attr", name], child) for name, child in vars(value).items() if not name.startswith("__")]
    return []


def _json_key(key: Any) -> bool:
    return type(key) in (str, int)


def _path_text(path: list) -> str:
    text = ""
    for kind, key in path:
        if kind in ("module", "attr"):
            text += f".{key}" if text else str(key)
        else:
            text += f"[{key!r}]"
    return text or "<root>"


def _get_step(parent: Any, step: list) -> Any:
    from aitune.torch.module import Module

    kind, key = step
    container = parent.__wrapped__ if isinstance(parent, Module) else parent
    if kind == "module":
        if isinstance(container, torch.nn.Module):
            return container._modules[key]
        return getattr(container, key)
    if kind == "attr":
        return getattr(container, key)
    if kind == "key":
        return container[key]
    if kind == "index":
        return container[key]
    raise KeyError(kind)


def _set_step(parent: Any, step: list, value: Any) -> None:
    from aitune.torch.module import Module

    kind, key = step
    container = parent.__wrapped__ if isinstance(parent, Module) else parent
    if kind in ("module", "attr"):
        setattr(container, key, value)
    elif isinstance(container, tuple):
        raise CheckpointError(f"cannot wrap an entry of a tuple in place ({type(container).__name__}[{key}]); "
                              "hold the module in a list, dict or attribute, or wrap it before load")
    else:
        container[key] = value


def _resolve_path(root: Any, path: list) -> tuple[Any, Any]:
    """(parent, value) at ``path`` below ``root`` (parent None for the root)."""
    parent, value = None, root
    for depth, step in enumerate(path):
        parent = value
        try:
            value = _get_step(parent, step)
        except (KeyError, IndexError, AttributeError, TypeError) as exc:
            raise CheckpointError(
                f"the checkpoint has a tuned module at {_path_text(path)}, but {type(root).__name__} has nothing at "
                f"{_path_text(path[: depth + 1])} ({type(exc).__name__}: {exc}); load into the same model/pipeline "
                "structure that was saved") from exc
    return parent, value


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the checkpoint")
    return dtype


def _tensor_spec_to_json(spec, device_type: str) -> dict:
    dims = []
    for dim in spec.dims:
        if dim is None:
            dims.append(None)
        else:
            from aitune.torch.samples import BatchDim

            dims.append({"kind": "batch" if isinstance(dim, BatchDim) else "dynamic", "name": dim.name,
                         "min": dim.min, "max": dim.max, "opt": dim.opt})
    return {"name": spec.name, "path": spec.path, "leaf_index": spec.leaf_index,
            "dtype": str(spec.dtype).removeprefix("torch."), "min_shape": list(spec.min_shape),
            "max_shape": list(spec.max_shape), "axes": list(spec.axes),
            "multipliers": [None if math.isnan(m) else m for m in spec.multipliers], "dims": dims,
            "device": device_type}


def _tensor_spec_from_json(data: dict):
    from aitune.torch.samples import BatchDim, DynamicDim, TensorSpec

    dims = []
    for dim in data["dims"]:
        if dim is None:
            dims.append(None)
        else:
            dim_class = BatchDim if dim["kind"] == "batch" else DynamicDim
            dims.append(dim_class(dim["name"], dim["min"], dim["max"], dim.get("opt")))
    return TensorSpec(name=data["name"], path=data["path"], leaf_index=int(data["leaf_index"]),
                      dtype=_dtype_from_name(data["dtype"]), min_shape=[int(v) for v in data["min_shape"]],
                      max_shape=[int(v) for v in data["max_shape"]], axes=list(data["axes"]),
                      multipliers=[math.nan if m is None else float(m) for m in data["multipliers"]], dims=dims)


def graph_to_json(graph, module_name: str) -> dict:
    """Everything needed to rebuild a :class:`~aitune.torch.samples.GraphSpec` except the sample tensors."""
    where = f"module {module_name!r} {graph.name}"
    leaves = graph.samples[0].leaves() if graph.samples else []
    constants = []
    for index, (leaf, path) in enumerate(zip(leaves, graph.input_paths)):
        if not isinstance(leaf, torch.Tensor):
            constants.append({"leaf_index": index, "path": path,
                              "value": constant_to_json(leaf, f"{where}: input {path!r}")})
    return {
        "index": graph.index,
        "input_structure": tree_spec_to_json(graph.input_spec, f"{where}: the input structure"),
        "input_paths": list(graph.input_paths),
        "input_names": list(graph.input_names),
        "tensor_specs": [_tensor_spec_to_json(spec, leaves[spec.leaf_index].device.type)
                         for spec in graph.tensor_specs],
        "constants": constants,
        "max_samples": graph.max_samples,
        "num_calls": graph.num_calls,
        "mutated_inputs": list(graph.mutated_inputs),
        "training": graph.training,
    }


# ============================================================================================ saving


def _base_manifest(obj: Any) -> dict:
    from aitune.torch.report import environment

    env = environment()
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "created_at": datetime.datetime.now().isoformat(timespec="seconds"),
        "saved_object": f"{type(obj).__module__}.{type(obj).__qualname__}",
        "versions": {"aitune": __version__, "torch": torch.__version__, "cuda": torch.version.cuda,
                     "python": platform.python_version()},
        "platform": env.get("platform"),
        "device": None,
        "modules": [],
    }


def device_facts(device: torch.device | str) -> dict:
    """JSON facts about a device: type, index, name, CUDA capability (``[major, minor]``) or CPU machine."""
    device = torch.device(device)
    facts: dict[str, Any] = {"type": device.type, "index": device.index, "name": None, "capability": None}
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        facts["index"] = index
        facts["name"] = torch.cuda.get_device_name(index)
        facts["capability"] = list(torch.cuda.get_device_capability(index))
    elif device.type == "cpu":
        facts["name"] = cpu_model_name()
        facts["machine"] = platform.machine()
    return facts


_CPU_MODEL: list = []


def cpu_model_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else ``platform.processor()``, else the machine type."""
    if not _CPU_MODEL:
        name = ""
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
                for line in handle:
                    if line.lower().startswith("model name"):
                        name = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
        _CPU_MODEL.append(name or platform.processor() or platform.machine())
    return _CPU_MODEL[0]


def _save_module(index: int, entry: WrapperEntry, staging: Path) -> dict:
    from aitune.torch.backend.base import BuildMode

    wrapper = entry.wrapper
    base = f"modules/{index}"
    graphs = []
    needs_weights = False
    rows = getattr(wrapper, "_self_tune_rows", None) or {}
    for graph, backend in sorted(wrapper._self_dispatch.values(), key=lambda item: item[0].index):
        if not graph.samples:
            raise CheckpointError(f"{wrapper.name}/{graph.name} has no recorded samples; re-run ait.tune")
        build_mode = BuildMode(backend.build_mode)
        needs_weights |= build_mode is BuildMode.JIT
        graph_base = f"{base}/graphs/{graph.name}"
        artifacts_dir = staging / graph_base / "artifacts"
        try:
            metadata = backend.save(artifacts_dir)
        except AITuneError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{wrapper.name}/{graph.name}: backend {backend.name} could not be saved: "
                                  f"{type(exc).__name__}: {exc}") from exc
        try:
            metadata = json.loads(json.dumps(metadata, allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{wrapper.name}/{graph.name}: backend {backend.name} returned metadata that is not "
                                  f"plain JSON ({exc}); this is a bug in the backend") from exc
        artifacts = sorted(p.relative_to(artifacts_dir).as_posix() for p in artifacts_dir.rglob("*") if p.is_file())
        data = graph_to_json(graph, wrapper.name)
        data.update({
            "name": graph.name,
            "backend": backend.name,
            "backend_class": f"{type(backend).__module__}.{type(backend).__qualname__}",
            "build_mode": build_mode.value,
            "config": backend.config.to_dict(),
            "description": backend.describe(),
            "metadata": metadata,
            "device": str(backend.device) if backend.device is not None else "cpu",
            "device_facts": device_facts(backend.device or "cpu"),
            "packages": dict(type(backend).availability().versions),
            "artifacts_dir": f"{graph_base}/artifacts",
            "artifacts": artifacts,
            "spec": _json_safe(graph.describe()),
            "output_structure": _output_structure(graph, wrapper.name, build_mode),
            "samples": _save_samples(graph, staging / graph_base / "samples.safetensors", f"{graph_base}/samples.safetensors"),
            "tune_row": _json_safe(rows.get(graph.name)) if rows.get(graph.name) else None,
            "tolerance": _tuned_tolerance(rows.get(graph.name)),
        })
        graphs.append(data)
    module = wrapper.__wrapped__
    record: dict[str, Any] = {
        "path": entry.path,
        "path_text": _path_text(entry.path),
        "aliases": entry.aliases,
        "name": wrapper.name,
        "class": f"{type(module).__module__}.{type(module).__qualname__}",
        "max_samples": wrapper._self_recorder.max_samples,
        "strategy": wrapper.strategy.describe() if wrapper.strategy is not None else None,
        "training": module.training,
        "weights": None,
        "weight_aliases": {},
        "graphs": graphs,
    }
    if needs_weights:
        record["weights"] = f"{base}/weights.safetensors"
        record["weight_aliases"], record["num_weight_tensors"] = _save_weights(
            module, staging / record["weights"], wrapper.name)
    return record


def _tuned_tolerance(row: dict | None) -> dict | None:
    """The thresholds the chosen backend was compared with eager under (``Tolerance.to_dict``), or None."""
    tolerance = ((row or {}).get("comparison") or {}).get("tolerance")
    return _json_safe(tolerance) if isinstance(tolerance, dict) else None


def _output_structure(graph, module_name: str, build_mode) -> dict | None:
    from aitune.torch.backend.base import BuildMode

    if graph.output_spec is None:
        return None
    try:
        return tree_spec_to_json(graph.output_spec, f"module {module_name!r} {graph.name}: the output structure")
    except CheckpointError:
        if build_mode is BuildMode.AOT:
            raise
        # JIT backends rebuild the output from the module itself; the structure is informative only.
        logger.debug("output structure of %s/%s not stored", module_name, graph.name, exc_info=True)
        return None


def _save_samples(graph, file: Path, member: str) -> dict:
    from safetensors.torch import save_file

    tensors = {}
    batch_sizes = []
    for sample_index, sample in enumerate(graph.samples):
        batch_sizes.append(sample.batch_size)
        for leaf_index, leaf in enumerate(sample.leaves()):
            if isinstance(leaf, torch.Tensor):
                tensors[f"{sample_index}/{leaf_index}"] = leaf.detach().to("cpu").contiguous().clone()
    file.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(file))
    return {"file": member, "count": len(graph.samples), "batch_sizes": batch_sizes}


def _save_weights(module: torch.nn.Module, file: Path, name: str) -> tuple[dict, int]:
    """state_dict -> safetensors. Entries that are the same tensor view (tied weights) are stored once and
    recorded as aliases; other tensors that share memory are copied (safetensors refuses shared storage)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    by_view: dict[tuple, str] = {}
    for key, value in module.state_dict().items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"module {name!r}: state_dict entry {key!r} is a {type(value).__name__} (extra "
                                  "state); checkpoints store tensors only")
        if value.device.type == "meta":
            raise CheckpointError(f"module {name!r}: parameter/buffer {key!r} is on the meta device (no data); "
                                  "materialise the module's weights before ait.save")
        value = value.detach()
        if value.numel():
            view = (value.device, value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape),
                    tuple(value.stride()), value.dtype)
            if view in by_view:
                aliases[key] = by_view[view]
                continue
            by_view[view] = key
        tensors[key] = value.to("cpu").contiguous()
    storages: set[int] = set()
    for key, tensor in tensors.items():
        if not tensor.numel():
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() in storages or storage.nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensors[key] = tensor.clone()
        storages.add(tensor.untyped_storage().data_ptr())
    file.parent.mkdir(parents=True, exist_ok=True)
    try:
        save_file(tensors, str(file))
    except Exception as exc:  # noqa: BLE001 - translated with the cause chained
        raise CheckpointError(f"module {name!r}: weights could not be stored as safetensors: {exc}") from exc
    return aliases, len(tensors)


def _finish_manifest(manifest: dict) -> None:
    modules = manifest["modules"]
    for module in modules:
        for graph in module["graphs"]:
            manifest["device"] = manifest["device"] or graph["device_facts"]
            for package, version in graph.get("packages", {}).items():
                manifest["versions"].setdefault(package, version)
    if manifest["device"] is None:
        manifest["device"] = device_facts("cpu")


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return str(value)


def _write_archive(archive: Path, staging: Path, manifest: dict) -> dict[str, str]:
    sums: dict[str, str] = {}
    manifest_bytes = json.dumps(manifest, indent=2, sort_keys=False, allow_nan=False).encode()
    with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for file in sorted(p for p in staging.rglob("*") if p.is_file()):
            name = file.relative_to(staging).as_posix()
            _check_member_name(name)
            hasher = hashlib.sha256()
            info = _zip_info(name)
            with open(file, "rb") as source, zf.open(info, "w", force_zip64=file.stat().st_size > 2**31) as target:
                while chunk := source.read(_CHUNK):
                    hasher.update(chunk)
                    target.write(chunk)
            sums[name] = hasher.hexdigest()
        zf.writestr(_zip_info(MANIFEST), manifest_bytes)
        sums[MANIFEST] = hashlib.sha256(manifest_bytes).hexdigest()
        zf.writestr(_zip_info(SUMS), _sums_text(sums).encode())
    return sums


def _zip_info(name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=_FIXED_ZIP_TIME)
    info.compress_type = zipfile.ZIP_STORED
    info.external_attr = (stat.S_IFREG | 0o644) << 16
    return info


def _sums_text(sums: dict[str, str]) -> str:
    return "".join(f"{digest}  {name}\n" for name, digest in sorted(sums.items()))


# ============================================================================================ reading


def _check_member_name(name: str) -> None:
    """Refuse names that could land outside an extraction folder or alias another file."""
    parts = name.split("/")
    if (not name or name.startswith("/") or "\\" in name or "\x00" in name or ":" in parts[0]
            or any(part in ("..", ".") for part in parts) or any(part == "" for part in parts[:-1])):
        raise CheckpointIntegrityError(
            f"unsafe member name {name!r} in the checkpoint (absolute path, '..', '.', a backslash or a drive): "
            "refusing to read it; the file was not written by aitune or was tampered with")


def _open_zip(path: Path) -> zipfile.ZipFile:
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        return zipfile.ZipFile(path)
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:
        raise CheckpointIntegrityError(f"{path} is truncated or is not an aitune checkpoint (not a readable zip: "
                                       f"{exc}); save it again or copy it completely") from exc


def _parse_sums(text: str, path: Path, origin: str) -> dict[str, str]:
    sums: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64 or any(ch not in "0123456789abcdef" for ch in digest):
            raise CheckpointIntegrityError(f"{origin} of {path}, line {number}: malformed entry {line[:120]!r}")
        _check_member_name(name)
        if name in sums:
            raise CheckpointIntegrityError(f"{origin} of {path} lists {name!r} twice")
        sums[name] = digest
    return sums


def _read_verified(path: Path, extract_to: Path | None) -> tuple[dict, dict[str, str]]:
    """Verify every member of the archive against SHA256SUMS (copying it under ``extract_to`` while
    hashing), then parse ``manifest.json``. Nothing is deserialised before every digest matched."""
    with _open_zip(path) as zf:
        try:
            infos = zf.infolist()
            members: dict[str, zipfile.ZipInfo] = {}
            for info in infos:
                _check_member_name(info.filename.rstrip("/") if info.is_dir() else info.filename)
                if stat.S_ISLNK(info.external_attr >> 16):
                    raise CheckpointIntegrityError(f"member {info.filename!r} of {path} is a symbolic link; refusing it")
                if info.is_dir():
                    continue
                if info.filename in members:
                    raise CheckpointIntegrityError(f"{path} holds {info.filename!r} twice; refusing an ambiguous archive")
                members[info.filename] = info
            if SUMS not in members:
                raise CheckpointIntegrityError(f"{path} has no {SUMS}: it is not an aitune checkpoint or was altered")
            sums_bytes = _read_small(zf, members[SUMS], path)
            sums = _parse_sums(sums_bytes.decode("utf-8", errors="replace"), path, SUMS)
            side = sums_path(path)
            if side.exists():
                side_sums = _parse_sums(side.read_text(encoding="utf-8", errors="replace"), path, side.name)
                if side_sums != sums:
                    different = sorted(n for n in set(sums) | set(side_sums) if sums.get(n) != side_sums.get(n))
                    raise CheckpointIntegrityError(
                        f"{side.name} beside {path} disagrees with the {SUMS} inside it ({', '.join(different[:5])}"
                        f"{'…' if len(different) > 5 else ''}): the archive or the sums file was changed")
            unlisted = sorted(set(members) - set(sums) - {SUMS})
            if unlisted:
                raise CheckpointIntegrityError(f"{path} holds files not listed in {SUMS}: {', '.join(unlisted[:5])}; "
                                               "refusing an altered checkpoint")
            missing = sorted(set(sums) - set(members))
            if missing:
                raise CheckpointIntegrityError(f"{path} is missing {', '.join(missing[:5])}, listed in its {SUMS}; the "
                                               "checkpoint is incomplete — save it again")
            manifest_bytes = b""
            for name in sorted(sums):
                hasher = hashlib.sha256()
                target = None
                if name == MANIFEST:
                    manifest_bytes = _read_small(zf, members[name], path)
                    hasher.update(manifest_bytes)
                else:
                    if extract_to is not None:
                        destination = extract_to.joinpath(*name.split("/"))
                        destination.parent.mkdir(parents=True, exist_ok=True)
                        target = open(destination, "wb")
                    try:
                        with zf.open(members[name]) as source:
                            while chunk := source.read(_CHUNK):
                                hasher.update(chunk)
                                if target is not None:
                                    target.write(chunk)
                    finally:
                        if target is not None:
                            target.close()
                if hasher.hexdigest() != sums[name]:
                    raise CheckpointIntegrityError(f"{name} in {path} does not match its SHA-256 digest in {SUMS}: the "
                                                   "checkpoint was corrupted or tampered with; do not use it")
        except (zipfile.BadZipFile, EOFError, zlib_error(), OSError) as exc:
            raise CheckpointIntegrityError(f"{path} is corrupted or truncated ({type(exc).__name__}: {exc}); save it "
                                           "again or copy it completely") from exc
    if MANIFEST not in sums:
        raise CheckpointIntegrityError(f"{path} has no {MANIFEST}: it is not an aitune checkpoint")
    return _parse_manifest(manifest_bytes, path), sums


def zlib_error() -> type:
    import zlib

    return zlib.error


def _read_small(zf: zipfile.ZipFile, info: zipfile.ZipInfo, path: Path) -> bytes:
    if info.file_size > _MAX_SMALL_MEMBER:
        raise CheckpointIntegrityError(f"{info.filename} in {path} is {info.file_size} bytes, far larger than "
                                       "aitune writes; refusing it")
    return zf.read(info)


def _read_manifest_only(path: Path) -> dict:
    with _open_zip(path) as zf:
        try:
            info = zf.getinfo(MANIFEST)
        except KeyError as exc:
            raise CheckpointIntegrityError(f"{path} has no {MANIFEST}: it is not an aitune checkpoint") from exc
        try:
            return _parse_manifest(_read_small(zf, info, path), path)
        except (zipfile.BadZipFile, EOFError, OSError) as exc:
            raise CheckpointIntegrityError(f"{path} is corrupted or truncated ({exc})") from exc


def _parse_manifest(data: bytes, path: Path) -> dict:
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{MANIFEST} of {path} is not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path} is not an aitune checkpoint ({MANIFEST} has no 'format': '{FORMAT_NAME}')")
    return manifest


def _check_format(manifest: dict, path: Path) -> None:
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CheckpointError(f"{path}: malformed format_version {version!r} in {MANIFEST}")
    if version > FORMAT_VERSION:
        raise CheckpointVersionError(
            f"{path} was written in checkpoint format version {version} (by aitune "
            f"{manifest.get('versions', {}).get('aitune', '?')}); this aitune ({__version__}) reads versions up to "
            f"{FORMAT_VERSION}. Upgrade aitune (pip install -U aitune) to load it")
    if not isinstance(manifest.get("modules"), list):
        raise CheckpointError(f"{path}: {MANIFEST} has no list of modules")


# ============================================================================================ loading


@dataclasses.dataclass
class _GraphPlan:
    entry: dict
    backend_class: type
    config: Any
    device: torch.device
    rebuild_as_eager: str | None = None  # reason, when a JIT backend cannot run on the target device


@dataclasses.dataclass
class _ModulePlan:
    entry: dict
    name: str
    parent: Any
    target: Any  # the wrapper, or the plain nn.Module that will be wrapped
    device: torch.device
    graphs: list
    dispatch: dict = dataclasses.field(default_factory=dict)
    wrapper: Any = None
    differences: list = dataclasses.field(default_factory=list)
    eager_fallback_error: str | None = None


class _ExtractedFiles:
    """Keeps the extracted artifacts alive while any restored backend refers to them."""

    def __init__(self, root: Path):
        self.root = root
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(root), True)


def _plan_module(root: Any, entry: dict, verified: set[str], device) -> _ModulePlan:
    """Resolve everything that can fail before touching the user's object: files, path, backends, device."""
    from aitune.torch.backend.base import BuildMode, get_backend_class
    from aitune.torch.module import Module

    path = entry.get("path")
    if not isinstance(path, list) or not all(isinstance(s, list) and len(s) == 2 for s in path):
        raise CheckpointError(f"malformed module path {path!r} in the checkpoint")
    parent, target = _resolve_path(root, path)
    name = entry.get("name", "?")
    if not isinstance(target, torch.nn.Module):
        raise CheckpointError(f"the checkpoint has the tuned module {name!r} at {_path_text(path)}, but there "
                              f"{type(root).__name__} holds a {type(target).__name__}, not an nn.Module")
    module = target.__wrapped__ if isinstance(target, Module) else target
    if not isinstance(target, Module) and isinstance(parent, tuple):
        raise CheckpointError(f"{name!r} at {_path_text(path)} is an entry of a tuple, which cannot be replaced by its "
                              "wrapper; hold the module in a list, dict or attribute, or wrap it before load")
    saved_class = entry.get("class")
    current_class = f"{type(module).__module__}.{type(module).__qualname__}"
    if saved_class and saved_class != current_class:
        logger.warning("aitune.load: %s at %s was saved from a %s and is loaded into a %s", name, _path_text(path),
                       saved_class, current_class)
    graphs_entries = entry.get("graphs") or []
    _check_files_present(entry, verified)
    needs_weights = any(g.get("build_mode") == BuildMode.JIT.value for g in graphs_entries)
    if needs_weights and not entry.get("weights"):
        raise CheckpointIntegrityError(f"module {name!r} has JIT graphs but the checkpoint stores no weights for it")
    module_device = _parameter_device(module)
    target_device = _target_device(device, graphs_entries, module_device if needs_weights else None)
    if needs_weights and module_device is not None and module_device.type != "meta" and not _same_device(
            module_device, target_device):
        raise CheckpointError(
            f"module {name!r}: its parameters are on {module_device} but it is loaded for {target_device}; its JIT "
            f"backend(s) run the module itself, so move it first (model.to('{target_device}')) or pass "
            f"device='{module_device}' (aitune never moves your module)")
    plans = []
    for graph_entry in graphs_entries:
        backend_name = graph_entry.get("backend")
        try:
            backend_class = get_backend_class(backend_name)
        except AITuneError as exc:
            raise CheckpointError(f"{name}/{graph_entry.get('name')}: {exc}") from exc
        available = backend_class.availability()
        build_mode = graph_entry.get("build_mode")
        saved_facts = graph_entry.get("device_facts") or {"type": torch.device(graph_entry.get("device", "cpu")).type}
        plan = _GraphPlan(graph_entry, backend_class, None, target_device)
        where = f"{name}/{graph_entry.get('name')}"
        if build_mode == BuildMode.AOT.value:
            _check_aot_device(where, backend_name, saved_facts, target_device)
            if not available.ok:
                raise CheckpointError(f"{where} uses backend '{backend_name}', unavailable here: {available.reason}")
        try:
            plan.config = backend_class.config_class.from_dict(graph_entry.get("config") or {})
        except AITuneError as exc:
            raise CheckpointError(f"{where}: the stored config of backend '{backend_name}' is invalid here: {exc}") from exc
        if build_mode != BuildMode.AOT.value:
            if not available.ok:
                plan.rebuild_as_eager = f"backend '{backend_name}' is unavailable here ({available.reason})"
            elif target_device.type not in backend_class.device_types:
                plan.rebuild_as_eager = f"backend '{backend_name}' does not run on {target_device.type}"
        plans.append(plan)
    return _ModulePlan(entry, name, parent, target, target_device, plans)


def _check_files_present(entry: dict, verified: set[str]) -> None:
    """Every file the manifest names must be in the archive (and so verified) before anything is read."""
    name = entry.get("name", "?")
    if entry.get("weights") and entry["weights"] not in verified:
        raise CheckpointIntegrityError(f"the weights of module {name!r} ({entry['weights']}) are missing from the "
                                       "checkpoint; it is incomplete — save it again")
    for graph in entry.get("graphs") or []:
        where = f"{name}/{graph.get('name')}"
        samples = (graph.get("samples") or {}).get("file")
        if samples not in verified:
            raise CheckpointIntegrityError(f"{where}: the recorded samples ({samples}) are missing from the checkpoint; "
                                           "it is incomplete — save it again")
        for artifact in graph.get("artifacts") or []:
            member = f"{graph.get('artifacts_dir')}/{artifact}"
            _check_member_name(member)
            if member not in verified:
                raise CheckpointIntegrityError(
                    f"{where}: artifact {artifact!r} of backend '{graph.get('backend')}' ({member}) is missing from "
                    "the checkpoint; it is incomplete — save it again")


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    index_a = a.index if a.index is not None else torch.cuda.current_device()
    index_b = b.index if b.index is not None else torch.cuda.current_device()
    return index_a == index_b


def _parameter_device(module: torch.nn.Module) -> torch.device | None:
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return None


def _target_device(device, graph_entries: list, module_device: torch.device | None) -> torch.device:
    if device is not None:
        try:
            target = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise CheckpointError(f"device {device!r} is not a torch device (use 'cpu' or 'cuda:0')") from exc
    elif module_device is not None and module_device.type != "meta":
        target = module_device
    else:
        saved = torch.device(graph_entries[0].get("device", "cpu")) if graph_entries else torch.device("cpu")
        if saved.type == "cuda" and torch.cuda.is_available():
            index = saved.index if saved.index is not None and saved.index < torch.cuda.device_count() else 0
            target = torch.device("cuda", index)
        elif saved.type == "cpu":
            target = saved
        else:
            target = torch.device("cpu")
    if target.type == "cuda":
        if not torch.cuda.is_available():
            raise CheckpointError(f"device {target} requested but CUDA is not available here")
        if target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
    return target


def _check_aot_device(where: str, backend: str, saved: dict, target: torch.device) -> None:
    saved_type = saved.get("type", "cpu")
    if saved_type != target.type:
        raise CheckpointError(
            f"{where} uses the AOT backend '{backend}', whose artifact was built for {saved_type}"
            f"{' (' + saved['name'] + ')' if saved.get('name') else ''}; it cannot run on {target.type}. Load it on "
            f"a {saved_type} device (device='{saved_type}') or re-tune here")
    if target.type == "cuda" and saved.get("capability"):
        here = list(torch.cuda.get_device_capability(target))
        if list(saved["capability"]) != here:
            raise CheckpointError(
                f"{where} uses the AOT backend '{backend}', built for GPU architecture sm_{''.join(map(str, saved['capability']))} "
                f"({saved.get('name')}); this GPU ({torch.cuda.get_device_name(target)}) is sm_{''.join(map(str, here))}. "
                "Compiled artifacts do not carry over between architectures: re-tune on this GPU")


def _warn_differences(manifest: dict, plans: list[_ModulePlan], path: Path) -> None:
    differences = []
    saved_versions = manifest.get("versions", {})
    for key, here in (("torch", torch.__version__), ("aitune", __version__), ("cuda", torch.version.cuda)):
        if saved_versions.get(key) != here:
            differences.append(f"{key} {saved_versions.get(key)} -> {here}")
    for plan in plans:
        for graph_plan in plan.graphs:
            graph = graph_plan.entry
            saved = graph.get("device_facts") or {}
            here = device_facts(graph_plan.device)
            where = f"{plan.name}/{graph.get('name')}"
            if saved.get("type") != here["type"]:
                differences.append(f"{where} was tuned on {saved.get('type')} and is rebuilt on {here['type']} "
                                   f"({graph.get('backend')}); its backend choice was measured on {saved.get('type')}")
            elif saved.get("name") != here.get("name"):
                differences.append(f"{where}: device {saved.get('name')!r} -> {here.get('name')!r}")
            for package, version in (graph.get("packages") or {}).items():
                now = graph_plan.backend_class.availability().versions.get(package)
                if now is not None and now != version:
                    differences.append(f"{where}: {package} {version} -> {now}")
            if graph_plan.rebuild_as_eager:
                differences.append(f"{where}: {graph_plan.rebuild_as_eager}; it runs eager")
    if differences:
        logger.warning("aitune.load: %s was saved in a different environment: %s. Figures in the checkpoint may not "
                       "hold here; re-tune for the best choice", path, "; ".join(dict.fromkeys(differences)))


def _restore_module(plan: _ModulePlan, files: _ExtractedFiles) -> None:
    from aitune.torch.backend.eager import TorchEagerBackend
    from aitune.torch.module import Module

    entry = plan.entry
    module = plan.target.__wrapped__ if isinstance(plan.target, Module) else plan.target
    if entry.get("weights"):
        _load_weights(module, files.root / entry["weights"], entry.get("weight_aliases") or {}, plan)
    if module.training != bool(entry.get("training", module.training)):
        logger.warning("aitune.load: %s is in %s mode but was tuned in %s mode; tuned backends run only when the "
                       "modes agree (call .eval() / .train())", plan.name, "training" if module.training else "eval",
                       "training" if entry.get("training") else "eval")
    for graph_plan in plan.graphs:
        graph_entry = graph_plan.entry
        graph = _restore_graph(graph_entry, files.root, graph_plan.device, plan.name, module)
        artifacts = files.root / graph_entry["artifacts_dir"]
        artifacts.mkdir(parents=True, exist_ok=True)
        for artifact in graph_entry.get("artifacts", []):
            _check_member_name(artifact)
            if not (artifacts / artifact).is_file():
                raise CheckpointIntegrityError(f"{plan.name}/{graph.name}: artifact {artifact!r} of backend "
                                               f"'{graph_entry['backend']}' is missing from the checkpoint")
        backend_class, config = graph_plan.backend_class, graph_plan.config
        if graph_plan.rebuild_as_eager:
            backend_class, config = TorchEagerBackend, TorchEagerBackend.config_class()
        try:
            with torch.no_grad():
                backend = backend_class.from_checkpoint(artifacts, config, graph_entry.get("metadata") or {}, module,
                                                        graph, graph_plan.device)
        except Exception as exc:  # noqa: BLE001 - translated with the cause chained
            raise CheckpointError(
                f"{plan.name}/{graph.name}: restoring backend '{backend_class.name}' failed: {type(exc).__name__}: "
                f"{exc}. It was saved on {graph_entry.get('device')}; load it in the environment it was saved in, or "
                "re-tune") from exc
        backend._checkpoint_files = files  # keeps the extracted artifacts while the backend lives
        backend.build_info.update({"restored_from_checkpoint": True})
        plan.dispatch[graph.key] = (graph, backend)
    if not entry.get("weights"):
        plan.eager_fallback_error = _eager_fallback_problem(module, plan)


def _eager_fallback_problem(module: torch.nn.Module, plan: "_ModulePlan") -> str | None:
    """Can calls an AOT artifact does not take (other shapes, untuned structures) still run eagerly?

    The checkpoint holds no weights for an AOT-only module, so eager fallback runs ``module`` with the weights
    it was given. NOTE [eager fallback after load]: we run it once per graph on a recorded sample and compare
    with the artifact; if they disagree (random or missing weights) fallback would be silently wrong, so the
    wrapper refuses such calls with this reason instead.
    """
    from aitune.torch.correctness import OutputComparator, Tolerance
    from aitune.torch.samples import clone_tree

    graph_entries = {g.entry.get("name"): g.entry for g in plan.graphs}

    if any(t.is_meta for t in list(module.parameters()) + list(module.buffers())):
        return (f"{plan.name} was loaded from an AOT checkpoint into a module without weights (meta tensors), so "
                "calls its artifacts do not take cannot run eagerly; load into a module with its real weights "
                "(e.g. from_pretrained) to allow that")
    for graph, backend in plan.dispatch.values():
        if not graph.samples:
            continue
        # The thresholds the module was tuned under; manifests written before they were stored per graph
        # fall back to the default Tolerance().
        try:
            tolerance = Tolerance.from_dict(graph_entries.get(graph.name, {}).get("tolerance"))
        except AITuneError as exc:
            raise CheckpointError(f"{plan.name}/{graph.name}: malformed tolerance in the checkpoint ({exc})") from exc
        try:
            with torch.no_grad():
                inputs = graph.samples[0].clone()
                expected = clone_tree(backend.infer(*inputs.args, **inputs.kwargs))
                inputs = graph.samples[0].clone()
                actual = module(*inputs.args, **inputs.kwargs)
            OutputComparator(tolerance, quantized=backend.is_quantizing,
                             low_precision=bool(getattr(backend, "low_precision", False))).compare(expected, actual)
        except Exception as exc:  # noqa: BLE001
            return (f"the module passed to ait.load does not reproduce {plan.name}/{graph.name}'s tuned outputs "
                    f"({type(exc).__name__}: {str(exc).splitlines()[0][:160]}) — its weights differ from the tuned "
                    "ones — so calls the AOT artifacts do not take cannot fall back to eager; load into the model "
                    "with its real weights")
    return None


def _restore_graph(entry: dict, root: Path, device: torch.device, module_name: str, module: torch.nn.Module):
    from safetensors.torch import load_file

    from aitune.torch.samples import CallSignature, GraphSpec, Sample, make_graph_key

    where = f"{module_name}/{entry.get('name')}"
    input_spec = tree_spec_from_json(entry["input_structure"])
    tensor_specs = [_tensor_spec_from_json(spec) for spec in entry["tensor_specs"]]
    constants = {int(c["leaf_index"]): constant_from_json(c["value"]) for c in entry["constants"]}
    count = input_spec.num_leaves
    if any(not 0 <= spec.leaf_index < count for spec in tensor_specs) or any(not 0 <= i < count for i in constants):
        raise CheckpointError(f"{where}: leaf indices in the checkpoint do not fit its input structure")
    samples_entry = entry["samples"]
    tensors = load_file(str(root / samples_entry["file"]), device="cpu")
    saved_type = torch.device(entry.get("device", "cpu")).type
    samples = []
    for sample_index in range(int(samples_entry["count"])):
        leaves: list[Any] = [None] * count
        for index, value in constants.items():
            leaves[index] = value
        for spec, spec_entry in zip(tensor_specs, entry["tensor_specs"]):
            key = f"{sample_index}/{spec.leaf_index}"
            if key not in tensors:
                raise CheckpointIntegrityError(f"{where}: sample tensor {key!r} is missing from the checkpoint")
            leaf_device = device if spec_entry.get("device", saved_type) == saved_type else torch.device(spec_entry["device"])
            leaves[spec.leaf_index] = tensors[key].to(leaf_device)
        args, kwargs = tree_unflatten(input_spec, leaves)
        samples.append(Sample(tuple(args), dict(kwargs), samples_entry["batch_sizes"][sample_index]))
    if not samples:
        raise CheckpointError(f"{where}: the checkpoint holds no samples for this graph")
    first = samples[0].leaves()
    graph = GraphSpec(int(entry["index"]), make_graph_key(first, input_spec), input_spec, first,
                      max_samples=int(entry.get("max_samples", len(samples))))
    graph.name = entry["name"]
    graph.input_paths = list(entry["input_paths"])
    graph._input_names = list(entry["input_names"])
    graph.tensor_specs = tensor_specs
    graph.constants = {c["path"]: constants[int(c["leaf_index"])] for c in entry["constants"]}
    graph.samples = samples
    graph.num_calls = int(entry.get("num_calls", len(samples)))
    graph.mutated_inputs = list(entry.get("mutated_inputs", []))
    graph.training = entry.get("training")
    graph.signature = CallSignature(module.forward)  # as the Recorder sets it: normalises direct backend calls
    output = entry.get("output_structure")
    graph.output_spec = None
    if output is not None:
        try:
            graph.output_spec = tree_spec_from_json(output)
        except CheckpointError:
            if entry.get("build_mode") == "aot":
                raise
            logger.debug("%s: output structure not restored (JIT backends rebuild it)", where, exc_info=True)
    return graph


def _load_weights(module: torch.nn.Module, file: Path, aliases: dict, plan: _ModulePlan) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(file), device="cpu")
    for alias, canonical in aliases.items():
        if canonical not in tensors:
            raise CheckpointIntegrityError(f"module {plan.name!r}: weight alias {alias!r} points to missing {canonical!r}")
        tensors[alias] = tensors[canonical]
    on_meta = any(t.device.type == "meta" for t in list(module.parameters()) + list(module.buffers()))
    try:
        with torch.no_grad():
            module.load_state_dict(tensors, strict=True, assign=on_meta)
        if on_meta:
            module.to(plan.device)
    except Exception as exc:  # noqa: BLE001 - translated with the cause chained
        raise CheckpointError(f"the stored weights of module {plan.name!r} do not fit the {type(module).__name__} "
                              f"passed to load ({type(exc).__name__}: {_first_line(exc)}); construct the same model "
                              "(class and configuration) that was saved") from exc


def _first_line(exc: BaseException) -> str:
    """The message's first meaningful lines (load_state_dict puts the useful part on the second)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return " ".join(lines[:3])[:400]


def _install(root: Any, plan: _ModulePlan) -> Any:
    """Wrap (if needed) and mark tuned; returns the (possibly new) root."""
    from aitune.torch.module import Module

    entry = plan.entry
    wrapper = plan.target
    if isinstance(wrapper, Module) and entry.get("name") and wrapper.name != entry["name"]:
        logger.warning("aitune.load: the checkpoint's module %r is loaded into the wrapper named %r (found at the "
                       "same place in the model); check that this is the module you meant", entry["name"],
                       wrapper.name)
    if not isinstance(wrapper, Module):
        wrapper = Module(plan.target, name=entry.get("name"), max_samples=int(entry.get("max_samples", 8)))
        if plan.parent is None:
            root = wrapper
        else:
            _set_step(plan.parent, entry["path"][-1], wrapper)
    for alias in entry.get("aliases") or []:
        try:
            parent, value = _resolve_path(root, alias)
        except CheckpointError:
            continue
        if parent is not None and value is plan.target:
            _set_step(parent, alias[-1], wrapper)
    wrapper._self_recorder.graphs = {graph.key: graph for graph, _ in plan.dispatch.values()}
    wrapper._set_tuned(dict(plan.dispatch))
    wrapper._self_eager_fallback_error = plan.eager_fallback_error
    wrapper._self_tune_rows = {g.entry["name"]: g.entry.get("tune_row") for g in plan.graphs if g.entry.get("tune_row")}
    plan.wrapper = wrapper
    return root


def _drop_loaded_tensor_files(scratch: Path) -> None:
    """Weights and samples are in memory now; only the artifacts stay on disk."""
    for pattern in ("modules/*/weights.safetensors", "modules/*/graphs/*/samples.safetensors"):
        for file in scratch.glob(pattern):
            file.unlink(missing_ok=True)


# ============================================================================================ text helpers


def _member_sizes(path: Path) -> dict[str, int]:
    try:
        with zipfile.ZipFile(path) as zf:
            return {info.filename: info.file_size for info in zf.infolist()}
    except (zipfile.BadZipFile, OSError):
        return {}


def _size_text(size: int) -> str:
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

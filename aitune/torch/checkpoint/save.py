"""``ait.save``: every tuned wrapper of a model or pipeline into one ``.ait`` file."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from aitune.errors import AITuneError, CheckpointError, ConfigError
from aitune.torch.backend.base import BuildMode
from aitune.torch.checkpoint.archive import is_aitune_sums, publish, read_unverified, sums_path
from aitune.torch.checkpoint.manifest import (
    MANIFEST,
    base_manifest,
    finish_manifest,
    graph_entry,
    is_aitune_manifest,
    manifest_bytes,
    state_signature,
    weights_digest,
)
from aitune.torch.checkpoint.wrappers import WrapperEntry, find_wrappers, path_text
from aitune.torch.common.jsonsafe import json_safe
from aitune.torch.record.module_arguments import check_unique_names

logger = logging.getLogger(__name__)


def save(model_or_pipeline: Any, path: str | os.PathLike) -> Path:
    """Write every tuned :class:`~aitune.torch.Module` found in ``model_or_pipeline`` to one ``.ait`` file.

    The archive carries SHA-256 digests of its members (see NOTE [what the digests prove] in
    :mod:`aitune.torch.checkpoint.archive`): they let :func:`~aitune.torch.load` detect corruption and
    accidental changes, not tampering.

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
        CheckpointError: ``path`` or its sums file exists and is not an aitune checkpoint (nothing is written:
            only an earlier aitune checkpoint is replaced); no tuned wrapper found; an input constant that is not a JSON type (None, bool,
            int, float, str); a structure type defined inside a function (it cannot be found at load); a
            backend whose ``save`` fails or returns non-JSON metadata; weights that cannot be stored.
    """
    path = Path(path)
    check_replaceable(path)
    found = find_wrappers(model_or_pipeline)
    try:
        check_unique_names([entry.wrapper for entry in found], "ait.save")
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from exc
    tuned = []
    for entry in found:
        wrapper = entry.wrapper
        if wrapper.state.value != "tuned" or not wrapper.tuned_graphs():
            logger.warning("aitune.save: %s (at %s) is not tuned (state: %s%s); it is not saved",
                           wrapper.name, path_text(entry.path), wrapper.state.value,
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
        manifest = base_manifest(model_or_pipeline)
        for index, entry in enumerate(tuned):
            manifest["modules"].append(_save_module(index, entry, staging))
        finish_manifest(manifest)
        publish(path, staging, {MANIFEST: manifest_bytes(manifest)})
    logger.info("aitune.save: wrote %s (%d module(s), %d graph(s), %.1f MiB)", path, len(manifest["modules"]),
                sum(len(m["graphs"]) for m in manifest["modules"]), path.stat().st_size / 2**20)
    return path


def check_replaceable(path: Path) -> None:
    """Refuse to overwrite an archive or ``<stem>_sha256_sums.txt`` that aitune did not write.

    An archive is aitune's when it is a zip whose ``manifest.json`` has aitune's format (any version); a sums
    file when every line is ``<sha256 hex>  <member>`` and the manifest is listed.

    Raises:
        CheckpointError: naming the file and how to choose another path.
    """
    for target, ours in ((path, _is_aitune_archive), (sums_path(path), is_aitune_sums)):
        if (target.exists() or target.is_symlink()) and not ours(target):
            raise CheckpointError(
                f"ait.save would overwrite {target}, which is not an aitune checkpoint file; nothing was written. "
                "Choose another checkpoint name (ait.save(model, 'other.ait')) or another folder "
                f"(storage=LocalTorchStorage(base_folder=...)), or move {target} away if you mean to replace it")


def _is_aitune_archive(path: Path) -> bool:
    if path.is_symlink() or not path.is_file():
        return False
    try:
        data = read_unverified(path, MANIFEST)
    except CheckpointError:
        return False
    return data is not None and is_aitune_manifest(data)


def _save_module(index: int, entry: WrapperEntry, staging: Path) -> dict:
    """Stage one wrapper's artifacts, samples and (for JIT graphs) weights; return its manifest entry."""
    wrapper = entry.wrapper
    base = f"modules/{index}"
    graphs = []
    needs_weights = False
    rows = wrapper.tune_rows
    for graph, backend in wrapper.tuned_graphs():
        if not graph.samples:
            raise CheckpointError(f"{wrapper.name}/{graph.name} has no recorded samples; re-run ait.tune")
        needs_weights |= BuildMode(backend.build_mode) is BuildMode.JIT
        graph_base = f"{base}/graphs/{graph.name}"
        artifacts_dir = staging / graph_base / "artifacts"
        metadata = _save_backend(wrapper.name, graph.name, backend, artifacts_dir)
        artifacts = sorted(p.relative_to(artifacts_dir).as_posix() for p in artifacts_dir.rglob("*") if p.is_file())
        samples = _save_samples(graph, staging / graph_base / "samples.safetensors", f"{graph_base}/samples.safetensors")
        graphs.append(graph_entry(graph, backend, wrapper.name, base=graph_base, metadata=metadata,
                                  artifacts=artifacts, samples=samples, tune_row=rows.get(graph.name)))
    module = wrapper.module
    record: dict[str, Any] = {
        "path": entry.path,
        "path_text": path_text(entry.path),
        "aliases": entry.aliases,
        "name": wrapper.name,
        "class": f"{type(module).__module__}.{type(module).__qualname__}",
        "max_samples": wrapper.max_samples,
        "strategy": wrapper.strategy.describe() if wrapper.strategy is not None else None,
        "training": module.training,
        "state": state_signature(module),
        "runtime": json_safe(wrapper.stats),
        "weights": None,
        "weight_aliases": {},
        "graphs": graphs,
    }
    if needs_weights:
        record["weights"] = f"{base}/weights.safetensors"
        record["weight_aliases"], record["num_weight_tensors"] = _save_weights(
            module, staging / record["weights"], wrapper.name)
    else:
        record["weights_sha256"] = _carried_weights_digest(wrapper)
    return record


def _carried_weights_digest(wrapper) -> str | None:
    """The digest of the weights an AOT-only module's artifacts carry (``ait.load`` compares the target module
    with it); None when unknown: weights on ``meta`` (offloaded after tuning), changed since tuning (the
    artifacts hold the old ones), or changed by ``forward`` itself (a stateful graph)."""
    if wrapper.needs_retune is not None or any(graph.stateful for graph, _ in wrapper.tuned_graphs()):
        return None
    return weights_digest(wrapper.module)


def _save_backend(module_name: str, graph_name: str, backend, directory: Path) -> dict:
    """``backend.save(directory)``; its metadata checked to be plain JSON."""
    try:
        metadata = backend.save(directory)
    except AITuneError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{module_name}/{graph_name}: backend {backend.name} could not be saved: "
                              f"{type(exc).__name__}: {exc}") from exc
    try:
        return json.loads(json.dumps(metadata, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{module_name}/{graph_name}: backend {backend.name} returned metadata that is not "
                              f"plain JSON ({exc}); this is a bug in the backend") from exc


def _save_samples(graph, file: Path, member: str) -> dict:
    """The samples' tensors as safetensors (key ``"<sample>/<leaf>"``); constants live in the manifest."""
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

"""The tuning cache: AOT builds reused across ``tune()`` runs when nothing that matters changed.

An entry is keyed by sha256 over the canonical JSON of:

* the module fingerprint: class (module + qualname), sha256 of every parameter and buffer (name, dtype,
  shape and bytes), every submodule's ``training`` flag, class and plain public attributes (e.g.
  ``eps``, ``approximate``), and the source files of the non-torch classes in the module tree (a
  changed ``forward`` must not reuse an old artifact);
* the graph spec: input structure, tensor specs (dtype, min/max shape, axes, declared dims),
  constants, the recorded sample shapes and batch sizes (and, for quantizing backends, which calibrate
  on them, the sample values);
* the backend: registered name, class and ``config.key()`` (which already includes the torch version);
* library versions: aitune, torch, CUDA, and the backend's packages (``requirements.package_versions``);
* the device: type, and for CUDA the GPU name and capability, for CPU the model name and machine type.

Layout: ``<root>/<key[:2]>/<key>/entry.json`` + ``artifacts/`` (what ``Backend.save`` wrote). ``entry.json``
lists every artifact with its sha256; a hit re-hashes them and restores with ``Backend.from_checkpoint``.
An entry that fails that check or fails to restore is deleted and rebuilt, never trusted. Entries are
written to a temporary folder and renamed into place, so a crash never leaves a half-written entry.
JIT backends (eager, Inductor JIT, TorchAO) are never cached: their "build" is a compile that only lives
in this process.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import inspect
import json
import logging
import math
import os
import platform
import shutil
import sys
import time
import uuid
import weakref
from pathlib import Path
from typing import Any

import torch

from aitune import __version__
from aitune.errors import CheckpointError
from aitune.torch.backend.base import Backend, BackendState, BuildMode
from aitune.torch.common.environment import cpu_model_name
from aitune.torch.common.requirements import package_versions
from aitune.torch.common.files import check_files, digest_files
from aitune.torch.record.serialization import tree_spec_to_json

logger = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 1
ENTRY_FILE = "entry.json"
ARTIFACTS_DIR = "artifacts"


class BuildCache:
    """AOT builds stored under ``root`` and reused by :func:`aitune.torch.tune`.

    Args:
        root: cache folder (``tune()`` passes ``<cache dir>/builds``; ``AITUNE_CACHE_DIR`` sets the cache dir).
    """

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser()
        self._module_fingerprints: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()
        self._source_digests: dict[str, str] = {}

    # ---- the one entry point used by strategies
    def build(self, blueprint: Backend, module: torch.nn.Module, graph, device: torch.device | str,
              workdir: Path | str) -> tuple[Backend, bool]:
        """Build ``blueprint`` for ``graph``, or restore the same build from the cache.

        Returns:
            ``(backend, cached)``: an ACTIVE backend; ``cached`` is True when it was restored from the cache.

        Raises:
            BackendBuildError (and whatever :meth:`Backend.build` raises) when an actual build fails; cache
            problems (unreadable or corrupted entries, a failing store) are logged, never raised.
        """
        workdir = Path(workdir)
        if BuildMode(blueprint.build_mode) is not BuildMode.AOT:
            return blueprint.copy().build(module, graph, device, workdir), False
        try:
            key = self.key(blueprint, module, graph, device)
        except Exception as exc:  # noqa: BLE001 - an unkeyable build (e.g. meta weights) is just not cached
            logger.debug("tuning cache: %s not cacheable: %s", blueprint.describe(), exc, exc_info=True)
            return blueprint.copy().build(module, graph, device, workdir), False
        entry = self.entry_path(key)
        if entry.exists():
            restored = self._restore(entry, key, blueprint, module, graph, device, workdir)
            if restored is not None:
                return restored, True
        backend = blueprint.copy().build(module, graph, device, workdir)
        if backend.state is BackendState.ACTIVE:  # a background build is stored by store() once it finished
            self._store(entry, key, backend)
        return backend, False

    def store(self, blueprint: Backend, module: torch.nn.Module, graph, device, backend: Backend) -> None:
        """Store a build that finished later (a background build, see ``Backend.finish_build``); never raises."""
        if BuildMode(blueprint.build_mode) is not BuildMode.AOT:
            return
        try:
            key = self.key(blueprint, module, graph, device)
        except Exception:  # noqa: BLE001 - an unkeyable build is just not cached
            return
        self._store(self.entry_path(key), key, backend)

    def entry_path(self, key: str) -> Path:
        return self.root / key[:2] / key

    # ---- keys
    def key(self, blueprint: Backend, module: torch.nn.Module, graph, device: torch.device | str) -> str:
        """sha256 hex of everything that decides the build (see the module docstring)."""
        return _digest_json(self.key_material(blueprint, module, graph, device))

    def key_material(self, blueprint: Backend, module: torch.nn.Module, graph, device) -> dict:
        backend_class = type(blueprint)
        return {
            "cache_format": CACHE_FORMAT_VERSION,
            "module": self.module_fingerprint(module),
            "graph": graph_fingerprint(graph, include_values=bool(blueprint.is_quantizing)),
            "backend": {"name": blueprint.name, "class": f"{backend_class.__module__}.{backend_class.__qualname__}",
                        "config_key": blueprint.config.key()},
            "versions": {"aitune": __version__, "torch": torch.__version__, "cuda": torch.version.cuda,
                         **{k: str(v) for k, v in package_versions(blueprint).items()}},
            "device": device_key(device),
        }

    def module_fingerprint(self, module: torch.nn.Module) -> str:
        """Class, weights (bytes), training flags, plain attributes and class sources of ``module``.

        Memoised per module object for the life of this cache object (one ``tune()`` run), during which
        tuning restores the module's weights and flags after every candidate.
        """
        cached = self._module_fingerprints.get(module)
        if cached is not None:
            return cached
        hasher = hashlib.sha256()
        root_class = type(module)
        hasher.update(f"{root_class.__module__}.{root_class.__qualname__}\n".encode())
        tensors = list(module.named_parameters(remove_duplicate=False)) + list(
            module.named_buffers(remove_duplicate=False))
        for name, tensor in tensors:
            hasher.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
            hash_tensor(hasher, tensor)
        for name, submodule in module.named_modules(remove_duplicate=False):
            sub_class = type(submodule)
            attributes = {key: value for key, value in vars(submodule).items()
                          if not key.startswith("_") and _plain(value)}
            hasher.update(json.dumps([name, f"{sub_class.__module__}.{sub_class.__qualname__}", submodule.training,
                                      attributes], sort_keys=True, default=repr).encode())
            hasher.update(self._class_source_digest(sub_class).encode())
        fingerprint = hasher.hexdigest()
        self._module_fingerprints[module] = fingerprint
        return fingerprint

    def _class_source_digest(self, klass: type) -> str:
        module_name = klass.__module__
        if module_name == "torch" or module_name.startswith("torch."):
            return ""  # covered by the torch version
        if module_name not in self._source_digests:
            digest = ""
            try:
                source_file = inspect.getsourcefile(sys.modules[module_name])
                if source_file:
                    digest = hashlib.sha256(Path(source_file).read_bytes()).hexdigest()
            except (KeyError, TypeError, OSError):
                pass
            if not digest:  # defined interactively: fall back to the forward's bytecode
                forward = getattr(klass, "forward", None)
                code = getattr(forward, "__code__", None)
                digest = hashlib.sha256(code.co_code + repr(code.co_consts).encode()).hexdigest() if code else ""
            self._source_digests[module_name] = digest
        return self._source_digests[module_name]

    # ---- entries
    def _restore(self, entry: Path, key: str, blueprint: Backend, module, graph, device, workdir: Path) -> Backend | None:
        started = time.perf_counter()
        try:
            record = json.loads((entry / ENTRY_FILE).read_text())
            problem = _verify_entry(entry, record, key)
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            problem = f"unreadable {ENTRY_FILE} ({type(exc).__name__}: {exc})"
            record = {}
        if problem is None:
            try:
                backend = type(blueprint).from_checkpoint(entry / ARTIFACTS_DIR, copy.deepcopy(blueprint.config),
                                                          record.get("metadata") or {}, module, graph, device)
            except Exception as exc:  # noqa: BLE001 - a cache entry that does not restore is rebuilt
                problem = f"restoring it failed ({type(exc).__name__}: {exc})"
        if problem is not None:
            logger.warning("tuning cache: entry %s is corrupted or stale: %s; it is deleted and %s is rebuilt",
                           entry, problem, blueprint.describe())
            shutil.rmtree(entry, ignore_errors=True)
            return None
        backend.build_info.update(record.get("build_info") or {})
        backend.build_info.update({"build_s": time.perf_counter() - started, "cached": True,
                                   "cache_entry": str(entry), "original_build_s": record.get("build_s")})
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "build.log").write_text(
            f"{datetime.datetime.now().isoformat(timespec='seconds')} restored {blueprint.describe()} from the tuning "
            f"cache entry {entry} (key {key}, built {record.get('created_at')} in {record.get('build_s')} s)\n")
        logger.info("tuning cache: reused %s from %s", blueprint.describe(), entry)
        return backend

    def _store(self, entry: Path, key: str, backend: Backend) -> None:
        staging = self.root / f".tmp-{uuid.uuid4().hex}"
        try:
            metadata = backend.save(staging / ARTIFACTS_DIR)
            metadata = json.loads(json.dumps(metadata, allow_nan=False))
            artifacts = staging / ARTIFACTS_DIR
            files = digest_files(artifacts)
            build_info = {}
            for name, value in backend.build_info.items():
                if name in ("build_s", "cached", "cache_entry", "original_build_s"):
                    continue
                try:
                    build_info[name] = json.loads(json.dumps(value, allow_nan=False))
                except (TypeError, ValueError):
                    continue
            record = {"cache_format": CACHE_FORMAT_VERSION, "key": key, "backend": backend.name,
                      "config": backend.config.to_dict(), "metadata": metadata, "files": files,
                      "build_s": backend.build_info.get("build_s"), "build_info": build_info,
                      "created_at": datetime.datetime.now().isoformat(timespec="seconds")}
            (staging / ENTRY_FILE).write_text(json.dumps(record, indent=2, allow_nan=False))
            entry.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(staging, entry)
            except OSError:  # another process stored the same key first (or a stale folder is in the way)
                logger.debug("tuning cache: %s already exists; keeping it", entry)
                return
            logger.debug("tuning cache: stored %s in %s", backend.describe(), entry)
        except Exception as exc:  # noqa: BLE001 - caching never fails a build
            logger.warning("tuning cache: could not store %s (%s: %s); it will be rebuilt next time",
                           backend.describe(), type(exc).__name__, exc)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


# ============================================================================================ helpers


def graph_fingerprint(graph, include_values: bool = False) -> dict:
    """JSON-able identity of a graph for cache keys: structure, tensor specs, constants, sample shapes."""
    try:
        structure: Any = tree_spec_to_json(graph.input_spec)
    except CheckpointError:
        structure = repr(graph.input_spec)  # types that cannot be named still key by their repr
    specs = []
    for spec in graph.tensor_specs:
        specs.append({"path": spec.path, "leaf_index": spec.leaf_index, "dtype": str(spec.dtype),
                      "min": list(spec.min_shape), "max": list(spec.max_shape), "axes": list(spec.axes),
                      "dims": [None if d is None else [type(d).__name__, d.name, d.min, d.max, d.opt]
                               for d in spec.dims]})
    samples = []
    values = hashlib.sha256()
    for sample in graph.samples:
        leaves = sample.leaves()
        samples.append({"batch_size": sample.batch_size,
                        "shapes": [list(leaf.shape) for leaf in leaves if isinstance(leaf, torch.Tensor)],
                        "devices": sorted({leaf.device.type for leaf in leaves if isinstance(leaf, torch.Tensor)})})
        if include_values:
            for leaf in leaves:
                if isinstance(leaf, torch.Tensor):
                    hash_tensor(values, leaf)
    return {
        "structure": structure,
        "tensor_specs": specs,
        "constants": {path: [type(value).__qualname__, repr(value)] for path, value in graph.constants.items()},
        "samples": samples,
        "sample_values": values.hexdigest() if include_values else None,
        "training": graph.training,
        "mutated_inputs": list(graph.mutated_inputs),
    }


def device_key(device: torch.device | str) -> dict:
    """Device facts that invalidate a compiled artifact."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return {"type": "cuda", "name": torch.cuda.get_device_name(index),
                "capability": list(torch.cuda.get_device_capability(index))}
    if device.type == "cpu":
        return {"type": "cpu", "name": cpu_model_name(), "machine": platform.machine()}
    return {"type": device.type}


def hash_tensor(hasher, tensor: torch.Tensor) -> None:
    """Feed ``tensor``'s bytes (copied to the CPU, contiguous) to ``hasher``.

    Raises:
        ValueError: a tensor on the ``meta`` device (it has no data).
    """
    tensor = tensor.detach()
    if tensor.device.type == "meta":
        raise ValueError("tensor on the meta device has no data to fingerprint")
    if not tensor.numel():
        return
    data = tensor.to("cpu").contiguous().reshape(-1).view(torch.uint8)
    hasher.update(data.numpy().data)


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (tuple, list)):
        return all(_plain(item) for item in value)
    return False


def _digest_json(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=repr).encode()).hexdigest()


def _verify_entry(entry: Path, record: dict, key: str) -> str | None:
    """None when the entry is intact, else what is wrong with it."""
    if record.get("cache_format") != CACHE_FORMAT_VERSION:
        return f"cache format {record.get('cache_format')!r} (this aitune writes {CACHE_FORMAT_VERSION})"
    if record.get("key") != key:
        return "its key differs from its folder name"
    files = record.get("files")
    if not isinstance(files, dict):
        return f"{ENTRY_FILE} lists no files"
    return check_files(entry / ARTIFACTS_DIR, files)

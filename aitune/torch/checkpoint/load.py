"""``ait.load``: verify the archive, plan (:mod:`~aitune.torch.checkpoint.plan`), restore every graph's
backend, then install the wrappers in the user's object."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

import torch

from aitune.errors import CheckpointError, CheckpointIntegrityError, ConfigError, one_line
from aitune.torch.backend.eager import TorchEagerBackend
from aitune.torch.common.files import checkpoint_path, forget_extraction
from aitune.torch.checkpoint.manifest import read_manifest, weights_digest
from aitune.torch.checkpoint.plan import ModulePlan, plan_module, warn_differences
from aitune.torch.checkpoint.wrappers import replace_at, resolve_path
from aitune.torch.check.correctness import comparator_for
from aitune.torch.check.guard import guard_for, signature
from aitune.torch.module import Module
from aitune.torch.record.pytree import tree_unflatten
from aitune.torch.record.samples import GraphSpec, Sample, clone_tree
from aitune.torch.record.serialization import constant_from_json, moved_structure, tree_spec_from_json
from aitune.torch.record.signature import CallSignature

logger = logging.getLogger(__name__)


WEIGHTS_CHOICES = (None, "checkpoint", "module")


def check_weights_choice(weights: Any) -> str | None:
    """``weights`` of :func:`load`, validated.

    Raises:
        ConfigError: anything but None, ``"checkpoint"`` or ``"module"``.
    """
    if weights is not None and (not isinstance(weights, str) or weights not in WEIGHTS_CHOICES):
        raise ConfigError(f"weights must be None (the default), 'checkpoint' or 'module', got {weights!r}: "
                          "'checkpoint' runs the checkpoint's model (what its AOT artifacts carry), 'module' runs the "
                          "weights of the module you load into")
    return weights


def load(model_or_pipeline: Any, path: str | os.PathLike, device: str | torch.device | None = None,
         weights: str | None = None) -> Any:
    """Restore the tuned modules of a checkpoint into ``model_or_pipeline``; returns it TUNED.

    Every digest is verified before anything is deserialised (see NOTE [checkpoint safety] in
    :mod:`aitune.torch.checkpoint`). The digests detect corruption and accidental changes, not tampering:
    an Inductor AOT artifact is a compiled shared library that runs in this process, so load checkpoints
    only from sources you trust. Where the checkpoint has a wrapper and ``model_or_pipeline`` holds a plain
    ``nn.Module``, the module is wrapped in place (as :func:`aitune.torch.wrap` does); when that place is the
    root, the new wrapper is returned. Weights stored for JIT graphs are loaded into the module
    (``load_state_dict(strict=True)``); AOT graphs run their artifact, which carries the weights the module was
    tuned with, and never touch the module's weights.

    NOTE [one model per loaded module]: every call of a loaded module comes from one model. For a module
    whose checkpoint stores no weights (AOT-only), the module passed here is compared with the weights the
    artifacts carry (their sha256, ``weights_sha256`` in the manifest; for checkpoints without it, the
    module's outputs on a recorded sample within the tuned tolerance). The same weights: calls the artifacts
    do not take (other shapes, untuned structures) run the module eagerly. No weights (``meta``): such calls
    raise :class:`~aitune.errors.BackendRuntimeError`. Other weights (a freshly initialised model, or a
    fine-tuned copy) are two models, and ``weights`` chooses: ``"checkpoint"`` — the artifacts answer and
    calls they do not take raise (never this module's other weights); ``"module"`` — the module's own weights
    answer every call, eagerly (the artifacts are stale: :attr:`~aitune.torch.Module.needs_retune` says why;
    re-tune for speed); None — as ``"checkpoint"``, with a warning naming the module and both options.

    Args:
        model_or_pipeline: the same model/pipeline structure that was saved (freshly constructed: its
            classes must be importable and imported; for JIT graphs its parameters receive the stored
            weights).
        path: the ``.ait`` file.
        device: where to run; None chooses per module (see NOTE [checkpoint devices]).
        weights: whose weights answer when the module's differ from those the checkpoint was tuned with:
            ``"checkpoint"``, ``"module"`` or None (``"checkpoint"`` with a warning); see NOTE [one model per
            loaded module]. With ``"module"``, JIT graphs are rebuilt from the module's own weights too (the
            stored ones are not loaded).

    Returns:
        ``model_or_pipeline``, or the new wrapper when its root was wrapped.

    Raises:
        CheckpointIntegrityError: not a zip / truncated, a digest mismatch, an unsafe or unlisted member,
            a missing file or artifact, or a side sums file that disagrees with the archive.
        CheckpointVersionError: the checkpoint was written by a newer format version.
        CheckpointError: a structure type that is not imported here, a module path missing from
            ``model_or_pipeline``, weights that do not fit, an AOT artifact for another device type or
            GPU architecture, an unavailable backend, a backend that fails to restore (cause chained), or
            ``weights="module"`` for a module without weights (``meta``).
        ConfigError: ``weights`` is not None, ``"checkpoint"`` or ``"module"``.
    """
    weights = check_weights_choice(weights)
    path = Path(path)
    scratch = Path(tempfile.mkdtemp(prefix="aitune-checkpoint-"))
    keep_scratch = False
    try:
        manifest, sums = read_manifest(path, extract_to=scratch)
        plans = [plan_module(model_or_pipeline, entry, set(sums), device) for entry in manifest["modules"]]
        warn_differences(manifest, plans, path)
        if weights == "module":
            _refuse_modules_without_weights(plans)
        files = ExtractedFiles(scratch)
        for plan in plans:
            _restore_module(plan, files, weights, path)
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
            forget_extraction(scratch)
            shutil.rmtree(scratch, ignore_errors=True)


class ExtractedFiles:
    """A folder of files extracted from a checkpoint, deleted once nothing that uses it is alive.

    Restored backends read their artifacts from here (an ONNX model, an AOTInductor package); a backend
    that keeps using the files after ``from_checkpoint`` is registered with :meth:`keep_alive_while`.

    Args:
        root: the folder (deleted with its contents when this object and every registered user are gone,
            or at interpreter exit).
    """

    def __init__(self, root: Path):
        self.root = root
        self._finalizer = weakref.finalize(self, _delete, str(root))

    def keep_alive_while(self, user: object) -> None:
        """Keep the folder at least as long as ``user`` (e.g. a restored backend) is alive.

        NOTE [keeping extracted files]: ``weakref.finalize`` holds its arguments until ``user`` is collected;
        holding ``self`` there is the reference that keeps the folder, without an attribute on ``user``.
        """
        weakref.finalize(user, _release, self)


def _delete(root: str) -> None:
    forget_extraction(root)
    shutil.rmtree(root, ignore_errors=True)


def _release(files: ExtractedFiles) -> None:
    """Drops the last reference a collected user held (see NOTE [keeping extracted files])."""


def _refuse_modules_without_weights(plans: list[ModulePlan]) -> None:
    """``weights="module"`` runs the modules' own weights: refuse, before anything is touched, a module without."""
    for plan in plans:
        if _on_meta(plan.module):
            raise CheckpointError(
                f"module {plan.name!r}: weights='module' runs the weights of the module passed to ait.load, but it "
                "has none (meta tensors); build it with its weights (e.g. from_pretrained), or load with "
                "weights='checkpoint' to run the checkpoint's model")


def _on_meta(module: torch.nn.Module) -> bool:
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


def _restore_module(plan: ModulePlan, files: ExtractedFiles, weights: str | None, path: Path) -> None:
    entry = plan.entry
    module = plan.module
    if entry.get("weights"):
        where = f"the manifest's 'weights' of module {plan.name!r}"
        stored, aliases = checkpoint_path(files.root, entry["weights"], where), entry.get("weight_aliases") or {}
        if weights != "module":
            _load_weights(module, stored, aliases, plan)
        elif any(graph_plan.entry.get("build_mode") == "aot" for graph_plan in plan.graphs):
            difference = _stored_weights_difference(module, stored, aliases, plan)
            if difference is not None:
                plan.stale_reason = _stale_reason(difference)
    if module.training != bool(entry.get("training", module.training)):
        logger.warning("aitune.load: %s is in %s mode but was tuned in %s mode; tuned backends run only when the "
                       "modes agree (call .eval() / .train())", plan.name, "training" if module.training else "eval",
                       "training" if entry.get("training") else "eval")
    for graph_plan in plan.graphs:
        graph_entry = graph_plan.entry
        graph = _restore_graph(graph_entry, files.root, graph_plan.device, plan.name, module)
        where = f"{plan.name}/{graph.name}"
        artifacts = checkpoint_path(files.root, graph_entry["artifacts_dir"], f"{where}: the manifest's "
                                    "'artifacts_dir'", kind="dir")
        artifacts.mkdir(parents=True, exist_ok=True)
        for artifact in graph_entry.get("artifacts", []):
            missing = CheckpointIntegrityError(f"{where}: artifact {artifact!r} of backend "
                                               f"'{graph_entry['backend']}' is missing from the checkpoint")
            checkpoint_path(artifacts, artifact, f"{where}: an entry of the manifest's 'artifacts'", missing=missing)
        backend_class, config = graph_plan.backend_class, graph_plan.config
        if graph_plan.rebuild_as_eager:
            backend_class, config = TorchEagerBackend, TorchEagerBackend.config_class()
        try:
            with torch.no_grad():
                backend = backend_class.from_checkpoint(artifacts, config, graph_entry.get("metadata") or {}, module,
                                                        graph, graph_plan.device)
        except CheckpointIntegrityError:
            raise  # a stored file name that leaves the checkpoint: the message names the field already
        except Exception as exc:  # noqa: BLE001 - translated with the cause chained
            if graph_entry.get("build_mode") == "aot" or backend_class is TorchEagerBackend:
                raise CheckpointError(
                    f"{where}: restoring backend '{backend_class.name}' failed: {type(exc).__name__}: {exc}. It was "
                    f"saved on {graph_entry.get('device')}; load it in the environment it was saved in, or re-tune"
                ) from exc
            # NOTE [a JIT rebuild that fails at load]: a JIT backend recompiles the user's module where it is loaded,
            # so eager can answer for it, as for a JIT backend unavailable here (plan_module): the load goes on.
            logger.warning("aitune.load: %s: rebuilding backend '%s' failed here (%s); the graph runs eager. "
                           "Re-tune here for a backend that builds", where, backend_class.name, one_line(exc))
            with torch.no_grad():
                backend = TorchEagerBackend.from_checkpoint(artifacts, TorchEagerBackend.config_class(), {}, module,
                                                            graph, graph_plan.device)
            backend.build_info["rebuild_failed"] = f"{backend_class.name}: {one_line(exc)}"
        files.keep_alive_while(backend)
        backend.build_info.update({"restored_from_checkpoint": True})
        plan.dispatch[graph.key] = (graph, backend)
    if not entry.get("weights"):
        _choose_weights(module, plan, weights, path)


def _choose_weights(module: torch.nn.Module, plan: ModulePlan, weights: str | None, path: Path) -> None:
    """Whose weights answer the calls of an AOT-only module (NOTE [one model per loaded module] in :func:`load`).

    Sets ``plan.eager_fallback_error`` (calls the artifacts do not take raise: the module has no weights, or
    other ones and the checkpoint's model was chosen) or ``plan.stale_reason`` (``weights="module"``: the
    artifacts carry other weights, every call runs the module eagerly); neither when the weights agree.
    """
    if _on_meta(module):
        plan.eager_fallback_error = (
            f"{plan.name} was loaded from an AOT checkpoint into a module without weights (meta tensors), so "
            "calls its artifacts do not take cannot run eagerly; load into a module with its real weights "
            "(e.g. from_pretrained) to allow that")
        return
    difference = _weights_difference(module, plan)
    if difference is None:
        return
    if weights == "module":
        plan.stale_reason = _stale_reason(difference)
        return
    plan.eager_fallback_error = (
        f"{plan.name}'s weights differ from those the checkpoint was tuned with ({difference}) and its calls come "
        f"from the checkpoint's model (ait.load weights={weights!r}), so calls its AOT artifacts do not take "
        "(other shapes, untuned structures) cannot run this module's other weights; load with weights='module' to "
        "run the module's own weights, or into the model with the checkpoint's weights")
    if weights is None:
        logger.warning(
            "aitune.load: %s's weights differ from those %s was tuned with (%s). Its AOT artifacts carry the "
            "checkpoint's weights, so every call of the loaded module comes from the checkpoint's model, and calls "
            "the artifacts do not take (other shapes, untuned structures) raise instead of running this module's "
            "weights. Pass weights='checkpoint' to ait.load to choose this without the warning, or "
            "weights='module' to run this module's own weights (eagerly until re-tuned; needs_retune says so)",
            plan.name, path, difference)
    else:
        logger.info("aitune.load: %s's weights differ from the checkpoint's (%s); weights='checkpoint': its "
                    "artifacts answer, calls they do not take raise", plan.name, difference)


def _stale_reason(difference: str) -> str:
    return (f"the module's weights differ from those the checkpoint was tuned with ({difference}; ait.load "
            "weights='module')")


def _weights_difference(module: torch.nn.Module, plan: ModulePlan) -> str | None:
    """How ``module``'s weights differ from those the AOT artifacts carry, or None when they agree.

    With the digest stored at save (``weights_sha256``) the comparison is exact. Checkpoints without it (saved
    before it was stored, or whose weights were unknown at save) use NOTE [eager fallback after load].
    """
    saved = plan.entry.get("weights_sha256")
    if saved:
        current = weights_digest(module)
        if current == saved:
            return None
        return f"weights sha256 {current[:12]}… here, {saved[:12]}… in the checkpoint"
    return _eager_fallback_problem(module, plan)


def _stored_weights_difference(module: torch.nn.Module, file: Path, aliases: dict, plan: ModulePlan) -> str | None:
    """The first ``state_dict`` entry of ``module`` that differs from the checkpoint's stored weights, or None."""
    from safetensors.torch import load_file

    stored = load_file(str(file), device="cpu")
    for alias, canonical in aliases.items():
        if canonical not in stored:
            raise CheckpointIntegrityError(f"module {plan.name!r}: weight alias {alias!r} points to missing "
                                           f"{canonical!r}")
        stored[alias] = stored[canonical]
    for name, value in module.state_dict().items():
        if not isinstance(value, torch.Tensor):
            continue
        saved = stored.get(name)
        if saved is None or saved.dtype != value.dtype or not torch.equal(value.detach().to("cpu"), saved):
            return f"'{name}' differs from the stored one"
    return None


def _eager_fallback_problem(module: torch.nn.Module, plan: ModulePlan) -> str | None:
    """Does ``module`` reproduce the AOT artifacts' outputs? None when it does, else how it does not.

    NOTE [eager fallback after load]: for a checkpoint without the weights' digest, we run the module once
    per graph on a recorded sample and compare with the artifact under the tolerance the graph was tuned with
    (the default ``Tolerance()`` for checkpoints that predate storing it); if they disagree, its weights
    differ from the tuned ones.
    """
    tolerances = {graph_plan.entry.get("name"): graph_plan.tolerance for graph_plan in plan.graphs}
    for graph, backend in plan.dispatch.values():
        if not graph.samples:
            continue
        try:
            with torch.no_grad():
                inputs = graph.samples[0].clone()
                expected = clone_tree(backend.infer(*inputs.args, **inputs.kwargs))
                inputs = graph.samples[0].clone()
                actual = module(*inputs.args, **inputs.kwargs)
            comparator_for(backend, tolerances[graph.name]).compare(expected, actual)
        except Exception as exc:  # noqa: BLE001
            return (f"it does not reproduce {graph.name}'s tuned outputs: {type(exc).__name__}: "
                    f"{str(exc).splitlines()[0][:160]}")
    return None


def _restore_graph(entry: dict, root: Path, device: torch.device, module_name: str,
                   module: torch.nn.Module) -> GraphSpec:
    where = f"{module_name}/{entry.get('name')}"
    samples = _restore_samples(entry, root, device, where)
    output_spec = None
    if entry.get("output_structure") is not None:
        try:
            output_spec = tree_spec_from_json(entry["output_structure"])
        except CheckpointError:
            if entry.get("build_mode") == "aot":
                raise
            logger.debug("%s: output structure not restored (JIT backends rebuild it)", where, exc_info=True)
    # The signature normalises direct backend calls, as the Recorder sets it.
    return GraphSpec.from_json(entry, samples, CallSignature(module.forward), output_spec=output_spec)


def _restore_samples(entry: dict, root: Path, device: torch.device, where: str) -> list[Sample]:
    """The recorded samples: tensors from the samples file, constants from the manifest, in the input structure.

    Tensors recorded on the saved graph's device go to ``device``; others (e.g. CPU inputs of a CUDA graph)
    back to the device type they were recorded on.
    """
    from safetensors.torch import load_file

    input_spec = tree_spec_from_json(entry["input_structure"])
    count = input_spec.num_leaves
    saved_type = torch.device(entry.get("device", "cpu")).type
    if torch.device(device).type != saved_type:  # a cache's context names the device it was recorded on
        input_spec = moved_structure(input_spec, saved_type, torch.device(device))
    tensor_leaves = [(int(spec["leaf_index"]), spec.get("device", saved_type)) for spec in entry["tensor_specs"]]
    constants = {int(c["leaf_index"]): constant_from_json(c["value"]) for c in entry["constants"]}
    if any(not 0 <= index < count for index, _ in tensor_leaves) or any(not 0 <= i < count for i in constants):
        raise CheckpointError(f"{where}: leaf indices in the checkpoint do not fit its input structure")
    samples_entry = entry["samples"]
    stored, sizes = samples_entry.get("count"), samples_entry.get("batch_sizes")
    if type(stored) is not int or not isinstance(sizes, list) or len(sizes) != stored:
        raise CheckpointError(f"{where}: the manifest's 'samples' count ({stored!r}) and batch_sizes ({sizes!r}) "
                              "disagree: the checkpoint was edited or damaged; save it again")
    tensors = load_file(str(checkpoint_path(root, samples_entry["file"], f"{where}: the manifest's 'samples.file'")),
                        device="cpu")
    samples = []
    for sample_index in range(int(samples_entry["count"])):
        leaves: list[Any] = [None] * count
        for index, value in constants.items():
            leaves[index] = value
        for leaf_index, leaf_device_type in tensor_leaves:
            key = f"{sample_index}/{leaf_index}"
            if key not in tensors:
                raise CheckpointIntegrityError(f"{where}: sample tensor {key!r} is missing from the checkpoint")
            leaf_device = device if leaf_device_type == saved_type else torch.device(leaf_device_type)
            leaves[leaf_index] = tensors[key].to(leaf_device)
        args, kwargs = tree_unflatten(input_spec, leaves)
        samples.append(Sample(tuple(args), dict(kwargs), samples_entry["batch_sizes"][sample_index]))
    if not samples:
        raise CheckpointError(f"{where}: the checkpoint holds no samples for this graph")
    return samples


def _load_weights(module: torch.nn.Module, file: Path, aliases: dict, plan: ModulePlan) -> None:
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
                              f"passed to load ({one_line(exc, 400, lines=3)}); construct the same model "
                              "(class and configuration) that was saved") from exc


def _install(root: Any, plan: ModulePlan) -> Any:
    """Wrap (if needed) and mark tuned; returns the (possibly new) root."""
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
            replace_at(plan.parent, entry["path"][-1], wrapper)
    for alias in entry.get("aliases") or []:
        try:
            parent, value = resolve_path(root, alias)
        except CheckpointError:
            continue
        if parent is not None and value is plan.target:
            replace_at(parent, alias[-1], wrapper)
    rows = {g.entry["name"]: g.entry.get("tune_row") for g in plan.graphs if g.entry.get("tune_row")}
    wrapper.install_tuned(list(plan.dispatch.values()), eager_fallback_error=plan.eager_fallback_error,
                          tune_rows=rows)
    # The guard re-runs eager: only where eager is the artifacts' model.
    if plan.eager_fallback_error is None and plan.stale_reason is None:
        tolerances = {g.entry["name"]: g.tolerance for g in plan.graphs}
        for graph, backend in plan.dispatch.values():
            checked = {signature(sample.leaves()) for sample in graph.samples}
            wrapper.arm_guard(graph, guard_for(wrapper.guard_config, graph, backend, tolerances[graph.name],
                                               rows.get(graph.name), checked))
    wrapper.watch_state(stale=plan.stale_reason)
    return root


def _drop_loaded_tensor_files(scratch: Path) -> None:
    """Weights and samples are in memory now; only the artifacts stay on disk."""
    for pattern in ("modules/*/weights.safetensors", "modules/*/graphs/*/samples.safetensors"):
        for file in scratch.glob(pattern):
            file.unlink(missing_ok=True)

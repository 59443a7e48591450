"""What the backend contract suite runs on: the candidates, the model and its inputs, the tuned runs.

Shared by ``test_backend_contract.py``, ``conftest.py`` (one :class:`ContractRuns` per session, so a
per-backend file can check something of its own on a contract build instead of compiling another model)
and ``fresh_process_load.py`` (the one script that loads checkpoints in a fresh process).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import pytest
import torch

import aitune.torch as ait
from aitune.torch.backend import (
    Backend,
    BuildMode,
    KernelSelectorBackend,
    KernelSelectorBackendConfig,
    ONNXRuntimeBackend,
    registered_backends,
)
from aitune.torch.record.samples import record_graphs
from fresh_process_load import run_fresh_process

# Recorded (batch, length) shapes: batch axis in [2, 4], length axis in [5, 9].
RECORDED_SHAPES = ((2, 5), (4, 9), (3, 7))
# Never recorded, inside both ranges: a backend must take them and match eager.
UNSEEN_SHAPES = ((2, 9), (4, 5), (3, 6))
# Outside a range (batch 5, length 10): AOT artifacts refuse them (accepts() is False); never run here, so
# that JIT backends are not made to recompile.
OUTSIDE_SHAPES = ((5, 6), (2, 10))
MODEL = "case_models:AttentionPool"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One parameter of the suite: a backend configuration, named ``id`` in test ids."""

    id: str
    make: Callable[[], Backend]

    def backend(self) -> Backend:
        return self.make()


def builtin_backends() -> dict[str, type[Backend]]:
    """Registered backends that aitune itself defines (test doubles register too; they are not candidates)."""
    return {name: cls for name, cls in registered_backends().items() if cls.__module__.startswith("aitune.")}


# NOTE [extra contract configs]: every backend runs with its default config. The kernel selector takes
# its build mode from its delegate; its default delegate (Inductor JIT) covers the JIT path, and ONNX
# Runtime (which runs here) covers the AOT one: the plan baked into an artifact that loads without the module.
# That extra config times each kernel briefly: which kernel wins does not matter to the contract.
EXTRA_CONFIGS: dict[str, list[Candidate]] = {
    "kernel_selector": [Candidate("kernel_selector+onnxruntime", lambda: KernelSelectorBackend(
        KernelSelectorBackendConfig(time_budget_s=0.05, warmup_rounds=1), delegate_backend=ONNXRuntimeBackend()))],
}


def candidates() -> list[Candidate]:
    result = []
    for name, backend_class in builtin_backends().items():
        result.append(Candidate(name, backend_class))
        result.extend(EXTRA_CONFIGS.get(name, []))
    return result


# ---------------------------------------------------------------------------------------------- model


def make_model(seed: int = 0) -> torch.nn.Module:
    """The contract model (``tests/case_models.py``), its weights drawn from ``seed``, in eval mode."""
    import importlib

    module_name, class_name = MODEL.split(":")
    torch.manual_seed(seed)
    return getattr(importlib.import_module(module_name), class_name)().eval()


def model_inputs(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [batch, length, 8] float32 and mask [batch, length] float32 (1 = keep), drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randn(batch, length, 8, generator=generator)
    mask = (torch.rand(batch, length, generator=generator) > 0.3).float()
    return tokens, mask


def recorded_inputs() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [model_inputs(batch, length, seed=index + 1) for index, (batch, length) in enumerate(RECORDED_SHAPES)]


def unseen_inputs() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {f"unseen_{b}x{t}": model_inputs(b, t, seed=100 + b * 10 + t) for b, t in UNSEEN_SHAPES}


def outside_inputs() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {f"outside_{b}x{t}": model_inputs(b, t, seed=200 + b * 10 + t) for b, t in OUTSIDE_SHAPES}


# ---------------------------------------------------------------------------------------------- outputs


def flatten_output(value: Any, path: str = "output") -> tuple[dict[str, torch.Tensor], Any]:
    """Split an output pytree into its tensors by path and a JSON-able description of everything else.

    Returns:
        ``(tensors, structure)``: ``tensors`` maps ``output.features`` / ``output.extra.stats.0`` to the
        leaf tensors (contiguous copies); ``structure`` names every container type (``module.qualname``)
        and holds the constant leaves, so two outputs have the same structure iff the descriptions are equal.
    """
    tensors: dict[str, torch.Tensor] = {}

    def visit(node: Any, where: str) -> Any:
        if isinstance(node, torch.Tensor):
            tensors[where] = node.detach().contiguous().clone()
            return {"tensor": where, "dtype": str(node.dtype).removeprefix("torch."), "device": node.device.type}
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            return {"type": f"{type(node).__module__}.{type(node).__qualname__}",
                    "fields": {field.name: visit(getattr(node, field.name), f"{where}.{field.name}")
                               for field in dataclasses.fields(node)}}
        if isinstance(node, dict):
            return {"type": "dict", "items": {str(key): visit(item, f"{where}.{key}") for key, item in node.items()}}
        if isinstance(node, (tuple, list)):
            return {"type": type(node).__name__, "items": [visit(item, f"{where}.{i}") for i, item in enumerate(node)]}
        if node is None or isinstance(node, (bool, int, float, str)):
            return {"constant": node}
        raise TypeError(f"{where}: unexpected output leaf {type(node).__name__}")

    return tensors, visit(value, path)


# ---------------------------------------------------------------------------------------------- tuned runs


def module_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by name, tied ones under every name."""
    return dict(list(module.named_parameters(remove_duplicate=False)) +
                list(module.named_buffers(remove_duplicate=False)))


@dataclasses.dataclass
class ModuleSnapshot:
    """A module's parameters and buffers (the objects, clones of their values, their version counters) and
    every submodule's ``training`` flag.

    NOTE [the module after the build]: ``ait.tune`` puts back any parameter, buffer or ``training`` flag that
    changed while tuning, which would hide a build that writes into the user's module. A tensor's
    version counter (``Tensor._version``) counts every in-place write, the putting back included, so a
    build that writes into a parameter or buffer stays visible after tuning; a replaced parameter is a
    different object. A ``training`` flag flipped and put back is not visible: the flags are compared as
    the user sees them.
    """

    objects: dict[str, torch.Tensor]
    values: dict[str, torch.Tensor]
    versions: dict[str, int]
    training: dict[str, bool]

    @classmethod
    def take(cls, module: torch.nn.Module) -> "ModuleSnapshot":
        tensors = module_tensors(module)
        return cls(objects=tensors, values={name: value.detach().clone() for name, value in tensors.items()},
                   versions={name: value._version for name, value in tensors.items()},
                   training={name: sub.training for name, sub in module.named_modules(remove_duplicate=False)})

    def differences(self, module: torch.nn.Module) -> list[str]:
        """What differs in ``module`` from this snapshot, one line per difference (empty: bit-identical)."""
        tensors = module_tensors(module)
        problems = [f"{name}: added or removed" for name in set(tensors) ^ set(self.objects)]
        for name in sorted(set(tensors) & set(self.objects)):
            value, before = tensors[name], self.values[name]
            if value is not self.objects[name]:
                problems.append(f"{name}: replaced by another tensor")
            elif value._version != self.versions[name]:
                problems.append(f"{name}: written in place ({value._version - self.versions[name]} write(s))")
            if type(value.detach()) is not type(before) or value.dtype != before.dtype or \
                    value.device != before.device or not torch.equal(value.detach(), before):
                problems.append(f"{name}: value, dtype, device or type changed")
        training = {name: sub.training for name, sub in module.named_modules(remove_duplicate=False)}
        if training != self.training:
            problems.append(f"training flags changed: {training} != {self.training}")
        return problems


def skip_reason(backend: Backend, model: torch.nn.Module, graph) -> str | None:
    """Why ``backend`` cannot run here (its availability(), then supports() on CPU), or None."""
    available = backend.availability()
    if not available.ok:
        return f"{backend.name} is unavailable: {available.reason}"
    supported = backend.supports(model, graph, torch.device("cpu"))
    if not supported.ok:
        return f"{backend.name} cannot build this model on CPU: {supported.reason}"
    return None


FAST = ait.ProfilingConfig(warmup_rounds=1, warmup_s=0.0, min_rounds=3, max_rounds=5, time_budget_s=0.05)
CHILD_SEED = 123  # the fresh process builds the model with other weights than the tuned ones


@dataclasses.dataclass
class ContractRun:
    """One candidate forced through the public API on the contract model (its one build), then saved.

    Attributes:
        wrapper: the ``ait.Module`` around ``model``; backend: the backend it runs (``wrapper.backends``).
        report: what ``ait.tune`` returned. module_before: the model before tuning (:class:`ModuleSnapshot`).
        dataset / dataset_before: the items given to ``ait.tune`` and clones taken before.
        probes: in-range inputs by name (the recorded ones, then unseen shapes); before_save: the wrapper's
            outputs on them, flattened (:func:`flatten_output`). load_request: what the fresh process loads.
    """

    candidate: Candidate
    model: torch.nn.Module
    wrapper: Any
    backend: Backend
    report: Any
    module_before: ModuleSnapshot
    dataset: list
    dataset_before: list
    probes: dict
    before_save: dict
    load_request: dict


class ContractRuns:
    """Tunes each candidate once, lazily; loads the saved checkpoints in fresh processes, in batches.

    A candidate that cannot run here is remembered with its reason and skipped by every test that needs it.
    """

    def __init__(self, tmp_path_factory: pytest.TempPathFactory):
        self._tmp_path_factory = tmp_path_factory
        self._candidates = {candidate.id: candidate for candidate in candidates()}
        self._runs: dict[str, ContractRun | str] = {}
        self._loaded: dict[str, tuple[dict, dict]] = {}

    def get(self, candidate_id: str) -> ContractRun:
        if candidate_id not in self._runs:
            self._runs[candidate_id] = self._tune(self._candidates[candidate_id])
        run = self._runs[candidate_id]
        if isinstance(run, str):
            pytest.skip(run)
        return run

    def loaded(self, candidate_id: str) -> tuple[dict, dict]:
        """What the fresh process computed from ``candidate_id``'s checkpoint: ``(result, outputs)``.

        NOTE [one fresh process]: importing torch, aitune and the optional packages takes a few seconds;
        the first call loads every checkpoint saved so far in one fresh process (each checkpoint on its
        own, its errors reported separately), later calls reuse what it wrote.
        """
        run = self.get(candidate_id)
        if candidate_id not in self._loaded:
            pending = [r for r in self._runs.values()
                       if isinstance(r, ContractRun) and r.candidate.id not in self._loaded]
            directory = self._tmp_path_factory.mktemp("fresh-process")
            results, outputs = run_fresh_process([r.load_request for r in pending], directory)
            for pending_run in pending:
                prefix = f"{pending_run.candidate.id}|"
                self._loaded[pending_run.candidate.id] = (
                    results[pending_run.candidate.id],
                    {key[len(prefix):]: value for key, value in outputs.items() if key.startswith(prefix)})
        return self._loaded[run.candidate.id]

    def _tune(self, candidate: Candidate) -> ContractRun | str:
        blueprint = candidate.backend()
        model = make_model(seed=0)
        [graph] = record_graphs(make_model(seed=0), [(inputs, {}) for inputs in recorded_inputs()])
        reason = skip_reason(blueprint, model, graph)
        if reason is not None:
            return reason
        root = self._tmp_path_factory.mktemp(f"contract-{candidate.id}")
        module_before = ModuleSnapshot.take(model)
        strategy = ait.OneBackendStrategy(blueprint, profiling_config=FAST).enable_performance_validation(False)
        wrapper = ait.Module(model, f"contract_{candidate.id}", strategy=strategy)
        dataset = recorded_inputs()
        dataset_before = [tuple(tensor.clone() for tensor in item) for item in dataset]
        report = ait.tune(wrapper, dataset, cache_dir_path=root / "cache", use_cache=False,
                          ignore_failing_modules=False, ready_batches=True)
        [backend] = wrapper.backends.values()

        probes = {f"sample_{i}": item for i, item in enumerate(recorded_inputs())} | unseen_inputs()
        with torch.no_grad():
            before_save = {name: flatten_output(wrapper(tokens.clone(), mask.clone()))
                           for name, (tokens, mask) in probes.items()}
        load_request = {"id": candidate.id, "checkpoint": str(ait.save(wrapper, root / "contract.ait")),
                        "seed": CHILD_SEED, "probes": list(probes), "refused_probes": list(outside_inputs()),
                        "inputs": str(root / "inputs.safetensors")}
        if backend.build_mode is BuildMode.AOT:  # an AOT artifact also loads on its own, without module or graph
            metadata = backend.save(root / "backend")
            load_request["backend_checkpoint"] = {"directory": str(root / "backend"), "backend": backend.name,
                                                  "config": backend.config.to_dict(), "metadata": metadata}
        from safetensors.torch import save_file

        save_file({f"{name}.{part}": tensor for name, item in (probes | outside_inputs()).items()
                   for part, tensor in zip(("tokens", "mask"), item)}, load_request["inputs"])
        return ContractRun(candidate, model, wrapper, backend, report, module_before, dataset, dataset_before,
                           probes, before_save, load_request)

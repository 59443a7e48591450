"""The backend contract (docs/design.md §3), checked the same way for every registered backend on CPU.

Parameters: every backend aitune registers, with its default config, plus the extra configs of
``contract_support.EXTRA_CONFIGS``. A backend that cannot run here is skipped with its ``availability()``
(or ``supports()``) reason, never faked.

Each candidate is built once, through the public API: ``ait.Module(model, strategy=OneBackendStrategy(...))``
+ ``ait.tune`` (``conftest.contract_runs``). The checks then use that build: the backend that runs is the
one forced (so nothing compares eager with eager), its outputs match eager on the recorded samples and on
unseen in-range shapes, the module and the samples are unchanged (see NOTE [the module after the build] in
contract_support.py), it deactivates and comes back, and ``ait.save`` -> ``ait.load`` in a fresh process
(``fresh_process_load.py``, one process for every checkpoint, run last) gives the same outputs.

The model is ``case_models.AttentionPool``: two inputs with dynamic batch and length, Linear layers, one SDPA
call, a buffer, and a dataclass output holding a dict, a tuple and a constant.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from typing import Any

import pytest
import torch

import aitune.torch as ait
from aitune.errors import BackendStateError, BackendUnavailableError, ConfigError, ToleranceExceededError
from aitune.torch.backend import (
    Backend,
    BackendConfig,
    BackendState,
    BuildMode,
    Check,
    TorchEagerBackendConfig,
    TorchInductorJitBackendConfig,
)
from aitune.torch.check.correctness import OutputComparator, Tolerance
from aitune.torch.record.samples import record_graphs
from contract_support import (
    EXTRA_CONFIGS,
    Candidate,
    ContractRun,
    builtin_backends,
    candidates,
    make_model,
    outside_inputs,
    recorded_inputs,
    unseen_inputs,
)

CANDIDATES = candidates()
# The same artifact, reloaded or recompiled from the same weights, computes the same numbers.
SAME_OUTPUTS = Tolerance(atol=1e-6, rtol=1e-6, low_precision_atol=1e-6, low_precision_rtol=1e-6)


@pytest.fixture(scope="module", params=CANDIDATES, ids=[candidate.id for candidate in CANDIDATES])
def candidate(request) -> Candidate:
    return request.param


@pytest.fixture(scope="module")
def run(candidate, contract_runs) -> ContractRun:
    return contract_runs.get(candidate.id)


@pytest.fixture(scope="module")
def reference_model() -> torch.nn.Module:
    """An untouched contract model: eager outputs never depend on what a build did to its own module."""
    return make_model(seed=0)


def eager(model: torch.nn.Module, tokens: torch.Tensor, mask: torch.Tensor) -> Any:
    with torch.no_grad():
        return model(tokens.clone(), mask.clone())


def comparator_for(backend: Backend) -> OutputComparator:
    """Quantizing backends are judged by SQNR/cosine floors, the others by atol/rtol
    (docs/design.md, Correctness rules)."""
    return OutputComparator(Tolerance(), quantized=backend.is_quantizing)


# ---------------------------------------------------------------------------------------------- parameters


def test_every_builtin_backend_is_a_candidate():
    names = builtin_backends()
    assert {"eager", "inductor_jit", "inductor_aot", "onnxruntime", "torchao", "tensorrt", "torch_tensorrt_jit",
            "torch_tensorrt_aot", "kernel_selector"} <= set(names)
    assert set(EXTRA_CONFIGS) <= set(names)
    ids = [candidate.id for candidate in CANDIDATES]
    assert len(ids) == len(set(ids)) and set(names) <= set(ids)


# ---------------------------------------------------------------------------------------------- 1. availability


def test_availability_is_reported_with_the_fix(candidate, tmp_path):
    backend = candidate.backend()
    check = type(backend).availability()
    assert isinstance(check, Check) and check == type(backend).availability()  # cached, stable
    if check.ok:
        return
    assert "pip install 'aitune[" in check.reason, check.reason
    model = make_model(seed=0)
    [graph] = record_graphs(model, [(recorded_inputs()[0], {})])
    with pytest.raises(BackendUnavailableError) as info:
        backend.build(model, graph, "cpu", tmp_path)
    assert str(info.value) == f"Backend '{backend.name}' is unavailable: {check.reason}"
    assert backend.state is BackendState.INIT


# ---------------------------------------------------------------------------------------------- 5. public API


def test_tune_runs_the_forced_backend(candidate, run, reference_model):
    wrapper, backend = run.wrapper, run.backend
    assert not run.report.module_errors
    assert wrapper.state is ait.ModuleState.TUNED
    [graph] = wrapper.graphs
    expected = candidate.backend()
    assert {name: chosen.name for name, chosen in wrapper.backends.items()} == {graph.name: expected.name}
    assert type(backend) is type(expected) and backend.describe() == expected.describe()
    assert run.report.selected(wrapper.name, graph.name) == backend.describe()
    # Calls through the wrapper reach that backend (it accepts them) and match eager.
    comparator = comparator_for(backend)
    for tokens, mask in unseen_inputs().values():
        assert backend.accepts([tokens, mask])
        with torch.no_grad():
            comparator.compare(eager(reference_model, tokens, mask), wrapper(tokens.clone(), mask=mask.clone()))


# ---------------------------------------------------------------------------------------------- 7. config


def test_config_round_trips_and_refuses_unknown_types(candidate):
    config = candidate.backend().config
    payload = json.loads(json.dumps(config.to_dict()))
    assert payload["type"] == type(config).__name__ and isinstance(payload["version"], int)
    for restored in (BackendConfig.from_dict(payload), type(config).from_dict(payload)):
        assert type(restored) is type(config)
        assert restored == config and restored.key() == config.key()
    with pytest.raises(ConfigError, match="unknown backend config type"):
        type(config).from_dict({"type": "os.system", "version": 1, "data": {}})
    other = (TorchInductorJitBackendConfig() if isinstance(config, TorchEagerBackendConfig)
             else TorchEagerBackendConfig())
    with pytest.raises(ConfigError, match="unknown backend config type"):
        type(config).from_dict(other.to_dict())



def test_settings_given_as_keywords_name_the_config_form(candidate):
    backend_class = type(candidate.backend())
    field = dataclasses.fields(backend_class.config_class)[0]
    value = getattr(backend_class.config_class(), field.name)
    with pytest.raises(ConfigError, match=re.escape(f"write {backend_class.__name__}("
                                                    f"{backend_class.config_class.__name__}({field.name}={value!r}))")):
        backend_class(**{field.name: value})
    with pytest.raises(ConfigError, match="unknown keyword.*'confg'.*go in a"):
        backend_class(confg=1)
    assert type(backend_class()) is backend_class  # the plain forms still work
    assert copy.deepcopy(backend_class()).config == backend_class().config


# ---------------------------------------------------------------------------------------------- 2. values


def test_outputs_match_eager_on_samples_and_unseen_shapes(run, reference_model):
    backend = run.backend
    comparator = comparator_for(backend)
    exact = OutputComparator(Tolerance(atol=0.0, rtol=0.0))
    differs = False
    [graph] = run.wrapper.graphs
    calls = [((sample.args, sample.kwargs), sample.leaves()) for sample in (s.clone() for s in graph.samples)]
    assert len(calls) == len(recorded_inputs())
    # unseen shapes go in with mask as a keyword: positional and keyword calls are the same call
    calls += [(((tokens,), {"mask": mask}), [tokens, mask]) for tokens, mask in unseen_inputs().values()]
    for (args, kwargs), (tokens, mask) in calls:
        expected = eager(reference_model, tokens, mask)
        output = backend(*args, **kwargs)
        assert type(output) is type(expected)
        comparator.compare(expected, output)
        try:
            exact.compare(expected, output)
        except ToleranceExceededError:
            differs = True
    if backend.is_quantizing:
        result = comparator.result()
        assert result.min_sqnr_db >= Tolerance().min_sqnr_db and result.min_cosine >= Tolerance().min_cosine
        assert differs, "a quantizing backend matched eager bit for bit: nothing was quantized"


def test_accepts_shapes_in_range_and_aot_refuses_the_others(run):
    backend = run.backend
    for tokens, mask in recorded_inputs() + list(unseen_inputs().values()):
        assert backend.accepts([tokens, mask]), tuple(tokens.shape)
    if backend.build_mode is BuildMode.AOT:  # outside the artifact's range the Module runs eager
        for tokens, mask in outside_inputs().values():
            assert not backend.accepts([tokens, mask]), tuple(tokens.shape)


# ---------------------------------------------------------------------------------------------- 3. untouched


def test_build_leaves_module_and_samples_unchanged(run):
    assert run.module_before.differences(run.model) == []
    for item, item_before in zip(run.dataset, run.dataset_before, strict=True):  # the caller's tensors
        assert all(torch.equal(tensor, before) for tensor, before in zip(item, item_before, strict=True))
    [graph] = run.wrapper.graphs  # the recorded samples every build was fed
    recorded = {tuple(leaf.shape for leaf in sample.leaves()): sample.leaves() for sample in graph.samples}
    assert len(recorded) == len(run.dataset_before)
    for item in run.dataset_before:
        leaves = recorded[tuple(tensor.shape for tensor in item)]
        assert all(torch.equal(leaf, tensor) for leaf, tensor in zip(leaves, item, strict=True))


def test_build_writes_its_log_and_runs_once(run):
    backend = run.backend
    assert backend.state is not BackendState.INIT
    assert (backend.workdir / "build.log").is_file()
    with pytest.raises(BackendStateError, match="runs once"):
        backend.build(run.model, backend.graph, "cpu", backend.workdir)
    assert run.module_before.differences(run.model) == []


# ---------------------------------------------------------------------------------------------- 4. lifecycle


def test_deactivate_then_call_reactivates(run):
    backend = run.backend
    tokens, mask = next(iter(unseen_inputs().values()))
    before = backend(tokens, mask)
    backend.deactivate()
    assert backend.state is BackendState.INACTIVE
    after = backend(tokens, mask)
    assert backend.state is BackendState.ACTIVE
    OutputComparator(SAME_OUTPUTS).compare(before, after)


# ---------------------------------------------------------------------------------------------- 6. checkpoint

# Not grouped with the checks above (no ``candidate`` fixture): these run last, so that one fresh process
# loads every checkpoint (NOTE [one fresh process] in contract_support.py).


@pytest.mark.parametrize("candidate_id", [candidate.id for candidate in CANDIDATES])
def test_save_then_load_in_fresh_process(candidate_id, contract_runs):
    run = contract_runs.get(candidate_id)
    result, outputs = contract_runs.loaded(candidate_id)
    assert "error" not in result, result.get("error")
    [graph_name] = run.wrapper.backends
    backend = run.backend
    assert result["ait.load"]["state"] == "tuned"
    assert result["ait.load"]["backends"] == {graph_name: {"name": backend.name, "describe": backend.describe(),
                                                           "build_mode": backend.build_mode.value}}
    routes = ["ait.load"] + (["Backend.from_checkpoint"] if backend.build_mode is BuildMode.AOT else [])
    assert sorted(result) == sorted(routes)
    for route in routes:
        for name, (expected_tensors, expected_structure) in run.before_save.items():
            assert result[route]["structures"][name] == expected_structure, (route, name)
            assert result[route]["accepts"][name], (route, name)
            loaded_tensors = {path: outputs[f"{route}|{name}|{path}"] for path in expected_tensors}
            OutputComparator(SAME_OUTPUTS).compare(expected_tensors, loaded_tensors)
        if backend.build_mode is BuildMode.AOT:
            assert not any(result[route]["accepts"][name] for name in outside_inputs()), route

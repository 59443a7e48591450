"""The default candidates come from the backends themselves (Backend.default_search_position): a backend joins
the default search from its own file, in the position it declares; a subclass of a default backend does not
join unless it declares its own position."""

import torch

import aitune.torch as ait
from aitune.torch.backend import TorchEagerBackend
from aitune.torch.backend import registry as backend_registry
from aitune.torch.tune_strategy.base import default_backends


def test_a_backend_joins_the_default_search_from_its_own_class(monkeypatch):
    monkeypatch.setattr(backend_registry, "_REGISTRY", dict(backend_registry._REGISTRY))
    monkeypatch.setattr(backend_registry, "_DEFAULT_CANDIDATES", list(getattr(backend_registry, "_DEFAULT_CANDIDATES", [])),
                        raising=False)  # the classes defined below are forgotten after the test
    before = [b.describe() for b in default_backends("cpu")]

    class Joiner(TorchEagerBackend):
        name = "test_default_joiner"
        passthrough = False
        default_search_position = 25  # after Inductor JIT (10) and eager with CUDA graphs (20), before AOT (30)

        @classmethod
        def default_candidates(cls, device):  # eager's own adds only its CUDA-graphs variant, on CUDA
            return [cls()]

    class Inherits(TorchEagerBackend):  # inherits eager's position, declares none of its own: not a default
        name = "test_not_a_default"

    after = default_backends("cpu")
    described = [b.describe() for b in after]
    joined = described.index("Joiner()")
    assert described[:joined] + described[joined + 1:] == before  # nothing else changed, same order
    assert described[joined - 1].startswith("TorchInductorJitBackend") and described[joined + 1] == \
        "TorchInductorAotBackend()"
    assert not any(isinstance(b, Inherits) for b in after)
    assert type(after[joined]) is Joiner
    model = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()  # a strategy given no backends tries it
    assert "Joiner()" in [b.describe() for b in ait.MaxThroughputStrategy().candidates(torch.device("cpu"), model)]

"""Just-in-time tuning settings for the tests (``AITUNE_JIT_SETUP=jit_user_settings:configure``).

A cheap strategy (Inductor only, short profiling, few probes, no speed requirement: tests check values and
choices, never speed), and, when ``$JIT_TEST_HIERARCHY`` names a file, the hierarchy written there at exit.
"""

import atexit
import json
import os

import aitune.torch as ait
from aitune.torch.backend import TorchInductorJitBackend, TorchInductorJitBackendConfig


def cheap_strategy(fullgraph: bool = False):
    strategy = ait.OneBackendStrategy(
        TorchInductorJitBackend(TorchInductorJitBackendConfig(fullgraph=fullgraph)),
        profiling_config=ait.ProfilingConfig(warmup_rounds=1, warmup_s=0.0, min_rounds=3, max_rounds=20,
                                             time_budget_s=0.2),
        probe_config=ait.ProbeConfig(max_probes=4))
    return strategy.enable_performance_validation(False)


def configure(config):
    config.update(strategy=cheap_strategy(), min_samples=2)
    path = os.environ.get("JIT_TEST_HIERARCHY")
    if path:
        from aitune.torch.jit import hierarchy

        atexit.register(lambda: open(path, "w").write(json.dumps(hierarchy(), default=str)))

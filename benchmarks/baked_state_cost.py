"""What the baked-state watch costs per call (aitune/torch/check/baked_state.py), on CPU, in µs.

Measures ``BakedState.differs`` alone — the check a tuned call makes before it reaches a backend — on a
ResNet-50-sized and a BERT-base-sized module (transformers' ``ResNetModel`` and ``BertModel`` built from their
default configs with random weights: the cost depends on the number of submodules, attributes and tensors,
not on the values), under ``torch.no_grad`` (the usual inference call) and with grad mode on and frozen
parameters (the parameters' ``requires_grad`` are then read too). The values check (sampled weights compared
every ``VALUES_CHECK_EVERY`` calls) is also timed on its own.

    python -m benchmarks.baked_state_cost
"""

from __future__ import annotations

import statistics
import time

import torch

from aitune.torch.check.baked_state import VALUES_CHECK_EVERY, BakedState


class BakingBackend:
    """Stands for a backend that bakes the module in (ONNX Runtime, AOTInductor): everything is watched."""

    name = "baked"
    passthrough = False
    bakes_module_state = True
    device = "cpu"


def resnet50() -> tuple[torch.nn.Module, torch.Tensor]:
    from transformers import ResNetConfig, ResNetModel

    return ResNetModel(ResNetConfig()).eval(), torch.randn(1, 3, 224, 224)


def bert_base() -> tuple[torch.nn.Module, torch.Tensor]:
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig()).eval(), torch.randint(0, 30000, (1, 128))


def median_us(function, calls: int = 20000, rounds: int = 10) -> float:
    for _ in range(calls // 10):
        function()
    samples = []
    per_round = calls // rounds
    for _ in range(rounds):
        started = time.perf_counter_ns()
        for _ in range(per_round):
            function()
        samples.append((time.perf_counter_ns() - started) / per_round / 1e3)
    return statistics.median(samples)


def main() -> int:
    backend = BakingBackend()
    print(f"| module | submodules | parameters+buffers | differs, no_grad (µs) | differs, grad on (µs) "
          f"| values check (µs, every {VALUES_CHECK_EVERY} calls) |")
    print("|---|---|---|---|---|---|")
    for name, build in (("ResNet-50", resnet50), ("BERT-base", bert_base)):
        module, example = build()
        for parameter in module.parameters():
            parameter.requires_grad_(False)
        state = BakedState(module)
        args, kwargs = (example,), {}
        assert state.differs(backend, args, kwargs) is None
        with torch.no_grad():
            no_grad = median_us(lambda: state.differs(backend, args, kwargs))
        grad_on = median_us(lambda: state.differs(backend, args, kwargs))
        values = median_us(state.values_changed, calls=2000)
        tensors = len(list(module.parameters())) + len(list(module.buffers()))
        print(f"| {name} | {len(state.modules)} | {tensors} | {no_grad:.1f} | {grad_on:.1f} | {values:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

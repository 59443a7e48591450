"""MinLatencyStrategy: the correct candidate with the lowest latency at the smallest recorded batch."""

from __future__ import annotations

from aitune.torch.tune_strategy.max_throughput import MaxThroughputStrategy


class MinLatencyStrategy(MaxThroughputStrategy):
    """Like :class:`MaxThroughputStrategy` but minimises the median latency (ms) of the smallest-batch
    sample (batch 1 when recorded)."""

    by_latency = True
